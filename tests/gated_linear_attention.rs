//! Parity of the gated linear-attention kernel (`mesa_kernels::gated_linear_attention`, issue 41)
//! with the f64 reference (`reference::gated_linear_attention`): forward, dq, dk, dv, da, the
//! final state and the initial state's gradient, on the emulator with its checks on (and a GPU
//! when one is present), for f32, f16 and bf16, per-step and per-head decay, grouped heads
//! (1, 4, multi-query), normalised or not, L = 1, odd L and chunk sizes, resets (a = −∞), long
//! strongly decaying sequences (L = 2000; L = 16K against a step recurrence), a non-finite input
//! kept out of the rows that do not see it, and a = 0 bit for bit the ungated kernel.
//!
//! Tolerances (derived, per element; u = 2⁻²⁴, u_T the storage type's unit roundoff):
//! * Inputs are exact in T (and the decay in f32); the reference reads the same values in f64,
//!   so all error is f32 arithmetic plus the final rounding to T.
//! * Every element is a sum of products of at most a dot over M, over D + 1 (v'·dv', and the
//!   dden dot), a chain through the state of at most L rows, a sum over ≤ C rows of a chunk, and
//!   ≤ L/C + 2 products of weights: with the classical bound n·u·Σ|terms|, the chain is
//!   `n = M + D + 2L + 2C + L/C + 24`, times `mag`, the same sum with every term replaced by its
//!   absolute value (the reference run on |q|, |k|, [|v| | 1], |S₀|, and for gradients the
//!   |dout|/|g|, |dden| terms) — computed in f64 below.
//! * A weight `exp(Λ_t − Λ_s)` comes from prefix sums of ≤ C values of its chunk, each off by
//!   ≤ C·u·Σ|a| of the prefix, and a prefix spans the weight's own steps plus ≤ C steps before
//!   them: the exponent is off by ≤ 2C·u·(|Σ_span a| + C·α) (α = max |a|), which is the weight's
//!   relative error. So the bound adds `2C·u·(span + C·α·mag)`, with `span` = Σ |Σ_span a|·|term|
//!   = −∂mag/∂λ for a → (1 + λ)a, a central difference of the reference in f64.
//! * da comes from `x_t = Σ_h q_t·dq_t − k_t·dk_t` (f32 values before rounding) summed from the
//!   end: its error is Σ_{t ≥ r} Σ_i (|q_ti|·err(dq_ti) + |k_ti|·err(dk_ti)) plus (M + G + 4)·u
//!   times those dots' magnitudes, the suffix sum's own roundings u·Σ_{t ≥ r} |partial sum_t|
//!   (the reference's |da_t|; per-head decay: the terms' magnitudes), and `⟨dS, S_final⟩`'s
//!   (M·W + 4)·u·Σ|dS||S| + Σ|dS|·err(S); per-head decay sums those over B and L, plus
//!   B·L·u·Σ|da|.
//! * f16 and bf16 run every chunk product on tensor cores (kernels/linear_attention.cu, the
//!   decayed `la_product_kernel` instances; docs/linear_attention.md): as bf16 split pairs,
//!   `hi·hi + hi·lo + lo·hi`. A 16-bit input is exact in hi (+ lo), an f32 value (the weighted
//!   scores `W ∘ P`, the state, the weighted rows of the state update) within 2⁻¹⁸ of itself,
//!   so a term of a product is off by ≤ 3·2⁻¹⁸ of its magnitude and a term that passes two
//!   products (`P` then `P V'`; the state's update then `Q S`) by ≤ 6·2⁻¹⁸; the backward reads the
//!   forward's denominators (and, through `⟨dS, S_final⟩`, its final state), which carry those
//!   errors. The tensor cores' f32 sums may truncate rather than round, so their chain is
//!   counted twice: 16-bit bounds add `(n·u + 6·2⁻¹⁸)·mag` (as tests/linear_attention.rs).
//! * L = 16K: the O(L²) reference would need L² weights; `steps` is the step-by-step f64
//!   recurrence instead (S_t, and in reverse the state's gradient R_t; da_t = e^{a_t}⟨R_t, S_{t−1}⟩),
//!   checked against the quadratic reference first.
//! * 16-bit inputs: the backward reads `out` rounded to T (dden is off by u_T relatively):
//!   `4·u_T·mag`; outputs round to T: `u_T·|ref|` (plus half the subnormal spacing).
mod common;

use half::{bf16, f16};
use mesa_kernels::gated_linear_attention::{
    backward, forward, forward_packed, forward_with, BackwardArgs, Decay, ForwardArgs, ForwardOptions, GatedConfig,
    GatedGrads, MemoryMode, Schedule, MAX_CHUNK,
};
use mesa_kernels::linear_attention as la;
use mesa_kernels::reference::gated_linear_attention as rg;
use mesa_kernels::{DType, Device, Element, Error, RawDeviceSlice, TensorMut, TensorRef};
use rand::rngs::StdRng;
use rand::RngExt;

const U: f64 = 1.0 / (1u64 << 24) as f64;

#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    h: usize,
    hkv: usize,
    l: usize,
    m: usize,
    d: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum DecayMode {
    PerStep,
    PerHead,
}

#[derive(Clone, Debug)]
struct Case {
    s: Shape,
    chunk: usize,
    normalize: bool,
    mode: DecayMode,
    /// max |a| of the finite log-decays
    alpha: f64,
    /// min |a| of the finite log-decays (a uniform in −alpha..−alpha_min)
    alpha_min: f64,
    initial: bool,
    d_final: bool,
    /// rows (b, kv head, t) set to −∞ (per step), or every KV head with a −∞ rate (per head)
    resets: Vec<(usize, usize, usize)>,
}

/// The problem in f64 (values exact in T and, for the decay, f32).
struct Problem {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    a: Vec<f32>,
    s0: Option<Vec<f32>>,
    dout: Vec<f64>,
    dsf: Option<Vec<f32>>,
}

fn width(c: &Case) -> usize {
    c.s.d + usize::from(c.normalize)
}

fn make<T: Element>(c: &Case, rng: &mut StdRng) -> Problem {
    let s = c.s;
    let round = |x: f64| T::from_f64(x).to_f64();
    let mut vals = |n: usize, pos: bool| -> Vec<f64> {
        (0..n)
            .map(|_| {
                let x: f64 = rng.random_range(-1.0..1.0);
                round(if pos { x.abs() + 0.1 } else { x })
            })
            .collect()
    };
    let q = vals(s.b * s.h * s.l * s.m, c.normalize);
    let k = vals(s.b * s.hkv * s.l * s.m, c.normalize);
    let v = vals(s.b * s.hkv * s.l * s.d, false);
    let dout = vals(s.b * s.h * s.l * s.d, false);
    let w = width(c);
    let ns = s.b * s.hkv * s.m * w;
    let s0 = c.initial.then(|| (0..ns).map(|_| rng.random_range(0.1f32..1.0)).collect());
    let dsf = c.d_final.then(|| (0..ns).map(|_| rng.random_range(-1.0f32..1.0)).collect());
    let na = match c.mode {
        DecayMode::PerStep => s.b * s.hkv * s.l,
        DecayMode::PerHead => s.hkv,
    };
    let mut a: Vec<f32> =
        (0..na).map(|_| if c.alpha > 0.0 { -(rng.random_range(c.alpha_min..c.alpha) as f32) } else { 0.0 }).collect();
    for &(b, kh, t) in &c.resets {
        match c.mode {
            DecayMode::PerStep => a[(b * s.hkv + kh) * s.l + t] = f32::NEG_INFINITY,
            DecayMode::PerHead => a[kh] = f32::NEG_INFINITY,
        }
    }
    Problem { q, k, v, a, s0, dout, dsf }
}

