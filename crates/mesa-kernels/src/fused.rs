//! Fused producers and consumers of saved activations (Mesa: Pan et al. 2021, §3; BRIEF §5.1):
//! GELU, softmax and LayerNorm whose forward writes the output **and** the codes of what
//! their backward needs in one pass, and whose backward decodes those codes inside the kernel
//! (no full-precision activation is ever materialised).
//!
//! | op | saved for backward | parameters of the codes |
//! |---|---|---|
//! | [`gelu_forward`] | codes of the input `x` | the [`Quantizer`]'s (running estimate or exact) |
//! | [`softmax_forward`] | codes of the output `y` only (of `√y` by default: [`SoftmaxCodes`]) | fixed: offset 0, scale `1/(2^bits − 1)` |
//! | [`layer_norm_forward`] | codes of `x̂ = (x − mean)·rstd`, plus per-row `mean`, `rstd` (f32) | the [`Quantizer`]'s |
//!
//! Every op also has a plain entry point that saves nothing ([`gelu`], [`softmax`],
//! [`layer_norm`]) and a backward that reads a full-precision saved tensor instead of codes
//! ([`gelu_backward_plain`], [`softmax_backward_plain`], [`layer_norm_backward_plain`]), for
//! callers that keep some activations uncompressed (and for the benches).
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
//! use mesa_kernels::fused::{gelu_backward, gelu_forward, softmax_backward, softmax_forward, channel_groups};
//! use mesa_kernels::{Device, GeluForm, Layout, Quantizer, SoftmaxSave};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::best_available();
//! // FFN activation [tokens, 4C] with 12 channel groups (Mesa's head-wise grouping)
//! let l = Layout::contiguous(&[8, 96]);
//! let x = device.upload(&(0..768).map(|i| (i as f32 * 0.01).sin() * 3.0).collect::<Vec<_>>())?;
//! let mut y = device.alloc_zeros::<f32>(768)?;
//! let mut quantizer = Quantizer::new(&device, channel_groups(1, 12))?;
//! let saved = gelu_forward(&device, &mut quantizer, GeluForm::Erf, &x, &l, &mut y, &l)?;
//! assert_eq!(saved.size_in_bytes(), 768 + 12 * 8 + 4); // 1 byte per element + parameters
//! let dy = device.upload(&[1.0f32; 768])?;
//! let mut dx = device.alloc_zeros::<f32>(768)?;
//! gelu_backward(&device, GeluForm::Erf, &saved, &dy, &l, &mut dx, &l)?; // decodes in the kernel
//!
//! // attention probabilities [B, H, N, N]: codes of the output only, fixed range [0, 1]
//! let s = Layout::contiguous(&[1, 2, 4, 4]);
//! let scores = device.upload(&[0.5f32; 32])?;
//! let mut p = device.alloc_zeros::<f32>(32)?;
//! let saved_p = softmax_forward(&device, &SoftmaxSave::per_head(1), &scores, &s, None, &mut p, &s)?;
//! let dp = device.upload(&[1.0f32; 32])?;
//! let mut ds = device.alloc_zeros::<f32>(32)?;
//! softmax_backward(&device, &saved_p, &dp, &s, &mut ds, &s)?;
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
use std::ffi::c_void;
use std::sync::Arc;

use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, DeviceMemory, DeviceMemoryMut};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::{kernel_view, Grouping, Layout, MAX_DIMS};
use crate::quant::{Companding, ProducerStep, QuantConfig, Quantizer, Rounding, SavedActivation, SavedMeta};

/// The GELU variant (Hendrycks & Gimpel 2016).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluForm {
    /// `x/2 · (1 + erf(x/√2))` (BERT, MiniLM).
    Erf,
    /// `x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))` (GPT-2).
    Tanh,
}

impl GeluForm {
    fn to_sys(self) -> sys::MesaGeluForm {
        (match self {
            GeluForm::Erf => sys::MESA_GELU_ERF,
            GeluForm::Tanh => sys::MESA_GELU_TANH,
        }) as sys::MesaGeluForm
    }
}

// ---------------------------------------------------------------------------------------
// Validation helpers.

fn same_device(device: &Device, quantizer: &Quantizer) -> Result<()> {
    let same = match (device.stream(), quantizer.device().stream()) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    };
    if !same {
        return Err(Error::LegacyWrongBackend("the quantizer was made for another device or stream".into()));
    }
    Ok(())
}

fn same_shape(a: &Layout, b: &Layout, what: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::LegacyShape(format!("{what} has shape {:?}, expected {:?}", b.shape(), a.shape())));
    }
    Ok(())
}

/// Elementwise view: merged dimensions of one tensor.
fn elem_desc(layout: &Layout, dtype: DType) -> Result<sys::MesaTensorDesc> {
    Ok(kernel_view(layout, &Grouping::Tensor, dtype)?.desc)
}

/// Row view: the last axis kept as the row, the others merged where contiguous.
fn row_desc(layout: &Layout, dtype: DType) -> Result<sys::MesaTensorDesc> {
    let rank = layout.shape().len();
    if rank == 0 {
        return Err(Error::LegacyShape("a row op needs a tensor of rank >= 1 (rows along the last axis)".into()));
    }
    let outer = Layout::strided(&layout.shape()[..rank - 1], &layout.strides()[..rank - 1], 0)?;
    let mut desc = kernel_view(&outer, &Grouping::Tensor, dtype)?.desc;
    let k = desc.ndim as usize;
    if k + 1 > MAX_DIMS {
        return Err(Error::LegacyUnsupported(format!(
            "a view with {} non-mergeable dimensions (at most {MAX_DIMS})",
            k + 1
        )));
    }
    desc.shape[k] = layout.shape()[rank - 1] as i64;
    desc.strides[k] = layout.strides()[rank - 1] as i64;
    desc.ndim += 1;
    Ok(desc)
}

