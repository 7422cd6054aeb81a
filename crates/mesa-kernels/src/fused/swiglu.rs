//! SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6; the MLP gate of Llama,
//! Mistral, Qwen): `y = silu(g) · u` with `silu(g) = g·σ(g)`. The forward saves the codes of
//! both inputs; the backward decodes them inside its kernel and writes both gradients.
use mesa_kernels_sys as sys;

use super::{check_saved, code_source, elem_desc, same_shape};
use crate::device::Device;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::kernel_view;
use crate::quant::{
    check_code_address, same_stream, Finalize, ProducerStep, Quantizer, SavedActivation, SavedMeta, SavedView,
    SavedViewMut,
};
use crate::tensor::{TensorMut, TensorRef};

/// The inputs of SwiGLU: the gate projection `g` and the up projection `u` (same shape, any
/// strides, for example two column slices of one fused `[tokens, 2·F]` projection).
#[derive(Debug, Clone, Copy)]
pub struct SwigluInput<'a, T> {
    /// `g`, the argument of silu.
    pub gate: &'a TensorRef<'a, T>,
    /// `u`, the factor silu(g) multiplies.
    pub up: &'a TensorRef<'a, T>,
}

/// The quantizers of SwiGLU's two saved inputs (one running estimate each: the gate and the up
/// projection have different ranges).
#[derive(Debug)]
pub struct SwigluQuantizers<'q> {
    /// Encodes `g`.
    pub gate: &'q mut Quantizer,
    /// Encodes `u`.
    pub up: &'q mut Quantizer,
}

/// What SwiGLU's backward reads: the codes of `g` and of `u`.
#[derive(Debug)]
#[must_use = "the saved codes are what the backward needs"]
pub struct SavedSwiglu {
    /// Codes of the gate `g`.
    pub gate: SavedActivation,
    /// Codes of the up projection `u`.
    pub up: SavedActivation,
}

impl SavedSwiglu {
    /// Bytes kept for the backward: both handles' codes and parameters.
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.gate.size_in_bytes() + self.up.size_in_bytes()
    }
}

/// Where [`swiglu_forward_to`] writes the codes of both inputs, in memory the caller owns
/// (each sized by [`crate::quant::saved_sizes`] for the input shape and its quantizer's
/// config).
#[derive(Debug)]
pub struct SwigluSaveMut<'a, 'b> {
    /// Codes of the gate `g`.
    pub gate: &'a mut SavedViewMut<'b>,
    /// Codes of the up projection `u`.
    pub up: &'a mut SavedViewMut<'b>,
}

/// What [`swiglu_forward_to`] returns: what each input's codes encode.
#[derive(Debug, Clone, PartialEq)]
#[must_use = "the metas are needed to read the saved codes back"]
pub struct SwigluMeta {
    /// For the codes of `g`.
    pub gate: SavedMeta,
    /// For the codes of `u`.
    pub up: SavedMeta,
}

/// What [`swiglu_backward_view`] reads: the codes of `g` and `u` in the caller's memory.
#[derive(Debug, Clone, Copy)]
pub struct SwigluSavedView<'a> {
    /// Codes of the gate `g`.
    pub gate: &'a SavedView<'a>,
    /// Codes of the up projection `u`.
    pub up: &'a SavedView<'a>,
}

/// The gradients SwiGLU's backward writes: `dg` and `du` (shape of `dy`, any strides).
#[derive(Debug)]
pub struct SwigluGrads<'a, 'b, T> {
    /// `dg = dy · u · silu'(g)`.
    pub gate: &'a mut TensorMut<'b, T>,
    /// `du = dy · silu(g)`.
    pub up: &'a mut TensorMut<'b, T>,
}

fn check_input<T: Element>(input: &SwigluInput<'_, T>, y_shape: &[usize]) -> Result<()> {
    same_shape(input.gate.shape(), input.up.shape(), "SwiGLU up projection (vs the gate)")?;
    same_shape(input.gate.shape(), y_shape, "SwiGLU output")
}

