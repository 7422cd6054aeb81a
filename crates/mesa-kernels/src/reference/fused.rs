//! Reference for the fused ops ([`crate::fused`]): GELU, SwiGLU, softmax over the last axis,
//! LayerNorm over the last axis, forward and backward, in f64 with plain loops over rows of
//! logical (row-major) data. Shares no code with the kernels.
//!
//! No input panics: `cols == 0` gives zeros; when the data does not hold whole rows, the
//! trailing partial row is its own (shorter) row (softmax) or is left 0 (LayerNorm); mask,
//! weight, bias and gradient values missing past the end of a shorter slice count as 0, 1, 0
//! and 0.
use crate::fused::GeluForm;

/// SwiGLU (Shazeer 2020, eq. 6): `silu(g)·u`, `silu(g) = g·σ(g)`.
#[must_use]
pub fn swiglu(g: f64, u: f64) -> f64 {
    g * sigmoid(g) * u
}

/// SwiGLU's gradients `(dg, du) = (dy·u·silu'(g), dy·silu(g))`, with
/// `silu'(g) = σ(g)·(1 + g·σ(−g))` (the derivative of `g·σ(g)`, since `σ' = σ·σ(−·)`).
#[must_use]
pub fn swiglu_backward(g: f64, u: f64, dy: f64) -> (f64, f64) {
    let (s, sm) = (sigmoid(g), sigmoid(-g));
    (dy * u * s * (1.0 + g * sm), dy * g * s)
}

/// `erf(x)` in f64: Maclaurin series below |x| = 3, `1 − erfc` above (both accurate to
/// ~1e-14 absolute).
#[must_use]
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    let a = x.abs();
    let r = if a < 3.0 { erf_series(a) } else { 1.0 - erfc_fraction(a) };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

/// `erfc(x) = 1 − erf(x)` in f64 with *relative* accuracy ~1e-13 for every x (down to the
/// underflow near x = 27): `1 − erf` only below |x| = 3 (where erfc(|x|) ≥ 2e-5, so the
/// cancellation costs < 5 digits of 16), the continued fraction above; `2 − erfc(−x)` for
/// x ≤ −3. `1 + erf(x)` for x ≪ 0 (GELU's negative tail) is `erfc(−x)`.
#[must_use]
pub fn erfc(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    let a = x.abs();
    if a < 3.0 {
        1.0 - if x < 0.0 { -erf_series(a) } else { erf_series(a) }
    } else if x > 0.0 {
        erfc_fraction(a)
    } else {
        2.0 - erfc_fraction(a)
    }
}