fn dims(s: Shape) -> rg::GatedDims {
    rg::GatedDims { batch: s.b, heads: s.h, kv_heads: s.hkv, len: s.l, feat: s.m, dim: s.d }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// Reference results: (out, final, dq, dk, dv, da, d_initial).
struct Ref {
    out: Vec<f64>,
    fin: Vec<f64>,
    g: rg::GatedGrads,
}

fn reference(c: &Case, p: &Problem) -> Ref {
    let a = widen(&p.a);
    let s0 = p.s0.as_deref().map(widen);
    let gated = rg::Gated {
        q: &p.q,
        k: &p.k,
        v: &p.v,
        decay: match c.mode {
            DecayMode::PerStep => rg::Decay::PerStep(&a),
            DecayMode::PerHead => rg::Decay::PerHead(&a),
        },
        dims: dims(c.s),
        normalize: c.normalize.then_some(1e-6),
        initial: s0.as_deref(),
    };
    let dsf = p.dsf.as_deref().map(widen);
    let (f, g) = fwd_bwd(&gated, &p.dout, dsf.as_deref());
    Ref { out: f.out, fin: f.final_state, g }
}

/// Longest L for the O(L²) reference (its weights are L² f64); longer: the step recurrence.
const QUADRATIC_MAX_L: usize = 4096;

fn fwd(g: &rg::Gated<'_>) -> rg::GatedOutput {
    if g.dims.len <= QUADRATIC_MAX_L {
        rg::forward(g).expect("reference forward")
    } else {
        steps(g, None, None).0
    }
}

fn fwd_bwd(g: &rg::Gated<'_>, dout: &[f64], d_final: Option<&[f64]>) -> (rg::GatedOutput, rg::GatedGrads) {
    if g.dims.len <= QUADRATIC_MAX_L {
        let f = rg::forward(g).expect("reference forward");
        (f, rg::backward(g, dout, d_final).expect("reference backward"))
    } else {
        steps(g, Some(dout), d_final)
    }
}

/// The f64 recurrence step by step, O(L·M·W) per head: forward `S_t = e^{a_t} S_{t−1} + k_t v'_tᵀ`,
/// `o'_t = q_tᵀ S_t`, and (with `dout`) `dq_t = S_t dv'_t`; then in reverse the gradient of the
/// state, `R_t = e^{a_{t+1}} R_{t+1} + Σ_h q_t dv'_tᵀ` (`R_{L−1}` adds `d_final`), `dk_t = R_t v'_t`,
/// `dv_t = (R_tᵀ k_t)[..D]`, `da_t = e^{a_t} ⟨R_t, S_{t−1}⟩` (0 at a reset), `d_initial = e^{a_0} R_0`.
/// Shares no code with the quadratic reference or the kernel (whose da is a suffix sum).
fn steps(g: &rg::Gated<'_>, dout: Option<&[f64]>, d_final: Option<&[f64]>) -> (rg::GatedOutput, rg::GatedGrads) {
    let n = g.dims;
    let (l, m, d) = (n.len, n.feat, n.dim);
    let wd = d + usize::from(g.normalize.is_some());
    let grp = n.heads / n.kv_heads;
    let mut out = vec![0.0; n.batch * n.heads * l * d];
    let mut den = vec![1.0; n.batch * n.heads * l];
    let mut fin = vec![0.0; n.batch * n.kv_heads * m * wd];
    let (mut dq, mut dk, mut dv) = (vec![0.0; g.q.len()], vec![0.0; g.k.len()], vec![0.0; g.v.len()]);
    let mut da = vec![0.0; n.batch * n.kv_heads * l];
    let mut ds0 = vec![0.0; n.batch * n.kv_heads * m * wd];
    let mw = m * wd;
    for b in 0..n.batch {
        for kh in 0..n.kv_heads {
            let kv = b * n.kv_heads + kh;
            let a = |t: usize| match g.decay {
                rg::Decay::PerStep(a) => a[kv * l + t],
                rg::Decay::PerHead(a) => a[kh],
            };
            let vp = |t: usize, j: usize| if j < d { g.v[(kv * l + t) * d + j] } else { 1.0 };
            let kk = |t: usize, i: usize| g.k[(kv * l + t) * m + i];
            let mut s: Vec<f64> = g.initial.map_or(vec![0.0; mw], |s0| s0[kv * mw..][..mw].to_vec());
            // S_{t−1} for every t (da), and dv'_t per query head
            let mut prev = vec![0.0; l * mw];
            let mut dvp = vec![0.0; grp * l * wd];
            for t in 0..l {
                prev[t * mw..][..mw].copy_from_slice(&s);
                let e = a(t).exp();
                for i in 0..m {
                    for j in 0..wd {
                        s[i * wd + j] = e * s[i * wd + j] + kk(t, i) * vp(t, j);
                    }
                }
                for (gi, hq) in (kh * grp..(kh + 1) * grp).enumerate() {
                    let row = (b * n.heads + hq) * l + t;
                    let q = &g.q[row * m..][..m];
                    let o: Vec<f64> = (0..wd).map(|j| (0..m).map(|i| q[i] * s[i * wd + j]).sum()).collect();
                    let gd = g.normalize.map_or(1.0, |eps| if o[d] >= 0.0 { o[d] + eps } else { o[d] - eps });
                    den[row] = gd;
                    for j in 0..d {
                        out[row * d + j] = o[j] / gd;
                    }
                    if let Some(dout) = dout {
                        let dvt = &mut dvp[(gi * l + t) * wd..][..wd];
                        for j in 0..d {
                            dvt[j] = dout[row * d + j] / gd;
                        }
                        if wd > d {
                            dvt[d] = -(0..d).map(|j| dout[row * d + j] * out[row * d + j]).sum::<f64>() / gd;
                        }
                        for i in 0..m {
                            dq[row * m + i] = (0..wd).map(|j| s[i * wd + j] * dvt[j]).sum();
                        }
                    }
                }
            }
            fin[kv * mw..][..mw].copy_from_slice(&s);
            if l == 0 {
                if let Some(s0) = g.initial {
                    fin[kv * mw..][..mw].copy_from_slice(&s0[kv * mw..][..mw]);
                }
            }
            if dout.is_none() {
                continue;
            }
            let mut r: Vec<f64> = d_final.map_or(vec![0.0; mw], |x| x[kv * mw..][..mw].to_vec());
            for t in (0..l).rev() {
                if t + 1 < l {
                    let e = a(t + 1).exp();
                    r.iter_mut().for_each(|x| *x *= e);
                }
                for (gi, hq) in (kh * grp..(kh + 1) * grp).enumerate() {
                    let q = &g.q[((b * n.heads + hq) * l + t) * m..][..m];
                    let dvt = &dvp[(gi * l + t) * wd..][..wd];
                    for i in 0..m {
                        for j in 0..wd {
                            r[i * wd + j] += q[i] * dvt[j];
                        }
                    }
                }
                let row = kv * l + t;
                for i in 0..m {
                    dk[row * m + i] = (0..wd).map(|j| r[i * wd + j] * vp(t, j)).sum();
                }
                for j in 0..d {
                    dv[row * d + j] = (0..m).map(|i| r[i * wd + j] * kk(t, i)).sum();
                }
                let e = a(t).exp();
                da[row] = if e == 0.0 { 0.0 } else { e * (0..mw).map(|x| r[x] * prev[t * mw + x]).sum::<f64>() };
            }
            let e = if l > 0 { a(0).exp() } else { 1.0 };
            for x in 0..mw {
                ds0[kv * mw + x] = e * r[x];
            }
        }
    }
    let da = match g.decay {
        rg::Decay::PerStep(_) => da,
        rg::Decay::PerHead(_) => (0..n.kv_heads)
            .map(|kh| (0..n.batch).map(|b| da[(b * n.kv_heads + kh) * l..][..l].iter().sum::<f64>()).sum())
            .collect(),
    };
    (rg::GatedOutput { out, den, final_state: fin }, rg::GatedGrads { dq, dk, dv, da, d_initial: ds0 })
}

/// Magnitudes: the reference on absolute values, not normalised, with v' = [|v| | 1] and
/// dout' = [|dout|/|g| | |dden|], the decay scaled by (1 + lam).
struct Mag {
    out: Vec<f64>,
    fin: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    ds0: Vec<f64>,
}

fn magnitudes(c: &Case, p: &Problem, r: &Ref, lam: f64) -> Mag {
    let s = c.s;
    let (w, d) = (width(c), s.d);
    let abs = |x: &[f64]| x.iter().map(|v| v.abs()).collect::<Vec<_>>();
    let mut vp = vec![0.0; s.b * s.hkv * s.l * w];
    for (row, chunk) in vp.chunks_mut(w).enumerate() {
        for (j, x) in chunk[..d].iter_mut().enumerate() {
            *x = p.v[row * d + j].abs();
        }
        if c.normalize {
            chunk[d] = 1.0;
        }
    }
    let den = fwd(&rg::Gated {
        q: &p.q,
        k: &p.k,
        v: &p.v,
        decay: decay_of(c, &widen(&p.a)),
        dims: dims(s),
        normalize: c.normalize.then_some(1e-6),
        initial: p.s0.as_deref().map(widen).as_deref(),
    })
    .den;
    let mut dp = vec![0.0; s.b * s.h * s.l * w];
    for (row, chunk) in dp.chunks_mut(w).enumerate() {
        let g = den[row].abs();
        let mut dd = 0.0;
        for (j, x) in chunk[..d].iter_mut().enumerate() {
            *x = p.dout[row * d + j].abs() / g;
            dd += (p.dout[row * d + j] * r.out[row * d + j]).abs();
        }
        if c.normalize {
            chunk[d] = dd / g;
        }
    }
    let a: Vec<f64> = p.a.iter().map(|&x| f64::from(x) * (1.0 + lam)).collect();
    let s0 = p.s0.as_deref().map(|x| abs(&widen(x)));
    let dsf = p.dsf.as_deref().map(|x| abs(&widen(x)));
    let gated = rg::Gated {
        q: &abs(&p.q),
        k: &abs(&p.k),
        v: &vp,
        decay: decay_of(c, &a),
        dims: rg::GatedDims { dim: w, ..dims(s) },
        normalize: None,
        initial: s0.as_deref(),
    };
    let (f, g) = fwd_bwd(&gated, &dp, dsf.as_deref());
    // out: the numerator's and the denominator's errors, over |g|
    let mut out = vec![0.0; s.b * s.h * s.l * d];
    for row in 0..s.b * s.h * s.l {
        let gd = den[row].abs();
        for j in 0..d {
            let num = f.out[row * w + j];
            out[row * d + j] =
                if c.normalize { (num + r.out[row * d + j].abs() * f.out[row * w + d]) / gd } else { num };
        }
    }
    let mut dv = vec![0.0; s.b * s.hkv * s.l * d];
    for row in 0..s.b * s.hkv * s.l {
        dv[row * d..][..d].copy_from_slice(&g.dv[row * w..][..d]);
    }
    Mag { out, fin: f.final_state, dq: g.dq, dk: g.dk, dv, ds0: g.d_initial }
}

fn decay_of<'a>(c: &Case, a: &'a [f64]) -> rg::Decay<'a> {
    match c.mode {
        DecayMode::PerStep => rg::Decay::PerStep(a),
        DecayMode::PerHead => rg::Decay::PerHead(a),
    }
}

/// The f32 part of the bound of every output (module docs): `tolg = u·(n·mag + 2C·(span + C·α·mag))`,
/// plus `(n·u + 6·2⁻¹⁸)·mag` for the tensor cores' split pairs (`tensor_cores`: f16, bf16).
fn bound32(c: &Case, mag: &[f64], lo: &[f64], hi: &[f64], ut: f64, tensor_cores: bool) -> Vec<f64> {
    let s = c.s;
    let n = (s.m + s.d + 2 * s.l + 2 * c.chunk + s.l / c.chunk + 24) as f64;
    let cc = c.chunk as f64;
    let tc = if tensor_cores { n * U + 6.0 * 2f64.powi(-18) } else { 0.0 };
    mag.iter()
        .zip(lo.iter().zip(hi))
        .map(|(&m, (&l, &h))| {
            // −∂mag/∂λ by a central difference (λ = ±1e-3)
            let span = ((l - h) / 2e-3).max(0.0);
            U * (n * m + 2.0 * cc * (span + cc * c.alpha * m)) + 4.0 * ut * m + tc * m
        })
        .collect()
}

