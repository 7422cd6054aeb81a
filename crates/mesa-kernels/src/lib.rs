//! # mesa-kernels
//!
//! Hand-written CUDA kernels with safe Rust bindings that make transformer training fit in
//! less GPU memory:
//!
//! * [`quant`]: activation compression (Mesa, Pan et al. 2021): exact forward, the copy
//!   saved for backward kept as 8/4/2-bit codes with per-head offset and scale learned by
//!   running estimates.
//! * [`collectives`]: sequence parallelism (Megatron, Korthikanti et al. 2022): reduce-scatter
//!   and all-gather of `[S, B, H]` along the sequence, intra-node kernel and NCCL backend.
//! * [`fused`]: GELU, softmax and LayerNorm whose forward writes the output and the codes of
//!   what backward needs in one pass, and whose backward reads the codes directly.
//! * [`linear_attention`] + [`feature_map`]: chunked causal and bidirectional linear
//!   attention (SLiM, Performer FAVOR+) with exact gradients and a saved state that can be
//!   independent of the sequence length.
//! * [`gated_linear_attention`]: causal linear attention with a decaying state (a log-decay per
//!   step or per head; RetNet, Mamba-2, GLA), grouped heads, exact gradients including the
//!   decay's (a first kernel on CUDA cores).
//! * [`plan`]: the activation-memory planner: bytes a layer keeps for backward per tensor,
//!   for each precision, parallelism and recomputation (Korthikanti et al. 2022, Table 2),
//!   and the largest micro-batch or sequence that fits a budget.
//!
//! Every op runs on a [`Device`]: a CUDA stream (through cudarc; candle's buffers and
//! streams pass straight in) or the host emulation, which compiles the same kernel source
//! for the CPU so that every test runs without a GPU. Tensors are given as [`TensorRef`]
//! (read) and [`TensorMut`] (written): memory of any kind plus a [`Layout`], checked when
//! the view is made. Errors are values ([`Error`]), checked before launch; nothing panics on
//! bad input. [`reference`](mod@reference) holds an independent f64
//! implementation of every op.
//!
//! # Stream contract
//!
//! * **Ops run on the device's stream.** Each op enqueues its kernels on the stream of the
//!   [`Device`] it is given and returns without synchronising with the host (the few methods
//!   that read results back say "synchronises"). No op allocates outside that stream, and
//!   none breaks CUDA-graph capture when all its buffers belong to the capturing stream.
//! * **A framework passes its own stream**: [`Device::from_stream`] (candle: the stream of its
//!   `CudaDevice`). Buffers of that stream need no event at all.
//! * **Host cost per op.** The builder of an op takes each buffer's address once
//!   (`device_ptr`): in a context that tracks events (cudarc's default once it has a second
//!   stream) that is one wait for the buffer's last write (two for a buffer the op writes:
//!   last write and last read) and one record after the kernels, per buffer; in a context
//!   that does not (candle's devices, and [`Device::cuda`], whose stream the crate manages
//!   alone) none. Beyond that, per kernel launch: binding the stream's context to the
//!   thread and the launch itself. Measured per op by the `host cost per op` group of
//!   `benches/quantize.rs` (GPU runs only).
//! * **Buffers last used on another stream are ordered by events, both ways.** For a cudarc
//!   buffer (`CudaSlice`/`CudaView`) whose stream differs from the op's, the op's stream first
//!   waits for everything enqueued on the buffer's stream so far, and after the op's kernels
//!   the buffer's stream waits for them; cudarc's read/write events are recorded after the
//!   kernels are enqueued. This holds whether or not the buffer's context tracks events
//!   (candle's default device does not), so such a buffer may be dropped, reused or written
//!   on its own stream right after the call. Buffers of another CUDA context (device) are
//!   rejected ([`Error::WrongBackend`]).
//! * **What the caller must still do**: for a [`RawDeviceSlice`] (no stream is known), keep
//!   the memory alive and unwritten until the op's stream has passed the op — the usual rule
//!   for a framework's own allocator on the same stream. Nothing for cudarc buffers. During
//!   CUDA-graph capture, give buffers of the capturing stream (an event wait on a stream
//!   outside the capture is not capturable).
//! * **Aliasing**: a written tensor whose address range (first to last element it can reach)
//!   overlaps the range of any other tensor of the same call is rejected
//!   ([`Error::Aliasing`]); no op computes in place. The test is conservative: two strided
//!   views that interleave in one buffer without sharing an element are rejected too.
//!
//! ```
//! use mesa_kernels::{Device, Layout, Quantizer, QuantConfig, TensorMut, TensorRef};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::best_available();
//! // an activation [B, N, H, D] = [2, 4, 3, 8]: one group per head (axis 2)
//! let shape = [2, 4, 3, 8];
//! let host: Vec<f32> = (0..2 * 4 * 3 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let x = device.upload(&host)?;
//! let layout = Layout::contiguous(&shape);
//!
//! let mut quantizer = Quantizer::new(&device, QuantConfig::per_head(2))?;
//! let saved = quantizer.quantize(&TensorRef::new(&x, &layout)?)?; // forward: 1 byte/element
//! assert!(saved.size_in_bytes() < host.len() * 4 / 3);
//!
//! let mut restored = device.alloc_zeros::<f32>(host.len())?; // backward: decode
//! saved.dequantize(&device, &mut TensorMut::new(&mut restored, &layout)?)?;
//! let restored = restored.to_vec()?;
//! let step = saved.params()?.iter().map(|p| p.scale).fold(0.0f32, f32::max);
//! assert!(host.iter().zip(&restored).all(|(a, b)| (a - b).abs() <= 0.5 * step * 1.0001));
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

pub mod collectives;
mod counting;
mod device;
mod dtype;
pub mod emulator;
mod error;
pub mod feature_map;
pub mod fused;
pub mod gated_linear_attention;
mod host_buffer;
mod launch;
mod layout;
pub mod linear_attention;
pub mod plan;
mod probe;
pub mod quant;
pub mod reference;
pub mod rope;
mod tensor;

pub use collectives::{Epilogue, SeqParallelGroup, SeqSplits};
pub use counting::CountingAllocator;
pub use device::{
    Buffer, Device, DeviceMemory, DeviceMemoryMut, DeviceProperties, MemMut, MemRef, RawDeviceSlice, Storage,
};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use fused::{GeluForm, SavedLayerNorm, SoftmaxCodes, SoftmaxSave};
pub use host_buffer::{observe_host_memory, HostBuffer, HostMemoryObserver};
pub use layout::{Grouping, Layout, MAX_DIMS};
pub use quant::{
    saved_sizes, Companding, GroupParams, QuantConfig, Quantizer, Rounding, SavedActivation, SavedMeta, SavedSizes,
    SavedView, SavedViewMut, StatsMode,
};
pub use tensor::{TensorMut, TensorRef};

/// Build facts of the linked kernel library.
pub mod build {
    /// True when the CUDA kernels were compiled into this build.
    pub const CUDA_BUILT: bool = mesa_kernels_sys::CUDA_BUILT;
    /// Architectures of the CUDA build (`MESA_CUDA_ARCHS`), empty without CUDA.
    pub const CUDA_ARCHS: &str = mesa_kernels_sys::CUDA_ARCHS;
}

/// The README's examples, compiled and run as doc-tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