fn code_source(saved: &SavedActivation, device: &Device, expect: &[usize]) -> Result<(usize, usize)> {
    saved.check_backend(device)?;
    if saved.shape() != expect {
        return Err(Error::LegacyShape(format!(
            "saved activation has shape {:?}, the gradient {:?}",
            saved.shape(),
            expect
        )));
    }
    saved.group_map()
}

fn sys_rounding(r: Rounding) -> (sys::MesaRounding, u64) {
    match r {
        Rounding::Nearest => (sys::MESA_ROUND_NEAREST as sys::MesaRounding, 0),
        Rounding::Stochastic { seed } => (sys::MESA_ROUND_STOCHASTIC as sys::MesaRounding, seed),
    }
}

// ---------------------------------------------------------------------------------------
// GELU.

/// GELU forward that saves the codes of its input: `y = gelu(x)`, and the returned handle
/// holds `Q(x)` with `quantizer`'s grouping, bit width, rounding and running estimate (one
/// pass over `x`; two on the quantizer's first batch and in [`crate::StatsMode::Exact`]).
///
/// Shapes: `x` and `y` any equal shapes, any strides (`y` must not overlap itself). Bytes
/// moved: `numel·sizeof(T)` read, `numel·sizeof(T) + numel·bits/8` written. Allocates the
/// saved handle (stream-ordered).
///
/// # Errors
/// [`Error::Shape`] (shapes differ, bad grouping, output overlaps itself),
/// [`Error::BufferTooShort`], [`Error::TooLarge`], [`Error::WrongBackend`] (buffers or
/// quantizer of another device), CUDA errors.
#[allow(clippy::too_many_arguments)]
pub fn gelu_forward<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    form: GeluForm,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    y: &mut (impl DeviceMemoryMut<T> + ?Sized),
    y_layout: &Layout,
) -> Result<SavedActivation> {
    same_device(device, quantizer)?;
    same_shape(x_layout, y_layout, "GELU output")?;
    let xm = x.mem_ref();
    x_layout.check_fits(xm.len(), "input")?;
    let mut ym = y.mem_mut();
    y_layout.check_fits(ym.len(), "output")?;
    y_layout.check_no_overlap("output")?;
    let x_desc = elem_desc(x_layout, T::DTYPE)?;
    let y_desc = elem_desc(y_layout, T::DTYPE)?;
    let xp = device.read_ptr(&xm, x_layout.offset(), "input")?;
    let yp = device.write_ptr(&mut ym, y_layout.offset(), "output")?;
    quantizer.produce::<T>(x_layout.shape(), x_layout.strides(), |step, sink| {
        let args = sys::MesaGeluForwardArgs {
            x: xp.addr as *const c_void,
            x_desc,
            y: if step == ProducerStep::Stats { std::ptr::null_mut() } else { yp.addr },
            y_desc,
            sink,
            form: form.to_sys(),
            _pad: 0,
        };
        // SAFETY: x and y views fit their buffers (check_fits), y does not overlap itself;
        // the sink's codes/params/stats were sized by the quantizer for x's shape and grouping.
        unsafe { device.launch("gelu_forward", &args, sys::mesa_gelu_forward, sys::mesa_emu_gelu_forward) }
    })
}

/// Plain GELU forward, nothing saved: `y = gelu(x)`.
///
/// # Errors
/// As [`gelu_forward`].
pub fn gelu<T: Element>(
    device: &Device,
    form: GeluForm,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    y: &mut (impl DeviceMemoryMut<T> + ?Sized),
    y_layout: &Layout,
) -> Result<()> {
    same_shape(x_layout, y_layout, "GELU output")?;
    let xm = x.mem_ref();
    x_layout.check_fits(xm.len(), "input")?;
    let mut ym = y.mem_mut();
    y_layout.check_fits(ym.len(), "output")?;
    y_layout.check_no_overlap("output")?;
    let args = sys::MesaGeluForwardArgs {
        x: device.read_ptr(&xm, x_layout.offset(), "input")?.addr as *const c_void,
        x_desc: elem_desc(x_layout, T::DTYPE)?,
        y: device.write_ptr(&mut ym, y_layout.offset(), "output")?.addr,
        y_desc: elem_desc(y_layout, T::DTYPE)?,
        sink: sys::MesaCodeSink::default(),
        form: form.to_sys(),
        _pad: 0,
    };
    // SAFETY: both views fit their buffers, y does not overlap itself; no codes are written.
    unsafe { device.launch("gelu_forward", &args, sys::mesa_gelu_forward, sys::mesa_emu_gelu_forward) }
}

/// GELU backward from codes: `dx = dy · gelu'(x̂)`, `x̂` decoded from `saved` inside the
/// kernel. Bytes moved: `numel·(sizeof(T) + bits/8)` read, `numel·sizeof(T)` written.
///
/// # Errors
/// [`Error::Shape`] (shapes differ from the saved tensor's, dx overlaps itself),
/// [`Error::BufferTooShort`], [`Error::WrongBackend`], CUDA errors.
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward<T: Element>(
    device: &Device,
    form: GeluForm,
    saved: &SavedActivation,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
) -> Result<()> {
    let (run, count) = code_source(saved, device, dy_layout.shape())?;
    let (codes, params) = saved.parts();
    let (cm, pm) = (codes.mem_ref(), params.mem_ref());
    let source = sys::MesaCodeSource {
        codes: device.read_ptr(&cm, 0, "codes")?.addr as *const u8,
        params: device.read_ptr(&pm, 0, "params")?.addr as *const sys::MesaGroupParams,
        group_run: run as i64,
        group_count: count as i64,
        bits: saved.bits() as i32,
        map: saved.companding().sys(),
    };
    gelu_backward_impl::<T>(device, form, source, None, dy, dy_layout, dx, dx_layout)
}

