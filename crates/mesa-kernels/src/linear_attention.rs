//! Chunked linear attention with exact gradients whose saved state can be independent of
//! the sequence length (SLiM: Likhosherstov et al., *Sub-Linear Memory: How to Make
//! Performers SLiM*, 2020, §3; Performer: Choromanski et al., *Rethinking Attention with
//! Performers*, 2020, §2.2 Eq. 5).
//!
//! Inputs are feature-mapped queries and keys `q, k: [B, H, L, M]` (see
//! [`crate::feature_map`]) and values `v: [B, H, L, D]`, any strides (e.g. views of one packed
//! `[B, L, H, ·]` tensor):
//!
//! ```text
//! causal:        out_t = Σ_{s≤t} (q_t·k_s) v_s  [ / g(q_t · Σ_{s≤t} k_s) ]     (Performer Eq. 5, SLiM Eq. 3)
//! bidirectional: out_t = Σ_s     (q_t·k_s) v_s  [ / g(q_t · Σ_s k_s) ]
//! guard:         g(x) = x + ε (x ≥ 0),  x − ε (x < 0)      (keeps |g| ≥ ε, g' = 1)
//! ```
//!
//! The kernels walk the sequence in chunks of `C ≤ 64` rows: inside a chunk a masked
//! `C×C` matmul, across chunks the prefix-sum state `S = Σ k_s [v_s | 1]ᵀ` (`M × W`, `W = D + 1` normalised, else `D`;
//! f32; the extra column is the normaliser `z = Σ k_s`). All accumulation is f32; outputs
//! and gradients have the inputs' dtype.
//!
//! Backward (exact): with `dnum_t = dout_t / g_t` and `dden_t = −(dout_t·out_t)/g_t`,
//!
//! ```text
//! dq_t = Σ_{s≤t} (dnum_t·v_s + dden_t) k_s      (needs the forward states S_t)
//! dk_s = Σ_{t≥s} (dnum_t·v_s + dden_t) q_t      (a reverse prefix sum, recomputed)
//! dv_s = Σ_{t≥s} (q_t·k_s) dnum_t
//! ```
//!
//! [`MemoryMode`] chooses how `dq` gets the forward states: the forward keeps every chunk
//! boundary's state ([`MemoryMode::BoundaryStates`], `B·H·(⌈L/C⌉+1)·M·W·4` bytes with the final one; `dq` is
//! parallel over chunks), or only the final one ([`MemoryMode::Slim`], `B·H·M·W·4`
//! bytes, independent of `L`; `dq` walks the chunks forward again from the initial state,
//! sequentially). SLiM §3 (Alg. 1) rebuilds the earlier states in reverse by subtraction,
//! `S_c = S_{c+1} − K_cᵀ V_c`; that loses the early states' digits to cancellation when later
//! keys and values are large (the future changes the past), so this crate does not: its `dq_t`
//! reads only rows `s ≤ t`, with the boundary mode's accuracy (docs/linear_attention.md has
//! the error against memory of both modes).
//!
//! [`forward_with_state`] / [`backward_with_state`] take an initial state and the final
//! state's gradient and return the initial state's gradient (module [`state`]): a sequence
//! processed in pieces gives the one-call results.
//!
//! Every op checks its tensors' shapes first, then registers them with the crate's launch
//! builder. In-place calls are not supported: an output that overlaps an input (or another
//! output) of the same call is rejected with [`Error::Aliasing`]. Inputs may share memory
//! (e.g. q, k, v as views of one packed tensor, or sub-slices `&buf[a..b]` of one host
//! buffer).
//!
//! ```
//! use mesa_kernels::linear_attention::{forward, ForwardArgs, LinearAttentionConfig};
//! use mesa_kernels::{Device, TensorMut, TensorRef};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::emulator();
//! let (b, h, l, m, d) = (1, 2, 5, 4, 3);
//! let q: Vec<f32> = (0..b * h * l * m).map(|i| 0.5 + (i as f32 * 0.3).sin().abs()).collect();
//! let k = q.clone();
//! let v: Vec<f32> = (0..b * h * l * d).map(|i| (i as f32 * 0.7).cos()).collect();
//! let mut out = vec![0f32; b * h * l * d];
//! let (qt, kt) = (TensorRef::contiguous(&q, &[b, h, l, m])?, TensorRef::contiguous(&k, &[b, h, l, m])?);
//! let vt = TensorRef::contiguous(&v, &[b, h, l, d])?;
//! let mut ot = TensorMut::contiguous(&mut out, &[b, h, l, d])?;
//! let config = LinearAttentionConfig::causal();
//! let saved = forward(&device, &config, ForwardArgs { q: &qt, k: &kt, v: &vt, out: &mut ot })?;
//! drop(ot);
//! // the first output of each head attends to itself only: out_0 = v_0
//! assert!((out[0] - v[0]).abs() < 1e-6);
//! assert!(saved.state_bytes() > 0);
//! # Ok(())
//! # }
//! ```
use std::ffi::c_void;

