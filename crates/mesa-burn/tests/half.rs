//! f16 and bf16: every op against burn's own op (or a composition of burn's ops) run in the
//! same 16-bit dtype on `Autodiff<Flex>` (without and with balanced checkpointing), forward and
//! gradients (8, 4 and 2 bits), and both against the exact values (f64) at the same 16-bit
//! inputs.
//!
//! **What burn's Flex computes in 16 bits** (burn-flex 0.22.1 sources): every elementwise op
//! converts its 16-bit operands to f32, applies the op in f32 and rounds the result to the
//! dtype (`ops/binary.rs` `binary_op`, `ops/unary.rs` `unary_op`); a scalar operand is rounded to
//! the dtype first (`binary.rs`, the scalar path); sums and means accumulate in f32 and round
//! once (`ops/reduce.rs` `reduce_dim_half`, `mean_dim_half`); an f16 matmul packs its operands
//! as f32 and accumulates in f32 (gemm-f16 0.19 `gemm.rs` on x86-64 without native f16; one
//! rounding per depth block of ≥ min(k, 512), so one here), a bf16 matmul converts to f32,
//! multiplies in f32 and rounds once (`ops/matmul.rs` `matmul_bf16`); erf-GELU, its backward,
//! sigmoid and its backward are single fused f32 evaluations rounded once
//! (`ops/activation.rs`). Under `Autodiff<Flex>`, softmax and LayerNorm are burn's default
//! decompositions (burn-backend 0.22.1 `ops/activation.rs` `softmax`, `ops/modules/base.rs`
//! `layer_norm`: the fused Flex kernels are not used), tanh-GELU and SiLU are compositions
//! (burn-tensor `activation/base.rs`), so burn rounds every intermediate, forward and backward,
//! to the 16-bit dtype. mesa-kernels' kernels load 16-bit values into f32, compute in f32 and
//! round once on store; Linear's matmuls are Flex's own (the same arithmetic as burn's).
//!
//! **The bounds.** `u` = 2⁻¹¹ (f16) or 2⁻⁸ (bf16), the dtype's unit roundoff; `η` = half its
//! smallest subnormal (2⁻²⁵ f16, 2⁻¹³⁴ bf16); `U` = 2⁻²⁴ (f32). Burn's error is bounded by
//! running error analysis ([`R`]): each intermediate carries its exact value `v` (exact
//! arithmetic on the 16-bit inputs) and a bound `e` on |computed − v|, propagated through
//! each op burn performs, in burn's order, with `(u + 4U)·(|v| + e) + η` added at each
//! 16-bit rounding (f32 evaluation within 4 U, then the rounding). Ours: the f32 bounds of
//! `tests/ops.rs` (the kernels' f32 arithmetic and the code step `s/2`), plus one rounding
//! `u·(|v| + e) + η`. Each result is checked three ways: |ours − exact| ≤ `b_ours`,
//! |burn − exact| ≤ `b_burn` and |ours − burn| ≤ `b_ours + b_burn`. The f64 comparison is what
//! separates the two sides' errors: burn rounds every intermediate (its f16 LayerNorm output is
//! many ulps from exact), ours round once but read codes in the backward.
mod common;

use burn::tensor::{activation, module, DType, Tensor};
use common::{
    autodiff_devices, data, gelu_f32_error, gelu_second_derivative_bound, linear_attention_magnitudes, rounded, step,
    tensor, values, U,
};
use mesa_burn::{Codes, GeluForm};
use mesa_kernels::reference::fused as reference;

/// A value of a 16-bit computation: exact value `v`, error bound `e` (|computed − v| ≤ e).
#[derive(Clone, Copy, Debug)]
struct R {
    v: f64,
    e: f64,
}

fn x(v: f32) -> R {
    R { v: v as f64, e: 0.0 }
}

fn add(a: R, b: R) -> R {
    R { v: a.v + b.v, e: a.e + b.e }
}

fn neg(a: R) -> R {
    R { v: -a.v, e: a.e }
}

fn mul(a: R, b: R) -> R {
    R { v: a.v * b.v, e: a.v.abs() * b.e + b.v.abs() * a.e + a.e * b.e }
}

/// |(a+δa)/(b+δb) − a/b| = |δa − (a/b)·δb|/|b+δb|
fn div(a: R, b: R) -> R {
    assert!(b.v.abs() > b.e, "division bound: |b| {} ≤ its error {}", b.v, b.e);
    let v = a.v / b.v;
    R { v, e: (a.e + v.abs() * b.e) / (b.v.abs() - b.e) }
}

/// |exp(v+δ) − exp(v)| ≤ exp(v)·(exp(e) − 1)
fn exp(a: R) -> R {
    let v = a.v.exp();
    R { v, e: v * a.e.exp_m1() }
}

/// |tanh'| = 1 − tanh² ≤ 1 − tanh²(max(|v| − e, 0)) on the interval
fn tanh(a: R) -> R {
    let t = (a.v.abs() - a.e).max(0.0).tanh();
    R { v: a.v.tanh(), e: a.e * (1.0 - t * t) }
}

/// |√(v+δ) − √v| = |δ|/(√(v+δ) + √v)
fn sqrt(a: R) -> R {
    assert!(a.v > a.e);
    R { v: a.v.sqrt(), e: a.e / ((a.v - a.e).sqrt() + a.v.sqrt()) }
}

/// `v^(-1/2)`: |d/dv| = v^(-3/2)/2, largest at v − e
fn rsqrt(a: R) -> R {
    assert!(a.v > a.e);
    R { v: 1.0 / a.v.sqrt(), e: a.e * 0.5 * (a.v - a.e).powf(-1.5) }
}

/// Σ in f32 (burn's reductions and matmuls): Higham's γ_n·Σ|terms| with γ_n ≤ 1.01·n·U.
fn sum32(t: &[R]) -> R {
    let n = t.len() as f64;
    let (v, e, m) = t.iter().fold((0.0, 0.0, 0.0), |(v, e, m), r| (v + r.v, e + r.e, m + r.v.abs() + r.e));
    R { v, e: e + 1.01 * n * U * m }
}

/// An f32 op result kept in f32 (within 4 U relative).
fn r32(a: R) -> R {
    R { v: a.v, e: a.e + 4.0 * U * (a.v.abs() + a.e) }
}

/// The 16-bit dtype.
#[derive(Clone, Copy)]
struct H {
    dtype: DType,
    u: f64,
    eta: f64,
}

