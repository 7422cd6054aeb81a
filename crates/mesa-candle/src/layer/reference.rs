//! The same layer written with candle's differentiable ops only (f32 or f64): the baseline
//! of the memory table and the oracle of gradient parity. Same parameters (one variable per
//! named weight), same dropout masks.
use std::collections::HashMap;

use candle_core::{DType, Tensor, Var, D};

use super::dropout::{self, DropoutSite};
use super::{Attention, LayerConfig, NormPlacement};
use crate::ops::FeatureKind;

/// One variable per parameter name, in `dtype`, from a flat f32 tensor laid out as `layout`.
///
/// # Errors
/// candle's errors.
pub fn variables(
    layout: &super::ParamLayout,
    flat: &Tensor,
    dtype: DType,
) -> candle_core::Result<HashMap<&'static str, Var>> {
    layout
        .unflatten(flat)?
        .into_iter()
        .map(|(n, t)| Ok((n, Var::from_tensor(&t.to_dtype(dtype)?.contiguous()?)?)))
        .collect()
}

fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

fn linear(x: &Tensor, p: &HashMap<&'static str, Var>, name: &str) -> candle_core::Result<Tensor> {
    let w = p[format!("{name}.weight").as_str()].as_tensor();
    let b = p[format!("{name}.bias").as_str()].as_tensor();
    x.broadcast_matmul(&w.t()?)?.broadcast_add(b)
}

/// The plain-candle forward of `config` with dropout seed `seed`; `x: [B, N, C]` of the
/// variables' dtype. Linear attention: ReLU and ELU+1 maps, written as the masked quadratic
/// form `A = φ(Q)φ(K)ᵀ`, `out = A·V / (A·1 + ε)` (non-negative features).
///
/// # Errors
/// candle's errors; FAVOR+ is not written here ([`crate::Error::InvalidArgument`]).
pub fn forward(
    config: &LayerConfig,
    p: &HashMap<&'static str, Var>,
    x: &Tensor,
    seed: u64,
) -> candle_core::Result<Tensor> {
    let (b, n, c) = x.dims3()?;
    let (h, d) = (config.heads, config.head_dim());
    let dtype = x.dtype();
    let eps = f64::from(config.eps);
    let mask = |site, shape: &[usize]| -> candle_core::Result<Option<Tensor>> {
        let prob = if site == DropoutSite::Attention { config.dropout.attention } else { config.dropout.residual };
        dropout::mask(seed, site, prob, shape, x.device())?.map(|m| m.to_dtype(dtype)).transpose()
    };
    let ln = |t: &Tensor, name: &str| {
        layer_norm(
            t,
            p[format!("{name}.weight").as_str()].as_tensor(),
            p[format!("{name}.bias").as_str()].as_tensor(),
            eps,
        )
    };
    let pre = config.norm == NormPlacement::Pre;
    let attn_in = if pre { ln(x, "ln_1")? } else { x.clone() };
    let heads = |t: Tensor| t.reshape((b, n, h, d))?.transpose(1, 2)?.contiguous();
    let q = heads(linear(&attn_in, p, "attn.q_proj")?)?;
    let k = heads(linear(&attn_in, p, "attn.k_proj")?)?;
    let v = heads(linear(&attn_in, p, "attn.v_proj")?)?;
    let o = match &config.attention {
        Attention::Softmax { causal } => {
            let mut s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
            if *causal {
                let m: Vec<f64> = (0..n * n).map(|i| if i % n > i / n { f64::NEG_INFINITY } else { 0.0 }).collect();
                s = s.broadcast_add(&Tensor::from_vec(m, (n, n), x.device())?.to_dtype(dtype)?)?;
            }
            let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
            let prob = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
            let prob = dropout::apply(&prob, mask(DropoutSite::Attention, prob.dims())?.as_ref())?;
            prob.matmul(&v)?
        }
        Attention::Linear { config: la, map } => {
            let phi = |t: &Tensor| match map {
                FeatureKind::Relu => t.relu(),
                FeatureKind::Elu1 => t.elu(1.0)? + 1.0,
                FeatureKind::Favor(_) => Err(crate::Error::InvalidArgument {
                    name: "map",
                    why: "FAVOR+ is not in the reference layer".into(),
                }
                .into()),
            };
            let mut a = phi(&q)?.matmul(&phi(&k)?.t()?)?;
            if la.causal {
                let m: Vec<f64> = (0..n * n).map(|i| if i % n > i / n { 0.0 } else { 1.0 }).collect();
                a = a.broadcast_mul(&Tensor::from_vec(m, (n, n), x.device())?.to_dtype(dtype)?)?;
            }
            let den = (a.sum_keepdim(D::Minus1)? + f64::from(la.eps))?;
            a.matmul(&v)?.broadcast_div(&den)?
        }
    };
    let o = o.transpose(1, 2)?.contiguous()?.reshape((b, n, c))?;
    let r =
        dropout::apply(&linear(&o, p, "attn.out_proj")?, mask(DropoutSite::AttentionResidual, &[b, n, c])?.as_ref())?;
    let x2 = if pre { (x + r)? } else { ln(&(x + r)?, "ln_1")? };
    let ffn_in = if pre { ln(&x2, "ln_2")? } else { x2.clone() };
    let g = linear(&ffn_in, p, "mlp.fc_in")?.gelu_erf()?;
    let f = dropout::apply(&linear(&g, p, "mlp.fc_out")?, mask(DropoutSite::FfnResidual, &[b, n, c])?.as_ref())?;
    if pre {
        x2 + f
    } else {
        ln(&(x2 + f)?, "ln_2")
    }
}
