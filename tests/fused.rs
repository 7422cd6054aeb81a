//! Parity of the fused GELU, SwiGLU, softmax and LayerNorm kernels (forward with codes, backward from
//! codes, plain variants) with the f64 reference (`mesa_kernels::reference::fused`), on every
//! backend, dtype and bit width, plus the bug classes of the issue.
//!
//! Tolerances (derived, not tuned). ε = 2⁻²⁴ (f32 unit roundoff), u_T = the output type's
//! unit roundoff (2⁻²⁴, 2⁻¹¹, 2⁻⁸):
//! * GELU forward: the erf form's erfc (exp2 and reciprocal approximations, a polynomial:
//!   `gelu_tail_tol`) and expf within a few ulp, a handful of f32 roundings of
//!   terms of size ≤ |x|: |y − ref| ≤ u_T·|ref| + 16ε·(|ref| + |x|).
//! * SwiGLU: σ from expf (≤ 2 ulp) and a Newton reciprocal (≤ 2ε), σ's relative error at most
//!   the exponential's, then three products: |y − ref| ≤ u_T·|ref| + 16ε·|ref|; silu' =
//!   σ·(1 + g·σ(−g)) cancels near its root g ≈ −1.28, so dg is bounded absolutely,
//!   16ε·|dy·u|·(1 + |g|).
//! * softmax forward: f32 sums of N terms in a per-thread sequence of N/32 then a 5-level tree
//!   (relative error ≤ (N/32 + 16)ε), exp of an argument with relative error ε·|v − m|:
//!   |y − ref| ≤ (u_T + (N/32 + 16 + 2·|v − m|)ε)·ref + tiny.
//! * LayerNorm: mean and variance are f32 sums like softmax's, so δmean ≤ E·max|x| with
//!   E = (C/32 + 32)ε, δx̂ ≤ E·(max|x|·rstd + |x̂|); y = x̂·w + b adds u_T·|y|.
//! * codes: decoding a code gives the saved value within half a quantization step (exact
//!   statistics, round to nearest) plus the slack of the value itself (above).
//! * backward from codes: the reference runs on the *decoded* values (f64), so kernel and
//!   reference differ only by f32 rounding of the backward formula; in addition each test
//!   bounds the difference to the backward on exact values by the derivative of the formula
//!   times half a step (e.g. GELU: |dy|·max|gelu''|·scale/2 with max|gelu''| ≤ 0.8).
mod common;

use half::{bf16, f16};
use mesa_kernels::fused::{
    self, gelu, gelu_backward, gelu_backward_plain, gelu_forward, layer_norm, layer_norm_backward,
    layer_norm_backward_plain, layer_norm_forward, softmax, softmax_backward, softmax_backward_plain, softmax_forward,
    swiglu, swiglu_backward, swiglu_backward_plain, swiglu_forward, GeluBackwardPlain, LayerNormBackward,
    LayerNormBackwardPlain, LayerNormForward, LayerNormGrads, SoftmaxBackwardPlain, SoftmaxInput, SwigluGrads,
    SwigluInput, SwigluQuantizers,
};
use mesa_kernels::reference::{self, fused as rf, quant as rq};
use mesa_kernels::{
    Buffer, Companding, DType, Device, DeviceMemory, DeviceMemoryMut, Element, Error, GeluForm, Grouping, Layout,
    QuantConfig, Quantizer, RawDeviceSlice, Rounding, SavedActivation, SoftmaxCodes, SoftmaxSave, StatsMode, Storage,
    TensorMut, TensorRef,
};
use rand::rngs::StdRng;
use rand::RngExt;

const EPS: f64 = 1.0 / 16_777_216.0;

/// Smallest normal of the type: values below it round with an absolute error.
fn tiny(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-37,
        DType::F16 => 2f64.powi(-24),
        DType::BF16 => 1e-37,
    }
}

fn random<T: Element>(rng: &mut StdRng, n: usize, center: f64, spread: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(center + spread * (rng.random::<f64>() * 2.0 - 1.0))).collect()
}

/// `mem` viewed through `l` (an input).
fn tref<'a, T>(mem: &'a (impl DeviceMemory<T> + ?Sized), l: &Layout) -> TensorRef<'a, T> {
    TensorRef::new(mem, l).expect("input view")
}

/// `mem` viewed through `l` (an output).
fn tmut<'a, T>(mem: &'a mut (impl DeviceMemoryMut<T> + ?Sized), l: &Layout) -> TensorMut<'a, T> {
    TensorMut::new(mem, l).expect("output view")
}

/// A whole buffer as a vector (LayerNorm parameters, rstd).
fn vref<T: Storage>(b: &Buffer<T>) -> TensorRef<'_, T> {
    TensorRef::contiguous(b, &[b.len()]).expect("vector view")
}

/// A whole buffer as an output vector (dweight, dbias).
fn vmut<T: Storage>(b: &mut Buffer<T>) -> TensorMut<'_, T> {
    let n = b.len();
    TensorMut::contiguous(b, &[n]).expect("vector view")
}

fn poisoned<T: Element>(device: &Device, n: usize) -> mesa_kernels::Buffer<T> {
    device.upload(&vec![T::from_f64(f64::NAN); n]).expect("upload")
}

fn host<T: Element>(b: &mesa_kernels::Buffer<T>) -> Vec<f64> {
    b.to_vec().expect("download").iter().map(|v| v.to_f64()).collect()
}

/// Decodes a saved activation on the host (f64): code · scale + offset per group.
fn decode_host(saved: &SavedActivation) -> Vec<f64> {
    let n = saved.numel();
    let codes = rq::unpack_codes(&saved.codes().to_vec().expect("codes"), n, saved.bits());
    let params = saved.params().expect("params");
    let groups = rq::group_index(saved.shape(), &saved.grouping()).expect("groups");
    let sqrt = saved.companding() == Companding::Sqrt;
    (0..n)
        .map(|i| {
            let (o, s) = (f64::from(params[groups[i]].offset), f64::from(params[groups[i]].scale));
            if sqrt {
                rf::sqrt_decode(codes[i], o, s)
            } else {
                rq::decode(codes[i], o, s)
            }
        })
        .collect()
}

fn max_scale(saved: &SavedActivation) -> f64 {
    saved.params().expect("params").iter().map(|p| f64::from(p.scale)).fold(0.0, f64::max)
}

/// A producer's saved codes and parameters are bit for bit those of `Quantizer::quantize`
/// (a twin quantizer with the same history) on the tensor it saves: the same first pass, the
/// same groups widened when the batch escapes the running estimate, the same second launch.
/// Returns the twin's count of widened groups.
fn same_as_quantizer<T: Element>(twin: &mut Quantizer, saved: &SavedActivation, v: &Buffer<T>) -> u32 {
    let l = Layout::contiguous(saved.shape());
    let want = twin.quantize(&TensorRef::new(v, &l).expect("view")).expect("twin quantize");
    assert_eq!(saved.codes().to_vec().expect("c"), want.codes().to_vec().expect("c"), "codes vs Quantizer::quantize");
    assert_eq!(saved.params().expect("p"), want.params().expect("p"), "params vs Quantizer::quantize");
    twin.widened_groups().expect("count").unwrap_or(0)
}

fn dtypes() -> [DType; 3] {
    [DType::F32, DType::F16, DType::BF16]
}

macro_rules! with_dtype {
    ($dtype:expr, $T:ident, $body:block) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
        }
    };
}

// ---------------------------------------------------------------------------------------
// GELU

/// GELU forward with codes + backward from codes against the reference; returns the saved handle.
#[allow(clippy::too_many_arguments)]
fn check_gelu<T: Element>(
    device: &Device,
    q: &mut Quantizer,
    form: GeluForm,
    x: &[T],
    x_layout: &Layout,
    dy: &[T],
    exact_stats: bool,
) -> SavedActivation {
    let shape = x_layout.shape().to_vec();
    let n: usize = shape.iter().product();
    let u = common::unit_roundoff(T::DTYPE);
    let xb = device.upload(x).expect("up");
    let mut y = poisoned::<T>(device, n);
    let dense = Layout::contiguous(&shape);
    let saved = gelu_forward(device, q, form, &tref(&xb, x_layout), &mut tmut(&mut y, &dense)).expect("gelu_forward");
    let xs = reference::gather(x, x_layout);
    for (i, (yv, xv)) in host(&y).iter().zip(&xs).enumerate() {
        let r = rf::gelu(*xv, form);
        let tol = u * r.abs() + 16.0 * EPS * (r.abs() + xv.abs()) + tiny(T::DTYPE);
        assert!((yv - r).abs() <= tol, "gelu y[{i}] = {yv}, reference {r} (x = {xv}, tol {tol})");
    }
    // codes of x: within half a step with exact statistics
    let dec = decode_host(&saved);
    if exact_stats {
        let params = saved.params().expect("p");
        let groups = rq::group_index(&shape, &saved.grouping()).expect("g");
        for i in 0..n {
            let s = f64::from(params[groups[i]].scale);
            assert!(
                (dec[i] - xs[i]).abs() <= 0.5 * s + 4.0 * EPS * (xs[i].abs() + s * 255.0),
                "gelu code {i}: decoded {} vs x {} (step {s})",
                dec[i],
                xs[i]
            );
        }
    }
    // backward from codes vs reference on the decoded values, and vs exact x
    let dyb = device.upload(dy).expect("up");
    let mut dx = poisoned::<T>(device, n);
    gelu_backward(device, form, &saved, &tref(&dyb, &dense), &mut tmut(&mut dx, &dense)).expect("gelu_backward");
    let dys = reference::gather(dy, &dense);
    let step = max_scale(&saved);
    for (i, d) in host(&dx).iter().enumerate() {
        let r = dys[i] * rf::gelu_derivative(dec[i], form);
        let tol = u * r.abs() + 32.0 * EPS * dys[i].abs() * (1.0 + dec[i].abs()) + tiny(T::DTYPE);
        assert!((d - r).abs() <= tol, "gelu dx[{i}] = {d}, reference {r} (x^ = {}, tol {tol})", dec[i]);
        if exact_stats {
            let exact = dys[i] * rf::gelu_derivative(xs[i], form);
            let qtol = dys[i].abs() * 0.8 * 0.5 * step * 1.01 + tol + u * exact.abs();
            assert!((d - exact).abs() <= qtol, "gelu dx[{i}] = {d} vs exact-x backward {exact} (tol {qtol})");
        }
    }
    saved
}

#[test]
fn gelu_parity_every_dtype_form_and_width() {
    let mut rng = common::rng("gelu_parity");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for form in [GeluForm::Erf, GeluForm::Tanh] {
                    for bits in [8, 4, 2] {
                        for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 7 }] {
                            // [B, N, 4C] with 12 channel groups; odd length tail
                            let shape = [2, 13, 96];
                            let n = 2 * 13 * 96;
                            let config = QuantConfig { bits, rounding, ..fused::channel_groups(2, 12) };
                            let mut q = Quantizer::new(&device, config).expect("q");
                            for batch in 0..2 {
                                let x: Vec<T> = random(&mut rng, n, 0.3, 6.0);
                                let dy: Vec<T> = random(&mut rng, n, 0.0, 1.0);
                                let exact = batch == 0 && rounding == Rounding::Nearest;
                                check_gelu(&device, &mut q, form, &x, &Layout::contiguous(&shape), &dy, exact);
                            }
                            // odd total size and a tensor of 1 group
                            let mut q1 =
                                Quantizer::new(&device, QuantConfig { bits, ..QuantConfig::per_tensor() }).expect("q");
                            let x: Vec<T> = random(&mut rng, 77, -1.0, 4.0);
                            let dy: Vec<T> = random(&mut rng, 77, 0.0, 2.0);
                            check_gelu(&device, &mut q1, form, &x, &Layout::contiguous(&[7, 11]), &dy, true);
                        }
                    }
                }
            });
        }
    }
}

#[test]
fn gelu_exact_mode_running_mode_and_strided_views() {
    let mut rng = common::rng("gelu_modes");
    for device in common::backends() {
        // running estimate: batch k > 0 is quantized with the estimate before it; batch 2
        // escapes it (x 40, groups widened by the second launch), batch 3 stays inside it
        let config = fused::channel_groups(1, 4);
        let mut q = Quantizer::new(&device, config).expect("q");
        let mut twin = Quantizer::new(&device, config).expect("q");
        for batch in 0..4 {
            let spread = [3.0, 3.0, 120.0, 0.5][batch];
            let x: Vec<f32> = random(&mut rng, 5 * 64, 0.1 * batch as f64, spread);
            let dy: Vec<f32> = random(&mut rng, 5 * 64, 0.0, 1.0);
            let saved = check_gelu(&device, &mut q, GeluForm::Erf, &x, &Layout::contiguous(&[5, 64]), &dy, batch == 0);
            let widened = same_as_quantizer(&mut twin, &saved, &device.upload(&x).expect("up"));
            if batch == 2 {
                assert_eq!(widened, 4, "batch 2 escapes the estimate in every group");
            }
            if batch == 3 {
                assert_eq!(widened, 0, "batch 3 lies inside the estimate");
            }
            // every element within one step of its group's saved scale (tests/quantize.rs)
            let (dec, p) = (decode_host(&saved), saved.params().expect("p"));
            for (i, (d, xv)) in dec.iter().zip(&x).enumerate() {
                let s = f64::from(p[(i % 64) / 16].scale);
                let tol = s + 4.0 * EPS * (f64::from(*xv).abs() + s * 255.0);
                assert!((d - f64::from(*xv)).abs() <= tol, "batch {batch} element {i}: {d} vs {xv} (step {s})");
            }
        }
        // exact mode every batch
        let mut qe = Quantizer::new(&device, QuantConfig { stats: StatsMode::Exact, ..config }).expect("q");
        for _ in 0..2 {
            let x: Vec<bf16> = random(&mut rng, 5 * 64, 0.0, 5.0);
            let dy: Vec<bf16> = random(&mut rng, 5 * 64, 0.0, 1.0);
            check_gelu(&device, &mut qe, GeluForm::Tanh, &x, &Layout::contiguous(&[5, 64]), &dy, true);
        }
        // transposed input view (codes in logical order of the view)
        let storage: Vec<f16> = random(&mut rng, 24 * 10, 0.0, 3.0);
        let view = Layout::contiguous(&[24, 10]).transpose(0, 1).expect("t");
        let mut qt = Quantizer::new(&device, QuantConfig::per_head(0)).expect("q");
        let dy: Vec<f16> = random(&mut rng, 240, 0.0, 1.0);
        check_gelu(&device, &mut qt, GeluForm::Erf, &storage, &view, &dy, true);
    }
}

