//! Ops with forward and backward in candle's autograd, each running our kernels.
//!
//! | op | forward keeps (in the op) | backward |
//! |---|---|---|
//! | [`Gelu`] (erf, tanh) | codes of `x` | `gelu_backward` decodes in the kernel |
//! | [`SwiGlu`] (`silu(g)·u`) | codes of `g` and of `u` | `swiglu_backward` decodes both in one kernel |
//! | [`Rope`] (rotary position embeddings) | nothing (its config) | the inverse rotation of `dy` |
//! | [`Softmax`] (last axis, additive mask) | codes of `y` (square-root companded) | `softmax_backward` decodes in the kernel; a tracked mask gets `dx` summed over its broadcast axes |
//! | [`LayerNorm`] | codes of `x̂`, per-row mean and rstd | `layer_norm_backward` (dx, dweight, dbias) |
//! | [`RmsNorm`] | codes of `x̂`, per-row `1/rstd` | candle ops on the decoded `x̂` (no RMSNorm kernel) |
//! | [`CodedLinear`] | codes of `x` | `dW = dyᵀ·x̂` from the decoded `x̂`, candle's matmuls |
//! | [`LinearAttention`] (ReLU, ELU+1, FAVOR+) | the attention's saved states (f16, bf16: nothing) | chunked kernels; φ recomputed from `q`, `k` (f16, bf16: the f32 forward rerun first) |
//! | [`GatedLinearAttention`] (decay per step or head, grouped heads; identity or a feature map) | its final state (and denominators when normalised) | the gated kernel's backward; `φ` recomputed; `da`, `d(initial)` too (identity map: in the inputs' dtype, 16-bit on tensor cores; a feature map with 16-bit normalised: the f32 forward rerun first) |
//! | [`Dropout`] | a 64-bit key (the mask is regenerated; replayed in [checkpoint regions](crate::region)) | the mask again, times `dy` |
//!
//! **Constructors and configs.** An op's `new` takes the [`Codes`] it keeps (the defaults:
//! exact statistics; Mesa's running estimate is opt-in) or the kernels' [`QuantConfig`]. The
//! kernels' settings the ops take are re-exported here, so common use needs no
//! `mesa_kernels` dependency. The norms and the Linear take their weights in `forward`; as
//! candle-nn layers that hold them, built by candle-nn's constructors from a `VarBuilder`:
//! [`crate::nn`]. [`Gelu`] and [`Softmax`] (no mask) are `Module`s, [`Dropout`] a `ModuleT`.
//!
//! **Dtypes.** f32, f16 and bf16 run natively (the kernels' element types; f32 arithmetic
//! inside). An f64 tensor is computed in f32: its arguments are cast to f32 by candle's
//! `to_dtype`, the op runs on those, and its result is cast back to f64, all inside candle's
//! graph, so the gradient reaches the f64 arguments through candle's casts. The math is that
//! of f32 (inputs rounded to f32 once, `|δx| ≤ 2⁻²⁴|x|`), not of f64. Any other dtype is
//! [`Error::UnsupportedDType`]; tensors of one call must share one dtype, else
//! [`Error::DTypeMismatch`] naming both (no op casts one to another's); a tensor of the wrong
//! rank [`Error::Rank`], of the wrong shape [`Error::Shape`].
//!
//! **Non-finite inputs.** The default [`Codes`] take one offset and scale per tensor, so one
//! NaN or ±inf in an op's input makes its saved range non-finite and every row's gradient
//! NaN, finite rows included (the forward is exact either way; the kernels count such
//! groups: `SavedActivation`). candle's own ops would keep the finite rows' gradients.
//!
//! **What these per-op ops do not save.** Candle's autograd keeps a clone of every argument
//! of every op until backward (`BackpropOp`, candle-core `op.rs`), so the full-precision input
//! of an op stays alive as long as its output's graph, whatever the op itself keeps: the
//! codes are held *in addition*. The ops give correct, checked gradients where candle-nn's
//! fused ops have none; memory is saved by [`crate::layer::TransformerLayer`], one graph node
//! over a whole layer whose internals never enter candle's graph, and by
//! [checkpoint regions](crate::region) around any of these ops.
use std::sync::Mutex;

use candle_core::{DType, DeviceLocation, Shape, Storage, Tensor};
use mesa_kernels::Quantizer;

use crate::error::{Error, KernelResult};

mod codes;
mod dropout;
pub(crate) mod gated_linear_attention;
mod gelu;
mod layer_norm;
pub(crate) mod linear;
mod linear_attention;
pub(crate) mod rms_norm;
mod rope;
mod softmax;
mod swiglu;

pub use codes::Codes;
pub use dropout::Dropout;
pub use gated_linear_attention::GatedLinearAttention;
pub use gelu::Gelu;
pub use layer_norm::LayerNorm;
pub use linear::CodedLinear;
pub use linear_attention::{FeatureKind, LinearAttention};
pub use rms_norm::RmsNorm;
pub use rope::Rope;
pub use softmax::Softmax;
pub use swiglu::SwiGlu;
// what the ops' constructors take, so that common settings need no `mesa_kernels` dependency
pub use mesa_kernels::gated_linear_attention::GatedConfig;
pub use mesa_kernels::linear_attention::{LinearAttentionConfig, MemoryMode, Schedule};
pub use mesa_kernels::rope::{RopeConfig, RopePairing};
pub use mesa_kernels::{GeluForm, Grouping, QuantConfig, Rounding, StatsMode};

