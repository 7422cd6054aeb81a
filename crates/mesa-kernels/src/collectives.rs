//! Sequence-parallel collectives (Megatron: Korthikanti et al., *Reducing Activation
//! Recomputation in Large Transformer Models*, 2022, §4.2.2): reduce-scatter and all-gather
//! of `[S, B, H]` activations along the sequence axis `S` between the `W` ranks of a
//! tensor-parallel group, so that norms, dropout and residual adds run on a `[S_r, B, H]`
//! shard. Placement in a transformer layer and the memory it saves: `docs/sequence_parallel.md`.
//!
//! ```text
//! reduce-scatter  out_r[s,b,h] = rnd( (((x_0[o_r+s,b,h] + x_1[..]) + … + x_{W-1}[..]) + bias[h]) + residual_r[s,b,h] )
//! all-gather      out_r[o_p+s,b,h] = x_p[s,b,h]           for every rank p
//! ```
//!
//! `o_r` is the first row of rank `r`'s shard ([`SeqSplits`]: explicit sizes, uneven allowed).
//! The reduce-scatter adds in f32, in the fixed rank order `0, 1, …, W−1`, then the optional
//! bias and residual, and rounds once to the output dtype: every rank's shard is bitwise what
//! a single process summing in that order would get. The all-gather is a bit copy.
//!
//! Backends with the same semantics:
//! * [`SeqParallelGroup`]: the intra-node kernel over a table of peer pointers. All ranks'
//!   buffers are given as slices and live on one [`Device`] (how it runs in tests and on a
//!   single GPU); the kernel itself is the same for ranks on separate GPUs (see the C header
//!   `mesa_collectives.h`). Synchronisation: per-block flags with monotonic u32 epochs,
//!   acquire/release at system scope, every wait bounded by [`SeqParallelGroup::timeout`].
//! * `nccl::NcclSeqParallel` (cargo feature `nccl`): one rank per process on NCCL
//!   communicators, for multi-GPU and multi-node use.
//!
//! Views: inputs and outputs are the crate's [`TensorRef`] / [`TensorMut`] (any
//! [`DeviceMemory`](crate::DeviceMemory): buffers, cudarc slices, raw device pointers, host
//! sub-slices), strided `[S, B, H]` (or `[S_r, B, H]`); all ranks share one set of strides
//! (offsets may differ). In-place is not supported: an output that overlaps any input,
//! residual, bias or another rank's output is [`Error::Aliasing`]. Dense views whose addresses are 16-byte
//! aligned move 16-byte vectors; a view offset by one element takes a scalar dense loop; any
//! other strides (transposed `B`/`H`, padded rows, broadcast inputs) take a strided loop with
//! the same per-element arithmetic, so the result never depends on the path.
use std::ops::Range;
use std::time::Duration;

use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::Layout;
use crate::tensor::{TensorMut, TensorRef};

#[cfg(feature = "nccl")]
pub mod nccl;

/// Largest tensor-parallel group of the intra-node kernel.
pub const MAX_RANKS: usize = sys::MESA_SEQPAR_MAX_RANKS as usize;
/// Largest `blocks_per_rank` of the intra-node kernel.
pub const MAX_BLOCKS_PER_RANK: usize = sys::MESA_SEQPAR_MAX_BLOCKS as usize;
const FLAG_WORDS: usize = sys::MESA_SEQPAR_FLAG_WORDS as usize;
const FLAG_STATUS: usize = sys::MESA_SEQPAR_FLAG_STATUS as usize;
const FLAG_EPOCH: usize = sys::MESA_SEQPAR_FLAG_EPOCH as usize;

/// How the sequence axis `S` is split between ranks: rank `r` owns rows
/// `[offset(r), offset(r) + rows(r))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSplits {
    offsets: Vec<usize>,
}

impl SeqSplits {
    /// Explicit shard sizes, one per rank (zeros allowed, e.g. `S = 3` over 4 ranks).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list, [`Error::TooLarge`] for a total that
    /// overflows.
    pub fn new(sizes: &[usize]) -> Result<Self> {
        if sizes.is_empty() {
            return Err(Error::invalid_argument("split sizes", "at least one rank, got an empty list"));
        }
        let mut offsets = Vec::with_capacity(sizes.len() + 1);
        offsets.push(0usize);
        let mut total = 0usize;
        for &s in sizes {
            total = total
                .checked_add(s)
                .ok_or_else(|| Error::too_large("split sizes", format!("their sum overflows ({sizes:?})")))?;
            offsets.push(total);
        }
        Ok(SeqSplits { offsets })
    }

