//! Gradients of the mesa-candle ops against the same computation written with candle's
//! differentiable ops in f64 (on the CPU), our ops on [`common::device`]: candle's CUDA
//! device in a `cuda` build with a GPU, else the CPU (the host emulation of the kernels).
//!
//! Every bound is derived from the codes' quantization step and the unit roundoff `u` of
//! the precision the op computes in (f32 2⁻²⁴, f16 2⁻¹¹, bf16 2⁻⁸; f64 tensors are computed
//! in f32, so `u = 2⁻²⁴` for them, on f32-valued inputs: [`common::Rng::tensor`]), written
//! next to the assertion:
//! * decoding: round to nearest leaves `|x̂ − x| ≤ h = step/2` (plus the f32 `fmaf` of the
//!   decode, `≤ u₃₂·max|x|`); the tests use exact per-batch statistics, so the step is
//!   `(max − min)/(2^bits − 1)` of the tensor that was encoded;
//! * arithmetic: a sum of `n` products accumulated in f32 is within `n·u₃₂·Σ|terms|`; a
//!   result stored in a half dtype is rounded once more (`u·|value|`).
mod common;

use candle_core::{DType, Module, Tensor, D};
use common::{assert_within, flat, grads, grads_on, norm_bounds, normalized, to_f64, unit, Rng};
use mesa_candle::ops::{
    CodedLinear, FeatureKind, Gelu, LayerNorm, LinearAttention, RmsNorm, Rope, RopeConfig, RopePairing, Softmax, SwiGlu,
};
use mesa_kernels::linear_attention::{LinearAttentionConfig, MemoryMode};
use mesa_kernels::{GeluForm, QuantConfig, StatsMode};

const U32: f64 = 1.0 / 16_777_216.0;
/// Every float dtype candle's CPU and CUDA backends hold.
const DTYPES: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::BF16];

/// 8-bit codes, one group, exact statistics: the step is known from the data.
fn exact(bits: u32) -> QuantConfig {
    QuantConfig { bits, stats: StatsMode::Exact, ..QuantConfig::per_tensor() }
}

fn step(values: &[f64], bits: u32) -> f64 {
    let (lo, hi) = values.iter().fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    (hi - lo) / f64::from((1u32 << bits) - 1)
}

/// `max |gelu''|`. Erf form: `gelu'' = φ(x)(2 − x²)`, largest at 0: `2φ(0) = 0.7979`.
/// Tanh form: the closed-form `gelu'` differenced on [−12, 12] with a 1e-3 grid (+1% for the
/// grid), a constant of the math evaluated rather than derived.
fn gelu_second_derivative_bound(form: GeluForm) -> f64 {
    match form {
        GeluForm::Erf => 2.0 / (2.0 * std::f64::consts::PI).sqrt(),
        GeluForm::Tanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let d1 = |x: f64| {
                let t = (c * (x + 0.044715 * x * x * x)).tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
            };
            let h = 1e-3;
            (-12_000..=12_000)
                .map(|i| f64::from(i) * h)
                .map(|x| ((d1(x + h) - d1(x - h)) / (2.0 * h)).abs())
                .fold(0.0, f64::max)
                * 1.01
        }
    }
}

#[test]
fn gelu_gradients_match_f64_candle_within_the_code_step() {
    let mut rng = Rng::new("gelu");
    let dev = common::device();
    for form in [GeluForm::Erf, GeluForm::Tanh] {
        let lip = gelu_second_derivative_bound(form);
        for dtype in DTYPES {
            // a transposed (strided) input: the kernels read candle's strides as they are
            let x = rng.tensor(&[37, 6], 0.0, 2.0, dtype).t().unwrap();
            let dy = rng.tensor(&[6, 37], 0.0, 1.0, dtype);
            let op = Gelu::new(form, exact(8));
            let (y, g) = grads_on(&dev, std::slice::from_ref(&x), &dy, |t| op.forward(&t[0]));
            let (y_ref, g_ref) = grads(&to_f64(std::slice::from_ref(&x)), &dy, |t| match form {
                GeluForm::Erf => t[0].gelu_erf(),
                GeluForm::Tanh => t[0].gelu(),
            });
            let (xs, dys) = (flat(&x), flat(&dy));
            let u = unit(dtype);
            // forward: exact up to f32 arithmetic (a few ulps of the f32 erf/tanh) and the
            // output's rounding
            let fwd: Vec<f64> = y_ref.iter().map(|v| u * v.abs() + 8.0 * U32 * (1.0 + v.abs())).collect();
            assert_within(&format!("gelu {form:?} {dtype:?} y"), &y, &y_ref, &fwd);
            // backward: |dy|·max|gelu''|·h from decoding, plus the same arithmetic terms
            let h = 0.5 * step(&xs, 8) + U32 * 4.0;
            let bound: Vec<f64> = (0..xs.len())
                .map(|i| dys[i].abs() * (lip * h + 8.0 * U32 * (1.0 + xs[i].abs())) + u * g_ref[0][i].abs())
                .collect();
            assert_within(&format!("gelu {form:?} {dtype:?} dx"), &g[0], &g_ref[0], &bound);
        }
    }
}

#[test]
fn swiglu_gradients_match_f64_candle_within_the_code_steps() {
    let mut rng = Rng::new("swiglu");
    let dev = common::device();
    for dtype in DTYPES {
        // the gate a strided view (a transposed tensor), the up projection dense
        let g_in = rng.tensor(&[29, 6], 0.0, 3.0, dtype).t().unwrap();
        let u_in = rng.tensor(&[6, 29], 0.5, 2.0, dtype);
        let dy = rng.tensor(&[6, 29], 0.0, 1.0, dtype);
        let op = SwiGlu::new(exact(8));
        let args = [g_in.clone(), u_in.clone()];
        let (y, gr) = grads_on(&dev, &args, &dy, |t| op.forward(&t[0], &t[1]));
        // silu(g)·u with candle's differentiable ops: g·σ(g), σ(g) = 1/(1 + e^{−g})
        let (y_ref, g_ref) = grads(&to_f64(&args), &dy, |t| {
            let sigma = t[0].neg()?.exp()?.affine(1.0, 1.0)?.recip()?;
            (&t[0] * sigma)?.mul(&t[1])
        });
        let (gs, us, dys) = (flat(&g_in), flat(&u_in), flat(&dy));
        let u = unit(dtype);
        let fwd: Vec<f64> = y_ref.iter().map(|v| (u + 16.0 * U32) * v.abs() + 1e-30).collect();
        assert_within(&format!("swiglu {dtype:?} y"), &y, &y_ref, &fwd);
        // half a step of g and of u: |silu'| <= 1.1, |silu''| <= 0.5; plus f32 arithmetic and
        // the gradients' rounding
        let (hg, hu) = (0.5 * step(&gs, 8) + 4.0 * U32, 0.5 * step(&us, 8) + 4.0 * U32);
        let dg: Vec<f64> = (0..gs.len())
            .map(|i| {
                dys[i].abs()
                    * (1.1 * hu + (us[i].abs() + hu) * 0.5 * hg + 16.0 * U32 * us[i].abs() * (1.0 + gs[i].abs()))
                    + u * g_ref[0][i].abs()
            })
            .collect();
        let du: Vec<f64> = (0..gs.len())
            .map(|i| dys[i].abs() * (1.1 * hg + 16.0 * U32 * gs[i].abs()) + u * g_ref[1][i].abs())
            .collect();
        assert_within(&format!("swiglu {dtype:?} dgate"), &gr[0], &g_ref[0], &dg);
        assert_within(&format!("swiglu {dtype:?} dup"), &gr[1], &g_ref[1], &du);
    }
    // shapes that differ are an error, not a panic
    let (a, b) = (rng.tensor(&[4, 8], 0.0, 1.0, DType::F32), rng.tensor(&[8, 4], 0.0, 1.0, DType::F32));
    let e = SwiGlu::new(exact(8)).forward(&a, &b).unwrap_err();
    assert!(e.to_string().contains("swiglu up (vs the gate)"), "{e}");
}

