//! Gated (decayed) causal linear attention with grouped heads (issue 41): RetNet and Lightning
//! Attention (a fixed log-decay per head), Mamba-2's SSD and gated linear attention with a
//! scalar gate (a log-decay per step and head; flash-linear-attention's `chunk_simple_gla`).
//!
//! ```text
//! S_t = exp(a_t)·S_{t−1} + k_t v'_tᵀ,   o_t = q_tᵀ S_t  [ / g(q_tᵀ z_t) ],   a_t ≤ 0
//! ```
//!
//! with `v' = [v | 1]` and `z` the state's last column when normalised, `g(x) = x + ε·sign(x)`.
//! `a_t = −∞` resets the state (a document boundary): nothing crosses that step, and no NaN
//! appears. Query head `h` of `H` reads KV head `⌊h/(H/H_kv)⌋` (its `k`, `v`, decay and state),
//! without copies; the gradients of `k`, `v`, the decay and the initial state are summed over
//! each KV head's group of query heads (in a fixed order: deterministic).
//!
//! The kernels are [`crate::linear_attention`]'s chunked products with a decay
//! (`kernels/linear_attention.cu`, its comments "Decay" and "Gated linear attention": the
//! weights, the backward and `da` derivations and the accuracy of the log-space differences),
//! with f32 state and arithmetic: f32 inputs on CUDA cores, f16 and bf16 inputs with every chunk
//! product on tensor cores (bf16 split pairs, each product term within 3·2⁻¹⁸ of its
//! magnitude; docs/linear_attention.md). With `a = 0` the results are the ungated kernel's bit
//! for bit. The f64 oracle is [`crate::reference::gated_linear_attention`].
//!
//! Shapes: `q, out, dout, dq: [B, H, L, M | D]`, `k, dk: [B, H_kv, L, M]`, `v, dv:
//! [B, H_kv, L, D]` (rank-4 views, any strides, one dtype: f32, f16 or bf16); the decay and its
//! gradient f32, contiguous, `[B, H_kv, L]` ([`Decay::PerStep`]) or `[H_kv]`
//! ([`Decay::PerHead`]); states f32, contiguous, `[B, H_kv, M, W]` with `W = D + 1` when
//! normalised (the last column is `z`), else `D`.
//!
//! Packed variable-length sequences ([`forward_packed`], flash-linear-attention's
//! `cu_seqlens`): `B = 1`, sequence `n` is rows `o_n..o_{n+1}` of every head, each walked from
//! its own initial state (or zero), no state crossing sequences; every state
//! (initial, final and their gradients) is then `[N, H_kv, M, W]`. The result is bitwise that of
//! one call per sequence, except a per-head decay's gradient (one sum over all rows).
//!
//! Memory ([`forward_with`], [`ForwardOptions`]): [`MemoryMode::Slim`] by default (only the final
//! state; the backward walks the chunks again), or [`MemoryMode::BoundaryStates`] (the state
//! entering every chunk is kept, computed by a [`Schedule`]; the backward's `dq`, `dk` and `dv`
//! run parallel over chunks; the same results bit for bit).
//!
//! The decay's values are on the device and are not checked: they must be `≤ 0` or `−∞` (a
//! NaN gives NaN outputs; a positive value is used as given).
//!
//! ```
//! use mesa_kernels::gated_linear_attention::{forward, Decay, ForwardArgs, GatedConfig};
//! use mesa_kernels::{Device, TensorMut, TensorRef};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::emulator();
//! let (b, h, hkv, l, m, d) = (1, 2, 1, 5, 4, 3);
//! let q: Vec<f32> = (0..b * h * l * m).map(|i| (i as f32 * 0.3).sin()).collect();
//! let k: Vec<f32> = (0..b * hkv * l * m).map(|i| (i as f32 * 0.5).cos()).collect();
//! let v: Vec<f32> = (0..b * hkv * l * d).map(|i| (i as f32 * 0.7).cos()).collect();
//! let a = vec![-0.5f32; b * hkv * l];
//! let mut out = vec![0f32; b * h * l * d];
//! let (qt, kt) = (TensorRef::contiguous(&q, &[b, h, l, m])?, TensorRef::contiguous(&k, &[b, hkv, l, m])?);
//! let (vt, at) = (TensorRef::contiguous(&v, &[b, hkv, l, d])?, TensorRef::contiguous(&a, &[b, hkv, l])?);
//! let mut ot = TensorMut::contiguous(&mut out, &[b, h, l, d])?;
//! let args = ForwardArgs { q: &qt, k: &kt, v: &vt, decay: Decay::PerStep(&at), initial: None, out: &mut ot };
//! let saved = forward(&device, &GatedConfig::default(), args)?;
//! drop(ot);
//! // row 0 attends to itself only: out_0 = (q_0·k_0) v_0
//! let qk: f32 = (0..m).map(|i| q[i] * k[i]).sum();
//! assert!((out[0] - qk * v[0]).abs() < 1e-5);
//! assert_eq!(saved.final_state()?.len(), b * hkv * m * d);
//! # Ok(())
//! # }
//! ```
use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::linear_attention::packing::{self, Packing};
use crate::linear_attention::{la_tensor, rank4, to_i64};
pub use crate::linear_attention::{MemoryMode, Schedule};
use crate::tensor::{TensorMut, TensorRef};

