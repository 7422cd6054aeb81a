//! Each op against burn's own op on Flex: the forward (f32, and f16/bf16 against mesa-kernels'
//! f64 reference), the gradients at 8, 4 and 2 bits under both checkpointing strategies, the
//! untracked and inference routes, the module wrappers, and the typed errors.
//!
//! Every bound is derived in a comment next to it. `U = 2^-24` is f32's unit roundoff;
//! `s = (max − min)/(2^bits − 1)` is the step of the per-tensor codes, and nearest rounding
//! decodes each element within `s/2` of its value.
//!
//! Deliberate break (checked while writing these tests): making `HostCodes::view` hand the
//! backward parameters with the scale set to 0 (every code decodes to the group's offset)
//! fails every gradient test (GELU, LayerNorm, RMSNorm, softmax, Linear, SwiGLU) and no
//! forward or route test, as it should.
mod common;

use burn::tensor::{activation, module, DType, Device, Tensor};
use common::{
    assert_within, autodiff_devices, data, gelu_f32_error, gelu_second_derivative_bound, linear_attention_magnitudes,
    rounded, step, tensor, values, U,
};
use mesa_burn::{Codes, Error, GeluForm};
use mesa_kernels::reference::fused as reference;

fn burn_gelu<const D: usize>(x: Tensor<D>, form: GeluForm) -> Tensor<D> {
    match form {
        GeluForm::Erf => activation::gelu(x),
        GeluForm::Tanh => activation::gelu_approximate(x),
    }
}

#[test]
fn gelu_forward_matches_burn_f32() {
    let device = Device::flex();
    let xv = data(4096, 1, -6.0, 6.0);
    for form in [GeluForm::Erf, GeluForm::Tanh] {
        let x = tensor(&xv, [64, 64], DType::F32, &device);
        let ours = values(&mesa_burn::gelu(x.clone(), form, Codes::default()).unwrap());
        let theirs = values(&burn_gelu(x, form));
        assert_within(&format!("gelu {form:?} f32"), &ours, &theirs, |i| gelu_f32_error(xv[i] as f64));
    }
}

#[test]
fn gelu_forward_f16_bf16_match_the_reference() {
    // The kernel computes in f32 and rounds once to the output dtype: |y − ref| ≤ half an
    // ulp of the output (2^-11·|ref| for f16, 2^-8·|ref| for bf16, plus f16's smallest
    // subnormal half-step 2^-25) + the f32 error (one implementation: half of gelu_f32_error),
    // on the input as rounded to the dtype.
    for (dtype, rel) in [(DType::F16, 2f64.powi(-11)), (DType::BF16, 2f64.powi(-8))] {
        for device in [Device::flex(), Device::flex().autodiff()] {
            let xv = rounded(&data(2048, 2, -5.0, 5.0), dtype);
            let mut x = tensor(&xv, [32, 64], dtype, &device);
            if device.is_autodiff() {
                x = x.require_grad();
            }
            let y = mesa_burn::gelu(x, GeluForm::Erf, Codes::bits(4)).unwrap();
            assert_eq!(y.dtype(), dtype);
            let ours = values(&y);
            let want: Vec<f32> = xv.iter().map(|&x| reference::gelu(x as f64, GeluForm::Erf) as f32).collect();
            assert_within(&format!("gelu {dtype:?}"), &ours, &want, |i| {
                let r = want[i].abs() as f64;
                rel * r + 2f64.powi(-25) + gelu_f32_error(xv[i] as f64) / 2.0 + U * r
            });
        }
    }
}

#[test]
fn gelu_gradients_match_burn() {
    // L = Σ c⊙gelu(x), so dx = c⊙gelu'(x̃) at the decoded x̃ (ours) against c⊙gelu'(x)
    // (burn's). |gelu'(x̃) − gelu'(x)| ≤ K·|x̃ − x| ≤ K·s/2 with K = max|gelu''|, hence
    // |Δdx_i| ≤ |c_i|·(K·s/2 + f32 error of gelu').
    let (rows, cols) = (48, 96);
    let xv = data(rows * cols, 3, -4.0, 4.0);
    let cv = data(rows * cols, 4, -1.0, 1.0);
    for form in [GeluForm::Erf, GeluForm::Tanh] {
        let k = gelu_second_derivative_bound(form);
        for bits in [8, 4, 2] {
            let s = step(&xv, bits);
            for device in autodiff_devices() {
                let c = tensor(&cv, [rows, cols], DType::F32, &device);
                let x = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
                let y = mesa_burn::gelu(x.clone(), form, Codes::bits(bits)).unwrap();
                let ours = values(&x.grad(&(y * c.clone()).sum().backward()).unwrap());

                let x2 = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
                let theirs = values(&x2.grad(&(burn_gelu(x2.clone(), form) * c).sum().backward()).unwrap());
                assert_within(&format!("gelu {form:?} dx {bits}-bit"), &ours, &theirs, |i| {
                    (cv[i].abs() as f64) * (k * s / 2.0 + gelu_f32_error(xv[i] as f64))
                });
            }
        }
    }
}

#[test]
fn untracked_and_inference_routes_give_the_tracked_forward() {
    // All three routes run the same f32 kernel arithmetic on the same input (the saving
    // forward only adds the codes), so the outputs are identical bit for bit.
    let xv = data(1024, 5, -3.0, 3.0);
    let run = |device: &Device, grad: bool| {
        let mut x = tensor(&xv, [16, 64], DType::F32, device);
        if grad {
            x = x.require_grad();
        }
        values(&mesa_burn::gelu(x, GeluForm::Erf, Codes::bits(2)).unwrap())
    };
    let tracked = run(&Device::flex().autodiff(), true);
    assert_eq!(run(&Device::flex().autodiff(), false), tracked, "untracked autodiff input");
    assert_eq!(run(&Device::flex(), false), tracked, "inference device");
}

/// LayerNorm test data: rows with different means and spreads, so rstd varies by row.
fn ln_data(rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = data(rows * cols, 6, -1.0, 1.0);
    for r in 0..rows {
        for v in &mut x[r * cols..(r + 1) * cols] {
            *v = *v * (0.5 + r as f32 * 0.25) + (r as f32 - 4.0);
        }
    }
    (x, data(cols, 7, 0.5, 1.5), data(cols, 8, -0.5, 0.5))
}

const EPS: f64 = 1e-5;

