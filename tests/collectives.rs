//! Sequence-parallel collectives (Megatron sequence parallelism): the intra-node
//! reduce-scatter and all-gather kernels against the f64 reference
//! (`mesa_kernels::reference::collectives`) and against the exact f32 fixed-order sum, on every
//! backend (emulator always — its cooperative launch runs every rank's blocks at once, so the
//! cross-rank waits really happen — and CUDA when present, all ranks on one device).
//!
//! Checks (derived, not tuned):
//! * bitwise: every reduce-scatter output equals `rnd_T(((x_0 + x_1) + … + x_{W-1}) + bias) +
//!   residual)` evaluated in f32 in rank order on the host — the contract that makes every
//!   rank's result identical to a single-process sum in that order. All-gather is a bit copy.
//! * reference: with k = W (+1 bias, +1 residual) f32 terms, the f32 sum differs from the exact
//!   (f64) sum by at most (k−1)·2⁻²⁴·Σ|terms| (recursive summation bound), and the final
//!   rounding to T adds u_T·|value| (u = 2⁻²⁴, 2⁻¹¹, 2⁻⁸ for f32, f16, bf16).
//! * every output element is written (outputs are poisoned with NaN first), and nothing
//!   outside the output view is (the padding stays NaN).
mod common;

use std::time::{Duration, Instant};

use half::{bf16, f16};
use mesa_kernels::reference::{self, collectives as rc};
use mesa_kernels::{Device, Element, Epilogue, Error, Layout, SeqParallelGroup, SeqSplits, TensorMut, TensorRef};
use rand::rngs::StdRng;
use rand::RngExt;

/// How a `[rows, B, H]` tensor is laid out in its buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum View {
    /// Dense row-major at offset 0.
    Dense,
    /// Dense, starting one element into the buffer (never 16-byte aligned).
    Offset1,
    /// Stored as `[rows, H, B]`, viewed transposed (B and H swapped).
    Transposed,
    /// Rows padded by 3 elements.
    Padded,
}

fn layout_of(view: View, shape: [usize; 3]) -> (Layout, usize) {
    let [r, b, h] = shape;
    let n = r * b * h;
    match view {
        View::Dense => (Layout::contiguous(&shape), n),
        View::Offset1 => (Layout::strided(&shape, &[b * h, h, 1], 1).expect("layout"), n + 1),
        View::Transposed => (Layout::strided(&shape, &[h * b, 1, b], 0).expect("layout"), n),
        View::Padded => (Layout::strided(&shape, &[b * h + 3, h, 1], 0).expect("layout"), r * (b * h + 3)),
    }
}

/// Storage holding `logical` (row-major over the view's shape) at the view's offsets, NaN
/// elsewhere.
fn place<T: Element>(logical: &[T], layout: &Layout, len: usize) -> Vec<T> {
    let mut v = vec![T::from_f64(f64::NAN); len];
    for (i, off) in reference::offsets(layout).into_iter().enumerate() {
        v[off] = logical[i];
    }
    v
}

fn random<T: Element>(rng: &mut StdRng, n: usize, scale: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(scale * (rng.random::<f64>() * 2.0 - 1.0))).collect()
}

fn widen<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

fn same_bits<T: Element>(a: T, b: T) -> bool {
    a.to_f64().to_bits() == b.to_f64().to_bits()
}

/// The kernel's contract evaluated on the host: f32, rank order, then bias, then residual.
fn fixed_order<T: Element>(
    inputs: &[Vec<T>],
    splits: &SeqSplits,
    bh: usize,
    h: usize,
    bias: Option<&[Vec<T>]>,
    residual: Option<&[Vec<T>]>,
) -> Vec<Vec<T>> {
    (0..splits.world_size())
        .map(|r| {
            let base = splits.offset(r) * bh;
            (0..splits.rows(r) * bh)
                .map(|i| {
                    let mut acc = inputs[0][base + i].to_f64() as f32;
                    for x in &inputs[1..] {
                        acc += x[base + i].to_f64() as f32;
                    }
                    if let Some(b) = bias {
                        acc += b[r][i % h].to_f64() as f32;
                    }
                    if let Some(res) = residual {
                        acc += res[r][i].to_f64() as f32;
                    }
                    T::from_f64(f64::from(acc))
                })
                .collect()
        })
        .collect()
}

struct Shape {
    splits: SeqSplits,
    b: usize,
    h: usize,
}

impl Shape {
    fn new(sizes: &[usize], b: usize, h: usize) -> Self {
        Shape { splits: SeqSplits::new(sizes).expect("splits"), b, h }
    }
    fn w(&self) -> usize {
        self.splits.world_size()
    }
    fn s(&self) -> usize {
        self.splits.total()
    }
    fn bh(&self) -> usize {
        self.b * self.h
    }
}

/// Runs a reduce-scatter from logical data through the given views and returns the logical
/// outputs, after checking that every output element was written and nothing else.
#[allow(clippy::too_many_arguments)]
fn run_rs<T: Element>(
    device: &Device,
    group: &mut SeqParallelGroup,
    shape: &Shape,
    inputs: &[Vec<T>],
    bias: Option<&[Vec<T>]>,
    residual: Option<&[Vec<T>]>,
    in_view: View,
    out_view: View,
) -> mesa_kernels::Result<Vec<Vec<T>>> {
    let w = shape.w();
    let (in_layout, in_len) = layout_of(in_view, [shape.s(), shape.b, shape.h]);
    let in_bufs: Vec<_> =
        inputs.iter().map(|x| device.upload(&place(x, &in_layout, in_len)).expect("upload")).collect();
    let out_layouts: Vec<(Layout, usize)> =
        (0..w).map(|r| layout_of(out_view, [shape.splits.rows(r), shape.b, shape.h])).collect();
    let mut out_bufs: Vec<_> =
        out_layouts.iter().map(|(_, len)| device.upload(&vec![T::from_f64(f64::NAN); *len]).expect("upload")).collect();
    let res_bufs: Vec<_> = residual
        .map(|res| {
            (0..w)
                .map(|r| {
                    let (l, len) = layout_of(in_view, [shape.splits.rows(r), shape.b, shape.h]);
                    (device.upload(&place(&res[r], &l, len)).expect("upload"), l)
                })
                .collect()
        })
        .unwrap_or_default();
    let bias_bufs: Vec<_> =
        bias.map(|bias| bias.iter().map(|v| device.upload(v).expect("upload")).collect()).unwrap_or_default();
    {
        let ins: Vec<TensorRef<'_, T>> = in_bufs.iter().map(|b| TensorRef::new(b, &in_layout).expect("view")).collect();
        let mut outs: Vec<TensorMut<'_, T>> =
            out_bufs.iter_mut().zip(&out_layouts).map(|(b, (l, _))| TensorMut::new(b, l).expect("view")).collect();
        let res_views: Vec<TensorRef<'_, T>> =
            res_bufs.iter().map(|(b, l)| TensorRef::new(b, l).expect("view")).collect();
        let bias_views: Vec<TensorRef<'_, T>> =
            bias_bufs.iter().map(|b| TensorRef::contiguous(b, &[shape.h]).expect("view")).collect();
        let epilogue =
            Epilogue { bias: bias.map(|_| bias_views.as_slice()), residual: residual.map(|_| res_views.as_slice()) };
        group.reduce_scatter_seq(&ins, &mut outs, &shape.splits, &epilogue)?;
    }
    group.check()?;
    Ok(out_bufs
        .iter()
        .zip(&out_layouts)
        .map(|(buf, (layout, _))| {
            let data = buf.to_vec().expect("download");
            let offsets = reference::offsets(layout);
            let mut in_view = vec![false; data.len()];
            for &o in &offsets {
                in_view[o] = true;
            }
            for (o, x) in data.iter().enumerate() {
                if !in_view[o] {
                    assert!(x.to_f64().is_nan(), "element {o} outside the output view was written");
                }
            }
            offsets.iter().map(|&o| data[o]).collect()
        })
        .collect())
}

