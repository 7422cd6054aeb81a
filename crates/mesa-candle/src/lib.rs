//! # mesa-candle
//!
//! mesa-kernels inside candle (candle-core 0.11): a zero-copy bridge from candle's devices,
//! storage and layouts to the kernels' devices and tensor views ([`View`], [`Output`],
//! [`kernel_device`]); ops with forward and backward in candle's autograd ([`ops`]); and a
//! transformer layer as one op that keeps only codes for backward ([`layer`]); the bytes a
//! stack of them keeps, predicted ([`plan`]). How they fit
//! and what was measured: `docs/candle.md`.
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
//! ```no_run
//! use candle_core::{Device, Module, Tensor};
//! use mesa_candle::layer::{LayerConfig, NormPlacement, Recompute, TransformerLayer};
//!
//! fn main() -> candle_core::Result<()> {
//!     let device = Device::Cpu; // a CUDA device with the `cuda` feature: candle's own stream
//!     let tensors = candle_core::safetensors::load("model.safetensors", &device)?;
//!     let config = LayerConfig { norm: NormPlacement::Pre, recompute: Recompute::Selective, bits: 8, ..LayerConfig::new(768, 12, 3072) };
//!     // was: a block of candle-nn Linear / LayerNorm / softmax ops reading "h.0.attn.q_proj.weight", …
//!     let layer = TransformerLayer::from_tensors(config, &tensors, "h.0.", &device)?;
//!     let x = Tensor::randn(0f32, 1.0, (2, 128, 768), &device)?;
//!     let y = layer.forward(&x)?; // one node of candle's graph over (x, layer.params())
//!     let grads = y.sum_all()?.backward()?; // every gradient from codes, our kernels and candle's matmuls
//!     let _flat = grads.get(layer.params().as_tensor()); // named by layer.layout().unflatten(..)
//!     Ok(())
//! }
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

mod attach;
mod bridge;
mod error;
pub mod layer;
pub mod memory;
pub mod ops;
pub mod plan;

pub use bridge::{kernel_device, kernel_layout, KernelFloat, Output, View};
pub use error::{as_mesa_error, Error};
pub use layer::{LayerConfig, TransformerLayer};
pub use memory::CountingAllocator;
