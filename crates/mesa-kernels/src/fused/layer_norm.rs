//! LayerNorm over the last axis: forward saving the codes of `x̂` and the per-row mean and
//! rstd, plain forward, backward from codes or from a full-precision `x̂`, with
//! deterministic `dweight`/`dbias`.
use std::ffi::c_void;

use mesa_kernels_sys as sys;

use super::{check_saved, code_source, empty_rows_desc, row_desc, row_len, same_shape};
use crate::device::{Buffer, Device};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::Layout;
use crate::quant::{
    checked_numel, same_stream, Finalize, ProducerStep, Quantizer, SavedActivation, SavedMeta, SavedView, SavedViewMut,
};
use crate::tensor::{TensorMut, TensorRef};

/// What [`layer_norm_forward`] keeps for backward: the codes of `x̂ = (x − mean)·rstd` and the
/// per-row `mean` and `rstd` in f32.
pub struct SavedLayerNorm {
    xhat: SavedActivation,
    mean: Buffer<f32>,
    rstd: Buffer<f32>,
}

impl std::fmt::Debug for SavedLayerNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedLayerNorm")
            .field("xhat", &self.xhat)
            .field("rows", &self.mean.len())
            .field("size_in_bytes", &self.size_in_bytes())
            .finish()
    }
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

/// The inputs of [`layer_norm_forward`] and [`layer_norm`].
#[derive(Debug)]
pub struct LayerNormForward<'a, T> {
    /// The input: rank ≥ 1, rows along the last axis (length C), any strides.
    pub x: &'a TensorRef<'a, T>,
    /// `[C]` contiguous, the input's dtype; `None` means 1.
    pub weight: Option<&'a TensorRef<'a, T>>,
    /// `[C]` contiguous, the input's dtype; `None` means 0.
    pub bias: Option<&'a TensorRef<'a, T>>,
    /// Added to the variance: positive and finite (e.g. `1e-5`).
    pub eps: f32,
}

impl<'a, T> LayerNormForward<'a, T> {
    /// `x` without affine parameters (weight 1, bias 0).
    #[must_use]
    pub fn new(x: &'a TensorRef<'a, T>, eps: f32) -> Self {
        LayerNormForward { x, weight: None, bias: None, eps }
    }
}

/// The inputs of [`layer_norm_backward`].
#[derive(Debug)]
pub struct LayerNormBackward<'a, T> {
    /// What the forward saved.
    pub saved: &'a SavedLayerNorm,
    /// The forward's weight (`[C]` contiguous), or `None` for 1.
    pub weight: Option<&'a TensorRef<'a, T>>,
    /// The gradient of the output (the input's shape).
    pub dy: &'a TensorRef<'a, T>,
}

/// Where [`layer_norm_forward_to`] writes what the backward needs, in memory the caller
/// owns: the codes of `x̂` (sized by [`crate::quant::saved_sizes`] for the input's shape and
/// the quantizer's config) and the per-row `mean` and `rstd` (`[rows]` f32 each, contiguous,
/// rows in logical order; `rows = numel / C`).
#[derive(Debug)]
pub struct LayerNormSaveMut<'a, 'b> {
    /// The codes of `x̂`.
    pub xhat: &'a mut SavedViewMut<'b>,
    /// Per-row mean.
    pub mean: &'a mut TensorMut<'b, f32>,
    /// Per-row `1/sqrt(var + eps)`.
    pub rstd: &'a mut TensorMut<'b, f32>,
}

/// The inputs of [`layer_norm_backward_view`]: what [`layer_norm_forward_to`] wrote, read
/// from the caller's memory.
#[derive(Debug)]
pub struct LayerNormBackwardView<'a, T> {
    /// The codes of `x̂` (with the meta the forward returned).
    pub xhat: &'a SavedView<'a>,
    /// Per-row `rstd`: `[rows]` contiguous f32, as the forward wrote it.
    pub rstd: &'a TensorRef<'a, f32>,
    /// The forward's weight (`[C]` contiguous), or `None` for 1.
    pub weight: Option<&'a TensorRef<'a, T>>,
    /// The gradient of the output (the input's shape).
    pub dy: &'a TensorRef<'a, T>,
}