/// Largest chunk the kernel supports (a chunk's `C×C` weights live in shared memory).
pub const MAX_CHUNK: usize = sys::MESA_GLA_MAX_CHUNK as usize;

/// Configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GatedConfig {
    /// Divide by the guarded denominator `g(q_tᵀ z_t)` (the state gains the column `z`).
    pub normalize: bool,
    /// The guard's ε (finite and > 0 when normalising).
    pub eps: f32,
    /// Rows per chunk, `1..=64`.
    pub chunk: usize,
}

impl Default for GatedConfig {
    /// Not normalised (as RetNet, Mamba-2 and GLA), chunks of 64, ε = 1e-6 (unused).
    fn default() -> Self {
        GatedConfig { normalize: false, eps: 1e-6, chunk: MAX_CHUNK }
    }
}

impl GatedConfig {
    fn check(&self) -> Result<()> {
        if self.chunk == 0 || self.chunk > MAX_CHUNK {
            return Err(Error::invalid_argument("chunk", format!("{} is outside 1..={MAX_CHUNK}", self.chunk)));
        }
        if self.normalize && !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::invalid_argument(
                "eps",
                format!("{} must be finite and > 0 when normalizing", self.eps),
            ));
        }
        Ok(())
    }
}

/// The log-decay `a ≤ 0` (`−∞`: a reset), f32, contiguous.
#[derive(Debug, Clone, Copy)]
pub enum Decay<'a, 'b> {
    /// Per step and KV head, `[B, H_kv, L]` (Mamba-2, GLA's scalar gate).
    PerStep(&'a TensorRef<'b, f32>),
    /// Per KV head, `[H_kv]` (RetNet, Lightning Attention).
    PerHead(&'a TensorRef<'b, f32>),
}

