//! GELU (Hendrycks & Gimpel 2016): forward saving the codes of its input, plain forward,
//! backward from codes or from a full-precision input.
use mesa_kernels_sys as sys;

use super::{check_saved, code_source, elem_desc, same_shape};
use crate::device::Device;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::kernel_view;
use crate::quant::{
    same_stream, Finalize, ProducerStep, Quantizer, SavedActivation, SavedMeta, SavedView, SavedViewMut,
};
use crate::tensor::{TensorMut, TensorRef};

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

/// GELU forward that saves the codes of its input: `y = gelu(x)`, and the returned handle
/// holds `Q(x)` with `quantizer`'s grouping, bit width, rounding and running estimate (one
/// pass over `x`; two on the quantizer's first batch and in [`crate::StatsMode::Exact`]).
///
/// Shapes: `x` and `y` any equal shapes, any strides. Bytes moved: `numel·sizeof(T)` read,
/// `numel·sizeof(T) + numel·bits/8` written. Allocates the saved handle (stream-ordered). An
/// empty tensor launches nothing and does not count as a batch.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] (shapes differ), [`Error::InvalidLayout`] (grouping, or a group
/// count other than the quantizer's), [`Error::Aliasing`], [`Error::TooLarge`],
/// [`Error::Unsupported`] (a view the kernels cannot index), [`Error::WrongBackend`]
/// (memory or quantizer of another device or stream), [`Error::Misaligned`], CUDA errors.
pub fn gelu_forward<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    form: GeluForm,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
) -> Result<SavedActivation> {
    if !same_stream(device, quantizer.device()) {
        return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
    }
    same_shape(x.shape(), y.shape(), "GELU output")?;
    let mut saved = quantizer.new_saved(x.layout(), T::DTYPE)?;
    let (mut view, meta) = saved.view_mut()?;
    *meta = gelu_forward_to(device, quantizer, form, x, y, &mut view)?;
    Ok(saved)
}

/// [`gelu_forward`] writing the saved codes of `x` into memory the caller owns: `saved`'s
/// parts sized by [`crate::quant::saved_sizes`] for `x`'s shape and `quantizer`'s config.
/// Returns what the codes encode, for [`SavedView::new`] and [`gelu_backward_view`].
///
/// # Errors
/// As [`gelu_forward`], plus [`Error::BufferTooShort`] / [`Error::InvalidArgument`] (a part
/// of `saved` shorter / longer than `x` needs), [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] for `saved`'s parts
/// overlapping each other, `x` or `y`. Nothing is launched when a check fails.
pub fn gelu_forward_to<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    form: GeluForm,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
    saved: &mut SavedViewMut<'_>,
) -> Result<SavedMeta> {
    if !same_stream(device, quantizer.device()) {
        return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
    }
    same_shape(x.shape(), y.shape(), "GELU output")?;
    let descs =
        if x.numel() == 0 { None } else { Some((elem_desc(x.layout(), T::DTYPE)?, elem_desc(y.layout(), T::DTYPE)?)) };
    // the saved tensor is x itself: its widening pass is the Quantizer's, on x's grouped view
    let grouped =
        if x.numel() == 0 { None } else { Some(kernel_view(x.layout(), &quantizer.config().grouping, T::DTYPE)?) };
    let layout = x.layout().clone();
    let mut launch = Launch::new(device);
    let xp = launch.input(x, "input")?;
    let yp = launch.output(y, "output")?;
    let meta = quantizer.encode::<T>(&mut launch, saved, &layout, Finalize::Separate, |launch, step, sink, _| {
        // encode runs no step for an empty tensor
        let (Some((x_desc, y_desc)), Some(grouped)) = (descs, grouped.as_ref()) else { return Ok(()) };
        if let ProducerStep::Widen(widen) = step {
            // SAFETY: x is a registered input described by `grouped`; codes, params and the
            // widen flags are the handle's and the quantizer's, registered and sized by `encode`.
            return unsafe { super::widen_input(launch, xp, grouped, &sink, widen) };
        }
        let args = sys::MesaGeluForwardArgs {
            x: xp,
            x_desc,
            y: if step == ProducerStep::Stats { std::ptr::null_mut() } else { yp },
            y_desc,
            sink,
            form: form.to_sys(),
            _pad: 0,
        };
        // SAFETY: x and y are registered views (fit their buffers, y without self-overlap,
        // disjoint) described by x_desc / y_desc; the sink's buffers were registered and
        // sized for x's shape and grouping by `encode`.
        unsafe { launch.launch("gelu_forward", &args, sys::mesa_gelu_forward, sys::mesa_emu_gelu_forward) }
    })?;
    launch.finish()?;
    Ok(meta)
}

