//! Sequence-parallel collectives, all ranks on one device: the intra-node reduce-scatter and
//! all-gather kernels against a device-to-device copy of the same number of bytes.
//!
//! Shape: a Megatron layer's `[S, B, H]` bf16 activation split evenly over `W` ranks
//! (`N = S·B·H` elements, `e = 2` bytes). Throughput counts bytes read + bytes written
//! (`Throughput::BytesDecimal`, GB/s), all ranks together:
//! * `reduce_scatter_bf16_w{W}`: `W·N·e` read (each rank reads its shard of every input) +
//!   `N·e` written.
//! * `all_gather_bf16_w{W}`: `W·N·e` read (each rank reads every shard) + `W·N·e` written.
//! * `copy_dtod_bf16_*` (CUDA only): `cuMemcpyDtoDAsync` of `(W+1)·N·e / 2` resp. `W·N·e`
//!   bytes, i.e. the same bytes read + written as the collective next to it: the ceiling.
//!
//! The target: both collectives at ≥ 80% of the copy's GB/s in the same run (GPU).
//! Backend: `Device::best_available()`; `MESA_REQUIRE_GPU=1` refuses the emulation. The
//! emulation runs a small shape and its group name says "emulator (not performance)".
//!
//! Run: `cargo bench --bench collectives` (add `-- --quick` for a short run).
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use mesa_kernels::{Buffer, Device, Epilogue, Layout, SeqParallelGroup, SeqSplits, TensorMut, TensorRef};

/// H200 device-to-device copy bandwidth (bytes/s), the floor's denominator (an assumed
/// figure, not measured here: `docs/results.md`).
const H200_COPY_BYTES_PER_S: f64 = 4.3e12;

fn device() -> Device {
    let require_gpu = std::env::var("MESA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Device::cuda(0) {
        Ok(d) => d,
        Err(e) if require_gpu => panic!("MESA_REQUIRE_GPU=1 but CUDA device 0 is not usable: {e}"),
        Err(e) => {
            eprintln!("collectives bench: CUDA not usable ({e}); falling back to the host emulation");
            Device::emulator()
        }
    }
}

fn timed(device: &Device, iters: u64, mut op: impl FnMut()) -> Duration {
    device.synchronize().expect("synchronize before timing");
    let start = Instant::now();
    for _ in 0..iters {
        op();
    }
    device.synchronize().expect("synchronize after timing");
    start.elapsed()
}

fn bench_collectives(c: &mut Criterion) {
    let device = device();
    let cuda = device.is_cuda();
    // GPU: s = 4096 tokens, b = 1, h = 8192 (a 70B-class layer); emulation: tiny.
    let (s, b, h) = if cuda { (4096usize, 1usize, 8192usize) } else { (64, 1, 256) };
    for w in [2usize, 4, 8] {
        let n = s * b * h;
        let splits = SeqSplits::even(s, w).expect("splits");
        let rows = s / w;
        let data: Vec<bf16> = (0..n).map(|i| bf16::from_f32(((i % 97) as f32 - 48.0) * 0.01)).collect();
        let inputs: Vec<Buffer<bf16>> = (0..w).map(|_| device.upload(&data).expect("upload")).collect();
        let mut shards: Vec<Buffer<bf16>> = (0..w).map(|_| device.alloc_zeros(rows * b * h).expect("alloc")).collect();
        let mut full: Vec<Buffer<bf16>> = (0..w).map(|_| device.alloc_zeros(n).expect("alloc")).collect();
        let mut group = SeqParallelGroup::new(&device, w).expect("group");
        let (rs_bytes, ag_bytes) = ((w + 1) * n * 2, 2 * w * n * 2);
        eprintln!(
            "collectives bench on {}: [{s}, {b}, {h}] bf16, W = {w}; bytes-moved floor at {:.1} TB/s: \
             reduce-scatter {:.1} MB -> {:.1} us, all-gather {:.1} MB -> {:.1} us{}",
            device.description(),
            H200_COPY_BYTES_PER_S / 1e12,
            rs_bytes as f64 / 1e6,
            rs_bytes as f64 / H200_COPY_BYTES_PER_S * 1e6,
            ag_bytes as f64 / 1e6,
            ag_bytes as f64 / H200_COPY_BYTES_PER_S * 1e6,
            if cuda { "" } else { " (host emulation: the numbers below are NOT GPU performance)" }
        );
        let name = if cuda {
            format!("seqpar cuda bf16 {s}x{b}x{h} W={w}")
        } else {
            format!("seqpar emulator (not performance) bf16 {s}x{b}x{h} W={w}")
        };
        let mut g = c.benchmark_group(name);
        if cuda {
            g.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        } else {
            g.sample_size(10).warm_up_time(Duration::from_millis(100)).measurement_time(Duration::from_millis(500));
        }
        let full_layout = Layout::contiguous(&[s, b, h]);
        let shard_layout = Layout::contiguous(&[rows, b, h]);

        g.throughput(Throughput::BytesDecimal(rs_bytes as u64));
        g.bench_function(format!("reduce_scatter_bf16_w{w}"), |bench| {
            bench.iter_custom(|iters| {
                timed(&device, iters, || {
                    let ins: Vec<TensorRef<'_, bf16>> =
                        inputs.iter().map(|x| TensorRef::new(x, &full_layout).expect("view")).collect();
                    let mut outs: Vec<TensorMut<'_, bf16>> =
                        shards.iter_mut().map(|x| TensorMut::new(x, &shard_layout).expect("view")).collect();
                    group.reduce_scatter_seq(black_box(&ins), &mut outs, &splits, &Epilogue::none()).expect("rs");
                })
            });
        });
        g.throughput(Throughput::BytesDecimal(ag_bytes as u64));
        g.bench_function(format!("all_gather_bf16_w{w}"), |bench| {
            bench.iter_custom(|iters| {
                timed(&device, iters, || {
                    let ins: Vec<TensorRef<'_, bf16>> =
                        shards.iter().map(|x| TensorRef::new(x, &shard_layout).expect("view")).collect();
                    let mut outs: Vec<TensorMut<'_, bf16>> =
                        full.iter_mut().map(|x| TensorMut::new(x, &full_layout).expect("view")).collect();
                    group.all_gather_seq(black_box(&ins), &mut outs, &splits).expect("ag");
                })
            });
        });
        group.check().expect("no rank timed out");

        if let Some(stream) = device.stream() {
            // copies moving the same bytes (read + write) as each collective
            for (label, elems) in [("rs", (w + 1) * n / 2), ("ag", w * n)] {
                let src = stream.alloc_zeros::<bf16>(elems).expect("alloc");
                let mut dst = stream.alloc_zeros::<bf16>(elems).expect("alloc");
                g.throughput(Throughput::BytesDecimal((2 * elems * 2) as u64));
                g.bench_function(format!("copy_dtod_bf16_as_{label}_w{w}"), |bench| {
                    bench.iter_custom(|iters| {
                        timed(&device, iters, || stream.memcpy_dtod(&src, &mut dst).expect("memcpy_dtod"))
                    });
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench_collectives);
criterion_main!(benches);
