//! The `cuda` feature's smoke test: every op on burn's CUDA backend (`Device::cuda(0)`, with
//! autodiff) against the same op on Flex, forward and input/parameter gradients, 8-bit codes.
//!
//! **Never run**: burn's CUDA backend cannot be linked on the machines that wrote this
//! (docs/burn.md, "CUDA"); `ci/compat/check.sh burn-cuda` type-checks and lints it (clippy
//! `--all-targets --features fusion`: there the device's backend is `Fusion<CubeBackend>`;
//! with `cuda` alone it is `CubeBackend`). Without a CUDA device, or with mesa-kernels built
//! without CUDA kernels, it returns early after printing why.
//!
//! The tolerance is a smoke test's, not a parity bound: a wrong pointer, offset, stride, dtype
//! or stream order gives errors of order 1, while the GPU and the emulator run the same kernel
//! source (differences: libm, fma contraction, burn's cubecl matmul against Flex's, and an
//! element rounding to the neighbouring code, one 8-bit step `s ≤ (max − min)/255` of the
//! decoded input, scaled by the op's derivative, which is at most a few units for these
//! inputs). `1e-2·(1 + |flex|)` covers all of these and no such bug. Parity with burn's own
//! ops, with derived bounds, is `tests/ops.rs` on Flex.
#![cfg(feature = "cuda")]
mod common;

use burn::tensor::{DType, Device, Tensor};
use common::{data, tensor, values};
use mesa_burn::{Codes, GeluForm, LinearAttentionConfig};

/// The CUDA device, or `None` (printed) when mesa-kernels cannot run on one.
fn cuda() -> Option<Device> {
    match mesa_kernels::Device::cuda(0) {
        Ok(_) => Some(Device::cuda(0).autodiff()),
        Err(e) => {
            eprintln!("skipped: no CUDA device for mesa-kernels ({e})");
            None
        }
    }
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let bound = 1e-2 * (1.0 + f64::from(w.abs()));
        assert!(f64::from((g - w).abs()) <= bound, "{what}[{i}]: CUDA {g} vs Flex {w}");
    }
}

/// Runs `op` on tracked inputs built from `inputs` (values, shape) on `device`; returns the
/// output and the gradient of `sum(y·c)` with respect to each input, all as f32.
fn run<const D: usize>(
    device: &Device,
    inputs: &[(Vec<f32>, [usize; D])],
    op: impl Fn(&[Tensor<D>]) -> Tensor<D>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let ts: Vec<Tensor<D>> = inputs.iter().map(|(v, s)| tensor(v, *s, DType::F32, device).require_grad()).collect();
    let y = op(&ts);
    let c = tensor(&data(y.shape().num_elements(), 99, -1.0, 1.0), y.dims(), DType::F32, device);
    let grads = (y.clone() * c).sum().backward();
    let g = ts.iter().map(|t| values(&t.grad(&grads).expect("tracked input"))).collect();
    (values(&y), g)
}

fn compare<const D: usize>(
    name: &str,
    cuda: &Device,
    inputs: &[(Vec<f32>, [usize; D])],
    op: impl Fn(&[Tensor<D>]) -> Tensor<D>,
) {
    let (yc, gc) = run(cuda, inputs, &op);
    let (yf, gf) = run(&Device::flex().autodiff(), inputs, &op);
    close(&format!("{name} forward"), &yc, &yf);
    for (i, (a, b)) in gc.iter().zip(&gf).enumerate() {
        close(&format!("{name} gradient {i}"), a, b);
    }
}

#[test]
fn every_op_on_cuda_matches_flex() {
    let Some(cuda) = cuda() else { return };
    let codes = Codes::bits(8);
    let (rows, cols) = (6, 40);
    let x = (data(rows * cols, 1, -3.0, 3.0), [rows, cols]);
    let g = (data(rows * cols, 2, -3.0, 3.0), [rows, cols]);
    let w = (data(cols, 3, 0.5, 1.5), [cols]);
    let b = (data(cols, 4, -0.5, 0.5), [cols]);

    compare("gelu", &cuda, std::slice::from_ref(&x), |t| mesa_burn::gelu(t[0].clone(), GeluForm::Erf, codes).unwrap());
    compare("softmax", &cuda, std::slice::from_ref(&x), |t| mesa_burn::softmax(t[0].clone(), None, codes).unwrap());
    compare("swiglu", &cuda, &[x.clone(), g.clone()], |t| {
        mesa_burn::swiglu(t[0].clone(), t[1].clone(), codes).unwrap()
    });

    // the parameters through 2-D tensors of one row, reshaped (one input list per call)
    let xw = [x.clone(), (w.0.clone(), [1, cols]), (b.0.clone(), [1, cols])];
    compare("layer_norm", &cuda, &xw, |t| {
        let (w, b) = (t[1].clone().reshape([cols]), t[2].clone().reshape([cols]));
        mesa_burn::layer_norm(t[0].clone(), w, b, 1e-5, codes).unwrap()
    });
    compare("rms_norm", &cuda, &xw[..2], |t| {
        mesa_burn::rms_norm(t[0].clone(), t[1].clone().reshape([cols]), 1e-5, codes).unwrap()
    });
    let d_out = 24;
    let lin = [x.clone(), (data(cols * d_out, 5, -0.3, 0.3), [cols, d_out]), (data(d_out, 6, -0.5, 0.5), [1, d_out])];
    compare("linear", &cuda, &lin, |t| {
        mesa_burn::linear(t[0].clone(), t[1].clone(), Some(t[2].clone().reshape([d_out])), codes).unwrap()
    });

    let (bh, len, m, d) = (2, 20, 8, 6);
    let qkv = [
        (data(bh * len * m, 7, 0.0, 1.0), [1, bh, len, m]),
        (data(bh * len * m, 8, 0.0, 1.0), [1, bh, len, m]),
        (data(bh * len * d, 9, -1.0, 1.0), [1, bh, len, d]),
    ];
    let config = LinearAttentionConfig { chunk: 8, ..LinearAttentionConfig::causal() };
    compare("linear_attention", &cuda, &qkv, |t| {
        mesa_burn::linear_attention(t[0].clone(), t[1].clone(), t[2].clone(), config).unwrap()
    });
}
