//! Gated linear attention (issue 41): forward, and forward + backward (bf16, a log-decay per
//! step and KV head, not normalised, chunk 64), with boundary states (`fwd_…`, `fwd_bwd_…`: the
//! chunk decomposition, parallel over chunks) and in SLiM memory (`slim_…`: sequential walks)
//! — the shapes of issue 41's GPU target, "forward +
//! backward ≥ 1.2× faster than fla-core's `chunk_simple_gla`", which
//! `scripts/peer/fla_gated_linear_attention.py` times in the same run.
//!
//! * CUDA: B = 8, H = H_kv = 32, M = D = 128, T ∈ {4K, 8K, 16K}. Throughput in elements =
//!   B·H·T tokens per iteration. Device memory at T = 16K: q, k, v, out, dout, dq, dk, dv are
//!   8 × 1 073 741 824 B (bf16 `[8, 32, 16384, 128]`); the decay and its gradient 2 × 16 777 216 B
//!   (f32 `[8, 32, 16384]`); the saved final state 16 777 216 B (f32 `[8, 32, 128, 128]`); the
//!   backward's scratch in SLiM memory (H = H_kv) 2·B·H_kv·M·W + ⌈M/32⌉·B·(H + H_kv)·L + B·H_kv·L
//!   f32 = 184 549 376 B: 8 824 815 616 B ≈ 8.2 GiB. With boundary states also those states,
//!   B·⌈L/C⌉·H_kv·M·W f32 = 4 294 967 296 B, and the backward's chunk states and whole decays for dk
//!   and dv, B·⌈L/C⌉·H_kv·(M·W + 1) f32 = 4 295 229 440 B: 17 415 012 352 B ≈ 16.2 GiB at
//!   most, which an H100's 80 GB holds four times. The bench prints the SLiM sum at start.
//! * Emulator (group name says "emulator (not performance)"): B = 1, H = H_kv = 2, T = 128,
//!   M = D = 16 — only a smoke run of the same code path.
//!
//! Inputs: q, k uniform in [−1, 1], v in [−1, 1], the decay uniform in [−0.2, −0.001] (the
//! range of `logsigmoid` gates a trained model has; the kernel's time does not depend on the
//! values), the upstream gradient in [−1, 1]. The values repeat with a period of 1 000 003
//! elements (generating 2³¹ of them on the host would take longer than the bench).
//!
//! Not run on a GPU yet: no number of this bench has been measured on one.
//! Device choice and timing: `benches/common`.
//! Run: `cargo bench --bench gated_linear_attention` (`-- --quick` for a short run).
mod common;

use std::hint::black_box;

use common::{timed, BenchDevice};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use half::bf16;
use mesa_kernels::gated_linear_attention::{
    backward, forward_with, BackwardArgs, Decay, ForwardArgs, ForwardOptions, GatedConfig, GatedGrads, MemoryMode,
};
use mesa_kernels::{Buffer, Element, Layout, TensorMut, TensorRef};

struct Case {
    b: usize,
    h: usize,
    hkv: usize,
    t: usize,
    d: usize,
}

/// `n` values uniform in `[lo, hi]`, repeating with a period of 1 000 003.
fn data<T: Element>(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<T> {
    const PERIOD: usize = 1_000_003;
    let mut s = seed | 1;
    let period: Vec<T> = (0..n.min(PERIOD))
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(f64::from(lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)))
        })
        .collect();
    period.iter().copied().cycle().take(n).collect()
}

/// Device bytes of one forward + backward at its peak (inputs, outputs, gradients, the decay
/// and its gradient, the final state, the backward's scratch).
fn device_bytes(case: &Case) -> usize {
    let (b, h, hkv, t, m, d) = (case.b, case.h, case.hkv, case.t, case.d, case.d);
    let w = d;
    let bf16s = 2 * (b * h * t * m) + 2 * (b * hkv * t * m) + 2 * (b * hkv * t * d) + 2 * (b * h * t * d);
    let decay = 2 * b * hkv * t;
    let state = b * hkv * m * w;
    // MESA_GLA_BACKWARD_WORK without boundary states (the default SLiM memory)
    let group_sums = if h > hkv { b * hkv * t * (m + d) } else { 0 };
    let scratch = 2 * b * hkv * m * w + m.div_ceil(32) * b * (h + hkv) * t + b * hkv * t + group_sums;
    2 * bf16s + 4 * (decay + state + scratch)
}

