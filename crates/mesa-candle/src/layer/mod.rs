//! A transformer layer as **one** candle op over the layer input and one flat parameter
//! tensor, whose forward keeps only what its backward needs — as codes plus small
//! statistics — and whose backward computes every gradient with our kernels and candle's
//! matrix products.
//!
//! Candle's autograd keeps a clone of every argument of an op until backward (candle-core
//! `op.rs`, `BackpropOp`): for this op that is the layer input `x` and the parameters,
//! which the caller holds anyway. Nothing of the layer's internals is a node of candle's
//! graph: the forward runs on detached tensors and the op holds [`Saved`].
//!
//! Two block designs ([`Block`]): GPT below, and Llama ([`LlamaBlock`]: RMSNorm, RoPE,
//! grouped-query attention, SwiGLU; what it keeps is in its own table, `layer/llama.rs`).
//!
//! ```text
//! pre-LN:  h = LN₁(x);  x₂ = x + D₁(Attn(h));         y = x₂ + D₂(FFN(LN₂(x₂)))
//! post-LN: x₂ = LN₁(x + D₁(Attn(x)));                 y = LN₂(x₂ + D₂(FFN(x₂)))
//! Attn(h) = merge(softmax(QKᵀ/√d + causal) ⊙ D_P · V)·W_oᵀ + b_o,  Q = hW_qᵀ + b_q, …
//!           (or chunked linear attention over φ(Q), φ(K), V; or gated linear attention
//!           over Q/√d, K, V with a fixed decay per head)
//! FFN(h)  = GELU_erf(hW₁ᵀ + b₁)·W₂ᵀ + b₂
//! ```
//!
//! What the forward keeps ([`Recompute`]):
//!
//! | tensor | kept as | used by |
//! |---|---|---|
//! | `x̂` of LN₁ and LN₂ | codes + per-row mean, rstd | LN backwards; the decoded LN output for the next projection's `dW` |
//! | Q, K, V `[B,H,N,d]` | codes (per head) | `dQ = dS·K̂`, `dK = dSᵀ·Q̂`, `dV = P̂ᵀ·dO`; selective recomputation of `P` |
//! | `P` `[B,H,N,N]` (softmax attention, [`Recompute::None`] only) | codes of `√P` (fixed range) | softmax backward, `dV` |
//! | attention output before `W_o` | codes | `dW_o`; linear attention's backward |
//! | FFN pre-activation `u` | codes | GELU backward; `GELU(û)` for `dW₂` |
//! | linear attention, gated or not | nothing more: its `O(N)` core is rerun in backward from the Q, K, V codes | its backward |
//! | dropout masks | nothing: a Philox key (8 bytes) | regenerated ([`dropout`]) |
//!
//! [`Recompute::Selective`] (Korthikanti et al. 2022, §4.2) keeps no `P`: the backward
//! recomputes `QKᵀ`, softmax and the dropout mask from the saved Q and K codes, so nothing of
//! size `N²` is kept. [`Recompute::Full`] keeps nothing: the backward reruns the forward
//! (same dropout seed) from `x`, which candle holds as the op's argument.
//!
//! Under [`StatsMode::Running`] (Mesa §3.3) each [`CodeSite`] keeps its own running estimate
//! and reports how its last forward's codes fared ([`TransformerLayer::code_report`]): how
//! many groups were widened (the batch left the estimate by more than one step and was
//! saved with its own range), how many clamped within the one-step band, and the largest
//! error in quantization steps of the saved scale — exact for the clamped elements, a bound
//! of `max(clamp, 1/2)` (`1` with stochastic rounding) over all ([`CodeReport`]). A
//! training loop logs it per step at the cost of one host synchronisation per read.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Module, Tensor, Var};
use mesa_kernels::linear_attention::LinearAttentionConfig;
use mesa_kernels::rope::RopeConfig;
use mesa_kernels::{GroupParams, StatsMode};

use crate::attach::attach;
use crate::error::Error;
use crate::ops::{FeatureKind, GatedConfig, LinearAttention};
use crate::parallel::Collectives;

mod backward;
pub mod dropout;
mod gated;

/// Host bytes one layer's forward leaves in candle's graph besides its tensors: the boxed
/// backward state (what it saved, described, and its plan), counted by the planner.
pub(crate) const BACKWARD_STATE_BYTES: usize = crate::attach::carrier_bytes::<backward::LayerGrad>();
mod forward;
mod kernels;
mod llama;
pub mod measure;
mod params;
pub mod reference;

pub use forward::Saved;
pub use params::{ParamEntry, ParamLayout};

/// Where the LayerNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormPlacement {
    /// Before each block, inside the residual branch (GPT-2).
    Pre,
    /// After each residual add (BERT, the original transformer).
    Post,
}

