//! Linear attention across sequence shards (`parallel::lasp`), ranks as threads: every
//! rank's output and gradients against (a) the unsharded `LinearAttention` op on the whole
//! sequence and (b) an f64 reference, what is bitwise (the prefix over ranks, one rank, the
//! hand-off of a final state at a chunk boundary), and bad inputs (docs/sequence_parallel.md,
//! "Linear attention across sequence shards (LASP)").
use super::common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use common::Rng;
use mesa_candle::ops::{FeatureKind, LinearAttention};
use mesa_candle::parallel::lasp::{ShardStates, ShardedLinearAttention};
use mesa_candle::parallel::{run_ranks, thread_group, Collectives, Rank};
use mesa_candle::{as_mesa_error, Error};
use mesa_kernels::linear_attention::{
    self as kla, BackwardArgs, ForwardArgs, Grads, LinearAttentionConfig, MemoryMode, Schedule, StateGrads,
};
use mesa_kernels::{Layout, TensorMut, TensorRef};

const U32: f64 = 1.0 / (1u64 << 24) as f64;
const EPS: f32 = 1e-6;
/// `B, H, d (= M for ReLU and ELU+1), D`.
const DIMS: (usize, usize, usize, usize) = (2, 2, 6, 5);

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// One rank's results: output and `dq, dk, dv` (host f64, in the dtype's values) and states.
struct RankOut {
    y: Vec<f64>,
    g: [Vec<f64>; 3],
    states: ShardStates,
    y_t: Tensor,
    g_t: [Tensor; 3],
}

/// Runs the sharded op on `world` threads, rank `r` on rows `o_r .. o_r + splits[r]` of the
/// full `[B, H, L, ·]` inputs, each rank's loss `Σ y_r ⊙ dy_r`.
fn run_sharded(op: &LinearAttention, splits: &[usize], inputs: &[Tensor; 3], dy: &Tensor) -> Vec<RankOut> {
    let world = splits.len();
    let ranks = thread_group(world, Duration::from_secs(60)).unwrap();
    let outs = run_ranks(ranks, |rank: Rank| {
        let r = rank.rank();
        let o: usize = splits[..r].iter().sum();
        let len = splits[r];
        let lasp = ShardedLinearAttention::new(op.clone(), Arc::new(rank)).map_err(candle_core::Error::from)?;
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.narrow(2, o, len)?.contiguous()?))
            .collect::<candle_core::Result<_>>()?;
        let (y, states) = lasp.forward_with_states(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor())?;
        let dys = dy.narrow(2, o, len)?.to_dtype(y.dtype())?;
        let grads = (&y * &dys)?.sum_all()?.backward()?;
        let g: Vec<Tensor> = vars.iter().map(|v| grads.get(v.as_tensor()).expect("a gradient").clone()).collect();
        Ok(RankOut {
            y: host(&y),
            g: [host(&g[0]), host(&g[1]), host(&g[2])],
            states,
            y_t: y,
            g_t: [g[0].clone(), g[1].clone(), g[2].clone()],
        })
    });
    outs.into_iter().enumerate().map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

/// The ranks' `[B, H, L_r, ·]` pieces put back in sequence order, flat.
fn assemble(pieces: &[Tensor]) -> Vec<f64> {
    host(&Tensor::cat(pieces, 2).unwrap())
}

/// The unsharded op on the whole sequence: output and gradients.
fn one_rank(op: &LinearAttention, inputs: &[Tensor; 3], dy: &Tensor) -> (Tensor, [Tensor; 3]) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let y = op.forward(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor()).unwrap();
    let grads = (&y * &dy.to_dtype(y.dtype()).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |i: usize| grads.get(vars[i].as_tensor()).unwrap().clone();
    (y, [g(0), g(1), g(2)])
}

#[derive(Clone, Copy, Debug)]
enum Map {
    Relu,
    Elu1,
}

/// The f64 reference of causal linear attention in its state form (written from the
/// kernels' module docs, `mesa_kernels::linear_attention` and its `state` module), with, for
/// every result, the same expression evaluated on absolute values (`abs`): every operand
/// replaced by its magnitude, every subtraction by an addition. The features are
/// non-negative (ReLU, ELU+1), so the normaliser has no cancellation and `1/g` keeps a
/// relative error of a few units.
struct Reference {
    out: Vec<f64>,
    g: [Vec<f64>; 3],
    out_abs: Vec<f64>,
    g_abs: [Vec<f64>; 3],
}

