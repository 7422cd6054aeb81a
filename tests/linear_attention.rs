//! Parity of chunked linear attention (forward, dq, dk, dv; both memory modes) and of the
//! feature maps with the f64 reference (`mesa_kernels::reference::linear_attention`), on
//! every backend, every dtype, causal and bidirectional, normalised or not, and the bug
//! classes of published linear-attention kernels.
//!
//! Tolerances (derived, per element):
//! * Inputs are exact in their dtype T (the reference reads the same values widened to
//!   f64), so all error comes from f32 arithmetic and the final rounding to T.
//! * Every output element is a sum of products whose longest accumulation chain has at most
//!   `M + D + 2L + 8` f32 roundings (a dot over M or D+1 features, the dot over D of `dden`,
//!   a prefix sum over ≤ L rows — for a sequence split into calls, the state carried from
//!   the first call continues the same chain, so ≤ L rows in all; the second L covers any
//!   regrouping of the rows into chunks — and a division by the denominator). The classical
//!   bound |fl(Σ) − Σ| ≤ n·u·Σ|terms| (u = 2⁻²⁴) gives `n·u·mag`, where `mag` is the same sum
//!   with every term replaced by its absolute value (for normalised outputs also the
//!   denominator's error times |out|, for gradients the |dnum|, |dden| terms) — computed in
//!   f64 below. Both memory modes sum only visible rows (`dq_t`: s ≤ t), so the magnitude is
//!   the causal one in both.
//! * The backward reads the forward output `out` rounded to T: `dden` is off by u_T
//!   relatively, covered by `4·u_T·mag`; the final rounding to T adds `u_T·|ref|`
//!   (u_T = 2⁻²⁴, 2⁻¹¹, 2⁻⁸ for f32, f16, bf16).
//! * f16 and bf16 run on tensor cores (docs/linear_attention.md, "Tensor cores"): every
//!   operand enters as a bf16 pair hi + lo (exact for f16/bf16 inputs, within 2⁻¹⁸|x| for f32
//!   values), a product of two pairs leaves out lo·lo, so a term is off by ≤ 3·2⁻¹⁸ of its
//!   magnitude; a chain of two such products (P = A Bᵀ, then P C; or A S with S built from
//!   them) ≤ 6·2⁻¹⁸. The tensor cores' order and rounding of their f32 sums are not specified
//!   (they may truncate): the chain term counts twice for them. So for f16/bf16 the bound
//!   adds `(chain + 6·2⁻¹⁸)·mag`.
mod common;

use half::{bf16, f16};
use mesa_kernels::feature_map::{self, FavorProjection, FavorStabilizer, FeatureBackwardArgs, FeatureMap};
use mesa_kernels::linear_attention::{
    backward, backward_with_state, forward, forward_packed, forward_with_state, BackwardArgs, ForwardArgs, Grads,
    LinearAttentionConfig, LinearAttentionSaved, MemoryMode, Schedule, StateGrads,
};
use mesa_kernels::reference::{self, linear_attention as rla};
use mesa_kernels::{
    Buffer, DType, Device, DeviceMemory, DeviceMemoryMut, Element, Error, Layout, RawDeviceSlice, TensorMut, TensorRef,
};
use rand::rngs::StdRng;
use rand::RngExt;

/// A checked input view (the tests' views all fit their buffers).
fn tr<'a, T>(mem: &'a (impl DeviceMemory<T> + ?Sized), layout: &Layout) -> TensorRef<'a, T> {
    TensorRef::new(mem, layout).expect("input view")
}

/// A checked output view.
fn tm<'a, T>(mem: &'a mut (impl DeviceMemoryMut<T> + ?Sized), layout: &Layout) -> TensorMut<'a, T> {
    TensorMut::new(mem, layout).expect("output view")
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    h: usize,
    l: usize,
    m: usize,
    d: usize,
}

impl Shape {
    fn dims(&self) -> rla::Dims {
        rla::Dims { batch: self.b, heads: self.h, len: self.l, feat: self.m, dim: self.d }
    }
    fn qk(&self) -> usize {
        self.b * self.h * self.l * self.m
    }
    fn vd(&self) -> usize {
        self.b * self.h * self.l * self.d
    }
}

/// Magnitudes `mag` of the tolerance (see the module docs): (out, dq, dk, dv).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn magnitudes(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    n: Shape,
    causal: bool,
    eps: Option<f64>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (l, m, d) = (n.l, n.m, n.d);
    let mut mo = vec![0.0; n.vd()];
    let mut mq = vec![0.0; n.qk()];
    let mut mk = vec![0.0; n.qk()];
    let mut mv = vec![0.0; n.vd()];
    for bh in 0..n.b * n.h {
        let absdot = |t: usize, s: usize| -> f64 {
            (0..m).map(|i| (q[(bh * l + t) * m + i] * k[(bh * l + s) * m + i]).abs()).sum()
        };
        let dot =
            |t: usize, s: usize| -> f64 { (0..m).map(|i| q[(bh * l + t) * m + i] * k[(bh * l + s) * m + i]).sum() };
        for t in 0..l {
            let vis = |s: usize| !causal || s <= t;
            let (mut den, mut aden) = (0.0, 0.0);
            let mut num = vec![0.0; d];
            let mut anum = vec![0.0; d];
            for s in (0..l).filter(|&s| vis(s)) {
                let (a, aa) = (dot(t, s), absdot(t, s));
                den += a;
                aden += aa;
                for j in 0..d {
                    num[j] += a * v[(bh * l + s) * d + j];
                    anum[j] += aa * v[(bh * l + s) * d + j].abs();
                }
            }
            let g = eps.map_or(1.0, |e| rla::guard(den, e));
            let dnum: Vec<f64> = (0..d).map(|j| (dout[(bh * l + t) * d + j] / g).abs()).collect();
            let dden = if eps.is_some() {
                (0..d).map(|j| (dout[(bh * l + t) * d + j] * num[j]).abs()).sum::<f64>() / (g * g)
            } else {
                0.0
            };
            for j in 0..d {
                let out = num[j] / g;
                mo[(bh * l + t) * d + j] =
                    anum[j] / g.abs() + if eps.is_some() { out.abs() * aden / g.abs() } else { 0.0 };
            }
            for s in (0..l).filter(|&s| vis(s)) {
                let da: f64 = (0..d).map(|j| dnum[j] * v[(bh * l + s) * d + j].abs()).sum::<f64>() + dden;
                for i in 0..m {
                    mq[(bh * l + t) * m + i] += da * k[(bh * l + s) * m + i].abs();
                    mk[(bh * l + s) * m + i] += da * q[(bh * l + t) * m + i].abs();
                }
                let aa = absdot(t, s);
                for j in 0..d {
                    mv[(bh * l + s) * d + j] += aa * dnum[j];
                }
            }
        }
    }
    (mo, mq, mk, mv)
}

fn check_close(what: &str, got: &[f64], want: &[f64], mag: &[f64], n: Shape, dtype: DType) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let u = common::unit_roundoff(dtype);
    let chain = (n.m + n.d + 2 * n.l + 8) as f64 * 2f64.powi(-24);
    let tensor_cores = if dtype == DType::F32 { 0.0 } else { chain + 6.0 * 2f64.powi(-18) };
    for (i, ((&g, &w), &mg)) in got.iter().zip(want).zip(mag).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} is not finite (element not written?)");
        // the result's rounding to `dtype`: relative `u`, or half the subnormal spacing below
        // the smallest normal (f16 gradients reach it: 2⁻²⁵ ≈ 3.0e-8 absolute)
        let tol = (chain + tensor_cores + 4.0 * u) * mg + u * w.abs() + 0.5 * common::subnormal_spacing(dtype);
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: {g} vs reference {w} (|diff| {} > tol {tol}), {n:?} {dtype:?}",
            (g - w).abs()
        );
    }
}

fn random_vec(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| lo + (hi - lo) * rng.random::<f64>()).collect()
}

fn to_t<T: Element>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}
fn widen<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

struct Outputs {
    out: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    saved_bytes: usize,
}

/// Runs forward + backward on contiguous [B, H, L, F] inputs (poisoned outputs).
fn run<T: Element>(
    device: &Device,
    cfg: &LinearAttentionConfig,
    n: Shape,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
) -> Outputs {
    let lq = Layout::contiguous(&[n.b, n.h, n.l, n.m]);
    let lv = Layout::contiguous(&[n.b, n.h, n.l, n.d]);
    run_views(device, cfg, n, [q, k, v, dout], (&lq, &lv))
}

/// Forward + backward with q, k (buffers and views of layout `lq`) and v, dout, out (`lv`),
/// the gradients contiguous; `out` gathered through `lv`. Outputs start as NaN.
fn run_views<T: Element>(
    device: &Device,
    cfg: &LinearAttentionConfig,
    n: Shape,
    inputs: [&[T]; 4],
    (lq, lv): (&Layout, &Layout),
) -> Outputs {
    let [q, k, v, dout] = inputs;
    let nan = T::from_f64(f64::NAN);
    let (qb, kb, vb, gb) = (up(device, q), up(device, k), up(device, v), up(device, dout));
    let mut ob = up(device, &vec![nan; v.len()]);
    let saved = forward(
        device,
        cfg,
        ForwardArgs { q: &tr(&qb, lq), k: &tr(&kb, lq), v: &tr(&vb, lv), out: &mut tm(&mut ob, lv) },
    )
    .expect("forward");
    let (lqc, lvc) = (Layout::contiguous(&[n.b, n.h, n.l, n.m]), Layout::contiguous(&[n.b, n.h, n.l, n.d]));
    let mut dqb = up(device, &vec![nan; n.qk()]);
    let mut dkb = up(device, &vec![nan; n.qk()]);
    let mut dvb = up(device, &vec![nan; n.vd()]);
    backward(
        device,
        &saved,
        BackwardArgs {
            q: &tr(&qb, lq),
            k: &tr(&kb, lq),
            v: &tr(&vb, lv),
            out: Some(&tr(&ob, lv)),
            dout: &tr(&gb, lv),
            grads: Grads { dq: &mut tm(&mut dqb, &lqc), dk: &mut tm(&mut dkb, &lqc), dv: &mut tm(&mut dvb, &lvc) },
        },
    )
    .expect("backward");
    Outputs {
        out: reference::gather(&ob.to_vec().expect("out"), lv),
        dq: widen(&dqb.to_vec().expect("dq")),
        dk: widen(&dkb.to_vec().expect("dk")),
        dv: widen(&dvb.to_vec().expect("dv")),
        saved_bytes: saved.size_in_bytes(),
    }
}

fn up<T: Element>(device: &Device, x: &[T]) -> Buffer<T> {
    device.upload(x).expect("upload")
}

/// Random inputs (positive features when normalised), rounded to T, run, and compared.
fn parity<T: Element>(device: &Device, rng: &mut StdRng, cfg: &LinearAttentionConfig, n: Shape) {
    let lo = if cfg.normalize { 0.05 } else { -1.0 };
    let q = to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0));
    let k = to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0));
    let v = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
    let dout = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
    let r = run(device, cfg, n, &q, &k, &v, &dout);
    let (q, k, v, dout) = (widen(&q), widen(&k), widen(&v), widen(&dout));
    let eps = cfg.normalize.then_some(f64::from(cfg.eps));
    let (out, _) =
        rla::forward(&rla::Attention { q: &q, k: &k, v: &v, dims: n.dims(), causal: cfg.causal, normalize: eps })
            .expect("reference");
    let (dq, dk, dv) = rla::backward(
        &rla::Attention { q: &q, k: &k, v: &v, dims: n.dims(), causal: cfg.causal, normalize: eps },
        &dout,
    )
    .expect("reference");
    let (mo, mq, mk, mv) = magnitudes(&q, &k, &v, &dout, n, cfg.causal, eps);
    check_close("out", &r.out, &out, &mo, n, T::DTYPE);
    check_close("dq", &r.dq, &dq, &mq, n, T::DTYPE);
    check_close("dk", &r.dk, &dk, &mk, n, T::DTYPE);
    check_close("dv", &r.dv, &dv, &mv, n, T::DTYPE);
}

fn configs() -> Vec<LinearAttentionConfig> {
    let mut v = Vec::new();
    for causal in [true, false] {
        for normalize in [true, false] {
            for memory in [MemoryMode::BoundaryStates, MemoryMode::Slim] {
                if !causal && memory == MemoryMode::Slim {
                    continue; // bidirectional: one state, the modes coincide
                }
                v.push(LinearAttentionConfig {
                    chunk: 16,
                    causal,
                    normalize,
                    memory,
                    ..LinearAttentionConfig::causal()
                });
            }
        }
    }
    v
}

#[test]
fn parity_every_dtype_mode_and_direction() {
    let mut rng = common::rng("parity_every_dtype_mode_and_direction");
    // L = 37: two full chunks of 16 and a partial one; M != D
    let n = Shape { b: 2, h: 2, l: 37, m: 8, d: 5 };
    for device in common::backends() {
        for cfg in configs() {
            parity::<f32>(&device, &mut rng, &cfg, n);
            parity::<f16>(&device, &mut rng, &cfg, n);
            parity::<bf16>(&device, &mut rng, &cfg, n);
        }
    }
}

/// The per-chunk outputs on tensor cores (the boundary mode's forward and dq) compute a chunk's
/// `P = mask(Q_c K_cᵀ)` once per block for a group of 32-column D-tiles, the group chosen by
/// the launch policy from the work items (kernels/linear_attention.cu, `value_group`; on the
/// emulator a notional 1-SM device: the fewest groups giving 8 items). M = 70 and D = 80 are
/// three D-tiles of both the outputs (D) and dq (M); the shapes give 2, 6 and 12 (batch·head,
/// chunk) items, so one D-tile per block, groups of 2 + 1, and all three in one block (the
/// last with a partial chunk of 8 rows). Against the f64 reference, and bitwise against SLiM
/// (bf16 and f16), whose walks run one D-tile per block: the same f32 operations in the same
/// order.
#[test]
fn tensor_core_value_tiles_match_the_reference_and_the_walk() {
    let mut rng = common::rng("tensor_core_value_tiles_match_the_reference_and_the_walk");
    let shapes = [
        Shape { b: 1, h: 1, l: 32, m: 70, d: 80 },
        Shape { b: 1, h: 2, l: 48, m: 70, d: 80 },
        Shape { b: 2, h: 2, l: 40, m: 70, d: 80 },
    ];
    let device = common::emulator();
    for n in shapes {
        for normalize in [true, false] {
            let cfg = LinearAttentionConfig { normalize, chunk: 16, ..LinearAttentionConfig::causal() };
            let slim = LinearAttentionConfig { memory: MemoryMode::Slim, ..cfg };
            parity::<bf16>(&device, &mut rng, &cfg, n);
            parity::<f16>(&device, &mut rng, &cfg, n);
            let lo = if normalize { 0.05 } else { -1.0 };
            let q = random_vec(&mut rng, n.qk(), lo, 1.0);
            let k = random_vec(&mut rng, n.qk(), lo, 1.0);
            let v = random_vec(&mut rng, n.vd(), -1.0, 1.0);
            let g = random_vec(&mut rng, n.vd(), -1.0, 1.0);
            let same = |a: Outputs, b: Outputs, t: &str| {
                for (what, x, y) in
                    [("out", &a.out, &b.out), ("dq", &a.dq, &b.dq), ("dk", &a.dk, &b.dk), ("dv", &a.dv, &b.dv)]
                {
                    assert!(
                        x.iter().zip(y).all(|(p, r)| p.to_bits() == r.to_bits()),
                        "{n:?}, normalize {normalize}, {t}: {what} of the boundary mode differs from SLiM's"
                    );
                }
            };
            let (qb, kb, vb, gb) = (to_t::<bf16>(&q), to_t::<bf16>(&k), to_t::<bf16>(&v), to_t::<bf16>(&g));
            same(run(&device, &cfg, n, &qb, &kb, &vb, &gb), run(&device, &slim, n, &qb, &kb, &vb, &gb), "bf16");
            // f16: both operands of the state update carry a lo tile; dq's state is the
            // forward's transposed, its MMAs add the cross terms in the forward's order
            let (qh, kh, vh, gh) = (to_t::<f16>(&q), to_t::<f16>(&k), to_t::<f16>(&v), to_t::<f16>(&g));
            same(run(&device, &cfg, n, &qh, &kh, &vh, &gh), run(&device, &slim, n, &qh, &kh, &vh, &gh), "f16");
        }
    }
}