fn run_ag<T: Element>(
    device: &Device,
    group: &mut SeqParallelGroup,
    shape: &Shape,
    shards: &[Vec<T>],
    in_view: View,
    out_view: View,
) -> mesa_kernels::Result<Vec<Vec<T>>> {
    let w = shape.w();
    let in_layouts: Vec<(Layout, usize)> =
        (0..w).map(|r| layout_of(in_view, [shape.splits.rows(r), shape.b, shape.h])).collect();
    let in_bufs: Vec<_> = shards
        .iter()
        .zip(&in_layouts)
        .map(|(x, (l, len))| device.upload(&place(x, l, *len)).expect("upload"))
        .collect();
    let (out_layout, out_len) = layout_of(out_view, [shape.s(), shape.b, shape.h]);
    let mut out_bufs: Vec<_> =
        (0..w).map(|_| device.upload(&vec![T::from_f64(f64::NAN); out_len]).expect("upload")).collect();
    {
        let ins: Vec<TensorRef<'_, T>> =
            in_bufs.iter().zip(&in_layouts).map(|(b, (l, _))| TensorRef::new(b, l).expect("view")).collect();
        let mut outs: Vec<TensorMut<'_, T>> =
            out_bufs.iter_mut().map(|b| TensorMut::new(b, &out_layout).expect("view")).collect();
        group.all_gather_seq(&ins, &mut outs, &shape.splits)?;
    }
    group.check()?;
    let offsets = reference::offsets(&out_layout);
    Ok(out_bufs
        .iter()
        .map(|buf| {
            let data = buf.to_vec().expect("download");
            offsets.iter().map(|&o| data[o]).collect()
        })
        .collect())
}

/// Asserts bitwise equality with the fixed-order f32 sum, the reference bound, and that no
/// output is NaN (all written).
#[allow(clippy::too_many_arguments)]
fn check_rs<T: Element>(
    got: &[Vec<T>],
    inputs: &[Vec<T>],
    shape: &Shape,
    bias: Option<&[Vec<T>]>,
    residual: Option<&[Vec<T>]>,
    label: &str,
) {
    let exact = fixed_order(inputs, &shape.splits, shape.bh(), shape.h, bias, residual);
    let wide: Vec<Vec<f64>> = inputs.iter().map(|x| widen(x)).collect();
    let wide_bias: Option<Vec<Vec<f64>>> = bias.map(|b| b.iter().map(|x| widen(x)).collect());
    let wide_res: Option<Vec<Vec<f64>>> = residual.map(|b| b.iter().map(|x| widen(x)).collect());
    let sizes = shape.splits.sizes();
    let want = rc::reduce_scatter_seq(&wide, &sizes, shape.b, shape.h, wide_bias.as_deref(), wide_res.as_deref())
        .expect("reference");
    // Σ|terms| per element, for the bound
    let abs_in: Vec<Vec<f64>> = wide.iter().map(|x| x.iter().map(|v| v.abs()).collect()).collect();
    let abs_bias: Option<Vec<Vec<f64>>> =
        wide_bias.as_ref().map(|b| b.iter().map(|x| x.iter().map(|v| v.abs()).collect()).collect());
    let abs_res: Option<Vec<Vec<f64>>> =
        wide_res.as_ref().map(|b| b.iter().map(|x| x.iter().map(|v| v.abs()).collect()).collect());
    let mags = rc::reduce_scatter_seq(&abs_in, &sizes, shape.b, shape.h, abs_bias.as_deref(), abs_res.as_deref())
        .expect("reference");
    let k = shape.w() + usize::from(bias.is_some()) + usize::from(residual.is_some());
    let u = common::unit_roundoff(T::DTYPE);
    for r in 0..shape.w() {
        assert_eq!(got[r].len(), want[r].len(), "{label}: rank {r} length");
        for i in 0..got[r].len() {
            let g = got[r][i];
            assert!(!g.to_f64().is_nan(), "{label}: rank {r} element {i} not written (NaN)");
            if !same_bits(g, exact[r][i]) {
                let base = shape.splits.offset(r) * shape.bh();
                let terms: Vec<f64> = inputs.iter().map(|x| x[base + i].to_f64()).collect();
                panic!(
                    "{label}: rank {r} element {i}: {} is not the fixed-order f32 sum {} (terms {terms:?})",
                    g.to_f64(),
                    exact[r][i].to_f64()
                );
            }
            let acc_err = (k as f64 - 1.0) * 2f64.powi(-24) * mags[r][i];
            let tol = acc_err + u * (want[r][i].abs() + acc_err) + 0.5 * common::subnormal_spacing(T::DTYPE);
            assert!(
                (g.to_f64() - want[r][i]).abs() <= tol,
                "{label}: rank {r} element {i}: {} vs reference {} (tol {tol})",
                g.to_f64(),
                want[r][i]
            );
        }
    }
}

fn shapes_for(w: usize, rng: &mut StdRng) -> Vec<(&'static str, Shape)> {
    // even: W | S; uneven: explicit random sizes (one may be zero), S not divisible by W
    let mut sizes: Vec<usize> = (0..w).map(|_| rng.random_range(0..5usize)).collect();
    sizes[0] += 1;
    if w > 1 && sizes.iter().sum::<usize>() % w == 0 {
        sizes[w - 1] += 1;
    }
    vec![("even", Shape::new(&vec![3; w], 2, 24)), ("uneven", Shape::new(&sizes, 3, 10))]
}

fn parity_for<T: Element>(device: &Device, rng: &mut StdRng) {
    for w in [1usize, 2, 3, 4, 5, 8, 16] {
        let mut group = SeqParallelGroup::new(device, w).expect("group");
        for (kind, shape) in shapes_for(w, rng) {
            let inputs: Vec<Vec<T>> = (0..w).map(|_| random(rng, shape.s() * shape.bh(), 4.0)).collect();
            let bias: Vec<Vec<T>> = (0..w).map(|_| random(rng, shape.h, 1.0)).collect();
            let res: Vec<Vec<T>> = (0..w).map(|r| random(rng, shape.splits.rows(r) * shape.bh(), 2.0)).collect();
            for epilogue in [false, true] {
                let (b, rr) = if epilogue { (Some(bias.as_slice()), Some(res.as_slice())) } else { (None, None) };
                let label = format!("{} W={w} {kind} {:?} epilogue={epilogue}", T::DTYPE.name(), shape.splits.sizes());
                let got = run_rs(device, &mut group, &shape, &inputs, b, rr, View::Dense, View::Dense).expect(&label);
                check_rs(&got, &inputs, &shape, b, rr, &label);
            }
            // all-gather of per-rank shards: a bit copy into every rank
            let shards: Vec<Vec<T>> = (0..w).map(|r| random(rng, shape.splits.rows(r) * shape.bh(), 3.0)).collect();
            let got = run_ag(device, &mut group, &shape, &shards, View::Dense, View::Dense).expect("all-gather");
            let want: Vec<T> = shards.iter().flatten().copied().collect();
            for (r, g) in got.iter().enumerate() {
                assert!(
                    g.iter().zip(&want).all(|(a, b)| same_bits(*a, *b)),
                    "{} W={w} {kind}: all-gather on rank {r} is not a bit copy",
                    T::DTYPE.name()
                );
            }
        }
    }
}

#[test]
fn reduce_scatter_and_all_gather_match_the_reference_for_every_world_size_and_dtype() {
    let mut rng = common::rng("parity");
    for device in common::backends() {
        parity_for::<f32>(&device, &mut rng);
        parity_for::<f16>(&device, &mut rng);
        parity_for::<bf16>(&device, &mut rng);
    }
}

