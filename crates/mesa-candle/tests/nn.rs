//! `mesa_candle::nn` against candle-nn: a model written once and built twice from one
//! `VarMap`, under `use candle_nn as nn` and under `use mesa_candle::nn`, and the
//! constructors' weight names.
//!
//! The gradient reference is the model written with candle's elementary ops in f64 (on the
//! CPU): candle-nn 0.11.1's fused LayerNorm (contiguous input with a bias), RmsNorm and
//! `softmax_last_dim` record no backward, so their gradients silently vanish.
//!
//! Bounds, everything in f32 (`u = 2⁻²⁴`), to first order in `u` and in the code step:
//! * forward: each op's own rounding (a sum of `n` products within `(n+2)u·Σ|terms|`; a
//!   norm's variance within `3(C+3)u·mean(x²)`, its mean within `C·u·mean|x|`; the GELU
//!   kernel within `u|y| + 8u(1+|y|)`, as in `tests/ops.rs`) plus the input's error carried
//!   by the op's derivative (`|gelu'| ≤ 1.13`; a norm's `rstd·(e + mean e + |x̂|·mean(|x̂|e))`);
//! * backward: each saved tensor decodes within `h` of its f64 value (half the 8-bit step of
//!   its exact range widened by its forward error, plus that error and the decode's `fmaf`);
//!   each op's decoding terms are those of `tests/ops.rs` (a norm's
//!   `rstd·(h|m| + |x̂|h·mean|g| + h²·mean|g|)`, a Linear's `Σ_rows |dy|·h`, GELU's
//!   `|dy|·max|gelu''|·h`), and the error of its incoming gradient is carried through the
//!   op's exact backward in absolute values.
mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{assert_within, flat, Rng};
use mesa_candle::nn;

/// f32's unit roundoff: the models run in f32.
const U: f64 = 1.0 / 16_777_216.0;
const IN: usize = 16;
const HID: usize = 24;
const OUT: usize = 8;
const LN_EPS: f64 = 1e-5;
const RMS_EPS: f64 = 1e-6;
/// `max |gelu'| = gelu'(√2) = Φ(√2) + √2·φ(√2) = 1.1289` (erf form).
const GELU1: f64 = 1.13;
/// `max |gelu''| = 2φ(0)` (erf form).
const GELU2: f64 = 0.797_884_560_802_865_4;

/// The model, written once against a module `nn` (candle-nn's or ours) and a `gelu`:
/// `x → Linear → LayerNorm → GELU → Linear → RmsNorm`.
macro_rules! mlp {
    () => {
        pub struct Mlp {
            fc1: nn::Linear,
            ln: nn::LayerNorm,
            fc2: nn::Linear,
            norm: nn::RmsNorm,
        }

        impl Mlp {
            pub fn new(vb: nn::VarBuilder) -> Result<Self> {
                Ok(Mlp {
                    fc1: nn::linear(super::IN, super::HID, vb.pp("fc1"))?,
                    ln: nn::layer_norm(super::HID, super::LN_EPS, vb.pp("ln"))?,
                    fc2: nn::linear(super::HID, super::OUT, vb.pp("fc2"))?,
                    norm: nn::rms_norm(super::OUT, super::RMS_EPS, vb.pp("norm"))?,
                })
            }

            pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
                let h = self.ln.forward(&self.fc1.forward(xs)?)?;
                self.norm.forward(&self.fc2.forward(&gelu(&h)?)?)
            }

            /// The tensors the layers hold.
            pub fn params(&self) -> Vec<Tensor> {
                let mut p = vec![self.fc1.weight().clone()];
                p.extend(self.fc1.bias().cloned());
                p.push(self.ln.weight().clone());
                p.extend(self.ln.bias().cloned());
                p.push(self.fc2.weight().clone());
                p.extend(self.fc2.bias().cloned());
                p.push(self.norm.weight().clone());
                p
            }
        }
    };
}

mod with_candle_nn {
    use candle_core::{Module, Result, Tensor};
    use candle_nn as nn;

    fn gelu(xs: &Tensor) -> Result<Tensor> {
        xs.gelu_erf()
    }

    mlp!();
}

mod with_mesa {
    use candle_core::{Result, Tensor};
    use mesa_candle::nn;
    use nn::Module;

