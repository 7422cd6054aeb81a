//! Gated linear attention across sequence shards (`parallel::gated_lasp`, issue 41), ranks as
//! threads: the assembled outputs and gradients (q, k, v and the decay) against the f64
//! reference on the whole sequence (`mesa_kernels::reference::gated_linear_attention`), for 1,
//! 2 and 4 ranks, per-step and per-head decay, grouped heads, resets inside a shard and on a
//! shard's first row, an empty shard; one rank bitwise the gated kernel on the whole sequence;
//! bad inputs (docs/sequence_parallel.md, "Linear attention across sequence shards (LASP)").
//!
//! Bounds (per element; u = 2⁻²⁴). The inputs are f32 values and the reference reads them in
//! f64, so all error is f32 arithmetic. Every result is a sum of products of non-negative
//! weights and inputs; `mag` is the reference run on |q|, |k|, |v|, |dout| with the same decay
//! (every term by its magnitude). A term's chain of roundings is at most
//! * the kernel's, on a shard of ≤ L rows: `M + D + 2L + 2C + L/C + 24` (tests/gated_linear_attention.rs),
//! * the hand-off: `w_s` (one rounding of an f64 exponential), the local state's matmul (≤ L
//!   terms), the fold over ≤ W ranks (a product, an `exp`, an addition each: 4W), the
//!   gradient's correction (a matmul over M or W = D columns, the weight: M + D + 2), and the
//!   group's sum of ≤ G heads;
//!
//! and its weight's exponent is off by the kernel's `2C·u·(|Σ_span a| + C·α)` ≤
//! `2C·u·(L + C)·α` (α = max |finite a|) plus `Σ_p |A_p|·u ≤ W·L·α·u` (each `A_p` rounded to
//! f32 once). So `|err| ≤ u·N·mag` with `N = M + D + 3L + 2C + L/C + 4W + G + 40 + (2C(L + C) +
//! W·L)·α`. The decay's gradient is a sum over rows of `q·dq`- and `k·dk`-type products
//! (module docs of `mesa_kernels::gated_linear_attention` and `parallel::gated_lasp`): its error
//! is at most `Σ (|q|·bound(dq) + |k|·bound(dk))` over the group's rows plus `(M + 2L + G + 8)·u`
//! times the terms' magnitude `T = Σ (|q|·mag(dq) + |k|·mag(dk))` (the prefix and suffix sums
//! over rows and their dots); per head, summed over B and the rows, `B·L` times that plus
//! `B·L·u·L·T`.
use super::common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Tensor, Var};
use common::Rng;
use mesa_candle::parallel::gated_lasp::ShardedGatedLinearAttention;
use mesa_candle::parallel::{run_ranks, thread_group, Collectives, Rank};
use mesa_candle::{as_mesa_error, Error};
use mesa_kernels::gated_linear_attention::{self as kgla, GatedConfig};
use mesa_kernels::reference::gated_linear_attention as rg;
use mesa_kernels::{TensorMut, TensorRef};

const U: f64 = 1.0 / (1u64 << 24) as f64;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    PerStep,
    PerHead,
}

#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    h: usize,
    hkv: usize,
    m: usize,
    d: usize,
}