fn reference(map: Map, normalize: bool, x: [&[f64]; 3], dy: &[f64], l: usize) -> Reference {
    let (b, h, m, d) = DIMS;
    let [xq, xk, v] = x;
    type Scalar = fn(f64) -> f64;
    let (phi, dphi): (Scalar, Scalar) = match map {
        Map::Relu => (|x| x.max(0.0), |x| if x > 0.0 { 1.0 } else { 0.0 }),
        Map::Elu1 => (|x| if x > 0.0 { x + 1.0 } else { x.exp() }, |x| if x > 0.0 { 1.0 } else { x.exp() }),
    };
    let (nq, nv) = (b * h * l * m, b * h * l * d);
    let mut r = Reference {
        out: vec![0.0; nv],
        g: [vec![0.0; nq], vec![0.0; nq], vec![0.0; nv]],
        out_abs: vec![0.0; nv],
        g_abs: [vec![0.0; nq], vec![0.0; nq], vec![0.0; nv]],
    };
    for bh in 0..b * h {
        let qi = |t: usize, i: usize| bh * l * m + t * m + i;
        let vi = |t: usize, j: usize| bh * l * d + t * d + j;
        let pq: Vec<f64> = (0..l * m).map(|i| phi(xq[bh * l * m + i])).collect();
        let pk: Vec<f64> = (0..l * m).map(|i| phi(xk[bh * l * m + i])).collect();
        // forward: S_t = Σ_{s≤t} φk_s v_sᵀ, z_t = Σ_{s≤t} φk_s
        let (mut s, mut s_abs, mut z) = (vec![0.0; m * d], vec![0.0; m * d], vec![0.0; m]);
        let mut g = vec![1.0; l];
        let (mut dnum, mut dnum_abs) = (vec![0.0; l * d], vec![0.0; l * d]);
        let (mut dden, mut dden_abs) = (vec![0.0; l], vec![0.0; l]);
        for t in 0..l {
            for i in 0..m {
                z[i] += pk[t * m + i];
                for j in 0..d {
                    s[i * d + j] += pk[t * m + i] * v[vi(t, j)];
                    s_abs[i * d + j] += pk[t * m + i] * v[vi(t, j)].abs();
                }
            }
            if normalize {
                g[t] = (0..m).map(|i| pq[t * m + i] * z[i]).sum::<f64>() + f64::from(EPS);
            }
            for j in 0..d {
                let num: f64 = (0..m).map(|i| pq[t * m + i] * s[i * d + j]).sum();
                let num_abs: f64 = (0..m).map(|i| pq[t * m + i] * s_abs[i * d + j]).sum();
                r.out[vi(t, j)] = num / g[t];
                r.out_abs[vi(t, j)] = num_abs / g[t];
                dnum[t * d + j] = dy[vi(t, j)] / g[t];
                dnum_abs[t * d + j] = dy[vi(t, j)].abs() / g[t];
            }
            if normalize {
                // dden_t = −(dout_t·out_t)/g_t (the kernels read the forward's output)
                dden[t] = -(0..d).map(|j| dy[vi(t, j)] * r.out[vi(t, j)]).sum::<f64>() / g[t];
                dden_abs[t] = (0..d).map(|j| dy[vi(t, j)].abs() * r.out_abs[vi(t, j)]).sum::<f64>() / g[t];
            }
            // dφq_t = S_t dnum_t + z_t dden_t
            for i in 0..m {
                let dp: f64 = (0..d).map(|j| s[i * d + j] * dnum[t * d + j]).sum::<f64>() + z[i] * dden[t];
                let dp_abs: f64 =
                    (0..d).map(|j| s_abs[i * d + j] * dnum_abs[t * d + j]).sum::<f64>() + z[i] * dden_abs[t];
                let x = xq[qi(t, i)];
                r.g[0][qi(t, i)] = dphi(x) * dp;
                r.g_abs[0][qi(t, i)] = dphi(x) * dp_abs;
            }
        }
        // backward: R_s = Σ_{t≥s} φq_t dnum_tᵀ, ρ_s = Σ_{t≥s} φq_t dden_t;
        // dφk_s = R_s v_s + ρ_s, dv_s = R_sᵀ φk_s
        let (mut rr, mut rr_abs) = (vec![0.0; m * d], vec![0.0; m * d]);
        let (mut rho, mut rho_abs) = (vec![0.0; m], vec![0.0; m]);
        for t in (0..l).rev() {
            for i in 0..m {
                rho[i] += pq[t * m + i] * dden[t];
                rho_abs[i] += pq[t * m + i] * dden_abs[t];
                for j in 0..d {
                    rr[i * d + j] += pq[t * m + i] * dnum[t * d + j];
                    rr_abs[i * d + j] += pq[t * m + i] * dnum_abs[t * d + j];
                }
            }
            for i in 0..m {
                let dp: f64 = (0..d).map(|j| rr[i * d + j] * v[vi(t, j)]).sum::<f64>() + rho[i];
                let dp_abs: f64 = (0..d).map(|j| rr_abs[i * d + j] * v[vi(t, j)].abs()).sum::<f64>() + rho_abs[i];
                let x = xk[qi(t, i)];
                r.g[1][qi(t, i)] = dphi(x) * dp;
                r.g_abs[1][qi(t, i)] = dphi(x) * dp_abs;
            }
            for j in 0..d {
                r.g[2][vi(t, j)] = (0..m).map(|i| rr[i * d + j] * pk[t * m + i]).sum();
                r.g_abs[2][vi(t, j)] = (0..m).map(|i| rr_abs[i * d + j] * pk[t * m + i]).sum();
            }
        }
    }
    r
}