impl H {
    fn of(dtype: DType) -> H {
        match dtype {
            DType::F16 => H { dtype, u: 2f64.powi(-11), eta: 2f64.powi(-25) },
            _ => H { dtype, u: 2f64.powi(-8), eta: 2f64.powi(-134) },
        }
    }
    /// One Flex op's result: evaluated in f32, rounded to the dtype.
    fn r(&self, a: R) -> R {
        R { v: a.v, e: a.e + (self.u + 4.0 * U) * (a.v.abs() + a.e) + self.eta }
    }
    /// A scalar operand as Flex uses it: the intended constant `k`, rounded to the dtype.
    fn c(&self, k: f64) -> R {
        R { v: k, e: (k - rounded(&[k as f32], self.dtype)[0] as f64).abs() }
    }
    fn add(&self, a: R, b: R) -> R {
        self.r(add(a, b))
    }
    fn mul(&self, a: R, b: R) -> R {
        self.r(mul(a, b))
    }
    fn div(&self, a: R, b: R) -> R {
        self.r(div(a, b))
    }
    fn sum(&self, t: &[R]) -> R {
        self.r(sum32(t))
    }
    /// One element of a Flex matmul: f32 accumulation, one rounding (the module doc). On
    /// aarch64 with FP16, gemm-f16 may accumulate f16 in f16 (`neonfp16`): there, the looser
    /// γ_n in `u` (not run: these machines are x86-64).
    fn mm(&self, t: &[R]) -> R {
        if self.dtype == DType::F16 && cfg!(target_arch = "aarch64") {
            let (v, e, m) = t.iter().fold((0.0, 0.0, 0.0), |(v, e, m), r| (v + r.v, e + r.e, m + r.v.abs() + r.e));
            return self.r(R { v, e: e + 1.01 * t.len() as f64 * self.u * m });
        }
        self.sum(t)
    }
    /// Our result: an f32 value within `e32` of the exact `v`, rounded once to the dtype.
    fn ours(&self, v: f64, e32: f64) -> f64 {
        e32 + self.u * (v.abs() + e32) + self.eta
    }
}

/// Checks `ours` and `burn` against `exact` and each other (module doc) and prints the worst
/// |Δ|/bound of each comparison, and each side's worst error in units of `u·|exact|` over the
/// elements with |exact| ≥ max|exact|/16 (the rounding unit of the result: ½ is one correct
/// rounding).
fn three_way(u: f64, what: &str, ours: &[f32], burn: &[f32], exact: &[f64], b_ours: &[f64], b_burn: &[f64]) {
    assert_eq!(ours.len(), exact.len(), "{what}: lengths");
    assert_eq!(burn.len(), exact.len(), "{what}: lengths");
    let big = exact.iter().fold(0.0f64, |m, v| m.max(v.abs())) / 16.0;
    let mut worst = [0.0f64; 3];
    let mut units = [0.0f64; 2];
    for i in 0..exact.len() {
        let (o, b) = (ours[i] as f64, burn[i] as f64);
        let checks = [
            ((o - exact[i]).abs(), b_ours[i], "ours − exact"),
            ((b - exact[i]).abs(), b_burn[i], "burn − exact"),
            ((o - b).abs(), b_ours[i] + b_burn[i], "ours − burn"),
        ];
        for (k, (d, bound, name)) in checks.into_iter().enumerate() {
            assert!(d <= bound, "{what}[{i}] {name}: ours {o}, burn {b}, exact {}: |Δ| = {d:e} > {bound:e}", exact[i]);
            worst[k] = worst[k].max(d / bound);
            if k < 2 && exact[i].abs() >= big && big > 0.0 {
                units[k] = units[k].max(d / (u * exact[i].abs()));
            }
        }
    }
    eprintln!(
        "{what}: worst |Δ|/bound: ours−exact {:.3}, burn−exact {:.3}, ours−burn {:.3}; worst |Δ|/(u·|exact|): ours {:.2}, burn {:.2}",
        worst[0], worst[1], worst[2], units[0], units[1]
    );
}

/// `exact` (from the mirrored computation) against an independent f64 reference: a check
/// that the mirror computes the op it claims to.
fn same_function(what: &str, mirror: &[R], reference: &[f64]) {
    for (i, (m, r)) in mirror.iter().zip(reference).enumerate() {
        assert!((m.v - r).abs() <= 1e-9 * (1.0 + r.abs()), "{what}[{i}]: mirror {} vs reference {r}", m.v);
    }
}

fn vals(r: &[R]) -> Vec<f64> {
    r.iter().map(|r| r.v).collect()
}

fn errs(r: &[R]) -> Vec<f64> {
    r.iter().map(|r| r.e).collect()
}

const DTYPES: [DType; 2] = [DType::F16, DType::BF16];
const EPS: f64 = 1e-5;

fn burn_gelu<const D: usize>(x: Tensor<D>, form: GeluForm) -> Tensor<D> {
    match form {
        GeluForm::Erf => activation::gelu(x),
        GeluForm::Tanh => activation::gelu_approximate(x),
    }
}

/// Burn's GELU in 16 bits at one element, `(y, dx)` for the loss weight `c`.
/// Erf: one fused f32 evaluation rounded (forward and backward; the f32 error is half of
/// `gelu_f32_error`, one implementation). Tanh: burn-tensor's composition
/// `0.5·(x·(tanh(√(2/π)·(x + 0.044715·x³)) + 1))` op by op, and its autodiff backward op by op.
fn burn_gelu_mirror(h: H, form: GeluForm, xv: f32, cv: f32) -> (R, R) {
    let (x, c) = (self::x(xv), self::x(cv));
    match form {
        GeluForm::Erf => {
            let e = gelu_f32_error(x.v) / 2.0;
            let y = h.r(R { v: reference::gelu(x.v, form), e });
            let dx = h.r(R { v: c.v * reference::gelu_derivative(x.v, form), e: c.v.abs() * e });
            (y, dx)
        }
        GeluForm::Tanh => {
            let (k1, k2, half) = (h.c(0.044715), h.c(0.797_884_560_802_865_4), h.c(0.5));
            let x3 = h.r(R { v: x.v.powi(3), e: 0.0 });
            let inner = h.add(x, h.mul(x3, k1));
            let inner2 = h.mul(inner, k2);
            let th = h.r(tanh(inner2));
            let th1 = h.add(th, self::x(1.0));
            let y = h.mul(h.mul(x, th1), half);
            // backward: y = p·0.5, p = x·th1, th1 = th + 1, th = tanh(inner2), inner2 =
            // inner·k2, inner = x + x3·k1, x3 = x³ (grad·(x^2·3))
            let dp = h.mul(c, half);
            let dx_a = h.mul(dp, th1);
            let dth = h.mul(dp, x);
            let sech2 = h.add(neg(h.mul(th, th)), self::x(1.0));
            let dinner = h.mul(h.mul(dth, sech2), k2);
            let dx3 = h.mul(dinner, k1);
            let dx_c = h.mul(dx3, h.mul(h.mul(x, x), h.c(3.0)));
            (y, h.add(h.add(dx_a, dinner), dx_c))
        }
    }
}

