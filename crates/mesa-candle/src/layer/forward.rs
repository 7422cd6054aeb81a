//! The layer's forward on detached tensors, and what it keeps.
use candle_core::Tensor;
use mesa_kernels::linear_attention::LinearAttentionSaved;
use mesa_kernels::quant::BatchReport;
use mesa_kernels::{
    GroupParams, Grouping, QuantConfig, Quantizer, Rounding, SavedActivation, SavedLayerNorm, SoftmaxCodes,
    SoftmaxSave, StatsMode,
};

use super::dropout::{self, DropoutSite};
use super::kernels::Ctx;
use super::{Attention, CodeSite, LayerConfig, NormPlacement, ParamLayout, Recompute};
use crate::error::KernelResult;
use crate::ops::linear::linear_forward;
use crate::ops::LinearAttention;
use crate::parallel::Collectives;

/// Everything fixed for one call: configuration, parameter names, device, dropout seed, and
/// the rank's place in a tensor-parallel group.
#[derive(Debug)]
pub(crate) struct Plan {
    pub config: LayerConfig,
    pub layout: std::sync::Arc<ParamLayout>,
    pub ctx: Ctx,
    pub seed: u64,
    pub linear: Option<LinearAttention>,
    pub tp: Option<TpPlan>,
}

/// One call of a layer on rank `r` of `t`: the group and the sequence's split.
#[derive(Debug)]
pub(crate) struct TpPlan {
    pub comm: std::sync::Arc<dyn Collectives>,
    pub splits: Vec<usize>,
    /// The rank's first row and rows of the sequence.
    pub offset: usize,
    pub len: usize,
}

/// One quantizer per tensor the forward saves as codes ([`CodeSite`]): fresh ones with exact
/// statistics for a single call, or the layer's own, kept across calls, for the running
/// estimate.
#[derive(Debug)]
pub(crate) struct Quantizers {
    sites: Vec<Quantizer>,
}

impl Quantizers {
    /// A quantizer per site with the layer's bits and groupings and statistics `stats`.
    /// Under [`StatsMode::Running`] each quantizer records its batches for
    /// [`Quantizers::report`] (two small device copies per batch, [`Quantizer::set_batch_report`]).
    pub fn new(plan: &Plan, stats: StatsMode) -> candle_core::Result<Self> {
        let new_site = |site: CodeSite| -> candle_core::Result<Quantizer> {
            let mut q = Quantizer::new(&plan.ctx.kernels, QuantConfig { stats, ..plan.site_codes(site) }).k()?;
            q.set_batch_report(stats == StatsMode::Running);
            Ok(q)
        };
        let sites = CodeSite::ALL.iter().map(|&site| new_site(site)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Quantizers { sites })
    }

    /// The quantizer of `site`.
    pub fn get(&mut self, site: CodeSite) -> &mut Quantizer {
        &mut self.sites[site as usize]
    }

    /// The running estimate of `site` (`None` before its first batch).
    pub fn running_params(&self, site: CodeSite) -> mesa_kernels::Result<Option<Vec<GroupParams>>> {
        self.sites[site as usize].running_params()
    }

    /// The quantizers of SwiGLU's gate ([`CodeSite::FfnIn`]) and up projection ([`CodeSite::FfnUp`]).
    pub fn swiglu(&mut self) -> mesa_kernels::fused::SwigluQuantizers<'_> {
        let (low, high) = self.sites.split_at_mut(CodeSite::FfnUp as usize);
        mesa_kernels::fused::SwigluQuantizers { gate: &mut low[CodeSite::FfnIn as usize], up: &mut high[0] }
    }

    /// The report of `site`'s last batch (`None` before it, when not recorded, or for a site
    /// without a quantizer).
    pub fn report(&self, site: CodeSite) -> mesa_kernels::Result<Option<BatchReport>> {
        self.sites.get(site as usize).map_or(Ok(None), Quantizer::batch_report)
    }
}

/// What one forward keeps for its backward (the module docs' table).
#[derive(Debug)]
pub struct Saved {
    pub(crate) inner: Option<Kept>,
}

/// The codes of one block design. Held inline: the planner counts the backward state's
/// size as one allocation (`BACKWARD_STATE_BYTES`), and both variants are of similar size.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Kept {
    Gpt(Codes),
    Llama(super::llama::Codes),
}