/// GELU backward reading a full-precision saved input `x` (same dtype as `dy`).
///
/// # Errors
/// As [`gelu_backward`].
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward_plain<T: Element>(
    device: &Device,
    form: GeluForm,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
) -> Result<()> {
    same_shape(dy_layout, x_layout, "saved input")?;
    let xm = x.mem_ref();
    x_layout.check_fits(xm.len(), "saved input")?;
    let xp = device.read_ptr(&xm, x_layout.offset(), "saved input")?;
    let plain = (xp.addr as *const c_void, elem_desc(x_layout, T::DTYPE)?);
    gelu_backward_impl::<T>(device, form, sys::MesaCodeSource::default(), Some(plain), dy, dy_layout, dx, dx_layout)
}

#[allow(clippy::too_many_arguments)]
fn gelu_backward_impl<T: Element>(
    device: &Device,
    form: GeluForm,
    source: sys::MesaCodeSource,
    plain: Option<(*const c_void, sys::MesaTensorDesc)>,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
) -> Result<()> {
    same_shape(dy_layout, dx_layout, "dx")?;
    let gm = dy.mem_ref();
    dy_layout.check_fits(gm.len(), "dy")?;
    let mut dm = dx.mem_mut();
    dx_layout.check_fits(dm.len(), "dx")?;
    dx_layout.check_no_overlap("dx")?;
    let (x, x_desc) = plain.unwrap_or((std::ptr::null(), sys::MesaTensorDesc::default()));
    let args = sys::MesaGeluBackwardArgs {
        dy: device.read_ptr(&gm, dy_layout.offset(), "dy")?.addr as *const c_void,
        dy_desc: elem_desc(dy_layout, T::DTYPE)?,
        x,
        x_desc,
        source,
        dx: device.write_ptr(&mut dm, dx_layout.offset(), "dx")?.addr,
        dx_desc: elem_desc(dx_layout, T::DTYPE)?,
        form: form.to_sys(),
        _pad: 0,
    };
    // SAFETY: dy/dx (and a plain x) fit their buffers, dx does not overlap itself; codes and
    // params (if any) were sized for this shape and grouping when saved.
    unsafe { device.launch("gelu_backward", &args, sys::mesa_gelu_backward, sys::mesa_emu_gelu_backward) }
}

// ---------------------------------------------------------------------------------------
// Softmax.

/// The code map of saved softmax probabilities (parameters fixed: offset 0, scale `s = 1/L`,
/// `L = 2^bits − 1`).
///
/// * [`SoftmaxCodes::Sqrt`] (default): `c = clamp(round(√y · L), 0, L)` (stochastic:
///   `floor(√y · L + u)`), decoded `ŷ = (c/L)²` — uniform codes of `√y`. Round to nearest
///   leaves `|√ŷ − √y| ≤ s/2`, so `|ŷ − y| ≤ (√y + s/4) · s`, i.e. `≈ 2/(L√y)` relative: at
///   8 bits and `y ≈ 1/128` (a row of 128 keys) a step is `≈ 7·10⁻⁴` instead of `3.9·10⁻³`.
///   Stochastic rounding: `|√ŷ − √y| < s`, `|ŷ − y| < (2√y + s) · s`, unbiased in `√y`.
/// * [`SoftmaxCodes::Linear`]: `c = round(y · L)`, `ŷ = c/L`, `|ŷ − y| ≤ s/2` — better only
///   for probabilities above `≈ 1/4`, where attention is peaked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SoftmaxCodes {
    /// Square-root companded codes ([`Companding::Sqrt`] on the handle).
    #[default]
    Sqrt,
    /// Linear codes of `y` ([`Companding::None`]).
    Linear,
}

impl SoftmaxCodes {
    /// The handle's companding for these codes.
    #[must_use]
    pub fn companding(self) -> Companding {
        match self {
            SoftmaxCodes::Sqrt => Companding::Sqrt,
            SoftmaxCodes::Linear => Companding::None,
        }
    }
}

/// How [`softmax_forward`] saves its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxSave {
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
    /// Code map: square-root companded (default) or linear; see [`SoftmaxCodes`].
    pub codes: SoftmaxCodes,
    /// Grouping metadata of the saved handle (e.g. heads on axis 1 of `[B, H, N, N]`); every
    /// group gets the same fixed parameters (offset 0, scale `1/(2^bits − 1)`).
    pub grouping: Grouping,
    /// Rounding; a stochastic seed is used as given (vary it per step).
    pub rounding: Rounding,
}

impl SoftmaxSave {
    /// 8-bit square-root companded codes, round to nearest, one group per head along
    /// `head_axis`.
    #[must_use]
    pub fn per_head(head_axis: usize) -> Self {
        SoftmaxSave {
            bits: 8,
            codes: SoftmaxCodes::Sqrt,
            grouping: Grouping::Heads { axis: head_axis },
            rounding: Rounding::Nearest,
        }
    }
}

/// An additive mask for [`softmax_forward`]: same shape as the logits, any strides (stride 0
/// broadcasts, e.g. a `[B, 1, 1, N]` key-padding mask over `[B, H, N, N]`), `−inf` allowed.
pub struct Mask<'a, T> {
    /// The mask values (same dtype as the logits).
    pub data: &'a dyn DeviceMemory<T>,
    /// Its view, with the logits' shape.
    pub layout: &'a Layout,
}