#[test]
fn gelu_f16_bf16_against_burn() {
    // Ours: the kernel's f32 value (within gelu_f32_error/2 forward; backward the code step,
    // |c|·(K·s/2 + gelu_f32_error) as in tests/ops.rs) rounded once.
    let (rows, cols) = (16, 64);
    for device in autodiff_devices() {
        for dtype in DTYPES {
            let h = H::of(dtype);
            let xv = rounded(&data(rows * cols, 60, -4.0, 4.0), dtype);
            let cv = rounded(&data(rows * cols, 61, -1.0, 1.0), dtype);
            for form in [GeluForm::Erf, GeluForm::Tanh] {
                let k = gelu_second_derivative_bound(form);
                let x = tensor(&xv, [rows, cols], dtype, &device).require_grad();
                let c = tensor(&cv, [rows, cols], dtype, &device);
                let y = burn_gelu(x.clone(), form);
                let y_burn = values(&y);
                let dx_burn = values(&x.grad(&(y * c.clone()).sum().backward()).unwrap());
                let (ry, rdx): (Vec<R>, Vec<R>) =
                    xv.iter().zip(&cv).map(|(&x, &c)| burn_gelu_mirror(h, form, x, c)).unzip();
                let y_ref: Vec<f64> = xv.iter().map(|&x| reference::gelu(x as f64, form)).collect();
                let dx_ref: Vec<f64> =
                    xv.iter().zip(&cv).map(|(&x, &c)| c as f64 * reference::gelu_derivative(x as f64, form)).collect();
                same_function("gelu mirror y", &ry, &y_ref);
                same_function("gelu mirror dx", &rdx, &dx_ref);
                for bits in [8, 4, 2] {
                    let s = step(&xv, bits);
                    let x = tensor(&xv, [rows, cols], dtype, &device).require_grad();
                    let y = mesa_burn::gelu(x.clone(), form, Codes::bits(bits)).unwrap();
                    assert_eq!(y.dtype(), dtype);
                    let y_ours = values(&y);
                    let dx_ours = values(&x.grad(&(y * c.clone()).sum().backward()).unwrap());
                    let what = format!("gelu {form:?} {dtype:?} {bits}-bit");
                    let b: Vec<f64> =
                        (0..xv.len()).map(|i| h.ours(y_ref[i], gelu_f32_error(xv[i] as f64) / 2.0)).collect();
                    three_way(h.u, &format!("{what} y"), &y_ours, &y_burn, &y_ref, &b, &errs(&ry));
                    let b: Vec<f64> = (0..xv.len())
                        .map(|i| {
                            let e32 = (cv[i] as f64).abs() * (k * s / 2.0 + gelu_f32_error(xv[i] as f64));
                            h.ours(dx_ref[i], e32)
                        })
                        .collect();
                    three_way(h.u, &format!("{what} dx"), &dx_ours, &dx_burn, &dx_ref, &b, &errs(&rdx));
                }
            }
        }
    }
}

/// LayerNorm rows with different means and spreads (as tests/ops.rs), rounded to `dtype`.
fn ln_data(rows: usize, cols: usize, dtype: DType) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = data(rows * cols, 62, -1.0, 1.0);
    for r in 0..rows {
        for v in &mut x[r * cols..(r + 1) * cols] {
            *v = *v * (0.5 + r as f32 * 0.25) + (r as f32 - 4.0);
        }
    }
    (
        rounded(&x, dtype),
        rounded(&data(cols, 63, 0.5, 1.5), dtype),
        rounded(&data(cols, 64, -0.5, 0.5), dtype),
        rounded(&data(rows * cols, 65, -1.0, 1.0), dtype),
    )
}

/// Burn's LayerNorm under autodiff in 16 bits (burn-backend's default decomposition: mean,
/// x − mean, square, mean, + eps, sqrt, ÷, ·w, + b; each rounded) and its autodiff backward op
/// by op: `(y, dx, dw, db)`.
fn burn_layer_norm_mirror(h: H, xv: &[f32], wv: &[f32], bv: &[f32], cv: &[f32], cols: usize) -> [Vec<R>; 4] {
    let rows = xv.len() / cols;
    let n_inv = h.c(1.0 / cols as f64);
    let (mut y, mut dx) = (vec![], vec![]);
    let (mut dw_terms, mut db_terms) = (vec![vec![]; cols], vec![vec![]; cols]);
    for r in 0..rows {
        let xs: Vec<R> = xv[r * cols..(r + 1) * cols].iter().map(|&v| x(v)).collect();
        let cs: Vec<R> = cv[r * cols..(r + 1) * cols].iter().map(|&v| x(v)).collect();
        // mean_dim: f32 sum, ÷ n in f32, one rounding
        let mean_of = |t: &[R]| {
            let s = sum32(t);
            h.r(R { v: s.v / cols as f64, e: s.e / cols as f64 })
        };
        let mean = mean_of(&xs);
        let cen: Vec<R> = xs.iter().map(|&x| h.add(x, neg(mean))).collect();
        let sq: Vec<R> = cen.iter().map(|&c| h.mul(c, c)).collect();
        let var = mean_of(&sq);
        let ve = h.add(var, h.c(EPS));
        let den = h.r(sqrt(ve));
        let nrm: Vec<R> = cen.iter().map(|&c| h.div(c, den)).collect();
        for c in 0..cols {
            y.push(h.add(h.mul(nrm[c], x(wv[c])), x(bv[c])));
        }
        // backward
        let dnrm: Vec<R> = (0..cols).map(|c| h.mul(cs[c], x(wv[c]))).collect();
        for c in 0..cols {
            dw_terms[c].push(h.mul(cs[c], nrm[c]));
            db_terms[c].push(cs[c]);
        }
        let rec = h.r(div(x(1.0), den));
        let den2 = h.mul(den, den);
        let dden = h.sum(&(0..cols).map(|c| h.mul(dnrm[c], h.div(neg(cen[c]), den2))).collect::<Vec<_>>());
        let dve = h.mul(dden, h.div(h.r(rsqrt(ve)), h.c(2.0)));
        let dsq = h.mul(n_inv, dve);
        let dcen: Vec<R> = (0..cols)
            .map(|c| {
                let d2 = h.mul(dsq, cen[c]);
                h.add(h.add(h.mul(dnrm[c], rec), d2), d2)
            })
            .collect();
        let dmean = neg(h.sum(&dcen));
        let dxb = h.mul(n_inv, dmean);
        dx.extend(dcen.iter().map(|&d| h.add(d, dxb)));
    }
    let dw = dw_terms.iter().map(|t| h.sum(t)).collect();
    let db = db_terms.iter().map(|t| h.sum(t)).collect();
    [y, dx, dw, db]
}