use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::Layout;
use crate::tensor::{TensorMut, TensorRef};

pub(crate) mod packing;
pub mod state;

pub use state::StateGrads;

/// Largest chunk the kernels support (rows of a chunk live in shared memory).
pub const MAX_CHUNK: usize = sys::MESA_LA_MAX_CHUNK as usize;

/// What the forward keeps for the backward (causal attention; bidirectional attention has
/// only the final state, the same in both modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryMode {
    /// The state entering every chunk, `B·H·⌈L/C⌉·M·W` f32 (`W = D + normalize`), and the
    /// final state `B·H·M·W`. The
    /// backward reads them, so its `dq` is parallel over chunks and as accurate as the
    /// forward. The default: see docs/linear_attention.md for the measured errors.
    #[default]
    BoundaryStates,
    /// Only the final state, `B·H·M·W` f32, independent of `L` (SLiM §3), plus a copy of
    /// the initial state when one is given. The backward's `dq` walks the chunks forward
    /// again from the initial state (sequential over chunks, as accurate as
    /// `BoundaryStates`); its scratch is `B·H·M·W` f32 as well.
    Slim,
}

/// How the states entering every chunk are computed in [`MemoryMode::BoundaryStates`]
/// (causal): the forward's, and the per-chunk states of the backward's `dk` and `dv`. All three
/// give the same results bit for bit; they differ in the shape of the work (docs/linear_attention.md,
/// "Schedules"; not timed on a GPU yet). Ignored in [`MemoryMode::Slim`] and bidirectional
/// attention, which walk the chunks anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// The chunk decomposition: every chunk's `Bᵀ C` in parallel over (b·h, chunk, 32-column
    /// tile), then a scan of them, one thread per state element (16 bytes of f32 state traffic
    /// per state element and chunk, with the outputs' reads).
    #[default]
    ChunkSums,
    /// One sequential walk per (b·h, 32-column tile) that writes the state entering each chunk
    /// (8 bytes per state element and chunk; `B·H·⌈D/32⌉` blocks, each through `⌈L/C⌉` chunks
    /// in order).
    StateWalk,
    /// The forward walks the chunks as in [`MemoryMode::Slim`], computing the outputs and
    /// writing each state as it goes (4 bytes per state element and chunk), and the backward's
    /// dk and dv walk back as in SLiM (no per-chunk states, no workspace for them); dq still
    /// reads the states, parallel over chunks.
    Walk,
}

/// Configuration of the attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearAttentionConfig {
    /// `s ≤ t` (causal) or all `s` (bidirectional).
    pub causal: bool,
    /// Divide by the guarded denominator `g(q_t · Σ k_s)`.
    pub normalize: bool,
    /// The guard's ε (> 0 and finite when normalizing): `g(x) = x + ε·sign(x)`, sign(0) = +1.
    pub eps: f32,
    /// Rows per chunk, `1..=64`.
    pub chunk: usize,
    /// What the forward keeps for the backward.
    pub memory: MemoryMode,
    /// How the boundary states are computed ([`MemoryMode::BoundaryStates`] only).
    pub schedule: Schedule,
}

impl LinearAttentionConfig {
    /// Causal, normalised, ε = 1e-6, chunks of 64, boundary states from chunk sums.
    #[must_use]
    pub fn causal() -> Self {
        LinearAttentionConfig {
            causal: true,
            normalize: true,
            eps: 1e-6,
            chunk: 64,
            memory: MemoryMode::default(),
            schedule: Schedule::default(),
        }
    }
    /// Bidirectional, normalised, ε = 1e-6, chunks of 64.
    #[must_use]
    pub fn bidirectional() -> Self {
        LinearAttentionConfig { causal: false, ..Self::causal() }
    }

    fn check(&self) -> Result<()> {
        if self.chunk == 0 || self.chunk > MAX_CHUNK {
            return Err(Error::invalid_argument("chunk", format!("{} is outside 1..={MAX_CHUNK}", self.chunk)));
        }
        // eps = 0 would leave 0/0 for a query orthogonal to the key sums (e.g. signed features)
        if self.normalize && !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::invalid_argument(
                "eps",
                format!("{} must be finite and > 0 when normalizing", self.eps),
            ));
        }
        Ok(())
    }

    /// True when the forward keeps per-chunk states.
    fn keeps_boundaries(&self) -> bool {
        self.causal && self.memory == MemoryMode::BoundaryStates
    }
}

/// The tensors of [`forward`]: `q, k: [B, H, L, M]`, `v, out: [B, H, L, D]`.
#[derive(Debug)]
pub struct ForwardArgs<'a, 'b, T> {
    /// Feature-mapped queries `[B, H, L, M]`.
    pub q: &'a TensorRef<'b, T>,
    /// Feature-mapped keys `[B, H, L, M]`.
    pub k: &'a TensorRef<'b, T>,
    /// Values `[B, H, L, D]`.
    pub v: &'a TensorRef<'b, T>,
    /// The output `[B, H, L, D]` (written).
    pub out: &'a mut TensorMut<'b, T>,
}