/// SwiGLU forward that saves the codes of both inputs: `y = silu(g)·u`; the returned handles
/// hold `Q(g)` and `Q(u)` with their quantizers' grouping, bit width, rounding and running
/// estimate.
///
/// Passes: one that reads `g` and `u`, writes `y` and the codes of `g`; one that reads `u`
/// and writes its codes (each quantizer adds its statistics pass on its first batch and in
/// [`crate::StatsMode::Exact`]). Bytes moved in the running mode: `3·numel·sizeof(T)` read,
/// `numel·sizeof(T) + 2·numel·bits/8` written.
///
/// Shapes: `gate`, `up`, `y` any equal shapes, any strides; dtype f32, f16 or bf16 (all
/// three the same), f32 arithmetic.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] (shapes differ), [`Error::InvalidLayout`] (a grouping the
/// shape does not have), [`Error::Aliasing`], [`Error::TooLarge`], [`Error::Unsupported`] (a
/// view the kernels cannot index), [`Error::WrongBackend`] (memory or a quantizer of another
/// device or stream), [`Error::Misaligned`], CUDA errors.
pub fn swiglu_forward<T: Element>(
    device: &Device,
    quantizers: SwigluQuantizers<'_>,
    input: &SwigluInput<'_, T>,
    y: &mut TensorMut<'_, T>,
) -> Result<SavedSwiglu> {
    let SwigluQuantizers { gate: qg, up: qu } = quantizers;
    for q in [&*qg, &*qu] {
        if !same_stream(device, q.device()) {
            return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
        }
    }
    check_input(input, y.shape())?;
    let mut gate = qg.new_saved(input.gate.layout(), T::DTYPE)?;
    let mut up = qu.new_saved(input.up.layout(), T::DTYPE)?;
    let (mut gate_view, gate_meta) = gate.view_mut()?;
    let (mut up_view, up_meta) = up.view_mut()?;
    let metas = swiglu_forward_to(
        device,
        SwigluQuantizers { gate: qg, up: qu },
        input,
        y,
        SwigluSaveMut { gate: &mut gate_view, up: &mut up_view },
    )?;
    (*gate_meta, *up_meta) = (metas.gate, metas.up);
    Ok(SavedSwiglu { gate, up })
}

/// [`swiglu_forward`] writing the codes of `g` and `u` into memory the caller owns
/// ([`SwigluSaveMut`]). Returns what they encode, for [`SavedView::new`] and
/// [`swiglu_backward_view`].
///
/// # Errors
/// As [`swiglu_forward`], plus [`Error::BufferTooShort`] / [`Error::InvalidArgument`] (a
/// saved part shorter / longer than the input needs), [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] (saved parts
/// overlapping each other, an input or `y`). All checked before the first launch.
pub fn swiglu_forward_to<T: Element>(
    device: &Device,
    quantizers: SwigluQuantizers<'_>,
    input: &SwigluInput<'_, T>,
    y: &mut TensorMut<'_, T>,
    saved: SwigluSaveMut<'_, '_>,
) -> Result<SwigluMeta> {
    let SwigluQuantizers { gate: qg, up: qu } = quantizers;
    for q in [&*qg, &*qu] {
        if !same_stream(device, q.device()) {
            return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
        }
    }
    check_input(input, y.shape())?;
    let SwigluSaveMut { gate, up } = saved;
    // the two passes are two launches: every size, alignment and overlap of both is checked
    // on one registration before the first
    let _ = gate.check_sizes(&qg.meta_for(input.gate.layout(), T::DTYPE))?;
    let _ = up.check_sizes(&qu.meta_for(input.up.layout(), T::DTYPE))?;
    check_disjoint(device, input, y, gate, up)?;
    let gate_meta = encode_pass(device, qg, input, Some(y), sys::MESA_SWIGLU_SAVE_GATE, gate)?;
    let up_meta = encode_pass(device, qu, input, None, sys::MESA_SWIGLU_SAVE_UP, up)?;
    Ok(SwigluMeta { gate: gate_meta, up: up_meta })
}

/// Registers the inputs, `y` and both saved views on one launch that runs nothing: the
/// backend, alignment and overlap checks of both passes at once.
fn check_disjoint<'b, T: Element>(
    device: &Device,
    input: &SwigluInput<'_, T>,
    y: &mut TensorMut<'_, T>,
    gate: &mut SavedViewMut<'b>,
    up: &mut SavedViewMut<'b>,
) -> Result<()> {
    let mut launch = Launch::new(device);
    launch.input(input.gate, "gate")?;
    launch.input(input.up, "up projection")?;
    launch.output(y, "output")?;
    for (view, what) in [(gate, "saved codes of the gate"), (up, "saved codes of the up projection")] {
        let SavedViewMut { codes, params, nonfinite } = view;
        check_code_address(launch.output(codes, what)? as usize, what)?;
        launch.output(params, "saved parameters")?;
        launch.output(nonfinite, "non-finite counter")?;
    }
    launch.finish()
}