/// The whole sequence: `q, k, v, a, dy` (CPU f32).
struct Problem {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    dy: Tensor,
    /// max |finite a|
    alpha: f64,
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// Per step: `a` uniform in [−α, 0] with the rows `resets` (b, KV head, t) at −∞; per head:
/// `a` uniform in [−α, 0] with the KV heads `resets.2` at −∞.
fn problem(rng: &mut Rng, s: Dims, l: usize, kind: Kind, alpha: f64, resets: &[(usize, usize, usize)]) -> Problem {
    let Dims { b, h, hkv, m, d } = s;
    let q = rng.tensor(&[b, h, l, m], 0.0, 0.7, DType::F32);
    let k = rng.tensor(&[b, hkv, l, m], 0.0, 0.7, DType::F32);
    let v = rng.tensor(&[b, hkv, l, d], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[b, h, l, d], 0.0, 1.0, DType::F32);
    let n = if kind == Kind::PerStep { b * hkv * l } else { hkv };
    let mut a: Vec<f32> = (0..n).map(|_| (-alpha * rng.uniform()) as f32).collect();
    for &(bi, kh, t) in resets {
        match kind {
            Kind::PerStep => a[(bi * hkv + kh) * l + t] = f32::NEG_INFINITY,
            Kind::PerHead => a[kh] = f32::NEG_INFINITY,
        }
    }
    let shape: Vec<usize> = if kind == Kind::PerStep { vec![b, hkv, l] } else { vec![hkv] };
    let a = Tensor::from_vec(a, shape, &candle_core::Device::Cpu).unwrap();
    Problem { q, k, v, a, dy, alpha }
}

/// One rank's results: output and `dq, dk, dv, da`.
struct RankOut {
    y: Tensor,
    g: [Tensor; 4],
}

/// The sharded op on `splits.len()` threads, rank `r` on its rows of the whole sequence
/// (per-head decay: the whole `[H_kv]` on every rank), each rank's loss `Σ y_r ⊙ dy_r`.
fn run_sharded(config: GatedConfig, splits: &[usize], p: &Problem) -> Vec<candle_core::Result<RankOut>> {
    let ranks = thread_group(splits.len(), Duration::from_secs(60)).unwrap();
    run_ranks(ranks, |rank: Rank| {
        let r = rank.rank();
        let (o, len) = (splits[..r].iter().sum::<usize>(), splits[r]);
        let op = ShardedGatedLinearAttention::new(config, Arc::new(rank));
        let shard = |t: &Tensor| Var::from_tensor(&t.narrow(2, o, len)?.contiguous()?);
        let a = if p.a.rank() == 3 {
            Var::from_tensor(&p.a.narrow(2, o, len)?.contiguous()?)?
        } else {
            Var::from_tensor(&p.a)?
        };
        let (q, k, v) = (shard(&p.q)?, shard(&p.k)?, shard(&p.v)?);
        let y = op.forward(q.as_tensor(), k.as_tensor(), v.as_tensor(), a.as_tensor())?;
        let grads = (&y * &p.dy.narrow(2, o, len)?)?.sum_all()?.backward()?;
        let g = |x: &Var| grads.get(x.as_tensor()).expect("a gradient").clone();
        Ok(RankOut { y: y.clone(), g: [g(&q), g(&k), g(&v), g(&a)] })
    })
}

fn ok(outs: Vec<candle_core::Result<RankOut>>) -> Vec<RankOut> {
    outs.into_iter().enumerate().map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

/// The ranks' `[B, ·, L_r, ·]` pieces in sequence order, flat; the decay's gradient per head
/// summed over the ranks in rank order.
fn assemble(ranks: &[RankOut], kind: Kind) -> [Vec<f64>; 5] {
    let cat = |f: &dyn Fn(&RankOut) -> Tensor| host(&Tensor::cat(&ranks.iter().map(f).collect::<Vec<_>>(), 2).unwrap());
    let da = match kind {
        Kind::PerStep => cat(&|r| r.g[3].clone()),
        Kind::PerHead => {
            let mut acc = vec![0.0; ranks[0].g[3].elem_count()];
            for r in ranks {
                for (x, y) in acc.iter_mut().zip(host(&r.g[3])) {
                    *x += y;
                }
            }
            acc
        }
    };
    [cat(&|r| r.y.clone()), cat(&|r| r.g[0].clone()), cat(&|r| r.g[1].clone()), cat(&|r| r.g[2].clone()), da]
}

/// The reference on the whole sequence (`abs`: on |q|, |k|, |v|, |dy|): out, dq, dk, dv, da.
fn reference(s: Dims, l: usize, p: &Problem, abs: bool) -> [Vec<f64>; 5] {
    let f = |t: &Tensor| -> Vec<f64> { host(t).into_iter().map(|x| if abs { x.abs() } else { x }).collect() };
    let (q, k, v, dy, a) = (f(&p.q), f(&p.k), f(&p.v), f(&p.dy), host(&p.a));
    let decay = if p.a.rank() == 3 { rg::Decay::PerStep(&a) } else { rg::Decay::PerHead(&a) };
    let dims = rg::GatedDims { batch: s.b, heads: s.h, kv_heads: s.hkv, len: l, feat: s.m, dim: s.d };
    let g = rg::Gated { q: &q, k: &k, v: &v, decay, dims, normalize: None, initial: None };
    let out = rg::forward(&g).unwrap();
    let grads = rg::backward(&g, &dy, None).unwrap();
    [out.out, grads.dq, grads.dk, grads.dv, grads.da]
}

/// The bounds of the module docs for out, dq, dk, dv, da (f32 inputs).
fn bounds(s: Dims, l: usize, c: usize, world: usize, p: &Problem, kind: Kind) -> [Vec<f64>; 5] {
    bounds_with(s, l, c, world, p, kind, 0.0)
}

/// [`bounds`] with `tc·mag` more on out, dq, dk, dv before rounding (16-bit inputs on tensor
/// cores, module docs), carried into da.
fn bounds_with(s: Dims, l: usize, c: usize, world: usize, p: &Problem, kind: Kind, tc: f64) -> [Vec<f64>; 5] {
    let mag = reference(s, l, p, true);
    let Dims { b, h, hkv, m, d } = s;
    let g = h / hkv;
    let chain = (m + d + 3 * l + 2 * c + l / c + 4 * world + g + 40) as f64;
    let n = chain + (2 * c * (l + c) + world * l) as f64 * p.alpha;
    let [out, dq, dk, dv] = [0, 1, 2, 3].map(|i| mag[i].iter().map(|x| (U * n + tc) * x).collect::<Vec<f64>>());
    // da per (b, KV head): Σ |q|·bound(dq) + |k|·bound(dk), plus (M + 2L + G + 8)·u·T
    let (qa, ka) = (host(&p.q.abs().unwrap()), host(&p.k.abs().unwrap()));
    let mut per_bk = vec![0.0; b * hkv];
    for bi in 0..b {
        for hh in 0..h {
            let kh = hh / g;
            for i in 0..l * m {
                let (qi, ki) = (((bi * h + hh) * l) * m + i, ((bi * hkv + kh) * l) * m + i);
                let t = qa[qi] * mag[1][qi] + if hh % g == 0 { ka[ki] * mag[2][ki] } else { 0.0 };
                let e = qa[qi] * dq[qi] + if hh % g == 0 { ka[ki] * dk[ki] } else { 0.0 };
                per_bk[bi * hkv + kh] += e + (m + 2 * l + g + 8) as f64 * U * t;
            }
        }
    }
    let da = match kind {
        Kind::PerStep => (0..b * hkv * l).map(|i| per_bk[i / l]).collect(),
        Kind::PerHead => (0..hkv)
            .map(|kh| {
                (0..b).map(|bi| per_bk[bi * hkv + kh]).sum::<f64>() * (b * l) as f64 * (1.0 + (b * l * l) as f64 * U)
            })
            .collect(),
    };
    [out, dq, dk, dv, da]
}

/// The candle op `ops::GatedLinearAttention` on the whole sequence: out, dq, dk, dv, da.
fn unsharded_op(config: GatedConfig, p: &Problem) -> [Vec<f64>; 5] {
    let op = mesa_candle::ops::GatedLinearAttention::new(config, None);
    let vars: Vec<Var> = [&p.q, &p.k, &p.v, &p.a].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let y = op.forward(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), vars[3].as_tensor()).unwrap();
    let grads = (&y * &p.dy).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |i: usize| host(grads.get(vars[i].as_tensor()).expect("a gradient"));
    [host(&y), g(0), g(1), g(2), g(3)]
}

/// Every rank's output and gradients, assembled, against the f64 reference on the whole
/// sequence (and the unsharded candle op, within twice the bound) for 1, 2 and 4 ranks (one
/// shard empty), per-step and per-head decay, 1, 2 and 4 query heads per KV head, resets inside
/// a shard and on the first row of shards 1 and 3 (rows 6 and 11: the splits start there),
/// chunks 4 and 64.
#[test]
fn shards_match_the_reference_on_the_whole_sequence() {
    let mut rng = Rng::new(module_path!());
    let l = 23;
    let splits: [&[usize]; 4] = [&[23], &[11, 12], &[6, 5, 0, 12], &[3, 8, 7, 5]];
    for kind in [Kind::PerStep, Kind::PerHead] {
        for (h, hkv) in [(2, 2), (4, 2), (4, 1)] {
            let s = Dims { b: 2, h, hkv, m: 5, d: 4 };
            let resets: Vec<(usize, usize, usize)> = match kind {
                Kind::PerStep => vec![(0, 0, 3), (1, hkv - 1, 11), (0, hkv - 1, 6), (1, 0, 17)],
                // one KV head resets on every row when there are two
                Kind::PerHead if hkv > 1 => vec![(0, 1, 0)],
                Kind::PerHead => vec![],
            };
            let p = problem(&mut rng, s, l, kind, 0.5, &resets);
            let want = reference(s, l, &p, false);
            for chunk in [4, 64] {
                let config = GatedConfig { chunk, ..GatedConfig::default() };
                for sp in splits {
                    let what = format!("{kind:?} H={h} H_kv={hkv} chunk={chunk} splits={sp:?}");
                    let got = assemble(&ok(run_sharded(config, sp, &p)), kind);
                    let bound = bounds(s, l, chunk.min(l), sp.len(), &p, kind);
                    let unsharded = unsharded_op(config, &p);
                    for (i, name) in ["out", "dq", "dk", "dv", "da"].iter().enumerate() {
                        common::assert_within(&format!("{what} {name}"), &got[i], &want[i], &bound[i]);
                        // two f32 computations, each within the bound
                        let twice: Vec<f64> = bound[i].iter().map(|x| 2.0 * x).collect();
                        common::assert_within(&format!("{what} {name} vs the op"), &got[i], &unsharded[i], &twice);
                    }
                }
            }
        }
    }
}

/// With one rank the op calls the gated kernel exactly as on the whole sequence: its output
/// and gradients are bitwise the kernel's forward and backward (f32, per-step and per-head,
/// grouped heads, a reset).
#[test]
fn one_rank_is_bitwise_the_kernel() {
    let mut rng = Rng::new(module_path!());
    let (s, l) = (Dims { b: 2, h: 4, hkv: 2, m: 5, d: 4 }, 19);
    for kind in [Kind::PerStep, Kind::PerHead] {
        let p = problem(&mut rng, s, l, kind, 1.0, &[(1, 1, 7)]);
        let config = GatedConfig { chunk: 8, ..GatedConfig::default() };
        let got = ok(run_sharded(config, &[l], &p)).remove(0);
        let device = mesa_kernels::Device::emulator();
        let v32 = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (q, k, v, a, dy) = (v32(&p.q), v32(&p.k), v32(&p.v), v32(&p.a), v32(&p.dy));
        let Dims { b, h, hkv, m, d } = s;
        let (qt, kt, vt) = (
            TensorRef::contiguous(&q, &[b, h, l, m]).unwrap(),
            TensorRef::contiguous(&k, &[b, hkv, l, m]).unwrap(),
            TensorRef::contiguous(&v, &[b, hkv, l, d]).unwrap(),
        );
        let at = TensorRef::contiguous(&a, p.a.dims()).unwrap();
        let decay = || if kind == Kind::PerStep { kgla::Decay::PerStep(&at) } else { kgla::Decay::PerHead(&at) };
        let mut out = vec![0f32; b * h * l * d];
        let saved = {
            let mut ot = TensorMut::contiguous(&mut out, &[b, h, l, d]).unwrap();
            let args = kgla::ForwardArgs { q: &qt, k: &kt, v: &vt, decay: decay(), initial: None, out: &mut ot };
            kgla::forward(&device, &config, args).unwrap()
        };
        let (mut dq, mut dk, mut dv, mut da) =
            (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()], vec![0f32; a.len()]);
        {
            let dyt = TensorRef::contiguous(&dy, &[b, h, l, d]).unwrap();
            let grads = kgla::GatedGrads {
                dq: &mut TensorMut::contiguous(&mut dq, &[b, h, l, m]).unwrap(),
                dk: &mut TensorMut::contiguous(&mut dk, &[b, hkv, l, m]).unwrap(),
                dv: &mut TensorMut::contiguous(&mut dv, &[b, hkv, l, d]).unwrap(),
                d_decay: &mut TensorMut::contiguous(&mut da, p.a.dims()).unwrap(),
                d_initial: None,
            };
            let args = kgla::BackwardArgs {
                q: &qt,
                k: &kt,
                v: &vt,
                decay: decay(),
                initial: None,
                out: None,
                dout: &dyt,
                d_final: None,
                grads,
            };
            kgla::backward(&device, &saved, args).unwrap();
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let names = ["out", "dq", "dk", "dv", "da"];
        let gots = [v32(&got.y), v32(&got.g[0]), v32(&got.g[1]), v32(&got.g[2]), v32(&got.g[3])];
        for (i, want) in [&out, &dq, &dk, &dv, &da].into_iter().enumerate() {
            assert_eq!(bits(&gots[i]), bits(want), "{kind:?} {}: one rank is the kernel, bitwise", names[i]);
        }
    }
}

/// A rank's bad decay value is its own `InvalidArgument` and its peers fail too (no hang);
/// ranks whose decay kinds differ all fail with the same `Shape` error.
#[test]
fn bad_decay_fails_every_rank() {
    let mut rng = Rng::new(module_path!());
    let s = Dims { b: 1, h: 2, hkv: 2, m: 3, d: 2 };
    let mut p = problem(&mut rng, s, 8, Kind::PerStep, 0.5, &[]);
    // row 5 (rank 1's second row) of the first head: a positive log-decay
    let mut a = host(&p.a).iter().map(|&x| x as f32).collect::<Vec<_>>();
    a[5] = 0.25;
    p.a = Tensor::from_vec(a, (1, 2, 8), &candle_core::Device::Cpu).unwrap();
    let outs = run_sharded(GatedConfig::default(), &[4, 4], &p);
    let e1 = outs[1].as_ref().err().expect("rank 1 fails");
    assert!(matches!(as_mesa_error(e1), Some(Error::InvalidArgument { name: "log-decay a", .. })), "{e1}");
    assert!(outs[0].is_err(), "rank 0 fails too");

    // rank 0 per step, rank 1 per head
    let ranks = thread_group(2, Duration::from_secs(60)).unwrap();
    let p = problem(&mut rng, s, 8, Kind::PerStep, 0.5, &[]);
    let outs = run_ranks(ranks, |rank: Rank| {
        let r = rank.rank();
        let op = ShardedGatedLinearAttention::new(GatedConfig::default(), Arc::new(rank));
        let sh = |t: &Tensor| t.narrow(2, 4 * r, 4).unwrap().contiguous().unwrap();
        let a = if r == 0 { sh(&p.a) } else { Tensor::zeros(2, DType::F32, &candle_core::Device::Cpu)? };
        op.forward(&sh(&p.q), &sh(&p.k), &sh(&p.v), &a).map(|_| ())
    });
    for (r, o) in outs.iter().enumerate() {
        let e = o.as_ref().err().unwrap_or_else(|| panic!("rank {r} must fail"));
        assert!(matches!(as_mesa_error(e), Some(Error::Shape { .. })), "rank {r}: {e}");
        assert!(e.to_string().contains("rank 1's log-decay"), "rank {r}: {e}");
    }
}

/// Normalised (the state's extra column `z` crosses the hand-off as a column of the state):
/// q and k positive (`|N(0, 0.7)| + 0.05`, so `g = q·z > 0` has no cancellation), against the
/// reference on the whole sequence for 1, 2 and 4 ranks, per step and per head, grouped heads,
/// resets.
///
/// Bounds: the normalised op is the plain one on `v' = [v | 1]` followed by the division by
/// `g`, so each result's magnitude is the plain reference (no normaliser) on |q|, |k|,
/// `[|v| | 1]` with the upstream gradient `[|dy_t|/g_t | |dy_t|·|o_t|/g_t]` (`dnum` and the
/// magnitude of `dden = −(dy_t·o_t)/g_t`); `g` keeps its relative error (positive terms), the
/// output adds `|o|`. The chain gains the division and `dden`'s dot over D: `N + D + 4`.
#[test]
fn normalised_shards_match_the_reference() {
    let mut rng = Rng::new(module_path!());
    let (s, l, eps) = (Dims { b: 2, h: 4, hkv: 2, m: 5, d: 4 }, 23, 1e-6f32);
    for kind in [Kind::PerStep, Kind::PerHead] {
        let resets: Vec<(usize, usize, usize)> = match kind {
            Kind::PerStep => vec![(0, 0, 3), (1, 1, 11), (0, 1, 6)],
            Kind::PerHead => vec![(0, 1, 0)],
        };
        let mut p = problem(&mut rng, s, l, kind, 0.5, &resets);
        let positive = |t: &Tensor| (t.abs().unwrap() + 0.05).unwrap();
        p.q = positive(&p.q);
        p.k = positive(&p.k);
        let Dims { b, h, hkv, m, d } = s;
        let (q, k, v, dy, a) = (host(&p.q), host(&p.k), host(&p.v), host(&p.dy), host(&p.a));
        let decay = if kind == Kind::PerStep { rg::Decay::PerStep(&a) } else { rg::Decay::PerHead(&a) };
        let dims = rg::GatedDims { batch: b, heads: h, kv_heads: hkv, len: l, feat: m, dim: d };
        let g = rg::Gated { q: &q, k: &k, v: &v, decay, dims, normalize: Some(f64::from(eps)), initial: None };
        let fwd = rg::forward(&g).unwrap();
        let grads = rg::backward(&g, &dy, None).unwrap();
        let want = [fwd.out.clone(), grads.dq, grads.dk, grads.dv, grads.da];
        // magnitudes: the plain reference on [|v| | 1] (absolute output o_abs first)
        let v1: Vec<f64> =
            (0..b * hkv * l).flat_map(|r| v[r * d..(r + 1) * d].iter().map(|x| x.abs()).chain([1.0])).collect();
        let dims1 = rg::GatedDims { dim: d + 1, ..dims };
        let plain = rg::Gated { q: &q, k: &k, v: &v1, decay, dims: dims1, normalize: None, initial: None };
        let num = rg::forward(&plain).unwrap().out;
        let mut up = vec![0.0; b * h * l * (d + 1)];
        let mut out_mag = vec![0.0; b * h * l * d];
        for r in 0..b * h * l {
            let den = fwd.den[r];
            let o_abs: f64 = (0..d).map(|j| dy[r * d + j].abs() * num[r * (d + 1) + j] / den).sum();
            for j in 0..d {
                up[r * (d + 1) + j] = dy[r * d + j].abs() / den;
                out_mag[r * d + j] = num[r * (d + 1) + j] / den + fwd.out[r * d + j].abs();
            }
            up[r * (d + 1) + d] = o_abs / den;
        }
        let mg = rg::backward(&plain, &up, None).unwrap();
        let dv_mag: Vec<f64> = (0..b * hkv * l * d).map(|i| mg.dv[(i / d) * (d + 1) + i % d]).collect();
        let mags = [out_mag, mg.dq, mg.dk, dv_mag];
        let config = GatedConfig { normalize: true, eps, chunk: 4 };
        for sp in [&[23][..], &[11, 12], &[6, 5, 0, 12]] {
            let what = format!("normalised {kind:?} splits={sp:?}");
            let got = assemble(&ok(run_sharded(config, sp, &p)), kind);
            let n = (m + 2 * d + 3 * l + 8 + l / 4 + 4 * sp.len() + 2 + 44) as f64
                + (8 * (l + 4) + sp.len() * l) as f64 * p.alpha;
            let bound: Vec<Vec<f64>> = mags.iter().map(|x| x.iter().map(|y| U * n * y).collect()).collect();
            // da: as the module docs, with these magnitudes
            let (qa, ka) = (host(&p.q), host(&p.k));
            let gsz = h / hkv;
            let mut per_bk = vec![0.0; b * hkv];
            for bi in 0..b {
                for hh in 0..h {
                    let kh = hh / gsz;
                    for i in 0..l * m {
                        let (qi, ki) = (((bi * h + hh) * l) * m + i, ((bi * hkv + kh) * l) * m + i);
                        let first = hh % gsz == 0;
                        let t = qa[qi] * mags[1][qi] + if first { ka[ki] * mags[2][ki] } else { 0.0 };
                        let e = qa[qi] * bound[1][qi] + if first { ka[ki] * bound[2][ki] } else { 0.0 };
                        per_bk[bi * hkv + kh] += e + (m + 2 * l + gsz + 8) as f64 * U * t;
                    }
                }
            }
            let da_bound: Vec<f64> = match kind {
                Kind::PerStep => (0..b * hkv * l).map(|i| per_bk[i / l]).collect(),
                Kind::PerHead => (0..hkv)
                    .map(|kh| {
                        (0..b).map(|bi| per_bk[bi * hkv + kh]).sum::<f64>()
                            * (b * l) as f64
                            * (1.0 + (b * l * l) as f64 * U)
                    })
                    .collect(),
            };
            for (i, name) in ["out", "dq", "dk", "dv", "da"].iter().enumerate() {
                let bd = if i < 4 { &bound[i] } else { &da_bound };
                common::assert_within(&format!("{what} {name}"), &got[i], &want[i], bd);
            }
        }
    }
}

/// f64 inputs are computed in f32: on inputs holding the same values, every rank's output and
/// gradients are the f32 op's, rounded once to f64 (the decay's gradient stays f32), bitwise —
/// 4 ranks, normalised or not.
#[test]
fn f64_is_the_f32_results() {
    let mut rng = Rng::new(module_path!());
    let (s, l) = (Dims { b: 1, h: 4, hkv: 2, m: 4, d: 3 }, 17);
    let splits = [5, 0, 7, 5];
    for normalize in [false, true] {
        let config = GatedConfig { normalize, chunk: 4, ..GatedConfig::default() };
        let mut p = problem(&mut rng, s, l, Kind::PerStep, 0.5, &[(0, 1, 7)]);
        if normalize {
            p.q = (p.q.abs().unwrap() + 0.05).unwrap();
            p.k = (p.k.abs().unwrap() + 0.05).unwrap();
        }
        let wide = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let p64 =
            Problem { q: wide(&p.q), k: wide(&p.k), v: wide(&p.v), a: p.a.clone(), dy: wide(&p.dy), alpha: p.alpha };
        let (got, want) = (ok(run_sharded(config, &splits, &p64)), ok(run_sharded(config, &splits, &p)));
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("normalize={normalize} rank {r}");
            assert_eq!(g.y.dtype(), DType::F64, "{what}");
            assert_eq!(host(&g.y), host(&w.y), "{what} out");
            for i in 0..4 {
                assert_eq!(host(&g.g[i]), host(&w.g[i]), "{what} gradient {i}");
            }
        }
    }
}