/// Checks every element; returns the largest |got − want| / tol.
fn check(what: &str, c: &Case, got: &[f64], want: &[f64], tolg: &[f64], ut: f64, sub: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f64;
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tolg).enumerate() {
        let tol = t + ut * w.abs() + sub;
        assert!(g.is_finite() && (g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}, tol {tol:e}: {c:?}");
        if tol > 0.0 {
            worst = worst.max((g - w).abs() / tol);
        }
    }
    worst
}

fn tr<'a, T>(x: &'a [T], shape: &[usize]) -> TensorRef<'a, T> {
    TensorRef::contiguous(x, shape).expect("input view")
}

fn to_t<T: Element>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}

fn to_f64<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|&v| v.to_f64()).collect()
}

/// The kernel's results: (out, final, dq, dk, dv, da, d_initial).
struct Got {
    out: Vec<f64>,
    fin: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    da: Vec<f64>,
    ds0: Vec<f64>,
}

/// How the kernel's `[B, H, L, F]` views are stored: contiguous, or as views of `[B, L, H, F]`
/// buffers (q, k, v of one packed projection: every stride differs from the contiguous one).
#[derive(Clone, Copy, PartialEq)]
enum Storage {
    Contiguous,
    SeqMajor,
}

/// The view of a logical `[B, H, L, F]` tensor in `st`, and the buffer holding `x` that way.
fn stored<T: Copy>(x: &[T], shape: [usize; 4], st: Storage) -> (Vec<T>, mesa_kernels::Layout) {
    let [b, h, l, f] = shape;
    match st {
        Storage::Contiguous => (x.to_vec(), mesa_kernels::Layout::contiguous(&shape)),
        Storage::SeqMajor => {
            let mut buf = Vec::with_capacity(x.len());
            for bi in 0..b {
                for li in 0..l {
                    for hi in 0..h {
                        buf.extend_from_slice(&x[((bi * h + hi) * l + li) * f..][..f]);
                    }
                }
            }
            let layout = mesa_kernels::Layout::contiguous(&[b, l, h, f]).transpose(1, 2).expect("transpose");
            (buf, layout)
        }
    }
}

/// The logical `[B, H, L, F]` order of a buffer written through `stored`'s view.
fn logical<T: Copy>(buf: &[T], shape: [usize; 4], st: Storage) -> Vec<T> {
    let [b, h, l, f] = shape;
    match st {
        Storage::Contiguous => buf.to_vec(),
        Storage::SeqMajor => {
            let mut x = Vec::with_capacity(buf.len());
            for bi in 0..b {
                for hi in 0..h {
                    for li in 0..l {
                        x.extend_from_slice(&buf[((bi * l + li) * h + hi) * f..][..f]);
                    }
                }
            }
            x
        }
    }
}

fn view<'a, T>(x: &'a [T], l: &mesa_kernels::Layout) -> TensorRef<'a, T> {
    TensorRef::new(x, l).expect("input view")
}

fn run<T: Element>(device: &Device, c: &Case, p: &Problem) -> mesa_kernels::Result<Got> {
    run_stored::<T>(device, c, p, Storage::Contiguous)
}

fn run_stored<T: Element>(device: &Device, c: &Case, p: &Problem, st: Storage) -> mesa_kernels::Result<Got> {
    run_with::<T>(device, c, p, st, None)
}

/// One forward and backward; `offsets`: packed sequences (`forward_packed`; the states
/// `p.s0`, `p.dsf` then `[N, H_kv, M, W]`).
fn run_with<T: Element>(
    device: &Device,
    c: &Case,
    p: &Problem,
    st: Storage,
    offsets: Option<&[usize]>,
) -> mesa_kernels::Result<Got> {
    run_opts::<T>(device, c, p, st, &ForwardOptions { seq_offsets: offsets, ..ForwardOptions::default() })
}

/// One forward (`forward_with` these options) and backward.
fn run_opts<T: Element>(
    device: &Device,
    c: &Case,
    p: &Problem,
    st: Storage,
    opts: &ForwardOptions<'_>,
) -> mesa_kernels::Result<Got> {
    let offsets = opts.seq_offsets;
    let s = c.s;
    let w = width(c);
    let units = offsets.map_or(s.b, |o| o.len() - 1);
    let qs = [s.b, s.h, s.l, s.m];
    let ks = [s.b, s.hkv, s.l, s.m];
    let vs = [s.b, s.hkv, s.l, s.d];
    let os = [s.b, s.h, s.l, s.d];
    let ss = [units, s.hkv, s.m, w];
    let ((q, lq), (k, lk)) = (stored(&to_t::<T>(&p.q), qs, st), stored(&to_t::<T>(&p.k), ks, st));
    let ((v, lv), (dout, lo)) = (stored(&to_t::<T>(&p.v), vs, st), stored(&to_t::<T>(&p.dout), os, st));
    let ashape: Vec<usize> = match c.mode {
        DecayMode::PerStep => vec![s.b, s.hkv, s.l],
        DecayMode::PerHead => vec![s.hkv],
    };
    let (qt, kt, vt) = (view(&q, &lq), view(&k, &lk), view(&v, &lv));
    let at = tr(&p.a, &ashape);
    let decay = match c.mode {
        DecayMode::PerStep => Decay::PerStep(&at),
        DecayMode::PerHead => Decay::PerHead(&at),
    };
    let s0t = p.s0.as_ref().map(|x| tr(x, &ss));
    let config = GatedConfig { normalize: c.normalize, eps: 1e-6, chunk: c.chunk };
    // outputs poisoned: every element must be written
    let nan = T::from_f64(f64::NAN);
    let (mut out, _) = stored(&vec![nan; os.iter().product()], os, st);
    let saved = {
        let mut ot = TensorMut::new(&mut out, &lo)?;
        let args = ForwardArgs { q: &qt, k: &kt, v: &vt, decay, initial: s0t.as_ref(), out: &mut ot };
        let saved = match (offsets, opts.memory) {
            (Some(o), MemoryMode::Slim) => forward_packed(device, &config, o, args)?,
            (None, MemoryMode::Slim) => forward(device, &config, args)?,
            _ => forward_with(device, &config, opts, args)?,
        };
        assert_eq!(saved.memory(), opts.memory);
        saved
    };
    let fin = widen(&saved.final_state()?);
    let (mut dq, mut dk, mut dv) = (vec![nan; q.len()], vec![nan; k.len()], vec![nan; v.len()]);
    let mut da = vec![f32::NAN; p.a.len()];
    let mut ds0 = vec![f32::NAN; ss.iter().product()];
    {
        let outt = TensorRef::new(&out, &lo)?;
        let doutt = view(&dout, &lo);
        let dsft = p.dsf.as_ref().map(|x| tr(x, &ss));
        let mut dqt = TensorMut::new(&mut dq, &lq)?;
        let mut dkt = TensorMut::new(&mut dk, &lk)?;
        let mut dvt = TensorMut::new(&mut dv, &lv)?;
        let mut dat = TensorMut::contiguous(&mut da, &ashape)?;
        let mut ds0t = TensorMut::contiguous(&mut ds0, &ss)?;
        backward(
            device,
            &saved,
            BackwardArgs {
                q: &qt,
                k: &kt,
                v: &vt,
                decay,
                initial: s0t.as_ref(),
                out: Some(&outt),
                dout: &doutt,
                d_final: dsft.as_ref(),
                grads: GatedGrads {
                    dq: &mut dqt,
                    dk: &mut dkt,
                    dv: &mut dvt,
                    d_decay: &mut dat,
                    d_initial: Some(&mut ds0t),
                },
            },
        )?;
    }
    Ok(Got {
        out: to_f64(&logical(&out, os, st)),
        fin,
        dq: to_f64(&logical(&dq, qs, st)),
        dk: to_f64(&logical(&dk, ks, st)),
        dv: to_f64(&logical(&dv, vs, st)),
        da: widen(&da),
        ds0: widen(&ds0),
    })
}

