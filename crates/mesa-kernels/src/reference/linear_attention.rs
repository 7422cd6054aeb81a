//! f64 reference of linear attention, its gradients and feature maps, and of exact softmax
//! attention: O(L²) loops over logical indices, written from the papers' equations. Shares
//! no code with the kernels (no chunks, no states).
//!
//! Tensors are contiguous `[B, H, L, F]` slices of f64 (use [`super::gather`] to read a
//! strided view). Every function checks the slice lengths against the sizes first (the
//! products checked for overflow; an empty axis makes a tensor empty whatever the other
//! sizes), so no input makes it panic.
use crate::error::{Error, Result};

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

/// One attention problem: inputs, sizes and options.
#[derive(Debug, Clone, Copy)]
pub struct Attention<'a> {
    /// `[B, H, L, M]`
    pub q: &'a [f64],
    /// `[B, H, L, M]`
    pub k: &'a [f64],
    /// `[B, H, L, D]`
    pub v: &'a [f64],
    /// The sizes.
    pub dims: Dims,
    /// `s ≤ t` (causal) or all `s`.
    pub causal: bool,
    /// `Some(ε)`: divide by the guarded denominator.
    pub normalize: Option<f64>,
}

/// The product of `factors` (0 when any is 0), or [`Error::TooLarge`] on overflow.
pub(super) fn count(factors: &[usize], what: &str) -> Result<usize> {
    if factors.contains(&0) {
        return Ok(0);
    }
    factors
        .iter()
        .try_fold(1usize, |a, &f| a.checked_mul(f))
        .ok_or_else(|| Error::too_large(what, format!("the element count of {factors:?} overflows")))
}

pub(super) fn check_len(x: &[f64], shape: &[usize], what: &str) -> Result<()> {
    let n = count(shape, what)?;
    if x.len() != n {
        return Err(Error::shape_mismatch(what, shape, &[x.len()]));
    }
    Ok(())
}

impl Attention<'_> {
    /// `(B·H, L, M, D)` after checking every slice against the sizes.
    fn check(&self) -> Result<(usize, usize, usize, usize)> {
        let n = self.dims;
        let qs = [n.batch, n.heads, n.len, n.feat];
        check_len(self.q, &qs, "q")?;
        check_len(self.k, &qs, "k")?;
        check_len(self.v, &[n.batch, n.heads, n.len, n.dim], "v")?;
        // the lengths match: every product below is at most a slice length (or 0)
        let bh = if n.len == 0 { 0 } else { count(&[n.batch, n.heads], "batch × heads")? };
        Ok((bh, n.len, n.feat, n.dim))
    }
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
/// or all s. Returns `(out [B,H,L,D], den [B·H·L])` (den = the guarded denominators, 1 when
/// not normalised).
///
/// # Errors
/// [`Error::ShapeMismatch`] when a slice's length differs from its shape's element count;
/// [`Error::TooLarge`] when that count overflows.
pub fn forward(a: &Attention<'_>) -> Result<(Vec<f64>, Vec<f64>)> {
    let (bhs, l, m, d) = a.check()?;
    let (q, k, v) = (a.q, a.k, a.v);
    let mut out = vec![0.0; a.v.len()];
    let mut den_all = vec![1.0; count(&[bhs, l], "denominators")?];
    for bh in 0..bhs {
        let (qb, kb, vb) = (&q[bh * l * m..], &k[bh * l * m..], &v[bh * l * d..]);
        for t in 0..l {
            let mut num = vec![0.0; d];
            let mut den = 0.0;
            for s in (0..l).filter(|&s| visible(a.causal, t, s)) {
                let w: f64 = (0..m).map(|i| qb[t * m + i] * kb[s * m + i]).sum();
                den += w;
                for j in 0..d {
                    num[j] += w * vb[s * d + j];
                }
            }
            let g = a.normalize.map_or(1.0, |eps| guard(den, eps));
            den_all[bh * l + t] = g;
            for j in 0..d {
                out[(bh * l + t) * d + j] = num[j] / g;
            }
        }
    }
    Ok((out, den_all))
}

