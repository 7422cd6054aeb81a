//! A Linear layer whose input is kept for backward as codes.
use candle_core::{DType, Tensor};
use mesa_kernels::{QuantConfig, SavedActivation};

use super::{check_dtypes, check_rank, f64_via_f32, tensor_result, QuantSlot};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, Output, View};
use crate::error::{Error, KernelResult};

/// `y = x·Wᵀ + b` with `x: [..., in]`, `W: [out, in]`, `b: [out]` (optional), one dtype
/// (f32, f16, bf16; f64 computed in f32, [`crate::ops`]); candle's matmuls.
///
/// The weight gradient `dW = dyᵀ·x̂` uses the decoded codes `x̂` of the input (quantizer's
/// bits and grouping); `dx = dy·W` and `db = Σ dy` are exact. Error of `dW_ij`:
/// `≤ Σ_rows |dy_ri|·step/2`.
#[derive(Debug)]
pub struct CodedLinear {
    quant: QuantSlot,
}

impl CodedLinear {
    /// A Linear keeping its input with `config` ([`crate::ops::Codes`] or a [`QuantConfig`]).
    #[must_use]
    pub fn new(config: impl Into<QuantConfig>) -> Self {
        CodedLinear { quant: QuantSlot::new(config.into()) }
    }

    /// `x: [..., in]`, `weight: [out, in]`, `bias: [out]` or `None`.
    ///
    /// # Errors
    /// [`Error::Rank`] (`x` of rank 0, weight not of rank 2), [`Error::InvalidArgument`]
    /// (`in = 0`), [`Error::Shape`] (`x`'s last dim not `in`, bias not `[out]`),
    /// [`Error::DTypeMismatch`] (not one dtype), [`Error::UnsupportedDType`],
    /// [`Error::DeviceMismatch`], the kernels' errors as [`Error::Kernel`].
    pub fn forward(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let mut args = vec![x, weight];
        args.extend(bias);
        let mut named = vec![(x, "input [..., in]"), (weight, "weight [out, in]")];
        named.extend(bias.map(|b| (b, "bias [out]")));
        check_dtypes("linear", &named)?;
        if let Some(y) = f64_via_f32("linear", &args, |t| self.forward(&t[0], &t[1], t.get(2)))? {
            return Ok(y);
        }
        check_rank("linear input [..., in]", x, 1, true)?;
        check_rank("linear weight [out, in]", weight, 2, false)?;
        let (out_f, in_f) = weight.dims2()?;
        if in_f == 0 {
            return Err(Error::InvalidArgument {
                name: "linear weight [out, in]",
                why: format!("in must be ≥ 1, got in = 0 (weight {:?}, input {:?})", weight.dims(), x.dims()),
            }
            .into());
        }
        let x_in = x.dims().last().copied().unwrap_or(0);
        if x_in != in_f {
            let mut expected = x.dims().to_vec();
            if let Some(last) = expected.last_mut() {
                *last = in_f;
            }
            return Err(Error::Shape {
                what: format!("linear input [..., in] (in = {in_f}: weight [out, in] is {:?})", weight.dims()),
                expected,
                got: x.dims().to_vec(),
            }
            .into());
        }
        if let Some(b) = bias {
            if b.dims() != [out_f] {
                return Err(
                    Error::Shape { what: "linear bias".into(), expected: vec![out_f], got: b.dims().to_vec() }.into()
                );
            }
        }
        let kernels = common_device("linear", &args)?;
        let y = linear_forward(&x.detach(), &weight.detach(), bias.map(Tensor::detach).as_ref())?;
        let saved = dispatch_float!(x.dtype(), "linear", T => {
            let xd = x.detach();
            let view = View::of(&xd)?;
            let xr = view.tensor_ref::<T>()?;
            self.quant.with(x.device(), &kernels, |q| q.quantize(&xr).k())
        })?;
        attach(&args, tensor_result(&y)?, LinearGrad { saved, kernels })
    }
}

/// `x·Wᵀ + b` over the last axis of `x` (candle's matmul on `[rows, in]`).
pub(crate) fn linear_forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (out_f, in_f) = weight.dims2()?;
    let mut dims = x.dims().to_vec();
    let y = x.reshape(((), in_f))?.matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    if let Some(last) = dims.last_mut() {
        *last = out_f;
    }
    y.reshape(dims)
}

struct LinearGrad {
    saved: SavedActivation,
    kernels: mesa_kernels::Device,
}

impl Backward for LinearGrad {
    fn name(&self) -> &'static str {
        "mesa-coded-linear"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let (x, weight) = (args[0], args[1]);
        let (out_f, in_f) = weight.dims2()?;
        let xhat = dispatch_float!(x.dtype(), "linear backward", T => {
            let mut xhat = Output::<T>::zeros(x.device(), &self.kernels, x.shape())?;
            self.saved.dequantize(&self.kernels, &mut xhat.tensor_mut()?).k()?;
            xhat.into_tensor()
        })?;
        let dy = grad.reshape(((), out_f))?;
        let dx = dy.matmul(&weight.detach())?.reshape(x.shape())?;
        let dw = dy.t()?.matmul(&xhat.reshape(((), in_f))?)?;
        let mut grads = vec![Some(dx), Some(dw)];
        if args.len() == 3 {
            let db = dy.to_dtype(DType::F32)?.sum(0)?.to_dtype(grad.dtype())?;
            grads.push(Some(db));
        }
        Ok(grads)
    }
}
