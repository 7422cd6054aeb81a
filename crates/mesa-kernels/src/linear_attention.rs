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
//! `C×C` matmul, across chunks the prefix-sum state `S = Σ k_s [v_s | 1]ᵀ` (`M × (D+1)`,
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
//! boundary's state ([`MemoryMode::BoundaryStates`], `B·H·⌈L/C⌉·M·(D+1)·4` bytes), or only
//! the final one ([`MemoryMode::Slim`], `B·H·M·(D+1)·4` bytes, independent of `L`) and the
//! backward rebuilds earlier states in reverse by subtraction, `S_{c} = S_{c+1} − K_cᵀ V_c`
//! (SLiM §3, Alg. 1). The subtraction loses accuracy as `L` grows (cancellation: the state
//! grows like `L` while the chunk terms stay O(1)); docs/linear_attention.md has the measured
//! errors, and [`MemoryMode::default`] is therefore `BoundaryStates`.
//!
//! ```
//! use mesa_kernels::{Device, Layout};
//! use mesa_kernels::linear_attention::{forward, LinearAttentionConfig, TensorMut, TensorRef};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::emulator();
//! let (b, h, l, m, d) = (1, 2, 5, 4, 3);
//! let q: Vec<f32> = (0..b * h * l * m).map(|i| 0.5 + (i as f32 * 0.3).sin().abs()).collect();
//! let k = q.clone();
//! let v: Vec<f32> = (0..b * h * l * d).map(|i| (i as f32 * 0.7).cos()).collect();
//! let mut out = vec![0f32; b * h * l * d];
//! let (lq, lv) = (Layout::contiguous(&[b, h, l, m]), Layout::contiguous(&[b, h, l, d]));
//! let config = LinearAttentionConfig::causal();
//! let saved = forward(&device, &config, TensorRef::new(&q, &lq), TensorRef::new(&k, &lq),
//!                     TensorRef::new(&v, &lv), TensorMut::new(&mut out, &lv))?;
//! // the first output of each head attends to itself only: out_0 = v_0
//! assert!((out[0] - v[0]).abs() < 1e-6);
//! assert!(saved.state_bytes() > 0);
//! # Ok(())
//! # }
//! ```
use std::ffi::c_void;

use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, DeviceMemory, DeviceMemoryMut, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;

/// Largest chunk the kernels support (rows of a chunk live in shared memory).
pub const MAX_CHUNK: usize = sys::MESA_LA_MAX_CHUNK as usize;

/// What the forward keeps for the backward (causal attention; bidirectional attention has
/// only the final state, the same in both modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryMode {
    /// The state entering every chunk: `B·H·⌈L/C⌉·M·W` f32 (`W = D + normalize`). The
    /// backward reads them, so its `dq` is parallel over chunks and as accurate as the
    /// forward. The default: see docs/linear_attention.md for the measured errors.
    #[default]
    BoundaryStates,
    /// Only the final state, `B·H·M·W` f32, independent of `L` (SLiM §3). The backward
    /// rebuilds the earlier states in reverse by subtraction; their error grows with `L`.
    Slim,
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
}

impl LinearAttentionConfig {
    /// Causal, normalised, ε = 1e-6, chunks of 64, boundary states.
    #[must_use]
    pub fn causal() -> Self {
        LinearAttentionConfig { causal: true, normalize: true, eps: 1e-6, chunk: 64, memory: MemoryMode::default() }
    }
    /// Bidirectional, normalised, ε = 1e-6, chunks of 64.
    #[must_use]
    pub fn bidirectional() -> Self {
        LinearAttentionConfig { causal: false, ..Self::causal() }
    }

    fn check(&self) -> Result<()> {
        if self.chunk == 0 || self.chunk > MAX_CHUNK {
            return Err(Error::LegacyUnsupported(format!("chunk {} (supported: 1..={MAX_CHUNK})", self.chunk)));
        }
        // eps = 0 would leave 0/0 for a query orthogonal to the key sums (e.g. signed features)
        if self.normalize && !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::LegacyShape(format!("eps {} must be finite and > 0 when normalizing", self.eps)));
        }
        Ok(())
    }

    /// True when the forward keeps per-chunk states.
    fn keeps_boundaries(&self) -> bool {
        self.causal && self.memory == MemoryMode::BoundaryStates
    }
}

/// A read-only strided view of device memory: buffer + [`Layout`].
pub struct TensorRef<'a, T> {
    data: &'a dyn DeviceMemory<T>,
    layout: &'a Layout,
}

