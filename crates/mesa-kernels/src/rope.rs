//! Rotary position embeddings (Su et al. 2021, RoFormer, §3.4.2, eq. 34), the position code of
//! Llama, Mistral, Qwen and GPT-NeoX: pairs of each query and key row rotated by angles that
//! grow with the row's position. Orthogonal, so the backward is the rotation by the opposite
//! angles ([`rope_backward`]) and nothing is kept for it. [`rope_forward_save`] also writes the
//! codes of its output in the same pass (the Q and K codes attention's backward reads).
use mesa_kernels_sys as sys;

use crate::device::Device;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::{kernel_view, Grouping};
#[allow(unused_imports)] // intra-doc links
use crate::quant::StatsMode;
use crate::quant::{same_stream, Finalize, ProducerStep, Quantizer, SavedActivation, SavedMeta, SavedViewMut};
use crate::tensor::{TensorMut, TensorRef};

/// Which dims form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePairing {
    /// `(i, i + R/2)`: the two halves (GPT-NeoX, Llama, Hugging Face, candle-nn's `rope`).
    Halves,
    /// `(2i, 2i + 1)`: neighbours (GPT-J, candle-nn's `rope_i`).
    Interleaved,
}

/// The rotation: `θ = p·base^(−2i/R)` for pair `i` of the first `R` dims of a row at position
/// `p = position_offset + s` (`s` its index along the sequence axis).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// `base` (10 000 in RoFormer and Llama 2, 500 000 in Llama 3); finite, > 1.
    pub base: f32,
    /// Which dims pair up.
    pub pairing: RopePairing,
    /// The rotated dims `R` (even, `2 ≤ R ≤ D`); `None`: all of them (`R = D`).
    pub rotary_dims: Option<usize>,
    /// The position of the first row (a continuation of a sequence; 0 otherwise).
    pub position_offset: usize,
}

impl RopeConfig {
    /// Llama's rotation: the two halves, all dims, from position 0, with `base`.
    #[must_use]
    pub fn llama(base: f32) -> Self {
        RopeConfig { base, pairing: RopePairing::Halves, rotary_dims: None, position_offset: 0 }
    }
}

/// `y = RoPE(x)`: `x` and `y` of one shape `[..., S, D]` (the last axis the head dim, the one
/// before it the positions), any strides; f32, f16 or bf16 (f32 arithmetic; `θ` rounded to f32
/// as Hugging Face's cos/sin cache rounds it, so outputs carry an error of about
/// `|x|·2⁻²⁴·p` at position `p`). Bytes moved: `2·numel·sizeof(T)`.
///
/// In-place: not supported (overlap → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] (shapes differ), [`Error::InvalidLayout`] (rank < 2, an odd or
/// too large `rotary_dims`, a base that is not finite and > 1, a position past 2²⁴ where f32
/// angles lose the position's last digit), [`Error::Aliasing`],
/// [`Error::TooLarge`], [`Error::Unsupported`], [`Error::WrongBackend`], CUDA errors.
pub fn rope<T: Element>(
    device: &Device,
    config: &RopeConfig,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
) -> Result<()> {
    rotate(device, config, x, y, false)
}

/// The backward of [`rope`]: `dx = RoPE⁻¹(dy)`, the rotation by `−θ` (shapes, dtypes and
/// errors as [`rope`]).
///
/// # Errors
/// As [`rope`].
pub fn rope_backward<T: Element>(
    device: &Device,
    config: &RopeConfig,
    dy: &TensorRef<'_, T>,
    dx: &mut TensorMut<'_, T>,
) -> Result<()> {
    rotate(device, config, dy, dx, true)
}

/// The rotation's sizes, checked against `config`: what the kernels take.
struct Geometry {
    seq: i64,
    dim: i64,
    rotary: i64,
    offset: i64,
}

