//! NCCL backend of the sequence-parallel collectives (cargo feature `nccl`): one rank per
//! process (or per thread), one GPU per rank, on an NCCL communicator — for multi-GPU and
//! multi-node tensor-parallel groups. Same shapes, shards and epilogue as
//! [`SeqParallelGroup`](super::SeqParallelGroup); NCCL is loaded at run time (cudarc's
//! dynamic loading), so building needs neither NCCL nor a GPU.
//!
//! **Uneven shards.** `ncclReduceScatter` / `ncclAllGather` need equal counts per rank. When
//! every shard has the same size they are used directly. Otherwise the reduce-scatter is a
//! group (`ncclGroupStart/End`) of `W` `ncclReduce` calls, the one rooted at rank `p` reducing
//! rows `[o_p, o_p + S_p)` into `p`'s output, and the all-gather a group of `W`
//! `ncclBroadcast` calls from each shard's owner into every rank's output. No padding, no
//! extra copy, the same bytes on the wire as the equal-count collectives (each shard crosses
//! the ring once); NCCL schedules the grouped operations together. The alternative — padding
//! every shard to the largest, `W·max(S_r)·B·H` elements — moves up to `W·max/S` times the
//! data and needs a staging copy on both sides.
//!
//! **Accumulation.** NCCL reduces in the buffer's dtype: a bf16 reduce-scatter rounds to bf16
//! after every addition (and the order depends on NCCL's ring/tree schedule). With
//! [`Accumulation::F32`] (the default) 16-bit inputs are first widened to an f32 staging copy
//! (one elementwise kernel), NCCL sums f32, and the epilogue kernel adds bias and residual in
//! f32 and rounds once — the intra-node kernel's numerics, except that NCCL's summation order
//! is its own, so results agree within f32 rounding (not bitwise) with the intra-node kernel.
//! It doubles the bytes on the wire for 16-bit types. [`Accumulation::InputDtype`] sends the
//! 16-bit data as is (NCCL's own numerics, as Megatron with NCCL gets), and the epilogue, if
//! any, adds to the already rounded sum.
//!
//! Views are [`TensorRef`] / [`TensorMut`] and must be contiguous (NCCL takes flat buffers);
//! a strided view is rejected with [`Error::Unsupported`]. Offsets into a buffer are fine.
//! Every tensor of a call is registered on the crate's launch builder, which holds cudarc's
//! guards until the NCCL calls and kernels are enqueued and orders buffers of other streams.
//! In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]), except
//! [`NcclSeqParallel::all_reduce_sum`], which is in place by definition.
//!
//! Timeouts: NCCL's own (`NCCL_TIMEOUT`-style watchdogs are the framework's business); this
//! backend does not add a bound. NCCL errors are [`Error::CudaRuntime`] with the
//! `ncclResult_t` as `code`.
use std::ffi::c_void;
use std::panic::catch_unwind;

use cudarc::nccl::{result as nccl, sys as nsys};
use mesa_kernels_sys as sys;

use super::SeqSplits;
use crate::device::{Buffer, Device, DeviceMemoryMut, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::layout::Layout;
use crate::tensor::{TensorMut, TensorRef};

/// How the NCCL backend sums 16-bit data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulation {
    /// Widen to f32 before the reduction, round once after the epilogue (default).
    F32,
    /// Let NCCL sum in the input dtype (half the bytes on the wire; a rounding per addition).
    InputDtype,
}

/// The 128-byte NCCL unique id that every rank of a communicator must share (rank 0 creates it
/// and sends the bytes to the others: a file, a socket, the launcher's environment).
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    bytes: [u8; 128],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclUniqueId(..)")
    }
}

fn nccl_present() -> Result<()> {
    if crate::probe::library_present(crate::probe::NCCL) {
        Ok(())
    } else {
        Err(Error::unsupported("NCCL backend", "libnccl.so could not be loaded (install NCCL)"))
    }
}

fn nccl_err(op: &'static str, e: nccl::NcclError) -> Error {
    Error::CudaRuntime { op, code: e.0 as i32 }
}

