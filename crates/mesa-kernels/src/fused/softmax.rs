//! Softmax over the last axis: forward saving the codes of its output (fixed parameters, no
//! statistics), plain forward, backward from codes or from a full-precision output.
use mesa_kernels_sys as sys;

use super::{check_saved, code_source, row_desc, row_len, same_shape};
use crate::device::Device;
use crate::dtype::DType;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::Layout;
use crate::layout::{kernel_view, Grouping};
use crate::quant::{
    check_code_address, write_registered, zero_registered, Companding, GroupParams, Rounding, SavedActivation,
    SavedMeta, SavedSizes, SavedView, SavedViewMut,
};
use crate::tensor::{TensorMut, TensorRef};

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

impl SoftmaxSave {
    /// What a caller allocates for [`softmax_forward_to`] on an input of `shape`: the codes
    /// and groups of this bit width and grouping (and one u32 counter).
    ///
    /// # Errors
    /// [`Error::Unsupported`] (bit width), [`Error::InvalidLayout`] (grouping),
    /// [`Error::TooLarge`] (sizes overflow).
    pub fn saved_sizes(&self, shape: &[usize]) -> Result<SavedSizes> {
        self.check()?;
        self.meta(&Layout::contiguous(shape), DType::F32).sizes()
    }

    /// The meta [`softmax_forward_to`] returns for a **contiguous** input of `shape` and
    /// `dtype` (made with `TensorRef::contiguous`): that shape, its row-major strides, these
    /// bits, grouping and companding. A function of the arguments only (no data), for a
    /// framework that builds the backward's state before the forward has run (as
    /// [`SavedMeta::contiguous`] for the quantizing producers).
    ///
    /// # Errors
    /// As [`SoftmaxSave::saved_sizes`]: [`Error::Unsupported`] (bit width),
    /// [`Error::InvalidLayout`] (grouping), [`Error::TooLarge`] (sizes overflow).
    pub fn saved_meta(&self, shape: &[usize], dtype: DType) -> Result<SavedMeta> {
        let _sizes: SavedSizes = self.saved_sizes(shape)?;
        Ok(self.meta(&Layout::contiguous(shape), dtype))
    }

    /// What the saved codes of an output of `layout` and `dtype` encode.
    fn meta(&self, layout: &Layout, dtype: DType) -> SavedMeta {
        SavedMeta {
            shape: layout.shape().to_vec(),
            strides: layout.strides().to_vec(),
            dtype,
            bits: self.bits,
            grouping: self.grouping,
            companding: self.codes.companding(),
        }
    }

    fn check(&self) -> Result<()> {
        if !matches!(self.bits, 2 | 4 | 8) {
            return Err(Error::unsupported("bits", format!("{}-bit codes (supported: 8, 4, 2)", self.bits)));
        }
        Ok(())
    }
}

/// The inputs of [`softmax_forward`] and [`softmax`]: the logits and an optional additive
/// mask of the same shape (any strides: stride 0 broadcasts, e.g. a `[B, 1, 1, N]`
/// key-padding mask over `[B, H, N, N]`; `−inf` allowed; the logits' dtype).
#[derive(Debug)]
pub struct SoftmaxInput<'a, T> {
    /// The logits.
    pub x: &'a TensorRef<'a, T>,
    /// An additive mask, or `None`.
    pub mask: Option<&'a TensorRef<'a, T>>,
}

