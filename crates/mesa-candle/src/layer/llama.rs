//! The Llama block's forward and backward ([`super::LlamaBlock`]): pre-RMSNorm, projections
//! without bias, RoPE on Q and K, grouped-query softmax (or gated linear) attention, SwiGLU MLP.
//!
//! What the forward keeps ([`super::Recompute`] as for the GPT block):
//!
//! | tensor | kept as | used by |
//! |---|---|---|
//! | `x̂` of both RMSNorms `[B, N, C]` | codes (per head-sized channel slice) + per-row `rms` | RMSNorm backwards; the decoded norm output for the next projections' `dW` |
//! | Q after RoPE `[B, H, N, d]` | codes (per head) | `dK`; selective recomputation of `P` |
//! | K after RoPE, V `[B, H_kv, N, d]` | codes (per KV head, never repeated) | `dQ`, `dP`; selective recomputation |
//! | `P` `[B, H, N, N]` ([`super::Recompute::None`] only, softmax attention) | codes of `√P` | softmax backward, `dV` |
//! | attention output before `W_o` `[B, N, C]` | codes | `dW_o` |
//! | gate `g` and up `u` projections `[B, N, F]` | codes of each (SwiGLU's forward writes them) | SwiGLU backward; `silu(ĝ)·û` for `dW_d` |
//!
//! RoPE writes Q and K and their codes in one pass ([`mesa_kernels::rope::rope_forward_save`]:
//! rotate, then encode); its backward rotates `dQ`, `dK` back and keeps nothing.
use std::collections::HashMap;

use candle_core::Tensor;
use mesa_kernels::fused::SavedSwiglu;
use mesa_kernels::SavedActivation;

use super::backward::weight_backward;
use super::dropout::{self, DropoutSite};
use super::forward::{Plan, Quantizers};
use super::kernels::SavedRms;
use super::{CodeSite, LlamaBlock, Recompute};
use crate::ops::linear::linear_forward;

/// What a Llama block's forward keeps (module docs).
#[derive(Debug)]
pub(crate) struct Codes {
    pub ln1: SavedRms,
    pub ln2: SavedRms,
    pub q: SavedActivation,
    pub k: SavedActivation,
    pub v: SavedActivation,
    pub p: Option<SavedActivation>,
    pub attn_out: SavedActivation,
    pub mlp: SavedSwiglu,
}

impl Codes {
    pub fn size_in_bytes(&self) -> usize {
        let acts = [&self.q, &self.k, &self.v, &self.attn_out].iter().map(|s| s.size_in_bytes()).sum::<usize>();
        acts + self.ln1.size_in_bytes()
            + self.ln2.size_in_bytes()
            + self.p.as_ref().map_or(0, SavedActivation::size_in_bytes)
            + self.mlp.size_in_bytes()
    }
}

/// `t·Wᵀ` of the projection `name` (no bias).
fn proj(plan: &Plan, params: &Tensor, t: &Tensor, name: &str) -> candle_core::Result<Tensor> {
    linear_forward(t, &plan.w(params, name)?, None)
}

/// The forward of `x: [B, N, C]` (detached, as `params`), coding with `quant`.
pub(crate) fn forward(
    plan: &Plan,
    block: &LlamaBlock,
    x: &Tensor,
    params: &Tensor,
    policy: Recompute,
    quant: &mut Quantizers,
) -> candle_core::Result<(Tensor, Codes)> {
    let (cfg, ctx) = (&plan.config, &plan.ctx);
    let w = |name: &str| plan.w(params, name);
    let (h1, ln1) = ctx.rms_norm(x, &w("input_layernorm.weight")?, cfg.eps, quant.get(CodeSite::Ln1))?;
    // the whole sequence into the column-parallel projections (g, with a group)
    let h1 = plan.gather(&h1)?;
    let q = plan.split_heads(&proj(plan, params, &h1, "self_attn.q_proj.weight")?)?;
    let k = plan.split_kv_heads(&proj(plan, params, &h1, "self_attn.k_proj.weight")?)?;
    let v = plan.split_kv_heads(&proj(plan, params, &h1, "self_attn.v_proj.weight")?)?;
    let gate = plan.input_gate(params, &h1)?;
    drop(h1);
    // rotate, then encode, in one pass each
    let (q, q_s) = ctx.rope_save(&q, &block.rope, quant.get(CodeSite::Q))?;
    let (k, k_s) = ctx.rope_save(&k, &block.rope, quant.get(CodeSite::K))?;
    let v_s = ctx.quantize(&v, quant.get(CodeSite::V))?;
    let (o, p_s) = match plan.gated_core(gate.as_ref())? {
        // grouped heads inside the kernel: K, V never repeated
        Some(core) => (core.forward(&ctx.kernels, &q, &k, &v)?, None),
        None => {
            let (p, p_s) = plan.probabilities(&q, &k, policy == Recompute::None)?;
            let mask = plan.dropout_mask(DropoutSite::Attention, p.dims())?;
            let p = dropout::apply(&p, mask.as_ref())?;
            (plan.ungroup_queries(&plan.group_queries(&p)?.matmul(&v)?)?, p_s)
        }
    };
    drop((q, k, v));
    let a = plan.merge_heads(&o)?;
    drop(o);
    let a_s = ctx.quantize(&a, quant.get(CodeSite::AttnOut))?;
    let x2 = plan.row_parallel(params, &a, ("self_attn.o_proj.weight", None), DropoutSite::AttentionResidual, x)?;
    drop(a);
    let (h2, ln2) = ctx.rms_norm(&x2, &w("post_attention_layernorm.weight")?, cfg.eps, quant.get(CodeSite::Ln2))?;
    let h2 = plan.gather(&h2)?;
    let g = proj(plan, params, &h2, "mlp.gate_proj.weight")?;
    let u = proj(plan, params, &h2, "mlp.up_proj.weight")?;
    drop(h2);
    let (m, mlp) = ctx.swiglu(&g, &u, quant.swiglu())?;
    drop((g, u));
    let y = plan.row_parallel(params, &m, ("mlp.down_proj.weight", None), DropoutSite::FfnResidual, &x2)?;
    Ok((y, Codes { ln1, ln2, q: q_s, k: k_s, v: v_s, p: p_s, attn_out: a_s, mlp }))
}