/// Softmax over the last axis that saves the codes of its output:
/// `y = softmax(x + mask)` per row; the handle holds `Q(y)` of the stored (dtype-rounded)
/// output with the fixed parameters offset 0, scale `1/(2^bits − 1)` — no statistics — as
/// square-root companded codes by default (`save.codes`, [`SoftmaxCodes`]; the handle's
/// [`SavedActivation::companding`] tells every decoder to square).
///
/// A row whose every entry is `−inf` (fully masked) gives `y = 0` (no NaN). NaN/±Inf
/// outputs (from non-finite logits) are counted in [`SavedActivation::nonfinite_count`].
/// Shapes: rank ≥ 1, rows along the last axis, any strides. Bytes moved: `numel·sizeof(T)`
/// read (+ the mask), `numel·(sizeof(T) + bits/8)` written. When `row length · bits` is not a
/// multiple of 8 (rows would not start on a byte: odd rows at 4 bits, e.g. ViT's 197), the
/// codes come from a second pass over `y` (same codes; `numel·sizeof(T)` more read) and the
/// non-finite count stays 0.
///
/// # Errors
/// [`Error::Shape`], [`Error::Unsupported`] (bit width), [`Error::BufferTooShort`],
/// [`Error::TooLarge`], [`Error::WrongBackend`], CUDA errors.
pub fn softmax_forward<T: Element>(
    device: &Device,
    save: &SoftmaxSave,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    mask: Option<Mask<'_, T>>,
    y: &mut (impl DeviceMemoryMut<T> + ?Sized),
    y_layout: &Layout,
) -> Result<SavedActivation> {
    if !matches!(save.bits, 2 | 4 | 8) {
        return Err(Error::LegacyUnsupported(format!("{}-bit codes (supported: 8, 4, 2)", save.bits)));
    }
    let shape = x_layout.shape();
    let groups = save.grouping.num_groups(shape)?;
    let companding = save.codes.companding();
    let mut saved = SavedActivation::allocate(
        device,
        &SavedMeta {
            shape: shape.to_vec(),
            strides: x_layout.strides().to_vec(),
            dtype: T::DTYPE,
            bits: save.bits,
            grouping: save.grouping,
            companding,
        },
    )?;
    let (run, count) = saved.group_map()?;
    let cols = shape.last().copied().unwrap_or(1);
    let fused = (cols * save.bits as usize) % 8 == 0;
    let (rounding, seed) = sys_rounding(save.rounding);
    let (codes, params, nonfinite) = saved.parts_mut();
    let mut cm = codes.mem_mut();
    let cp = device.write_ptr(&mut cm, 0, "codes")?;
    let mut pm = params.mem_mut();
    let pp = device.write_ptr(&mut pm, 0, "params")?;
    let mut nm = nonfinite.mem_mut();
    let np = device.write_ptr(&mut nm, 0, "nonfinite")?;
    let sink = sys::MesaCodeSink {
        codes: cp.addr.cast(),
        params: pp.addr as *const sys::MesaGroupParams,
        stats: std::ptr::null_mut(),
        group_run: run as i64,
        group_count: count as i64,
        seed,
        bits: save.bits as i32,
        rounding,
        map: companding.sys(),
        _pad: 0,
    };
    let mut ym = y.mem_mut();
    y_layout.check_fits(ym.len(), "output")?;
    y_layout.check_no_overlap("output")?;
    let yp = device.write_ptr(&mut ym, y_layout.offset(), "output")?;
    softmax_launch(
        device,
        x,
        x_layout,
        mask,
        yp.addr,
        y_layout,
        if fused { sink } else { sys::MesaCodeSink { codes: std::ptr::null_mut(), ..sink } },
        pp.addr.cast(),
        groups,
        np.addr.cast(),
        save.bits,
    )?;
    if !fused && x_layout.numel() > 0 {
        // rows do not start on a byte: encode the stored y with the same fixed parameters
        let view = kernel_view(y_layout, &save.grouping, T::DTYPE)?;
        let args = sys::MesaQuantizeArgs {
            x: yp.addr as *const c_void,
            x_desc: view.desc,
            grouping: view.grouping,
            params: pp.addr as *const sys::MesaGroupParams,
            codes: cp.addr.cast(),
            stats: std::ptr::null_mut(),
            seed,
            bits: save.bits as i32,
            rounding,
            map: companding.sys(),
            _pad: 0,
        };
        // SAFETY: y was validated by softmax_launch (fits, no self-overlap); codes hold
        // code_bytes(numel) bytes and params `groups` entries for this shape and grouping.
        unsafe { device.launch("quantize", &args, sys::mesa_quantize, sys::mesa_emu_quantize)? };
    }
    drop((cp, pp, np, yp));
    Ok(saved)
}

/// Plain softmax over the last axis, nothing saved (fully masked rows give 0).
///
/// # Errors
/// As [`softmax_forward`].
pub fn softmax<T: Element>(
    device: &Device,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    mask: Option<Mask<'_, T>>,
    y: &mut (impl DeviceMemoryMut<T> + ?Sized),
    y_layout: &Layout,
) -> Result<()> {
    let mut ym = y.mem_mut();
    y_layout.check_fits(ym.len(), "output")?;
    y_layout.check_no_overlap("output")?;
    let yp = device.write_ptr(&mut ym, y_layout.offset(), "output")?;
    softmax_launch(
        device,
        x,
        x_layout,
        mask,
        yp.addr,
        y_layout,
        sys::MesaCodeSink::default(),
        std::ptr::null_mut(),
        0,
        std::ptr::null_mut(),
        8,
    )
}