#[test]
fn gelu_plain_forward_and_backward_match_the_fused_ones() {
    let mut rng = common::rng("gelu_plain");
    for device in common::backends() {
        let shape = [3, 40];
        let l = Layout::contiguous(&shape);
        let x: Vec<bf16> = random(&mut rng, 120, 0.0, 4.0);
        let xb = device.upload(&x).expect("up");
        let mut y1 = poisoned::<bf16>(&device, 120);
        let mut y2 = poisoned::<bf16>(&device, 120);
        gelu(&device, GeluForm::Erf, &tref(&xb, &l), &mut tmut(&mut y1, &l)).expect("gelu");
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        let _saved = gelu_forward(&device, &mut q, GeluForm::Erf, &tref(&xb, &l), &mut tmut(&mut y2, &l)).expect("fwd");
        assert_eq!(y1.to_vec().expect("y"), y2.to_vec().expect("y"), "saving must not change the output");
        let dy: Vec<bf16> = random(&mut rng, 120, 0.0, 1.0);
        let dyb = device.upload(&dy).expect("up");
        let mut dx = poisoned::<bf16>(&device, 120);
        gelu_backward_plain(
            &device,
            &GeluBackwardPlain { form: GeluForm::Erf, x: &tref(&xb, &l), dy: &tref(&dyb, &l) },
            &mut tmut(&mut dx, &l),
        )
        .expect("bwd");
        let xs = reference::gather(&x, &l);
        for (i, d) in host(&dx).iter().enumerate() {
            let r = dy[i].to_f64() * rf::gelu_derivative(xs[i], GeluForm::Erf);
            let tol = 2f64.powi(-8) * r.abs() + 32.0 * EPS * dy[i].to_f64().abs() * (1.0 + xs[i].abs()) + 1e-37;
            assert!((d - r).abs() <= tol, "plain dx[{i}] = {d}, reference {r}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// softmax

/// Softmax forward with codes + backward from codes against the reference.
#[allow(clippy::too_many_arguments)]
fn check_softmax<T: Element>(
    device: &Device,
    save: &SoftmaxSave,
    x: &[T],
    x_layout: &Layout,
    mask: Option<(&[T], &Layout)>,
    dy: &[T],
) -> SavedActivation {
    let shape = x_layout.shape().to_vec();
    let n: usize = shape.iter().product();
    let cols = *shape.last().expect("rank");
    let u = common::unit_roundoff(T::DTYPE);
    let xb = device.upload(x).expect("up");
    let mb = mask.map(|(m, _)| device.upload(m).expect("up"));
    let dense = Layout::contiguous(&shape);
    let mut y = poisoned::<T>(device, n);
    let mask_view = match (&mb, mask) {
        (Some(b), Some((_, l))) => Some(tref(b, l)),
        _ => None,
    };
    let input = SoftmaxInput { x: &tref(&xb, x_layout), mask: mask_view.as_ref() };
    let saved = softmax_forward(device, save, &input, &mut tmut(&mut y, &dense)).expect("softmax_forward");
    let xs = reference::gather(x, x_layout);
    let ms = mask.map(|(m, l)| reference::gather(m, l));
    let r = rf::softmax_rows(&xs, ms.as_deref(), cols);
    let yh = host(&y);
    for row in 0..n / cols.max(1) {
        let v: Vec<f64> =
            (0..cols).map(|c| xs[row * cols + c] + ms.as_ref().map_or(0.0, |m| m[row * cols + c])).collect();
        let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for (c, vc) in v.iter().enumerate() {
            let i = row * cols + c;
            let spread = if vc.is_finite() { (vc - m).abs() } else { 0.0 };
            let tol = (u + (cols as f64 / 32.0 + 16.0 + 2.0 * spread) * EPS) * r[i] + tiny(T::DTYPE);
            assert!(yh[i].is_finite(), "softmax y[{i}] not finite: {}", yh[i]);
            assert!((yh[i] - r[i]).abs() <= tol, "softmax y[{i}] = {}, reference {} (tol {tol})", yh[i], r[i]);
        }
    }
    // codes of the stored y with the fixed parameters: code == round(y / scale), or
    // round(√y / scale) for companded codes
    assert_eq!(saved.companding(), save.codes.companding());
    let sqrt = save.codes == SoftmaxCodes::Sqrt;
    let levels = rq::levels(save.bits);
    for p in saved.params().expect("p") {
        assert_eq!(p.offset, 0.0);
        assert_eq!(p.scale, (1.0 / levels) as f32, "fixed scale 1/(2^bits - 1)");
    }
    let codes = rq::unpack_codes(&saved.codes().to_vec().expect("c"), n, save.bits);
    let scale = f64::from((1.0 / levels) as f32);
    for i in 0..n {
        let t = if sqrt { yh[i].max(0.0).sqrt() / scale } else { yh[i] / scale };
        let expect = match (save.rounding, sqrt) {
            (Rounding::Nearest, false) => rq::encode_nearest(yh[i], 0.0, scale, save.bits),
            (Rounding::Nearest, true) => rf::sqrt_code_nearest(yh[i], scale, save.bits),
            (Rounding::Stochastic { seed }, false) => {
                rq::encode_stochastic(yh[i], 0.0, scale, save.bits, rq::rounding_uniform(seed, i as u64))
            }
            (Rounding::Stochastic { seed }, true) => {
                rf::sqrt_code_stochastic(yh[i], scale, save.bits, rq::rounding_uniform(seed, i as u64))
            }
        };
        if codes[i] != expect {
            let frac = match save.rounding {
                Rounding::Nearest => ((t - t.floor()) - 0.5).abs(),
                // the rule's boundary: t + u at an integer, within the 2^-16 grid of t'
                Rounding::Stochastic { seed } => {
                    let s = t + rq::rounding_uniform(seed, i as u64);
                    ((s - s.round()).abs() - 1.0 / rq::ROUNDING_ONE).max(0.0)
                }
            };
            assert!(
                frac <= 8.0 * EPS * t.abs().max(1.0) && codes[i].abs_diff(expect) == 1,
                "softmax code {i}: {} vs {expect} (y = {}, t = {t})",
                codes[i],
                yh[i]
            );
        }
    }
    // backward from codes
    let dec = decode_host(&saved);
    let dyb = device.upload(dy).expect("up");
    let mut dx = poisoned::<T>(device, n);
    softmax_backward(device, &saved, &tref(&dyb, &dense), &mut tmut(&mut dx, &dense)).expect("softmax_backward");
    let dys = reference::gather(dy, &dense);
    let rdx = rf::softmax_backward_rows(&dec, &dys, cols);
    let exact = rf::softmax_backward_rows(&r, &dys, cols);
    let dxh = host(&dx);
    // δ_i ≥ |ŷ_i − r_i|: the code error of the stored y (half a step at nearest, a step
    // stochastic; companded: rf::sqrt_code_error_bound at the larger of r_i, ŷ_i, ×1.01 for
    // the f32 scale and the stored y ≠ r) + the stored y's dtype rounding u·r_i
    let stochastic = matches!(save.rounding, Rounding::Stochastic { .. });
    let delta: Vec<f64> = (0..n)
        .map(|i| {
            let code_err = if sqrt {
                rf::sqrt_code_error_bound(r[i].max(dec[i]), scale, stochastic)
            } else if stochastic {
                scale
            } else {
                0.5 * scale
            };
            1.01 * code_err + u * r[i]
        })
        .collect();
    for row in 0..n / cols.max(1) {
        let range = row * cols..(row + 1) * cols;
        let sum_abs: f64 = range.clone().map(|i| (dys[i] * dec[i]).abs()).sum();
        let dy_delta: f64 = range.clone().map(|i| dys[i].abs() * delta[i]).sum();
        let dot: f64 = range.clone().map(|i| dys[i] * r[i]).sum();
        for i in range {
            let tol = u * rdx[i].abs()
                + (cols as f64 / 32.0 + 16.0) * EPS * dec[i].abs() * (sum_abs + dys[i].abs())
                + tiny(T::DTYPE);
            assert!((dxh[i] - rdx[i]).abs() <= tol, "softmax dx[{i}] = {}, reference {} (tol {tol})", dxh[i], rdx[i]);
            // vs the backward on exact probabilities: dx̂ − dx = (ŷ_i − y_i)(dy_i − dot)
            // − ŷ_i Σ_k dy_k (ŷ_k − y_k), so |·| ≤ δ_i |dy_i − dot| + |ŷ_i| Σ_k |dy_k| δ_k
            let qtol =
                delta[i] * (dys[i] - dot).abs() + r[i].abs().max(dec[i].abs()) * dy_delta + tol + u * exact[i].abs();
            assert!(
                (dxh[i] - exact[i]).abs() <= qtol,
                "softmax dx[{i}] = {} vs exact-y {} (tol {qtol})",
                dxh[i],
                exact[i]
            );
        }
    }
    saved
}

#[test]
fn softmax_parity_every_dtype_width_and_row_length_class() {
    let mut rng = common::rng("softmax_parity");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for bits in [8, 4, 2] {
                    // warp-per-row (1, 2, 4 chunks), block-per-row cached, odd lengths
                    for cols in [1usize, 8, 37, 200, 300, 1000, 2500] {
                        let rows = if cols > 1000 { 3 } else { 9 };
                        let shape = [rows, cols];
                        let n = rows * cols;
                        let x: Vec<T> = random(&mut rng, n, 0.0, 4.0);
                        let dy: Vec<T> = random(&mut rng, n, 0.0, 1.0);
                        let save = SoftmaxSave {
                            bits,
                            codes: SoftmaxCodes::Sqrt,
                            grouping: Grouping::Tensor,
                            rounding: Rounding::Nearest,
                        };
                        check_softmax(&device, &save, &x, &Layout::contiguous(&shape), None, &dy);
                    }
                }
            });
        }
    }
}

#[test]
fn softmax_head_grouping_mask_and_stochastic_rounding() {
    let mut rng = common::rng("softmax_mask");
    for device in common::backends() {
        // [B, H, N, N] with a key-padding mask [B, 1, 1, N] broadcast by strides 0
        let (b, h, nq) = (2, 3, 24);
        let shape = [b, h, nq, nq];
        let n = b * h * nq * nq;
        let mut mask_data = vec![0f32; b * nq];
        for k in 20..nq {
            mask_data[nq + k] = f32::NEG_INFINITY; // batch 1: the last 4 keys are padding
        }
        let mask_layout = Layout::strided(&shape, &[nq, 0, 0, 1], 0).expect("mask");
        let x: Vec<f32> = random(&mut rng, n, 0.0, 6.0);
        let dy: Vec<f32> = random(&mut rng, n, 0.0, 1.0);
        for (rounding, codes) in [
            (Rounding::Nearest, SoftmaxCodes::Sqrt),
            (Rounding::Stochastic { seed: 99 }, SoftmaxCodes::Sqrt),
            (Rounding::Nearest, SoftmaxCodes::Linear),
            (Rounding::Stochastic { seed: 7 }, SoftmaxCodes::Linear),
        ] {
            for bits in [8, 4, 2] {
                let save = SoftmaxSave { bits, codes, grouping: Grouping::Heads { axis: 1 }, rounding };
                let saved = check_softmax(
                    &device,
                    &save,
                    &x,
                    &Layout::contiguous(&shape),
                    Some((&mask_data, &mask_layout)),
                    &dy,
                );
                assert_eq!(saved.num_groups(), h, "head-wise grouping metadata kept");
                let p = decode_host(&saved);
                for q in 0..nq {
                    for k in 20..nq {
                        assert_eq!(p[((h + 1) * nq + q) * nq + k], 0.0, "masked key must get probability 0");
                    }
                }
            }
        }
    }
}

/// The dense softmax kernel (rows dense and 16-byte aligned, N % 8 == 0, N ≤ 1024, codes into
/// the call's fixed parameters) gives what the general kernel gives, bit for bit: outputs,
/// codes, parameters and the NaN count. The same data through a row-padded view (not dense:
/// the general kernel) must agree exactly. Rows: random, fully masked, half masked, one NaN
/// logit and one +inf logit (NaN rows, which poison their group: one group per row here, so
/// no row's codes depend on another's).
#[test]
fn softmax_dense_kernel_equals_the_general_kernel_bitwise() {
    let mut rng = common::rng("softmax_dense_kernel_equals_the_general_kernel_bitwise");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for cols in [8usize, 256, 264, 1024] {
                    let rows = 6;
                    let n = rows * cols;
                    let mut x: Vec<T> = random(&mut rng, n, 0.0, 6.0);
                    let mut mask = vec![T::from_f64(0.0); n];
                    for c in 0..cols {
                        mask[c] = T::from_f64(f64::NEG_INFINITY); // row 0: fully masked
                        if c % 2 == 0 {
                            mask[3 * cols + c] = T::from_f64(f64::NEG_INFINITY);
                            // row 3: half masked
                        }
                    }
                    x[2 * cols + cols / 2] = T::from_f64(f64::NAN); // row 2: a NaN row
                    x[4 * cols + 1] = T::from_f64(f64::INFINITY); // row 4: +inf makes a NaN row
                    let pitch = cols + 8;
                    let mut xp = vec![T::from_f64(0.0); rows * pitch];
                    for r in 0..rows {
                        xp[r * pitch..r * pitch + cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
                    }
                    let dense = Layout::contiguous(&[rows, cols]);
                    let padded = Layout::strided(&[rows, cols], &[pitch, 1], 0).expect("padded view");
                    let (xb, xpb, mb) = (
                        device.upload(&x).expect("up"),
                        device.upload(&xp).expect("up"),
                        device.upload(&mask).expect("up"),
                    );
                    for with_mask in [false, true] {
                        for bits in [8, 4, 2] {
                            for codes in [SoftmaxCodes::Sqrt, SoftmaxCodes::Linear] {
                                let save = SoftmaxSave {
                                    bits,
                                    codes,
                                    grouping: Grouping::Heads { axis: 0 },
                                    rounding: Rounding::Nearest,
                                };
                                let run = |xv: TensorRef<'_, T>| {
                                    let mv = tref(&mb, &dense);
                                    let input = SoftmaxInput { x: &xv, mask: with_mask.then_some(&mv) };
                                    let mut y = poisoned::<T>(&device, n);
                                    let saved = softmax_forward(&device, &save, &input, &mut tmut(&mut y, &dense))
                                        .expect("softmax_forward");
                                    // NaN payloads and signs are not compared: IEEE leaves them open, the
                                    // GPU makes every NaN canonical, the host keeps an operand's
                                    let bits_of: Vec<u64> = host(&y)
                                        .iter()
                                        .map(|v| if v.is_nan() { f64::NAN.to_bits() } else { v.to_bits() })
                                        .collect();
                                    let params: Vec<(u32, u32)> = saved
                                        .params()
                                        .expect("params")
                                        .iter()
                                        .map(|p| (p.offset.to_bits(), p.scale.to_bits()))
                                        .collect();
                                    (
                                        bits_of,
                                        saved.codes().to_vec().expect("codes"),
                                        params,
                                        saved.nonfinite_count().expect("count"),
                                    )
                                };
                                let (fast, general) = (run(tref(&xb, &dense)), run(tref(&xpb, &padded)));
                                let what = format!("{dtype:?} {cols} cols, mask {with_mask}, {bits} bits, {codes:?}");
                                assert_eq!(fast.0, general.0, "y differs: {what}");
                                assert_eq!(fast.1, general.1, "codes differ: {what}");
                                assert_eq!(fast.2, general.2, "parameters differ: {what}");
                                assert_eq!(fast.3, general.3, "NaN count differs: {what}");
                                assert_eq!(fast.3 as usize, 2 * cols, "two NaN rows counted: {what}");
                            }
                        }
                    }
                }
            });
        }
    }
}

#[test]
fn softmax_fully_masked_rows_and_rows_of_equal_values() {
    for device in common::backends() {
        let cols = 40;
        let rows = 4;
        let mut x = vec![0f32; rows * cols];
        let mut mask = vec![0f32; rows * cols];
        for c in 0..cols {
            mask[c] = f32::NEG_INFINITY; // row 0: fully masked by the mask
            x[cols + c] = f32::NEG_INFINITY; // row 1: fully -inf logits
            x[2 * cols + c] = 3.25; // row 2: equal values
            x[3 * cols + c] = c as f32; // row 3: ordinary
        }
        let l = Layout::contiguous(&[rows, cols]);
        let dy = vec![1f32; rows * cols];
        for bits in [8, 4, 2] {
            for codes in [SoftmaxCodes::Sqrt, SoftmaxCodes::Linear] {
                let save = SoftmaxSave { bits, codes, grouping: Grouping::Tensor, rounding: Rounding::Nearest };
                let saved = check_softmax(&device, &save, &x, &l, Some((&mask, &l)), &dy);
                assert_eq!(saved.nonfinite_count().expect("nf"), 0);
                // fully masked rows decode to exactly 0 (no NaN) through the generic decoder
                let mut p = poisoned::<f32>(&device, rows * cols);
                saved.dequantize(&device, &mut TensorMut::new(&mut p, &l).expect("view")).expect("decode");
                let p = host(&p);
                assert!(p[..2 * cols].iter().all(|&v| v == 0.0), "fully masked rows decode to 0 ({codes:?})");
                assert!(p.iter().all(|v| v.is_finite()));
            }
        }
        // the plain kernel: zeros for fully masked rows, exactly 1/N for equal values
        let xb = device.upload(&x).expect("up");
        let mb = device.upload(&mask).expect("up");
        let mut y = poisoned::<f32>(&device, rows * cols);
        softmax(&device, &SoftmaxInput { x: &tref(&xb, &l), mask: Some(&tref(&mb, &l)) }, &mut tmut(&mut y, &l))
            .expect("softmax");
        let y = y.to_vec().expect("y");
        assert!(y[..2 * cols].iter().all(|&v| v == 0.0), "fully masked rows give 0, no NaN");
        assert!(y[2 * cols..3 * cols].iter().all(|&v| (f64::from(v) - 1.0 / cols as f64).abs() <= 4.0 * EPS));
    }
}