/// The da bound (module docs), from the dq and dk bounds and magnitudes.
#[allow(clippy::too_many_arguments)]
fn da_bound(c: &Case, p: &Problem, r: &Ref, m0: &Mag, tdq: &[f64], tdk: &[f64], tfin: &[f64]) -> Vec<f64> {
    let s = c.s;
    let (l, mm, w) = (s.l, s.m, width(c));
    let g = s.h / s.hkv;
    // each row's x_t = Σ_h q_t·dq_t − k_t·dk_t: a dot over M, the group's sum, a subtraction
    let dot = (mm + g + 4) as f64 * U;
    let mut per_step = vec![0.0; s.b * s.hkv * l];
    for b in 0..s.b {
        for kh in 0..s.hkv {
            let kv = b * s.hkv + kh;
            // ⟨dS, S_final⟩
            let mut acc = 0.0;
            if let Some(dsf) = &p.dsf {
                for e in 0..mm * w {
                    let (x, sf) = (f64::from(dsf[kv * mm * w + e]).abs(), m0.fin[kv * mm * w + e]);
                    acc += x * (tfin[kv * mm * w + e] + (mm * w + 4) as f64 * U * sf);
                }
            }
            // the suffix sum's own roundings: u·|partial sum| per step — the reference's |da|
            // per step, or (per-head decay, whose per-step da the reference does not give) the
            // terms' magnitudes — plus those of its runs (gla_da_scan_kernel: each of 256
            // threads first sums its run of ⌈L/256⌉ rows alone, whose partial sums are at most
            // the run's Σ|x_t|; a row is in at most ⌈L/256⌉ of them)
            let run = l.div_ceil(256) as f64;
            let (mut partials, mut terms) = (0.0, 0.0);
            for t in (0..l).rev() {
                let (mut x, mut xm) = (0.0, 0.0);
                for hq in kh * g..(kh + 1) * g {
                    let row = (b * s.h + hq) * l + t;
                    for i in 0..mm {
                        x += p.q[row * mm + i].abs() * (tdq[row * mm + i] + dot * m0.dq[row * mm + i]);
                        xm += p.q[row * mm + i].abs() * m0.dq[row * mm + i];
                    }
                }
                let row = kv * l + t;
                for i in 0..mm {
                    x += p.k[row * mm + i].abs() * (tdk[row * mm + i] + dot * m0.dk[row * mm + i]);
                    xm += p.k[row * mm + i].abs() * m0.dk[row * mm + i];
                }
                acc += x;
                terms += xm;
                partials += match c.mode {
                    DecayMode::PerStep => r.g.da[row].abs(),
                    DecayMode::PerHead => terms,
                };
                per_step[row] = acc + U * (partials + run * terms);
            }
        }
    }
    match c.mode {
        DecayMode::PerStep => per_step,
        DecayMode::PerHead => (0..s.hkv)
            .map(|kh| {
                let rows = (0..s.b).flat_map(|b| (0..l).map(move |t| (b * s.hkv + kh) * l + t));
                let (t, a): (f64, f64) = rows.fold((0.0, 0.0), |(t, a), row| (t + per_step[row], a + per_step[row]));
                t + (s.b * l) as f64 * U * a
            })
            .collect(),
    }
}

fn parity<T: Element>(device: &Device, c: &Case, rng: &mut StdRng) {
    let p = make::<T>(c, rng);
    let r = reference(c, &p);
    let got = run::<T>(device, c, &p).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let ut = common::unit_roundoff(T::DTYPE);
    let sub = common::subnormal_spacing(T::DTYPE);
    let (m0, lo, hi) = (magnitudes(c, &p, &r, 0.0), magnitudes(c, &p, &r, -1e-3), magnitudes(c, &p, &r, 1e-3));
    // the backward reads `out` rounded to T only when normalised (dden)
    let ut16 = if T::DTYPE == DType::F32 || !c.normalize { 0.0 } else { ut };
    let tc = T::DTYPE != DType::F32;
    let tout = bound32(c, &m0.out, &lo.out, &hi.out, 0.0, tc);
    let tfin = bound32(c, &m0.fin, &lo.fin, &hi.fin, 0.0, tc);
    let tdq = bound32(c, &m0.dq, &lo.dq, &hi.dq, ut16, tc);
    let tdk = bound32(c, &m0.dk, &lo.dk, &hi.dk, ut16, tc);
    let tdv = bound32(c, &m0.dv, &lo.dv, &hi.dv, ut16, tc);
    let tda = da_bound(c, &p, &r, &m0, &tdq, &tdk, &tfin);
    // d_initial: the reverse chain of dS, bounded as the other outputs
    let tds0 = bound32(c, &m0.ds0, &lo.ds0, &hi.ds0, ut16, tc);
    let worst = [
        check("out", c, &got.out, &r.out, &tout, ut, sub),
        check("final state", c, &got.fin, &r.fin, &tfin, 0.0, 0.0),
        check("dq", c, &got.dq, &r.g.dq, &tdq, ut, sub),
        check("dk", c, &got.dk, &r.g.dk, &tdk, ut, sub),
        check("dv", c, &got.dv, &r.g.dv, &tdv, ut, sub),
        check("da", c, &got.da, &r.g.da, &tda, 0.0, 0.0),
        check("d_initial", c, &got.ds0, &r.g.d_initial, &tds0, 0.0, 0.0),
    ];
    let ratios: Vec<String> = worst.iter().map(|x| format!("{x:.1e}")).collect();
    eprintln!(
        "{} {:?} C={} normalize={} {:?}: error / bound (out, final, dq, dk, dv, da, d_initial) = {}",
        T::DTYPE.name(),
        c.s,
        c.chunk,
        c.normalize,
        c.mode,
        ratios.join(" ")
    );
}

fn base(s: Shape, chunk: usize) -> Case {
    Case {
        s,
        chunk,
        normalize: false,
        mode: DecayMode::PerStep,
        alpha: 1.0,
        alpha_min: 0.0,
        initial: true,
        d_final: true,
        resets: Vec::new(),
    }
}

fn sh(b: usize, h: usize, hkv: usize, l: usize, m: usize, d: usize) -> Shape {
    Shape { b, h, hkv, l, m, d }
}

#[test]
fn matches_the_reference_f32() {
    let mut rng = common::rng("gated matches_the_reference_f32");
    let cases = vec![
        base(sh(1, 1, 1, 1, 3, 2), 1),   // L = 1
        base(sh(2, 4, 4, 37, 5, 3), 7),  // odd L and chunk, GQA ratio 1
        base(sh(1, 8, 2, 45, 4, 5), 16), // GQA ratio 4
        base(sh(2, 3, 1, 21, 6, 4), 5),  // multi-query
        base(sh(1, 2, 1, 70, 3, 3), 64), // a full chunk and a tail
        Case { normalize: true, ..base(sh(2, 4, 2, 29, 4, 3), 9) },
        Case { mode: DecayMode::PerHead, ..base(sh(2, 4, 2, 33, 4, 3), 8) },
        Case { mode: DecayMode::PerHead, normalize: true, ..base(sh(1, 3, 3, 19, 3, 2), 4) },
        Case { initial: false, d_final: false, ..base(sh(1, 2, 2, 26, 4, 4), 13) },
        Case { initial: false, d_final: true, normalize: true, ..base(sh(1, 4, 1, 17, 3, 3), 3) },
    ];
    for device in common::backends() {
        for c in &cases {
            parity::<f32>(&device, c, &mut rng);
        }
    }
}

#[test]
fn matches_the_reference_f16_bf16() {
    let mut rng = common::rng("gated matches_the_reference_f16_bf16");
    // the tensor-core forward's tiles: 16-row blocks of a chunk padded to 64 rows, 32 features
    // and 32 value columns per tile (more than one of each below, and partial ones)
    let resets = vec![(0, 0, 3), (0, 1, 16), (1, 0, 17), (1, 1, 29)];
    let cases = vec![
        base(sh(1, 1, 1, 1, 3, 2), 1), // L = 1
        base(sh(1, 4, 1, 23, 4, 3), 6),
        Case { normalize: true, ..base(sh(2, 2, 2, 19, 3, 4), 5) },
        Case { mode: DecayMode::PerHead, ..base(sh(1, 4, 2, 17, 4, 2), 8) },
        base(sh(1, 2, 1, 50, 40, 35), 17), // two feature and value tiles, odd L and chunk
        // W = D + 1 = 33: z in the second value tile; a full chunk of 64 and a tail
        Case { normalize: true, ..base(sh(1, 2, 2, 70, 33, 32), 64) },
        Case { mode: DecayMode::PerHead, normalize: true, ..base(sh(1, 2, 1, 40, 20, 18), 33) },
        Case { resets, normalize: true, ..base(sh(2, 4, 2, 30, 4, 3), 16) },
    ];
    for device in common::backends() {
        for c in &cases {
            parity::<f16>(&device, c, &mut rng);
            parity::<bf16>(&device, c, &mut rng);
        }
    }
}

/// a = −∞ resets the state: at row 0, inside a chunk, on a chunk boundary, twice in a row, at
/// the last row, and a per-head rate of −∞ (every step a reset). No NaN, reference parity
/// (whose weights across a reset are exactly 0). f32 on CUDA cores, bf16 on tensor cores.
#[test]
fn resets_without_nan() {
    let mut rng = common::rng("gated resets_without_nan");
    let s = sh(2, 4, 2, 30, 4, 3);
    let resets = vec![(0, 0, 0), (0, 0, 5), (0, 1, 8), (0, 1, 9), (1, 0, 16), (1, 1, 29), (1, 0, 23)];
    let cases = vec![
        Case { resets: resets.clone(), ..base(s, 8) },
        Case { resets: resets.clone(), normalize: true, ..base(s, 7) },
        Case { mode: DecayMode::PerHead, resets: vec![(0, 1, 0)], ..base(s, 8) },
    ];
    for device in common::backends() {
        for c in &cases {
            parity::<f32>(&device, c, &mut rng);
            parity::<bf16>(&device, c, &mut rng); // tensor cores
        }
    }
}

/// A long sequence of strongly decaying steps (|a| up to 4: the state forgets in a few steps),
/// L in the thousands, full chunks of 64: the log-space differences' error stays within the
/// header's bound.
#[test]
fn long_sequence_strong_decay() {
    let mut rng = common::rng("gated long_sequence_strong_decay");
    let c = Case { alpha: 4.0, ..base(sh(1, 2, 1, 2000, 4, 4), 64) };
    let device = common::emulator();
    parity::<f32>(&device, &c, &mut rng);
}

/// L = 16K (plus a tail) of strongly decaying steps (a in −8..−4: the state forgets within a few
/// steps), full chunks of 64, bf16 on tensor cores, against the step recurrence in f64. One head
/// (M = D = 16): about 7 s of the emulator on this machine (two heads took 14 s).
#[test]
fn sixteen_k_steps_strong_decay() {
    let mut rng = common::rng("gated sixteen_k_steps_strong_decay");
    let c = Case { alpha: 8.0, alpha_min: 4.0, ..base(sh(1, 1, 1, 16 * 1024 + 7, 16, 16), 64) };
    let device = common::emulator();
    parity::<bf16>(&device, &c, &mut rng);
}

