#!/usr/bin/env python3
"""fit_gelu_erfc.py — the polynomial of GELU's erf form in kernels/gelu.cu (`erf_parts`).

For s = |x| the kernel evaluates erfc(s/sqrt 2) = exp(-x^2/2) * R(r) with
r = (s - 3)/(s + 3) in [-1, 1) and R(r) = erfcx(s/sqrt 2), the scaled complementary error
function, as a degree-10 polynomial in r. This script fits that polynomial, minimising the
largest relative error over s in [0, inf) (Lawson's iteration on a weighted least-squares fit at
Chebyshev nodes in r), rounds the coefficients to f32, evaluates the kernel's f32 Horner
scheme on a dense grid of s and prints the coefficients as the C++ literals of gelu.cu and
the relative error of R (in units of 2^-24).

    python3 -m venv /tmp/fit && /tmp/fit/bin/pip install numpy scipy
    /tmp/fit/bin/python scripts/fit_gelu_erfc.py

Run 2026-12-01 with numpy 2.4.6 and scipy 1.17.1: largest relative error of the f32 Horner
evaluation of R 0.9 * 2^-24 (the fit alone 0.57 * 2^-24).
"""
import numpy as np
from scipy.special import erfcx

CENTER = 3.0  # r = (s - CENTER) / (s + CENTER) = 1 - 2 CENTER / (s + CENTER)
DEGREE = 10
NODES = 4000
ITERATIONS = 60


def fit():
    j = np.arange(NODES)
    r = np.cos(np.pi * (j + 0.5) / NODES)
    r = r[r < 0.999999]  # s up to ~8e6: R is smooth through r = 1
    s = CENTER * (1 + r) / (1 - r)
    target = erfcx(s / np.sqrt(2.0))
    vander = np.vander(r, DEGREE + 1, increasing=True)
    w = np.ones_like(r)
    for _ in range(ITERATIONS):
        coef, *_ = np.linalg.lstsq(vander * (w / target)[:, None], w, rcond=None)
        err = (vander @ coef - target) / target
        w = w * np.sqrt(np.abs(err))
        w /= w.max()
    return coef, np.abs(err).max()


def horner_f32(coef32, s):
    s = s.astype(np.float32)
    rc = (np.float32(1) / (s + np.float32(CENTER))).astype(np.float32)
    r = (np.float64(-2 * CENTER) * rc + 1.0).astype(np.float32)  # fmaf(-2 CENTER, 1/(s + CENTER), 1)
    acc = np.full_like(r, coef32[-1])
    for c in coef32[-2::-1]:
        acc = (acc.astype(np.float64) * r + np.float64(c)).astype(np.float32)  # fmaf: one rounding
    return acc


def main():
    coef, fit_err = fit()
    coef32 = coef.astype(np.float32)
    # s up to 14: beyond ~13.2 the kernel's exp(-x^2/2) is 0 (flushed), so R no longer matters
    s = np.linspace(0, 14, 1400001).astype(np.float32)
    got = horner_f32(coef32, s).astype(np.float64)
    want = erfcx(s.astype(np.float64) / np.sqrt(2.0))
    f32_err = np.abs((got - want) / want).max()
    eps = 2.0 ** -24
    print(f"fit: {fit_err / eps:.2f} eps; f32 Horner: {f32_err / eps:.2f} eps")
    # the kernel folds the factor -1/2 of gelu = max(x, 0) - |x| erfc(|x|/sqrt 2) / 2 into the
    # coefficients (exact: a power of two)
    for k, c in enumerate(coef32):
        print(f"  c{k} = {float(c):.9e}f   (kernel: {float(c * np.float32(-0.5)):.9e}f)")


if __name__ == "__main__":
    main()