#[test]
fn layer_norm_forward_matches_burn_f32() {
    // Both compute mean and variance in f32 over C values: relative error of each ≤ C·U
    // (pairwise or serial summation), so |Δx̂| ≤ 2·C·U·(|x̂| + 1) per implementation; y =
    // x̂·w + b adds 2 roundings. Two implementations: 4·C·U·(|x̂|+1)·|w| + 4·U·|y|.
    let (rows, cols) = (16, 64);
    let (xv, wv, bv) = ln_data(rows, cols);
    let device = Device::flex();
    let x = tensor(&xv, [rows, cols], DType::F32, &device);
    let w = tensor(&wv, [cols], DType::F32, &device);
    let b = tensor(&bv, [cols], DType::F32, &device);
    let ours = values(&mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), EPS, Codes::default()).unwrap());
    let theirs = values(&module::layer_norm(x, w, Some(b), EPS));
    let x64: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    let f = reference::layer_norm_rows(&x64, None, None, EPS, cols);
    assert_within("layer_norm f32", &ours, &theirs, |i| {
        let c = i % cols;
        4.0 * cols as f64 * U * (f.xhat[i].abs() + 1.0) * wv[c] as f64 + 4.0 * U * theirs[i].abs() as f64
    });
}

#[test]
fn layer_norm_gradients_match_burn() {
    // L = Σ c⊙y; a = c⊙w per row. Exact: dx = rstd·(a − mean(a) − x̂·mean(a⊙x̂)). The backward
    // reads x̃ = x̂ + δ, |δ| ≤ s/2 (s: step of the codes of x̂), so
    //   |Δdx_i| ≤ rstd·(s/2·|mean(a⊙x̂)| + |x̂_i|·mean|a|·s/2 + (s/2)²·mean|a|),
    //   |Δdw_c| ≤ s/2·Σ_rows |c|   (dw = Σ_rows c⊙x̃),   db = Σ_rows c is exact.
    // Plus f32 summation over C (dx) or rows (dw, db): 4·n·U times the sum of magnitudes.
    let (rows, cols) = (16, 64);
    let (xv, wv, bv) = ln_data(rows, cols);
    let cv = data(rows * cols, 9, -1.0, 1.0);
    let x64: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    let f = reference::layer_norm_rows(&x64, None, None, EPS, cols);
    let xhat32: Vec<f32> = f.xhat.iter().map(|&v| v as f32).collect();
    for bits in [8, 4, 2] {
        // the kernel's x̂ is f32: its range differs from the f64 one by a few U
        let s = step(&xhat32, bits) * (1.0 + 1e-5);
        for device in autodiff_devices() {
            let grads = |mesa: bool| {
                let x = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
                let w = tensor(&wv, [cols], DType::F32, &device).require_grad();
                let b = tensor(&bv, [cols], DType::F32, &device).require_grad();
                let c = tensor(&cv, [rows, cols], DType::F32, &device);
                let y = if mesa {
                    mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), EPS, Codes::bits(bits)).unwrap()
                } else {
                    module::layer_norm(x.clone(), w.clone(), Some(b.clone()), EPS)
                };
                let g = (y * c).sum().backward();
                (values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap()), values(&b.grad(&g).unwrap()))
            };
            let (dx, dw, db) = grads(true);
            let (dx0, dw0, db0) = grads(false);
            let a = |i: usize| cv[i] as f64 * wv[i % cols] as f64;
            let row_stats: Vec<(f64, f64)> = (0..rows)
                .map(|r| {
                    let idx = r * cols..(r + 1) * cols;
                    let m_ax = idx.clone().map(|i| a(i) * f.xhat[i]).sum::<f64>() / cols as f64;
                    let m_a = idx.map(|i| a(i).abs()).sum::<f64>() / cols as f64;
                    (m_ax, m_a)
                })
                .collect();
            assert_within(&format!("layer_norm dx {bits}-bit"), &dx, &dx0, |i| {
                let r = i / cols;
                let (m_ax, m_a) = row_stats[r];
                let rstd = f.rstd[r];
                let h = s / 2.0;
                rstd * (h * m_ax.abs() + f.xhat[i].abs() * m_a * h + h * h * m_a)
                    + 4.0 * cols as f64 * U * rstd * m_a * (2.0 + f.xhat[i].abs()) * 2.0
            });
            let col_sum = |c: usize, g: &dyn Fn(usize) -> f64| (0..rows).map(|r| g(r * cols + c)).sum::<f64>();
            assert_within(&format!("layer_norm dweight {bits}-bit"), &dw, &dw0, |c| {
                s / 2.0 * col_sum(c, &|i| cv[i].abs() as f64)
                    + 4.0 * rows as f64 * U * col_sum(c, &|i| (cv[i] as f64 * f.xhat[i]).abs())
            });
            assert_within(&format!("layer_norm dbias {bits}-bit"), &db, &db0, |c| {
                4.0 * rows as f64 * U * col_sum(c, &|i| cv[i].abs() as f64)
            });
        }
    }
}

#[test]
fn linear_forward_matches_burn_and_gradients_at_each_bit_width() {
    // Forward: both are an f32 matmul over d_in plus a bias: |Δy| ≤ 2·(d_in+1)·U·(Σ|x||w| + |b|)
    // (each within γ_{d_in+1} ≈ (d_in+1)·U of its sum of magnitudes).
    // Gradients, L = Σ c⊙y: dx = c·Wᵀ reads W itself (same f32 bound over d_out);
    // dW = x̃ᵀ·c with |x̃ − x| ≤ s/2: |ΔdW_kj| ≤ s/2·Σ_i|c_ij| + 2·N·U·Σ_i|x_ik c_ij|;
    // db = Σ_i c_ij: 2·N·U·Σ_i|c_ij|.
    let (b0, b1, d_in, d_out) = (2, 16, 48, 24);
    let n = b0 * b1;
    let xv = data(n * d_in, 10, -2.0, 3.0);
    let wv = data(d_in * d_out, 11, -0.3, 0.3);
    let bv = data(d_out, 12, -0.1, 0.1);
    let cv = data(n * d_out, 13, -1.0, 1.0);
    let xi = |i: usize, k: usize| xv[i * d_in + k] as f64;
    let wi = |k: usize, j: usize| wv[k * d_out + j] as f64;
    let ci = |i: usize, j: usize| cv[i * d_out + j] as f64;
    for bits in [8, 4, 2] {
        let s = step(&xv, bits);
        for device in autodiff_devices() {
            let run = |mesa: bool| {
                let x = tensor(&xv, [b0, b1, d_in], DType::F32, &device).require_grad();
                let w = tensor(&wv, [d_in, d_out], DType::F32, &device).require_grad();
                let b = tensor(&bv, [d_out], DType::F32, &device).require_grad();
                let c = tensor(&cv, [b0, b1, d_out], DType::F32, &device);
                let y = if mesa {
                    mesa_burn::linear(x.clone(), w.clone(), Some(b.clone()), Codes::bits(bits)).unwrap()
                } else {
                    module::linear(x.clone(), w.clone(), Some(b.clone()))
                };
                let yv = values(&y);
                let g = (y * c).sum().backward();
                (yv, values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap()), values(&b.grad(&g).unwrap()))
            };
            let (y, dx, dw, db) = run(true);
            let (y0, dx0, dw0, db0) = run(false);
            assert_within("linear y", &y, &y0, |e| {
                let (i, j) = (e / d_out, e % d_out);
                2.0 * (d_in + 1) as f64
                    * U
                    * ((0..d_in).map(|k| (xi(i, k) * wi(k, j)).abs()).sum::<f64>() + bv[j].abs() as f64)
            });
            assert_within("linear dx", &dx, &dx0, |e| {
                let (i, k) = (e / d_in, e % d_in);
                2.0 * d_out as f64 * U * (0..d_out).map(|j| (ci(i, j) * wi(k, j)).abs()).sum::<f64>()
            });
            assert_within(&format!("linear dweight {bits}-bit"), &dw, &dw0, |e| {
                let (k, j) = (e / d_out, e % d_out);
                s / 2.0 * (0..n).map(|i| ci(i, j).abs()).sum::<f64>()
                    + 2.0 * n as f64 * U * (0..n).map(|i| (xi(i, k) * ci(i, j)).abs()).sum::<f64>()
            });
            assert_within("linear dbias", &db, &db0, |j| {
                2.0 * n as f64 * U * (0..n).map(|i| ci(i, j).abs()).sum::<f64>()
            });
        }
    }
}