#[test]
fn layer_norm_f16_bf16_against_burn() {
    // Ours: the kernel in f32 (forward within 2·C·U·(|x̂|+1)·|w| + 2·U·|y|, one implementation of
    // tests/ops.rs' forward bound; gradients within tests/ops.rs' bounds: the code step of x̂,
    // s/2, through dx = rstd·(a − mean(a) − x̂·mean(a⊙x̂)), dw = Σ c⊙x̃, plus f32 sums), rounded once.
    let (rows, cols) = (8, 64);
    for device in autodiff_devices() {
        for dtype in DTYPES {
            let h = H::of(dtype);
            let (xv, wv, bv, cv) = ln_data(rows, cols, dtype);
            let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            let (x64, w64, b64, c64) = (f64s(&xv), f64s(&wv), f64s(&bv), f64s(&cv));
            let f = reference::layer_norm_rows(&x64, Some(&w64), Some(&b64), EPS, cols);
            let (dx_ref, dw_ref, db_ref) =
                reference::layer_norm_backward_rows(&f.xhat, &f.rstd, Some(&w64), &c64, cols);
            let [ry, rdx, rdw, rdb] = burn_layer_norm_mirror(h, &xv, &wv, &bv, &cv, cols);
            for (what, m, r) in [("y", &ry, &f.y), ("dx", &rdx, &dx_ref), ("dw", &rdw, &dw_ref), ("db", &rdb, &db_ref)]
            {
                same_function(&format!("layer_norm mirror {what}"), m, r);
            }
            let grads = |mesa: Option<u32>| {
                let x = tensor(&xv, [rows, cols], dtype, &device).require_grad();
                let w = tensor(&wv, [cols], dtype, &device).require_grad();
                let b = tensor(&bv, [cols], dtype, &device).require_grad();
                let c = tensor(&cv, [rows, cols], dtype, &device);
                let y = match mesa {
                    Some(bits) => {
                        mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), EPS, Codes::bits(bits)).unwrap()
                    }
                    None => module::layer_norm(x.clone(), w.clone(), Some(b.clone()), EPS),
                };
                assert_eq!(y.dtype(), dtype);
                let yv = values(&y);
                let g = (y * c).sum().backward();
                [yv, values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap()), values(&b.grad(&g).unwrap())]
            };
            let [y0, dx0, dw0, db0] = grads(None);
            let xhat32: Vec<f32> = f.xhat.iter().map(|&v| v as f32).collect();
            let a = |i: usize| c64[i] * w64[i % cols];
            let stats: Vec<(f64, f64)> = (0..rows)
                .map(|r| {
                    let idx = r * cols..(r + 1) * cols;
                    let m_ax = idx.clone().map(|i| a(i) * f.xhat[i]).sum::<f64>() / cols as f64;
                    (m_ax, idx.map(|i| a(i).abs()).sum::<f64>() / cols as f64)
                })
                .collect();
            let col_sum = |c: usize, g: &dyn Fn(usize) -> f64| (0..rows).map(|r| g(r * cols + c)).sum::<f64>();
            for bits in [8, 4, 2] {
                let [y, dx, dw, db] = grads(Some(bits));
                let s = step(&xhat32, bits) * (1.0 + 1e-5);
                let hs = s / 2.0;
                let what = format!("layer_norm {dtype:?} {bits}-bit");
                let b: Vec<f64> = (0..y.len())
                    .map(|i| {
                        let e32 =
                            2.0 * cols as f64 * U * (f.xhat[i].abs() + 1.0) * w64[i % cols] + 2.0 * U * f.y[i].abs();
                        h.ours(f.y[i], e32)
                    })
                    .collect();
                three_way(h.u, &format!("{what} y"), &y, &y0, &f.y, &b, &errs(&ry));
                let b: Vec<f64> = (0..dx.len())
                    .map(|i| {
                        let r = i / cols;
                        let ((m_ax, m_a), rstd) = (stats[r], f.rstd[r]);
                        let e32 = rstd * (hs * m_ax.abs() + f.xhat[i].abs() * m_a * hs + hs * hs * m_a)
                            + 8.0 * cols as f64 * U * rstd * m_a * (2.0 + f.xhat[i].abs());
                        h.ours(dx_ref[i], e32)
                    })
                    .collect();
                three_way(h.u, &format!("{what} dx"), &dx, &dx0, &dx_ref, &b, &errs(&rdx));
                let b: Vec<f64> = (0..cols)
                    .map(|c| {
                        let e32 = hs * col_sum(c, &|i| c64[i].abs())
                            + 4.0 * rows as f64 * U * col_sum(c, &|i| (c64[i] * f.xhat[i]).abs());
                        h.ours(dw_ref[c], e32)
                    })
                    .collect();
                three_way(h.u, &format!("{what} dw"), &dw, &dw0, &dw_ref, &b, &errs(&rdw));
                let b: Vec<f64> = (0..cols)
                    .map(|c| h.ours(db_ref[c], 4.0 * rows as f64 * U * col_sum(c, &|i| c64[i].abs())))
                    .collect();
                three_way(h.u, &format!("{what} db"), &db, &db0, &db_ref, &b, &errs(&rdb));
            }
        }
    }
}

/// Burn-nn's RmsNorm in 16 bits: `rms = sqrt(mean(x_f32²) + eps)` in f32, cast to the dtype,
/// `x / rms · w` in the dtype; and the autodiff backward op by op (the f32 part in f32):
/// `(y, dx, dw)`.
fn burn_rms_norm_mirror(h: H, xv: &[f32], wv: &[f32], cv: &[f32], cols: usize) -> [Vec<R>; 3] {
    let rows = xv.len() / cols;
    let (mut y, mut dx) = (vec![], vec![]);
    let mut dw_terms = vec![vec![]; cols];
    let eps = R { v: EPS, e: (EPS - EPS as f32 as f64).abs() };
    let n_inv = R { v: 1.0 / cols as f64, e: 0.0 };
    for r in 0..rows {
        let xs: Vec<R> = xv[r * cols..(r + 1) * cols].iter().map(|&v| x(v)).collect();
        let cs: Vec<R> = cv[r * cols..(r + 1) * cols].iter().map(|&v| x(v)).collect();
        let sq: Vec<R> = xs.iter().map(|&x| r32(mul(x, x))).collect();
        let a = r32(add(r32(mul(sum32(&sq), n_inv)), eps));
        let rms = h.r(r32(sqrt(a)));
        let q: Vec<R> = xs.iter().map(|&x| h.div(x, rms)).collect();
        for c in 0..cols {
            y.push(h.mul(q[c], x(wv[c])));
        }
        let dq: Vec<R> = (0..cols).map(|c| h.mul(cs[c], x(wv[c]))).collect();
        for c in 0..cols {
            dw_terms[c].push(h.mul(cs[c], q[c]));
        }
        let rec = h.r(div(x(1.0), rms));
        let rms2 = h.mul(rms, rms);
        let drms = h.sum(&(0..cols).map(|c| h.mul(dq[c], h.div(neg(xs[c]), rms2))).collect::<Vec<_>>());
        let da = r32(mul(drms, r32(mul(r32(rsqrt(a)), x(0.5)))));
        let dsq = r32(mul(n_inv, da));
        for c in 0..cols {
            let d = r32(mul(dsq, xs[c]));
            let dxf = r32(add(d, d));
            dx.push(h.add(h.mul(dq[c], rec), h.r(dxf)));
        }
    }
    [y, dx, dw_terms.iter().map(|t| h.sum(t)).collect()]
}