/// The inputs of [`layer_norm_backward_plain`].
#[derive(Debug)]
pub struct LayerNormBackwardPlain<'a, T> {
    /// A full-precision `x̂` (the input's shape, `dy`'s dtype).
    pub xhat: &'a TensorRef<'a, T>,
    /// Per-row `rstd`: `[rows]` contiguous f32, rows in logical order.
    pub rstd: &'a TensorRef<'a, f32>,
    /// The forward's weight (`[C]` contiguous), or `None` for 1.
    pub weight: Option<&'a TensorRef<'a, T>>,
    /// The gradient of the output.
    pub dy: &'a TensorRef<'a, T>,
}

/// The outputs of the LayerNorm backward: `dx` (the input's shape) and the f32 parameter
/// gradients `dweight`, `dbias` (`[C]` contiguous each, overwritten).
#[derive(Debug)]
pub struct LayerNormGrads<'a, 'b, T> {
    /// Gradient of the input.
    pub dx: &'a mut TensorMut<'b, T>,
    /// `Σ_rows dy·x̂`.
    pub dweight: &'a mut TensorMut<'b, f32>,
    /// `Σ_rows dy`.
    pub dbias: &'a mut TensorMut<'b, f32>,
}

/// (rows, C) of a LayerNorm input of `shape`; `(0, C)` for an empty tensor with no rows.
fn ln_rows(shape: &[usize], what: &str) -> Result<(usize, usize)> {
    let cols = row_len(shape, what)?;
    let rows = checked_numel(&shape[..shape.len() - 1], what)?;
    if cols == 0 && rows > 0 {
        return Err(Error::invalid_layout(
            what,
            "LayerNorm over rows of length 0 (C = 0): a row without elements has no mean",
        ));
    }
    Ok((rows, cols))
}

fn check_eps(eps: f32) -> Result<()> {
    if !(eps > 0.0 && eps.is_finite()) {
        return Err(Error::invalid_argument("eps", format!("must be positive and finite, got {eps}")));
    }
    Ok(())
}

/// A `[C]` parameter or gradient vector: that shape, contiguous.
fn check_vector(layout: &Layout, cols: usize, what: &str) -> Result<()> {
    same_shape(&[cols], layout.shape(), what)?;
    if cols > 1 && layout.strides()[0] != 1 {
        return Err(Error::invalid_layout(what, "a LayerNorm parameter or its gradient must be contiguous"));
    }
    Ok(())
}

fn check_affine<T>(t: Option<&TensorRef<'_, T>>, cols: usize, what: &str) -> Result<()> {
    t.map_or(Ok(()), |t| check_vector(t.layout(), cols, what))
}

/// Registers an optional `[C]` parameter.
fn affine<'a, T>(
    launch: &mut Launch<'a>,
    t: Option<&'a TensorRef<'_, T>>,
    what: &'static str,
) -> Result<*const c_void> {
    t.map_or(Ok(std::ptr::null()), |t| launch.input(t, what))
}

/// LayerNorm over the last axis that saves what its backward needs: `y = x̂·w + b`,
/// `x̂ = (x − mean)·rstd`, `rstd = 1/sqrt(var + eps)`; the handle holds `Q(x̂)` (with
/// `quantizer`'s grouping — e.g. channel groups of C — bit width, rounding and running
/// estimate) and the per-row mean and rstd in f32. A constant row (variance 0) gives
/// `x̂ = 0`, `y = b`.
///
/// Shapes: `x`, `y` rank ≥ 1, rows along the last axis (C > 0 unless there are no rows), any
/// strides; `weight`, `bias` `[C]` contiguous. Bytes moved: `numel·sizeof(T)` read (twice on
/// the quantizer's first batch and in exact mode), `numel·(sizeof(T) + bits/8) + 8·rows`
/// written. When `C·bits` is not a multiple of 8 the codes come from a second, elementwise
/// pass (reads x again). Allocates the handle (stream-ordered). An empty tensor launches
/// nothing and does not count as a batch.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]; the code
/// pass re-reads `x` after `y` is written).
///
/// # Errors
/// [`Error::ShapeMismatch`] (output, weight, bias), [`Error::InvalidLayout`] (rank 0, rows
/// of length 0, non-contiguous weight or bias, grouping), [`Error::InvalidArgument`] (eps
/// not positive and finite), [`Error::Aliasing`], [`Error::TooLarge`], [`Error::Unsupported`],
/// [`Error::WrongBackend`] (memory or quantizer of another device or stream),
/// [`Error::Misaligned`], CUDA errors.
pub fn layer_norm_forward<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    args: &LayerNormForward<'_, T>,
    y: &mut TensorMut<'_, T>,
) -> Result<SavedLayerNorm> {
    if !same_stream(device, quantizer.device()) {
        return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
    }
    let (rows, _) = check_forward(args, y)?;
    let mut saved = SavedLayerNorm {
        xhat: quantizer.new_saved(args.x.layout(), T::DTYPE)?,
        mean: device.alloc_for_kernel::<f32>(rows)?,
        rstd: device.alloc_for_kernel::<f32>(rows)?,
    };
    let SavedLayerNorm { xhat, mean, rstd } = &mut saved;
    let (mut xview, xmeta) = xhat.view_mut()?;
    let mut mean = TensorMut::contiguous(mean, &[rows])?;
    let mut rstd = TensorMut::contiguous(rstd, &[rows])?;
    *xmeta = forward_saving(
        device,
        quantizer,
        args,
        y,
        LayerNormSaveMut { xhat: &mut xview, mean: &mut mean, rstd: &mut rstd },
    )?;
    Ok(saved)
}

