//! Quantize / dequantize throughput (Mesa activation compression, 8-bit codes, bf16).
//!
//! Benchmarks (each reports its throughput as bytes read + bytes written, shown in decimal
//! units — `Throughput::BytesDecimal`, GB/s — to compare with the 4.3 TB/s floor):
//! * `quantize_running_bf16_8bit`: one-pass quantize with the running estimate (the
//!   quantizer has already seen one batch): the quantize kernel, which also reduces the
//!   batch's min/max, plus the one-block finalize that updates the EMA. Bytes: `2n` read
//!   (bf16) + `n` written (codes); the per-group parameters are negligible.
//! * `dequantize_bf16_8bit`: codes → bf16. Bytes: `n` read + `2n` written.
//! * `copy_dtod_bf16` (CUDA only): `cuMemcpyDtoDAsync` of the bf16 input, the bandwidth
//!   ceiling for a streaming kernel. Bytes: `2 · 2n` (read + write).
//!
//! Backend: `Device::best_available()` (CUDA device 0, otherwise the host emulation). With
//! `MESA_REQUIRE_GPU=1` the bench refuses to fall back to the emulation. The emulation
//! runs a small shape and its group name says "emulator (not performance)": its numbers
//! say nothing about the GPU kernels.
//!
//! Timing: `iter_custom`, with the device's stream synchronised before the clock starts and
//! before it stops (ops are stream-ordered and return before the GPU finishes).
//!
//! Run: `cargo bench --bench quantize` (add `-- --quick` for a short run).
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use half::bf16;
use mesa_kernels::{Buffer, Device, Layout, QuantConfig, Quantizer, SavedActivation, StatsMode, TensorMut, TensorRef};

/// Device-to-device copy bandwidth of an H200 (bytes/s), the floor's denominator
/// (an assumed figure, not measured here: `docs/results.md`).
const H200_COPY_BYTES_PER_S: f64 = 4.3e12;

/// A realistic attention activation [B, N, H, D], bf16, grouped per head (axis 2); 134M
/// elements, so that input and codes (402 MB) are 8× the H200's 50 MB L2.
const CUDA_SHAPE: [usize; 4] = [256, 512, 16, 64];
/// A small shape for the host emulation (MiniLM-like heads).
const EMU_SHAPE: [usize; 4] = [2, 64, 12, 32];
const HEAD_AXIS: usize = 2;

fn device() -> Device {
    let require_gpu = std::env::var("MESA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Device::cuda(0) {
        Ok(d) => d,
        Err(e) if require_gpu => panic!("MESA_REQUIRE_GPU=1 but CUDA device 0 is not usable: {e}"),
        Err(e) => {
            eprintln!("quantize bench: CUDA not usable ({e}); falling back to the host emulation");
            Device::best_available()
        }
    }
}

/// Deterministic activation-like data: a per-head offset and scale plus a bounded
/// pseudo-random value, so that groups have different ranges (as real heads do).
fn make_input(shape: &[usize]) -> Vec<bf16> {
    let numel: usize = shape.iter().product();
    let (h, d) = (shape[2], shape[3]);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..numel)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let head = (i / d) % h;
            let scale = 0.5 + head as f32 * 0.25;
            let offset = head as f32 * 0.1 - 0.5;
            bf16::from_f32(offset + scale * (2.0 * u - 1.0))
        })
        .collect()
}

fn print_floor_note(device: &Device, shape: &[usize]) {
    let n: usize = shape.iter().product();
    let mb = |b: usize| b as f64 / 1e6;
    let floor_us = |b: usize| b as f64 / H200_COPY_BYTES_PER_S * 1e6;
    let (q, dq, cp) = (3 * n, 3 * n, 4 * n);
    eprintln!("quantize bench on {} — shape {shape:?} bf16, {n} elements", device.description());
    eprintln!(
        "bytes-moved floor at ~{:.1} TB/s (H200 measured copy bandwidth): \
         quantize {:.3} MB -> {:.3} us, dequantize {:.3} MB -> {:.3} us, copy {:.3} MB -> {:.3} us; \
         fraction of floor = achieved GB/s / {:.0} GB/s",
        H200_COPY_BYTES_PER_S / 1e12,
        mb(q),
        floor_us(q),
        mb(dq),
        floor_us(dq),
        mb(cp),
        floor_us(cp),
        H200_COPY_BYTES_PER_S / 1e9,
    );
    if !device.is_cuda() {
        eprintln!("(host emulation: numbers below are NOT GPU performance)");
    }
}