impl<'a, 'b> Decay<'a, 'b> {
    fn tensor(&self) -> &'a TensorRef<'b, f32> {
        match *self {
            Decay::PerStep(t) | Decay::PerHead(t) => t,
        }
    }
    fn kind(&self) -> DecayKind {
        match self {
            Decay::PerStep(_) => DecayKind::PerStep,
            Decay::PerHead(_) => DecayKind::PerHead,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecayKind {
    PerStep,
    PerHead,
}

impl DecayKind {
    fn shape(self, d: &GatedDims) -> Vec<usize> {
        match self {
            DecayKind::PerStep => vec![d.batch, d.kv_heads, d.len],
            DecayKind::PerHead => vec![d.kv_heads],
        }
    }
    fn to_sys(self) -> sys::MesaGlaDecayKind {
        (match self {
            DecayKind::PerStep => sys::MESA_GLA_DECAY_PER_STEP,
            DecayKind::PerHead => sys::MESA_GLA_DECAY_PER_HEAD,
        }) as sys::MesaGlaDecayKind
    }
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedDims {
    /// `B`
    pub batch: usize,
    /// `H`, query heads
    pub heads: usize,
    /// `H_kv`, KV heads (dividing `H`)
    pub kv_heads: usize,
    /// `L`
    pub len: usize,
    /// `M`, features of `q`, `k`
    pub feat: usize,
    /// `D`, columns of `v`, `out`
    pub dim: usize,
}

/// Options of [`forward_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardOptions<'a> {
    /// What the forward keeps for the backward. [`MemoryMode::Slim`] (the default of
    /// [`ForwardOptions`]; `MemoryMode::default()` is `BoundaryStates`, the ungated kernel's): only
    /// the final state, memory independent of `L`; the backward's `dq` walks the chunks again
    /// from the initial state. [`MemoryMode::BoundaryStates`]: also the state entering every
    /// chunk, `chunks·H_kv·M·W` f32 (`chunks = B·⌈L/C⌉`, packed `Σ_n ⌈len_n/C⌉`); the backward's
    /// `dq` then runs parallel over chunks from them, and so do `dk` and `dv` from their own
    /// chunk sums (unless [`Schedule::Walk`]); the results are bit for bit SLiM's.
    pub memory: MemoryMode,
    /// How the boundary states are computed (the ungated kernel's [`Schedule`]s, bit for bit
    /// the same results); ignored in [`MemoryMode::Slim`].
    pub schedule: Schedule,
    /// Packed sequences' offsets, as [`forward_packed`]'s; `None`: not packed.
    pub seq_offsets: Option<&'a [usize]>,
}

impl Default for ForwardOptions<'_> {
    /// SLiM memory, not packed: what [`forward`] does.
    fn default() -> Self {
        ForwardOptions { memory: MemoryMode::Slim, schedule: Schedule::default(), seq_offsets: None }
    }
}

/// The tensors of [`forward`].
#[derive(Debug)]
pub struct ForwardArgs<'a, 'b, T> {
    /// Queries `[B, H, L, M]`.
    pub q: &'a TensorRef<'b, T>,
    /// Keys `[B, H_kv, L, M]`.
    pub k: &'a TensorRef<'b, T>,
    /// Values `[B, H_kv, L, D]`.
    pub v: &'a TensorRef<'b, T>,
    /// The log-decay.
    pub decay: Decay<'a, 'b>,
    /// The state before row 0, `[B, H_kv, M, W]` (packed: `[N, H_kv, M, W]`) f32 contiguous;
    /// `None`: zero.
    pub initial: Option<&'a TensorRef<'b, f32>>,
    /// The output `[B, H, L, D]` (written).
    pub out: &'a mut TensorMut<'b, T>,
}

/// The gradients [`backward`] writes.
#[derive(Debug)]
pub struct GatedGrads<'a, 'b, T> {
    /// `[B, H, L, M]`
    pub dq: &'a mut TensorMut<'b, T>,
    /// `[B, H_kv, L, M]`, summed over each group.
    pub dk: &'a mut TensorMut<'b, T>,
    /// `[B, H_kv, L, D]`, summed over each group.
    pub dv: &'a mut TensorMut<'b, T>,
    /// The decay's gradient, f32 contiguous, shaped as the decay (`[H_kv]`: summed over `B`, `L`).
    pub d_decay: &'a mut TensorMut<'b, f32>,
    /// The initial state's gradient `[B | N, H_kv, M, W]` f32 contiguous; `None`: not wanted.
    pub d_initial: Option<&'a mut TensorMut<'b, f32>>,
}

/// The tensors of [`backward`]: the forward's inputs (the same `initial` too), its output, the
/// upstream gradients and the gradients to write.
#[derive(Debug)]
pub struct BackwardArgs<'a, 'b, T> {
    /// The forward's `q`.
    pub q: &'a TensorRef<'b, T>,
    /// The forward's `k`.
    pub k: &'a TensorRef<'b, T>,
    /// The forward's `v`.
    pub v: &'a TensorRef<'b, T>,
    /// The forward's decay (same kind).
    pub decay: Decay<'a, 'b>,
    /// The forward's initial state (given exactly when the forward had one).
    pub initial: Option<&'a TensorRef<'b, f32>>,
    /// The forward's output `[B, H, L, D]`: required when normalised, ignored otherwise. For
    /// f16/bf16 it is the rounded output, so the normaliser's gradient term `dout·out` carries
    /// its rounding (about `2⁻⁸` relative for bf16; the f32 output removes it: the candle op
    /// reruns the f32 forward for this).
    pub out: Option<&'a TensorRef<'b, T>>,
    /// The upstream gradient `[B, H, L, D]`.
    pub dout: &'a TensorRef<'b, T>,
    /// The final state's gradient `[B | N, H_kv, M, W]` f32 contiguous; `None`: zero.
    pub d_final: Option<&'a TensorRef<'b, f32>>,
    /// The gradients (written).
    pub grads: GatedGrads<'a, 'b, T>,
}

/// What the forward keeps: the final state `[B | N, H_kv, M, W]` f32, normalised the guarded
/// denominators `[B, H, L]` f32, and with [`MemoryMode::BoundaryStates`] the state entering
/// every chunk ([`ForwardOptions`]).
pub struct GatedSaved {
    final_state: Buffer<f32>,
    packing: Option<Packing>,
    boundary: Option<Buffer<f32>>,
    den: Option<Buffer<f32>>,
    dims: GatedDims,
    config: GatedConfig,
    dtype: DType,
    decay: DecayKind,
    has_initial: bool,
    schedule: Schedule,
}

impl std::fmt::Debug for GatedSaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatedSaved")
            .field("dims", &self.dims)
            .field("config", &self.config)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl GatedSaved {
    /// Sizes of the call that made it.
    #[must_use]
    pub fn dims(&self) -> GatedDims {
        self.dims
    }
    /// What the forward kept ([`ForwardOptions::memory`]).
    #[must_use]
    pub fn memory(&self) -> MemoryMode {
        if self.boundary.is_some() {
            MemoryMode::BoundaryStates
        } else {
            MemoryMode::Slim
        }
    }
    /// `N` when made by [`forward_packed`] (the states are then `[N, H_kv, M, W]`).
    #[must_use]
    pub fn sequences(&self) -> Option<usize> {
        self.packing.as_ref().map(|p| p.n)
    }
    /// The final state `[B, H_kv, M, W]` (packed: `[N, H_kv, M, W]`, row-major). Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn final_state(&self) -> Result<Vec<f32>> {
        let mut v = self.final_state.to_vec()?;
        v.truncate(self.state_len());
        Ok(v)
    }
    /// The final state as a `[B | N, H_kv, M, W]` f32 view (the next piece's initial state). No copy.
    ///
    /// # Errors
    /// None in practice (the buffer holds the state).
    pub fn final_state_tensor(&self) -> Result<TensorRef<'_, f32>> {
        TensorRef::contiguous(&self.final_state, &self.state_shape())
    }
    /// The guarded denominators `[B·H·L]` when normalised. Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn denominators(&self) -> Result<Option<Vec<f32>>> {
        self.den.as_ref().map(Buffer::to_vec).transpose()
    }
    fn width(&self) -> usize {
        self.dims.dim + usize::from(self.config.normalize)
    }
    /// Blocks per head: `B`, or `N` packed sequences.
    fn units(&self) -> usize {
        self.sequences().unwrap_or(self.dims.batch)
    }
    fn state_shape(&self) -> [usize; 4] {
        [self.units(), self.dims.kv_heads, self.dims.feat, self.width()]
    }
    fn state_len(&self) -> usize {
        self.state_shape().iter().product()
    }
}

