//! The same layer written with candle's differentiable ops only (f32 or f64): the baseline
//! of the memory table and the oracle of gradient parity. Same parameters (one variable per
//! named weight), same dropout masks.
use std::collections::HashMap;

use candle_core::{DType, Tensor, Var, D};

use super::dropout::{self, DropoutSite};
use super::params::GateNames;
use super::{Attention, LayerConfig, NormPlacement};
use crate::ops::FeatureKind;
use crate::parallel::SeqParallel;

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
    forward_impl(config, p, x, seed, None)
}

/// [`forward`] on rank `r` of a tensor- and sequence-parallel group (Korthikanti et al.
/// 2022, §4.2.2), with candle's autograd through the conjugate operators of
/// [`SeqParallel`]: `x` is the rank's rows `[B, S_r, C]`, `p` the rank's slices of the
/// weights ([`super::ParamLayout::sharded`] names and shapes, e.g. cut by
/// [`super::ParamLayout::shard`]). LayerNorms run on the rank's rows with their weights
/// passed through [`SeqParallel::replicated`] (their gradients are summed over the ranks);
/// the sequence is all-gathered into the Q, K, V and first FFN projections (column parallel:
/// the rank's `H/t` heads, `F/t` units; [`SeqParallel::column_linear`], which keeps only the
/// rank's rows for the backward) and the partial outputs of the output
/// projection and second FFN linear are reduce-scattered with their bias
/// ([`SeqParallel::row_linear`], which keeps no partial product). Dropout masks are
/// the rank's part of the unsharded layer's. The result is the rank's rows `[B, S_r, C]`.
///
/// # Errors
/// As [`forward`]; [`crate::Error::Collective`] from the group.
pub fn forward_sharded(
    config: &LayerConfig,
    p: &HashMap<&'static str, Var>,
    x: &Tensor,
    seed: u64,
    sp: &SeqParallel,
) -> candle_core::Result<Tensor> {
    forward_impl(config, p, x, seed, Some(sp))
}

