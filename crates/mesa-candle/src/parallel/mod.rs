//! Tensor and sequence parallelism inside candle's autograd (Korthikanti et al. 2022, §4.2.2):
//! the conjugate collectives `g` (all-gather along the sequence in the forward, reduce-scatter
//! in the backward) and `ḡ` (reduce-scatter in the forward, all-gather in the backward), the
//! ranks that run them, and linear attention across sequence shards ([`lasp`]).
//!
//! A rank holds the `[B, S_r, C]` shard of a `[B, S, C]` activation (batch first, as
//! [`crate::layer`]; shard `r` is rows `o_r .. o_r + S_r` of axis 1). Every rank runs the same
//! program on its own shard and its own slice of the weights, and meets the others in the
//! collectives, in the same order (forward and backward): a rank out of step is an error on
//! every rank, never a hang.
//!
//! ```text
//! x_r ─ LN ─ g ─▶ [B,S,C] ─ column-parallel W_qkv ─ attention (H/t heads) ─ row-parallel W_o ─▶ partial [B,S,C]
//!     ─ ḡ (+ b_o + x_r, fused) ─▶ x2_r ─ LN ─ g ─ column-parallel W_1 ─ GELU ─ row-parallel W_2 ─ ḡ (+ b_2 + x2_r) ─▶ y_r
//! ```
//!
//! Backends ([`Collectives`]):
//! * [`Rank`] from [`thread_group`]: `W` ranks as threads of one process on one device (the
//!   host emulation in tests; one GPU); the last rank to arrive at a call runs the intra-node
//!   kernel (`mesa_kernels::SeqParallelGroup`) over every rank's tensors.
//! * `NcclRank` (features `nccl` and `cuda`): one rank per process and GPU on an NCCL
//!   communicator (`mesa_kernels::collectives::nccl`).
//!
//! How the layer, the memory and linear attention across shards fit: `docs/sequence_parallel.md`.
use std::fmt;
use std::sync::Arc;

use candle_core::Tensor;

use crate::attach::{attach, Backward};
use crate::error::Error;

mod exec;
mod group;
pub mod lasp;
#[cfg(all(feature = "nccl", feature = "cuda"))]
mod nccl;

pub use group::{run_ranks, thread_group, Rank};
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub use nccl::NcclRank;

/// The collectives of one rank of a tensor-parallel group. Tensors are `[B, S_r, C]` shards
/// (axis 1 the sequence, split as `splits`: one size per rank) of one dtype (f32, f16, bf16).
/// Every rank must make the same calls in the same order; the results are identical on every
/// rank where they are replicated (sums in fixed rank order `0..W`, f32 accumulation, one
/// rounding: `docs/sequence_parallel.md`).
pub trait Collectives: Send + Sync + fmt::Debug {
    /// This rank `r`.
    fn rank(&self) -> usize;
    /// The group's size `W`.
    fn world_size(&self) -> usize;
    /// `[B, S_r, C]` → `[B, S, C]`: every rank's shard in rank order.
    ///
    /// # Errors
    /// [`Error::Collective`]: the ranks disagree (op, split sizes, their count, shapes,
    /// dtype), a peer failed, or a peer did not arrive within the timeout.
    fn all_gather_seq(&self, shard: &Tensor, splits: &[usize]) -> Result<Tensor, Error>;
    /// `[B, S, C]` partial sums → this rank's rows of their sum `[B, S_r, C]`, plus `bias`
    /// `[C]` and `residual` `[B, S_r, C]` when given (added in f32 after the sum, then one
    /// rounding).
    ///
    /// # Errors
    /// As [`Collectives::all_gather_seq`].
    fn reduce_scatter_seq(
        &self,
        partial: &Tensor,
        splits: &[usize],
        bias: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor, Error>;
    /// The sum over ranks of same-shape tensors, identical on every rank.
    ///
    /// # Errors
    /// As [`Collectives::all_gather_seq`].
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor, Error>;
    /// Tells the peers this rank failed: their waiting and later calls return
    /// [`crate::error::Fault::PeerFailed`] at once instead of timing out.
    fn fail(&self, why: &str);
}

/// One sequence split over a group: the conjugate operators of Korthikanti et al. (2022)
/// §4.2.2 as candle ops with backward, for `[B, S, C]` activations.
#[derive(Debug, Clone)]
pub struct SeqParallel {
    comm: Arc<dyn Collectives>,
    splits: Vec<usize>,
}

impl SeqParallel {
    /// `seq` rows split over the group as evenly as possible (the first `seq mod W` ranks one
    /// row more: `mesa_kernels::SeqSplits::even`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the group has no rank.
    pub fn even(comm: Arc<dyn Collectives>, seq: usize) -> Result<Self, Error> {
        let splits = mesa_kernels::SeqSplits::even(seq, comm.world_size())?.sizes();
        Ok(SeqParallel { comm, splits })
    }