    /// `S` rows over `world` ranks as evenly as possible: the first `S mod W` ranks get one row
    /// more (`S = 10`, `W = 4` → `3, 3, 2, 2`). Megatron requires `W | S`; this does not.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `world` is 0.
    pub fn even(seq: usize, world: usize) -> Result<Self> {
        if world == 0 {
            return Err(Error::invalid_argument("world size", "at least one rank, got 0"));
        }
        let sizes: Vec<usize> = (0..world).map(|r| seq / world + usize::from(r < seq % world)).collect();
        SeqSplits::new(&sizes)
    }

    /// Number of ranks `W`.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.offsets.len() - 1
    }
    /// The sequence length `S` (sum of the sizes).
    #[must_use]
    pub fn total(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }
    /// Rows of rank `r` (0 past the last rank).
    #[must_use]
    pub fn rows(&self, r: usize) -> usize {
        match (self.offsets.get(r), self.offsets.get(r + 1)) {
            (Some(a), Some(b)) => b - a,
            _ => 0,
        }
    }
    /// First row of rank `r` (`S` past the last rank).
    #[must_use]
    pub fn offset(&self, r: usize) -> usize {
        self.offsets.get(r).copied().unwrap_or_else(|| self.total())
    }
    /// The largest shard.
    #[must_use]
    pub fn max_rows(&self) -> usize {
        (0..self.world_size()).map(|r| self.rows(r)).max().unwrap_or(0)
    }
    /// The sizes, one per rank.
    #[must_use]
    pub fn sizes(&self) -> Vec<usize> {
        (0..self.world_size()).map(|r| self.rows(r)).collect()
    }
}

/// The fused epilogue of a reduce-scatter: `out = (Σ + bias[h]) + residual`, per rank.
///
/// In a Megatron layer the reduce-scatter follows the row-parallel linear (attention output
/// projection, MLP down projection); its bias and the residual add of the following
/// bias-dropout-add belong to the sequence shard, so fusing them saves a read and a write of
/// `[S_r, B, H]` (dropout, when used, needs its own mask and is not fused).
#[derive(Debug)]
pub struct Epilogue<'a, T> {
    /// Per rank: the bias `[H]` (any stride), or `None`.
    pub bias: Option<&'a [TensorRef<'a, T>]>,
    /// Per rank: the residual `[S_r, B, H]`, or `None`.
    pub residual: Option<&'a [TensorRef<'a, T>]>,
}

impl<T> Epilogue<'_, T> {
    /// No epilogue: the plain reduce-scatter.
    #[must_use]
    pub fn none() -> Self {
        Epilogue { bias: None, residual: None }
    }
}

impl<T> Default for Epilogue<'_, T> {
    fn default() -> Self {
        Epilogue::none()
    }
}

/// Checks a `[S, B, H]` shape and returns `(B, H)`.
fn bh_of(layout: &Layout, rows: usize, what: &str) -> Result<(usize, usize)> {
    match layout.shape() {
        &[s, b, h] if s == rows => Ok((b, h)),
        &[_, b, h] => Err(Error::shape_mismatch(what, &[rows, b, h], layout.shape())),
        shape => Err(Error::invalid_layout(what, format!("expected a [{rows}, B, H] view, got {shape:?}"))),
    }
}

fn strides3(layout: &Layout) -> [i64; 3] {
    let s = layout.strides();
    [s[0] as i64, s[1] as i64, s[2] as i64]
}