#[test]
fn all_gather_of_reduce_scatter_is_an_all_reduce_identical_on_every_rank() {
    let mut rng = common::rng("all_reduce");
    for device in common::backends() {
        for (w, sizes) in [(4usize, vec![3usize, 3, 2, 2]), (3, vec![5, 0, 2])] {
            let shape = Shape::new(&sizes, 2, 20);
            let mut group = SeqParallelGroup::new(&device, w).expect("group");
            let inputs: Vec<Vec<bf16>> = (0..w).map(|_| random(&mut rng, shape.s() * shape.bh(), 8.0)).collect();
            let shards = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense)
                .expect("reduce-scatter");
            let gathered = run_ag(&device, &mut group, &shape, &shards, View::Dense, View::Dense).expect("all-gather");
            let want = rc::all_reduce(&inputs.iter().map(|x| widen(x)).collect::<Vec<_>>()).expect("reference");
            let mags = rc::all_reduce(
                &inputs.iter().map(|x| x.iter().map(|v| v.to_f64().abs()).collect()).collect::<Vec<_>>(),
            )
            .expect("reference");
            for r in 0..w {
                assert!(
                    gathered[r].iter().zip(&gathered[0]).all(|(a, b)| same_bits(*a, *b)),
                    "rank {r}'s all-reduce differs from rank 0's"
                );
                for i in 0..want.len() {
                    let acc = (w as f64 - 1.0) * 2f64.powi(-24) * mags[i];
                    let tol = acc + 2f64.powi(-8) * (want[i].abs() + acc);
                    assert!((gathered[r][i].to_f64() - want[i]).abs() <= tol, "element {i}");
                }
            }
        }
    }
}

#[test]
fn strided_transposed_and_misaligned_views_give_the_same_bits() {
    let mut rng = common::rng("views");
    for device in common::backends() {
        let shape = Shape::new(&[4, 3, 3, 1], 3, 10); // S = 11, not divisible by 4
        let w = shape.w();
        let mut group = SeqParallelGroup::new(&device, w).expect("group");
        let inputs: Vec<Vec<f16>> = (0..w).map(|_| random(&mut rng, shape.s() * shape.bh(), 4.0)).collect();
        let bias: Vec<Vec<f16>> = (0..w).map(|_| random(&mut rng, shape.h, 1.0)).collect();
        let res: Vec<Vec<f16>> = (0..w).map(|r| random(&mut rng, shape.splits.rows(r) * shape.bh(), 2.0)).collect();
        for (in_view, out_view) in [
            (View::Transposed, View::Dense),
            (View::Dense, View::Transposed),
            (View::Padded, View::Padded),
            (View::Offset1, View::Dense),
            (View::Dense, View::Offset1),
            (View::Offset1, View::Offset1),
        ] {
            let label = format!("RS in {in_view:?} out {out_view:?}");
            let got =
                run_rs(&device, &mut group, &shape, &inputs, Some(&bias), Some(&res), in_view, out_view).expect(&label);
            check_rs(&got, &inputs, &shape, Some(&bias), Some(&res), &label);
            let got = run_ag(&device, &mut group, &shape, &res, in_view, out_view).expect("all-gather");
            let want: Vec<f16> = res.iter().flatten().copied().collect();
            for g in &got {
                assert!(g.iter().zip(&want).all(|(a, b)| same_bits(*a, *b)), "AG in {in_view:?} out {out_view:?}");
            }
        }
    }
}

#[test]
fn element_counts_that_are_not_a_multiple_of_the_vector_width() {
    let mut rng = common::rng("tails");
    for device in common::backends() {
        // f32 vectors hold 4, f16/bf16 8: B·H = 13 and shard sizes leave tails of every length
        for sizes in [vec![1usize, 2, 1], vec![3, 1, 2], vec![1, 0, 1]] {
            let shape = Shape::new(&sizes, 1, 13);
            let mut group = SeqParallelGroup::new(&device, 3).expect("group");
            let inputs: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, shape.s() * shape.bh(), 1.0)).collect();
            let got = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense).expect("rs");
            check_rs(&got, &inputs, &shape, None, None, &format!("tails {sizes:?}"));
            let inputs: Vec<Vec<bf16>> = (0..3).map(|_| random(&mut rng, shape.s() * shape.bh(), 1.0)).collect();
            let got = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense).expect("rs");
            check_rs(&got, &inputs, &shape, None, None, &format!("tails bf16 {sizes:?}"));
        }
    }
}

#[test]
fn two_sizes_alternating_and_many_back_to_back_calls_with_fresh_data() {
    let mut rng = common::rng("back_to_back");
    for device in common::backends() {
        let mut group = SeqParallelGroup::new(&device, 4).expect("group");
        let a = Shape::new(&[4, 4, 4, 4], 2, 16);
        let b = Shape::new(&[3, 2, 2, 0], 1, 40);
        for call in 0..70 {
            let shape = if call % 2 == 0 { &a } else { &b };
            // the block count changes too: blocks past it skip calls, so the per-block epochs
            // drift apart (consistently on every rank) and must still meet correctly
            group.set_blocks_per_rank([0, 1, 3, 7, 2][call % 5]).expect("blocks per rank");
            let inputs: Vec<Vec<bf16>> = (0..4).map(|_| random(&mut rng, shape.s() * shape.bh(), 2.0)).collect();
            if call % 3 == 2 {
                let shards: Vec<Vec<bf16>> =
                    (0..4).map(|r| random(&mut rng, shape.splits.rows(r) * shape.bh(), 2.0)).collect();
                let got = run_ag(&device, &mut group, shape, &shards, View::Dense, View::Dense).expect("ag");
                let want: Vec<bf16> = shards.iter().flatten().copied().collect();
                assert!(got.iter().all(|g| g.iter().zip(&want).all(|(x, y)| same_bits(*x, *y))), "call {call}");
            } else {
                let got =
                    run_rs(&device, &mut group, shape, &inputs, None, None, View::Dense, View::Dense).expect("rs");
                check_rs(&got, &inputs, shape, None, None, &format!("call {call}"));
            }
        }
    }
}

#[test]
fn many_blocks_per_rank_with_grid_stride_loops() {
    let mut rng = common::rng("blocks");
    for device in common::backends() {
        // 4 ranks x 12 blocks of 256 threads over shards of up to 10·3·40 = 1200 elements:
        // every block, vector and tail loop and per-block flag slot is used
        let shape = Shape::new(&[10, 9, 9, 9], 3, 40);
        let mut group = SeqParallelGroup::new(&device, 4).expect("group");
        for bpr in [12usize, 5] {
            group.set_blocks_per_rank(bpr).expect("blocks");
            let inputs: Vec<Vec<f16>> = (0..4).map(|_| random(&mut rng, shape.s() * shape.bh(), 4.0)).collect();
            let res: Vec<Vec<f16>> = (0..4).map(|r| random(&mut rng, shape.splits.rows(r) * shape.bh(), 1.0)).collect();
            let got = run_rs(&device, &mut group, &shape, &inputs, None, Some(&res), View::Dense, View::Dense)
                .expect("reduce-scatter");
            check_rs(&got, &inputs, &shape, None, Some(&res), &format!("{bpr} blocks per rank"));
            let got = run_ag(&device, &mut group, &shape, &res, View::Padded, View::Transposed).expect("all-gather");
            let want: Vec<f16> = res.iter().flatten().copied().collect();
            assert!(got.iter().all(|g| g.iter().zip(&want).all(|(x, y)| same_bits(*x, *y))), "{bpr} blocks per rank");
        }
    }
}

#[test]
fn the_largest_grids_run_on_every_backend() {
    // 2 ranks x 128 blocks and 8 x 16 blocks of 256 threads: up to 256 blocks that must all be
    // resident at once (the emulator gives each its own OS thread and fiber stacks)
    let mut rng = common::rng("largest_grids");
    for device in common::backends() {
        for (w, bpr) in [(2usize, 128usize), (8, 16)] {
            let splits: Vec<usize> = (0..w).map(|r| 3 + r % 2).collect();
            let shape = Shape::new(&splits, 1, 4);
            let mut group = SeqParallelGroup::new(&device, w).expect("group");
            group.set_blocks_per_rank(bpr).expect("blocks");
            if device.backend_name() == "emulator" {
                // The emulator starts one OS thread per block. Under AddressSanitizer on 2 cores,
                // with the binary's other tests running beside it, a CI run (2026-12-04) saw a
                // block wait out the default 10 s for peers whose threads had not yet run. A
                // deadlock would still fail, after 120 s.
                group.set_timeout(Duration::from_secs(120)).expect("timeout");
            }
            let inputs: Vec<Vec<f32>> = (0..w).map(|_| random(&mut rng, shape.s() * shape.bh(), 1.0)).collect();
            let got = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense)
                .expect("reduce-scatter");
            check_rs(&got, &inputs, &shape, None, None, &format!("W={w}, {bpr} blocks per rank"));
        }
    }
}

