//! Issue 39: candle-nn 0.11.1's fused norms have no backward, ours do.
//!
//! candle-nn applies its fused `LayerNorm` (contiguous input, with a bias), `RmsNorm`
//! (contiguous input) and `ops::softmax_last_dim` with `apply_op*_no_bwd`: the result enters
//! candle's graph as a constant. The backward then succeeds, but nothing flows through the op:
//! the norm's weight and bias get no gradient and a residual block `x + f(norm(x))` passes the
//! gradient only around its norm (`dx = dy`). The first two tests document that on a pre-norm
//! residual block `x + W₂·gelu(W₁·norm(x) + b₁) + b₂` (norm weight and bias variables), and
//! that candle-nn's composed forms (`ops::layer_norm_slow`, `RmsNorm::forward_diff`) do give
//! every gradient; they fail when candle fixes the defect, and then `docs/candle.md`
//! ("Models that use candle-nn's fused norms") must be updated. The last two run the same block
//! with [`mesa_candle::nn::LayerNorm`] / [`mesa_candle::nn::RmsNorm`] (candle-nn's
//! constructors, our ops) and check every gradient against the block written with candle's
//! elementary ops in f64.
//!
//! **Bounds.** Our norms' forward is computed in f32 (no codes); their backward decodes `x̂`
//! from 8-bit codes (the default [`mesa_candle::ops::Codes`]: exact per-tensor range, round to
//! nearest): `|x̂_dec − x̂| ≤ h = step/2` (+ the decode's `fmaf`), `step = (max − min)/255` of
//! `x̂`. That error reaches only the norm's gradients (`dx`, `dw`, `db`): `common::norm_bounds` (shared
//! with `tests/ops.rs`) applied to the reference's gradient of the norm's output, `dn`. The rest
//! is f32 arithmetic, bounded from the reference's values ([`errors`]): the norm's forward
//! within `64·C·u₃₂·(1 + |n|)` (the bound `tests/ops.rs` checks), a sum of `k` products within
//! `k·u₃₂` of its magnitudes, `|gelu'| ≤ 1.13` and `|gelu''| ≤ 2φ(0) < 0.8` carrying `h`'s
//! error through GELU; the error of `dn` enters the norm's backward linearly. The decoding
//! terms dominate `dx` and `dw` (worst error about a third of the bound); the other gradients
//! carry only the forward's error, whose `64·C·u₃₂` bound is far above what it measures.
mod common;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use common::{assert_within, flat, norm_bounds, normalized, Rng};

const U32: f64 = 1.0 / 16_777_216.0;
const EPS: f64 = 1e-5;
/// Rows, features, hidden width of the block.
const R: usize = 12;
const C: usize = 32;
const H: usize = 64;
/// The block's inputs, in the order of [`inputs`].
const NAMES: [&str; 7] = ["x", "norm weight", "norm bias", "W1", "b1", "W2", "b2"];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Layer,
    Rms,
}