#[test]
fn modules_mirror_burn_nn() {
    // Same parameters, same forward up to the f32 bounds above (loosely: the largest of them
    // for these sizes is below 1e-4 for |values| ≤ 10): a model swaps the type and keeps
    // its weights.
    use mesa_burn::nn::{GeluConfig, LayerNormConfig, LinearConfig};
    let device = Device::flex();
    device.seed(3);
    let ours = LinearConfig::new(32, 16).init(&device);
    let theirs = burn::nn::Linear { weight: ours.weight.clone(), bias: ours.bias.clone() };
    assert_eq!(ours.weight.dims(), [32, 16]);
    let x = tensor(&data(8 * 32, 14, -1.0, 1.0), [8, 32], DType::F32, &device);
    let y = values(&ours.forward(x.clone()).unwrap());
    let y0 = values(&theirs.forward(x.clone()));
    // Kaiming uniform bound 1/√d_in·... ≤ 0.18: |y| ≤ 32·0.18 + 0.18; bound 2·33·U·6
    assert_within("Linear module", &y, &y0, |_| 2.0 * 33.0 * U * 6.0);
    let ln = LayerNormConfig::new(16).with_bits(4).init(&device);
    let yn = values(
        &ln.forward(Tensor::<2>::from_data(burn::tensor::TensorData::new(y0.clone(), [8, 16]), &device)).unwrap(),
    );
    let yn0 = values(
        &burn::nn::LayerNormConfig::new(16)
            .init(&device)
            .forward(Tensor::<2>::from_data(burn::tensor::TensorData::new(y0, [8, 16]), &device)),
    );
    // x̂ ≤ √16 = 4 in magnitude: 4·16·U·5 per implementation pair (see the LayerNorm test)
    assert_within("LayerNorm module", &yn, &yn0, |_| 4.0 * 16.0 * U * 5.0 + 4.0 * U * 4.0);
    let g = GeluConfig::new().with_bits(2).init();
    let yg = values(&g.forward(x.clone()).unwrap());
    let yg0 = values(&activation::gelu(x));
    assert_within("Gelu module", &yg, &yg0, |_| gelu_f32_error(1.0));
}

#[test]
fn bad_input_is_a_typed_error_before_dispatch() {
    let device = Device::flex().autodiff();
    let x = tensor(&data(64, 15, -1.0, 1.0), [4, 16], DType::F32, &device);
    let w = tensor(&data(16, 16, 0.5, 1.5), [16], DType::F32, &device);
    let b = tensor(&data(16, 17, -0.5, 0.5), [16], DType::F32, &device);
    assert!(matches!(
        mesa_burn::gelu(x.clone(), GeluForm::Erf, Codes::bits(3)),
        Err(Error::Config { what: "bits", .. })
    ));
    assert!(matches!(
        mesa_burn::gelu(x.clone().cast(DType::F64), GeluForm::Erf, Codes::bits(8)),
        Err(Error::Dtype { .. })
    ));
    let w8 = tensor(&data(8, 18, 0.5, 1.5), [8], DType::F32, &device);
    assert!(matches!(
        mesa_burn::layer_norm(x.clone(), w8, b.clone(), EPS, Codes::default()),
        Err(Error::Shape { what: "weight", .. })
    ));
    assert!(matches!(
        mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), 0.0, Codes::default()),
        Err(Error::Config { what: "eps", .. })
    ));
    assert!(matches!(
        mesa_burn::layer_norm(x.clone(), w.clone().cast(DType::F16), b.clone(), EPS, Codes::default()),
        Err(Error::DtypeMismatch { what: "weight" })
    ));
    let wl = tensor(&data(12 * 4, 19, -1.0, 1.0), [12, 4], DType::F32, &device);
    assert!(matches!(mesa_burn::linear(x.clone(), wl, None, Codes::default()), Err(Error::Shape { what: "x", .. })));
}

/// x̂ = x/sqrt(mean(x²) + eps) per row (f64) and the rows' rstd.
fn rms_reference(x: &[f32], cols: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / cols;
    let mut xhat = vec![0.0; x.len()];
    let mut rstd = vec![0.0; rows];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / cols as f64;
        rstd[r] = 1.0 / (ms + EPS).sqrt();
        for c in 0..cols {
            xhat[r * cols + c] = row[c] as f64 * rstd[r];
        }
    }
    (xhat, rstd)
}