#[test]
fn epoch_counters_wrap_around_u32() {
    let mut rng = common::rng("wrap");
    for device in common::backends() {
        let mut group = SeqParallelGroup::new(&device, 3).expect("group");
        group.set_epoch_for_testing(u32::MAX - 3).expect("epoch");
        let shape = Shape::new(&[2, 3, 2], 2, 8);
        for call in 0..8 {
            let inputs: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, shape.s() * shape.bh(), 1.0)).collect();
            let got = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense)
                .unwrap_or_else(|e| panic!("call {call} across the u32 wrap: {e}"));
            check_rs(&got, &inputs, &shape, None, None, &format!("wrap call {call}"));
        }
        // At the wrap itself (epoch u32::MAX -> 0) a missing peer's slot still holds u32::MAX:
        // only a wrap-safe comparison keeps waiting (a plain `>=` would see it as arrived).
        group.set_epoch_for_testing(u32::MAX).expect("epoch");
        group.set_timeout(Duration::from_millis(50)).expect("timeout");
        group.set_launch_ranks_for_testing(Some(0..2));
        let inputs: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, shape.s() * shape.bh(), 1.0)).collect();
        let result = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense);
        assert!(
            matches!(result, Err(Error::Timeout { .. })),
            "a stale u32::MAX slot passed for epoch 0: {:?}",
            result.err()
        );
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_with_nan_outputs_and_no_hang() {
    let mut rng = common::rng("timeout");
    for device in common::backends() {
        let shape = Shape::new(&[2, 2, 2, 2], 2, 8);
        let mut group = SeqParallelGroup::new(&device, 4).expect("group");
        let bound = Duration::from_millis(100);
        group.set_timeout(bound).expect("timeout");
        group.set_launch_ranks_for_testing(Some(0..3)); // rank 3's blocks are never launched
        let inputs: Vec<Vec<f32>> = (0..4).map(|_| random(&mut rng, shape.s() * shape.bh(), 1.0)).collect();
        let (layout, _) = layout_of(View::Dense, [shape.s(), shape.b, shape.h]);
        let in_bufs: Vec<_> = inputs.iter().map(|x| device.upload(x).expect("upload")).collect();
        let mut out_bufs: Vec<_> = (0..4).map(|_| device.upload(&vec![0.5f32; 2 * shape.bh()]).expect("up")).collect();
        let started = Instant::now();
        let result = {
            let ins: Vec<TensorRef<'_, f32>> =
                in_bufs.iter().map(|b| TensorRef::new(b, &layout).expect("view")).collect();
            let mut outs: Vec<TensorMut<'_, f32>> =
                out_bufs.iter_mut().map(|b| TensorMut::contiguous(b, &[2, shape.b, shape.h]).expect("view")).collect();
            group.reduce_scatter_seq(&ins, &mut outs, &shape.splits, &Epilogue::none()).and_then(|()| group.check())
        };
        let elapsed = started.elapsed();
        assert!(matches!(result, Err(Error::Timeout { .. })), "expected a timeout, got {result:?}");
        assert!(elapsed < bound * 50, "the timeout took {elapsed:?} (bound {bound:?})");
        for (r, buf) in out_bufs.iter().enumerate().take(3) {
            assert!(buf.to_vec().expect("down").iter().all(|x| x.is_nan()), "rank {r}: no stale data after a timeout");
        }
        // poisoned until reset, then healthy again
        group.set_launch_ranks_for_testing(None);
        let again = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense);
        assert!(matches!(again, Err(Error::Timeout { .. })), "a poisoned group must refuse: {:?}", again.err());
        group.reset().expect("reset");
        let got =
            run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense).expect("after reset");
        check_rs(&got, &inputs, &shape, None, None, "after reset");
    }
}

#[test]
fn values_near_the_bf16_range_limit_stay_finite_with_f32_accumulation() {
    for device in common::backends() {
        // MAX + c with c = 1e36 is 3.3995e38: past bf16's largest finite value plus half an ulp
        // (3.3961e38), so a bf16 running sum is +inf after two ranks, but below f32's maximum
        // (3.4028e38). Rank 2 subtracts MAX again: the f32 sum ends near c, finite.
        let max = bf16::MAX;
        let c = bf16::from_f64(1e36);
        let partial = max.to_f64() + c.to_f64();
        assert!(bf16::from_f64(partial).to_f64().is_infinite() && partial < f64::from(f32::MAX));
        let shape = Shape::new(&[1, 1, 1, 1], 1, 16);
        let n = shape.s() * shape.bh();
        let inputs = vec![vec![max; n], vec![c; n], vec![-max; n], vec![bf16::from_f64(3.0); n]];
        let mut group = SeqParallelGroup::new(&device, 4).expect("group");
        let got = run_rs(&device, &mut group, &shape, &inputs, None, None, View::Dense, View::Dense).expect("rs");
        for shard in &got {
            for x in shard {
                assert!(x.to_f64().is_finite(), "f32 accumulation must keep the sum finite, got {}", x.to_f64());
                assert!((x.to_f64() - c.to_f64()).abs() <= 2f64.powi(-8) * c.to_f64(), "got {}", x.to_f64());
            }
        }
        check_rs(&got, &inputs, &shape, None, None, "bf16 range");
    }
}