    fn gelu(xs: &Tensor) -> Result<Tensor> {
        xs.apply(&nn::Gelu::erf())
    }

    mlp!();
}

/// Parameter names (the `VarMap`'s) with the mean and spread of their test values.
const PARAMS: [(&str, f64, f64); 7] = [
    ("fc1.weight", 0.0, 0.25),
    ("fc1.bias", 0.0, 0.3),
    ("ln.weight", 1.0, 0.3),
    ("ln.bias", 0.0, 0.3),
    ("fc2.weight", 0.0, 0.2),
    ("fc2.bias", 0.0, 0.3),
    ("norm.weight", 1.0, 0.3),
];

/// `|a|·|b|`.
fn absmm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.abs()?.matmul(&b.abs()?)
}

fn max_abs(t: &Tensor) -> Result<f64> {
    t.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
}

/// A bound as an f64 vector, for [`assert_within`].
fn v(t: &Tensor) -> Vec<f64> {
    flat(t)
}

/// Half the step of 8-bit codes of `t`'s exact range when the tensor encoded is within `e`
/// of `t`, plus `e` and the decode's rounding: every decoded value is within this of `t`.
/// (`1 + 1e-4`: the scale computed in f32, as in `tests/ops.rs`.)
fn decoded_within(t: &Tensor, e: &Tensor) -> Result<f64> {
    let t = t.flatten_all()?;
    let (lo, hi) = (t.min(0)?.to_scalar::<f64>()?, t.max(0)?.to_scalar::<f64>()?);
    let e = max_abs(e)?;
    Ok((hi - lo + 2.0 * e) / (2.0 * 255.0) * (1.0 + 1e-4) + e + 8.0 * U * max_abs(&t)?)
}

/// Forward error of `y = x·Wᵀ + b` in f32 from `x` known within `e`.
fn linear_fwd(x: &Tensor, e: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let n = w.dim(1)? as f64;
    let own = (absmm(x, &w.t()?)?.broadcast_add(&b.abs()?)? * ((n + 2.0) * U))?;
    e.matmul(&w.abs()?.t()?)? + own
}

/// A norm's forward error: `x̂` and the relative error of `rstd`.
struct NormFwd {
    xhat: Tensor,
    rstd_rel: Tensor,
}

/// `x̂ = (x − [mean x])·rstd` (centred: LayerNorm) in f32 from `x` known within `e`.
fn norm_fwd(center: bool, x: &Tensor, e: &Tensor, xhat: &Tensor, rstd: &Tensor) -> Result<NormFwd> {
    let c = x.dim(1)? as f64;
    let ax = xhat.abs()?;
    // the input's error: δx̂ = rstd·(δx − [mean δx] − x̂·mean(x̂·δx_c)), δx_c = δx − [mean δx]
    let ec = if center { e.broadcast_add(&e.mean_keepdim(1)?)? } else { e.clone() };
    let carried = (&ec + ax.broadcast_mul(&(&ax * &ec)?.mean_keepdim(1)?)?)?.broadcast_mul(rstd)?;
    // its own rounding: the variance within 3(C+3)u·mean(x²), so rstd within ρ/2 + 3u with
    // ρ = 3(C+3)u·mean(x²)·rstd²; the centring and scaling 2u; the mean within C·u·mean|x|
    let rho = (x.sqr()?.mean_keepdim(1)? * rstd.sqr()?)?;
    let own_rel = ((rho * (1.5 * (c + 3.0) * U))? + 3.0 * U)?;
    let mut own = ax.broadcast_mul(&(&own_rel + 2.0 * U)?)?;
    if center {
        own = own.broadcast_add(&(x.abs()?.mean_keepdim(1)? * rstd)?.affine(c * U, 0.0)?)?;
    }
    // rstd's: its own, and the input's `rstd·mean(|x̂|·e_c)` (δrstd/rstd = −rstd·mean(x̂·δx_c))
    let rstd_rel = (own_rel + ((&ax * &ec)?.mean_keepdim(1)? * rstd)?)?;
    Ok(NormFwd { xhat: (carried + own)?, rstd_rel })
}

/// Errors of a backward's results.
struct Grads {
    dx: Tensor,
    dw: Tensor,
    db: Tensor,
}