#[test]
fn rms_norm_matches_burn_nn_forward_and_gradients() {
    // Forward: both take mean(x²) from the same Flex mean in f32; ours multiplies by
    // 1/sqrt (sqrt, recip, two products: 4 roundings), burn-nn divides by sqrt (sqrt,
    // division, product: 3): |Δy| ≤ 8·U·|y|.
    // Gradients, L = Σ c⊙y, g = c⊙w: exact dx = rstd·(g − x̂·mean(g⊙x̂)), dw = Σ_rows c⊙x̂.
    // The backward reads x̃ = x̂ + δ, |δ| ≤ h = s/2:
    //   |Δdx_i| ≤ rstd·(h·|mean(g⊙x̂)| + |x̂_i|·mean|g|·h + h²·mean|g|), |Δdw_c| ≤ h·Σ_rows|c|,
    // plus f32 sums over C (dx) or rows (dw): 4·n·U times the sums of magnitudes.
    let (rows, cols) = (16, 64);
    let (xv, wv, _) = ln_data(rows, cols);
    let cv = data(rows * cols, 22, -1.0, 1.0);
    let (xhat, rstd) = rms_reference(&xv, cols);
    let xhat32: Vec<f32> = xhat.iter().map(|&v| v as f32).collect();
    for bits in [8, 4, 2] {
        let s = step(&xhat32, bits) * (1.0 + 1e-5);
        for device in autodiff_devices() {
            let run = |mesa: bool| {
                let x = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
                let w = tensor(&wv, [cols], DType::F32, &device);
                let c = tensor(&cv, [rows, cols], DType::F32, &device);
                let (y, w) = if mesa {
                    let m = mesa_burn::nn::RmsNormConfig::new(cols).with_bits(bits).init(&device);
                    let m = mesa_burn::nn::RmsNorm { gamma: m.gamma.map(|_| w.clone().require_grad()), ..m };
                    (m.forward(x.clone()).unwrap(), m.gamma.val())
                } else {
                    let m = burn::nn::RmsNormConfig::new(cols).init(&device);
                    let m = burn::nn::RmsNorm { gamma: m.gamma.map(|_| w.clone().require_grad()), ..m };
                    (m.forward(x.clone()), m.gamma.val())
                };
                let yv = values(&y);
                let g = (y * c).sum().backward();
                (yv, values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap()))
            };
            let (y, dx, dw) = run(true);
            let (y0, dx0, dw0) = run(false);
            assert_within("rms_norm y", &y, &y0, |i| 8.0 * U * y0[i].abs() as f64);
            let ga = |i: usize| cv[i] as f64 * wv[i % cols] as f64;
            let stats: Vec<(f64, f64)> = (0..rows)
                .map(|r| {
                    let idx = r * cols..(r + 1) * cols;
                    let m = idx.clone().map(|i| ga(i) * xhat[i]).sum::<f64>() / cols as f64;
                    (m, idx.map(|i| ga(i).abs()).sum::<f64>() / cols as f64)
                })
                .collect();
            assert_within(&format!("rms_norm dx {bits}-bit"), &dx, &dx0, |i| {
                let r = i / cols;
                let (m, mg) = stats[r];
                let h = s / 2.0;
                rstd[r] * (h * m.abs() + xhat[i].abs() * mg * h + h * h * mg)
                    + 8.0 * cols as f64 * U * rstd[r] * mg * (2.0 + xhat[i].abs())
            });
            assert_within(&format!("rms_norm dweight {bits}-bit"), &dw, &dw0, |c| {
                (0..rows).map(|r| s / 2.0 * cv[r * cols + c].abs() as f64).sum::<f64>()
                    + 4.0
                        * rows as f64
                        * U
                        * (0..rows).map(|r| (cv[r * cols + c] as f64 * xhat[r * cols + c]).abs()).sum::<f64>()
            });
        }
    }
}

#[test]
fn softmax_with_mask_matches_burn_forward_and_gradients() {
    // Forward: y = exp(x − max)/Σexp, both in f32: exp within 2 U, the row sum within
    // C·U, the division U: |Δy_i| ≤ 2·(C + 4)·U·y_i for the two implementations.
    // Gradients, L = Σ c⊙y: exact dx_i = y_i·(c_i − m), m = Σ_j c_j·y_j. The backward reads
    // ŷ from square-root codes, e_j = |ŷ_j − y_j| ≤ (√y_j + 1/(4L))/L (L = 2^bits − 1), so
    //   |Δdx_i| ≤ e_i·|c_i − m| + (y_i + e_i)·Σ_j |c_j|·e_j,
    // plus f32: 4·(C + 4)·U·y_i·(|c_i| + Σ_j |c_j|·y_j).
    let (rows, cols) = (32, 32);
    let xv = data(rows * cols, 23, -3.0, 3.0);
    let cv = data(rows * cols, 24, -1.0, 1.0);
    // causal mask: row r sees columns ≤ r (no row fully masked)
    let mask: Vec<f32> = (0..rows * cols).map(|i| if i % cols <= i / cols { 0.0 } else { f32::NEG_INFINITY }).collect();
    let xm: Vec<f64> = xv.iter().zip(&mask).map(|(&x, &m)| x as f64 + m as f64).collect();
    let y: Vec<f64> = reference::softmax_rows(&xm, None, cols);
    for bits in [8, 4, 2] {
        let l = f64::from((1u32 << bits) - 1);
        let e: Vec<f64> = y.iter().map(|&y| (y.sqrt() + 1.0 / (4.0 * l)) / l).collect();
        for device in autodiff_devices() {
            let run = |mesa: bool| {
                let x = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
                let m = tensor(&mask, [rows, cols], DType::F32, &device);
                let c = tensor(&cv, [rows, cols], DType::F32, &device);
                let y = if mesa {
                    mesa_burn::softmax(x.clone(), Some(m), Codes::bits(bits)).unwrap()
                } else {
                    activation::softmax(x.clone() + m, 1)
                };
                let yv = values(&y);
                let g = (y * c).sum().backward();
                (yv, values(&x.grad(&g).unwrap()))
            };
            let (ys, dx) = run(true);
            let (ys0, dx0) = run(false);
            assert_within("softmax y", &ys, &ys0, |i| 2.0 * (cols + 4) as f64 * U * y[i]);
            assert_within(&format!("softmax dx {bits}-bit"), &dx, &dx0, |i| {
                let r = i / cols;
                let idx = r * cols..(r + 1) * cols;
                let m: f64 = idx.clone().map(|j| cv[j] as f64 * y[j]).sum();
                let ce: f64 = idx.clone().map(|j| (cv[j] as f64).abs() * e[j]).sum();
                let cy: f64 = idx.map(|j| (cv[j] as f64).abs() * y[j]).sum();
                e[i] * (cv[i] as f64 - m).abs()
                    + (y[i] + e[i]) * ce
                    + 4.0 * (cols + 4) as f64 * U * y[i] * ((cv[i] as f64).abs() + cy)
            });
        }
    }
}

#[test]
fn softmax_broadcast_mask_and_fully_masked_rows() {
    // A [1, C] key-padding mask broadcast over the rows gives the same output as the
    // expanded [rows, C] mask (the same additions in f32: bit for bit); a row whose every
    // entry is masked gives 0 (burn's own softmax gives NaN there).
    let device = Device::flex();
    let (rows, cols) = (4, 8);
    let xv = data(rows * cols, 25, -2.0, 2.0);
    let pad: Vec<f32> = (0..cols).map(|c| if c < 5 { 0.0 } else { f32::NEG_INFINITY }).collect();
    let x = tensor(&xv, [rows, cols], DType::F32, &device);
    let small =
        mesa_burn::softmax(x.clone(), Some(tensor(&pad, [1, cols], DType::F32, &device)), Codes::default()).unwrap();
    let full: Vec<f32> = (0..rows).flat_map(|_| pad.clone()).collect();
    let big = mesa_burn::softmax(x.clone(), Some(tensor(&full, [rows, cols], DType::F32, &device)), Codes::default())
        .unwrap();
    assert_eq!(values(&small), values(&big));
    assert!(values(&small).iter().enumerate().all(|(i, &v)| (i % cols < 5) == (v > 0.0)));
    let all = vec![f32::NEG_INFINITY; rows * cols];
    let y = values(
        &mesa_burn::softmax(x.clone(), Some(tensor(&all, [rows, cols], DType::F32, &device)), Codes::default())
            .unwrap(),
    );
    assert!(y.iter().all(|&v| v == 0.0), "{y:?}");
    let bad = tensor(&pad[..4], [1, 4], DType::F32, &device);
    assert!(matches!(mesa_burn::softmax(x, Some(bad), Codes::default()), Err(Error::Shape { what: "mask", .. })));
}