/// The gradients [`backward`] writes: `dq, dk: [B, H, L, M]`, `dv: [B, H, L, D]`.
#[derive(Debug)]
pub struct Grads<'a, 'b, T> {
    /// Gradient of the queries, `[B, H, L, M]`.
    pub dq: &'a mut TensorMut<'b, T>,
    /// Gradient of the keys, `[B, H, L, M]`.
    pub dk: &'a mut TensorMut<'b, T>,
    /// Gradient of the values, `[B, H, L, D]`.
    pub dv: &'a mut TensorMut<'b, T>,
}

/// The tensors of [`backward`]: the forward's inputs, its output, the upstream gradient and
/// the gradients to write.
#[derive(Debug)]
pub struct BackwardArgs<'a, 'b, T> {
    /// The forward's `q`, `[B, H, L, M]`.
    pub q: &'a TensorRef<'b, T>,
    /// The forward's `k`, `[B, H, L, M]`.
    pub k: &'a TensorRef<'b, T>,
    /// The forward's `v`, `[B, H, L, D]`.
    pub v: &'a TensorRef<'b, T>,
    /// The forward's output `[B, H, L, D]`: required when normalised, ignored otherwise.
    pub out: Option<&'a TensorRef<'b, T>>,
    /// The upstream gradient `[B, H, L, D]`.
    pub dout: &'a TensorRef<'b, T>,
    /// The gradients (written).
    pub grads: Grads<'a, 'b, T>,
}

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Batch `B`.
    pub batch: usize,
    /// Heads `H`.
    pub heads: usize,
    /// Sequence length `L`.
    pub len: usize,
    /// Feature dimension `M` of `q`, `k`.
    pub feat: usize,
    /// Value dimension `D` of `v`, `out`.
    pub dim: usize,
}

/// Element counts of what the forward saves (checked: they fit the kernels' arithmetic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SavedSizes {
    /// The final state `B·H·M·W`.
    state: usize,
    /// The boundary states `B·H·⌈L/C⌉·M·W` (causal, boundary mode), else 0.
    boundary: usize,
    /// The denominators `B·H·L` (normalised), else 0.
    den: usize,
}

impl SavedSizes {
    /// f32 elements of the backward's workspace (both counts < i64::MAX / 16: no overflow).
    fn workspace(&self, config: &LinearAttentionConfig) -> usize {
        // dk's and dv's per-chunk states, unless they walk (Schedule::Walk)
        let chunks = if config.schedule == Schedule::Walk { 0 } else { self.boundary };
        (self.state + chunks).max(1)
    }
    /// Elements of the copy of an initial state (SLiM mode keeps it for the backward).
    fn init_copy(&self, config: &LinearAttentionConfig, has_initial: bool) -> usize {
        if has_initial && config.causal && config.memory == MemoryMode::Slim {
            self.state
        } else {
            0
        }
    }
}

/// What the forward saved for the backward (on the forward's device).
pub struct LinearAttentionSaved {
    state: Buffer<f32>,
    boundary: Option<Buffer<f32>>,
    den: Option<Buffer<f32>>,
    /// SLiM mode with an initial state: a copy of it (the backward's dq walk starts there).
    init: Option<Buffer<f32>>,
    /// Packed sequences: their offsets on the device.
    packing: Option<packing::Packing>,
    sizes: SavedSizes,
    dims: Dims,
    config: LinearAttentionConfig,
    dtype: DType,
}

impl std::fmt::Debug for LinearAttentionSaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinearAttentionSaved")
            .field("dims", &self.dims)
            .field("config", &self.config)
            .field("dtype", &self.dtype)
            .field("state_bytes", &self.state_bytes())
            .field("denominator_bytes", &self.denominator_bytes())
            .finish()
    }
}