#[allow(clippy::too_many_arguments)]
fn softmax_launch<T: Element>(
    device: &Device,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    mask: Option<Mask<'_, T>>,
    y: *mut c_void,
    y_layout: &Layout,
    sink: sys::MesaCodeSink,
    params_out: *mut sys::MesaGroupParams,
    params_count: usize,
    nonfinite: *mut u32,
    bits: u32,
) -> Result<()> {
    same_shape(x_layout, y_layout, "softmax output")?;
    let xm = x.mem_ref();
    x_layout.check_fits(xm.len(), "input")?;
    let x_desc = row_desc(x_layout, T::DTYPE)?;
    let y_desc = row_desc(y_layout, T::DTYPE)?;
    let mask_mem = mask.as_ref().map(|m| m.data.mem_ref());
    let (mask_p, mask_desc) = match (&mask, &mask_mem) {
        (Some(m), Some(mm)) => {
            same_shape(x_layout, m.layout, "mask")?;
            m.layout.check_fits(mm.len(), "mask")?;
            let desc = row_desc(m.layout, T::DTYPE)?;
            (Some(device.read_ptr(mm, m.layout.offset(), "mask")?), desc)
        }
        _ => (None, sys::MesaTensorDesc::default()),
    };
    let mut sink = sink;
    sink.bits = bits as i32;
    let args = sys::MesaSoftmaxForwardArgs {
        x: device.read_ptr(&xm, x_layout.offset(), "input")?.addr as *const c_void,
        x_desc,
        mask: mask_p.as_ref().map_or(std::ptr::null(), |p| p.addr as *const c_void),
        mask_desc,
        y,
        y_desc,
        sink,
        params_out,
        params_count: params_count as i64,
        nonfinite,
    };
    // SAFETY: x and the mask fit their buffers (check_fits); the callers checked that y fits
    // its buffer and does not overlap itself;
    // codes (if any) hold code_bytes(numel) bytes and params `params_count` entries.
    unsafe { device.launch("softmax_forward", &args, sys::mesa_softmax_forward, sys::mesa_emu_softmax_forward) }
}

/// Softmax backward from the codes of its output: `dx = ŷ ⊙ (dy − Σ_row dy·ŷ)`, `ŷ` decoded
/// inside the kernel. Bytes moved: `numel·(sizeof(T) + bits/8)` read, `numel·sizeof(T)` written.
///
/// # Errors
/// [`Error::Shape`], [`Error::BufferTooShort`], [`Error::WrongBackend`], CUDA errors.
pub fn softmax_backward<T: Element>(
    device: &Device,
    saved: &SavedActivation,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
) -> Result<()> {
    let (run, count) = code_source(saved, device, dy_layout.shape())?;
    let (codes, params) = saved.parts();
    let (cm, pm) = (codes.mem_ref(), params.mem_ref());
    let source = sys::MesaCodeSource {
        codes: device.read_ptr(&cm, 0, "codes")?.addr as *const u8,
        params: device.read_ptr(&pm, 0, "params")?.addr as *const sys::MesaGroupParams,
        group_run: run as i64,
        group_count: count as i64,
        bits: saved.bits() as i32,
        map: saved.companding().sys(),
    };
    softmax_backward_impl::<T>(device, source, None, dy, dy_layout, dx, dx_layout)
}

/// Softmax backward reading a full-precision saved output `y`.
///
/// # Errors
/// As [`softmax_backward`].
pub fn softmax_backward_plain<T: Element>(
    device: &Device,
    y: &(impl DeviceMemory<T> + ?Sized),
    y_layout: &Layout,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
) -> Result<()> {
    same_shape(dy_layout, y_layout, "saved output")?;
    let ymem = y.mem_ref();
    y_layout.check_fits(ymem.len(), "saved output")?;
    let yp = device.read_ptr(&ymem, y_layout.offset(), "saved output")?;
    let plain = (yp.addr as *const c_void, row_desc(y_layout, T::DTYPE)?);
    softmax_backward_impl::<T>(device, sys::MesaCodeSource::default(), Some(plain), dy, dy_layout, dx, dx_layout)
}

fn softmax_backward_impl<T: Element>(
    device: &Device,
    source: sys::MesaCodeSource,
    plain: Option<(*const c_void, sys::MesaTensorDesc)>,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
) -> Result<()> {
    same_shape(dy_layout, dx_layout, "dx")?;
    let gm = dy.mem_ref();
    dy_layout.check_fits(gm.len(), "dy")?;
    let mut dm = dx.mem_mut();
    dx_layout.check_fits(dm.len(), "dx")?;
    dx_layout.check_no_overlap("dx")?;
    let (y, y_desc) = plain.unwrap_or((std::ptr::null(), sys::MesaTensorDesc::default()));
    let args = sys::MesaSoftmaxBackwardArgs {
        dy: device.read_ptr(&gm, dy_layout.offset(), "dy")?.addr as *const c_void,
        dy_desc: row_desc(dy_layout, T::DTYPE)?,
        y,
        y_desc,
        source,
        dx: device.write_ptr(&mut dm, dx_layout.offset(), "dx")?.addr,
        dx_desc: row_desc(dx_layout, T::DTYPE)?,
    };
    // SAFETY: dy/dx (and a plain y) fit their buffers, dx does not overlap itself; codes and
    // params (if any) were sized for this shape and grouping when saved.
    unsafe { device.launch("softmax_backward", &args, sys::mesa_softmax_backward, sys::mesa_emu_softmax_backward) }
}

// ---------------------------------------------------------------------------------------
// LayerNorm.

/// What [`layer_norm_forward`] keeps for backward: the codes of `x̂ = (x − mean)·rstd` and the
/// per-row `mean` and `rstd` in f32.
pub struct SavedLayerNorm {
    xhat: SavedActivation,
    mean: Buffer<f32>,
    rstd: Buffer<f32>,
}

impl SavedLayerNorm {
    /// The codes of `x̂` (shape of the input).
    #[must_use]
    pub fn xhat(&self) -> &SavedActivation {
        &self.xhat
    }
    /// Per-row mean (f32, `numel / C` entries, rows in logical order).
    #[must_use]
    pub fn mean(&self) -> &Buffer<f32> {
        &self.mean
    }
    /// Per-row `1/sqrt(var + eps)` (f32).
    #[must_use]
    pub fn rstd(&self) -> &Buffer<f32> {
        &self.rstd
    }
    /// Bytes held for backward: the codes of `x̂` with their parameters, plus 8 bytes per row
    /// (mean and rstd).
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.xhat.size_in_bytes() + self.mean.size_in_bytes() + self.rstd.size_in_bytes()
    }
}