#[test]
fn bad_shapes_and_mismatched_splits_are_errors() {
    let device = common::emulator();
    let invalid_argument = |r: mesa_kernels::Result<()>| matches!(r, Err(Error::InvalidArgument { .. }));
    assert!(invalid_argument(SeqParallelGroup::new(&device, 0).map(drop)));
    assert!(invalid_argument(SeqParallelGroup::new(&device, 17).map(drop)));
    assert!(invalid_argument(SeqSplits::new(&[]).map(drop)));
    assert!(invalid_argument(SeqSplits::even(4, 0).map(drop)));
    assert!(matches!(SeqSplits::new(&[usize::MAX, 1]), Err(Error::TooLarge { .. })));
    assert_eq!(SeqSplits::even(10, 4).expect("even").sizes(), vec![3, 3, 2, 2]);
    let mut group = SeqParallelGroup::new(&device, 2).expect("group");
    assert!(invalid_argument(group.set_timeout(Duration::ZERO)));
    assert!(invalid_argument(group.set_timeout(Duration::MAX)));
    let (b, h) = (2usize, 4usize);
    let inputs = [vec![1.0f32; 6 * b * h], vec![1.0f32; 6 * b * h]];
    let mut outs = [vec![0.0f32; 3 * b * h], vec![0.0f32; 3 * b * h]];
    let full = Layout::contiguous(&[6, b, h]);
    let half = Layout::contiguous(&[3, b, h]);
    let ins = |l: &Layout| -> Vec<TensorRef<'_, f32>> {
        inputs.iter().map(|x| TensorRef::new(x, l).expect("view")).collect()
    };
    let mut call = |ins: &[TensorRef<'_, f32>], layouts: [Layout; 2], splits: &[usize]| {
        let [l0, l1] = layouts;
        let (o0, o1) = outs.split_at_mut(1);
        let mut o = vec![TensorMut::new(&mut o0[0], &l0)?, TensorMut::new(&mut o1[0], &l1)?];
        let splits = SeqSplits::new(splits).expect("splits");
        group.reduce_scatter_seq(ins, &mut o, &splits, &Epilogue::none())
    };
    // the baseline call is fine
    assert_eq!(call(&ins(&full), [half.clone(), half.clone()], &[3, 3]), Ok(()));
    // split sizes that do not sum to S: the inputs are not [S, B, H]
    assert!(matches!(
        call(&ins(&full), [half.clone(), half.clone()], &[3, 2]),
        Err(Error::ShapeMismatch { expected, got, .. }) if expected == [5, b, h] && got == [6, b, h]
    ));
    // a split list of the wrong world size
    assert!(invalid_argument(call(&ins(&full), [half.clone(), half.clone()], &[6])));
    // output shard of the wrong shape
    let wrong = Layout::contiguous(&[3, b, h - 1]);
    assert!(matches!(call(&ins(&full), [half.clone(), wrong], &[3, 3]), Err(Error::ShapeMismatch { .. })));
    // rank-2 input
    assert!(matches!(
        call(&ins(&Layout::contiguous(&[6, b * h])), [half.clone(), half.clone()], &[3, 3]),
        Err(Error::InvalidLayout { .. })
    ));
    // a view past the end of its buffer
    let past = Layout::strided(&[3, b, h], &[b * h, h, 1], 1).expect("layout");
    assert!(matches!(call(&ins(&full), [half.clone(), past], &[3, 3]), Err(Error::BufferTooShort { .. })));
    // an output that overlaps itself (stride 0)
    let bcast = Layout::strided(&[3, b, h], &[0, h, 1], 0).expect("layout");
    assert!(matches!(call(&ins(&full), [bcast.clone(), bcast], &[3, 3]), Err(Error::InvalidLayout { .. })));
    // ranks with different strides
    let padded = Layout::strided(&[3, b, h], &[h * b, 1, b], 0).expect("layout");
    assert!(matches!(call(&ins(&full), [half.clone(), padded], &[3, 3]), Err(Error::Unsupported { .. })));
    // wrong number of ranks
    let one = [TensorRef::new(&inputs[0], &full).expect("view")];
    assert!(invalid_argument(call(&one, [half.clone(), half.clone()], &[3, 3])));
    // all-gather: inputs must be the shards
    let mut big = [vec![0.0f32; 6 * b * h], vec![0.0f32; 6 * b * h]];
    let (g0, g1) = big.split_at_mut(1);
    let mut o =
        vec![TensorMut::new(&mut g0[0], &full).expect("view"), TensorMut::new(&mut g1[0], &full).expect("view")];
    let splits = SeqSplits::new(&[3, 3]).expect("splits");
    assert!(matches!(group.all_gather_seq(&ins(&full), &mut o, &splits), Err(Error::ShapeMismatch { .. })));
    assert_eq!(group.all_gather_seq(&ins(&half), &mut o, &splits), Ok(()));
    drop(o);
    assert!(big.iter().all(|x| x.iter().all(|&v| v == 1.0)), "all-gather of ones");

    // a grid that cannot be co-resident (the emulator, like a GPU, caps cooperative launches)
    let mut wide = SeqParallelGroup::new(&device, 16).expect("group");
    assert!(matches!(wide.set_blocks_per_rank(129), Err(Error::InvalidArgument { .. })));
    wide.set_blocks_per_rank(64).expect("64 blocks per rank");
    let data: Vec<Vec<f32>> = (0..16).map(|_| vec![1.0f32; 16 * 4]).collect();
    let mut shards: Vec<Vec<f32>> = (0..16).map(|_| vec![0.0f32; 4]).collect();
    let ins16: Vec<TensorRef<'_, f32>> =
        data.iter().map(|x| TensorRef::contiguous(x, &[16, 1, 4]).expect("view")).collect();
    let mut outs16: Vec<TensorMut<'_, f32>> =
        shards.iter_mut().map(|x| TensorMut::contiguous(x, &[1, 1, 4]).expect("view")).collect();
    let even = SeqSplits::even(16, 16).expect("splits");
    let r = wide.reduce_scatter_seq(&ins16, &mut outs16, &even, &Epilogue::none());
    assert!(matches!(r, Err(Error::TooLarge { .. })), "16 x 64 blocks must not launch: {r:?}");
    wide.set_blocks_per_rank(0).expect("auto");
    assert_eq!(wide.reduce_scatter_seq(&ins16, &mut outs16, &even, &Epilogue::none()), Ok(()));
    drop(outs16);
    assert!(shards.iter().all(|s| s.iter().all(|&v| v == 16.0)), "W = 16: every shard sums 16 ones");
}

/// The C entry point re-checks what would make the kernel touch memory it should not.
#[test]
fn collective_entry_point_rejects_bad_arguments() {
    use mesa_kernels_sys as sys;
    let mut flags = vec![0u32; 2 * sys::MESA_SEQPAR_FLAG_WORDS as usize];
    let input = [1.0f32; 8];
    let mut out = [[0.0f32; 4]; 2];
    let mut good = sys::MesaSeqParArgs {
        batch: 1,
        hidden: 4,
        in_strides: [4, 4, 1],
        out_strides: [4, 4, 1],
        timeout_ns: 1_000_000_000,
        world_size: 2,
        rank_count: 2,
        dtype: sys::MESA_DTYPE_F32 as i32,
        ..Default::default()
    };
    good.split_offsets[1] = 1;
    good.split_offsets[2] = 2;
    let fp = flags.as_mut_ptr();
    for (r, o) in out.iter_mut().enumerate() {
        good.ranks[r] = sys::MesaSeqParRank {
            input: input.as_ptr().cast(),
            output: o.as_mut_ptr().cast(),
            residual: std::ptr::null(),
            bias: std::ptr::null(),
            flags: fp.wrapping_add(r * sys::MESA_SEQPAR_FLAG_WORDS as usize),
        };
    }
    let call = |a: &sys::MesaSeqParArgs| {
        // SAFETY: the pointers address the host arrays above, large enough for the good case;
        // the bad cases are rejected before any access.
        unsafe { sys::mesa_emu_seqpar_reduce_scatter(a, std::ptr::null_mut()) }
    };
    assert_eq!(call(&good), 0);
    assert_eq!(out, [[2.0; 4]; 2]);
    let invalid = sys::MESA_STATUS_INVALID_ARGUMENT as i32;
    let mut bad = good;
    bad.world_size = 17;
    assert_eq!(call(&bad), invalid, "world size past the maximum");
    let mut bad = good;
    bad.rank_begin = 1;
    assert_eq!(call(&bad), invalid, "launch past the last rank");
    let mut bad = good;
    bad.split_offsets[1] = 3;
    assert_eq!(call(&bad), invalid, "decreasing split offsets");
    let mut bad = good;
    bad.blocks_per_rank = 129;
    assert_eq!(call(&bad), invalid, "blocks per rank past the flag capacity");
    let mut bad = good;
    bad.ranks[1].flags = std::ptr::null_mut();
    assert_eq!(call(&bad), invalid, "a peer without flags");
    let mut bad = good;
    bad.dtype = 9;
    assert_eq!(call(&bad), invalid, "unknown dtype");
}