impl LinearAttentionSaved {
    /// Sizes of the call that made it.
    #[must_use]
    pub fn dims(&self) -> Dims {
        self.dims
    }
    /// Its configuration.
    #[must_use]
    pub fn config(&self) -> &LinearAttentionConfig {
        &self.config
    }
    /// Bytes of saved states: the final state `B·H·M·W·4`, plus the boundary states
    /// `B·H·⌈L/C⌉·M·W·4` in [`MemoryMode::BoundaryStates`] (causal), or in
    /// [`MemoryMode::Slim`] the copy of the initial state (`B·H·M·W·4`, when one was given).
    #[must_use]
    pub fn state_bytes(&self) -> usize {
        // each count was checked to be below i64::MAX / 16 (saved_sizes)
        let init = if self.init.is_some() { self.sizes.state } else { 0 };
        (self.sizes.state + self.sizes.boundary + init) * 4
    }
    /// Bytes of the saved denominators (`B·H·L·4`, normalised attention only): the same
    /// order as one output column, kept so that the backward needs no recomputation.
    #[must_use]
    pub fn denominator_bytes(&self) -> usize {
        self.sizes.den * 4
    }
    /// All bytes held: [`Self::state_bytes`] + [`Self::denominator_bytes`].
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.state_bytes() + self.denominator_bytes()
    }
    /// The final state `[B·H, M, W]` (`[N·H, M, W]` when packed; row-major; column `D` is
    /// `z = Σ k_s` when normalised). Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn final_state(&self) -> Result<Vec<f32>> {
        let mut v = self.state.to_vec()?;
        v.truncate(self.sizes.state);
        Ok(v)
    }
    /// The final state as a `[B, H, M, W]` f32 view on the forward's device, `[N, H, M, W]`
    /// for packed sequences (the initial state of the next piece of the sequence:
    /// [`forward_with_state`], [`forward_packed`]). No copy.
    ///
    /// # Errors
    /// None in practice (the buffer holds the state's elements); a layout error otherwise.
    pub fn final_state_tensor(&self) -> Result<TensorRef<'_, f32>> {
        TensorRef::contiguous(&self.state, &self.state_shape()?)
    }
    /// `N` when the forward ran on packed sequences ([`forward_packed`]), else `None`.
    #[must_use]
    pub fn sequences(&self) -> Option<usize> {
        self.packing.as_ref().map(|p| p.n)
    }
    /// The shape of a state of this call: `[B, H, M, W]`, or `[N, H, M, W]` when packed.
    fn state_shape(&self) -> Result<[usize; 4]> {
        let d = &self.dims;
        let w = state_width(d, &self.config)
            .ok_or_else(|| Error::too_large("state", format!("D + 1 overflows for {d:?}")))?;
        Ok(state::state_shape(self.sequences().unwrap_or(d.batch), d.heads, d.feat, w))
    }
    /// The guarded denominators `g(q_t · Σ k_s)`, `[B·H·L]`, if normalised. Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn denominators(&self) -> Result<Option<Vec<f32>>> {
        match &self.den {
            Some(d) => {
                let mut v = d.to_vec()?;
                v.truncate(self.sizes.den);
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }
}

/// The product of `factors`, or `None` on overflow; 0 when any factor is 0 (an empty axis
/// makes the product empty whatever the other sizes are).
fn product(factors: &[usize]) -> Option<usize> {
    if factors.contains(&0) {
        return Some(0);
    }
    factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f))
}

/// `W = D + normalize`, or `None` on overflow.
fn state_width(d: &Dims, c: &LinearAttentionConfig) -> Option<usize> {
    d.dim.checked_add(usize::from(c.normalize))
}

/// Bytes the forward keeps for a call of `dims` (states and denominators), without running it
/// (no initial state; one adds `B·H·M·W·4` bytes in [`MemoryMode::Slim`]). For an unpacked
/// call: packed sequences keep `[N, H, M, W]` states and `Σ_n ⌈len_n/C⌉` boundary states, as
/// [`LinearAttentionSaved::size_in_bytes`] of the call reports.
///
/// # Errors
/// [`Error::TooLarge`] when a count overflows (or passes the kernels' 64-bit indexing).
pub fn saved_bytes(dims: &Dims, config: &LinearAttentionConfig) -> Result<usize> {
    let s = saved_sizes(dims, config)?;
    Ok((s.state + s.boundary + s.den) * 4)
}

/// Bytes of the scratch [`backward`] allocates for a call of `dims`: one state, `B·H·M·W·4`,
/// independent of `L`; in [`MemoryMode::BoundaryStates`] (causal) also the per-chunk states of
/// the decomposed dk/dv, `B·H·⌈L/C⌉·M·W·4` (as many as the saved boundary states; none with
/// [`Schedule::Walk`]). For an unpacked call (packed sequences: `N` states and `Σ_n ⌈len_n/C⌉` per-chunk ones).
///
/// # Errors
/// [`Error::TooLarge`] when a count overflows.
pub fn backward_workspace_bytes(dims: &Dims, config: &LinearAttentionConfig) -> Result<usize> {
    Ok(saved_sizes(dims, config)?.workspace(config) * 4)
}

/// Element counts for `d` (and, for packed sequences, `(N, Σ_n ⌈len_n/C⌉)`).
fn saved_sizes(d: &Dims, c: &LinearAttentionConfig) -> Result<SavedSizes> {
    saved_sizes_packed(d, c, None)
}