/// The step recurrence (`steps`, the reference at L = 16K) against the quadratic reference, in
/// f64: resets, per-step and per-head decay, groups, normalised or not, with and without the
/// states. Both sum the same terms in different orders and form the weights differently (the
/// exp of a sum of ≤ L steps, against a product of ≤ L exps): each term is within
/// (n + L·(1 + α))·2⁻⁵³ of itself in either, n the chain of the f32 bound.
#[test]
fn step_recurrence_matches_the_quadratic_reference() {
    let mut rng = common::rng("gated step_recurrence_matches_the_quadratic_reference");
    let resets = vec![(0, 0, 0), (0, 1, 7), (1, 0, 8), (1, 1, 20)];
    let s = sh(2, 4, 2, 21, 3, 4);
    for c in [
        Case { resets: resets.clone(), alpha: 3.0, ..base(s, 8) },
        Case { resets, normalize: true, ..base(s, 8) },
        Case { mode: DecayMode::PerHead, normalize: true, ..base(s, 8) },
        Case { mode: DecayMode::PerHead, initial: false, d_final: false, ..base(sh(1, 3, 1, 9, 2, 3), 8) },
    ] {
        let p = make::<f32>(&c, &mut rng);
        let r = reference(&c, &p);
        let m0 = magnitudes(&c, &p, &r, 0.0);
        let a = widen(&p.a);
        let s0 = p.s0.as_deref().map(widen);
        let gated = rg::Gated {
            q: &p.q,
            k: &p.k,
            v: &p.v,
            decay: decay_of(&c, &a),
            dims: dims(c.s),
            normalize: c.normalize.then_some(1e-6),
            initial: s0.as_deref(),
        };
        let dsf = p.dsf.as_deref().map(widen);
        let (f, g) = steps(&gated, Some(&p.dout), dsf.as_deref());
        let n = (c.s.m + c.s.d + 2 * c.s.l + 2 * c.chunk + c.s.l / c.chunk + 24) as f64;
        let rel = 2.0 * (n + c.s.l as f64 * (1.0 + c.alpha)) * 2f64.powi(-53);
        let tol = |m: &[f64]| m.iter().map(|x| rel * x).collect::<Vec<_>>();
        check("out", &c, &f.out, &r.out, &tol(&m0.out), 0.0, 0.0);
        check("final state", &c, &f.final_state, &r.fin, &tol(&m0.fin), 0.0, 0.0);
        check("dq", &c, &g.dq, &r.g.dq, &tol(&m0.dq), 0.0, 0.0);
        check("dk", &c, &g.dk, &r.g.dk, &tol(&m0.dk), 0.0, 0.0);
        check("dv", &c, &g.dv, &r.g.dv, &tol(&m0.dv), 0.0, 0.0);
        check("d_initial", &c, &g.d_initial, &r.g.d_initial, &tol(&m0.ds0), 0.0, 0.0);
        // da_r sums the terms G_ts of the weights spanning step r; Σ |G_ts| over them is at
        // most Σ_{t ≥ r} (Σ_h |q_t|·mag(dq_t) + |k_t|·mag(dk_t)) (each G_ts is a term of q_t·dq_t
        // and of k_s·dk_s), over B and L for a per-head decay
        let (sh_, mm) = (c.s, c.s.m);
        let g_ = sh_.h / sh_.hkv;
        let mut per_step = vec![0.0; sh_.b * sh_.hkv * sh_.l];
        for b in 0..sh_.b {
            for kh in 0..sh_.hkv {
                let mut acc = 0.0;
                for t in (0..sh_.l).rev() {
                    for hq in kh * g_..(kh + 1) * g_ {
                        let row = (b * sh_.h + hq) * sh_.l + t;
                        acc += (0..mm).map(|i| p.q[row * mm + i].abs() * m0.dq[row * mm + i]).sum::<f64>();
                    }
                    let row = (b * sh_.hkv + kh) * sh_.l + t;
                    acc += (0..mm).map(|i| p.k[row * mm + i].abs() * m0.dk[row * mm + i]).sum::<f64>();
                    per_step[row] = acc;
                }
            }
        }
        let tda: Vec<f64> = match c.mode {
            DecayMode::PerStep => per_step.iter().map(|x| rel * x).collect(),
            DecayMode::PerHead => (0..sh_.hkv)
                .map(|kh| {
                    rel * (0..sh_.b)
                        .map(|b| per_step[(b * sh_.hkv + kh) * sh_.l..][..sh_.l].iter().sum::<f64>())
                        .sum::<f64>()
                })
                .collect(),
        };
        check("da", &c, &g.da, &r.g.da, &tda, 0.0, 0.0);
    }
}

/// A non-finite input value at row s leaves the rows the mask hides from it finite and correct:
/// `v_s` (the forward's `P V'`), `k_s` (the forward's scores and `dq`'s `E K`) for the rows
/// t < s, `q_t` (the dk/dv walk's `Eᵀ Q`) for the rows s > t. On tensor cores the masked zeros
/// of the diagonal 16×16 block would carry it into those rows as NaN (0·∞) through the MMA;
/// the kernels sum that block with scalar FMAs instead when its rows hold a non-finite value.
/// Row 21 lies in the second 16-row block of a chunk of 32: rows 16..20 share its block.
#[test]
fn a_non_finite_value_stays_out_of_the_rows_it_cannot_see() {
    let mut rng = common::rng("gated a_non_finite_value_stays_out_of_the_rows_it_cannot_see");
    let device = common::emulator();
    let c = Case { initial: false, d_final: false, ..base(sh(1, 2, 1, 40, 5, 3), 32) };
    let row = 21;
    fn one<T: Element>(device: &Device, c: &Case, rng: &mut StdRng, row: usize) {
        let s = c.s;
        let p = make::<T>(c, rng);
        let r = reference(c, &p);
        let (m0, lo, hi) = (magnitudes(c, &p, &r, 0.0), magnitudes(c, &p, &r, -1e-3), magnitudes(c, &p, &r, 1e-3));
        let tc = T::DTYPE != DType::F32;
        let (ut, sub) = (common::unit_roundoff(T::DTYPE), common::subnormal_spacing(T::DTYPE));
        let tout = bound32(c, &m0.out, &lo.out, &hi.out, 0.0, tc);
        let tdq = bound32(c, &m0.dq, &lo.dq, &hi.dq, 0.0, tc);
        let tdk = bound32(c, &m0.dk, &lo.dk, &hi.dk, 0.0, tc);
        // the elements of rows `rows` of every head (width f) of a [B, heads, L, f] tensor
        let pick = |x: &[f64], heads: usize, f: usize, rows: &dyn Fn(usize) -> bool| -> Vec<f64> {
            (0..s.b * heads * s.l * f).filter(|i| rows((i / f) % s.l)).map(|i| x[i]).collect()
        };
        let cmp = |what: &str,
                   got: &[f64],
                   want: &[f64],
                   tol: &[f64],
                   heads: usize,
                   f: usize,
                   rows: &dyn Fn(usize) -> bool| {
            check(
                what,
                c,
                &pick(got, heads, f, rows),
                &pick(want, heads, f, rows),
                &pick(tol, heads, f, rows),
                ut,
                sub,
            );
        };
        let before = |t: usize| t < row;
        let after = |t: usize| t > row;
        // v_s = ∞: the outputs before it
        let mut pv = make::<T>(c, rng);
        (pv.q, pv.k, pv.v, pv.dout) = (p.q.clone(), p.k.clone(), p.v.clone(), p.dout.clone());
        pv.a.clone_from(&p.a);
        pv.v[row * s.d + 1] = f64::INFINITY;
        let g = run::<T>(device, c, &pv).expect("v = inf");
        cmp("out (v inf)", &g.out, &r.out, &tout, s.h, s.d, &before);
        // k_s = ∞: the outputs and dq before it
        let mut pk = make::<T>(c, rng);
        (pk.q, pk.k, pk.v, pk.dout) = (p.q.clone(), p.k.clone(), p.v.clone(), p.dout.clone());
        pk.a.clone_from(&p.a);
        pk.k[row * s.m + 2] = f64::INFINITY;
        let g = run::<T>(device, c, &pk).expect("k = inf");
        cmp("out (k inf)", &g.out, &r.out, &tout, s.h, s.d, &before);
        cmp("dq (k inf)", &g.dq, &r.g.dq, &tdq, s.h, s.m, &before);
        // q_t = ∞ (query head 0): dk after it
        let mut pq = make::<T>(c, rng);
        (pq.q, pq.k, pq.v, pq.dout) = (p.q.clone(), p.k.clone(), p.v.clone(), p.dout.clone());
        pq.a.clone_from(&p.a);
        pq.q[row * s.m] = f64::INFINITY;
        let g = run::<T>(device, c, &pq).expect("q = inf");
        cmp("dk (q inf)", &g.dk, &r.g.dk, &tdk, s.hkv, s.m, &after);
    }
    one::<f32>(&device, &c, &mut rng, row);
    one::<f16>(&device, &c, &mut rng, row);
    one::<bf16>(&device, &c, &mut rng, row);
}
/// `a = 0` gives the ungated kernel's results bit for bit (issue 41): out, the final state, dq,
/// dk and dv, for f32, f16 and bf16, normalised or not, a decay per step or per head (zeros),
/// in SLiM memory and with boundary states under each schedule, with two feature and value
/// tiles (M = 40, D = 35) and a chunk that does not divide L (L = 29, C = 13). The gated products are the
/// ungated ones with the decay's weights, each exactly 1 here, and a multiplication by 1 is
/// exact (kernels/linear_attention.cu, "Decay").
#[test]
fn zero_decay_is_the_ungated_kernel_bit_for_bit() {
    let mut rng = common::rng("gated zero_decay_is_the_ungated_kernel_bit_for_bit");
    let device = common::emulator();
    zero_decay_bitwise::<f32>(&device, &mut rng);
    zero_decay_bitwise::<f16>(&device, &mut rng);
    zero_decay_bitwise::<bf16>(&device, &mut rng);
}