/// RoPE of `x: [B, H, S, D]` with candle's differentiable ops in f64: `x·cos + rot(x)·sin`,
/// `rot` the pair partner with its sign (halves: `[−x₂, x₁]`; interleaved: `(−x_{2i+1}, x_{2i})`).
fn rope_ref(x: &Tensor, cfg: &RopeConfig) -> candle_core::Result<Tensor> {
    let (s, d) = (x.dim(2)?, x.dim(3)?);
    let (mut cos, mut sin) = (vec![0.0f64; s * d], vec![0.0f64; s * d]);
    for p in 0..s {
        for j in 0..d {
            let i = match cfg.pairing {
                RopePairing::Halves => j % (d / 2),
                RopePairing::Interleaved => j / 2,
            };
            let theta = (cfg.position_offset + p) as f64 * f64::from(cfg.base).powf(-2.0 * i as f64 / d as f64);
            (cos[p * d + j], sin[p * d + j]) = (theta.cos(), theta.sin());
        }
    }
    let dev = x.device();
    let (cos, sin) = (Tensor::from_vec(cos, (s, d), dev)?, Tensor::from_vec(sin, (s, d), dev)?);
    let rot = match cfg.pairing {
        RopePairing::Halves => Tensor::cat(&[&x.narrow(3, d / 2, d / 2)?.neg()?, &x.narrow(3, 0, d / 2)?], 3)?,
        RopePairing::Interleaved => {
            let pairs = x.reshape((x.dim(0)?, x.dim(1)?, s, d / 2, 2))?;
            let (even, odd) = (pairs.narrow(4, 0, 1)?, pairs.narrow(4, 1, 1)?);
            Tensor::cat(&[&odd.neg()?, &even], 4)?.reshape(x.shape())?
        }
    };
    x.broadcast_mul(&cos)?.add(&rot.broadcast_mul(&sin)?)
}

#[test]
fn rope_gradients_match_f64_candle() {
    let mut rng = Rng::new("rope");
    let dev = common::device();
    for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
        let cfg = RopeConfig { base: 10_000.0, pairing, rotary_dims: None, position_offset: 3 };
        for dtype in DTYPES {
            let x = rng.tensor(&[2, 3, 11, 16], 0.0, 1.0, dtype);
            let dy = rng.tensor(&[2, 3, 11, 16], 0.0, 1.0, dtype);
            let op = Rope::new(cfg);
            let (y, g) = grads_on(&dev, std::slice::from_ref(&x), &dy, |t| op.forward(&t[0]));
            let (y_ref, g_ref) = grads(&to_f64(std::slice::from_ref(&x)), &dy, |t| rope_ref(&t[0], &cfg));
            // tests/rope.rs: |Δ| ≤ (|x_a| + |x_b|)·2⁻²⁴·(20θ + 8) + u·|ref|, θ ≤ 14 here; both
            // members of a pair below 2·max|x|
            let (xm, dm) = (
                flat(&x).iter().fold(0.0f64, |m, v| m.max(v.abs())),
                flat(&dy).iter().fold(0.0f64, |m, v| m.max(v.abs())),
            );
            let u = unit(dtype);
            let fwd: Vec<f64> = y_ref.iter().map(|v| 2.0 * xm * U32 * (20.0 * 14.0 + 8.0) + u * v.abs()).collect();
            assert_within(&format!("rope {pairing:?} {dtype:?} y"), &y, &y_ref, &fwd);
            let bwd: Vec<f64> = g_ref[0].iter().map(|v| 2.0 * dm * U32 * (20.0 * 14.0 + 8.0) + u * v.abs()).collect();
            assert_within(&format!("rope {pairing:?} {dtype:?} dx"), &g[0], &g_ref[0], &bwd);
        }
    }
    let e = Rope::new(RopeConfig { rotary_dims: Some(5), ..RopeConfig::llama(10_000.0) })
        .forward(&rng.tensor(&[2, 4, 8], 0.0, 1.0, DType::F32))
        .unwrap_err();
    assert!(e.to_string().contains("rotary dims"), "{e}");
}

fn softmax_ref(z: &Tensor) -> candle_core::Result<Tensor> {
    let z = z.broadcast_sub(&z.max_keepdim(D::Minus1)?.detach())?;
    let e = z.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[test]
fn softmax_with_mask_gradients_match_f64_candle_within_the_code_step() {
    let mut rng = Rng::new("softmax");
    let dev = common::device();
    let (b, h, n, m) = (2, 3, 5, 19);
    for dtype in DTYPES {
        let x = rng.tensor(&[b, h, n, m], 0.0, 2.0, dtype);
        // a key-padding mask [B, 1, 1, N]: −inf on the last 4 keys of batch 1, small
        // additive biases elsewhere; broadcast by stride 0
        let mask: Vec<f64> = (0..b * m)
            .map(|i| if i / m == 1 && i % m >= m - 4 { f64::NEG_INFINITY } else { 0.3 * rng.gauss() })
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, m), &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let dy = rng.tensor(&[b, h, n, m], 0.0, 1.0, dtype);
        let op = Softmax::new(8);
        let mask_on = mask.to_device(&dev).unwrap();
        let (y, g) = grads_on(&dev, std::slice::from_ref(&x), &dy, |t| op.forward(&t[0], Some(&mask_on)));
        let mask64 = mask.to_dtype(DType::F64).unwrap();
        let (y_ref, g_ref) =
            grads(&to_f64(std::slice::from_ref(&x)), &dy, |t| softmax_ref(&t[0].broadcast_add(&mask64)?));
        let u = unit(dtype);
        let fwd: Vec<f64> = y_ref.iter().map(|v| u * v + 16.0 * U32).collect();
        assert_within(&format!("softmax {dtype:?} y"), &y, &y_ref, &fwd);
        // backward from square-root codes: e_j = (√y_j + s/4)·s bounds |ŷ_j − y_j|
        // (s = 1/255, plus the stored y's rounding u·y_j); with c = Σ dy·y and
        // E = Σ_j |dy_j| e_j per row: |Δdx_i| ≤ e_i(|dy_i| + |c| + E) + (y_i + e_i)·E.
        let s = 1.0 / 255.0;
        let dys = flat(&dy);
        let mut bound = vec![0.0; y_ref.len()];
        for row in 0..(b * h * n) {
            let r = row * m..(row + 1) * m;
            let e: Vec<f64> =
                r.clone().map(|j| ((y_ref[j].sqrt() + s / 4.0) * s + u * y_ref[j]) * (1.0 + 1e-6)).collect();
            let c: f64 = r.clone().map(|j| dys[j] * y_ref[j]).sum();
            let big_e: f64 = r.clone().zip(&e).map(|(j, ej)| dys[j].abs() * ej).sum();
            let arith = 4.0 * m as f64 * U32 * r.clone().map(|j| dys[j].abs()).sum::<f64>();
            for (k, j) in r.enumerate() {
                bound[j] =
                    e[k] * (dys[j].abs() + c.abs() + big_e) + (y_ref[j] + e[k]) * big_e + arith + u * g_ref[0][j].abs();
            }
        }
        assert_within(&format!("softmax {dtype:?} dx"), &g[0], &g_ref[0], &bound);
    }
}

