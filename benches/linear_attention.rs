//! Chunked linear attention: forward, and forward + backward (causal, normalised, bf16, chunk
//! 64; f16/bf16 run on tensor cores).
//!
//! * CUDA: B = 4, H = 16, T ∈ {4K, 8K, 16K}, M = D ∈ {64, 128}, both memory modes
//!   (`boundary`: boundary states from chunk sums and a scan, the default; `statewalk` and
//!   `walk`: the same states from `Schedule::StateWalk` and `Schedule::Walk`; `slim`).
//!   Throughput in elements = B·H·T tokens per iteration.
//! * Emulator (group name says "emulator (not performance)"): B = 1, H = 2, T = 256,
//!   M = D = 16 — only a smoke run of the same code path.
//!
//! Floors printed at start (docs/linear_attention.md derives them): per token and head, the
//! chunked algorithm does ≈ 2·C·(M + D) (intra-chunk) + 4·M·D (state read + update) FLOPs in
//! the forward and about 3× that in the backward; bytes: forward reads (2M + D)·2, writes
//! D·2; backward reads (2M + 3D)·2, writes (2M + D)·2.
//!
//! FAVOR+ feature maps (group `favor`): the forward with the row-max stabiliser (queries) and
//! the backward, bf16 (projections on tensor cores) against f32 (the FP32 kernels), CUDA:
//! B = 4, H = 16, T = 8K, d = 64, m = 256 (bf16 forward moves 0.34 GB, the backward 0.67 GB:
//! several times the L2); emulator: B = 1, H = 2, T = 64, d = 16, m = 32. Throughput in rows.
//!
//! The floors use the copy bandwidth measured at start and the FP32 rate from the queried SM
//! count and clock. Device choice and timing: `benches/common`.
//! Run: `cargo bench --bench linear_attention` (`-- --quick` for a short run).
mod common;

use std::hint::black_box;

use common::{timed, BenchDevice};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use mesa_kernels::feature_map::{self, FavorProjection, FavorStabilizer, FeatureBackwardArgs, FeatureMap};
use mesa_kernels::linear_attention::{
    backward, forward, BackwardArgs, ForwardArgs, Grads, LinearAttentionConfig, MemoryMode, Schedule,
};
use mesa_kernels::{Buffer, Element, Layout};
use mesa_kernels::{TensorMut, TensorRef};

struct Case {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
}

fn data<T: Element>(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<T> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(f64::from(lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)))
        })
        .collect()
}

/// (FLOPs, bytes) of one forward + backward.
fn work(c: &Case) -> (f64, f64) {
    let (rows, m, d, chunk) = ((c.b * c.h * c.t) as f64, c.d as f64, c.d as f64, 64.0);
    let flops_fwd = rows * (2.0 * chunk * (m + d) + 4.0 * m * d);
    let flops = 4.0 * flops_fwd;
    let bytes = rows * 2.0 * ((2.0 * m + d) + d + (2.0 * m + 3.0 * d) + (2.0 * m + d));
    (flops, bytes)
}

fn bench_case(c: &mut Criterion, bench: &BenchDevice, case: &Case) {
    let device = &bench.device;
    let group_name = bench.group_name("linear_attention");
    let (b, h, t, d) = (case.b, case.h, case.t, case.d);
    let n = b * h * t * d;
    let layout = Layout::contiguous(&[b, h, t, d]);
    let up = |x: &[bf16]| -> Buffer<bf16> { device.upload(x).expect("upload") };
    let data = data::<bf16>;
    let (q, k, v, g) = (
        up(&data(n, 0.05, 1.0, 1)),
        up(&data(n, 0.05, 1.0, 2)),
        up(&data(n, -1.0, 1.0, 3)),
        up(&data(n, -1.0, 1.0, 4)),
    );
    let alloc = || device.alloc_zeros::<bf16>(n).expect("alloc");
    let (mut out, mut dq, mut dk, mut dv) = (alloc(), alloc(), alloc(), alloc());
    let (flops, bytes) = work(case);
    if let (Some(flop_rate), Some(byte_rate)) = (bench.fp32_flop_per_s(), bench.copy_bytes_per_s) {
        eprintln!(
            "{group_name} T={t} D={d}: floor fwd+bwd ≈ max({:.1} us fp32-FMA, {:.1} us bytes)",
            flops / flop_rate * 1e6,
            bytes / byte_rate * 1e6
        );
    }
    let mut group = c.benchmark_group(&group_name);
    group.throughput(Throughput::Elements((b * h * t) as u64));
    group.sample_size(10);
    for (name, memory, schedule) in [
        ("boundary", MemoryMode::BoundaryStates, Schedule::ChunkSums),
        ("statewalk", MemoryMode::BoundaryStates, Schedule::StateWalk),
        ("walk", MemoryMode::BoundaryStates, Schedule::Walk),
        ("slim", MemoryMode::Slim, Schedule::ChunkSums),
    ] {
        let cfg = LinearAttentionConfig { memory, schedule, ..LinearAttentionConfig::causal() };
        group.bench_function(format!("fwd_{name}_T{t}_D{d}"), |bencher| {
            bencher.iter_custom(|iters| {
                timed(device, iters, || {
                    let saved = forward(
                        device,
                        &cfg,
                        ForwardArgs {
                            q: &TensorRef::new(&q, &layout).expect("view"),
                            k: &TensorRef::new(&k, &layout).expect("view"),
                            v: &TensorRef::new(&v, &layout).expect("view"),
                            out: &mut TensorMut::new(&mut out, &layout).expect("view"),
                        },
                    )
                    .expect("forward");
                    black_box(&saved);
                })
            });
        });
        group.bench_function(format!("fwd_bwd_{name}_T{t}_D{d}"), |bencher| {
            bencher.iter_custom(|iters| {
                timed(device, iters, || {
                    let saved = forward(
                        device,
                        &cfg,
                        ForwardArgs {
                            q: &TensorRef::new(&q, &layout).expect("view"),
                            k: &TensorRef::new(&k, &layout).expect("view"),
                            v: &TensorRef::new(&v, &layout).expect("view"),
                            out: &mut TensorMut::new(&mut out, &layout).expect("view"),
                        },
                    )
                    .expect("forward");
                    backward(
                        device,
                        &saved,
                        BackwardArgs {
                            q: &TensorRef::new(&q, &layout).expect("view"),
                            k: &TensorRef::new(&k, &layout).expect("view"),
                            v: &TensorRef::new(&v, &layout).expect("view"),
                            out: Some(&TensorRef::new(&out, &layout).expect("view")),
                            dout: &TensorRef::new(&g, &layout).expect("view"),
                            grads: Grads {
                                dq: &mut TensorMut::new(&mut dq, &layout).expect("view"),
                                dk: &mut TensorMut::new(&mut dk, &layout).expect("view"),
                                dv: &mut TensorMut::new(&mut dv, &layout).expect("view"),
                            },
                        },
                    )
                    .expect("backward");
                    black_box(&saved);
                })
            });
        });
    }
    group.finish();
}