#[test]
fn m_and_d_differ_up_to_512_in_both_orders() {
    let mut rng = common::rng("m_and_d_differ_up_to_512_in_both_orders");
    for device in common::backends() {
        for (m, d) in [(33, 300), (300, 33), (512, 24), (24, 512)] {
            let n = Shape { b: 1, h: 1, l: 19, m, d };
            for memory in [MemoryMode::BoundaryStates, MemoryMode::Slim] {
                let cfg = LinearAttentionConfig { chunk: 8, memory, ..LinearAttentionConfig::causal() };
                parity::<f32>(&device, &mut rng, &cfg, n);
            }
            parity::<bf16>(
                &device,
                &mut rng,
                &LinearAttentionConfig { chunk: 8, ..LinearAttentionConfig::bidirectional() },
                n,
            );
        }
    }
}

/// A non-finite input at position s reaches no output that does not depend on it. With +inf in
/// k_s and v_s, the forward's and dq's rows t < s are clean (later rows read k_s, v_s through
/// the state and the normaliser); with +inf in q_s, every row but s of the forward and dq,
/// and dk's and dv's rows t > s (their walk runs backwards; q_s enters them as C). Inside a
/// chunk a masked zero of P times the non-finite value would be NaN (0 × inf); the kernels
/// multiply only visible entries. Chunk 64, s = 40 or 70: on tensor cores the diagonal 16×16
/// block of P holds rows on both sides of s.
#[test]
fn non_finite_inputs_do_not_cross_the_causal_mask() {
    let mut rng = common::rng("non_finite_inputs_do_not_cross_the_causal_mask");
    let n = Shape { b: 1, h: 2, l: 100, m: 16, d: 24 };
    for device in common::backends() {
        for normalize in [true, false] {
            for memory in [MemoryMode::BoundaryStates, MemoryMode::Slim] {
                let cfg = LinearAttentionConfig { normalize, chunk: 64, memory, ..LinearAttentionConfig::causal() };
                for s in [40, 70] {
                    for key_side in [true, false] {
                        mask_holds::<f32>(&device, &mut rng, &cfg, n, s, key_side);
                        mask_holds::<f16>(&device, &mut rng, &cfg, n, s, key_side);
                        mask_holds::<bf16>(&device, &mut rng, &cfg, n, s, key_side);
                    }
                }
            }
        }
    }
}

/// +inf in one column of row s of k and v (`key_side`) or of q, then the rows that cannot
/// depend on it compared with the reference on the finite inputs.
fn mask_holds<T: Element>(
    device: &Device,
    rng: &mut StdRng,
    cfg: &LinearAttentionConfig,
    n: Shape,
    s: usize,
    key_side: bool,
) {
    let lo = if cfg.normalize { 0.05 } else { -1.0 };
    let q = to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0));
    let k = to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0));
    let v = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
    let dout = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
    let (mut qi, mut ki, mut vi) = (q.clone(), k.clone(), v.clone());
    let inf = T::from_f64(f64::INFINITY);
    for bh in 0..n.b * n.h {
        if key_side {
            ki[(bh * n.l + s) * n.m + 1] = inf;
            vi[(bh * n.l + s) * n.d + 2] = inf;
        } else {
            qi[(bh * n.l + s) * n.m] = inf;
        }
    }
    let r = run(device, cfg, n, &qi, &ki, &vi, &dout);
    let (q, k, v, dout) = (widen(&q), widen(&k), widen(&v), widen(&dout));
    let eps = cfg.normalize.then_some(f64::from(cfg.eps));
    let att = rla::Attention { q: &q, k: &k, v: &v, dims: n.dims(), causal: true, normalize: eps };
    let (out, _) = rla::forward(&att).expect("reference");
    let (dq, dk, dv) = rla::backward(&att, &dout).expect("reference");
    let (mo, mq, mk, mv) = magnitudes(&q, &k, &v, &dout, n, true, eps);
    // the rows of x (width w per row) whose position satisfies `keep`
    let rows = |x: &[f64], w: usize, keep: &dyn Fn(usize) -> bool| -> Vec<f64> {
        x.chunks(w).enumerate().filter(|(row, _)| keep(row % n.l)).flat_map(|(_, c)| c.to_vec()).collect()
    };
    let (before, after, other) = (|t: usize| t < s, |t: usize| t > s, |t: usize| t != s);
    let none = |_: usize| false;
    let forward_rows: &dyn Fn(usize) -> bool = if key_side { &before } else { &other };
    let reverse_rows: &dyn Fn(usize) -> bool = if key_side { &none } else { &after };
    for (what, got, want, mag, w, keep) in [
        ("out", &r.out, &out, &mo, n.d, forward_rows),
        ("dq", &r.dq, &dq, &mq, n.m, forward_rows),
        ("dk", &r.dk, &dk, &mk, n.m, reverse_rows),
        ("dv", &r.dv, &dv, &mv, n.d, reverse_rows),
    ] {
        let what = format!("{what} beside +inf at {s} (key side {key_side}, {cfg:?})");
        check_close(&what, &rows(got, w, keep), &rows(want, w, keep), &rows(mag, w, keep), n, T::DTYPE);
    }
}

#[test]
fn any_length_and_chunk() {
    let mut rng = common::rng("any_length_and_chunk");
    for device in common::backends() {
        // L < chunk, L = chunk, L = chunk + 1, chunk 1, the largest chunk
        for (l, chunk) in [(5, 64), (16, 16), (17, 16), (9, 1), (130, 64), (1, 7)] {
            let n = Shape { b: 1, h: 2, l, m: 4, d: 3 };
            for memory in [MemoryMode::BoundaryStates, MemoryMode::Slim] {
                let cfg = LinearAttentionConfig { chunk, memory, ..LinearAttentionConfig::causal() };
                parity::<f32>(&device, &mut rng, &cfg, n);
            }
        }
    }
}

#[test]
fn changing_future_positions_never_changes_earlier_outputs() {
    let mut rng = common::rng("changing_future_positions_never_changes_earlier_outputs");
    let n = Shape { b: 1, h: 2, l: 45, m: 6, d: 4 };
    for device in common::backends() {
        for normalize in [true, false] {
            let cfg = LinearAttentionConfig { chunk: 16, normalize, ..LinearAttentionConfig::causal() };
            let q = to_t::<f32>(&random_vec(&mut rng, n.qk(), 0.05, 1.0));
            let k = to_t::<f32>(&random_vec(&mut rng, n.qk(), 0.05, 1.0));
            let v = to_t::<f32>(&random_vec(&mut rng, n.vd(), -1.0, 1.0));
            let dout = vec![0.0f32; n.vd()];
            let base = run(&device, &cfg, n, &q, &k, &v, &dout);
            // change every position after t0 (inside a chunk, so the masked intra-chunk
            // matmul is exercised): q, k, v all differ there
            for t0 in [20, 31, 44] {
                let (mut q2, mut k2, mut v2) = (q.clone(), k.clone(), v.clone());
                for bh in 0..n.b * n.h {
                    for t in t0 + 1..n.l {
                        for i in 0..n.m {
                            q2[(bh * n.l + t) * n.m + i] *= 3.5;
                            k2[(bh * n.l + t) * n.m + i] += 7.0;
                        }
                        for j in 0..n.d {
                            v2[(bh * n.l + t) * n.d + j] = -100.0;
                        }
                    }
                }
                let other = run(&device, &cfg, n, &q2, &k2, &v2, &dout);
                for bh in 0..n.b * n.h {
                    for t in 0..=t0 {
                        for j in 0..n.d {
                            let i = (bh * n.l + t) * n.d + j;
                            assert_eq!(
                                base.out[i].to_bits(),
                                other.out[i].to_bits(),
                                "out[{bh},{t},{j}] changed (t0 {t0})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn f16_key_sums_beyond_the_f16_range_stay_finite() {
    // keys ~ 2000 over L = 100 rows: sum_s k_s ~ 2e5 > 65504 (f16 max); v ~ 30, so the
    // state sum k v ~ 6e6. The state and the denominators are f32: outputs stay finite.
    let mut rng = common::rng("f16_key_sums_beyond_the_f16_range_stay_finite");
    let n = Shape { b: 1, h: 1, l: 100, m: 4, d: 3 };
    for device in common::backends() {
        let q = to_t::<f16>(&random_vec(&mut rng, n.qk(), 0.5, 1.0));
        let k = to_t::<f16>(&random_vec(&mut rng, n.qk(), 1500.0, 2500.0));
        let v = to_t::<f16>(&random_vec(&mut rng, n.vd(), 20.0, 40.0));
        let dout = to_t::<f16>(&random_vec(&mut rng, n.vd(), -1.0, 1.0));
        let cfg = LinearAttentionConfig { chunk: 16, ..LinearAttentionConfig::causal() };
        let r = run(&device, &cfg, n, &q, &k, &v, &dout);
        let (qw, kw, vw, gw) = (widen(&q), widen(&k), widen(&v), widen(&dout));
        let (out, den) = rla::forward(&rla::Attention {
            q: &qw,
            k: &kw,
            v: &vw,
            dims: n.dims(),
            causal: true,
            normalize: Some(1e-6),
        })
        .expect("reference");
        assert!(den.iter().any(|&d| d > 65504.0), "the test must push sums past the f16 range");
        let (dq, dk, dv) = rla::backward(
            &rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) },
            &gw,
        )
        .expect("reference");
        let (mo, mq, mk, mv) = magnitudes(&qw, &kw, &vw, &gw, n, true, Some(1e-6));
        check_close("out", &r.out, &out, &mo, n, DType::F16);
        check_close("dq", &r.dq, &dq, &mq, n, DType::F16);
        check_close("dk", &r.dk, &dk, &mk, n, DType::F16);
        check_close("dv", &r.dv, &dv, &mv, n, DType::F16);
    }
}

#[test]
fn views_of_one_packed_qkv_tensor() {
    // qkv packed as [B, L, H, 2M + D] (q | k | v per head), out a view of [B, L, H, D]
    let mut rng = common::rng("views_of_one_packed_qkv_tensor");
    let n = Shape { b: 2, h: 3, l: 21, m: 5, d: 7 };
    let f = 2 * n.m + n.d;
    for device in common::backends() {
        let packed = to_t::<bf16>(&random_vec(&mut rng, n.b * n.l * n.h * f, 0.05, 1.0));
        let view = |off: usize, width: usize| {
            Layout::strided(&[n.b, n.h, n.l, width], &[n.l * n.h * f, f, n.h * f, 1], off).expect("layout")
        };
        let (lq, lk, lv) = (view(0, n.m), view(n.m, n.m), view(2 * n.m, n.d));
        let lo = Layout::strided(&[n.b, n.h, n.l, n.d], &[n.l * n.h * n.d, n.d, n.h * n.d, 1], 0).expect("layout");
        let pb = up(&device, &packed);
        let nan = bf16::from_f64(f64::NAN);
        let mut ob = up(&device, &vec![nan; n.vd()]);
        for cfg in [
            LinearAttentionConfig { chunk: 8, ..LinearAttentionConfig::causal() },
            LinearAttentionConfig::bidirectional(),
        ] {
            let saved = forward(
                &device,
                &cfg,
                ForwardArgs { q: &tr(&pb, &lq), k: &tr(&pb, &lk), v: &tr(&pb, &lv), out: &mut tm(&mut ob, &lo) },
            )
            .expect("forward");
            // gradients into a packed [B, L, H, 2M + D] buffer as well
            let gout = to_t::<bf16>(&random_vec(&mut rng, n.vd(), -1.0, 1.0));
            let gb = up(&device, &gout);
            // gradients into buffers of the packed size, through the same strided views
            let mut dq = up(&device, &vec![nan; packed.len()]);
            let mut dk = up(&device, &vec![nan; packed.len()]);
            let mut dv = up(&device, &vec![nan; packed.len()]);
            backward(
                &device,
                &saved,
                BackwardArgs {
                    q: &tr(&pb, &lq),
                    k: &tr(&pb, &lk),
                    v: &tr(&pb, &lv),
                    out: Some(&tr(&ob, &lo)),
                    dout: &tr(&gb, &lo),
                    grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lk), dv: &mut tm(&mut dv, &lv) },
                },
            )
            .expect("backward");
            let qv = reference::gather(&packed, &lq);
            let kv = reference::gather(&packed, &lk);
            let vv = reference::gather(&packed, &lv);
            let gv = reference::gather(&gout, &lo);
            let eps = Some(f64::from(cfg.eps));
            let (out, _) = rla::forward(&rla::Attention {
                q: &qv,
                k: &kv,
                v: &vv,
                dims: n.dims(),
                causal: cfg.causal,
                normalize: eps,
            })
            .expect("reference");
            let (rdq, rdk, rdv) = rla::backward(
                &rla::Attention { q: &qv, k: &kv, v: &vv, dims: n.dims(), causal: cfg.causal, normalize: eps },
                &gv,
            )
            .expect("reference");
            let (mo, mq, mk, mv) = magnitudes(&qv, &kv, &vv, &gv, n, cfg.causal, eps);
            check_close("out", &reference::gather(&ob.to_vec().expect("o"), &lo), &out, &mo, n, DType::BF16);
            check_close("dq", &reference::gather(&dq.to_vec().expect("dq"), &lq), &rdq, &mq, n, DType::BF16);
            check_close("dk", &reference::gather(&dk.to_vec().expect("dk"), &lk), &rdk, &mk, n, DType::BF16);
            check_close("dv", &reference::gather(&dv.to_vec().expect("dv"), &lv), &rdv, &mv, n, DType::BF16);
        }
    }
}

#[test]
fn zero_length_and_empty_dimensions() {
    for device in common::backends() {
        for (l, m, d) in [(0, 4, 3), (5, 0, 3), (5, 4, 0)] {
            let n = Shape { b: 1, h: 2, l, m, d };
            for cfg in configs() {
                let q = vec![0.5f32; n.qk()];
                let v = vec![0.25f32; n.vd()];
                let r = run(&device, &cfg, n, &q, &q, &v, &v);
                assert!(r.out.iter().all(|x| *x == 0.0 || (m > 0 && x.is_finite())), "{n:?}");
                // M = 0: no features, out = 0 / g(0) = 0; gradients finite and zero
                if m == 0 {
                    assert!(r.out.iter().all(|&x| x == 0.0));
                    assert!(r.dv.iter().all(|&x| x == 0.0));
                }
                assert!(r.dq.iter().chain(&r.dk).chain(&r.dv).all(|x| x.is_finite()));
            }
        }
    }
}

#[test]
fn slim_state_is_independent_of_length_and_boundary_states_are_not() {
    let device = common::emulator();
    let mut sizes = Vec::new();
    for l in [64, 256] {
        let n = Shape { b: 1, h: 1, l, m: 4, d: 4 };
        let q = vec![0.5f32; n.qk()];
        let v = vec![0.25f32; n.vd()];
        for memory in [MemoryMode::Slim, MemoryMode::BoundaryStates] {
            let cfg = LinearAttentionConfig { chunk: 32, memory, normalize: false, ..LinearAttentionConfig::causal() };
            sizes.push(run(&device, &cfg, n, &q, &q, &v, &v).saved_bytes);
        }
    }
    // unnormalised: state M x D f32 = 64 bytes; boundaries ceil(L/32) x 64 more
    assert_eq!(sizes, vec![64, 64 + 2 * 64, 64, 64 + 8 * 64]);
}

#[test]
fn offsets_past_2_pow_31_use_64_bit_indexing() {
    // q and out of batch 1 start 2^31 + 5 elements into their buffers (lazily committed
    // zero pages: only the touched ones cost memory).
    let device = common::emulator();
    let n = Shape { b: 2, h: 1, l: 3, m: 2, d: 2 };
    let far = (1usize << 31) + 5;
    let lq = Layout::strided(&[2, 1, 3, 2], &[far, 6, 2, 1], 0).expect("layout");
    let lo = Layout::strided(&[2, 1, 3, 2], &[far, 6, 2, 1], 0).expect("layout");
    let lc = Layout::contiguous(&[2, 1, 3, 2]);
    let mut qbig = vec![0f32; far + 6];
    let qv: Vec<f32> = (0..12).map(|i| 0.25 + 0.125 * i as f32).collect();
    qbig[..6].copy_from_slice(&qv[..6]);
    qbig[far..far + 6].copy_from_slice(&qv[6..]);
    let k: Vec<f32> = (0..12).map(|i| 1.0 + 0.5 * (i % 5) as f32).collect();
    let v: Vec<f32> = (0..12).map(|i| (i as f32) - 4.0).collect();
    let mut obig = vec![0f32; far + 6];
    obig[far..].iter_mut().for_each(|x| *x = f32::NAN);
    obig[..6].iter_mut().for_each(|x| *x = f32::NAN);
    let cfg = LinearAttentionConfig { chunk: 2, ..LinearAttentionConfig::causal() };
    let saved = forward(
        &device,
        &cfg,
        ForwardArgs { q: &tr(&qbig, &lq), k: &tr(&k, &lc), v: &tr(&v, &lc), out: &mut tm(&mut obig, &lo) },
    )
    .expect("forward");
    let qw: Vec<f64> = qv.iter().map(|&x| f64::from(x)).collect();
    let kw: Vec<f64> = k.iter().map(|&x| f64::from(x)).collect();
    let vw: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
    let (out, _) =
        rla::forward(&rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) })
            .expect("reference");
    let got: Vec<f64> = obig[..6].iter().chain(&obig[far..far + 6]).map(|&x| f64::from(x)).collect();
    let (mo, _, _, _) = magnitudes(&qw, &kw, &vw, &vw, n, true, Some(1e-6));
    check_close("out", &got, &out, &mo, n, DType::F32);
    drop(obig);
    // gradients: dq written past 2^31 as well
    let mut dqbig = vec![0f32; far + 6];
    let (mut dk, mut dv) = (vec![f32::NAN; 12], vec![f32::NAN; 12]);
    let o_small: Vec<f32> = got.iter().map(|&x| x as f32).collect();
    let g: Vec<f32> = (0..12).map(|i| 0.5 - 0.1 * i as f32).collect();
    backward(
        &device,
        &saved,
        BackwardArgs {
            q: &tr(&qbig, &lq),
            k: &tr(&k, &lc),
            v: &tr(&v, &lc),
            out: Some(&tr(&o_small, &lc)),
            dout: &tr(&g, &lc),
            grads: Grads { dq: &mut tm(&mut dqbig, &lq), dk: &mut tm(&mut dk, &lc), dv: &mut tm(&mut dv, &lc) },
        },
    )
    .expect("backward");
    let gw: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
    let (rdq, _, _) = rla::backward(
        &rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) },
        &gw,
    )
    .expect("reference");
    let (_, mq, _, _) = magnitudes(&qw, &kw, &vw, &gw, n, true, Some(1e-6));
    let got: Vec<f64> = dqbig[..6].iter().chain(&dqbig[far..far + 6]).map(|&x| f64::from(x)).collect();
    check_close("dq", &got, &rdq, &mq, n, DType::F32);
}

