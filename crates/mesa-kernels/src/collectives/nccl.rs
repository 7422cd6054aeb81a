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
//! Views must be contiguous (NCCL takes flat buffers); a strided view is rejected with
//! [`Error::Unsupported`]. Offsets into a buffer are fine.
//!
//! Timeouts: NCCL's own (`NCCL_TIMEOUT`-style watchdogs are the framework's business); this
//! backend does not add a bound.
use std::ffi::c_void;
use std::panic::catch_unwind;

use cudarc::nccl::{result as nccl, sys as nsys};
use mesa_kernels_sys as sys;

use super::{RankView, RankViewMut, SeqSplits};
use crate::device::{Buffer, Device, DeviceMemoryMut, Kind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

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
    // SAFETY: only probes whether libnccl can be loaded.
    if unsafe { nsys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::LegacyUnsupported("NCCL backend: libnccl.so could not be loaded (install NCCL)".into()))
    }
}

fn nccl_err(what: &str, e: nccl::NcclError) -> Error {
    Error::LegacyCuda(format!("NCCL {what}: {:?}", e.0))
}

impl NcclUniqueId {
    /// A fresh id (`ncclGetUniqueId`), on the rank that creates the communicator.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when NCCL is not installed; NCCL errors as [`Error::Cuda`].
    pub fn new() -> Result<Self> {
        nccl_present()?;
        let id = catch_unwind(nccl::get_uniqueid)
            .map_err(|_| Error::LegacyUnsupported("NCCL backend: ncclGetUniqueId is missing from libnccl".into()))?
            .map_err(|e| nccl_err("get unique id", e))?;
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
    /// [`Error::Shape`] unless exactly 128 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bytes: [u8; 128] = bytes
            .try_into()
            .map_err(|_| Error::LegacyShape(format!("an NCCL id has 128 bytes, got {}", bytes.len())))?;
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

fn contiguous_bh(layout: &crate::layout::Layout, rows: usize, what: &str) -> Result<(usize, usize)> {
    let (b, h) = super::bh_of(layout, rows, what)?;
    if !layout.is_contiguous() {
        return Err(Error::LegacyUnsupported(format!(
            "NCCL backend: {what} must be a contiguous view (NCCL takes flat buffers); got strides {:?}",
            layout.strides()
        )));
    }
    Ok((b, h))
}

impl NcclSeqParallel {
    /// Joins the communicator `id` as `rank` of `world` (`ncclCommInitRank`; blocks until every
    /// rank has joined). `device` must be a CUDA device (one GPU per rank).
    ///
    /// # Errors
    /// [`Error::WrongBackend`] for the emulator, [`Error::Shape`] for `rank >= world`,
    /// [`Error::Unsupported`] without libnccl, NCCL errors as [`Error::Cuda`].
    pub fn new(device: &Device, rank: usize, world: usize, id: &NcclUniqueId) -> Result<Self> {
        let Kind::Cuda(stream) = device.kind() else {
            return Err(Error::LegacyWrongBackend("the NCCL backend needs a CUDA device".into()));
        };
        if world == 0 || rank >= world || world > i32::MAX as usize {
            return Err(Error::LegacyShape(format!("rank {rank} of a world of {world}")));
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
        .map_err(|_| Error::LegacyUnsupported("NCCL backend: ncclCommInitRank is missing from libnccl".into()))?
        .map_err(|e| nccl_err("comm init", e))?;
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
            Kind::Emulator => Err(Error::LegacyWrongBackend("the NCCL backend needs a CUDA device".into())),
        }
    }

    fn staging(slot: &mut Option<Buffer<f32>>, device: &Device, len: usize) -> Result<()> {
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            *slot = Some(device.alloc_zeros::<f32>(len.max(1))?);
        }
        Ok(())
    }

    /// Reduce-scatter along the sequence on this rank: `output = Σ_p input_p[rows of this rank]
    /// (+ bias) (+ residual)`. `input`: `[S, B, H]`; `output`, `residual`: `[S_r, B, H]`;
    /// `bias`: `[H]`; all contiguous. Every rank must call with the same `splits`.
    ///
    /// # Errors
    /// [`Error::Shape`], [`Error::Unsupported`] (strided views), [`Error::BufferTooShort`],
    /// [`Error::WrongBackend`], NCCL/CUDA errors as [`Error::Cuda`].
    pub fn reduce_scatter_seq<T: Element>(
        &mut self,
        input: &RankView<'_, T>,
        output: &mut RankViewMut<'_, T>,
        splits: &SeqSplits,
        bias: Option<&RankView<'_, T>>,
        residual: Option<&RankView<'_, T>>,
    ) -> Result<()> {
        self.check_world(splits)?;
        let (seq, rows) = (splits.total(), splits.rows(self.rank));
        let (b, h) = contiguous_bh(&input.layout, seq, "input")?;
        if contiguous_bh(&output.layout, rows, "output")? != (b, h) {
            return Err(Error::LegacyShape(format!(
                "output must be [{rows}, {b}, {h}], got {:?}",
                output.layout.shape()
            )));
        }
        input.layout.check_fits(input.mem.mem_ref().len(), "input")?;
        output.layout.check_fits(output.mem.mem_mut().len(), "output")?;
        if let Some(r) = residual {
            if contiguous_bh(&r.layout, rows, "residual")? != (b, h) {
                return Err(Error::LegacyShape(format!("residual must be [{rows}, {b}, {h}]")));
            }
            r.layout.check_fits(r.mem.mem_ref().len(), "residual")?;
        }
        if let Some(bv) = bias {
            if bv.layout.shape() != [h] || (h > 1 && bv.layout.strides()[0] != 1) {
                return Err(Error::LegacyShape(format!("bias must be a contiguous [{h}]")));
            }
            bv.layout.check_fits(bv.mem.mem_ref().len(), "bias")?;
        }
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
        let device = &self.device;
        let in_mem = input.mem.mem_ref();
        let in_p = device.read_ptr(&in_mem, input.layout.offset(), "input")?;
        let out_offset = output.layout.offset();
        let mut out_mem = output.mem.mem_mut();
        let out_p = device.write_ptr(&mut out_mem, out_offset, "output")?;
        let res_mem = residual.map(|r| r.mem.mem_ref());
        let res_p = match (&res_mem, residual) {
            (Some(m), Some(r)) => Some(device.read_ptr(m, r.layout.offset(), "residual")?),
            _ => None,
        };
        let bias_mem = bias.map(|r| r.mem.mem_ref());
        let bias_p = match (&bias_mem, bias) {
            (Some(m), Some(r)) => Some(device.read_ptr(m, r.layout.offset(), "bias")?),
            _ => None,
        };
        let (mut sin_mem, mut sout_mem) =
            (self.staging_in.as_mut().map(|b| b.mem_mut()), self.staging_out.as_mut().map(|b| b.mem_mut()));
        let sin_p = match (&mut sin_mem, widen) {
            (Some(m), true) => Some(device.write_ptr(m, 0, "staging")?),
            _ => None,
        };
        let sout_p = match (&mut sout_mem, widen) {
            (Some(m), true) => Some(device.write_ptr(m, 0, "staging")?),
            _ => None,
        };

        // 1. (widen) input -> f32 staging
        let (send, recv, dtype) = match (&sin_p, &sout_p) {
            (Some(si), Some(so)) => {
                let args = sys::MesaSeqParEpilogueArgs {
                    src: in_p.addr as *const c_void,
                    dst: si.addr,
                    bias: std::ptr::null(),
                    residual: std::ptr::null(),
                    n: (seq * bh) as i64,
                    hidden: h as i64,
                    src_dtype: T::DTYPE.to_sys(),
                    dst_dtype: DType::F32.to_sys(),
                };
                // SAFETY: input holds seq·bh elements (check_fits), the staging buffer at least
                // as many f32 (allocated above).
                unsafe {
                    device.launch("seqpar_epilogue", &args, sys::mesa_seqpar_epilogue, sys::mesa_emu_seqpar_epilogue)?
                };
                (si.addr as *const c_void, so.addr, DType::F32)
            }
            _ => (in_p.addr as *const c_void, out_p.addr, T::DTYPE),
        };
        // 2. the reduction
        let elem = dtype.size_in_bytes();
        let even = (0..self.world).all(|r| splits.rows(r) == rows);
        // SAFETY: send holds seq·bh elements of `dtype`; recv holds rows·bh; every shard range
        // [o_p·bh, (o_p + S_p)·bh) lies inside send. Pointers are device memory of this
        // communicator's device; the calls are enqueued on its stream.
        unsafe {
            if even {
                nccl::reduce_scatter(
                    send,
                    recv,
                    rows * bh,
                    nccl_dtype(dtype),
                    nsys::ncclRedOp_t::ncclSum,
                    self.comm,
                    stream,
                )
                .map_err(|e| nccl_err("reduce-scatter", e))?;
            } else {
                nccl::group_start().map_err(|e| nccl_err("group start", e))?;
                let mut status = Ok(());
                for p in 0..self.world {
                    let count = splits.rows(p) * bh;
                    if count == 0 {
                        continue;
                    }
                    let src = (send as *const u8).add(splits.offset(p) * bh * elem) as *const c_void;
                    let r = nccl::reduce(
                        src,
                        recv,
                        count,
                        nccl_dtype(dtype),
                        nsys::ncclRedOp_t::ncclSum,
                        p as i32,
                        self.comm,
                        stream,
                    );
                    if let Err(e) = r {
                        status = Err(nccl_err("reduce", e));
                        break;
                    }
                }
                let end = nccl::group_end().map_err(|e| nccl_err("group end", e));
                status?;
                end?;
            }
        }
        // 3. epilogue: f32 staging -> output (+ bias, + residual), or in place on the output
        if widen || bias_p.is_some() || res_p.is_some() {
            let args = sys::MesaSeqParEpilogueArgs {
                src: recv as *const c_void,
                dst: out_p.addr,
                bias: bias_p.as_ref().map_or(std::ptr::null(), |p| p.addr as *const c_void),
                residual: res_p.as_ref().map_or(std::ptr::null(), |p| p.addr as *const c_void),
                n: (rows * bh) as i64,
                hidden: h as i64,
                src_dtype: dtype.to_sys(),
                dst_dtype: T::DTYPE.to_sys(),
            };
            // SAFETY: src (staging or the output itself, read then written by the same thread)
            // and dst hold rows·bh elements, residual rows·bh, bias h (checked above).
            unsafe {
                device.launch("seqpar_epilogue", &args, sys::mesa_seqpar_epilogue, sys::mesa_emu_seqpar_epilogue)?
            };
        }
        Ok(())
    }

    /// All-gather along the sequence on this rank: `output[rows of p] = input_p` for every rank.
    /// `input`: `[S_r, B, H]`; `output`: `[S, B, H]`; contiguous. A bit copy (no arithmetic).
    ///
    /// # Errors
    /// As [`NcclSeqParallel::reduce_scatter_seq`].
    pub fn all_gather_seq<T: Element>(
        &mut self,
        input: &RankView<'_, T>,
        output: &mut RankViewMut<'_, T>,
        splits: &SeqSplits,
    ) -> Result<()> {
        self.check_world(splits)?;
        let (seq, rows) = (splits.total(), splits.rows(self.rank));
        let (b, h) = contiguous_bh(&input.layout, rows, "input")?;
        if contiguous_bh(&output.layout, seq, "output")? != (b, h) {
            return Err(Error::LegacyShape(format!(
                "output must be [{seq}, {b}, {h}], got {:?}",
                output.layout.shape()
            )));
        }
        input.layout.check_fits(input.mem.mem_ref().len(), "input")?;
        output.layout.check_fits(output.mem.mem_mut().len(), "output")?;
        let bh = b * h;
        if seq == 0 || bh == 0 {
            return Ok(());
        }
        let stream = self.stream()?;
        let device = &self.device;
        let in_mem = input.mem.mem_ref();
        let in_p = device.read_ptr(&in_mem, input.layout.offset(), "input")?;
        let out_offset = output.layout.offset();
        let mut out_mem = output.mem.mem_mut();
        let out_p = device.write_ptr(&mut out_mem, out_offset, "output")?;
        let elem = T::DTYPE.size_in_bytes();
        let even = (0..self.world).all(|r| splits.rows(r) == rows);
        // SAFETY: input holds rows·bh elements, output seq·bh; shard p's range lies inside it.
        unsafe {
            if even {
                nccl::all_gather(
                    in_p.addr as *const c_void,
                    out_p.addr,
                    rows * bh,
                    nccl_dtype(T::DTYPE),
                    self.comm,
                    stream,
                )
                .map_err(|e| nccl_err("all-gather", e))?;
            } else {
                nccl::group_start().map_err(|e| nccl_err("group start", e))?;
                let mut status = Ok(());
                for p in 0..self.world {
                    let count = splits.rows(p) * bh;
                    if count == 0 {
                        continue;
                    }
                    let dst = (out_p.addr as *mut u8).add(splits.offset(p) * bh * elem) as *mut c_void;
                    let r = nccl::broadcast(
                        in_p.addr as *const c_void,
                        dst,
                        count,
                        nccl_dtype(T::DTYPE),
                        p as i32,
                        self.comm,
                        stream,
                    );
                    if let Err(e) = r {
                        status = Err(nccl_err("broadcast", e));
                        break;
                    }
                }
                let end = nccl::group_end().map_err(|e| nccl_err("group end", e));
                status?;
                end?;
            }
        }
        Ok(())
    }

    /// In-place sum over ranks of a flat buffer (`ncclAllReduce`, input dtype): the all-reduce
    /// that the gradients of sequence-parallel LayerNorm weights need (each rank saw other
    /// tokens of the same replicated weights).
    ///
    /// # Errors
    /// [`Error::WrongBackend`], NCCL errors as [`Error::Cuda`].
    pub fn all_reduce_sum<T: Element>(&mut self, data: &mut (impl DeviceMemoryMut<T> + ?Sized)) -> Result<()> {
        let stream = self.stream()?;
        let mut mem = data.mem_mut();
        let n = mem.len();
        if n == 0 {
            return Ok(());
        }
        let p = self.device.write_ptr(&mut mem, 0, "data")?;
        // SAFETY: `p` addresses n elements of T on this communicator's device.
        unsafe {
            nccl::all_reduce(
                p.addr as *const c_void,
                p.addr,
                n,
                nccl_dtype(T::DTYPE),
                nsys::ncclRedOp_t::ncclSum,
                self.comm,
                stream,
            )
            .map_err(|e| nccl_err("all-reduce", e))?;
        }
        Ok(())
    }

    fn check_world(&self, splits: &SeqSplits) -> Result<()> {
        if splits.world_size() != self.world {
            return Err(Error::LegacyShape(format!(
                "{} split sizes for a communicator of {} ranks",
                splits.world_size(),
                self.world
            )));
        }
        Ok(())
    }
}