/// FAVOR+ forward (row-max stabiliser) and backward of `rows` = B·H·T rows in dtype T.
fn bench_favor<T: Element>(c: &mut Criterion, bench: &BenchDevice, case: &Case, m: usize) {
    let device = &bench.device;
    let (b, h, t, d) = (case.b, case.h, case.t, case.d);
    let proj = FavorProjection::orthogonal(device, m, d, 7).expect("projection");
    let map = FeatureMap::Favor { projection: &proj, stabilizer: FavorStabilizer::RowMax };
    let (lx, lp) = (Layout::contiguous(&[b, h, t, d]), Layout::contiguous(&[b, h, t, m]));
    let x: Buffer<T> = device.upload(&data::<T>(b * h * t * d, -1.0, 1.0, 5)).expect("upload");
    let dphi: Buffer<T> = device.upload(&data::<T>(b * h * t * m, -1.0, 1.0, 6)).expect("upload");
    let mut phi = device.alloc_zeros::<T>(b * h * t * m).expect("alloc");
    let mut dx = device.alloc_zeros::<T>(b * h * t * d).expect("alloc");
    let mut group = c.benchmark_group(bench.group_name("favor"));
    group.throughput(Throughput::Elements((b * h * t) as u64));
    group.sample_size(10);
    let dtype = format!("{:?}", T::DTYPE).to_lowercase();
    group.bench_function(format!("fwd_rowmax_{dtype}_T{t}_d{d}_m{m}"), |bencher| {
        bencher.iter_custom(|iters| {
            timed(device, iters, || {
                let x = TensorRef::new(&x, &lx).expect("view");
                feature_map::forward(device, &map, &x, &mut TensorMut::new(&mut phi, &lp).expect("view"))
                    .expect("forward");
            })
        });
    });
    group.bench_function(format!("bwd_{dtype}_T{t}_d{d}_m{m}"), |bencher| {
        bencher.iter_custom(|iters| {
            timed(device, iters, || {
                let args = FeatureBackwardArgs {
                    x: &TensorRef::new(&x, &lx).expect("view"),
                    phi: Some(&TensorRef::new(&phi, &lp).expect("view")),
                    dphi: &TensorRef::new(&dphi, &lp).expect("view"),
                    dx: &mut TensorMut::new(&mut dx, &lx).expect("view"),
                };
                feature_map::backward(device, &map, args).expect("backward");
            })
        });
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let bench = BenchDevice::new("linear_attention");
    if bench.is_cuda() {
        for d in [64, 128] {
            for t in [4096, 8192, 16384] {
                bench_case(c, &bench, &Case { b: 4, h: 16, t, d });
            }
        }
        let favor = Case { b: 4, h: 16, t: 8192, d: 64 };
        bench_favor::<bf16>(c, &bench, &favor, 256);
        bench_favor::<f32>(c, &bench, &favor, 256);
    } else {
        bench_case(c, &bench, &Case { b: 1, h: 2, t: 256, d: 16 });
        let favor = Case { b: 1, h: 2, t: 64, d: 16 };
        bench_favor::<bf16>(c, &bench, &favor, 32);
        bench_favor::<f32>(c, &bench, &favor, 32);
    }
}

criterion_group!(linear_attention, benches);
criterion_main!(linear_attention);