/// `r` must be an error that `pred` accepts.
fn expect_err<T>(r: mesa_kernels::Result<T>, what: &str, pred: impl Fn(&Error) -> bool) {
    match r {
        Err(e) if pred(&e) => {}
        Err(e) => panic!("{what}: unexpected error {e:?}"),
        Ok(_) => panic!("{what}: expected an error, got Ok"),
    }
}

fn is_shape_mismatch(of: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::ShapeMismatch { what, .. } if what == of)
}

fn is_invalid_argument(of: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::InvalidArgument { name, .. } if name == of)
}

#[test]
fn bad_inputs_are_errors() {
    let device = common::emulator();
    let lq = Layout::contiguous(&[1, 2, 8, 4]);
    let lv = Layout::contiguous(&[1, 2, 8, 3]);
    let q = vec![0.5f32; 64];
    let v = vec![0.5f32; 48];
    let mut out = vec![0f32; 48];
    let cfg = LinearAttentionConfig::causal();
    let fwd = |cfg: &LinearAttentionConfig, lq: &Layout, lk: &Layout, lv: &Layout, lo: &Layout, out: &mut Vec<f32>| {
        forward(&device, cfg, ForwardArgs { q: &tr(&q, lq), k: &tr(&q, lk), v: &tr(&v, lv), out: &mut tm(out, lo) })
    };
    // rank 3
    expect_err(
        fwd(&cfg, &Layout::contiguous(&[2, 8, 4]), &lq, &lv, &lv, &mut out),
        "rank 3",
        |e| matches!(e, Error::InvalidLayout { what, .. } if what == "q"),
    );
    // k shape differs from q
    expect_err(fwd(&cfg, &lq, &Layout::contiguous(&[1, 2, 8, 2]), &lv, &lv, &mut out), "k", is_shape_mismatch("k"));
    // v length differs
    expect_err(fwd(&cfg, &lq, &lq, &Layout::contiguous(&[1, 2, 4, 3]), &lv, &mut out), "v", is_shape_mismatch("v"));
    // out shape differs from v
    expect_err(fwd(&cfg, &lq, &lq, &lv, &Layout::contiguous(&[1, 2, 8, 2]), &mut out), "out", is_shape_mismatch("out"));
    // an output view that overlaps itself (broadcast stride) cannot be made
    let bcast = Layout::strided(&[1, 2, 8, 3], &[0, 0, 3, 1], 0).expect("layout");
    expect_err(TensorMut::new(&mut out, &bcast), "overlapping out", |e| matches!(e, Error::InvalidLayout { .. }));
    // buffer too short
    expect_err(TensorRef::new(&q, &Layout::contiguous(&[1, 2, 9, 4])), "short q", |e| {
        matches!(e, Error::BufferTooShort { needed: 72, len: 64, .. })
    });
    // chunks outside 1..=64
    for chunk in [0, 65] {
        let r = fwd(&LinearAttentionConfig { chunk, ..cfg }, &lq, &lq, &lv, &lv, &mut out);
        expect_err(r, "chunk", is_invalid_argument("chunk"));
    }
    // bad eps
    for eps in [f32::NAN, 0.0, -1.0, f32::INFINITY] {
        let r = fwd(&LinearAttentionConfig { eps, ..cfg }, &lq, &lq, &lv, &lv, &mut out);
        expect_err(r, "eps", is_invalid_argument("eps"));
    }
    // backward: normalised without out; wrong dtype
    let saved: LinearAttentionSaved = fwd(&cfg, &lq, &lq, &lv, &lv, &mut out).expect("forward");
    let (mut dq, mut dk, mut dv) = (vec![0f32; 64], vec![0f32; 64], vec![0f32; 48]);
    let (qt, vt) = (tr(&q, &lq), tr(&v, &lv));
    let r = backward(
        &device,
        &saved,
        BackwardArgs {
            q: &qt,
            k: &qt,
            v: &vt,
            out: None,
            dout: &vt,
            grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
        },
    );
    expect_err(r, "missing out", is_invalid_argument("out"));
    let (qh, vh) = (vec![f16::ONE; 64], vec![f16::ONE; 48]);
    let (mut dqh, mut dkh, mut dvh) = (vec![f16::ZERO; 64], vec![f16::ZERO; 64], vec![f16::ZERO; 48]);
    let (qht, vht) = (tr(&qh, &lq), tr(&vh, &lv));
    let r = backward(
        &device,
        &saved,
        BackwardArgs {
            q: &qht,
            k: &qht,
            v: &vht,
            out: Some(&vht),
            dout: &vht,
            grads: Grads { dq: &mut tm(&mut dqh, &lq), dk: &mut tm(&mut dkh, &lq), dv: &mut tm(&mut dvh, &lv) },
        },
    );
    expect_err(r, "dtype", is_invalid_argument("saved"));
    // backward with other dims than the forward
    let lq2 = Layout::contiguous(&[1, 2, 4, 4]);
    let ot = tr(&out, &lv);
    let r = backward(
        &device,
        &saved,
        BackwardArgs {
            q: &tr(&q, &lq2),
            k: &qt,
            v: &vt,
            out: Some(&ot),
            dout: &vt,
            grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
        },
    );
    expect_err(r, "dims", is_shape_mismatch("q"));
}

// ---------------------------------------------------------------------------------------
// Feature maps

#[allow(clippy::too_many_arguments)]
fn fm_parity<T: Element>(
    device: &Device,
    rng: &mut StdRng,
    map: &FeatureMap<'_>,
    stab: rla::Stabilizer,
    b: usize,
    h: usize,
    l: usize,
    d: usize,
) {
    let m = map.out_dim(d);
    let mut x = to_t::<T>(&random_vec(rng, b * h * l * d, -1.5, 1.5));
    if let (FeatureMap::Favor { projection, .. }, rla::Stabilizer::SequenceMax) = (map, stab) {
        // the sequence's largest exponent in its last row (the last, partial row tile for
        // l > 64): a maximum pass that skipped a tile would scale every phi by exp(Δc)
        last_row_holds_the_largest_exponent(&mut x, projection.omega(), l, d);
    }
    let dphi = to_t::<T>(&random_vec(rng, b * h * l * m, -1.0, 1.0));
    let lx = Layout::contiguous(&[b, h, l, d]);
    let lp = Layout::contiguous(&[b, h, l, m]);
    let nan = T::from_f64(f64::NAN);
    let xb = up(device, &x);
    let mut pb = up(device, &vec![nan; b * h * l * m]);
    feature_map::forward(device, map, &tr(&xb, &lx), &mut tm(&mut pb, &lp)).expect("forward");
    let gb = up(device, &dphi);
    let mut db = up(device, &vec![nan; x.len()]);
    feature_map::backward(
        device,
        map,
        FeatureBackwardArgs {
            x: &tr(&xb, &lx),
            phi: Some(&tr(&pb, &lp)),
            dphi: &tr(&gb, &lp),
            dx: &mut tm(&mut db, &lx),
        },
    )
    .expect("backward");
    let (xw, gw) = (widen(&x), widen(&dphi));
    let phi_t = pb.to_vec().expect("phi");
    let phi = widen(&phi_t);
    let dx = widen(&db.to_vec().expect("dx"));
    let u = common::unit_roundoff(T::DTYPE);
    // rounding to T below its smallest normal is absolute (half the subnormal spacing); the
    // 1e-40 covers f32 intermediates that underflow in the exponent's evaluation
    let floor = 0.5 * common::subnormal_spacing(T::DTYPE) + 1e-40;
    match map {
        FeatureMap::Relu | FeatureMap::Elu1 => {
            let (rp, rd) = if matches!(map, FeatureMap::Relu) {
                (rla::relu(&xw), rla::relu_backward(&xw, &gw))
            } else {
                (rla::elu1(&xw), rla::elu1_backward(&xw, &gw))
            };
            // one expf (≤ 2 ulp on the GPU, ≤ 1 on the host) or add, then rounding to T;
            // the backward multiplies by one more rounded factor
            for i in 0..rp.len() {
                assert!(
                    (phi[i] - rp[i]).abs() <= (4.0 * 2f64.powi(-24) + u) * rp[i].abs() + floor,
                    "phi[{i}] {} vs {}",
                    phi[i],
                    rp[i]
                );
                assert!(
                    (dx[i] - rd[i]).abs() <= (6.0 * 2f64.powi(-24) + u) * rd[i].abs() + floor,
                    "dx[{i}] {} vs {}",
                    dx[i],
                    rd[i]
                );
            }
        }
        FeatureMap::Favor { projection, .. } => {
            let omega: Vec<f64> = projection.omega().iter().map(|&w| f64::from(w)).collect();
            let rp =
                rla::favor(&xw, &rla::Favor { omega: &omega, features: m, in_dim: d }, l, stab).expect("reference");
            // exponent u - c from a dot over d terms of |w||x'| (≤ (d+4) u32 · Σ|w_j x'_j|
            // + |x'|^2/2 terms) and expf (≤ 2 ulp): relative error of phi ≤ e_abs + 4u32
            // (+ the rounding to T). f16/bf16 project on tensor cores (split_mma.cuh): each
            // term within 3·2^-18 of its magnitude, the f32 sum counted twice (the tensor
            // cores' sums may truncate). A computed stabiliser c (RowMax, SequenceMax) is a u of
            // its row or sequence: off by the largest e_abs there.
            let xs = (d as f64).powf(-0.25);
            let tc =
                if T::DTYPE == DType::F32 { 0.0 } else { (d as f64 + 8.0) * 2f64.powi(-24) + 3.0 * 2f64.powi(-18) };
            let e_abs: Vec<f64> = (0..b * h * l * m)
                .map(|e| {
                    let (r, i) = (e / m, e % m);
                    let xr = &xw[r * d..(r + 1) * d];
                    let sq: f64 = xr.iter().map(|x| (x * xs).powi(2)).sum();
                    let dotabs: f64 = (0..d).map(|j| (omega[i * d + j] * xr[j] * xs).abs()).sum();
                    (d as f64 + 8.0) * 2f64.powi(-24) * (dotabs + sq + 1.0) + tc * dotabs
                })
                .collect();
            let span = match stab {
                rla::Stabilizer::RowMax => m,
                rla::Stabilizer::SequenceMax => l * m,
                _ => 0,
            };
            let e_c: Vec<f64> = if span == 0 {
                vec![0.0]
            } else {
                e_abs.chunks(span).map(|c| c.iter().fold(0.0, |a: f64, &x| a.max(x))).collect()
            };
            for e in 0..b * h * l * m {
                let (r, i) = (e / m, e % m);
                let w = rp[e];
                let tol =
                    (e_abs[e] + e_c[e.checked_div(span).unwrap_or(0)] + 8.0 * 2f64.powi(-24) + u) * w.abs() * 1.01
                        + floor;
                assert!((phi[e] - w).abs() <= tol, "phi[{r},{i}] {} vs {w}", phi[e]);
            }
            // the backward from the kernel's own phi (what it reads): Σ_i over m terms; on tensor
            // cores G Ω with g = dphi·phi and ω as f32 pairs (the same term as the forward's)
            let tc_b =
                if T::DTYPE == DType::F32 { 0.0 } else { (m as f64 + 8.0) * 2f64.powi(-24) + 3.0 * 2f64.powi(-18) };
            let rd = rla::favor_backward(&xw, &rla::Favor { omega: &omega, features: m, in_dim: d }, &phi, &gw)
                .expect("reference");
            for r in 0..b * h * l {
                for j in 0..d {
                    let mag: f64 = (0..m)
                        .map(|i| {
                            (gw[r * m + i] * phi[r * m + i]).abs()
                                * (omega[i * d + j].abs() + (xw[r * d + j] * xs).abs())
                                * xs
                        })
                        .sum();
                    let tol = ((m + 8) as f64 * 2f64.powi(-24) + tc_b + u) * mag + u * rd[r * d + j].abs() + floor;
                    let i = r * d + j;
                    assert!((dx[i] - rd[i]).abs() <= tol, "dx[{r},{j}] {} vs {}", dx[i], rd[i]);
                }
            }
        }
    }
}

