//! Rotary position embeddings (RoFormer, eq. 34) in candle's autograd, keeping nothing.
use candle_core::Tensor;
use mesa_kernels::rope::{rope, rope_backward, RopeConfig};

use super::{check_rank, f64_via_f32};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, Output, View};
use crate::error::KernelResult;

/// RoPE over `x: [..., S, D]` (candle-transformers' `[B, H, S, D]` queries and keys): pair `i`
/// of the first `R` dims of the row at position `p = position_offset + s` rotated by
/// `θ = p·base^(−2i/R)` ([`RopeConfig`]: pairing, base, rotated dims, offset). f32, f16, bf16,
/// and f64 computed in f32 ([`crate::ops`], "Dtypes").
///
/// What candle-nn's `rotary_emb::rope` (halves) and `rope_i` (interleaved) compute from a
/// cos/sin cache built with the same f32 angles, with a backward: the rotation by `−θ`, which
/// needs nothing kept (the op holds its config only).
#[derive(Debug, Clone, Copy)]
pub struct Rope {
    config: RopeConfig,
}

impl Rope {
    /// RoPE with `config` (`RopeConfig::llama(base)`: halves, every dim, from position 0).
    #[must_use]
    pub fn new(config: RopeConfig) -> Self {
        Rope { config }
    }

    /// `RoPE(x)`.
    ///
    /// # Errors
    /// [`crate::Error::Rank`] (rank < 2), [`crate::Error::UnsupportedDType`],
    /// [`crate::Error::UnsupportedDevice`], the kernels' errors as [`crate::Error::Kernel`]
    /// (rotated dims odd or wider than `D`, a base not finite and > 1, positions past 2²⁴).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        check_rank("rope input [..., S, D]", x, 2, true)?;
        if let Some(y) = f64_via_f32("rope", &[x], |t| self.forward(&t[0]))? {
            return Ok(y);
        }
        let kernels = common_device("rope", &[x])?;
        dispatch_float!(x.dtype(), "rope", T => {
            let detached = x.detach();
            let view = View::of(&detached)?;
            let mut y = Output::<T>::zeros(x.device(), &kernels, x.shape())?;
            rope(&kernels, &self.config, &view.tensor_ref::<T>()?, &mut y.tensor_mut()?).k()?;
            drop(view);
            attach(&[x], y.into_storage()?, RopeGrad { config: self.config, kernels })
        })
    }
}

struct RopeGrad {
    config: RopeConfig,
    kernels: mesa_kernels::Device,
}

impl Backward for RopeGrad {
    fn name(&self) -> &'static str {
        "mesa-rope"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        dispatch_float!(grad.dtype(), "rope backward", T => {
            let view = View::of(grad)?;
            let mut dx = Output::<T>::zeros(grad.device(), &self.kernels, grad.shape())?;
            rope_backward(&self.kernels, &self.config, &view.tensor_ref::<T>()?, &mut dx.tensor_mut()?).k()?;
            Ok(vec![Some(dx.into_tensor()?)])
        })
    }
}