fn layer_norm_ref(t: &[Tensor], eps: f64) -> candle_core::Result<Tensor> {
    let x = &t[0];
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xhat.broadcast_mul(&t[1])?.broadcast_add(&t[2])
}

#[test]
fn layer_norm_gradients_match_f64_candle_within_the_code_step() {
    let mut rng = Rng::new("layer_norm");
    let dev = common::device();
    let (rows, cols, eps) = (9, 48, 1e-5);
    for dtype in DTYPES {
        let x = rng.tensor(&[3, rows / 3, cols], 3.0, 2.0, dtype);
        let w = rng.tensor(&[cols], 1.0, 0.5, dtype);
        let b = rng.tensor(&[cols], 0.0, 0.5, dtype);
        let dy = rng.tensor(&[3, rows / 3, cols], 0.0, 1.0, dtype);
        let op = LayerNorm::new(eps as f32, exact(8));
        let inputs = [x.clone(), w.clone(), b.clone()];
        let (y, g) = grads_on(&dev, &inputs, &dy, |t| op.forward(&t[0], &t[1], &t[2]));
        let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| layer_norm_ref(t, eps));
        let u = unit(dtype);
        let (xs, ws, dys) = (flat(&x), flat(&w), flat(&dy));
        let (xhat, rstd) = normalized(&xs, cols, eps, true);
        let fwd: Vec<f64> = y_ref.iter().map(|v| u * v.abs() + 64.0 * cols as f64 * U32 * (1.0 + v.abs())).collect();
        assert_within(&format!("layer norm {dtype:?} y"), &y, &y_ref, &fwd);
        let h = 0.5 * step(&xhat, 8) * (1.0 + 1e-4) + 8.0 * U32 * xhat.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        let nb = norm_bounds(&xhat, &rstd, &ws, &dys, h);
        let with_u = |b: &[f64], r: &[f64]| -> Vec<f64> { b.iter().zip(r).map(|(b, r)| b + u * r.abs()).collect() };
        assert_within(&format!("layer norm {dtype:?} dx"), &g[0], &g_ref[0], &with_u(&nb.dx, &g_ref[0]));
        assert_within(&format!("layer norm {dtype:?} dw"), &g[1], &g_ref[1], &with_u(&nb.dw, &g_ref[1]));
        assert_within(&format!("layer norm {dtype:?} db"), &g[2], &g_ref[2], &with_u(&nb.db, &g_ref[2]));
    }
}

#[test]
fn rms_norm_gradients_match_f64_candle_within_the_code_step() {
    let mut rng = Rng::new("rms_norm");
    let dev = common::device();
    let (rows, cols, eps) = (7, 40, 1e-6);
    for dtype in DTYPES {
        let x = rng.tensor(&[rows, cols], 0.5, 2.0, dtype);
        let w = rng.tensor(&[cols], 1.0, 0.5, dtype);
        let dy = rng.tensor(&[rows, cols], 0.0, 1.0, dtype);
        let op = RmsNorm::new(eps as f32, exact(8));
        let inputs = [x.clone(), w.clone()];
        let (y, g) = grads_on(&dev, &inputs, &dy, |t| op.forward(&t[0], &t[1]));
        let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| {
            let rstd = (t[0].sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
            t[0].broadcast_mul(&rstd)?.broadcast_mul(&t[1])
        });
        let u = unit(dtype);
        let (xs, ws, dys) = (flat(&x), flat(&w), flat(&dy));
        let (xhat, rstd) = normalized(&xs, cols, eps, false);
        let fwd: Vec<f64> = y_ref.iter().map(|v| u * v.abs() + 16.0 * cols as f64 * U32 * (1.0 + v.abs())).collect();
        assert_within(&format!("rms norm {dtype:?} y"), &y, &y_ref, &fwd);
        let h = 0.5 * step(&xhat, 8) * (1.0 + 1e-4) + 8.0 * U32 * xhat.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        let nb = norm_bounds(&xhat, &rstd, &ws, &dys, h);
        let with_u =
            |b: &[f64], r: &[f64]| -> Vec<f64> { b.iter().zip(r).map(|(b, r)| b + 2.0 * u * r.abs()).collect() };
        assert_within(&format!("rms norm {dtype:?} dx"), &g[0], &g_ref[0], &with_u(&nb.dx, &g_ref[0]));
        assert_within(&format!("rms norm {dtype:?} dw"), &g[1], &g_ref[1], &with_u(&nb.dw, &g_ref[1]));
    }
}

#[test]
fn coded_linear_weight_gradient_is_within_the_input_code_step() {
    let mut rng = Rng::new("linear");
    let dev = common::device();
    let (rows, n_in, n_out) = (13, 24, 10);
    for dtype in DTYPES {
        let x = rng.tensor(&[rows, n_in], 0.0, 1.5, dtype);
        let w = rng.tensor(&[n_out, n_in], 0.0, 0.3, dtype);
        let b = rng.tensor(&[n_out], 0.0, 0.3, dtype);
        let dy = rng.tensor(&[rows, n_out], 0.0, 1.0, dtype);
        let op = CodedLinear::new(exact(8));
        let inputs = [x.clone(), w.clone(), b.clone()];
        let (y, g) = grads_on(&dev, &inputs, &dy, |t| op.forward(&t[0], &t[1], Some(&t[2])));
        let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| t[0].matmul(&t[1].t()?)?.broadcast_add(&t[2]));
        let u = unit(dtype);
        let (xs, ws, dys) = (flat(&x), flat(&w), flat(&dy));
        // products accumulated over n terms (candle's gemm; in the dtype's precision at worst):
        // n·u·Σ|a||b|, plus the result's rounding
        let mag = |a: &[f64],
                   b: &[f64],
                   ni: usize,
                   nj: usize,
                   nk: usize,
                   ai: &dyn Fn(usize, usize) -> usize,
                   bj: &dyn Fn(usize, usize) -> usize|
         -> Vec<f64> {
            (0..ni * nj)
                .map(|ij| {
                    (0..nk).map(|k| (a[ai(ij / nj, k)] * b[bj(ij % nj, k)]).abs()).sum::<f64>() * (nk as f64 + 2.0) * u
                })
                .collect()
        };
        let y_mag = mag(&xs, &ws, rows, n_out, n_in, &|i, k| i * n_in + k, &|j, k| j * n_in + k);
        let fwd: Vec<f64> = y_ref.iter().zip(&y_mag).map(|(v, m)| m + u * v.abs() + u * 8.0).collect();
        assert_within(&format!("linear {dtype:?} y"), &y, &y_ref, &fwd);
        let dx_mag = mag(&dys, &ws, rows, n_in, n_out, &|i, k| i * n_out + k, &|j, k| k * n_in + j);
        assert_within(&format!("linear {dtype:?} dx"), &g[0], &g_ref[0], &dx_mag);
        // dW_ij = Σ_r dy_ri x̂_rj: decoding adds Σ_r |dy_ri|·h
        let h = 0.5 * step(&xs, 8) * (1.0 + 1e-4) + 4.0 * U32 * xs.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        let dw_mag = mag(&dys, &xs, n_out, n_in, rows, &|i, r| r * n_out + i, &|j, r| r * n_in + j);
        let dw_bound: Vec<f64> = (0..n_out * n_in)
            .map(|ij| {
                dw_mag[ij] + (0..rows).map(|r| dys[r * n_out + ij / n_in].abs()).sum::<f64>() * h * (1.0 + 2.0 * u)
            })
            .collect();
        assert_within(&format!("linear {dtype:?} dw"), &g[1], &g_ref[1], &dw_bound);
        let db_bound: Vec<f64> = (0..n_out)
            .map(|j| (0..rows).map(|r| dys[r * n_out + j].abs()).sum::<f64>() * (rows as f64 + 2.0) * u)
            .collect();
        assert_within(&format!("linear {dtype:?} db"), &g[2], &g_ref[2], &db_bound);
    }
}

