//! Activation-memory planner: the bytes a transformer layer keeps for its backward, per
//! tensor, per layer and for the stack — and the largest micro-batch or sequence that fits a
//! budget ([`largest_micro_batch`], [`largest_sequence`]).
//!
//! Framework-independent arithmetic, no device. Sizes follow Korthikanti et al. 2022,
//! *Reducing Activation Recomputation in Large Transformer Models*, §4 (notation `s`
//! sequence, `b` micro-batch, `h` hidden, `a` heads, `t` tensor-parallel size, `L` layers),
//! with the FFN width `f` (`4h` in the paper) and the precision of every saved tensor as
//! parameters. Per layer and per tensor-parallel rank, at 16 bits with 1-byte dropout masks
//! (the paper's Table 2):
//!
//! ```text
//! attention block  11sbh + 5as²b :  LN₁ input 2sbh · QKV input 2sbh · Q, K 4sbh ·
//!                                   softmax out 2as²b · its dropout mask as²b · dropout out 2as²b ·
//!                                   V 2sbh · out-proj input 2sbh · residual dropout mask sbh
//! MLP block        19sbh         :  LN₂ input 2sbh · FC₁ input 2sbh · GeLU input 8sbh ·
//!                                   FC₂ input 8sbh · residual dropout mask sbh
//! no parallelism                    sbh(34 + 5as/h)
//! tensor parallel t                 sbh(10 + 24/t + 5as/(ht))
//! tensor + sequence parallel        sbh(34/t + 5as/(ht))
//! tensor parallel + selective       sbh(10 + 24/t)
//! tensor + sequence + selective     sbh·34/t
//! full recomputation                2sbh  (the layer input; 2sbh/t under sequence parallelism)
//! ```
//!
//! Under tensor parallelism (§4.2.1) Q, K, V, the `s²` tensors, the out-projection input and
//! the two FFN tensors of width `f` are split over the heads/columns (`/t`); the norms' inputs,
//! the QKV and FC₁ inputs and the residual masks are replicated — unless sequence parallelism
//! (§4.2.2) splits them along `s` (`/t`). Selective recomputation (§5) keeps nothing of the
//! attention core (`QKᵀ`, softmax, its dropout, `·V`): the `5as²b` term goes. Full
//! recomputation keeps the layer input only.
//!
//! What each precision costs per element, and per tensor: [`Precision`]. A tensor's bytes
//! are `elements · bytes/element`, or for codes `⌈elements · bits / 8⌉ + groups · 8 + 4`
//! (offset and scale f32 per group, a non-finite counter), the format of
//! [`SavedActivation`](crate::SavedActivation). Every count is checked: a product past
//! `u64` is [`Error::TooLarge`], never a wrap or a panic.
//!
//! The whole training step — weights, gradients, optimizer state, these activations and the
//! largest transient — and the largest batch that fits on that total: [`TrainingConfig`],
//! [`MemoryBreakdown`], [`largest_training_batch`]. The cheapest tensor-parallel size,
//! sequence parallelism, recomputation and code width that fit a budget per GPU, for the
//! paper's four Table 3 models: [`cheapest_setting`].
use crate::error::{Error, Result};

mod search;
mod setting;
mod training;

pub use search::{largest_fit, largest_micro_batch, largest_sequence};
pub use setting::{
    candidate_settings, cheapest_setting, llama3_models, paper_models, setting_memory, PaperModel, Setting,
    SettingMemory, LLAMA3_VOCAB, PAPER_VOCAB,
};
pub use training::{
    largest_training_batch, layer_parameters, MemoryBreakdown, Optimizer, TrainingConfig, TrainingPrecision,
};

/// The model's sizes (the paper's `L, s, b, h, a` and the FFN width).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer layers `L`.
    pub layers: u64,
    /// Sequence length `s` (tokens).
    pub seq: u64,
    /// Micro-batch `b` (sequences).
    pub micro_batch: u64,
    /// Hidden size `h`.
    pub hidden: u64,
    /// Attention heads `a` (`h` a multiple of `a`).
    pub heads: u64,
    /// FFN width `f` (`4h` in GPT-3 and the paper).
    pub ffn: u64,
}

/// Tensor and sequence parallelism (§4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    /// Tensor-parallel size `t` (1: none). Must divide `a`, `h` and `f`.
    pub tensor: u64,
    /// Sequence parallelism: the replicated tensors are split along `s` (`t` must divide `s`).
    pub sequence: bool,
}