/// f16 and bf16 run the kernels in their dtype (tensor cores): 1, 2 and 4 ranks (one shard
/// empty), per step and per head, a reset, against the f64 reference on the rounded values.
/// Bound: [`bounds`] plus the tensor cores' `(n·u + 6·2⁻¹⁸)·mag` (n the kernel's chain, as
/// `tests/gated_ops.rs`), then the roundings to the dtype: `u_T·|ref|` for the output and `dq`,
/// and for `dk`, `dv` also the kernel's own rounding before the hand-off's correction is added
/// (`u_T·mag`: the kernel's part is a partial sum of the terms `mag` sums), plus half the f16
/// subnormal spacing.
#[test]
fn sixteen_bit_shards_match_the_reference() {
    let mut rng = Rng::new(module_path!());
    let (s, l, chunk) = (Dims { b: 2, h: 4, hkv: 2, m: 5, d: 4 }, 19, 4);
    let config = GatedConfig { chunk, ..GatedConfig::default() };
    for dtype in [DType::BF16, DType::F16] {
        let ut = if dtype == DType::BF16 { 2f64.powi(-8) } else { 2f64.powi(-11) };
        for kind in [Kind::PerStep, Kind::PerHead] {
            let resets: &[(usize, usize, usize)] = if kind == Kind::PerStep { &[(1, 1, 8)] } else { &[] };
            let p = problem(&mut rng, s, l, kind, 0.5, resets);
            let round = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let p16 = Problem {
                q: round(&p.q),
                k: round(&p.k),
                v: round(&p.v),
                a: p.a.clone(),
                dy: round(&p.dy),
                alpha: p.alpha,
            };
            let want = reference(s, l, &p16, false);
            let mag = reference(s, l, &p16, true);
            let kernel_chain = (s.m + s.d + 2 * l + 2 * chunk + l / chunk + 24) as f64;
            let tc = kernel_chain * U + 6.0 * 2f64.powi(-18);
            for sp in [&[19][..], &[8, 11], &[6, 5, 0, 8]] {
                let what = format!("{dtype:?} {kind:?} splits={sp:?}");
                let outs = ok(run_sharded(config, sp, &p16));
                assert!(outs.iter().all(|o| o.y.dtype() == dtype && o.g[0].dtype() == dtype), "{what}: dtypes");
                let got = assemble(&outs, kind);
                let bound = bounds_with(s, l, chunk, sp.len(), &p16, kind, tc);
                for (i, name) in ["out", "dq", "dk", "dv", "da"].iter().enumerate() {
                    let rounded: Vec<f64> = (0..want[i].len())
                        .map(|e| match i {
                            0 | 1 => bound[i][e] + ut * want[i][e].abs() + 6e-8,
                            2 | 3 => bound[i][e] + ut * (want[i][e].abs() + mag[i][e]) + 1.2e-7,
                            _ => bound[i][e],
                        })
                        .collect();
                    common::assert_within(&format!("{what} {name}"), &got[i], &want[i], &rounded);
                }
            }
        }
    }
}