/// The reference of [`LinearAttention`]: `φ` by candle's ops, `A = φ(q)φ(k)ᵀ` masked
/// (causal), `out = A·v / g(A·1)` with `g(x) = x + ε` (the features are non-negative).
fn linear_attention_ref(t: &[Tensor], map: &FeatureKind, causal: bool, eps: f64) -> candle_core::Result<Tensor> {
    let phi = |x: &Tensor, query: bool| -> candle_core::Result<Tensor> {
        match map {
            FeatureKind::Relu => x.relu(),
            FeatureKind::Elu1 => x.elu(1.0)? + 1.0,
            FeatureKind::Favor(p) => {
                let (m, d) = (p.features(), p.in_dim());
                let omega = Tensor::from_vec(p.omega().to_vec(), (m, d), x.device())?.to_dtype(DType::F64)?;
                let xs = (x * (d as f64).powf(-0.25))?;
                let u = xs.broadcast_matmul(&omega.t()?)?.broadcast_sub(&(xs.sqr()?.sum_keepdim(D::Minus1)? * 0.5)?)?;
                // the kernels' stabilisers, constants in backward: queries their row maximum,
                // causal keys the projection's bound max|ω_i|²/2, bidirectional keys the
                // maximum over the (b, h) sequence (they cancel up to the ε guard)
                let c = if query {
                    u.max_keepdim(D::Minus1)?.detach()
                } else if causal {
                    (u.max_keepdim(D::Minus1)?.zeros_like()? + f64::from(p.bound()))?
                } else {
                    u.max_keepdim(D::Minus1)?.max_keepdim(2)?.detach()
                };
                u.broadcast_sub(&c)?.exp()? / (m as f64).sqrt()
            }
        }
    };
    let (q, k, v) = (phi(&t[0], true)?, phi(&t[1], false)?, &t[2]);
    let l = q.dim(2)?;
    let mut a = q.matmul(&k.t()?)?;
    if causal {
        let mask: Vec<f64> = (0..l * l).map(|i| if i % l <= i / l { 1.0 } else { 0.0 }).collect();
        a = a.broadcast_mul(&Tensor::from_vec(mask, (l, l), q.device())?)?;
    }
    let den = (a.sum_keepdim(D::Minus1)? + eps)?;
    a.matmul(v)?.broadcast_div(&den)
}

#[test]
fn linear_attention_gradients_match_f64_candle() {
    let mut rng = Rng::new("linear_attention");
    let dev = common::device();
    let (b, h, l, d, dv) = (1, 2, 45, 8, 6);
    let favor = LinearAttention::favor(&dev, 16, d, 7).unwrap();
    for map in [FeatureKind::Relu, FeatureKind::Elu1, favor] {
        for (causal, memory) in
            [(true, MemoryMode::BoundaryStates), (true, MemoryMode::Slim), (false, MemoryMode::BoundaryStates)]
        {
            for dtype in DTYPES {
                let config = LinearAttentionConfig { causal, chunk: 16, memory, ..LinearAttentionConfig::causal() };
                // The bound below holds for well-conditioned positions: the gradients
                // through the normaliser z_t = φ(q_t)·Σ_{s≤t} φ(k_s) carry the rounding of
                // the output divided by z_t, and with eps the sensitivity eps/(z_t + eps)²,
                // unbounded as z_t → 0. ReLU features at mean 0.6 made z_0 (a sum of 8
                // products, each 0 with probability ≈ 0.5) tiny now and then (a dq of
                // 0.015 came out 0); at mean 1, std 0.5 the ReLU cut still zeroes ≈ 2 % of
                // the entries and z_0 stays of order 1.
                let (mean, std) = if matches!(map, FeatureKind::Relu) { (1.0, 0.5) } else { (0.0, 0.7) };
                let q = rng.tensor(&[b, h, l, d], mean, std, dtype);
                let k = rng.tensor(&[b, h, l, d], mean, std, dtype);
                let v = rng.tensor(&[b, h, l, dv], 0.0, 1.0, dtype);
                let dy = rng.tensor(&[b, h, l, dv], 0.0, 1.0, dtype);
                let op = LinearAttention::new(config, map.clone());
                let inputs = [q, k, v];
                let (y, g) = grads_on(&dev, &inputs, &dy, |t| op.forward(&t[0], &t[1], &t[2]));
                let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| linear_attention_ref(t, &map, causal, 1e-6));
                // f32 accumulation over n = L·(d + D) terms in at most three chained
                // reductions (γ_n each, constant 16 with the feature map's exp), plus the
                // stored intermediates (φ, dφ, out) rounded to the dtype, four times
                // at most per path (8u): componentwise and relative to the tensor's largest
                // entry (the sums mix signs, so no componentwise bound alone holds).
                let n = (l * (d + dv)) as f64;
                let c = 16.0 * n * U32 + 8.0 * unit(dtype);
                let what = format!("linear attention {map:?} causal={causal} {memory:?} {dtype:?}");
                for (name, got, want) in
                    [("out", &y, &y_ref), ("dq", &g[0], &g_ref[0]), ("dk", &g[1], &g_ref[1]), ("dv", &g[2], &g_ref[2])]
                {
                    let top = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
                    let bound: Vec<f64> = want.iter().map(|w| c * (w.abs() + top)).collect();
                    assert_within(&format!("{what} {name}"), got, want, &bound);
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors_not_panics() {
    use mesa_candle::{as_mesa_error, Error};
    let cpu = candle_core::Device::Cpu;
    let x = Tensor::zeros((4, 8), DType::F32, &cpu).unwrap();
    let w7 = Tensor::ones(7, DType::F32, &cpu).unwrap();
    let e = LayerNorm::new(1e-5, exact(8)).forward(&x, &w7, &w7).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{e}");
    let w8 = Tensor::ones(8, DType::F32, &cpu).unwrap();
    // eps ≤ 0: rejected by the kernel's checks, carried as the kernels' typed error
    let e = LayerNorm::new(0.0, exact(8)).forward(&x, &w8, &w8).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Kernel(mesa_kernels::Error::InvalidArgument { .. }))), "{e}");
    let e = RmsNorm::new(-1.0, exact(8)).forward(&x, &w8).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { name: "rms norm eps", .. })), "{e}");
    // 3-bit codes: the kernels support 8, 4 and 2
    let e = Gelu::new(GeluForm::Erf, exact(3)).forward(&x).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Kernel(mesa_kernels::Error::Unsupported { .. }))), "{e}");
    let e =
        CodedLinear::new(exact(8)).forward(&x, &Tensor::zeros((3, 5), DType::F32, &cpu).unwrap(), None).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{e}");
    let q = Tensor::zeros((1, 2, 5, 4), DType::F32, &cpu).unwrap();
    let k = Tensor::zeros((1, 2, 6, 4), DType::F32, &cpu).unwrap();
    let la = LinearAttention::new(LinearAttentionConfig::causal(), FeatureKind::Elu1);
    let e = la.forward(&q, &k, &q).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{e}");
    // a mask that does not broadcast to the input: our shape error, before any kernel
    let e = Softmax::default().forward(&x, Some(&Tensor::zeros((3, 8), DType::F32, &cpu).unwrap())).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{e}");
    let e = Softmax::default().forward(&x, Some(&Tensor::zeros((2, 4, 8), DType::F32, &cpu).unwrap())).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{e}");
}

