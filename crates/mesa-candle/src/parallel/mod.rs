//! Tensor and sequence parallelism inside candle's autograd (Korthikanti et al. 2022, §4.2.2):
//! the conjugate collectives `g` (all-gather along the sequence in the forward, reduce-scatter
//! in the backward) and `ḡ` (reduce-scatter in the forward, all-gather in the backward), the
//! ranks that run them, and linear attention across sequence shards ([`lasp`]; with decay,
//! [`gated_lasp`]).
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
pub mod gated_lasp;
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

/// `result`, after telling the peers when it is an error of this rank's own (bad input, a
/// kernel's error): they return [`crate::Fault::PeerFailed`] at once instead of waiting for
/// this rank at their next collective until the timeout. An [`Error::Collective`] every rank
/// has already got is passed on as it is.
pub(crate) fn tell_peers<T>(comm: &dyn Collectives, result: candle_core::Result<T>) -> candle_core::Result<T> {
    if let Err(e) = &result {
        if !matches!(crate::error::as_mesa_error(e), Some(Error::Collective { .. })) {
            comm.fail(&e.to_string());
        }
    }
    result
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

    /// `g` followed by a column-parallel linear: `gather(shard)·Wᵀ + b`, `[B, S_r, C]` →
    /// `[B, S, N]` for the rank's `W: [N, C]`, `b: [N]`. The same values as
    /// `gather(shard).broadcast_matmul(&W.t())+b`, but the op keeps only the shard for its
    /// backward, not the all-gathered `[B, S, C]`: the backward all-gathers the shard again
    /// for `dW = dyᵀ·x`, and reduce-scatters `dy·W` into the shard's gradient (Korthikanti
    /// et al. 2022, §4.2.2: what sequence parallelism saves is the replicated input of the
    /// first linear, `4sbh` of the `10sbh`). Several projections of one input (Q, K, V) share
    /// one call with their weights concatenated.
    ///
    /// # Errors
    /// [`Error::Shape`] for a weight or bias that does not fit; as
    /// [`Collectives::all_gather_seq`].
    pub fn column_linear(&self, shard: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        tell_peers(self.comm.as_ref(), self.column_linear_inner(shard, weight, bias))
    }

    fn column_linear_inner(&self, shard: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        let (n, c) = weight.dims2()?;
        if shard.dims().last() != Some(&c) || bias.dims() != [n] {
            return Err(Error::Shape {
                what: "column-parallel linear: weight [N, C], bias [N] for an input [B, S_r, C]".into(),
                expected: vec![n, shard.dims().last().copied().unwrap_or(0)],
                got: weight.dims().to_vec(),
            }
            .into());
        }
        let full = self.comm.all_gather_seq(&shard.detach(), &self.splits)?;
        let y = full.broadcast_matmul(&weight.detach().t()?)?.broadcast_add(&bias.detach())?;
        drop(full);
        attach(&[shard, weight, bias], crate::ops::tensor_result(&y)?, ColumnLinearGrad(self.clone()))
    }

    /// A row-parallel linear followed by `ḡ`: `Σ_ranks (x·Wᵀ)[rows of r] + b`, `[B, S, K]`
    /// (the rank's `K` input features, e.g. its heads' attention output) → `[B, S_r, N]` for
    /// the rank's `W: [N, K]` and the replicated `b: [N]`. The same values as
    /// `scatter(&x.broadcast_matmul(&W.t()), b, None)`, but the partial product `[B, S, N]` is
    /// not kept for the backward (a `scatter` after a separate matmul keeps it as its
    /// argument): the backward all-gathers the output gradient and computes `dx = dy·W`,
    /// `dW = dyᵀ·x` and `db = Σ dy` (complete on every rank).
    ///
    /// # Errors
    /// [`Error::Shape`] for a weight or bias that does not fit; as
    /// [`Collectives::reduce_scatter_seq`].
    pub fn row_linear(&self, input: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        tell_peers(self.comm.as_ref(), self.row_linear_inner(input, weight, bias))
    }

    fn row_linear_inner(&self, input: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        let (n, k) = weight.dims2()?;
        if input.dims().last() != Some(&k) || bias.dims() != [n] {
            return Err(Error::Shape {
                what: "row-parallel linear: weight [N, K], bias [N] for an input [B, S, K]".into(),
                expected: vec![n, input.dims().last().copied().unwrap_or(0)],
                got: weight.dims().to_vec(),
            }
            .into());
        }
        let partial = input.detach().broadcast_matmul(&weight.detach().t()?)?;
        let out = self.comm.reduce_scatter_seq(&partial, &self.splits, Some(&bias.detach()), None)?;
        drop(partial);
        attach(&[input, weight, bias], crate::ops::tensor_result(&out)?, RowLinearGrad(self.clone()))
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

struct ColumnLinearGrad(SeqParallel);

impl Backward for ColumnLinearGrad {
    fn name(&self) -> &'static str {
        "mesa-seq-column-linear"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let sp = &self.0;
        let (shard, weight) = (args[0].detach(), args[1].detach());
        let (n, c) = weight.dims2()?;
        let dy = grad.reshape(((), n))?;
        // the input again (not kept by the forward), then the weight's and bias's gradients
        let full = sp.comm.all_gather_seq(&shard, &sp.splits)?;
        let d_weight = dy.t()?.matmul(&full.reshape(((), c))?)?;
        drop(full);
        let d_bias = dy.sum(0)?;
        let (b, s) = (grad.dim(0)?, grad.dim(1)?);
        let d_full = dy.matmul(&weight)?.reshape((b, s, c))?;
        let d_shard = sp.comm.reduce_scatter_seq(&d_full, &sp.splits, None, None)?;
        Ok(vec![Some(d_shard), Some(d_weight), Some(d_bias)])
    }
}

struct RowLinearGrad(SeqParallel);

impl Backward for RowLinearGrad {
    fn name(&self) -> &'static str {
        "mesa-seq-row-linear"
    }
    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let sp = &self.0;
        let (input, weight) = (args[0].detach(), args[1].detach());
        let (n, k) = weight.dims2()?;
        let dy = sp.comm.all_gather_seq(grad, &sp.splits)?.reshape(((), n))?;
        let d_weight = dy.t()?.matmul(&input.reshape(((), k))?)?;
        let d_bias = dy.sum(0)?;
        let d_input = dy.matmul(&weight)?.reshape(input.shape())?;
        Ok(vec![Some(d_input), Some(d_weight), Some(d_bias)])
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
