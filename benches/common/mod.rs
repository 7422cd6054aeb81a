//! What every criterion bench of this workspace shares, said once: the device (with
//! `MESA_REQUIRE_GPU=1` refusing the emulation), its properties queried from the driver, the
//! device-to-device copy bandwidth measured in the same run (the denominator of every
//! "fraction of the bytes floor"), working sets sized from the queried L2, and timing with
//! the stream synchronised before the clock starts and before it stops.
//!
//! Each bench includes it with `mod common;`; not every bench uses every item.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use criterion::measurement::Measurement;
use criterion::BenchmarkGroup;
use mesa_kernels::{Device, DeviceProperties};

/// Working sets move at least this many times the device's L2 per iteration, so that a
/// kernel's time is HBM time, not L2 time.
pub const L2_MULTIPLE: usize = 4;

/// The device a bench runs on, what it is, and its measured copy bandwidth.
pub struct BenchDevice {
    /// CUDA device 0, or the host emulation when CUDA is not usable.
    pub device: Device,
    /// Queried from the driver (the emulation reports no L2).
    pub props: DeviceProperties,
    /// Bytes read + written per second by `cuMemcpyDtoDAsync` of a buffer of at least
    /// [`L2_MULTIPLE`]× the L2, measured at start; `None` on the emulation.
    pub copy_bytes_per_s: Option<f64>,
}

impl BenchDevice {
    /// Picks the device for bench `name` and measures its copy bandwidth.
    ///
    /// # Panics
    /// When `MESA_REQUIRE_GPU=1` and CUDA device 0 cannot be used, or a CUDA call of the
    /// set-up fails (a bench has no one to return an error to).
    #[must_use]
    pub fn new(name: &str) -> Self {
        let require_gpu = std::env::var("MESA_REQUIRE_GPU").is_ok_and(|v| v == "1");
        let device = match Device::cuda(0) {
            Ok(d) => d,
            Err(e) if require_gpu => panic!("MESA_REQUIRE_GPU=1 but CUDA device 0 is not usable: {e}"),
            Err(e) => {
                eprintln!("{name} bench: CUDA not usable ({e}); falling back to the host emulation");
                Device::emulator()
            }
        };
        let props = device.properties().expect("device properties");
        let copy_bytes_per_s = copy_bandwidth(&device, &props);
        match copy_bytes_per_s {
            Some(bw) => eprintln!(
                "{name} bench on {}: {} SMs, L2 {:.1} MB, {:.1} GB memory, device-to-device copy {:.0} GB/s \
                 (measured now)",
                device.description(),
                props.multiprocessors,
                props.l2_cache_bytes as f64 / 1e6,
                props.memory_bytes as f64 / 1e9,
                bw / 1e9
            ),
            None => eprintln!("{name} bench on the host emulation: the numbers below are NOT GPU performance"),
        }
        BenchDevice { device, props, copy_bytes_per_s }
    }

    /// True on CUDA.
    #[must_use]
    pub fn is_cuda(&self) -> bool {
        self.device.is_cuda()
    }

    /// A criterion group name that says which backend ran.
    #[must_use]
    pub fn group_name(&self, what: &str) -> String {
        if self.is_cuda() {
            format!("{what} cuda")
        } else {
            format!("{what} emulator (not performance)")
        }
    }

    /// Sample counts and times: enough for a GPU's ±1 %, short for the emulation.
    pub fn configure<M: Measurement>(&self, group: &mut BenchmarkGroup<'_, M>) {
        if self.is_cuda() {
            group.sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
        } else {
            group.sample_size(10).warm_up_time(Duration::from_millis(100)).measurement_time(Duration::from_millis(500));
        }
    }

    /// How many rows of `bytes_per_row` (read + written per iteration) make the working set
    /// at least [`L2_MULTIPLE`]× the L2, as a power of two (at least `at_least`). The
    /// emulation, which has no L2, gets `emulator_rows`.
    #[must_use]
    pub fn rows_for(&self, bytes_per_row: usize, at_least: usize, emulator_rows: usize) -> usize {
        if !self.is_cuda() {
            return emulator_rows;
        }
        let want = (L2_MULTIPLE * self.props.l2_cache_bytes).div_ceil(bytes_per_row.max(1));
        want.max(at_least).next_power_of_two()
    }

    /// Prints the time `bytes` (read + written) take at the measured copy bandwidth, and how
    /// the working set compares with the L2.
    pub fn floor_note(&self, label: &str, bytes: usize) {
        if let Some(bw) = self.copy_bytes_per_s {
            let l2 = self.props.l2_cache_bytes.max(1) as f64;
            eprintln!(
                "  {label}: {:.1} MB moved ({:.1}× L2) -> floor {:.1} us at the measured copy bandwidth; \
                 fraction of the floor = achieved GB/s / {:.0} GB/s",
                bytes as f64 / 1e6,
                bytes as f64 / l2,
                bytes as f64 / bw * 1e6,
                bw / 1e9
            );
        }
    }

    /// Peak FP32 FMA throughput in FLOP/s from the queried SM count and clock: 128 FP32
    /// lanes per SM on sm_86 and later (sm_90 included), 64 on sm_80; `None` on the emulation.
    #[must_use]
    pub fn fp32_flop_per_s(&self) -> Option<f64> {
        let (major, minor) = self.props.compute_capability?;
        let lanes = if (major, minor) == (8, 0) { 64.0 } else { 128.0 };
        Some(self.props.multiprocessors as f64 * lanes * 2.0 * self.props.clock_khz as f64 * 1e3)
    }
}

/// Times `iters` calls of `op`, synchronising the device's stream before and after (ops are
/// stream-ordered and return before the GPU finishes).
///
/// # Panics
/// When synchronising reports a CUDA error.
pub fn timed(device: &Device, iters: u64, mut op: impl FnMut()) -> Duration {
    device.synchronize().expect("synchronize before timing");
    let start = Instant::now();
    for _ in 0..iters {
        op();
    }
    device.synchronize().expect("synchronize after timing");
    start.elapsed().max(Duration::from_nanos(1))
}

/// Bytes read + written per second by a device-to-device copy of at least
/// [`L2_MULTIPLE`]× the L2 (and 64 MiB), median of 7 timings of 10 copies after a warm-up.
fn copy_bandwidth(device: &Device, props: &DeviceProperties) -> Option<f64> {
    let stream = device.stream()?;
    let bytes = (L2_MULTIPLE * props.l2_cache_bytes).max(64 << 20);
    let src = stream.alloc_zeros::<u8>(bytes).expect("alloc copy source");
    let mut dst = stream.alloc_zeros::<u8>(bytes).expect("alloc copy destination");
    let mut copies = |n: u64| timed(device, n, || stream.memcpy_dtod(&src, &mut dst).expect("memcpy_dtod"));
    copies(5);
    let mut times: Vec<Duration> = (0..7).map(|_| copies(10)).collect();
    times.sort();
    Some(2.0 * bytes as f64 * 10.0 / times[3].as_secs_f64())
}