/// Every op on every non-float dtype candle has: [`Error::UnsupportedDType`] naming it.
#[test]
fn non_float_dtypes_are_typed_errors() {
    use mesa_candle::{as_mesa_error, Error};
    let cpu = candle_core::Device::Cpu;
    let la = LinearAttention::new(LinearAttentionConfig::causal(), FeatureKind::Elu1);
    for dtype in [DType::U8, DType::U32, DType::I64] {
        let x = Tensor::zeros((1, 2, 4, 8), dtype, &cpu).unwrap();
        let w = Tensor::zeros(8, dtype, &cpu).unwrap();
        let w2 = Tensor::zeros((3, 8), dtype, &cpu).unwrap();
        let results = [
            ("gelu", Gelu::erf().forward(&x)),
            ("softmax", Softmax::default().forward(&x, None)),
            ("layer norm", LayerNorm::new(1e-5, exact(8)).forward(&x, &w, &w)),
            ("rms norm", RmsNorm::new(1e-5, exact(8)).forward(&x, &w)),
            ("linear", CodedLinear::new(exact(8)).forward(&x, &w2, None)),
            ("linear attention", la.forward(&x, &x, &x)),
        ];
        for (op, r) in results {
            let e = r.unwrap_err();
            assert!(
                matches!(as_mesa_error(&e), Some(Error::UnsupportedDType { dtype: d, op: o }) if *d == dtype && *o == op),
                "{op} {dtype:?}: {e}"
            );
        }
    }
}

/// Inputs of the wrong rank or shape: [`Error::Rank`] or [`Error::Shape`] from every op and
/// the message names the tensor, never candle's own `dims4()`-style error.
#[test]
fn bad_ranks_and_shapes_are_typed_errors() {
    use mesa_candle::{as_mesa_error, Error};
    let cpu = candle_core::Device::Cpu;
    let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &cpu).unwrap();
    let scalar = Tensor::new(1f32, &cpu).unwrap();
    let la = LinearAttention::new(LinearAttentionConfig::causal(), FeatureKind::Elu1);
    let rank = |what: &str, r: candle_core::Result<Tensor>, name: &str| {
        let e = r.unwrap_err();
        assert!(matches!(as_mesa_error(&e), Some(Error::Rank { what, .. }) if what.contains(name)), "{what}: {e}");
        assert!(e.to_string().contains("expected rank"), "{what}: {e}");
    };
    rank("softmax scalar", Softmax::default().forward(&scalar, None), "softmax input");
    rank("layer norm scalar", LayerNorm::new(1e-5, exact(8)).forward(&scalar, &z(&[1]), &z(&[1])), "layer norm input");
    rank("rms norm scalar", RmsNorm::new(1e-5, exact(8)).forward(&scalar, &z(&[1])), "rms norm input");
    rank("linear scalar", CodedLinear::new(exact(8)).forward(&scalar, &z(&[1, 1]), None), "linear input");
    rank("linear weight [8]", CodedLinear::new(exact(8)).forward(&z(&[4, 8]), &z(&[8]), None), "linear weight");
    rank("linear attention q rank 3", la.forward(&z(&[2, 5, 4]), &z(&[2, 5, 4]), &z(&[2, 5, 4])), "queries");
    rank(
        "linear attention q rank 5",
        la.forward(&z(&[1, 1, 2, 5, 4]), &z(&[1, 2, 5, 4]), &z(&[1, 2, 5, 4])),
        "queries",
    );
    rank("linear attention k rank 3", la.forward(&z(&[1, 2, 5, 4]), &z(&[2, 5, 4]), &z(&[1, 2, 5, 4])), "keys");
    rank("linear attention v rank 3", la.forward(&z(&[1, 2, 5, 4]), &z(&[1, 2, 5, 4]), &z(&[2, 5, 4])), "values");
    let shape = |what: &str, r: candle_core::Result<Tensor>| {
        let e = r.unwrap_err();
        assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{what}: {e}");
    };
    shape("linear bias", CodedLinear::new(exact(8)).forward(&z(&[4, 8]), &z(&[3, 8]), Some(&z(&[4]))));
    shape("linear attention values", la.forward(&z(&[1, 2, 5, 4]), &z(&[1, 2, 5, 4]), &z(&[1, 2, 6, 4])));
    // the f64 path checks the same (after its casts)
    let z64 = |dims: &[usize]| Tensor::zeros(dims, DType::F64, &cpu).unwrap();
    rank("linear attention f64 q rank 3", la.forward(&z64(&[2, 5, 4]), &z64(&[2, 5, 4]), &z64(&[2, 5, 4])), "queries");
}