/// The attention of the layer.
#[derive(Debug, Clone)]
pub enum Attention {
    /// Softmax attention, optionally causal.
    Softmax {
        /// Mask `s > t`.
        causal: bool,
    },
    /// Chunked linear attention over feature-mapped Q and K (no attention probabilities,
    /// hence no attention dropout).
    Linear {
        /// Causality, chunk, normalisation, memory mode of the kernels.
        config: LinearAttentionConfig,
        /// The feature map.
        map: FeatureKind,
    },
    /// Causal gated linear attention (issue 41; RetNet, Sun et al. 2023, §2.1–2.2, without its
    /// group norm and output gate): `S_t = γ_h S_{t−1} + k_t v_tᵀ`, `o_t = (q_t/√d)ᵀ S_t` per
    /// head, a fixed decay `γ_h = exp(a_h)` per KV head, over Q, K, V as they are (no feature
    /// map; the queries scaled by `1/√d` as softmax attention's logits). A Llama block's query
    /// heads read their KV head's K, V and decay without repeating them. No probabilities,
    /// hence no attention dropout. [`Attention::retnet`] gives RetNet's decays.
    Gated {
        /// The kernel's chunk (`normalize` must be false: [`LayerConfig::validate`]).
        config: GatedConfig,
        /// The log-decays `a_h = ln γ_h` (natural log, `≤ 0`; `−∞`: no memory), one per KV
        /// head ([`LayerConfig::kv_heads`]: `H` in a GPT block).
        log_decay: Vec<f32>,
    },
    /// Causal gated linear attention with a decay per step and KV head computed from the
    /// attention block's input `x̂` (the projections' input: the normalised input of a
    /// pre-norm block), in Mamba-2's parametrisation (Dao & Gu 2024, §7, the Mamba-2 block):
    /// `Δ_t = softplus(x̂_t·w_h + b_h)`, `a_t = −exp(A_log_h)·Δ_t`, so
    /// `S_t = exp(a_t) S_{t−1} + k_t v_tᵀ`, `o_t = (q_t/√d)ᵀ S_t`. The gate's parameters are
    /// the layer's ([`ParamLayout::of`]: `attn.decay_proj.weight` `[H_kv, C]`,
    /// `attn.decay_proj.bias` `[H_kv]` and `attn.A_log` `[H_kv]`, with `self_attn.` in a
    /// Llama block) and take gradients. Otherwise as [`Attention::Gated`]: no feature map, no
    /// normalisation, no attention dropout; Mamba-2's scaling of the input by `Δ`, its
    /// convolution, gate and norm are not part of it.
    InputGated {
        /// The kernel's chunk (`normalize` must be false: [`LayerConfig::validate`]).
        config: GatedConfig,
    },
}

impl Attention {
    /// Gated attention with RetNet's decays (Sun et al. 2023, §3.1: `γ_h = 1 − 2^(−5−h)` for
    /// head `h` of `kv_heads`, `a_h = ln γ_h`), not normalised, chunks of 64.
    #[must_use]
    pub fn retnet(kv_heads: usize) -> Attention {
        let log_decay = (0..kv_heads).map(|h| (1.0 - 2f64.powi(-5 - h as i32)).ln() as f32).collect();
        Attention::Gated { config: GatedConfig::default(), log_decay }
    }

    /// Gated attention with an input-dependent decay ([`Attention::InputGated`]), not
    /// normalised, chunks of 64.
    #[must_use]
    pub fn input_gated() -> Attention {
        Attention::InputGated { config: GatedConfig::default() }
    }

    /// Whether this is [`Attention::InputGated`].
    #[must_use]
    pub fn is_input_gated(&self) -> bool {
        matches!(self, Attention::InputGated { .. })
    }

    /// The gated kernel's configuration of [`Attention::Gated`] and [`Attention::InputGated`].
    #[must_use]
    pub fn gated_config(&self) -> Option<&GatedConfig> {
        match self {
            Attention::Gated { config, .. } | Attention::InputGated { config } => Some(config),
            Attention::Softmax { .. } | Attention::Linear { .. } => None,
        }
    }
}

/// What the forward keeps and the backward recomputes (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Keep every code the backward needs.
    None,
    /// Megatron's selective recomputation: recompute the attention core from Q, K codes.
    Selective,
    /// Keep only the layer input; recompute the whole forward in backward.
    Full,
}

/// A tensor the forward saves as codes, each with its own quantizer (and, under
/// [`StatsMode::Running`], its own running estimate, Mesa §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CodeSite {
    /// `x̂` of the first LayerNorm `[B, N, C]`, one group per head-sized channel slice.
    Ln1,
    /// The query projection `[B, H, N, d]`, one group per head.
    Q,
    /// The key projection `[B, H, N, d]`, one group per head.
    K,
    /// The value projection `[B, H, N, d]`, one group per head.
    V,
    /// The attention output before `W_o` `[B, N, C]`, per head-sized channel slice.
    AttnOut,
    /// `x̂` of the second LayerNorm `[B, N, C]`, per head-sized channel slice.
    Ln2,
    /// The FFN pre-activation `u` `[B, N, F]`, `H` channel slices of `F/H` (a Llama block's
    /// gate projection `g`, the argument of silu).
    FfnIn,
    /// A Llama block's up projection `u` `[B, N, F]` (the factor of SwiGLU), as
    /// [`CodeSite::FfnIn`]; a GPT block has none.
    FfnUp,
}