fn zero_decay_bitwise<T: Element>(device: &Device, rng: &mut StdRng) {
    let modes = [
        (MemoryMode::Slim, Schedule::ChunkSums),
        (MemoryMode::BoundaryStates, Schedule::ChunkSums),
        (MemoryMode::BoundaryStates, Schedule::StateWalk),
        (MemoryMode::BoundaryStates, Schedule::Walk),
    ];
    for (i, (memory, schedule)) in modes.into_iter().enumerate() {
        for normalize in [false, true] {
            let mut c = base(sh(1, 2, 2, 29, 40, 35), 13);
            c.normalize = normalize;
            c.mode = if i % 2 == 0 { DecayMode::PerStep } else { DecayMode::PerHead };
            c.alpha = 0.0;
            c.initial = false;
            c.d_final = false;
            let mut p = make::<T>(&c, rng);
            p.a.iter_mut().for_each(|x| *x = 0.0);
            let opts = ForwardOptions { memory, schedule, seq_offsets: None };
            let got = run_opts::<T>(device, &c, &p, Storage::Contiguous, &opts).expect("gated");
            let s = c.s;
            let (q, k, v, dout) = (to_t::<T>(&p.q), to_t::<T>(&p.k), to_t::<T>(&p.v), to_t::<T>(&p.dout));
            let (qs, vs) = ([s.b, s.h, s.l, s.m], [s.b, s.h, s.l, s.d]);
            let config = la::LinearAttentionConfig {
                normalize,
                eps: 1e-6,
                chunk: c.chunk,
                memory,
                schedule,
                ..la::LinearAttentionConfig::causal()
            };
            let mut out = vec![T::from_f64(0.0); q.len() / s.m * s.d];
            let (qt, kt, vt) = (tr(&q, &qs), tr(&k, &qs), tr(&v, &vs));
            let saved = {
                let mut ot = TensorMut::contiguous(&mut out, &vs).expect("view");
                la::forward(device, &config, la::ForwardArgs { q: &qt, k: &kt, v: &vt, out: &mut ot }).expect("ungated")
            };
            let fin = saved.final_state().expect("final state");
            let zero = T::from_f64(0.0);
            let (mut dq, mut dk, mut dv) = (vec![zero; q.len()], vec![zero; k.len()], vec![zero; v.len()]);
            {
                let (ot, dt) = (tr(&out, &vs), tr(&dout, &vs));
                let mut dqt = TensorMut::contiguous(&mut dq, &qs).expect("view");
                let mut dkt = TensorMut::contiguous(&mut dk, &qs).expect("view");
                let mut dvt = TensorMut::contiguous(&mut dv, &vs).expect("view");
                let grads = la::Grads { dq: &mut dqt, dk: &mut dkt, dv: &mut dvt };
                let args = la::BackwardArgs { q: &qt, k: &kt, v: &vt, out: Some(&ot), dout: &dt, grads };
                la::backward(device, &saved, args).expect("ungated backward");
            }
            let what = format!("{} {memory:?} {schedule:?} normalize {normalize} {:?}", T::DTYPE.name(), c.mode);
            let fin = widen(&fin);
            let pairs: [(&str, &[f64], Vec<f64>); 5] = [
                ("out", &got.out, to_f64(&out)),
                ("final state", &got.fin, fin),
                ("dq", &got.dq, to_f64(&dq)),
                ("dk", &got.dk, to_f64(&dk)),
                ("dv", &got.dv, to_f64(&dv)),
            ];
            for (name, gated, ungated) in pairs {
                assert_eq!(gated.len(), ungated.len(), "{name} ({what})");
                for (j, (g, u)) in gated.iter().zip(&ungated).enumerate() {
                    assert!(g.to_bits() == u.to_bits(), "{name}[{j}] ({what}): gated {g:e}, ungated {u:e}");
                }
            }
        }
    }
}

/// Views of `[B, L, H, ·]` buffers (strides (L·H·F, F, H·F, 1)) give bit for bit the results of
/// contiguous ones: the kernel's arithmetic does not depend on the strides. Also L = 0 (the
/// final state is the initial one, d_initial is d_final, da is 0).
#[test]
fn strided_views_and_empty_sequences() {
    let mut rng = common::rng("gated strided_views_and_empty_sequences");
    let device = common::emulator();
    for c in [
        Case { normalize: true, ..base(sh(2, 4, 2, 19, 3, 4), 5) },
        Case { mode: DecayMode::PerHead, ..base(sh(1, 3, 1, 11, 4, 2), 4) },
    ] {
        let p = make::<bf16>(&c, &mut rng);
        let a = run_stored::<bf16>(&device, &c, &p, Storage::Contiguous).expect("contiguous");
        let b = run_stored::<bf16>(&device, &c, &p, Storage::SeqMajor).expect("strided");
        let pairs = [(&a.out, &b.out), (&a.fin, &b.fin), (&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv)];
        for (x, y) in pairs.into_iter().chain([(&a.da, &b.da), (&a.ds0, &b.ds0)]) {
            assert!(x.iter().zip(y.iter()).all(|(u, v)| u.to_bits() == v.to_bits()), "{c:?}");
        }
    }
    for mode in [DecayMode::PerStep, DecayMode::PerHead] {
        let c = Case { mode, normalize: true, ..base(sh(2, 2, 1, 0, 3, 2), 4) };
        parity::<f32>(&device, &c, &mut rng);
    }
}

fn is_invalid(name: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::InvalidArgument { name: n, .. } if n == name)
}

/// Every bad input is a typed error before any launch.
#[test]
fn bad_inputs_are_typed_errors() {
    let device = common::emulator();
    let (b, h, hkv, l, m, d) = (1, 4, 2, 5, 3, 2);
    let q = vec![0f32; b * h * l * m];
    let k = vec![0f32; b * hkv * l * m];
    let v = vec![0f32; b * hkv * l * d];
    let a = vec![0f32; b * hkv * l];
    let (qt, kt, vt, at) =
        (tr(&q, &[b, h, l, m]), tr(&k, &[b, hkv, l, m]), tr(&v, &[b, hkv, l, d]), tr(&a, &[b, hkv, l]));
    let mut out = vec![0f32; b * h * l * d];
    let fwd = |config: GatedConfig,
               k: &TensorRef<'_, f32>,
               v: &TensorRef<'_, f32>,
               decay: Decay<'_, '_>,
               out: &mut [f32],
               oshape: &[usize]| {
        let mut ot = TensorMut::contiguous(out, oshape).expect("view");
        forward(&device, &config, ForwardArgs { q: &qt, k, v, decay, initial: None, out: &mut ot }).map(|_| ())
    };
    let good = GatedConfig::default();
    let os = [b, h, l, d];
    for chunk in [0, MAX_CHUNK + 1] {
        let e = fwd(GatedConfig { chunk, ..good }, &kt, &vt, Decay::PerStep(&at), &mut out, &os).unwrap_err();
        assert!(is_invalid("chunk")(&e), "{e}");
    }
    let e = fwd(GatedConfig { normalize: true, eps: 0.0, ..good }, &kt, &vt, Decay::PerStep(&at), &mut out, &os)
        .unwrap_err();
    assert!(is_invalid("eps")(&e), "{e}");
    // H_kv = 3 does not divide H = 4
    let k3 = vec![0f32; b * 3 * l * m];
    let v3 = vec![0f32; b * 3 * l * d];
    let e =
        fwd(good, &tr(&k3, &[b, 3, l, m]), &tr(&v3, &[b, 3, l, d]), Decay::PerStep(&at), &mut out, &os).unwrap_err();
    assert!(is_invalid("kv_heads")(&e), "{e}");
    // v with another length, the decay of the wrong shape, out of the wrong shape
    let e =
        fwd(good, &kt, &tr(&v[..b * hkv * 4 * d], &[b, hkv, 4, d]), Decay::PerStep(&at), &mut out, &os).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = fwd(good, &kt, &vt, Decay::PerHead(&at), &mut out, &os).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = fwd(good, &kt, &vt, Decay::PerStep(&at), &mut out[..b * h * l * (d - 1)], &[b, h, l, d - 1]).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    // q of rank 3
    let e = {
        let q3 = tr(&q, &[b * h, l, m]);
        let mut ot = TensorMut::contiguous(&mut out, &os).expect("view");
        forward(
            &device,
            &good,
            ForwardArgs { q: &q3, k: &kt, v: &vt, decay: Decay::PerStep(&at), initial: None, out: &mut ot },
        )
        .unwrap_err()
    };
    assert!(matches!(e, Error::InvalidLayout { .. }), "{e}");
    // out over v (views of one host buffer: on the emulator a raw slice is a host address)
    let mut vo = vec![0f32; b * h * l * d];
    // SAFETY: `vo` outlives both views and the (synchronous) emulated call.
    let raw = unsafe { RawDeviceSlice::<f32>::new(vo.as_mut_ptr() as u64, vo.len()) };
    let mut raw_out = raw;
    let e = {
        let vview = TensorRef::contiguous(&raw, &[b, hkv, l, d]).expect("view");
        let mut ot = TensorMut::contiguous(&mut raw_out, &os).expect("view");
        forward(
            &device,
            &good,
            ForwardArgs { q: &qt, k: &kt, v: &vview, decay: Decay::PerStep(&at), initial: None, out: &mut ot },
        )
        .unwrap_err()
    };
    assert!(matches!(e, Error::Aliasing { first: "v", second: "out" }), "{e}");
    // a state of the wrong shape
    let s0 = vec![0f32; b * hkv * m * (d + 1)];
    let e = {
        let s0t = tr(&s0, &[b, hkv, m, d + 1]);
        let mut ot = TensorMut::contiguous(&mut out, &os).expect("view");
        forward(
            &device,
            &good,
            ForwardArgs { q: &qt, k: &kt, v: &vt, decay: Decay::PerStep(&at), initial: Some(&s0t), out: &mut ot },
        )
        .unwrap_err()
    };
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    // the backward: a normalised forward without an initial state, then calls that disagree
    let config = GatedConfig { normalize: true, ..good };
    let saved = {
        let mut ot = TensorMut::contiguous(&mut out, &os).expect("view");
        forward(
            &device,
            &config,
            ForwardArgs { q: &qt, k: &kt, v: &vt, decay: Decay::PerStep(&at), initial: None, out: &mut ot },
        )
        .expect("forward")
    };
    let ah = vec![0f32; hkv];
    let aht = tr(&ah, &[hkv]);
    let s0 = vec![0f32; b * hkv * m * (d + 1)];
    let s0t = tr(&s0, &[b, hkv, m, d + 1]);
    let ot = tr(&out, &os);
    let bwd = |decay: Decay<'_, '_>,
               initial: Option<&TensorRef<'_, f32>>,
               out: Option<&TensorRef<'_, f32>>,
               da_len: usize| {
        let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
        let mut da = vec![0f32; da_len];
        let mut dqt = TensorMut::contiguous(&mut dq, &[b, h, l, m]).expect("view");
        let mut dkt = TensorMut::contiguous(&mut dk, &[b, hkv, l, m]).expect("view");
        let mut dvt = TensorMut::contiguous(&mut dv, &[b, hkv, l, d]).expect("view");
        let dashape: Vec<usize> = if da_len == hkv { vec![hkv] } else { vec![b, hkv, da_len / (b * hkv)] };
        let mut dat = TensorMut::contiguous(&mut da, &dashape).expect("view");
        backward(
            &device,
            &saved,
            BackwardArgs {
                q: &qt,
                k: &kt,
                v: &vt,
                decay,
                initial,
                out,
                dout: &ot,
                d_final: None,
                grads: GatedGrads { dq: &mut dqt, dk: &mut dkt, dv: &mut dvt, d_decay: &mut dat, d_initial: None },
            },
        )
    };
    let n = b * hkv * l;
    bwd(Decay::PerStep(&at), None, Some(&ot), n).expect("a valid backward");
    let e = bwd(Decay::PerHead(&aht), None, Some(&ot), hkv).unwrap_err();
    assert!(is_invalid("decay")(&e), "{e}");
    let e = bwd(Decay::PerStep(&at), Some(&s0t), Some(&ot), n).unwrap_err();
    assert!(is_invalid("initial_state")(&e), "{e}");
    let e = bwd(Decay::PerStep(&at), None, None, n).unwrap_err();
    assert!(is_invalid("out")(&e), "{e}");
    let e = bwd(Decay::PerStep(&at), None, Some(&ot), b * hkv * (l + 1)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
}

/// Rows `o..o + n` of every head of a `[1, heads, L, f]` tensor, as `[1, heads, n, f]`.
fn rows_of<X: Copy>(x: &[X], heads: usize, l: usize, f: usize, o: usize, n: usize) -> Vec<X> {
    (0..heads).flat_map(|h| x[(h * l + o) * f..(h * l + o + n) * f].iter().copied()).collect()
}

/// `[0, l_0, l_0 + l_1, …]`
fn offsets_of(lens: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |o, &x| {
            *o += x;
            Some(*o)
        }))
        .collect()
}