/// The NCCL backend on a one-rank communicator (GPU only; needs libnccl on the library path).
/// With one rank the reduce-scatter is the identity plus the epilogue, so the f32-accumulation
/// result is bitwise the fixed-order f32 evaluation, and the all-gather a bit copy.
#[cfg(feature = "nccl")]
#[test]
fn nccl_backend_one_rank_communicator() {
    use mesa_kernels::collectives::nccl::{Accumulation, NcclSeqParallel, NcclUniqueId, ShardEpilogue};
    let Some(device) = common::cuda_only("nccl_backend_one_rank_communicator") else { return };
    let id = match NcclUniqueId::new() {
        Ok(id) => id,
        Err(e) => {
            assert!(
                !common::require_gpu() || std::env::var_os("MESA_ALLOW_NO_NCCL").is_some(),
                "NCCL unavailable: {e}"
            );
            eprintln!("SKIPPED nccl_backend_one_rank_communicator: {e}");
            return;
        }
    };
    let mut rng = common::rng("nccl");
    let mut comm = NcclSeqParallel::new(&device, 0, 1, &id).expect("communicator");
    let shape = Shape::new(&[5], 3, 24);
    let n = shape.s() * shape.bh();
    for acc in [Accumulation::F32, Accumulation::InputDtype] {
        comm.set_accumulation(acc);
        let x: Vec<bf16> = random(&mut rng, n, 4.0);
        let bias: Vec<bf16> = random(&mut rng, shape.h, 1.0);
        let res: Vec<bf16> = random(&mut rng, n, 2.0);
        let (xb, bb, rb) =
            (device.upload(&x).expect("up"), device.upload(&bias).expect("up"), device.upload(&res).expect("up"));
        let mut out = device.upload(&vec![bf16::NAN; n]).expect("up");
        {
            let layout = Layout::contiguous(&[shape.s(), shape.b, shape.h]);
            let mut o = TensorMut::new(&mut out, &layout).expect("view");
            let bias_view = TensorRef::contiguous(&bb, &[shape.h]).expect("view");
            let res_view = TensorRef::new(&rb, &layout).expect("view");
            let epilogue = ShardEpilogue { bias: Some(&bias_view), residual: Some(&res_view) };
            comm.reduce_scatter_seq(&TensorRef::new(&xb, &layout).expect("view"), &mut o, &shape.splits, &epilogue)
                .expect("reduce-scatter");
        }
        let got = out.to_vec().expect("down");
        // one rank: Σ = x exactly; f32: rnd((x + bias) + res) once; input dtype: the same
        // (NCCL's one-rank sum is x itself, already bf16)
        let want = fixed_order(
            std::slice::from_ref(&x),
            &shape.splits,
            shape.bh(),
            shape.h,
            Some(std::slice::from_ref(&bias)),
            Some(std::slice::from_ref(&res)),
        );
        assert!(got.iter().zip(&want[0]).all(|(a, b)| same_bits(*a, *b)), "{acc:?}: NCCL reduce-scatter differs");
        let mut gathered = device.upload(&vec![bf16::NAN; n]).expect("up");
        {
            let layout = Layout::contiguous(&[shape.s(), shape.b, shape.h]);
            let mut o = TensorMut::new(&mut gathered, &layout).expect("view");
            comm.all_gather_seq(&TensorRef::new(&out, &layout).expect("view"), &mut o, &shape.splits)
                .expect("all-gather");
        }
        assert!(gathered.to_vec().expect("down").iter().zip(&got).all(|(a, b)| same_bits(*a, *b)));
    }
    let mut grads = device.upload(&[1.5f32, -2.0, 3.25]).expect("up");
    comm.all_reduce_sum(&mut grads).expect("all-reduce");
    assert_eq!(grads.to_vec().expect("down"), vec![1.5, -2.0, 3.25]);
}

/// The elementwise epilogue/conversion kernel of the NCCL path (run here through the
/// emulator's C entry point, since the NCCL backend itself needs GPUs): upcast to f32, then
/// `rnd((sum + bias[h]) + residual)` in f32 with one rounding, in place or not.
#[test]
fn nccl_path_epilogue_kernel_widens_adds_and_rounds_once() {
    use mesa_kernels_sys as sys;
    let mut rng = common::rng("epilogue");
    let (n, h) = (3 * 37, 37usize);
    let x: Vec<bf16> = random(&mut rng, n, 4.0);
    let bias: Vec<bf16> = random(&mut rng, h, 1.0);
    let res: Vec<bf16> = random(&mut rng, n, 2.0);
    let launch = |args: &sys::MesaSeqParEpilogueArgs| {
        // SAFETY: every pointer addresses n (bias: h) host elements of the dtype it is tagged with.
        let status = unsafe { sys::mesa_emu_seqpar_epilogue(args, std::ptr::null_mut()) };
        assert_eq!(status, 0, "epilogue status");
    };
    // widen bf16 -> f32 (exact)
    let mut wide = vec![f32::NAN; n];
    launch(&sys::MesaSeqParEpilogueArgs {
        src: x.as_ptr().cast(),
        dst: wide.as_mut_ptr().cast(),
        bias: std::ptr::null(),
        residual: std::ptr::null(),
        n: n as i64,
        hidden: h as i64,
        src_dtype: sys::MESA_DTYPE_BF16 as i32,
        dst_dtype: sys::MESA_DTYPE_F32 as i32,
    });
    assert!(wide.iter().zip(&x).all(|(w, v)| f64::from(*w) == v.to_f64()));
    // f32 -> bf16 with bias and residual: the fixed-order contract with one "rank"
    let mut out = vec![bf16::NAN; n];
    launch(&sys::MesaSeqParEpilogueArgs {
        src: wide.as_ptr().cast(),
        dst: out.as_mut_ptr().cast(),
        bias: bias.as_ptr().cast(),
        residual: res.as_ptr().cast(),
        n: n as i64,
        hidden: h as i64,
        src_dtype: sys::MESA_DTYPE_F32 as i32,
        dst_dtype: sys::MESA_DTYPE_BF16 as i32,
    });
    let splits = SeqSplits::new(&[3]).expect("splits");
    let want = fixed_order(
        std::slice::from_ref(&x),
        &splits,
        h,
        h,
        Some(std::slice::from_ref(&bias)),
        Some(std::slice::from_ref(&res)),
    );
    assert!(out.iter().zip(&want[0]).all(|(a, b)| same_bits(*a, *b)), "f32 -> bf16 epilogue");
    // in place, bf16 -> bf16
    let mut inplace = x.clone();
    let p = inplace.as_mut_ptr();
    launch(&sys::MesaSeqParEpilogueArgs {
        src: p.cast_const().cast(),
        dst: p.cast(),
        bias: bias.as_ptr().cast(),
        residual: res.as_ptr().cast(),
        n: n as i64,
        hidden: h as i64,
        src_dtype: sys::MESA_DTYPE_BF16 as i32,
        dst_dtype: sys::MESA_DTYPE_BF16 as i32,
    });
    assert!(inplace.iter().zip(&want[0]).all(|(a, b)| same_bits(*a, *b)), "in-place epilogue");
    // bad arguments are rejected by the entry point
    let bad = sys::MesaSeqParEpilogueArgs { n: 4, src_dtype: 7, ..Default::default() };
    // SAFETY: rejected before any pointer is used.
    assert_eq!(
        unsafe { sys::mesa_emu_seqpar_epilogue(&bad, std::ptr::null_mut()) },
        sys::MESA_STATUS_INVALID_ARGUMENT as i32
    );
}

/// Issue 8: every output of a timed-out call is NaN, for every rank: asserts that `result` is
/// a timeout and that every element of every buffer in `out_bufs` is NaN.
fn assert_all_nan(out_bufs: &[mesa_kernels::Buffer<f32>], result: mesa_kernels::Result<()>, label: &str) {
    assert!(matches!(result, Err(Error::Timeout { .. })), "{label}: expected a timeout, got {result:?}");
    for (r, buf) in out_bufs.iter().enumerate() {
        let data = buf.to_vec().expect("download");
        let finite = data.iter().filter(|x| !x.is_nan()).count();
        assert_eq!(finite, 0, "{label}: rank {r} holds {finite} non-NaN elements of {} after a timeout", data.len());
    }
}

/// Issue 8 (timeout at START, late peer): ranks 0..3 publish their START flags, wait for
/// rank 3, give up and return; their inputs then change. Rank 3 arrives after that (a
/// separate launch, as on its own GPU, whose host has not seen the timeout): it must not read
/// the changing inputs into finite results.
#[test]
fn a_late_rank_arriving_after_the_others_gave_up_writes_nan() {
    let mut rng = common::rng("late_rank");
    for device in common::backends() {
        let shape = Shape::new(&[2, 2, 2, 2], 2, 8);
        let mut group = SeqParallelGroup::new(&device, 4).expect("group");
        group.set_timeout(Duration::from_millis(50)).expect("timeout");
        let n = shape.s() * shape.bh();
        let inputs: Vec<Vec<f32>> = (0..4).map(|_| random(&mut rng, n, 1.0)).collect();
        let layout = Layout::contiguous(&[shape.s(), shape.b, shape.h]);
        let mut in_bufs: Vec<_> = inputs.iter().map(|x| device.upload(x).expect("upload")).collect();
        let mut out_bufs: Vec<_> = (0..4).map(|_| device.upload(&vec![0.5f32; 2 * shape.bh()]).expect("up")).collect();
        let call = |group: &mut SeqParallelGroup, in_bufs: &[mesa_kernels::Buffer<f32>], out_bufs: &mut [_]| {
            let ins: Vec<TensorRef<'_, f32>> =
                in_bufs.iter().map(|b| TensorRef::new(b, &layout).expect("view")).collect();
            let mut outs: Vec<TensorMut<'_, f32>> =
                out_bufs.iter_mut().map(|b| TensorMut::contiguous(b, &[2, shape.b, shape.h]).expect("view")).collect();
            group.reduce_scatter_seq(&ins, &mut outs, &shape.splits, &Epilogue::none()).and_then(|()| group.check())
        };
        group.set_launch_ranks_for_testing(Some(0..3));
        let first = call(&mut group, &in_bufs, &mut out_bufs);
        assert!(matches!(first, Err(Error::Timeout { .. })), "ranks 0..3 must time out: {first:?}");
        // the ranks that gave up go on: their inputs are overwritten by the next layer
        for buf in &mut in_bufs[..3] {
            device.copy_into(&vec![1.0e6f32; n], buf).expect("overwrite");
        }
        group.clear_poisoned_for_testing();
        group.set_launch_ranks_for_testing(Some(3..4));
        let late = call(&mut group, &in_bufs, &mut out_bufs);
        assert_all_nan(&out_bufs, late, &format!("{} late rank", device.backend_name()));
    }
}