/// Backward of a norm `y = x̂·w (+ b)` from `x̂` decoded within `h`, `rstd` within `rstd_rel`
/// (relative), the incoming gradient `dy` within `dy_err`; `dx` is the true input gradient.
#[allow(clippy::too_many_arguments)]
fn norm_bwd(
    center: bool,
    xhat: &Tensor,
    rstd: &Tensor,
    rstd_rel: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    dy_err: &Tensor,
    h: f64,
    dx: &Tensor,
) -> Result<Grads> {
    let (rows, cols) = xhat.dims2()?;
    let ax = xhat.abs()?;
    let g = dy.broadcast_mul(w)?;
    let dg = (dy_err.broadcast_mul(&w.abs()?)? + (g.abs()? * U)?)?;
    let ag = (g.abs()? + &dg)?;
    let mg = ag.mean_keepdim(1)?;
    let m = (&g * xhat)?.mean_keepdim(1)?.abs()?;
    // the incoming error through dx = rstd·(g − [mean g] − x̂·mean(g·x̂))
    let mut carried = (&dg + ax.broadcast_mul(&(&dg * (&ax + h)?)?.mean_keepdim(1)?)?)?;
    if center {
        carried = carried.broadcast_add(&dg.mean_keepdim(1)?)?;
    }
    // decoding (tests/ops.rs, norm_bounds), and the f32 sums over a row
    let decoding = (ax.broadcast_mul(&(&mg * h)?)?.broadcast_add(&((m * h)? + (&mg * (h * h))?)?))?;
    let arith = ((&ag + (&ax + 1.0)?.broadcast_mul(&mg)?)? * (8.0 * cols as f64 * U))?;
    let dx_err = ((carried + decoding)? + arith)?.broadcast_mul(rstd)?.add(&dx.abs()?.broadcast_mul(rstd_rel)?)?;
    let sums = (4.0 * rows as f64) * U;
    let dw = ((dy_err * (&ax + h)?)? + (dy.abs()? * ((ax * sums)? + (h + sums))?)?)?.sum(0)?;
    let db = (dy_err.sum(0)? + (dy.abs()?.sum(0)? * sums)?)?;
    Ok(Grads { dx: dx_err, dw, db })
}

/// Backward of `y = x·Wᵀ + b` from `x̂` decoded within `hx`, the incoming gradient `dy`
/// within `dy_err`.
fn linear_bwd(x: &Tensor, hx: f64, w: &Tensor, dy: &Tensor, dy_err: &Tensor) -> Result<Grads> {
    let (rows, n_out, n_in) = (x.dim(0)? as f64, w.dim(0)? as f64, w.dim(1)? as f64);
    let dx = (dy_err.matmul(&w.abs()?)? + (absmm(dy, w)? * ((n_out + 2.0) * U))?)?;
    let dy_cols = dy.abs()?.sum(0)?;
    let dw = ((dy_err.t()?.matmul(&(x.abs()? + hx)?)?
        + dy_cols.unsqueeze(1)?.broadcast_as((n_out as usize, n_in as usize))?.affine(hx, 0.0)?)?
        + (absmm(&dy.t()?, x)? * ((rows + 2.0) * U))?)?;
    let db = (dy_err.sum(0)? + (dy_cols * ((rows + 2.0) * U))?)?;
    Ok(Grads { dx, dw, db })
}

/// The model in candle's elementary ops, f64, with its intermediates and every gradient.
struct Reference {
    h1: Tensor,
    xhat1: Tensor,
    rstd1: Tensor,
    h2: Tensor,
    h3: Tensor,
    h4: Tensor,
    xhat4: Tensor,
    rstd4: Tensor,
    y: Tensor,
    /// Gradients of the parameters, by name, and of `h1` … `h4`.
    grads: HashMap<String, Tensor>,
}

/// The gradient of `Σ f(t)⊙dy` with respect to `t` (candle's autograd).
fn vjp(t: &Tensor, dy: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let v = Var::from_tensor(t)?;
    let store = (f(v.as_tensor())? * dy)?.sum_all()?.backward()?;
    Ok(store.get(v.as_tensor()).expect("a gradient").clone())
}