#[derive(Debug)]
pub(crate) struct Codes {
    pub ln1: SavedLayerNorm,
    pub ln2: SavedLayerNorm,
    pub q: SavedActivation,
    pub k: SavedActivation,
    pub v: SavedActivation,
    pub p: Option<SavedActivation>,
    pub attn_out: SavedActivation,
    pub u: SavedActivation,
    pub la: Option<LinearAttentionSaved>,
}

impl Saved {
    /// Bytes held (codes, their parameters, statistics, linear-attention states); 0 under
    /// [`Recompute::Full`].
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.inner.as_ref().map_or(0, |kept| {
            let c = match kept {
                Kept::Gpt(c) => c,
                Kept::Llama(l) => return l.size_in_bytes(),
            };
            let acts = [&c.q, &c.k, &c.v, &c.attn_out, &c.u].iter().map(|s| s.size_in_bytes()).sum::<usize>();
            acts + c.ln1.size_in_bytes()
                + c.ln2.size_in_bytes()
                + c.p.as_ref().map_or(0, SavedActivation::size_in_bytes)
                + c.la.as_ref().map_or(0, LinearAttentionSaved::size_in_bytes)
        })
    }
}

impl Plan {
    pub fn w(&self, params: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        self.layout.view(params, name)
    }

    /// Tensor-parallel ranks `t` (1 without a group).
    pub fn tensor(&self) -> usize {
        self.tp.as_ref().map_or(1, |tp| tp.comm.world_size())
    }

    /// The heads of this rank: `H/t`.
    pub fn local_heads(&self) -> usize {
        self.config.heads / self.tensor()
    }

    /// The K/V heads of this rank: `H_kv/t`, or the one KV head its query heads read when
    /// `t > H_kv` (replicated over `t/H_kv` ranks).
    pub fn local_kv_heads(&self) -> usize {
        (self.config.kv_heads() / self.tensor()).max(1)
    }

    /// `[B, H, N, e]` → `[B, H_kv, (H/H_kv)·N, e]`: the query heads that share a KV head as one
    /// matrix (query head `i` reads KV head `⌊i/(H/H_kv)⌋`, Hugging Face's `repeat_kv` order), so
    /// a product with the KV head's `[N, e]` serves the whole group without repeating it. A
    /// reshape of a contiguous tensor; the identity for `H_kv = H`.
    pub fn group_queries(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (b, h, n, e) = t.dims4()?;
        let kv = self.local_kv_heads();
        t.contiguous()?.reshape((b, kv, h / kv * n, e))
    }

    /// The inverse of [`Plan::group_queries`]: `[B, H_kv, (H/H_kv)·N, e]` → `[B, H, N, e]`.
    pub fn ungroup_queries(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (b, kv, gn, e) = t.dims4()?;
        let h = self.local_heads();
        t.contiguous()?.reshape((b, h, gn * kv / h, e))
    }