/// Packed sequences (`c.s.b = 1`, `c.s.l` = the sum of `lens`) against one call per sequence.
/// A sequence's blocks walk the same chunks from its first row, with the same arithmetic in
/// the same order as a call of that sequence alone (row indices shift, values do not), so every
/// output is bitwise equal to the per-sequence calls' — except a per-head decay's gradient,
/// which the packed call sums over all rows at once (its bound below). The per-sequence calls
/// are the unpacked kernel that the parity tests above check against the f64 reference.
/// A packed problem (`c.s.b = 1`, `c.s.l` = the sum of `lens`): its states `[N, H_kv, M, W]`,
/// and the offsets.
fn packed_problem<T: Element>(c: &Case, lens: &[usize], rng: &mut StdRng) -> (Problem, Vec<usize>) {
    let s = c.s;
    let n = lens.len();
    let offsets = offsets_of(lens);
    assert_eq!((s.b, offsets[n]), (1, s.l), "a packed case is B = 1 with L = the sum of the lengths");
    let mut p = make::<T>(&Case { initial: false, d_final: false, ..c.clone() }, rng);
    let ns = s.hkv * s.m * width(c); // one sequence's state
    if c.initial {
        p.s0 = Some((0..n * ns).map(|_| rng.random_range(0.1f32..1.0)).collect());
    }
    if c.d_final {
        p.dsf = Some((0..n * ns).map(|_| rng.random_range(-1.0f32..1.0)).collect());
    }
    (p, offsets)
}

fn packed_matches_per_sequence<T: Element>(device: &Device, c: &Case, lens: &[usize], rng: &mut StdRng) {
    let s = c.s;
    let ns = s.hkv * s.m * width(c); // one sequence's state
    let (p, offsets) = packed_problem::<T>(c, lens, rng);
    let got = run_with::<T>(device, c, &p, Storage::Contiguous, Some(&offsets)).expect("packed");
    for (i, (&o, &len)) in offsets.iter().zip(lens).enumerate() {
        let sub = Problem {
            q: rows_of(&p.q, s.h, s.l, s.m, o, len),
            k: rows_of(&p.k, s.hkv, s.l, s.m, o, len),
            v: rows_of(&p.v, s.hkv, s.l, s.d, o, len),
            a: match c.mode {
                DecayMode::PerStep => rows_of(&p.a, s.hkv, s.l, 1, o, len),
                DecayMode::PerHead => p.a.clone(),
            },
            s0: p.s0.as_ref().map(|x| x[i * ns..(i + 1) * ns].to_vec()),
            dout: rows_of(&p.dout, s.h, s.l, s.d, o, len),
            dsf: p.dsf.as_ref().map(|x| x[i * ns..(i + 1) * ns].to_vec()),
        };
        let one = run::<T>(device, &Case { s: Shape { l: len, ..s }, ..c.clone() }, &sub).expect("one sequence");
        let same = |what: &str, x: &[f64], y: &[f64]| {
            assert_eq!(x.len(), y.len(), "{what}");
            for (j, (a, b)) in x.iter().zip(y).enumerate() {
                assert!(
                    a.is_finite() && a.to_bits() == b.to_bits(),
                    "{what} of sequence {i}, element {j}: packed {a}, alone {b} ({c:?}, lengths {lens:?})"
                );
            }
        };
        same("out", &rows_of(&got.out, s.h, s.l, s.d, o, len), &one.out);
        same("dq", &rows_of(&got.dq, s.h, s.l, s.m, o, len), &one.dq);
        same("dk", &rows_of(&got.dk, s.hkv, s.l, s.m, o, len), &one.dk);
        same("dv", &rows_of(&got.dv, s.hkv, s.l, s.d, o, len), &one.dv);
        same("final state", &got.fin[i * ns..(i + 1) * ns], &one.fin);
        same("d_initial", &got.ds0[i * ns..(i + 1) * ns], &one.ds0);
        if c.mode == DecayMode::PerStep {
            same("da", &rows_of(&got.da, s.hkv, s.l, 1, o, len), &one.da);
        }
    }
    if c.mode == DecayMode::PerHead {
        // A per-step call with the head's rate at every row computes the per-head call's da rows
        // bitwise (the kernel reads equal values), and those rows are bitwise the per-sequence
        // ones (checked above for per-step decay). The per-head call sums them in
        // gla_da_reduce_kernel: thread-strided partial sums of ⌈L/256⌉ rows, then a tree of 8
        // levels; each f32 addition is off by ≤ u·|its result| ≤ u·Σ|rows|, and a row passes
        // ≤ ⌈L/256⌉ + 8 of them: |d_decay − Σ rows| ≤ (⌈L/256⌉ + 8)·u·Σ|rows|.
        let cs = Case { mode: DecayMode::PerStep, ..c.clone() };
        let ps = Problem {
            q: p.q.clone(),
            k: p.k.clone(),
            v: p.v.clone(),
            a: (0..s.hkv).flat_map(|kh| std::iter::repeat_n(p.a[kh], s.l)).collect(),
            s0: p.s0.clone(),
            dout: p.dout.clone(),
            dsf: p.dsf.clone(),
        };
        let rows = run_with::<T>(device, &cs, &ps, Storage::Contiguous, Some(&offsets)).expect("packed per step").da;
        for kh in 0..s.hkv {
            let r = &rows[kh * s.l..(kh + 1) * s.l];
            let sum: f64 = r.iter().sum();
            let bound = (s.l.div_ceil(256) + 8) as f64 * U * r.iter().map(|x| x.abs()).sum::<f64>();
            let err = (got.da[kh] - sum).abs();
            assert!(err <= bound, "d_decay[{kh}] = {} vs Σ rows {sum}: {err:e} > {bound:e} ({c:?})", got.da[kh]);
        }
    }
}

/// Packed variable-length sequences equal one call per sequence: f32 (CUDA cores) and bf16
/// (tensor cores), per-step and per-head decay, grouped heads, normalised or not, with and
/// without initial states, empty sequences (first, inner, last), lengths that are not a
/// multiple of the chunk, a full chunk, and a reset inside a sequence.
#[test]
fn packed_sequences_match_one_call_per_sequence() {
    let mut rng = common::rng("gated packed_sequences_match_one_call_per_sequence");
    let device = common::emulator();
    let lens = [5usize, 0, 17, 16, 3, 0];
    let l: usize = lens.iter().sum();
    let f32_cases = [
        base(sh(1, 4, 2, l, 3, 4), 8),
        Case { normalize: true, initial: false, ..base(sh(1, 2, 1, l, 4, 3), 5) },
        Case { mode: DecayMode::PerHead, ..base(sh(1, 4, 2, l, 3, 2), 8) },
        // a reset at row 3 of the third sequence (KV head 1)
        Case { resets: vec![(0, 1, 5 + 3)], ..base(sh(1, 4, 2, l, 3, 3), 4) },
    ];
    for c in &f32_cases {
        packed_matches_per_sequence::<f32>(&device, c, &lens, &mut rng);
    }
    let bf16_cases = [
        base(sh(1, 4, 2, l, 5, 3), 16),
        Case { normalize: true, mode: DecayMode::PerHead, ..base(sh(1, 2, 1, l, 3, 4), 8) },
    ];
    for c in &bf16_cases {
        packed_matches_per_sequence::<bf16>(&device, c, &lens, &mut rng);
    }
    // one sequence, and a first sequence that is empty
    packed_matches_per_sequence::<f32>(&device, &base(sh(1, 2, 2, 9, 2, 2), 4), &[9], &mut rng);
    packed_matches_per_sequence::<bf16>(&device, &base(sh(1, 2, 1, 7, 2, 3), 4), &[0, 7], &mut rng);
}

