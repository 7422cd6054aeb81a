//! Softmax over the last axis with an additive mask, keeping only the codes of its output.
use candle_core::Tensor;
use mesa_kernels::fused::{softmax_backward, softmax_forward, SoftmaxInput};
use mesa_kernels::{Grouping, Rounding, SavedActivation, SoftmaxCodes, SoftmaxSave};

use super::{check_dtypes, check_rank, f64_via_f32};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, Output, View};
use crate::error::{Error, KernelResult};

/// `y = softmax(x + mask)` over the last axis; f32, f16, bf16, and f64 computed in f32
/// ([`crate::ops`], "Dtypes").
///
/// Forward: one kernel writes `y` and its codes with fixed parameters (offset 0, scale
/// `1/(2^bits − 1)`, square-root companded by default: no statistics pass); backward:
/// `dx = ŷ⊙(dy − Σ_row dy·ŷ)`, `ŷ` decoded inside the kernel. With `s = 1/(2^bits − 1)` the
/// decoded probabilities satisfy `|ŷ − y| ≤ (√y + s/4)·s` (round to nearest). A fully masked
/// row (all `−inf`) gives zeros. A mask that tracks a gradient (a variable, or computed from
/// one) gets `dx` — the gradient with respect to `x + mask` — summed over the axes along which
/// it was broadcast (in f32, then rounded to its dtype), in its own shape; otherwise none.
#[derive(Debug, Clone, Copy)]
pub struct Softmax {
    save: SoftmaxSave,
}

impl Default for Softmax {
    /// 8-bit square-root companded codes, round to nearest.
    fn default() -> Self {
        Softmax::new(8)
    }
}

impl Softmax {
    /// Codes of `bits` (8, 4, 2; checked by the kernel call), square-root companded.
    #[must_use]
    pub fn new(bits: u32) -> Self {
        Softmax {
            save: SoftmaxSave {
                bits,
                codes: SoftmaxCodes::Sqrt,
                grouping: Grouping::Tensor,
                rounding: Rounding::Nearest,
            },
        }
    }

    /// `x`: rank ≥ 1, rows along the last axis; `mask`: `None` or any shape that broadcasts
    /// to `x`'s (read through stride 0, never expanded), `x`'s dtype.
    ///
    /// # Errors
    /// [`Error::Rank`] (`x` of rank 0), [`Error::Shape`] (a mask that does not broadcast to
    /// `x`), [`Error::DTypeMismatch`] (a mask of another dtype), [`Error::UnsupportedDType`],
    /// [`Error::DeviceMismatch`], the kernels' errors as [`Error::Kernel`].
    pub fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let mut args = vec![x];
        args.extend(mask);
        let mut named = vec![(x, "input [..., N]")];
        named.extend(mask.map(|m| (m, "mask")));
        check_dtypes("softmax", &named)?;
        if let Some(y) = f64_via_f32("softmax", &args, |t| self.forward(&t[0], t.get(1)))? {
            return Ok(y);
        }
        check_rank("softmax input [..., N]", x, 1, true)?;
        if let Some(m) = mask {
            broadcasts_to(m.dims(), x.dims())?;
        }
        let kernels = common_device("softmax", &args)?;
        let mask_view = mask.map(|m| m.detach().broadcast_as(x.shape())).transpose()?;
        dispatch_float!(x.dtype(), "softmax", T => {
            let xd = x.detach();
            let mut y = Output::<T>::zeros(x.device(), &kernels, x.shape())?;
            let saved = {
                let xv = View::of(&xd)?;
                let mv = mask_view.as_ref().map(View::of).transpose()?;
                let xr = xv.tensor_ref::<T>()?;
                let mr = mv.as_ref().map(|m| m.tensor_ref::<T>()).transpose()?;
                let input = SoftmaxInput { x: &xr, mask: mr.as_ref() };
                softmax_forward(&kernels, &self.save, &input, &mut y.tensor_mut()?).k()?
            };
            attach(&args, y.into_storage()?, SoftmaxGrad { saved, kernels })
        })
    }
}

/// A mask of shape `mask` can be read as `x`'s shape by stride 0 (numpy's rule, right-aligned:
/// each of its dims 1 or `x`'s), else [`Error::Shape`].
fn broadcasts_to(mask: &[usize], x: &[usize]) -> candle_core::Result<()> {
    let fits = mask.len() <= x.len() && mask.iter().rev().zip(x.iter().rev()).all(|(&m, &d)| m == 1 || m == d);
    if fits {
        Ok(())
    } else {
        Err(Error::Shape {
            what: "softmax mask (broadcast to the input)".into(),
            expected: x.to_vec(),
            got: mask.to_vec(),
        }
        .into())
    }
}

struct SoftmaxGrad {
    saved: SavedActivation,
    kernels: mesa_kernels::Device,
}

/// The gradient of a mask of shape `mask` broadcast to `dx`'s shape: `dx` summed over the
/// axes the mask lacks (leading) or has as 1 where `dx` has more, in f32, as `dtype`.
fn mask_grad(dx: &Tensor, mask: &[usize], dtype: candle_core::DType) -> candle_core::Result<Tensor> {
    let dims = dx.dims();
    let lead = dims.len() - mask.len();
    let axes: Vec<usize> = (0..dims.len()).filter(|&i| i < lead || (mask[i - lead] == 1 && dims[i] != 1)).collect();
    let sum = dx.to_dtype(candle_core::DType::F32)?;
    let sum = if axes.is_empty() { sum } else { sum.sum_keepdim(axes)? };
    sum.reshape(mask)?.to_dtype(dtype)
}

impl Backward for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "mesa-softmax"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let dx = dispatch_float!(grad.dtype(), "softmax backward", T => {
            let view = View::of(grad)?;
            let mut dx = Output::<T>::zeros(grad.device(), &self.kernels, grad.shape())?;
            softmax_backward(&self.kernels, &self.saved, &view.tensor_ref::<T>()?, &mut dx.tensor_mut()?).k()?;
            dx.into_tensor()
        })?;
        // the mask's gradient only where candle's graph wants one (an untracked mask: none)
        let dmask = match args.get(1) {
            Some(m) if m.track_op() => Some(mask_grad(&dx, m.dims(), m.dtype())?),
            _ => None,
        };
        let mut grads = vec![Some(dx)];
        if args.len() == 2 {
            grads.push(dmask);
        }
        Ok(grads)
    }
}