/// [`layer_norm_forward`] writing the codes of `x̂` and the per-row mean and rstd into memory
/// the caller owns ([`LayerNormSaveMut`]). Returns what the codes encode, for
/// [`SavedView::new`] and [`layer_norm_backward_view`].
///
/// # Errors
/// As [`layer_norm_forward`], plus [`Error::BufferTooShort`] / [`Error::InvalidArgument`]
/// (a part of `saved.xhat` shorter / longer than `x` needs), [`Error::ShapeMismatch`] /
/// [`Error::InvalidLayout`] (mean or rstd not `[rows]` contiguous), [`Error::Misaligned`]
/// (codes not [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] (any two of
/// the saved parts, x, weight, bias, y overlapping where one is written). Nothing is
/// launched when a check fails.
pub fn layer_norm_forward_to<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    args: &LayerNormForward<'_, T>,
    y: &mut TensorMut<'_, T>,
    saved: LayerNormSaveMut<'_, '_>,
) -> Result<SavedMeta> {
    if !same_stream(device, quantizer.device()) {
        return Err(Error::wrong_backend("quantizer", "it was made for another device or stream"));
    }
    let (rows, _) = check_forward(args, y)?;
    check_vector(saved.mean.layout(), rows, "mean")?;
    check_vector(saved.rstd.layout(), rows, "rstd")?;
    forward_saving(device, quantizer, args, y, saved)
}

fn check_forward<T>(args: &LayerNormForward<'_, T>, y: &TensorMut<'_, T>) -> Result<(usize, usize)> {
    let (rows, cols) = ln_rows(args.x.shape(), "input")?;
    same_shape(args.x.shape(), y.shape(), "LayerNorm output")?;
    check_eps(args.eps)?;
    check_affine(args.weight, cols, "weight")?;
    check_affine(args.bias, cols, "bias")?;
    Ok((rows, cols))
}