/// f64 tensors are computed in f32 (`docs/candle.md`): on general f64 inputs, every op's
/// result and gradients are exactly those of the same op on the f32-rounded inputs and
/// gradient, cast to f64 — bitwise, since the casts are the only difference. (Exact
/// statistics and a fresh op per run: the codes are a function of the data alone.)
#[test]
fn f64_is_computed_in_f32() {
    let mut rng = Rng::new("f64_in_f32");
    let dev = common::device();
    type Run = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>>;
    /// (name, input shapes, output shape, the op)
    type Case = (&'static str, Vec<Vec<usize>>, Vec<usize>, Run);
    let cases: Vec<Case> = vec![
        (
            "gelu",
            vec![vec![5, 7]],
            vec![5, 7],
            Box::new(|t: &[Tensor]| Gelu::new(GeluForm::Erf, exact(8)).forward(&t[0])) as Run,
        ),
        ("softmax", vec![vec![3, 9]], vec![3, 9], Box::new(|t: &[Tensor]| Softmax::new(8).forward(&t[0], None)) as Run),
        (
            "layer norm",
            vec![vec![4, 12], vec![12], vec![12]],
            vec![4, 12],
            Box::new(|t: &[Tensor]| LayerNorm::new(1e-5, exact(8)).forward(&t[0], &t[1], &t[2])) as Run,
        ),
        (
            "rms norm",
            vec![vec![4, 12], vec![12]],
            vec![4, 12],
            Box::new(|t: &[Tensor]| RmsNorm::new(1e-5, exact(8)).forward(&t[0], &t[1])) as Run,
        ),
        (
            "linear",
            vec![vec![6, 10], vec![4, 10], vec![4]],
            vec![6, 4],
            Box::new(|t: &[Tensor]| CodedLinear::new(exact(8)).forward(&t[0], &t[1], Some(&t[2]))) as Run,
        ),
        (
            "linear attention",
            vec![vec![1, 2, 20, 4], vec![1, 2, 20, 4], vec![1, 2, 20, 3]],
            vec![1, 2, 20, 3],
            Box::new(|t: &[Tensor]| {
                let config = LinearAttentionConfig { chunk: 8, ..LinearAttentionConfig::causal() };
                LinearAttention::new(config, FeatureKind::Elu1).forward(&t[0], &t[1], &t[2])
            }) as Run,
        ),
    ];
    for (op, shapes, out, run) in cases {
        let inputs: Vec<Tensor> = shapes.iter().map(|s| rng.tensor_f64(s, 0.3, 1.0)).collect();
        let dy = rng.tensor_f64(&out, 0.0, 1.0);
        let (y64, g64) = grads_on(&dev, &inputs, &dy, |t| {
            assert!(t.iter().all(|t| t.dtype() == DType::F64));
            run(t)
        });
        let inputs32: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect();
        let (y32, g32) = grads_on(&dev, &inputs32, &dy.to_dtype(DType::F32).unwrap(), |t| run(t));
        assert_eq!(y64, y32, "{op}: f64 result ≠ f32 result on the rounded inputs");
        assert_eq!(g64, g32, "{op}: f64 gradients ≠ f32 gradients on the rounded inputs");
        // and the f64 inputs were not all f32 values already (the rounding was exercised)
        assert_ne!(flat(&inputs[0]), flat(&inputs32[0]), "{op}");
    }
}

/// The bound of softmax's `dx` from `s = 1/255` square-root codes on rows of `m` (the
/// derivation at `softmax_with_mask_gradients_match_f64_candle_within_the_code_step`):
/// `e_j = (√y_j + s/4)·s + u·y_j` bounds `|ŷ_j − y_j|`; with `c = Σ dy·y`, `E = Σ_j |dy_j|
/// e_j` per row, `|Δdx_i| ≤ e_i(|dy_i| + |c| + E) + (y_i + e_i)·E`, plus the f32 sums and
/// the result's rounding.
fn softmax_dx_bound(y: &[f64], dy: &[f64], g: &[f64], m: usize, u: f64) -> Vec<f64> {
    let s = 1.0 / 255.0;
    let mut bound = vec![0.0; y.len()];
    for row in 0..y.len() / m {
        let r = row * m..(row + 1) * m;
        let e: Vec<f64> = r.clone().map(|j| ((y[j].sqrt() + s / 4.0) * s + u * y[j]) * (1.0 + 1e-6)).collect();
        let c: f64 = r.clone().map(|j| dy[j] * y[j]).sum();
        let big_e: f64 = r.clone().zip(&e).map(|(j, ej)| dy[j].abs() * ej).sum();
        let arith = 4.0 * m as f64 * U32 * r.clone().map(|j| dy[j].abs()).sum::<f64>();
        for (k, j) in r.enumerate() {
            bound[j] = e[k] * (dy[j].abs() + c.abs() + big_e) + (y[j] + e[k]) * big_e + arith + u * g[j].abs();
        }
    }
    bound
}

/// Issue 39: a mask computed from a variable gets its gradient, `dx` summed over the axes the
/// mask was broadcast along (before, backward panicked: "grad not populated"). The issue's
/// snippet, then a mask `2·b`, `b: [3, 1, 5]`, on `x: [2, 3, 4, 5]` against candle f64.
#[test]
fn softmax_mask_from_a_variable_gets_its_gradient() {
    let mut rng = Rng::new("softmax_mask_gradient");
    let cpu = candle_core::Device::Cpu;
    let x = candle_core::Var::new(&[[1f32, 2., 3.]], &cpu).unwrap();
    let bias = candle_core::Var::new(&[[0f32, 0.5, -0.5]], &cpu).unwrap();
    let mask = (bias.as_tensor() * 2.0).unwrap();
    let y = Softmax::default().forward(x.as_tensor(), Some(&mask)).unwrap();
    let store = y.sum_all().unwrap().backward().unwrap();
    // Σ_j y_j = 1: both true gradients are 0; dbias = 2·dx, within twice dx's bound
    let y_ref = flat(&softmax_ref(&Tensor::new(&[[1f64, 3., 2.]], &cpu).unwrap()).unwrap());
    let dx_bound = softmax_dx_bound(&y_ref, &[1.0; 3], &[0.0; 3], 3, U32);
    let dbias = store.get(bias.as_tensor()).expect("the mask's variable gets a gradient");
    assert_eq!(dbias.dims(), [1, 3]);
    let twice: Vec<f64> = dx_bound.iter().map(|b| 2.0 * b).collect();
    assert_within("issue 39 dbias", &flat(dbias), &[0.0; 3], &twice);
    assert_within("issue 39 dx", &flat(store.get(x.as_tensor()).unwrap()), &[0.0; 3], &dx_bound);

    let dev = common::device();
    let (xs_dims, b_dims) = ([2usize, 3, 4, 5], [3usize, 1, 5]);
    let m = xs_dims[3];
    for dtype in DTYPES {
        let x = rng.tensor(&xs_dims, 0.0, 2.0, dtype);
        let b = rng.tensor(&b_dims, 0.0, 0.3, dtype);
        let dy = rng.tensor(&xs_dims, 0.0, 1.0, dtype);
        let op = Softmax::new(8);
        let inputs = [x, b];
        let (y, g) = grads_on(&dev, &inputs, &dy, |t| op.forward(&t[0], Some(&(&t[1] * 2.0)?)));
        let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| softmax_ref(&t[0].broadcast_add(&(&t[1] * 2.0)?)?));
        let u = unit(dtype);
        let fwd: Vec<f64> = y_ref.iter().map(|v| u * v + 16.0 * U32).collect();
        assert_within(&format!("softmax mask {dtype:?} y"), &y, &y_ref, &fwd);
        let dys = flat(&dy);
        // dx as computed (the kernel's; the gradient w.r.t. x + mask), then db = 2·Σ dx over
        // the broadcast axes (0 and 2), summed in f32 (12 terms) and rounded to the dtype
        let dx_bound = softmax_dx_bound(&y_ref, &dys, &g_ref[0], m, u);
        assert_within(&format!("softmax mask {dtype:?} dx"), &g[0], &g_ref[0], &dx_bound);
        let mut db_bound = vec![0.0; g_ref[1].len()];
        for (i, (bound, dx)) in dx_bound.iter().zip(&g_ref[0]).enumerate() {
            let j = ((i / (4 * m)) % 3) * m + i % m;
            db_bound[j] += 2.0 * (bound + 12.0 * U32 * dx.abs() * 1.01);
        }
        for (bound, want) in db_bound.iter_mut().zip(&g_ref[1]) {
            *bound += u * want.abs();
        }
        assert_within(&format!("softmax mask {dtype:?} dmask"), &g[1], &g_ref[1], &db_bound);
    }
}