fn saved_sizes_packed(d: &Dims, c: &LinearAttentionConfig, seqs: Option<(usize, usize)>) -> Result<SavedSizes> {
    let too_large = || Error::too_large("saved state", format!("the element counts of {d:?} overflow"));
    // the kernels hold a row's batch and head index in 32 bits (a call with an empty axis
    // has no work and is not limited)
    let has_work = d.batch > 0 && d.heads > 0 && d.len.max(d.feat).max(d.dim) > 0;
    if has_work && d.batch.max(d.heads) > i32::MAX as usize {
        return Err(Error::too_large(
            "batch and heads",
            format!("{d:?}: the kernels index batch and head in 32 bits (at most {} each)", i32::MAX),
        ));
    }
    let nst = seqs.map_or(d.batch, |s| s.0);
    let nhm = product(&[nst, d.heads, d.feat]).ok_or_else(too_large)?;
    // W is only computed for a non-empty state (D may be any size when M = 0)
    let state =
        if nhm == 0 { 0 } else { product(&[nhm, state_width(d, c).ok_or_else(too_large)?]).ok_or_else(too_large)? };
    // H·M·W, exact (nst > 0 when state > 0)
    let hmw = if state == 0 { 0 } else { state / nst };
    let boundary = match (c.keeps_boundaries(), seqs) {
        (false, _) => 0,
        (true, None) => product(&[state, d.len.div_ceil(c.chunk.max(1))]).ok_or_else(too_large)?,
        (true, Some((_, nchunks))) => product(&[hmw, nchunks]).ok_or_else(too_large)?,
    };
    let den = if c.normalize { product(&[d.batch, d.heads, d.len]).ok_or_else(too_large)? } else { 0 };
    // the three buffers are summed (saved_bytes, the workspace) and indexed in bytes
    if state.max(boundary).max(den) >= i64::MAX as usize / 16 {
        return Err(too_large());
    }
    Ok(SavedSizes { state, boundary, den })
}

/// The shape of a rank-4 view (any other rank: [`Error::InvalidLayout`]).
pub(crate) fn rank4(shape: &[usize], what: &str) -> Result<[usize; 4]> {
    match *shape {
        [b, h, l, f] => Ok([b, h, l, f]),
        _ => Err(Error::invalid_layout(what, format!("expected a rank-4 [B, H, L, F] view, got shape {shape:?}"))),
    }
}

/// `got` must be `want` ([`Error::ShapeMismatch`] naming `what` otherwise).
pub(crate) fn expect_shape(got: &[usize], want: [usize; 4], what: &str) -> Result<()> {
    if got != want {
        return Err(Error::shape_mismatch(what, &want, got));
    }
    Ok(())
}

/// `x` as the kernels' signed 64-bit size.
pub(crate) fn to_i64(x: usize, what: &str) -> Result<i64> {
    i64::try_from(x).map_err(|_| Error::too_large(what, format!("{x} does not fit the kernels' 64-bit indexing")))
}

/// The kernels' view of a layout (strides of size-1 dimensions, and all strides of an empty
/// view, zeroed: never multiplied by a nonzero index). The view was checked by
/// `TensorRef`/`TensorMut::new`, so every other stride times its extent stays below 2^63.
pub(crate) fn la_tensor(layout: &Layout, data: *mut c_void) -> sys::MesaLaTensor {
    let mut strides = [0i64; 4];
    if layout.numel() > 0 {
        for (k, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate().take(4) {
            strides[k] = if n > 1 { s as i64 } else { 0 };
        }
    }
    sys::MesaLaTensor { data, strides }
}

fn la_shape<'a>(
    d: &Dims,
    c: &LinearAttentionConfig,
    dtype: DType,
    packing: Option<&'a packing::Packing>,
    launch: &mut Launch<'a>,
) -> Result<sys::MesaLaShape> {
    let packing = packing::to_sys(packing, launch)?;
    Ok(sys::MesaLaShape {
        packing,
        batch: to_i64(d.batch, "batch")?,
        heads: to_i64(d.heads, "heads")?,
        len: to_i64(d.len, "sequence length")?,
        feat: to_i64(d.feat, "feature dimension")?,
        dim: to_i64(d.dim, "value dimension")?,
        // check(): 1..=64
        chunk: c.chunk as i32,
        dtype: dtype.to_sys(),
        causal: i32::from(c.causal),
        normalize: i32::from(c.normalize),
        eps: c.eps,
        memory: (match c.memory {
            MemoryMode::BoundaryStates => sys::MESA_LA_BOUNDARY_STATES,
            MemoryMode::Slim => sys::MESA_LA_SLIM,
        }) as sys::MesaLaMemory,
        schedule: c.schedule.to_sys(),
    })
}

impl Schedule {
    pub(crate) fn to_sys(self) -> sys::MesaLaSchedule {
        (match self {
            Schedule::ChunkSums => sys::MESA_LA_SCHEDULE_CHUNK_SUMS,
            Schedule::StateWalk => sys::MESA_LA_SCHEDULE_STATE_WALK,
            Schedule::Walk => sys::MESA_LA_SCHEDULE_WALK,
        }) as sys::MesaLaSchedule
    }
}