fn forward_saving<T: Element>(
    device: &Device,
    quantizer: &mut Quantizer,
    args: &LayerNormForward<'_, T>,
    y: &mut TensorMut<'_, T>,
    saved: LayerNormSaveMut<'_, '_>,
) -> Result<SavedMeta> {
    let x = args.x;
    let empty = x.numel() == 0;
    let cols = x.shape().last().copied().unwrap_or(0);
    let bits = u64::from(quantizer.config().bits);
    // C·bits: C ≤ numel, checked to fit the kernels' i64 indexing
    let fused = (cols as u64 * bits) % 8 == 0;
    let descs = if empty {
        None
    } else {
        Some((row_desc(x.layout(), T::DTYPE, "input")?, row_desc(y.layout(), T::DTYPE, "output")?))
    };
    let layout = x.layout().clone();
    let LayerNormSaveMut { xhat, mean, rstd } = saved;
    let mut launch = Launch::new(device);
    let xp = launch.input(x, "input")?;
    let wp = affine(&mut launch, args.weight, "weight")?;
    let bp = affine(&mut launch, args.bias, "bias")?;
    let yp = launch.output(y, "output")?;
    let mp = launch.output(mean, "mean")?.cast::<f32>();
    let rp = launch.output(rstd, "rstd")?.cast::<f32>();
    let meta = quantizer.encode::<T>(&mut launch, xhat, &layout, Finalize::Separate, |launch, step, sink, _| {
        // encode runs no step for an empty tensor
        let Some((x_desc, y_desc)) = descs else { return Ok(()) };
        let base = sys::MesaLayerNormForwardArgs {
            x: xp,
            x_desc,
            weight: wp,
            bias: bp,
            y: yp,
            y_desc,
            mean: mp,
            rstd: rp,
            sink: sys::MesaCodeSink::default(),
            eps: args.eps,
            codes_only: 0,
            widen: std::ptr::null(),
        };
        let stats_only = sys::MesaCodeSink { codes: std::ptr::null_mut(), params: std::ptr::null(), ..sink };
        let codes_only = sys::MesaCodeSink { stats: std::ptr::null_mut(), ..sink };
        let mut run = |args: sys::MesaLayerNormForwardArgs| {
            // SAFETY: x, weight, bias (inputs) and y, mean, rstd (outputs) are registered and
            // pairwise disjoint where written; x/y are described by their descs, weight and
            // bias hold C values, mean and rstd `rows`; the sink's buffers were registered
            // and sized for x's shape and grouping by `encode`.
            unsafe {
                launch.launch("layernorm_forward", &args, sys::mesa_layernorm_forward, sys::mesa_emu_layernorm_forward)
            }
        };
        match (step, fused) {
            // exact statistics of x̂ first: nothing else written
            (ProducerStep::Stats, true) => {
                run(sys::MesaLayerNormForwardArgs { y: std::ptr::null_mut(), sink: stats_only, ..base })
            }
            (ProducerStep::Codes | ProducerStep::CodesAndStats, true) => {
                run(sys::MesaLayerNormForwardArgs { sink, ..base })
            }
            // rows do not start on a byte: the row pass writes y, mean, rstd (+ statistics),
            // an elementwise pass the codes
            (ProducerStep::Stats, false) => run(sys::MesaLayerNormForwardArgs { sink: stats_only, ..base }),
            (ProducerStep::Codes, false) => {
                run(sys::MesaLayerNormForwardArgs { sink: codes_only, codes_only: 1, ..base })
            }
            (ProducerStep::CodesAndStats, false) => {
                run(sys::MesaLayerNormForwardArgs { sink: stats_only, ..base })?;
                run(sys::MesaLayerNormForwardArgs { sink: codes_only, codes_only: 1, ..base })
            }
            // the groups that escaped the running estimate: their codes again, from x, mean
            // and rstd (the x̂ of the row pass, bit for bit) with the saved parameters
            (ProducerStep::Widen(widen), _) => run(sys::MesaLayerNormForwardArgs {
                y: std::ptr::null_mut(),
                sink: codes_only,
                codes_only: 1,
                widen,
                ..base
            }),
        }
    })?;
    launch.finish()?;
    Ok(meta)
}

/// Plain LayerNorm forward, nothing saved (no mean, rstd or codes are written).
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`layer_norm_forward`] (without the quantizer's).
pub fn layer_norm<T: Element>(device: &Device, args: &LayerNormForward<'_, T>, y: &mut TensorMut<'_, T>) -> Result<()> {
    check_forward(args, y)?;
    if args.x.numel() == 0 {
        return Ok(());
    }
    let (x_desc, y_desc) = (row_desc(args.x.layout(), T::DTYPE, "input")?, row_desc(y.layout(), T::DTYPE, "output")?);
    let mut launch = Launch::new(device);
    let a = sys::MesaLayerNormForwardArgs {
        x: launch.input(args.x, "input")?,
        x_desc,
        weight: affine(&mut launch, args.weight, "weight")?,
        bias: affine(&mut launch, args.bias, "bias")?,
        y: launch.output(y, "output")?,
        y_desc,
        mean: std::ptr::null_mut(),
        rstd: std::ptr::null_mut(),
        sink: sys::MesaCodeSink::default(),
        eps: args.eps,
        codes_only: 0,
        widen: std::ptr::null(),
    };
    // SAFETY: x, weight, bias and y are registered (y disjoint from the others) and described
    // by their descs / hold C values; nothing else is written.
    unsafe { launch.launch("layernorm_forward", &a, sys::mesa_layernorm_forward, sys::mesa_emu_layernorm_forward)? };
    launch.finish()
}

/// Rows of the dweight/dbias partial sums: fixed by the shape alone, so the summation order
/// (and hence every bit of dweight/dbias) is the same on every device. At least
/// [`ROWS_PER_PARTIAL`] rows a block (two per warp of the fused kernel), at most 512 blocks:
/// one row a block left seven of its eight warps idle, and a batch of 512 rows launched
/// 512 blocks of 256 threads for 512 rows (on the emulator, where every thread is a fiber,
/// half of a training step's time).
fn partial_blocks(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_PARTIAL).clamp(1, 512)
}