/// Bad offsets and states of the unpacked shape are typed errors naming the argument.
#[test]
fn packed_bad_offsets_are_typed_errors() {
    let device = common::emulator();
    let (h, hkv, l, m, d) = (2, 1, 5, 3, 2);
    let q = vec![0f32; 2 * h * l * m];
    let k = vec![0f32; 2 * hkv * l * m];
    let v = vec![0f32; 2 * hkv * l * d];
    let a = vec![0f32; 2 * hkv * l];
    let mut out = vec![0f32; 2 * h * l * d];
    let fwd = |b: usize, offsets: &[usize], initial: Option<&TensorRef<'_, f32>>, out: &mut [f32]| {
        let (qt, kt) = (tr(&q[..b * h * l * m], &[b, h, l, m]), tr(&k[..b * hkv * l * m], &[b, hkv, l, m]));
        let (vt, at) = (tr(&v[..b * hkv * l * d], &[b, hkv, l, d]), tr(&a[..b * hkv * l], &[b, hkv, l]));
        let mut ot = TensorMut::contiguous(&mut out[..b * h * l * d], &[b, h, l, d]).expect("view");
        let args = ForwardArgs { q: &qt, k: &kt, v: &vt, decay: Decay::PerStep(&at), initial, out: &mut ot };
        forward_packed(&device, &GatedConfig { chunk: 2, ..GatedConfig::default() }, offsets, args)
    };
    let bad: [&[usize]; 6] = [&[], &[0], &[1, 5], &[0, 4], &[0, 6], &[0, 3, 2, 5]];
    for o in bad {
        let e = fwd(1, o, None, &mut out).unwrap_err();
        assert!(is_invalid("seq_offsets")(&e), "{o:?}: {e}");
    }
    let e = fwd(2, &[0, 5], None, &mut out).unwrap_err();
    assert!(is_invalid("seq_offsets")(&e), "B = 2: {e}");
    // two sequences: states are [2, H_kv, M, D], not [B = 1, …]
    let s1 = vec![0f32; hkv * m * d];
    let e = fwd(1, &[0, 2, 5], Some(&tr(&s1, &[1, hkv, m, d])), &mut out).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let saved = fwd(1, &[0, 2, 5], None, &mut out).expect("a valid packed forward");
    assert_eq!(saved.sequences(), Some(2));
    assert_eq!(saved.final_state().expect("state").len(), 2 * hkv * m * d);
    let (qt, kt, vt, at) = (
        tr(&q[..h * l * m], &[1, h, l, m]),
        tr(&k[..hkv * l * m], &[1, hkv, l, m]),
        tr(&v[..hkv * l * d], &[1, hkv, l, d]),
        tr(&a[..hkv * l], &[1, hkv, l]),
    );
    let dout = vec![0f32; h * l * d];
    let (mut dq, mut dk, mut dv, mut da) =
        (vec![0f32; h * l * m], vec![0f32; hkv * l * m], vec![0f32; hkv * l * d], vec![0f32; hkv * l]);
    let dst = tr(&s1, &[1, hkv, m, d]);
    let e = backward(
        &device,
        &saved,
        BackwardArgs {
            q: &qt,
            k: &kt,
            v: &vt,
            decay: Decay::PerStep(&at),
            initial: None,
            out: None,
            dout: &tr(&dout, &[1, h, l, d]),
            d_final: Some(&dst),
            grads: GatedGrads {
                dq: &mut TensorMut::contiguous(&mut dq, &[1, h, l, m]).expect("view"),
                dk: &mut TensorMut::contiguous(&mut dk, &[1, hkv, l, m]).expect("view"),
                dv: &mut TensorMut::contiguous(&mut dv, &[1, hkv, l, d]).expect("view"),
                d_decay: &mut TensorMut::contiguous(&mut da, &[1, hkv, l]).expect("view"),
                d_initial: None,
            },
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "d_final of [1, …] for 2 sequences: {e}");
}

/// Boundary states (`MemoryMode::BoundaryStates`): the forward keeps the state entering every
/// chunk (computed by each `Schedule`: chunk sums and a scan, a state walk, or the outputs'
/// walk) and the backward's dq runs parallel over chunks from them, dk and dv from their own
/// chunk sums (or, `Schedule::Walk`, walking back). Every schedule computes a state with the
/// same operations in the same order as the SLiM walks, so every result is bit for bit the
/// SLiM mode's (asserted bitwise, finite): f32, f16 and bf16, each schedule, per-step and per-head
/// decay, GQA, normalised, resets, L not a multiple of the chunk, L = 0, packed sequences with
/// empty ones.
#[test]
fn boundary_states_give_the_walks_results() {
    let mut rng = common::rng("gated boundary_states_give_the_walks_results");
    let device = common::emulator();
    let same = |c: &Case, x: &Got, y: &Got| {
        let pairs = [(&x.out, &y.out), (&x.fin, &y.fin), (&x.dq, &y.dq), (&x.dk, &y.dk), (&x.dv, &y.dv)];
        for (what, (a, b)) in ["out", "final", "dq", "dk", "dv", "da", "d_initial"]
            .into_iter()
            .zip(pairs.into_iter().chain([(&x.da, &y.da), (&x.ds0, &y.ds0)]))
        {
            assert_eq!(a.len(), b.len(), "{what}");
            for (j, (u, v)) in a.iter().zip(b.iter()).enumerate() {
                assert!(u.is_finite() && u.to_bits() == v.to_bits(), "{what}[{j}]: boundary {v}, walk {u} ({c:?})");
            }
        }
    };
    let schedules = [Schedule::ChunkSums, Schedule::StateWalk, Schedule::Walk];
    let boundary = |i: usize| ForwardOptions {
        memory: MemoryMode::BoundaryStates,
        schedule: schedules[i % 3],
        ..ForwardOptions::default()
    };
    let cases = [
        base(sh(2, 4, 2, 37, 5, 3), 7),
        Case { normalize: true, mode: DecayMode::PerHead, ..base(sh(2, 2, 1, 29, 4, 3), 8) },
        Case { resets: vec![(1, 0, 3), (0, 1, 20)], ..base(sh(2, 4, 2, 33, 3, 4), 16) },
        base(sh(2, 2, 1, 0, 3, 2), 4),
        // two feature tiles (an f16 dq once rounded differently here: the transposed state's
        // MMA cross terms in another order)
        Case { initial: false, d_final: false, ..base(sh(1, 2, 1, 16, 40, 3), 8) },
    ];
    for (i, c) in cases.iter().enumerate() {
        let p = make::<f32>(c, &mut rng);
        let walk = run::<f32>(&device, c, &p).expect("walk");
        same(c, &walk, &run_opts::<f32>(&device, c, &p, Storage::Contiguous, &boundary(i)).expect("boundary"));
        let p = make::<bf16>(c, &mut rng);
        let walk = run::<bf16>(&device, c, &p).expect("walk");
        same(c, &walk, &run_opts::<bf16>(&device, c, &p, Storage::Contiguous, &boundary(i + 1)).expect("boundary"));
        let p = make::<f16>(c, &mut rng);
        let walk = run::<f16>(&device, c, &p).expect("walk");
        same(c, &walk, &run_opts::<f16>(&device, c, &p, Storage::Contiguous, &boundary(i + 2)).expect("boundary"));
    }
    let lens = [5usize, 0, 17, 16, 3, 0];
    let l = lens.iter().sum();
    for (i, c) in [
        base(sh(1, 4, 2, l, 3, 4), 8),
        Case { normalize: true, mode: DecayMode::PerHead, ..base(sh(1, 2, 1, l, 3, 4), 4) },
    ]
    .into_iter()
    .enumerate()
    {
        let (p, offsets) = packed_problem::<f32>(&c, &lens, &mut rng);
        let walk = run_with::<f32>(&device, &c, &p, Storage::Contiguous, Some(&offsets)).expect("walk");
        let opts = ForwardOptions { seq_offsets: Some(&offsets), ..boundary(i) };
        same(&c, &walk, &run_opts::<f32>(&device, &c, &p, Storage::Contiguous, &opts).expect("boundary"));
        let (p, offsets) = packed_problem::<bf16>(&c, &lens, &mut rng);
        let walk = run_with::<bf16>(&device, &c, &p, Storage::Contiguous, Some(&offsets)).expect("walk");
        let opts = ForwardOptions { seq_offsets: Some(&offsets), ..boundary(i + 2) };
        same(&c, &walk, &run_opts::<bf16>(&device, &c, &p, Storage::Contiguous, &opts).expect("boundary"));
        let (p, offsets) = packed_problem::<f16>(&c, &lens, &mut rng);
        let walk = run_with::<f16>(&device, &c, &p, Storage::Contiguous, Some(&offsets)).expect("walk");
        let opts = ForwardOptions { seq_offsets: Some(&offsets), ..boundary(i + 1) };
        same(&c, &walk, &run_opts::<f16>(&device, &c, &p, Storage::Contiguous, &opts).expect("boundary"));
    }
}