#[test]
fn rms_norm_f16_bf16_against_burn() {
    // Ours: Flex's ops in f32 (forward within 4 U relative: sqrt, recip, two products;
    // gradients within tests/ops.rs' bounds from the code step of x̂), cast once to the dtype.
    let (rows, cols) = (8, 64);
    for device in autodiff_devices() {
        for dtype in DTYPES {
            let h = H::of(dtype);
            let (xv, wv, _, cv) = ln_data(rows, cols, dtype);
            let [ry, rdx, rdw] = burn_rms_norm_mirror(h, &xv, &wv, &cv, cols);
            // exact: x̂ = x·rstd, y = x̂·w, dx = rstd·(g − x̂·mean(g⊙x̂)) with g = c⊙w, dw = Σ_rows c⊙x̂
            let (w64, c64) = (|c: usize| wv[c] as f64, |i: usize| cv[i] as f64);
            let mut rstd = vec![];
            let mut xhat = vec![];
            for r in 0..rows {
                let row = &xv[r * cols..(r + 1) * cols];
                let rs = 1.0 / (row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64 + EPS).sqrt();
                rstd.push(rs);
                xhat.extend(row.iter().map(|&v| v as f64 * rs));
            }
            let y_ref: Vec<f64> = (0..xhat.len()).map(|i| xhat[i] * w64(i % cols)).collect();
            let ga = |i: usize| c64(i) * w64(i % cols);
            let stats: Vec<(f64, f64)> = (0..rows)
                .map(|r| {
                    let idx = r * cols..(r + 1) * cols;
                    let m = idx.clone().map(|i| ga(i) * xhat[i]).sum::<f64>() / cols as f64;
                    (m, idx.map(|i| ga(i).abs()).sum::<f64>() / cols as f64)
                })
                .collect();
            let dx_ref: Vec<f64> =
                (0..xhat.len()).map(|i| rstd[i / cols] * (ga(i) - xhat[i] * stats[i / cols].0)).collect();
            let dw_ref: Vec<f64> =
                (0..cols).map(|c| (0..rows).map(|r| c64(r * cols + c) * xhat[r * cols + c]).sum()).collect();
            same_function("rms_norm mirror y", &ry, &y_ref);
            same_function("rms_norm mirror dx", &rdx, &dx_ref);
            same_function("rms_norm mirror dw", &rdw, &dw_ref);
            let run = |bits: Option<u32>| {
                let x = tensor(&xv, [rows, cols], dtype, &device).require_grad();
                let w = tensor(&wv, [cols], dtype, &device);
                let c = tensor(&cv, [rows, cols], dtype, &device);
                let (y, w) = match bits {
                    Some(bits) => {
                        let m = mesa_burn::nn::RmsNormConfig::new(cols).with_bits(bits).init(&device);
                        let m = mesa_burn::nn::RmsNorm { gamma: m.gamma.map(|_| w.clone().require_grad()), ..m };
                        (m.forward(x.clone()).unwrap(), m.gamma.val())
                    }
                    None => {
                        let m = burn::nn::RmsNormConfig::new(cols).init(&device);
                        let m = burn::nn::RmsNorm { gamma: m.gamma.map(|_| w.clone().require_grad()), ..m };
                        (m.forward(x.clone()), m.gamma.val())
                    }
                };
                assert_eq!(y.dtype(), dtype);
                let yv = values(&y);
                let g = (y * c).sum().backward();
                [yv, values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap())]
            };
            let [y0, dx0, dw0] = run(None);
            let xhat32: Vec<f32> = xhat.iter().map(|&v| v as f32).collect();
            for bits in [8, 4, 2] {
                let [y, dx, dw] = run(Some(bits));
                let hs = step(&xhat32, bits) * (1.0 + 1e-5) / 2.0;
                let what = format!("rms_norm {dtype:?} {bits}-bit");
                let b: Vec<f64> = y_ref.iter().map(|&v| h.ours(v, 4.0 * U * v.abs())).collect();
                three_way(h.u, &format!("{what} y"), &y, &y0, &y_ref, &b, &errs(&ry));
                let b: Vec<f64> = (0..dx.len())
                    .map(|i| {
                        let (m, mg) = stats[i / cols];
                        let rs = rstd[i / cols];
                        let e32 = rs * (hs * m.abs() + xhat[i].abs() * mg * hs + hs * hs * mg)
                            + 8.0 * cols as f64 * U * rs * mg * (2.0 + xhat[i].abs());
                        h.ours(dx_ref[i], e32)
                    })
                    .collect();
                three_way(h.u, &format!("{what} dx"), &dx, &dx0, &dx_ref, &b, &errs(&rdx));
                let b: Vec<f64> = (0..cols)
                    .map(|c| {
                        let e32 = (0..rows)
                            .map(|r| {
                                let i = r * cols + c;
                                hs * c64(i).abs() + 4.0 * rows as f64 * U * (c64(i) * xhat[i]).abs()
                            })
                            .sum::<f64>();
                        h.ours(dw_ref[c], e32)
                    })
                    .collect();
                three_way(h.u, &format!("{what} dw"), &dw, &dw0, &dw_ref, &b, &errs(&rdw));
            }
        }
    }
}

#[test]
fn linear_f16_bf16_against_burn() {
    // Ours and burn's: the same Flex matmuls in the dtype for y = x·W + b and dx = c·Wᵀ, and the
    // same f32 sum for db (the mirror bounds both). dW = x̃ᵀ·c: ours decodes x̃ into the dtype,
    // within s/2 of x plus 2 U·max|x| (f32 decode) plus its rounding; then the same matmul.
    let (b0, b1, d_in, d_out) = (2, 16, 48, 24);
    let n = b0 * b1;
    for device in autodiff_devices() {
        for dtype in DTYPES {
            let h = H::of(dtype);
            let xv = rounded(&data(n * d_in, 70, -2.0, 3.0), dtype);
            let wv = rounded(&data(d_in * d_out, 71, -0.3, 0.3), dtype);
            let bv = rounded(&data(d_out, 72, -0.1, 0.1), dtype);
            let cv = rounded(&data(n * d_out, 73, -1.0, 1.0), dtype);
            let (xi, wi, ci) = (
                |i: usize, k: usize| x(xv[i * d_in + k]),
                |k: usize, j: usize| x(wv[k * d_out + j]),
                |i: usize, j: usize| x(cv[i * d_out + j]),
            );
            let ry: Vec<R> = (0..n * d_out)
                .map(|e| {
                    let (i, j) = (e / d_out, e % d_out);
                    h.add(h.mm(&(0..d_in).map(|k| mul(xi(i, k), wi(k, j))).collect::<Vec<_>>()), x(bv[j]))
                })
                .collect();
            let rdx: Vec<R> = (0..n * d_in)
                .map(|e| {
                    let (i, k) = (e / d_in, e % d_in);
                    h.mm(&(0..d_out).map(|j| mul(ci(i, j), wi(k, j))).collect::<Vec<_>>())
                })
                .collect();
            let rdw: Vec<R> = (0..d_in * d_out)
                .map(|e| {
                    let (k, j) = (e / d_out, e % d_out);
                    h.mm(&(0..n).map(|i| mul(xi(i, k), ci(i, j))).collect::<Vec<_>>())
                })
                .collect();
            let rdb: Vec<R> = (0..d_out).map(|j| h.sum(&(0..n).map(|i| ci(i, j)).collect::<Vec<_>>())).collect();
            let run = |bits: Option<u32>| {
                let x = tensor(&xv, [b0, b1, d_in], dtype, &device).require_grad();
                let w = tensor(&wv, [d_in, d_out], dtype, &device).require_grad();
                let b = tensor(&bv, [d_out], dtype, &device).require_grad();
                let c = tensor(&cv, [b0, b1, d_out], dtype, &device);
                let y = match bits {
                    Some(bits) => mesa_burn::linear(x.clone(), w.clone(), Some(b.clone()), Codes::bits(bits)).unwrap(),
                    None => module::linear(x.clone(), w.clone(), Some(b.clone())),
                };
                assert_eq!(y.dtype(), dtype);
                let yv = values(&y);
                let g = (y * c).sum().backward();
                [yv, values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap()), values(&b.grad(&g).unwrap())]
            };
            let [y0, dx0, dw0, db0] = run(None);
            let max_x = xv.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
            for bits in [8, 4, 2] {
                let [y, dx, dw, db] = run(Some(bits));
                let hs = step(&xv, bits) / 2.0;
                let what = format!("linear {dtype:?} {bits}-bit");
                three_way(h.u, &format!("{what} y"), &y, &y0, &vals(&ry), &errs(&ry), &errs(&ry));
                three_way(h.u, &format!("{what} dx"), &dx, &dx0, &vals(&rdx), &errs(&rdx), &errs(&rdx));
                let b: Vec<f64> = (0..d_in * d_out)
                    .map(|e| {
                        let (k, j) = (e / d_out, e % d_out);
                        let terms: Vec<R> = (0..n)
                            .map(|i| {
                                let xq = xi(i, k);
                                let dq = hs + 2.0 * U * max_x;
                                mul(R { v: xq.v, e: dq + h.u * (xq.v.abs() + dq) + h.eta }, ci(i, j))
                            })
                            .collect();
                        h.mm(&terms).e
                    })
                    .collect();
                three_way(h.u, &format!("{what} dW"), &dw, &dw0, &vals(&rdw), &b, &errs(&rdw));
                three_way(h.u, &format!("{what} db"), &db, &db0, &vals(&rdb), &errs(&rdb), &errs(&rdb));
            }
        }
    }
}

