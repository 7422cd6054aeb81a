//! RMSNorm (Zhang & Sennrich 2019) keeping the codes of `x̂` and the per-row rstd.
//!
//! mesa-kernels has no RMSNorm kernel: the forward and backward here are candle's own ops in
//! f32, and what is kept for backward is encoded and decoded by the crate's quantize and
//! dequantize kernels (one extra pass over `x̂` each way compared with a fused kernel).
use candle_core::{DType, Tensor, D};
use mesa_kernels::{QuantConfig, SavedActivation};

use super::{check_rank, f64_via_f32, tensor_result, QuantSlot};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, Output, View};
use crate::error::{Error, KernelResult};

/// `y = x̂·w`, `x̂ = x·rstd`, `rstd = 1/√(mean(x²) + eps)` over the last axis; `x` f32, f16,
/// bf16 or f64 of rank ≥ 1, `w` `[C]` of `x`'s dtype; arithmetic in f32 (also for f64,
/// [`crate::ops`]).
///
/// Backward: `dx = rstd·(g − x̂·mean(g·x̂))` with `g = dy·w`, `dw = Σ_rows dy·x̂`, from the
/// decoded `x̂`.
#[derive(Debug)]
pub struct RmsNorm {
    eps: f32,
    quant: QuantSlot,
}

impl RmsNorm {
    /// RMSNorm with `eps` keeping `x̂` with `config`.
    #[must_use]
    pub fn new(eps: f32, config: QuantConfig) -> Self {
        RmsNorm { eps, quant: QuantSlot::new(config) }
    }

    /// `x: [..., C]`, `weight: [C]`.
    ///
    /// # Errors
    /// [`Error::Rank`] (`x` of rank 0), [`Error::Shape`] (weight not `[C]`, or `C = 0`),
    /// [`Error::InvalidArgument`] (eps not positive and finite), [`Error::UnsupportedDType`],
    /// [`Error::DeviceMismatch`], the kernels' errors as [`Error::Kernel`].
    pub fn forward(&self, x: &Tensor, weight: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(y) = f64_via_f32("rms norm", &[x, weight], |t| self.forward(&t[0], &t[1]))? {
            return Ok(y);
        }
        check_rank("rms norm input [..., C]", x, 1, true)?;
        let cols = x.dims().last().copied().unwrap_or(0);
        if weight.dims() != [cols] || cols == 0 {
            return Err(Error::Shape {
                what: "rms norm weight".into(),
                expected: vec![cols.max(1)],
                got: weight.dims().to_vec(),
            }
            .into());
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return Err(Error::InvalidArgument {
                name: "eps",
                why: format!("must be positive and finite, got {}", self.eps),
            }
            .into());
        }
        if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::UnsupportedDType { op: "rms norm", dtype: x.dtype() }.into());
        }
        let kernels = common_device("rms norm", &[x, weight])?;
        let xf = x.detach().to_dtype(DType::F32)?;
        let rstd = (xf.sqr()?.mean_keepdim(D::Minus1)? + f64::from(self.eps))?.sqrt()?.recip()?;
        let xhat = xf.broadcast_mul(&rstd)?;
        let y = xhat.broadcast_mul(&weight.detach().to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
        let saved = {
            let view = View::of(&xhat)?;
            let xr = view.tensor_ref::<f32>()?;
            self.quant.with(x.device(), &kernels, |q| q.quantize(&xr).k())?
        };
        attach(&[x, weight], tensor_result(&y)?, RmsNormGrad { saved, rstd, kernels })
    }
}

struct RmsNormGrad {
    saved: SavedActivation,
    rstd: Tensor,
    kernels: mesa_kernels::Device,
}

impl Backward for RmsNormGrad {
    fn name(&self) -> &'static str {
        "mesa-rms-norm"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let mut xhat = Output::<f32>::zeros(grad.device(), &self.kernels, grad.shape())?;
        self.saved.dequantize(&self.kernels, &mut xhat.tensor_mut()?).k()?;
        let xhat = xhat.into_tensor()?;
        let dy = grad.to_dtype(DType::F32)?;
        let g = dy.broadcast_mul(&args[1].detach().to_dtype(DType::F32)?)?;
        let m = (&g * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = (g - xhat.broadcast_mul(&m)?)?.broadcast_mul(&self.rstd)?;
        let cols = xhat.dims().last().copied().unwrap_or(0);
        let dw = (dy * xhat)?.reshape(((), cols))?.sum(0)?;
        Ok(vec![Some(dx.to_dtype(grad.dtype())?), Some(dw.to_dtype(args[1].dtype())?)])
    }
}