/// Gradients `(dq, dk, dv)` of [`forward`] for the upstream gradient `dout` (`[B, H, L, D]`),
/// by the explicit formulas: with `A_ts = q_t·k_s`, `g_t` the guarded denominator (g' = 1),
/// `dnum_t = dout_t/g_t`, `dden_t = −(dout_t·num_t)/g_t²` (0 when not normalised),
/// `dA_ts = dnum_t·v_s + dden_t` for visible (t, s):
/// `dq_t = Σ_s dA_ts k_s`, `dk_s = Σ_t dA_ts q_t`, `dv_s = Σ_t A_ts dnum_t`.
///
/// # Errors
/// As [`forward`], for `dout` too.
pub fn backward(a: &Attention<'_>, dout: &[f64]) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let (bhs, l, m, d) = a.check()?;
    check_len(dout, &[a.dims.batch, a.dims.heads, a.dims.len, a.dims.dim], "dout")?;
    let (q, k, v) = (a.q, a.k, a.v);
    if q.is_empty() && v.is_empty() {
        // nothing to write (and B·H·L may be any size)
        return Ok((Vec::new(), Vec::new(), Vec::new()));
    }
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    for bh in 0..bhs {
        let (qb, kb, vb, gb) = (&q[bh * l * m..], &k[bh * l * m..], &v[bh * l * d..], &dout[bh * l * d..]);
        for t in 0..l {
            let dot = |s: usize| -> f64 { (0..m).map(|i| qb[t * m + i] * kb[s * m + i]).sum() };
            let mut num = vec![0.0; d];
            let mut den = 0.0;
            for s in (0..l).filter(|&s| visible(a.causal, t, s)) {
                let w = dot(s);
                den += w;
                for j in 0..d {
                    num[j] += w * vb[s * d + j];
                }
            }
            let g = a.normalize.map_or(1.0, |eps| guard(den, eps));
            let dnum: Vec<f64> = (0..d).map(|j| gb[t * d + j] / g).collect();
            let dden = if a.normalize.is_some() {
                -(0..d).map(|j| gb[t * d + j] * num[j]).sum::<f64>() / (g * g)
            } else {
                0.0
            };
            for s in (0..l).filter(|&s| visible(a.causal, t, s)) {
                let w = dot(s);
                let da: f64 = (0..d).map(|j| dnum[j] * vb[s * d + j]).sum::<f64>() + dden;
                for i in 0..m {
                    dq[(bh * l + t) * m + i] += da * kb[s * m + i];
                    dk[(bh * l + s) * m + i] += da * qb[t * m + i];
                }
                for j in 0..d {
                    dv[(bh * l + s) * d + j] += w * dnum[j];
                }
            }
        }
    }
    Ok((dq, dk, dv))
}

/// Exact softmax attention `softmax(q kᵀ/√d_k + mask) v` for `q, k: [B, H, L, d_k]`,
/// `v: [B, H, L, D]` (the target FAVOR+ estimates; [`Attention::normalize`] is ignored).
///
/// # Errors
/// As [`forward`].
pub fn softmax_attention(a: &Attention<'_>) -> Result<Vec<f64>> {
    let (bhs, l, m, d) = a.check()?;
    let (q, k, v) = (a.q, a.k, a.v);
    if v.is_empty() {
        return Ok(Vec::new());
    }
    let scale = if m == 0 { 0.0 } else { 1.0 / (m as f64).sqrt() };
    let mut out = vec![0.0; v.len()];
    for bh in 0..bhs {
        for t in 0..l {
            let logits: Vec<(usize, f64)> = (0..l)
                .filter(|&s| visible(a.causal, t, s))
                .map(|s| (s, scale * (0..m).map(|i| q[(bh * l + t) * m + i] * k[(bh * l + s) * m + i]).sum::<f64>()))
                .collect();
            let mx = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|x| (x.1 - mx).exp()).sum();
            for &(s, w) in &logits {
                let w = (w - mx).exp() / z;
                for j in 0..d {
                    out[(bh * l + t) * d + j] += w * v[(bh * l + s) * d + j];
                }
            }
        }
    }
    Ok(out)
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

/// Derivative factor of ReLU (1 for `x > 0`, else 0) times `dphi` (pairs up to the shorter
/// slice).
#[must_use]
pub fn relu_backward(x: &[f64], dphi: &[f64]) -> Vec<f64> {
    x.iter().zip(dphi).map(|(&v, &g)| if v > 0.0 { g } else { 0.0 }).collect()
}

/// Derivative of ELU+1 (1 for `x > 0`, `exp(x)` otherwise) times `dphi` (pairs up to the
/// shorter slice).
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