    /// Explicit shard sizes, one per rank (they must agree on every rank: checked at the
    /// first collective).
    #[must_use]
    pub fn with_splits(comm: Arc<dyn Collectives>, splits: Vec<usize>) -> Self {
        SeqParallel { comm, splits }
    }

    /// The group.
    #[must_use]
    pub fn comm(&self) -> &Arc<dyn Collectives> {
        &self.comm
    }

    /// The shard sizes.
    #[must_use]
    pub fn splits(&self) -> &[usize] {
        &self.splits
    }

    /// This rank's shard: rows `offset .. offset + len` of the sequence, as `(offset, len)`.
    #[must_use]
    pub fn shard(&self) -> (usize, usize) {
        let r = self.comm.rank();
        (self.splits[..r.min(self.splits.len())].iter().sum(), self.splits.get(r).copied().unwrap_or(0))
    }

    /// `g`: `[B, S_r, C]` → `[B, S, C]` (all-gather); its backward reduce-scatters the
    /// gradient back to `[B, S_r, C]`.
    ///
    /// # Errors
    /// As [`Collectives::all_gather_seq`].
    pub fn gather(&self, shard: &Tensor) -> candle_core::Result<Tensor> {
        let full = self.comm.all_gather_seq(shard, &self.splits)?;
        attach(&[shard], crate::ops::tensor_result(&full)?, GatherGrad(self.clone()))
    }

    /// `ḡ`: `[B, S, C]` partial sums → `Σ_ranks partial[rows of r] + bias + residual`,
    /// `[B, S_r, C]` (reduce-scatter, bias and residual fused). Its backward all-gathers the
    /// gradient: the partial sums' gradient is the gathered `[B, S, C]`, the bias's its sum
    /// over all `B·S` rows (complete on every rank: do not also pass the bias through
    /// [`SeqParallel::replicated`]), the residual's the rank's own `[B, S_r, C]`.
    ///
    /// # Errors
    /// As [`Collectives::reduce_scatter_seq`].
    pub fn scatter(&self, partial: &Tensor, bias: &Tensor, residual: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let out = self.comm.reduce_scatter_seq(partial, &self.splits, Some(bias), residual)?;
        let grad = ScatterGrad { sp: self.clone(), residual: residual.is_some() };
        match residual {
            Some(res) => attach(&[partial, bias, res], crate::ops::tensor_result(&out)?, grad),
            None => attach(&[partial, bias], crate::ops::tensor_result(&out)?, grad),
        }
    }

    /// A weight replicated on every rank but applied to each rank's own shard (LayerNorm's
    /// weight and bias): the identity, whose backward sums the gradient over the ranks, so
    /// that every rank steps its copy by the same, complete gradient (Megatron's all-reduce of
    /// `sequence_parallel` parameters, here inside the backward).
    ///
    /// # Errors
    /// candle's errors.
    pub fn replicated(&self, weight: &Tensor) -> candle_core::Result<Tensor> {
        attach(&[weight], crate::ops::tensor_result(weight)?, ReplicatedGrad(self.clone()))
    }
}

struct GatherGrad(SeqParallel);

impl Backward for GatherGrad {
    fn name(&self) -> &'static str {
        "mesa-seq-all-gather"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let sp = &self.0;
        Ok(vec![Some(sp.comm.reduce_scatter_seq(grad, &sp.splits, None, None)?)])
    }
}

struct ScatterGrad {
    sp: SeqParallel,
    residual: bool,
}

impl Backward for ScatterGrad {
    fn name(&self) -> &'static str {
        "mesa-seq-reduce-scatter"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let full = self.sp.comm.all_gather_seq(grad, &self.sp.splits)?;
        let d_bias = full.sum((0, 1))?;
        let mut grads = vec![Some(full), Some(d_bias)];
        if self.residual {
            grads.push(Some(grad.clone()));
        }
        Ok(grads)
    }
}

struct ReplicatedGrad(SeqParallel);

impl Backward for ReplicatedGrad {
    fn name(&self) -> &'static str {
        "mesa-replicated-weight"
    }
    fn backward(&self, _: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(self.0.comm.all_reduce_sum(grad)?)])
    }
}