fn product(f: &[usize], what: &str) -> Result<usize> {
    let n = f.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
    match n {
        Some(n) if n < i64::MAX as usize / 16 => Ok(n),
        _ => Err(Error::too_large(what, format!("the element count of {f:?} overflows"))),
    }
}

fn expect(got: &[usize], want: &[usize], what: &str) -> Result<()> {
    if got != want {
        return Err(Error::shape_mismatch(what, want, got));
    }
    Ok(())
}

/// A state tensor: `[B | N, H_kv, M, W]`, contiguous.
fn check_state(t: &TensorRef<'_, f32>, want: &[usize; 4], what: &str) -> Result<()> {
    expect(t.shape(), want, what)?;
    if !t.layout().is_contiguous() {
        return Err(Error::invalid_layout(what, "a state must be contiguous"));
    }
    Ok(())
}

fn check_decay(d: &Decay<'_, '_>, dims: &GatedDims) -> Result<()> {
    let t = d.tensor();
    expect(t.shape(), &d.kind().shape(dims), "decay")?;
    if !t.layout().is_contiguous() {
        return Err(Error::invalid_layout("decay", "the decay must be contiguous"));
    }
    Ok(())
}

/// Shapes of `q, k, v` → the dims (and every size check that does not need the other tensors).
fn dims_of<T>(q: &TensorRef<'_, T>, k: &TensorRef<'_, T>, v: &TensorRef<'_, T>) -> Result<GatedDims> {
    let [b, h, l, m] = rank4(q.shape(), "q")?;
    let [_, hkv, _, _] = rank4(k.shape(), "k")?;
    let [_, _, _, d] = rank4(v.shape(), "v")?;
    if hkv == 0 || h < hkv || h % hkv != 0 {
        return Err(Error::invalid_argument(
            "kv_heads",
            format!("k has {hkv} heads: a positive divisor of the {h} query heads is required"),
        ));
    }
    expect(k.shape(), &[b, hkv, l, m], "k")?;
    expect(v.shape(), &[b, hkv, l, d], "v")?;
    if m == 0 || d == 0 {
        return Err(Error::invalid_argument("feat and dim", format!("M = {m} and D = {d} must be at least 1")));
    }
    if b.saturating_mul(h) > i32::MAX as usize {
        return Err(Error::too_large("batch·heads", format!("{b}·{h}: at most 2^31 − 1 (32-bit row indices)")));
    }
    Ok(GatedDims { batch: b, heads: h, kv_heads: hkv, len: l, feat: m, dim: d })
}