/// Every gradient of the block from its codes: `(dx, gradients by parameter name)`.
pub(crate) fn backward(
    plan: &Plan,
    c: &Codes,
    x: &Tensor,
    params: &Tensor,
    dy: &Tensor,
) -> candle_core::Result<(Tensor, HashMap<&'static str, Tensor>)> {
    let super::Block::Llama(block) = plan.config.block else {
        return Err(crate::Error::StateConsumed { op: "llama block" }.into());
    };
    let ctx = &plan.ctx;
    let w = |name: &str| plan.w(params, name);
    let mut grads = HashMap::new();
    // MLP: y = x₂ + D₂((silu(g)·u)·W_dᵀ)
    // With a group (as the GPT block, `backward.rs`): x, dy and the norms' tensors are the
    // rank's rows; the projections' output gradients are all-gathered, the column-parallel
    // projections' input gradients reduce-scattered.
    let m2 = plan.dropout_mask(DropoutSite::FfnResidual, x.dims())?;
    let d_f = plan.gather(&dropout::apply(dy, m2.as_ref())?)?;
    let m_hat = (ctx.decode(&c.mlp.gate)?.silu()? * ctx.decode(&c.mlp.up)?)?;
    let (d_m, dw_d) = weight_backward(plan, params, "mlp.down_proj.weight", &m_hat, &d_f)?;
    drop((m_hat, d_f));
    grads.insert("mlp.down_proj.weight", dw_d);
    let (d_g, d_u) = ctx.swiglu_backward(&c.mlp, &d_m)?;
    drop(d_m);
    let w_post = w("post_attention_layernorm.weight")?;
    let h2 = plan.gather(&ctx.rms_norm_output(&c.ln2, &w_post)?)?;
    let (d_h2g, dw_g) = weight_backward(plan, params, "mlp.gate_proj.weight", &h2, &d_g)?;
    let (d_h2u, dw_u) = weight_backward(plan, params, "mlp.up_proj.weight", &h2, &d_u)?;
    drop((h2, d_g, d_u));
    grads.insert("mlp.gate_proj.weight", dw_g);
    grads.insert("mlp.up_proj.weight", dw_u);
    let d_h2 = plan.scatter(&(d_h2g + d_h2u)?, None, None)?;
    let (dx_ln2, dw_post) = ctx.rms_norm_backward(&c.ln2, &w_post, &d_h2)?;
    let d_x2 = (dy + dx_ln2)?;
    // attention: x₂ = x + D₁(a·W_oᵀ)
    let m1 = plan.dropout_mask(DropoutSite::AttentionResidual, x.dims())?;
    let d_r = plan.gather(&dropout::apply(&d_x2, m1.as_ref())?)?;
    let a_hat = ctx.decode(&c.attn_out)?;
    let (d_a, dw_o) = weight_backward(plan, params, "self_attn.o_proj.weight", &a_hat, &d_r)?;
    drop((a_hat, d_r));
    grads.insert("self_attn.o_proj.weight", dw_o);
    let d_o = plan.split_heads(&d_a)?;
    drop(d_a);
    let w_in = w("input_layernorm.weight")?;
    // the projections' input, made before the core only for an input gate (recomputed from it)
    let h1_of = || plan.gather(&ctx.rms_norm_output(&c.ln1, &w_in)?);
    let gated_h1 = plan.config.attention.is_input_gated().then(h1_of).transpose()?;
    let gate = gated_h1.as_ref().map(|t| plan.input_gate(params, t)).transpose()?.flatten();
    let (q, k, v) = (ctx.decode(&c.q)?, ctx.decode(&c.k)?, ctx.decode(&c.v)?);
    let ((dq, dk, dv), d_gate) = match plan.gated_core(gate.as_ref())? {
        Some(core) => {
            let ([dq, dk, dv], da) = core.backward(&ctx.kernels, &q, &k, &v, &d_o)?;
            let d_gate = match (&gate, &gated_h1) {
                (Some(g), Some(t)) => Some(plan.input_gate_backward(params, t, g, &da, &mut grads)?),
                _ => None,
            };
            ((dq, dk, dv), d_gate)
        }
        None => (super::backward::softmax_core_backward(plan, c.p.as_ref(), &q, &k, &v, &d_o)?, None),
    };
    drop((q, k, v, d_o, gate));
    // through RoPE: the inverse rotation
    let dq = ctx.rope(&dq, &block.rope, true)?;
    let dk = ctx.rope(&dk, &block.rope, true)?;
    let h1 = match gated_h1 {
        Some(t) => t,
        None => h1_of()?,
    };
    let (d_hq, dw_q) = weight_backward(plan, params, "self_attn.q_proj.weight", &h1, &plan.merge_heads(&dq)?)?;
    let (d_hk, dw_k) = weight_backward(plan, params, "self_attn.k_proj.weight", &h1, &plan.merge_kv_heads(&dk)?)?;
    let (d_hv, dw_v) = weight_backward(plan, params, "self_attn.v_proj.weight", &h1, &plan.merge_kv_heads(&dv)?)?;
    drop((h1, dq, dk, dv));
    let (dw_k, dw_v) = replicated_kv_sum(plan, dw_k, dw_v)?;
    grads.insert("self_attn.q_proj.weight", dw_q);
    grads.insert("self_attn.k_proj.weight", dw_k);
    grads.insert("self_attn.v_proj.weight", dw_v);
    let mut d_h1 = ((d_hq + d_hk)? + d_hv)?;
    if let Some(d) = d_gate {
        d_h1 = (d_h1 + d)?;
    }
    let d_in = plan.scatter(&d_h1, None, None)?;
    let (dx_ln1, dw_in) = ctx.rms_norm_backward(&c.ln1, &w_in, &d_in)?;
    if plan.tp.is_some() {
        // the norms are replicated but each rank normalised its own rows: one all-reduce of
        // both weights' gradients
        let summed = plan.all_reduce(&Tensor::stack(&[&dw_in, &dw_post], 0)?)?;
        grads.insert("input_layernorm.weight", summed.get(0)?);
        grads.insert("post_attention_layernorm.weight", summed.get(1)?);
    } else {
        grads.insert("input_layernorm.weight", dw_in);
        grads.insert("post_attention_layernorm.weight", dw_post);
    }
    Ok(((d_x2 + dx_ln1)?, grads))
}