#[test]
fn softmax_companded_codes_decode_like_the_reference_in_every_dtype_and_width() {
    // Encoding parity (codes == rf::sqrt_code_*) is checked by check_softmax; here the
    // decoders: SavedActivation::dequantize into f32/f16/bf16 gives exactly the f32 value
    // q·q, q = code·scale (one f32 product each: fmaf(c, s, 0) rounds once), then the dtype's
    // rounding; the f64 reference (c·s)² agrees within 3 f32 roundings.
    let mut rng = common::rng("softmax_sqrt_decode");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for bits in [8, 4, 2] {
                    let shape = [3, 2, 40];
                    let n: usize = shape.iter().product();
                    let l = Layout::contiguous(&shape);
                    let x: Vec<T> = random(&mut rng, n, 0.0, 5.0);
                    let xb = device.upload(&x).expect("up");
                    let mut y = poisoned::<T>(&device, n);
                    let save = SoftmaxSave { bits, ..SoftmaxSave::per_head(1) };
                    let saved = softmax_forward(
                        &device,
                        &save,
                        &SoftmaxInput { x: &tref(&xb, &l), mask: None },
                        &mut tmut(&mut y, &l),
                    )
                    .expect("fwd");
                    assert_eq!(saved.companding(), Companding::Sqrt, "companded codes are the default");
                    assert_eq!(saved.size_in_bytes(), n * bits as usize / 8 + 8 * 2 + 4, "bytes unchanged");
                    let codes = rq::unpack_codes(&saved.codes().to_vec().expect("c"), n, bits);
                    let scale = (1.0 / rq::levels(bits)) as f32;
                    let mut out = poisoned::<T>(&device, n);
                    saved.dequantize(&device, &mut TensorMut::new(&mut out, &l).expect("view")).expect("decode");
                    let out = host(&out);
                    let yh = host(&y);
                    for i in 0..n {
                        let q = codes[i] as f32 * scale;
                        let exact_f32 = f64::from(T::from_f64(f64::from(q * q)).to_f64() as f32);
                        assert_eq!(out[i], exact_f32, "decode {i} (code {}, {bits} bits)", codes[i]);
                        let r = rf::sqrt_decode(codes[i], 0.0, f64::from(scale));
                        let dt = common::unit_roundoff(T::DTYPE);
                        assert!((out[i] - r).abs() <= (3.0 * EPS + dt) * r, "decode {i}: {} vs {r}", out[i]);
                        // and the decoded value is within the derived bound of the stored y
                        let bound = rf::sqrt_code_error_bound(yh[i], f64::from(scale), false);
                        assert!((out[i] - yh[i]).abs() <= 1.01 * bound + dt * yh[i], "error bound at {i}");
                    }
                }
            });
        }
    }
}

#[test]
fn softmax_backward_decodes_exactly_what_dequantize_gives() {
    // dy = e_j (1 at the row's argmax j, 0 elsewhere): the kernel's dot is exactly ŷ_j
    // (fmaf(0, ŷ, d) = d), so dx_i = ŷ_i · (dy_i − ŷ_j) is one f32 product of decoded values:
    // it must equal that product computed from SavedActivation::dequantize's ŷ, bit for bit.
    let mut rng = common::rng("softmax_shared_decode");
    for device in common::backends() {
        for codes in [SoftmaxCodes::Sqrt, SoftmaxCodes::Linear] {
            for bits in [8, 4, 2] {
                let (rows, cols) = (6, 48);
                let l = Layout::contiguous(&[rows, cols]);
                let mut x: Vec<f32> = random(&mut rng, rows * cols, 0.0, 4.0);
                for r in 0..rows {
                    x[r * cols + (7 * r) % cols] = 6.0; // a peak: its probability decodes > 0 at 2 bits
                }
                let xb = device.upload(&x).expect("up");
                let mut y = poisoned::<f32>(&device, rows * cols);
                let save = SoftmaxSave { bits, codes, grouping: Grouping::Tensor, rounding: Rounding::Nearest };
                let saved = softmax_forward(
                    &device,
                    &save,
                    &SoftmaxInput { x: &tref(&xb, &l), mask: None },
                    &mut tmut(&mut y, &l),
                )
                .expect("fwd");
                let mut p = poisoned::<f32>(&device, rows * cols);
                saved.dequantize(&device, &mut TensorMut::new(&mut p, &l).expect("view")).expect("decode");
                let p: Vec<f32> = host(&p).iter().map(|&v| v as f32).collect();
                let mut dy = vec![0f32; rows * cols];
                let mut arg = vec![0usize; rows];
                for r in 0..rows {
                    let row = &x[r * cols..(r + 1) * cols];
                    arg[r] = (0..cols).fold(0, |b, c| if row[c] > row[b] { c } else { b });
                    dy[r * cols + arg[r]] = 1.0;
                }
                let dyb = device.upload(&dy).expect("up");
                let mut dx = poisoned::<f32>(&device, rows * cols);
                softmax_backward(&device, &saved, &tref(&dyb, &l), &mut tmut(&mut dx, &l)).expect("bwd");
                let dx = dx.to_vec().expect("dx");
                for r in 0..rows {
                    let pj = p[r * cols + arg[r]];
                    assert!(pj > 0.0, "the argmax decodes to a positive probability");
                    for c in 0..cols {
                        let i = r * cols + c;
                        let expect = p[i] * (dy[i] - pj);
                        assert_eq!(dx[i].to_bits(), expect.to_bits(), "{codes:?} {bits} bits: dx[{i}]");
                    }
                }
            }
        }
    }
}

#[test]
fn softmax_very_long_rows() {
    let mut rng = common::rng("softmax_long");
    for device in common::backends() {
        for (cols, bits) in [(32_768usize, 8u32), (40_001, 8), (33_000, 2)] {
            let shape = [2, cols];
            let x: Vec<bf16> = random(&mut rng, 2 * cols, 0.0, 8.0);
            let dy: Vec<bf16> = random(&mut rng, 2 * cols, 0.0, 1.0);
            let save = SoftmaxSave {
                bits,
                codes: SoftmaxCodes::Sqrt,
                grouping: Grouping::Tensor,
                rounding: Rounding::Nearest,
            };
            check_softmax(&device, &save, &x, &Layout::contiguous(&shape), None, &dy);
        }
    }
}

#[test]
fn softmax_vit_shape_batch_heads_197_197() {
    let mut rng = common::rng("softmax_vit");
    for device in common::backends() {
        let shape = [2, 3, 197, 197];
        let n = shape.iter().product();
        let x: Vec<f16> = random(&mut rng, n, 0.0, 5.0);
        let dy: Vec<f16> = random(&mut rng, n, 0.0, 1.0);
        // 8 bits: fused; 4 bits: 197 is odd, so codes come from the second pass
        for bits in [8, 4] {
            let save = SoftmaxSave { bits, ..SoftmaxSave::per_head(1) };
            check_softmax(&device, &save, &x, &Layout::contiguous(&shape), None, &dy);
        }
    }
}

#[test]
fn softmax_bf16_extremes_and_plain_backward() {
    for device in common::backends() {
        let cols = 16;
        let mut x = vec![bf16::from_f64(0.0); 2 * cols];
        x[0] = bf16::MAX;
        x[1] = bf16::MAX;
        x[2] = bf16::MIN;
        x[cols] = bf16::MIN;
        x[cols + 1] = bf16::from_f64(-1e38);
        let l = Layout::contiguous(&[2, cols]);
        let dy: Vec<bf16> = (0..2 * cols).map(|i| bf16::from_f64((i as f64 * 0.37).sin())).collect();
        for codes in [SoftmaxCodes::Sqrt, SoftmaxCodes::Linear] {
            let save = SoftmaxSave { bits: 8, codes, grouping: Grouping::Tensor, rounding: Rounding::Nearest };
            check_softmax(&device, &save, &x, &l, None, &dy);
        }
        // plain backward from a bf16 y
        let xb = device.upload(&x).expect("up");
        let mut y = poisoned::<bf16>(&device, 2 * cols);
        softmax(&device, &SoftmaxInput { x: &tref(&xb, &l), mask: None }, &mut tmut(&mut y, &l)).expect("softmax");
        let dyb = device.upload(&dy).expect("up");
        let mut dx = poisoned::<bf16>(&device, 2 * cols);
        softmax_backward_plain(
            &device,
            &SoftmaxBackwardPlain { y: &tref(&y, &l), dy: &tref(&dyb, &l) },
            &mut tmut(&mut dx, &l),
        )
        .expect("bwd");
        let r = rf::softmax_backward_rows(&host(&y), &reference::gather(&dy, &l), cols);
        for (i, d) in host(&dx).iter().enumerate() {
            assert!((d - r[i]).abs() <= 2f64.powi(-8) * r[i].abs() + 1e-6, "plain dx[{i}] {d} vs {}", r[i]);
        }
    }
}

#[test]
fn softmax_real_attention_logits_from_the_fixture() {
    let path = common::fixture_dir().join("minilm_activations.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let load = |name: &str| -> Vec<f64> {
        let t = st.tensor(name).expect("tensor");
        t.data().chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64()).collect()
    };
    let (nq, h, d) = (28, 12, 32);
    for device in common::backends() {
        for layer in [0, 5] {
            let q = load(&format!("layer{layer}.batch0.q"));
            let k = load(&format!("layer{layer}.batch0.k"));
            // logits S[h, i, j] = q_i · k_j / sqrt(d) per head
            let mut s = vec![0f32; h * nq * nq];
            for hh in 0..h {
                for i in 0..nq {
                    for j in 0..nq {
                        let dot: f64 = (0..d).map(|e| q[i * h * d + hh * d + e] * k[j * h * d + hh * d + e]).sum();
                        s[(hh * nq + i) * nq + j] = (dot / (d as f64).sqrt()) as f32;
                    }
                }
            }
            let probs = load(&format!("layer{layer}.batch0.attn_probs"));
            let shape = [1, h, nq, nq];
            let dy: Vec<f32> = probs.iter().map(|p| (p * 7.0).sin() as f32).collect();
            for bits in [8, 4, 2] {
                let saved = check_softmax(
                    &device,
                    &SoftmaxSave { bits, ..SoftmaxSave::per_head(1) },
                    &s,
                    &Layout::contiguous(&shape),
                    None,
                    &dy,
                );
                // agrees with the model's own probabilities (f16-stored) within half a step of
                // √y: |ŷ − y| ≤ (√y + s/4)·s (rf::sqrt_code_error_bound), y within 2e-3 of b
                let dec = decode_host(&saved);
                let step = 1.0 / rq::levels(bits);
                for (a, b) in dec.iter().zip(&probs) {
                    let bound = rf::sqrt_code_error_bound(b + 2e-3, step, false) * 1.01;
                    assert!((a - b).abs() <= bound + 2e-3, "decoded {a} vs model probability {b}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// LayerNorm

/// LayerNorm forward with codes + backward from codes against the reference.
#[allow(clippy::too_many_arguments)]
fn check_layer_norm<T: Element>(
    device: &Device,
    q: &mut Quantizer,
    x: &[T],
    x_layout: &Layout,
    w: Option<&[T]>,
    b: Option<&[T]>,
    dy: &[T],
    exact_stats: bool,
) -> mesa_kernels::SavedLayerNorm {
    let shape = x_layout.shape().to_vec();
    let n: usize = shape.iter().product();
    let cols = *shape.last().expect("rank");
    let rows = n / cols;
    let u = common::unit_roundoff(T::DTYPE);
    let eps = 1e-5f32;
    let xb = device.upload(x).expect("up");
    let wb = w.map(|w| device.upload(w).expect("up"));
    let bb = b.map(|b| device.upload(b).expect("up"));
    let dense = Layout::contiguous(&shape);
    let mut y = poisoned::<T>(device, n);
    let (wv, bv) = (wb.as_ref().map(vref), bb.as_ref().map(vref));
    let args = LayerNormForward { x: &tref(&xb, x_layout), weight: wv.as_ref(), bias: bv.as_ref(), eps };
    let saved = layer_norm_forward(device, q, &args, &mut tmut(&mut y, &dense)).expect("layer_norm_forward");
    let xs = reference::gather(x, x_layout);
    let wf: Option<Vec<f64>> = w.map(|w| w.iter().map(|v| v.to_f64()).collect());
    let bf: Option<Vec<f64>> = b.map(|b| b.iter().map(|v| v.to_f64()).collect());
    let r = rf::layer_norm_rows(&xs, wf.as_deref(), bf.as_deref(), f64::from(eps), cols);
    let yh = host(&y);
    let mean = saved.mean().to_vec().expect("mean");
    let rstd = saved.rstd().to_vec().expect("rstd");
    let big_e = (cols as f64 / 32.0 + 32.0) * EPS;
    let mut xhat_tol = vec![0.0; n];
    for row in 0..rows {
        let max_abs = (0..cols).map(|c| xs[row * cols + c].abs()).fold(0.0, f64::max);
        let dm = big_e * max_abs;
        assert!((f64::from(mean[row]) - r.mean[row]).abs() <= dm + 1e-30, "mean[{row}]");
        assert!(
            (f64::from(rstd[row]) - r.rstd[row]).abs() <= 4.0 * big_e * r.rstd[row] * (1.0 + max_abs * r.rstd[row]),
            "rstd[{row}] = {} vs {}",
            rstd[row],
            r.rstd[row]
        );
        for c in 0..cols {
            let i = row * cols + c;
            let dxh = 4.0 * big_e * (max_abs * r.rstd[row] + r.xhat[i].abs());
            xhat_tol[i] = dxh;
            let wc = wf.as_ref().map_or(1.0, |w| w[c].abs());
            let tol = u * r.y[i].abs() + dxh * wc + 4.0 * EPS * r.y[i].abs() + tiny(T::DTYPE);
            assert!(
                yh[i].is_finite() && (yh[i] - r.y[i]).abs() <= tol,
                "ln y[{i}] = {}, reference {} (tol {tol})",
                yh[i],
                r.y[i]
            );
        }
    }
    let dec = decode_host(saved.xhat());
    if exact_stats {
        let params = saved.xhat().params().expect("p");
        let groups = rq::group_index(&shape, &saved.xhat().grouping()).expect("g");
        for i in 0..n {
            let s = f64::from(params[groups[i]].scale);
            let tol = 0.5 * s * 1.0001 + xhat_tol[i] + 8.0 * EPS * (r.xhat[i].abs() + s * 255.0) + 1e-30;
            assert!((dec[i] - r.xhat[i]).abs() <= tol, "x^ code {i}: decoded {} vs {} (tol {tol})", dec[i], r.xhat[i]);
        }
    }
    // backward from codes, against the reference on the decoded x̂ and the saved rstd
    let dyb = device.upload(dy).expect("up");
    let mut dx = poisoned::<T>(device, n);
    let mut dw = device.upload(&vec![f32::NAN; cols]).expect("up");
    let mut db = device.upload(&vec![f32::NAN; cols]).expect("up");
    let dyv = tref(&dyb, &dense);
    let bargs = LayerNormBackward { saved: &saved, weight: wv.as_ref(), dy: &dyv };
    let grads =
        LayerNormGrads { dx: &mut tmut(&mut dx, &dense), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) };
    layer_norm_backward(device, &bargs, grads).expect("layer_norm_backward");
    let dys = reference::gather(dy, &dense);
    let rs: Vec<f64> = rstd.iter().map(|&v| f64::from(v)).collect();
    let (rdx, rdw, rdb) = rf::layer_norm_backward_rows(&dec, &rs, wf.as_deref(), &dys, cols);
    let dxh = host(&dx);
    for row in 0..rows {
        let range = row * cols..(row + 1) * cols;
        let g_abs: f64 = range.clone().map(|i| (dys[i] * wf.as_ref().map_or(1.0, |w| w[i - row * cols])).abs()).sum();
        let gx_abs: f64 =
            range.clone().map(|i| (dys[i] * wf.as_ref().map_or(1.0, |w| w[i - row * cols]) * dec[i]).abs()).sum();
        for i in range {
            let tol = u * rdx[i].abs()
                + big_e * rs[row] * (g_abs / cols as f64 + dec[i].abs() * gx_abs / cols as f64 + dys[i].abs() * 4.0)
                + 4.0
                    * EPS
                    * rs[row]
                    * (dys[i].abs() + dec[i].abs())
                    * wf.as_ref().map_or(1.0, |w| w[i - row * cols].abs())
                + tiny(T::DTYPE);
            assert!((dxh[i] - rdx[i]).abs() <= tol, "ln dx[{i}] = {}, reference {} (tol {tol})", dxh[i], rdx[i]);
        }
    }
    let dwh = dw.to_vec().expect("dw");
    let dbh = db.to_vec().expect("db");
    for c in 0..cols {
        let sw: f64 = (0..rows).map(|r| (dys[r * cols + c] * dec[r * cols + c]).abs()).sum();
        let sb: f64 = (0..rows).map(|r| dys[r * cols + c].abs()).sum();
        let k = (rows as f64 / 512.0).ceil() + 512f64.min(rows as f64) + 2.0;
        assert!((f64::from(dwh[c]) - rdw[c]).abs() <= k * EPS * sw + 1e-30, "dweight[{c}] {} vs {}", dwh[c], rdw[c]);
        assert!((f64::from(dbh[c]) - rdb[c]).abs() <= k * EPS * sb + 1e-30, "dbias[{c}] {} vs {}", dbh[c], rdb[c]);
    }
    // deterministic: the same bits again
    let mut dw2 = device.upload(&vec![0f32; cols]).expect("up");
    let mut db2 = device.upload(&vec![0f32; cols]).expect("up");
    let mut dx2 = poisoned::<T>(device, n);
    let grads =
        LayerNormGrads { dx: &mut tmut(&mut dx2, &dense), dweight: &mut vmut(&mut dw2), dbias: &mut vmut(&mut db2) };
    layer_norm_backward(device, &bargs, grads).expect("again");
    let bits_of = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits_of(dw2.to_vec().expect("dw")), bits_of(dwh), "dweight must be bitwise reproducible");
    assert_eq!(bits_of(db2.to_vec().expect("db")), bits_of(dbh), "dbias must be bitwise reproducible");
    saved
}

#[test]
fn layer_norm_parity_every_dtype_width_and_row_length_class() {
    let mut rng = common::rng("ln_parity");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for bits in [8, 4, 2] {
                    // C not a multiple of the vector width (7, 13, 385) or of 8/bits; warp and
                    // block paths (2500)
                    for cols in [7usize, 13, 64, 385, 1000, 2500] {
                        let rows = if cols > 1000 { 3 } else { 11 };
                        let n = rows * cols;
                        let x: Vec<T> = random(&mut rng, n, 0.5, 3.0);
                        let w: Vec<T> = random(&mut rng, cols, 1.0, 0.5);
                        let b: Vec<T> = random(&mut rng, cols, 0.0, 0.5);
                        let dy: Vec<T> = random(&mut rng, n, 0.0, 1.0);
                        let config = QuantConfig { bits, ..QuantConfig::per_tensor() };
                        let mut q = Quantizer::new(&device, config).expect("q");
                        check_layer_norm(
                            &device,
                            &mut q,
                            &x,
                            &Layout::contiguous(&[rows, cols]),
                            Some(&w),
                            Some(&b),
                            &dy,
                            true,
                        );
                    }
                }
            });
        }
    }
}