impl Parallelism {
    /// No parallelism (`t = 1`).
    #[must_use]
    pub fn none() -> Self {
        Parallelism { tensor: 1, sequence: false }
    }
}

/// How a dropout mask is kept for the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskStorage {
    /// Stored, this many bytes per element (Megatron: 1, a `bool` tensor; a framework that
    /// multiplies by an f32 mask: 4).
    Stored {
        /// Bytes per element.
        bytes: u64,
    },
    /// Regenerated from a counter-based seed in the backward: 0 bytes.
    Regenerated,
}

/// Dropout probabilities and how their masks are kept. A probability of 0 means no dropout
/// there (no mask, and no dropout output of the attention probabilities).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// On the attention probabilities, in `[0, 1)`.
    pub attention: f64,
    /// On each block's output before its residual add, in `[0, 1)`.
    pub residual: f64,
    /// Masks stored or regenerated.
    pub masks: MaskStorage,
}

/// What the forward keeps and the backward recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Keep everything the backward needs.
    None,
    /// Recompute the attention core (`QKᵀ`, softmax, its dropout, `·V`) from Q, K, V (§5).
    Selective,
    /// Keep the layer input only and rerun the layer's forward in the backward (§5).
    Full,
}

/// Which elements of a coded tensor share an offset and a scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeGroups {
    /// One group per attention head (of this rank): Mesa's head-wise statistics; for token
    /// tensors `[s, b, h]` one group per head-sized channel slice.
    PerHead,
    /// One group for the whole tensor.
    PerTensor,
}

/// A quantized format: packed codes plus per-group statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeFormat {
    /// Bits per code: 8, 4 or 2 (packed, `⌈n·bits/8⌉` bytes).
    pub bits: u32,
    /// Grouping of the statistics.
    pub groups: CodeGroups,
    /// Bytes of statistics per group (offset and scale, f32: 8).
    pub group_bytes: u64,
    /// Bytes per tensor besides (a 4-byte non-finite counter).
    pub tensor_bytes: u64,
}

impl CodeFormat {
    /// The format of [`SavedActivation`](crate::SavedActivation): `bits`-bit codes, one
    /// f32 offset and scale per head, a 4-byte non-finite counter.
    #[must_use]
    pub fn per_head(bits: u32) -> Self {
        CodeFormat { bits, groups: CodeGroups::PerHead, group_bytes: 8, tensor_bytes: 4 }
    }
}

/// The precision of one saved tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// 4 bytes per element.
    F32,
    /// 2 bytes per element (bf16 or fp16).
    Half,
    /// Codes: `⌈n·bits/8⌉` bytes plus statistics ([`CodeFormat`]).
    Codes(CodeFormat),
}

/// The precision saved for each class of op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedPrecision {
    /// What a norm keeps of its input (Megatron: the input; Mesa-style fused norms: the codes
    /// of `x̂`, whose rows are rebuilt with the row statistics).
    pub norm: Precision,
    /// Bytes per row a norm keeps besides (e.g. its mean and `1/σ` in f32: 8; the paper
    /// counts 0).
    pub norm_row_bytes: u64,
    /// Inputs of the linear layers (QKV, out-projection, FC₁, FC₂) that are stored.
    pub linear_input: Precision,
    /// Q, K and V.
    pub qkv: Precision,
    /// The attention probabilities (softmax output; and its dropout output when stored).
    pub probabilities: Precision,
    /// The GeLU input (`[s, b, f]`).
    pub activation: Precision,
    /// Shared FC inputs: the QKV, FC₁, FC₂ and `P·V` inputs are rebuilt in the backward from
    /// what their producer saved (LN₁, LN₂, GeLU input, softmax output and mask): 0 bytes. The
    /// paper stores them (false).
    pub shared_inputs: bool,
    /// The layer input as the framework keeps it besides what the ops save (candle keeps an
    /// op's arguments), or `None` when it is only the first norm's saved input (the paper).
    pub layer_input: Option<Precision>,
}