/// Plain GELU forward, nothing saved: `y = gelu(x)`.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`gelu_forward`] (without the quantizer's).
pub fn gelu<T: Element>(device: &Device, form: GeluForm, x: &TensorRef<'_, T>, y: &mut TensorMut<'_, T>) -> Result<()> {
    same_shape(x.shape(), y.shape(), "GELU output")?;
    if x.numel() == 0 {
        return Ok(());
    }
    let (x_desc, y_desc) = (elem_desc(x.layout(), T::DTYPE)?, elem_desc(y.layout(), T::DTYPE)?);
    let mut launch = Launch::new(device);
    let args = sys::MesaGeluForwardArgs {
        x: launch.input(x, "input")?,
        x_desc,
        y: launch.output(y, "output")?,
        y_desc,
        sink: sys::MesaCodeSink::default(),
        form: form.to_sys(),
        _pad: 0,
    };
    // SAFETY: x and y are registered, disjoint views described by their descs; no codes.
    unsafe { launch.launch("gelu_forward", &args, sys::mesa_gelu_forward, sys::mesa_emu_gelu_forward)? };
    launch.finish()
}

/// GELU backward from codes: `dx = dy · gelu'(x̂)`, `x̂` decoded from `saved` inside the
/// kernel. Bytes moved: `numel·(sizeof(T) + bits/8)` read, `numel·sizeof(T)` written.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] (dy, dx or the saved tensor differ in shape),
/// [`Error::Aliasing`], [`Error::WrongBackend`], [`Error::Unsupported`],
/// [`Error::Misaligned`], CUDA errors.
pub fn gelu_backward<T: Element>(
    device: &Device,
    form: GeluForm,
    saved: &SavedActivation,
    dy: &TensorRef<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    check_saved(saved, device, dy.shape())?;
    gelu_backward_view(device, form, &saved.view()?, dy, dx)
}

/// [`gelu_backward`] reading the codes from memory the caller owns (what
/// [`gelu_forward_to`] wrote, with the meta it returned).
///
/// # Errors
/// As [`gelu_backward`], plus [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] (dx overlapping the
/// codes or parameters).
pub fn gelu_backward_view<T: Element>(
    device: &Device,
    form: GeluForm,
    saved: &SavedView<'_>,
    dy: &TensorRef<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    same_shape(saved.meta().shape(), dy.shape(), "gradient (vs the saved activation)")?;
    same_shape(dy.shape(), dx.shape(), "dx")?;
    if dy.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let source = code_source(&mut launch, saved)?;
    let args = sys::MesaGeluBackwardArgs {
        dy_desc: elem_desc(dy.layout(), T::DTYPE)?,
        dx_desc: elem_desc(dx.layout(), T::DTYPE)?,
        dy: launch.input(dy, "dy")?,
        x: std::ptr::null(),
        x_desc: sys::MesaTensorDesc::default(),
        source,
        dx: launch.output(dx, "dx")?,
        form: form.to_sys(),
        _pad: 0,
    };
    // SAFETY: dy and dx are registered, disjoint views described by their descs; codes and
    // params are the handle's (registered), sized for this shape and grouping when saved.
    unsafe { launch.launch("gelu_backward", &args, sys::mesa_gelu_backward, sys::mesa_emu_gelu_backward)? };
    launch.finish()
}

/// The inputs of [`gelu_backward_plain`]: the saved full-precision input and the incoming
/// gradient (same shape, same dtype).
#[derive(Debug)]
pub struct GeluBackwardPlain<'a, T> {
    /// The GELU variant of the forward.
    pub form: GeluForm,
    /// The forward's input `x`.
    pub x: &'a TensorRef<'a, T>,
    /// The gradient of the output.
    pub dy: &'a TensorRef<'a, T>,
}

/// GELU backward reading a full-precision saved input: `dx = dy · gelu'(x)`.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`gelu_backward`].
pub fn gelu_backward_plain<T: Element>(
    device: &Device,
    args: &GeluBackwardPlain<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    let GeluBackwardPlain { form, x, dy } = *args;
    same_shape(dy.shape(), x.shape(), "saved input")?;
    same_shape(dy.shape(), dx.shape(), "dx")?;
    if dy.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let args = sys::MesaGeluBackwardArgs {
        dy_desc: elem_desc(dy.layout(), T::DTYPE)?,
        x_desc: elem_desc(x.layout(), T::DTYPE)?,
        dx_desc: elem_desc(dx.layout(), T::DTYPE)?,
        dy: launch.input(dy, "dy")?,
        x: launch.input(x, "saved input")?,
        source: sys::MesaCodeSource::default(),
        dx: launch.output(dx, "dx")?,
        form: form.to_sys(),
        _pad: 0,
    };
    // SAFETY: dy, x and dx are registered views described by their descs, dx disjoint from
    // both; no codes are read.
    unsafe { launch.launch("gelu_backward", &args, sys::mesa_gelu_backward, sys::mesa_emu_gelu_backward)? };
    launch.finish()
}