/// The dtype of an op's first argument, checked: `Ok(None)` for f32, f16 and bf16 (the op
/// runs natively); for f64, `f` run on the arguments cast to f32 (f64 ones only: the ops
/// refuse mixed dtypes first, [`check_dtypes`]) and its result cast back to f64, inside
/// candle's graph; any other dtype [`Error::UnsupportedDType`].
pub(crate) fn f64_via_f32(
    op: &'static str,
    args: &[&Tensor],
    f: impl FnOnce(&[Tensor]) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    let first = args.first().ok_or(Error::InvalidArgument { name: "tensors", why: "none given".into() })?;
    match first.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => Ok(None),
        DType::F64 => {
            let cast = args
                .iter()
                .map(|t| if t.dtype() == DType::F64 { t.to_dtype(DType::F32) } else { Ok((*t).clone()) })
                .collect::<candle_core::Result<Vec<Tensor>>>()?;
            Ok(Some(f(&cast)?.to_dtype(DType::F64)?))
        }
        dtype => Err(Error::UnsupportedDType { op, dtype }.into()),
    }
}

/// One dtype for all of an op's tensors (each named with its layout, the first the one the
/// others must match), else [`Error::DTypeMismatch`] naming the first that differs. Checked
/// before [`f64_via_f32`], so f64 goes to f32 only with f64 alone.
pub(crate) fn check_dtypes(op: &'static str, named: &[(&Tensor, &str)]) -> candle_core::Result<()> {
    let Some(((first, of), rest)) = named.split_first() else { return Ok(()) };
    match rest.iter().find(|(t, _)| t.dtype() != first.dtype()) {
        None => Ok(()),
        Some((t, what)) => Err(Error::DTypeMismatch {
            op,
            what: (*what).into(),
            of: (*of).into(),
            expected: first.dtype(),
            got: t.dtype(),
        }
        .into()),
    }
}

/// `t` has rank `expected` (or more, when `at_least`), else [`Error::Rank`] naming `what`.
pub(crate) fn check_rank(what: &str, t: &Tensor, expected: usize, at_least: bool) -> candle_core::Result<()> {
    let rank = t.rank();
    if rank == expected || (at_least && rank > expected) {
        Ok(())
    } else {
        Err(Error::Rank { what: what.into(), expected, at_least, got: t.dims().to_vec() }.into())
    }
}

/// A norm's parameter `param` (`what`, e.g. `"weight [C]"`) is `[C]` for the input `x: [..., C]`,
/// else [`Error::Shape`]: a rank-1 parameter of another size names the input's `C` and shows
/// the input's expected and given shapes (the usual cause: an input of another width than
/// the layer's); any other shape names the parameter.
pub(crate) fn check_norm_param(op: &str, what: &str, x: &Tensor, param: &Tensor) -> candle_core::Result<()> {
    let cols = x.dims().last().copied().unwrap_or(0);
    match param.dims() {
        [c] if *c == cols => Ok(()),
        [c] => {
            let mut expected = x.dims().to_vec();
            if let Some(last) = expected.last_mut() {
                *last = *c;
            }
            Err(Error::Shape {
                what: format!("{op} input [..., C] (C = {c}: {what} is [{c}])"),
                expected,
                got: x.dims().to_vec(),
            }
            .into())
        }
        other => Err(Error::Shape { what: format!("{op} {what}"), expected: vec![cols], got: other.to_vec() }.into()),
    }
}

/// A [`Quantizer`] (its running estimate) per device, made on first use.
#[derive(Debug)]
pub(crate) struct QuantSlot {
    config: QuantConfig,
    slot: Mutex<Option<(DeviceLocation, Quantizer)>>,
}

impl QuantSlot {
    pub(crate) fn new(config: QuantConfig) -> Self {
        QuantSlot { config, slot: Mutex::new(None) }
    }

    /// Runs `f` with the quantizer of `device` (a new one when the device changed).
    pub(crate) fn with<R>(
        &self,
        device: &candle_core::Device,
        kernels: &mesa_kernels::Device,
        f: impl FnOnce(&mut Quantizer) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let mut slot = self.slot.lock().map_err(|_| Error::StateConsumed { op: "quantizer" })?;
        let location = device.location();
        if !matches!(&*slot, Some((l, _)) if *l == location) {
            *slot = Some((location, Quantizer::new(kernels, self.config).k()?));
        }
        match slot.as_mut() {
            Some((_, q)) => f(q),
            None => Err(Error::StateConsumed { op: "quantizer" }.into()),
        }
    }
}

/// A result computed with candle's own ops, as the storage [`crate::attach`] carries:
/// one copy of it (candle has no way to move a tensor's storage out).
pub(crate) fn tensor_result(t: &Tensor) -> candle_core::Result<(Storage, Shape)> {
    let t = t.contiguous()?;
    let dense = t.layout().start_offset() == 0 && dense_len(&t) == Some(t.elem_count());
    let t = if dense { t } else { t.copy()? };
    let (storage, layout) = t.storage_and_layout();
    let copy = match &*storage {
        Storage::Cpu(s) => Storage::Cpu(s.clone()),
        #[cfg(feature = "cuda")]
        Storage::Cuda(s) => {
            use candle_core::backend::BackendStorage;
            Storage::Cuda(s.try_clone(layout)?)
        }
        other => {
            let _ = layout;
            return Err(
                Error::UnsupportedDevice { op: "result", device: format!("{:?}", other.device().location()) }.into()
            );
        }
    };
    Ok((copy, t.shape().clone()))
}

/// Elements of a CPU tensor's whole storage (`None` for other devices and dtypes).
fn dense_len(t: &Tensor) -> Option<usize> {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(candle_core::CpuStorage::F32(v)) => Some(v.len()),
        Storage::Cpu(candle_core::CpuStorage::F16(v)) => Some(v.len()),
        Storage::Cpu(candle_core::CpuStorage::BF16(v)) => Some(v.len()),
        Storage::Cpu(candle_core::CpuStorage::F64(v)) => Some(v.len()),
        _ => None,
    }
}