#[test]
fn a_tracked_mask_gets_the_gradient_of_x() {
    // y = softmax(x + m), so dm = dx, summed over the rows a [1, C] mask is broadcast over.
    // Against burn's autodiff of `softmax(x + m)` (its broadcast add sums the same way): per
    // row, the dx bound of `softmax_with_mask_matches_burn_forward_and_gradients` (8 bits),
    // summed over the rows, plus the two f32 row sums, 2·rows·U·Σ_r |dx_r|.
    // A learnt [1, C] bias (a leaf) and a [rows, C] mask computed from a parameter (2·p);
    // both used to panic in backward (the mask's producing op found no gradient).
    let (rows, cols, bits) = (16, 16, 8);
    let xv = data(rows * cols, 31, -3.0, 3.0);
    let cv = data(rows * cols, 32, -1.0, 1.0);
    let bv = data(cols, 33, -1.0, 1.0);
    let xb: Vec<f64> = (0..rows * cols).map(|i| xv[i] as f64 + bv[i % cols] as f64).collect();
    let y = reference::softmax_rows(&xb, None, cols);
    let l = f64::from((1u32 << bits) - 1);
    let e: Vec<f64> = y.iter().map(|&y| (y.sqrt() + 1.0 / (4.0 * l)) / l).collect();
    let dx_bound = |i: usize| {
        let r = i / cols;
        let idx = r * cols..(r + 1) * cols;
        let m: f64 = idx.clone().map(|j| cv[j] as f64 * y[j]).sum();
        let ce: f64 = idx.clone().map(|j| (cv[j] as f64).abs() * e[j]).sum();
        let cy: f64 = idx.map(|j| (cv[j] as f64).abs() * y[j]).sum();
        let dx = (y[i] * (cv[i] as f64 - m)).abs();
        e[i] * (cv[i] as f64 - m).abs()
            + (y[i] + e[i]) * ce
            + 4.0 * (cols + 4) as f64 * U * y[i] * ((cv[i] as f64).abs() + cy)
            + 2.0 * rows as f64 * U * dx
    };
    for device in autodiff_devices() {
        let run = |mesa: bool| {
            let x = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
            let b = tensor(&bv, [1, cols], DType::F32, &device).require_grad();
            let c = tensor(&cv, [rows, cols], DType::F32, &device);
            let y = if mesa {
                mesa_burn::softmax(x.clone(), Some(b.clone()), Codes::bits(bits)).unwrap()
            } else {
                activation::softmax(x.clone() + b.clone(), 1)
            };
            let g = (y * c).sum().backward();
            values(&b.grad(&g).expect("the mask's gradient"))
        };
        let (db, db0) = (run(true), run(false));
        assert_within("learnt bias d_mask", &db, &db0, |j| (0..rows).map(|r| dx_bound(r * cols + j)).sum());
        // a full-shape mask computed from a parameter: d_p = 2·dx
        let x = tensor(&xv, [rows, cols], DType::F32, &device).require_grad();
        let p = tensor(&vec![0.0; rows * cols], [rows, cols], DType::F32, &device).require_grad();
        let c = tensor(&cv, [rows, cols], DType::F32, &device);
        let y = mesa_burn::softmax(x.clone(), Some(p.clone() * 2.0), Codes::bits(bits)).unwrap();
        let g = (y * c).sum().backward();
        let (dx, dp) = (values(&x.grad(&g).unwrap()), values(&p.grad(&g).unwrap()));
        assert!(dp.iter().zip(&dx).all(|(&dp, &dx)| dp == 2.0 * dx), "d_p = 2·dx exactly");
    }
}

#[test]
fn views_of_more_than_six_axes_are_copied_not_refused() {
    // The kernels take at most MAX_DIMS = 6 axes after merging adjacent ones; a permuted view of
    // rank 7 merges none. mesa-burn copies it contiguous first, so each op's result equals
    // (bit for bit) the result on the contiguous copy; it used to panic in the kernel.
    let device = Device::flex();
    let dims = [2usize; 7];
    let n = dims.iter().product::<usize>();
    let xv = data(n, 41, -2.0, 2.0);
    let x = tensor(&xv, dims, DType::F32, &device).permute([6, 5, 4, 3, 2, 1, 0]);
    let xc = tensor(&values(&x), dims, DType::F32, &device);
    let w = Tensor::<1>::ones([2], &device);
    let b = Tensor::<1>::zeros([2], &device);
    let mask = tensor(&data(8, 42, -1.0, 1.0), [1, 2, 1, 2, 1, 2, 1], DType::F32, &device);
    let maskc = mask.clone().expand(dims);
    // a full-shape mask that is itself a rank-7 permuted view, and its contiguous copy
    let maskv = tensor(&data(n, 43, -1.0, 1.0), dims, DType::F32, &device).permute([6, 5, 4, 3, 2, 1, 0]);
    let maskvc = tensor(&values(&maskv), dims, DType::F32, &device);
    let c = Codes::default();
    let pairs = [
        (mesa_burn::gelu(x.clone(), GeluForm::Erf, c), mesa_burn::gelu(xc.clone(), GeluForm::Erf, c)),
        (mesa_burn::softmax(x.clone(), Some(maskv), c), mesa_burn::softmax(xc.clone(), Some(maskvc), c)),
        (mesa_burn::softmax(x.clone(), Some(mask), c), mesa_burn::softmax(xc.clone(), Some(maskc), c)),
        (
            mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), EPS, c),
            mesa_burn::layer_norm(xc.clone(), w, b, EPS, c),
        ),
        (mesa_burn::swiglu(x.clone(), x.clone(), c), mesa_burn::swiglu(xc.clone(), xc.clone(), c)),
    ];
    for (i, (got, want)) in pairs.into_iter().enumerate() {
        assert_eq!(values(&got.unwrap()), values(&want.unwrap()), "op {i}");
    }
}

/// silu(x) = x·σ(x) and its first two derivatives (f64).
fn silu_d(x: f64) -> (f64, f64, f64) {
    let s = 1.0 / (1.0 + (-x).exp());
    let d1 = s * (1.0 + x * (1.0 - s));
    let d2 = s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s));
    (x * s, d1, d2)
}