#[test]
fn layer_norm_constant_rows_long_rows_strided_and_running_mode() {
    let mut rng = common::rng("ln_classes");
    for device in common::backends() {
        // constant rows (variance 0): x̂ = 0, y = bias, no NaN
        let cols = 48;
        let mut x: Vec<f32> = random(&mut rng, 4 * cols, 0.0, 1.0);
        for c in 0..cols {
            x[c] = 2.5;
            x[2 * cols + c] = -1e4;
        }
        let b: Vec<f32> = random(&mut rng, cols, 0.0, 1.0);
        let dy: Vec<f32> = random(&mut rng, 4 * cols, 0.0, 1.0);
        let mut q = Quantizer::new(&device, fused::channel_groups(1, 4)).expect("q");
        let saved = check_layer_norm(&device, &mut q, &x, &Layout::contiguous(&[4, cols]), None, Some(&b), &dy, true);
        let dec = decode_host(saved.xhat());
        let half_step = 0.5 * max_scale(saved.xhat()) * 1.0001;
        assert!(dec[..cols].iter().all(|v| v.abs() <= half_step), "constant row: x^ = 0 within half a step");
        // very long rows (streaming path)
        for (cols, bits) in [(33_000usize, 8u32), (32_771, 4)] {
            let x: Vec<bf16> = random(&mut rng, 2 * cols, 3.0, 2.0);
            let dy: Vec<bf16> = random(&mut rng, 2 * cols, 0.0, 1.0);
            let mut q = Quantizer::new(&device, QuantConfig { bits, ..QuantConfig::per_tensor() }).expect("q");
            check_layer_norm(&device, &mut q, &x, &Layout::contiguous(&[2, cols]), None, None, &dy, true);
        }
        // rows with a padded stride, offset into the buffer; large offset values
        let storage: Vec<f16> = random(&mut rng, 10 * 40 + 3, 100.0, 4.0);
        let view = Layout::strided(&[10, 33], &[40, 1], 3).expect("view");
        let dy: Vec<f16> = random(&mut rng, 330, 0.0, 1.0);
        let mut q = Quantizer::new(&device, QuantConfig { bits: 4, ..QuantConfig::per_tensor() }).expect("q");
        check_layer_norm(&device, &mut q, &storage, &view, None, None, &dy, true);
        // running estimate over batches: the codes and params of x̂ are those of
        // Quantizer::quantize on the kernel's own x̂ (plain LayerNorm, f32, no affine: y = x̂
        // exactly), also when a batch escapes the estimate (batch 1: one row of outliers) and
        // its groups are widened; rows of 64 (fused codes) and of 33 at 4 bits (C·bits not a
        // multiple of 8: the elementwise code pass, which also runs the second launch)
        for (cols, bits) in [(64usize, 8u32), (33, 4)] {
            let config = QuantConfig { bits, ..fused::channel_groups(1, if cols == 64 { 2 } else { 3 }) };
            let mut q = Quantizer::new(&device, config).expect("q");
            let mut twin = Quantizer::new(&device, config).expect("q");
            let mut widened = Vec::new();
            for batch in 0..3 {
                let mut x: Vec<f32> = random(&mut rng, 6 * cols, 0.0, 2.0 + batch as f64);
                if batch == 1 {
                    for (c, v) in x[..cols].iter_mut().enumerate() {
                        *v = if c % 11 == 0 { 3e3 } else { 0.0 }; // x̂ ~3.1: past the estimate
                    }
                }
                let dy: Vec<f32> = random(&mut rng, 6 * cols, 0.0, 1.0);
                let l = Layout::contiguous(&[6, cols]);
                let s = check_layer_norm(&device, &mut q, &x, &l, None, None, &dy, batch == 0);
                let xb = device.upload(&x).expect("up");
                let mut xhat = device.alloc_zeros::<f32>(6 * cols).expect("alloc");
                layer_norm(&device, &LayerNormForward::new(&tref(&xb, &l), 1e-5), &mut tmut(&mut xhat, &l))
                    .expect("ln");
                widened.push(same_as_quantizer(&mut twin, s.xhat(), &xhat));
            }
            assert!(widened[1] > 0, "rows of {cols}: batch 1 must escape the estimate ({widened:?})");
        }
        // exact mode, C·bits not a multiple of 8 (codes from the elementwise pass)
        let mut q =
            Quantizer::new(&device, QuantConfig { bits: 2, stats: StatsMode::Exact, ..QuantConfig::per_tensor() })
                .expect("q");
        for _ in 0..2 {
            let x: Vec<f32> = random(&mut rng, 5 * 31, 0.0, 2.0);
            let dy: Vec<f32> = random(&mut rng, 5 * 31, 0.0, 1.0);
            check_layer_norm(&device, &mut q, &x, &Layout::contiguous(&[5, 31]), None, None, &dy, true);
        }
    }
}

/// More rows than partial ranges (512): each block of the one-pass backward (rows of ≤ 1024)
/// sums dweight/dbias over several rows per warp and over its 8 warps, for every unit count
/// per lane; the bounds and the run-to-run bitwise check of `check_layer_norm` apply.
#[test]
fn layer_norm_backward_with_many_rows_per_partial_range() {
    let mut rng = common::rng("ln_many_rows");
    for device in common::backends() {
        for (rows, cols) in [(4133usize, 72usize), (4133, 264), (8200, 24), (4100, 1000)] {
            let n = rows * cols;
            let x: Vec<bf16> = random(&mut rng, n, 0.5, 2.0);
            let w: Vec<bf16> = random(&mut rng, cols, 1.0, 0.5);
            let dy: Vec<bf16> = random(&mut rng, n, 0.0, 1.0);
            let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
            check_layer_norm(&device, &mut q, &x, &Layout::contiguous(&[rows, cols]), Some(&w), None, &dy, true);
        }
    }
}

/// The dense LayerNorm kernel (x, y, weight and bias dense and 16-byte aligned, C % 8 == 0,
/// C ≤ 1024, codes rounded to nearest with units of 8 in one group) gives what the general
/// kernel gives, bit for bit: y, mean, rstd, codes, parameters and the non-finite count, over
/// three batches (the first batch's exact statistics, then the running estimate with fused
/// statistics, whose parameters the third batch's codes use; or exact mode). The same data through a row-padded view (not dense: the
/// general kernel) must agree exactly. Rows: random, constant (variance 0), huge (past 2^44:
/// the scaled path; f16 cannot hold such values and gets its largest), one NaN, one +inf.
#[test]
fn layer_norm_dense_kernel_equals_the_general_kernel_bitwise() {
    let mut rng = common::rng("layer_norm_dense_kernel_equals_the_general_kernel_bitwise");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for cols in [8usize, 256, 264, 512, 1000, 1024] {
                    let rows = 6;
                    let n = rows * cols;
                    let big = if dtype == DType::F16 { 6e4 } else { 3e20 };
                    let batches: Vec<Vec<T>> = (0..3)
                        .map(|batch| {
                            let mut x: Vec<T> = random(&mut rng, n, 0.5, 3.0 + batch as f64);
                            for c in 0..cols {
                                x[cols + c] = T::from_f64(-2.5); // row 1: constant
                                x[2 * cols + c] = T::from_f64(big * (rng.random::<f64>() - 0.3));
                                // row 2: huge
                            }
                            if batch == 1 {
                                x[3 * cols + cols / 2] = T::from_f64(f64::NAN); // row 3: a NaN
                                x[4 * cols + 1] = T::from_f64(f64::INFINITY); // row 4: +inf
                            }
                            x
                        })
                        .collect();
                    let w: Vec<T> = random(&mut rng, cols, 1.0, 0.5);
                    let b: Vec<T> = random(&mut rng, cols, 0.0, 0.5);
                    let (wb, bb) = (device.upload(&w).expect("up"), device.upload(&b).expect("up"));
                    let pitch = cols + 8;
                    let dense = Layout::contiguous(&[rows, cols]);
                    let padded = Layout::strided(&[rows, cols], &[pitch, 1], 0).expect("padded view");
                    let groupings = [
                        Grouping::Tensor,
                        Grouping::Heads { axis: 0 },
                        Grouping::Channels { axis: 1, groups: cols / 8 },
                    ];
                    for grouping in groupings {
                        for (bits, stats, affine) in [
                            (8, StatsMode::Running, true),
                            (4, StatsMode::Running, false),
                            (2, StatsMode::Exact, true),
                            (8, StatsMode::Exact, false),
                        ] {
                            let config =
                                QuantConfig { bits, grouping, stats, rounding: Rounding::Nearest, momentum: 0.9 };
                            let run = |padded_view: bool, q: &mut Quantizer, x: &[T]| {
                                let (storage, view) = if padded_view {
                                    let mut xp = vec![T::from_f64(0.0); rows * pitch];
                                    for r in 0..rows {
                                        xp[r * pitch..r * pitch + cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
                                    }
                                    (device.upload(&xp).expect("up"), &padded)
                                } else {
                                    (device.upload(x).expect("up"), &dense)
                                };
                                let (wv, bv) = (vref(&wb), vref(&bb));
                                let xv = tref(&storage, view);
                                let args = LayerNormForward {
                                    x: &xv,
                                    weight: affine.then_some(&wv),
                                    bias: affine.then_some(&bv),
                                    eps: 1e-5,
                                };
                                let mut y = poisoned::<T>(&device, n);
                                let saved = layer_norm_forward(&device, q, &args, &mut tmut(&mut y, &dense))
                                    .expect("layer_norm_forward");
                                // NaN payloads and signs are not compared (IEEE leaves them open)
                                let bits_of = |v: Vec<f64>| -> Vec<u64> {
                                    v.iter()
                                        .map(|v| if v.is_nan() { f64::NAN.to_bits() } else { v.to_bits() })
                                        .collect()
                                };
                                let f32_bits = |v: Vec<f32>| bits_of(v.iter().map(|&v| f64::from(v)).collect());
                                let params: Vec<(u32, u32)> = saved
                                    .xhat()
                                    .params()
                                    .expect("params")
                                    .iter()
                                    .map(|p| (p.offset.to_bits(), p.scale.to_bits()))
                                    .collect();
                                (
                                    bits_of(host(&y)),
                                    f32_bits(saved.mean().to_vec().expect("mean")),
                                    f32_bits(saved.rstd().to_vec().expect("rstd")),
                                    saved.xhat().codes().to_vec().expect("codes"),
                                    params,
                                    saved.xhat().nonfinite_count().expect("count"),
                                )
                            };
                            let mut fast_q = Quantizer::new(&device, config).expect("q");
                            let mut general_q = Quantizer::new(&device, config).expect("q");
                            for (batch, x) in batches.iter().enumerate() {
                                let fast = run(false, &mut fast_q, x);
                                let general = run(true, &mut general_q, x);
                                let what = format!(
                                    "{dtype:?} {cols} cols, {grouping:?}, {bits} bits, {stats:?}, affine {affine}, batch {batch}"
                                );
                                assert_eq!(fast.0, general.0, "y differs: {what}");
                                assert_eq!(fast.1, general.1, "mean differs: {what}");
                                assert_eq!(fast.2, general.2, "rstd differs: {what}");
                                assert_eq!(fast.3, general.3, "codes differ: {what}");
                                assert_eq!(fast.4, general.4, "parameters differ: {what}");
                                assert_eq!(fast.5, general.5, "non-finite count differs: {what}");
                                if batch == 1 {
                                    assert_eq!(fast.5 as usize, 2 * cols, "two non-finite rows counted: {what}");
                                }
                            }
                        }
                    }
                }
            });
        }
    }
}

#[test]
fn layer_norm_plain_paths_match() {
    let mut rng = common::rng("ln_plain");
    for device in common::backends() {
        let (rows, cols) = (6, 96);
        let l = Layout::contiguous(&[rows, cols]);
        let x: Vec<f32> = random(&mut rng, rows * cols, 1.0, 2.0);
        let w: Vec<f32> = random(&mut rng, cols, 1.0, 0.3);
        let xb = device.upload(&x).expect("up");
        let wb = device.upload(&w).expect("up");
        let mut y1 = poisoned::<f32>(&device, rows * cols);
        let mut y2 = poisoned::<f32>(&device, rows * cols);
        layer_norm(
            &device,
            &LayerNormForward { x: &tref(&xb, &l), weight: Some(&vref(&wb)), bias: None, eps: 1e-5 },
            &mut tmut(&mut y1, &l),
        )
        .expect("plain");
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        let saved = layer_norm_forward(
            &device,
            &mut q,
            &LayerNormForward { x: &tref(&xb, &l), weight: Some(&vref(&wb)), bias: None, eps: 1e-5 },
            &mut tmut(&mut y2, &l),
        )
        .expect("fused");
        assert_eq!(y1.to_vec().expect("y"), y2.to_vec().expect("y"), "saving must not change the output");
        // plain backward from an f32 x̂ equals the reference
        let r = rf::layer_norm_rows(
            &reference::gather(&x, &l),
            Some(&w.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()),
            None,
            1e-5,
            cols,
        );
        let xhat: Vec<f32> = r.xhat.iter().map(|&v| v as f32).collect();
        let xhb = device.upload(&xhat).expect("up");
        let dy: Vec<f32> = random(&mut rng, rows * cols, 0.0, 1.0);
        let dyb = device.upload(&dy).expect("up");
        let mut dx = poisoned::<f32>(&device, rows * cols);
        let mut dw = device.upload(&vec![f32::NAN; cols]).expect("up");
        let mut db = device.upload(&vec![f32::NAN; cols]).expect("up");
        layer_norm_backward_plain(
            &device,
            &LayerNormBackwardPlain {
                xhat: &tref(&xhb, &l),
                rstd: &vref(saved.rstd()),
                weight: Some(&vref(&wb)),
                dy: &tref(&dyb, &l),
            },
            LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) },
        )
        .expect("plain bwd");
        let rs: Vec<f64> = saved.rstd().to_vec().expect("r").iter().map(|&v| f64::from(v)).collect();
        let xh64: Vec<f64> = xhat.iter().map(|&v| f64::from(v)).collect();
        let (rdx, rdw, _) = rf::layer_norm_backward_rows(
            &xh64,
            &rs,
            Some(&w.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()),
            &dy.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
            cols,
        );
        for (i, d) in dx.to_vec().expect("dx").iter().enumerate() {
            assert!((f64::from(*d) - rdx[i]).abs() <= 1e-4 * (1.0 + rdx[i].abs()), "plain ln dx[{i}]");
        }
        for (c, d) in dw.to_vec().expect("dw").iter().enumerate() {
            assert!((f64::from(*d) - rdw[c]).abs() <= 1e-4 * (1.0 + rdw[c].abs()), "plain ln dw[{c}]");
        }
    }
}