impl CodeSite {
    /// Every site, in the order of the forward.
    pub const ALL: [CodeSite; 8] = [
        CodeSite::Ln1,
        CodeSite::Q,
        CodeSite::K,
        CodeSite::V,
        CodeSite::AttnOut,
        CodeSite::Ln2,
        CodeSite::FfnIn,
        CodeSite::FfnUp,
    ];

    /// The sites of a GPT block ([`Block::Gpt`]): all but [`CodeSite::FfnUp`].
    pub const GPT: [CodeSite; 7] =
        [CodeSite::Ln1, CodeSite::Q, CodeSite::K, CodeSite::V, CodeSite::AttnOut, CodeSite::Ln2, CodeSite::FfnIn];
}

/// The design of the block: which norms, projections, position code and MLP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Block {
    /// GPT-2 / BERT / ViT: LayerNorm with bias, biased projections, as many K/V heads as Q
    /// heads, GELU (erf) MLP, no position code (the caller adds it to the input).
    Gpt,
    /// Llama / Mistral / Qwen ([`LlamaBlock`]): pre-RMSNorm, no biases, RoPE on Q and K,
    /// grouped-query attention, SwiGLU MLP.
    Llama(LlamaBlock),
}

/// The parts of a Llama-style block (Touvron et al. 2023, §2.2; grouped-query attention:
/// Ainslie et al. 2023):
///
/// ```text
/// h = RMSNorm₁(x);  x₂ = x + Attn(h)·W_oᵀ;  y = x₂ + (silu(h₂W_gᵀ) ⊙ h₂W_uᵀ)·W_dᵀ,  h₂ = RMSNorm₂(x₂)
/// Attn(h) = softmax(RoPE(hW_qᵀ)·RoPE(hW_kᵀ)ᵀ/√d + causal) · hW_vᵀ,  query head i reading KV head ⌊i/(H/H_kv)⌋
/// ```
///
/// The K and V codes are kept once per KV head (`[B, H_kv, N, d]`), never repeated: the
/// products run on the query heads of a group as one `[(H/H_kv)·N, d]` matrix against their
/// KV head, and the K, V gradients sum over the group inside the same product.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaBlock {
    /// K/V heads `H_kv`, dividing `heads` (`heads`: multi-head; 1: multi-query).
    pub kv_heads: usize,
    /// The rotation of Q and K (base, pairing, rotated dims; Llama: halves, base 10 000 or
    /// 500 000).
    pub rope: RopeConfig,
}

/// How the codes of one [`CodeSite`] fared in the layer's last forward under
/// [`StatsMode::Running`] (Mesa §3.3: the running estimate against the batch), from
/// [`TransformerLayer::code_report`].
///
/// Errors are in **quantization steps**: `|x − x̂| / scale` with `scale` the step of the
/// parameters the element's group was saved with (the ones backward decodes), over the
/// finite elements of the saved tensor (groups with NaN/±Inf are left out). The figures
/// come from the batch's exact per-group min/max against those parameters
/// ([`mesa_kernels::quant::BatchReport`]).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodeReport {
    /// Parameter groups of the site (one per head, or per head-sized channel slice).
    pub groups: usize,
    /// Groups the forward saved with their batch's own exact range because the batch left
    /// the running estimate by more than one step (0 on the first forward, which uses exact
    /// statistics).
    pub widened_groups: usize,
    /// Groups with an element outside the range their parameters decode to (clamped to the
    /// lowest or highest code; within one step, else the group is widened).
    pub clamped_groups: usize,
    /// The largest error of a clamped element, in steps: exact, attained by the batch's
    /// extreme element (0 when nothing clamped).
    pub max_clamp_steps: f64,
    /// Upper bound on the largest error of any element, in steps: `max(max_clamp_steps, r)`
    /// with `r` = 1/2 for round-to-nearest and 1 for stochastic rounding (the bound of an
    /// element inside the range, up to f32 rounding); the exact maximum whenever
    /// `max_clamp_steps > r`.
    pub max_error_steps: f64,
    /// Batches the site's quantizer has seen, the reported one included: the layer's
    /// forwards so far (the rerun of a [`Recompute::Full`] backward uses fresh quantizers
    /// with exact statistics and is not counted).
    pub batches: u64,
}