fn reference(p: &HashMap<&str, Tensor>, x: &Tensor, dy: &Tensor) -> Result<Reference> {
    let vars: HashMap<&str, Var> = p.iter().map(|(k, t)| Ok((*k, Var::from_tensor(t)?))).collect::<Result<_>>()?;
    let q = |k: &str| vars[k].as_tensor().clone();
    // the stages, over the parameters `q` (variables) or their values `p` (constants)
    let fc = |x: &Tensor, w: Tensor, b: Tensor| x.matmul(&w.t()?)?.broadcast_add(&b);
    let ln = |h: &Tensor| -> Result<(Tensor, Tensor)> {
        let xc = h.broadcast_sub(&h.mean_keepdim(1)?)?;
        let rstd = (xc.sqr()?.mean_keepdim(1)? + LN_EPS)?.sqrt()?.recip()?;
        Ok((xc.broadcast_mul(&rstd)?, rstd))
    };
    let rms = |h: &Tensor| -> Result<(Tensor, Tensor)> {
        let rstd = (h.sqr()?.mean_keepdim(1)? + RMS_EPS)?.sqrt()?.recip()?;
        Ok((h.broadcast_mul(&rstd)?, rstd))
    };
    let h1 = fc(x, q("fc1.weight"), q("fc1.bias"))?;
    let (xhat1, rstd1) = ln(&h1)?;
    let h2 = xhat1.broadcast_mul(&q("ln.weight"))?.broadcast_add(&q("ln.bias"))?;
    let h3 = h2.gelu_erf()?;
    let h4 = fc(&h3, q("fc2.weight"), q("fc2.bias"))?;
    let (xhat4, rstd4) = rms(&h4)?;
    let y = xhat4.broadcast_mul(&q("norm.weight"))?;
    let store = (&y * dy)?.sum_all()?.backward()?;
    let mut grads = HashMap::new();
    for (k, var) in &vars {
        grads.insert(k.to_string(), store.get(var.as_tensor()).expect("a gradient").clone());
    }
    // the intermediates' gradients, stage by stage (candle's backward keeps only the leaves')
    let d = |t: &Tensor| t.detach();
    let dh4 = vjp(&d(&h4), dy, |h| rms(h)?.0.broadcast_mul(&p["norm.weight"]))?;
    let dh3 = vjp(&d(&h3), &dh4, |h| fc(h, p["fc2.weight"].clone(), p["fc2.bias"].clone()))?;
    let dh2 = vjp(&d(&h2), &dh3, |h| h.gelu_erf())?;
    let dh1 = vjp(&d(&h1), &dh2, |h| ln(h)?.0.broadcast_mul(&p["ln.weight"])?.broadcast_add(&p["ln.bias"]))?;
    for (k, t) in [("h1", dh1), ("h2", dh2), ("h3", dh3), ("h4", dh4)] {
        grads.insert(k.to_string(), t);
    }
    Ok(Reference {
        h1: d(&h1),
        xhat1: d(&xhat1),
        rstd1: d(&rstd1),
        h2: d(&h2),
        h3: d(&h3),
        h4: d(&h4),
        xhat4: d(&xhat4),
        rstd4: d(&rstd4),
        y: d(&y),
        grads,
    })
}