/// The affine parameters of a LayerNorm: `[C]` contiguous, dtype of the input; `None` means
/// weight 1 / bias 0.
pub type Affine<'a, T> = Option<&'a dyn DeviceMemory<T>>;

fn affine_ptr<'a, T>(
    device: &'a Device,
    mem: &'a Option<crate::device::MemRef<'a, T>>,
    cols: usize,
    what: &'static str,
) -> Result<*const c_void> {
    match mem {
        None => Ok(std::ptr::null()),
        Some(m) => {
            if m.len() < cols {
                return Err(Error::BufferTooShort { what, needed: cols, len: m.len() });
            }
            Ok(device.read_ptr(m, 0, what)?.addr as *const c_void)
        }
    }
}

/// LayerNorm over the last axis that saves what its backward needs: `y = x̂·w + b`,
/// `x̂ = (x − mean)·rstd`, `rstd = 1/sqrt(var + eps)`; the handle holds `Q(x̂)` (with
/// `quantizer`'s grouping — e.g. channel groups of C — bit width, rounding and running
/// estimate) and the per-row mean and rstd in f32. A constant row (variance 0) gives
/// `x̂ = 0`, `y = b`.
///
/// Shapes: `x`, `y` rank ≥ 1, rows along the last axis (C > 0), any strides; `weight`,
/// `bias` `[C]`. Bytes moved: `numel·sizeof(T)` read (twice on the quantizer's first batch
/// and in exact mode), `numel·(sizeof(T) + bits/8) + 8·rows` written. When `C·bits` is not
/// a multiple of 8 the codes come from a second, elementwise pass (reads x again).
/// Allocates the handle (stream-ordered).
///
/// # Errors
/// [`Error::Shape`] (shapes, C = 0, eps not positive and finite, grouping),
/// [`Error::BufferTooShort`], [`Error::TooLarge`], [`Error::WrongBackend`], CUDA errors.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    weight: Affine<'_, T>,
    bias: Affine<'_, T>,
    eps: f32,
    y: &mut (impl DeviceMemoryMut<T> + ?Sized),
    y_layout: &Layout,
) -> Result<SavedLayerNorm> {
    same_device(device, quantizer)?;
    let (rows, cols) = ln_check(x_layout, y_layout, eps)?;
    let xm = x.mem_ref();
    x_layout.check_fits(xm.len(), "input")?;
    let mut ym = y.mem_mut();
    y_layout.check_fits(ym.len(), "output")?;
    y_layout.check_no_overlap("output")?;
    let x_desc = row_desc(x_layout, T::DTYPE)?;
    let y_desc = row_desc(y_layout, T::DTYPE)?;
    let (wm, bm) = (weight.map(|w| w.mem_ref()), bias.map(|b| b.mem_ref()));
    let wp = affine_ptr(device, &wm, cols, "weight")?;
    let bp = affine_ptr(device, &bm, cols, "bias")?;
    let mut mean = device.alloc_for_kernel::<f32>(rows)?;
    let mut rstd = device.alloc_for_kernel::<f32>(rows)?;
    let xp = device.read_ptr(&xm, x_layout.offset(), "input")?;
    let yp = device.write_ptr(&mut ym, y_layout.offset(), "output")?;
    let xhat = layer_norm_produce::<T>(
        device,
        quantizer,
        (xp.addr as *const c_void, x_desc),
        x_layout,
        (yp.addr, y_desc),
        (wp, bp),
        eps,
        &mut mean,
        &mut rstd,
        cols,
    )?;
    drop((xp, yp));
    Ok(SavedLayerNorm { xhat, mean, rstd })
}

#[allow(clippy::too_many_arguments)]
fn layer_norm_produce<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    (x, x_desc): (*const c_void, sys::MesaTensorDesc),
    x_layout: &Layout,
    (y, y_desc): (*mut c_void, sys::MesaTensorDesc),
    (wp, bp): (*const c_void, *const c_void),
    eps: f32,
    mean: &mut Buffer<f32>,
    rstd: &mut Buffer<f32>,
    cols: usize,
) -> Result<SavedActivation> {
    let mut mean_m = mean.mem_mut();
    let mp = device.write_ptr(&mut mean_m, 0, "mean")?;
    let mut rstd_m = rstd.mem_mut();
    let rp = device.write_ptr(&mut rstd_m, 0, "rstd")?;
    let bits = quantizer.config().bits as usize;
    let fused = (cols * bits) % 8 == 0;
    let base = sys::MesaLayerNormForwardArgs {
        x,
        x_desc,
        weight: wp,
        bias: bp,
        y,
        y_desc,
        mean: mp.addr.cast(),
        rstd: rp.addr.cast(),
        sink: sys::MesaCodeSink::default(),
        eps,
        codes_only: 0,
    };
    let launch = |args: &sys::MesaLayerNormForwardArgs| {
        // SAFETY: x/y fit their buffers (check_fits), y does not overlap itself, weight and
        // bias hold >= C elements, mean/rstd `rows` entries; the sink was sized by the
        // quantizer for x's shape and grouping.
        unsafe {
            device.launch("layernorm_forward", args, sys::mesa_layernorm_forward, sys::mesa_emu_layernorm_forward)
        }
    };
    let xhat = quantizer.produce::<T>(x_layout.shape(), x_layout.strides(), |step, sink| {
        let stats_only = sys::MesaCodeSink { codes: std::ptr::null_mut(), params: std::ptr::null(), ..sink };
        let codes_only = sys::MesaCodeSink { stats: std::ptr::null_mut(), ..sink };
        match (step, fused) {
            // exact statistics of x̂ first: nothing else written
            (ProducerStep::Stats, true) => {
                launch(&sys::MesaLayerNormForwardArgs { y: std::ptr::null_mut(), sink: stats_only, ..base })
            }
            (ProducerStep::Codes | ProducerStep::CodesAndStats, true) => {
                launch(&sys::MesaLayerNormForwardArgs { sink, ..base })
            }
            // rows do not start on a byte: the row pass writes y, mean, rstd (+ statistics),
            // an elementwise pass the codes
            (ProducerStep::Stats, false) => launch(&sys::MesaLayerNormForwardArgs { sink: stats_only, ..base }),
            (ProducerStep::Codes, false) => {
                launch(&sys::MesaLayerNormForwardArgs { sink: codes_only, codes_only: 1, ..base })
            }
            (ProducerStep::CodesAndStats, false) => {
                launch(&sys::MesaLayerNormForwardArgs { sink: stats_only, ..base })?;
                launch(&sys::MesaLayerNormForwardArgs { sink: codes_only, codes_only: 1, ..base })
            }
        }
    })?;
    drop((mp, rp));
    Ok(xhat)
}