/// The fewest rows one dweight/dbias partial sums ([`partial_blocks`]).
const ROWS_PER_PARTIAL: usize = 16;

/// Where `x̂` comes from in a backward.
enum Xhat<'a, T> {
    Codes(&'a SavedView<'a>, &'a TensorRef<'a, f32>),
    Plain(&'a TensorRef<'a, T>, &'a TensorRef<'a, f32>),
}

/// LayerNorm backward from codes: with `g = dy·w`,
/// `dx = rstd·(g − mean_row(g) − x̂·mean_row(g·x̂))`, `dweight = Σ_rows dy·x̂`,
/// `dbias = Σ_rows dy` (f32, `[C]`), `x̂` decoded inside the kernels.
///
/// `dweight`/`dbias` are reduced deterministically: per-block partial sums over fixed row
/// ranges (`min(512, ⌈rows/16⌉)` ranges, chosen from the shape only), then one ordered sum per column —
/// no float atomics, the same bits on every run. Allocates a `2·ranges·C` f32 scratch
/// (stream-ordered). Bytes moved: `numel·(sizeof(T) + bits/8)` read for rows of C ≤ 1024 (dx
/// and the partial sums in one pass), twice that above (a dx kernel, then a column kernel),
/// `numel·sizeof(T)` written. No rows: `dweight = dbias = 0`.
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]; the column
/// kernel re-reads `dy` after `dx` is written).
///
/// # Errors
/// [`Error::ShapeMismatch`] (dy, dx, the saved tensor, weight, dweight, dbias),
/// [`Error::InvalidLayout`] (non-contiguous vectors, rows of length 0), [`Error::Aliasing`],
/// [`Error::TooLarge`], [`Error::WrongBackend`], [`Error::Unsupported`],
/// [`Error::Misaligned`], CUDA errors.
pub fn layer_norm_backward<T: Element>(
    device: &Device,
    args: &LayerNormBackward<'_, T>,
    grads: LayerNormGrads<'_, '_, T>,
) -> Result<()> {
    let saved = args.saved;
    check_saved(&saved.xhat, device, args.dy.shape())?;
    let xhat = saved.xhat.view()?;
    let rstd = TensorRef::contiguous(&saved.rstd, &[saved.rstd.len()])?;
    backward(device, Xhat::Codes(&xhat, &rstd), args.weight, args.dy, grads)
}

/// [`layer_norm_backward`] reading the codes of `x̂` and `rstd` from memory the caller owns
/// (what [`layer_norm_forward_to`] wrote).
///
/// # Errors
/// As [`layer_norm_backward`], plus [`Error::Misaligned`] (codes not
/// [`crate::quant::CODE_ALIGN`]-byte aligned) and [`Error::Aliasing`] (an output over the
/// codes, parameters or rstd).
pub fn layer_norm_backward_view<T: Element>(
    device: &Device,
    args: &LayerNormBackwardView<'_, T>,
    grads: LayerNormGrads<'_, '_, T>,
) -> Result<()> {
    backward(device, Xhat::Codes(args.xhat, args.rstd), args.weight, args.dy, grads)
}

/// LayerNorm backward reading a full-precision `x̂` and `rstd` (the formulas of
/// [`layer_norm_backward`]).
///
/// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
///
/// # Errors
/// As [`layer_norm_backward`].
pub fn layer_norm_backward_plain<T: Element>(
    device: &Device,
    args: &LayerNormBackwardPlain<'_, T>,
    grads: LayerNormGrads<'_, '_, T>,
) -> Result<()> {
    backward(device, Xhat::Plain(args.xhat, args.rstd), args.weight, args.dy, grads)
}