/// `γ_N = N·u/(1 − N·u)`, u = 2⁻²⁴: the bound on the relative effect of N roundings in f32.
fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U32;
    nu / (1.0 - nu)
}

/// The test data: `q, k: [B, H, L, d]`, `v, dy: [B, H, L, D]`, f32 values.
fn data(rng: &mut Rng, map: Map, l: usize, dtype: DType) -> ([Tensor; 3], Tensor) {
    let (b, h, m, d) = DIMS;
    // ReLU at mean 1: the normaliser stays of order 1 (tests/ops.rs says why); the bounds
    // below hold either way, they scale with 1/g
    let (mean, std) = match map {
        Map::Relu => (1.0, 0.5),
        Map::Elu1 => (0.0, 0.7),
    };
    let q = rng.tensor(&[b, h, l, m], mean, std, dtype);
    let k = rng.tensor(&[b, h, l, m], mean, std, dtype);
    let v = rng.tensor(&[b, h, l, d], 0.0, 1.0, dtype);
    let dy = rng.tensor(&[b, h, l, d], 0.0, 1.0, dtype);
    ([q, k, v], dy)
}

fn check(what: &str, got: &[f64], want: &[f64], bound: &[f64]) {
    common::assert_within(what, got, want, bound);
}

/// Every rank's output and `dq, dk, dv` against (a) the unsharded op on the whole sequence
/// and (b) the f64 reference, for 1, 2 and 4 ranks, ReLU and ELU+1, normalised or not,
/// shards that are multiples of the chunk (boundary states) and shards that are not, uneven,
/// one of them empty (SLiM mode).
///
/// Bounds: every result is a sum of products whose longest chain of f32 roundings has at most
/// `N = L + 2(M + D) + 2W + 16` of them: a state entry sums `L` terms (the kernel's chunk
/// sums and their scan, or the shard's matmul and the `W`-term prefix over ranks), then a dot
/// over `M` (`φq·S`) or `D` (`dnum·v`), the normaliser's division, and in the backward the
/// suffix over ranks (`W` terms) and the correction's matmul (`M` or `D`). So
/// `|computed − exact| ≤ γ_N · (the expression on absolute values)` (`Reference::*_abs`;
/// `1/g` keeps its relative error because the features are ≥ 0), and two f32 computations
/// differ by at most twice that. With one rank the sharded op is the unsharded one, bitwise.
#[test]
fn shards_give_the_unsharded_outputs_and_gradients() {
    let mut rng = Rng::new(module_path!());
    // (world, chunk, splits, memory): multiples of the chunk, then not (one shard empty)
    let cases: [(usize, usize, Vec<usize>, MemoryMode); 6] = [
        (1, 4, vec![20], MemoryMode::BoundaryStates),
        (2, 4, vec![12, 8], MemoryMode::BoundaryStates),
        (4, 4, vec![8, 8, 4, 4], MemoryMode::BoundaryStates),
        (1, 5, vec![17], MemoryMode::Slim),
        (2, 5, vec![11, 6], MemoryMode::Slim),
        (4, 5, vec![7, 0, 9, 3], MemoryMode::Slim),
    ];
    for (world, chunk, splits, memory) in &cases {
        let l: usize = splits.iter().sum();
        for map in [Map::Relu, Map::Elu1] {
            for normalize in [true, false] {
                let config = LinearAttentionConfig {
                    chunk: *chunk,
                    memory: *memory,
                    normalize,
                    eps: EPS,
                    ..LinearAttentionConfig::causal()
                };
                let kind = match map {
                    Map::Relu => FeatureKind::Relu,
                    Map::Elu1 => FeatureKind::Elu1,
                };
                let op = LinearAttention::new(config, kind);
                let what = format!("W={world} chunk={chunk} splits={splits:?} {map:?} normalize={normalize}");
                let (inputs, dy) = data(&mut rng, map, l, DType::F32);
                let ranks = run_sharded(&op, splits, &inputs, &dy);
                let y = assemble(&ranks.iter().map(|r| r.y_t.clone()).collect::<Vec<_>>());
                let g: Vec<Vec<f64>> =
                    (0..3).map(|i| assemble(&ranks.iter().map(|r| r.g_t[i].clone()).collect::<Vec<_>>())).collect();
                let (y1, g1) = one_rank(&op, &inputs, &dy);
                let x: Vec<Vec<f64>> = inputs.iter().map(host).collect();
                let reference = reference(map, normalize, [&x[0], &x[1], &x[2]], &host(&dy), l);
                let (_, _, m, d) = DIMS;
                let c = gamma(l + 2 * (m + d) + 2 * world + 16);
                let names = ["out", "dq", "dk", "dv"];
                let got = [&y, &g[0], &g[1], &g[2]];
                let unsharded = [host(&y1), host(&g1[0]), host(&g1[1]), host(&g1[2])];
                let want = [&reference.out, &reference.g[0], &reference.g[1], &reference.g[2]];
                let abs = [&reference.out_abs, &reference.g_abs[0], &reference.g_abs[1], &reference.g_abs[2]];
                for i in 0..4 {
                    let bound: Vec<f64> = abs[i].iter().map(|a| c * a).collect();
                    check(&format!("{what} {} vs f64", names[i]), got[i], want[i], &bound);
                    check(&format!("{what} unsharded {} vs f64", names[i]), &unsharded[i], want[i], &bound);
                    let twice: Vec<f64> = bound.iter().map(|b| 2.0 * b).collect();
                    check(&format!("{what} {} vs unsharded", names[i]), got[i], &unsharded[i], &twice);
                    if *world == 1 {
                        assert_eq!(got[i], &unsharded[i], "{what} {}: one rank is the unsharded op, bitwise", names[i]);
                    }
                }
                // each rank's own values are the assembled ones (no mix-up of shards)
                let r0 = &ranks[0];
                assert_eq!(r0.y.len(), DIMS.0 * DIMS.1 * splits[0] * DIMS.3);
                assert_eq!(r0.g[0].len(), DIMS.0 * DIMS.1 * splits[0] * DIMS.2);
            }
        }
    }
}