/// Issue 8 (timeout at END): every launched rank passes START (rank 3's START flags are
/// there, as if it had arrived) and computes its shard, then rank 3 never reaches END. The
/// ranks time out at END: their outputs must be NaN too, not the finite shards.
#[test]
fn a_timeout_at_end_leaves_nan_outputs() {
    let mut rng = common::rng("end_timeout");
    for device in common::backends() {
        let shape = Shape::new(&[2, 2, 2, 2], 2, 8);
        let mut group = SeqParallelGroup::new(&device, 4).expect("group");
        group.set_timeout(Duration::from_millis(50)).expect("timeout");
        let n = shape.s() * shape.bh();
        let inputs: Vec<Vec<f32>> = (0..4).map(|_| random(&mut rng, n, 1.0)).collect();
        let layout = Layout::contiguous(&[shape.s(), shape.b, shape.h]);
        let in_bufs: Vec<_> = inputs.iter().map(|x| device.upload(x).expect("upload")).collect();
        let mut out_bufs: Vec<_> = (0..4).map(|_| device.upload(&vec![0.5f32; 2 * shape.bh()]).expect("up")).collect();
        group.pretend_start_for_testing(3).expect("fake START of rank 3");
        group.set_launch_ranks_for_testing(Some(0..3));
        let result = {
            let ins: Vec<TensorRef<'_, f32>> =
                in_bufs.iter().map(|b| TensorRef::new(b, &layout).expect("view")).collect();
            let mut outs: Vec<TensorMut<'_, f32>> =
                out_bufs.iter_mut().map(|b| TensorMut::contiguous(b, &[2, shape.b, shape.h]).expect("view")).collect();
            group.reduce_scatter_seq(&ins, &mut outs, &shape.splits, &Epilogue::none()).and_then(|()| group.check())
        };
        // rank 3 was never launched: its output keeps its 0.5s; the launched ranks' must be NaN
        let label = format!("{} END timeout", device.backend_name());
        assert_all_nan(&out_bufs[..3], result, &label);
        assert!(out_bufs[3].to_vec().expect("down").iter().all(|&x| x == 0.5), "{label}: rank 3 was not launched");
    }
}

/// Issue 8 (aliasing): one host vector given as a rank's input and, through a
/// `RawDeviceSlice`, as the same rank's output. The kernel reads every input after other
/// ranks may have written their shards, so an in-place call would read overwritten data:
/// it must be rejected before the launch.
#[test]
fn a_rank_whose_output_overlaps_an_input_is_rejected() {
    use mesa_kernels::RawDeviceSlice;
    let device = common::emulator();
    let (b, h) = (2usize, 4usize);
    let mut group = SeqParallelGroup::new(&device, 2).expect("group");
    let mut shared = vec![1.0f32; 6 * b * h];
    let other = vec![2.0f32; 6 * b * h];
    let mut out1 = vec![0.0f32; 3 * b * h];
    // SAFETY: `shared` outlives both views and is not otherwise used until they are dropped.
    let raw_in = unsafe { RawDeviceSlice::<f32>::new(shared.as_mut_ptr() as u64, shared.len()) };
    let mut raw_out = unsafe { RawDeviceSlice::<f32>::new(shared.as_mut_ptr() as u64, shared.len()) };
    let splits = SeqSplits::new(&[3, 3]).expect("splits");
    let full = Layout::contiguous(&[6, b, h]);
    let ins = [TensorRef::new(&raw_in, &full).expect("view"), TensorRef::new(&other, &full).expect("view")];
    let mut outs = [
        TensorMut::contiguous(&mut raw_out, &[3, b, h]).expect("view"),
        TensorMut::contiguous(&mut out1, &[3, b, h]).expect("view"),
    ];
    let r = group.reduce_scatter_seq(&ins, &mut outs, &splits, &Epilogue::none());
    assert!(matches!(r, Err(Error::Aliasing { .. })), "rank 0's output over its input must be rejected: {r:?}");
    drop(outs);
    drop(ins);
    assert!(shared.iter().all(|&x| x == 1.0), "nothing may be written when the call is rejected");
}

/// Outputs may overlap nothing else of the call: another rank's output, a residual, or the
/// same buffer shared by two ranks' outputs are all rejected, and nothing is written.
#[test]
fn outputs_overlapping_other_outputs_or_residuals_are_rejected() {
    use mesa_kernels::RawDeviceSlice;
    let device = common::emulator();
    let (b, h) = (1usize, 4usize);
    let mut group = SeqParallelGroup::new(&device, 2).expect("group");
    let inputs = [vec![1.0f32; 4 * b * h], vec![2.0f32; 4 * b * h]];
    let full = Layout::contiguous(&[4, b, h]);
    let ins: Vec<TensorRef<'_, f32>> = inputs.iter().map(|x| TensorRef::new(x, &full).expect("view")).collect();
    let splits = SeqSplits::new(&[2, 2]).expect("splits");
    // both ranks' outputs in one vector, overlapping by one row
    let mut both = vec![-1.0f32; 3 * b * h];
    let p = both.as_mut_ptr();
    // SAFETY: `both` outlives the views and is not otherwise touched until they are dropped.
    let (mut r0, mut r1) = unsafe {
        (RawDeviceSlice::<f32>::new(p as u64, 2 * b * h), RawDeviceSlice::<f32>::new(p.add(b * h) as u64, 2 * b * h))
    };
    let mut outs = [
        TensorMut::contiguous(&mut r0, &[2, b, h]).expect("view"),
        TensorMut::contiguous(&mut r1, &[2, b, h]).expect("view"),
    ];
    let r = group.reduce_scatter_seq(&ins, &mut outs, &splits, &Epilogue::none());
    assert!(
        matches!(r, Err(Error::Aliasing { first: "output 0", second: "output 1" })),
        "overlapping outputs of two ranks: {r:?}"
    );
    drop(outs);
    // rank 1's residual is rank 0's output
    let mut out0 = vec![-1.0f32; 2 * b * h];
    let mut out1 = vec![-1.0f32; 2 * b * h];
    // SAFETY: as above, for `out0`.
    let res_alias = unsafe { RawDeviceSlice::<f32>::new(out0.as_mut_ptr() as u64, out0.len()) };
    let res_other = vec![0.0f32; 2 * b * h];
    let residual = [
        TensorRef::contiguous(&res_other, &[2, b, h]).expect("view"),
        TensorRef::contiguous(&res_alias, &[2, b, h]).expect("view"),
    ];
    let mut outs = [
        TensorMut::contiguous(&mut out0, &[2, b, h]).expect("view"),
        TensorMut::contiguous(&mut out1, &[2, b, h]).expect("view"),
    ];
    let r = group.reduce_scatter_seq(&ins, &mut outs, &splits, &Epilogue { bias: None, residual: Some(&residual) });
    assert!(matches!(r, Err(Error::Aliasing { .. })), "a residual over an output: {r:?}");
    drop(outs);
    assert!(both.iter().chain(&out0).chain(&out1).all(|&x| x == -1.0), "nothing may be written");
}