#[test]
fn swiglu_matches_burn_forward_and_gradients() {
    // Forward: silu(g)·u in f32, both: σ (exp, add, division: ≤ 4 U), two products:
    // |Δy| ≤ 2·6·U·|y| + 2·U·|g·u|·(…) — bounded by 16·U·(|y| + |g·u|).
    // Gradients, L = Σ c⊙y, with g̃ = g + δg, ũ = u + δu, |δg| ≤ hg, |δu| ≤ hu (half steps of
    // the two codes): du = c·silu(g̃): |Δdu| ≤ |c|·S1·hg; dg = c·ũ·silu'(g̃):
    // |Δdg| ≤ |c|·(hu·S1 + (|u| + hu)·S2·hg), S1 = max|silu'|, S2 = max|silu''| (from f64
    // over a fine grid), plus f32: 16·U·|c|·(|u| + 1)·(1 + |g|).
    let (rows, cols) = (32, 64);
    let gv = data(rows * cols, 26, -5.0, 5.0);
    let uv = data(rows * cols, 27, -2.0, 2.0);
    let cv = data(rows * cols, 28, -1.0, 1.0);
    let (mut s1, mut s2) = (0.0f64, 0.0f64);
    for k in -20_000..=20_000 {
        let (_, d1, d2) = silu_d(k as f64 * 1e-3);
        s1 = s1.max(d1.abs());
        s2 = s2.max(d2.abs());
    }
    let (s1, s2) = (s1 * 1.001, s2 * 1.001);
    for bits in [8, 4, 2] {
        let (hg, hu) = (step(&gv, bits) / 2.0, step(&uv, bits) / 2.0);
        for device in autodiff_devices() {
            let run = |mesa: bool| {
                let g = tensor(&gv, [rows, cols], DType::F32, &device).require_grad();
                let u = tensor(&uv, [rows, cols], DType::F32, &device).require_grad();
                let c = tensor(&cv, [rows, cols], DType::F32, &device);
                let y = if mesa {
                    mesa_burn::swiglu(g.clone(), u.clone(), Codes::bits(bits)).unwrap()
                } else {
                    activation::silu(g.clone()) * u.clone()
                };
                let yv = values(&y);
                let gr = (y * c).sum().backward();
                (yv, values(&g.grad(&gr).unwrap()), values(&u.grad(&gr).unwrap()))
            };
            let (y, dg, du) = run(true);
            let (y0, dg0, du0) = run(false);
            let (g, u, c) = (|i: usize| gv[i] as f64, |i: usize| uv[i] as f64, |i: usize| cv[i] as f64);
            assert_within("swiglu y", &y, &y0, |i| 16.0 * U * ((y0[i] as f64).abs() + (g(i) * u(i)).abs()));
            let slack = |i: usize| 16.0 * U * c(i).abs() * (u(i).abs() + 1.0) * (1.0 + g(i).abs());
            assert_within(&format!("swiglu dup {bits}-bit"), &du, &du0, |i| c(i).abs() * s1 * hg + slack(i));
            assert_within(&format!("swiglu dgate {bits}-bit"), &dg, &dg0, |i| {
                c(i).abs() * (hu * s1 + (u(i).abs() + hu) * s2 * hg) + slack(i)
            });
        }
    }
}

/// `v` rounded once to `dtype` (round to nearest even), as f32.
fn round_once(v: &[f32], dtype: DType) -> Vec<f32> {
    rounded(v, dtype)
}

#[test]
fn f16_and_bf16_results_are_the_f32_results_rounded_once() {
    // The kernels load f16/bf16 into f32 (exactly), compute in f32 and round once when
    // storing; RMSNorm casts to f32, computes, casts back. So on inputs that are exact in
    // the narrow dtype, every output and gradient in f16/bf16 is the f32 run's value
    // rounded once: equal bit for bit (a test that a second rounding, an f16 accumulation or
    // a dtype mix-up fails). The codes are the same in both runs (same min/max, same f32
    // encoding), so this also holds for the gradients from codes. Softmax saves codes of
    // its stored (rounded) output, so only its forward is compared.
    let (rows, cols) = (8, 64);
    for dtype in [DType::F16, DType::BF16] {
        let xv = rounded(&data(rows * cols, 30, -3.0, 3.0), dtype);
        let uv = rounded(&data(rows * cols, 31, -2.0, 2.0), dtype);
        let wv = rounded(&data(cols, 32, 0.5, 1.5), dtype);
        let bv = rounded(&data(cols, 33, -0.5, 0.5), dtype);
        let cv = rounded(&data(rows * cols, 34, -1.0, 1.0), dtype);
        let device = Device::flex().autodiff();
        // (output, grads of the inputs) of one op in `dt`
        type Run<'a> = Box<dyn Fn(DType) -> (Vec<f32>, Vec<Vec<f32>>) + 'a>;
        let t2 = |v: &[f32], dt| tensor(v, [rows, cols], dt, &device).require_grad();
        let t1 = |v: &[f32], dt| tensor(v, [cols], dt, &device).require_grad();
        let c = |dt| tensor(&cv, [rows, cols], dt, &device);
        let ops: Vec<(&str, Run)> = vec![
            (
                "gelu",
                Box::new(|dt| {
                    let x = t2(&xv, dt);
                    let y = mesa_burn::gelu(x.clone(), GeluForm::Erf, Codes::bits(4)).unwrap();
                    let g = (y.clone() * c(dt)).sum().backward();
                    (values(&y), vec![values(&x.grad(&g).unwrap())])
                }),
            ),
            (
                "layer_norm",
                Box::new(|dt| {
                    let (x, w, b) = (t2(&xv, dt), t1(&wv, dt), t1(&bv, dt));
                    let y = mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), EPS, Codes::bits(8)).unwrap();
                    let g = (y.clone() * c(dt)).sum().backward();
                    let gs = [values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap()), values(&b.grad(&g).unwrap())];
                    (values(&y), gs.to_vec())
                }),
            ),
            (
                "rms_norm",
                Box::new(|dt| {
                    let (x, w) = (t2(&xv, dt), t1(&wv, dt));
                    let y = mesa_burn::rms_norm(x.clone(), w.clone(), EPS, Codes::bits(8)).unwrap();
                    let g = (y.clone() * c(dt)).sum().backward();
                    (values(&y), vec![values(&x.grad(&g).unwrap()), values(&w.grad(&g).unwrap())])
                }),
            ),
            (
                "swiglu",
                Box::new(|dt| {
                    let (gt, u) = (t2(&xv, dt), t2(&uv, dt));
                    let y = mesa_burn::swiglu(gt.clone(), u.clone(), Codes::bits(2)).unwrap();
                    let g = (y.clone() * c(dt)).sum().backward();
                    (values(&y), vec![values(&gt.grad(&g).unwrap()), values(&u.grad(&g).unwrap())])
                }),
            ),
            (
                "softmax",
                Box::new(|dt| (values(&mesa_burn::softmax(t2(&xv, dt), None, Codes::bits(8)).unwrap()), vec![])),
            ),
        ];
        for (name, run) in &ops {
            let (y32, g32) = run(DType::F32);
            let (yh, gh) = run(dtype);
            assert_eq!(yh, round_once(&y32, dtype), "{name} {dtype:?} output");
            // not vacuous: the f32 results are not already exact in the narrow dtype
            assert_ne!(yh, y32, "{name} {dtype:?}: rounding changed nothing");
            for (k, (a, b)) in gh.iter().zip(&g32).enumerate() {
                assert_eq!(*a, round_once(b, dtype), "{name} {dtype:?} gradient {k}");
            }
        }
    }
}