/// One input's codes into `saved` (`which`: MESA_SWIGLU_SAVE_GATE or _UP), with `y` written
/// in the encoding step when given.
fn encode_pass<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    input: &SwigluInput<'_, T>,
    y: Option<&mut TensorMut<'_, T>>,
    which: u32,
    saved: &mut SavedViewMut<'_>,
) -> Result<SavedMeta> {
    let x = if which == sys::MESA_SWIGLU_SAVE_GATE { input.gate } else { input.up };
    let empty = x.numel() == 0;
    let desc =
        |t: &TensorRef<'_, T>| if empty { Ok(sys::MesaTensorDesc::default()) } else { elem_desc(t.layout(), T::DTYPE) };
    let (g_desc, u_desc) = (desc(input.gate)?, desc(input.up)?);
    let y_desc = match (&y, empty) {
        (Some(y), false) => elem_desc(y.layout(), T::DTYPE)?,
        _ => sys::MesaTensorDesc::default(),
    };
    // the widening pass re-encodes x alone: the Quantizer's pass on x's grouped view
    let grouped = if empty { None } else { Some(kernel_view(x.layout(), &quantizer.config().grouping, T::DTYPE)?) };
    let layout = x.layout().clone();
    let mut launch = Launch::new(device);
    let gp = launch.input(input.gate, "gate")?;
    let up = launch.input(input.up, "up projection")?;
    let yp = match y {
        Some(y) => launch.output(y, "output")?,
        None => std::ptr::null_mut(),
    };
    let xp = if which == sys::MESA_SWIGLU_SAVE_GATE { gp } else { up };
    let meta = quantizer.encode::<T>(&mut launch, saved, &layout, Finalize::Separate, |launch, step, sink, _| {
        let Some(grouped) = grouped.as_ref() else { return Ok(()) };
        if let ProducerStep::Widen(widen) = step {
            // SAFETY: x is a registered input described by `grouped`; codes, params and the
            // widen flags are the handle's and the quantizer's, registered and sized by `encode`.
            return unsafe { super::widen_input(launch, xp, grouped, &sink, widen) };
        }
        let args = sys::MesaSwigluForwardArgs {
            g: gp,
            g_desc,
            u: up,
            u_desc,
            y: if step == ProducerStep::Stats { std::ptr::null_mut() } else { yp },
            y_desc,
            sink,
            saved: which as sys::MesaSwigluSaved,
            _pad: 0,
        };
        // SAFETY: g, u and y are registered views (y without self-overlap, disjoint from the
        // inputs) described by their descs; the sink's buffers were registered and sized for
        // x's shape and grouping by `encode`.
        unsafe { launch.launch("swiglu_forward", &args, sys::mesa_swiglu_forward, sys::mesa_emu_swiglu_forward) }
    })?;
    launch.finish()?;
    Ok(meta)
}

/// Plain SwiGLU forward, nothing saved: `y = silu(g)·u`.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`swiglu_forward`] (without the quantizers').
pub fn swiglu<T: Element>(device: &Device, input: &SwigluInput<'_, T>, y: &mut TensorMut<'_, T>) -> Result<()> {
    check_input(input, y.shape())?;
    if y.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let args = sys::MesaSwigluForwardArgs {
        g_desc: elem_desc(input.gate.layout(), T::DTYPE)?,
        u_desc: elem_desc(input.up.layout(), T::DTYPE)?,
        y_desc: elem_desc(y.layout(), T::DTYPE)?,
        g: launch.input(input.gate, "gate")?,
        u: launch.input(input.up, "up projection")?,
        y: launch.output(y, "output")?,
        sink: sys::MesaCodeSink::default(),
        saved: sys::MESA_SWIGLU_SAVE_GATE as sys::MesaSwigluSaved,
        _pad: 0,
    };
    // SAFETY: g, u and y are registered views described by their descs, y disjoint from both;
    // no codes.
    unsafe { launch.launch("swiglu_forward", &args, sys::mesa_swiglu_forward, sys::mesa_emu_swiglu_forward)? };
    launch.finish()
}

