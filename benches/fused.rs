//! Fused producers/consumers of saved activations (GELU, SwiGLU, softmax, LayerNorm, RoPE),
//! bf16, 8-bit codes.
//!
//! Pairs (each reports bytes read + written as `Throughput::BytesDecimal`; GB/s divided by the
//! copy bandwidth measured at start is the fraction of the bytes-moved floor, docs/fused.md):
//! * `gelu_forward_plain` vs `gelu_forward_saving`: `y = gelu(x)`, 4n bytes, vs the same plus
//!   the codes of x (running estimate, after a first batch), 5n bytes.
//! * `softmax_forward_plain` vs `softmax_forward_saving` (rows of 512 with a key-padding
//!   mask): 4n (+ mask) vs 5n bytes.
//! * `layernorm_forward_plain` vs `layernorm_forward_saving` (C = 1024): 4n vs 5n bytes
//!   (+ 8 bytes per row).
//! * `gelu_backward_bf16` vs `gelu_backward_codes`: dx from a bf16 saved input (6n bytes) vs
//!   from its codes (5n bytes); the same for softmax (`softmax_backward_*`) and LayerNorm
//!   (`layernorm_backward_*`: dx plus the deterministic dweight/dbias; the dx and column
//!   kernels each read dy and the saved x̂, 2·(2+2)n + 2n vs 2·(2+1)n + 2n bytes).
//! * `swiglu_forward_plain` vs `swiglu_forward_saving`: `y = silu(g)·u`, 6n bytes, vs the same
//!   plus the codes of g, then a pass writing the codes of u (10n bytes); `swiglu_backward_bf16`
//!   (10n) vs `swiglu_backward_codes` (8n bytes). g and u: the halves of one [rows, 2·cols]
//!   projection, as a fused gate-up matmul writes them.
//! * `rope_plain` vs `rope_forward_saving`: RoPE (Llama's halves) of queries `[B, H, N, d]`
//!   (d = 128), 4n bytes, vs the same plus the codes of the rotated output with head-wise
//!   groups (running estimate, after a first batch), 5n bytes: the rotation fused into the save
//!   of the Q codes (issue 40).
//!
//! Working sets: rows sized from the queried L2 (at least 4× of it moved per call); the
//! emulation runs small shapes. Device choice, copy bandwidth and timing: `benches/common`.
//! Run: `cargo bench --bench fused` (add `-- --quick` for a short run).
mod common;

use std::hint::black_box;

use common::{timed, BenchDevice};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use mesa_kernels::fused::{
    self, GeluBackwardPlain, LayerNormBackward, LayerNormBackwardPlain, LayerNormForward, LayerNormGrads,
    SoftmaxBackwardPlain, SoftmaxInput, SwigluGrads, SwigluInput, SwigluQuantizers,
};
use mesa_kernels::rope::{self, RopeConfig};
use mesa_kernels::{
    Buffer, Device, DeviceMemory, DeviceMemoryMut, GeluForm, Layout, QuantConfig, Quantizer, SoftmaxSave, Storage,
    TensorMut, TensorRef,
};

fn tref<'a, T>(mem: &'a (impl DeviceMemory<T> + ?Sized), l: &Layout) -> TensorRef<'a, T> {
    TensorRef::new(mem, l).expect("input view")
}

fn tmut<'a, T>(mem: &'a mut (impl DeviceMemoryMut<T> + ?Sized), l: &Layout) -> TensorMut<'a, T> {
    TensorMut::new(mem, l).expect("output view")
}

fn vref<T: Storage>(b: &Buffer<T>) -> TensorRef<'_, T> {
    TensorRef::contiguous(b, &[b.len()]).expect("vector view")
}

fn vmut<T: Storage>(b: &mut Buffer<T>) -> TensorMut<'_, T> {
    let n = b.len();
    TensorMut::contiguous(b, &[n]).expect("vector view")
}

fn data(n: usize, seed: u64) -> Vec<bf16> {
    let mut state = seed | 1;
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((i % 97) as f32 * 0.02 - 1.0 + 3.0 * (2.0 * u - 1.0))
        })
        .collect()
}