#[test]
fn linear_attention_matches_the_f64_reference() {
    // Causal, normalised, positive features (q, k in [0.1, 1]: every denominator g_t ≥ 0.01·M
    // is far from the guard). Each output and gradient element is a composition of at most
    // three f32 sums (the denominator, the numerator or the backward's dA, the gradient's sum
    // over positions), each of at most n = L + M + D terms along any accumulation chain
    // (chunked or serial); with `mag` the same formula over absolute values (Higham's
    // Σ|terms|), the error is ≤ 3·γ_n·mag + O(U²) ≤ 4·n·U·mag. Several chunk sizes (chunk
    // boundaries, a partial last chunk) and both memory modes.
    use mesa_burn::{LinearAttentionConfig, MemoryMode};
    use mesa_kernels::reference::linear_attention as la;
    let (b, h, l, m, d) = (1, 2, 40, 8, 6);
    let qv = data(b * h * l * m, 40, 0.1, 1.0);
    let kv = data(b * h * l * m, 41, 0.1, 1.0);
    let vv = data(b * h * l * d, 42, -1.0, 1.0);
    let cv = data(b * h * l * d, 43, -1.0, 1.0);
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (q64, k64, v64, c64) = (f64s(&qv), f64s(&kv), f64s(&vv), f64s(&cv));
    let eps = 1e-6f64;
    let a = la::Attention {
        q: &q64,
        k: &k64,
        v: &v64,
        dims: la::Dims { batch: b, heads: h, len: l, feat: m, dim: d },
        causal: true,
        normalize: Some(eps),
    };
    let (out_ref, _) = la::forward(&a).unwrap();
    let (dq_ref, dk_ref, dv_ref) = la::backward(&a, &c64).unwrap();

    let [m_out, m_dq, m_dk, m_dv] = linear_attention_magnitudes(&q64, &k64, &v64, &c64, (b * h, l, m, d), eps);
    let n = (l + m + d) as f64;
    fn bound(n: f64, mag: &[f64]) -> impl Fn(usize) -> f64 + '_ {
        move |i| 4.0 * n * U * mag[i] + 1e-30
    }
    let as32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();

    for (chunk, memory) in [(64, MemoryMode::BoundaryStates), (16, MemoryMode::BoundaryStates), (7, MemoryMode::Slim)] {
        let config = LinearAttentionConfig { chunk, memory, eps: eps as f32, ..LinearAttentionConfig::causal() };
        for device in autodiff_devices() {
            let q = tensor(&qv, [b, h, l, m], DType::F32, &device).require_grad();
            let k = tensor(&kv, [b, h, l, m], DType::F32, &device).require_grad();
            let v = tensor(&vv, [b, h, l, d], DType::F32, &device).require_grad();
            let c = tensor(&cv, [b, h, l, d], DType::F32, &device);
            let out = mesa_burn::linear_attention(q.clone(), k.clone(), v.clone(), config).unwrap();
            let what = format!("linear attention chunk {chunk} {memory:?}");
            assert_within(&format!("{what} out"), &values(&out), &as32(&out_ref), bound(n, &m_out));
            let g = (out * c).sum().backward();
            assert_within(&format!("{what} dq"), &values(&q.grad(&g).unwrap()), &as32(&dq_ref), bound(n, &m_dq));
            assert_within(&format!("{what} dk"), &values(&k.grad(&g).unwrap()), &as32(&dk_ref), bound(n, &m_dk));
            assert_within(&format!("{what} dv"), &values(&v.grad(&g).unwrap()), &as32(&dv_ref), bound(n, &m_dv));
        }
    }
    // bad input: v of another length
    let device = Device::flex();
    let q = tensor(&qv, [b, h, l, m], DType::F32, &device);
    let v_short = tensor(&vv[..b * h * (l - 1) * d], [b, h, l - 1, d], DType::F32, &device);
    let r = mesa_burn::linear_attention(q.clone(), q.clone(), v_short, LinearAttentionConfig::causal());
    assert!(matches!(r, Err(Error::Shape { what: "v", .. })), "{r:?}");
    let bad = LinearAttentionConfig { chunk: 65, ..LinearAttentionConfig::causal() };
    let v = tensor(&vv, [b, h, l, d], DType::F32, &device);
    assert!(matches!(mesa_burn::linear_attention(q.clone(), q, v, bad), Err(Error::Config { what: "chunk", .. })));
}

#[test]
fn empty_tensors_run_forward_and_backward() {
    // A batch of zero rows: every op returns an empty output and empty gradients (no kernel
    // has anything to do); nothing panics on the way.
    let device = Device::flex().autodiff();
    let x = Tensor::<2>::zeros([0, 8], &device).require_grad();
    let w = Tensor::<1>::ones([8], &device).require_grad();
    let b = Tensor::<1>::zeros([8], &device).require_grad();
    let wl = Tensor::<2>::ones([8, 4], &device).require_grad();
    let outs = [
        mesa_burn::gelu(x.clone(), GeluForm::Erf, Codes::default()).unwrap().sum(),
        mesa_burn::layer_norm(x.clone(), w.clone(), b.clone(), EPS, Codes::default()).unwrap().sum(),
        mesa_burn::rms_norm(x.clone(), w.clone(), EPS, Codes::default()).unwrap().sum(),
        mesa_burn::linear(x.clone(), wl.clone(), None, Codes::default()).unwrap().sum(),
        mesa_burn::softmax(x.clone(), None, Codes::default()).unwrap().sum(),
        mesa_burn::swiglu(x.clone(), x.clone(), Codes::default()).unwrap().sum(),
    ];
    for (i, y) in outs.into_iter().enumerate() {
        assert_eq!(values(&y), vec![0.0], "op {i}: the sum of an empty output");
        let g = y.backward();
        assert_eq!(x.grad(&g).map(|t| t.dims()), Some([0, 8]), "op {i}");
    }
    // a broadcast mask over an empty x (burn's expand refuses a zero extent: it used to panic)
    let m = Tensor::<2>::zeros([1, 8], &device).require_grad();
    let y = mesa_burn::softmax(x.clone(), Some(m), Codes::default()).unwrap();
    assert_eq!(y.dims(), [0, 8]);
    let g = y.sum().backward();
    assert_eq!(x.grad(&g).map(|t| t.dims()), Some([0, 8]));
}