/// Burn's softmax of `x + mask` under autodiff in 16 bits (burn-backend's default: detached
/// row max, x − max, exp, Σ, ÷; each rounded; a masked entry is exactly 0) and its backward
/// op by op: `(y, dx)`. `x + 0` is exact (no rounding) for an unmasked entry.
fn burn_softmax_mirror(h: H, xv: &[f32], masked: &dyn Fn(usize) -> bool, cv: &[f32], cols: usize) -> [Vec<R>; 2] {
    let zero = x(0.0);
    let (mut y, mut dx) = (vec![], vec![]);
    for r in 0..xv.len() / cols {
        let idx = r * cols..(r + 1) * cols;
        let max = idx.clone().filter(|&i| !masked(i)).map(|i| xv[i] as f64).fold(f64::MIN, f64::max);
        let ex: Vec<R> = idx
            .clone()
            .map(|i| if masked(i) { zero } else { h.r(exp(h.r(add(x(xv[i]), R { v: -max, e: 0.0 })))) })
            .collect();
        let s = h.sum(&ex);
        y.extend(ex.iter().map(|&e| if e.v == 0.0 { zero } else { h.div(e, s) }));
        let rec = h.r(div(x(1.0), s));
        let s2 = h.mul(s, s);
        let cs: Vec<R> = idx.clone().map(|i| x(cv[i])).collect();
        let ds = h.sum(&(0..cols).map(|c| h.mul(cs[c], h.div(neg(ex[c]), s2))).collect::<Vec<_>>());
        dx.extend((0..cols).map(|c| if ex[c].v == 0.0 { zero } else { h.mul(h.add(h.mul(cs[c], rec), ds), ex[c]) }));
    }
    [y, dx]
}

#[test]
fn softmax_with_causal_mask_f16_bf16_against_burn() {
    // Ours: the kernel's f32 softmax (within (C + 4)·U·y, one implementation of tests/ops.rs'
    // forward bound) rounded once: y' within ey = u·(y + …) + η of y. The backward decodes ŷ
    // from square-root codes of the stored y': |ŷ − y| ≤ e = ey + (√(y + ey) + 1/(4L))/L
    // (L = 2^bits − 1), and then tests/ops.rs' bound
    // e_i·|c_i − m| + (y_i + e_i)·Σ_j |c_j|·e_j + 4·(C + 4)·U·y_i·(|c_i| + Σ_j |c_j|·y_j), rounded once.
    let (rows, cols) = (32, 32);
    for device in autodiff_devices() {
        let masked = |i: usize| i % cols > i / cols;
        let mask: Vec<f32> = (0..rows * cols).map(|i| if masked(i) { f32::NEG_INFINITY } else { 0.0 }).collect();
        for dtype in DTYPES {
            let h = H::of(dtype);
            let xv = rounded(&data(rows * cols, 80, -3.0, 3.0), dtype);
            let cv = rounded(&data(rows * cols, 81, -1.0, 1.0), dtype);
            let xm: Vec<f64> = xv.iter().zip(&mask).map(|(&x, &m)| x as f64 + m as f64).collect();
            let c64: Vec<f64> = cv.iter().map(|&c| c as f64).collect();
            let y_ref = reference::softmax_rows(&xm, None, cols);
            let dx_ref = reference::softmax_backward_rows(&y_ref, &c64, cols);
            let [ry, rdx] = burn_softmax_mirror(h, &xv, &masked, &cv, cols);
            same_function("softmax mirror y", &ry, &y_ref);
            same_function("softmax mirror dx", &rdx, &dx_ref);
            let run = |bits: Option<u32>| {
                let x = tensor(&xv, [rows, cols], dtype, &device).require_grad();
                let m = tensor(&mask, [rows, cols], dtype, &device);
                let c = tensor(&cv, [rows, cols], dtype, &device);
                let y = match bits {
                    Some(bits) => mesa_burn::softmax(x.clone(), Some(m), Codes::bits(bits)).unwrap(),
                    None => activation::softmax(x.clone() + m, 1),
                };
                assert_eq!(y.dtype(), dtype);
                let yv = values(&y);
                [yv, values(&x.grad(&(y * c).sum().backward()).unwrap())]
            };
            let [y0, dx0] = run(None);
            let ey: Vec<f64> = y_ref.iter().map(|&y| h.ours(y, (cols + 4) as f64 * U * y)).collect();
            for bits in [8, 4, 2] {
                let [y, dx] = run(Some(bits));
                let what = format!("softmax {dtype:?} {bits}-bit");
                three_way(h.u, &format!("{what} y"), &y, &y0, &y_ref, &ey, &errs(&ry));
                let l = f64::from((1u32 << bits) - 1);
                let e: Vec<f64> =
                    (0..y_ref.len()).map(|i| ey[i] + ((y_ref[i] + ey[i]).sqrt() + 1.0 / (4.0 * l)) / l).collect();
                let b: Vec<f64> = (0..y_ref.len())
                    .map(|i| {
                        if masked(i) {
                            return 0.0;
                        }
                        let idx = (i / cols) * cols..(i / cols + 1) * cols;
                        let m: f64 = idx.clone().map(|j| c64[j] * y_ref[j]).sum();
                        let ce: f64 = idx.clone().filter(|&j| !masked(j)).map(|j| c64[j].abs() * e[j]).sum();
                        let cy: f64 = idx.map(|j| c64[j].abs() * y_ref[j]).sum();
                        let e32 = e[i] * (c64[i] - m).abs()
                            + (y_ref[i] + e[i]) * ce
                            + 4.0 * (cols + 4) as f64 * U * y_ref[i] * (c64[i].abs() + cy);
                        h.ours(dx_ref[i], e32)
                    })
                    .collect();
                three_way(h.u, &format!("{what} dx"), &dx, &dx0, &dx_ref, &b, &errs(&rdx));
            }
        }
    }
}

