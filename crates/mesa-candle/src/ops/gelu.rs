//! GELU (Hendrycks & Gimpel 2016) whose forward keeps the codes of its input.
use candle_core::{Module, Tensor};
use mesa_kernels::fused::{gelu_backward, gelu_forward};
use mesa_kernels::{GeluForm, QuantConfig, SavedActivation};

use super::{f64_via_f32, QuantSlot};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, Output, View};
use crate::error::KernelResult;

/// GELU, `y = x/2·(1 + erf(x/√2))` ([`GeluForm::Erf`]) or the tanh approximation
/// ([`GeluForm::Tanh`]), elementwise over any shape and strides; f32, f16, bf16, and f64
/// computed in f32 ([`crate::ops`], "Dtypes").
///
/// Forward: one kernel writes `y` and the codes `Q(x)` (the quantizer's bits, grouping and
/// range: exact by default, or Mesa's running estimate, §3.3); backward: `dx = dy·gelu'(x̂)`, `x̂` decoded inside the
/// kernel. The gradient's error is bounded by `|dy|·max|gelu''|·step/2`
/// (`max|gelu''| = 2φ(0) ≈ 0.80` for erf), `step` the codes' quantization step.
#[derive(Debug)]
pub struct Gelu {
    form: GeluForm,
    quant: QuantSlot,
}

impl Gelu {
    /// GELU of `form` keeping its input with `config`: [`crate::ops::Codes`] (bits, rounding,
    /// statistics) or the kernels' [`QuantConfig`] (also grouping).
    #[must_use]
    pub fn new(form: GeluForm, config: impl Into<QuantConfig>) -> Self {
        Gelu { form, quant: QuantSlot::new(config.into()) }
    }

    /// The erf form with the default [`crate::ops::Codes`]: 8 bits, round to nearest, exact
    /// statistics (Mesa's running estimate: `Gelu::new(GeluForm::Erf, Codes::default().running())`).
    #[must_use]
    pub fn erf() -> Self {
        Gelu::new(GeluForm::Erf, super::Codes::default())
    }

    /// The tanh form with the default [`crate::ops::Codes`].
    #[must_use]
    pub fn tanh() -> Self {
        Gelu::new(GeluForm::Tanh, super::Codes::default())
    }
}

impl Module for Gelu {
    /// `x`: any shape; the result has `x`'s shape and dtype.
    ///
    /// # Errors
    /// [`crate::Error::UnsupportedDType`] (not a float), [`crate::Error::UnsupportedDevice`],
    /// the kernels' errors as [`crate::Error::Kernel`].
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(y) = f64_via_f32("gelu", &[x], |t| self.forward(&t[0]))? {
            return Ok(y);
        }
        let kernels = common_device("gelu", &[x])?;
        dispatch_float!(x.dtype(), "gelu", T => {
            let detached = x.detach();
            let view = View::of(&detached)?;
            let mut y = Output::<T>::zeros(x.device(), &kernels, x.shape())?;
            let saved = self.quant.with(x.device(), &kernels, |q| {
                gelu_forward(&kernels, q, self.form, &view.tensor_ref::<T>()?, &mut y.tensor_mut()?).k()
            })?;
            drop(view);
            attach(&[x], y.into_storage()?, GeluGrad { form: self.form, saved, kernels })
        })
    }
}

struct GeluGrad {
    form: GeluForm,
    saved: SavedActivation,
    kernels: mesa_kernels::Device,
}

impl Backward for GeluGrad {
    fn name(&self) -> &'static str {
        "mesa-gelu"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        dispatch_float!(grad.dtype(), "gelu backward", T => {
            let view = View::of(grad)?;
            let mut dx = Output::<T>::zeros(grad.device(), &self.kernels, grad.shape())?;
            gelu_backward(&self.kernels, self.form, &self.saved, &view.tensor_ref::<T>()?, &mut dx.tensor_mut()?).k()?;
            Ok(vec![Some(dx.into_tensor()?)])
        })
    }
}