impl From<mesa_kernels::quant::BatchReport> for CodeReport {
    fn from(r: mesa_kernels::quant::BatchReport) -> Self {
        CodeReport {
            groups: r.groups,
            widened_groups: r.widened_groups,
            clamped_groups: r.clamped_groups,
            max_clamp_steps: r.max_clamp_steps,
            max_error_steps: r.max_error_steps,
            batches: r.batches,
        }
    }
}

/// Dropout probabilities and the seed of their masks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutConfig {
    /// On the attention probabilities (softmax attention only), in `[0, 1)`.
    pub attention: f32,
    /// On each block's output before its residual add, in `[0, 1)`.
    pub residual: f32,
    /// Philox seed; call `k` of [`Module::forward`] uses `seed + k` ([`TransformerLayer::forward_seeded`] takes one).
    pub seed: u64,
}

impl DropoutConfig {
    /// No dropout.
    #[must_use]
    pub fn none() -> Self {
        DropoutConfig { attention: 0.0, residual: 0.0, seed: 0 }
    }
}

/// The configuration of a [`TransformerLayer`].
#[derive(Debug, Clone)]
pub struct LayerConfig {
    /// The block's design ([`LayerConfig::new`]: GPT; [`LayerConfig::llama`]: Llama).
    pub block: Block,
    /// Model width `C`.
    pub hidden: usize,
    /// Heads `H` (`C = H·d`).
    pub heads: usize,
    /// FFN width `F`.
    pub ffn: usize,
    /// LayerNorm placement.
    pub norm: NormPlacement,
    /// Softmax or linear attention.
    pub attention: Attention,
    /// What backward recomputes.
    pub recompute: Recompute,
    /// Dropout.
    pub dropout: DropoutConfig,
    /// Bits of every code: 8, 4 or 2.
    pub bits: u32,
    /// Where the codes' ranges come from: [`StatsMode::Exact`] quantizes each call with its
    /// own min/max (two passes, fresh quantizers); [`StatsMode::Running`] keeps one quantizer
    /// per [`CodeSite`] in the layer across calls, Mesa's running estimate (one pass after
    /// the first call, momentum 0.9; [`TransformerLayer::running_params`] reads it). Under
    /// [`Recompute::Full`] the backward's rerun of the forward uses exact statistics.
    pub stats: StatsMode,
    /// Stochastic rounding of every code instead of round to nearest (issue 30): the key of
    /// each saved tensor comes from the call's seed (the dropout seed of
    /// [`TransformerLayer::forward_seeded`], `dropout.seed + k` for the `k`-th
    /// [`Module::forward`]) and the tensor's site, so calls and sites draw independent bits and
    /// a run replays from its seeds; the running estimate's quantizers, kept across calls,
    /// advance their own call counter from the first call's keys.
    pub stochastic_rounding: bool,
    /// ε of the norms (LayerNorm's, or RMSNorm's in a Llama block).
    pub eps: f32,
    /// The dtype of the flat parameter variable (and of its gradient): `F32` (master weights;
    /// the layer then takes f32, f16 or bf16 inputs and computes in the input's dtype with a
    /// rounded copy of the weights) or `F16`/`BF16` (inputs of that dtype only).
    pub param_dtype: DType,
}

impl LayerConfig {
    /// A pre-LN, causal softmax-attention layer, 8-bit codes with exact statistics, no
    /// recomputation, no dropout.
    #[must_use]
    pub fn new(hidden: usize, heads: usize, ffn: usize) -> Self {
        LayerConfig {
            block: Block::Gpt,
            hidden,
            heads,
            ffn,
            norm: NormPlacement::Pre,
            attention: Attention::Softmax { causal: true },
            recompute: Recompute::None,
            dropout: DropoutConfig::none(),
            bits: 8,
            stats: StatsMode::Exact,
            stochastic_rounding: false,
            eps: 1e-5,
            param_dtype: DType::F32,
        }
    }

    /// A Llama block ([`LlamaBlock`]) of width `hidden`, `heads` query heads and `kv_heads`
    /// K/V heads, SwiGLU width `ffn`: causal softmax attention, RoPE with base 10 000 over
    /// the two halves, RMSNorm ε 1e-5, 8-bit codes with exact statistics, no recomputation,
    /// no dropout (Llama 2's settings; Llama 3's base is 500 000; a checkpoint's
    /// `rms_norm_eps` and `rope_theta` are in its `config.json`).
    #[must_use]
    pub fn llama(hidden: usize, heads: usize, kv_heads: usize, ffn: usize) -> Self {
        LayerConfig {
            block: Block::Llama(LlamaBlock { kv_heads, rope: RopeConfig::llama(10_000.0) }),
            ..LayerConfig::new(hidden, heads, ffn)
        }
    }

    /// K/V heads: `H_kv` of a Llama block, `H` of a GPT block.
    #[must_use]
    pub fn kv_heads(&self) -> usize {
        match self.block {
            Block::Gpt => self.heads,
            Block::Llama(l) => l.kv_heads,
        }
    }

