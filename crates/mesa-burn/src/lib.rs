//! mesa-kernels' activation-compressed ops inside burn 0.22.1.
//!
//! burn's autodiff keeps, for an op with a hand-written backward, only the state that op
//! chooses. The ops here choose 8-, 4- or 2-bit codes of the tensor their backward needs
//! (Mesa's activation compression) instead of that tensor, so a model that swaps burn's
//! `gelu`, `layer_norm`, `rms_norm`, `softmax` or `Linear` for these keeps `bits/8` bytes per element for backward
//! where it kept 4 (f32) or 2 (f16/bf16).
//!
//! * Functions: [`gelu`], [`layer_norm`], [`rms_norm`], [`linear`], [`softmax`] (with an
//!   optional additive mask), [`swiglu`]: `Tensor<D>` in, `Result<Tensor<D>>` out; every
//!   check runs before the op is dispatched ([`Error`]). [`linear_attention`]: the chunked
//!   kernels with their exact backward (it keeps its inputs, not codes).
//! * Modules: [`nn::Gelu`], [`nn::LayerNorm`], [`nn::RmsNorm`], [`nn::Linear`] with configs
//!   mirroring burn-nn's, plus the bits of the codes.
//! * [`plan`]: the bytes each op keeps for backward, and a transformer block's total
//!   ([`plan::TransformerBlockConfig`]), by arithmetic alone.
//! * Backends: `Flex` (burn's CPU backend) and `Autodiff<Flex>` with either checkpointing
//!   strategy. The kernels run on mesa-kernels' host emulator (the CUDA source compiled for
//!   the CPU). With the `cuda` feature every op also runs on burn's CUDA backend
//!   (`CubeBackend`, with and without autodiff; what an op keeps lives in cubecl's device
//!   memory; host-fenced: two host synchronisations per kernel call), and with the `fusion`
//!   feature on `Fusion<CubeBackend>` (burn's `fusion` feature: each kernel call a fusion
//!   custom operation running that code later on the fusion server). That code is
//!   **type-checked only, never built into a binary or run** (`docs/burn.md`).
//!
//! The forward is exact (the same kernel math as the full-precision op); only the backward
//! reads decoded codes, so gradients carry the quantization error: with nearest rounding
//! each decoded element is within `scale/2` of its value (`scale = (max − min)/(2^bits − 1)`
//! over the tensor).
#![warn(missing_docs)]

mod api;
mod autodiff;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
#[cfg(feature = "fusion")]
mod fusion;
mod host;
pub mod nn;
pub mod ops;
pub mod plan;
mod validate;

pub use api::{gelu, layer_norm, linear, linear_attention, rms_norm, softmax, swiglu};
pub use config::Codes;
pub use error::{Error, Result};
pub use mesa_kernels::linear_attention::{LinearAttentionConfig, MemoryMode, Schedule};
pub use mesa_kernels::{CountingAllocator, GeluForm, Rounding};
