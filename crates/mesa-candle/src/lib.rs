//! # mesa-candle
//!
//! mesa-kernels inside candle.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod attach;
mod bridge;
mod error;
pub mod layer;
pub mod memory;
pub mod ops;

pub use bridge::{kernel_device, kernel_layout, KernelFloat, Output, View};
pub use error::{as_mesa_error, Error};
pub use layer::{LayerConfig, TransformerLayer};
pub use memory::CountingAllocator;
