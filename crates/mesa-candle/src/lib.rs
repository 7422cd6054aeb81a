//! # mesa-candle
//!
//! mesa-kernels inside candle (candle-core 0.11): a zero-copy bridge from candle's devices,
//! storage and layouts to the kernels' devices and tensor views ([`View`], [`Output`],
//! [`kernel_device`]); ops with forward and backward in candle's autograd ([`ops`]; gated linear attention with
//! grouped heads: [`ops::GatedLinearAttention`]), also as
//! candle-nn's layers and constructors ([`nn`]); and a
//! transformer layer as one op that keeps only codes for backward ([`layer`]); checkpoint
//! regions, which make any candle code keep only its input for backward ([`region`]); tensor and
//! sequence parallelism — ranks, the conjugate collectives in autograd, the sharded layer,
//! linear attention across sequence shards ([`parallel`], `docs/sequence_parallel.md`); the
//! bytes a stack of them keeps, predicted ([`plan`]). How they fit and what was measured:
//! `docs/candle.md`.
//!
//! # Stream contract
//!
//! A CPU tensor runs on the kernels' host emulation (synchronously, on candle's memory). A
//! CUDA tensor (feature `cuda`) runs on the stream of its candle `CudaDevice`: the kernels are
//! enqueued in program order with candle's own kernels on that one stream, so they see
//! everything candle wrote before and candle sees what they wrote, with no event and no host
//! synchronisation; memory stays owned by candle (inputs are borrowed through read locks,
//! outputs become candle storage). Tensors of one op must share a device
//! ([`Error::DeviceMismatch`]).
//!
//! # Swapping a layer
//!
//! The repository's README ("Using it from candle") shows how a candle model swaps its
//! transformer layer for [`TransformerLayer`] in a few lines; `examples/candle_layer.rs`
//! does it (weights loaded by name with [`TransformerLayer::from_tensors`]) and prints the
//! measured bytes and gradient parity.
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

mod attach;
mod bridge;
mod error;
pub mod layer;
pub mod nn;
pub mod ops;
pub mod parallel;
pub mod plan;
pub mod region;

pub use bridge::{kernel_device, kernel_layout, KernelFloat, Output, View};
pub use error::{as_mesa_error, Error, Fault};
pub use layer::{LayerConfig, TransformerLayer};
pub use mesa_kernels::CountingAllocator;
pub use ops::GatedLinearAttention;
