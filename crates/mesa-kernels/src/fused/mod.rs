//! Fused producers and consumers of saved activations (Mesa: Pan et al. 2021, §3):
//! GELU, SwiGLU, softmax and LayerNorm whose forward writes the output **and** the codes of what
//! their backward needs in one pass, and whose backward decodes those codes inside the kernel
//! (no full-precision activation is ever materialised).
//!
//! | op | saved for backward | parameters of the codes |
//! |---|---|---|
//! | [`gelu_forward`] | codes of the input `x` | the [`Quantizer`]'s (running estimate or exact) |
//! | [`softmax_forward`] | codes of the output `y` only (of `√y` by default: [`SoftmaxCodes`]) | fixed: offset 0, scale `1/(2^bits − 1)` |
//! | [`layer_norm_forward`] | codes of `x̂ = (x − mean)·rstd`, plus per-row `mean`, `rstd` (f32) | the [`Quantizer`]'s |
//! | [`swiglu_forward`] | codes of both inputs, the gate `g` and the up projection `u` | two [`Quantizer`]s |
//! | [`rope_forward_save`](crate::rope::rope_forward_save) (module `rope`) | codes of its output `y = RoPE(x)`, the rotated Q or K attention's backward reads | the [`Quantizer`]'s |
//!
//! Every op also has a plain entry point that saves nothing ([`gelu`], [`softmax`],
//! [`layer_norm`]) and a backward that reads a full-precision saved tensor instead of codes
//! ([`gelu_backward_plain`], [`softmax_backward_plain`], [`layer_norm_backward_plain`]), for
//! callers that keep some activations uncompressed (and for the benches).
//!
//! Tensors are [`TensorRef`] (inputs) and [`TensorMut`] (outputs); two tensors of the same
//! type and shape are named fields of an argument struct ([`LayerNormForward`],
//! [`LayerNormGrads`], [`SoftmaxInput`], …), so they cannot be swapped by position.
//!
//! **In-place: not supported** by any op here (overlapping inputs and outputs →
//! [`Error::Aliasing`]): the kernels mark their pointers
//! `__restrict__`, and several passes re-read an input (LayerNorm's code pass reads `x`
//! after `y` is written, its `dweight`/`dbias` pass reads `dy` after `dx` is written).
//!
//! **Empty tensors** are valid: an op on a tensor with no element launches nothing (LayerNorm
//! backward still writes `dweight = dbias = 0`), and the forward ops return an empty saved
//! handle — also when the grouped axis has length 0 (0 groups). The one exception is
//! LayerNorm over rows of length 0 (`C = 0` with at least one row): a row without elements
//! has no mean, so that is [`Error::InvalidLayout`].
//!
//! **Why softmax needs no statistics.** Probabilities lie in `[0, 1]`, so the code range is
//! known before the kernel runs: offset 0, scale `1/(2^bits − 1)` (`1/255` at 8 bits). There
//! is no statistics pass, no running estimate and nothing is ever clamped; Mesa's running
//! estimate instead learns a per-head `[min, max]` that lags the batch and clamps attention
//! peaks of later batches. By default the codes are of `√y` (square-root companding,
//! [`SoftmaxCodes::Sqrt`]): the step in `y` is `≈ 2√y/(2^bits − 1)`, finer where a long row's
//! probabilities sit (`≈ 1/N`); decoders square (`ŷ = q²`), as the handle's
//! [`SavedActivation::companding`] tells them.
//!
//! **A tensor consumed by two ops is saved once.** A [`SavedActivation`] is an immutable
//! handle: keep one and hand `&saved` to every consumer. For attention, the softmax output
//! `P` is needed by the softmax backward *and* by the backward of `P·V` (`dV = Pᵀ·dO`): pass
//! the handle of [`softmax_forward`] to [`softmax_backward`] and decode the same handle
//! ([`SavedActivation::dequantize`]) for the matmul — Mesa stores it up to three times.
//! Likewise the input of the Q, K and V projections is quantized once and its handle
//! decoded by the three weight-gradient matmuls.
//!
//! ```
//! use mesa_kernels::fused::{gelu_backward, gelu_forward, softmax_backward, softmax_forward, channel_groups, SoftmaxInput};
//! use mesa_kernels::{Device, GeluForm, Quantizer, SoftmaxSave, TensorMut, TensorRef};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::best_available();
//! // FFN activation [tokens, 4C] with 12 channel groups (Mesa's head-wise grouping)
//! let xb = device.upload(&(0..768).map(|i| (i as f32 * 0.01).sin() * 3.0).collect::<Vec<_>>())?;
//! let mut yb = device.alloc_zeros::<f32>(768)?;
//! let x = TensorRef::contiguous(&xb, &[8, 96])?;
//! let mut quantizer = Quantizer::new(&device, channel_groups(1, 12))?;
//! let saved = gelu_forward(&device, &mut quantizer, GeluForm::Erf, &x, &mut TensorMut::contiguous(&mut yb, &[8, 96])?)?;
//! assert_eq!(saved.size_in_bytes(), 768 + 12 * 8 + 4); // 1 byte per element + parameters
//! let dyb = device.upload(&[1.0f32; 768])?;
//! let mut dxb = device.alloc_zeros::<f32>(768)?;
//! let dy = TensorRef::contiguous(&dyb, &[8, 96])?;
//! gelu_backward(&device, GeluForm::Erf, &saved, &dy, &mut TensorMut::contiguous(&mut dxb, &[8, 96])?)?; // decodes in the kernel
//!
//! // attention probabilities [B, H, N, N]: codes of the output only, fixed range [0, 1]
//! let shape = [1, 2, 4, 4];
//! let scores = device.upload(&[0.5f32; 32])?;
//! let mut p = device.alloc_zeros::<f32>(32)?;
//! let s = TensorRef::contiguous(&scores, &shape)?;
//! let saved_p = softmax_forward(&device, &SoftmaxSave::per_head(1), &SoftmaxInput::new(&s), &mut TensorMut::contiguous(&mut p, &shape)?)?;
//! let dpb = device.upload(&[1.0f32; 32])?;
//! let mut ds = device.alloc_zeros::<f32>(32)?;
//! let dp = TensorRef::contiguous(&dpb, &shape)?;
//! softmax_backward(&device, &saved_p, &dp, &mut TensorMut::contiguous(&mut ds, &shape)?)?;
//! // constant dy: the exact gradient is 0; from 8-bit codes of p = 1/4 it is within a step
//! assert!(ds.to_vec()?.iter().all(|v| v.abs() < 1.0 / 255.0));
//! # Ok(())
//! # }
//! ```
//!
//! Shapes: GELU is elementwise over any shape and strides; softmax and LayerNorm work along
//! the **last** axis (any strides; the other axes index rows). dtypes: f32, f16, bf16 in and
//! out (same dtype), f32 arithmetic; LayerNorm's `mean`, `rstd`, `dweight`, `dbias` are f32.
//! Bytes moved per kernel and the H200 floors: `docs/fused.md`.
use mesa_kernels_sys as sys;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::{kernel_view, Grouping, Layout, MAX_DIMS};
#[allow(unused_imports)] // intra-doc links
use crate::quant::Quantizer;
use crate::quant::{QuantConfig, SavedActivation, SavedView};
#[allow(unused_imports)] // intra-doc links
use crate::tensor::{TensorMut, TensorRef};

