//! Quantize / dequantize throughput (Mesa activation compression, 8-bit codes, bf16).
//!
//! Benchmarks (each reports its throughput as bytes read + bytes written, shown in decimal
//! units — `Throughput::BytesDecimal`, GB/s — to compare with the copy bandwidth measured in
//! the same run):
//! * `quantize_running_bf16_8bit`: one-pass quantize with the running estimate (the
//!   quantizer has already seen one batch): the quantize kernel, which also reduces the
//!   batch's min/max and whose last block finalizes (EMA update), plus the widening pass
//!   (one 4-byte load per thread when no group escaped). Bytes: `2n` read
//!   (bf16) + `n` written (codes); the per-group parameters are negligible.
//! * `dequantize_bf16_8bit`: codes → bf16. Bytes: `n` read + `2n` written.
//! * `copy_dtod_bf16` (CUDA only): `cuMemcpyDtoDAsync` of the bf16 input, the bandwidth
//!   ceiling for a streaming kernel. Bytes: `2 · 2n` (read + write).
//! * group `host cost per op` (CUDA only): the host time of enqueuing one
//!   `quantize_into` (running mode: the quantize pass with the fused finalize, then the
//!   widening pass) or one `dequantize` on a small tensor (`[1, 64, 16, 64]`), batches of 200
//!   ops timed without synchronising (the queue never fills); the stream is synchronised
//!   between batches, outside the clock. Reported as time per op (issue 12's target: ≤ 5 µs).
//!
//! Shape: `[B, 512, 16, 64]` bf16 grouped per head (axis 2), `B` sized from the queried L2
//! (at least 4× the L2 moved by quantize: B = 128, 201 MB, on a 50 MB L2); the emulation
//! runs a small shape. Device choice (`MESA_REQUIRE_GPU=1`), the copy bandwidth measured at
//! start, and timing are `benches/common`'s.
//!
//! Run: `cargo bench --bench quantize` (add `-- --quick` for a short run).
mod common;

use std::hint::black_box;

use common::{timed, BenchDevice};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use mesa_kernels::{Buffer, Layout, QuantConfig, Quantizer, SavedActivation, StatsMode, TensorMut, TensorRef};

/// One batch row of a realistic attention activation `[B, N, H, D]`.
const ROW: [usize; 3] = [512, 16, 64];
/// A small shape for the host emulation (MiniLM-like heads).
const EMU_SHAPE: [usize; 4] = [2, 64, 12, 32];
const HEAD_AXIS: usize = 2;

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