fn forward_impl(
    config: &LayerConfig,
    p: &HashMap<&'static str, Var>,
    x: &Tensor,
    seed: u64,
    sp: Option<&SeqParallel>,
) -> candle_core::Result<Tensor> {
    if let super::Block::Llama(block) = config.block {
        if sp.is_some() {
            let why = "the sharded reference is written for the GPT block (the sharded Llama block is \
                       checked against the unsharded reference)";
            return Err(crate::Error::InvalidArgument { name: "block", why: why.into() }.into());
        }
        config.validate()?;
        return llama_forward(config, &block, p, x, seed);
    }
    let (b, n_r, c) = x.dims3()?;
    let (t, rank) = sp.map_or((1, 0), |sp| (sp.comm().world_size(), sp.comm().rank()));
    let (offset, _) = sp.map_or((0, n_r), SeqParallel::shard);
    let n = sp.map_or(n_r, |sp| sp.splits().iter().sum());
    let (h, d) = (config.heads / t, config.head_dim());
    let dtype = x.dtype();
    let eps = f64::from(config.eps);
    // the rank's part (its heads, its rows) of the unsharded layer's mask
    let mask = |site, local: &[usize]| -> candle_core::Result<Option<Tensor>> {
        let prob = if site == DropoutSite::Attention { config.dropout.attention } else { config.dropout.residual };
        let mut full = local.to_vec();
        let (start, len) = if site == DropoutSite::Attention {
            full[1] = config.heads;
            (rank * local[1], local[1])
        } else {
            full[1] = n;
            (offset, local[1])
        };
        dropout::mask(seed, site, prob, &full, x.device())?
            .map(|m| m.narrow(1, start, len)?.contiguous()?.to_dtype(dtype))
            .transpose()
    };
    let replicated = |w: &Tensor| sp.map_or_else(|| Ok(w.clone()), |sp| sp.replicated(w));
    let ln = |t: &Tensor, name: &str| {
        layer_norm(
            t,
            &replicated(p[format!("{name}.weight").as_str()].as_tensor())?,
            &replicated(p[format!("{name}.bias").as_str()].as_tensor())?,
            eps,
        )
    };
    // `residual + D(t·Wᵀ + b)` of a row-parallel linear, on the rank's rows
    let row_parallel = |t: &Tensor, name: &str, site, residual: &Tensor| -> candle_core::Result<Tensor> {
        let r = match sp {
            None => linear(t, p, name)?,
            Some(sp) => sp.row_linear(
                t,
                p[format!("{name}.weight").as_str()].as_tensor(),
                p[format!("{name}.bias").as_str()].as_tensor(),
            )?,
        };
        residual + dropout::apply(&r, mask(site, &[b, n_r, c])?.as_ref())?
    };
    let pre = config.norm == NormPlacement::Pre;
    let attn_in = if pre { ln(x, "ln_1")? } else { x.clone() };
    let (q, k, v) = match sp {
        None => (
            linear(&attn_in, p, "attn.q_proj")?,
            linear(&attn_in, p, "attn.k_proj")?,
            linear(&attn_in, p, "attn.v_proj")?,
        ),
        Some(sp) => {
            // g and the Q, K, V projections in one op that keeps only the rank's rows
            let cat = |suffix: &str| {
                let parts: Vec<&Tensor> =
                    ["q", "k", "v"].iter().map(|m| p[format!("attn.{m}_proj.{suffix}").as_str()].as_tensor()).collect();
                Tensor::cat(&parts, 0)
            };
            let qkv = sp.column_linear(&attn_in, &cat("weight")?, &cat("bias")?)?;
            (qkv.narrow(2, 0, h * d)?, qkv.narrow(2, h * d, h * d)?, qkv.narrow(2, 2 * h * d, h * d)?)
        }
    };
    let gate = match &config.attention {
        Attention::InputGated { .. } if sp.is_some() => None, // refused below
        Attention::InputGated { .. } => Some(input_gate(&attn_in, p, GateNames::of(config.block))?),
        _ => None,
    };
    drop(attn_in);
    let heads = |t: Tensor| t.reshape((b, n, h, d))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
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
        Attention::InputGated { .. } if sp.is_some() => {
            let why = "input-gated attention in a sharded layer is not in the reference (the layer refuses it)".into();
            return Err(crate::Error::InvalidArgument { name: "attention", why }.into());
        }
        // the rank's heads' decays (a GPT block: one per head)
        Attention::Gated { config: g, log_decay } => {
            let mine = log_decay.get(rank * h..(rank + 1) * h).ok_or_else(|| crate::Error::InvalidArgument {
                name: "log_decay",
                why: format!("{} values for {} heads", log_decay.len(), config.heads),
            })?;
            gated_quadratic(&q, &k, &v, g, RefDecay::PerHead(mine))?
        }
        Attention::InputGated { config: g } => {
            let a = gate.ok_or(crate::Error::StateConsumed { op: "reference input gate" })?;
            gated_quadratic(&q, &k, &v, g, RefDecay::PerStep(&a))?
        }
    };
    let o = o.transpose(1, 2)?.contiguous()?.reshape((b, n, h * d))?;
    let z1 = row_parallel(&o, "attn.out_proj", DropoutSite::AttentionResidual, x)?;
    let x2 = if pre { z1 } else { ln(&z1, "ln_1")? };
    let ffn_in = if pre { ln(&x2, "ln_2")? } else { x2.clone() };
    let u = match sp {
        None => linear(&ffn_in, p, "mlp.fc_in")?,
        Some(sp) => sp.column_linear(&ffn_in, p["mlp.fc_in.weight"].as_tensor(), p["mlp.fc_in.bias"].as_tensor())?,
    };
    let g = u.gelu_erf()?;
    let z2 = row_parallel(&g, "mlp.fc_out", DropoutSite::FfnResidual, &x2)?;
    if pre {
        Ok(z2)
    } else {
        ln(&z2, "ln_2")
    }
}