/// silu(x) = x·σ(x) and its first two derivatives (f64).
fn silu_d(x: f64) -> (f64, f64, f64) {
    let s = 1.0 / (1.0 + (-x).exp());
    (x * s, s * (1.0 + x * (1.0 - s)), s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s)))
}

/// Burn's `silu(g)·u` in 16 bits (fused f32 sigmoid rounded, two products) and its autodiff
/// backward (the sigmoid's fused backward `d·s·(1 − s)` from the recomputed, rounded `s`):
/// `(y, dgate, dup)`.
fn burn_swiglu_mirror(h: H, gv: f32, uv: f32, cv: f32) -> [R; 3] {
    let (g, u, c) = (x(gv), x(uv), x(cv));
    let sig = h.r(R { v: reference::sigmoid(g.v), e: 0.0 });
    let sg = h.mul(g, sig);
    let y = h.mul(sg, u);
    let dsg = h.mul(c, u);
    let du = h.mul(c, sg);
    let dg_a = h.mul(dsg, sig);
    let dsig = h.mul(dsg, g);
    let dg_b = h.r(mul(dsig, mul(sig, add(x(1.0), neg(sig)))));
    [y, h.add(dg_a, dg_b), du]
}

#[test]
fn swiglu_f16_bf16_against_burn() {
    // Ours: the kernel in f32 (tests/ops.rs' bounds: forward 8·U·(|y| + |g·u|) for one
    // implementation; du ≤ |c|·S1·hg, dg ≤ |c|·(hu·S1 + (|u| + hu)·S2·hg) from the half steps hg,
    // hu of the two codes, S1 = max|silu'|, S2 = max|silu''|, plus 16·U·|c|·(|u| + 1)·(1 + |g|)),
    // rounded once.
    let (rows, cols) = (16, 64);
    for device in autodiff_devices() {
        let (mut s1, mut s2) = (0.0f64, 0.0f64);
        for k in -20_000..=20_000 {
            let (_, d1, d2) = silu_d(k as f64 * 1e-3);
            s1 = s1.max(d1.abs());
            s2 = s2.max(d2.abs());
        }
        let (s1, s2) = (s1 * 1.001, s2 * 1.001);
        for dtype in DTYPES {
            let h = H::of(dtype);
            let gv = rounded(&data(rows * cols, 90, -5.0, 5.0), dtype);
            let uv = rounded(&data(rows * cols, 91, -2.0, 2.0), dtype);
            let cv = rounded(&data(rows * cols, 92, -1.0, 1.0), dtype);
            let (g, u, c) = (|i: usize| gv[i] as f64, |i: usize| uv[i] as f64, |i: usize| cv[i] as f64);
            let n = gv.len();
            let y_ref: Vec<f64> = (0..n).map(|i| reference::swiglu(g(i), u(i))).collect();
            let (dg_ref, du_ref): (Vec<f64>, Vec<f64>) =
                (0..n).map(|i| reference::swiglu_backward(g(i), u(i), c(i))).unzip();
            let mirror: Vec<[R; 3]> = (0..n).map(|i| burn_swiglu_mirror(h, gv[i], uv[i], cv[i])).collect();
            let part = |k: usize| mirror.iter().map(|m| m[k]).collect::<Vec<R>>();
            let (ry, rdg, rdu) = (part(0), part(1), part(2));
            same_function("swiglu mirror y", &ry, &y_ref);
            same_function("swiglu mirror dgate", &rdg, &dg_ref);
            same_function("swiglu mirror dup", &rdu, &du_ref);
            let run = |bits: Option<u32>| {
                let gt = tensor(&gv, [rows, cols], dtype, &device).require_grad();
                let ut = tensor(&uv, [rows, cols], dtype, &device).require_grad();
                let ct = tensor(&cv, [rows, cols], dtype, &device);
                let y = match bits {
                    Some(bits) => mesa_burn::swiglu(gt.clone(), ut.clone(), Codes::bits(bits)).unwrap(),
                    None => activation::silu(gt.clone()) * ut.clone(),
                };
                assert_eq!(y.dtype(), dtype);
                let yv = values(&y);
                let gr = (y * ct).sum().backward();
                [yv, values(&gt.grad(&gr).unwrap()), values(&ut.grad(&gr).unwrap())]
            };
            let [y0, dg0, du0] = run(None);
            for bits in [8, 4, 2] {
                let [y, dg, du] = run(Some(bits));
                let (hg, hu) = (step(&gv, bits) / 2.0, step(&uv, bits) / 2.0);
                let what = format!("swiglu {dtype:?} {bits}-bit");
                let slack = |i: usize| 16.0 * U * c(i).abs() * (u(i).abs() + 1.0) * (1.0 + g(i).abs());
                let b: Vec<f64> =
                    (0..n).map(|i| h.ours(y_ref[i], 8.0 * U * (y_ref[i].abs() + (g(i) * u(i)).abs()))).collect();
                three_way(h.u, &format!("{what} y"), &y, &y0, &y_ref, &b, &errs(&ry));
                let b: Vec<f64> = (0..n).map(|i| h.ours(du_ref[i], c(i).abs() * s1 * hg + slack(i))).collect();
                three_way(h.u, &format!("{what} dup"), &du, &du0, &du_ref, &b, &errs(&rdu));
                let b: Vec<f64> = (0..n)
                    .map(|i| h.ours(dg_ref[i], c(i).abs() * (hu * s1 + (u(i).abs() + hu) * s2 * hg) + slack(i)))
                    .collect();
                three_way(h.u, &format!("{what} dgate"), &dg, &dg0, &dg_ref, &b, &errs(&rdg));
            }
        }
    }
}