    /// The sites this block saves codes at ([`CodeSite::GPT`] or [`CodeSite::ALL`]).
    #[must_use]
    pub fn sites(&self) -> &'static [CodeSite] {
        match self.block {
            Block::Gpt => &CodeSite::GPT,
            Block::Llama(_) => &CodeSite::ALL,
        }
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |name, why: String| Err(Error::InvalidArgument { name, why });
        if self.hidden == 0 || self.heads == 0 || self.hidden % self.heads != 0 {
            return bad("heads", format!("hidden {} must be a positive multiple of heads {}", self.hidden, self.heads));
        }
        if self.ffn == 0 || self.ffn % self.heads != 0 {
            return bad(
                "ffn",
                format!(
                    "{} must be a positive multiple of heads {} (codes are grouped per head)",
                    self.ffn, self.heads
                ),
            );
        }
        if !matches!(self.bits, 2 | 4 | 8) {
            return bad("bits", format!("{} (supported: 8, 4, 2)", self.bits));
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return bad("eps", format!("must be positive and finite, got {}", self.eps));
        }
        // the parameter count (GPT: 4C² + 2CF + 9C + F; Llama: 2C² + 2C·H_kv·d + 3CF + 2C,
        // both below 4C² + 3CF + 9C + F) and its bytes fit in usize
        let (c, f) = (self.hidden, self.ffn);
        let count = c.checked_mul(c).and_then(|c2| c2.checked_mul(4)).and_then(|a| {
            let cf = c.checked_mul(f)?.checked_mul(3)?;
            a.checked_add(cf)?.checked_add(c.checked_mul(9)?)?.checked_add(f)?.checked_mul(4)
        });
        if count.is_none() {
            return bad("hidden", format!("hidden {c} and ffn {f}: the parameters' bytes overflow usize"));
        }
        if !matches!(self.param_dtype, DType::F32 | DType::F16 | DType::BF16) {
            return bad("param_dtype", format!("{:?} (supported: F32, F16, BF16)", self.param_dtype));
        }
        for (name, p) in [("dropout.attention", self.dropout.attention), ("dropout.residual", self.dropout.residual)] {
            if !(0.0..1.0).contains(&p) {
                return bad(name, format!("{p} is outside [0, 1)"));
            }
        }
        if !matches!(self.attention, Attention::Softmax { .. }) && self.dropout.attention != 0.0 {
            return bad("dropout.attention", "linear attention has no probabilities to drop".into());
        }
        if let Attention::Gated { log_decay, .. } = &self.attention {
            if log_decay.len() != self.kv_heads() {
                let why = format!("{} values for {} KV heads (one per KV head)", log_decay.len(), self.kv_heads());
                return bad("log_decay", why);
            }
            if let Some(a) = log_decay.iter().find(|a| a.is_nan() || **a > 0.0) {
                return bad("log_decay", format!("{a} is not ≤ 0 (a natural-log decay; −∞: no memory)"));
            }
        }
        if let Some(config) = self.attention.gated_config() {
            let max = mesa_kernels::gated_linear_attention::MAX_CHUNK;
            if config.chunk == 0 || config.chunk > max {
                return bad("attention.config.chunk", format!("{} is outside 1..={max}", config.chunk));
            }
            if config.normalize {
                // Q·Σ K of either sign: a denominator near 0, the guard ε its only bound. Tried:
                // at 8 bits the gradients' cosines to the f64 reference fell to 0.1–0.7
                let why = "the layer's gated attention is not normalised (no feature map keeps Q·ΣK away from 0)";
                return bad("attention.config.normalize", why.into());
            }
        }
        if let Block::Llama(l) = self.block {
            if l.kv_heads == 0 || self.heads % l.kv_heads != 0 {
                let why = format!("{} must be a positive divisor of heads {}", l.kv_heads, self.heads);
                return bad("kv_heads", why);
            }
            if self.norm != NormPlacement::Pre {
                return bad("norm", "a Llama block normalises before each block (NormPlacement::Pre)".into());
            }
            if matches!(self.attention, Attention::Linear { .. }) {
                let why =
                    "a Llama block takes softmax or gated attention (ungated linear attention has no grouped heads)";
                return bad("attention", why.into());
            }
            let d = self.head_dim();
            let r = l.rope.rotary_dims.unwrap_or(d);
            if r < 2 || r % 2 != 0 || r > d {
                return bad(
                    "rope.rotary_dims",
                    format!("{r} rotated dims of a head of {d}: an even number from 2 to {d}"),
                );
            }
            if !(l.rope.base.is_finite() && l.rope.base > 1.0) {
                return bad("rope.base", format!("{} must be finite and > 1", l.rope.base));
            }
        }
        Ok(())
    }

    /// Head dimension `d = C / H`.
    #[must_use]
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }
}