fn shape_sys(
    d: &GatedDims,
    c: &GatedConfig,
    dtype: DType,
    decay: DecayKind,
    schedule: Schedule,
    packing: sys::MesaLaPacking,
) -> Result<sys::MesaGlaShape> {
    Ok(sys::MesaGlaShape {
        packing,
        batch: to_i64(d.batch, "batch")?,
        heads: to_i64(d.heads, "heads")?,
        kv_heads: to_i64(d.kv_heads, "kv_heads")?,
        len: to_i64(d.len, "sequence length")?,
        feat: to_i64(d.feat, "feature dimension")?,
        dim: to_i64(d.dim, "value dimension")?,
        // check(): 1..=64
        chunk: c.chunk as i32,
        dtype: dtype.to_sys(),
        normalize: i32::from(c.normalize),
        eps: c.eps,
        decay_kind: decay.to_sys(),
        schedule: schedule.to_sys(),
    })
}

/// Forward: writes `out`, returns the final state (and the denominators) for the backward.
///
/// Any `L ≥ 0` (`L = 0`: the final state is the initial one), `M, D ≥ 1`, `H_kv | H`.
/// Allocates (stream-ordered) the saved state. Runs the ungated kernel's chunked products with
/// the decay (SLiM memory: one walk per query head; `k`, `v` read once per query head of the
/// group). Bytes moved: `(2M + D)·L·sizeof(T)` read per query head and `D·L·sizeof(T)`
/// written, plus `4L` of decay read per chunk pass.
///
/// In-place: not supported (`out` overlapping an input → [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::InvalidArgument`] (chunk outside `1..=64`, ε not finite and > 0 when normalising,
/// `H_kv` not a divisor of `H`, `M` or `D` of 0), [`Error::InvalidLayout`] (a rank other than
/// 4; a decay or state not contiguous), [`Error::ShapeMismatch`] (naming the tensor),
/// [`Error::Aliasing`], [`Error::TooLarge`], [`Error::WrongBackend`], CUDA errors.
pub fn forward<T: Element>(device: &Device, config: &GatedConfig, args: ForwardArgs<'_, '_, T>) -> Result<GatedSaved> {
    forward_with(device, config, &ForwardOptions::default(), args)
}

/// Forward over `N` packed variable-length sequences (flash-linear-attention's `cu_seqlens`):
/// `B = 1`, sequence `n` is rows `seq_offsets[n]..seq_offsets[n + 1]` of every head (empty
/// sequences allowed), starting from its own initial state (`initial`: `[N, H_kv, M, W]`) or
/// zero; no state crosses sequences. The saved final states are `[N, H_kv, M, W]` (an empty
/// sequence's is its initial state); [`backward`] takes them as they are (its `initial`,
/// `d_final` and `d_initial` then `[N, H_kv, M, W]`; a per-head decay's gradient summed over all
/// sequences). Bitwise equal to one [`forward`] per sequence (the same chunks from each
/// sequence's first row).
///
/// # Errors
/// As [`forward`], and [`Error::InvalidArgument`] naming `"seq_offsets"` (`B ≠ 1`, fewer than 2
/// offsets, not starting at 0 or not ending at `L`, decreasing).
pub fn forward_packed<T: Element>(
    device: &Device,
    config: &GatedConfig,
    seq_offsets: &[usize],
    args: ForwardArgs<'_, '_, T>,
) -> Result<GatedSaved> {
    forward_with(device, config, &ForwardOptions { seq_offsets: Some(seq_offsets), ..ForwardOptions::default() }, args)
}