/// `erf(a)`, `0 ≤ a < 3`: `2/√π Σ (−1)^n a^(2n+1) / (n! (2n+1))`.
fn erf_series(a: f64) -> f64 {
    let mut term = a; // a^(2n+1)/n!
    let mut sum = a;
    for n in 1..200 {
        term *= -a * a / f64::from(n);
        let t = term / f64::from(2 * n + 1);
        sum += t;
        if t.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// `erfc(a)`, `a ≥ 3`: `exp(−a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + …))))`.
fn erfc_fraction(a: f64) -> f64 {
    let mut t = a;
    for k in (1..=80).rev() {
        t = a + (f64::from(k) / 2.0) / t;
    }
    (-a * a).exp() / (std::f64::consts::PI.sqrt() * t)
}

/// `σ(z) = 1/(1 + e^{−z})` (0 for z → −∞, 1 for z → ∞; no cancellation either way).
#[must_use]
pub fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const TANH_COEF: f64 = 0.044_715;

/// `gelu(x)` (erf or tanh form), with full relative accuracy in the negative tail:
/// `x/2 · erfc(−x/√2)` for `x/2 · (1 + erf(x/√2))`, and `x · σ(2u)` for
/// `x/2 · (1 + tanh u)`, `u = √(2/π)(x + 0.044715x³)` (`1 + tanh u = 2σ(2u)`).
#[must_use]
pub fn gelu(x: f64, form: GeluForm) -> f64 {
    match form {
        GeluForm::Erf => 0.5 * x * erfc(-x / std::f64::consts::SQRT_2),
        GeluForm::Tanh => x * sigmoid(2.0 * SQRT_2_OVER_PI * (x + TANH_COEF * x * x * x)),
    }
}

/// `gelu'(x)`: `Φ(x) + x·φ(x)` (erf form, `Φ = erfc(−x/√2)/2`);
/// `σ(2u) + 2x·σ(2u)·σ(−2u)·u'` (tanh form, `(1 − tanh² u)/2 = 2σ(2u)σ(−2u)`), a term that is
/// exactly 0 counting as 0 even where `u'` overflows.
#[must_use]
pub fn gelu_derivative(x: f64, form: GeluForm) -> f64 {
    match form {
        GeluForm::Erf => {
            0.5 * erfc(-x / std::f64::consts::SQRT_2) + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
        }
        GeluForm::Tanh => {
            let u = SQRT_2_OVER_PI * (x + TANH_COEF * x * x * x);
            let (s, sm) = (sigmoid(2.0 * u), sigmoid(-2.0 * u));
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_COEF * x * x);
            let t = if sm > 0.0 { 2.0 * x * sm * du } else { 0.0 };
            if s > 0.0 {
                s * (1.0 + t)
            } else {
                0.0
            }
        }
    }
}

/// Softmax of every row of `cols` values of `x + mask`; a row with every entry `−inf` gives 0.
#[must_use]
pub fn softmax_rows(x: &[f64], mask: Option<&[f64]>, cols: usize) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    if cols == 0 {
        return y;
    }
    for (r, (xs, out)) in x.chunks(cols).zip(y.chunks_mut(cols)).enumerate() {
        let v: Vec<f64> = xs
            .iter()
            .enumerate()
            .map(|(c, &xi)| xi + mask.and_then(|m| m.get(r * cols + c)).copied().unwrap_or(0.0))
            .collect();
        let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue; // fully masked: zeros
        }
        let e: Vec<f64> = v.iter().map(|&vi| if vi == f64::NEG_INFINITY { 0.0 } else { (vi - m).exp() }).collect();
        let s: f64 = e.iter().sum();
        for (o, ei) in out.iter_mut().zip(&e) {
            *o = ei / s;
        }
    }
    y
}

/// Softmax backward per row: `dx = y · (dy − Σ dy·y)`.
#[must_use]
pub fn softmax_backward_rows(y: &[f64], dy: &[f64], cols: usize) -> Vec<f64> {
    let mut dx = vec![0.0; y.len()];
    if cols == 0 {
        return dx;
    }
    let grad = |i: usize| dy.get(i).copied().unwrap_or(0.0);
    for start in (0..y.len()).step_by(cols) {
        let row = start..(start + cols).min(y.len());
        let dot: f64 = row.clone().map(|i| y[i] * grad(i)).sum();
        for i in row {
            dx[i] = y[i] * (grad(i) - dot);
        }
    }
    dx
}

/// Square-root companded code of a probability `y` (the default softmax codes of
/// [`crate::fused::SoftmaxCodes::Sqrt`]): `clamp(round_half_even(√y / scale), 0, L)`,
/// `L = 2^bits − 1`, `scale` the saved step (`1/L` rounded to f32). `y < 0` or NaN give 0.
#[must_use]
pub fn sqrt_code_nearest(y: f64, scale: f64, bits: u32) -> u32 {
    let levels = super::quant::levels(bits);
    let t = if y > 0.0 { y.sqrt() / scale } else { 0.0 };
    t.round_ties_even().clamp(0.0, levels) as u32
}

/// Stochastic square-root companded code for `u ∈ [0, 1)`: `clamp(floor(√y / scale + u), 0, L)`,
/// evaluated as [`super::quant::stochastic_round`] (an on-grid `√y / scale` keeps its code).
#[must_use]
pub fn sqrt_code_stochastic(y: f64, scale: f64, bits: u32, u: f64) -> u32 {
    let levels = super::quant::levels(bits);
    let t = if y > 0.0 { y.sqrt() / scale } else { 0.0 };
    super::quant::stochastic_round(t, u).clamp(0.0, levels) as u32
}

