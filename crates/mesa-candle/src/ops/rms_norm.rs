//! RMSNorm (Zhang & Sennrich 2019) keeping the codes of `x̂` and the per-row rstd.
//!
//! mesa-kernels has no RMSNorm kernel: the forward and backward here are candle's own ops in
//! f32, and what is kept for backward is encoded and decoded by the crate's quantize and
//! dequantize kernels (one extra pass over `x̂` each way compared with a fused kernel).
use candle_core::{DType, Tensor, D};
use mesa_kernels::{QuantConfig, SavedActivation};

use super::{check_dtypes, check_rank, f64_via_f32, tensor_result, QuantSlot};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, Output, View};
use crate::error::{Error, KernelResult};

/// `y = x̂·w`, `x̂ = x·rstd`, `rstd = 1/√(mean(x²) + eps)` over the last axis; `x` f32, f16,
/// bf16 or f64 of rank ≥ 1, `w` `[C]` of `x`'s dtype; arithmetic in f32 (also for f64,
/// [`crate::ops`]) except `mean(x²)`, summed in f64 so that no finite row overflows or
/// underflows (rows of any finite size give their `x̂`, also beyond `|x| ≈ 1.8e19`, where
/// the f32 squares overflow). Keeps the codes of `x̂` and the per-row `1/rstd` (f32).
///
/// Backward: `dx = rstd·(g − x̂·mean(g·x̂))` with `g = dy·w`, `dw = Σ_rows dy·x̂`, from the
/// decoded `x̂`.
#[derive(Debug)]
pub struct RmsNorm {
    eps: f32,
    quant: QuantSlot,
}

impl RmsNorm {
    /// RMSNorm with `eps` keeping `x̂` with `config` ([`crate::ops::Codes`] or a
    /// [`QuantConfig`]).
    #[must_use]
    pub fn new(eps: f32, config: impl Into<QuantConfig>) -> Self {
        RmsNorm { eps, quant: QuantSlot::new(config.into()) }
    }

    /// `x: [..., C]`, `weight: [C]`.
    ///
    /// # Errors
    /// [`Error::Rank`] (`x` of rank 0), [`Error::InvalidArgument`] (`C = 0`; eps not
    /// positive and finite), [`Error::Shape`] (weight not `[C]`), [`Error::DTypeMismatch`]
    /// (not one dtype), [`Error::UnsupportedDType`], [`Error::DeviceMismatch`], the kernels'
    /// errors as [`Error::Kernel`].
    pub fn forward(&self, x: &Tensor, weight: &Tensor) -> candle_core::Result<Tensor> {
        check_dtypes("rms norm", &[(x, "input [..., C]"), (weight, "weight [C]")])?;
        if let Some(y) = f64_via_f32("rms norm", &[x, weight], |t| self.forward(&t[0], &t[1]))? {
            return Ok(y);
        }
        check_rank("rms norm input [..., C]", x, 1, true)?;
        let cols = x.dims().last().copied().unwrap_or(0);
        if cols == 0 {
            return Err(Error::InvalidArgument {
                name: "rms norm input [..., C]",
                why: format!("C must be ≥ 1, got the empty last axis of shape {:?}", x.dims()),
            }
            .into());
        }
        super::check_norm_param("rms norm", "weight [C]", x, weight)?;
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return Err(Error::InvalidArgument {
                name: "rms norm eps",
                why: format!("must be positive and finite, got {:e}", self.eps),
            }
            .into());
        }
        if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::UnsupportedDType { op: "rms norm", dtype: x.dtype() }.into());
        }
        let kernels = common_device("rms norm", &[x, weight])?;
        let rms = rms_of(&x.detach(), self.eps)?;
        let xhat = x.detach().to_dtype(DType::F32)?.broadcast_div(&rms)?;
        let y = xhat.broadcast_mul(&weight.detach().to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
        let saved = {
            let view = View::of(&xhat)?;
            let xr = view.tensor_ref::<f32>()?;
            self.quant.with(x.device(), &kernels, |q| q.quantize(&xr).k())?
        };
        attach(&[x, weight], tensor_result(&y)?, RmsNormGrad { saved, rms, kernels })
    }
}

struct RmsNormGrad {
    saved: SavedActivation,
    /// `1/rstd` per row, `[..., 1]` f32.
    rms: Tensor,
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
        let w = args[1].detach().to_dtype(DType::F32)?;
        let (dx, dw) = rms_norm_grads(&xhat, &self.rms, &w, &grad.to_dtype(DType::F32)?)?;
        Ok(vec![Some(dx.to_dtype(grad.dtype())?), Some(dw.to_dtype(args[1].dtype())?)])
    }
}

/// `rms = √(mean(x²) + eps)` per row of `x: [..., C]` (any float dtype), as `[..., 1]` f32.
///
/// `mean(x²)` is summed in f64: the square of every f32 value, 2⁻²⁹⁸ ≤ x² < 2²⁵⁶ (and sums of
/// up to 2⁷⁶⁷ of them), is a finite normal f64; in f32, x² overflows above |x| ≈ 1.8e19
/// (rstd = 0: output and gradients 0) and underflows below ≈ 1e-23. (Scaling each row by a
/// power of two near its max|x| would be exact as well, but candle has no frexp, and eps would
/// scale by its square, overflowing for tiny rows.) `rms` lies in `[√eps, max|x|]` up to
/// rounding, so it is a normal f32 and callers divide by it: `rstd = 1/rms` is subnormal for
/// rows near f32's largest values.
pub(crate) fn rms_of(x: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    let mean_sq = x.to_dtype(DType::F64)?.sqr()?.mean_keepdim(D::Minus1)?;
    (mean_sq + f64::from(eps))?.sqrt()?.to_dtype(DType::F32)
}

/// RMSNorm's backward in f32 from `x̂` (decoded), `rms` (`[..., 1]`), the weight `[C]` and
/// `dy`: `dx = (g − x̂·mean(g·x̂))/rms` with `g = dy·w`, and `dw = Σ_rows dy·x̂` (`[C]`).
pub(crate) fn rms_norm_grads(
    xhat: &Tensor,
    rms: &Tensor,
    w: &Tensor,
    dy: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let g = dy.broadcast_mul(w)?;
    let m = (&g * xhat)?.mean_keepdim(D::Minus1)?;
    let dx = (g - xhat.broadcast_mul(&m)?)?.broadcast_div(rms)?;
    let cols = xhat.dims().last().copied().unwrap_or(0);
    let dw = (dy * xhat)?.reshape(((), cols))?.sum(0)?;
    Ok((dx, dw))
}