/// The same model source built with `candle_nn` and with `mesa_candle::nn` from one
/// `VarMap`: the same variables; forward outputs within the f32 rounding bound of the f64
/// model (so within twice that of each other); our gradients of every parameter within the
/// bound of the codes and rounding (module docs), and that bound is below the largest
/// gradient of each parameter, so a missing gradient would fail.
#[test]
fn a_candle_nn_model_with_one_path_changed_matches_candle_in_f64() -> Result<()> {
    let mut rng = Rng::new("nn_model");
    let dev = common::device();
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let theirs = with_candle_nn::Mlp::new(vb.clone())?;
    let ours = with_mesa::Mlp::new(vb)?;
    assert_eq!(varmap.all_vars().len(), PARAMS.len(), "our constructors created no variable of their own");
    let same: Vec<bool> = theirs.params().iter().zip(ours.params()).map(|(a, b)| a.id() == b.id()).collect();
    assert_eq!(same, vec![true; PARAMS.len()], "both models hold the VarMap's tensors");

    let mut values = HashMap::new();
    for (name, mean, std) in PARAMS {
        let dims = varmap.data().lock().unwrap()[name].dims().to_vec();
        let t = rng.tensor(&dims, mean, std, DType::F32);
        varmap.set_one(name, t.to_device(&dev)?)?;
        values.insert(name, t.to_dtype(DType::F64)?);
    }
    let (b, n) = (2, 5);
    let x = rng.tensor(&[b, n, IN], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[b, n, OUT], 0.0, 1.0, DType::F32);

    let y_theirs = theirs.forward(&x.to_device(&dev)?)?;
    let y_ours = ours.forward(&x.to_device(&dev)?)?;
    assert_eq!(y_ours.dims(), [b, n, OUT]);
    let store = (&y_ours * dy.to_device(&dev)?)?.sum_all()?.backward()?;
    let vars = varmap.data().lock().unwrap().clone();

    let rows = b * n;
    let x64 = x.to_dtype(DType::F64)?.reshape((rows, IN))?;
    let dy64 = dy.to_dtype(DType::F64)?.reshape((rows, OUT))?;
    let r = reference(&values, &x64, &dy64)?;
    let p = |k: &str| values[k].clone();
    let g = |k: &str| r.grads[k].clone();

    // forward errors
    let zero_x = x64.zeros_like()?;
    let e_h1 = linear_fwd(&x64, &zero_x, &p("fc1.weight"), &p("fc1.bias"))?;
    let ln = norm_fwd(true, &r.h1, &e_h1, &r.xhat1, &r.rstd1)?;
    let affine = |xhat: &Tensor, e: &Tensor, w: &Tensor, b: Option<&Tensor>| -> Result<Tensor> {
        let y = xhat.broadcast_mul(w)?.abs()?;
        let y = match b {
            Some(b) => y.broadcast_add(&b.abs()?)?,
            None => y,
        };
        e.broadcast_mul(&w.abs()?)? + (y * (4.0 * U))?
    };
    let e_h2 = affine(&r.xhat1, &ln.xhat, &p("ln.weight"), Some(&p("ln.bias")))?;
    let e_h3 = ((&e_h2 * GELU1)? + ((r.h3.abs()? * (9.0 * U))? + 8.0 * U)?)?;
    let e_h4 = linear_fwd(&r.h3, &e_h3, &p("fc2.weight"), &p("fc2.bias"))?;
    let rms = norm_fwd(false, &r.h4, &e_h4, &r.xhat4, &r.rstd4)?;
    let e_y = affine(&r.xhat4, &rms.xhat, &p("norm.weight"), None)?;
    let y_ref = flat(&r.y);
    assert_within("mesa y", &flat(&y_ours), &y_ref, &v(&e_y));
    assert_within("candle-nn y", &flat(&y_theirs), &y_ref, &v(&e_y));
    assert_within("mesa y against candle-nn y", &flat(&y_ours), &flat(&y_theirs), &v(&(&e_y * 2.0)?));

    // backward errors, from the output back
    let h_x = decoded_within(&x64, &zero_x)?;
    let h_xhat1 = decoded_within(&r.xhat1, &ln.xhat)?;
    let h_h2 = decoded_within(&r.h2, &e_h2)?;
    let h_h3 = decoded_within(&r.h3, &e_h3)?;
    let h_xhat4 = decoded_within(&r.xhat4, &rms.xhat)?;
    let zero_dy = dy64.zeros_like()?;
    let (dh1, dh2, dh3, dh4) = (g("h1"), g("h2"), g("h3"), g("h4"));
    let rms_g = norm_bwd(false, &r.xhat4, &r.rstd4, &rms.rstd_rel, &p("norm.weight"), &dy64, &zero_dy, h_xhat4, &dh4)?;
    let fc2 = linear_bwd(&r.h3, h_h3, &p("fc2.weight"), &dh4, &rms_g.dx)?;
    let e_dh2 = ((&fc2.dx * (GELU1 + GELU2 * h_h2))?
        + (dh3.abs()? * ((r.h2.abs()? * (8.0 * U))? + (GELU2 * h_h2 + 8.0 * U))?)?
        + (dh2.abs()? * U)?)?;
    let ln_g = norm_bwd(true, &r.xhat1, &r.rstd1, &ln.rstd_rel, &p("ln.weight"), &dh2, &e_dh2, h_xhat1, &dh1)?;
    let fc1 = linear_bwd(&x64, h_x, &p("fc1.weight"), &dh1, &ln_g.dx)?;
    let bounds = [
        ("fc1.weight", fc1.dw),
        ("fc1.bias", fc1.db),
        ("ln.weight", ln_g.dw),
        ("ln.bias", ln_g.db),
        ("fc2.weight", fc2.dw),
        ("fc2.bias", fc2.db),
        ("norm.weight", rms_g.dw),
    ];
    for (name, bound) in bounds {
        let want = flat(&g(name));
        let got = flat(store.get(vars[name].as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient")));
        // and the f32 result's rounding
        let bound: Vec<f64> = flat(&bound).iter().zip(&want).map(|(b, w)| b + U * w.abs()).collect();
        assert_within(&format!("d{name}"), &got, &want, &bound);
        let top = (0..want.len()).max_by(|&i, &j| want[i].abs().total_cmp(&want[j].abs())).unwrap_or(0);
        assert!(
            bound[top] < want[top].abs(),
            "d{name}: the bound {:.3e} at the largest gradient {:.3e} would not see it vanish",
            bound[top],
            want[top]
        );
    }
    Ok(())
}

/// Where the constructors look: candle-nn's names (`weight`, `bias`; `gamma`, `beta` for the
/// norms) under the builder's prefix, and the shapes they ask for.
#[test]
fn constructors_read_candle_nn_names() -> Result<()> {
    let mut rng = Rng::new("nn_names");
    let dev = Device::Cpu;
    let shapes: [(&str, &[usize]); 8] = [
        ("fc.weight", &[3, 4]),
        ("fc.bias", &[3]),
        ("nb.weight", &[3, 4]),
        ("ln.weight", &[4]),
        ("ln.bias", &[4]),
        ("old.gamma", &[4]),
        ("old.beta", &[4]),
        ("rms.weight", &[4]),
    ];
    let tensors: HashMap<String, Tensor> =
        shapes.iter().map(|(k, s)| (k.to_string(), rng.tensor(s, 0.0, 1.0, DType::F32))).collect();
    let vb = VarBuilder::from_tensors(tensors.clone(), DType::F32, &dev);
    let is = |t: &Tensor, name: &str| assert_eq!(flat(t), flat(&tensors[name]), "{name}");

    let fc = nn::linear(4, 3, vb.pp("fc"))?;
    is(fc.weight(), "fc.weight");
    is(fc.bias().expect("a bias"), "fc.bias");
    let nb = nn::linear_no_bias(4, 3, vb.pp("nb"))?;
    is(nb.weight(), "nb.weight");
    assert!(nb.bias().is_none());
    assert!(nn::linear_b(4, 3, false, vb.pp("nb"))?.bias().is_none());
    assert!(nn::linear(4, 3, vb.pp("nb")).is_err(), "no nb.bias");
    assert!(nn::linear(5, 3, vb.pp("fc")).is_err(), "fc.weight is [3, 4], not [3, 5]");

    let ln = nn::layer_norm(4, 1e-5, vb.pp("ln"))?;
    is(ln.weight(), "ln.weight");
    is(ln.bias().expect("a bias"), "ln.bias");
    assert!(ln.remove_mean());
    assert_eq!(ln.eps(), 1e-5);
    let old = nn::layer_norm(4, candle_nn::LayerNormConfig::default(), vb.pp("old"))?;
    is(old.weight(), "old.gamma");
    is(old.bias().expect("a bias"), "old.beta");
    let no_bias = nn::layer_norm_no_bias(4, 1e-5, vb.pp("rms"))?;
    is(no_bias.weight(), "rms.weight");
    assert!(no_bias.bias().is_none());
    let rms = nn::rms_norm(4, 1e-6, vb.pp("rms"))?;
    is(rms.weight(), "rms.weight");
    assert_eq!(rms.eps(), 1e-6);
    assert!(!rms.clone().into_inner().remove_mean());
    assert!(nn::rms_norm(4, 1e-6, vb.pp("ln2")).is_err(), "no ln2.weight");
    Ok(())
}

/// The configs' defaults are candle-nn's plus the default codes: 8 bits, round to nearest,
/// exact statistics; `f64` and candle-nn's config convert.
#[test]
fn configs_have_candle_nn_defaults() {
    use mesa_candle::ops::{Codes, Grouping, QuantConfig, Rounding, StatsMode};
    let codes = Codes::default();
    let q = QuantConfig::from(codes);
    assert_eq!((q.bits, q.rounding, q.stats, q.grouping), (8, Rounding::Nearest, StatsMode::Exact, Grouping::Tensor));
    assert_eq!(Codes::bits(4).running().stats, StatsMode::Running);
    let c = nn::LayerNormConfig::default();
    let theirs = candle_nn::LayerNormConfig::default();
    assert_eq!((c.eps, c.remove_mean, c.affine, c.codes), (theirs.eps, theirs.remove_mean, theirs.affine, codes));
    assert_eq!(nn::LayerNormConfig::from(theirs), c);
    assert_eq!(nn::LayerNormConfig::from(1e-6), nn::LayerNormConfig { eps: 1e-6, ..c });
    let rms_off = candle_nn::LayerNormConfig { eps: 1e-6, remove_mean: false, affine: false };
    assert_eq!(
        nn::LayerNormConfig::from(rms_off),
        nn::LayerNormConfig { eps: 1e-6, remove_mean: false, affine: false, codes }
    );
    assert_eq!(nn::RmsNormConfig::from(1e-6), nn::RmsNormConfig { eps: 1e-6, codes });
}

/// LayerNorm without a bias (the kernel with a zero one) and without mean removal but with
/// a bias (RMSNorm, then candle's add): the forward within the f32 bound of the f64 norm,
/// and the bias gradient `Σ_rows dy` within the f32 sum's rounding.
#[test]
fn layer_norm_variants_match_f64() -> Result<()> {
    let mut rng = Rng::new("nn_norm_variants");
    let dev = common::device();
    let (rows, cols, eps) = (6, 12, 1e-5);
    let x = rng.tensor(&[rows, cols], 0.5, 1.5, DType::F32);
    let w = rng.tensor(&[cols], 1.0, 0.3, DType::F32);
    let b = rng.tensor(&[cols], 0.0, 0.3, DType::F32);
    let dy = rng.tensor(&[rows, cols], 0.0, 1.0, DType::F32);
    let (x64, w64, b64) = (x.to_dtype(DType::F64)?, w.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    for center in [true, false] {
        let (wv, bv) = (Var::from_tensor(&w.to_device(&dev)?)?, Var::from_tensor(&b.to_device(&dev)?)?);
        let layer = if center {
            nn::LayerNorm::new_no_bias(wv.as_tensor().clone(), eps)
        } else {
            let config = nn::LayerNormConfig { remove_mean: false, ..nn::LayerNormConfig::from(eps) };
            let vb = VarBuilder::from_tensors(
                [("weight".to_string(), wv.as_tensor().clone()), ("bias".to_string(), bv.as_tensor().clone())].into(),
                DType::F32,
                &dev,
            );
            nn::layer_norm(cols, config, vb)?
        };
        let y = layer.forward(&x.to_device(&dev)?)?;
        let xc = if center { x64.broadcast_sub(&x64.mean_keepdim(1)?)? } else { x64.clone() };
        let rstd = (xc.sqr()?.mean_keepdim(1)? + eps)?.sqrt()?.recip()?;
        let xhat = xc.broadcast_mul(&rstd)?;
        let y_ref = xhat.broadcast_mul(&w64)?;
        let y_ref = if center { y_ref } else { y_ref.broadcast_add(&b64)? };
        let e = norm_fwd(center, &x64, &x64.zeros_like()?, &xhat, &rstd)?.xhat;
        let terms = xhat.broadcast_mul(&w64)?.abs()?;
        let terms = if center { terms } else { terms.broadcast_add(&b64.abs()?)? };
        let bound = (e.broadcast_mul(&w64.abs()?)? + (terms * (4.0 * U))?)?;
        assert_within(&format!("center {center}: y"), &flat(&y), &flat(&y_ref), &v(&bound));
        let store = (&y * dy.to_device(&dev)?)?.sum_all()?.backward()?;
        assert!(store.get(wv.as_tensor()).is_some(), "center {center}: a weight gradient");
        if !center {
            let db = flat(store.get(bv.as_tensor()).expect("a bias gradient"));
            let dy64 = dy.to_dtype(DType::F64)?;
            let want = flat(&dy64.sum(0)?);
            let bound = flat(&(dy64.abs()?.sum(0)? * ((rows + 2) as f64 * U))?);
            assert_within("rms + bias: db", &db, &want, &bound);
        }
    }
    Ok(())
}

/// `Softmax` as a `Module` and `nn::softmax_last_dim` are the op without a mask, bit for bit,
/// and within `tests/ops.rs`'s forward bound of the f64 softmax.
#[test]
fn softmax_module_is_the_op_without_mask() -> Result<()> {
    let mut rng = Rng::new("nn_softmax");
    let dev = common::device();
    let x = rng.tensor(&[3, 11], 0.0, 2.0, DType::F32).to_device(&dev)?;
    let op = nn::Softmax::default();
    let y = flat(&op.forward(&x, None)?);
    assert_eq!(flat(&x.apply(&op)?), y);
    assert_eq!(flat(&nn::softmax_last_dim(&x)?), y);
    let x64 = x.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let e = x64.broadcast_sub(&x64.max_keepdim(1)?)?.exp()?;
    let want = flat(&e.broadcast_div(&e.sum_keepdim(1)?)?);
    let bound: Vec<f64> = want.iter().map(|v| U * v + 16.0 * U).collect();
    assert_within("softmax y", &y, &want, &bound);
    Ok(())
}

/// `Gelu::erf()` uses each call's exact range: a call on a narrow input after one on a wide
/// input has the gradient bound of its own step (with Mesa's running estimate the step
/// would come from a range ~0.9 of the wide one's).
#[test]
fn gelu_erf_default_uses_exact_statistics() -> Result<()> {
    let mut rng = Rng::new("nn_gelu_exact");
    let dev = common::device();
    let gelu = nn::Gelu::erf();
    let wide = rng.tensor(&[4, 64], 0.0, 8.0, DType::F32).to_device(&dev)?;
    let _ = wide.apply(&gelu)?;
    let x = rng.tensor(&[4, 64], 0.0, 0.5, DType::F32);
    let dy = rng.tensor(&[4, 64], 0.0, 1.0, DType::F32);
    let (_, g) = common::grads_on(&dev, std::slice::from_ref(&x), &dy, |t| t[0].apply(&gelu));
    let (_, g_ref) = common::grads(&common::to_f64(std::slice::from_ref(&x)), &dy, |t| t[0].gelu_erf());
    let (xs, dys) = (flat(&x), flat(&dy));
    let lo = xs.iter().copied().fold(f64::MAX, f64::min);
    let hi = xs.iter().copied().fold(f64::MIN, f64::max);
    let h = 0.5 * (hi - lo) / 255.0 * (1.0 + 1e-4) + 4.0 * U;
    let bound: Vec<f64> = (0..xs.len())
        .map(|i| dys[i].abs() * (GELU2 * h + 8.0 * U * (1.0 + xs[i].abs())) + U * g_ref[0][i].abs())
        .collect();
    assert_within("gelu dx after a wide call", &g[0], &g_ref[0], &bound);
    Ok(())
}

/// A layer fed an input of another width names the input and both widths; an eps the
/// kernels cannot take (0 in f32) names the op and the value given, not its f32 rounding.
#[test]
fn norm_errors_name_the_input_and_the_given_eps() -> Result<()> {
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let x = Tensor::ones((2, 7), DType::F32, &dev)?;
    let ln = nn::layer_norm(8, 1e-5, vb.pp("ln"))?;
    let e = ln.forward(&x).expect_err("width 7 into a layer of 8");
    assert_eq!(
        e.to_string(),
        "layer norm input [..., C] (C = 8: weight [C] is [8]): expected shape [2, 8], got [2, 7]"
    );
    let rms = nn::rms_norm(8, 1e-5, vb.pp("rms"))?;
    let e = rms.forward(&x).expect_err("width 7 into a layer of 8");
    assert_eq!(e.to_string(), "rms norm input [..., C] (C = 8: weight [C] is [8]): expected shape [2, 8], got [2, 7]");
    let x = Tensor::ones((2, 8), DType::F32, &dev)?;
    let e = nn::rms_norm(8, 1e-50, vb.pp("tiny"))?.forward(&x).expect_err("eps 0 in f32");
    assert_eq!(e.to_string(), "rms norm eps: must be positive and finite in f32 (the kernels' precision), got 1e-50");
    let e = nn::layer_norm(8, 0.0, vb.pp("zero"))?.forward(&x).expect_err("eps 0");
    assert!(e.to_string().starts_with("layer norm eps: must be positive"), "{e}");
    Ok(())
}
