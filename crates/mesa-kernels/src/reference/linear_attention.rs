//! f64 reference of linear attention, its gradients and feature maps, and of exact softmax
//! attention: O(L²) loops over logical indices, written from the papers' equations. Shares
//! no code with the kernels (no chunks, no states).
//!
//! Tensors are contiguous `[B, H, L, F]` slices of f64 (use [`super::gather`] to read a
//! strided view).

/// Sizes: `q, k: [B, H, L, M]`, `v: [B, H, L, D]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// B
    pub batch: usize,
    /// H
    pub heads: usize,
    /// L
    pub len: usize,
    /// M
    pub feat: usize,
    /// D
    pub dim: usize,
}

/// The guard `g(x) = x + ε·sign(x)` (sign(0) = +1).
#[must_use]
pub fn guard(x: f64, eps: f64) -> f64 {
    if x >= 0.0 {
        x + eps
    } else {
        x - eps
    }
}

fn visible(causal: bool, t: usize, s: usize) -> bool {
    !causal || s <= t
}

/// `out_t = Σ_{s ∈ W(t)} (q_t·k_s) v_s  [/ g(Σ_{s ∈ W(t)} q_t·k_s)]`, W(t) = {s ≤ t} (causal)
/// or all s. `normalize`: `Some(ε)`. Returns `(out [B,H,L,D], den [B·H·L])` (den = the
/// guarded denominators, 1 when not normalised).
#[must_use]
pub fn forward(q: &[f64], k: &[f64], v: &[f64], n: Dims, causal: bool, normalize: Option<f64>) -> (Vec<f64>, Vec<f64>) {
    let (l, m, d) = (n.len, n.feat, n.dim);
    let mut out = vec![0.0; n.batch * n.heads * l * d];
    let mut den_all = vec![1.0; n.batch * n.heads * l];
    for bh in 0..n.batch * n.heads {
        let (qb, kb, vb) = (&q[bh * l * m..], &k[bh * l * m..], &v[bh * l * d..]);
        for t in 0..l {
            let mut num = vec![0.0; d];
            let mut den = 0.0;
            for s in (0..l).filter(|&s| visible(causal, t, s)) {
                let a: f64 = (0..m).map(|i| qb[t * m + i] * kb[s * m + i]).sum();
                den += a;
                for j in 0..d {
                    num[j] += a * vb[s * d + j];
                }
            }
            let g = normalize.map_or(1.0, |eps| guard(den, eps));
            den_all[bh * l + t] = g;
            for j in 0..d {
                out[(bh * l + t) * d + j] = num[j] / g;
            }
        }
    }
    (out, den_all)
}