/// A FAVOR+ projection ω `[m, d]` (row-major) for the reference.
#[derive(Debug, Clone, Copy)]
pub struct Favor<'a> {
    /// ω, `m·d` entries.
    pub omega: &'a [f64],
    /// `m`.
    pub features: usize,
    /// `d`.
    pub in_dim: usize,
}

impl Favor<'_> {
    /// `(rows, d, m)` of `x` (`rows·d` entries), checking ω's length.
    fn check(&self, x: &[f64]) -> Result<(usize, usize, usize)> {
        let (m, d) = (self.features, self.in_dim);
        check_len(self.omega, &[m, d], "omega")?;
        if d == 0 {
            if !x.is_empty() {
                return Err(Error::invalid_argument("in_dim", "0 with a non-empty x"));
            }
            return Ok((0, 0, m));
        }
        if x.len() % d != 0 {
            return Err(Error::invalid_argument("x", format!("{} entries are not rows of d = {d}", x.len())));
        }
        Ok((x.len() / d, d, m))
    }

    fn u(&self, xrow: &[f64]) -> Vec<f64> {
        let (m, d) = (self.features, xrow.len());
        let xs = (d as f64).powf(-0.25);
        let sq: f64 = xrow.iter().map(|x| (x * xs) * (x * xs)).sum::<f64>() * 0.5;
        (0..m).map(|i| (0..d).map(|j| self.omega[i * d + j] * xrow[j] * xs).sum::<f64>() - sq).collect()
    }
}

/// FAVOR+ features `φ_i = exp(ω_iᵀx' − |x'|²/2 − c)/√m`, `x' = x d^(−1/4)`, for
/// `x: [rows, d]` contiguous, `rows` a multiple of `seq_len` (a sequence = one (b, h)).
///
/// # Errors
/// [`Error::ShapeMismatch`] (ω not `m·d` entries), [`Error::InvalidArgument`] (`x` not
/// whole rows, or not whole sequences for [`Stabilizer::SequenceMax`]).
pub fn favor(x: &[f64], proj: &Favor<'_>, seq_len: usize, stab: Stabilizer) -> Result<Vec<f64>> {
    let (rows, d, m) = proj.check(x)?;
    if matches!(stab, Stabilizer::SequenceMax) && rows > 0 && (seq_len == 0 || rows % seq_len != 0) {
        return Err(Error::invalid_argument("seq_len", format!("{rows} rows are not sequences of {seq_len}")));
    }
    let us: Vec<Vec<f64>> = (0..rows).map(|r| proj.u(&x[r * d..(r + 1) * d])).collect();
    let rmax = |u: &Vec<f64>| u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut out = Vec::with_capacity(rows * m);
    for (r, u) in us.iter().enumerate() {
        let c = match stab {
            Stabilizer::None => 0.0,
            Stabilizer::RowMax => rmax(u),
            Stabilizer::Constant(c) => c,
            Stabilizer::SequenceMax => {
                let s0 = r / seq_len * seq_len;
                us[s0..s0 + seq_len].iter().map(rmax).fold(f64::NEG_INFINITY, f64::max)
            }
        };
        let c = if c.is_finite() { c } else { 0.0 };
        out.extend(u.iter().map(|&ui| (ui - c).exp() / (m as f64).sqrt()));
    }
    Ok(out)
}

/// FAVOR+ backward with c constant: `dx = d^(−1/4) Σ_i dφ_i φ_i (ω_i − x')`, for `x: [rows,
/// d]`, `phi, dphi: [rows, m]`.
///
/// # Errors
/// As [`favor`], and [`Error::ShapeMismatch`] when `phi` or `dphi` is not `[rows, m]`.
pub fn favor_backward(x: &[f64], proj: &Favor<'_>, phi: &[f64], dphi: &[f64]) -> Result<Vec<f64>> {
    let (rows, d, m) = proj.check(x)?;
    check_len(phi, &[rows, m], "phi")?;
    check_len(dphi, &[rows, m], "dphi")?;
    let xs = (d as f64).powf(-0.25);
    let mut dx = vec![0.0; x.len()];
    for r in 0..rows {
        for i in 0..m {
            let g = dphi[r * m + i] * phi[r * m + i];
            for j in 0..d {
                dx[r * d + j] += g * (proj.omega[i * d + j] - x[r * d + j] * xs) * xs;
            }
        }
    }
    Ok(dx)
}