/// A transformer layer whose parameters are one flat variable (f32, or the 16-bit
/// [`LayerConfig::param_dtype`]) with named views
/// ([`ParamLayout`]); its forward is one node of candle's graph (module docs).
#[derive(Debug)]
pub struct TransformerLayer {
    config: LayerConfig,
    /// The tensor-parallel group this layer is one rank of ([`TransformerLayer::sharded`]).
    parallel: Option<Arc<dyn Collectives>>,
    /// shared with every forward's plan (no per-call copy of the names)
    layout: Arc<ParamLayout>,
    params: Var,
    calls: AtomicU64,
    /// The quantizers of [`StatsMode::Running`], created by the first forward.
    running: Mutex<Option<forward::Quantizers>>,
}

impl TransformerLayer {
    fn assemble(
        config: LayerConfig,
        layout: Arc<ParamLayout>,
        params: Var,
        parallel: Option<Arc<dyn Collectives>>,
    ) -> Self {
        TransformerLayer { config, parallel, layout, params, calls: AtomicU64::new(0), running: Mutex::new(None) }
    }

    /// A layer with freshly initialised parameters on `device` ([`ParamLayout::init`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] from [`LayerConfig::validate`]; candle's errors.
    pub fn new(config: LayerConfig, device: &candle_core::Device) -> candle_core::Result<Self> {
        config.validate()?;
        let layout = Arc::new(ParamLayout::of(&config)?);
        let params = layout.init(device)?;
        let params = match config.param_dtype {
            DType::F32 => params,
            dtype => Var::from_tensor(&params.as_tensor().to_dtype(dtype)?)?,
        };
        Ok(TransformerLayer::assemble(config, layout, params, None))
    }

    /// A layer whose parameters are loaded from per-weight tensors named `prefix + name`
    /// (e.g. `"h.0."` + `"attn.q_proj.weight"`), e.g. from `candle_core::safetensors::load`.
    ///
    /// # Errors
    /// As [`TransformerLayer::new`]; [`Error::MissingParameter`], [`Error::Shape`].
    pub fn from_tensors(
        config: LayerConfig,
        tensors: &std::collections::HashMap<String, Tensor>,
        prefix: &str,
        device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        config.validate()?;
        let layout = Arc::new(ParamLayout::of(&config)?);
        let params = Var::from_tensor(&layout.flatten(tensors, prefix, device)?.to_dtype(config.param_dtype)?)?;
        Ok(TransformerLayer::assemble(config, layout, params, None))
    }

    /// Rank `comm.rank()` of a layer split over the `t = comm.world_size()` ranks of a
    /// tensor- and sequence-parallel group (Korthikanti et al. 2022, §4.2.2; [`crate::parallel`],
    /// `docs/sequence_parallel.md`), with its share of the whole layer's flat parameters
    /// `full` ([`ParamLayout::new`] order; [`ParamLayout::shard`] cuts it). Its input and
    /// output are the rank's rows of the sequence, `[B, S_r, C]`; its parameters are the
    /// rank's slices ([`ParamLayout::sharded`]), and their gradient is complete on every rank
    /// (the replicated LayerNorm gradients are summed over the ranks inside the backward).
    ///
    /// # Errors
    /// As [`TransformerLayer::new`]; [`Error::InvalidArgument`] when `t` does not divide the
    /// heads and the FFN width, or for input-gated attention (not done for a sharded layer);
    /// [`Error::Shape`] when `full` is not the whole layer's.
    pub fn sharded(config: LayerConfig, full: &Tensor, comm: Arc<dyn Collectives>) -> candle_core::Result<Self> {
        let peers = Arc::clone(&comm);
        crate::parallel::tell_peers(peers.as_ref(), Self::sharded_inner(config, full, comm))
    }

    fn sharded_inner(config: LayerConfig, full: &Tensor, comm: Arc<dyn Collectives>) -> candle_core::Result<Self> {
        config.validate()?;
        if config.attention.is_input_gated() {
            // the gate's projection would be split by KV head, its replicated heads' gradients
            // summed: not done (fixed decays are: each rank takes its KV heads')
            let why = "input-gated attention in a sharded layer is not supported yet".into();
            return Err(Error::InvalidArgument { name: "attention", why }.into());
        }
        if config.param_dtype != DType::F32 {
            // its forward takes f32 inputs only (the 16-bit path over ranks is not tested)
            let op = "sharded transformer layer (f32 only)";
            return Err(Error::UnsupportedDType { op, dtype: config.param_dtype }.into());
        }
        let t = comm.world_size();
        if t == 0 || config.heads % t != 0 || config.ffn % t != 0 {
            return Err(Error::InvalidArgument {
                name: "tensor",
                why: format!("{t} ranks must divide heads {} and ffn {}", config.heads, config.ffn),
            }
            .into());
        }
        let whole = ParamLayout::of(&config)?;
        let part = whole.shard(&full.detach().to_dtype(config.param_dtype)?, comm.rank(), t)?;
        let layout = Arc::new(ParamLayout::sharded_of(&config, t)?);
        Ok(TransformerLayer::assemble(config, layout, Var::from_tensor(&part)?, Some(comm)))
    }