/// FAVOR+ features (causal keys use the projection's bound, a per-row map, so shards see the
/// unsharded features) and the 16-bit dtypes: against the unsharded op. The FAVOR+ bound is
/// that of `tests/ops.rs` (`16·n·u` relative to `|w| + max|w|`, `n = L(d + D)`), twice (two
/// f32 computations); 16-bit results are rounded once from f32 values each within that, so
/// they may also differ by one rounding each, `2·u_dtype·|w|`. f64 inputs are computed in
/// f32: bitwise the f32 results.
#[test]
fn favor_and_other_dtypes_match_the_unsharded_op() {
    let mut rng = Rng::new(module_path!());
    let (b, h, d, dv) = DIMS;
    let (splits, l) = (vec![9, 14, 0, 6], 29);
    let favor = LinearAttention::favor(&Device::Cpu, 16, d, 7).unwrap();
    let cases = [(favor, DType::F32), (FeatureKind::Elu1, DType::BF16), (FeatureKind::Elu1, DType::F16)];
    for (kind, dtype) in cases {
        let config = LinearAttentionConfig { chunk: 8, ..LinearAttentionConfig::causal() };
        let op = LinearAttention::new(config, kind.clone());
        let q = rng.tensor(&[b, h, l, d], 0.0, 0.7, dtype);
        let k = rng.tensor(&[b, h, l, d], 0.0, 0.7, dtype);
        let v = rng.tensor(&[b, h, l, dv], 0.0, 1.0, dtype);
        let dy = rng.tensor(&[b, h, l, dv], 0.0, 1.0, dtype);
        let inputs = [q, k, v];
        let ranks = run_sharded(&op, &splits, &inputs, &dy);
        let (y1, g1) = one_rank(&op, &inputs, &dy);
        let got = [
            assemble(&ranks.iter().map(|r| r.y_t.clone()).collect::<Vec<_>>()),
            assemble(&ranks.iter().map(|r| r.g_t[0].clone()).collect::<Vec<_>>()),
            assemble(&ranks.iter().map(|r| r.g_t[1].clone()).collect::<Vec<_>>()),
            assemble(&ranks.iter().map(|r| r.g_t[2].clone()).collect::<Vec<_>>()),
        ];
        assert_eq!(ranks[0].y_t.dtype(), dtype);
        let want = [host(&y1), host(&g1[0]), host(&g1[1]), host(&g1[2])];
        let n = (l * (d + dv)) as f64;
        let c = 2.0 * 16.0 * n * U32;
        let ud = if dtype == DType::F32 { 0.0 } else { 2.0 * common::unit(dtype) };
        for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            let top = want[i].iter().fold(0.0f64, |a, w| a.max(w.abs()));
            let bound: Vec<f64> = want[i].iter().map(|w| c * (w.abs() + top) + ud * w.abs()).collect();
            check(&format!("{kind:?} {dtype:?} {name}"), &got[i], &want[i], &bound);
        }
    }
    // f64 inputs: the f32 computation, cast (candle's casts carry the gradients)
    let op =
        LinearAttention::new(LinearAttentionConfig { chunk: 8, ..LinearAttentionConfig::causal() }, FeatureKind::Elu1);
    let (inputs, dy) = data(&mut rng, Map::Elu1, l, DType::F32);
    let f32_ranks = run_sharded(&op, &splits, &inputs, &dy);
    let inputs64 = inputs.clone().map(|t| t.to_dtype(DType::F64).unwrap());
    let f64_ranks = run_sharded(&op, &splits, &inputs64, &dy.to_dtype(DType::F64).unwrap());
    for (r, (a, b)) in f32_ranks.iter().zip(&f64_ranks).enumerate() {
        assert_eq!(b.y_t.dtype(), DType::F64);
        assert_eq!(a.y, b.y, "rank {r}: f64 out");
        assert_eq!(a.g, b.g, "rank {r}: f64 gradients");
    }
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The prefix combination is bitwise identical on every rank: `S0_0 = 0`,
/// `S0_{r+1} = S0_r + L_r` as one f32 addition per element (rank order), and the total
/// `S0_{W−1} + L_{W−1}` the same bits on every rank. Each shard's own sum `L_r` is
/// `Σ_s φ(k_s)[v_s|1]ᵀ` within `γ_{L_r}` of its f64 value. A second run gives the same bits
/// everywhere (nothing depends on the ranks' timing).
#[test]
fn prefix_combination_is_bitwise_identical_on_every_rank() {
    let mut rng = Rng::new(module_path!());
    let splits = vec![5, 3, 0, 6];
    let l = 14;
    let (b, h, m, d) = DIMS;
    let op =
        LinearAttention::new(LinearAttentionConfig { chunk: 4, ..LinearAttentionConfig::causal() }, FeatureKind::Elu1);
    let (inputs, dy) = data(&mut rng, Map::Elu1, l, DType::F32);
    let ranks = run_sharded(&op, &splits, &inputs, &dy);
    let total = f32s(&ranks[0].states.total);
    assert_eq!(total.len(), b * h * m * (d + 1));
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(f32s(&rank.states.total), total, "rank {r}'s total");
        let (s0, lr) = (f32s(&rank.states.initial), f32s(&rank.states.local));
        if r == 0 {
            assert!(s0.iter().all(|&x| x == 0.0), "S0_0 = 0");
        }
        let next: Vec<f32> = s0.iter().zip(&lr).map(|(a, b)| a + b).collect();
        match ranks.get(r + 1) {
            Some(n) => assert_eq!(f32s(&n.states.initial), next, "S0_{} = S0_{r} + L_{r}", r + 1),
            None => assert_eq!(next, total, "total = S0_W−1 + L_W−1"),
        }
        // L_r against f64: Σ over the shard's rows of φ(k_s)[v_s | 1]ᵀ
        let o: usize = splits[..r].iter().sum();
        let (xk, v) = (host(&inputs[1]), host(&inputs[2]));
        let phi = |x: f64| if x > 0.0 { x + 1.0 } else { x.exp() };
        let w = d + 1;
        let mut want = vec![0.0; b * h * m * w];
        let mut abs = vec![0.0; b * h * m * w];
        for bh in 0..b * h {
            for s in o..o + splits[r] {
                for i in 0..m {
                    let pk = phi(xk[(bh * l + s) * m + i]);
                    for j in 0..w {
                        let vj = if j < d { v[(bh * l + s) * d + j] } else { 1.0 };
                        want[(bh * m + i) * w + j] += pk * vj;
                        abs[(bh * m + i) * w + j] += (pk * vj).abs();
                    }
                }
            }
        }
        let c = gamma(splits[r] + 4);
        let bound: Vec<f64> = abs.iter().map(|a| c * a).collect();
        check(&format!("L_{r}"), &lr.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(), &want, &bound);
    }
    let again = run_sharded(&op, &splits, &inputs, &dy);
    for (r, (a, b)) in ranks.iter().zip(&again).enumerate() {
        assert_eq!(a.y, b.y, "rank {r}: out, second run");
        assert_eq!(a.g, b.g, "rank {r}: gradients, second run");
        assert_eq!(f32s(&a.states.total), f32s(&b.states.total), "rank {r}: total, second run");
    }
}