/// With `t > H_kv` ranks each KV head's weights are replicated over the `t/H_kv` ranks whose
/// query heads read it, and each rank's gradient holds its own query heads' part: the sum over
/// those ranks, as one all-reduce over the group of both weights' gradients placed at their
/// KV head's rows of a zero `[2, H_kv·d, C]` tensor (`2·H_kv·d·C` elements; the sum at each
/// head's rows is then that head's ranks' sum). Otherwise the gradients as they are.
fn replicated_kv_sum(plan: &Plan, dw_k: Tensor, dw_v: Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (Some(tp), super::Block::Llama(block)) = (&plan.tp, plan.config.block) else {
        return Ok((dw_k, dw_v));
    };
    let (t, kv) = (tp.comm.world_size(), block.kv_heads);
    if t <= kv {
        return Ok((dw_k, dw_v));
    }
    let (rows, c) = dw_k.dims2()?;
    let head = tp.comm.rank() * kv / t;
    let both = Tensor::stack(&[&dw_k, &dw_v], 0)?;
    let before = Tensor::zeros((2, head * rows, c), both.dtype(), both.device())?;
    let after = Tensor::zeros((2, (kv - head - 1) * rows, c), both.dtype(), both.device())?;
    let placed = Tensor::cat(&[&before, &both, &after], 1)?;
    let summed = plan.all_reduce(&placed)?.narrow(1, head * rows, rows)?;
    Ok((summed.get(0)?, summed.get(1)?))
}