impl SavedPrecision {
    /// Every tensor at `p`, inputs stored, nothing else (the paper's accounting at `p`).
    #[must_use]
    pub fn uniform(p: Precision) -> Self {
        SavedPrecision {
            norm: p,
            norm_row_bytes: 0,
            linear_input: p,
            qkv: p,
            probabilities: p,
            activation: p,
            shared_inputs: false,
            layer_input: None,
        }
    }
}

/// What linear attention keeps of its prefix-sum states (the kernels' memory modes,
/// [`MemoryMode`](crate::linear_attention::MemoryMode)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearStates {
    /// The state entering every chunk and the final one: `b·a·(⌈s/C⌉ + 1)·M·W` f32 (causal;
    /// bidirectional: the final state only).
    Boundary,
    /// SLiM: only the final state, `b·a·M·W` f32, independent of `s`.
    Slim,
    /// Nothing: the backward reruns the `O(s)` core from Q, K, V.
    Rerun,
}

/// The attention of the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Softmax attention: the `s²` tensors of §4.1.
    Softmax,
    /// Chunked linear attention (SLiM/Performer): no `s²` tensor.
    Linear {
        /// Causal (bidirectional attention keeps no per-chunk states).
        causal: bool,
        /// Rows per chunk `C`.
        chunk: u64,
        /// Feature dimension `M` of φ(Q), φ(K) (`h/a` for ReLU or ELU+1 maps).
        features: u64,
        /// Normalised: the states carry `Σk` (`W = h/a + 1`) and the denominators
        /// (`b·a·s` f32) are kept.
        normalize: bool,
        /// The states kept.
        states: LinearStates,
    },
}

/// The design of the block: which tensors its MLP and attention keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// GPT-2 / BERT (the paper's layer): LayerNorms, `a` K/V heads, GeLU MLP.
    Gpt,
    /// Llama (Touvron et al. 2023): RMSNorms, RoPE, grouped-query attention with `kv_heads`
    /// K/V heads, SwiGLU MLP (gate and up projections of width `f`, then the down
    /// projection). Per layer it keeps, instead of the GPT block's K and V `[s, b, h]`, K and V
    /// `[s, b, kv_heads·h/a]`, and instead of the GeLU input, SwiGLU's two inputs `[s, b, f]`.
    /// Under tensor parallelism each rank holds `kv_heads/t` K/V heads, or one (replicated)
    /// when `t > kv_heads` (Megatron's split; `t` and `kv_heads` must divide one another).
    Llama {
        /// K/V heads, dividing `a`.
        kv_heads: u64,
    },
}

/// Everything the planner needs for one configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanConfig {
    /// The block's design.
    pub block: BlockKind,
    /// Sizes.
    pub shape: ModelShape,
    /// Tensor and sequence parallelism.
    pub parallel: Parallelism,
    /// Dropout.
    pub dropout: Dropout,
    /// Recomputation.
    pub recompute: Recompute,
    /// Precision per op class.
    pub saved: SavedPrecision,
    /// Softmax or linear attention.
    pub attention: AttentionKind,
}

/// The saved tensors the planner itemises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SavedTensor {
    /// The layer input kept by the framework ([`SavedPrecision::layer_input`]), or the only
    /// thing kept under full recomputation.
    LayerInput,
    /// LN₁'s saved input (or `x̂` codes).
    Norm1,
    /// LN₁'s per-row statistics.
    Norm1Rows,
    /// The QKV projection input.
    QkvInput,
    /// Q.
    Q,
    /// K.
    K,
    /// V.
    V,
    /// The softmax output `[a, s, s]` per sequence.
    Softmax,
    /// The attention dropout mask.
    SoftmaxDropoutMask,
    /// The attention dropout output (the input of `·V`).
    SoftmaxDropoutOutput,
    /// Linear attention's prefix-sum states and denominators.
    LinearStates,
    /// The out-projection input.
    OutProjInput,
    /// The attention block's residual dropout mask.
    AttentionResidualMask,
    /// LN₂'s saved input (or `x̂` codes).
    Norm2,
    /// LN₂'s per-row statistics.
    Norm2Rows,
    /// The FC₁ input.
    Fc1Input,
    /// The GeLU input `[s, b, f]`.
    GeluInput,
    /// SwiGLU's gate input `g` `[s, b, f]` (Llama).
    SwigluGate,
    /// SwiGLU's up input `u` `[s, b, f]` (Llama).
    SwigluUp,
    /// The FC₂ input `[s, b, f]`.
    Fc2Input,
    /// The FFN block's residual dropout mask.
    FfnResidualMask,
}