/// With one rank the sharded op is the candle op `ops::GatedLinearAttention` (identity map)
/// on the whole sequence, bitwise: output and gradients, f32 and bf16 (the kernels in the
/// inputs' dtype in both), normalised or not, per step and per head.
#[test]
fn one_rank_is_bitwise_the_candle_op() {
    let mut rng = Rng::new(module_path!());
    let (s, l) = (Dims { b: 2, h: 4, hkv: 2, m: 5, d: 4 }, 21);
    for kind in [Kind::PerStep, Kind::PerHead] {
        for normalize in [false, true] {
            for dtype in [DType::F32, DType::BF16] {
                let mut p = problem(&mut rng, s, l, kind, 0.7, &[(0, 1, 9)]);
                if normalize {
                    p.q = (p.q.abs().unwrap() + 0.05).unwrap();
                    p.k = (p.k.abs().unwrap() + 0.05).unwrap();
                }
                for t in [&mut p.q, &mut p.k, &mut p.v, &mut p.dy] {
                    *t = t.to_dtype(dtype).unwrap();
                }
                let config = GatedConfig { normalize, chunk: 8, ..GatedConfig::default() };
                let got = ok(run_sharded(config, &[l], &p)).remove(0);
                let op = mesa_candle::ops::GatedLinearAttention::new(config, None);
                let vars: Vec<Var> = [&p.q, &p.k, &p.v, &p.a].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
                let y = op
                    .forward(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), vars[3].as_tensor())
                    .unwrap();
                let grads = (&y * &p.dy).unwrap().sum_all().unwrap().backward().unwrap();
                let what = format!("{kind:?} normalize={normalize} {dtype:?}");
                assert_eq!(host(&got.y), host(&y), "{what} out");
                for (i, var) in vars.iter().enumerate() {
                    let want = grads.get(var.as_tensor()).expect("a gradient");
                    assert_eq!(host(&got.g[i]), host(want), "{what} gradient {i}");
                }
            }
        }
    }
}