fn backward<T: Element>(
    device: &Device,
    xhat: Xhat<'_, T>,
    weight: Option<&TensorRef<'_, T>>,
    dy: &TensorRef<'_, T>,
    grads: LayerNormGrads<'_, '_, T>,
) -> Result<()> {
    let LayerNormGrads { dx, dweight, dbias } = grads;
    let (rows, cols) = ln_rows(dy.shape(), "dy")?;
    same_shape(dy.shape(), dx.shape(), "dx")?;
    check_affine(weight, cols, "weight")?;
    check_vector(dweight.layout(), cols, "dweight")?;
    check_vector(dbias.layout(), cols, "dbias")?;
    match &xhat {
        Xhat::Codes(saved, rstd) => {
            same_shape(saved.meta().shape(), dy.shape(), "gradient (vs the saved activation)")?;
            same_shape(&[rows], rstd.shape(), "saved rstd")?;
            check_vector(rstd.layout(), rows, "saved rstd")?;
        }
        Xhat::Plain(h, rstd) => {
            same_shape(dy.shape(), h.shape(), "saved x̂")?;
            check_vector(rstd.layout(), rows, "rstd")?;
        }
    }
    if cols == 0 {
        // no rows either (ln_rows): dweight and dbias are empty, nothing to write
        return Ok(());
    }
    let empty = rows == 0;
    // no rows: 0 partial ranges, the kernel writes dweight = dbias = 0
    let parts = if empty { 0 } else { partial_blocks(rows) };
    let scratch = parts
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(2))
        .ok_or_else(|| Error::too_large("LayerNorm backward scratch", format!("2·{parts}·{cols} f32 values")))?;
    let mut partials = device.alloc_for_kernel::<f32>(scratch)?;
    let desc =
        |l: &Layout, what: &str| if empty { Ok(empty_rows_desc(cols, T::DTYPE)) } else { row_desc(l, T::DTYPE, what) };
    let dy_desc = desc(dy.layout(), "dy")?;
    let dx_desc = desc(dx.layout(), "dx")?;
    let mut launch = Launch::new(device);
    let (source, xhat_p, xhat_desc, rstd_p) = match xhat {
        // no rows: nothing is read; the kernel only zeroes dweight and dbias
        _ if empty => (sys::MesaCodeSource::default(), std::ptr::null(), dy_desc, std::ptr::null()),
        Xhat::Codes(saved, rstd) => {
            let source = code_source(&mut launch, saved)?;
            (source, std::ptr::null(), sys::MesaTensorDesc::default(), launch.input(rstd, "saved rstd")?.cast())
        }
        Xhat::Plain(h, rstd) => {
            let h_desc = row_desc(h.layout(), T::DTYPE, "saved x̂")?;
            (sys::MesaCodeSource::default(), launch.input(h, "saved x̂")?, h_desc, launch.input(rstd, "rstd")?.cast())
        }
    };
    let args = sys::MesaLayerNormBackwardArgs {
        dy: launch.input(dy, "dy")?,
        dy_desc,
        xhat: xhat_p,
        xhat_desc,
        source,
        rstd: rstd_p,
        weight: affine(&mut launch, weight, "weight")?,
        dx: launch.output(dx, "dx")?,
        dx_desc,
        partials: launch.write_buffer(&mut partials, "partial sums")?,
        partial_blocks: parts as i64,
        dweight: launch.output(dweight, "dweight")?.cast(),
        dbias: launch.output(dbias, "dbias")?.cast(),
    };
    // SAFETY: dy, x̂ (plain or codes + params), rstd, weight (inputs) and dx, the scratch,
    // dweight, dbias (outputs) are registered, the outputs disjoint from everything else; the
    // views are described by their descs (an empty tensor as [0, C]), rstd holds `rows`
    // values, weight/dweight/dbias C, the scratch 2·parts·C; codes and params were sized for
    // this shape and grouping when saved.
    unsafe {
        launch.launch("layernorm_backward", &args, sys::mesa_layernorm_backward, sys::mesa_emu_layernorm_backward)?
    };
    launch.finish()
}