/// [`forward`] (or [`forward_packed`]) with [`ForwardOptions`]: the memory mode, schedule and
/// packed sequences. With [`MemoryMode::BoundaryStates`] it also allocates and writes the
/// boundary states (`chunks·H_kv·M·W` f32, kept in the returned [`GatedSaved`]; computed once
/// per KV head, then each query head's outputs parallel over chunks), and with
/// [`Schedule::ChunkSums`] a scratch of `chunks·H_kv` f32 (each chunk's whole decay).
///
/// # Errors
/// As [`forward`] and [`forward_packed`].
pub fn forward_with<T: Element>(
    device: &Device,
    config: &GatedConfig,
    options: &ForwardOptions<'_>,
    args: ForwardArgs<'_, '_, T>,
) -> Result<GatedSaved> {
    let seq_offsets = options.seq_offsets;
    config.check()?;
    let ForwardArgs { q, k, v, decay, initial, out } = args;
    let dims = dims_of(q, k, v)?;
    expect(out.shape(), &[dims.batch, dims.heads, dims.len, dims.dim], "out")?;
    check_decay(&decay, &dims)?;
    let packing = match seq_offsets {
        Some(o) => {
            let p = packing::pack(device, o, dims.batch, dims.len, config.chunk)?;
            if p.n.saturating_mul(dims.heads) > i32::MAX as usize {
                return Err(Error::too_large(
                    "sequences·heads",
                    format!("{}·{}: at most 2^31 − 1 (32-bit row indices)", p.n, dims.heads),
                ));
            }
            Some(p)
        }
        None => None,
    };
    let units = packing.as_ref().map_or(dims.batch, |p| p.n);
    let w = dims.dim + usize::from(config.normalize);
    let sshape = [units, dims.kv_heads, dims.feat, w];
    let chunks = packing.as_ref().map_or(dims.batch.saturating_mul(dims.len.div_ceil(config.chunk)), |p| p.nchunks);
    let boundary = match options.memory {
        MemoryMode::Slim => None,
        MemoryMode::BoundaryStates => {
            let n = product(&[chunks, dims.kv_heads, dims.feat, w], "boundary states")?;
            Some(device.alloc_for_kernel::<f32>(n.max(1))?)
        }
    };
    if let Some(s0) = initial {
        check_state(s0, &sshape, "initial_state")?;
    }
    let state = product(&sshape, "final state")?;
    let den = product(&[dims.batch, dims.heads, dims.len], "denominators")?;
    // MESA_GLA_FORWARD_WORK: the chunk sums' whole decays
    let chunk_sums = boundary.is_some() && options.schedule == Schedule::ChunkSums;
    let work = if chunk_sums { product(&[chunks, dims.kv_heads], "forward scratch")? } else { 0 };
    let mut saved = GatedSaved {
        final_state: device.alloc_for_kernel::<f32>(state.max(1))?,
        packing,
        boundary,
        den: if config.normalize { Some(device.alloc_for_kernel::<f32>(den.max(1))?) } else { None },
        dims,
        config: *config,
        dtype: T::DTYPE,
        decay: decay.kind(),
        has_initial: initial.is_some(),
        schedule: options.schedule,
    };
    if dims.batch == 0 {
        return Ok(saved);
    }
    let mut scratch = device.alloc_for_kernel::<f32>(work.max(1))?;
    let GatedSaved { final_state, den, packing, boundary, .. } = &mut saved;
    let mut launch = Launch::new(device);
    let packing = packing::to_sys(packing.as_ref(), &mut launch)?;
    let args = sys::MesaGlaForwardArgs {
        shape: shape_sys(&dims, config, T::DTYPE, decay.kind(), options.schedule, packing)?,
        q: la_tensor(q.layout(), launch.input(q, "q")?.cast_mut()),
        k: la_tensor(k.layout(), launch.input(k, "k")?.cast_mut()),
        v: la_tensor(v.layout(), launch.input(v, "v")?.cast_mut()),
        out: la_tensor(&out.layout().clone(), launch.output(out, "out")?),
        decay: launch.input(decay.tensor(), "decay")?.cast(),
        init_state: match initial {
            Some(s0) => launch.input(s0, "initial_state")?.cast(),
            None => std::ptr::null(),
        },
        final_state: launch.write_buffer(final_state, "final state")?,
        den: match den.as_mut() {
            Some(b) => launch.write_buffer(b, "denominators")?,
            None => std::ptr::null_mut(),
        },
        work: launch.write_buffer(&mut scratch, "forward scratch")?,
        boundary: match boundary.as_mut() {
            Some(b) => launch.write_buffer(b, "boundary states")?,
            None => std::ptr::null_mut(),
        },
    };
    // SAFETY: q, k, v, out are registered rank-4 views with the shapes checked above (q, out
    // [B, H, L, ·], k, v [B, H_kv, L, ·], H_kv | H), inside their buffers (TensorRef/TensorMut::new);
    // out overlaps no input (the builder's aliasing check); the decay is a registered contiguous
    // f32 view of the kind's shape; the initial state a registered contiguous [U, H_kv, M, W]
    // f32 view (U = B, or N packed: the offsets checked by packing::pack, on the device, with
    // B = 1); the final state, denominators and scratch buffers hold U·H_kv·M·W, B·H·L and
    // MESA_GLA_FORWARD_WORK f32 as the header requires, the boundary states (when given)
    // chunks·H_kv·M·W (chunks: B·⌈L/C⌉, or the packing's nchunks with its chunk offsets uploaded).
    unsafe {
        launch.launch(
            "gated_linear_attention_forward",
            &args,
            sys::mesa_gated_linear_attention_forward,
            sys::mesa_emu_gated_linear_attention_forward,
        )?;
    }
    launch.finish()?;
    drop(scratch);
    Ok(saved)
}