/// Swaps, in every sequence of `l` rows of `x` (`[.., l, d]`), the row with the largest FAVOR+
/// exponent u = ω_i·x' − |x'|²/2 (x' = x d^(-1/4), f64) into the last position.
fn last_row_holds_the_largest_exponent<T: Element>(x: &mut [T], omega: &[f32], l: usize, d: usize) {
    if l == 0 || d == 0 {
        return;
    }
    let xs = (d as f64).powf(-0.25);
    let max_u = |row: &[T]| {
        let xp: Vec<f64> = row.iter().map(|v| v.to_f64() * xs).collect();
        let sq: f64 = xp.iter().map(|v| v * v).sum();
        omega
            .chunks(d)
            .map(|w| w.iter().zip(&xp).map(|(a, b)| f64::from(*a) * b).sum::<f64>() - 0.5 * sq)
            .fold(f64::NEG_INFINITY, f64::max)
    };
    for seq in x.chunks_mut(l * d) {
        let best = (0..l).max_by(|&a, &b| max_u(&seq[a * d..][..d]).total_cmp(&max_u(&seq[b * d..][..d])));
        if let Some(best) = best {
            for j in 0..d {
                seq.swap(best * d + j, (l - 1) * d + j);
            }
        }
    }
}

#[test]
fn feature_maps_match_the_reference() {
    let mut rng = common::rng("feature_maps_match_the_reference");
    for device in common::backends() {
        for map in [FeatureMap::Relu, FeatureMap::Elu1] {
            fm_parity::<f32>(&device, &mut rng, &map, rla::Stabilizer::None, 2, 3, 5, 7);
            fm_parity::<f16>(&device, &mut rng, &map, rla::Stabilizer::None, 1, 2, 9, 4);
            fm_parity::<bf16>(&device, &mut rng, &map, rla::Stabilizer::None, 1, 2, 9, 4);
        }
        let proj = FavorProjection::orthogonal(&device, 24, 8, 7).expect("omega");
        for (stab, rstab) in [
            (FavorStabilizer::None, rla::Stabilizer::None),
            (FavorStabilizer::RowMax, rla::Stabilizer::RowMax),
            (FavorStabilizer::Bound, rla::Stabilizer::Constant(f64::from(proj.bound()))),
            (FavorStabilizer::SequenceMax, rla::Stabilizer::SequenceMax),
        ] {
            let map = FeatureMap::Favor { projection: &proj, stabilizer: stab };
            fm_parity::<f32>(&device, &mut rng, &map, rstab, 2, 2, 6, 8);
            fm_parity::<f16>(&device, &mut rng, &map, rstab, 1, 2, 5, 8);
            fm_parity::<bf16>(&device, &mut rng, &map, rstab, 1, 2, 5, 8);
        }
        // f16/bf16 project on tensor cores in tiles of 64 rows x 64 features (forward) or 64
        // columns of d (backward), k in steps of 32: several tiles with partial last ones;
        // d = 37 takes the element loads (rows and ω not in 16-byte runs), d = 40 both kinds,
        // d = 100 two column tiles of the backward (64 + 36) and four k steps of the forward.
        // The tensor-core term of the tolerance is below bf16's output rounding: f16 is the
        // dtype that would see a small projection error.
        for (m, d) in [(70, 40), (20, 37), (24, 100)] {
            let proj = FavorProjection::orthogonal(&device, m, d, 9).expect("omega");
            for (stab, rstab) in [
                (FavorStabilizer::RowMax, rla::Stabilizer::RowMax),
                (FavorStabilizer::Bound, rla::Stabilizer::Constant(f64::from(proj.bound()))),
                (FavorStabilizer::SequenceMax, rla::Stabilizer::SequenceMax),
            ] {
                let map = FeatureMap::Favor { projection: &proj, stabilizer: stab };
                fm_parity::<f16>(&device, &mut rng, &map, rstab, 1, 2, 70, d);
                fm_parity::<bf16>(&device, &mut rng, &map, rstab, 2, 1, 33, d);
            }
        }
    }
}

/// FAVOR+ on tensor cores (f16, bf16) reads x, phi and dphi and writes phi and dx as 16-byte
/// runs where the rows allow it (contiguous: d = 64, m = 72, so also a partial feature tile),
/// else element by element (rows padded by 3 elements): the same bits either way, and nothing
/// outside a padded view is written.
#[test]
fn favor_tensor_cores_read_the_same_from_16_byte_runs_and_elements() {
    let mut rng = common::rng("favor_tensor_cores_read_the_same_from_16_byte_runs_and_elements");
    for device in common::backends() {
        let proj = FavorProjection::orthogonal(&device, 72, 64, 13).expect("omega");
        for stab in [FavorStabilizer::RowMax, FavorStabilizer::SequenceMax] {
            let map = FeatureMap::Favor { projection: &proj, stabilizer: stab };
            favor_loads_agree::<f16>(&device, &mut rng, &map);
            favor_loads_agree::<bf16>(&device, &mut rng, &map);
        }
    }
}

/// phi and dx of `map` on x, dphi given as `layouts` (x's and phi's); both gathered.
fn favor_views<T: Element>(
    device: &Device,
    map: &FeatureMap<'_>,
    x: &[T],
    dphi: &[T],
    (lx, lp): (&Layout, &Layout),
) -> (Vec<f64>, Vec<f64>, Vec<T>, Vec<T>) {
    let nan = T::from_f64(f64::NAN);
    let (xb, gb) = (up(device, x), up(device, dphi));
    let mut pb = up(device, &vec![nan; dphi.len()]);
    feature_map::forward(device, map, &tr(&xb, lx), &mut tm(&mut pb, lp)).expect("forward");
    let mut db = up(device, &vec![nan; x.len()]);
    let args =
        FeatureBackwardArgs { x: &tr(&xb, lx), phi: Some(&tr(&pb, lp)), dphi: &tr(&gb, lp), dx: &mut tm(&mut db, lx) };
    feature_map::backward(device, map, args).expect("backward");
    let (phi, dx) = (pb.to_vec().expect("phi"), db.to_vec().expect("dx"));
    (reference::gather(&phi, lp), reference::gather(&dx, lx), phi, dx)
}

fn favor_loads_agree<T: Element>(device: &Device, rng: &mut StdRng, map: &FeatureMap<'_>) {
    let (d, pad) = (64, 3);
    let m = map.out_dim(d);
    let n = Shape { b: 1, h: 2, l: 70, m: d, d };
    let x = to_t::<T>(&random_vec(rng, n.b * n.h * n.l * d, -1.5, 1.5));
    let g = to_t::<T>(&random_vec(rng, n.b * n.h * n.l * m, -1.0, 1.0));
    let (lx, lp) = (Layout::contiguous(&[n.b, n.h, n.l, d]), Layout::contiguous(&[n.b, n.h, n.l, m]));
    let (phi, dx, _, _) = favor_views(device, map, &x, &g, (&lx, &lp));
    let ((xp, lxp), (gp, lgp)) = (padded_rows(&x, n, d, pad), padded_rows(&g, n, m, pad));
    let (phi_p, dx_p, raw_phi, raw_dx) = favor_views(device, map, &xp, &gp, (&lxp, &lgp));
    let bits = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(bits(&phi, &phi_p), "phi ({:?}): 16-byte and element accesses differ", T::DTYPE);
    assert!(bits(&dx, &dx_p), "dx ({:?}): 16-byte and element accesses differ", T::DTYPE);
    for (what, raw, w) in [("phi", &raw_phi, m), ("dx", &raw_dx, d)] {
        let outside = raw.iter().enumerate().filter(|(i, v)| i % (w + pad) >= w && !v.to_f64().is_nan()).count();
        assert_eq!(outside, 0, "{what} ({:?}): {outside} padding elements written", T::DTYPE);
    }
}

#[test]
fn orthogonal_projection_is_reproducible_and_orthogonal_in_blocks() {
    let device = common::emulator();
    let a = FavorProjection::orthogonal(&device, 20, 8, 42).expect("a");
    let b = FavorProjection::orthogonal(&device, 20, 8, 42).expect("b");
    let c = FavorProjection::orthogonal(&device, 20, 8, 43).expect("c");
    assert_eq!(a.omega(), b.omega());
    assert_ne!(a.omega(), c.omega());
    let w = a.omega();
    for blk in 0..2 {
        for i in 0..8 {
            for j in 0..i {
                let (ri, rj) =
                    (&w[(blk * 8 + i) * 8..(blk * 8 + i + 1) * 8], &w[(blk * 8 + j) * 8..(blk * 8 + j + 1) * 8]);
                let dot: f64 = ri.iter().zip(rj).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
                let n = ri.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt()
                    * rj.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                assert!(dot.abs() <= 1e-5 * n, "rows {i}, {j} of block {blk} not orthogonal: {dot}");
            }
        }
    }
}

#[test]
fn causal_favor_keys_use_no_future_statistics() {
    // with the Bound stabiliser, a key's features depend on that key only
    let device = common::emulator();
    let proj = FavorProjection::orthogonal(&device, 16, 8, 3).expect("omega");
    let map = FeatureMap::Favor { projection: &proj, stabilizer: FavorStabilizer::Bound };
    let l = 10;
    let lx = Layout::contiguous(&[1, 1, l, 8]);
    let lp = Layout::contiguous(&[1, 1, l, 16]);
    let x: Vec<f32> = (0..l * 8).map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.2).collect();
    let mut x2 = x.clone();
    x2[(l - 1) * 8..].iter_mut().for_each(|v| *v *= 9.0);
    let (mut p1, mut p2) = (vec![0f32; l * 16], vec![0f32; l * 16]);
    feature_map::forward(&device, &map, &tr(&x, &lx), &mut tm(&mut p1, &lp)).expect("f");
    feature_map::forward(&device, &map, &tr(&x2, &lx), &mut tm(&mut p2, &lp)).expect("f");
    assert_eq!(p1[..(l - 1) * 16], p2[..(l - 1) * 16]);
    assert!(p2.iter().all(|&v| v.is_finite() && v <= 1.0 / 4.0 + 1e-6), "Bound keeps every feature <= 1/sqrt(m)");
}

#[test]
fn feature_map_bad_inputs_are_errors() {
    let device = common::emulator();
    let proj = FavorProjection::orthogonal(&device, 16, 8, 3).expect("omega");
    let x = vec![0f32; 40];
    let mut phi = vec![0f32; 160];
    let lx = Layout::contiguous(&[1, 1, 5, 8]);
    // projection for d = 8 given d = 4 input
    let map = FeatureMap::Favor { projection: &proj, stabilizer: FavorStabilizer::RowMax };
    let r = feature_map::forward(
        &device,
        &map,
        &tr(&x, &Layout::contiguous(&[1, 2, 5, 4])),
        &mut tm(&mut phi, &Layout::contiguous(&[1, 2, 5, 16])),
    );
    expect_err(
        r,
        "d",
        |e| matches!(e, Error::ShapeMismatch { what, expected, .. } if what == "x" && expected == &[1, 2, 5, 8]),
    );
    // wrong phi width
    let r = feature_map::forward(&device, &map, &tr(&x, &lx), &mut tm(&mut phi, &Layout::contiguous(&[1, 1, 5, 8])));
    expect_err(r, "m", is_shape_mismatch("phi"));
    // rank 3
    let r =
        feature_map::forward(&device, &FeatureMap::Relu, &tr(&x, &Layout::contiguous(&[5, 8])), &mut tm(&mut phi, &lx));
    expect_err(r, "rank", |e| matches!(e, Error::InvalidLayout { .. }));
    // favor backward without phi; a mis-shaped dphi and dx
    let mut dx = vec![0f32; 40];
    let lp = Layout::contiguous(&[1, 1, 5, 16]);
    let (xt, pt) = (tr(&x, &lx), tr(&phi, &lp));
    let r = feature_map::backward(
        &device,
        &map,
        FeatureBackwardArgs { x: &xt, phi: None, dphi: &pt, dx: &mut tm(&mut dx, &lx) },
    );
    expect_err(r, "phi", is_invalid_argument("phi"));
    let r = feature_map::backward(
        &device,
        &map,
        FeatureBackwardArgs { x: &xt, phi: Some(&pt), dphi: &xt, dx: &mut tm(&mut dx, &lx) },
    );
    expect_err(r, "dphi", is_shape_mismatch("dphi"));
    let r = feature_map::backward(
        &device,
        &map,
        FeatureBackwardArgs {
            x: &xt,
            phi: Some(&pt),
            dphi: &pt,
            dx: &mut tm(&mut dx, &Layout::contiguous(&[1, 1, 4, 8])),
        },
    );
    expect_err(r, "dx", is_shape_mismatch("dx"));
    // feature counts past the limits, and a wrong-sized ω
    expect_err(FavorProjection::orthogonal(&device, 8, 2048, 1), "d limit", is_invalid_argument("in_dim"));
    expect_err(FavorProjection::orthogonal(&device, 5000, 8, 1), "m limit", is_invalid_argument("features"));
    expect_err(FavorProjection::from_matrix(&device, 3, 2, &[0.0; 5]), "omega", is_invalid_argument("omega"));
    expect_err(FavorProjection::from_matrix(&device, 1, 2, &[0.0, f32::NAN]), "omega", is_invalid_argument("omega"));
}

#[test]
fn favor_estimates_softmax_attention_and_improves_with_more_features() {
    // small logits (|q|, |k| ~ 0.4·√d): the regime where FAVOR+ is accurate (Performer §2.3,
    // Lemma 2: the variance grows with exp(|x'_q + x'_k|²)). The estimator is random, so the
    // bounds are loose: m = 512 must beat m = 8 and land within 15% of softmax attention.
    let device = common::emulator();
    let (h, l, d) = (2, 24, 16);
    let mut rng = common::rng("favor_estimates_softmax_attention_and_improves_with_more_features");
    let q: Vec<f32> = (0..h * l * d).map(|_| (rng.random::<f32>() - 0.5) * 0.8).collect();
    let k: Vec<f32> = (0..h * l * d).map(|_| (rng.random::<f32>() - 0.5) * 0.8).collect();
    let v: Vec<f32> = (0..h * l * d).map(|_| rng.random::<f32>() - 0.5).collect();
    let dims = rla::Dims { batch: 1, heads: h, len: l, feat: d, dim: d };
    let wide = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
    for causal in [false, true] {
        let exact = rla::softmax_attention(&rla::Attention {
            q: &wide(&q),
            k: &wide(&k),
            v: &wide(&v),
            dims,
            causal,
            normalize: None,
        })
        .expect("reference");
        let mut errs = Vec::new();
        for m in [8, 512] {
            let proj = FavorProjection::orthogonal(&device, m, d, 11).expect("omega");
            let lx = Layout::contiguous(&[1, h, l, d]);
            let lp = Layout::contiguous(&[1, h, l, m]);
            let (mut qf, mut kf) = (vec![0f32; h * l * m], vec![0f32; h * l * m]);
            let kstab = if causal { FavorStabilizer::Bound } else { FavorStabilizer::SequenceMax };
            let qmap = FeatureMap::Favor { projection: &proj, stabilizer: FavorStabilizer::RowMax };
            let kmap = FeatureMap::Favor { projection: &proj, stabilizer: kstab };
            feature_map::forward(&device, &qmap, &tr(&q, &lx), &mut tm(&mut qf, &lp)).expect("q");
            feature_map::forward(&device, &kmap, &tr(&k, &lx), &mut tm(&mut kf, &lp)).expect("k");
            let mut out = vec![0f32; h * l * d];
            let base = if causal { LinearAttentionConfig::causal() } else { LinearAttentionConfig::bidirectional() };
            let cfg = LinearAttentionConfig { eps: 1e-30, ..base };
            forward(
                &device,
                &cfg,
                ForwardArgs { q: &tr(&qf, &lp), k: &tr(&kf, &lp), v: &tr(&v, &lx), out: &mut tm(&mut out, &lx) },
            )
            .expect("attention");
            let num: f64 = out.iter().zip(&exact).map(|(&a, &b)| (f64::from(a) - b).powi(2)).sum();
            let den: f64 = exact.iter().map(|b| b * b).sum();
            errs.push((num / den).sqrt());
        }
        eprintln!("causal {causal}: rel-L2 vs softmax for m = 8, 512: {errs:?}");
        assert!(errs[1] < errs[0] && errs[1] < 0.15, "causal {causal}: rel-L2 errors for m = 8, 512: {errs:?}");
    }
}