/// No panic on any input: empty shards next to huge other dimensions (whose products overflow
/// usize) are handled as empty, on the wrapper and on the reference; overflowing split sizes
/// are errors. Run once with overflow checks on (see the report of issue 8).
#[test]
fn empty_shards_with_huge_dims_are_empty_not_a_panic() {
    let device = common::emulator();
    let huge = usize::MAX / 2;
    let mut group = SeqParallelGroup::new(&device, 2).expect("group");
    // S = 0: every shard empty, B·H overflows
    let splits = SeqSplits::new(&[0, 0]).expect("splits");
    let empty: Vec<f32> = Vec::new();
    let mut o0: Vec<f32> = Vec::new();
    let mut o1: Vec<f32> = Vec::new();
    let ins = [
        TensorRef::contiguous(&empty, &[0, huge, huge]).expect("empty view"),
        TensorRef::contiguous(&empty, &[0, huge, huge]).expect("empty view"),
    ];
    let mut outs = [
        TensorMut::contiguous(&mut o0, &[0, huge, huge]).expect("empty view"),
        TensorMut::contiguous(&mut o1, &[0, huge, huge]).expect("empty view"),
    ];
    assert_eq!(group.reduce_scatter_seq(&ins, &mut outs, &splits, &Epilogue::none()), Ok(()));
    assert_eq!(group.all_gather_seq(&ins, &mut outs, &splits), Ok(()));
    // H = 0 with a huge S: nothing moves
    let splits = SeqSplits::new(&[huge, huge]).expect("splits");
    let ins = [
        TensorRef::contiguous(&empty, &[2 * huge, 1, 0]).expect("empty view"),
        TensorRef::contiguous(&empty, &[2 * huge, 1, 0]).expect("empty view"),
    ];
    let mut outs = [
        TensorMut::contiguous(&mut o0, &[huge, 1, 0]).expect("empty view"),
        TensorMut::contiguous(&mut o1, &[huge, 1, 0]).expect("empty view"),
    ];
    assert_eq!(group.reduce_scatter_seq(&ins, &mut outs, &splits, &Epilogue::none()), Ok(()));
    assert!(matches!(SeqSplits::new(&[huge, huge, huge]), Err(Error::TooLarge { .. })));
    // the reference: empty results, errors for overflowing sizes or wrong lengths
    let none: Vec<Vec<f64>> = vec![Vec::new(), Vec::new()];
    assert_eq!(rc::reduce_scatter_seq(&none, &[0, 0], huge, huge, None, None), Ok(vec![Vec::new(), Vec::new()]));
    assert!(matches!(rc::reduce_scatter_seq(&none, &[1, 0], huge, huge, None, None), Err(Error::TooLarge { .. })));
    assert!(matches!(rc::split_offsets(&[usize::MAX, 1]), Err(Error::TooLarge { .. })));
    assert!(matches!(rc::reduce_scatter_seq(&none, &[1, 0], 1, 2, None, None), Err(Error::InvalidLayout { .. })));
    assert!(matches!(rc::all_reduce(&[vec![1.0], vec![]]), Err(Error::InvalidLayout { .. })));
    assert_eq!(rc::all_reduce(&[vec![1.0, 2.0], vec![0.5, 0.25]]), Ok(vec![1.5, 2.25]));
}

/// An empty shard may be given as a null pointer (what `cudaMalloc(0)` and framework
/// allocators hand out): an all-gather input or a reduce-scatter output of 0 rows. The
/// results are exact (bit copies; sums of two ones), as for any other shard.
#[test]
fn null_pointers_for_empty_shards_are_accepted() {
    let device = common::emulator();
    // SAFETY: a zero-length view; the builder and the kernels never dereference it.
    let null: mesa_kernels::RawDeviceSlice<f32> = unsafe { mesa_kernels::RawDeviceSlice::new(0, 0) };
    let mut null_out: mesa_kernels::RawDeviceSlice<f32> = unsafe { mesa_kernels::RawDeviceSlice::new(0, 0) };
    let mut group = SeqParallelGroup::new(&device, 2).expect("group");
    let splits = SeqSplits::new(&[2, 0]).expect("splits");
    // all-gather: rank 1 contributes no rows
    let shard0: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
    let (mut o0, mut o1) = (vec![f32::NAN; 4], vec![f32::NAN; 4]);
    {
        let ins = [
            TensorRef::contiguous(&shard0, &[2, 1, 2]).expect("view"),
            TensorRef::contiguous(&null, &[0, 1, 2]).expect("view"),
        ];
        let mut outs = vec![
            TensorMut::contiguous(&mut o0, &[2, 1, 2]).expect("view"),
            TensorMut::contiguous(&mut o1, &[2, 1, 2]).expect("view"),
        ];
        let r = group.all_gather_seq(&ins, &mut outs, &splits);
        assert!(r.is_ok(), "all-gather with a null empty shard: {r:?}");
    }
    assert_eq!((o0.clone(), o1.clone()), (shard0.clone(), shard0.clone()), "gathered rows");
    // reduce-scatter: rank 1 receives no rows
    let ones = vec![1f32; 4];
    let mut out0 = vec![f32::NAN; 4];
    {
        let ins = [
            TensorRef::contiguous(&ones, &[2, 1, 2]).expect("view"),
            TensorRef::contiguous(&ones, &[2, 1, 2]).expect("view"),
        ];
        let mut outs = vec![
            TensorMut::contiguous(&mut out0, &[2, 1, 2]).expect("view"),
            TensorMut::contiguous(&mut null_out, &[0, 1, 2]).expect("view"),
        ];
        let r = group.reduce_scatter_seq(&ins, &mut outs, &splits, &Epilogue::none());
        assert!(r.is_ok(), "reduce-scatter with a null empty output shard: {r:?}");
    }
    assert_eq!(out0, vec![2.0; 4], "sum of two ranks of ones");
}

/// After a timeout the group is poisoned until `reset`; a later call must not leave stale
/// numbers in its outputs (the promise of `Error::Timeout`: every output NaN), and a call
/// that is invalid anyway reports its own error, not the old timeout.
#[test]
fn a_poisoned_group_writes_nan_not_stale_numbers() {
    let device = common::emulator();
    let mut group = SeqParallelGroup::new(&device, 2).expect("group");
    group.set_timeout(Duration::from_millis(20)).expect("timeout");
    let input = vec![1f32; 8];
    let call = |group: &mut SeqParallelGroup, fill: f32| {
        let (mut o0, mut o1) = (vec![fill; 4], vec![fill; 4]);
        let r = {
            let ins = [
                TensorRef::contiguous(&input, &[4, 1, 2]).expect("view"),
                TensorRef::contiguous(&input, &[4, 1, 2]).expect("view"),
            ];
            let mut outs = vec![
                TensorMut::contiguous(&mut o0, &[2, 1, 2]).expect("view"),
                TensorMut::contiguous(&mut o1, &[2, 1, 2]).expect("view"),
            ];
            group.reduce_scatter_seq(&ins, &mut outs, &SeqSplits::even(4, 2).expect("splits"), &Epilogue::none())
        };
        (r, o0, o1)
    };
    group.set_launch_ranks_for_testing(Some(0..1)); // rank 1 never comes: rank 0 times out
    let (r, o0, _) = call(&mut group, 7.0);
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(o0.iter().all(|v| v.is_nan()), "first timed-out call: {o0:?}");
    group.set_launch_ranks_for_testing(None);
    let (r, o0, o1) = call(&mut group, 7.0);
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(o0.iter().chain(&o1).all(|v| v.is_nan()), "poisoned group left {o0:?} {o1:?}");
    // an invalid call on a poisoned group: its own error kind
    let mut o = vec![0f32; 8];
    let ins = [TensorRef::contiguous(&input, &[4, 1, 2]).expect("view")];
    let mut outs = vec![TensorMut::contiguous(&mut o, &[4, 1, 2]).expect("view")];
    let r = group.reduce_scatter_seq(&ins, &mut outs, &SeqSplits::new(&[4]).expect("splits"), &Epilogue::none());
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    group.reset().expect("reset");
    // both ranks come now: a bound for a loaded machine, not for a missing rank (20 ms flaked
    // under the emulator's checks with other jobs running)
    group.set_timeout(Duration::from_secs(30)).expect("timeout");
    let (r, o0, o1) = call(&mut group, 7.0);
    r.expect("after reset");
    assert_eq!((o0, o1), (vec![2.0; 4], vec![2.0; 4]));
}