/// Issue 39: a mesa-candle error shows, as a candle error, its own one-line message (not
/// candle's `WrappedContext` Debug dump), and `as_mesa_error` gets the typed error back,
/// also through candle's `.context()` and its `Context` trait.
#[test]
fn errors_display_their_one_line_message() {
    use mesa_candle::{as_mesa_error, Error};
    let cpu = candle_core::Device::Cpu;
    let z = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &cpu).unwrap();
    let la = LinearAttention::new(LinearAttentionConfig::causal(), FeatureKind::Elu1);
    let f32s = |dims: &[usize]| z(dims, DType::F32);
    let x = f32s(&[4, 8]);
    type Is = fn(&Error) -> bool;
    let cases: Vec<(candle_core::Error, &str, Is)> = vec![
        (
            la.forward(&f32s(&[2, 5, 4]), &f32s(&[2, 5, 4]), &f32s(&[2, 5, 4])).unwrap_err(),
            "linear attention queries [B, H, L, d]: expected rank 4, got shape [2, 5, 4] (rank 3)",
            |e| matches!(e, Error::Rank { .. }),
        ),
        (
            Softmax::default().forward(&x, Some(&f32s(&[3, 8]))).unwrap_err(),
            "softmax mask (broadcast to the input): expected shape [4, 8], got [3, 8]",
            |e| matches!(e, Error::Shape { .. }),
        ),
        (
            LayerNorm::new(0.0, exact(8)).forward(&x, &f32s(&[8]), &f32s(&[8])).unwrap_err(),
            "mesa-kernels: invalid argument `eps`: must be positive and finite, got 0",
            |e| matches!(e, Error::Kernel(mesa_kernels::Error::InvalidArgument { .. })),
        ),
        (
            Gelu::erf().forward(&z(&[3], DType::U8)).unwrap_err(),
            "gelu: dtype U8 is not supported (ops: f32, f16, bf16, f64 computed in f32; layer: f32, f16, bf16)",
            |e| matches!(e, Error::UnsupportedDType { op: "gelu", dtype: DType::U8 }),
        ),
    ];
    for (e, want, is) in cases {
        let shown = e.to_string();
        assert_eq!(shown, want, "Display of {e:?}");
        assert!(!shown.contains('\n'), "{shown:?}");
        let typed = as_mesa_error(&e).unwrap_or_else(|| panic!("no mesa error in {e:?}"));
        assert!(is(typed), "{typed:?}");
        assert_eq!(typed.to_string(), want);
        // a caller's context around it: candle's own formats, the typed error still inside
        let via_trait = candle_core::Context::context(Err::<(), _>(e), "in layer 3").unwrap_err();
        assert!(as_mesa_error(&via_trait).is_some_and(is), "{via_trait:?}");
        let via_method = via_trait.context("in the model");
        assert!(as_mesa_error(&via_method).is_some_and(is), "{via_method:?}");
    }
}

/// `v` (f32 values) rounded to `dtype` once, as f64: through f32 (exact), since half's
/// f64 → bf16 drops the f64's low 32 bits before rounding (an f32's last 3 bits, which decide
/// some ties).
fn rounded(v: &[f64], dtype: DType) -> Vec<f64> {
    let t = Tensor::new(v, &candle_core::Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    flat(&t.to_dtype(dtype).unwrap())
}

/// Issue 39: f16 and bf16 linear attention is computed in f32 and rounded once at the
/// results, as `LinearAttention`'s docs say: output and gradients are bitwise the f32 op's on
/// the same values, rounded to the dtype, and so within the f32 bound of
/// `linear_attention_gradients_match_f64_candle` plus that one rounding, `u·|w|`. (The
/// backward's normaliser term read the output as candle holds it, already rounded: f16
/// `[1, 2, 24, 8]`, a dq was 8.07e-6 off against 7.97e-6 allowed.) Values with a common
/// offset make the normaliser term (`∝ out`) and the numerator's cancel in `dq`, `dk`, so the
/// rounding of `out` is not hidden under the size of the result.
#[test]
fn linear_attention_16_bit_is_f32_rounded_once() {
    let mut rng = Rng::new("linear_attention_16_bit");
    let dev = common::device();
    let (b, h, l, d, dv) = (1, 2, 24, 8, 8);
    let favor = LinearAttention::favor(&dev, 16, d, 11).unwrap();
    // each map, memory mode and dtype once
    let cases = [
        (FeatureKind::Elu1, MemoryMode::BoundaryStates, DType::F16),
        (FeatureKind::Elu1, MemoryMode::Slim, DType::BF16),
        (favor.clone(), MemoryMode::BoundaryStates, DType::BF16),
        (favor, MemoryMode::Slim, DType::F16),
    ];
    for (map, memory, dtype) in cases {
        let config = LinearAttentionConfig { chunk: 16, memory, ..LinearAttentionConfig::causal() };
        let op = LinearAttention::new(config, map.clone());
        let q = rng.tensor(&[b, h, l, d], 0.0, 0.7, dtype);
        let k = rng.tensor(&[b, h, l, d], 0.0, 0.7, dtype);
        let v = rng.tensor(&[b, h, l, dv], 4.0, 0.5, dtype);
        let dy = rng.tensor(&[b, h, l, dv], 0.0, 1.0, dtype);
        let inputs = [q, k, v];
        let run = |t: &[Tensor]| op.forward(&t[0], &t[1], &t[2]);
        let (y, g) = grads_on(&dev, &inputs, &dy, run);
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let (y32, g32) = grads_on(&dev, &inputs.clone().map(|t| f32s(&t)), &f32s(&dy), run);
        let what = format!("linear attention {map:?} {memory:?} {dtype:?}");
        assert!(y == rounded(&y32, dtype), "{what}: out is not the f32 op's rounded once");
        for (name, i) in [("dq", 0), ("dk", 1), ("dv", 2)] {
            let want = rounded(&g32[i], dtype);
            let differ = (0..want.len()).filter(|&j| g[i][j] != want[j]).count();
            assert!(differ == 0, "{what}: {differ} of {} {name} are not the f32 op's rounded once", want.len());
        }
        let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| linear_attention_ref(t, &map, true, 1e-6));
        // the f32 result f is within E = c·(|w| + top) (the f32 test's bound), its rounding r
        // within u·|f|: |r − w| ≤ E·(1 + u) + u·|w|
        let c = 16.0 * (l * (d + dv)) as f64 * U32;
        let u = unit(dtype);
        for (name, got, want) in
            [("out", &y, &y_ref), ("dq", &g[0], &g_ref[0]), ("dk", &g[1], &g_ref[1]), ("dv", &g[2], &g_ref[2])]
        {
            let top = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            let bound: Vec<f64> = want.iter().map(|w| c * (w.abs() + top) * (1.0 + u) + u * w.abs()).collect();
            assert_within(&format!("{what} {name}"), got, want, &bound);
        }
    }
}