/// Forward: writes `out` and returns what the backward needs.
///
/// Shapes: `q, k: [B, H, L, M]`, `v, out: [B, H, L, D]` (rank-4 views, any strides).
/// dtypes: f32, f16, bf16 (one for all; state and accumulation f32). Any `L` (including 0
/// and `L < C`), `M`, `D`, `B·H`; a call with nothing to write launches nothing.
///
/// In-place: not supported (an `out` overlapping `q`, `k` or `v` → [`Error::Aliasing`]);
/// the inputs may share memory.
///
/// Allocates (stream-ordered) the saved state: see [`LinearAttentionSaved::size_in_bytes`].
/// Bytes moved (floor): `(2M + D)·L·sizeof(T)` read + `D·L·sizeof(T)` written per `(b, h)`,
/// plus the boundary states written in [`MemoryMode::BoundaryStates`].
///
/// # Errors
/// [`Error::InvalidArgument`] (chunk outside `1..=64`, ε not finite and > 0 when
/// normalizing), [`Error::InvalidLayout`] (`q` or `v` of rank ≠ 4), [`Error::ShapeMismatch`]
/// (`k` or `out` disagreeing with `q` or `v`, any rank), [`Error::Aliasing`], [`Error::TooLarge`] (saved state),
/// [`Error::WrongBackend`], [`Error::Misaligned`], CUDA errors.
pub fn forward<T: Element>(
    device: &Device,
    config: &LinearAttentionConfig,
    args: ForwardArgs<'_, '_, T>,
) -> Result<LinearAttentionSaved> {
    forward_with_state(device, config, args, None)
}

/// [`forward`] starting from an initial state (causal; module [`state`]): `initial` is an f32
/// `[B, H, M, W]` contiguous tensor (`W = D + normalize`, column `D` the normaliser's `z`),
/// e.g. the previous piece's [`LinearAttentionSaved::final_state_tensor`]; `None` is the zero
/// state. The saved final state includes it. In [`MemoryMode::Slim`] the forward keeps a
/// copy of it (`B·H·M·W·4` bytes) for the backward.
///
/// # Errors
/// As [`forward`], and [`Error::InvalidArgument`] (an initial state for bidirectional
/// attention), [`Error::ShapeMismatch`] / [`Error::InvalidLayout`] naming
/// `"initial_state"` (not `[B, H, M, W]`, not contiguous), [`Error::Aliasing`] (it overlaps
/// `out`).
pub fn forward_with_state<T: Element>(
    device: &Device,
    config: &LinearAttentionConfig,
    args: ForwardArgs<'_, '_, T>,
    initial: Option<&TensorRef<'_, f32>>,
) -> Result<LinearAttentionSaved> {
    forward_impl(device, config, args, initial, None)
}

/// [`forward_with_state`] on `N` variable-length sequences packed into one batch
/// (flash-linear-attention's `cu_seqlens`): `B = 1`, and `seq_offsets`
/// (`N + 1` entries, `0 = o_0 ≤ o_1 ≤ … ≤ o_N = L`, on the host) makes rows `o_n..o_{n+1}`
/// of every head sequence `n`. No state crosses from one sequence to the next: the outputs,
/// and the gradients of [`backward`] / [`backward_with_state`] on the returned value, equal
/// one call per sequence. States (initial, final and their gradients) are `[N, H, M, W]`.
///
/// # Errors
/// As [`forward_with_state`], and [`Error::InvalidArgument`] naming `"seq_offsets"` (`B ≠
/// 1`, fewer than 2 offsets, not starting at 0 or not ending at `L`, decreasing).
pub fn forward_packed<T: Element>(
    device: &Device,
    config: &LinearAttentionConfig,
    args: ForwardArgs<'_, '_, T>,
    seq_offsets: &[usize],
    initial: Option<&TensorRef<'_, f32>>,
) -> Result<LinearAttentionSaved> {
    forward_impl(device, config, args, initial, Some(seq_offsets))
}

