//! [`Collectives`] of one rank per process and GPU on an NCCL communicator
//! (`mesa_kernels::collectives::nccl::NcclSeqParallel`, features `nccl` and `cuda`).
//!
//! NCCL takes contiguous `[S, B, C]` buffers: a `[B, S_r, C]` candle tensor is copied to its
//! sequence-first layout before the call and the result back after it (two copies of the
//! shard per call; a layer written sequence-first would need none). Sums follow NCCL's order
//! in f32 ([`mesa_kernels::collectives::nccl::Accumulation::F32`]): not bitwise the intra-node
//! kernel's rank order. NCCL has no timeout of its own here: a rank that never arrives hangs
//! its peers until the framework aborts the communicator; [`Collectives::fail`] only refuses
//! this rank's later calls (docs/sequence_parallel.md, "NCCL backend").
use std::sync::Mutex;

use candle_core::{Shape, Tensor};
use mesa_kernels::collectives::nccl::{NcclSeqParallel, NcclUniqueId, ShardEpilogue};
use mesa_kernels::SeqSplits;

use super::Collectives;
use crate::bridge::{dispatch_float, kernel_device, KernelFloat, Output, View};
use crate::error::{Error, Fault, KernelResult};

/// One rank of an NCCL group (module docs).
#[derive(Debug)]
pub struct NcclRank {
    rank: usize,
    world: usize,
    device: candle_core::Device,
    comm: Mutex<NcclSeqParallel>,
    failed: Mutex<Option<String>>,
}

impl NcclRank {
    /// Rank `rank` of `world` on candle's CUDA `device` (its stream), joining the
    /// communicator of `id` (made by rank 0 with `NcclUniqueId::new` and shared out of band).
    ///
    /// # Errors
    /// [`Error::UnsupportedDevice`] for a non-CUDA device; NCCL's errors as [`Error::Kernel`]
    /// (`Unsupported` when libnccl cannot be loaded).
    pub fn new(device: &candle_core::Device, rank: usize, world: usize, id: &NcclUniqueId) -> Result<Self, Error> {
        if !device.is_cuda() {
            return Err(Error::UnsupportedDevice { op: "NcclRank", device: format!("{:?}", device.location()) });
        }
        let kernels =
            kernel_device(device).map_err(|e| Error::InvalidArgument { name: "device", why: e.to_string() })?;
        let comm = NcclSeqParallel::new(&kernels, rank, world, id)?;
        Ok(NcclRank { rank, world, device: device.clone(), comm: Mutex::new(comm), failed: Mutex::new(None) })
    }

    fn run<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut NcclSeqParallel) -> candle_core::Result<R>,
    ) -> Result<R, Error> {
        if let Some(why) = self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() {
            return Err(Error::Collective { op, fault: Fault::PeerFailed { rank: self.rank }, why });
        }
        let mut comm = self.comm.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut comm).map_err(|e| match crate::error::as_mesa_error(&e) {
            Some(m) => m.clone(),
            None => Error::Collective { op, fault: Fault::Mismatch, why: e.to_string() },
        })
    }
}

/// `[B, S, C]` → a dense `[S, B, C]` copy.
fn seq_first(t: &Tensor) -> candle_core::Result<Tensor> {
    t.transpose(0, 1)?.contiguous()
}

fn gather<T: KernelFloat>(
    comm: &mut NcclSeqParallel,
    device: &candle_core::Device,
    shard: &Tensor,
    splits: &SeqSplits,
) -> candle_core::Result<Tensor> {
    let kernels = kernel_device(device)?;
    let (b, _, c) = shard.dims3()?;
    let input = seq_first(shard)?;
    let mut out = Output::<T>::zeros(device, &kernels, &Shape::from((splits.total(), b, c)))?;
    {
        let view = View::of(&input)?;
        comm.all_gather_seq(&view.tensor_ref::<T>()?, &mut out.tensor_mut()?, splits).k()?;
    }
    out.into_tensor()?.transpose(0, 1)?.contiguous()
}

fn scatter<T: KernelFloat>(
    comm: &mut NcclSeqParallel,
    device: &candle_core::Device,
    partial: &Tensor,
    splits: &SeqSplits,
    rows: usize,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let kernels = kernel_device(device)?;
    let (b, _, c) = partial.dims3()?;
    let input = seq_first(partial)?;
    let residual = residual.map(seq_first).transpose()?;
    let bias = bias.map(Tensor::contiguous).transpose()?;
    let mut out = Output::<T>::zeros(device, &kernels, &Shape::from((rows, b, c)))?;
    {
        let (iv, rv, bv) =
            (View::of(&input)?, residual.as_ref().map(View::of).transpose()?, bias.as_ref().map(View::of).transpose()?);
        let (ir, rr, br) = (
            iv.tensor_ref::<T>()?,
            rv.as_ref().map(View::tensor_ref::<T>).transpose()?,
            bv.as_ref().map(View::tensor_ref::<T>).transpose()?,
        );
        let epilogue = ShardEpilogue { bias: br.as_ref(), residual: rr.as_ref() };
        comm.reduce_scatter_seq(&ir, &mut out.tensor_mut()?, splits, &epilogue).k()?;
    }
    out.into_tensor()?.transpose(0, 1)?.contiguous()
}

/// The sum over ranks: a reduce-scatter of the flattened `[1, n, 1]` tensor into even shards,
/// then an all-gather (as the thread backend).
fn all_reduce<T: KernelFloat>(
    comm: &mut NcclSeqParallel,
    device: &candle_core::Device,
    x: &Tensor,
) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    let world = comm.world_size();
    let sizes: Vec<usize> = (0..world).map(|r| n / world + usize::from(r < n % world)).collect();
    let splits = SeqSplits::new(&sizes).k()?;
    let flat = x.flatten_all()?.reshape((1, n, 1))?;
    let shard = scatter::<T>(comm, device, &flat, &splits, sizes[comm.rank()], None, None)?;
    gather::<T>(comm, device, &shard, &splits)?.reshape(x.shape())
}

impl Collectives for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather_seq(&self, shard: &Tensor, splits: &[usize]) -> Result<Tensor, Error> {
        let splits = SeqSplits::new(splits)?;
        self.run("all_gather_seq", |comm| {
            dispatch_float!(shard.dtype(), "all_gather_seq", T => gather::<T>(comm, &self.device, shard, &splits))
        })
    }

    fn reduce_scatter_seq(
        &self,
        partial: &Tensor,
        splits: &[usize],
        bias: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor, Error> {
        let rows = splits.get(self.rank).copied().unwrap_or(0);
        let splits = SeqSplits::new(splits)?;
        self.run("reduce_scatter_seq", |comm| {
            dispatch_float!(partial.dtype(), "reduce_scatter_seq", T => scatter::<T>(comm, &self.device, partial, &splits, rows, bias, residual))
        })
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor, Error> {
        self.run(
            "all_reduce_sum",
            |comm| dispatch_float!(x.dtype(), "all_reduce_sum", T => all_reduce::<T>(comm, &self.device, x)),
        )
    }

    fn fail(&self, why: &str) {
        *self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(format!("rank {} failed: {why}", self.rank));
    }
}