impl NcclUniqueId {
    /// A fresh id (`ncclGetUniqueId`), on the rank that creates the communicator.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when NCCL is not installed; NCCL errors as
    /// [`Error::CudaRuntime`].
    pub fn new() -> Result<Self> {
        nccl_present()?;
        let id = catch_unwind(nccl::get_uniqueid)
            .map_err(|_| Error::unsupported("NCCL backend", "ncclGetUniqueId is missing from libnccl"))?
            .map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = *c as u8;
        }
        Ok(NcclUniqueId { bytes })
    }

    /// The id's bytes, to send to the other ranks.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.bytes
    }

    /// The id from the bytes rank 0 sent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless exactly 128 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bytes: [u8; 128] = bytes
            .try_into()
            .map_err(|_| Error::invalid_argument("NCCL id", format!("128 bytes, got {}", bytes.len())))?;
        Ok(NcclUniqueId { bytes })
    }
}

/// One rank of a sequence-parallel group on an NCCL communicator.
///
/// Stream-ordered on the device's stream; allocates f32 staging buffers on the first call
/// that needs them (and when a larger one is needed), kept for later calls.
pub struct NcclSeqParallel {
    comm: nsys::ncclComm_t,
    device: Device,
    rank: usize,
    world: usize,
    accumulation: Accumulation,
    staging_in: Option<Buffer<f32>>,
    staging_out: Option<Buffer<f32>>,
}

// SAFETY: the communicator handle is an opaque pointer NCCL lets any thread use, as long as
// calls on one communicator do not run concurrently (NCCL's thread-safety rule); every call
// takes `&mut self`, so moving the value to another thread cannot make two calls overlap.
// The other fields (device handle, buffers) are `Send` already.
unsafe impl Send for NcclSeqParallel {}

impl std::fmt::Debug for NcclSeqParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclSeqParallel(rank {}/{}, {:?})", self.rank, self.world, self.accumulation)
    }
}

impl Drop for NcclSeqParallel {
    fn drop(&mut self) {
        // errors cannot be reported from drop; the communicator is released either way
        let _ = self.device.synchronize();
        // SAFETY: `comm` came from ncclCommInitRank and is destroyed exactly once.
        let _ = catch_unwind(|| unsafe { nccl::comm_destroy(self.comm) });
    }
}

fn nccl_dtype(d: DType) -> nsys::ncclDataType_t {
    match d {
        DType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DType::BF16 => nsys::ncclDataType_t::ncclBfloat16,
    }
}

fn contiguous_bh(layout: &Layout, rows: usize, what: &str) -> Result<(usize, usize)> {
    let (b, h) = super::bh_of(layout, rows, what)?;
    if !layout.is_contiguous() {
        return Err(Error::unsupported(
            what,
            format!("the NCCL backend takes contiguous views (flat buffers); got strides {:?}", layout.strides()),
        ));
    }
    Ok((b, h))
}

/// The fused epilogue of this rank's reduce-scatter shard: `out = (Σ + bias[h]) + residual`.
#[derive(Debug)]
pub struct ShardEpilogue<'a, T> {
    /// The bias `[H]` (contiguous), or `None`.
    pub bias: Option<&'a TensorRef<'a, T>>,
    /// The residual `[S_r, B, H]` (contiguous), or `None`.
    pub residual: Option<&'a TensorRef<'a, T>>,
}

impl<T> ShardEpilogue<'_, T> {
    /// No epilogue.
    #[must_use]
    pub fn none() -> Self {
        ShardEpilogue { bias: None, residual: None }
    }
}

impl<T> Default for ShardEpilogue<'_, T> {
    fn default() -> Self {
        ShardEpilogue::none()
    }
}