impl<'a, T> TensorRef<'a, T> {
    /// `data` viewed through `layout`.
    #[must_use]
    pub fn new(data: &'a impl DeviceMemory<T>, layout: &'a Layout) -> Self {
        TensorRef { data, layout }
    }
    /// The layout.
    #[must_use]
    pub fn layout(&self) -> &'a Layout {
        self.layout
    }
    pub(crate) fn data_ref(&self) -> crate::device::MemRef<'_, T> {
        self.data.mem_ref()
    }
}

/// A writable strided view of device memory: buffer + [`Layout`] (must not overlap itself).
pub struct TensorMut<'a, T> {
    data: &'a mut dyn DeviceMemoryMut<T>,
    layout: &'a Layout,
}

impl<'a, T> TensorMut<'a, T> {
    /// `data` viewed through `layout`.
    #[must_use]
    pub fn new(data: &'a mut impl DeviceMemoryMut<T>, layout: &'a Layout) -> Self {
        TensorMut { data, layout }
    }
    pub(crate) fn parts(self) -> (crate::device::MemMut<'a, T>, &'a Layout) {
        (self.data.mem_mut(), self.layout)
    }
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

/// What the forward saved for the backward (on the forward's device).
pub struct LinearAttentionSaved {
    state: Buffer<f32>,
    boundary: Option<Buffer<f32>>,
    den: Option<Buffer<f32>>,
    dims: Dims,
    config: LinearAttentionConfig,
    dtype: DType,
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
    /// `B·H·⌈L/C⌉·M·W·4` in [`MemoryMode::BoundaryStates`] (causal).
    #[must_use]
    pub fn state_bytes(&self) -> usize {
        self.state.size_in_bytes() + self.boundary.as_ref().map_or(0, Buffer::size_in_bytes)
    }
    /// Bytes of the saved denominators (`B·H·L·4`, normalised attention only): the same
    /// order as one output column, kept so that the backward needs no recomputation.
    #[must_use]
    pub fn denominator_bytes(&self) -> usize {
        self.den.as_ref().map_or(0, Buffer::size_in_bytes)
    }
    /// All bytes held: [`Self::state_bytes`] + [`Self::denominator_bytes`].
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.state_bytes() + self.denominator_bytes()
    }
    /// The final state `[B·H, M, W]` (row-major; column `D` is `z = Σ k_s` when
    /// normalised). Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn final_state(&self) -> Result<Vec<f32>> {
        let n = self.dims.batch * self.dims.heads * self.dims.feat * state_width(&self.dims, &self.config);
        let mut v = self.state.to_vec()?;
        v.truncate(n);
        Ok(v)
    }
    /// The guarded denominators `g(q_t · Σ k_s)`, `[B·H·L]`, if normalised. Synchronises.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn denominators(&self) -> Result<Option<Vec<f32>>> {
        match &self.den {
            Some(d) => {
                let mut v = d.to_vec()?;
                v.truncate(self.dims.batch * self.dims.heads * self.dims.len);
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }
}

fn state_width(d: &Dims, c: &LinearAttentionConfig) -> usize {
    d.dim + usize::from(c.normalize)
}

/// Bytes the forward keeps for a call of `dims` (states and denominators), without running it.
///
/// # Errors
/// [`Error::TooLarge`] on overflow.
pub fn saved_bytes(dims: &Dims, config: &LinearAttentionConfig) -> Result<usize> {
    let (states, den) = saved_sizes(dims, config)?;
    Ok((states.0 + states.1 + den) * 4)
}

/// ((final, boundary), den) element counts.
fn saved_sizes(d: &Dims, c: &LinearAttentionConfig) -> Result<((usize, usize), usize)> {
    let too_large = || Error::LegacyTooLarge("saved state size overflows".into());
    let bh = d.batch.checked_mul(d.heads).ok_or_else(too_large)?;
    let per = d.feat.checked_mul(state_width(d, c)).ok_or_else(too_large)?;
    let fin = bh.checked_mul(per).ok_or_else(too_large)?;
    let bnd =
        if c.keeps_boundaries() { fin.checked_mul(d.len.div_ceil(c.chunk.max(1))).ok_or_else(too_large)? } else { 0 };
    let den = if c.normalize { bh.checked_mul(d.len).ok_or_else(too_large)? } else { 0 };
    if fin.max(bnd).max(den) >= i64::MAX as usize / 4 {
        return Err(too_large());
    }
    Ok(((fin, bnd), den))
}