    /// `[B, N, H_kv·d]` → `[B, H_kv, N, d]` (contiguous).
    pub fn split_kv_heads(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, _) = t.dims3()?;
        t.reshape((b, n, self.local_kv_heads(), self.config.head_dim()))?.transpose(1, 2)?.contiguous()
    }

    /// `[B, H_kv, N, d]` → `[B, N, H_kv·d]` (contiguous).
    pub fn merge_kv_heads(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (b, _, n, _) = t.dims4()?;
        t.transpose(1, 2)?.contiguous()?.reshape((b, n, self.local_kv_heads() * self.config.head_dim()))
    }

    /// `g`: the rank's `[B, S_r, C]` shard → the whole `[B, S, C]` (all-gather); the tensor
    /// itself without a group.
    pub fn gather(&self, shard: &Tensor) -> candle_core::Result<Tensor> {
        match &self.tp {
            None => Ok(shard.clone()),
            Some(tp) => Ok(tp.comm.all_gather_seq(shard, &tp.splits)?),
        }
    }

    /// `ḡ`: partial sums `[B, S, C]` → the rank's rows of their sum (+ bias, + residual),
    /// `[B, S_r, C]` (reduce-scatter); without a group the sum is the tensor itself.
    pub fn scatter(
        &self,
        partial: &Tensor,
        bias: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        match &self.tp {
            None => {
                let y = match bias {
                    Some(b) => partial.broadcast_add(b)?,
                    None => partial.clone(),
                };
                residual.map_or(Ok(y.clone()), |r| r + y)
            }
            Some(tp) => Ok(tp.comm.reduce_scatter_seq(partial, &tp.splits, bias, residual)?),
        }
    }

    /// The sum over the group's ranks (the gradients of replicated weights).
    pub fn all_reduce(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        match &self.tp {
            None => Ok(t.clone()),
            Some(tp) => Ok(tp.comm.all_reduce_sum(t)?),
        }
    }

    /// `residual + D(t·Wᵀ + b)` of the row-parallel projection with weight `weight` and bias
    /// `bias` (parameter names; a Llama block's have no bias) on the rank's rows
    /// `[B, S_r, C]`: without a group the existing order (bias in the linear, dropout, then the
    /// residual); with one the partial product, then the reduce-scatter with bias and residual
    /// fused (dropout: bias only, then the shard's mask, then the residual).
    pub fn row_parallel(
        &self,
        params: &Tensor,
        t: &Tensor,
        (weight, bias): (&str, Option<&str>),
        site: DropoutSite,
        residual: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, n, c) = residual.dims3()?;
        let mask = self.dropout_mask(site, &[b, n, c])?;
        let bias = bias.map(|name| self.w(params, name)).transpose()?;
        if self.tp.is_none() {
            let r = linear_forward(t, &self.w(params, weight)?, bias.as_ref())?;
            return residual + dropout::apply(&r, mask.as_ref())?;
        }
        let partial = linear_forward(t, &self.w(params, weight)?, None)?;
        match mask {
            None => self.scatter(&partial, bias.as_ref(), Some(residual)),
            Some(m) => residual + dropout::apply(&self.scatter(&partial, bias.as_ref(), None)?, Some(&m))?,
        }
    }

    /// `t·Wᵀ + b` of the projection `name`.
    pub fn proj(&self, params: &Tensor, t: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        linear_forward(t, &self.w(params, &format!("{name}.weight"))?, Some(&self.w(params, &format!("{name}.bias"))?))
    }

    fn codes(&self, grouping: Grouping) -> QuantConfig {
        QuantConfig {
            bits: self.config.bits,
            grouping,
            rounding: Rounding::Nearest,
            momentum: 0.9,
            stats: StatsMode::Exact,
        }
    }

    /// The rounding of the tensor saved at `site` (the [`CodeSite`]s, then the softmax
    /// probabilities as one more): [`LayerConfig::stochastic_rounding`]'s key is the call's
    /// seed mixed with the site (a Weyl step apart, offset from the dropout sites' keys).
    fn rounding(&self, site: u64) -> Rounding {
        if self.config.stochastic_rounding {
            Rounding::Stochastic { seed: self.seed ^ (0x5352_0000 + site).wrapping_mul(0x9E37_79B9_7F4A_7C15) }
        } else {
            Rounding::Nearest
        }
    }

    /// The codes of `site` (exact statistics; [`Quantizers::new`] sets the mode).
    pub fn site_codes(&self, site: CodeSite) -> QuantConfig {
        let codes = match site {
            CodeSite::Q | CodeSite::K | CodeSite::V => self.head_codes(),
            CodeSite::Ln1 | CodeSite::Ln2 => self.token_codes(),
            // a rank's C/t and F/t channels: H/t head-sized slices
            CodeSite::AttnOut | CodeSite::FfnIn | CodeSite::FfnUp => {
                self.codes(Grouping::Channels { axis: 2, groups: self.local_heads() })
            }
        };
        QuantConfig { rounding: self.rounding(site as u64), ..codes }
    }

    /// Token tensors `[B, N, C or F]`: one group per head-sized channel slice.
    pub fn token_codes(&self) -> QuantConfig {
        self.codes(Grouping::Channels { axis: 2, groups: self.config.heads })
    }

    /// Head tensors `[B, H, N, d]`: one group per head.
    pub fn head_codes(&self) -> QuantConfig {
        self.codes(Grouping::Heads { axis: 1 })
    }

    pub fn softmax_save(&self) -> SoftmaxSave {
        SoftmaxSave {
            bits: self.config.bits,
            codes: SoftmaxCodes::Sqrt,
            grouping: Grouping::Heads { axis: 1 },
            rounding: self.rounding(CodeSite::ALL.len() as u64),
        }
    }

    /// `[B, N, C]` → `[B, H, N, d]` (contiguous).
    pub fn split_heads(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, _) = t.dims3()?;
        t.reshape((b, n, self.local_heads(), self.config.head_dim()))?.transpose(1, 2)?.contiguous()
    }

    /// `[B, H/t, N, d]` → `[B, N, C/t]` (contiguous).
    pub fn merge_heads(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let (b, _, n, _) = t.dims4()?;
        t.transpose(1, 2)?.contiguous()?.reshape((b, n, self.local_heads() * self.config.head_dim()))
    }

    /// The additive causal mask `[N, N]` (−∞ above the diagonal), or none.
    pub fn causal_mask(&self, n: usize) -> candle_core::Result<Option<Tensor>> {
        match self.config.attention {
            Attention::Softmax { causal: true } => {
                let m: Vec<f32> = (0..n * n).map(|i| if i % n > i / n { f32::NEG_INFINITY } else { 0.0 }).collect();
                Ok(Some(Tensor::from_vec(m, (n, n), &self.ctx.candle)?))
            }
            _ => Ok(None),
        }
    }

    /// The dropout mask of `site` for this rank's tensor of `shape`: `[B, H/t, N, N]`
    /// probabilities, or `[B, S_r, C]` residual-branch rows. With a group, the rank's part of
    /// the unsharded layer's mask (its heads, its rows), so that masks do not depend on `t`.
    pub fn dropout_mask(&self, site: DropoutSite, shape: &[usize]) -> candle_core::Result<Option<Tensor>> {
        let p = match site {
            DropoutSite::Attention => self.config.dropout.attention,
            _ => self.config.dropout.residual,
        };
        let Some(tp) = &self.tp else {
            return dropout::mask(self.seed, site, p, shape, &self.ctx.candle);
        };
        let mut full = shape.to_vec();
        let (axis, start, len) = match site {
            DropoutSite::Attention => {
                full[1] = self.config.heads;
                (1, tp.comm.rank() * shape[1], shape[1])
            }
            _ => {
                full[1] = tp.splits.iter().sum();
                (1, tp.offset, tp.len)
            }
        };
        dropout::mask(self.seed, site, p, &full, &self.ctx.candle)?
            .map(|m| m.narrow(axis, start, len)?.contiguous())
            .transpose()
    }

    /// `softmax(QKᵀ/√d + mask)` by our softmax kernel; its codes when `save`. `q: [B, H, N, d]`,
    /// `k: [B, H_kv, N, d]` (grouped queries, [`Plan::group_queries`]) → `[B, H, N, N]`.
    pub fn probabilities(
        &self,
        q: &Tensor,
        k: &Tensor,
        save: bool,
    ) -> candle_core::Result<(Tensor, Option<SavedActivation>)> {
        let scale = 1.0 / (self.config.head_dim() as f64).sqrt();
        let s = (self.ungroup_queries(&self.group_queries(q)?.matmul(&k.t()?)?)? * scale)?;
        let mask = self.causal_mask(q.dim(2)?)?;
        let save = save.then(|| self.softmax_save());
        self.ctx.softmax(&s, mask.as_ref(), save.as_ref())
    }
}