/// Checks the shapes of `x` and `y` against each other and `config`; the geometry of the
/// rotation (checked before an empty tensor returns, as for a full one).
fn geometry(config: &RopeConfig, x: &[usize], y: &[usize]) -> Result<Geometry> {
    if x != y {
        return Err(Error::shape_mismatch("RoPE output", x, y));
    }
    let rank = x.len();
    if rank < 2 {
        return Err(Error::invalid_layout("RoPE input", "a tensor [..., S, D] of rank >= 2"));
    }
    let (seq, dim) = (x[rank - 2], x[rank - 1]);
    let rotary = config.rotary_dims.unwrap_or(dim);
    if rotary < 2 || rotary % 2 != 0 || rotary > dim {
        return Err(Error::invalid_layout(
            "RoPE rotary dims",
            format!("{rotary} rotated dims of a head of {dim}: an even number from 2 to {dim}"),
        ));
    }
    if !(config.base > 1.0 && config.base.is_finite()) {
        return Err(Error::invalid_layout("RoPE base", format!("{}: a finite base > 1", config.base)));
    }
    // f32 positions: exact below 2^24 (Hugging Face's cache computes them in f32 too)
    if config.position_offset.saturating_add(seq) > 1 << 24 {
        return Err(Error::invalid_layout(
            "RoPE positions",
            format!(
                "up to {} (offset {} + {seq}): at most 2^24, exact in f32",
                config.position_offset.saturating_add(seq),
                config.position_offset
            ),
        ));
    }
    let to_i64 = |v: usize, what: &str| i64::try_from(v).map_err(|_| Error::too_large(what, "above i64::MAX"));
    Ok(Geometry {
        seq: to_i64(seq, "RoPE sequence")?,
        dim: to_i64(dim, "RoPE head dim")?,
        rotary: to_i64(rotary, "RoPE rotary dims")?,
        offset: to_i64(config.position_offset, "RoPE position offset")?,
    })
}

/// The kernels' arguments for a rotation of `x` into `y` (descs of non-empty views).
fn rope_args(
    config: &RopeConfig,
    g: &Geometry,
    (x_desc, x): (sys::MesaTensorDesc, *const std::ffi::c_void),
    (y_desc, y): (sys::MesaTensorDesc, *mut std::ffi::c_void),
    inverse: bool,
) -> sys::MesaRopeArgs {
    sys::MesaRopeArgs {
        x,
        x_desc,
        y,
        y_desc,
        seq_len: g.seq,
        head_dim: g.dim,
        rotary_dims: g.rotary,
        position_offset: g.offset,
        base: config.base,
        pairing: (match config.pairing {
            RopePairing::Halves => sys::MESA_ROPE_HALVES,
            RopePairing::Interleaved => sys::MESA_ROPE_INTERLEAVED,
        }) as sys::MesaRopePairing,
        inverse: i32::from(inverse),
        _pad: 0,
    }
}

fn rotate<T: Element>(
    device: &Device,
    config: &RopeConfig,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
    inverse: bool,
) -> Result<()> {
    let g = geometry(config, x.shape(), y.shape())?;
    if x.numel() == 0 {
        return Ok(());
    }
    let x_desc = kernel_view(x.layout(), &Grouping::Tensor, T::DTYPE)?.desc;
    let y_desc = kernel_view(y.layout(), &Grouping::Tensor, T::DTYPE)?.desc;
    let mut launch = Launch::new(device);
    let xp = launch.input(x, "input")?;
    let yp = launch.output(y, "output")?;
    let args = rope_args(config, &g, (x_desc, xp), (y_desc, yp), inverse);
    // SAFETY: x and y are registered, disjoint views described by their descs (the logical
    // element order of [..., S, D], which the kernel indexes); no other memory is touched.
    unsafe { launch.launch("rope", &args, sys::mesa_rope, sys::mesa_emu_rope)? };
    launch.finish()
}