/// Issue 39: RMSNorm of rows of huge finite values (the f32 mean of squares overflowed above
/// |x| ≈ 1.8e19: rstd = 0, and output, dx and dw were 0) and of tiny ones, in every dtype,
/// against candle f64 with `rms_norm_gradients_match_f64_candle_within_the_code_step`'s
/// bounds, plus, for the gradients of the largest rows (`dx ≈ rstd·g ≈ 3e-39`, subnormal in
/// f32 and bf16), half the dtype's smallest subnormal — bf16: its smallest normal, 2⁻¹²⁶, since
/// candle's CPU bf16 addition (its gradient accumulation, `0 + dx`) flushes subnormals to zero
/// where the CPU has AVX512-BF16 (`vcvtneps2bf16`, candle-core `cpu/avx.rs`).
#[test]
fn rms_norm_of_huge_and_tiny_rows_matches_f64_candle() {
    let mut rng = Rng::new("rms_norm_range");
    let dev = common::device();
    let (cols, eps) = (16, 1e-6);
    for dtype in DTYPES {
        let (scales, tiny): (&[f64], f64) = match dtype {
            DType::F16 => (&[1.0, 3e4, 1e-5], 2f64.powi(-25)),
            DType::BF16 => (&[1.0, 1e20, 3e38, 1e-30], 2f64.powi(-126)),
            _ => (&[1.0, 1e20, 3e38, 1e-30], 2f64.powi(-150)),
        };
        let rows = scales.len();
        // entries ±(0.5 … 1)·scale: the 3e38 rows stay finite in f32 and bf16
        let xs: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let m = scales[i / cols] * (0.5 + 0.5 * rng.uniform());
                if rng.next_u64() & 1 == 0 {
                    m
                } else {
                    -m
                }
            })
            .collect();
        let stored = if dtype == DType::F64 { DType::F32 } else { dtype };
        let x = Tensor::from_vec(xs, (rows, cols), &candle_core::Device::Cpu).unwrap();
        let x = x.to_dtype(stored).unwrap().to_dtype(dtype).unwrap();
        let w = rng.tensor(&[cols], 1.0, 0.5, dtype);
        let dy = rng.tensor(&[rows, cols], 0.0, 1.0, dtype);
        let op = RmsNorm::new(eps as f32, exact(8));
        let inputs = [x.clone(), w.clone()];
        let (y, g) = grads_on(&dev, &inputs, &dy, |t| op.forward(&t[0], &t[1]));
        let (y_ref, g_ref) = grads(&to_f64(&inputs), &dy, |t| {
            let rstd = (t[0].sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
            t[0].broadcast_mul(&rstd)?.broadcast_mul(&t[1])
        });
        let u = unit(dtype);
        let (xs, ws, dys) = (flat(&x), flat(&w), flat(&dy));
        let (xhat, rstd) = normalized(&xs, cols, eps, false);
        let fwd: Vec<f64> = y_ref.iter().map(|v| u * v.abs() + 16.0 * cols as f64 * U32 * (1.0 + v.abs())).collect();
        assert_within(&format!("rms norm range {dtype:?} y"), &y, &y_ref, &fwd);
        let h = 0.5 * step(&xhat, 8) * (1.0 + 1e-4) + 8.0 * U32 * xhat.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        let nb = norm_bounds(&xhat, &rstd, &ws, &dys, h);
        let with_u =
            |b: &[f64], r: &[f64]| -> Vec<f64> { b.iter().zip(r).map(|(b, r)| b + 2.0 * u * r.abs() + tiny).collect() };
        assert_within(&format!("rms norm range {dtype:?} dx"), &g[0], &g_ref[0], &with_u(&nb.dx, &g_ref[0]));
        assert_within(&format!("rms norm range {dtype:?} dw"), &g[1], &g_ref[1], &with_u(&nb.dw, &g_ref[1]));
    }
}

/// Issue 39: tensors of one call with different dtypes are refused by every op with
/// `Error::DTypeMismatch` naming both tensors and dtypes (LayerNorm and RMSNorm accepted
/// them, the others said "dtype F16 is not supported", f64 with f32 ran).
#[test]
fn mixed_dtypes_are_a_dtype_mismatch_naming_both_tensors() {
    use mesa_candle::{as_mesa_error, Error};
    let cpu = candle_core::Device::Cpu;
    let z = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &cpu).unwrap();
    let (f, hf) = (|d: &[usize]| z(d, DType::F32), |d: &[usize]| z(d, DType::F16));
    let la = LinearAttention::new(LinearAttentionConfig::causal(), FeatureKind::Elu1);
    let (ln, rms, lin) = (LayerNorm::new(1e-5, exact(8)), RmsNorm::new(1e-5, exact(8)), CodedLinear::new(exact(8)));
    let x = f(&[4, 8]);
    let q = f(&[1, 2, 4, 8]);
    let tail = "(one dtype for all the op's tensors)";
    let cases = [
        (ln.forward(&x, &hf(&[8]), &f(&[8])), "layer norm: dtype F16 of weight [C] differs from F32 of input [..., C]"),
        (ln.forward(&x, &f(&[8]), &hf(&[8])), "layer norm: dtype F16 of bias [C] differs from F32 of input [..., C]"),
        (rms.forward(&x, &hf(&[8])), "rms norm: dtype F16 of weight [C] differs from F32 of input [..., C]"),
        (
            rms.forward(&z(&[4, 8], DType::F64), &x.get(0).unwrap()),
            "rms norm: dtype F32 of weight [C] differs from F64 of input [..., C]",
        ),
        (
            lin.forward(&x, &hf(&[3, 8]), None),
            "linear: dtype F16 of weight [out, in] differs from F32 of input [..., in]",
        ),
        (
            lin.forward(&x, &f(&[3, 8]), Some(&hf(&[3]))),
            "linear: dtype F16 of bias [out] differs from F32 of input [..., in]",
        ),
        (
            Softmax::default().forward(&x, Some(&hf(&[8]))),
            "softmax: dtype F16 of mask differs from F32 of input [..., N]",
        ),
        (
            la.forward(&q, &hf(&[1, 2, 4, 8]), &q),
            "linear attention: dtype F16 of keys [B, H, L, d] differs from F32 of queries [B, H, L, d]",
        ),
        (
            la.forward(&q, &q, &hf(&[1, 2, 4, 8])),
            "linear attention: dtype F16 of values [B, H, L, D] differs from F32 of queries [B, H, L, d]",
        ),
    ];
    for (r, want) in cases {
        let e = r.unwrap_err();
        assert!(matches!(as_mesa_error(&e), Some(Error::DTypeMismatch { .. })), "{want}: {e}");
        assert_eq!(e.to_string(), format!("{want} {tail}"));
    }
}

/// Issue 39: shape messages name the real problem: the Linear's input's last dimension (not
/// `[17]` shown as a shape), the empty last axis of a norm's input (not the weight), and
/// `in = 0` as a typed error (it was candle's reshape error).
#[test]
fn shape_messages_name_the_real_problem() {
    use mesa_candle::{as_mesa_error, Error};
    let cpu = candle_core::Device::Cpu;
    let f = |d: &[usize]| Tensor::zeros(d, DType::F32, &cpu).unwrap();
    let lin = CodedLinear::new(exact(8));
    let e = lin.forward(&f(&[2, 3, 16]), &f(&[5, 17]), None).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::Shape { .. })), "{e}");
    assert_eq!(
        e.to_string(),
        "linear input [..., in] (in = 17: weight [out, in] is [5, 17]): expected shape [2, 3, 17], got [2, 3, 16]"
    );
    let e = lin.forward(&f(&[4, 0]), &f(&[3, 0]), None).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { .. })), "{e}");
    assert_eq!(e.to_string(), "linear weight [out, in]: in must be ≥ 1, got in = 0 (weight [3, 0], input [4, 0])");
    let e = RmsNorm::new(1e-5, exact(8)).forward(&f(&[4, 0]), &f(&[0])).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { .. })), "{e}");
    assert_eq!(e.to_string(), "rms norm input [..., C]: C must be ≥ 1, got the empty last axis of shape [4, 0]");
    let e = LayerNorm::new(1e-5, exact(8)).forward(&f(&[4, 0]), &f(&[0]), &f(&[0])).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { .. })), "{e}");
    assert_eq!(e.to_string(), "layer norm input [..., C]: C must be ≥ 1, got the empty last axis of shape [4, 0]");
}