/// One saved tensor of one layer on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// Which tensor.
    pub tensor: SavedTensor,
    /// Elements kept on this rank.
    pub elements: u64,
    /// Bytes kept on this rank.
    pub bytes: u64,
}

/// The bytes one layer keeps on one rank, itemised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBytes {
    /// The saved tensors with a non-zero size, in forward order.
    pub items: Vec<Item>,
    /// Their sum.
    pub total: u64,
}

/// The plan of a configuration: one layer itemised, and the stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// One layer (every layer of the stack has the same shape).
    pub layer: LayerBytes,
    /// Layers `L`.
    pub layers: u64,
    /// `L · layer.total`: bytes per rank for the stack of layers (the paper's first pipeline
    /// stage without pipeline parallelism; embedding and output layer not included).
    pub total: u64,
}

fn too_large(what: &str) -> Error {
    Error::too_large(format!("plan: {what}"), "the byte count overflows u64")
}

/// `Π factors`, checked.
fn product(factors: &[u64], what: &str) -> Result<u64> {
    factors.iter().try_fold(1u64, |acc, &f| acc.checked_mul(f)).ok_or_else(|| too_large(what))
}

impl Precision {
    /// Bytes of a tensor of `elements` elements whose statistics groups are `heads` heads.
    ///
    /// # Errors
    /// [`Error::TooLarge`] on overflow; [`Error::InvalidArgument`] for a bit width other than
    /// 8, 4 or 2.
    pub fn bytes(&self, elements: u64, heads: u64) -> Result<u64> {
        match *self {
            Precision::F32 => product(&[elements, 4], "f32 tensor"),
            Precision::Half => product(&[elements, 2], "16-bit tensor"),
            Precision::Codes(f) => {
                if !matches!(f.bits, 2 | 4 | 8) {
                    return Err(Error::invalid_argument("bits", format!("{} (supported: 8, 4, 2)", f.bits)));
                }
                let codes = product(&[elements, u64::from(f.bits)], "codes")?.div_ceil(8);
                let groups = match f.groups {
                    CodeGroups::PerHead => heads,
                    CodeGroups::PerTensor => 1,
                };
                product(&[groups, f.group_bytes], "group statistics")?
                    .checked_add(codes)
                    .and_then(|v| v.checked_add(f.tensor_bytes))
                    .ok_or_else(|| too_large("codes"))
            }
        }
    }
}