/// RoPE that saves its output for the backward of attention (issue 40: the rotation fused into
/// the save of the Q and K codes, Mesa §3): writes `y = RoPE(x)` — bit for bit what [`rope`]
/// writes — and returns the codes of `y`, the stored (dtype-rounded) output, with
/// `quantizer`'s grouping, bit width (8, 4, 2), rounding (nearest or stochastic) and
/// statistics (exact, or the running estimate): bit for bit the handle
/// [`Quantizer::quantize`] gives for that `y`, and the quantizer's state moves as it would.
/// The handle decodes to `Q(RoPE(x))` ([`SavedActivation::dequantize`], or inside a backward
/// kernel); the backward of RoPE itself keeps nothing ([`rope_backward`]).
///
/// Passes: one that reads `x`, rotates it in registers and writes `y` and its codes. The
/// quantizer adds on its first batch and in [`StatsMode::Exact`] a statistics pass before it
/// (reads `x`, rotates it in registers, reduces the statistics of the rounded `y`; writes
/// nothing else), and in [`StatsMode::Running`] a widening pass after it (the units of the
/// groups that escaped the estimate, read from `y` and encoded again; none in the steady
/// state). Bytes moved in the running mode: `numel·sizeof(T)` read, `numel·(sizeof(T) +
/// bits/8)` written (the saving adds `bits/8` per element to [`rope`]'s `2·sizeof(T)`); the
/// statistics pass reads `numel·sizeof(T)` more.
///
/// Shapes: `x` and `y` of one shape `[..., S, D]` (the last axis the head dim, the one before
/// it the positions), any strides, e.g. the queries `[B, H, N, d]` of a Llama layer with
/// `Grouping::Heads { axis: 1 }` (Mesa's head-wise codes), also when they are a transposed
/// view of a `[B, N, H, d]` projection; the quantizer's grouping is of that shape. dtypes: f32,
/// f16 or bf16 (`x` and `y` the same), f32 arithmetic; rotation angles as [`rope`].
///
/// In-place: not supported (overlap → [`Error::Aliasing`]).
///
/// # Errors
/// As [`rope`] ([`Error::ShapeMismatch`], [`Error::InvalidLayout`] for the rotation, checked
/// first), and [`Error::InvalidLayout`] (a grouping the shape does not have, a group count
/// differing from the quantizer's earlier batches), [`Error::WrongBackend`] (memory or a
/// quantizer of another device or stream), [`Error::Aliasing`], [`Error::TooLarge`],
/// [`Error::Unsupported`] (a view the kernels cannot index), [`Error::Misaligned`], CUDA
/// errors. A call that fails its checks writes nothing and is no quantizer batch.
pub fn rope_forward_save<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    config: &RopeConfig,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
) -> Result<SavedActivation> {
    if !same_stream(device, quantizer.device()) {
        return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
    }
    geometry(config, x.shape(), y.shape())?;
    let mut saved = quantizer.new_saved(y.layout(), T::DTYPE)?;
    let (mut view, meta) = saved.view_mut()?;
    *meta = rope_forward_save_to(device, quantizer, config, x, y, &mut view)?;
    Ok(saved)
}

/// [`rope_forward_save`] writing the codes of `y` into memory the caller owns (`saved`'s
/// parts sized by [`crate::quant::saved_sizes`] for `y`'s shape and `quantizer`'s config).
/// Returns what the codes encode, for [`crate::SavedView::new`].
///
/// # Errors
/// As [`rope_forward_save`], plus [`Error::BufferTooShort`] / [`Error::InvalidArgument`]
/// (a part of `saved` shorter / longer than `y` needs), [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] for `saved`'s parts
/// overlapping each other, `x` or `y`. Nothing is launched when a check fails.
pub fn rope_forward_save_to<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    config: &RopeConfig,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
    saved: &mut SavedViewMut<'_>,
) -> Result<SavedMeta> {
    if !same_stream(device, quantizer.device()) {
        return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
    }
    let g = geometry(config, x.shape(), y.shape())?;
    // views of a non-empty tensor only (merging multiplies sizes); nothing is launched otherwise
    let views = match x.numel() {
        0 => None,
        _ => Some((
            kernel_view(x.layout(), &Grouping::Tensor, T::DTYPE)?.desc,
            kernel_view(y.layout(), &Grouping::Tensor, T::DTYPE)?.desc,
            // the widening pass re-encodes y: the Quantizer's pass on y's grouped view
            kernel_view(y.layout(), &quantizer.config().grouping, T::DTYPE)?,
        )),
    };
    let layout = y.layout().clone();
    let mut launch = Launch::new(device);
    let xp = launch.input(x, "input")?;
    let yp = launch.output(y, "output")?;
    let meta = quantizer.encode::<T>(&mut launch, saved, &layout, Finalize::Separate, |launch, step, sink, _| {
        let Some((x_desc, y_desc, grouped)) = views.as_ref() else { return Ok(()) };
        if let ProducerStep::Widen(widen) = step {
            // SAFETY: y is a registered output, written in full by the previous step of this
            // launch and described by `grouped`; codes, params and the widen flags are the
            // handle's and the quantizer's, registered and sized for y's shape and grouping by
            // `encode`.
            return unsafe { crate::fused::widen_input(launch, yp.cast_const(), grouped, &sink, widen) };
        }
        // the statistics pass writes no output
        let out = if step == ProducerStep::Stats { std::ptr::null_mut() } else { yp };
        let args = sys::MesaRopeSaveArgs { rope: rope_args(config, &g, (*x_desc, xp), (*y_desc, out), false), sink };
        // SAFETY: x and y are registered, disjoint views described by their descs; the sink's
        // buffers were registered and sized for y's shape and grouping by `encode`.
        unsafe { launch.launch("rope_save", &args, sys::mesa_rope_save, sys::mesa_emu_rope_save) }
    })?;
    launch.finish()?;
    Ok(meta)
}