#[test]
fn layer_norm_real_activations_from_the_fixture() {
    let path = common::fixture_dir().join("minilm_activations.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut rng = common::rng("ln_real");
    for device in common::backends() {
        for name in ["layer0.batch0.ln_attn_input", "layer5.batch1.ln_ffn_input", "layer3.batch2.gelu_input"] {
            let t = st.tensor(name).expect("tensor");
            let x: Vec<f16> = t.data().chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect();
            let cols = *t.shape().last().expect("rank");
            let rows = x.len() / cols;
            let dy: Vec<f16> = random(&mut rng, x.len(), 0.0, 1.0);
            let w: Vec<f16> = random(&mut rng, cols, 1.0, 0.2);
            for bits in [8, 4, 2] {
                let mut q = Quantizer::new(&device, QuantConfig { bits, ..fused::channel_groups(1, 12) }).expect("q");
                if name.contains("gelu") {
                    check_gelu(&device, &mut q, GeluForm::Erf, &x, &Layout::contiguous(&[rows, cols]), &dy, true);
                } else {
                    check_layer_norm(
                        &device,
                        &mut q,
                        &x,
                        &Layout::contiguous(&[rows, cols]),
                        Some(&w),
                        None,
                        &dy,
                        true,
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Sharing, zero sizes, errors

#[test]
fn a_tensor_consumed_by_two_ops_is_saved_once() {
    let mut rng = common::rng("shared");
    for device in common::backends() {
        // attention: P = softmax(S) feeds the softmax backward and P·V (dV = Pᵀ·dO)
        let (h, n, d) = (2, 16, 8);
        let shape = [h, n, n];
        let s: Vec<f32> = random(&mut rng, h * n * n, 0.0, 3.0);
        let sb = device.upload(&s).expect("up");
        let l = Layout::contiguous(&shape);
        let mut p = poisoned::<f32>(&device, h * n * n);
        let saved = softmax_forward(
            &device,
            &SoftmaxSave::per_head(0),
            &SoftmaxInput { x: &tref(&sb, &l), mask: None },
            &mut tmut(&mut p, &l),
        )
        .expect("fwd");
        // consumer 1: the matmul backward decodes the same handle
        let mut p_hat = poisoned::<f32>(&device, h * n * n);
        saved.dequantize(&device, &mut TensorMut::new(&mut p_hat, &l).expect("view")).expect("decode");
        let p_hat = host(&p_hat);
        let d_o: Vec<f64> = (0..h * n * d).map(|i| (i as f64 * 0.13).cos()).collect();
        let mut dv = vec![0.0; h * n * d];
        for hh in 0..h {
            for j in 0..n {
                for e in 0..d {
                    dv[(hh * n + j) * d + e] =
                        (0..n).map(|i| p_hat[(hh * n + i) * n + j] * d_o[(hh * n + i) * d + e]).sum();
                }
            }
        }
        assert!(dv.iter().all(|v| v.is_finite()));
        // consumer 2: the softmax backward reads the same codes
        let dy: Vec<f32> = random(&mut rng, h * n * n, 0.0, 1.0);
        let dyb = device.upload(&dy).expect("up");
        let mut dx = poisoned::<f32>(&device, h * n * n);
        softmax_backward(&device, &saved, &tref(&dyb, &l), &mut tmut(&mut dx, &l)).expect("bwd");
        let r = rf::softmax_backward_rows(&decode_host(&saved), &reference::gather(&dy, &l), n);
        for (i, v) in host(&dx).iter().enumerate() {
            assert!((v - r[i]).abs() <= 1e-5 * (1.0 + r[i].abs()), "dx[{i}]");
        }
        // the two consumers decode identical values: one copy held, 1 byte per element
        for (a, b) in decode_host(&saved).iter().zip(&p_hat) {
            assert!((a - b).abs() <= 2.0 * EPS * a.abs(), "one decode for both consumers: {a} vs {b}");
        }
        assert_eq!(saved.size_in_bytes(), h * n * n + 8 * h + 4, "saved once: codes + params + counter");
        // GELU: two backward calls from one handle give the same bits
        let x: Vec<f32> = random(&mut rng, 64, 0.0, 2.0);
        let xb = device.upload(&x).expect("up");
        let l1 = Layout::contiguous(&[64]);
        let mut y = poisoned::<f32>(&device, 64);
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        let g = gelu_forward(&device, &mut q, GeluForm::Erf, &tref(&xb, &l1), &mut tmut(&mut y, &l1)).expect("gelu");
        let ones = device.upload(&[1f32; 64]).expect("up");
        let mut a = poisoned::<f32>(&device, 64);
        let mut b = poisoned::<f32>(&device, 64);
        gelu_backward(&device, GeluForm::Erf, &g, &tref(&ones, &l1), &mut tmut(&mut a, &l1)).expect("b1");
        gelu_backward(&device, GeluForm::Erf, &g, &tref(&ones, &l1), &mut tmut(&mut b, &l1)).expect("b2");
        assert_eq!(a.to_vec().expect("a"), b.to_vec().expect("b"));
    }
}

#[test]
fn zero_size_tensors() {
    for device in common::backends() {
        let empty = device.upload::<f32>(&[]).expect("up");
        let mut out = device.upload::<f32>(&[]).expect("up");
        let l = Layout::contiguous(&[0, 16]);
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        let s = gelu_forward(&device, &mut q, GeluForm::Erf, &tref(&empty, &l), &mut tmut(&mut out, &l)).expect("gelu");
        assert_eq!(s.numel(), 0);
        assert_eq!(q.batches(), 0, "an empty tensor does not count as a batch");
        let mut dx = device.upload::<f32>(&[]).expect("up");
        gelu_backward(&device, GeluForm::Erf, &s, &tref(&empty, &l), &mut tmut(&mut dx, &l)).expect("gelu bwd");
        let sm = softmax_forward(
            &device,
            &SoftmaxSave::per_head(1),
            &SoftmaxInput { x: &tref(&empty, &l), mask: None },
            &mut tmut(&mut out, &l),
        )
        .expect("softmax");
        softmax_backward(&device, &sm, &tref(&empty, &l), &mut tmut(&mut dx, &l)).expect("softmax bwd");
        let ln = layer_norm_forward(
            &device,
            &mut q,
            &LayerNormForward { x: &tref(&empty, &l), weight: None, bias: None, eps: 1e-5 },
            &mut tmut(&mut out, &l),
        )
        .expect("ln");
        assert_eq!(ln.mean().len(), 0);
        let mut dw = device.upload(&[f32::NAN; 16]).expect("up");
        let mut db = device.upload(&[f32::NAN; 16]).expect("up");
        layer_norm_backward(
            &device,
            &LayerNormBackward { saved: &ln, weight: None, dy: &tref(&empty, &l) },
            LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) },
        )
        .expect("ln bwd");
        assert!(dw.to_vec().expect("dw").iter().all(|&v| v == 0.0), "no rows: dweight = 0");
        assert!(db.to_vec().expect("db").iter().all(|&v| v == 0.0), "no rows: dbias = 0");
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    // grouping and self-overlap errors come from `Layout`
    let layout_error = |e: &Error| matches!(e, Error::InvalidLayout { .. });
    for device in common::backends() {
        let x = device.upload(&[0.5f32; 24]).expect("up");
        let mut y = device.upload(&[0f32; 24]).expect("up");
        let l = Layout::contiguous(&[2, 3, 4]);
        let xv = tref(&x, &l);
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        // shapes differ
        let other = Layout::contiguous(&[2, 12]);
        let r = gelu_forward(&device, &mut q, GeluForm::Erf, &xv, &mut tmut(&mut y, &other));
        assert!(
            matches!(r, Err(Error::ShapeMismatch { ref expected, ref got, .. }) if expected == &[2, 3, 4] && got == &[2, 12])
        );
        let r = softmax(&device, &SoftmaxInput::new(&xv), &mut tmut(&mut y, &other));
        assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
        // rank 0 row op
        let scalar = Layout::contiguous(&[]);
        let r = softmax(&device, &SoftmaxInput::new(&tref(&x, &scalar)), &mut tmut(&mut y, &scalar));
        assert!(matches!(r, Err(Error::InvalidLayout { .. })), "{r:?}");
        // buffer too short: rejected when the view is made
        let long = Layout::contiguous(&[5, 5]);
        assert!(matches!(TensorRef::new(&x, &long), Err(Error::BufferTooShort { needed: 25, len: 24, .. })));
        // output overlapping itself: rejected when the view is made
        let bcast = Layout::strided(&[2, 3, 4], &[0, 4, 1], 0).expect("l");
        assert!(TensorMut::new(&mut y, &bcast).err().as_ref().is_some_and(layout_error));
        // bit width
        let bad = SoftmaxSave { bits: 3, ..SoftmaxSave::per_head(0) };
        let r = softmax_forward(&device, &bad, &SoftmaxInput::new(&xv), &mut tmut(&mut y, &l));
        assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
        // mask of another shape
        let m = device.upload(&[0f32; 24]).expect("up");
        let mv = tref(&m, &Layout::contiguous(&[6, 4]));
        let r = softmax(&device, &SoftmaxInput::new(&xv).with_mask(&mv), &mut tmut(&mut y, &l));
        assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
        // LayerNorm: eps (an argument, not a shape), C = 0, short or strided weight
        for eps in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let r = layer_norm(&device, &LayerNormForward::new(&xv, eps), &mut tmut(&mut y, &l));
            assert!(matches!(r, Err(Error::InvalidArgument { ref name, .. }) if name == "eps"), "eps {eps}: {r:?}");
        }
        let c0 = Layout::contiguous(&[3, 0]);
        let r = layer_norm(&device, &LayerNormForward::new(&tref(&x, &c0), 1e-5), &mut tmut(&mut y, &c0));
        assert!(matches!(r, Err(Error::InvalidLayout { .. })), "{r:?}");
        let w = device.upload(&[1f32; 8]).expect("up");
        let short = tref(&w, &Layout::contiguous(&[3]));
        let args = LayerNormForward { weight: Some(&short), ..LayerNormForward::new(&xv, 1e-5) };
        let r = layer_norm(&device, &args, &mut tmut(&mut y, &l));
        assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
        let strided = tref(&w, &Layout::strided(&[4], &[2], 0).expect("l"));
        let args = LayerNormForward { bias: Some(&strided), ..LayerNormForward::new(&xv, 1e-5) };
        let r = layer_norm(&device, &args, &mut tmut(&mut y, &l));
        assert!(matches!(r, Err(Error::InvalidLayout { .. })), "{r:?}");
        // backward with a gradient of another shape than the saved tensor
        let s = gelu_forward(&device, &mut q, GeluForm::Erf, &xv, &mut tmut(&mut y, &l)).expect("fwd");
        let mut dx = device.upload(&[0f32; 24]).expect("up");
        let r = gelu_backward(&device, GeluForm::Erf, &s, &tref(&x, &other), &mut tmut(&mut dx, &other));
        assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
        // grouping that does not divide
        let mut qg = Quantizer::new(&device, fused::channel_groups(2, 3)).expect("q");
        let r = gelu_forward(&device, &mut qg, GeluForm::Erf, &xv, &mut tmut(&mut y, &l));
        assert!(r.as_ref().err().is_some_and(layout_error), "{r:?}");
        // a quantizer of another device
        let other_dev = common::emulator();
        if device.is_cuda() {
            let mut qo = Quantizer::new(&other_dev, QuantConfig::per_tensor()).expect("q");
            let r = gelu_forward(&device, &mut qo, GeluForm::Erf, &xv, &mut tmut(&mut y, &l));
            assert!(matches!(r, Err(Error::WrongBackend { .. })), "{r:?}");
        }
        // LN backward: short dweight, rstd of another length
        let ln =
            layer_norm_forward(&device, &mut q, &LayerNormForward::new(&xv, 1e-5), &mut tmut(&mut y, &l)).expect("ln");
        let mut dw = device.upload(&[0f32; 2]).expect("up");
        let mut db = device.upload(&[0f32; 4]).expect("up");
        let bargs = LayerNormBackward { saved: &ln, weight: None, dy: &xv };
        let grads =
            LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) };
        let r = layer_norm_backward(&device, &bargs, grads);
        assert!(matches!(r, Err(Error::ShapeMismatch { ref what, .. }) if what == "dweight"), "{r:?}");
        let rstd = device.upload(&[1f32; 5]).expect("up");
        let mut dw = device.upload(&[0f32; 4]).expect("up");
        let pargs = LayerNormBackwardPlain { xhat: &xv, rstd: &vref(&rstd), weight: None, dy: &xv };
        let grads =
            LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) };
        let r = layer_norm_backward_plain(&device, &pargs, grads);
        assert!(matches!(r, Err(Error::ShapeMismatch { ref what, .. }) if what == "rstd"), "{r:?}");
    }
}

#[test]
fn emulator_and_gpu_agree() {
    let Some(gpu) = common::cuda_only("fused emulator_and_gpu_agree") else { return };
    let emu = common::emulator();
    let mut rng = common::rng("fused_emu_vs_gpu");
    let shape = [6, 200];
    let l = Layout::contiguous(&shape);
    let x: Vec<bf16> = random(&mut rng, 1200, 0.0, 4.0);
    let dy: Vec<bf16> = random(&mut rng, 1200, 0.0, 1.0);
    // GELU: the codes of x are bitwise those of the quantizer (same encode, same parameters);
    // outputs go through the GPU's ex2/rcp approximations, a few f32 ulps from the emulator's
    // (every other rounding is explicit: docs/design.md), so after rounding to bf16 they
    // differ by at most one bf16 ulp (≤ 2⁻⁷·|y|), or by subnormal-range noise below 1e-37.
    let run_gelu = |d: &Device| {
        let mut q = Quantizer::new(d, QuantConfig { bits: 4, ..QuantConfig::per_tensor() }).expect("q");
        let xb = d.upload(&x).expect("up");
        let mut y = poisoned::<bf16>(d, 1200);
        let s = gelu_forward(d, &mut q, GeluForm::Erf, &tref(&xb, &l), &mut tmut(&mut y, &l)).expect("gelu");
        (s.codes().to_vec().expect("c"), s.params().expect("p"), host(&y))
    };
    let (ce, pe, ye) = run_gelu(&emu);
    let (cg, pg, yg) = run_gelu(&gpu);
    assert_eq!((ce, pe), (cg, pg), "GELU codes and parameters must be bitwise equal");
    for (a, b) in ye.iter().zip(&yg) {
        assert!((a - b).abs() <= 2f64.powi(-7) * a.abs().max(b.abs()) + 1e-37, "GELU output {a} vs {b}");
    }
    // softmax: expf differs by ulps -> outputs within one bf16 ulp, codes within one step.
    // LayerNorm uses only IEEE-rounded +, ×, /, sqrt and fmaf in one fixed reduction order
    // (the emulator runs the same warp shuffles), so its outputs, codes, statistics and
    // gradients are bitwise equal.
    for bits in [8, 2] {
        let run = |d: &Device| {
            let xb = d.upload(&x).expect("up");
            let mut y = poisoned::<bf16>(d, 1200);
            let s = softmax_forward(
                d,
                &SoftmaxSave { bits, ..SoftmaxSave::per_head(0) },
                &SoftmaxInput { x: &tref(&xb, &l), mask: None },
                &mut tmut(&mut y, &l),
            )
            .expect("softmax");
            let mut q = Quantizer::new(d, QuantConfig { bits, ..QuantConfig::per_tensor() }).expect("q");
            let mut z = poisoned::<bf16>(d, 1200);
            let ln = layer_norm_forward(
                d,
                &mut q,
                &LayerNormForward { x: &tref(&xb, &l), weight: None, bias: None, eps: 1e-5 },
                &mut tmut(&mut z, &l),
            )
            .expect("ln");
            let dyb = d.upload(&dy).expect("up");
            let mut dx = poisoned::<bf16>(d, 1200);
            let mut dw = d.upload(&[0f32; 200]).expect("up");
            let mut db = d.upload(&[0f32; 200]).expect("up");
            layer_norm_backward(
                d,
                &LayerNormBackward { saved: &ln, weight: None, dy: &tref(&dyb, &l) },
                LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) },
            )
            .expect("ln bwd");
            (decode_host(&s), host(&y), decode_host(ln.xhat()), host(&z), dw.to_vec().expect("dw"))
        };
        let (e, g) = (run(&emu), run(&gpu));
        let step = 1.0 / rq::levels(bits);
        for (a, b) in e.0.iter().zip(&g.0) {
            // companded codes c, c + 1 decode (c·s)², ((c + 1)·s)²: apart by (√a + √b)·s
            assert!((a - b).abs() <= (a.sqrt() + b.sqrt()) * step * 1.0001, "softmax codes differ by more than one");
        }
        for (a, b) in e.1.iter().zip(&g.1) {
            assert!((a - b).abs() <= 2f64.powi(-7) * a.abs().max(b.abs()) + 1e-37, "softmax output {a} vs {b}");
        }
        assert_eq!(e.3, g.3, "LayerNorm outputs must be bitwise equal");
        assert_eq!(e.4, g.4, "LayerNorm dweight must be bitwise equal");
        assert_eq!(e.2, g.2, "LayerNorm x^ codes (decoded with their parameters) must be bitwise equal");
    }
}