    /// The group of a [`TransformerLayer::sharded`] layer.
    #[must_use]
    pub fn parallel(&self) -> Option<&Arc<dyn Collectives>> {
        self.parallel.as_ref()
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &LayerConfig {
        &self.config
    }

    /// The names and offsets of the parameters.
    #[must_use]
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The flat parameter variable `[total]` ([`LayerConfig::param_dtype`]): hand it to an
    /// optimiser; its gradient is
    /// flat too ([`ParamLayout::unflatten`] names the pieces).
    #[must_use]
    pub fn params(&self) -> &Var {
        &self.params
    }

    /// The forward with an explicit dropout seed (the backward and a recomputation reuse it).
    /// `x: [B, N, C]` → `[B, N, C]` of `x`'s dtype: f32, f16 or bf16 (with parameters of that
    /// dtype or f32, [`LayerConfig::param_dtype`]). A 16-bit layer computes its projections,
    /// attention products and codes in the input's dtype, and its norms and softmax in f32
    /// (inside the kernels; the RMSNorm of a Llama block in f32 candle ops, its `x̂` codes of
    /// the f32 `x̂`); its parameters' gradient has the parameters' dtype. A
    /// [`TransformerLayer::sharded`] layer (f32 only) takes its rank's rows `[B, N_r, C]` of a
    /// sequence split evenly (`N = t·N_r`: [`TransformerLayer::forward_shard`] takes other
    /// splits).
    ///
    /// # Errors
    /// [`Error::Rank`] (`x` not of rank 3), [`Error::Shape`] (`C` not the configured hidden
    /// size), [`Error::UnsupportedDType`] (not f32, f16 or bf16; 16-bit on a sharded layer),
    /// [`Error::DTypeMismatch`] (16-bit parameters and an input of another dtype),
    /// [`Error::DeviceMismatch`], the kernels' errors.
    pub fn forward_seeded(&self, x: &Tensor, seed: u64) -> candle_core::Result<Tensor> {
        let splits = match &self.parallel {
            Some(comm) => vec![x.dims().get(1).copied().unwrap_or(0); comm.world_size()],
            None => Vec::new(),
        };
        self.forward_shard(x, &splits, seed)
    }

    /// [`TransformerLayer::forward_seeded`] of a sharded layer on rank `r`'s rows `[B, N_r, C]`
    /// of a sequence split as `splits` (one size per rank, the same on every rank, `N_r =
    /// splits[r]`). An unsharded layer takes `&[]`.
    ///
    /// # Errors
    /// As [`TransformerLayer::forward_seeded`]; [`Error::Shape`] when `N_r ≠ splits[r]`;
    /// [`Error::Collective`] when the ranks disagree, one fails or one does not arrive.
    pub fn forward_shard(&self, x: &Tensor, splits: &[usize], seed: u64) -> candle_core::Result<Tensor> {
        match &self.parallel {
            // an error of this rank's own must not leave its peers waiting for it
            Some(comm) => crate::parallel::tell_peers(comm.as_ref(), self.forward_inner(x, splits, seed)),
            None => self.forward_inner(x, splits, seed),
        }
    }

    fn forward_inner(&self, x: &Tensor, splits: &[usize], seed: u64) -> candle_core::Result<Tensor> {
        crate::ops::check_rank("layer input [B, N, C]", x, 3, false)?;
        let tp = match &self.parallel {
            None if splits.is_empty() => None,
            None => {
                return Err(
                    Error::InvalidArgument { name: "splits", why: "an unsharded layer takes no splits".into() }.into()
                )
            }
            Some(comm) => {
                let r = comm.rank();
                let len = splits.get(r).copied();
                if len != Some(x.dims()[1]) {
                    let what = format!("rank {r}'s rows of the layer input (splits {splits:?})");
                    let (b, c) = (x.dims()[0], x.dims()[2]);
                    let want = vec![b, len.unwrap_or(0), c];
                    return Err(Error::Shape { what, expected: want, got: x.dims().to_vec() }.into());
                }
                Some(forward::TpPlan {
                    comm: Arc::clone(comm),
                    splits: splits.to_vec(),
                    offset: splits[..r].iter().sum(),
                    len: splits[r],
                })
            }
        };
        let (b, n, c) = x.dims3()?;
        if c != self.config.hidden {
            return Err(Error::Shape {
                what: format!("layer input [B, N, C] with C = hidden = {}", self.config.hidden),
                expected: vec![b, n, self.config.hidden],
                got: x.dims().to_vec(),
            }
            .into());
        }
        let params = self.params.as_tensor();
        self.check_dtypes(x)?;
        let ctx = kernels::Ctx {
            candle: x.device().clone(),
            kernels: crate::bridge::common_device("transformer layer", &[x, params])?,
        };
        let plan = Arc::new(forward::Plan {
            config: self.config.clone(),
            layout: Arc::clone(&self.layout),
            ctx,
            seed,
            linear: self.linear(),
            tp,
        });
        let (y, saved) = match self.config.stats {
            StatsMode::Exact => {
                let mut quant = forward::Quantizers::new(&plan, StatsMode::Exact)?;
                forward::run(
                    &plan,
                    &x.detach(),
                    &params.detach().to_dtype(x.dtype())?,
                    self.config.recompute,
                    &mut quant,
                )?
            }
            StatsMode::Running => {
                // a panic elsewhere cannot leave a quantizer half-updated: its state is device
                // memory written by whole launches
                let mut guard = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if guard.is_none() {
                    *guard = Some(forward::Quantizers::new(&plan, StatsMode::Running)?);
                }
                let quant = guard.as_mut().ok_or(Error::StateConsumed { op: "transformer layer" })?;
                forward::run(&plan, &x.detach(), &params.detach().to_dtype(x.dtype())?, self.config.recompute, quant)?
            }
        };
        let result = crate::ops::tensor_result(&y)?;
        drop(y);
        attach(&[x, params], result, backward::LayerGrad { plan, saved })
    }

    /// The running estimate of `site` per group — `offset` (EMA of the minimum) and `scale`
    /// (EMA of the range over `2^bits − 1`), f32, one entry per head (per head-sized channel
    /// slice for token tensors) — or `None` under [`StatsMode::Exact`] and before the first
    /// forward. Synchronises with the device.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the copy from the device fails.
    pub fn running_params(&self, site: CodeSite) -> Result<Option<Vec<GroupParams>>, Error> {
        let guard = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_ref() {
            Some(q) => Ok(q.running_params(site)?),
            None => Ok(None),
        }
    }

    /// How the codes of `site` fared in the last forward ([`CodeReport`]: groups, widened
    /// groups, the largest error in quantization steps of the saved tensor — shapes per
    /// [`CodeSite`]), or `None` under [`StatsMode::Exact`] and before the first forward.
    /// Mesa §3.3: under [`StatsMode::Running`] every forward after the first quantizes
    /// with the running estimate in one pass and widens the groups that left it by more
    /// than one step.
    ///
    /// Recording costs each forward, per site, two small device-to-device copies (24 B a
    /// group) and, for the quantize-on-save sites (Q, K, V, attention output), a separate
    /// finalize launch; reading synchronises with the device (three copies of ≤ 16 B a
    /// group to the host).
    ///
    /// # Errors
    /// [`Error::Kernel`] when a copy from the device fails.
    pub fn code_report(&self, site: CodeSite) -> Result<Option<CodeReport>, Error> {
        let guard = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_ref() {
            Some(q) => Ok(q.report(site)?.map(CodeReport::from)),
            None => Ok(None),
        }
    }

    /// The input's dtype against the parameters' ([`LayerConfig::param_dtype`]).
    fn check_dtypes(&self, x: &Tensor) -> Result<(), Error> {
        let op = "transformer layer";
        if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::UnsupportedDType { op, dtype: x.dtype() });
        }
        let p = self.params.dtype();
        if p != DType::F32 && p != x.dtype() {
            let (what, of) = ("layer input [B, N, C]".to_string(), "parameters (param_dtype)".to_string());
            return Err(Error::DTypeMismatch { op, what, of, expected: p, got: x.dtype() });
        }
        if self.parallel.is_some() && x.dtype() != DType::F32 {
            // the 16-bit path over ranks is not tested yet
            return Err(Error::UnsupportedDType { op: "sharded transformer layer (f32 only)", dtype: x.dtype() });
        }
        Ok(())
    }

    fn linear(&self) -> Option<LinearAttention> {
        match &self.config.attention {
            Attention::Linear { config, map } => Some(LinearAttention::new(*config, map.clone())),
            Attention::Softmax { .. } | Attention::Gated { .. } | Attention::InputGated { .. } => None,
        }
    }
}

impl Module for TransformerLayer {
    /// [`TransformerLayer::forward_seeded`] with seed `dropout.seed + k` for the `k`-th call;
    /// inside a checkpoint region, with the region's next key ([`crate::region::next_key`]),
    /// so that the region's rerun replays the dropout masks.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if crate::region::in_region() {
            return self.forward_seeded(x, crate::region::next_key());
        }
        let k = self.calls.fetch_add(1, Ordering::Relaxed);
        self.forward_seeded(x, self.config.dropout.seed.wrapping_add(k))
    }
}