fn forward_impl<T: Element>(
    device: &Device,
    config: &LinearAttentionConfig,
    args: ForwardArgs<'_, '_, T>,
    initial: Option<&TensorRef<'_, f32>>,
    seq_offsets: Option<&[usize]>,
) -> Result<LinearAttentionSaved> {
    config.check()?;
    let ForwardArgs { q, k, v, out } = args;
    let qs = rank4(q.shape(), "q")?;
    expect_shape(k.shape(), qs, "k")?;
    let vs = rank4(v.shape(), "v")?;
    expect_shape(v.shape(), [qs[0], qs[1], qs[2], vs[3]], "v")?;
    expect_shape(out.shape(), vs, "out")?;
    let dims = Dims { batch: qs[0], heads: qs[1], len: qs[2], feat: qs[3], dim: vs[3] };
    let packing = match seq_offsets {
        Some(o) => Some(packing::pack(device, o, dims.batch, dims.len, config.chunk)?),
        None => None,
    };
    let sizes = saved_sizes_packed(&dims, config, packing.as_ref().map(|p| (p.n, p.nchunks)))?;
    if let Some(s0) = initial {
        state::require_causal(config.causal, "initial_state")?;
        let w = state_width(&dims, config).ok_or_else(|| Error::too_large("initial_state", "D + 1 overflows"))?;
        let nst = packing.as_ref().map_or(dims.batch, |p| p.n);
        let want = state::state_shape(nst, dims.heads, dims.feat, w);
        state::check_state(s0.shape(), s0.layout().is_contiguous(), want, "initial_state")?;
    }
    let init_copy = sizes.init_copy(config, initial.is_some());
    let mut saved = LinearAttentionSaved {
        state: device.alloc_for_kernel::<f32>(sizes.state.max(1))?,
        boundary: if config.keeps_boundaries() {
            Some(device.alloc_for_kernel::<f32>(sizes.boundary.max(1))?)
        } else {
            None
        },
        den: if config.normalize { Some(device.alloc_for_kernel::<f32>(sizes.den.max(1))?) } else { None },
        init: if init_copy > 0 { Some(device.alloc_for_kernel::<f32>(init_copy)?) } else { None },
        packing,
        sizes,
        dims,
        config: *config,
        dtype: T::DTYPE,
    };
    if out.numel() == 0 && sizes.state == 0 && sizes.boundary == 0 && sizes.den == 0 {
        return Ok(saved);
    }
    let LinearAttentionSaved { state, boundary, den, init, packing, .. } = &mut saved;
    let mut launch = Launch::new(device);
    let shape = la_shape(&dims, config, T::DTYPE, packing.as_ref(), &mut launch)?;
    let args = sys::MesaLaForwardArgs {
        shape,
        q: la_tensor(q.layout(), launch.input(q, "q")?.cast_mut()),
        k: la_tensor(k.layout(), launch.input(k, "k")?.cast_mut()),
        v: la_tensor(v.layout(), launch.input(v, "v")?.cast_mut()),
        out: la_tensor(&out.layout().clone(), launch.output(out, "out")?),
        state: launch.write_buffer(state, "saved state")?,
        boundary: match boundary.as_mut() {
            Some(b) => launch.write_buffer(b, "boundary states")?,
            None => std::ptr::null_mut(),
        },
        den: match den.as_mut() {
            Some(b) => launch.write_buffer(b, "denominators")?,
            None => std::ptr::null_mut(),
        },
        init_state: match initial {
            Some(s0) => launch.input(s0, "initial_state")?.cast(),
            None => std::ptr::null(),
        },
        init_copy: match init.as_mut() {
            Some(b) => launch.write_buffer(b, "initial state copy")?,
            None => std::ptr::null_mut(),
        },
    };
    // SAFETY: q, k, v, out are registered rank-4 views (each inside its buffer, checked by
    // TensorRef/TensorMut::new) with the shapes checked equal above and described by their
    // strides; out overlaps no input (the builder's aliasing check); the state, boundary,
    // denominator and initial-state-copy buffers are registered and hold the counts the
    // header documents for these dims (saved_sizes, init_copy); the initial state is a
    // registered contiguous [B, H, M, W] f32 view (checked above).
    unsafe {
        launch.launch(
            "linear_attention_forward",
            &args,
            sys::mesa_linear_attention_forward,
            sys::mesa_emu_linear_attention_forward,
        )?;
    }
    launch.finish()?;
    Ok(saved)
}

/// Gradients of [`forward`]: writes `dq`, `dk`, `dv` (exact up to floating point).
///
/// `out` (the forward's output) is required when normalised (`dden = −(dout·out)/g`), and
/// ignored otherwise. `q, k, v` must be the forward's inputs. `dq, dk: [B, H, L, M]`,
/// `dv, dout: [B, H, L, D]`, one dtype. `saved` is not modified (the backward's state walks
/// use their own workspace).
///
/// In-place: not supported (a gradient overlapping an input or another gradient →
/// [`Error::Aliasing`]).
///
/// Allocates a workspace of [`backward_workspace_bytes`] (stream-ordered, freed when the
/// call's work is done): independent of `L` in [`MemoryMode::Slim`].
///
/// # Errors
/// [`Error::ShapeMismatch`] naming the tensor whose shape differs from the forward's dims
/// (`q`, `k`, `v`, `out`, `dout`, `dq`, `dk`, `dv`); [`Error::InvalidArgument`] when `saved`
/// was made in another dtype, or `out` is missing (normalised); [`Error::WrongBackend`] when
/// `saved` is another backend's; [`Error::Aliasing`], [`Error::TooLarge`],
/// [`Error::Misaligned`], CUDA errors.
pub fn backward<T: Element>(
    device: &Device,
    saved: &LinearAttentionSaved,
    args: BackwardArgs<'_, '_, T>,
) -> Result<()> {
    backward_with_state(device, saved, args, StateGrads::default())
}