#[test]
fn softmax_nan_and_inf_logits_give_nan_rows_and_poisoned_codes() {
    // A NaN or +inf logit makes its whole row NaN (as PyTorch does), the fused path counts the
    // non-finite outputs, and the saved group decodes to NaN — never to finite stand-ins.
    for device in common::backends() {
        let (rows, cols) = (4, 8);
        let l = Layout::contiguous(&[2, 2, cols]);
        let mut x = vec![0.5f32; rows * cols];
        x[1] = f32::NAN; // row 0 (head 0)
        x[2 * cols + 2] = f32::INFINITY; // row 2 (head 1)
        let xb = device.upload(&x).expect("up");
        let mut y = poisoned::<f32>(&device, rows * cols);
        let save = SoftmaxSave::per_head(1);
        let saved =
            softmax_forward(&device, &save, &SoftmaxInput { x: &tref(&xb, &l), mask: None }, &mut tmut(&mut y, &l))
                .expect("fwd");
        let y = y.to_vec().expect("y");
        for r in 0..rows {
            let nan_row = r == 0 || r == 2;
            for c in 0..cols {
                assert_eq!(y[r * cols + c].is_nan(), nan_row, "y[{r},{c}] = {}", y[r * cols + c]);
            }
        }
        assert_eq!(saved.nonfinite_count().expect("count"), 16);
        let mut p = poisoned::<f32>(&device, rows * cols);
        saved.dequantize(&device, &mut TensorMut::new(&mut p, &l).expect("view")).expect("decode");
        let p = p.to_vec().expect("p");
        // [B=2, H=2, cols]: rows 0 and 2 are heads 0 and 0 of batches 0 and 1 -> head 0 poisoned
        for (i, v) in p.iter().enumerate() {
            let head = (i / cols) % 2;
            assert_eq!(v.is_nan(), head == 0, "decoded p[{i}] = {v}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Issue 8: in-place calls, empty grouped axes, shape products of huge empty tensors

/// A raw device slice over a host vector: on the emulator, device memory is host memory, so
/// two copies of it are one buffer given as both input and output.
fn raw_over<T>(v: &mut [T]) -> RawDeviceSlice<T> {
    // SAFETY: the emulator runs each kernel synchronously on the calling thread; `v` outlives
    // every call that uses the slice, and the test does not touch `v` during a call.
    unsafe { RawDeviceSlice::new(v.as_mut_ptr() as u64, v.len()) }
}

#[test]
fn in_place_gelu_forward_with_saving_is_rejected() {
    let device = common::emulator();
    let mut rng = common::rng("alias_gelu_forward");
    let l = Layout::contiguous(&[4, 64]);
    let x0: Vec<f32> = random(&mut rng, 256, 0.0, 3.0);
    let mut storage = x0.clone();
    let (x, mut y) = (raw_over(&mut storage), raw_over(&mut storage));
    let mut q = Quantizer::new(&device, fused::channel_groups(1, 4)).expect("q");
    let r = gelu_forward(&device, &mut q, GeluForm::Erf, &tref(&x, &l), &mut tmut(&mut y, &l));
    if let Ok(saved) = &r {
        let dec = decode_host(saved);
        let worst = dec.iter().zip(&x0).map(|(d, &x)| (d - f64::from(x)).abs()).fold(0.0, f64::max);
        panic!("in-place GELU forward returned Ok (codes decode within {worst} of x, step {})", max_scale(saved));
    }
    assert!(matches!(r, Err(Error::Aliasing { .. })), "in-place GELU forward: {r:?}");
}

#[test]
fn in_place_layer_norm_forward_with_saving_is_rejected() {
    let device = common::emulator();
    let mut rng = common::rng("alias_ln_forward");
    // C·bits not a multiple of 8: the codes come from a second pass that re-reads x
    let (rows, cols) = (5, 31);
    let l = Layout::contiguous(&[rows, cols]);
    let x0: Vec<f32> = random(&mut rng, rows * cols, 1.0, 3.0);
    let mut storage = x0.clone();
    let (x, mut y) = (raw_over(&mut storage), raw_over(&mut storage));
    let mut q = Quantizer::new(&device, QuantConfig { bits: 4, ..QuantConfig::per_tensor() }).expect("q");
    let r = layer_norm_forward(
        &device,
        &mut q,
        &LayerNormForward { x: &tref(&x, &l), weight: None, bias: None, eps: 1e-5 },
        &mut tmut(&mut y, &l),
    );
    if let Ok(saved) = &r {
        let xs: Vec<f64> = x0.iter().map(|&v| f64::from(v)).collect();
        let rx = rf::layer_norm_rows(&xs, None, None, 1e-5, cols);
        let dec = decode_host(saved.xhat());
        let worst = dec.iter().zip(&rx.xhat).map(|(d, r)| (d - r).abs()).fold(0.0, f64::max);
        panic!(
            "in-place LayerNorm forward returned Ok (codes of x^ off by up to {worst}, step {})",
            max_scale(saved.xhat())
        );
    }
    assert!(matches!(r, Err(Error::Aliasing { .. })), "in-place LayerNorm forward: {:?}", r.as_ref().err());
}

#[test]
fn layer_norm_backward_with_dx_over_dy_is_rejected() {
    let device = common::emulator();
    let mut rng = common::rng("alias_ln_backward");
    let (rows, cols) = (6, 32);
    let l = Layout::contiguous(&[rows, cols]);
    let x: Vec<f32> = random(&mut rng, rows * cols, 0.0, 2.0);
    let xb = device.upload(&x).expect("up");
    let mut y = device.alloc_zeros::<f32>(rows * cols).expect("alloc");
    let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
    let saved = layer_norm_forward(
        &device,
        &mut q,
        &LayerNormForward { x: &tref(&xb, &l), weight: None, bias: None, eps: 1e-5 },
        &mut tmut(&mut y, &l),
    )
    .expect("fwd");
    let dy0: Vec<f32> = random(&mut rng, rows * cols, 0.0, 1.0);
    let mut storage = dy0.clone();
    let (dy, mut dx) = (raw_over(&mut storage), raw_over(&mut storage));
    let mut dw = device.upload(&vec![f32::NAN; cols]).expect("up");
    let mut db = device.upload(&vec![f32::NAN; cols]).expect("up");
    let r = layer_norm_backward(
        &device,
        &LayerNormBackward { saved: &saved, weight: None, dy: &tref(&dy, &l) },
        LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) },
    );
    if r.is_ok() {
        let dec = decode_host(saved.xhat());
        let rs: Vec<f64> = saved.rstd().to_vec().expect("r").iter().map(|&v| f64::from(v)).collect();
        let dys: Vec<f64> = dy0.iter().map(|&v| f64::from(v)).collect();
        let (_, rdw, rdb) = rf::layer_norm_backward_rows(&dec, &rs, None, &dys, cols);
        let err = |got: Vec<f32>, want: &[f64]| {
            got.iter().zip(want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max)
        };
        panic!(
            "LayerNorm backward with dx over dy returned Ok: max |dweight - ref| = {}, max |dbias - ref| = {}",
            err(dw.to_vec().expect("dw"), &rdw),
            err(db.to_vec().expect("db"), &rdb)
        );
    }
    assert!(matches!(r, Err(Error::Aliasing { .. })), "dx over dy: {r:?}");
}

#[test]
fn empty_grouped_axes_give_empty_handles() {
    for device in common::backends() {
        let empty = device.upload::<f32>(&[]).expect("up");
        let mut out = device.upload::<f32>(&[]).expect("up");
        // [B, H, N, N] with no heads, grouped by head; and rows of length 0
        for (shape, grouping) in [
            (vec![2usize, 0, 4, 4], Grouping::Heads { axis: 1 }),
            (vec![3, 0], Grouping::Heads { axis: 1 }),
            (vec![3, 0], Grouping::Channels { axis: 1, groups: 2 }),
        ] {
            let l = Layout::contiguous(&shape);
            let save = SoftmaxSave { grouping, ..SoftmaxSave::per_head(0) };
            let r = softmax_forward(
                &device,
                &save,
                &SoftmaxInput { x: &tref(&empty, &l), mask: None },
                &mut tmut(&mut out, &l),
            );
            let saved = r.unwrap_or_else(|e| panic!("softmax_forward of {shape:?} grouped {grouping:?}: {e:?}"));
            assert_eq!((saved.numel(), saved.shape()), (0, shape.as_slice()));
            let mut dx = device.upload::<f32>(&[]).expect("up");
            softmax_backward(&device, &saved, &tref(&empty, &l), &mut tmut(&mut dx, &l)).expect("softmax backward");
            let mut q = Quantizer::new(&device, QuantConfig { grouping, ..QuantConfig::per_tensor() }).expect("q");
            let g =
                gelu_forward(&device, &mut q, GeluForm::Erf, &tref(&empty, &l), &mut tmut(&mut out, &l)).expect("gelu");
            assert_eq!((g.numel(), q.batches()), (0, 0));
            gelu_backward(&device, GeluForm::Erf, &g, &tref(&empty, &l), &mut tmut(&mut dx, &l))
                .expect("gelu backward");
        }
        // LayerNorm: no rows is an empty tensor; rows of length 0 have no mean
        let l = Layout::contiguous(&[2, 0, 8]);
        let mut q = Quantizer::new(&device, QuantConfig::per_head(1)).expect("q");
        let ln = layer_norm_forward(
            &device,
            &mut q,
            &LayerNormForward { x: &tref(&empty, &l), weight: None, bias: None, eps: 1e-5 },
            &mut tmut(&mut out, &l),
        )
        .expect("ln");
        assert_eq!((ln.xhat().numel(), ln.xhat().num_groups(), ln.mean().len()), (0, 0, 0));
        let c0 = Layout::contiguous(&[3, 0]);
        let mut q = Quantizer::new(&device, fused::channel_groups(1, 2)).expect("q");
        let r = layer_norm_forward(
            &device,
            &mut q,
            &LayerNormForward { x: &tref(&empty, &c0), weight: None, bias: None, eps: 1e-5 },
            &mut tmut(&mut out, &c0),
        );
        assert!(
            matches!(r, Err(Error::InvalidLayout { .. })),
            "LayerNorm over rows of length 0: {:?}",
            r.as_ref().err()
        );
    }
}

#[test]
fn huge_empty_tensors_are_never_a_panic() {
    // [0, usize::MAX/2, 4]: no element, but every product of trailing dimensions overflows.
    // Run once with overflow checks (see docs/fused.md): each op is Ok (nothing to do) or a
    // clean error, never a panic and never the "bug in this crate" kind.
    let shape = [0usize, usize::MAX / 2, 4];
    let l = Layout::contiguous(&shape);
    let clean = |what: &str, r: &mesa_kernels::Result<()>| {
        assert!(!matches!(r, Err(Error::KernelArgument { .. })), "{what}: {r:?}");
    };
    for device in common::backends() {
        let empty = device.upload::<f32>(&[]).expect("up");
        let mut out = device.upload::<f32>(&[]).expect("up");
        let mut dx = device.upload::<f32>(&[]).expect("up");
        for grouping in [Grouping::Tensor, Grouping::Heads { axis: 0 }, Grouping::Channels { axis: 2, groups: 2 }] {
            let mut q = Quantizer::new(&device, QuantConfig { grouping, ..QuantConfig::per_tensor() }).expect("q");
            match gelu_forward(&device, &mut q, GeluForm::Erf, &tref(&empty, &l), &mut tmut(&mut out, &l)) {
                Ok(s) => clean(
                    "gelu backward",
                    &gelu_backward(&device, GeluForm::Erf, &s, &tref(&empty, &l), &mut tmut(&mut dx, &l)),
                ),
                Err(e) => clean("gelu forward", &Err(e)),
            }
            clean("gelu", &gelu(&device, GeluForm::Tanh, &tref(&empty, &l), &mut tmut(&mut out, &l)));
            let save = SoftmaxSave { grouping, ..SoftmaxSave::per_head(0) };
            match softmax_forward(
                &device,
                &save,
                &SoftmaxInput { x: &tref(&empty, &l), mask: None },
                &mut tmut(&mut out, &l),
            ) {
                Ok(s) => {
                    clean("softmax backward", &softmax_backward(&device, &s, &tref(&empty, &l), &mut tmut(&mut dx, &l)))
                }
                Err(e) => clean("softmax forward", &Err(e)),
            }
            clean(
                "softmax",
                &softmax(&device, &SoftmaxInput { x: &tref(&empty, &l), mask: None }, &mut tmut(&mut out, &l)),
            );
            let mut q = Quantizer::new(&device, QuantConfig { grouping, ..QuantConfig::per_tensor() }).expect("q");
            match layer_norm_forward(
                &device,
                &mut q,
                &LayerNormForward { x: &tref(&empty, &l), weight: None, bias: None, eps: 1e-5 },
                &mut tmut(&mut out, &l),
            ) {
                Ok(s) => {
                    let mut dw = device.upload(&[f32::NAN; 4]).expect("up");
                    let mut db = device.upload(&[f32::NAN; 4]).expect("up");
                    let r = layer_norm_backward(
                        &device,
                        &LayerNormBackward { saved: &s, weight: None, dy: &tref(&empty, &l) },
                        LayerNormGrads {
                            dx: &mut tmut(&mut dx, &l),
                            dweight: &mut vmut(&mut dw),
                            dbias: &mut vmut(&mut db),
                        },
                    );
                    clean("layer norm backward", &r);
                    if r.is_ok() {
                        assert!(dw.to_vec().expect("dw").iter().chain(&db.to_vec().expect("db")).all(|&v| v == 0.0));
                    }
                }
                Err(e) => clean("layer norm forward", &Err(e)),
            }
            clean(
                "layer norm",
                &layer_norm(
                    &device,
                    &LayerNormForward { x: &tref(&empty, &l), weight: None, bias: None, eps: 1e-5 },
                    &mut tmut(&mut out, &l),
                ),
            );
        }
    }
}

#[test]
fn every_input_output_pair_that_overlaps_is_rejected() {
    // One host vector seen as two raw slices: every op, every (input, output) pair in turn.
    let device = common::emulator();
    let mut rng = common::rng("alias_pairs");
    let (rows, cols) = (4, 16);
    let n = rows * cols;
    let l = Layout::contiguous(&[rows, cols]);
    let v = Layout::contiguous(&[cols]);
    let base: Vec<f32> = random(&mut rng, 2 * n, 0.5, 2.0);
    let mut shared = base.clone();
    let raw = raw_over(&mut shared);
    // the second half of the shared vector: overlapping views share an element with the first
    let (mut a, b) = (raw, raw);
    let aliased = |r: mesa_kernels::Result<()>, what: &str| {
        assert!(matches!(r, Err(Error::Aliasing { .. })), "{what}: {r:?}");
    };
    let xb = device.upload(&base[..n]).expect("up");
    let mut other = device.alloc_zeros::<f32>(n).expect("alloc");
    let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
    let gsaved = gelu_forward(&device, &mut q, GeluForm::Tanh, &tref(&xb, &l), &mut tmut(&mut other, &l)).expect("g");
    let ssaved = softmax_forward(
        &device,
        &SoftmaxSave::per_head(0),
        &SoftmaxInput::new(&tref(&xb, &l)),
        &mut tmut(&mut other, &l),
    )
    .expect("s");
    let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
    let lsaved =
        layer_norm_forward(&device, &mut q, &LayerNormForward::new(&tref(&xb, &l), 1e-5), &mut tmut(&mut other, &l))
            .expect("ln");
    // partially overlapping: the output starts in the middle of the input
    let shifted = Layout::strided(&[rows, cols], &[cols, 1], n / 2).expect("l");
    for out_l in [&l, &shifted] {
        let bv = tref(&b, &l);
        aliased(gelu(&device, GeluForm::Erf, &bv, &mut tmut(&mut a, out_l)), "gelu x/y");
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        aliased(
            gelu_forward(&device, &mut q, GeluForm::Erf, &bv, &mut tmut(&mut a, out_l)).map(drop),
            "gelu_forward x/y",
        );
        assert_eq!(q.batches(), 0, "a rejected call is not a batch");
        aliased(gelu_backward(&device, GeluForm::Erf, &gsaved, &bv, &mut tmut(&mut a, out_l)), "gelu_backward dy/dx");
        let xv = tref(&xb, &l);
        let plain = GeluBackwardPlain { form: GeluForm::Erf, x: &bv, dy: &xv };
        aliased(gelu_backward_plain(&device, &plain, &mut tmut(&mut a, out_l)), "gelu_backward_plain x/dx");
        let plain = GeluBackwardPlain { form: GeluForm::Erf, x: &xv, dy: &bv };
        aliased(gelu_backward_plain(&device, &plain, &mut tmut(&mut a, out_l)), "gelu_backward_plain dy/dx");
        aliased(softmax(&device, &SoftmaxInput::new(&bv), &mut tmut(&mut a, out_l)), "softmax x/y");
        aliased(softmax(&device, &SoftmaxInput::new(&xv).with_mask(&bv), &mut tmut(&mut a, out_l)), "softmax mask/y");
        let save = SoftmaxSave::per_head(0);
        aliased(
            softmax_forward(&device, &save, &SoftmaxInput::new(&bv), &mut tmut(&mut a, out_l)).map(drop),
            "softmax_forward x/y",
        );
        aliased(softmax_backward(&device, &ssaved, &bv, &mut tmut(&mut a, out_l)), "softmax_backward dy/dx");
        let plain = SoftmaxBackwardPlain { y: &bv, dy: &xv };
        aliased(softmax_backward_plain(&device, &plain, &mut tmut(&mut a, out_l)), "softmax_backward_plain y/dx");
        aliased(layer_norm(&device, &LayerNormForward::new(&bv, 1e-5), &mut tmut(&mut a, out_l)), "layer_norm x/y");
        // a vector inside both output views (elements n/2 + 8 .. n/2 + 8 + C)
        let inner = Layout::strided(&[cols], &[1], n / 2 + 8).expect("l");
        let w = tref(&b, &inner);
        let args = LayerNormForward { weight: Some(&w), ..LayerNormForward::new(&xv, 1e-5) };
        aliased(layer_norm(&device, &args, &mut tmut(&mut a, out_l)), "layer_norm weight/y");
        let args = LayerNormForward { bias: Some(&w), ..LayerNormForward::new(&xv, 1e-5) };
        let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
        aliased(
            layer_norm_forward(&device, &mut q, &args, &mut tmut(&mut a, out_l)).map(drop),
            "layer_norm_forward bias/y",
        );
        // backward: dy over each output in turn
        let mut dw = device.alloc_zeros::<f32>(cols).expect("a");
        let mut db = device.alloc_zeros::<f32>(cols).expect("a");
        let mut dx = device.alloc_zeros::<f32>(n).expect("a");
        let bargs = LayerNormBackward { saved: &lsaved, weight: None, dy: &bv };
        let g = LayerNormGrads { dx: &mut tmut(&mut a, out_l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) };
        aliased(layer_norm_backward(&device, &bargs, g), "layer_norm_backward dy/dx");
        let mut a2 = raw;
        let g =
            LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut tmut(&mut a2, &v), dbias: &mut vmut(&mut db) };
        aliased(layer_norm_backward(&device, &bargs, g), "layer_norm_backward dy/dweight");
        let wv = tref(&b, &v);
        let bargs = LayerNormBackward { saved: &lsaved, weight: Some(&wv), dy: &xv };
        let g =
            LayerNormGrads { dx: &mut tmut(&mut dx, &l), dweight: &mut vmut(&mut dw), dbias: &mut tmut(&mut a2, &v) };
        aliased(layer_norm_backward(&device, &bargs, g), "layer_norm_backward weight/dbias");
        // dweight and dbias over each other
        let (mut o1, mut o2) = (raw, raw);
        let bargs = LayerNormBackward { saved: &lsaved, weight: None, dy: &xv };
        let g = LayerNormGrads {
            dx: &mut tmut(&mut dx, &l),
            dweight: &mut tmut(&mut o1, &v),
            dbias: &mut tmut(&mut o2, &v),
        };
        aliased(layer_norm_backward(&device, &bargs, g), "layer_norm_backward dweight/dbias");
        let rv = tref(&b, &Layout::strided(&[rows], &[1], n / 2 + 8).expect("l"));
        let pargs = LayerNormBackwardPlain { xhat: &xv, rstd: &rv, weight: None, dy: &xv };
        let g = LayerNormGrads { dx: &mut tmut(&mut a, out_l), dweight: &mut vmut(&mut dw), dbias: &mut vmut(&mut db) };
        aliased(layer_norm_backward_plain(&device, &pargs, g), "layer_norm_backward_plain rstd/dx");
    }
    // nothing was written by any rejected call
    assert_eq!(shared, base, "a rejected call must not write");
    // disjoint halves of one buffer are fine
    let first = Layout::contiguous(&[rows, cols]);
    let second = Layout::strided(&[rows, cols], &[cols, 1], n).expect("l");
    let bv = tref(&b, &first);
    gelu(&device, GeluForm::Erf, &bv, &mut tmut(&mut a, &second)).expect("disjoint halves");
    let got = host_vec(&shared[n..]);
    for (i, g) in got.iter().enumerate() {
        let r = rf::gelu(f64::from(base[i]), GeluForm::Erf);
        assert!((g - r).abs() <= EPS * 16.0 * (r.abs() + f64::from(base[i]).abs()), "gelu[{i}] {g} vs {r}");
    }
}

fn host_vec(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

// ---------------------------------------------------------------------------------------
// Issue 10: numerical defect classes (GELU tail, LayerNorm near 1e20, softmax NaN rows in the
// separate code pass). They run on every backend, so the GPU bundle runs them on the GPU's own
// ex2/rcp approximations and expf.

/// `Φ(x)` for `x ≤ −8` from the asymptotic series `φ(x)/|x| · Σ (−1)^k (2k−1)!! / x^{2k}`
/// (its error is below the first omitted term: < 3e-12 relative at 16 terms for |x| ≥ 8), an
/// oracle independent of the reference's `erf`.
fn normal_cdf_tail(x: f64) -> f64 {
    let phi = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let (mut term, mut sum) = (1.0, 1.0);
    for k in 1..16 {
        term *= -f64::from(2 * k - 1) / (x * x);
        sum += term;
    }
    phi / x.abs() * sum
}

#[test]
fn reference_gelu_is_accurate_in_the_negative_tail() {
    // erf form: gelu(x) = x·Φ(x), gelu'(x) = Φ(x) + x·φ(x); tanh form: gelu(x) = x·σ(2u),
    // 1 + tanh(u) = 2σ(2u), computed here as 2·e^{2u}/(1 + e^{2u}) (no cancellation for u < 0).
    // The f64 reference must be within 1e-10 relative of these (they are good to ~1e-12).
    for &x in &[-8.0f64, -10.0, -14.0, -20.0, -30.0] {
        let phi = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let cdf = normal_cdf_tail(x);
        let checks = [
            ("erf gelu", rf::gelu(x, GeluForm::Erf), x * cdf),
            ("erf gelu'", rf::gelu_derivative(x, GeluForm::Erf), cdf + x * phi),
        ];
        for (what, got, want) in checks {
            assert!((got - want).abs() <= 1e-10 * want.abs(), "reference {what}({x}) = {got:e}, oracle {want:e}");
        }
    }
    for &x in &[-4.0f64, -6.0, -8.0, -10.0, -15.0] {
        let u = 0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x);
        let e = (2.0 * u).exp();
        let sig = e / (1.0 + e);
        let want = x * sig;
        let got = rf::gelu(x, GeluForm::Tanh);
        assert!((got - want).abs() <= 1e-10 * want.abs(), "reference tanh gelu({x}) = {got:e}, oracle {want:e}");
        // gelu'(x) = σ(2u) + 2x·σ(2u)·σ(−2u)·u'(x), u' = √(2/π)(1 + 3·0.044715·x²)
        let du = 0.797_884_560_802_865_4 * (1.0 + 3.0 * 0.044_715 * x * x);
        let want = sig + 2.0 * x * sig * (1.0 / (1.0 + e)) * du;
        let got = rf::gelu_derivative(x, GeluForm::Tanh);
        assert!((got - want).abs() <= 1e-10 * want.abs(), "reference tanh gelu'({x}) = {got:e}, oracle {want:e}");
    }
}

/// The bound on `|kernel − reference|` of GELU at `x` in f32 (ε = 2⁻²⁴), from the error
/// propagation of each form (no cancellation left: every term is a product or a sum of
/// terms of one sign, except gelu' near its root, bounded by the sum of the terms' sizes):
/// * erf (`kernels/gelu.cu`, `erf_parts`: `erfc(s/√2) = e^{−x²/2}·R(r)`, `s = |x|`,
///   `r = 1 − 6/(s + 3)`): the exponent `x²·(−log2(e)/2)` carries 2ε relative (two products),
///   which `e^{−x²/2}` turns into `x²ε ≤ 2x²ε`; `R` in f32 (the fit, its Horner scheme and a
///   correctly rounded reciprocal) is within 6.7ε for `s ≤ 6` and 10.3ε up to `s = 14`
///   (`scripts/fit_gelu_erfc.py`), the GPU's 1-ulp reciprocal adds up to 3ε, `ex2.approx`
///   is within 2⁻²² (4ε), the final product and fmaf 2ε: at most 15.7ε for `|x| ≤ 6`, and
///   19.3ε ≤ (3|x| + 16)ε beyond. So `rel ≤ (2x² + 3|x| + 16)ε`, and gelu' = Φ + xφ: the same
///   relative bound on each term (`xφ` reuses `e^{−x²/2}`), applied to `|Φ| + |xφ|`.
/// * tanh: `u = √(2/π)(x + 0.044715x³)` carries ≤ 6ε relative, so `e^{−2u}` carries
///   `12|u|ε` + 4 ulp; the sigmoid's division and the products add 6ε:
///   `rel ≤ (12|u| + 16)ε`, applied to `|σ| + |2xσσ'u'|` for gelu'.
///
/// The output type's rounding (`u_T·|ref|`) and an absolute floor at the bottom of the
/// normal range (results below ~1e-37 are subnormal or 0) come on top.
fn gelu_tail_tol(x: f64, form: GeluForm, derivative: bool, out_u: f64) -> f64 {
    let sqrt_2pi = (2.0 * std::f64::consts::PI).sqrt();
    let (rel, size) = match form {
        GeluForm::Erf => {
            let cdf = 0.5 * (1.0 + reference::fused::erf(x / std::f64::consts::SQRT_2));
            let cdf = if x < -8.0 { normal_cdf_tail(x) } else { cdf };
            let xphi = x * (-0.5 * x * x).exp() / sqrt_2pi;
            let size = if derivative { cdf.abs() + xphi.abs() } else { (x * cdf).abs() };
            ((2.0 * x * x + 3.0 * x.abs() + 16.0) * EPS, size)
        }
        GeluForm::Tanh => {
            let u = 0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x);
            let s = 1.0 / (1.0 + (-2.0 * u).exp());
            let sm = 1.0 / (1.0 + (2.0 * u).exp());
            let du = 0.797_884_560_802_865_4 * (1.0 + 3.0 * 0.044_715 * x * x);
            let size = if derivative { s.abs() + (2.0 * x * s * sm * du).abs() } else { (x * s).abs() };
            ((12.0 * u.abs() + 16.0) * EPS, size)
        }
    };
    let r = if derivative { rf::gelu_derivative(x, form) } else { rf::gelu(x, form) };
    rel * size + out_u * r.abs() + 1e-37
}