mod gelu;
mod layer_norm;
mod softmax;
mod swiglu;

pub use gelu::{
    gelu, gelu_backward, gelu_backward_plain, gelu_backward_view, gelu_forward, gelu_forward_to, GeluBackwardPlain,
    GeluForm,
};
pub use layer_norm::{
    layer_norm, layer_norm_backward, layer_norm_backward_plain, layer_norm_backward_view, layer_norm_forward,
    layer_norm_forward_to, LayerNormBackward, LayerNormBackwardPlain, LayerNormBackwardView, LayerNormForward,
    LayerNormGrads, LayerNormSaveMut, SavedLayerNorm,
};
pub use softmax::{
    softmax, softmax_backward, softmax_backward_plain, softmax_backward_view, softmax_forward, softmax_forward_to,
    SoftmaxBackwardPlain, SoftmaxCodes, SoftmaxInput, SoftmaxSave,
};
pub use swiglu::{
    swiglu, swiglu_backward, swiglu_backward_plain, swiglu_backward_view, swiglu_forward, swiglu_forward_to,
    SavedSwiglu, SwigluGrads, SwigluInput, SwigluMeta, SwigluQuantizers, SwigluSaveMut, SwigluSavedView,
};

/// `got` must have the shape `expected`.
fn same_shape(expected: &[usize], got: &[usize], what: &str) -> Result<()> {
    if expected != got {
        return Err(Error::shape_mismatch(what, expected, got));
    }
    Ok(())
}

/// Elementwise view: merged dimensions of one tensor. Only for non-empty views (merging
/// multiplies sizes).
fn elem_desc(layout: &Layout, dtype: DType) -> Result<sys::MesaTensorDesc> {
    Ok(kernel_view(layout, &Grouping::Tensor, dtype)?.desc)
}

/// Rank ≥ 1 for a row op (rows along the last axis): the row length.
fn row_len(shape: &[usize], what: &str) -> Result<usize> {
    shape
        .last()
        .copied()
        .ok_or_else(|| Error::invalid_layout(what, "a row op needs a tensor of rank >= 1 (rows along the last axis)"))
}