/// The serial alternative (a ring): piece `p` of the sequence starts from piece `p−1`'s
/// `final_state_tensor`, and its backward takes piece `p+1`'s `d_initial` as `d_final`. With
/// pieces that are multiples of the chunk, that is one call on the whole sequence bit for bit
/// — outputs, final state and gradients — in every memory mode and schedule (the kernels carry
/// the state across chunks by the same additions). With pieces that end inside a chunk it is
/// one call within rounding only (the chunks, hence the additions, differ); the bound is
/// `γ_N` of `N = L + M + D + 16` times the terms' magnitudes (here: `16·n·u` relative to
/// `|w| + max|w|` as in `tests/ops.rs`).
#[test]
fn handoff_at_chunk_boundaries_is_bitwise_one_call() {
    let mut rng = Rng::new(module_path!());
    let device = mesa_kernels::Device::emulator();
    let (b, h, m, d) = (1, 2, 5, 4);
    let chunk = 4;
    let mut positive = |n: usize| -> Vec<f32> { (0..n).map(|_| (0.2 + rng.uniform()) as f32).collect() };
    let l = 20;
    let (q, k) = (positive(b * h * l * m), positive(b * h * l * m));
    let mut signed = |n: usize| -> Vec<f32> { (0..n).map(|_| (rng.uniform() * 2.0 - 1.0) as f32).collect() };
    let (v, dout) = (signed(b * h * l * d), signed(b * h * l * d));
    let schedules = [
        (MemoryMode::BoundaryStates, Schedule::ChunkSums),
        (MemoryMode::BoundaryStates, Schedule::StateWalk),
        (MemoryMode::BoundaryStates, Schedule::Walk),
        (MemoryMode::Slim, Schedule::ChunkSums),
    ];
    for normalize in [true, false] {
        for (memory, schedule) in schedules {
            let config = LinearAttentionConfig {
                chunk,
                memory,
                schedule,
                normalize,
                eps: EPS,
                ..LinearAttentionConfig::causal()
            };
            let w = d + usize::from(normalize);
            let view = |len: usize, o: usize, f: usize| {
                Layout::strided(&[b, h, len, f], &[h * l * f, l * f, f, 1], o * f).unwrap()
            };
            // one call
            let mut out1 = vec![0f32; v.len()];
            let (qt, kt) = (TensorRef::new(&q, &view(l, 0, m)).unwrap(), TensorRef::new(&k, &view(l, 0, m)).unwrap());
            let vt = TensorRef::new(&v, &view(l, 0, d)).unwrap();
            let saved = {
                let mut ot = TensorMut::new(&mut out1, &view(l, 0, d)).unwrap();
                kla::forward(&device, &config, ForwardArgs { q: &qt, k: &kt, v: &vt, out: &mut ot }).unwrap()
            };
            let final1 = saved.final_state().unwrap();
            let (mut dq1, mut dk1, mut dv1) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
            {
                let ot = TensorRef::new(&out1, &view(l, 0, d)).unwrap();
                let gt = TensorRef::new(&dout, &view(l, 0, d)).unwrap();
                let grads = Grads {
                    dq: &mut TensorMut::new(&mut dq1, &view(l, 0, m)).unwrap(),
                    dk: &mut TensorMut::new(&mut dk1, &view(l, 0, m)).unwrap(),
                    dv: &mut TensorMut::new(&mut dv1, &view(l, 0, d)).unwrap(),
                };
                let args = BackwardArgs { q: &qt, k: &kt, v: &vt, out: Some(&ot), dout: &gt, grads };
                kla::backward(&device, &saved, args).unwrap();
            }
            for (pieces, aligned) in [(vec![8, 4, 8], true), (vec![6, 7, 7], false)] {
                let offsets: Vec<usize> = (0..pieces.len()).map(|p| pieces[..p].iter().sum()).collect();
                let mut out = vec![0f32; v.len()];
                let mut saved_pieces = Vec::new();
                for (p, (&o, &len)) in offsets.iter().zip(&pieces).enumerate() {
                    let (qt, kt) =
                        (TensorRef::new(&q, &view(len, o, m)).unwrap(), TensorRef::new(&k, &view(len, o, m)).unwrap());
                    let vt = TensorRef::new(&v, &view(len, o, d)).unwrap();
                    let mut ot = TensorMut::new(&mut out, &view(len, o, d)).unwrap();
                    let prev: Option<&kla::LinearAttentionSaved> =
                        if p == 0 { None } else { Some(&saved_pieces[p - 1]) };
                    let s0 = prev.map(|s| s.final_state_tensor().unwrap());
                    let s = kla::forward_with_state(
                        &device,
                        &config,
                        ForwardArgs { q: &qt, k: &kt, v: &vt, out: &mut ot },
                        s0.as_ref(),
                    )
                    .unwrap();
                    saved_pieces.push(s);
                }
                let final_p = saved_pieces.last().unwrap().final_state().unwrap();
                let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
                let mut d_next: Option<Vec<f32>> = None;
                for p in (0..pieces.len()).rev() {
                    let (o, len) = (offsets[p], pieces[p]);
                    let (qt, kt) =
                        (TensorRef::new(&q, &view(len, o, m)).unwrap(), TensorRef::new(&k, &view(len, o, m)).unwrap());
                    let vt = TensorRef::new(&v, &view(len, o, d)).unwrap();
                    let ot = TensorRef::new(&out, &view(len, o, d)).unwrap();
                    let gt = TensorRef::new(&dout, &view(len, o, d)).unwrap();
                    let mut d_init = vec![0f32; b * h * m * w];
                    {
                        let grads = Grads {
                            dq: &mut TensorMut::new(&mut dq, &view(len, o, m)).unwrap(),
                            dk: &mut TensorMut::new(&mut dk, &view(len, o, m)).unwrap(),
                            dv: &mut TensorMut::new(&mut dv, &view(len, o, d)).unwrap(),
                        };
                        let df = d_next.as_ref().map(|x| TensorRef::contiguous(x, &[b, h, m, w]).unwrap());
                        let mut di = TensorMut::contiguous(&mut d_init, &[b, h, m, w]).unwrap();
                        let args = BackwardArgs { q: &qt, k: &kt, v: &vt, out: Some(&ot), dout: &gt, grads };
                        let states = StateGrads { d_final: df.as_ref(), d_initial: Some(&mut di) };
                        kla::backward_with_state(&device, &saved_pieces[p], args, states).unwrap();
                    }
                    d_next = Some(d_init);
                }
                let what = format!("{memory:?} {schedule:?} normalize={normalize} pieces {pieces:?}");
                let results = [
                    ("out", &out, &out1),
                    ("final state", &final_p, &final1),
                    ("dq", &dq, &dq1),
                    ("dk", &dk, &dk1),
                    ("dv", &dv, &dv1),
                ];
                for (name, got, want) in results {
                    if aligned {
                        assert_eq!(got, want, "{what}: {name} is bitwise one call");
                    } else {
                        let n = (l * (m + d)) as f64;
                        let top = want.iter().fold(0.0f64, |a, w| a.max(f64::from(w.abs())));
                        let g: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
                        let wv: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
                        let bound: Vec<f64> = wv.iter().map(|w| 16.0 * n * U32 * (w.abs() + top)).collect();
                        check(&format!("{what}: {name}"), &g, &wv, &bound);
                    }
                }
            }
        }
    }
}