/// Every rank's view must use the same strides (the kernel gets one set); offsets may differ.
/// Axes of length 1 are never stepped, so their strides are ignored.
fn common_strides(layouts: &[&Layout], what: &str) -> Result<[i64; 3]> {
    let mut common: [Option<usize>; 3] = [None; 3];
    for l in layouts {
        for (d, slot) in common.iter_mut().enumerate() {
            if l.shape()[d] > 1 {
                match *slot {
                    None => *slot = Some(l.strides()[d]),
                    Some(s) if s == l.strides()[d] => {}
                    Some(s) => {
                        return Err(Error::unsupported(
                            what,
                            format!(
                                "every rank's view must have the same strides (axis {d}: {s} vs {})",
                                l.strides()[d]
                            ),
                        ))
                    }
                }
            }
        }
    }
    // axes never stepped: use the first layout's (dense if possible, for the vector path)
    let first = layouts.first().map(|l| strides3(l)).unwrap_or([0; 3]);
    Ok([0, 1, 2].map(|d| common[d].map_or(first[d], |s| s as i64)))
}

/// The intra-node sequence-parallel group: all `W` ranks' buffers on one [`Device`], one
/// cooperative launch per call covering every rank (blocks of rank `r` are
/// `r·blocks_per_rank .. (r+1)·blocks_per_rank`).
///
/// Owns the ranks' flag buffers (`W · MESA_SEQPAR_FLAG_WORDS` u32 words, 17 KiB per rank),
/// allocated once by [`SeqParallelGroup::new`]. Calls are stream-ordered and may change sizes
/// from call to call; the flags need no clearing between calls.
///
/// **Timeouts.** Every wait of the kernel is bounded by [`SeqParallelGroup::timeout`]
/// (default 10 s). A rank that gives up — its wait expired, or it saw that a peer gave up, at
/// START or at END — marks its status word and writes NaN over its whole output: a timed-out
/// call leaves NaN, never stale numbers, including on a rank that arrives after the others
/// gave up (the protocol and its one limit are in the C header `mesa_collectives.h`). Its later
/// calls write NaN only, until [`SeqParallelGroup::reset`].
///
/// **When the error surfaces.** The emulator runs synchronously and returns
/// [`Error::Timeout`] from the call itself. On CUDA a call only enqueues the kernel on the
/// device's stream and returns `Ok(())` before it runs (an op cannot know the outcome without
/// a host synchronisation): the timeout surfaces from [`SeqParallelGroup::check`], which
/// synchronises the stream and reads the status words. Work enqueued after a timed-out call
/// reads its NaN outputs. Once a timeout has been reported, every later call returns
/// [`Error::Timeout`] until `reset`.
///
/// **In-place:** not supported: an output that overlaps any input, residual, bias or another
/// rank's output is rejected with [`Error::Aliasing`] (ranks read every input while the others
/// write their outputs).
#[derive(Debug)]
pub struct SeqParallelGroup {
    device: Device,
    world: usize,
    flags: Buffer<u32>,
    timeout: Duration,
    blocks_per_rank: usize,
    poisoned: bool,
    launch_ranks: Option<Range<usize>>,
}

impl SeqParallelGroup {
    /// A group of `world` ranks on `device`, allocating its flag buffers (zeroed).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `world` outside `1..=MAX_RANKS`; allocation errors
    /// ([`Error::TooLarge`], [`Error::Driver`]).
    pub fn new(device: &Device, world: usize) -> Result<Self> {
        if world == 0 || world > MAX_RANKS {
            return Err(Error::invalid_argument("world size", format!("{world} is outside 1..={MAX_RANKS}")));
        }
        let flags = device.alloc_zeros::<u32>(world * FLAG_WORDS)?;
        Ok(SeqParallelGroup {
            device: device.clone(),
            world,
            flags,
            timeout: Duration::from_secs(10),
            blocks_per_rank: 0,
            poisoned: false,
            launch_ranks: None,
        })
    }