fn upload(device: &Device, v: &[bf16]) -> Buffer<bf16> {
    device.upload(v).expect("upload")
}

fn bench(c: &mut Criterion) {
    let bench = BenchDevice::new("fused");
    let (device, cuda) = (&bench.device, bench.is_cuda());
    // rows of the saving forwards (5 bytes per element moved) sized from the L2:
    // GELU [rows, 3072], softmax [rows, 512] (rows = heads·512), LayerNorm [rows, 1024]
    let (cols, scols, lcols) = if cuda { (3072, 512, 1024) } else { (768, 64, 256) };
    let rows = bench.rows_for(5 * cols, 512, 64);
    let srows = bench.rows_for(5 * scols, 512, 12 * 64);
    let lrows = bench.rows_for(5 * lcols, 512, 128);
    let n = rows * cols;
    let sn = srows * scols;
    let ln = lrows * lcols;
    bench.floor_note("gelu_forward_saving", 5 * n);
    bench.floor_note("softmax_forward_saving", 5 * sn);
    bench.floor_note("layernorm_forward_saving", 5 * ln);
    let mut g = c.benchmark_group(bench.group_name("fused (bf16, 8-bit codes)"));
    bench.configure(&mut g);

    // ---- GELU
    let l = Layout::contiguous(&[rows, cols]);
    let x = upload(device, &data(n, 1));
    let dy = upload(device, &data(n, 2));
    let mut y = device.alloc_zeros::<bf16>(n).expect("alloc");
    let mut dx = device.alloc_zeros::<bf16>(n).expect("alloc");
    let mut q = Quantizer::new(device, fused::channel_groups(1, 12)).expect("q");
    let saved = fused::gelu_forward(device, &mut q, GeluForm::Erf, &tref(&x, &l), &mut tmut(&mut y, &l))
        .expect("warm-up batch");
    g.throughput(Throughput::BytesDecimal(4 * n as u64));
    g.bench_function("gelu_forward_plain", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::gelu(device, GeluForm::Erf, &tref(&x, &l), &mut tmut(&mut y, &l)).expect("gelu")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(5 * n as u64));
    g.bench_function("gelu_forward_saving", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                black_box(
                    fused::gelu_forward(device, &mut q, GeluForm::Erf, &tref(&x, &l), &mut tmut(&mut y, &l))
                        .expect("gelu"),
                );
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(6 * n as u64));
    g.bench_function("gelu_backward_bf16", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::gelu_backward_plain(
                    device,
                    &GeluBackwardPlain { form: GeluForm::Erf, x: &tref(&x, &l), dy: &tref(&dy, &l) },
                    &mut tmut(&mut dx, &l),
                )
                .expect("bwd")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(5 * n as u64));
    g.bench_function("gelu_backward_codes", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::gelu_backward(device, GeluForm::Erf, &saved, &tref(&dy, &l), &mut tmut(&mut dx, &l))
                    .expect("bwd")
            })
        })
    });

    // ---- softmax with a key-padding mask broadcast over rows
    let heads_rows = srows / scols;
    let ls = Layout::contiguous(&[heads_rows, scols, scols]);
    let s = upload(device, &data(sn, 3));
    let sdy = upload(device, &data(sn, 4));
    let mask = upload(device, &vec![bf16::from_f32(0.0); scols]);
    let ml = Layout::strided(&[heads_rows, scols, scols], &[0, 0, 1], 0).expect("mask");
    let mut p = device.alloc_zeros::<bf16>(sn).expect("alloc");
    let mut sdx = device.alloc_zeros::<bf16>(sn).expect("alloc");
    let save = SoftmaxSave::per_head(0);
    let psaved = fused::softmax_forward(
        device,
        &save,
        &SoftmaxInput { x: &tref(&s, &ls), mask: Some(&tref(&mask, &ml)) },
        &mut tmut(&mut p, &ls),
    )
    .expect("softmax");
    g.throughput(Throughput::BytesDecimal(4 * sn as u64));
    g.bench_function("softmax_forward_plain", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::softmax(
                    device,
                    &SoftmaxInput { x: &tref(&s, &ls), mask: Some(&tref(&mask, &ml)) },
                    &mut tmut(&mut p, &ls),
                )
                .expect("sm")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(5 * sn as u64));
    g.bench_function("softmax_forward_saving", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                black_box(
                    fused::softmax_forward(
                        device,
                        &save,
                        &SoftmaxInput { x: &tref(&s, &ls), mask: Some(&tref(&mask, &ml)) },
                        &mut tmut(&mut p, &ls),
                    )
                    .expect("sm"),
                );
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(6 * sn as u64));
    g.bench_function("softmax_backward_bf16", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::softmax_backward_plain(
                    device,
                    &SoftmaxBackwardPlain { y: &tref(&p, &ls), dy: &tref(&sdy, &ls) },
                    &mut tmut(&mut sdx, &ls),
                )
                .expect("b")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(5 * sn as u64));
    g.bench_function("softmax_backward_codes", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::softmax_backward(device, &psaved, &tref(&sdy, &ls), &mut tmut(&mut sdx, &ls)).expect("b")
            })
        })
    });

    // ---- LayerNorm
    let ll = Layout::contiguous(&[lrows, lcols]);
    let lx = upload(device, &data(ln, 5));
    let ldy = upload(device, &data(ln, 6));
    let w = upload(device, &data(lcols, 7));
    let bias = upload(device, &data(lcols, 8));
    let mut ly = device.alloc_zeros::<bf16>(ln).expect("alloc");
    let mut ldx = device.alloc_zeros::<bf16>(ln).expect("alloc");
    let mut dw = device.alloc_zeros::<f32>(lcols).expect("alloc");
    let mut db = device.alloc_zeros::<f32>(lcols).expect("alloc");
    let mut lq = Quantizer::new(device, QuantConfig::per_tensor()).expect("q");
    let lsaved = fused::layer_norm_forward(
        device,
        &mut lq,
        &LayerNormForward { x: &tref(&lx, &ll), weight: Some(&vref(&w)), bias: Some(&vref(&bias)), eps: 1e-5 },
        &mut tmut(&mut ly, &ll),
    )
    .expect("ln");
    g.throughput(Throughput::BytesDecimal(4 * ln as u64));
    g.bench_function("layernorm_forward_plain", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::layer_norm(
                    device,
                    &LayerNormForward {
                        x: &tref(&lx, &ll),
                        weight: Some(&vref(&w)),
                        bias: Some(&vref(&bias)),
                        eps: 1e-5,
                    },
                    &mut tmut(&mut ly, &ll),
                )
                .expect("ln")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(5 * ln as u64 + 8 * lrows as u64));
    g.bench_function("layernorm_forward_saving", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                black_box(
                    fused::layer_norm_forward(
                        device,
                        &mut lq,
                        &LayerNormForward {
                            x: &tref(&lx, &ll),
                            weight: Some(&vref(&w)),
                            bias: Some(&vref(&bias)),
                            eps: 1e-5,
                        },
                        &mut tmut(&mut ly, &ll),
                    )
                    .expect("ln"),
                );
            })
        })
    });
    // a bf16 x̂ for the plain backward (the values do not matter for timing)
    let xhat = upload(device, &data(ln, 9));
    g.throughput(Throughput::BytesDecimal(10 * ln as u64));
    g.bench_function("layernorm_backward_bf16", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::layer_norm_backward_plain(
                    device,
                    &LayerNormBackwardPlain {
                        xhat: &tref(&xhat, &ll),
                        rstd: &vref(lsaved.rstd()),
                        weight: Some(&vref(&w)),
                        dy: &tref(&ldy, &ll),
                    },
                    LayerNormGrads {
                        dx: &mut tmut(&mut ldx, &ll),
                        dweight: &mut vmut(&mut dw),
                        dbias: &mut vmut(&mut db),
                    },
                )
                .expect("b")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(8 * ln as u64));
    g.bench_function("layernorm_backward_codes", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                fused::layer_norm_backward(
                    device,
                    &LayerNormBackward { saved: &lsaved, weight: Some(&vref(&w)), dy: &tref(&ldy, &ll) },
                    LayerNormGrads {
                        dx: &mut tmut(&mut ldx, &ll),
                        dweight: &mut vmut(&mut dw),
                        dbias: &mut vmut(&mut db),
                    },
                )
                .expect("b")
            })
        })
    });

    // ---- SwiGLU on the halves of one [rows, 2·cols] projection
    let whole = Layout::contiguous(&[rows, 2 * cols]);
    let (gl, ul) = (
        Layout::strided(&[rows, cols], whole.strides(), 0).expect("gate"),
        Layout::strided(&[rows, cols], whole.strides(), cols).expect("up"),
    );
    let gu = upload(device, &data(2 * n, 5));
    let (gv, uv) = (tref(&gu, &gl), tref(&gu, &ul));
    let input = SwigluInput { gate: &gv, up: &uv };
    let mut du = device.alloc_zeros::<bf16>(n).expect("alloc");
    let (mut qg, mut qu) = (
        Quantizer::new(device, fused::channel_groups(1, 12)).expect("q"),
        Quantizer::new(device, fused::channel_groups(1, 12)).expect("q"),
    );
    let ssaved =
        fused::swiglu_forward(device, SwigluQuantizers { gate: &mut qg, up: &mut qu }, &input, &mut tmut(&mut y, &l))
            .expect("warm-up batch");
    g.throughput(Throughput::BytesDecimal(6 * n as u64));
    g.bench_function("swiglu_forward_plain", |b| {
        b.iter_custom(|it| timed(device, it, || fused::swiglu(device, &input, &mut tmut(&mut y, &l)).expect("swiglu")))
    });
    g.throughput(Throughput::BytesDecimal(10 * n as u64));
    g.bench_function("swiglu_forward_saving", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                drop(black_box(
                    fused::swiglu_forward(
                        device,
                        SwigluQuantizers { gate: &mut qg, up: &mut qu },
                        &input,
                        &mut tmut(&mut y, &l),
                    )
                    .expect("swiglu"),
                ));
            })
        })
    });
    g.bench_function("swiglu_backward_bf16", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                let grads = SwigluGrads { gate: &mut tmut(&mut dx, &l), up: &mut tmut(&mut du, &l) };
                fused::swiglu_backward_plain(device, &input, &tref(&dy, &l), grads).expect("bwd")
            })
        })
    });
    g.throughput(Throughput::BytesDecimal(8 * n as u64));
    g.bench_function("swiglu_backward_codes", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                let grads = SwigluGrads { gate: &mut tmut(&mut dx, &l), up: &mut tmut(&mut du, &l) };
                fused::swiglu_backward(device, &ssaved, &tref(&dy, &l), grads).expect("bwd")
            })
        })
    });

    // ---- RoPE of queries [B, H, N, d] (Llama 3's base), saving head-wise codes of the output
    let (heads, dim) = (32, 128);
    let tokens = bench.rows_for(5 * heads * dim, 512, 16);
    let rl = Layout::contiguous(&[1, heads, tokens, dim]);
    let rn = heads * tokens * dim;
    bench.floor_note("rope_forward_saving", 5 * rn);
    let rx = upload(device, &data(rn, 10));
    let mut ry = device.alloc_zeros::<bf16>(rn).expect("alloc");
    let rcfg = RopeConfig::llama(500_000.0);
    let mut rq = Quantizer::new(device, QuantConfig::per_head(1)).expect("q");
    drop(
        rope::rope_forward_save(device, &mut rq, &rcfg, &tref(&rx, &rl), &mut tmut(&mut ry, &rl))
            .expect("warm-up batch"),
    );
    g.throughput(Throughput::BytesDecimal(4 * rn as u64));
    g.bench_function("rope_plain", |b| {
        b.iter_custom(|it| {
            timed(device, it, || rope::rope(device, &rcfg, &tref(&rx, &rl), &mut tmut(&mut ry, &rl)).expect("rope"))
        })
    });
    g.throughput(Throughput::BytesDecimal(5 * rn as u64));
    g.bench_function("rope_forward_saving", |b| {
        b.iter_custom(|it| {
            timed(device, it, || {
                drop(black_box(
                    rope::rope_forward_save(device, &mut rq, &rcfg, &tref(&rx, &rl), &mut tmut(&mut ry, &rl))
                        .expect("rope"),
                ));
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
