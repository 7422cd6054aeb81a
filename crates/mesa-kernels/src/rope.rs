//! Rotary position embeddings (Su et al. 2021, RoFormer, §3.4.2, eq. 34), the position code of
//! Llama, Mistral, Qwen and GPT-NeoX: pairs of each query and key row rotated by angles that
//! grow with the row's position. Orthogonal, so the backward is the rotation by the opposite
//! angles ([`rope_backward`]) and nothing is kept for it.
use mesa_kernels_sys as sys;

use crate::device::Device;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::{kernel_view, Grouping};
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

fn rotate<T: Element>(
    device: &Device,
    config: &RopeConfig,
    x: &TensorRef<'_, T>,
    y: &mut TensorMut<'_, T>,
    inverse: bool,
) -> Result<()> {
    if x.shape() != y.shape() {
        return Err(Error::shape_mismatch("RoPE output", x.shape(), y.shape()));
    }
    let rank = x.shape().len();
    if rank < 2 {
        return Err(Error::invalid_layout("RoPE input", "a tensor [..., S, D] of rank >= 2"));
    }
    let (seq, dim) = (x.shape()[rank - 2], x.shape()[rank - 1]);
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
                config.position_offset + seq,
                config.position_offset
            ),
        ));
    }
    if x.numel() == 0 {
        return Ok(());
    }
    let to_i64 = |v: usize, what: &str| i64::try_from(v).map_err(|_| Error::too_large(what, "above i64::MAX"));
    let mut launch = Launch::new(device);
    let args = sys::MesaRopeArgs {
        x_desc: kernel_view(x.layout(), &Grouping::Tensor, T::DTYPE)?.desc,
        y_desc: kernel_view(y.layout(), &Grouping::Tensor, T::DTYPE)?.desc,
        x: launch.input(x, "input")?,
        y: launch.output(y, "output")?,
        seq_len: to_i64(seq, "RoPE sequence")?,
        head_dim: to_i64(dim, "RoPE head dim")?,
        rotary_dims: to_i64(rotary, "RoPE rotary dims")?,
        position_offset: to_i64(config.position_offset, "RoPE position offset")?,
        base: config.base,
        pairing: (match config.pairing {
            RopePairing::Halves => sys::MESA_ROPE_HALVES,
            RopePairing::Interleaved => sys::MESA_ROPE_INTERLEAVED,
        }) as sys::MesaRopePairing,
        inverse: i32::from(inverse),
        _pad: 0,
    };
    // SAFETY: x and y are registered, disjoint views described by their descs (the logical
    // element order of [..., S, D], which the kernel indexes); no other memory is touched.
    unsafe { launch.launch("rope", &args, sys::mesa_rope, sys::mesa_emu_rope)? };
    launch.finish()
}