impl<'a, T> SoftmaxInput<'a, T> {
    /// Logits without a mask.
    #[must_use]
    pub fn new(x: &'a TensorRef<'a, T>) -> Self {
        SoftmaxInput { x, mask: None }
    }
    /// The same logits with an additive mask.
    #[must_use]
    pub fn with_mask(self, mask: &'a TensorRef<'a, T>) -> Self {
        SoftmaxInput { mask: Some(mask), ..self }
    }
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
/// codes come from a second pass over `y` (same codes; `numel·sizeof(T)` more read), with the
/// same non-finite count and NaN groups as the fused pass. An empty tensor (also one whose grouped axis or rows have
/// length 0) launches nothing and returns an empty handle (its groups hold the fixed
/// parameters).
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] (output or mask shape), [`Error::InvalidLayout`] (rank 0,
/// grouping), [`Error::Unsupported`] (bit width, a view the kernels cannot index),
/// [`Error::Aliasing`], [`Error::TooLarge`], [`Error::WrongBackend`], [`Error::Misaligned`],
/// CUDA errors.
pub fn softmax_forward<T: Element>(
    device: &Device,
    save: &SoftmaxSave,
    input: &SoftmaxInput<'_, T>,
    y: &mut TensorMut<'_, T>,
) -> Result<SavedActivation> {
    save.check()?;
    check_inputs(input, y)?;
    let x = input.x;
    let mut saved = SavedActivation::allocate(device, &save.meta(x.layout(), T::DTYPE))?;
    let (mut view, meta) = saved.view_mut()?;
    *meta = softmax_forward_to(device, save, input, y, &mut view)?;
    Ok(saved)
}

/// [`softmax_forward`] writing the codes of `y`, their fixed parameters and the non-finite
/// count into memory the caller owns: `saved`'s parts sized by [`SoftmaxSave::saved_sizes`]
/// for the input's shape. Returns what the codes encode, for [`SavedView::new`] and
/// [`softmax_backward_view`].
///
/// # Errors
/// As [`softmax_forward`], plus [`Error::BufferTooShort`] / [`Error::InvalidArgument`] (a
/// part of `saved` shorter / longer than the tensor needs), [`Error::Misaligned`] (codes
/// not [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] for `saved`'s
/// parts overlapping each other, the input, the mask or `y`. Nothing is launched when a
/// check fails.
pub fn softmax_forward_to<T: Element>(
    device: &Device,
    save: &SoftmaxSave,
    input: &SoftmaxInput<'_, T>,
    y: &mut TensorMut<'_, T>,
    saved: &mut SavedViewMut<'_>,
) -> Result<SavedMeta> {
    save.check()?;
    check_inputs(input, y)?;
    let x = input.x;
    let companding = save.codes.companding();
    let meta = save.meta(x.layout(), T::DTYPE);
    let _: SavedSizes = saved.check_sizes(&meta)?;
    let (run, count) = meta.group_map()?;
    let fixed = GroupParams { offset: 0.0, scale: (1.0 / f64::from((1u32 << save.bits) - 1)) as f32 };
    let SavedViewMut { codes, params, nonfinite } = saved;
    let mut launch = Launch::new(device);
    let cp = launch.output(codes, "saved codes")?.cast::<u8>();
    check_code_address(cp as usize, "saved codes")?;
    let pp = launch.output(params, "saved parameters")?.cast::<GroupParams>();
    let np = launch.output(nonfinite, "non-finite counter")?.cast::<u32>();
    if x.numel() == 0 {
        // nothing to launch: the groups get the fixed parameters, the count 0
        // SAFETY: params holds `count` entries and the counter one (check_sizes), registered
        unsafe {
            write_registered(&launch, pp, &vec![fixed; count])?;
            zero_registered(&launch, np, 1)?;
        }
        launch.finish()?;
        return Ok(meta);
    }
    let cols = row_len(x.shape(), "input")?;
    // cols · bits: cols ≤ numel, which was checked to fit the kernels' i64 indexing
    let fused = (cols as u64 * u64::from(save.bits)) % 8 == 0;
    let (rounding, seed) = sys_rounding(save.rounding);
    let view = if fused { None } else { Some(kernel_view(y.layout(), &save.grouping, T::DTYPE)?) };
    let mut args = forward_args(input, y.layout())?;
    args.x = launch.input(x, "input")?;
    if let Some(m) = input.mask {
        args.mask = launch.input(m, "mask")?;
    }
    let yp = launch.output(y, "output")?;
    // the kernel adds to the counter
    // SAFETY: the counter is one registered u32
    unsafe { zero_registered(&launch, np, 1)? };
    let sink = sys::MesaCodeSink {
        codes: if fused { cp } else { std::ptr::null_mut() },
        params: pp.cast_const().cast(),
        stats: std::ptr::null_mut(),
        group_run: run as i64,
        group_count: count as i64,
        seed,
        bits: save.bits as i32,
        rounding,
        map: companding.sys(),
        _pad: 0,
    };
    let args = sys::MesaSoftmaxForwardArgs {
        y: yp,
        sink,
        params_out: pp.cast(),
        params_count: count as i64,
        nonfinite: np,
        ..args
    };
    // SAFETY: x, the mask and y are registered views described by their descs (y disjoint
    // from both); codes hold code_bytes(numel) bytes, params `count` entries and the counter
    // one, all registered and sized for this shape and grouping by `allocate`.
    unsafe { launch.launch("softmax_forward", &args, sys::mesa_softmax_forward, sys::mesa_emu_softmax_forward)? };
    if let Some(view) = view {
        // rows do not start on a byte: encode the stored y with the same fixed parameters
        let args = sys::MesaQuantizeArgs {
            x: yp.cast_const(),
            x_desc: view.desc,
            grouping: view.grouping,
            params: pp.cast_const().cast(),
            codes: cp,
            stats: std::ptr::null_mut(),
            seed,
            bits: save.bits as i32,
            rounding,
            map: companding.sys(),
            _pad: 0,
            widen: std::ptr::null(),
            finalize: sys::MesaFusedFinalize::default(),
        };
        // SAFETY: y (registered as the output, written by the kernel above) is described by
        // view.desc; codes and params as above.
        unsafe { launch.launch("quantize", &args, sys::mesa_quantize, sys::mesa_emu_quantize)? };
    }
    launch.finish()?;
    Ok(meta)
}

/// Plain softmax over the last axis, nothing saved (fully masked rows give 0).
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`softmax_forward`] (without the bit width).
pub fn softmax<T: Element>(device: &Device, input: &SoftmaxInput<'_, T>, y: &mut TensorMut<'_, T>) -> Result<()> {
    check_inputs(input, y)?;
    if input.x.numel() == 0 {
        return Ok(());
    }
    let mut args = forward_args(input, y.layout())?;
    let mut launch = Launch::new(device);
    args.x = launch.input(input.x, "input")?;
    if let Some(m) = input.mask {
        args.mask = launch.input(m, "mask")?;
    }
    args.y = launch.output(y, "output")?;
    args.sink.bits = 8;
    // SAFETY: x, the mask and y are registered views described by their descs, y disjoint
    // from both; no codes, parameters or counter are written.
    unsafe { launch.launch("softmax_forward", &args, sys::mesa_softmax_forward, sys::mesa_emu_softmax_forward)? };
    launch.finish()
}