/// `x̂·w`, `x̂ = x/√(mean(x²) + eps)` over the last axis.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// RoPE (RoFormer eq. 34) of `x: [B, heads, N, d]` with angles `θ = p·base^(−2i/R)` computed
/// in f64 on the host and rounded to `x`'s dtype.
fn rope(x: &Tensor, config: &mesa_kernels::rope::RopeConfig) -> candle_core::Result<Tensor> {
    use mesa_kernels::rope::RopePairing;
    let (_, _, n, d) = x.dims4()?;
    let r = config.rotary_dims.unwrap_or(d);
    let half = r / 2;
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for s in 0..n {
        for i in 0..half {
            let inv_freq = f64::from(config.base).powf(-2.0 * i as f64 / r as f64);
            let theta = (config.position_offset + s) as f64 * inv_freq;
            cos.push(theta.cos());
            sin.push(theta.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (n, half), x.device())?.to_dtype(x.dtype())?;
    let sin = Tensor::from_vec(sin, (n, half), x.device())?.to_dtype(x.dtype())?;
    let rot = x.narrow(3, 0, r)?;
    let (x1, x2) = match config.pairing {
        RopePairing::Halves => (rot.narrow(3, 0, half)?, rot.narrow(3, half, half)?),
        RopePairing::Interleaved => {
            let pairs = rot.reshape((x.dim(0)?, x.dim(1)?, n, half, 2))?;
            (pairs.narrow(4, 0, 1)?.squeeze(4)?, pairs.narrow(4, 1, 1)?.squeeze(4)?)
        }
    };
    let y1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let y2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    let rotated = match config.pairing {
        RopePairing::Halves => Tensor::cat(&[&y1, &y2], 3)?,
        RopePairing::Interleaved => Tensor::stack(&[&y1, &y2], 4)?.flatten_from(3)?,
    };
    if r == d {
        Ok(rotated)
    } else {
        Tensor::cat(&[&rotated, &x.narrow(3, r, d - r)?], 3)
    }
}

/// The decay of [`gated_quadratic`]: fixed per KV head, or per step (`[B, H_kv, N]`, a tensor
/// of the graph: gradients reach what made it).
enum RefDecay<'a> {
    PerHead(&'a [f32]),
    PerStep(&'a Tensor),
}

/// The input gate of [`Attention::InputGated`] in plain candle ops: `a = −e^{A_log}·softplus(x̂·Wᵀ
/// + b)`, `[B, H_kv, N]`, from the projections' input `x_in: [B, N, C]`.
fn input_gate(x_in: &Tensor, p: &HashMap<&'static str, Var>, names: GateNames) -> candle_core::Result<Tensor> {
    let z = x_in.broadcast_matmul(&p[names.weight].as_tensor().t()?)?.broadcast_add(p[names.bias].as_tensor())?;
    let softplus = (z.relu()? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
    softplus.broadcast_mul(&p[names.a_log].as_tensor().exp()?.neg()?)?.transpose(1, 2)?.contiguous()
}

/// Gated attention ([`Attention::Gated`], [`Attention::InputGated`]) in its quadratic masked
/// form, `q, k, v: [B, H, N, d]` (K, V repeated to the query heads; the decay per KV head,
/// query head `h` reading KV head `⌊h/(H/H_kv)⌋`): `O = ((Q/√d)Kᵀ ∘ W) V` with
/// `W_ts = exp(Σ_{r=s+1..t} a_r)` for `s ≤ t`, else 0 — for a fixed decay `exp((t−s)·a_h)`, a
/// constant built on the host in f64; per step, the differences of the prefix sums of `a`
/// (masked before the exponential); normalised, each row divided by the guarded row sum
/// `g(x) = x + ε·sign(x)` of that matrix.
fn gated_quadratic(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    config: &mesa_kernels::gated_linear_attention::GatedConfig,
    decay: RefDecay<'_>,
) -> candle_core::Result<Tensor> {
    let (b, h, n, d) = q.dims4()?;
    let w = match decay {
        RefDecay::PerHead(log_decay) => {
            let group = h / log_decay.len().max(1);
            let mut w = vec![0f64; h * n * n];
            for hh in 0..h {
                let a = f64::from(log_decay[hh / group.max(1)]);
                for t in 0..n {
                    for s in 0..=t {
                        w[(hh * n + t) * n + s] = if s == t { 1.0 } else { ((t - s) as f64 * a).exp() };
                    }
                }
            }
            Tensor::from_vec(w, (1, h, n, n), q.device())?.to_dtype(q.dtype())?
        }
        RefDecay::PerStep(a) => {
            let kv = a.dim(1)?;
            let cs = a.cumsum(2)?;
            // [B, H_kv, t, s]: Σ_{r≤t} a_r − Σ_{r≤s} a_r
            let diff = cs.unsqueeze(3)?.broadcast_sub(&cs.unsqueeze(2)?)?;
            let m: Vec<u8> = (0..n * n).map(|i| u8::from(i % n <= i / n)).collect();
            let mask = Tensor::from_vec(m, (1, 1, n, n), q.device())?.broadcast_as(diff.shape())?;
            let hidden = Tensor::full(f64::NEG_INFINITY, diff.shape(), q.device())?.to_dtype(diff.dtype())?;
            let w = mask.where_cond(&diff, &hidden)?.exp()?;
            // repeat_kv: KV head j's weights serve query heads j·g … j·g + g − 1
            Tensor::cat(&vec![&w; h / kv], 2)?.reshape((b, h, n, n))?.to_dtype(q.dtype())?
        }
    };
    let a = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_mul(&w)?;
    let o = a.matmul(v)?;
    if !config.normalize {
        return Ok(o);
    }
    let den = a.sum_keepdim(D::Minus1)?;
    let sign = ((den.ge(0.0)?.to_dtype(q.dtype())? * 2.0)? - 1.0)?;
    o.broadcast_div(&(den + (sign * f64::from(config.eps))?)?)
}

/// The Llama block ([`super::LlamaBlock`]) in plain candle ops: RMSNorm, projections,
/// RoPE, K and V repeated to the query heads (Hugging Face's `repeat_kv`), softmax with the
/// causal mask, SwiGLU as `silu(g)·u`.
fn llama_forward(
    config: &LayerConfig,
    block: &super::LlamaBlock,
    p: &HashMap<&'static str, Var>,
    x: &Tensor,
    seed: u64,
) -> candle_core::Result<Tensor> {
    let (b, n, c) = x.dims3()?;
    let (h, kv, d) = (config.heads, block.kv_heads, config.head_dim());
    let dtype = x.dtype();
    let eps = f64::from(config.eps);
    let w = |name: &str| p[name].as_tensor().clone();
    let lin = |t: &Tensor, name: &str| t.broadcast_matmul(&w(name).t()?);
    let mask = |site, dims: &[usize]| -> candle_core::Result<Option<Tensor>> {
        let prob = if site == DropoutSite::Attention { config.dropout.attention } else { config.dropout.residual };
        dropout::mask(seed, site, prob, dims, x.device())?.map(|m| m.to_dtype(dtype)).transpose()
    };
    let h1 = rms_norm(x, &w("input_layernorm.weight"), eps)?;
    let heads = |t: Tensor, count: usize| t.reshape((b, n, count, d))?.transpose(1, 2)?.contiguous();
    let q = rope(&heads(lin(&h1, "self_attn.q_proj.weight")?, h)?, &block.rope)?;
    let k = rope(&heads(lin(&h1, "self_attn.k_proj.weight")?, kv)?, &block.rope)?;
    let v = heads(lin(&h1, "self_attn.v_proj.weight")?, kv)?;
    // repeat_kv: KV head j serves query heads j·g … j·g + g − 1
    let repeat = |t: &Tensor| -> candle_core::Result<Tensor> {
        let g = h / kv;
        Tensor::cat(&vec![t; g], 2)?.reshape((b, kv * g, n, d))
    };
    let (k, v) = (repeat(&k)?, repeat(&v)?);
    let o = if let Attention::Gated { config: g, log_decay } = &config.attention {
        gated_quadratic(&q, &k, &v, g, RefDecay::PerHead(log_decay))?
    } else if let Attention::InputGated { config: g } = &config.attention {
        let a = input_gate(&h1, p, GateNames::of(config.block))?;
        gated_quadratic(&q, &k, &v, g, RefDecay::PerStep(&a))?
    } else {
        let mut s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        if let Attention::Softmax { causal: true } = config.attention {
            let m: Vec<f64> = (0..n * n).map(|i| if i % n > i / n { f64::NEG_INFINITY } else { 0.0 }).collect();
            s = s.broadcast_add(&Tensor::from_vec(m, (n, n), x.device())?.to_dtype(dtype)?)?;
        }
        let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
        let prob = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let prob = dropout::apply(&prob, mask(DropoutSite::Attention, prob.dims())?.as_ref())?;
        prob.matmul(&v)?
    };
    let o = o.transpose(1, 2)?.contiguous()?.reshape((b, n, c))?;
    let r1 = lin(&o, "self_attn.o_proj.weight")?;
    let x2 = (x + dropout::apply(&r1, mask(DropoutSite::AttentionResidual, &[b, n, c])?.as_ref())?)?;
    let h2 = rms_norm(&x2, &w("post_attention_layernorm.weight"), eps)?;
    let m = (lin(&h2, "mlp.gate_proj.weight")?.silu()? * lin(&h2, "mlp.up_proj.weight")?)?;
    let r2 = lin(&m, "mlp.down_proj.weight")?;
    x2 + dropout::apply(&r2, mask(DropoutSite::FfnResidual, &[b, n, c])?.as_ref())?
}
