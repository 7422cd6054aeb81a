//! f64 reference of gated (decayed) causal linear attention with grouped heads (issue 41):
//! RetNet and Lightning Attention (a fixed rate per head), Mamba-2's SSD and gated linear
//! attention with a scalar gate (a rate per step and head; flash-linear-attention's
//! `chunk_simple_gla`):
//!
//! ```text
//! S_t = exp(a_t)·S_{t−1} + k_t v'_tᵀ,   o_t = q_tᵀ S_t [/ g(q_tᵀ z_t)],   a_t ≤ 0
//! ```
//!
//! with `v' = [v | 1]` and `z` the state's last column when normalised. Written as the
//! `O(L²)` sum it unrolls to, from the initial state `S_{−1}`:
//!
//! ```text
//! o_t = Σ_{s ≤ t} w_ts (q_t·k_s) v_s + w_t,−1 q_tᵀ S_{−1},   w_ts = exp(Σ_{r = s+1..t} a_r)
//! ```
//!
//! Each weight is the exponential of a sum of the `a_r` between the two rows — never a
//! difference of cumulative sums, and never `exp` of a positive number — so `a_r = −∞` (a
//! document boundary) gives weights 0 across it and no NaN. Query head `h` reads KV head
//! `⌊h/(H/H_kv)⌋` (its K, V, decay and state); the gradients of K, V, the decay and the
//! initial state sum over the group. Shares no code with the kernels.
//!
//! Tensors are contiguous f64 slices: `q: [B, H, L, M]`, `k: [B, H_kv, L, M]`,
//! `v: [B, H_kv, L, D]`, the decay `[B, H_kv, L]` or `[H_kv]`, states `[B, H_kv, M, W]` with
//! `W = D + 1` when normalised (the last column is `z`), else `D`.
use super::linear_attention::{check_len, count, guard};
use crate::error::{Error, Result};

/// Sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedDims {
    /// B
    pub batch: usize,
    /// H (query heads)
    pub heads: usize,
    /// H_kv (dividing H)
    pub kv_heads: usize,
    /// L
    pub len: usize,
    /// M (features of q, k)
    pub feat: usize,
    /// D (columns of v)
    pub dim: usize,
}

/// The log-decay `a ≤ 0` (`−∞` allowed: a reset).
#[derive(Debug, Clone, Copy)]
pub enum Decay<'a> {
    /// Per step and KV head, `[B, H_kv, L]` (Mamba-2, GLA's scalar gate).
    PerStep(&'a [f64]),
    /// Per KV head, `[H_kv]` (RetNet, Lightning Attention).
    PerHead(&'a [f64]),
}

/// One problem.
#[derive(Debug, Clone, Copy)]
pub struct Gated<'a> {
    /// `[B, H, L, M]`
    pub q: &'a [f64],
    /// `[B, H_kv, L, M]`
    pub k: &'a [f64],
    /// `[B, H_kv, L, D]`
    pub v: &'a [f64],
    /// `a`.
    pub decay: Decay<'a>,
    /// The sizes.
    pub dims: GatedDims,
    /// `Some(ε)`: divide by the guarded denominator `g(x) = x + ε·sign(x)`.
    pub normalize: Option<f64>,
    /// `S_{−1}`, `[B, H_kv, M, W]`; `None`: zero.
    pub initial: Option<&'a [f64]>,
}

/// What [`forward`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct GatedOutput {
    /// `[B, H, L, D]`
    pub out: Vec<f64>,
    /// The guarded denominators `[B, H, L]` (1 when not normalised).
    pub den: Vec<f64>,
    /// `S_{L−1}`, `[B, H_kv, M, W]`.
    pub final_state: Vec<f64>,
}

/// What [`backward`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct GatedGrads {
    /// `[B, H, L, M]`
    pub dq: Vec<f64>,
    /// `[B, H_kv, L, M]`
    pub dk: Vec<f64>,
    /// `[B, H_kv, L, D]`
    pub dv: Vec<f64>,
    /// The decay's gradient, shaped as the decay.
    pub da: Vec<f64>,
    /// `[B, H_kv, M, W]`
    pub d_initial: Vec<f64>,
}