#[test]
fn model_gradients_along_a_few_training_steps() {
    // Linear(d_in→d_h) → GELU → Linear(d_h→d_out), L = Σ c⊙y, three SGD steps taken with
    // burn's gradients; at each step both gradient sets are computed at the same parameters
    // (teacher forcing), ours from codes. With h = x·W1 + b1, g = gelu(h), the decoded
    // x̃, h̃, g̃ within s_x/2, s_h/2, s_g/2 of x, h, g, and K = max|gelu''|:
    //   dW2 = g̃ᵀ·c:             |Δ|_kj ≤ s_g/2·Σ_i|c_ij|
    //   db2 = Σ_i c_ij:           exact (f32 only)
    //   dg = c·W2ᵀ:               exact (the same matmul)
    //   dh = dg⊙gelu'(h̃):        |Δ|_ik ≤ |dg_ik|·K·s_h/2 =: e_ik
    //   dW1 = x̃ᵀ·dh̃:             |Δ|_jk ≤ s_x/2·Σ_i(|dh_ik| + e_ik) + Σ_i|x_ij|·e_ik
    //   db1 = Σ_i dh̃_ik:          |Δ|_k ≤ Σ_i e_ik
    // plus f32 rounding of each sum: 4·n·U·Σ|terms| (n = the longest sum), taken on the
    // magnitudes of the exact terms.
    use burn::tensor::module::linear;
    let (n, d_in, d_h, d_out) = (16, 12, 32, 8);
    let device = Device::flex().autodiff();
    let xv = data(n * d_in, 50, -2.0, 2.0);
    let cv = data(n * d_out, 51, -1.0, 1.0);
    let k_gelu = gelu_second_derivative_bound(GeluForm::Erf);
    let lr = 0.01f32;
    for bits in [8, 4, 2] {
        // each bit width trains from the same initialisation
        let mut w1v = data(d_in * d_h, 52, -0.5, 0.5);
        let mut b1v = data(d_h, 53, -0.1, 0.1);
        let mut w2v = data(d_h * d_out, 54, -0.5, 0.5);
        let mut b2v = data(d_out, 55, -0.1, 0.1);
        for _step in 0..3 {
            let params = || {
                (
                    tensor(&w1v, [d_in, d_h], DType::F32, &device).require_grad(),
                    tensor(&b1v, [d_h], DType::F32, &device).require_grad(),
                    tensor(&w2v, [d_h, d_out], DType::F32, &device).require_grad(),
                    tensor(&b2v, [d_out], DType::F32, &device).require_grad(),
                )
            };
            let x = tensor(&xv, [n, d_in], DType::F32, &device);
            let c = tensor(&cv, [n, d_out], DType::F32, &device);
            // burn's
            let (w1, b1, w2, b2) = params();
            let h = linear(x.clone(), w1.clone(), Some(b1.clone()));
            let g = activation::gelu(h.clone());
            let (hv, gv) = (values(&h), values(&g));
            let gr = (linear(g, w2.clone(), Some(b2.clone())) * c.clone()).sum().backward();
            let burn = [
                values(&w1.grad(&gr).unwrap()),
                values(&b1.grad(&gr).unwrap()),
                values(&w2.grad(&gr).unwrap()),
                values(&b2.grad(&gr).unwrap()),
            ];
            // ours
            let (m1, mb1, m2, mb2) = params();
            let codes = Codes::bits(bits);
            let hm = mesa_burn::linear(x.clone(), m1.clone(), Some(mb1.clone()), codes).unwrap();
            let gm = mesa_burn::gelu(hm, GeluForm::Erf, codes).unwrap();
            let ym = mesa_burn::linear(gm, m2.clone(), Some(mb2.clone()), codes).unwrap();
            let gr = (ym * c).sum().backward();
            let ours = [
                values(&m1.grad(&gr).unwrap()),
                values(&mb1.grad(&gr).unwrap()),
                values(&m2.grad(&gr).unwrap()),
                values(&mb2.grad(&gr).unwrap()),
            ];

            let (sx, sh, sg) = (step(&xv, bits), step(&hv, bits), step(&gv, bits));
            let f = |v: &[f32], i: usize| v[i] as f64;
            // dg = c·W2ᵀ and its exact magnitudes
            let dg: Vec<f64> = (0..n * d_h)
                .map(|e| (0..d_out).map(|j| f(&cv, (e / d_h) * d_out + j) * f(&w2v, (e % d_h) * d_out + j)).sum())
                .collect();
            let dh_abs: Vec<f64> = (0..n * d_h)
                .map(|e| dg[e].abs() * reference::gelu_derivative(f(&hv, e), GeluForm::Erf).abs())
                .collect();
            let e_dh: Vec<f64> =
                dg.iter().map(|d| d.abs() * k_gelu * sh / 2.0 + 4.0 * d_out as f64 * U * d.abs()).collect();
            let what = |p: &str| format!("{bits}-bit model {p}");
            assert_within(&what("dW2"), &ours[2], &burn[2], |e| {
                let (k, j) = (e / d_out, e % d_out);
                (0..n)
                    .map(|i| (sg / 2.0 + 4.0 * n as f64 * U * f(&gv, i * d_h + k).abs()) * f(&cv, i * d_out + j).abs())
                    .sum()
            });
            assert_within(&what("db2"), &ours[3], &burn[3], |j| {
                4.0 * n as f64 * U * (0..n).map(|i| f(&cv, i * d_out + j).abs()).sum::<f64>()
            });
            assert_within(&what("dW1"), &ours[0], &burn[0], |e| {
                let (j, k) = (e / d_h, e % d_h);
                (0..n)
                    .map(|i| {
                        let (dh, ee, x) = (dh_abs[i * d_h + k], e_dh[i * d_h + k], f(&xv, i * d_in + j).abs());
                        sx / 2.0 * (dh + ee) + x * ee + 4.0 * n as f64 * U * x * dh
                    })
                    .sum()
            });
            assert_within(&what("db1"), &ours[1], &burn[1], |k| {
                (0..n).map(|i| e_dh[i * d_h + k] + 4.0 * n as f64 * U * dh_abs[i * d_h + k]).sum()
            });
            // the step, with burn's gradients (both runs continue from the same parameters)
            for (p, g) in [(&mut w1v, &burn[0]), (&mut b1v, &burn[1]), (&mut w2v, &burn[2]), (&mut b2v, &burn[3])] {
                for (a, d) in p.iter_mut().zip(g) {
                    *a -= lr * d;
                }
            }
        }
    }
}