/// The forward of `x: [B, N, C]` with parameters `params` (both detached), coding with
/// `quant`: the output and, unless `policy` is [`Recompute::Full`], what the backward needs.
pub(crate) fn run(
    plan: &Plan,
    x: &Tensor,
    params: &Tensor,
    policy: Recompute,
    quant: &mut Quantizers,
) -> candle_core::Result<(Tensor, Saved)> {
    let (y, kept) = match plan.config.block {
        super::Block::Gpt => {
            let (y, codes) = run_gpt(plan, x, params, policy, quant)?;
            (y, Kept::Gpt(codes))
        }
        super::Block::Llama(block) => {
            let (y, codes) = super::llama::forward(plan, &block, x, params, policy, quant)?;
            (y, Kept::Llama(codes))
        }
    };
    Ok((y, Saved { inner: (policy != Recompute::Full).then_some(kept) }))
}

fn run_gpt(
    plan: &Plan,
    x: &Tensor,
    params: &Tensor,
    policy: Recompute,
    quant: &mut Quantizers,
) -> candle_core::Result<(Tensor, Codes)> {
    let (cfg, ctx) = (&plan.config, &plan.ctx);
    let w = |name: &str| plan.w(params, name);
    let pre = cfg.norm == NormPlacement::Pre;
    // attention block input, all-gathered along the sequence (g) with a group
    let (attn_in, ln1_pre) = if pre {
        let (h1, s) = ctx.layer_norm(x, &w("ln_1.weight")?, &w("ln_1.bias")?, cfg.eps, quant.get(CodeSite::Ln1))?;
        (plan.gather(&h1)?, Some(s))
    } else {
        (plan.gather(x)?, None)
    };
    let q = plan.split_heads(&plan.proj(params, &attn_in, "attn.q_proj")?)?;
    let k = plan.split_heads(&plan.proj(params, &attn_in, "attn.k_proj")?)?;
    let v = plan.split_heads(&plan.proj(params, &attn_in, "attn.v_proj")?)?;
    let gate = plan.input_gate(params, &attn_in)?;
    drop(attn_in);
    let q_s = ctx.quantize(&q, quant.get(CodeSite::Q))?;
    let k_s = ctx.quantize(&k, quant.get(CodeSite::K))?;
    let v_s = ctx.quantize(&v, quant.get(CodeSite::V))?;
    let (o, p_s, la) = match (&plan.linear, plan.gated_core(gate.as_ref())?) {
        (None, Some(core)) => (core.forward(&ctx.kernels, &q, &k, &v)?, None, None),
        (None, None) => {
            let (p, p_s) = plan.probabilities(&q, &k, policy == Recompute::None)?;
            let mask = plan.dropout_mask(DropoutSite::Attention, p.dims())?;
            let o = dropout::apply(&p, mask.as_ref())?.matmul(&v)?;
            (o, p_s, None)
        }
        (Some(op), _) => {
            // its states are not kept: the backward reruns the O(N) core from the codes
            // in f32 for every dtype, as the op computes 16-bit inputs (crate::ops, "Dtypes")
            let f = |t: &Tensor| t.to_dtype(candle_core::DType::F32);
            let (o, _states) = op.forward_detached::<f32>(&ctx.kernels, &f(&q)?, &f(&k)?, &f(&v)?)?;
            (o.into_tensor()?.to_dtype(q.dtype())?, None, None)
        }
    };
    drop((q, k, v));
    let a = plan.merge_heads(&o)?;
    drop(o);
    let a_s = ctx.quantize(&a, quant.get(CodeSite::AttnOut))?;
    // x + D₁(a·W_oᵀ + b_o) on the rank's rows (ḡ with a group)
    let out_proj = ("attn.out_proj.weight", Some("attn.out_proj.bias"));
    let z1 = plan.row_parallel(params, &a, out_proj, DropoutSite::AttentionResidual, x)?;
    drop(a);
    let (x2, ffn_in, ln1, ln2_pre) = if pre {
        let (h2, s2) = ctx.layer_norm(&z1, &w("ln_2.weight")?, &w("ln_2.bias")?, cfg.eps, quant.get(CodeSite::Ln2))?;
        (z1, h2, ln1_pre, Some(s2))
    } else {
        let (x2n, s1) = ctx.layer_norm(&z1, &w("ln_1.weight")?, &w("ln_1.bias")?, cfg.eps, quant.get(CodeSite::Ln1))?;
        (x2n.clone(), x2n, Some(s1), None)
    };
    let u = plan.proj(params, &plan.gather(&ffn_in)?, "mlp.fc_in")?;
    drop(ffn_in);
    let (g, u_s) = ctx.gelu(&u, quant.get(CodeSite::FfnIn))?;
    drop(u);
    let fc_out = ("mlp.fc_out.weight", Some("mlp.fc_out.bias"));
    let z2 = plan.row_parallel(params, &g, fc_out, DropoutSite::FfnResidual, &x2)?;
    drop((g, x2));
    let (y, ln2) = if pre {
        (z2, ln2_pre)
    } else {
        let (y, s2) = ctx.layer_norm(&z2, &w("ln_2.weight")?, &w("ln_2.bias")?, cfg.eps, quant.get(CodeSite::Ln2))?;
        (y, Some(s2))
    };
    let (Some(ln1), Some(ln2)) = (ln1, ln2) else {
        return Err(crate::Error::StateConsumed { op: "transformer layer" }.into());
    };
    Ok((y, Codes { ln1, ln2, q: q_s, k: k_s, v: v_s, p: p_s, attn_out: a_s, u: u_s, la }))
}