/// Checks a rank-4 view against its buffer; returns its shape.
fn check_view(layout: &Layout, len: usize, what: &'static str) -> Result<[usize; 4]> {
    let s = layout.shape();
    if s.len() != 4 {
        return Err(Error::LegacyShape(format!("{what}: expected a rank-4 [B, H, L, F] view, got shape {s:?}")));
    }
    layout.check_fits(len, what)?;
    Ok([s[0], s[1], s[2], s[3]])
}

fn expect_shape(got: [usize; 4], want: [usize; 4], what: &'static str) -> Result<()> {
    if got != want {
        return Err(Error::LegacyShape(format!("{what}: shape {got:?}, expected {want:?}")));
    }
    Ok(())
}

/// The kernels' view of a layout (strides of size-1 dimensions zeroed: never multiplied by
/// a nonzero index, so they cannot overflow the signed arithmetic).
fn la_tensor(layout: &Layout, data: *mut c_void) -> sys::MesaLaTensor {
    let mut strides = [0i64; 4];
    for (k, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate().take(4) {
        strides[k] = if n > 1 { s as i64 } else { 0 };
    }
    sys::MesaLaTensor { data, strides }
}

fn la_shape(d: &Dims, c: &LinearAttentionConfig, dtype: DType) -> sys::MesaLaShape {
    sys::MesaLaShape {
        batch: d.batch as i64,
        heads: d.heads as i64,
        len: d.len as i64,
        feat: d.feat as i64,
        dim: d.dim as i64,
        chunk: c.chunk as i32,
        dtype: dtype.to_sys(),
        causal: i32::from(c.causal),
        normalize: i32::from(c.normalize),
        eps: c.eps,
        memory: (match c.memory {
            MemoryMode::BoundaryStates => sys::MESA_LA_BOUNDARY_STATES,
            MemoryMode::Slim => sys::MESA_LA_SLIM,
        }) as sys::MesaLaMemory,
    }
}

/// Forward: writes `out` and returns what the backward needs.
///
/// Shapes: `q, k: [B, H, L, M]`, `v, out: [B, H, L, D]` (rank-4 views, any strides; `out`
/// must not overlap itself or the inputs). dtypes: f32, f16, bf16 (one for all; state and
/// accumulation f32). Any `L` (including 0 and `L < C`), `M`, `D`, `B·H`.
///
/// Allocates (stream-ordered) the saved state: see [`LinearAttentionSaved::size_in_bytes`].
/// Bytes moved (floor): `(2M + D)·L·sizeof(T)` read + `D·L·sizeof(T)` written per `(b, h)`,
/// plus the boundary states written in [`MemoryMode::BoundaryStates`].
///
/// # Errors
/// [`Error::Shape`] (rank ≠ 4, shapes disagree, output overlaps itself, bad ε),
/// [`Error::Unsupported`] (chunk outside `1..=64`), [`Error::BufferTooShort`],
/// [`Error::TooLarge`], [`Error::WrongBackend`], [`Error::Misaligned`], CUDA errors.
pub fn forward<T: Element>(
    device: &Device,
    config: &LinearAttentionConfig,
    q: TensorRef<'_, T>,
    k: TensorRef<'_, T>,
    v: TensorRef<'_, T>,
    out: TensorMut<'_, T>,
) -> Result<LinearAttentionSaved> {
    config.check()?;
    let qm = q.data.mem_ref();
    let km = k.data.mem_ref();
    let vm = v.data.mem_ref();
    let mut om = out.data.mem_mut();
    let qs = check_view(q.layout, qm.len(), "q")?;
    let ks = check_view(k.layout, km.len(), "k")?;
    let vs = check_view(v.layout, vm.len(), "v")?;
    let os = check_view(out.layout, om.len(), "out")?;
    expect_shape(ks, qs, "k")?;
    if vs[..3] != qs[..3] {
        return Err(Error::LegacyShape(format!("v: shape {vs:?} does not share [B, H, L] with q {qs:?}")));
    }
    expect_shape(os, vs, "out")?;
    out.layout.check_no_overlap("out")?;
    let dims = Dims { batch: qs[0], heads: qs[1], len: qs[2], feat: qs[3], dim: vs[3] };
    let ((fin, bnd), den) = saved_sizes(&dims, config)?;
    let mut saved = LinearAttentionSaved {
        state: device.alloc_for_kernel::<f32>(fin.max(1))?,
        boundary: if config.keeps_boundaries() { Some(device.alloc_for_kernel::<f32>(bnd.max(1))?) } else { None },
        den: if config.normalize { Some(device.alloc_for_kernel::<f32>(den.max(1))?) } else { None },
        dims,
        config: *config,
        dtype: T::DTYPE,
    };
    {
        let qp = device.read_ptr(&qm, q.layout.offset(), "q")?;
        let kp = device.read_ptr(&km, k.layout.offset(), "k")?;
        let vp = device.read_ptr(&vm, v.layout.offset(), "v")?;
        let op = device.write_ptr(&mut om, out.layout.offset(), "out")?;
        let mut state_mem = saved.state.mem_mut();
        let sp = device.write_ptr(&mut state_mem, 0, "state")?;
        let mut bnd_mem = saved.boundary.as_mut().map(DeviceMemoryMut::mem_mut);
        let bp = match bnd_mem.as_mut() {
            Some(m) => Some(device.write_ptr(m, 0, "boundary states")?),
            None => None,
        };
        let mut den_mem = saved.den.as_mut().map(DeviceMemoryMut::mem_mut);
        let dp = match den_mem.as_mut() {
            Some(m) => Some(device.write_ptr(m, 0, "denominators")?),
            None => None,
        };
        let args = sys::MesaLaForwardArgs {
            shape: la_shape(&dims, config, T::DTYPE),
            q: la_tensor(q.layout, qp.addr),
            k: la_tensor(k.layout, kp.addr),
            v: la_tensor(v.layout, vp.addr),
            out: la_tensor(out.layout, op.addr),
            state: sp.addr.cast(),
            boundary: bp.as_ref().map_or(std::ptr::null_mut(), |p| p.addr.cast()),
            den: dp.as_ref().map_or(std::ptr::null_mut(), |p| p.addr.cast()),
        };
        // SAFETY: q, k, v, out are rank-4 views whose furthest element lies inside their buffers
        // (check_fits) with the shapes checked equal above; out does not overlap itself; the
        // state, boundary and denominator buffers were allocated with the sizes the header
        // documents for these dims (saved_sizes). The cudarc guards order the accesses.
        unsafe {
            device.launch(
                "linear_attention_forward",
                &args,
                sys::mesa_linear_attention_forward,
                sys::mesa_emu_linear_attention_forward,
            )?;
        }
    }
    Ok(saved)
}

/// Gradients of [`forward`]: writes `dq`, `dk`, `dv` (exact up to floating point).
///
/// `out` (the forward's output) is required when normalised (`dden = −(dout·out)/g`), and
/// ignored otherwise. `q, k, v` must be the forward's inputs. `dq, dk: [B, H, L, M]`,
/// `dv, dout: [B, H, L, D]`, one dtype; the gradient views must not overlap themselves (or
/// each other, or the inputs). `saved` is not modified (the SLiM rebuild works on a copy).
///
/// Allocates a workspace of `(B·H·M·W + B·H·L)·4` bytes (stream-ordered, freed when the
/// call's work is done).
///
/// # Errors
/// As [`forward`], plus [`Error::Shape`] when `saved` was made for other dims, dtype or
/// config, or `out` is missing; [`Error::WrongBackend`] when `saved` is another backend's.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    device: &Device,
    saved: &LinearAttentionSaved,
    q: TensorRef<'_, T>,
    k: TensorRef<'_, T>,
    v: TensorRef<'_, T>,
    out: Option<TensorRef<'_, T>>,
    dout: TensorRef<'_, T>,
    dq: TensorMut<'_, T>,
    dk: TensorMut<'_, T>,
    dv: TensorMut<'_, T>,
) -> Result<()> {
    let config = saved.config;
    let dims = saved.dims;
    if saved.dtype != T::DTYPE {
        return Err(Error::LegacyShape(format!(
            "saved by a {} forward, backward in {}",
            saved.dtype.name(),
            T::DTYPE.name()
        )));
    }
    match (device.kind(), &saved.state) {
        (Kind::Cuda(_), Buffer::Cuda(_)) | (Kind::Emulator, Buffer::Host(_)) => {}
        _ => return Err(Error::LegacyWrongBackend("saved state belongs to another backend".into())),
    }
    let qshape = [dims.batch, dims.heads, dims.len, dims.feat];
    let vshape = [dims.batch, dims.heads, dims.len, dims.dim];
    let qm = q.data.mem_ref();
    let km = k.data.mem_ref();
    let vm = v.data.mem_ref();
    let gm = dout.data.mem_ref();
    expect_shape(check_view(q.layout, qm.len(), "q")?, qshape, "q")?;
    expect_shape(check_view(k.layout, km.len(), "k")?, qshape, "k")?;
    expect_shape(check_view(v.layout, vm.len(), "v")?, vshape, "v")?;
    expect_shape(check_view(dout.layout, gm.len(), "dout")?, vshape, "dout")?;
    let out_pair = match (&out, config.normalize) {
        (Some(o), true) => {
            let m = o.data.mem_ref();
            expect_shape(check_view(o.layout, m.len(), "out")?, vshape, "out")?;
            Some((m, o.layout))
        }
        (None, true) => {
            return Err(Error::LegacyShape("normalised attention: backward needs the forward output `out`".into()))
        }
        (_, false) => None,
    };
    let mut dqm = dq.data.mem_mut();
    let mut dkm = dk.data.mem_mut();
    let mut dvm = dv.data.mem_mut();
    expect_shape(check_view(dq.layout, dqm.len(), "dq")?, qshape, "dq")?;
    expect_shape(check_view(dk.layout, dkm.len(), "dk")?, qshape, "dk")?;
    expect_shape(check_view(dv.layout, dvm.len(), "dv")?, vshape, "dv")?;
    dq.layout.check_no_overlap("dq")?;
    dk.layout.check_no_overlap("dk")?;
    dv.layout.check_no_overlap("dv")?;
    let ((fin, _), den) = saved_sizes(&dims, &config)?;
    let mut work = device.alloc_for_kernel::<f32>((fin + den).max(1))?;

    let qp = device.read_ptr(&qm, q.layout.offset(), "q")?;
    let kp = device.read_ptr(&km, k.layout.offset(), "k")?;
    let vp = device.read_ptr(&vm, v.layout.offset(), "v")?;
    let gp = device.read_ptr(&gm, dout.layout.offset(), "dout")?;
    let op = match &out_pair {
        Some((m, l)) => Some((device.read_ptr(m, l.offset(), "out")?, *l)),
        None => None,
    };
    let state_mem = saved.state.mem_ref();
    let sp = device.read_ptr(&state_mem, 0, "state")?;
    let bnd_mem = saved.boundary.as_ref().map(DeviceMemory::mem_ref);
    let bp = match bnd_mem.as_ref() {
        Some(m) => Some(device.read_ptr(m, 0, "boundary states")?),
        None => None,
    };
    let den_mem = saved.den.as_ref().map(DeviceMemory::mem_ref);
    let dp = match den_mem.as_ref() {
        Some(m) => Some(device.read_ptr(m, 0, "denominators")?),
        None => None,
    };
    let dqp = device.write_ptr(&mut dqm, dq.layout.offset(), "dq")?;
    let dkp = device.write_ptr(&mut dkm, dk.layout.offset(), "dk")?;
    let dvp = device.write_ptr(&mut dvm, dv.layout.offset(), "dv")?;
    let mut work_mem = work.mem_mut();
    let wp = device.write_ptr(&mut work_mem, 0, "workspace")?;
    let null = sys::MesaLaTensor { data: std::ptr::null_mut(), strides: [0; 4] };
    let args = sys::MesaLaBackwardArgs {
        shape: la_shape(&dims, &config, T::DTYPE),
        q: la_tensor(q.layout, qp.addr),
        k: la_tensor(k.layout, kp.addr),
        v: la_tensor(v.layout, vp.addr),
        out: op.as_ref().map_or(null, |(p, l)| la_tensor(l, p.addr)),
        dout: la_tensor(dout.layout, gp.addr),
        dq: la_tensor(dq.layout, dqp.addr),
        dk: la_tensor(dk.layout, dkp.addr),
        dv: la_tensor(dv.layout, dvp.addr),
        state: sp.addr as *const f32,
        boundary: bp.as_ref().map_or(std::ptr::null(), |p| p.addr as *const f32),
        den: dp.as_ref().map_or(std::ptr::null(), |p| p.addr as *const f32),
        work: wp.addr.cast(),
    };
    // SAFETY: every view is rank 4 with the forward's dims and lies inside its buffer
    // (check_fits); the gradient views do not overlap themselves; the saved buffers were
    // sized by the forward for these dims and config (same dtype and backend checked
    // above); the workspace holds B·H·M·W + B·H·L f32 as the header requires.
    unsafe {
        device.launch(
            "linear_attention_backward",
            &args,
            sys::mesa_linear_attention_backward,
            sys::mesa_emu_linear_attention_backward,
        )?;
    }
    drop((qp, kp, vp, gp, op, sp, bp, dp, dqp, dkp, dvp, wp));
    // the workspace is freed stream-ordered (cudarc) after the kernels that use it
    drop(work);
    Ok(())
}