#[test]
fn gelu_negative_tail_keeps_its_relative_accuracy() {
    // x from −13 (the erf form's f32 result is still a normal number there) to 4 in steps of
    // 1/64 (exact in f32; bf16 gets 1/16, also exact): forward, plain backward (dy = 1) and
    // the fused forward (same values as the plain one), both forms, against the f64
    // reference with the bound of gelu_tail_tol. `1 + erf(x/√2)` and `1 + tanh(u)` lose every
    // digit there (0 below x ≈ −6 and −5.5).
    for device in common::backends() {
        for dtype in [DType::F32, DType::BF16] {
            with_dtype!(dtype, T, {
                let step = if dtype == DType::F32 { 64.0 } else { 16.0 };
                let xs: Vec<f64> = (0..).map(|k| -13.0 + f64::from(k) / step).take_while(|&x| x <= 4.0).collect();
                let x: Vec<T> = xs.iter().map(|&v| T::from_f64(v)).collect();
                let n = x.len();
                let l = Layout::contiguous(&[n]);
                let xb = device.upload(&x).expect("up");
                let dyb = device.upload(&vec![T::from_f64(1.0); n]).expect("up");
                let u = common::unit_roundoff(dtype);
                for form in [GeluForm::Erf, GeluForm::Tanh] {
                    let mut y = poisoned::<T>(&device, n);
                    gelu(&device, form, &tref(&xb, &l), &mut tmut(&mut y, &l)).expect("gelu");
                    let mut dx = poisoned::<T>(&device, n);
                    gelu_backward_plain(
                        &device,
                        &GeluBackwardPlain { form, x: &tref(&xb, &l), dy: &tref(&dyb, &l) },
                        &mut tmut(&mut dx, &l),
                    )
                    .expect("gelu_backward_plain");
                    let mut yf = poisoned::<T>(&device, n);
                    let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
                    let _s = gelu_forward(&device, &mut q, form, &tref(&xb, &l), &mut tmut(&mut yf, &l)).expect("fwd");
                    let (yh, dxh, yfh) = (host(&y), host(&dx), host(&yf));
                    let mut bad = Vec::new();
                    for i in 0..n {
                        let (r, rd) = (rf::gelu(xs[i], form), rf::gelu_derivative(xs[i], form));
                        let (t, td) = (gelu_tail_tol(xs[i], form, false, u), gelu_tail_tol(xs[i], form, true, u));
                        if (yh[i] - r).abs().is_nan() || (yh[i] - r).abs() > t || yfh[i].to_bits() != yh[i].to_bits() {
                            bad.push((
                                xs[i],
                                format!(
                                    "{form:?} {dtype:?} gelu({}) = {:e} (fused {:e}), reference {r:e}",
                                    xs[i], yh[i], yfh[i]
                                ),
                            ));
                        }
                        if (dxh[i] - rd).abs().is_nan() || (dxh[i] - rd).abs() > td {
                            bad.push((
                                xs[i],
                                format!("{form:?} {dtype:?} gelu'({}) = {:e}, reference {rd:e}", xs[i], dxh[i]),
                            ));
                        }
                    }
                    // show the whole and half integers, where the issue quotes the errors
                    let shown: Vec<&str> = bad
                        .iter()
                        .filter(|(x, _)| bad.len() <= 24 || (2.0 * x).fract() == 0.0)
                        .map(|(_, s)| s.as_str())
                        .take(24)
                        .collect();
                    assert!(bad.is_empty(), "{} elements off, e.g.:\n{}", bad.len(), shown.join("\n"));
                }
            });
        }
    }
}

