//! The layer's backward: every gradient from the saved codes, our kernels and candle's
//! matrix products.
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::dropout::{self, DropoutSite};
use super::forward::{self, Codes, Kept, Plan, Saved};
use super::kernels::SoftmaxSource;
use super::{NormPlacement, Recompute};
use crate::attach::Backward;

pub(crate) struct LayerGrad {
    pub plan: Arc<Plan>,
    pub saved: Saved,
}

impl Backward for LayerGrad {
    fn name(&self) -> &'static str {
        "mesa-transformer-layer"
    }

    fn backward(&self, args: &[&Tensor], _: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        // computed in the input's dtype, with the parameters rounded to it
        let x = args[0].detach();
        let params = args[1].detach().to_dtype(x.dtype())?;
        let recomputed;
        let codes = match &self.saved.inner {
            Some(c) => c,
            None => {
                // full recomputation: the forward again, same seed, keeping its codes (exact
                // statistics: a running estimate is the forward's alone)
                let mut quant = forward::Quantizers::new(&self.plan, mesa_kernels::StatsMode::Exact)?;
                recomputed = forward::run(&self.plan, &x, &params, Recompute::None, &mut quant)?.1;
                recomputed.inner.as_ref().ok_or(crate::Error::StateConsumed { op: "transformer layer" })?
            }
        };
        let dy = grad.to_dtype(x.dtype())?;
        let result = match codes {
            Kept::Gpt(codes) => layer_backward(&self.plan, codes, &x, &params, &dy),
            Kept::Llama(codes) => super::llama::backward(&self.plan, codes, &x, &params, &dy),
        };
        let (dx, grads) = match &self.plan.tp {
            Some(tp) => crate::parallel::tell_peers(tp.comm.as_ref(), result)?,
            None => result?,
        };
        let pdtype = args[1].dtype();
        let flat = self
            .plan
            .layout
            .entries()
            .iter()
            .map(|e| {
                // in the parameters' dtype (LayerNorm's kernels write dw, db in f32)
                grads
                    .get(e.name)
                    .map(|g| g.flatten_all()?.to_dtype(pdtype))
                    .unwrap_or_else(|| Tensor::zeros(e.numel(), pdtype, x.device()))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(vec![Some(dx), Some(Tensor::cat(&flat, 0)?)])
    }
}

/// Gradients of a projection `y = t·Wᵀ + b` given `dy`: `(dt, dW, db)`.
fn proj_backward(
    plan: &Plan,
    params: &Tensor,
    name: &str,
    t: &Tensor,
    dy: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (dt, dw) = weight_backward(plan, params, &format!("{name}.weight"), t, dy)?;
    let out_f = dw.dim(0)?;
    Ok((dt, dw, dy.reshape(((), out_f))?.sum(0)?))
}

/// Gradients of `y = t·Wᵀ` (`W` the parameter named `weight`) given `dy`: `(dt, dW)`.
pub(crate) fn weight_backward(
    plan: &Plan,
    params: &Tensor,
    weight: &str,
    t: &Tensor,
    dy: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let w = plan.w(params, weight)?;
    let (out_f, in_f) = w.dims2()?;
    let dy2 = dy.reshape(((), out_f))?;
    let dt = dy2.matmul(&w)?.reshape(t.shape())?;
    let dw = dy2.t()?.matmul(&t.reshape(((), in_f))?)?;
    Ok((dt, dw))
}

/// The gradients `(dQ, dK, dV)` of softmax attention `D(softmax(QKᵀ/√d + mask))·V` from
/// the decoded `q: [B, H, N, d]`, `k, v: [B, H_kv, N, d]` and `d_o: [B, H, N, d]`, with `P`
/// from its codes or, without them (selective recomputation), recomputed from `q` and `k`.
/// The query heads that share a KV head run as one matrix ([`Plan::group_queries`]), so `dK`
/// and `dV` come out summed over each group (the identity for `H_kv = H`).
pub(crate) fn softmax_core_backward(
    plan: &Plan,
    p_codes: Option<&mesa_kernels::SavedActivation>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let ctx = &plan.ctx;
    let recomputed;
    let source = match p_codes {
        Some(p) => SoftmaxSource::Codes(p),
        None => {
            recomputed = plan.probabilities(q, k, false)?.0;
            SoftmaxSource::Plain(&recomputed)
        }
    };
    let p_hat = match &source {
        SoftmaxSource::Codes(p) => ctx.decode(p)?,
        SoftmaxSource::Plain(p) => (*p).clone(),
    };
    let ma = plan.dropout_mask(DropoutSite::Attention, p_hat.dims())?;
    let d_o = plan.group_queries(d_o)?;
    // dV = Pᵀ·dO, one product per KV group
    let dv = plan.group_queries(&dropout::apply(&p_hat, ma.as_ref())?)?.t()?.matmul(&d_o)?;
    drop(p_hat);
    let d_p = dropout::apply(&plan.ungroup_queries(&d_o.matmul(&v.t()?)?)?, ma.as_ref())?;
    drop(d_o);
    let d_s = plan.group_queries(&ctx.softmax_backward(source, &d_p)?)?;
    drop(d_p);
    let scale = 1.0 / (plan.config.head_dim() as f64).sqrt();
    let dq = (plan.ungroup_queries(&d_s.matmul(k)?)? * scale)?;
    let dk = (d_s.t()?.matmul(&plan.group_queries(q)?)? * scale)?;
    Ok((dq, dk, dv))
}

fn insert(grads: &mut HashMap<&'static str, Tensor>, name: &'static str, w: Tensor, b: Tensor) {
    let (wn, bn) = match name {
        "attn.q_proj" => ("attn.q_proj.weight", "attn.q_proj.bias"),
        "attn.k_proj" => ("attn.k_proj.weight", "attn.k_proj.bias"),
        "attn.v_proj" => ("attn.v_proj.weight", "attn.v_proj.bias"),
        "attn.out_proj" => ("attn.out_proj.weight", "attn.out_proj.bias"),
        "mlp.fc_in" => ("mlp.fc_in.weight", "mlp.fc_in.bias"),
        "mlp.fc_out" => ("mlp.fc_out.weight", "mlp.fc_out.bias"),
        "ln_1" => ("ln_1.weight", "ln_1.bias"),
        _ => ("ln_2.weight", "ln_2.bias"),
    };
    grads.insert(wn, w);
    grads.insert(bn, b);
}

fn layer_backward(
    plan: &Plan,
    c: &Codes,
    x: &Tensor,
    params: &Tensor,
    dy: &Tensor,
) -> candle_core::Result<(Tensor, HashMap<&'static str, Tensor>)> {
    let (b, n, hidden) = x.dims3()?;
    let (cfg, ctx) = (&plan.config, &plan.ctx);
    // With a tensor-parallel group (t ranks): x, dy and every [B, N, C] tensor of the norms
    // and residuals are the rank's rows [B, N_r, C]; the projections' gradients need every
    // row, so their output gradients are all-gathered (g's backward is ḡ's forward and the
    // other way round, Korthikanti et al. §4.2.2) and the partial input gradients of the
    // column-parallel projections are reduce-scattered.
    let w = |name: &str| plan.w(params, name);
    let pre = cfg.norm == NormPlacement::Pre;
    let mut grads = HashMap::new();
    // FFN block: y = x₂ + D₂(f) (pre) or y = LN₂(x₂ + D₂(f)) (post)
    let (d_res, d_f) = if pre {
        (dy.clone(), dy.clone())
    } else {
        let (dz, dw, db) = ctx.layer_norm_backward(&c.ln2, &w("ln_2.weight")?, dy)?;
        insert(&mut grads, "ln_2", dw, db);
        (dz.clone(), dz)
    };
    let m2 = plan.dropout_mask(DropoutSite::FfnResidual, &[b, n, hidden])?;
    let d_f = plan.gather(&dropout::apply(&d_f, m2.as_ref())?)?;
    let u_hat = ctx.decode(&c.u)?;
    let g_hat = u_hat.gelu_erf()?;
    drop(u_hat);
    let (d_g, dw2, db2) = proj_backward(plan, params, "mlp.fc_out", &g_hat, &d_f)?;
    drop(g_hat);
    insert(&mut grads, "mlp.fc_out", dw2, db2);
    let d_u = ctx.gelu_backward(&c.u, &d_g)?;
    drop(d_g);
    // the FFN input: LN₂'s output (pre) or LN₁'s (post), decoded from its codes
    let (ffn_ln, ffn_ln_name) = if pre { (&c.ln2, "ln_2") } else { (&c.ln1, "ln_1") };
    let ffn_in = plan.gather(&ctx.layer_norm_output(
        ffn_ln,
        &w(&format!("{ffn_ln_name}.weight"))?,
        &w(&format!("{ffn_ln_name}.bias"))?,
    )?)?;
    let (d_h2, dw1, db1) = proj_backward(plan, params, "mlp.fc_in", &ffn_in, &d_u)?;
    let d_h2 = plan.scatter(&d_h2, None, None)?;
    drop((ffn_in, d_u));
    insert(&mut grads, "mlp.fc_in", dw1, db1);
    // through the norm between the blocks: d x₂ (pre: LN₂ backward + residual; post: the
    // FFN input is LN₁'s output, then LN₁ backward)
    let d_x2 = if pre {
        let (dx_ln, dw, db) = ctx.layer_norm_backward(&c.ln2, &w("ln_2.weight")?, &d_h2)?;
        insert(&mut grads, "ln_2", dw, db);
        (d_res + dx_ln)?
    } else {
        let (dz1, dw, db) = ctx.layer_norm_backward(&c.ln1, &w("ln_1.weight")?, &(d_res + d_h2)?)?;
        insert(&mut grads, "ln_1", dw, db);
        dz1
    };
    // attention block: r = D₁(a·W_oᵀ + b_o)
    let m1 = plan.dropout_mask(DropoutSite::AttentionResidual, &[b, n, hidden])?;
    let d_r = plan.gather(&dropout::apply(&d_x2, m1.as_ref())?)?;
    let a_hat = ctx.decode(&c.attn_out)?;
    let (d_a, dwo, dbo) = proj_backward(plan, params, "attn.out_proj", &a_hat, &d_r)?;
    insert(&mut grads, "attn.out_proj", dwo, dbo);
    let d_o = plan.split_heads(&d_a)?;
    drop(d_a);
    // the projections' input: LN₁'s output (pre, decoded) or the layer input itself (post);
    // made before the core only for an input gate (which is recomputed from it)
    let attn_input = || -> candle_core::Result<Tensor> {
        plan.gather(&if pre { ctx.layer_norm_output(&c.ln1, &w("ln_1.weight")?, &w("ln_1.bias")?)? } else { x.clone() })
    };
    let gated_input = plan.config.attention.is_input_gated().then(attn_input).transpose()?;
    let gate = gated_input.as_ref().map(|t| plan.input_gate(params, t)).transpose()?.flatten();
    let mut d_gate = None;
    let (q, k, v) = (ctx.decode(&c.q)?, ctx.decode(&c.k)?, ctx.decode(&c.v)?);
    let (dq, dk, dv) = match &plan.linear {
        Some(op) => {
            // the attention core recomputed from the decoded Q, K, V (O(N): states and output
            // of the same inputs the backward differentiates, so the normaliser's gradient
            // sees the output that belongs to them)
            // in f32 for every dtype, as the op computes 16-bit inputs (crate::ops, "Dtypes")
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let (qf, kf, vf) = (f(&q)?, f(&k)?, f(&v)?);
            let (o_hat, la) = op.forward_detached::<f32>(&ctx.kernels, &qf, &kf, &vf)?;
            let o_hat = o_hat.into_tensor()?;
            let [dq, dk, dv] = op.backward_detached::<f32>(&ctx.kernels, &la, [&qf, &kf, &vf], &o_hat, &f(&d_o)?)?;
            let dt = q.dtype();
            (dq.to_dtype(dt)?, dk.to_dtype(dt)?, dv.to_dtype(dt)?)
        }
        None => match plan.gated_core(gate.as_ref())? {
            Some(core) => {
                let ([dq, dk, dv], da) = core.backward(&ctx.kernels, &q, &k, &v, &d_o)?;
                if let (Some(g), Some(t)) = (&gate, &gated_input) {
                    d_gate = Some(plan.input_gate_backward(params, t, g, &da, &mut grads)?);
                }
                (dq, dk, dv)
            }
            None => softmax_core_backward(plan, c.p.as_ref(), &q, &k, &v, &d_o)?,
        },
    };
    drop((q, k, v, a_hat, gate));
    let attn_in = match gated_input {
        Some(t) => t,
        None => attn_input()?,
    };
    let mut d_in: Option<Tensor> = d_gate;
    for (name, d) in [("attn.q_proj", dq), ("attn.k_proj", dk), ("attn.v_proj", dv)] {
        let (dt, dw, db) = proj_backward(plan, params, name, &attn_in, &plan.merge_heads(&d)?)?;
        insert(&mut grads, name, dw, db);
        d_in = Some(match d_in {
            Some(acc) => (acc + dt)?,
            None => dt,
        });
    }
    let d_in = plan.scatter(&d_in.ok_or(crate::Error::StateConsumed { op: "transformer layer" })?, None, None)?;
    let dx = if pre {
        let (dx_ln, dw, db) = ctx.layer_norm_backward(&c.ln1, &w("ln_1.weight")?, &d_in)?;
        insert(&mut grads, "ln_1", dw, db);
        (d_x2 + dx_ln)?
    } else {
        (d_x2 + d_in)?
    };
    if plan.tp.is_some() {
        // the LayerNorms are replicated but each rank normalised its own rows: sum their
        // gradients over the ranks, in one call (the row-parallel biases' gradients are
        // complete already: they come from the all-gathered output gradients)
        let names = ["ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"];
        let parts = names
            .iter()
            .map(|n| grads.get(n).cloned().ok_or(crate::Error::StateConsumed { op: "transformer layer" }))
            .collect::<Result<Vec<_>, _>>()?;
        let summed = plan.all_reduce(&Tensor::stack(&parts, 0)?)?;
        for (i, n) in names.into_iter().enumerate() {
            grads.insert(n, summed.get(i)?);
        }
    }
    Ok((dx, grads))
}