#[test]
fn feature_maps_read_and_write_strided_views() {
    // x = the q part of a packed [B, L, H, 2d] tensor, phi written into a packed
    // [B, L, H, m + 3] buffer: results equal those of contiguous copies, element for element
    let device = common::emulator();
    let mut rng = common::rng("feature_maps_read_and_write_strided_views");
    let (b, h, l, d) = (2, 3, 7, 8);
    let packed: Vec<f32> = random_vec(&mut rng, b * l * h * 2 * d, -1.5, 1.5).iter().map(|&x| x as f32).collect();
    let lx = Layout::strided(&[b, h, l, d], &[l * h * 2 * d, 2 * d, h * 2 * d, 1], d).expect("layout");
    let xc: Vec<f32> = reference::gather(&packed, &lx).iter().map(|&x| x as f32).collect();
    let proj = FavorProjection::orthogonal(&device, 12, d, 5).expect("omega");
    let maps = [
        FeatureMap::Relu,
        FeatureMap::Elu1,
        FeatureMap::Favor { projection: &proj, stabilizer: FavorStabilizer::RowMax },
        FeatureMap::Favor { projection: &proj, stabilizer: FavorStabilizer::SequenceMax },
    ];
    for map in &maps {
        let m = map.out_dim(d);
        let w = m + 3;
        let lp = Layout::strided(&[b, h, l, m], &[l * h * w, w, h * w, 1], 1).expect("layout");
        let lpc = Layout::contiguous(&[b, h, l, m]);
        let mut phi = vec![f32::NAN; b * l * h * w];
        let mut phic = vec![f32::NAN; b * h * l * m];
        feature_map::forward(&device, map, &tr(&packed, &lx), &mut tm(&mut phi, &lp)).expect("strided");
        feature_map::forward(&device, map, &tr(&xc, &Layout::contiguous(&[b, h, l, d])), &mut tm(&mut phic, &lpc))
            .expect("contiguous");
        let got = reference::gather(&phi, &lp);
        let want = reference::gather(&phic, &lpc);
        assert_eq!(got, want, "feature map on strided views differs");
        // the padding columns of the packed output are never written
        for (i, x) in phi.iter().enumerate() {
            let col = i % w;
            if col == 0 || col > m {
                assert!(x.is_nan(), "element {i} outside the view was written");
            }
        }
        // backward on the strided views equals backward on the contiguous copies
        let g: Vec<f32> = (0..b * l * h * w).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let gc: Vec<f32> = reference::gather(&g, &lp).iter().map(|&x| x as f32).collect();
        let mut dx = vec![f32::NAN; packed.len()];
        let mut dxc = vec![f32::NAN; xc.len()];
        feature_map::backward(
            &device,
            map,
            FeatureBackwardArgs {
                x: &tr(&packed, &lx),
                phi: Some(&tr(&phi, &lp)),
                dphi: &tr(&g, &lp),
                dx: &mut tm(&mut dx, &lx),
            },
        )
        .expect("strided backward");
        let lxc = Layout::contiguous(&[b, h, l, d]);
        feature_map::backward(
            &device,
            map,
            FeatureBackwardArgs {
                x: &tr(&xc, &lxc),
                phi: Some(&tr(&phic, &lpc)),
                dphi: &tr(&gc, &lpc),
                dx: &mut tm(&mut dxc, &lxc),
            },
        )
        .expect("contiguous backward");
        assert_eq!(reference::gather(&dx, &lx), reference::gather(&dxc, &lxc), "backward on strided views differs");
    }
}

// ---------------------------------------------------------------------------------------
// Aliasing (issue 8): an output over an input of the same call

fn max_abs_diff(got: &[f32], want: &[f64]) -> f64 {
    got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).abs()).fold(0.0, f64::max)
}

#[test]
fn in_place_calls_are_rejected_with_aliasing() {
    // forward with `out` written over `v`, and backward with `dq` written over `q`, through
    // RawDeviceSlice views of one host Vec (on the emulator a raw slice is a host address):
    // the kernels re-read the overwritten input, so the result is wrong; the call must be
    // rejected with Error::Aliasing.
    let device = common::emulator();
    let n = Shape { b: 1, h: 2, l: 37, m: 4, d: 4 };
    let mut rng = common::rng("in_place_calls_are_rejected_with_aliasing");
    let q = to_t::<f32>(&random_vec(&mut rng, n.qk(), 0.05, 1.0));
    let k = to_t::<f32>(&random_vec(&mut rng, n.qk(), 0.05, 1.0));
    let v = to_t::<f32>(&random_vec(&mut rng, n.vd(), -1.0, 1.0));
    let g = to_t::<f32>(&random_vec(&mut rng, n.vd(), -1.0, 1.0));
    let (qw, kw, vw, gw) = (widen(&q), widen(&k), widen(&v), widen(&g));
    let lq = Layout::contiguous(&[n.b, n.h, n.l, n.m]);
    let lv = Layout::contiguous(&[n.b, n.h, n.l, n.d]);
    let cfg = LinearAttentionConfig { chunk: 16, ..LinearAttentionConfig::causal() };
    let (rout, _) =
        rla::forward(&rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) })
            .expect("reference");
    let (rdq, _, _) = rla::backward(
        &rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) },
        &gw,
    )
    .expect("reference");

    // out over v
    let mut vo = v.clone();
    // SAFETY: `vo` outlives both views and the (synchronous) emulated call.
    let raw = unsafe { RawDeviceSlice::<f32>::new(vo.as_mut_ptr() as u64, vo.len()) };
    let mut raw_out = raw;
    let r = forward(
        &device,
        &cfg,
        ForwardArgs { q: &tr(&q, &lq), k: &tr(&k, &lq), v: &tr(&raw, &lv), out: &mut tm(&mut raw_out, &lv) },
    );
    let forward_report = format!(
        "forward with out over v: got {:?}; max |out - reference| = {:.3e}",
        r.as_ref().map(|_| "Ok").map_err(ToString::to_string),
        max_abs_diff(&vo, &rout)
    );
    let forward_rejected = matches!(r, Err(Error::Aliasing { first: "v", second: "out" }));

    // dq over q
    let mut out = vec![0f32; n.vd()];
    let saved = forward(
        &device,
        &cfg,
        ForwardArgs { q: &tr(&q, &lq), k: &tr(&k, &lq), v: &tr(&v, &lv), out: &mut tm(&mut out, &lv) },
    )
    .expect("forward");
    let mut qd = q.clone();
    // SAFETY: as above.
    let raw = unsafe { RawDeviceSlice::<f32>::new(qd.as_mut_ptr() as u64, qd.len()) };
    let mut raw_dq = raw;
    let (mut dk, mut dv) = (vec![0f32; n.qk()], vec![0f32; n.vd()]);
    let r = backward(
        &device,
        &saved,
        BackwardArgs {
            q: &tr(&raw, &lq),
            k: &tr(&k, &lq),
            v: &tr(&v, &lv),
            out: Some(&tr(&out, &lv)),
            dout: &tr(&g, &lv),
            grads: Grads { dq: &mut tm(&mut raw_dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
        },
    );
    let (_, rdk, _) = rla::backward(
        &rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) },
        &gw,
    )
    .expect("reference");
    let backward_report = format!(
        "backward with dq over q: got {:?}; max |dq - reference| = {:.3e}, max |dk - reference| = {:.3e}",
        r.as_ref().map(|_| "Ok").map_err(ToString::to_string),
        max_abs_diff(&qd, &rdq),
        max_abs_diff(&dk, &rdk)
    );
    let backward_rejected = matches!(r, Err(Error::Aliasing { first: "q", second: "dq" }));
    assert!(
        forward_rejected && backward_rejected,
        "expected Err(Aliasing) from both calls:\n  {forward_report}\n  {backward_report}"
    );
    // rejected before any kernel ran: the inputs are untouched
    assert_eq!((vo, qd), (v, q.clone()));
    // the feature maps: phi over x (ReLU, m = d), dx over dphi
    let mut x = q.clone();
    // SAFETY: as above.
    let raw = unsafe { RawDeviceSlice::<f32>::new(x.as_mut_ptr() as u64, x.len()) };
    let mut raw_phi = raw;
    let r = feature_map::forward(&device, &FeatureMap::Relu, &tr(&raw, &lq), &mut tm(&mut raw_phi, &lq));
    assert!(matches!(r, Err(Error::Aliasing { first: "x", second: "phi" })), "phi over x: {r:?}");
    let r = feature_map::backward(
        &device,
        &FeatureMap::Relu,
        FeatureBackwardArgs { x: &tr(&q, &lq), phi: None, dphi: &tr(&raw, &lq), dx: &mut tm(&mut raw_phi, &lq) },
    );
    assert!(matches!(r, Err(Error::Aliasing { first: "dphi", second: "dx" })), "dx over dphi: {r:?}");
    assert_eq!(x, q);
}

// ---------------------------------------------------------------------------------------
// Gradients named, shapes checked (issue 8)