fn check_inputs<T>(input: &SoftmaxInput<'_, T>, y: &TensorMut<'_, T>) -> Result<()> {
    row_len(input.x.shape(), "input")?;
    same_shape(input.x.shape(), y.shape(), "softmax output")?;
    if let Some(m) = input.mask {
        same_shape(input.x.shape(), m.shape(), "mask")?;
    }
    Ok(())
}

/// The descriptors of a non-empty softmax call (pointers filled in by the caller).
fn forward_args<T: Element>(
    input: &SoftmaxInput<'_, T>,
    y: &crate::layout::Layout,
) -> Result<sys::MesaSoftmaxForwardArgs> {
    Ok(sys::MesaSoftmaxForwardArgs {
        x: std::ptr::null(),
        x_desc: row_desc(input.x.layout(), T::DTYPE, "input")?,
        mask: std::ptr::null(),
        mask_desc: match input.mask {
            Some(m) => row_desc(m.layout(), T::DTYPE, "mask")?,
            None => sys::MesaTensorDesc::default(),
        },
        y: std::ptr::null_mut(),
        y_desc: row_desc(y, T::DTYPE, "output")?,
        sink: sys::MesaCodeSink::default(),
        params_out: std::ptr::null_mut(),
        params_count: 0,
        nonfinite: std::ptr::null_mut(),
    })
}

