//! Shared test helpers: the backends every test body runs on, seeded random data, the
//! fixture's location.
#![allow(dead_code)]

use std::path::PathBuf;

use mesa_kernels::{DType, Device};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// True when `MESA_REQUIRE_GPU=1`: a missing GPU is then a failure, not a skip.
pub fn require_gpu() -> bool {
    std::env::var("MESA_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The emulator, with its checks on (shuffled schedules, poisoned and guarded memory, barrier,
/// shuffle and launch-bounds checks) unless `MESA_EMU_CHECK` says otherwise: see
/// `docs/emulator.md`. A failed check is an `Error::EmulatorCheck` from the launch.
pub fn emulator() -> Device {
    mesa_kernels::emulator::enable_for_tests();
    Device::emulator()
}

/// The emulator always (checks on, [`emulator`]); CUDA device 0 when one is usable. A missing GPU is reported on
/// stderr as a skip, or fails the test under `MESA_REQUIRE_GPU=1`.
pub fn backends() -> Vec<Device> {
    let mut v = vec![emulator()];
    match Device::cuda(0) {
        Ok(d) => v.push(d),
        Err(e) => {
            assert!(!require_gpu(), "MESA_REQUIRE_GPU=1 but the CUDA backend is unavailable: {e}");
            eprintln!("SKIPPED on CUDA (no usable GPU: {e}); ran on the emulator only");
        }
    }
    v
}

/// The CUDA device, or `None` with a skip notice (a failure under `MESA_REQUIRE_GPU=1`).
pub fn cuda_only(test: &str) -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(!require_gpu(), "MESA_REQUIRE_GPU=1 but the CUDA backend is unavailable: {e}");
            eprintln!("SKIPPED {test}: needs a GPU ({e})");
            None
        }
    }
}

/// A random generator with a fresh seed per run (printed, so a failure can be replayed
/// with `MESA_TEST_SEED=<seed>`).
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("MESA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        (t as u64) ^ 0x5DEE_CE66_D1CE_4E5B
    });
    eprintln!("{test}: MESA_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// `fixtures/` of the repository, or `MESA_FIXTURE_DIR` (the GPU bundle sets it).
pub fn fixture_dir() -> PathBuf {
    std::env::var_os("MESA_FIXTURE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures"))
}

/// Unit roundoff `u` of a storage type: round-to-nearest of a normal value `x` errs by at
/// most `u·|x|` (2⁻²⁴ f32, 2⁻¹¹ f16, 2⁻⁸ bf16).
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
    }
}

/// Spacing of a storage type's subnormal range (its smallest subnormal: 2⁻¹⁴⁹ f32, 2⁻²⁴ f16,
/// 2⁻¹³³ bf16). Below the smallest normal the relative bound [`unit_roundoff`] no longer
/// holds; round-to-nearest errs there by at most half this spacing.
pub fn subnormal_spacing(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-149),
        DType::F16 => 2f64.powi(-24),
        DType::BF16 => 2f64.powi(-133),
    }
}