type Norm = fn(Kind, &Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// `x [R, C]`, norm weight and bias `[C]`, `W₁ [H, C]`, `b₁ [H]`, `W₂ [C, H]`, `b₂ [C]` (f32),
/// and `dy [R, C]`.
fn inputs(rng: &mut Rng) -> (Vec<Tensor>, Tensor) {
    let f = DType::F32;
    let t = vec![
        rng.tensor(&[R, C], 1.0, 2.0, f),
        rng.tensor(&[C], 1.0, 0.5, f),
        rng.tensor(&[C], 0.0, 0.5, f),
        rng.tensor(&[H, C], 0.0, 1.0 / (C as f64).sqrt(), f),
        rng.tensor(&[H], 0.0, 0.5, f),
        rng.tensor(&[C, H], 0.0, 1.0 / (H as f64).sqrt(), f),
        rng.tensor(&[C], 0.0, 0.5, f),
    ];
    (t, rng.tensor(&[R, C], 0.0, 1.0, f))
}

/// The block, `x + mlp(norm(x))`.
fn block(t: &[Tensor], kind: Kind, norm: Norm) -> candle_core::Result<Tensor> {
    &t[0] + mlp(&norm(kind, &t[0], &t[1], &t[2])?, t)?
}

/// `W₂·gelu(W₁·n + b₁) + b₂`.
fn mlp(n: &Tensor, t: &[Tensor]) -> candle_core::Result<Tensor> {
    let h = n.matmul(&t[3].t()?)?.broadcast_add(&t[4])?;
    h.gelu_erf()?.matmul(&t[5].t()?)?.broadcast_add(&t[6])
}

/// candle-nn's layers as a model uses them (`Module::forward`): the fused ops.
fn candle_fused(kind: Kind, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match kind {
        Kind::Layer => candle_nn::LayerNorm::new(w.clone(), b.clone(), EPS).forward(x),
        Kind::Rms => candle_nn::RmsNorm::new(w.clone(), EPS).forward(x)?.broadcast_add(b),
    }
}

/// candle-nn's composed forms (differentiable).
fn candle_composed(kind: Kind, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match kind {
        Kind::Layer => candle_nn::ops::layer_norm_slow(x, w, b, EPS as f32),
        Kind::Rms => candle_nn::RmsNorm::new(w.clone(), EPS).forward_diff(x)?.broadcast_add(b),
    }
}

/// Ours, through candle-nn's constructors (`mesa_candle::nn`).
fn ours(kind: Kind, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match kind {
        Kind::Layer => mesa_candle::nn::LayerNorm::new(w.clone(), b.clone(), EPS).forward(x),
        Kind::Rms => mesa_candle::nn::RmsNorm::new(w.clone(), EPS).forward(x)?.broadcast_add(b),
    }
}

/// The reference: candle's elementary ops (run in f64).
fn elementary(kind: Kind, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let xc = match kind {
        Kind::Layer => x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?,
        Kind::Rms => x.clone(),
    };
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + EPS)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

/// The gradients of `Σ block(inputs) ⊙ dy` on `device` for every input (`None` where candle's
/// backward gave none).
fn gradients(device: &Device, inputs: &[Tensor], dy: &Tensor, kind: Kind, norm: Norm) -> Vec<Option<Vec<f64>>> {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(&t.to_device(device).unwrap()).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = block(&ts, kind, norm).unwrap();
    let dy = dy.to_device(device).unwrap();
    let store = (y * dy).unwrap().sum_all().unwrap().backward().unwrap();
    ts.iter().map(|t| store.get(t).map(flat)).collect()
}

/// The reference's gradient of the norm's output, `dn` (candle keeps the gradients of
/// variables only: the MLP run on the reference's `n` made a variable).
fn norm_output_gradient(t64: &[Tensor], dy64: &Tensor, kind: Kind) -> Vec<f64> {
    let n = Var::from_tensor(&elementary(kind, &t64[0], &t64[1], &t64[2]).unwrap()).unwrap();
    let store = (mlp(n.as_tensor(), t64).unwrap() * dy64).unwrap().sum_all().unwrap().backward().unwrap();
    flat(store.get(n.as_tensor()).unwrap())
}

/// candle-nn's fused norm: the norm's parameters (those inside the fused op) get no gradient,
/// `dx = dy` exactly (only the residual path), the MLP's parameters get theirs; the composed
/// form gets every gradient.
fn fused_norm_drops_the_gradient(kind: Kind, op: &str, inside: &[usize]) {
    let mut rng = Rng::new(op);
    let dev = common::device();
    let (t, dy) = inputs(&mut rng);
    let g = gradients(&dev, &t, &dy, kind, candle_fused);
    let fixed = format!(
        "candle-nn's fused {op} now passes gradients: candle fixed the defect of issue 39; update docs/candle.md \
         (\"Models that use candle-nn's fused norms\"), docs/results.md's candle-transformers section and this test"
    );
    for &i in inside {
        assert!(g[i].is_none(), "{fixed} ({} got one)", NAMES[i]);
    }
    assert_eq!(g[0].as_deref(), Some(flat(&dy).as_slice()), "{fixed} (dx is not dy alone)");
    for i in 3..7 {
        assert!(g[i].is_some(), "{op}: {} (after the norm) has no gradient", NAMES[i]);
    }
    let g = gradients(&dev, &t, &dy, kind, candle_composed);
    for (i, gi) in g.iter().enumerate() {
        assert!(gi.is_some(), "{op}, candle-nn's composed form: {} has no gradient", NAMES[i]);
    }
    assert_ne!(g[0].as_deref(), Some(flat(&dy).as_slice()), "{op}, composed: dx includes the norm's path");
}

#[test]
fn candle_nn_fused_layer_norm_drops_the_norm_gradients() {
    // weight and bias are arguments of the fused op
    fused_norm_drops_the_gradient(Kind::Layer, "layer_norm", &[1, 2]);
}

#[test]
fn candle_nn_fused_rms_norm_drops_the_norm_gradients() {
    // the bias is added by candle after the fused op, and gets its gradient
    fused_norm_drops_the_gradient(Kind::Rms, "rms_norm", &[1]);
}

/// Bounds on the f32 errors of our block's intermediates (the module docs), from the
/// reference's values: `|n|`, `|h|` (`≥ |gelu(h)|`), `|dh| ≤ 1.13·|dy·W₂|`, and the errors
/// `E_n`, `E_h`, `E_dh`, `E_dn` of `n`, `h`, `dh`, `dn`.
struct Errors {
    n: Vec<f64>,
    en: Vec<f64>,
    h: Vec<f64>,
    eh: Vec<f64>,
    dh: Vec<f64>,
    edh: Vec<f64>,
    edn: Vec<f64>,
}

/// * `E_n = 64·C·u·(1 + |n|)`: the norm's forward (the bound `tests/ops.rs` checks);
/// * `E_h = Σ_c E_n·|W₁| + (C + 1)·u·(Σ_c |n|·|W₁| + |b₁|)`: the product and its sum;
/// * `E_dh = 1.13·C·u·Σ_c |dy|·|W₂| + |dy·W₂|·(0.8·E_h + 8u·(1 + |h|))`: `dy·W₂`'s sum, then
///   `gelu'` (`≤ 1.13`) at the computed `h` (`|gelu''| < 0.8`) and its own evaluation;
/// * `E_dn = Σ_j E_dh·|W₁| + H·u·Σ_j |dh|·|W₁|`.
#[allow(clippy::needless_range_loop)] // rows, columns and hidden units index several arrays
fn errors(t: &[Vec<f64>], xhat: &[f64], dy: &[f64]) -> Errors {
    let (w, b, w1, b1, w2) = (&t[1], &t[2], &t[3], &t[4], &t[5]);
    let mut e = Errors {
        n: vec![0.0; R * C],
        en: vec![0.0; R * C],
        h: vec![0.0; R * H],
        eh: vec![0.0; R * H],
        dh: vec![0.0; R * H],
        edh: vec![0.0; R * H],
        edn: vec![0.0; R * C],
    };
    for r in 0..R {
        for c in 0..C {
            let n = xhat[r * C + c] * w[c] + b[c];
            e.n[r * C + c] = n.abs();
            e.en[r * C + c] = 64.0 * C as f64 * U32 * (1.0 + n.abs());
        }
        for j in 0..H {
            let i = r * H + j;
            let h: f64 = (0..C).map(|c| (xhat[r * C + c] * w[c] + b[c]) * w1[j * C + c]).sum::<f64>() + b1[j];
            let mag: f64 = (0..C).map(|c| e.n[r * C + c] * w1[j * C + c].abs()).sum::<f64>() + b1[j].abs();
            e.h[i] = h.abs();
            e.eh[i] = (0..C).map(|c| e.en[r * C + c] * w1[j * C + c].abs()).sum::<f64>() + (C + 1) as f64 * U32 * mag;
            let da: f64 = (0..C).map(|c| dy[r * C + c] * w2[c * H + j]).sum();
            let da_mag: f64 = (0..C).map(|c| (dy[r * C + c] * w2[c * H + j]).abs()).sum();
            e.dh[i] = 1.13 * da.abs();
            e.edh[i] = 1.13 * C as f64 * U32 * da_mag + da.abs() * (0.8 * e.eh[i] + 8.0 * U32 * (1.0 + h.abs()));
        }
        for c in 0..C {
            e.edn[r * C + c] =
                (0..H).map(|j| (e.edh[r * H + j] + H as f64 * U32 * e.dh[r * H + j]) * w1[j * C + c].abs()).sum();
        }
    }
    e
}

/// Our norm in the block: every input gets a gradient, each within its bound of the
/// elementary-op block's in f64 (module docs).
#[allow(clippy::needless_range_loop)]
fn our_norm_gets_every_gradient(kind: Kind, op: &str) {
    let mut rng = Rng::new(op);
    let dev = common::device();
    let (t, dy) = inputs(&mut rng);
    let g = gradients(&dev, &t, &dy, kind, ours);
    let g: Vec<Vec<f64>> = g
        .into_iter()
        .enumerate()
        .map(|(i, g)| g.unwrap_or_else(|| panic!("{op}: {} has no gradient", NAMES[i])))
        .collect();
    let t64: Vec<Tensor> = t.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
    let dy64 = dy.to_dtype(DType::F64).unwrap();
    let g_ref: Vec<Vec<f64>> =
        gradients(&Device::Cpu, &t64, &dy64, kind, elementary).into_iter().map(Option::unwrap).collect();
    let dn_ref = norm_output_gradient(&t64, &dy64, kind);

    let host: Vec<Vec<f64>> = t.iter().map(flat).collect();
    let (w, dys) = (&host[1], flat(&dy));
    let (xhat, rstd) = normalized(&host[0], C, EPS, kind == Kind::Layer);
    let (lo, hi) = xhat.iter().fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    let top = xhat.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    // half the 8-bit code step of x̂ (exact range, round to nearest) and the decode's fmaf
    let h = 0.5 * (hi - lo) / 255.0 * (1.0 + 1e-4) + 8.0 * U32 * top;
    let e = errors(&host, &xhat, &dys);
    // the decoding terms, for the reference's dn
    let common::NormBounds { dx: mut bx, dw: mut bw, db: mut bb } = norm_bounds(&xhat, &rstd, w, &dn_ref, h);
    let (mut bw1, mut bb1) = (vec![0.0; H * C], vec![0.0; H]);
    let (mut bw2, mut bb2) = (vec![0.0; C * H], vec![0.0; C]);
    let (ur, uc) = (R as f64 * U32, C as f64 * U32);
    for r in 0..R {
        // dn's error through the norm's backward, linear in g = dn·w: rstd·(|Δg| + mean|Δg| +
        // (|x̂| + h)·mean(|Δg|·(|x̂| + h))), |Δg| ≤ |w|·E_dn
        let dg: Vec<f64> = (0..C).map(|c| w[c].abs() * e.edn[r * C + c]).collect();
        let mean_dg = dg.iter().sum::<f64>() / C as f64;
        let mean_dgx = (0..C).map(|c| dg[c] * (xhat[r * C + c].abs() + h)).sum::<f64>() / C as f64;
        for c in 0..C {
            let (i, x) = (r * C + c, xhat[r * C + c].abs() + h);
            bx[i] += rstd[r] * (dg[c] + mean_dg + x * mean_dgx + 8.0 * uc * (dg[c] + mean_dg));
            bw[c] += e.edn[i] * x;
            bb[c] += e.edn[i];
            bb2[c] += ur * dys[i].abs();
        }
        for j in 0..H {
            let k = r * H + j;
            bb1[j] += e.edh[k] + ur * e.dh[k];
            for c in 0..C {
                let i = r * C + c;
                // dW₁ = dhᵀ·n
                bw1[j * C + c] += e.edh[k] * e.n[i] + e.dh[k] * e.en[i] + ur * e.dh[k] * e.n[i];
                // dW₂ = dyᵀ·gelu(h): |gelu(h)| ≤ |h|, its error ≤ 1.13·E_h + 8u·(1 + |h|)
                bw2[c * H + j] += dys[i].abs() * (1.13 * e.eh[k] + 8.0 * U32 * (1.0 + e.h[k]) + ur * e.h[k]);
            }
        }
    }
    let bounds = [bx, bw, bb, bw1, bb1, bw2, bb2];
    for (i, bound) in bounds.iter().enumerate() {
        // the result stored in f32 (and dx's residual sum): 2u₃₂ of its value
        let bound: Vec<f64> = bound.iter().zip(&g_ref[i]).map(|(b, r)| b + 2.0 * U32 * r.abs()).collect();
        assert_within(&format!("{op} block d{}", NAMES[i]), &g[i], &g_ref[i], &bound);
    }
}

#[test]
fn mesa_layer_norm_block_gets_every_gradient() {
    our_norm_gets_every_gradient(Kind::Layer, "mesa layer_norm");
}

#[test]
fn mesa_rms_norm_block_gets_every_gradient() {
    our_norm_gets_every_gradient(Kind::Rms, "mesa rms_norm");
}