#[test]
fn layer_norm_of_finite_rows_near_1e20_does_not_overflow() {
    // Rows around 1e20 with deviations ~1e19: (x − mean)² ~ 1e38, and their sum over a row
    // overflows f32 (FLT_MAX ≈ 3.4e38), which made rstd 0 and the whole row 0. Every value is
    // finite and so is every result: x̂ = (x − mean)/σ is O(1). Checked by check_layer_norm
    // against the f64 reference with its derived bounds (all relative to max|x| and rstd, so
    // they scale with the data), in f32 and bf16, on the warp (64, 1000), block (2500) and
    // streaming (5000) paths, and with rows at ±3e37 (near FLT_MAX/10) and tiny deviations.
    let mut rng = common::rng("ln_near_1e20");
    for device in common::backends() {
        for dtype in [DType::F32, DType::BF16] {
            with_dtype!(dtype, T, {
                for (cols, center, spread) in [
                    (64usize, 1e20, 1e19),
                    (1000, -1e20, 3e19),
                    (2500, 1e20, 1e19),
                    (5000, 3e19, 1e20),
                    (64, 3e37, 1e37),
                ] {
                    let rows = 3;
                    let x: Vec<T> = random(&mut rng, rows * cols, center, spread);
                    let dy: Vec<T> = random(&mut rng, rows * cols, 0.0, 1.0);
                    let mut q = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
                    let saved = check_layer_norm(
                        &device,
                        &mut q,
                        &x,
                        &Layout::contiguous(&[rows, cols]),
                        None,
                        None,
                        &dy,
                        true,
                    );
                    let rstd = saved.rstd().to_vec().expect("rstd");
                    assert!(rstd.iter().all(|&r| r > 0.0 && r.is_finite()), "{dtype:?} C={cols}: rstd {rstd:?}");
                }
            });
        }
    }
}

#[test]
fn softmax_nan_rows_in_the_separate_code_pass_are_counted_and_poison_their_group() {
    // Rows whose codes do not start on a byte (C·bits % 8 ≠ 0: the codes come from a second
    // pass over y) must behave as the fused pass (softmax_nan_and_inf_logits_...): the
    // non-finite outputs are counted, their group's scale is NaN, so the group decodes to NaN
    // and its backward gives NaN — never finite stand-ins. Exact checks, no tolerance.
    for device in common::backends() {
        for (cols, bits) in [(7usize, 4u32), (9, 2), (197, 4), (5, 8)] {
            let fused_pass = cols * bits as usize % 8 == 0;
            let rows = 4;
            let l = Layout::contiguous(&[2, 2, cols]);
            let mut x = vec![0.5f32; rows * cols];
            x[1] = f32::NAN; // row 0 (batch 0, head 0)
            x[2 * cols + 2] = f32::INFINITY; // row 2 (batch 1, head 0)
            let xb = device.upload(&x).expect("up");
            let mut y = poisoned::<f32>(&device, rows * cols);
            let save = SoftmaxSave { bits, ..SoftmaxSave::per_head(1) };
            let saved =
                softmax_forward(&device, &save, &SoftmaxInput { x: &tref(&xb, &l), mask: None }, &mut tmut(&mut y, &l))
                    .expect("fwd");
            let tag = format!("C = {cols}, {bits} bits (fused pass: {fused_pass})");
            assert_eq!(saved.nonfinite_count().expect("count"), 2 * cols as u32, "{tag}: non-finite outputs counted");
            let params = saved.params().expect("params");
            assert!(
                params[0].scale.is_nan() && !params[1].scale.is_nan(),
                "{tag}: head 0 poisoned, head 1 not: {params:?}"
            );
            let mut p = poisoned::<f32>(&device, rows * cols);
            saved.dequantize(&device, &mut TensorMut::new(&mut p, &l).expect("view")).expect("decode");
            for (i, v) in p.to_vec().expect("p").iter().enumerate() {
                let head = (i / cols) % 2;
                assert_eq!(v.is_nan(), head == 0, "{tag}: decoded p[{i}] = {v}");
            }
            let dyb = device.upload(&vec![1.0f32; rows * cols]).expect("up");
            let mut dx = poisoned::<f32>(&device, rows * cols);
            softmax_backward(&device, &saved, &tref(&dyb, &l), &mut tmut(&mut dx, &l)).expect("bwd");
            for (i, v) in dx.to_vec().expect("dx").iter().enumerate() {
                let head = (i / cols) % 2;
                assert_eq!(v.is_nan(), head == 0, "{tag}: dx[{i}] = {v}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// SwiGLU

/// SwiGLU forward with codes of both inputs + backward from codes against the reference, and
/// the codes bit for bit those of twin quantizers with the same history.
#[allow(clippy::too_many_arguments)]
fn check_swiglu<T: Element>(
    device: &Device,
    quantizers: (&mut Quantizer, &mut Quantizer),
    twins: (&mut Quantizer, &mut Quantizer),
    storage: (&[T], &Layout, &Layout),
    dy: &[T],
    exact_stats: bool,
) {
    let (store, g_layout, u_layout) = storage;
    let shape = g_layout.shape().to_vec();
    let n: usize = shape.iter().product();
    let u_t = common::unit_roundoff(T::DTYPE);
    let sb = device.upload(store).expect("up");
    let (gv, uv) = (tref(&sb, g_layout), tref(&sb, u_layout));
    let input = SwigluInput { gate: &gv, up: &uv };
    let dense = Layout::contiguous(&shape);
    let mut y = poisoned::<T>(device, n);
    let saved = swiglu_forward(
        device,
        SwigluQuantizers { gate: quantizers.0, up: quantizers.1 },
        &input,
        &mut tmut(&mut y, &dense),
    )
    .expect("swiglu_forward");
    let (gs, us) = (reference::gather(store, g_layout), reference::gather(store, u_layout));
    for (i, yv) in host(&y).iter().enumerate() {
        let r = rf::swiglu(gs[i], us[i]);
        let tol = (u_t + 16.0 * EPS) * r.abs() + tiny(T::DTYPE);
        assert!((yv - r).abs() <= tol, "swiglu y[{i}] = {yv}, reference {r} (g {}, u {}, tol {tol})", gs[i], us[i]);
    }
    // the codes of g and u: those of Quantizer::quantize on each, bit for bit
    let to_dense = |v: &[f64]| device.upload(&v.iter().map(|x| T::from_f64(*x)).collect::<Vec<T>>()).expect("up");
    same_as_quantizer(twins.0, &saved.gate, &to_dense(&gs));
    same_as_quantizer(twins.1, &saved.up, &to_dense(&us));
    assert_eq!(saved.size_in_bytes(), saved.gate.size_in_bytes() + saved.up.size_in_bytes());
    // backward from codes vs the reference on the decoded values, and vs exact g, u
    let (dg_hat, du_hat) = (decode_host(&saved.gate), decode_host(&saved.up));
    let (sg, su) = (max_scale(&saved.gate), max_scale(&saved.up));
    let dyb = device.upload(dy).expect("up");
    let (mut dg, mut du) = (poisoned::<T>(device, n), poisoned::<T>(device, n));
    swiglu_backward(
        device,
        &saved,
        &tref(&dyb, &dense),
        SwigluGrads { gate: &mut tmut(&mut dg, &dense), up: &mut tmut(&mut du, &dense) },
    )
    .expect("swiglu_backward");
    let dys = reference::gather(dy, &dense);
    for (i, (a, b)) in host(&dg).iter().zip(host(&du)).enumerate() {
        let (g, u, d) = (dg_hat[i], du_hat[i], dys[i]);
        let (rg, ru) = rf::swiglu_backward(g, u, d);
        let tg = u_t * rg.abs() + 16.0 * EPS * (d * u).abs() * (1.0 + g.abs()) + tiny(T::DTYPE);
        let tu = (u_t + 16.0 * EPS) * ru.abs() + tiny(T::DTYPE);
        assert!((a - rg).abs() <= tg, "swiglu dg[{i}] = {a}, reference {rg} (g^ {g}, u^ {u}, tol {tg})");
        assert!((b - ru).abs() <= tu, "swiglu du[{i}] = {b}, reference {ru} (g^ {g}, tol {tu})");
        if exact_stats {
            // |silu'| <= 1.1 and |silu''| <= 0.5: half a step of g and of u moves the gradients
            // by at most this much
            let (eg, eu) = rf::swiglu_backward(gs[i], us[i], d);
            let qg =
                d.abs() * (1.1 * 0.5 * su + (us[i].abs() + 0.5 * su) * 0.5 * 0.5 * sg) * 1.01 + tg + u_t * eg.abs();
            let qu = d.abs() * 1.1 * 0.5 * sg * 1.01 + tu + u_t * eu.abs();
            assert!((a - eg).abs() <= qg, "swiglu dg[{i}] = {a} vs exact-input backward {eg} (tol {qg})");
            assert!((b - eu).abs() <= qu, "swiglu du[{i}] = {b} vs exact-input backward {eu} (tol {qu})");
        }
    }
}

#[test]
fn swiglu_parity_every_dtype_width_and_rounding() {
    let mut rng = common::rng("swiglu_parity");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                for bits in [8, 4, 2] {
                    for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 11 }] {
                        // [B, N, F] with 12 channel groups, gate and up stored side by side as
                        // the halves of one fused [B, N, 2F] projection
                        let (b, t, f) = (2usize, 13usize, 96usize);
                        let whole = Layout::contiguous(&[b, t, 2 * f]);
                        let gate = Layout::strided(&[b, t, f], whole.strides(), 0).expect("gate view");
                        let up = Layout::strided(&[b, t, f], whole.strides(), f).expect("up view");
                        let config = QuantConfig { bits, rounding, ..fused::channel_groups(2, 12) };
                        let q = || Quantizer::new(&device, config).expect("q");
                        let (mut qg, mut qu, mut tg, mut tu) = (q(), q(), q(), q());
                        for batch in 0..2 {
                            let s: Vec<T> = random(&mut rng, b * t * 2 * f, 0.2, 5.0);
                            let dy: Vec<T> = random(&mut rng, b * t * f, 0.0, 1.0);
                            let exact = batch == 0 && rounding == Rounding::Nearest;
                            check_swiglu(&device, (&mut qg, &mut qu), (&mut tg, &mut tu), (&s, &gate, &up), &dy, exact);
                        }
                        // odd total size, one group per tensor, two separate dense tensors in one buffer
                        let pt = QuantConfig { bits, ..QuantConfig::per_tensor() };
                        let q = || Quantizer::new(&device, pt).expect("q");
                        let (mut qg, mut qu, mut tg, mut tu) = (q(), q(), q(), q());
                        let s: Vec<T> = random(&mut rng, 154, -0.5, 8.0);
                        let dy: Vec<T> = random(&mut rng, 77, 0.0, 2.0);
                        let (gate, up) =
                            (Layout::contiguous(&[7, 11]), Layout::strided(&[7, 11], &[11, 1], 77).expect("up"));
                        check_swiglu(&device, (&mut qg, &mut qu), (&mut tg, &mut tu), (&s, &gate, &up), &dy, true);
                    }
                }
            });
        }
    }
}

#[test]
fn swiglu_plain_forward_and_backward_match_the_reference() {
    let mut rng = common::rng("swiglu_plain");
    for device in common::backends() {
        for dtype in dtypes() {
            with_dtype!(dtype, T, {
                // the tails: silu(g) -> 0 below -80, silu(g) -> g above 80, and g = 0
                let mut s: Vec<T> = random(&mut rng, 2 * 300, 0.0, 12.0);
                for (k, v) in [-90.0, -30.0, -1.2785, 0.0, 1e-3, 30.0, 90.0].iter().enumerate() {
                    s[k] = T::from_f64(*v);
                }
                let (gate, up) = (Layout::contiguous(&[300]), Layout::strided(&[300], &[1], 300).expect("up"));
                let sb = device.upload(&s).expect("up");
                let (gv, uv) = (tref(&sb, &gate), tref(&sb, &up));
                let input = SwigluInput { gate: &gv, up: &uv };
                let dense = Layout::contiguous(&[300]);
                let mut y = poisoned::<T>(&device, 300);
                swiglu(&device, &input, &mut tmut(&mut y, &dense)).expect("swiglu");
                let dy: Vec<T> = random(&mut rng, 300, 0.0, 1.0);
                let dyb = device.upload(&dy).expect("up");
                let (mut dg, mut du) = (poisoned::<T>(&device, 300), poisoned::<T>(&device, 300));
                let grads = SwigluGrads { gate: &mut tmut(&mut dg, &dense), up: &mut tmut(&mut du, &dense) };
                swiglu_backward_plain(&device, &input, &tref(&dyb, &dense), grads).expect("backward");
                let u_t = common::unit_roundoff(T::DTYPE);
                let (ys, dgs, dus) = (host(&y), host(&dg), host(&du));
                for i in 0..300 {
                    let (g, u, d) = (s[i].to_f64(), s[300 + i].to_f64(), dy[i].to_f64());
                    let r = rf::swiglu(g, u);
                    let (rg, ru) = rf::swiglu_backward(g, u, d);
                    let (ty, tu) = ((u_t + 16.0 * EPS) * r.abs(), (u_t + 16.0 * EPS) * ru.abs());
                    let tg = u_t * rg.abs() + 16.0 * EPS * (d * u).abs() * (1.0 + g.abs());
                    let t = tiny(T::DTYPE);
                    assert!((ys[i] - r).abs() <= ty + t, "{dtype:?} y[{i}] = {} vs {r} (g {g}, u {u})", ys[i]);
                    assert!((dgs[i] - rg).abs() <= tg + t, "{dtype:?} dg[{i}] = {} vs {rg} (g {g})", dgs[i]);
                    assert!((dus[i] - ru).abs() <= tu + t, "{dtype:?} du[{i}] = {} vs {ru} (g {g})", dus[i]);
                }
            });
        }
    }
}

#[test]
fn swiglu_bad_input_is_an_error() {
    let device = common::emulator();
    let a = device.upload(&[1.0f32; 64]).expect("up");
    let mut y = device.alloc_zeros::<f32>(64).expect("alloc");
    let (l8, l4) = (Layout::contiguous(&[8, 8]), Layout::contiguous(&[4, 8]));
    let (g, u) = (tref(&a, &l8), tref(&a, &l4));
    // gate and up of different shapes
    let r = swiglu(&device, &SwigluInput { gate: &g, up: &u }, &mut tmut(&mut y, &l8));
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
    // an output of another shape
    let r = swiglu(&device, &SwigluInput { gate: &g, up: &g }, &mut tmut(&mut y, &l4));
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
    // du over dy: the launch refuses an output that overlaps an input
    let mut q1 = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
    let mut q2 = Quantizer::new(&device, QuantConfig::per_tensor()).expect("q");
    let saved = swiglu_forward(
        &device,
        SwigluQuantizers { gate: &mut q1, up: &mut q2 },
        &SwigluInput { gate: &g, up: &g },
        &mut tmut(&mut y, &l8),
    )
    .expect("forward");
    let mut storage = vec![0.5f32; 64];
    let (dy, mut du) = (raw_over(&mut storage), raw_over(&mut storage));
    let mut dg = device.alloc_zeros::<f32>(64).expect("alloc");
    let r = swiglu_backward(
        &device,
        &saved,
        &tref(&dy, &l8),
        SwigluGrads { gate: &mut tmut(&mut dg, &l8), up: &mut tmut(&mut du, &l8) },
    );
    assert!(matches!(r, Err(Error::Aliasing { .. })), "du over dy: {r:?}");
}