/// Gradients `(dq, dk, dv)` of [`forward`] for the upstream gradient `dout`, by the explicit
/// formulas: with `A_ts = q_t·k_s`, `g_t` the guarded denominator (g' = 1),
/// `dnum_t = dout_t/g_t`, `dden_t = −(dout_t·num_t)/g_t²` (0 when not normalised),
/// `dA_ts = dnum_t·v_s + dden_t` for visible (t, s):
/// `dq_t = Σ_s dA_ts k_s`, `dk_s = Σ_t dA_ts q_t`, `dv_s = Σ_t A_ts dnum_t`.
#[must_use]
pub fn backward(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    n: Dims,
    causal: bool,
    normalize: Option<f64>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (l, m, d) = (n.len, n.feat, n.dim);
    let mut dq = vec![0.0; n.batch * n.heads * l * m];
    let mut dk = vec![0.0; dq.len()];
    let mut dv = vec![0.0; n.batch * n.heads * l * d];
    for bh in 0..n.batch * n.heads {
        let (qb, kb, vb, gb) = (&q[bh * l * m..], &k[bh * l * m..], &v[bh * l * d..], &dout[bh * l * d..]);
        for t in 0..l {
            let dot = |s: usize| -> f64 { (0..m).map(|i| qb[t * m + i] * kb[s * m + i]).sum() };
            let mut num = vec![0.0; d];
            let mut den = 0.0;
            for s in (0..l).filter(|&s| visible(causal, t, s)) {
                let a = dot(s);
                den += a;
                for j in 0..d {
                    num[j] += a * vb[s * d + j];
                }
            }
            let g = normalize.map_or(1.0, |eps| guard(den, eps));
            let dnum: Vec<f64> = (0..d).map(|j| gb[t * d + j] / g).collect();
            let dden =
                if normalize.is_some() { -(0..d).map(|j| gb[t * d + j] * num[j]).sum::<f64>() / (g * g) } else { 0.0 };
            for s in (0..l).filter(|&s| visible(causal, t, s)) {
                let a = dot(s);
                let da: f64 = (0..d).map(|j| dnum[j] * vb[s * d + j]).sum::<f64>() + dden;
                for i in 0..m {
                    dq[(bh * l + t) * m + i] += da * kb[s * m + i];
                    dk[(bh * l + s) * m + i] += da * qb[t * m + i];
                }
                for j in 0..d {
                    dv[(bh * l + s) * d + j] += a * dnum[j];
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Exact softmax attention `softmax(q kᵀ/√d_k + mask) v` for `q, k: [B, H, L, d_k]`,
/// `v: [B, H, L, D]` (the target FAVOR+ estimates).
#[must_use]
pub fn softmax_attention(q: &[f64], k: &[f64], v: &[f64], n: Dims, causal: bool) -> Vec<f64> {
    let (l, m, d) = (n.len, n.feat, n.dim);
    let scale = 1.0 / (m as f64).sqrt();
    let mut out = vec![0.0; n.batch * n.heads * l * d];
    for bh in 0..n.batch * n.heads {
        for t in 0..l {
            let logits: Vec<(usize, f64)> = (0..l)
                .filter(|&s| visible(causal, t, s))
                .map(|s| (s, scale * (0..m).map(|i| q[(bh * l + t) * m + i] * k[(bh * l + s) * m + i]).sum::<f64>()))
                .collect();
            let mx = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|x| (x.1 - mx).exp()).sum();
            for &(s, a) in &logits {
                let w = (a - mx).exp() / z;
                for j in 0..d {
                    out[(bh * l + t) * d + j] += w * v[(bh * l + s) * d + j];
                }
            }
        }
    }
    out
}

/// ReLU features `max(x, 0)` (elementwise).
#[must_use]
pub fn relu(x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| v.max(0.0)).collect()
}

/// ELU+1 features (elementwise): `x + 1` for `x > 0`, `exp(x)` otherwise.
#[must_use]
pub fn elu1(x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| if v > 0.0 { v + 1.0 } else { v.exp() }).collect()
}

/// Derivative factor of ReLU (1 for `x > 0`, else 0) times `dphi`.
#[must_use]
pub fn relu_backward(x: &[f64], dphi: &[f64]) -> Vec<f64> {
    x.iter().zip(dphi).map(|(&v, &g)| if v > 0.0 { g } else { 0.0 }).collect()
}

/// Derivative of ELU+1 (1 for `x > 0`, `exp(x)` otherwise) times `dphi`.
#[must_use]
pub fn elu1_backward(x: &[f64], dphi: &[f64]) -> Vec<f64> {
    x.iter().zip(dphi).map(|(&v, &g)| if v > 0.0 { g } else { g * v.exp() }).collect()
}

/// The FAVOR+ stabiliser of the reference (mirrors [`crate::feature_map::FavorStabilizer`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stabilizer {
    /// c = 0
    None,
    /// c = max_i u_i per row
    RowMax,
    /// c = the given constant
    Constant(f64),
    /// c = max over the (b, h) sequence and features
    SequenceMax,
}

fn favor_u(xrow: &[f64], omega: &[f64], m: usize) -> Vec<f64> {
    let d = xrow.len();
    let xs = (d as f64).powf(-0.25);
    let sq: f64 = xrow.iter().map(|x| (x * xs) * (x * xs)).sum::<f64>() * 0.5;
    (0..m).map(|i| (0..d).map(|j| omega[i * d + j] * xrow[j] * xs).sum::<f64>() - sq).collect()
}

/// FAVOR+ features `φ_i = exp(ω_iᵀx' − |x'|²/2 − c)/√m`, `x' = x d^(−1/4)`, for
/// `x: [rows_per_seq × seqs, d]` contiguous (a sequence = one (b, h)); ω `[m, d]`.
#[must_use]
pub fn favor(x: &[f64], d: usize, omega: &[f64], m: usize, seq_len: usize, stab: Stabilizer) -> Vec<f64> {
    let rows = x.len().checked_div(d).unwrap_or(0);
    let us: Vec<Vec<f64>> = (0..rows).map(|r| favor_u(&x[r * d..(r + 1) * d], omega, m)).collect();
    let rmax = |u: &Vec<f64>| u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut out = Vec::with_capacity(rows * m);
    for (r, u) in us.iter().enumerate() {
        let c = match stab {
            Stabilizer::None => 0.0,
            Stabilizer::RowMax => rmax(u),
            Stabilizer::Constant(c) => c,
            Stabilizer::SequenceMax => {
                let s0 = r / seq_len.max(1) * seq_len;
                us[s0..s0 + seq_len].iter().map(rmax).fold(f64::NEG_INFINITY, f64::max)
            }
        };
        let c = if c.is_finite() { c } else { 0.0 };
        out.extend(u.iter().map(|&ui| (ui - c).exp() / (m as f64).sqrt()));
    }
    out
}

/// FAVOR+ backward with c constant: `dx = d^(−1/4) Σ_i dφ_i φ_i (ω_i − x')`.
#[must_use]
pub fn favor_backward(x: &[f64], d: usize, omega: &[f64], m: usize, phi: &[f64], dphi: &[f64]) -> Vec<f64> {
    let rows = x.len().checked_div(d).unwrap_or(0);
    let xs = (d as f64).powf(-0.25);
    let mut dx = vec![0.0; x.len()];
    for r in 0..rows {
        for i in 0..m {
            let g = dphi[r * m + i] * phi[r * m + i];
            for j in 0..d {
                dx[r * d + j] += g * (omega[i * d + j] - x[r * d + j] * xs) * xs;
            }
        }
    }
    dx
}