/// f32 elements of the backward's scratch (`MESA_GLA_BACKWARD_WORK` of the header: `units` = `N`
/// packed sequences or `B`, `chunks` the boundary states' chunks when `dk` and `dv` run as the
/// chunk decomposition, else 0).
fn backward_work(d: &GatedDims, units: usize, chunks: usize, w: usize) -> Result<usize> {
    let too_large = || Error::too_large("backward scratch", format!("the element count for {d:?} overflows"));
    let tiles = d.feat.div_ceil(32);
    let group_sums = if d.heads > d.kv_heads {
        product(&[d.batch, d.kv_heads, d.len, d.feat + d.dim], "backward scratch")?
    } else {
        0
    };
    let parts = [
        product(&[2, units, d.kv_heads, d.feat, w], "backward scratch")?,
        product(
            &[chunks, d.kv_heads, d.feat.checked_mul(w).and_then(|x| x.checked_add(1)).ok_or_else(too_large)?],
            "backward scratch",
        )?,
        product(&[tiles, d.batch, d.heads + d.kv_heads, d.len], "backward scratch")?,
        group_sums,
        product(&[d.batch, d.kv_heads, d.len], "backward scratch")?,
    ];
    parts
        .iter()
        .try_fold(0usize, |a, &x| a.checked_add(x))
        .filter(|&n| n < i64::MAX as usize / 16)
        .ok_or_else(too_large)
}