fn bench_quantize(c: &mut Criterion) {
    let bench = BenchDevice::new("quantize");
    let (device, cuda) = (&bench.device, bench.is_cuda());
    let row_elems: usize = ROW.iter().product();
    // quantize moves 3 bytes per element
    let batch = bench.rows_for(3 * row_elems, 1, 0);
    let cuda_shape = [batch, ROW[0], ROW[1], ROW[2]];
    let shape: &[usize] = if cuda { &cuda_shape } else { &EMU_SHAPE };
    let numel: usize = shape.iter().product();
    eprintln!("quantize bench: shape {shape:?} bf16, {numel} elements");
    bench.floor_note("quantize", 3 * numel);
    bench.floor_note("dequantize", 3 * numel);

    let layout = Layout::contiguous(shape);
    let host = make_input(shape);
    let x: Buffer<bf16> = device.upload(&host).expect("upload input");

    // one-pass running mode: the first batch (exact statistics, two passes) is done here,
    // so every timed call is quantize (with fused statistics and finalize) + the widening pass.
    let config = QuantConfig { stats: StatsMode::Running, ..QuantConfig::per_head(HEAD_AXIS) };
    let mut quantizer = Quantizer::new(device, config).expect("quantizer");
    let xt = TensorRef::new(&x, &layout).expect("input view");
    let mut saved: SavedActivation = quantizer.quantize(&xt).expect("first batch");
    quantizer.quantize_into(&xt, &mut saved).expect("second batch");
    device.synchronize().expect("synchronize");

    let dims = shape.iter().map(ToString::to_string).collect::<Vec<_>>().join("x");
    let mut group = c.benchmark_group(bench.group_name(&format!("quantize bf16 {dims}")));
    bench.configure(&mut group);

    group.throughput(Throughput::BytesDecimal((numel * 2 + numel) as u64));
    group.bench_function("quantize_running_bf16_8bit", |b| {
        b.iter_custom(|iters| {
            timed(device, iters, || {
                quantizer.quantize_into(black_box(&xt), &mut saved).expect("quantize");
            })
        });
    });

    let mut y: Buffer<bf16> = device.alloc_zeros(numel).expect("alloc output");
    let mut yt = TensorMut::new(&mut y, &layout).expect("output view");
    group.throughput(Throughput::BytesDecimal((numel + numel * 2) as u64));
    group.bench_function("dequantize_bf16_8bit", |b| {
        b.iter_custom(|iters| {
            timed(device, iters, || {
                saved.dequantize(device, black_box(&mut yt)).expect("dequantize");
            })
        });
    });

    if let (Some(stream), Buffer::Cuda(src)) = (device.stream(), &x) {
        let mut dst = stream.alloc_zeros::<bf16>(numel).expect("alloc copy destination");
        group.throughput(Throughput::BytesDecimal((2 * numel * 2) as u64));
        group.bench_function("copy_dtod_bf16", |b| {
            b.iter_custom(|iters| {
                timed(device, iters, || {
                    stream.memcpy_dtod(src, &mut dst).expect("memcpy_dtod");
                })
            });
        });
    }
    group.finish();
}

/// Ops enqueued per timed batch: far below the launch queue's depth (two launches per
/// quantize), so no enqueue waits for the GPU.
const HOST_BATCH: u64 = 200;

/// Host time of `iters` calls of `op` in batches of [`HOST_BATCH`], the stream synchronised
/// between batches outside the clock.
fn host_time(device: &mesa_kernels::Device, iters: u64, mut op: impl FnMut()) -> std::time::Duration {
    let mut total = std::time::Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(HOST_BATCH);
        device.synchronize().expect("synchronize between batches");
        let start = std::time::Instant::now();
        for _ in 0..n {
            op();
        }
        total += start.elapsed();
        left -= n;
    }
    device.synchronize().expect("synchronize after the batches");
    total.max(std::time::Duration::from_nanos(1))
}

fn bench_host_cost(c: &mut Criterion) {
    let bench = BenchDevice::new("quantize host cost");
    if !bench.is_cuda() {
        eprintln!("host cost per op: not measured on the host emulation (its ops run synchronously)");
        return;
    }
    let device = &bench.device;
    let shape = [1, 64, 16, 64];
    let layout = Layout::contiguous(&shape);
    let x: Buffer<bf16> = device.upload(&make_input(&shape)).expect("upload input");
    let xt = TensorRef::new(&x, &layout).expect("input view");
    let config = QuantConfig { stats: StatsMode::Running, ..QuantConfig::per_head(HEAD_AXIS) };
    let mut quantizer = Quantizer::new(device, config).expect("quantizer");
    let mut saved = quantizer.quantize(&xt).expect("first batch");
    let mut y: Buffer<bf16> = device.alloc_zeros(layout.numel()).expect("alloc output");
    let mut yt = TensorMut::new(&mut y, &layout).expect("output view");
    let mut group = c.benchmark_group(bench.group_name("host cost per op"));
    bench.configure(&mut group);
    group.bench_function("quantize_into_running", |b| {
        b.iter_custom(|iters| host_time(device, iters, || quantizer.quantize_into(&xt, &mut saved).expect("quantize")));
    });
    group.bench_function("dequantize", |b| {
        b.iter_custom(|iters| host_time(device, iters, || saved.dequantize(device, &mut yt).expect("dequantize")));
    });
    group.finish();
}

criterion_group!(benches, bench_quantize, bench_host_cost);
criterion_main!(benches);