/// Decoded square-root companded code: `(code · scale + offset)²`.
#[must_use]
pub fn sqrt_decode(code: u32, offset: f64, scale: f64) -> f64 {
    let q = f64::from(code) * scale + offset;
    q * q
}

/// Bound on `|ŷ − y|` of a square-root companded code with step `s` for `y ∈ [0, 1]`:
/// `√ŷ = √y + e` with `|e| ≤ s/2` (nearest) or `|e| < s` (stochastic), so
/// `|ŷ − y| = |2√y·e + e²| ≤ (√y + s/4)·s` (nearest) or `< (2√y + s)·s` (stochastic).
#[must_use]
pub fn sqrt_code_error_bound(y: f64, scale: f64, stochastic: bool) -> f64 {
    let r = y.max(0.0).sqrt();
    if stochastic {
        (2.0 * r + scale) * scale
    } else {
        (r + 0.25 * scale) * scale
    }
}

/// LayerNorm forward of every row of `cols` values.
#[derive(Debug, Clone)]
pub struct LayerNormForward {
    /// `x̂ · w + b`.
    pub y: Vec<f64>,
    /// `(x − mean) · rstd`.
    pub xhat: Vec<f64>,
    /// Per-row mean.
    pub mean: Vec<f64>,
    /// Per-row `1/sqrt(var + eps)` (biased variance).
    pub rstd: Vec<f64>,
}

/// LayerNorm over rows of `cols` (`weight`/`bias` `None`: 1 and 0).
#[must_use]
pub fn layer_norm_rows(
    x: &[f64],
    weight: Option<&[f64]>,
    bias: Option<&[f64]>,
    eps: f64,
    cols: usize,
) -> LayerNormForward {
    let rows = x.len().checked_div(cols).unwrap_or(0);
    let mut f = LayerNormForward { y: vec![0.0; x.len()], xhat: vec![0.0; x.len()], mean: vec![], rstd: vec![] };
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (c, &xc) in row.iter().enumerate() {
            let xh = (xc - mean) * rstd;
            f.xhat[r * cols + c] = xh;
            f.y[r * cols + c] = xh * value_or(weight, c, 1.0) + value_or(bias, c, 0.0);
        }
        f.mean.push(mean);
        f.rstd.push(rstd);
    }
    f
}

/// LayerNorm backward from `x̂` and `rstd`: `(dx, dweight, dbias)`.
#[must_use]
pub fn layer_norm_backward_rows(
    xhat: &[f64],
    rstd: &[f64],
    weight: Option<&[f64]>,
    dy: &[f64],
    cols: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = xhat.len().checked_div(cols).unwrap_or(0);
    let mut dx = vec![0.0; xhat.len()];
    let mut dw = vec![0.0; cols];
    let mut db = vec![0.0; cols];
    for (r, &rs) in rstd.iter().enumerate().take(rows) {
        let i0 = r * cols;
        let dyr: Vec<f64> = (0..cols).map(|c| dy.get(i0 + c).copied().unwrap_or(0.0)).collect();
        let g: Vec<f64> = (0..cols).map(|c| dyr[c] * value_or(weight, c, 1.0)).collect();
        let a = g.iter().sum::<f64>() / cols as f64;
        let b = (0..cols).map(|c| g[c] * xhat[i0 + c]).sum::<f64>() / cols as f64;
        for c in 0..cols {
            dx[i0 + c] = rs * (g[c] - a - xhat[i0 + c] * b);
            dw[c] += dyr[c] * xhat[i0 + c];
            db[c] += dyr[c];
        }
    }
    (dx, dw, db)
}

/// `v[i]`, or `default` when `v` is `None` or shorter.
fn value_or(v: Option<&[f64]>, i: usize, default: f64) -> f64 {
    v.and_then(|v| v.get(i)).copied().unwrap_or(default)
}