fn mesa(e: &candle_core::Error) -> Option<&Error> {
    as_mesa_error(e)
}

/// Bad input is an error, never a panic: bidirectional attention, this rank's tensors of the
/// wrong rank, shape or dtype, and ranks that disagree on `[B, H, M, W]` (an error on every
/// rank: the same `n` but another `B·H` split is caught by the dims each state carries, a
/// different `n` by the collective).
#[test]
fn bad_inputs_are_errors_on_every_rank() {
    let _rng = Rng::new(module_path!());
    let cpu = Device::Cpu;
    let elu = |config| LinearAttention::new(config, FeatureKind::Elu1);
    let one = || -> Arc<dyn Collectives> { Arc::new(thread_group(1, Duration::from_secs(5)).unwrap().remove(0)) };
    let e = ShardedLinearAttention::new(elu(LinearAttentionConfig::bidirectional()), one()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { name: "config", .. }), "{e}");
    let lasp = ShardedLinearAttention::new(elu(LinearAttentionConfig::causal()), one()).unwrap();
    let t = |shape: &[usize]| Tensor::ones(shape, DType::F32, &cpu).unwrap();
    let e = lasp.forward(&t(&[2, 4, 3]), &t(&[2, 4, 3]), &t(&[2, 4, 3])).unwrap_err();
    assert!(matches!(mesa(&e), Some(Error::Rank { .. })), "{e}");
    let e = lasp.forward(&t(&[1, 2, 4, 3]), &t(&[1, 2, 5, 3]), &t(&[1, 2, 4, 3])).unwrap_err();
    assert!(matches!(mesa(&e), Some(Error::Shape { .. })), "{e}");
    let e = lasp.forward(&t(&[1, 2, 4, 3]), &t(&[1, 2, 4, 3]), &t(&[1, 1, 4, 3])).unwrap_err();
    assert!(matches!(mesa(&e), Some(Error::Shape { .. })), "{e}");
    let u = Tensor::zeros((1, 2, 4, 3), DType::U32, &cpu).unwrap();
    let e = lasp.forward(&u, &u, &u).unwrap_err();
    assert!(matches!(mesa(&e), Some(Error::UnsupportedDType { .. })), "{e}");
    let h16 = t(&[1, 2, 4, 3]).to_dtype(DType::F16).unwrap();
    let e = lasp.forward(&t(&[1, 2, 4, 3]), &h16, &t(&[1, 2, 4, 3])).unwrap_err();
    assert!(matches!(mesa(&e), Some(Error::DTypeMismatch { .. })), "{e}");
    assert_eq!(
        e.to_string(),
        "sharded linear attention: dtype F16 of keys [B, H, L_r, d] differs from F32 of queries [B, H, L_r, d] \
         (one dtype for all the op's tensors)"
    );
    // ranks that disagree (rank 0: q, k [1, 2, 4, 3], v [1, 2, 4, 3], f32) on [B, H] (the
    // same state size), D, d (issue 39: the all-gather of states of different sizes said
    // "expected [B, S, C] = …", its own layout), the dtype: the same error on every rank,
    // naming the user's tensors (the ranks' dims travel first, in one all-gather)
    let dims = "sharded linear attention: [B, H, d, D] of rank 1's queries, keys [B, H, L_r, d] and values \
                [B, H, L_r, D] (every rank's must be rank 0's): expected shape [1, 2, 3, 3]";
    let cases = [
        ([2usize, 1, 4, 3], [2usize, 1, 4, 3], DType::F32, format!("{dims}, got [2, 1, 3, 3]")),
        ([1, 2, 4, 3], [1, 2, 4, 4], DType::F32, format!("{dims}, got [1, 2, 3, 4]")),
        ([1, 2, 4, 4], [1, 2, 4, 3], DType::F32, format!("{dims}, got [1, 2, 4, 3]")),
        (
            [1, 2, 4, 3],
            [1, 2, 4, 3],
            DType::F16,
            "sharded linear attention: dtype F16 of rank 1's queries, keys and values differs from F32 of rank 0's \
             (one dtype for all the op's tensors)"
                .to_string(),
        ),
    ];
    for (qs1, vs1, dtype1, want) in cases {
        let ranks = thread_group(2, Duration::from_secs(20)).unwrap();
        let out = run_ranks(ranks, |rank: Rank| {
            let r = rank.rank();
            let lasp = ShardedLinearAttention::new(elu(LinearAttentionConfig::causal()), Arc::new(rank))
                .map_err(candle_core::Error::from)?;
            let (qs, vs, dt) = if r == 0 { ([1, 2, 4, 3], [1, 2, 4, 3], DType::F32) } else { (qs1, vs1, dtype1) };
            let c = |s: &[usize]| t(s).to_dtype(dt);
            lasp.forward(&c(&qs)?, &c(&qs)?, &c(&vs)?).map(|_| ())
        });
        for (r, o) in out.iter().enumerate() {
            let e = o.as_ref().expect_err("ranks that disagree must fail");
            assert!(matches!(mesa(e), Some(Error::Shape { .. } | Error::DTypeMismatch { .. })), "rank {r}: {e}");
            assert_eq!(e.to_string(), want, "rank {r}");
        }
    }
}