#[test]
fn misshaped_dq_or_dk_is_a_shape_mismatch_naming_it() {
    let device = common::emulator();
    let (lq, lv) = (Layout::contiguous(&[1, 2, 8, 4]), Layout::contiguous(&[1, 2, 8, 3]));
    let q = vec![0.5f32; 64];
    let v = vec![0.25f32; 48];
    let mut out = vec![0f32; 48];
    let cfg = LinearAttentionConfig::causal();
    let saved = forward(
        &device,
        &cfg,
        ForwardArgs { q: &tr(&q, &lq), k: &tr(&q, &lq), v: &tr(&v, &lv), out: &mut tm(&mut out, &lv) },
    )
    .expect("forward");
    // dq, then dk, given dv's shape [1, 2, 8, 3] instead of q's [1, 2, 8, 4]
    for wrong in ["dq", "dk"] {
        let (mut a, mut b, mut dv) = (vec![0f32; 64], vec![0f32; 64], vec![0f32; 48]);
        let (la, lb) = if wrong == "dq" { (&lv, &lq) } else { (&lq, &lv) };
        let r = backward(
            &device,
            &saved,
            BackwardArgs {
                q: &tr(&q, &lq),
                k: &tr(&q, &lq),
                v: &tr(&v, &lv),
                out: Some(&tr(&out, &lv)),
                dout: &tr(&v, &lv),
                grads: Grads { dq: &mut tm(&mut a, la), dk: &mut tm(&mut b, lb), dv: &mut tm(&mut dv, &lv) },
            },
        );
        match r {
            Err(Error::ShapeMismatch { what, expected, got }) => {
                assert_eq!(what, wrong);
                assert_eq!((expected, got), (vec![1, 2, 8, 4], vec![1, 2, 8, 3]));
            }
            other => panic!("{wrong} mis-shaped: expected ShapeMismatch naming {wrong}, got {:?}", other.err()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// No panic on any input (issue 8)

#[test]
fn empty_tensors_with_huge_other_dims_are_handled() {
    let device = common::emulator();
    let none: Vec<f32> = Vec::new();
    let mut none_out: Vec<f32> = Vec::new();
    let big = 1usize << 62;
    // B = 0 with H, M huge: nothing to compute, nothing to save
    // L = 0, M = 0 with D = usize::MAX: nothing to write either
    let empty_cases = [([0, big, 4, big], [0, big, 4, 3]), ([1, 1, 0, 0], [1, 1, 0, usize::MAX])];
    for (sq, sv) in empty_cases {
        let (lq, lv) = (Layout::contiguous(&sq), Layout::contiguous(&sv));
        for cfg in configs() {
            let r = forward(
                &device,
                &cfg,
                ForwardArgs {
                    q: &tr(&none, &lq),
                    k: &tr(&none, &lq),
                    v: &tr(&none, &lv),
                    out: &mut tm(&mut none_out, &lv),
                },
            );
            let saved = match r {
                Ok(s) => s,
                Err(e) => panic!("forward {sq:?} {sv:?} {cfg:?}: expected Ok (empty), got {e:?}"),
            };
            assert_eq!(saved.size_in_bytes(), 0, "{sq:?} {sv:?}");
            assert_eq!(saved.final_state().expect("state"), Vec::<f32>::new());
            let (mut dq, mut dk, mut dv) = (Vec::<f32>::new(), Vec::<f32>::new(), Vec::<f32>::new());
            let r = backward(
                &device,
                &saved,
                BackwardArgs {
                    q: &tr(&none, &lq),
                    k: &tr(&none, &lq),
                    v: &tr(&none, &lv),
                    out: Some(&tr(&none, &lv)),
                    dout: &tr(&none, &lv),
                    grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
                },
            );
            assert!(r.is_ok(), "backward {sq:?} {sv:?} {cfg:?}: expected Ok (empty), got {:?}", r.err());
        }
    }
    // L = 0 but a state of B·H·M·(D+1) = 2^80·3 f32: too large, an error and not a panic
    let (lq, lv) = (Layout::contiguous(&[1, 1 << 40, 0, 1 << 40]), Layout::contiguous(&[1, 1 << 40, 0, 2]));
    let r = forward(
        &device,
        &LinearAttentionConfig::causal(),
        ForwardArgs { q: &tr(&none, &lq), k: &tr(&none, &lq), v: &tr(&none, &lv), out: &mut tm(&mut none_out, &lv) },
    );
    assert!(matches!(r, Err(Error::TooLarge { .. })), "expected TooLarge, got {:?}", r.err());
    // 2^31 heads (L = 0, a state of 2^31·2 f32 to write): the kernels index heads in 32 bits
    let heads = 1usize << 31;
    let (lq, lv) = (Layout::contiguous(&[1, heads, 0, 1]), Layout::contiguous(&[1, heads, 0, 1]));
    let r = forward(
        &device,
        &LinearAttentionConfig::causal(),
        ForwardArgs { q: &tr(&none, &lq), k: &tr(&none, &lq), v: &tr(&none, &lv), out: &mut tm(&mut none_out, &lv) },
    );
    match r {
        Err(Error::TooLarge { what, .. }) => assert_eq!(what, "batch and heads"),
        other => panic!("expected TooLarge for 2^31 heads, got {:?}", other.err()),
    }
}

#[test]
fn reference_returns_errors_instead_of_panicking() {
    // q shorter than the dims say: the public reference must not index out of bounds
    let n = rla::Dims { batch: 2, heads: 1, len: 3, feat: 2, dim: 2 };
    let short = [0.5; 5];
    let att = |q: &'static [f64]| rla::Attention {
        q,
        k: &[0.5; 12],
        v: &[0.25; 12],
        dims: n,
        causal: true,
        normalize: Some(1e-6),
    };
    let r = rla::forward(&att(&[0.5; 5]));
    assert!(matches!(&r, Err(Error::ShapeMismatch { what, .. }) if what == "q"), "short q: {:?}", r.err());
    let r = rla::backward(&att(&[0.5; 12]), &short);
    assert!(matches!(&r, Err(Error::ShapeMismatch { what, .. }) if what == "dout"), "short dout: {:?}", r.err());
    let r = rla::softmax_attention(&att(&[0.5; 13]));
    assert!(matches!(&r, Err(Error::ShapeMismatch { what, .. }) if what == "q"), "long q: {:?}", r.err());
    // empty tensors whose other sizes are huge: handled as empty, or TooLarge when the
    // outputs (here the denominators B·H·L) would not fit
    let huge = usize::MAX;
    let empty = |dims| rla::Attention { q: &[], k: &[], v: &[], dims, causal: false, normalize: Some(1e-6) };
    for dims in [
        rla::Dims { batch: 0, heads: huge, len: huge, feat: huge, dim: huge },
        rla::Dims { batch: huge, heads: huge, len: 0, feat: huge, dim: huge },
        rla::Dims { batch: 3, heads: 1 << 40, len: 1 << 40, feat: 0, dim: 0 },
    ] {
        let r = rla::forward(&empty(dims));
        let want_ok = dims.batch == 0 || dims.len == 0;
        match (want_ok, &r) {
            (true, Ok((out, den))) => assert!(out.is_empty() && den.is_empty(), "{dims:?}"),
            (false, Err(Error::TooLarge { .. })) => {}
            _ => panic!("{dims:?}: {:?}", r.err()),
        }
        // backward and softmax attention have empty outputs here
        let r = rla::backward(&empty(dims), &[]).expect("backward");
        assert!(r.0.is_empty() && r.1.is_empty() && r.2.is_empty());
        assert!(rla::softmax_attention(&empty(dims)).expect("softmax").is_empty());
    }
    // FAVOR+: ω of the wrong size, x not whole rows, rows not whole sequences
    let proj = rla::Favor { omega: &[0.1; 6], features: 3, in_dim: 2 };
    expect_err(
        rla::favor(&[0.0; 4], &rla::Favor { omega: &[0.1; 5], ..proj }, 2, rla::Stabilizer::None),
        "omega",
        |e| matches!(e, Error::ShapeMismatch { .. }),
    );
    expect_err(rla::favor(&[0.0; 5], &proj, 2, rla::Stabilizer::None), "rows", is_invalid_argument("x"));
    expect_err(rla::favor(&[0.0; 6], &proj, 2, rla::Stabilizer::SequenceMax), "seq", is_invalid_argument("seq_len"));
    expect_err(rla::favor(&[0.0; 6], &proj, 0, rla::Stabilizer::SequenceMax), "seq 0", is_invalid_argument("seq_len"));
    expect_err(rla::favor_backward(&[0.0; 4], &proj, &[0.0; 6], &[0.0; 5]), "dphi", is_shape_mismatch("dphi"));
    assert_eq!(
        rla::favor(&[], &rla::Favor { omega: &[], features: huge, in_dim: 0 }, 0, rla::Stabilizer::SequenceMax)
            .expect("empty"),
        Vec::<f64>::new()
    );
}

// ---------------------------------------------------------------------------------------
// Host sub-slices (issue 8)

#[test]
fn forward_takes_q_k_v_as_sub_slices_of_one_host_vec() {
    // q | k | v back to back in one Vec, given as `&all[a..b]` (inputs may share memory)
    let device = common::emulator();
    let n = Shape { b: 1, h: 2, l: 11, m: 3, d: 2 };
    let mut rng = common::rng("forward_takes_q_k_v_as_sub_slices_of_one_host_vec");
    let all = to_t::<f32>(&random_vec(&mut rng, 2 * n.qk() + n.vd(), 0.05, 1.0));
    let (lq, lv) = (Layout::contiguous(&[n.b, n.h, n.l, n.m]), Layout::contiguous(&[n.b, n.h, n.l, n.d]));
    let mut out = vec![f32::NAN; n.vd()];
    forward(
        &device,
        &LinearAttentionConfig { chunk: 4, ..LinearAttentionConfig::causal() },
        ForwardArgs {
            q: &tr(&all[..n.qk()], &lq),
            k: &tr(&all[n.qk()..2 * n.qk()], &lq),
            v: &tr(&all[2 * n.qk()..], &lv),
            out: &mut tm(&mut out[..], &lv),
        },
    )
    .expect("forward");
    let w = widen(&all);
    let (q, k, v) = (&w[..n.qk()], &w[n.qk()..2 * n.qk()], &w[2 * n.qk()..]);
    let (rout, _) = rla::forward(&rla::Attention { q, k, v, dims: n.dims(), causal: true, normalize: Some(1e-6) })
        .expect("reference");
    let (mo, _, _, _) = magnitudes(q, k, v, v, n, true, Some(1e-6));
    check_close("out", &widen(&out), &rout, &mo, n, DType::F32);
}

/// FAVOR+ with no input features (d = 0): x and ω are empty and may be null pointers;
/// φ(x) = exp(ω·x − |x|²/2)/√m = 1/√m exactly for every position (Performer Eq. for the
/// positive features, with empty sums).
#[test]
fn favor_with_no_input_features_takes_null_pointers() {
    let device = common::emulator();
    let proj = FavorProjection::from_matrix(&device, 4, 0, &[]).expect("empty projection");
    // every stabiliser (the tensor-core kernels of f16/bf16 have one instance each): u = 0 for
    // every feature, so every c is 0 (the bound max |ω_i|²/2 of empty rows too) and φ = 1/2
    for stabilizer in
        [FavorStabilizer::None, FavorStabilizer::RowMax, FavorStabilizer::Bound, FavorStabilizer::SequenceMax]
    {
        let map = FeatureMap::Favor { projection: &proj, stabilizer };
        empty_x_gives_constant_features::<f32>(&device, &map, 0.5);
        empty_x_gives_constant_features::<f16>(&device, &map, 0.5);
        empty_x_gives_constant_features::<bf16>(&device, &map, 0.5);
    }
}

fn empty_x_gives_constant_features<T: Element>(device: &Device, map: &FeatureMap<'_>, phi0: f64) {
    // SAFETY: a zero-length view; never dereferenced.
    let null: mesa_kernels::RawDeviceSlice<T> = unsafe { mesa_kernels::RawDeviceSlice::new(0, 0) };
    let x = TensorRef::contiguous(&null, &[1, 1, 2, 0]).expect("view");
    let mut phi = to_t::<T>(&[f64::NAN; 8]);
    let r = feature_map::forward(device, map, &x, &mut TensorMut::contiguous(&mut phi, &[1, 1, 2, 4]).expect("view"));
    assert!(r.is_ok(), "{:?}: {r:?}", T::DTYPE);
    // exp(0) = 1 and 1/√4 = 1/2 are exact in every dtype
    assert_eq!(widen(&phi), vec![phi0; 8], "{:?}, {map:?}", T::DTYPE);
}

/// The issue-13 measure of causality of `dq`: max |dq − dq_ref| over positions `t < t0`
/// (all heads, all features) divided by the largest |dq_ref| there.
fn early_dq_error(dq: &[f64], dq_ref: &[f64], n: Shape, t0: usize) -> f64 {
    let (mut err, mut big) = (0.0f64, 0.0f64);
    for bh in 0..n.b * n.h {
        for t in 0..t0 {
            for i in 0..n.m {
                let j = (bh * n.l + t) * n.m + i;
                err = err.max((dq[j] - dq_ref[j]).abs());
                big = big.max(dq_ref[j].abs());
            }
        }
    }
    err / big
}

#[test]
fn slim_dq_at_earlier_positions_ignores_large_later_keys_and_values() {
    // Issue 13's finding: L = 16, the keys and values of the last positions multiplied by
    // 1e3, 1e4, 1e5. In exact arithmetic dq_t for t < t0 does not depend on them (dq_t sums
    // over s ≤ t only). SLiM's error at those positions must stay within 10x the boundary
    // mode's on the same input; both within the derived f32 bound of the module docs (chain
    // M + D + 2L + 8 roundings times the causal magnitude of dq_t).
    let mut rng = common::rng("slim_dq_at_earlier_positions_ignores_large_later_keys_and_values");
    let n = Shape { b: 1, h: 2, l: 16, m: 6, d: 5 };
    let device = Device::emulator();
    for (chunk, t0) in [(4, 12), (4, 15), (8, 8), (5, 13)] {
        let q = random_vec(&mut rng, n.qk(), 0.05, 1.0);
        let k0 = random_vec(&mut rng, n.qk(), 0.05, 1.0);
        let v0 = random_vec(&mut rng, n.vd(), -1.0, 1.0);
        let g = random_vec(&mut rng, n.vd(), -1.0, 1.0);
        let mut first_early: Option<Vec<Vec<f64>>> = None;
        for scale in [1e3, 1e4, 1e5] {
            let (mut k, mut v) = (k0.clone(), v0.clone());
            for bh in 0..n.b * n.h {
                for t in t0..n.l {
                    k[(bh * n.l + t) * n.m..(bh * n.l + t + 1) * n.m].iter_mut().for_each(|x| *x *= scale);
                    v[(bh * n.l + t) * n.d..(bh * n.l + t + 1) * n.d].iter_mut().for_each(|x| *x *= scale);
                }
            }
            let (qt, kt, vt, gt) = (to_t::<f32>(&q), to_t::<f32>(&k), to_t::<f32>(&v), to_t::<f32>(&g));
            let (qw, kw, vw, gw) = (widen(&qt), widen(&kt), widen(&vt), widen(&gt));
            let att = rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: Some(1e-6) };
            let (rdq, _, _) = rla::backward(&att, &gw).expect("reference");
            let (_, mq, _, _) = magnitudes(&qw, &kw, &vw, &gw, n, true, Some(1e-6));
            let modes = [MemoryMode::BoundaryStates, MemoryMode::Slim];
            let runs: Vec<Outputs> = modes
                .iter()
                .map(|&memory| {
                    let cfg = LinearAttentionConfig { chunk, memory, ..LinearAttentionConfig::causal() };
                    run(&device, &cfg, n, &qt, &kt, &vt, &gt)
                })
                .collect();
            // the boundary mode's forward, dk and dv are the chunk decomposition (parallel chunk
            // sums, a scan, parallel outputs), SLiM's the sequential walk: bitwise the same
            assert!(
                runs[0].out.iter().zip(&runs[1].out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "chunk {chunk}, x{scale:e}: the modes' forward outputs differ"
            );
            // the same for dk and dv (decomposed in the boundary mode, sequential in SLiM)
            for (what, a, b) in [("dk", &runs[0].dk, &runs[1].dk), ("dv", &runs[0].dv, &runs[1].dv)] {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "chunk {chunk}, x{scale:e}: the modes' {what} differ"
                );
            }
            let dqs: Vec<Vec<f64>> = runs.into_iter().map(|r| r.dq).collect();
            let (boundary, slim) = (early_dq_error(&dqs[0], &rdq, n, t0), early_dq_error(&dqs[1], &rdq, n, t0));
            eprintln!("chunk {chunk}, t0 {t0}, x{scale:e}: early-dq error boundary {boundary:.3e}, slim {slim:.3e}");
            assert!(
                slim <= 10.0 * boundary,
                "chunk {chunk}, rows {t0}.. x{scale:e}: SLiM's early-dq error {slim:.3e} > 10x the boundary mode's \
                 {boundary:.3e}"
            );
            let early = |x: &[f64]| -> Vec<f64> {
                (0..n.b * n.h).flat_map(|bh| x[bh * n.l * n.m..(bh * n.l + t0) * n.m].to_vec()).collect()
            };
            for (memory, dq) in modes.iter().zip(&dqs) {
                let what = format!("dq before {t0}, {memory:?}, x{scale:e}");
                check_close(&what, &early(dq), &early(&rdq), &early(&mq), Shape { l: t0, ..n }, DType::F32);
            }
            // both modes do the same f32 operations in the same order (docs): bitwise equal
            assert!(
                dqs[0].iter().zip(&dqs[1]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "chunk {chunk}, x{scale:e}: the modes' dq differ"
            );
            // stronger: both modes read only rows s <= t, so the early dq is bitwise the same
            // whatever the later rows hold
            let now: Vec<Vec<f64>> = dqs.iter().map(|dq| early(dq)).collect();
            match &first_early {
                None => first_early = Some(now),
                Some(first) => {
                    for (m, (a, b)) in modes.iter().zip(first.iter().zip(&now)) {
                        assert!(
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{m:?}: dq before {t0} changed with the later rows' scale (x{scale:e})"
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// State in / out (issue 13 item 4)

/// The rows `t0..t1` of a contiguous `[B, H, L, F]` buffer as a strided view.
fn rows_view(n: Shape, f: usize, t0: usize, t1: usize) -> Layout {
    Layout::strided(&[n.b, n.h, t1 - t0, f], &[n.h * n.l * f, n.l * f, f, 1], t0 * f).expect("rows view")
}

/// f64 reference of the state terms: the final state `Σ_s k_s [v_s | 1]ᵀ` `[B·H, M, W]`, the
/// initial state's gradient `dS_L' + Σ_t q_t dO'_tᵀ`, and the final-state gradient's part of
/// dk and dv; each with its magnitude (terms replaced by their absolute values).
struct StateRef {
    fin: Vec<f64>,
    fin_mag: Vec<f64>,
    d_init: Vec<f64>,
    d_init_mag: Vec<f64>,
    dk: Vec<f64>,
    dk_mag: Vec<f64>,
    dv: Vec<f64>,
    dv_mag: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
fn state_reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    d_final: &[f64],
    n: Shape,
    eps: Option<f64>,
) -> StateRef {
    let (l, m, d) = (n.l, n.m, n.d);
    let w = d + usize::from(eps.is_some());
    let att = rla::Attention { q, k, v, dims: n.dims(), causal: true, normalize: eps };
    let (out, den) = rla::forward(&att).expect("reference");
    let bhs = n.b * n.h;
    let mut r = StateRef {
        fin: vec![0.0; bhs * m * w],
        fin_mag: vec![0.0; bhs * m * w],
        d_init: d_final.to_vec(),
        d_init_mag: d_final.iter().map(|x| x.abs()).collect(),
        dk: vec![0.0; n.qk()],
        dk_mag: vec![0.0; n.qk()],
        dv: vec![0.0; n.vd()],
        dv_mag: vec![0.0; n.vd()],
    };
    for bh in 0..bhs {
        for t in 0..l {
            let row = bh * l + t;
            let g = den[row];
            // c'_t = [v_t | 1], dO'_t = [dout_t / g | dden_t] (and their magnitudes)
            let c: Vec<f64> = (0..w).map(|j| if j < d { v[row * d + j] } else { 1.0 }).collect();
            let dden = -(0..d).map(|j| dout[row * d + j] * out[row * d + j]).sum::<f64>() / g;
            let ddmag = (0..d).map(|j| (dout[row * d + j] * out[row * d + j]).abs()).sum::<f64>() / g.abs();
            let dz: Vec<f64> = (0..w).map(|j| if j < d { dout[row * d + j] / g } else { dden }).collect();
            let dzm: Vec<f64> = (0..w).map(|j| if j < d { (dout[row * d + j] / g).abs() } else { ddmag }).collect();
            for i in 0..m {
                let (kf, qf) = (k[row * m + i], q[row * m + i]);
                for j in 0..w {
                    let s = (bh * m + i) * w + j;
                    r.fin[s] += kf * c[j];
                    r.fin_mag[s] += (kf * c[j]).abs();
                    r.d_init[s] += qf * dz[j];
                    r.d_init_mag[s] += (qf * dzm[j]).abs();
                    r.dk[row * m + i] += d_final[s] * c[j];
                    r.dk_mag[row * m + i] += (d_final[s] * c[j]).abs();
                }
                for j in 0..d {
                    let s = (bh * m + i) * w + j;
                    r.dv[row * d + j] += kf * d_final[s];
                    r.dv_mag[row * d + j] += (kf * d_final[s]).abs();
                }
            }
        }
    }
    r
}

/// One piece `t0..t1` of the sequence: forward from `initial`, returning what it saved.
#[allow(clippy::too_many_arguments)]
fn forward_piece<T: Element>(
    device: &Device,
    cfg: &LinearAttentionConfig,
    n: Shape,
    (t0, t1): (usize, usize),
    (qb, kb, vb): (&Buffer<T>, &Buffer<T>, &Buffer<T>),
    ob: &mut Buffer<T>,
    initial: Option<&TensorRef<'_, f32>>,
) -> LinearAttentionSaved {
    let (lq, lv) = (rows_view(n, n.m, t0, t1), rows_view(n, n.d, t0, t1));
    forward_with_state(
        device,
        cfg,
        ForwardArgs { q: &tr(qb, &lq), k: &tr(kb, &lq), v: &tr(vb, &lv), out: &mut tm(ob, &lv) },
        initial,
    )
    .expect("forward piece")
}

#[test]
fn a_sequence_split_in_two_calls_gives_the_one_call_results() {
    // Outputs, gradients, the final state and the initial state's gradient of two calls
    // (the second starting from the first's final state; backward in reverse, passing the
    // state gradient back) against the f64 reference of one call, with the module's bound:
    // the carried f32 state continues the same accumulation chain (≤ L rows in all), so the
    // split adds no term to it. A final-state gradient dS_L' enters the second call.
    let mut rng = common::rng("a_sequence_split_in_two_calls_gives_the_one_call_results");
    let n = Shape { b: 2, h: 2, l: 37, m: 6, d: 5 };
    for device in common::backends() {
        for cfg in configs().into_iter().filter(|c| c.causal) {
            for split in [0, 13, 16, 37] {
                split_case::<f32>(&device, &mut rng, &cfg, n, split);
            }
            split_case::<bf16>(&device, &mut rng, &cfg, n, 21);
        }
    }
}

fn split_case<T: Element>(device: &Device, rng: &mut StdRng, cfg: &LinearAttentionConfig, n: Shape, split: usize) {
    let lo = if cfg.normalize { 0.05 } else { -1.0 };
    let w = n.d + usize::from(cfg.normalize);
    let (q, k) = (to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0)), to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0)));
    let v = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
    let dout = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
    let d_final: Vec<f32> = random_vec(rng, n.b * n.h * n.m * w, -1.0, 1.0).iter().map(|&x| x as f32).collect();
    let nan = T::from_f64(f64::NAN);
    let (qb, kb, vb, gb) = (up(device, &q), up(device, &k), up(device, &v), up(device, &dout));
    let mut ob = up(device, &vec![nan; n.vd()]);
    let first = forward_piece(device, cfg, n, (0, split), (&qb, &kb, &vb), &mut ob, None);
    let s1 = first.final_state_tensor().expect("state view");
    let second = forward_piece(device, cfg, n, (split, n.l), (&qb, &kb, &vb), &mut ob, Some(&s1));
    // backward: the second piece first, its d_initial is the first piece's d_final
    let sshape = [n.b, n.h, n.m, w];
    let dfb = up(device, &d_final);
    let mut dmid = up(device, &vec![f32::NAN; d_final.len()]);
    let mut dinit = up(device, &vec![f32::NAN; d_final.len()]);
    let (mut dqb, mut dkb, mut dvb) =
        (up(device, &vec![nan; n.qk()]), up(device, &vec![nan; n.qk()]), up(device, &vec![nan; n.vd()]));
    for (saved, (t0, t1), piece) in [(&second, (split, n.l), 1), (&first, (0, split), 0)] {
        let (lq, lv) = (rows_view(n, n.m, t0, t1), rows_view(n, n.d, t0, t1));
        let (dfin, dini) = if piece == 1 { (&dfb, &mut dmid) } else { (&dmid, &mut dinit) };
        let dfin_t = TensorRef::contiguous(dfin, &sshape).expect("d_final");
        let mut dini_t = TensorMut::contiguous(dini, &sshape).expect("d_initial");
        backward_with_state(
            device,
            saved,
            BackwardArgs {
                q: &tr(&qb, &lq),
                k: &tr(&kb, &lq),
                v: &tr(&vb, &lv),
                out: Some(&tr(&ob, &lv)),
                dout: &tr(&gb, &lv),
                grads: Grads { dq: &mut tm(&mut dqb, &lq), dk: &mut tm(&mut dkb, &lq), dv: &mut tm(&mut dvb, &lv) },
            },
            StateGrads { d_final: Some(&dfin_t), d_initial: Some(&mut dini_t) },
        )
        .expect("backward piece");
    }
    // the reference of one call, plus the final state's terms
    let (qw, kw, vw, gw) = (widen(&q), widen(&k), widen(&v), widen(&dout));
    let dfw: Vec<f64> = d_final.iter().map(|&x| f64::from(x)).collect();
    let eps = cfg.normalize.then_some(f64::from(cfg.eps));
    let att = rla::Attention { q: &qw, k: &kw, v: &vw, dims: n.dims(), causal: true, normalize: eps };
    let (out, _) = rla::forward(&att).expect("reference");
    let (rdq, mut rdk, mut rdv) = rla::backward(&att, &gw).expect("reference");
    let (mo, mq, mut mk, mut mv) = magnitudes(&qw, &kw, &vw, &gw, n, true, eps);
    let st = state_reference(&qw, &kw, &vw, &gw, &dfw, n, eps);
    for i in 0..rdk.len() {
        rdk[i] += st.dk[i];
        mk[i] += st.dk_mag[i];
    }
    for i in 0..rdv.len() {
        rdv[i] += st.dv[i];
        mv[i] += st.dv_mag[i];
    }
    let what = |x: &str| format!("{x}, split at {split}, {:?}", cfg);
    check_close(&what("out"), &widen(&ob.to_vec().expect("out")), &out, &mo, n, T::DTYPE);
    check_close(&what("dq"), &widen(&dqb.to_vec().expect("dq")), &rdq, &mq, n, T::DTYPE);
    check_close(&what("dk"), &widen(&dkb.to_vec().expect("dk")), &rdk, &mk, n, T::DTYPE);
    check_close(&what("dv"), &widen(&dvb.to_vec().expect("dv")), &rdv, &mv, n, T::DTYPE);
    // the states are f32 (the rounding to T of check_close's last term is then conservative)
    let f32s = |x: Vec<f32>| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    check_close(&what("final state"), &f32s(second.final_state().expect("state")), &st.fin, &st.fin_mag, n, T::DTYPE);
    check_close(&what("d_initial"), &f32s(dinit.to_vec().expect("d_init")), &st.d_init, &st.d_init_mag, n, T::DTYPE);
}

#[test]
fn bad_states_are_errors() {
    let device = Device::emulator();
    let n = Shape { b: 1, h: 2, l: 8, m: 4, d: 3 };
    let (lq, lv) = (Layout::contiguous(&[1, 2, 8, 4]), Layout::contiguous(&[1, 2, 8, 3]));
    let (q, v) = (vec![0.5f32; n.qk()], vec![0.5f32; n.vd()]);
    let mut out = vec![0f32; n.vd()];
    // normalised: W = D + 1 = 4
    let good = vec![0f32; 2 * 4 * 4];
    let s_ok = TensorRef::contiguous(&good, &[1, 2, 4, 4]).expect("state");
    let s_narrow = TensorRef::contiguous(&good, &[1, 2, 4, 3]).expect("state");
    let s_strided =
        TensorRef::new(&good, &Layout::contiguous(&[1, 2, 4, 4]).transpose(2, 3).expect("t")).expect("state");
    let fwd = |cfg: &LinearAttentionConfig, s: &TensorRef<'_, f32>, out: &mut Vec<f32>| {
        forward_with_state(
            &device,
            cfg,
            ForwardArgs { q: &tr(&q, &lq), k: &tr(&q, &lq), v: &tr(&v, &lv), out: &mut tm(out, &lv) },
            Some(s),
        )
    };
    let causal = LinearAttentionConfig::causal();
    expect_err(
        fwd(&LinearAttentionConfig::bidirectional(), &s_ok, &mut out),
        "bidir",
        is_invalid_argument("initial_state"),
    );
    expect_err(fwd(&causal, &s_narrow, &mut out), "W", is_shape_mismatch("initial_state"));
    expect_err(
        fwd(&causal, &s_strided, &mut out),
        "strided",
        |e| matches!(e, Error::InvalidLayout { what, .. } if what == "initial_state"),
    );
    let saved = fwd(&causal, &s_ok, &mut out).expect("forward");
    let bidir = forward(
        &device,
        &LinearAttentionConfig::bidirectional(),
        ForwardArgs { q: &tr(&q, &lq), k: &tr(&q, &lq), v: &tr(&v, &lv), out: &mut tm(&mut out, &lv) },
    )
    .expect("forward");
    let (mut dq, mut dk, mut dv) = (vec![0f32; n.qk()], vec![0f32; n.qk()], vec![0f32; n.vd()]);
    let mut dinit = vec![0f32; good.len()];
    let (qt, vt, ot) = (tr(&q, &lq), tr(&v, &lv), tr(&out, &lv));
    let mut bwd = |saved: &LinearAttentionSaved, states: StateGrads<'_, '_>| {
        backward_with_state(
            &device,
            saved,
            BackwardArgs {
                q: &qt,
                k: &qt,
                v: &vt,
                out: Some(&ot),
                dout: &vt,
                grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
            },
            states,
        )
    };
    expect_err(
        bwd(&saved, StateGrads { d_final: Some(&s_narrow), d_initial: None }),
        "d_final W",
        is_shape_mismatch("d_final"),
    );
    expect_err(
        bwd(&saved, StateGrads { d_final: Some(&s_strided), d_initial: None }),
        "d_final strided",
        |e| matches!(e, Error::InvalidLayout { what, .. } if what == "d_final"),
    );
    let mut di = TensorMut::contiguous(&mut dinit, &[1, 2, 4, 3]).expect("d_init");
    expect_err(
        bwd(&saved, StateGrads { d_final: None, d_initial: Some(&mut di) }),
        "d_initial W",
        is_shape_mismatch("d_initial"),
    );
    expect_err(
        bwd(&bidir, StateGrads { d_final: Some(&s_ok), d_initial: None }),
        "bidir",
        is_invalid_argument("d_final"),
    );
    let mut di = TensorMut::contiguous(&mut dinit, &[1, 2, 4, 4]).expect("d_init");
    expect_err(
        bwd(&bidir, StateGrads { d_final: None, d_initial: Some(&mut di) }),
        "bidir",
        is_invalid_argument("d_initial"),
    );
    // d_initial over d_final (one host Vec through RawDeviceSlice): rejected as aliasing
    let mut shared = vec![0f32; good.len()];
    // SAFETY: `shared` outlives both views and the (synchronous) emulated call.
    let raw = unsafe { RawDeviceSlice::<f32>::new(shared.as_mut_ptr() as u64, shared.len()) };
    let mut raw_out = raw;
    let df = TensorRef::contiguous(&raw, &[1, 2, 4, 4]).expect("d_final");
    let mut di = TensorMut::contiguous(&mut raw_out, &[1, 2, 4, 4]).expect("d_initial");
    let r = bwd(&saved, StateGrads { d_final: Some(&df), d_initial: Some(&mut di) });
    expect_err(r, "in place", |e| matches!(e, Error::Aliasing { .. }));
}

// ---------------------------------------------------------------------------------------
// Packed variable-length sequences (issue 13 item 5)

/// Everything one causal/bidirectional call writes, as f64 (gradients, states).
struct CallResult {
    out: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    fin: Vec<f64>,
    d_init: Vec<f64>,
}

/// One call on rows `t0..t1` of the `[1, H, L, ·]` buffers, or (with `offsets`) one packed
/// call on all rows; initial states / final-state gradients given for causal attention.
#[allow(clippy::too_many_arguments)]
fn state_call<T: Element>(
    device: &Device,
    cfg: &LinearAttentionConfig,
    n: Shape,
    (t0, t1): (usize, usize),
    offsets: Option<&[usize]>,
    x: (&[T], &[T], &[T], &[T]),
    s0: Option<&[f32]>,
    dfin: Option<&[f32]>,
) -> CallResult {
    let (q, k, v, g) = x;
    let (lq, lv) = (rows_view(n, n.m, t0, t1), rows_view(n, n.d, t0, t1));
    let nan = T::from_f64(f64::NAN);
    let (mut ob, mut dq, mut dk, mut dv) = (vec![nan; n.vd()], vec![nan; n.qk()], vec![nan; n.qk()], vec![nan; n.vd()]);
    let nst = offsets.map_or(n.b, |o| o.len() - 1);
    let sshape = [nst, n.h, n.m, n.d + usize::from(cfg.normalize)];
    let s0t = s0.map(|s| TensorRef::contiguous(s, &sshape).expect("s0"));
    let args = ForwardArgs { q: &tr(q, &lq), k: &tr(k, &lq), v: &tr(v, &lv), out: &mut tm(&mut ob, &lv) };
    let saved = match offsets {
        Some(o) => forward_packed(device, cfg, args, o, s0t.as_ref()),
        None => forward_with_state(device, cfg, args, s0t.as_ref()),
    }
    .expect("forward");
    let mut d_init = vec![f32::NAN; sshape.iter().product()];
    {
        let dft = dfin.map(|s| TensorRef::contiguous(s, &sshape).expect("d_final"));
        let mut dit = TensorMut::contiguous(&mut d_init, &sshape).expect("d_initial");
        let states = if cfg.causal {
            StateGrads { d_final: dft.as_ref(), d_initial: Some(&mut dit) }
        } else {
            StateGrads::default()
        };
        backward_with_state(
            device,
            &saved,
            BackwardArgs {
                q: &tr(q, &lq),
                k: &tr(k, &lq),
                v: &tr(v, &lv),
                out: Some(&tr(&ob, &lv)),
                dout: &tr(g, &lv),
                grads: Grads { dq: &mut tm(&mut dq, &lq), dk: &mut tm(&mut dk, &lq), dv: &mut tm(&mut dv, &lv) },
            },
            states,
        )
        .expect("backward");
    }
    let w = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
    CallResult {
        out: widen(&ob),
        dq: widen(&dq),
        dk: widen(&dk),
        dv: widen(&dv),
        fin: w(&saved.final_state().expect("state")),
        d_init: if cfg.causal { w(&d_init) } else { Vec::new() },
    }
}

#[test]
fn packed_sequences_equal_one_call_per_sequence() {
    // N = 6 sequences of lengths 5, 0, 17, 16, 1, 33 (an empty one, L < chunk, L = chunk,
    // L not a multiple of the chunk) in one [1, H, 72, ·] batch. Each sequence's rows are
    // computed from its own rows only, chunked from its own start, with the same f32
    // operations as a separate call on a view of them: the results must be bitwise equal
    // (outputs, gradients, final states, initial-state gradients).
    let mut rng = common::rng("packed_sequences_equal_one_call_per_sequence");
    packed_case::<f32>(&mut rng, 6, 5);
    // bf16 on tensor cores, D = 80 (three D-tiles of the outputs and dv) and M = 40 (two of
    // dq and dk): the packed call's 24 (head, chunk) items give its per-chunk outputs whole
    // groups, the sequences' own calls (2–10 items) one D-tile per block (2 items), groups of
    // 2 (+ 1) (4, 6) or whole groups (10) (value_group, the emulator's notional 1-SM device)
    packed_case::<bf16>(&mut rng, 40, 80);
}

fn packed_case<T: Element>(rng: &mut StdRng, m: usize, d: usize) {
    let lens = [5usize, 0, 17, 16, 1, 33];
    let mut offsets = vec![0usize];
    for l in lens {
        offsets.push(offsets.last().copied().unwrap_or(0) + l);
    }
    let n = Shape { b: 1, h: 2, l: offsets[lens.len()], m, d };
    let device = common::emulator();
    // (tensor cores: causal only, the per-chunk outputs are the boundary mode's)
    for cfg in configs().into_iter().filter(|c| c.causal || T::DTYPE == DType::F32) {
        let cfg = LinearAttentionConfig { chunk: 8, ..cfg };
        let lo = if cfg.normalize { 0.05 } else { -1.0 };
        let t = |rng: &mut StdRng, len: usize, lo: f64| to_t::<T>(&random_vec(rng, len, lo, 1.0));
        let f = |rng: &mut StdRng, len: usize, lo: f64| to_t::<f32>(&random_vec(rng, len, lo, 1.0));
        let (q, k, v, g) = (t(rng, n.qk(), lo), t(rng, n.qk(), lo), t(rng, n.vd(), -1.0), t(rng, n.vd(), -1.0));
        let w = n.d + usize::from(cfg.normalize);
        let per_seq = n.h * n.m * w;
        let (s0, dfin) = (f(rng, lens.len() * per_seq, 0.0), f(rng, lens.len() * per_seq, -1.0));
        let causal = cfg.causal;
        let packed = state_call(
            &device,
            &cfg,
            n,
            (0, n.l),
            Some(&offsets),
            (&q, &k, &v, &g),
            causal.then_some(&s0[..]),
            causal.then_some(&dfin[..]),
        );
        for (i, win) in offsets.windows(2).enumerate() {
            let (a, b) = (win[0], win[1]);
            let st = i * per_seq..(i + 1) * per_seq;
            let one = state_call(
                &device,
                &cfg,
                n,
                (a, b),
                None,
                (&q, &k, &v, &g),
                causal.then_some(&s0[st.clone()]),
                causal.then_some(&dfin[st.clone()]),
            );
            let same = |what: &str, x: &[f64], y: &[f64]| {
                assert!(
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{what} of sequence {i} (rows {a}..{b}) differs from its own call, {cfg:?}"
                );
            };
            for h in 0..n.h {
                let rows = |x: &[f64], f: usize| x[(h * n.l + a) * f..(h * n.l + b) * f].to_vec();
                same("out", &rows(&packed.out, n.d), &rows(&one.out, n.d));
                same("dq", &rows(&packed.dq, n.m), &rows(&one.dq, n.m));
                same("dk", &rows(&packed.dk, n.m), &rows(&one.dk, n.m));
                same("dv", &rows(&packed.dv, n.d), &rows(&one.dv, n.d));
            }
            same("final state", &packed.fin[st.clone()], &one.fin);
            if causal {
                same("d_initial", &packed.d_init[st.clone()], &one.d_init);
            }
        }
    }
}

/// The state-walk schedule (`Schedule::StateWalk`: one sequential walk per (state, D-tile)
/// writing the state entering each chunk, for the forward and for dk, dv) and the walk
/// (`Schedule::Walk`: SLiM's forward walk keeping the states, SLiM's dk and dv walks) do the
/// f32 operations of the chunk sums and their scan in the same order, so every result must be
/// bitwise that of `Schedule::ChunkSums`: outputs, gradients, final states and initial-state
/// gradients, on packed sequences (an empty one, L < chunk, L not a multiple of it) with
/// initial states and final-state gradients; M = D = 40 (f32 on the FP32 tiles, bf16 on
/// tensor cores) give every walk two D-tiles, f16 (M = D = 8) the other tensor-core instances.
/// And against the f64 reference on its own.
#[test]
fn walk_schedules_equal_chunk_sums_bitwise() {
    let mut rng = common::rng("walk_schedules_equal_chunk_sums_bitwise");
    let device = common::emulator();
    schedules_agree::<f32>(&device, &mut rng, 40, 40);
    schedules_agree::<f16>(&device, &mut rng, 8, 8);
    schedules_agree::<bf16>(&device, &mut rng, 40, 40);
}

fn schedules_agree<T: Element>(device: &Device, rng: &mut StdRng, m: usize, d: usize) {
    let lens = [5usize, 0, 17, 16, 1, 33];
    let mut offsets = vec![0usize];
    for l in lens {
        offsets.push(offsets.last().copied().unwrap_or(0) + l);
    }
    let n = Shape { b: 1, h: 2, l: offsets[lens.len()], m, d };
    for normalize in [true, false] {
        let sums = LinearAttentionConfig { normalize, chunk: 16, ..LinearAttentionConfig::causal() };
        let state_walk = LinearAttentionConfig { schedule: Schedule::StateWalk, ..sums };
        let walk = LinearAttentionConfig { schedule: Schedule::Walk, ..sums };
        parity::<T>(device, rng, &state_walk, Shape { b: 2, h: 2, l: 37, m: 8, d: 5 });
        parity::<T>(device, rng, &walk, Shape { b: 2, h: 2, l: 37, m: 8, d: 5 });
        let lo = if normalize { 0.05 } else { -1.0 };
        let t = |rng: &mut StdRng, len: usize, lo: f64| to_t::<T>(&random_vec(rng, len, lo, 1.0));
        let f = |rng: &mut StdRng, len: usize, lo: f64| to_t::<f32>(&random_vec(rng, len, lo, 1.0));
        let (q, k, v, g) = (t(rng, n.qk(), lo), t(rng, n.qk(), lo), t(rng, n.vd(), -1.0), t(rng, n.vd(), -1.0));
        let per_seq = n.h * n.m * (n.d + usize::from(normalize));
        let (s0, dfin) = (f(rng, lens.len() * per_seq, 0.0), f(rng, lens.len() * per_seq, -1.0));
        let call = |cfg: &LinearAttentionConfig| {
            state_call(device, cfg, n, (0, n.l), Some(&offsets), (&q, &k, &v, &g), Some(&s0), Some(&dfin))
        };
        let a = call(&sums);
        for cfg in [state_walk, walk] {
            let b = call(&cfg);
            for (what, x, y) in [
                ("out", &a.out, &b.out),
                ("dq", &a.dq, &b.dq),
                ("dk", &a.dk, &b.dk),
                ("dv", &a.dv, &b.dv),
                ("final state", &a.fin, &b.fin),
                ("d_initial", &a.d_init, &b.d_init),
            ] {
                assert!(
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{what} of {:?} differs from the chunk sums' ({:?}, normalize {normalize})",
                    cfg.schedule,
                    T::DTYPE
                );
            }
        }
    }
}

#[test]
fn bad_sequence_offsets_are_errors() {
    let device = Device::emulator();
    let q = vec![0.5f32; 2 * 2 * 8 * 4];
    let v = vec![0.5f32; 2 * 2 * 8 * 3];
    let mut out = vec![0f32; v.len()];
    let cfg = LinearAttentionConfig::causal();
    let mut call = |b: usize, offsets: &[usize]| {
        let (lq, lv) = (Layout::contiguous(&[b, 2, 8, 4]), Layout::contiguous(&[b, 2, 8, 3]));
        forward_packed(
            &device,
            &cfg,
            ForwardArgs { q: &tr(&q, &lq), k: &tr(&q, &lq), v: &tr(&v, &lv), out: &mut tm(&mut out, &lv) },
            offsets,
            None,
        )
        .map(|s| s.sequences())
    };
    for (b, offsets, what) in [
        (2, &[0, 4, 8][..], "B = 2"),
        (1, &[][..], "no offsets"),
        (1, &[0][..], "one offset"),
        (1, &[1, 8][..], "not from 0"),
        (1, &[0, 4, 7][..], "not to L"),
        (1, &[0, 5, 3, 8][..], "decreasing"),
        (1, &[0, 4, 9][..], "past L"),
    ] {
        expect_err(call(b, offsets), what, is_invalid_argument("seq_offsets"));
    }
    assert_eq!(call(1, &[0, 3, 3, 8]).expect("valid"), Some(3));
    // a state of [B, H, M, W] instead of [N, H, M, W] is a shape mismatch
    let (lq, lv) = (Layout::contiguous(&[1, 2, 8, 4]), Layout::contiguous(&[1, 2, 8, 3]));
    let s = vec![0f32; 2 * 4 * 4];
    let r = forward_packed(
        &device,
        &cfg,
        ForwardArgs { q: &tr(&q, &lq), k: &tr(&q, &lq), v: &tr(&v, &lv), out: &mut tm(&mut out, &lv) },
        &[0, 3, 8],
        Some(&TensorRef::contiguous(&s, &[1, 2, 4, 4]).expect("s")),
    );
    expect_err(r, "state shape", is_shape_mismatch("initial_state"));
}

/// `x` (contiguous `[B, H, L, f]`) copied into rows of `f + pad` elements (NaN in the padding),
/// and the strided view of it.
fn padded_rows<T: Element>(x: &[T], n: Shape, f: usize, pad: usize) -> (Vec<T>, Layout) {
    let w = f + pad;
    let mut out = vec![T::from_f64(f64::NAN); n.b * n.h * n.l * w];
    for (row, chunk) in x.chunks(f.max(1)).enumerate().take(n.b * n.h * n.l) {
        out[row * w..row * w + f].copy_from_slice(chunk);
    }
    let layout = Layout::strided(&[n.b, n.h, n.l, f], &[n.h * n.l * w, n.l * w, w, 1], 0).expect("padded view");
    (out, layout)
}

/// Forward + backward with q, k, v, dout and out read through row-padded views (`pad`
/// elements after every row), gradients contiguous.
fn run_padded<T: Element>(
    device: &Device,
    cfg: &LinearAttentionConfig,
    n: Shape,
    inputs: [&[T]; 4],
    pad: usize,
) -> Outputs {
    let [q, k, v, dout] = inputs;
    let (q, lq) = padded_rows(q, n, n.m, pad);
    let (k, _) = padded_rows(k, n, n.m, pad);
    let (v, lv) = padded_rows(v, n, n.d, pad);
    let (dout, _) = padded_rows(dout, n, n.d, pad);
    run_views(device, cfg, n, [&q, &k, &v, &dout], (&lq, &lv))
}

fn tile_loads_agree<T: Element>(device: &Device, rng: &mut StdRng, n: Shape, pad: usize) {
    for cfg in configs() {
        let lo = if cfg.normalize { 0.05 } else { -1.0 };
        let q = to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0));
        let k = to_t::<T>(&random_vec(rng, n.qk(), lo, 1.0));
        let v = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
        let dout = to_t::<T>(&random_vec(rng, n.vd(), -1.0, 1.0));
        let a = run(device, &cfg, n, &q, &k, &v, &dout);
        let b = run_padded(device, &cfg, n, [&q, &k, &v, &dout], pad);
        for (what, x, y) in [("out", &a.out, &b.out), ("dq", &a.dq, &b.dq), ("dk", &a.dk, &b.dk), ("dv", &a.dv, &b.dv)]
        {
            let same = x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{what} ({:?}, {n:?}, pad {pad}, {cfg:?}): 16-byte and element loads differ", T::DTYPE);
        }
    }
}

/// The tensor-core tiles are loaded as 16-byte runs of 8 elements where an operand's rows
/// allow it (stride-1 features, rows 16-byte aligned) and element by element elsewhere; both
/// produce the same floats, so results are bitwise equal. M = 16, D = 24 contiguous (every run
/// 16 bytes) against rows padded by 1 (no run 16 bytes); M = 12, D = 20 contiguous (no run)
/// against rows padded to 16 and 24 (16-byte runs and an 8-element tail per row).
#[test]
fn tensor_core_tiles_load_the_same_from_16_byte_runs_and_elements() {
    let mut rng = common::rng("tensor_core_tiles_load_the_same_from_16_byte_runs_and_elements");
    for device in common::backends() {
        for (m, d, pad) in [(16, 24, 1), (12, 20, 4)] {
            let n = Shape { b: 1, h: 2, l: 37, m, d };
            tile_loads_agree::<bf16>(&device, &mut rng, n, pad);
            tile_loads_agree::<f16>(&device, &mut rng, n, pad);
        }
    }
}

/// The largest chunk and a full feature tile on the tensor cores: every row of a 64-row chunk
/// and every quarter of a 32-feature tile enters the denominators a product computes itself
/// (the four threads of a row each sum 16 columns of P and 8 features), and the 64×64 P of
/// the intra-chunk product is used whole. L = 130: two full chunks and a partial one.
#[test]
fn tensor_cores_with_chunks_of_64_rows_and_32_features() {
    let mut rng = common::rng("tensor_cores_with_chunks_of_64_rows_and_32_features");
    let n = Shape { b: 1, h: 2, l: 130, m: 32, d: 8 };
    for device in common::backends() {
        for cfg in configs() {
            let cfg = LinearAttentionConfig { chunk: 64, ..cfg };
            parity::<f16>(&device, &mut rng, &cfg, n);
            parity::<bf16>(&device, &mut rng, &cfg, n);
        }
    }
}

/// The raw C ABI takes signed strides: FAVOR+ on tensor cores (f16, bf16) with x, phi, dphi
/// and dx stored back to front along L (`strides[2] < 0`, the data pointer at the last row)
/// gives, bitwise, the contiguous call's rows (RowMax: every row on its own), and writes
/// every row (a row offset below 0 is a valid offset, not a skipped row).
#[test]
fn favor_tensor_cores_take_negative_strides_through_the_c_abi() {
    let mut rng = common::rng("favor_tensor_cores_take_negative_strides_through_the_c_abi");
    let device = common::emulator();
    let proj = FavorProjection::orthogonal(&device, 24, 40, 5).expect("omega");
    reversed_rows_agree::<f16>(&device, &mut rng, &proj, mesa_kernels_sys::MESA_DTYPE_F16);
    reversed_rows_agree::<bf16>(&device, &mut rng, &proj, mesa_kernels_sys::MESA_DTYPE_BF16);
}

fn reversed_rows_agree<T: Element>(device: &Device, rng: &mut StdRng, proj: &FavorProjection, dtype: u32) {
    use mesa_kernels_sys as sys;
    let (h, l, d, m) = (2usize, 70usize, 40usize, 24usize);
    let x = to_t::<T>(&random_vec(rng, h * l * d, -1.5, 1.5));
    let g = to_t::<T>(&random_vec(rng, h * l * m, -1.0, 1.0));
    let map = FeatureMap::Favor { projection: proj, stabilizer: FavorStabilizer::RowMax };
    let (lx, lp) = (Layout::contiguous(&[1, h, l, d]), Layout::contiguous(&[1, h, l, m]));
    let (phi, dx, _, _) = favor_views(device, &map, &x, &g, (&lx, &lp));
    // the same tensors with their rows in reverse order in memory
    let reverse = |v: &[T], w: usize| -> Vec<T> { v.chunks(w).rev().flatten().copied().collect() };
    let (xr, gr) = (reverse(&x, d), reverse(&g, m));
    let nan = T::from_f64(f64::NAN);
    let (mut phir, mut dxr) = (vec![nan; h * l * m], vec![nan; h * l * d]);
    // (0, h, l) at the last row minus h·L rows minus l rows: the first row of the reversed buffer
    // is (0, H-1, L-1)
    let view = |base: *mut T, w: usize| sys::MesaLaTensor {
        data: base.wrapping_add((h * l - 1) * w).cast(),
        strides: [-((h * l * w) as i64), -((l * w) as i64), -(w as i64), 1],
    };
    let omega = proj.omega().to_vec();
    let fwd = sys::MesaFeatureArgs {
        map: sys::MESA_FEATURE_FAVOR as i32,
        stabilizer: sys::MESA_FAVOR_ROW_MAX as i32,
        dtype: dtype as i32,
        batch: 1,
        heads: h as i64,
        len: l as i64,
        in_dim: d as i64,
        out_dim: m as i64,
        x: view(xr.as_ptr().cast_mut(), d),
        phi: view(phir.as_mut_ptr(), m),
        omega: omega.as_ptr(),
        bound: 0.0,
        _pad: 0,
        _pad2: 0,
    };
    // SAFETY: every view addresses exactly the host vectors above (the emulator's device memory
    // is host memory); ω is [m, d] f32.
    assert_eq!(unsafe { sys::mesa_emu_feature_map_forward(&fwd, std::ptr::null_mut()) }, 0, "forward");
    let bwd = sys::MesaFeatureBackwardArgs {
        map: sys::MESA_FEATURE_FAVOR as i32,
        dtype: dtype as i32,
        batch: 1,
        heads: h as i64,
        len: l as i64,
        in_dim: d as i64,
        out_dim: m as i64,
        x: view(xr.as_ptr().cast_mut(), d),
        phi: view(phir.as_mut_ptr(), m),
        dphi: view(gr.as_ptr().cast_mut(), m),
        dx: view(dxr.as_mut_ptr(), d),
        omega: omega.as_ptr(),
    };
    // SAFETY: as above.
    assert_eq!(unsafe { sys::mesa_emu_feature_map_backward(&bwd, std::ptr::null_mut()) }, 0, "backward");
    let bits = |a: &[f64], b: &[T]| a.iter().zip(widen(b)).all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(bits(&phi, &reverse(&phir, m)), "phi ({:?}): reversed rows differ", T::DTYPE);
    assert!(bits(&dx, &reverse(&dxr, d)), "dx ({:?}): reversed rows differ", T::DTYPE);
}
