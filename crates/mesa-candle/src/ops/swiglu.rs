//! SwiGLU (Shazeer 2020, eq. 6; the MLP gate of Llama, Mistral, Qwen) whose forward keeps the
//! codes of both inputs.
use candle_core::Tensor;
use mesa_kernels::fused::{swiglu_backward, swiglu_forward, SavedSwiglu, SwigluGrads, SwigluInput, SwigluQuantizers};
use mesa_kernels::QuantConfig;

use super::{check_dtypes, f64_via_f32, QuantSlot};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, Output, View};
use crate::error::{Error, KernelResult};

/// SwiGLU, `y = silu(g)·u` with `silu(g) = g·σ(g)`, elementwise over any equal shapes and
/// strides of the gate `g` and the up projection `u`; f32, f16, bf16, and f64 computed in f32
/// ([`crate::ops`], "Dtypes"). What candle-transformers' Llama MLP computes as
/// `silu(gate_proj(x)) * up_proj(x)`.
///
/// Forward: `y` and the codes `Q(g)` in one kernel, then the codes `Q(u)` (each input with its
/// own quantizer: exact statistics by default); backward: `dg = dy·û·silu'(ĝ)`,
/// `du = dy·silu(ĝ)`, `ĝ` and `û` decoded inside one kernel. With `|silu'| ≤ 1.1` and
/// `|silu''| ≤ 0.5`, the gradients' error from the codes is at most
/// `|dy|·(1.1·step_u + (|u| + step_u/2)·0.5·step_g)/2` for `dg` and `|dy|·1.1·step_g/2` for `du`.
#[derive(Debug)]
pub struct SwiGlu {
    gate: QuantSlot,
    up: QuantSlot,
}

impl SwiGlu {
    /// SwiGLU keeping both inputs with `config` ([`crate::ops::Codes`] or the kernels'
    /// [`QuantConfig`]), one quantizer (running estimate) each.
    #[must_use]
    pub fn new(config: impl Into<QuantConfig>) -> Self {
        let config = config.into();
        SwiGlu { gate: QuantSlot::new(config), up: QuantSlot::new(config) }
    }

    /// `y = silu(gate)·up`.
    ///
    /// Shapes: `gate` and `up` equal, any rank; the result has their shape and dtype.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] (the shapes differ), [`crate::Error::DTypeMismatch`],
    /// [`crate::Error::UnsupportedDType`] (not a float), [`crate::Error::UnsupportedDevice`],
    /// the kernels' errors as [`crate::Error::Kernel`].
    pub fn forward(&self, gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
        check_dtypes("swiglu", &[(gate, "gate"), (up, "up")])?;
        if gate.dims() != up.dims() {
            return Err(Error::Shape {
                what: "swiglu up (vs the gate)".into(),
                expected: gate.dims().to_vec(),
                got: up.dims().to_vec(),
            }
            .into());
        }
        if let Some(y) = f64_via_f32("swiglu", &[gate, up], |t| self.forward(&t[0], &t[1]))? {
            return Ok(y);
        }
        let kernels = common_device("swiglu", &[gate, up])?;
        dispatch_float!(gate.dtype(), "swiglu", T => {
            let (g, u) = (gate.detach(), up.detach());
            let (gv, uv) = (View::of(&g)?, View::of(&u)?);
            let mut y = Output::<T>::zeros(gate.device(), &kernels, gate.shape())?;
            let saved = self.gate.with(gate.device(), &kernels, |qg| {
                self.up.with(gate.device(), &kernels, |qu| {
                    let (gr, ur) = (gv.tensor_ref::<T>()?, uv.tensor_ref::<T>()?);
                    swiglu_forward(
                        &kernels,
                        SwigluQuantizers { gate: qg, up: qu },
                        &SwigluInput { gate: &gr, up: &ur },
                        &mut y.tensor_mut()?,
                    )
                    .k()
                })
            })?;
            drop((gv, uv));
            attach(&[gate, up], y.into_storage()?, SwiGluGrad { saved, kernels })
        })
    }
}

struct SwiGluGrad {
    saved: SavedSwiglu,
    kernels: mesa_kernels::Device,
}

impl Backward for SwiGluGrad {
    fn name(&self) -> &'static str {
        "mesa-swiglu"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        dispatch_float!(grad.dtype(), "swiglu backward", T => {
            let view = View::of(grad)?;
            let mut dg = Output::<T>::zeros(grad.device(), &self.kernels, grad.shape())?;
            let mut du = Output::<T>::zeros(grad.device(), &self.kernels, grad.shape())?;
            swiglu_backward(
                &self.kernels,
                &self.saved,
                &view.tensor_ref::<T>()?,
                SwigluGrads { gate: &mut dg.tensor_mut()?, up: &mut du.tensor_mut()? },
            )
            .k()?;
            Ok(vec![Some(dg.into_tensor()?), Some(du.into_tensor()?)])
        })
    }
}