impl NcclSeqParallel {
    /// Joins the communicator `id` as `rank` of `world` (`ncclCommInitRank`; blocks until every
    /// rank has joined). `device` must be a CUDA device (one GPU per rank).
    ///
    /// # Errors
    /// [`Error::WrongBackend`] for the emulator, [`Error::InvalidArgument`] for
    /// `rank >= world`, [`Error::Unsupported`] without libnccl, NCCL errors as
    /// [`Error::CudaRuntime`], driver errors as [`Error::Driver`].
    pub fn new(device: &Device, rank: usize, world: usize, id: &NcclUniqueId) -> Result<Self> {
        let Kind::Cuda(stream) = device.kind() else {
            return Err(Error::wrong_backend("NCCL backend", "it needs a CUDA device"));
        };
        if world == 0 || rank >= world || world > i32::MAX as usize {
            return Err(Error::invalid_argument("rank", format!("rank {rank} of a world of {world}")));
        }
        nccl_present()?;
        stream.context().bind_to_thread()?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(id.bytes.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let uid = nsys::ncclUniqueId { internal };
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is 128 bytes from ncclGetUniqueId.
        catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
            nccl::comm_init_rank(&mut comm, world as i32, uid, rank as i32)
        }))
        .map_err(|_| Error::unsupported("NCCL backend", "ncclCommInitRank is missing from libnccl"))?
        .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(NcclSeqParallel {
            comm,
            device: device.clone(),
            rank,
            world,
            accumulation: Accumulation::F32,
            staging_in: None,
            staging_out: None,
        })
    }

    /// This rank.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.world
    }
    /// How 16-bit data is summed.
    #[must_use]
    pub fn accumulation(&self) -> Accumulation {
        self.accumulation
    }
    /// Chooses how 16-bit data is summed (every rank must choose the same).
    pub fn set_accumulation(&mut self, a: Accumulation) {
        self.accumulation = a;
    }

    fn stream(&self) -> Result<nsys::cudaStream_t> {
        match self.device.kind() {
            Kind::Cuda(s) => {
                s.context().bind_to_thread()?;
                Ok(s.cu_stream() as nsys::cudaStream_t)
            }
            Kind::Emulator => Err(Error::wrong_backend("NCCL backend", "it needs a CUDA device")),
        }
    }

    fn staging(slot: &mut Option<Buffer<f32>>, device: &Device, len: usize) -> Result<()> {
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            *slot = Some(device.alloc_zeros::<f32>(len.max(1))?);
        }
        Ok(())
    }

    /// Reduce-scatter along the sequence on this rank: `output = Σ_p input_p[rows of this rank]
    /// (+ bias) (+ residual)`. `input`: `[S, B, H]`; `output`, residual: `[S_r, B, H]`;
    /// bias: `[H]`; all contiguous. Every rank must call with the same `splits`.
    /// Stream-ordered: the call returns once the work is enqueued.
    ///
    /// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (splits of another world size), [`Error::ShapeMismatch`],
    /// [`Error::InvalidLayout`], [`Error::Unsupported`] (strided views), [`Error::Aliasing`],
    /// [`Error::WrongBackend`], [`Error::Misaligned`], NCCL errors as [`Error::CudaRuntime`],
    /// driver errors as [`Error::Driver`].
    pub fn reduce_scatter_seq<T: Element>(
        &mut self,
        input: &TensorRef<'_, T>,
        output: &mut TensorMut<'_, T>,
        splits: &SeqSplits,
        epilogue: &ShardEpilogue<'_, T>,
    ) -> Result<()> {
        self.check_world(splits)?;
        let (seq, rows) = (splits.total(), splits.rows(self.rank));
        let (b, h) = contiguous_bh(input.layout(), seq, "input")?;
        if contiguous_bh(output.layout(), rows, "output")? != (b, h) {
            return Err(Error::shape_mismatch("output", &[rows, b, h], output.shape()));
        }
        if let Some(r) = epilogue.residual {
            if contiguous_bh(r.layout(), rows, "residual")? != (b, h) {
                return Err(Error::shape_mismatch("residual", &[rows, b, h], r.shape()));
            }
        }
        if let Some(bv) = epilogue.bias {
            if bv.shape() != [h] {
                return Err(Error::shape_mismatch("bias", &[h], bv.shape()));
            }
            if h > 1 && bv.layout().strides()[0] != 1 {
                return Err(Error::unsupported("bias", "the NCCL backend takes a contiguous bias"));
            }
        }
        // the views fit their buffers (TensorRef/TensorMut), so these products do not overflow
        let bh = b * h;
        if seq == 0 || bh == 0 {
            return Ok(());
        }
        let widen = self.accumulation == Accumulation::F32 && T::DTYPE != DType::F32;
        if widen {
            Self::staging(&mut self.staging_in, &self.device, seq * bh)?;
            Self::staging(&mut self.staging_out, &self.device, rows * bh)?;
        }
        let stream = self.stream()?;
        let NcclSeqParallel { device, comm, world, staging_in, staging_out, .. } = self;
        let (comm, world) = (*comm, *world);
        let mut launch = Launch::new(&*device);
        let in_p = launch.input(input, "input")?;
        let res_p = match epilogue.residual {
            Some(r) => launch.input(r, "residual")?,
            None => std::ptr::null(),
        };
        let bias_p = match epilogue.bias {
            Some(bv) => launch.input(bv, "bias")?,
            None => std::ptr::null(),
        };
        let out_p = launch.output(output, "output")?;
        let staging = match (widen, staging_in.as_mut(), staging_out.as_mut()) {
            (true, Some(si), Some(so)) => {
                Some((launch.write_buffer(si, "f32 staging input")?, launch.write_buffer(so, "f32 staging output")?))
            }
            _ => None,
        };

        // 1. (widen) input -> f32 staging
        let (send, recv, dtype) = match staging {
            Some((si, so)) => {
                let args = sys::MesaSeqParEpilogueArgs {
                    src: in_p,
                    dst: si.cast(),
                    bias: std::ptr::null(),
                    residual: std::ptr::null(),
                    n: (seq * bh) as i64,
                    hidden: h as i64,
                    src_dtype: T::DTYPE.to_sys(),
                    dst_dtype: DType::F32.to_sys(),
                };
                // SAFETY: registered on this builder: the input holds seq·bh elements (its
                // checked [S, B, H] contiguous view), the staging buffer at least as many f32.
                unsafe {
                    launch.launch("seqpar_epilogue", &args, sys::mesa_seqpar_epilogue, sys::mesa_emu_seqpar_epilogue)?
                };
                (si.cast_const().cast::<c_void>(), so.cast::<c_void>(), DType::F32)
            }
            None => (in_p, out_p, T::DTYPE),
        };
        // 2. the reduction
        let elem = dtype.size_in_bytes();
        let even = (0..world).all(|r| splits.rows(r) == rows);
        // SAFETY: send holds seq·bh elements of `dtype`, recv rows·bh (registered above; the
        // builder holds their guards until `finish`, after these calls are enqueued); every
        // shard range [o_p·bh, (o_p + S_p)·bh) lies inside send. Pointers are device memory of
        // this communicator's device; the calls are enqueued on the builder's stream.
        unsafe {
            if even {
                nccl::reduce_scatter(
                    send,
                    recv,
                    rows * bh,
                    nccl_dtype(dtype),
                    nsys::ncclRedOp_t::ncclSum,
                    comm,
                    stream,
                )
                .map_err(|e| nccl_err("ncclReduceScatter", e))?;
            } else {
                nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let mut status = Ok(());
                for p in 0..world {
                    let count = splits.rows(p) * bh;
                    if count == 0 {
                        continue;
                    }
                    let src = send.cast::<u8>().add(splits.offset(p) * bh * elem).cast::<c_void>();
                    let r = nccl::reduce(
                        src,
                        recv,
                        count,
                        nccl_dtype(dtype),
                        nsys::ncclRedOp_t::ncclSum,
                        p as i32,
                        comm,
                        stream,
                    );
                    if let Err(e) = r {
                        status = Err(nccl_err("ncclReduce", e));
                        break;
                    }
                }
                let end = nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
                status?;
                end?;
            }
        }
        // 3. epilogue: f32 staging -> output (+ bias, + residual), or in place on the output
        if widen || !bias_p.is_null() || !res_p.is_null() {
            let args = sys::MesaSeqParEpilogueArgs {
                src: recv.cast_const(),
                dst: out_p,
                bias: bias_p,
                residual: res_p,
                n: (rows * bh) as i64,
                hidden: h as i64,
                src_dtype: dtype.to_sys(),
                dst_dtype: T::DTYPE.to_sys(),
            };
            // SAFETY: src (the staging output, or the output itself: the kernel reads then
            // writes each element in the same thread, which its header allows) and dst hold
            // rows·bh elements, residual rows·bh, bias h; all registered on this builder.
            unsafe {
                launch.launch("seqpar_epilogue", &args, sys::mesa_seqpar_epilogue, sys::mesa_emu_seqpar_epilogue)?
            };
        }
        launch.finish()
    }

    /// All-gather along the sequence on this rank: `output[rows of p] = input_p` for every rank.
    /// `input`: `[S_r, B, H]`; `output`: `[S, B, H]`; contiguous. A bit copy (no arithmetic).
    /// Stream-ordered.
    ///
    /// In-place: not supported (overlapping inputs and outputs → [`Error::Aliasing`]).
    ///
    /// # Errors
    /// As [`NcclSeqParallel::reduce_scatter_seq`].
    pub fn all_gather_seq<T: Element>(
        &mut self,
        input: &TensorRef<'_, T>,
        output: &mut TensorMut<'_, T>,
        splits: &SeqSplits,
    ) -> Result<()> {
        self.check_world(splits)?;
        let (seq, rows) = (splits.total(), splits.rows(self.rank));
        let (b, h) = contiguous_bh(input.layout(), rows, "input")?;
        if contiguous_bh(output.layout(), seq, "output")? != (b, h) {
            return Err(Error::shape_mismatch("output", &[seq, b, h], output.shape()));
        }
        let bh = b * h;
        if seq == 0 || bh == 0 {
            return Ok(());
        }
        let stream = self.stream()?;
        let (comm, world) = (self.comm, self.world);
        let mut launch = Launch::new(&self.device);
        let in_p = launch.input(input, "input")?;
        let out_p = launch.output(output, "output")?;
        let elem = T::DTYPE.size_in_bytes();
        let even = (0..world).all(|r| splits.rows(r) == rows);
        // SAFETY: input holds rows·bh elements, output seq·bh (registered above, guards held
        // until `finish`); shard p's range lies inside the output.
        unsafe {
            if even {
                nccl::all_gather(in_p, out_p, rows * bh, nccl_dtype(T::DTYPE), comm, stream)
                    .map_err(|e| nccl_err("ncclAllGather", e))?;
            } else {
                nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let mut status = Ok(());
                for p in 0..world {
                    let count = splits.rows(p) * bh;
                    if count == 0 {
                        continue;
                    }
                    let dst = out_p.cast::<u8>().add(splits.offset(p) * bh * elem).cast::<c_void>();
                    let r = nccl::broadcast(in_p, dst, count, nccl_dtype(T::DTYPE), p as i32, comm, stream);
                    if let Err(e) = r {
                        status = Err(nccl_err("ncclBroadcast", e));
                        break;
                    }
                }
                let end = nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
                status?;
                end?;
            }
        }
        launch.finish()
    }

    /// In-place sum over ranks of a flat buffer (`ncclAllReduce`, input dtype): the all-reduce
    /// that the gradients of sequence-parallel LayerNorm weights need (each rank saw other
    /// tokens of the same replicated weights). In place by definition.
    ///
    /// # Errors
    /// [`Error::WrongBackend`], [`Error::Misaligned`], NCCL errors as [`Error::CudaRuntime`].
    pub fn all_reduce_sum<T: Element>(&mut self, data: &mut (impl DeviceMemoryMut<T> + ?Sized)) -> Result<()> {
        let stream = self.stream()?;
        let n = data.mem_mut().len();
        if n == 0 {
            return Ok(());
        }
        let mut view = TensorMut::contiguous(data, &[n])?;
        let comm = self.comm;
        let mut launch = Launch::new(&self.device);
        let p = launch.output(&mut view, "data")?;
        // SAFETY: `p` addresses n elements of T on this communicator's device, registered on
        // the builder (guard held until `finish`).
        unsafe {
            nccl::all_reduce(p.cast_const(), p, n, nccl_dtype(T::DTYPE), nsys::ncclRedOp_t::ncclSum, comm, stream)
                .map_err(|e| nccl_err("ncclAllReduce", e))?;
        }
        launch.finish()
    }

    fn check_world(&self, splits: &SeqSplits) -> Result<()> {
        if splits.world_size() != self.world {
            return Err(Error::invalid_argument(
                "splits",
                format!("{} split sizes for a communicator of {} ranks", splits.world_size(), self.world),
            ));
        }
        Ok(())
    }
}