/// Gradients of [`forward`]: writes `dq`, `dk`, `dv` (the last two summed over each KV head's
/// query heads), the decay's gradient and, if asked, the initial state's.
///
/// `saved` is the forward's; `q, k, v, decay, initial` must be the forward's inputs; `out` (the
/// forward's output) is required when normalised. Allocates (stream-ordered) a scratch of
/// `2·U·H_kv·M·W + ⌈M/32⌉·B·(H + H_kv)·L + B·H_kv·L` f32 (`U` = `B`, or `N` packed; the row
/// dots `q·dq`, `k·dk` per 32-column tile, `dL/dΛ` per row), plus `B·H_kv·L·(M + D)` with
/// grouped heads (the group's `dk`, `dv` summed in f32) and, with boundary states and a
/// schedule other than [`Schedule::Walk`], `chunks·H_kv·(M·W + 1)` (`dk`, `dv` as the chunk
/// decomposition: parallel over chunks, as `dq` from the saved states).
///
/// In-place: not supported (a gradient overlapping an input or another gradient →
/// [`Error::Aliasing`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming the tensor whose shape differs from the forward's;
/// [`Error::InvalidArgument`] (`saved` of another dtype or decay kind, `out` missing when
/// normalised, `initial` given when the forward had none or missing when it had one);
/// [`Error::InvalidLayout`], [`Error::WrongBackend`], [`Error::Aliasing`], [`Error::TooLarge`],
/// CUDA errors.
pub fn backward<T: Element>(device: &Device, saved: &GatedSaved, args: BackwardArgs<'_, '_, T>) -> Result<()> {
    let (dims, config) = (saved.dims, saved.config);
    if saved.dtype != T::DTYPE {
        return Err(Error::invalid_argument(
            "saved",
            format!("made by a {} forward, backward in {}", saved.dtype.name(), T::DTYPE.name()),
        ));
    }
    match (device.kind(), &saved.final_state) {
        (Kind::Cuda(_), Buffer::Cuda(_)) | (Kind::Emulator, Buffer::Host(_)) => {}
        _ => return Err(Error::wrong_backend("saved state", "it belongs to another backend than the device")),
    }
    let BackwardArgs { q, k, v, decay, initial, out, dout, d_final, grads } = args;
    let GatedGrads { dq, dk, dv, d_decay, d_initial } = grads;
    if decay.kind() != saved.decay {
        return Err(Error::invalid_argument("decay", "not the kind (per step or per head) of the forward's"));
    }
    let (b, h, hkv, l, m, d) = (dims.batch, dims.heads, dims.kv_heads, dims.len, dims.feat, dims.dim);
    expect(q.shape(), &[b, h, l, m], "q")?;
    expect(k.shape(), &[b, hkv, l, m], "k")?;
    expect(v.shape(), &[b, hkv, l, d], "v")?;
    expect(dout.shape(), &[b, h, l, d], "dout")?;
    expect(dq.shape(), &[b, h, l, m], "dq")?;
    expect(dk.shape(), &[b, hkv, l, m], "dk")?;
    expect(dv.shape(), &[b, hkv, l, d], "dv")?;
    check_decay(&decay, &dims)?;
    expect(d_decay.shape(), &decay.kind().shape(&dims), "d_decay")?;
    if !d_decay.layout().is_contiguous() {
        return Err(Error::invalid_layout("d_decay", "the decay's gradient must be contiguous"));
    }
    let out = match (out, config.normalize) {
        (Some(o), true) => {
            expect(o.shape(), &[b, h, l, d], "out")?;
            Some(o)
        }
        (None, true) => {
            return Err(Error::invalid_argument("out", "normalised attention: the backward needs the forward output"))
        }
        (_, false) => None,
    };
    let sshape = saved.state_shape();
    match (initial, saved.has_initial) {
        (Some(s0), true) => check_state(s0, &sshape, "initial_state")?,
        (None, false) => {}
        (Some(_), false) => return Err(Error::invalid_argument("initial_state", "the forward had no initial state")),
        (None, true) => return Err(Error::invalid_argument("initial_state", "the forward's initial state is needed")),
    }
    if let Some(t) = d_final {
        check_state(t, &sshape, "d_final")?;
    }
    if let Some(t) = d_initial.as_ref() {
        expect(t.shape(), &sshape, "d_initial")?;
        if !t.layout().is_contiguous() {
            return Err(Error::invalid_layout("d_initial", "a state must be contiguous"));
        }
    }
    if b == 0 && decay.kind() == DecayKind::PerStep {
        return Ok(());
    }
    let decompose = saved.boundary.is_some() && saved.schedule != Schedule::Walk;
    let chunks = match (decompose, saved.packing.as_ref()) {
        (false, _) => 0,
        (true, Some(p)) => p.nchunks,
        (true, None) => dims.batch * dims.len.div_ceil(config.chunk),
    };
    let work = backward_work(&dims, saved.units(), chunks, saved.width())?;
    let mut work = device.alloc_for_kernel::<f32>(work.max(1))?;
    let mut launch = Launch::new(device);
    let null = sys::MesaLaTensor { data: std::ptr::null_mut(), strides: [0; 4] };
    let packing = packing::to_sys(saved.packing.as_ref(), &mut launch)?;
    let args = sys::MesaGlaBackwardArgs {
        shape: shape_sys(&dims, &config, T::DTYPE, decay.kind(), saved.schedule, packing)?,
        q: la_tensor(q.layout(), launch.input(q, "q")?.cast_mut()),
        k: la_tensor(k.layout(), launch.input(k, "k")?.cast_mut()),
        v: la_tensor(v.layout(), launch.input(v, "v")?.cast_mut()),
        out: match out {
            Some(o) => la_tensor(o.layout(), launch.input(o, "out")?.cast_mut()),
            None => null,
        },
        dout: la_tensor(dout.layout(), launch.input(dout, "dout")?.cast_mut()),
        dq: la_tensor(&dq.layout().clone(), launch.output(dq, "dq")?),
        dk: la_tensor(&dk.layout().clone(), launch.output(dk, "dk")?),
        dv: la_tensor(&dv.layout().clone(), launch.output(dv, "dv")?),
        decay: launch.input(decay.tensor(), "decay")?.cast(),
        init_state: match initial {
            Some(s0) => launch.input(s0, "initial_state")?.cast(),
            None => std::ptr::null(),
        },
        final_state: launch.read_buffer(&saved.final_state, "final state")?,
        den: match saved.den.as_ref() {
            Some(x) => launch.read_buffer(x, "denominators")?,
            None => std::ptr::null(),
        },
        d_final: match d_final {
            Some(t) => launch.input(t, "d_final")?.cast(),
            None => std::ptr::null(),
        },
        d_decay: launch.output(d_decay, "d_decay")?.cast(),
        d_init: match d_initial {
            Some(t) => launch.output(t, "d_initial")?.cast(),
            None => std::ptr::null_mut(),
        },
        work: launch.write_buffer(&mut work, "backward scratch")?,
        boundary: match saved.boundary.as_ref() {
            Some(b) => launch.read_buffer(b, "boundary states")?,
            None => std::ptr::null(),
        },
    };
    // SAFETY: every view is registered, rank 4 with the forward's dims (checked above) and
    // inside its buffer; no gradient overlaps an input or another gradient (the builder's
    // aliasing check); the decay and its gradient are contiguous f32 of the kind's shape; the
    // states are registered contiguous [U, H_kv, M, W] f32 views (U = B, or N with the
    // forward's checked offsets); the saved buffers were sized by the forward for these dims
    // (same dtype, decay kind and backend checked above), the boundary states too; the
    // scratch holds MESA_GLA_BACKWARD_WORK f32 (backward_work, with the saved schedule).
    unsafe {
        launch.launch(
            "gated_linear_attention_backward",
            &args,
            sys::mesa_gated_linear_attention_backward,
            sys::mesa_emu_gated_linear_attention_backward,
        )?;
    }
    launch.finish()?;
    drop(work);
    Ok(())
}
