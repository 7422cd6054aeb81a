//! LayerNorm over the last axis keeping the codes of `x̂` and per-row statistics.
use candle_core::{DType, Tensor};
use mesa_kernels::fused::{
    layer_norm_backward, layer_norm_forward, LayerNormBackward, LayerNormForward, LayerNormGrads,
};
use mesa_kernels::{QuantConfig, SavedLayerNorm};

use super::{check_dtypes, check_rank, f64_via_f32, QuantSlot};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, Output, View};
use crate::error::{Error, KernelResult};

/// `y = x̂·w + b`, `x̂ = (x − mean)·rstd`, `rstd = 1/√(var + eps)` over the last axis
/// (Ba et al. 2016); `x` f32/f16/bf16 (f64 computed in f32, [`crate::ops`]) of any rank ≥ 1
/// and strides, `w`, `b` `[C]` of `x`'s dtype.
///
/// Forward: one kernel pass writes `y`, the codes of `x̂` and per-row mean and rstd (f32);
/// backward: `dx = rstd·(g − mean(g) − x̂·mean(g·x̂))` with `g = dy·w`, `dw = Σ_rows dy·x̂`,
/// `db = Σ_rows dy` (deterministic column sums), `x̂` decoded inside the kernels.
#[derive(Debug)]
pub struct LayerNorm {
    eps: f32,
    quant: QuantSlot,
}

impl LayerNorm {
    /// LayerNorm with `eps` keeping `x̂` with `config` ([`crate::ops::Codes`] or a
    /// [`QuantConfig`]).
    #[must_use]
    pub fn new(eps: f32, config: impl Into<QuantConfig>) -> Self {
        LayerNorm { eps, quant: QuantSlot::new(config.into()) }
    }

    /// `x: [..., C]`, `weight`, `bias`: `[C]`.
    ///
    /// # Errors
    /// [`Error::Rank`] (`x` of rank 0), [`Error::InvalidArgument`] (`C = 0`), [`Error::Shape`]
    /// (weight or bias not `[C]`), [`Error::DTypeMismatch`] (not one dtype),
    /// [`Error::UnsupportedDType`], [`Error::DeviceMismatch`], the kernels' errors (eps,
    /// layouts) as [`Error::Kernel`].
    pub fn forward(&self, x: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        check_dtypes("layer norm", &[(x, "input [..., C]"), (weight, "weight [C]"), (bias, "bias [C]")])?;
        if let Some(y) = f64_via_f32("layer norm", &[x, weight, bias], |t| self.forward(&t[0], &t[1], &t[2]))? {
            return Ok(y);
        }
        check_rank("layer norm input [..., C]", x, 1, true)?;
        let cols = x.dims().last().copied().unwrap_or(0);
        if cols == 0 {
            return Err(Error::InvalidArgument {
                name: "layer norm input [..., C]",
                why: format!("C must be ≥ 1, got the empty last axis of shape {:?}", x.dims()),
            }
            .into());
        }
        super::check_norm_param("layer norm", "weight [C]", x, weight)?;
        super::check_norm_param("layer norm", "bias [C]", x, bias)?;
        let kernels = common_device("layer norm", &[x, weight, bias])?;
        dispatch_float!(x.dtype(), "layer norm", T => {
            let (xd, wd, bd) = (x.detach(), weight.contiguous()?.detach(), bias.contiguous()?.detach());
            let mut y = Output::<T>::zeros(x.device(), &kernels, x.shape())?;
            let saved = {
                let (xv, wv, bv) = (View::of(&xd)?, View::of(&wd)?, View::of(&bd)?);
                let (xr, wr, br) = (xv.tensor_ref::<T>()?, wv.tensor_ref::<T>()?, bv.tensor_ref::<T>()?);
                let args = LayerNormForward { x: &xr, weight: Some(&wr), bias: Some(&br), eps: self.eps };
                self.quant.with(x.device(), &kernels, |q| layer_norm_forward(&kernels, q, &args, &mut y.tensor_mut()?).k())?
            };
            attach(&[x, weight, bias], y.into_storage()?, LayerNormGrad { saved, kernels })
        })
    }
}

struct LayerNormGrad {
    saved: SavedLayerNorm,
    kernels: mesa_kernels::Device,
}

impl Backward for LayerNormGrad {
    fn name(&self) -> &'static str {
        "mesa-layer-norm"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let weight = args[1].contiguous()?.detach();
        let cols = candle_core::Shape::from(weight.dims());
        dispatch_float!(grad.dtype(), "layer norm backward", T => {
            let mut dx = Output::<T>::zeros(grad.device(), &self.kernels, grad.shape())?;
            let mut dw = Output::<f32>::zeros(grad.device(), &self.kernels, &cols)?;
            let mut db = Output::<f32>::zeros(grad.device(), &self.kernels, &cols)?;
            {
                let (gv, wv) = (View::of(grad)?, View::of(&weight)?);
                let (gr, wr) = (gv.tensor_ref::<T>()?, wv.tensor_ref::<T>()?);
                let args = LayerNormBackward { saved: &self.saved, weight: Some(&wr), dy: &gr };
                let grads = LayerNormGrads { dx: &mut dx.tensor_mut()?, dweight: &mut dw.tensor_mut()?, dbias: &mut db.tensor_mut()? };
                layer_norm_backward(&self.kernels, &args, grads).k()?;
            }
            let dtype: DType = grad.dtype();
            Ok(vec![Some(dx.into_tensor()?), Some(dw.into_tensor()?.to_dtype(dtype)?), Some(db.into_tensor()?.to_dtype(dtype)?)])
        })
    }
}