fn bench_case(c: &mut Criterion, bench: &BenchDevice, case: &Case) {
    let device = &bench.device;
    let group_name = bench.group_name("gated_linear_attention");
    let (b, h, hkv, t, d) = (case.b, case.h, case.hkv, case.t, case.d);
    let config = GatedConfig::default();
    eprintln!(
        "{group_name} B={b} H={h} H_kv={hkv} T={t} M=D={d}: {} device bytes at the backward's peak",
        device_bytes(case)
    );
    let (lq, lkv, la) =
        (Layout::contiguous(&[b, h, t, d]), Layout::contiguous(&[b, hkv, t, d]), Layout::contiguous(&[b, hkv, t]));
    let up = |x: &[bf16]| -> Buffer<bf16> { device.upload(x).expect("upload") };
    let (nq, nkv) = (b * h * t * d, b * hkv * t * d);
    let (q, k, v, dout) = (
        up(&data(nq, -1.0, 1.0, 1)),
        up(&data(nkv, -1.0, 1.0, 2)),
        up(&data(nkv, -1.0, 1.0, 3)),
        up(&data(nq, -1.0, 1.0, 4)),
    );
    let a: Buffer<f32> = device.upload(&data::<f32>(b * hkv * t, -0.2, -0.001, 5)).expect("upload");
    let alloc = |n| device.alloc_zeros::<bf16>(n).expect("alloc");
    let (mut out, mut dq, mut dk, mut dv) = (alloc(nq), alloc(nq), alloc(nkv), alloc(nkv));
    let mut da = device.alloc_zeros::<f32>(b * hkv * t).expect("alloc");
    let mut group = c.benchmark_group(&group_name);
    group.throughput(Throughput::Elements((b * h * t) as u64));
    group.sample_size(10);
    if bench.is_cuda() {
        // one call takes milliseconds to a second: the same count per sample (criterion's
        // linear mode would run 55 of them at least)
        group.sampling_mode(SamplingMode::Flat);
    }
    // boundary states (the chunk decomposition, parallel over chunks in both directions: the
    // mode to compare with chunk_simple_gla), and SLiM memory (sequential walks), prefix "slim_"
    for (memory, prefix) in [(MemoryMode::BoundaryStates, ""), (MemoryMode::Slim, "slim_")] {
        let options = ForwardOptions { memory, ..ForwardOptions::default() };
        let run_forward = |out: &mut Buffer<bf16>| {
            let decay = TensorRef::new(&a, &la).expect("view");
            forward_with(
                device,
                &config,
                &options,
                ForwardArgs {
                    q: &TensorRef::new(&q, &lq).expect("view"),
                    k: &TensorRef::new(&k, &lkv).expect("view"),
                    v: &TensorRef::new(&v, &lkv).expect("view"),
                    decay: Decay::PerStep(&decay),
                    initial: None,
                    out: &mut TensorMut::new(out, &lq).expect("view"),
                },
            )
            .expect("forward")
        };
        group.bench_function(format!("{prefix}fwd_T{t}_D{d}"), |bencher| {
            bencher.iter_custom(|iters| timed(device, iters, || drop(black_box(run_forward(&mut out)))));
        });
        group.bench_function(format!("{prefix}fwd_bwd_T{t}_D{d}"), |bencher| {
            bencher.iter_custom(|iters| {
                timed(device, iters, || {
                    let saved = run_forward(&mut out);
                    let decay = TensorRef::new(&a, &la).expect("view");
                    backward(
                        device,
                        &saved,
                        BackwardArgs {
                            q: &TensorRef::new(&q, &lq).expect("view"),
                            k: &TensorRef::new(&k, &lkv).expect("view"),
                            v: &TensorRef::new(&v, &lkv).expect("view"),
                            decay: Decay::PerStep(&decay),
                            initial: None,
                            out: None,
                            dout: &TensorRef::new(&dout, &lq).expect("view"),
                            d_final: None,
                            grads: GatedGrads {
                                dq: &mut TensorMut::new(&mut dq, &lq).expect("view"),
                                dk: &mut TensorMut::new(&mut dk, &lkv).expect("view"),
                                dv: &mut TensorMut::new(&mut dv, &lkv).expect("view"),
                                d_decay: &mut TensorMut::new(&mut da, &la).expect("view"),
                                d_initial: None,
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

fn benches(c: &mut Criterion) {
    let bench = BenchDevice::new("gated_linear_attention");
    if bench.is_cuda() {
        for t in [4096, 8192, 16384] {
            bench_case(c, &bench, &Case { b: 8, h: 32, hkv: 32, t, d: 128 });
        }
    } else {
        bench_case(c, &bench, &Case { b: 1, h: 2, hkv: 2, t: 128, d: 16 });
    }
}

criterion_group!(gated_linear_attention, benches);
criterion_main!(gated_linear_attention);