/// Issue 39: 16-bit shards compute in f32 and round once (`ShardedLinearAttention::forward`):
/// every rank's output and gradients are bitwise the f32 sharded op's on the same values,
/// rounded to the dtype. (The backward's normaliser term read the output candle holds,
/// already rounded.) Values with a common offset, so that the rounding of the output is not
/// hidden under the size of the gradients (`tests/ops.rs`,
/// `linear_attention_16_bit_is_f32_rounded_once`).
#[test]
fn sixteen_bit_shards_are_the_f32_shards_rounded_once() {
    let mut rng = Rng::new(module_path!());
    let (b, h, d, dv) = DIMS;
    let (splits, l) = (vec![9, 7], 16);
    // bf16 (f16 takes the same path; tests/ops.rs checks both on the unsharded op)
    for dtype in [DType::BF16] {
        let op = LinearAttention::new(LinearAttentionConfig { chunk: 4, ..LinearAttentionConfig::causal() }, {
            FeatureKind::Elu1
        });
        let q = rng.tensor(&[b, h, l, d], 0.0, 0.7, dtype);
        let k = rng.tensor(&[b, h, l, d], 0.0, 0.7, dtype);
        let v = rng.tensor(&[b, h, l, dv], 4.0, 0.5, dtype);
        let dy = rng.tensor(&[b, h, l, dv], 0.0, 1.0, dtype);
        let inputs = [q, k, v];
        let ranks = run_sharded(&op, &splits, &inputs, &dy);
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let ranks32 = run_sharded(&op, &splits, &inputs.clone().map(|t| f32s(&t)), &f32s(&dy));
        let rounded = |t: &Tensor| host(&t.to_dtype(dtype).unwrap());
        for (r, (a, b)) in ranks.iter().zip(&ranks32).enumerate() {
            assert!(a.y == rounded(&b.y_t), "{dtype:?} rank {r}: out is not the f32 op's rounded once");
            for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                let want = rounded(&b.g_t[i]);
                let differ = (0..want.len()).filter(|&j| a.g[i][j] != want[j]).count();
                assert!(
                    differ == 0,
                    "{dtype:?} rank {r}: {differ} of {} {name} are not the f32 op's rounded once",
                    want.len()
                );
            }
        }
    }
}