impl PlanConfig {
    /// Checks sizes, divisibility and probabilities.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field: a zero size, `h` not a multiple of `a`,
    /// `t` not dividing `a`, `h` or `f` (or `s` under sequence parallelism), a probability
    /// outside `[0, 1)`, a zero chunk or feature dimension, bits other than 8/4/2.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, why: String| Err(Error::invalid_argument(format!("plan: {name}"), why));
        let s = &self.shape;
        for (name, v) in [
            ("layers", s.layers),
            ("seq", s.seq),
            ("micro_batch", s.micro_batch),
            ("hidden", s.hidden),
            ("heads", s.heads),
            ("ffn", s.ffn),
            ("tensor", self.parallel.tensor),
        ] {
            if v == 0 {
                return bad(name, "must be positive".into());
            }
        }
        if s.hidden % s.heads != 0 {
            return bad("heads", format!("hidden {} is not a multiple of heads {}", s.hidden, s.heads));
        }
        let t = self.parallel.tensor;
        for (name, v) in [("heads", s.heads), ("hidden", s.hidden), ("ffn", s.ffn)] {
            if v % t != 0 {
                return bad(name, format!("{v} is not a multiple of the tensor-parallel size {t}"));
            }
        }
        if self.parallel.sequence && s.seq % t != 0 {
            return bad(
                "seq",
                format!("{} is not a multiple of the tensor-parallel size {t} (sequence parallel)", s.seq),
            );
        }
        for (name, p) in [("dropout.attention", self.dropout.attention), ("dropout.residual", self.dropout.residual)] {
            if !(0.0..1.0).contains(&p) {
                return bad(name, format!("{p} is outside [0, 1)"));
            }
        }
        if let AttentionKind::Linear { chunk, features, .. } = self.attention {
            if chunk == 0 || features == 0 {
                return bad("attention", format!("chunk {chunk} and features {features} must be positive"));
            }
        }
        if let BlockKind::Llama { kv_heads: kv } = self.block {
            if kv == 0 || s.heads % kv != 0 {
                return bad("kv_heads", format!("{kv} must be a positive divisor of heads {}", s.heads));
            }
            if kv % t != 0 && t % kv != 0 {
                return bad("kv_heads", format!("{kv} and the tensor-parallel size {t} must divide one another"));
            }
        }
        let sv = &self.saved;
        for p in [
            Some(sv.norm),
            Some(sv.linear_input),
            Some(sv.qkv),
            Some(sv.probabilities),
            Some(sv.activation),
            sv.layer_input,
        ]
        .into_iter()
        .flatten()
        {
            if let Precision::Codes(f) = p {
                if !matches!(f.bits, 2 | 4 | 8) {
                    return bad("bits", format!("{} (supported: 8, 4, 2)", f.bits));
                }
            }
        }
        Ok(())
    }

    /// The plan: one layer itemised and the stack (module docs for the formulas).
    ///
    /// # Errors
    /// [`PlanConfig::validate`]'s errors; [`Error::TooLarge`] when a count overflows `u64`.
    pub fn plan(&self) -> Result<Plan> {
        let layer = self.layer_bytes()?;
        let total = product(&[layer.total, self.shape.layers], "stack")?;
        Ok(Plan { layer, layers: self.shape.layers, total })
    }

    /// [`Plan::total`] of [`PlanConfig::plan`].
    ///
    /// # Errors
    /// As [`PlanConfig::plan`].
    pub fn total_bytes(&self) -> Result<u64> {
        Ok(self.plan()?.total)
    }

    /// The bytes one layer keeps on one rank, itemised by tensor.
    ///
    /// # Errors
    /// As [`PlanConfig::plan`].
    pub fn layer_bytes(&self) -> Result<LayerBytes> {
        self.validate()?;
        let ModelShape { seq: s, micro_batch: b, hidden: h, heads: a, ffn: f, .. } = self.shape;
        let t = self.parallel.tensor;
        let sp = self.parallel.sequence;
        // a replicated token tensor [s, b, h] is split along s under sequence parallelism
        let rep = |width: u64| -> Result<u64> {
            let n = product(&[s, b, width], "token tensor")?;
            Ok(if sp { n / t } else { n })
        };
        // rows (tokens) of a replicated tensor
        let rows = product(&[s, b], "rows")? / if sp { t } else { 1 };
        let tok = product(&[s, b, h], "token tensor")? / t; // split over heads/columns
        let ffn = product(&[s, b, f], "FFN tensor")? / t;
        let heads = a / t;
        // K and V: `kv_heads/t` heads of `h/a` per rank (one when t > kv_heads), or `h/t`
        let (kv_tok, kv_local) = match self.block {
            BlockKind::Gpt => (tok, heads),
            BlockKind::Llama { kv_heads } => {
                let local = (kv_heads / t).max(1);
                (product(&[s, b, local, h / a], "K/V tensor")?, local)
            }
        };
        let sv = &self.saved;
        let mut items: Vec<Item> = Vec::new();
        let mut push = |tensor: SavedTensor, elements: u64, bytes: u64| {
            if bytes > 0 {
                items.push(Item { tensor, elements, bytes });
            }
        };
        let mask = |elements: u64| -> Result<u64> {
            match self.dropout.masks {
                MaskStorage::Stored { bytes } => product(&[elements, bytes], "dropout mask"),
                MaskStorage::Regenerated => Ok(0),
            }
        };
        if self.recompute == Recompute::Full {
            let n = rep(h)?;
            let p = sv.layer_input.unwrap_or(sv.norm);
            push(SavedTensor::LayerInput, n, p.bytes(n, a)?);
            return finish(items);
        }
        let n_rep = rep(h)?;
        if let Some(p) = sv.layer_input {
            push(SavedTensor::LayerInput, n_rep, p.bytes(n_rep, a)?);
        }
        push(SavedTensor::Norm1, n_rep, sv.norm.bytes(n_rep, a)?);
        push(SavedTensor::Norm1Rows, rows, product(&[rows, sv.norm_row_bytes], "norm rows")?);
        if !sv.shared_inputs {
            push(SavedTensor::QkvInput, n_rep, sv.linear_input.bytes(n_rep, a)?);
        }
        push(SavedTensor::Q, tok, sv.qkv.bytes(tok, heads)?);
        push(SavedTensor::K, kv_tok, sv.qkv.bytes(kv_tok, kv_local)?);
        if self.recompute == Recompute::None {
            match self.attention {
                AttentionKind::Softmax => {
                    let p = product(&[heads, s, s, b], "attention probabilities")?;
                    push(SavedTensor::Softmax, p, sv.probabilities.bytes(p, heads)?);
                    if self.dropout.attention > 0.0 {
                        push(SavedTensor::SoftmaxDropoutMask, p, mask(p)?);
                        if !sv.shared_inputs {
                            push(SavedTensor::SoftmaxDropoutOutput, p, sv.probabilities.bytes(p, heads)?);
                        }
                    }
                }
                AttentionKind::Linear { causal, chunk, features, normalize, states } => {
                    let w = (h / a).checked_add(u64::from(normalize)).ok_or_else(|| too_large("state width"))?;
                    // one state per K/V head (the gated kernel's; H_kv = H but in a Llama block)
                    let state = product(&[b, kv_local, features, w], "linear-attention state")?;
                    let kept = match states {
                        LinearStates::Boundary if causal => {
                            let chunks =
                                s.div_ceil(chunk).checked_add(1).ok_or_else(|| too_large("boundary states"))?;
                            product(&[state, chunks], "boundary states")?
                        }
                        LinearStates::Boundary | LinearStates::Slim => state,
                        LinearStates::Rerun => 0,
                    };
                    let den = if normalize && states != LinearStates::Rerun {
                        product(&[b, heads, s], "denominators")?
                    } else {
                        0
                    };
                    let n = kept.checked_add(den).ok_or_else(|| too_large("linear-attention states"))?;
                    push(SavedTensor::LinearStates, n, product(&[n, 4], "linear-attention states")?);
                }
            }
        }
        push(SavedTensor::V, kv_tok, sv.qkv.bytes(kv_tok, kv_local)?);
        push(SavedTensor::OutProjInput, tok, sv.linear_input.bytes(tok, heads)?);
        if self.dropout.residual > 0.0 {
            push(SavedTensor::AttentionResidualMask, n_rep, mask(n_rep)?);
        }
        push(SavedTensor::Norm2, n_rep, sv.norm.bytes(n_rep, a)?);
        push(SavedTensor::Norm2Rows, rows, product(&[rows, sv.norm_row_bytes], "norm rows")?);
        if !sv.shared_inputs {
            push(SavedTensor::Fc1Input, n_rep, sv.linear_input.bytes(n_rep, a)?);
        }
        match self.block {
            BlockKind::Gpt => push(SavedTensor::GeluInput, ffn, sv.activation.bytes(ffn, heads)?),
            BlockKind::Llama { .. } => {
                push(SavedTensor::SwigluGate, ffn, sv.activation.bytes(ffn, heads)?);
                push(SavedTensor::SwigluUp, ffn, sv.activation.bytes(ffn, heads)?);
            }
        }
        if !sv.shared_inputs {
            push(SavedTensor::Fc2Input, ffn, sv.linear_input.bytes(ffn, heads)?);
        }
        if self.dropout.residual > 0.0 {
            push(SavedTensor::FfnResidualMask, n_rep, mask(n_rep)?);
        }
        finish(items)
    }
}

fn finish(items: Vec<Item>) -> Result<LayerBytes> {
    let total =
        items.iter().try_fold(0u64, |acc, i| acc.checked_add(i.bytes)).ok_or_else(|| too_large("layer total"))?;
    Ok(LayerBytes { items, total })
}

impl PlanConfig {
    /// Megatron's setting of the paper's Table 2: 16-bit activations, 1-byte dropout masks
    /// (attention and residual dropout on), inputs stored, softmax attention.
    #[must_use]
    pub fn megatron(shape: ModelShape, parallel: Parallelism, recompute: Recompute) -> Self {
        PlanConfig {
            block: BlockKind::Gpt,
            shape,
            parallel,
            dropout: Dropout { attention: 0.1, residual: 0.1, masks: MaskStorage::Stored { bytes: 1 } },
            recompute,
            saved: SavedPrecision::uniform(Precision::Half),
            attention: AttentionKind::Softmax,
        }
    }
}