/// The hand-off's states: every rank derives the same bits for the whole sequence's final
/// state (`total`), rank `r + 1` starts from `exp(A_r)·S0_r + L_r` of rank `r` exactly (the
/// fold in rank order), and `total` is the reference's final state on the whole sequence
/// within `u·N·mag` (the bound of the module docs; `mag` the reference's final state on |k|,
/// |v|).
#[test]
fn states_are_the_same_bits_on_every_rank() {
    let mut rng = Rng::new(module_path!());
    let (s, l) = (Dims { b: 2, h: 2, hkv: 2, m: 4, d: 3 }, 19);
    let splits = [4, 6, 0, 9];
    let p = problem(&mut rng, s, l, Kind::PerStep, 0.5, &[(1, 0, 10), (0, 1, 2)]);
    let ranks = thread_group(splits.len(), Duration::from_secs(60)).unwrap();
    let states = run_ranks(ranks, |rank: Rank| {
        let r = rank.rank();
        let (o, len) = (splits[..r].iter().sum::<usize>(), splits[r]);
        let op = ShardedGatedLinearAttention::new(GatedConfig { chunk: 4, ..GatedConfig::default() }, Arc::new(rank));
        let sh = |t: &Tensor| t.narrow(2, o, len).unwrap().contiguous().unwrap();
        Ok(op.forward_with_states(&sh(&p.q), &sh(&p.k), &sh(&p.v), &sh(&p.a))?.1)
    });
    let states: Vec<_> = states.into_iter().map(|s| s.unwrap()).collect();
    let bits =
        |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for r in 0..splits.len() {
        assert_eq!(bits(&states[r].total), bits(&states[0].total), "rank {r}'s total");
        if r + 1 < splits.len() {
            let (b, hkv) = (s.b, s.hkv);
            let next = (states[r]
                .initial
                .broadcast_mul(&states[r].log_decay.exp().unwrap().reshape((b, hkv, 1, 1)).unwrap())
                .unwrap()
                + &states[r].local)
                .unwrap();
            assert_eq!(bits(&states[r + 1].initial), bits(&next), "rank {}'s initial state", r + 1);
        }
    }
    let (k, v, a) = (host(&p.k), host(&p.v), host(&p.a));
    let (ka, va): (Vec<f64>, Vec<f64>) = (k.iter().map(|x| x.abs()).collect(), v.iter().map(|x| x.abs()).collect());
    let q = vec![0.0; s.b * s.h * l * s.m];
    let dims = rg::GatedDims { batch: s.b, heads: s.h, kv_heads: s.hkv, len: l, feat: s.m, dim: s.d };
    let run = |k: &[f64], v: &[f64]| {
        let g = rg::Gated { q: &q, k, v, decay: rg::Decay::PerStep(&a), dims, normalize: None, initial: None };
        rg::forward(&g).unwrap().final_state
    };
    let (want, mag) = (run(&k, &v), run(&ka, &va));
    let n = (s.m + s.d + 3 * l + 8 + l / 4 + 4 * splits.len() + 41) as f64
        + (8 * (l + 4) + splits.len() * l) as f64 * p.alpha;
    let bound: Vec<f64> = mag.iter().map(|x| U * n * x).collect();
    common::assert_within("total state", &host(&states[0].total), &want, &bound);
}