/// Row view: the last axis kept as the row, the others merged where contiguous. Only for
/// non-empty views.
fn row_desc(layout: &Layout, dtype: DType, what: &str) -> Result<sys::MesaTensorDesc> {
    let rank = layout.shape().len();
    row_len(layout.shape(), what)?;
    let outer = Layout::strided(&layout.shape()[..rank - 1], &layout.strides()[..rank - 1], 0)?;
    let mut desc = kernel_view(&outer, &Grouping::Tensor, dtype)?.desc;
    let k = desc.ndim as usize;
    if k + 1 > MAX_DIMS {
        return Err(Error::unsupported(
            what,
            format!("a view with {} non-mergeable dimensions (at most {MAX_DIMS})", k + 1),
        ));
    }
    desc.shape[k] = layout.shape()[rank - 1] as i64;
    desc.strides[k] = layout.strides()[rank - 1] as i64;
    desc.ndim += 1;
    Ok(desc)
}

/// A dense `[0, cols]` row view: what an empty row tensor is shown to a kernel as (no
/// product of its possibly huge dimensions is formed).
fn empty_rows_desc(cols: usize, dtype: DType) -> sys::MesaTensorDesc {
    let mut desc = sys::MesaTensorDesc { ndim: 2, dtype: dtype.to_sys(), ..Default::default() };
    desc.shape[1] = cols as i64;
    desc.strides[0] = cols as i64;
    desc.strides[1] = 1;
    desc
}

/// Registers a saved tensor's codes and parameters on `launch` for a kernel that decodes
/// them (the backwards of GELU, softmax and LayerNorm).
fn code_source<'a>(launch: &mut Launch<'a>, saved: &'a SavedView<'_>) -> Result<sys::MesaCodeSource> {
    let meta = saved.meta();
    let (run, count) = meta.group_map()?;
    let (codes, params) = saved.register(launch)?;
    Ok(sys::MesaCodeSource {
        codes,
        params,
        group_run: run as i64,
        group_count: count as i64,
        bits: meta.bits() as i32,
        map: meta.companding().sys(),
    })
}

/// The widening pass of a producer whose saved tensor is its input (GELU, SwiGLU) or an
/// output it wrote in an earlier step (RoPE, [`crate::rope::rope_forward_save`]): the
/// Quantizer's quantize kernel on that tensor's grouped view, encoding the widened groups
/// again (`widen`: the flags of [`crate::quant::ProducerStep::Widen`]).
///
/// # Safety
/// `x` is a tensor registered on `launch` (an input, or an output written by an earlier
/// kernel of it) and described by `grouped`; `sink`'s codes and params and `widen` are
/// buffers `Quantizer::encode` registered on `launch` and sized for that tensor's shape and
/// grouping.
pub(crate) unsafe fn widen_input(
    launch: &mut Launch<'_>,
    x: *const std::ffi::c_void,
    grouped: &crate::layout::KernelView,
    sink: &sys::MesaCodeSink,
    widen: *const u32,
) -> Result<()> {
    let args = sys::MesaQuantizeArgs {
        x,
        x_desc: grouped.desc,
        grouping: grouped.grouping,
        params: sink.params,
        codes: sink.codes,
        stats: std::ptr::null_mut(),
        seed: sink.seed,
        bits: sink.bits,
        rounding: sink.rounding,
        map: sys::MESA_CODE_MAP_IDENTITY as sys::MesaCodeMap,
        _pad: 0,
        widen,
        finalize: sys::MesaFusedFinalize::default(),
    };
    // SAFETY: the caller's contract: every pointer registered and sized for this launch.
    unsafe { launch.launch("quantize", &args, sys::mesa_quantize, sys::mesa_emu_quantize) }
}

/// A saved handle can be decoded for a gradient of shape `expect` on `device`.
fn check_saved(saved: &SavedActivation, device: &Device, expect: &[usize]) -> Result<()> {
    saved.check_backend(device)?;
    same_shape(saved.shape(), expect, "gradient (vs the saved activation)")
}

/// Shorthand: a [`QuantConfig`] for the inputs of GELU and LayerNorm in a transformer of
/// hidden size divisible by `groups`: `groups` channel groups of the last axis (Mesa's
/// "head-wise" for token tensors), 8 bits, round to nearest, momentum 0.9, running estimate.
#[must_use]
pub fn channel_groups(last_axis: usize, groups: usize) -> QuantConfig {
    QuantConfig { grouping: Grouping::Channels { axis: last_axis, groups }, ..QuantConfig::per_tensor() }
}