/// Times `iters` calls of `op`, synchronising the device's stream before and after.
fn timed(device: &Device, iters: u64, mut op: impl FnMut()) -> Duration {
    device.synchronize().expect("synchronize before timing");
    let start = Instant::now();
    for _ in 0..iters {
        op();
    }
    device.synchronize().expect("synchronize after timing");
    start.elapsed()
}

fn configure<M: criterion::measurement::Measurement>(group: &mut BenchmarkGroup<'_, M>, cuda: bool) {
    if cuda {
        group.sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    } else {
        group.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_secs(1));
    }
}

fn bench_quantize(c: &mut Criterion) {
    let device = device();
    let cuda = device.is_cuda();
    let shape: &[usize] = if cuda { &CUDA_SHAPE } else { &EMU_SHAPE };
    let numel: usize = shape.iter().product();
    print_floor_note(&device, shape);

    let layout = Layout::contiguous(shape);
    let host = make_input(shape);
    let x: Buffer<bf16> = device.upload(&host).expect("upload input");

    // one-pass running mode: the first batch (exact statistics, two passes) is done here,
    // so every timed call is quantize (with fused statistics) + finalize (EMA update).
    let config = QuantConfig { stats: StatsMode::Running, ..QuantConfig::per_head(HEAD_AXIS) };
    let mut quantizer = Quantizer::new(&device, config).expect("quantizer");
    let xt = TensorRef::new(&x, &layout).expect("input view");
    let mut saved: SavedActivation = quantizer.quantize(&xt).expect("first batch");
    quantizer.quantize_into(&xt, &mut saved).expect("second batch");
    device.synchronize().expect("synchronize");

    let dims = shape.iter().map(ToString::to_string).collect::<Vec<_>>().join("x");
    let name = if cuda {
        format!("quantize cuda bf16 {dims}")
    } else {
        format!("quantize emulator (not performance) bf16 {dims}")
    };
    let mut group = c.benchmark_group(name);
    configure(&mut group, cuda);

    group.throughput(Throughput::BytesDecimal((numel * 2 + numel) as u64));
    group.bench_function("quantize_running_bf16_8bit", |b| {
        b.iter_custom(|iters| {
            timed(&device, iters, || {
                quantizer.quantize_into(black_box(&xt), &mut saved).expect("quantize");
            })
        });
    });

    let mut y: Buffer<bf16> = device.alloc_zeros(numel).expect("alloc output");
    let mut yt = TensorMut::new(&mut y, &layout).expect("output view");
    group.throughput(Throughput::BytesDecimal((numel + numel * 2) as u64));
    group.bench_function("dequantize_bf16_8bit", |b| {
        b.iter_custom(|iters| {
            timed(&device, iters, || {
                saved.dequantize(&device, black_box(&mut yt)).expect("dequantize");
            })
        });
    });

    if let (Some(stream), Buffer::Cuda(src)) = (device.stream(), &x) {
        let mut dst = stream.alloc_zeros::<bf16>(numel).expect("alloc copy destination");
        group.throughput(Throughput::BytesDecimal((2 * numel * 2) as u64));
        group.bench_function("copy_dtod_bf16", |b| {
            b.iter_custom(|iters| {
                timed(&device, iters, || {
                    stream.memcpy_dtod(src, &mut dst).expect("memcpy_dtod");
                })
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_quantize);
criterion_main!(benches);