fn sys_rounding(r: Rounding) -> (sys::MesaRounding, u64) {
    match r {
        Rounding::Nearest => (sys::MESA_ROUND_NEAREST as sys::MesaRounding, 0),
        Rounding::Stochastic { seed } => (sys::MESA_ROUND_STOCHASTIC as sys::MesaRounding, seed),
    }
}

/// Softmax backward from the codes of its output: `dx = ŷ ⊙ (dy − Σ_row dy·ŷ)`, `ŷ` decoded
/// inside the kernel. Bytes moved: `numel·(sizeof(T) + bits/8)` read, `numel·sizeof(T)`
/// written.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::InvalidLayout`] (rank 0), [`Error::Aliasing`],
/// [`Error::WrongBackend`], [`Error::Unsupported`], [`Error::Misaligned`], CUDA errors.
pub fn softmax_backward<T: Element>(
    device: &Device,
    saved: &SavedActivation,
    dy: &TensorRef<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    check_saved(saved, device, dy.shape())?;
    softmax_backward_view(device, &saved.view()?, dy, dx)
}

/// [`softmax_backward`] reading the codes from memory the caller owns (what
/// [`softmax_forward_to`] wrote, with the meta it returned).
///
/// # Errors
/// As [`softmax_backward`], plus [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] (dx over the codes or
/// parameters).
pub fn softmax_backward_view<T: Element>(
    device: &Device,
    saved: &SavedView<'_>,
    dy: &TensorRef<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    same_shape(saved.meta().shape(), dy.shape(), "gradient (vs the saved activation)")?;
    row_len(dy.shape(), "dy")?;
    same_shape(dy.shape(), dx.shape(), "dx")?;
    if dy.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let source = code_source(&mut launch, saved)?;
    let args = sys::MesaSoftmaxBackwardArgs {
        dy_desc: row_desc(dy.layout(), T::DTYPE, "dy")?,
        dx_desc: row_desc(dx.layout(), T::DTYPE, "dx")?,
        dy: launch.input(dy, "dy")?,
        y: std::ptr::null(),
        y_desc: sys::MesaTensorDesc::default(),
        source,
        dx: launch.output(dx, "dx")?,
    };
    // SAFETY: dy and dx are registered, disjoint views described by their descs; codes and
    // params are the handle's (registered), sized for this shape and grouping when saved.
    unsafe { launch.launch("softmax_backward", &args, sys::mesa_softmax_backward, sys::mesa_emu_softmax_backward)? };
    launch.finish()
}

/// The inputs of [`softmax_backward_plain`]: the saved full-precision output and the
/// incoming gradient (same shape, same dtype).
#[derive(Debug)]
pub struct SoftmaxBackwardPlain<'a, T> {
    /// The forward's output `y`.
    pub y: &'a TensorRef<'a, T>,
    /// The gradient of the output.
    pub dy: &'a TensorRef<'a, T>,
}

/// Softmax backward reading a full-precision saved output `y`.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`softmax_backward`].
pub fn softmax_backward_plain<T: Element>(
    device: &Device,
    args: &SoftmaxBackwardPlain<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    let SoftmaxBackwardPlain { y, dy } = *args;
    row_len(dy.shape(), "dy")?;
    same_shape(dy.shape(), y.shape(), "saved output")?;
    same_shape(dy.shape(), dx.shape(), "dx")?;
    if dy.numel() == 0 {
        return Ok(());
    }
    let mut launch = Launch::new(device);
    let args = sys::MesaSoftmaxBackwardArgs {
        dy_desc: row_desc(dy.layout(), T::DTYPE, "dy")?,
        y_desc: row_desc(y.layout(), T::DTYPE, "saved output")?,
        dx_desc: row_desc(dx.layout(), T::DTYPE, "dx")?,
        dy: launch.input(dy, "dy")?,
        y: launch.input(y, "saved output")?,
        source: sys::MesaCodeSource::default(),
        dx: launch.output(dx, "dx")?,
    };
    // SAFETY: dy, y and dx are registered views described by their descs, dx disjoint from
    // both; no codes are read.
    unsafe { launch.launch("softmax_backward", &args, sys::mesa_softmax_backward, sys::mesa_emu_softmax_backward)? };
    launch.finish()
}