fn ln_check(x_layout: &Layout, y_layout: &Layout, eps: f32) -> Result<(usize, usize)> {
    same_shape(x_layout, y_layout, "LayerNorm output")?;
    if !(eps > 0.0 && eps.is_finite()) {
        return Err(Error::LegacyShape(format!("LayerNorm eps must be positive and finite, got {eps}")));
    }
    let cols = *x_layout
        .shape()
        .last()
        .ok_or_else(|| Error::LegacyShape("LayerNorm needs a tensor of rank >= 1 (rows along the last axis)".into()))?;
    let numel = x_layout.numel();
    if cols == 0 {
        if numel == 0 && x_layout.shape().iter().rev().skip(1).any(|&d| d == 0) {
            return Ok((0, 0));
        }
        return Err(Error::LegacyShape("LayerNorm over an empty last axis (C = 0)".into()));
    }
    Ok((numel / cols, cols))
}

/// Plain LayerNorm forward, nothing saved; `mean`/`rstd` (f32, one per row) are written when
/// given.
///
/// # Errors
/// As [`layer_norm_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layer_norm<T: Element>(
    device: &Device,
    x: &(impl DeviceMemory<T> + ?Sized),
    x_layout: &Layout,
    weight: Affine<'_, T>,
    bias: Affine<'_, T>,
    eps: f32,
    y: &mut (impl DeviceMemoryMut<T> + ?Sized),
    y_layout: &Layout,
) -> Result<()> {
    let (_, cols) = ln_check(x_layout, y_layout, eps)?;
    let xm = x.mem_ref();
    x_layout.check_fits(xm.len(), "input")?;
    let mut ym = y.mem_mut();
    y_layout.check_fits(ym.len(), "output")?;
    y_layout.check_no_overlap("output")?;
    let (wm, bm) = (weight.map(|w| w.mem_ref()), bias.map(|b| b.mem_ref()));
    let args = sys::MesaLayerNormForwardArgs {
        x: device.read_ptr(&xm, x_layout.offset(), "input")?.addr as *const c_void,
        x_desc: row_desc(x_layout, T::DTYPE)?,
        weight: affine_ptr(device, &wm, cols, "weight")?,
        bias: affine_ptr(device, &bm, cols, "bias")?,
        y: device.write_ptr(&mut ym, y_layout.offset(), "output")?.addr,
        y_desc: row_desc(y_layout, T::DTYPE)?,
        mean: std::ptr::null_mut(),
        rstd: std::ptr::null_mut(),
        sink: sys::MesaCodeSink::default(),
        eps,
        codes_only: 0,
    };
    // SAFETY: x/y fit their buffers, y does not overlap itself, weight/bias hold >= C values.
    unsafe { device.launch("layernorm_forward", &args, sys::mesa_layernorm_forward, sys::mesa_emu_layernorm_forward) }
}

/// Rows of the dweight/dbias partial sums: fixed by the shape alone, so the summation order
/// (and hence every bit of dweight/dbias) is the same on every device.
fn partial_blocks(rows: usize) -> usize {
    rows.clamp(1, 512)
}

/// LayerNorm backward from codes: with `g = dy·w`,
/// `dx = rstd·(g − mean_row(g) − x̂·mean_row(g·x̂))`, `dweight = Σ_rows dy·x̂`,
/// `dbias = Σ_rows dy` (f32, `[C]`), `x̂` decoded inside the kernels.
///
/// `dweight`/`dbias` are reduced deterministically: per-block partial sums over fixed row
/// ranges (512 ranges at most, chosen from the shape only), then one ordered sum per column —
/// no float atomics, the same bits on every run. Allocates a `2·ranges·C` f32 scratch
/// (stream-ordered). Bytes moved: `2·numel·(sizeof(T) + bits/8)` read (dx kernel, then the
/// column kernel), `numel·sizeof(T)` written.
///
/// # Errors
/// [`Error::Shape`], [`Error::BufferTooShort`], [`Error::WrongBackend`], CUDA errors.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<T: Element>(
    device: &Device,
    saved: &SavedLayerNorm,
    weight: Affine<'_, T>,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
    dweight: &mut (impl DeviceMemoryMut<f32> + ?Sized),
    dbias: &mut (impl DeviceMemoryMut<f32> + ?Sized),
) -> Result<()> {
    let (run, count) = code_source(&saved.xhat, device, dy_layout.shape())?;
    let (codes, params) = saved.xhat.parts();
    let (cm, pm) = (codes.mem_ref(), params.mem_ref());
    let source = sys::MesaCodeSource {
        codes: device.read_ptr(&cm, 0, "codes")?.addr as *const u8,
        params: device.read_ptr(&pm, 0, "params")?.addr as *const sys::MesaGroupParams,
        group_run: run as i64,
        group_count: count as i64,
        bits: saved.xhat.bits() as i32,
        map: saved.xhat.companding().sys(),
    };
    layer_norm_backward_impl::<T>(
        device,
        source,
        None,
        &saved.rstd,
        weight,
        dy,
        dy_layout,
        dx,
        dx_layout,
        dweight,
        dbias,
    )
}