impl Gated<'_> {
    fn width(&self) -> usize {
        self.dims.dim + usize::from(self.normalize.is_some())
    }

    fn check(&self) -> Result<()> {
        let n = self.dims;
        if n.kv_heads == 0 || n.heads % n.kv_heads != 0 {
            return Err(Error::invalid_argument(
                "kv_heads",
                format!("{} must be a positive divisor of heads {}", n.kv_heads, n.heads),
            ));
        }
        check_len(self.q, &[n.batch, n.heads, n.len, n.feat], "q")?;
        check_len(self.k, &[n.batch, n.kv_heads, n.len, n.feat], "k")?;
        check_len(self.v, &[n.batch, n.kv_heads, n.len, n.dim], "v")?;
        match self.decay {
            Decay::PerStep(a) => check_len(a, &[n.batch, n.kv_heads, n.len], "decay [B, H_kv, L]")?,
            Decay::PerHead(a) => check_len(a, &[n.kv_heads], "decay [H_kv]")?,
        }
        let a = match self.decay {
            Decay::PerStep(a) | Decay::PerHead(a) => a,
        };
        if let Some(bad) = a.iter().find(|x| x.is_nan() || **x > 0.0) {
            return Err(Error::invalid_argument("decay", format!("{bad} is not ≤ 0 (a log-decay; −∞ resets)")));
        }
        if let Some(s) = self.initial {
            check_len(s, &[n.batch, n.kv_heads, n.feat, self.width()], "initial state")?;
        }
        Ok(())
    }

    /// `a_r` of KV head `kh` of batch `b`.
    fn a(&self, b: usize, kh: usize, r: usize) -> f64 {
        match self.decay {
            Decay::PerStep(a) => a[(b * self.dims.kv_heads + kh) * self.dims.len + r],
            Decay::PerHead(a) => a[kh],
        }
    }

    /// `w_ts = exp(Σ_{r = s+1..t} a_r)` for `−1 ≤ s ≤ t` (the sums by prefix over `r`,
    /// each weight its own sum, so `−∞` gives exactly 0 and never NaN).
    fn weights(&self, b: usize, kh: usize) -> Vec<Vec<f64>> {
        let l = self.dims.len;
        // w[t][s + 1]
        let mut w = vec![vec![0.0; l + 1]; l];
        for t in 0..l {
            let mut sum = 0.0;
            w[t][t + 1] = 1.0;
            for s in (0..=t).rev() {
                // s − 1 < t: add a_s, the step between row s − 1 and row s
                sum += self.a(b, kh, s);
                w[t][s] = sum.exp();
            }
        }
        w
    }
}

/// `(out, den, final_state)`: the `O(L²)` sum of the module docs.
///
/// # Errors
/// [`Error::ShapeMismatch`] for a slice of the wrong length, [`Error::InvalidArgument`] for
/// `H_kv` not dividing `H` or a decay entry that is not `≤ 0` (NaN included),
/// [`Error::TooLarge`] when a count overflows.
pub fn forward(g: &Gated<'_>) -> Result<GatedOutput> {
    g.check()?;
    let n = g.dims;
    let (l, m, d, wd) = (n.len, n.feat, n.dim, g.width());
    let group = n.heads / n.kv_heads.max(1);
    let mut out = vec![0.0; count(&[n.batch, n.heads, l, d], "out")?];
    let mut den = vec![1.0; count(&[n.batch, n.heads, l], "denominators")?];
    let mut fin = vec![0.0; count(&[n.batch, n.kv_heads, m, wd], "final state")?];
    for b in 0..n.batch {
        for kh in 0..n.kv_heads {
            let w = g.weights(b, kh);
            let kv = b * n.kv_heads + kh;
            let (kb, vb) = (&g.k[kv * l * m..], &g.v[kv * l * d..]);
            // v'_s [j]: v, then 1 when normalised
            let vp = |s: usize, j: usize| if j < d { vb[s * d + j] } else { 1.0 };
            let s0 = |i: usize, j: usize| g.initial.map_or(0.0, |s| s[(kv * m + i) * wd + j]);
            for hq in kh * group..(kh + 1) * group {
                let qh = b * n.heads + hq;
                let qb = &g.q[qh * l * m..];
                for t in 0..l {
                    let mut acc = vec![0.0; wd];
                    for s in 0..=t {
                        let dot: f64 = (0..m).map(|i| qb[t * m + i] * kb[s * m + i]).sum();
                        for (j, x) in acc.iter_mut().enumerate() {
                            *x += w[t][s + 1] * dot * vp(s, j);
                        }
                    }
                    for (j, x) in acc.iter_mut().enumerate() {
                        *x += w[t][0] * (0..m).map(|i| qb[t * m + i] * s0(i, j)).sum::<f64>();
                    }
                    let gd = g.normalize.map_or(1.0, |eps| guard(acc[d], eps));
                    den[qh * l + t] = gd;
                    for j in 0..d {
                        out[(qh * l + t) * d + j] = acc[j] / gd;
                    }
                }
            }
            if l > 0 {
                // S_{L−1} = Σ_s w_{L−1,s} k_s v'_sᵀ + w_{L−1,−1} S_{−1}
                for i in 0..m {
                    for j in 0..wd {
                        let mut x = w[l - 1][0] * s0(i, j);
                        for s in 0..l {
                            x += w[l - 1][s + 1] * kb[s * m + i] * vp(s, j);
                        }
                        fin[(kv * m + i) * wd + j] = x;
                    }
                }
            } else if let Some(s) = g.initial {
                fin.copy_from_slice(s);
            }
        }
    }
    Ok(GatedOutput { out, den, final_state: fin })
}