#[test]
fn linear_attention_f16_bf16_against_burn() {
    // Burn's composition (causal, normalised): A = (q·kᵀ)⊙mask, y = (A·v) / (Σ_s A + eps), in
    // the dtype, and its autodiff backward, mirrored op by op (the mask's 0/1 products exact).
    // Ours: the kernels in f32 (tests/ops.rs: within 4·n·U·mag of the exact values, n = L + M + D),
    // rounded once; the backward also reads the stored, rounded output: with eo_t its error,
    // dA_ts moves by δ_t = Σ_j |c_tj|·eo_tj / g_t, so dq_t by δ_t·Σ_{s≤t} k_s and dk_s by
    // Σ_{t≥s} δ_t·q_t.
    use mesa_burn::LinearAttentionConfig;
    use mesa_kernels::reference::linear_attention as la;
    let (b, hh, l, m, d) = (1, 2, 24, 8, 6);
    let eps = 1e-6f64;
    for device in autodiff_devices() {
        let mask: Vec<f32> = (0..l * l).map(|i| if i % l <= i / l { 1.0 } else { 0.0 }).collect();
        for dtype in DTYPES {
            let h = H::of(dtype);
            let qv = rounded(&data(b * hh * l * m, 100, 0.1, 1.0), dtype);
            let kv = rounded(&data(b * hh * l * m, 101, 0.1, 1.0), dtype);
            let vv = rounded(&data(b * hh * l * d, 102, -1.0, 1.0), dtype);
            let cv = rounded(&data(b * hh * l * d, 103, -1.0, 1.0), dtype);
            let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            let (q64, k64, v64, c64) = (f64s(&qv), f64s(&kv), f64s(&vv), f64s(&cv));
            let att = la::Attention {
                q: &q64,
                k: &k64,
                v: &v64,
                dims: la::Dims { batch: b, heads: hh, len: l, feat: m, dim: d },
                causal: true,
                normalize: Some(eps),
            };
            let (y_ref, _) = la::forward(&att).unwrap();
            let (dq_ref, dk_ref, dv_ref) = la::backward(&att, &c64).unwrap();

            // the mirror
            let (mut ry, mut rdq, mut rdk, mut rdv) = (vec![], vec![], vec![], vec![]);
            for bh in 0..b * hh {
                let q = |t: usize, j: usize| x(qv[(bh * l + t) * m + j]);
                let k = |s: usize, j: usize| x(kv[(bh * l + s) * m + j]);
                let v = |s: usize, j: usize| x(vv[(bh * l + s) * d + j]);
                let c = |t: usize, j: usize| x(cv[(bh * l + t) * d + j]);
                let a: Vec<Vec<R>> = (0..l)
                    .map(|t| {
                        (0..=t).map(|s| h.mm(&(0..m).map(|j| mul(q(t, j), k(s, j))).collect::<Vec<_>>())).collect()
                    })
                    .collect();
                let num: Vec<Vec<R>> = (0..l)
                    .map(|t| {
                        (0..d).map(|j| h.mm(&(0..=t).map(|s| mul(a[t][s], v(s, j))).collect::<Vec<_>>())).collect()
                    })
                    .collect();
                let den: Vec<R> = (0..l).map(|t| h.add(h.sum(&a[t]), h.c(eps))).collect();
                let mut da = vec![vec![]; l];
                let mut dnum = vec![vec![]; l];
                for t in 0..l {
                    ry.extend((0..d).map(|j| h.div(num[t][j], den[t])));
                    let rec = h.r(div(x(1.0), den[t]));
                    let den2 = h.mul(den[t], den[t]);
                    dnum[t] = (0..d).map(|j| h.mul(c(t, j), rec)).collect::<Vec<R>>();
                    let dden = h.sum(&(0..d).map(|j| h.mul(c(t, j), h.div(neg(num[t][j]), den2))).collect::<Vec<_>>());
                    da[t] = (0..=t)
                        .map(|s| h.add(h.mm(&(0..d).map(|j| mul(dnum[t][j], v(s, j))).collect::<Vec<_>>()), dden))
                        .collect();
                }
                for (t, da_t) in da.iter().enumerate() {
                    rdq.extend((0..m).map(|j| h.mm(&(0..=t).map(|s| mul(da_t[s], k(s, j))).collect::<Vec<_>>())));
                }
                for s in 0..l {
                    rdk.extend((0..m).map(|j| h.mm(&(s..l).map(|t| mul(da[t][s], q(t, j))).collect::<Vec<_>>())));
                    rdv.extend((0..d).map(|j| h.mm(&(s..l).map(|t| mul(a[t][s], dnum[t][j])).collect::<Vec<_>>())));
                }
            }
            same_function("linear attention mirror y", &ry, &y_ref);
            same_function("linear attention mirror dq", &rdq, &dq_ref);
            same_function("linear attention mirror dk", &rdk, &dk_ref);
            same_function("linear attention mirror dv", &rdv, &dv_ref);

            let run = |mesa: bool| {
                let q = tensor(&qv, [b, hh, l, m], dtype, &device).require_grad();
                let k = tensor(&kv, [b, hh, l, m], dtype, &device).require_grad();
                let v = tensor(&vv, [b, hh, l, d], dtype, &device).require_grad();
                let c = tensor(&cv, [b, hh, l, d], dtype, &device);
                let y = if mesa {
                    let config = LinearAttentionConfig { eps: eps as f32, ..LinearAttentionConfig::causal() };
                    mesa_burn::linear_attention(q.clone(), k.clone(), v.clone(), config).unwrap()
                } else {
                    let a = q.clone().matmul(k.clone().swap_dims(2, 3)) * tensor(&mask, [1, 1, l, l], dtype, &device);
                    let den = a.clone().sum_dim(3) + eps;
                    a.matmul(v.clone()) / den
                };
                assert_eq!(y.dtype(), dtype);
                let yv = values(&y);
                let g = (y * c).sum().backward();
                [yv, values(&q.grad(&g).unwrap()), values(&k.grad(&g).unwrap()), values(&v.grad(&g).unwrap())]
            };
            let [y0, dq0, dk0, dv0] = run(false);
            let [y, dq, dk, dv] = run(true);

            let [m_out, m_dq, m_dk, m_dv] = linear_attention_magnitudes(&q64, &k64, &v64, &c64, (b * hh, l, m, d), eps);
            let n = (l + m + d) as f64;
            let f32_err = |mag: &[f64]| mag.iter().map(|&v| 4.0 * n * U * v + 1e-30).collect::<Vec<f64>>();
            let eo: Vec<f64> = f32_err(&m_out).iter().zip(&y_ref).map(|(&e, &v)| h.ours(v, e)).collect();
            // δ_t per (bh, t), and g_t
            let mut e_dq = f32_err(&m_dq);
            let mut e_dk = f32_err(&m_dk);
            for bh in 0..b * hh {
                let row = |t: usize| bh * l + t;
                let g: Vec<f64> = (0..l)
                    .map(|t| {
                        (0..=t)
                            .map(|s| (0..m).map(|j| q64[row(t) * m + j] * k64[row(s) * m + j]).sum::<f64>())
                            .sum::<f64>()
                            + eps
                    })
                    .collect();
                let delta: Vec<f64> = (0..l)
                    .map(|t| (0..d).map(|j| c64[row(t) * d + j].abs() * eo[row(t) * d + j]).sum::<f64>() / g[t])
                    .collect();
                for t in 0..l {
                    for j in 0..m {
                        e_dq[row(t) * m + j] += delta[t] * (0..=t).map(|s| k64[row(s) * m + j]).sum::<f64>();
                        e_dk[row(t) * m + j] += (t..l).map(|u| delta[u] * q64[row(u) * m + j]).sum::<f64>();
                    }
                }
            }
            let ours = |e: &[f64], r: &[f64]| e.iter().zip(r).map(|(&e, &v)| h.ours(v, e)).collect::<Vec<f64>>();
            let what = format!("linear attention {dtype:?}");
            three_way(h.u, &format!("{what} y"), &y, &y0, &y_ref, &eo, &errs(&ry));
            three_way(h.u, &format!("{what} dq"), &dq, &dq0, &dq_ref, &ours(&e_dq, &dq_ref), &errs(&rdq));
            three_way(h.u, &format!("{what} dk"), &dk, &dk0, &dk_ref, &ours(&e_dk, &dk_ref), &errs(&rdk));
            three_way(h.u, &format!("{what} dv"), &dv, &dv0, &dv_ref, &ours(&f32_err(&m_dv), &dv_ref), &errs(&rdv));
        }
    }
}