/// SwiGLU backward from codes: `dg = dy·u·silu'(g)`, `du = dy·silu(g)`, with `g` and `u`
/// decoded from `saved` inside the kernel. Bytes moved: `numel·(sizeof(T) + 2·bits/8)` read,
/// `2·numel·sizeof(T)` written.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] (dy, a gradient or a saved tensor differ in shape),
/// [`Error::Aliasing`], [`Error::WrongBackend`], [`Error::Unsupported`],
/// [`Error::Misaligned`], CUDA errors.
pub fn swiglu_backward<T: Element>(
    device: &Device,
    saved: &SavedSwiglu,
    dy: &TensorRef<'_, T>,
    grads: SwigluGrads<'_, '_, T>,
) -> Result<()> {
    check_saved(&saved.gate, device, dy.shape())?;
    check_saved(&saved.up, device, dy.shape())?;
    let (gate, up) = (saved.gate.view()?, saved.up.view()?);
    swiglu_backward_view(device, SwigluSavedView { gate: &gate, up: &up }, dy, grads)
}

/// [`swiglu_backward`] reading the codes from memory the caller owns (what
/// [`swiglu_forward_to`] wrote, with the metas it returned).
///
/// # Errors
/// As [`swiglu_backward`], plus [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] (a gradient over the
/// codes or parameters).
pub fn swiglu_backward_view<T: Element>(
    device: &Device,
    saved: SwigluSavedView<'_>,
    dy: &TensorRef<'_, T>,
    grads: SwigluGrads<'_, '_, T>,
) -> Result<()> {
    same_shape(saved.gate.meta().shape(), dy.shape(), "gradient (vs the saved gate)")?;
    same_shape(saved.up.meta().shape(), dy.shape(), "gradient (vs the saved up projection)")?;
    same_shape(dy.shape(), grads.gate.shape(), "dg")?;
    same_shape(dy.shape(), grads.up.shape(), "du")?;
    if dy.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let gate_source = code_source(&mut launch, saved.gate)?;
    let up_source = code_source(&mut launch, saved.up)?;
    let args = sys::MesaSwigluBackwardArgs {
        dy_desc: elem_desc(dy.layout(), T::DTYPE)?,
        dg_desc: elem_desc(grads.gate.layout(), T::DTYPE)?,
        du_desc: elem_desc(grads.up.layout(), T::DTYPE)?,
        dy: launch.input(dy, "dy")?,
        g: std::ptr::null(),
        g_desc: sys::MesaTensorDesc::default(),
        gate_source,
        u: std::ptr::null(),
        u_desc: sys::MesaTensorDesc::default(),
        up_source,
        dg: launch.output(grads.gate, "dg")?,
        du: launch.output(grads.up, "du")?,
    };
    // SAFETY: dy, dg and du are registered, disjoint views described by their descs; codes and
    // params are the handles' (registered), sized for this shape and grouping when saved.
    unsafe { launch.launch("swiglu_backward", &args, sys::mesa_swiglu_backward, sys::mesa_emu_swiglu_backward)? };
    launch.finish()
}

/// SwiGLU backward reading full-precision saved inputs: `dg = dy·u·silu'(g)`,
/// `du = dy·silu(g)`.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`swiglu_backward`].
pub fn swiglu_backward_plain<T: Element>(
    device: &Device,
    input: &SwigluInput<'_, T>,
    dy: &TensorRef<'_, T>,
    grads: SwigluGrads<'_, '_, T>,
) -> Result<()> {
    check_input(input, dy.shape())?;
    same_shape(dy.shape(), grads.gate.shape(), "dg")?;
    same_shape(dy.shape(), grads.up.shape(), "du")?;
    if dy.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let args = sys::MesaSwigluBackwardArgs {
        dy_desc: elem_desc(dy.layout(), T::DTYPE)?,
        g_desc: elem_desc(input.gate.layout(), T::DTYPE)?,
        u_desc: elem_desc(input.up.layout(), T::DTYPE)?,
        dg_desc: elem_desc(grads.gate.layout(), T::DTYPE)?,
        du_desc: elem_desc(grads.up.layout(), T::DTYPE)?,
        dy: launch.input(dy, "dy")?,
        g: launch.input(input.gate, "gate")?,
        gate_source: sys::MesaCodeSource::default(),
        u: launch.input(input.up, "up projection")?,
        up_source: sys::MesaCodeSource::default(),
        dg: launch.output(grads.gate, "dg")?,
        du: launch.output(grads.up, "du")?,
    };
    // SAFETY: dy, g, u, dg and du are registered views described by their descs, the outputs
    // disjoint from the inputs and from each other; no codes are read.
    unsafe { launch.launch("swiglu_backward", &args, sys::mesa_swiglu_backward, sys::mesa_emu_swiglu_backward)? };
    launch.finish()
}