/// Gradients of [`forward`] for `dout` (`[B, H, L, D]`) and `d_final` (`[B, H_kv, M, W]`,
/// `None`: 0), by the explicit formulas: with `A_ts = q_t·k_s`, the guarded denominator
/// `g_t` (g' = 1), `dv'_t = [dout_t/g_t | −(dout_t·out_t)/g_t]` (the second part only when
/// normalised), and `G_ts = w_ts·∂L/∂w_ts` for `−1 ≤ s ≤ t` (`∂L/∂w_ts = A_ts (v'_s·dv'_t)`,
/// and `q_tᵀ S_{−1} dv'_t` for `s = −1`) plus the final state's `w_{L−1,s} k_sᵀ dS v'_s`:
///
/// ```text
/// dq_t = Σ_s w_ts (v'_s·dv'_t) k_s + w_t,−1 S_{−1} dv'_t
/// dk_s = Σ_t w_ts (v'_s·dv'_t) q_t + w_{L−1,s} dS v'_s
/// dv_s = Σ_t w_ts A_ts dv'_t[..D] + w_{L−1,s} (dSᵀ k_s)[..D]
/// da_r = Σ_{s < r ≤ t} G_ts          (every weight spanning step r)
/// dS_{−1} = Σ_t w_t,−1 q_t dv'_tᵀ + w_{L−1,−1} dS
/// ```
///
/// summed over each KV head's query heads; a per-head decay's gradient also over `B` and `L`.
///
/// # Errors
/// As [`forward`], for `dout` and `d_final` too.
pub fn backward(g: &Gated<'_>, dout: &[f64], d_final: Option<&[f64]>) -> Result<GatedGrads> {
    let fwd = forward(g)?;
    let n = g.dims;
    let (l, m, d, wd) = (n.len, n.feat, n.dim, g.width());
    check_len(dout, &[n.batch, n.heads, l, d], "dout")?;
    if let Some(s) = d_final {
        check_len(s, &[n.batch, n.kv_heads, m, wd], "d_final")?;
    }
    let group = n.heads / n.kv_heads.max(1);
    let mut dq = vec![0.0; g.q.len()];
    let mut dk = vec![0.0; g.k.len()];
    let mut dv = vec![0.0; g.v.len()];
    let mut da = vec![0.0; count(&[n.batch, n.kv_heads, l], "decay gradient")?];
    let mut ds0 = vec![0.0; count(&[n.batch, n.kv_heads, m, wd], "initial state gradient")?];
    for b in 0..n.batch {
        for kh in 0..n.kv_heads {
            let w = g.weights(b, kh);
            let kv = b * n.kv_heads + kh;
            let (kb, vb) = (&g.k[kv * l * m..], &g.v[kv * l * d..]);
            let vp = |s: usize, j: usize| if j < d { vb[s * d + j] } else { 1.0 };
            let s0 = |i: usize, j: usize| g.initial.map_or(0.0, |s| s[(kv * m + i) * wd + j]);
            let dsf = |i: usize, j: usize| d_final.map_or(0.0, |s| s[(kv * m + i) * wd + j]);
            // G[t][s + 1] = w_ts ∂L/∂w_ts, summed over the group's query heads
            let mut big_g = vec![vec![0.0; l + 1]; l];
            for hq in kh * group..(kh + 1) * group {
                let qh = b * n.heads + hq;
                let (qb, gb) = (&g.q[qh * l * m..], &dout[qh * l * d..]);
                for t in 0..l {
                    let gd = fwd.den[qh * l + t];
                    let o = &fwd.out[(qh * l + t) * d..];
                    let mut dvp = vec![0.0; wd];
                    for j in 0..d {
                        dvp[j] = gb[t * d + j] / gd;
                    }
                    if g.normalize.is_some() {
                        dvp[d] = -(0..d).map(|j| gb[t * d + j] * o[j]).sum::<f64>() / gd;
                    }
                    for s in 0..=t {
                        let wts = w[t][s + 1];
                        let a_ts: f64 = (0..m).map(|i| qb[t * m + i] * kb[s * m + i]).sum();
                        let vd: f64 = (0..wd).map(|j| vp(s, j) * dvp[j]).sum();
                        big_g[t][s + 1] += wts * a_ts * vd;
                        for i in 0..m {
                            dq[(qh * l + t) * m + i] += wts * vd * kb[s * m + i];
                            dk[(kv * l + s) * m + i] += wts * vd * qb[t * m + i];
                        }
                        for j in 0..d {
                            dv[(kv * l + s) * d + j] += wts * a_ts * dvp[j];
                        }
                    }
                    // the initial state's term
                    let w0 = w[t][0];
                    let mut qs = 0.0;
                    for i in 0..m {
                        for j in 0..wd {
                            qs += qb[t * m + i] * s0(i, j) * dvp[j];
                            dq[(qh * l + t) * m + i] += w0 * s0(i, j) * dvp[j];
                            ds0[(kv * m + i) * wd + j] += w0 * qb[t * m + i] * dvp[j];
                        }
                    }
                    big_g[t][0] += w0 * qs;
                }
            }
            if l > 0 {
                // the final state's terms, through row L − 1's weights
                for s in 0..l {
                    let wls = w[l - 1][s + 1];
                    let mut kdv = 0.0;
                    for i in 0..m {
                        for j in 0..wd {
                            let x = dsf(i, j);
                            kdv += kb[s * m + i] * x * vp(s, j);
                            dk[(kv * l + s) * m + i] += wls * x * vp(s, j);
                            if j < d {
                                dv[(kv * l + s) * d + j] += wls * kb[s * m + i] * x;
                            }
                        }
                    }
                    big_g[l - 1][s + 1] += wls * kdv;
                }
                let w0 = w[l - 1][0];
                let mut s0ds = 0.0;
                for i in 0..m {
                    for j in 0..wd {
                        s0ds += s0(i, j) * dsf(i, j);
                        ds0[(kv * m + i) * wd + j] += w0 * dsf(i, j);
                    }
                }
                big_g[l - 1][0] += w0 * s0ds;
            } else {
                for i in 0..m {
                    for j in 0..wd {
                        ds0[(kv * m + i) * wd + j] += dsf(i, j);
                    }
                }
            }
            // da_r = Σ_{t ≥ r} Σ_{s + 1 ≤ r} G[t][s + 1]  (s = −1 included)
            for r in 0..l {
                let mut x = 0.0;
                for row in big_g.iter().skip(r) {
                    x += row[..=r].iter().sum::<f64>();
                }
                da[kv * l + r] = x;
            }
        }
    }
    let da = match g.decay {
        Decay::PerStep(_) => da,
        Decay::PerHead(_) => {
            let mut per = vec![0.0; n.kv_heads];
            for b in 0..n.batch {
                for (kh, p) in per.iter_mut().enumerate() {
                    *p += da[(b * n.kv_heads + kh) * l..][..l].iter().sum::<f64>();
                }
            }
            per
        }
    };
    Ok(GatedGrads { dq, dk, dv, da, d_initial: ds0 })
}