    /// Number of ranks `W`.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The device.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The bound of every wait inside the kernel.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the bound of every wait (wall clock, in nanoseconds).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] below 1 µs or past `u64::MAX` nanoseconds.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        if timeout < Duration::from_micros(1) || u64::try_from(timeout.as_nanos()).is_err() {
            return Err(Error::invalid_argument("timeout", format!("{timeout:?} is outside 1 µs ..= u64::MAX ns")));
        }
        self.timeout = timeout;
        Ok(())
    }

    /// Sets the blocks per rank (0: the launcher's choice, two blocks per SM over all ranks).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] above [`MAX_BLOCKS_PER_RANK`] (the flag buffers' capacity).
    pub fn set_blocks_per_rank(&mut self, blocks: usize) -> Result<()> {
        if blocks > MAX_BLOCKS_PER_RANK {
            return Err(Error::invalid_argument(
                "blocks per rank",
                format!("{blocks} is past the flag buffers' capacity ({MAX_BLOCKS_PER_RANK})"),
            ));
        }
        self.blocks_per_rank = blocks;
        Ok(())
    }

    /// True after a timeout was reported (calls are refused until [`SeqParallelGroup::reset`]).
    #[must_use]
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Clears every rank's flags and status (stream-ordered): the group starts again at epoch 0.
    /// No call of this group may still be waiting on another stream.
    ///
    /// # Errors
    /// CUDA copy errors ([`Error::Driver`]).
    pub fn reset(&mut self) -> Result<()> {
        self.device.copy_into(&vec![0u32; self.world * FLAG_WORDS], &mut self.flags)?;
        self.poisoned = false;
        Ok(())
    }

    /// Waits for the group's work on the stream and reports an expired wait: the way a timeout
    /// of a CUDA call surfaces (see the type's docs). Synchronises the device's stream.
    ///
    /// # Errors
    /// [`Error::Timeout`] when some rank's status word is set (the outputs of the calls since
    /// the last `check` that timed out hold NaN; the group is then poisoned until
    /// [`SeqParallelGroup::reset`]); driver errors ([`Error::Driver`]).
    pub fn check(&mut self) -> Result<()> {
        self.device.synchronize()?;
        let words = self.flags.to_vec()?;
        self.report_status(&words, "sequence-parallel group")
    }

    /// `Error::Timeout` (and poisoned) when some rank's status word in `words` is set.
    fn report_status(&mut self, words: &[u32], op: &'static str) -> Result<()> {
        let err = status_error(self.world, words, self.timeout, op);
        self.poisoned |= err.is_some();
        err.map_or(Ok(()), Err)
    }

    /// Test hook: sets every rank's epochs (and the peers' slots) to `epoch`, as if the group had
    /// already run `epoch` calls — to exercise the u32 wrap-around of the flag counters.
    #[doc(hidden)]
    pub fn set_epoch_for_testing(&mut self, epoch: u32) -> Result<()> {
        let mut words = vec![0u32; self.world * FLAG_WORDS];
        for r in 0..self.world {
            let base = r * FLAG_WORDS;
            words[base + FLAG_EPOCH..base + FLAG_WORDS].fill(epoch);
            words[base + FLAG_STATUS] = 0;
        }
        self.device.copy_into(&words, &mut self.flags)?;
        self.poisoned = false;
        Ok(())
    }

    /// Test hook: launch only the blocks of `ranks` (the others never arrive), as a GPU of a
    /// multi-GPU group would launch its own rank only. `None` launches every rank.
    #[doc(hidden)]
    pub fn set_launch_ranks_for_testing(&mut self, ranks: Option<Range<usize>>) {
        self.launch_ranks = ranks;
    }

    /// Test hook: forgets a reported timeout on the host side only (the flags stay as they
    /// are), as the host of a late rank in another process would not know about it.
    #[doc(hidden)]
    pub fn clear_poisoned_for_testing(&mut self) {
        self.poisoned = false;
    }

    /// Test hook: writes `rank`'s START flags for the next call into every peer's slots, as if
    /// `rank` had arrived at START (and then never reached END).
    #[doc(hidden)]
    pub fn pretend_start_for_testing(&mut self, rank: usize) -> Result<()> {
        const START: usize = sys::MESA_SEQPAR_FLAG_START as usize;
        const RANKS: usize = sys::MESA_SEQPAR_MAX_RANKS as usize;
        let mut words = self.flags.to_vec()?;
        if rank >= self.world {
            return Err(Error::invalid_argument("rank", format!("{rank} outside 0..{}", self.world)));
        }
        let next: Vec<u32> =
            (0..MAX_BLOCKS_PER_RANK).map(|b| words[rank * FLAG_WORDS + FLAG_EPOCH + b].wrapping_add(1)).collect();
        for p in (0..self.world).filter(|&p| p != rank) {
            for (b, &e) in next.iter().enumerate() {
                words[p * FLAG_WORDS + START + b * RANKS + rank] = e;
            }
        }
        self.device.copy_into(&words, &mut self.flags)
    }

    /// Reduce-scatter along the sequence: `outputs[r] = Σ_p inputs[p][rows of r] (+ bias_r)
    /// (+ residual_r)`, f32 accumulation in rank order `0..W`, one rounding to `T`.
    ///
    /// Shapes: `inputs[p]`: `[S, B, H]`; `outputs[r]`, residual `r`: `[S_r, B, H]` with
    /// `S_r = splits.rows(r)`; bias `r`: `[H]`. dtypes: f32, f16, bf16 (one `T` throughout).
    /// Views of any [`DeviceMemory`](crate::DeviceMemory) (buffers, cudarc slices, raw device
    /// pointers, host sub-slices on the emulator); all ranks' views share one set of strides.
    /// Bytes moved: `W·N·e` read + `N·e` written (`N = S·B·H`, `e = sizeof(T)`), plus `N·e`
    /// read for the residual. Stream-ordered; no allocation. On CUDA a timeout surfaces from
    /// [`SeqParallelGroup::check`], not from this call (see the type's docs).
    ///
    /// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]; so is
    /// an output overlapping another rank's output, a residual or a bias).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (rank counts or split sizes that do not match the group, a
    /// residual or bias list of the wrong length), [`Error::ShapeMismatch`] (a view of the
    /// wrong size), [`Error::InvalidLayout`] (a view that is not `[rows, B, H]`),
    /// [`Error::Unsupported`] (ranks' strides differ), [`Error::Aliasing`],
    /// [`Error::WrongBackend`], [`Error::Misaligned`], [`Error::TooLarge`] (a cooperative grid
    /// that cannot be co-resident), [`Error::Timeout`] (emulator; earlier timeouts on every
    /// backend), [`Error::Driver`].
    pub fn reduce_scatter_seq<T: Element>(
        &mut self,
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        splits: &SeqSplits,
        epilogue: &Epilogue<'_, T>,
    ) -> Result<()> {
        self.collective(inputs, outputs, splits, epilogue, false)
    }

    /// All-gather along the sequence: `outputs[r][rows of p] = inputs[p]` for every rank `p`
    /// (a bit copy).
    ///
    /// Shapes: `inputs[p]`: `[S_p, B, H]`; `outputs[r]`: `[S, B, H]`. dtypes: f32, f16, bf16.
    /// Bytes moved: `W·N·e` read + `W·N·e` written. Stream-ordered; no allocation. On CUDA a
    /// timeout surfaces from [`SeqParallelGroup::check`].
    ///
    /// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
    ///
    /// # Errors
    /// As [`SeqParallelGroup::reduce_scatter_seq`].
    pub fn all_gather_seq<T: Element>(
        &mut self,
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        splits: &SeqSplits,
    ) -> Result<()> {
        self.collective(inputs, outputs, splits, &Epilogue::none(), true)
    }

    /// Validates every view; returns the kernel's `(B, H)`, strides and bias stride.
    fn validate<T>(
        &self,
        op: &'static str,
        inputs: &[TensorRef<'_, T>],
        outputs: &[TensorMut<'_, T>],
        splits: &SeqSplits,
        epilogue: &Epilogue<'_, T>,
        gather: bool,
    ) -> Result<Plan> {
        let w = self.world;
        if splits.world_size() != w {
            return Err(Error::invalid_argument(
                "splits",
                format!("{op}: {} split sizes for a group of {w} ranks", splits.world_size()),
            ));
        }
        if inputs.len() != w || outputs.len() != w {
            return Err(Error::invalid_argument(
                "inputs/outputs",
                format!(
                    "{op}: a group of {w} ranks needs {w} inputs and outputs, got {} and {}",
                    inputs.len(),
                    outputs.len()
                ),
            ));
        }
        let seq = splits.total();
        let in_rows = |r: usize| if gather { splits.rows(r) } else { seq };
        let out_rows = |r: usize| if gather { seq } else { splits.rows(r) };
        let (b, h) = bh_of(inputs[0].layout(), in_rows(0), "input 0")?;
        for r in 0..w {
            if bh_of(inputs[r].layout(), in_rows(r), INPUT[r])? != (b, h) {
                return Err(Error::shape_mismatch(INPUT[r], &[in_rows(r), b, h], inputs[r].shape()));
            }
            if bh_of(outputs[r].layout(), out_rows(r), OUTPUT[r])? != (b, h) {
                return Err(Error::shape_mismatch(OUTPUT[r], &[out_rows(r), b, h], outputs[r].shape()));
            }
        }
        let in_strides = common_strides(&inputs.iter().map(TensorRef::layout).collect::<Vec<_>>(), "inputs")?;
        let out_strides = common_strides(&outputs.iter().map(TensorMut::layout).collect::<Vec<_>>(), "outputs")?;
        let mut residual_strides = [0i64; 3];
        if let Some(res) = epilogue.residual {
            if gather || res.len() != w {
                return Err(Error::invalid_argument(
                    "residual",
                    format!("{op}: one residual per rank ({w}) for a reduce-scatter, got {}", res.len()),
                ));
            }
            for (r, v) in res.iter().enumerate() {
                if bh_of(v.layout(), splits.rows(r), RESIDUAL[r])? != (b, h) {
                    return Err(Error::shape_mismatch(RESIDUAL[r], &[splits.rows(r), b, h], v.shape()));
                }
            }
            residual_strides = common_strides(&res.iter().map(TensorRef::layout).collect::<Vec<_>>(), "residuals")?;
        }
        let mut bias_stride = 0i64;
        if let Some(bias) = epilogue.bias {
            if gather || bias.len() != w {
                return Err(Error::invalid_argument(
                    "bias",
                    format!("{op}: one bias per rank ({w}) for a reduce-scatter, got {}", bias.len()),
                ));
            }
            let mut stride = None;
            for (r, v) in bias.iter().enumerate() {
                if v.shape() != [h] {
                    return Err(Error::shape_mismatch(BIAS[r], &[h], v.shape()));
                }
                let s = v.layout().strides()[0];
                if h > 1 && stride.is_some_and(|t| t != s) {
                    return Err(Error::unsupported(BIAS[r], "every rank's bias must have the same stride"));
                }
                stride = stride.or(Some(s));
            }
            bias_stride = stride.unwrap_or(1) as i64;
        }
        Ok(Plan { seq, b, h, in_strides, out_strides, residual_strides, bias_stride })
    }

    fn collective<T: Element>(
        &mut self,
        inputs: &[TensorRef<'_, T>],
        outputs: &mut [TensorMut<'_, T>],
        splits: &SeqSplits,
        epilogue: &Epilogue<'_, T>,
        gather: bool,
    ) -> Result<()> {
        let op = if gather { "seqpar_all_gather" } else { "seqpar_reduce_scatter" };
        let plan = self.validate(op, inputs, outputs, splits, epilogue, gather)?;
        // A poisoned group still launches: the ranks whose status word is set write NaN over
        // their outputs and their peers give up on them, so no output keeps stale numbers.
        let poisoned = self.poisoned;
        let w = self.world;
        let mut args = sys::MesaSeqParArgs {
            batch: plan.b as i64,
            hidden: plan.h as i64,
            in_strides: plan.in_strides,
            out_strides: plan.out_strides,
            residual_strides: plan.residual_strides,
            bias_stride: plan.bias_stride,
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
            world_size: w as i32,
            rank_begin: 0,
            rank_count: w as i32,
            blocks_per_rank: self.blocks_per_rank as i32,
            dtype: T::DTYPE.to_sys(),
            ..Default::default()
        };
        if let Some(r) = &self.launch_ranks {
            if r.start >= r.end || r.end > w {
                return Err(Error::invalid_argument("launch ranks", format!("{r:?} outside 0..{w}")));
            }
            args.rank_begin = r.start as i32;
            args.rank_count = (r.end - r.start) as i32;
        }
        for r in 0..w {
            args.split_offsets[r] = splits.offset(r) as i64;
        }
        args.split_offsets[w] = plan.seq as i64;
        if plan.seq == 0 || plan.b == 0 || plan.h == 0 {
            return Ok(()); // nothing moves; no rank meets (consistently on every rank)
        }

        // every rank's tensors on one builder: outputs may overlap nothing else
        let SeqParallelGroup { device, flags, .. } = self;
        let mut launch = Launch::new(&*device);
        for (r, x) in inputs.iter().enumerate() {
            args.ranks[r].input = launch.input(x, INPUT[r])?;
        }
        if let Some(res) = epilogue.residual {
            for (r, x) in res.iter().enumerate() {
                args.ranks[r].residual = launch.input(x, RESIDUAL[r])?;
            }
        }
        if let Some(bias) = epilogue.bias {
            for (r, x) in bias.iter().enumerate() {
                args.ranks[r].bias = launch.input(x, BIAS[r])?;
            }
        }
        for (r, y) in outputs.iter_mut().enumerate() {
            args.ranks[r].output = launch.output(y, OUTPUT[r])?;
        }
        let flags_p = launch.write_buffer(flags, "collective flags")?;
        for r in 0..w {
            args.ranks[r].flags = flags_p.wrapping_add(r * FLAG_WORDS);
        }
        // SAFETY: every pointer comes from this builder. Each view was checked at construction
        // to fit its buffer with the shape and strides the kernel walks ([S,B,H] inputs,
        // [S_r,B,H] outputs and residuals, [H] biases; `validate` checked the shapes against
        // the splits and that all ranks share the strides passed), outputs do not overlap
        // themselves (TensorMut) nor anything else registered (the builder), and the flag
        // buffer holds W · MESA_SEQPAR_FLAG_WORDS words (allocated by `new`).
        unsafe {
            if gather {
                launch.launch(op, &args, sys::mesa_seqpar_all_gather, sys::mesa_emu_seqpar_all_gather)?;
            } else {
                launch.launch(op, &args, sys::mesa_seqpar_reduce_scatter, sys::mesa_emu_seqpar_reduce_scatter)?;
            }
        }
        launch.finish()?;
        if poisoned {
            return Err(Error::timeout(op, "the group timed out earlier (outputs are NaN); call reset() first"));
        }
        // The emulation is synchronous: read the status words now (free). CUDA: see check().
        if let Buffer::Host(words) = &self.flags {
            if let Some(e) = status_error(self.world, words, self.timeout, op) {
                self.poisoned = true;
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The timeout error when some rank's status word in `words` is set.
fn status_error(world: usize, words: &[u32], timeout: Duration, op: &'static str) -> Option<Error> {
    let bad: Vec<usize> =
        (0..world).filter(|&r| words.get(r * FLAG_WORDS + FLAG_STATUS).is_some_and(|&w| w != 0)).collect();
    (!bad.is_empty()).then(|| {
        Error::timeout(
            op,
            format!(
                "ranks {bad:?} gave up waiting for their peers (bound {timeout:?}); the outputs of the timed-out \
                 call hold NaN; call reset() once every rank is idle"
            ),
        )
    })
}

/// What [`SeqParallelGroup::validate`] found: sizes and the kernel's strides.
struct Plan {
    seq: usize,
    b: usize,
    h: usize,
    in_strides: [i64; 3],
    out_strides: [i64; 3],
    residual_strides: [i64; 3],
    bias_stride: i64,
}

/// Per-rank names for the builder's registrations (and its errors).
macro_rules! rank_names {
    ($p:literal) => {
        [
            concat!($p, " 0"),
            concat!($p, " 1"),
            concat!($p, " 2"),
            concat!($p, " 3"),
            concat!($p, " 4"),
            concat!($p, " 5"),
            concat!($p, " 6"),
            concat!($p, " 7"),
            concat!($p, " 8"),
            concat!($p, " 9"),
            concat!($p, " 10"),
            concat!($p, " 11"),
            concat!($p, " 12"),
            concat!($p, " 13"),
            concat!($p, " 14"),
            concat!($p, " 15"),
        ]
    };
}
const INPUT: [&str; MAX_RANKS] = rank_names!("input");
const OUTPUT: [&str; MAX_RANKS] = rank_names!("output");
const RESIDUAL: [&str; MAX_RANKS] = rank_names!("residual");
const BIAS: [&str; MAX_RANKS] = rank_names!("bias");
