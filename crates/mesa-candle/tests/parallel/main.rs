//! Tensor and sequence parallelism in mesa-candle (`mesa_candle::parallel`), ranks as threads
//! on the host emulation: one test binary for the collectives and their faults
//! (`collectives`), the sharded layer (`layer`) and linear attention across sequence shards
//! (`lasp`). docs/sequence_parallel.md names what each test checks.
#[path = "../common/mod.rs"]
mod common;

mod collectives;
mod gated_lasp;
mod lasp;
mod layer;