/// LayerNorm backward reading a full-precision `x̂` (same dtype as `dy`) and `rstd`.
///
/// # Errors
/// As [`layer_norm_backward`].
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_plain<T: Element>(
    device: &Device,
    xhat: &(impl DeviceMemory<T> + ?Sized),
    xhat_layout: &Layout,
    rstd: &(impl DeviceMemory<f32> + ?Sized),
    weight: Affine<'_, T>,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
    dweight: &mut (impl DeviceMemoryMut<f32> + ?Sized),
    dbias: &mut (impl DeviceMemoryMut<f32> + ?Sized),
) -> Result<()> {
    same_shape(dy_layout, xhat_layout, "saved x̂")?;
    let hm = xhat.mem_ref();
    xhat_layout.check_fits(hm.len(), "saved x̂")?;
    let hp = device.read_ptr(&hm, xhat_layout.offset(), "saved x̂")?;
    let plain = (hp.addr as *const c_void, row_desc(xhat_layout, T::DTYPE)?);
    layer_norm_backward_impl::<T>(
        device,
        sys::MesaCodeSource::default(),
        Some(plain),
        rstd,
        weight,
        dy,
        dy_layout,
        dx,
        dx_layout,
        dweight,
        dbias,
    )
}

#[allow(clippy::too_many_arguments)]
fn layer_norm_backward_impl<T: Element>(
    device: &Device,
    source: sys::MesaCodeSource,
    plain: Option<(*const c_void, sys::MesaTensorDesc)>,
    rstd: &(impl DeviceMemory<f32> + ?Sized),
    weight: Affine<'_, T>,
    dy: &(impl DeviceMemory<T> + ?Sized),
    dy_layout: &Layout,
    dx: &mut (impl DeviceMemoryMut<T> + ?Sized),
    dx_layout: &Layout,
    dweight: &mut (impl DeviceMemoryMut<f32> + ?Sized),
    dbias: &mut (impl DeviceMemoryMut<f32> + ?Sized),
) -> Result<()> {
    let (rows, cols) = ln_check(dy_layout, dx_layout, 1.0)?;
    let gm = dy.mem_ref();
    dy_layout.check_fits(gm.len(), "dy")?;
    let mut dm = dx.mem_mut();
    dx_layout.check_fits(dm.len(), "dx")?;
    dx_layout.check_no_overlap("dx")?;
    let rm = rstd.mem_ref();
    if rm.len() < rows {
        return Err(Error::BufferTooShort { what: "rstd", needed: rows, len: rm.len() });
    }
    let mut dwm = dweight.mem_mut();
    let mut dbm = dbias.mem_mut();
    for (len, what) in [(dwm.len(), "dweight"), (dbm.len(), "dbias")] {
        if len < cols {
            return Err(Error::BufferTooShort { what, needed: cols, len });
        }
    }
    let wm = weight.map(|w| w.mem_ref());
    let wp = affine_ptr(device, &wm, cols, "weight")?;
    let dwp = device.write_ptr(&mut dwm, 0, "dweight")?;
    let dbp = device.write_ptr(&mut dbm, 0, "dbias")?;
    // no rows: 0 partial ranges, the kernel writes dweight = dbias = 0
    let parts = if rows == 0 { 0 } else { partial_blocks(rows) };
    let mut partials = device.alloc_for_kernel::<f32>(2 * parts * cols)?;
    let mut part_m = partials.mem_mut();
    let pp = device.write_ptr(&mut part_m, 0, "partials")?;
    let (xhat, xhat_desc) = plain.unwrap_or((std::ptr::null(), sys::MesaTensorDesc::default()));
    let args = sys::MesaLayerNormBackwardArgs {
        dy: device.read_ptr(&gm, dy_layout.offset(), "dy")?.addr as *const c_void,
        dy_desc: row_desc(dy_layout, T::DTYPE)?,
        xhat,
        xhat_desc,
        source,
        rstd: device.read_ptr(&rm, 0, "rstd")?.addr as *const f32,
        weight: wp,
        dx: device.write_ptr(&mut dm, dx_layout.offset(), "dx")?.addr,
        dx_desc: row_desc(dx_layout, T::DTYPE)?,
        partials: pp.addr.cast(),
        partial_blocks: parts as i64,
        dweight: dwp.addr.cast(),
        dbias: dbp.addr.cast(),
    };
    // SAFETY: dy/dx (and a plain x̂) fit their buffers, dx does not overlap itself, rstd holds
    // `rows` values, weight/dweight/dbias >= C, partials 2·parts·C; codes and params (if any)
    // were sized for this shape and grouping when saved.
    unsafe {
        device.launch("layernorm_backward", &args, sys::mesa_layernorm_backward, sys::mesa_emu_layernorm_backward)
    }
}

/// Shorthand: a [`QuantConfig`] for the inputs of GELU and LayerNorm in a transformer of
/// hidden size divisible by `groups`: `groups` channel groups of the last axis (Mesa's
/// "head-wise" for token tensors), 8 bits, round to nearest, momentum 0.9, running estimate.
#[must_use]
pub fn channel_groups(last_axis: usize, groups: usize) -> QuantConfig {
    QuantConfig { grouping: Grouping::Channels { axis: last_axis, groups }, ..QuantConfig::per_tensor() }
}