/// [`backward`] with the state gradients of a call that is one piece of a longer sequence
/// (causal; module [`state`]): `d_final` is the gradient of the saved final state (from the
/// next piece's `d_initial`, or `None` for zero), `d_initial` receives the gradient of the
/// initial state. Both `[B, H, M, W]` f32, contiguous. Pieces are run in reverse order.
///
/// # Errors
/// As [`backward`], and [`Error::InvalidArgument`] (state gradients of bidirectional
/// attention), [`Error::ShapeMismatch`] / [`Error::InvalidLayout`] naming `"d_final"` or
/// `"d_initial"`, [`Error::Aliasing`] (`d_initial` overlapping an input or a gradient).
pub fn backward_with_state<T: Element>(
    device: &Device,
    saved: &LinearAttentionSaved,
    args: BackwardArgs<'_, '_, T>,
    states: StateGrads<'_, '_>,
) -> Result<()> {
    let config = saved.config;
    let dims = saved.dims;
    if saved.dtype != T::DTYPE {
        return Err(Error::invalid_argument(
            "saved",
            format!("made by a {} forward, backward in {}", saved.dtype.name(), T::DTYPE.name()),
        ));
    }
    match (device.kind(), &saved.state) {
        (Kind::Cuda(_), Buffer::Cuda(_)) | (Kind::Emulator, Buffer::Host(_)) => {}
        _ => return Err(Error::wrong_backend("saved state", "it belongs to another backend than the device")),
    }
    let BackwardArgs { q, k, v, out, dout, grads: Grads { dq, dk, dv } } = args;
    let qshape = [dims.batch, dims.heads, dims.len, dims.feat];
    let vshape = [dims.batch, dims.heads, dims.len, dims.dim];
    expect_shape(q.shape(), qshape, "q")?;
    expect_shape(k.shape(), qshape, "k")?;
    expect_shape(v.shape(), vshape, "v")?;
    expect_shape(dout.shape(), vshape, "dout")?;
    let out = match (out, config.normalize) {
        (Some(o), true) => {
            expect_shape(o.shape(), vshape, "out")?;
            Some(o)
        }
        (None, true) => {
            return Err(Error::invalid_argument(
                "out",
                "normalised attention: the backward needs the forward output `out`",
            ))
        }
        (_, false) => None,
    };
    expect_shape(dq.shape(), qshape, "dq")?;
    expect_shape(dk.shape(), qshape, "dk")?;
    expect_shape(dv.shape(), vshape, "dv")?;
    let StateGrads { d_final, d_initial } = states;
    // W is only computed when a state tensor is given (D may be any size when M = 0)
    let sshape = || saved.state_shape();
    if let Some(t) = d_final {
        state::require_causal(config.causal, "d_final")?;
        state::check_state(t.shape(), t.layout().is_contiguous(), sshape()?, "d_final")?;
    }
    if let Some(t) = d_initial.as_ref() {
        state::require_causal(config.causal, "d_initial")?;
        state::check_state(t.shape(), t.layout().is_contiguous(), sshape()?, "d_initial")?;
    }
    let wants_state = d_initial.as_ref().is_some_and(|t| t.numel() > 0);
    if dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0 && !wants_state {
        return Ok(());
    }
    let sizes = saved.sizes;
    let mut work = device.alloc_for_kernel::<f32>(sizes.workspace(&config))?;
    let mut launch = Launch::new(device);
    let shape = la_shape(&dims, &config, T::DTYPE, saved.packing.as_ref(), &mut launch)?;
    let null = sys::MesaLaTensor { data: std::ptr::null_mut(), strides: [0; 4] };
    let args = sys::MesaLaBackwardArgs {
        shape,
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
        state: launch.read_buffer(&saved.state, "saved state")?,
        boundary: match saved.boundary.as_ref() {
            Some(b) => launch.read_buffer(b, "boundary states")?,
            None => std::ptr::null(),
        },
        den: match saved.den.as_ref() {
            Some(b) => launch.read_buffer(b, "denominators")?,
            None => std::ptr::null(),
        },
        init_state: match saved.init.as_ref() {
            Some(b) => launch.read_buffer(b, "initial state copy")?,
            None => std::ptr::null(),
        },
        d_final: match d_final {
            Some(t) => launch.input(t, "d_final")?.cast(),
            None => std::ptr::null(),
        },
        d_init: match d_initial {
            Some(t) => launch.output(t, "d_initial")?.cast(),
            None => std::ptr::null_mut(),
        },
        work: launch.write_buffer(&mut work, "workspace")?,
    };
    // SAFETY: every view is registered, rank 4 with the forward's dims (checked above) and
    // inside its buffer (TensorRef/TensorMut::new); no gradient overlaps an input or another
    // gradient (the builder's aliasing check); the saved buffers were sized by the forward
    // for these dims and config (same dtype and backend checked above); d_final and
    // d_initial are registered contiguous [B, H, M, W] f32 views (checked above); the
    // workspace holds B·H·M·W f32 plus the boundary count (SavedSizes::workspace) as the
    // header requires.
    unsafe {
        launch.launch(
            "linear_attention_backward",
            &args,
            sys::mesa_linear_attention_backward,
            sys::mesa_emu_linear_attention_backward,
        )?;
    }
    launch.finish()?;
    // the workspace is freed stream-ordered (cudarc) after the kernels that use it
    drop(work);
    Ok(())
}
