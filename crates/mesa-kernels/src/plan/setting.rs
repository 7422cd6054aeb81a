//! The cheapest setting of a large model that fits a memory budget per GPU: tensor-parallel
//! size `t`, sequence parallelism on or off, recomputation (none, selective, full) and the
//! width of the saved activations (16 bits, or 8-, 4-, 2-bit codes) — for the four models of
//! Korthikanti et al. 2022, *Reducing Activation Recomputation in Large Transformer Models*,
//! Table 3 ([`paper_models`]).
//!
//! # What one GPU holds ([`setting_memory`])
//!
//! The GPU of the **first pipeline stage** (the one with the most activations under 1F1B):
//!
//! ```text
//! parameters    Ψ₁ = (L/p) · layer_parameters(t) + ⌈v/t⌉·h + s·h  (+ 2h when p = 1)
//! model state   16 · Ψ₁ bytes   (16-bit weights 2 + gradients 2 + Adam's f32 master copy,
//!                                momentum and variance 12: ZeRO §3.1, no sharding of it)
//! activations   (L/p) · p · A(t, SP, recompute, bits)   (bytes)
//! total         model state + activations
//! ```
//!
//! * `layer_parameters(t)` is [`layer_parameters`](super::layer_parameters):
//!   `(4h² + 2hf + 3h + f)/t + 6h` per rank (Megatron's split, biases and norms counted).
//!   The first stage also holds the word embedding, split over the vocabulary (`⌈v/t⌉·h`),
//!   and the learned position embedding (`s·h`, replicated); with `p = 1` it is the last
//!   stage too and holds the final LayerNorm (`2h`); the output head is tied to the word
//!   embedding (Megatron's GPT default) and adds nothing.
//! * `A` is [`PlanConfig::layer_bytes`](super::PlanConfig::layer_bytes) of the setting
//!   ([`Setting::config`]): the paper's Table 2 at 16 bits (1-byte dropout masks stored,
//!   every input stored), or Mesa-style codes (masks regenerated from a seed, the FC inputs
//!   rebuilt from their producers' codes, f32 mean and `1/σ` per norm row, one offset and
//!   scale per head) — the setting of `examples/plan.rs` in mesa-candle.
//! * Under the non-interleaved 1F1B schedule the first stage holds the activations of `p`
//!   micro-batches of its `L/p` layers (§4.2.3): `L` layers' worth whatever `p` is.
//!
//! **Not counted**: the embedding's dropout mask (about `sbhp/t` on the first stage, §4.3),
//! the output layer's activations (`4sbh/t·(1 + v/h)`, on the last stage, which is the first
//! only for `p = 1`), transients (logits, the backward's decoded tensors, gradient buckets),
//! communication buffers, the CUDA context, fragmentation, and Megatron's f32 gradient
//! accumulation buffer (`main_grad`: 2 more bytes per parameter than the 16 counted here).
//! The totals are therefore a floor: leave headroom.
//!
//! # The order ([`Setting::cmp`])
//!
//! Cheaper first, compared lexicographically:
//!
//! 1. **fewer tensor-parallel ranks** `t`: fewer GPUs per model replica and less
//!    communication (none at `t = 1`; else two all-reduces of `[s, b, h]` per layer in the
//!    forward and two in the backward, `2(t − 1)/t · sbh` elements sent per rank each, §4.2);
//! 2. **codes that keep training as it is**: 16-bit activations and 8-bit codes first (8-bit
//!    codes trained indistinguishably from f32 in docs/results.md: paired difference
//!    −0.0002 ± 0.0003; Pan et al. 2021 report no loss), then 4-bit (+0.0066 ± 0.0033, not
//!    resolved from noise), then 2-bit (gradient cosine to f32 as low as −0.45 there);
//! 3. **less recomputation**: none < selective < full (extra forward FLOPs: about 2.7 % for
//!    selective on GPT-3, §5; a whole second forward, about a third of a step, for full);
//! 4. **sequence parallelism on** before off: it replaces each all-reduce by a
//!    reduce-scatter and an all-gather, the same bytes on the wire (an all-reduce *is* the
//!    two, §4.2.2), and splits the norms' and dropouts' work by `t` — it costs nothing and
//!    never keeps more bytes, so whenever it is possible (`t > 1` and `t` divides `s`) it is
//!    preferred;
//! 5. **16 bits before 8-bit codes** (exact before coded, at the same accuracy class).
//!
//! So selective recomputation with 8-bit codes is preferred over no recomputation with 4- or
//! 2-bit codes, and no recomputation with 8-bit codes over selective recomputation at 16
//! bits. A caller who weighs these otherwise can rank the [`candidate_settings`] with its own
//! key.
use std::cmp::Ordering;
use std::fmt;

use super::training::{add, layer_parameters, mul, MemoryBreakdown, Optimizer, TrainingPrecision};
use super::{
    BlockKind, CodeFormat, MaskStorage, ModelShape, Parallelism, PlanConfig, Precision, Recompute, SavedPrecision,
};
use crate::error::{Error, Result};

/// One way to run a model: tensor and sequence parallelism, recomputation and the width of
/// the saved activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// Tensor-parallel size `t` (1: none).
    pub tensor: u64,
    /// Sequence parallelism (§4.2.2).
    pub sequence: bool,
    /// Recomputation (§5).
    pub recompute: Recompute,
    /// Bits of the activation codes (8, 4 or 2), or `None` for 16-bit activations (the
    /// paper's setting).
    pub code_bits: Option<u32>,
}

impl Setting {
    /// The comparison key of the documented order (module docs): `t`, the codes' accuracy
    /// class (16 and 8 bits, then 4, then 2), recomputation, SP on first, 16 bits before 8.
    /// Injective, so the order is total and agrees with `==`.
    fn key(&self) -> (u64, u8, u8, bool, bool) {
        let recompute = match self.recompute {
            Recompute::None => 0,
            Recompute::Selective => 1,
            Recompute::Full => 2,
        };
        let class = match self.code_bits {
            None | Some(8) => 0,
            Some(4) => 1,
            Some(_) => 2,
        };
        (self.tensor, class, recompute, !self.sequence, self.code_bits.is_some())
    }

    /// The planner's configuration of this setting for `shape`: [`PlanConfig::megatron`] at
    /// 16 bits; with codes, masks regenerated, FC inputs shared, 8 bytes of statistics per
    /// norm row and every saved tensor as `bits`-bit codes per head
    /// ([`CodeFormat::per_head`]).
    #[must_use]
    pub fn config(&self, shape: ModelShape) -> PlanConfig {
        let parallel = Parallelism { tensor: self.tensor, sequence: self.sequence };
        let mut cfg = PlanConfig::megatron(shape, parallel, self.recompute);
        if let Some(bits) = self.code_bits {
            cfg.dropout.masks = MaskStorage::Regenerated;
            cfg.saved = SavedPrecision {
                norm_row_bytes: 8,
                shared_inputs: true,
                ..SavedPrecision::uniform(Precision::Codes(CodeFormat::per_head(bits)))
            };
        }
        cfg
    }
}

impl PartialOrd for Setting {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Setting {
    /// `Less` = cheaper, in the order of the module docs.
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

impl fmt::Display for Setting {
    /// E.g. `t=8, SP on, selective, 8-bit codes` or `t=1, SP off, no recompute, 16-bit`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let recompute = match self.recompute {
            Recompute::None => "no recompute",
            Recompute::Selective => "selective",
            Recompute::Full => "full recompute",
        };
        write!(f, "t={}, SP {}, {recompute}, ", self.tensor, if self.sequence { "on" } else { "off" })?;
        match self.code_bits {
            Some(bits) => write!(f, "{bits}-bit codes"),
            None => write!(f, "16-bit"),
        }
    }
}

/// A model of the paper's Table 3 (or of [`llama3_models`]) with its pipeline depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaperModel {
    /// Its name (`"22B"`, `"175B"`, `"530B"`, `"1T"`; `"Llama-3 8B"`, `"Llama-3 70B"`).
    pub name: &'static str,
    /// The block: the paper's GPT, or Llama (no position embedding, untied output head, RMSNorm).
    pub block: BlockKind,
    /// `L, s, b, h, a, f`.
    pub shape: ModelShape,
    /// Pipeline-parallel size `p` (divides `L`).
    pub pipeline: u64,
    /// Vocabulary `v` (rows of the word embedding).
    pub vocab: u64,
}

/// GPT-2's 50,257 BPE tokens padded by Megatron to a multiple of `128·t` (51,200 at
/// `t = 8` and `t = 16`); used for every `t` here (at most 896 rows more than Megatron's
/// padding at `t < 8`).
pub const PAPER_VOCAB: u64 = 51_200;

/// The paper's four models (Table 3): sequence `s = 2048`, micro-batch `b = 1`, FFN `4h`,
/// vocabulary [`PAPER_VOCAB`]:
///
/// | name | `a` | `h` | `L` | `p` (paper's `t = 8`) |
/// |---|---:|---:|---:|---:|
/// | 22B | 64 | 6144 | 48 | 1 |
/// | 175B (GPT-3) | 96 | 12288 | 96 | 8 |
/// | 530B (MT-NLG) | 128 | 20480 | 105 | 35 |
/// | 1T | 160 | 25600 | 128 | 64 |
#[must_use]
pub fn paper_models() -> [PaperModel; 4] {
    let model = |name, heads, hidden, layers, pipeline| PaperModel {
        name,
        block: BlockKind::Gpt,
        shape: ModelShape { layers, seq: 2048, micro_batch: 1, hidden, heads, ffn: 4 * hidden },
        pipeline,
        vocab: PAPER_VOCAB,
    };
    [
        model("22B", 64, 6144, 48, 1),
        model("175B", 96, 12288, 96, 8),
        model("530B", 128, 20480, 105, 35),
        model("1T", 160, 25600, 128, 64),
    ]
}

/// Llama 3's vocabulary (128,256 tokens; Llama Team 2024, *The Llama 3 Herd of Models*,
/// Table 3).
pub const LLAMA3_VOCAB: u64 = 128_256;

/// Llama 3 8B and 70B (*The Llama 3 Herd of Models*, Table 3: layers, width, FFN width, 8 K/V
/// heads) at sequence `s = 8192`, micro-batch 1, with a pipeline depth of our choice: 1 for
/// 8B, 8 for 70B (10 layers per stage).
///
/// | name | `a` | K/V heads | `h` | `f` | `L` | `p` |
/// |---|---:|---:|---:|---:|---:|---:|
/// | Llama-3 8B | 32 | 8 | 4096 | 14336 | 32 | 1 |
/// | Llama-3 70B | 64 | 8 | 8192 | 28672 | 80 | 8 |
///
/// [`setting_memory`] counts them without dropout, with an untied output head, RMSNorm (one
/// f32 per row with codes) and no position embedding.
#[must_use]
pub fn llama3_models() -> [PaperModel; 2] {
    let model = |name, heads, hidden, ffn, layers, pipeline| PaperModel {
        name,
        block: BlockKind::Llama { kv_heads: 8 },
        shape: ModelShape { layers, seq: 8192, micro_batch: 1, hidden, heads, ffn },
        pipeline,
        vocab: LLAMA3_VOCAB,
    };
    [model("Llama-3 8B", 32, 4096, 14336, 32, 1), model("Llama-3 70B", 64, 8192, 28672, 80, 8)]
}

/// What one GPU of the first pipeline stage holds under a [`Setting`] (bytes unless said
/// otherwise; module docs for what is counted).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettingMemory {
    /// Layers of the stage, `L/p`.
    pub layers_per_stage: u64,
    /// Micro-batches whose activations the stage holds at once under 1F1B, `p`.
    pub in_flight: u64,
    /// Parameters on the GPU (elements): the stage's layers, the embeddings.
    pub parameters: u64,
    /// 16-bit weights, `2Ψ₁`.
    pub weights: u64,
    /// 16-bit gradients, `2Ψ₁`.
    pub gradients: u64,
    /// Adam's f32 master copy, momentum and variance, `12Ψ₁`.
    pub optimizer_state: u64,
    /// `weights + gradients + optimizer_state`, `16Ψ₁`.
    pub model_state: u64,
    /// Activations kept for the backward: `(L/p) · p` layers of the setting.
    pub activations: u64,
    /// `model_state + activations`.
    pub total: u64,
}

impl PaperModel {
    /// Checks the shape ([`PlanConfig::validate`] at `t = 1`), `p ≥ 1` dividing `L`, and
    /// `v ≥ 1`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        PlanConfig { block: self.block, ..PlanConfig::megatron(self.shape, Parallelism::none(), Recompute::None) }
            .validate()?;
        if self.pipeline == 0 || self.shape.layers % self.pipeline != 0 {
            return Err(Error::invalid_argument(
                "plan: pipeline",
                format!("{} must be positive and divide the {} layers", self.pipeline, self.shape.layers),
            ));
        }
        if self.vocab == 0 {
            return Err(Error::invalid_argument("plan: vocab", "must be positive"));
        }
        Ok(())
    }
}

/// The memory per GPU of `setting` for `model` (module docs: first pipeline stage, 16-bit
/// mixed precision with Adam, 1F1B).
///
/// # Errors
/// [`Error::InvalidArgument`]: [`PaperModel::validate`]'s, and [`PlanConfig::validate`]'s for
/// the setting (`t` zero or not dividing `a`, `h`, `f`, or `s` with sequence parallelism;
/// bits other than 8, 4, 2). [`Error::TooLarge`] when a count overflows `u64`.
pub fn setting_memory(model: &PaperModel, setting: &Setting) -> Result<SettingMemory> {
    model.validate()?;
    let mut cfg = setting.config(model.shape);
    cfg.block = model.block;
    if model.block != BlockKind::Gpt {
        // Llama trains without dropout; RMSNorm keeps one f32 per row
        cfg.dropout.attention = 0.0;
        cfg.dropout.residual = 0.0;
        if setting.code_bits.is_some() {
            cfg.saved.norm_row_bytes = 4;
        }
    }
    let layer = cfg.layer_bytes()?;
    let ModelShape { layers, seq, hidden, .. } = model.shape;
    let t = setting.tensor;
    let p = model.pipeline;
    let per_stage = layers / p;
    let activations = mul(mul(layer.total, per_stage, "stage activations")?, p, "stage activations")?;
    let word = mul(model.vocab.div_ceil(t), hidden, "word embedding")?;
    let (embedding, final_norm) = match model.block {
        BlockKind::Gpt => (
            add(word, mul(seq, hidden, "position embedding")?, "embeddings")?,
            if p == 1 { mul(2, hidden, "final norm")? } else { 0 },
        ),
        // RoPE: no position embedding; the untied output head and the final RMSNorm sit on the
        // last stage, the first only when p = 1
        BlockKind::Llama { .. } => {
            if p == 1 {
                (add(word, word, "embeddings")?, hidden)
            } else {
                (word, 0)
            }
        }
    };
    let parameters = add(
        add(mul(layer_parameters(&cfg)?, per_stage, "stage parameters")?, embedding, "stage parameters")?,
        final_norm,
        "stage parameters",
    )?;
    let state = MemoryBreakdown::of_parameters(parameters, TrainingPrecision::mixed16(), Optimizer::Adam)?;
    let with = state.with(activations, 0)?;
    Ok(SettingMemory {
        layers_per_stage: per_stage,
        in_flight: p,
        parameters,
        weights: state.weights,
        gradients: state.gradients,
        optimizer_state: state.optimizer_state,
        model_state: state.total,
        activations,
        total: with.total,
    })
}

/// Every setting of `model` over `tensor_choices`, cheapest first (module docs): each `t`
/// dividing `a`, `h` and `f` (others skipped), recomputation none/selective/full, sequence
/// parallelism on (only where `t > 1` divides `s`) and off, 16 bits and 8-, 4-, 2-bit codes.
/// Duplicated choices count once.
///
/// # Errors
/// [`Error::InvalidArgument`]: an empty `tensor_choices`, a zero `t`, or
/// [`PaperModel::validate`]'s errors.
pub fn candidate_settings(model: &PaperModel, tensor_choices: &[u64]) -> Result<Vec<Setting>> {
    model.validate()?;
    if tensor_choices.is_empty() {
        return Err(Error::invalid_argument("plan: tensor_choices", "empty (give at least one t)"));
    }
    if tensor_choices.contains(&0) {
        return Err(Error::invalid_argument("plan: tensor_choices", "contains 0 (t must be positive)"));
    }
    let ModelShape { seq, hidden, heads, ffn, .. } = model.shape;
    let mut out = Vec::new();
    for &t in tensor_choices {
        if heads % t != 0 || hidden % t != 0 || ffn % t != 0 {
            continue;
        }
        if let BlockKind::Llama { kv_heads } = model.block {
            if kv_heads % t != 0 && t % kv_heads != 0 {
                continue;
            }
        }
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            for sequence in [true, false] {
                if sequence && (t == 1 || seq % t != 0) {
                    continue;
                }
                for code_bits in [None, Some(8), Some(4), Some(2)] {
                    out.push(Setting { tensor: t, sequence, recompute, code_bits });
                }
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The cheapest setting (module docs for the order) whose [`setting_memory`] total is at
/// most `budget_bytes`, with its memory; `None` when none of [`candidate_settings`] fits (or
/// no choice of `t` divides `a`, `h` and `f`). A setting whose count overflows `u64` does not
/// fit.
///
/// `budget_bytes` is the memory per GPU the model may use (bytes); `tensor_choices` the
/// tensor-parallel sizes to try (e.g. `[1, 2, 4, 8, 16]`).
///
/// # Errors
/// [`Error::InvalidArgument`]: a zero budget, [`candidate_settings`]' errors.
pub fn cheapest_setting(
    model: &PaperModel,
    budget_bytes: u64,
    tensor_choices: &[u64],
) -> Result<Option<(Setting, SettingMemory)>> {
    if budget_bytes == 0 {
        return Err(Error::invalid_argument("plan: budget_bytes", "must be positive"));
    }
    for setting in candidate_settings(model, tensor_choices)? {
        match setting_memory(model, &setting) {
            Ok(m) if m.total <= budget_bytes => return Ok(Some((setting, m))),
            Ok(_) | Err(Error::TooLarge { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const CHOICES: [u64; 5] = [1, 2, 4, 8, 16];

    /// `⌈n·bits/8⌉ + 8·groups + 4`: the `SavedActivation` format, from its definition.
    fn code(n: u128, bits: u128, groups: u128) -> u128 {
        (n * bits).div_ceil(8) + 8 * groups + 4
    }

    /// Activation bytes per layer and rank, from the paper's Table 2 (16 bits, 1-byte masks)
    /// or, for codes, from the list of tensors of §4.1 with masks regenerated, FC inputs
    /// rebuilt and 8 bytes per norm row. Exact integers (u128), independent of the planner.
    fn reference_layer(shape: &ModelShape, s: &Setting) -> u128 {
        let (sq, b, h, a, f) = (shape.seq, shape.micro_batch, shape.hidden, shape.heads, shape.ffn);
        let (sq, b, h, a, f, t) = (sq as u128, b as u128, h as u128, a as u128, f as u128, s.tensor as u128);
        assert_eq!(f, 4 * h, "the paper's formulas take f = 4h");
        let sbh = sq * b * h;
        let attn = 5 * a * sq * sq * b; // 5as²b
        match s.code_bits {
            None => match (s.recompute, s.sequence) {
                (Recompute::None, false) => 10 * sbh + 24 * sbh / t + attn / t,
                (Recompute::None, true) => 34 * sbh / t + attn / t,
                (Recompute::Selective, false) => 10 * sbh + 24 * sbh / t,
                (Recompute::Selective, true) => 34 * sbh / t,
                (Recompute::Full, false) => 2 * sbh,
                (Recompute::Full, true) => 2 * sbh / t,
            },
            Some(bits) => {
                let bits = bits as u128;
                let split = if s.sequence { t } else { 1 };
                let rep = sbh / split; // norm inputs: [s, b, h], split along s under SP
                let rows = sq * b / split;
                let tok = sbh / t; // Q, K, V, out-projection input: split over heads
                let heads = a / t;
                if s.recompute == Recompute::Full {
                    return code(rep, bits, a);
                }
                let norms = 2 * (code(rep, bits, a) + 8 * rows);
                let qkvo = 4 * code(tok, bits, heads);
                let gelu = code(sq * b * f / t, bits, heads);
                let softmax = if s.recompute == Recompute::None { code(heads * sq * sq * b, bits, heads) } else { 0 };
                norms + qkvo + gelu + softmax
            }
        }
    }

    /// Parameters of the first stage from the module docs' formula (f = 4h).
    fn reference_parameters(m: &PaperModel, t: u64) -> u128 {
        let (h, s, v, t) = (m.shape.hidden as u128, m.shape.seq as u128, m.vocab as u128, t as u128);
        let layer = (4 * h * h + 2 * h * 4 * h + 3 * h + 4 * h) / t + 6 * h;
        let stage = layer * (m.shape.layers / m.pipeline) as u128;
        let last = if m.pipeline == 1 { 2 * h } else { 0 };
        stage + v.div_ceil(t) * h + s * h + last
    }

    #[test]
    fn paper_models_are_table3() {
        let m = paper_models();
        let got: Vec<_> =
            m.iter().map(|m| (m.name, m.shape.heads, m.shape.hidden, m.shape.layers, m.pipeline)).collect();
        assert_eq!(
            got,
            [
                ("22B", 64, 6144, 48, 1),
                ("175B", 96, 12288, 96, 8),
                ("530B", 128, 20480, 105, 35),
                ("1T", 160, 25600, 128, 64)
            ]
        );
        for m in &m {
            assert_eq!((m.shape.seq, m.shape.micro_batch, m.shape.ffn), (2048, 1, 4 * m.shape.hidden));
            m.validate().unwrap();
            // t·p of Table 3 (t = 8): 8, 64, 280, 512 GPUs
        }
        assert_eq!(m.map(|m| 8 * m.pipeline), [8, 64, 280, 512]);
        // 5as/h of §5: 80 for GPT-3, 64 for MT-NLG
        assert_eq!(5 * 96 * 2048 / 12288, 80);
        assert_eq!(5 * 128 * 2048 / 20480, 64);
    }

    #[test]
    fn display_names_the_four_choices() {
        let s = Setting { tensor: 8, sequence: true, recompute: Recompute::Selective, code_bits: Some(8) };
        assert_eq!(s.to_string(), "t=8, SP on, selective, 8-bit codes");
        let s = Setting { tensor: 1, sequence: false, recompute: Recompute::None, code_bits: None };
        assert_eq!(s.to_string(), "t=1, SP off, no recompute, 16-bit");
        let s = Setting { tensor: 16, sequence: true, recompute: Recompute::Full, code_bits: Some(2) };
        assert_eq!(s.to_string(), "t=16, SP on, full recompute, 2-bit codes");
    }

    /// (i) The activation bytes of every candidate setting — so of every chosen one — equal
    /// the paper's formula (16 bits) or the code format's count, exactly, times `(L/p)·p`;
    /// the parameters equal the module docs' formula; the total is `16Ψ₁ + activations`.
    #[test]
    fn activations_and_parameters_match_the_formulas() {
        let mut checked = 0;
        for m in paper_models() {
            for s in candidate_settings(&m, &CHOICES).unwrap() {
                let got = setting_memory(&m, &s).unwrap();
                let per_layer = reference_layer(&m.shape, &s);
                assert_eq!(u128::from(s.config(m.shape).layer_bytes().unwrap().total), per_layer, "{} {s}", m.name);
                let lp = u128::from(m.shape.layers / m.pipeline);
                assert_eq!(u128::from(got.activations), per_layer * lp * u128::from(m.pipeline), "{} {s}", m.name);
                assert_eq!(u128::from(got.parameters), reference_parameters(&m, s.tensor), "{} {s}", m.name);
                assert_eq!(got.model_state, 16 * got.parameters);
                assert_eq!(
                    (got.weights, got.gradients, got.optimizer_state),
                    (2 * got.parameters, 2 * got.parameters, 12 * got.parameters)
                );
                assert_eq!(got.total, got.model_state + got.activations);
                assert_eq!((got.layers_per_stage, got.in_flight), (m.shape.layers / m.pipeline, m.pipeline));
                checked += 1;
            }
        }
        // 22B: t ∈ {1,2,4,8,16} all divide; per t: 3 recomputes × (SP on, off) × 4 widths,
        // t = 1 without SP on: 12 + 4·24 = 108 per model
        assert_eq!(checked, 4 * 108);
        // and the paper's Table 2 per-layer figures for 175B at t = 8 in MiB (docs/plan.md):
        let gpt3 = paper_models()[1];
        let mib = |sequence, recompute| {
            let s = Setting { tensor: 8, sequence, recompute, code_bits: None };
            reference_layer(&gpt3.shape, &s) as f64 / (1u64 << 20) as f64
        };
        assert_eq!(mib(false, Recompute::None), 552.0);
        assert_eq!(mib(true, Recompute::None), 342.0);
        assert_eq!(mib(false, Recompute::Selective), 312.0);
        assert_eq!(mib(true, Recompute::Selective), 102.0);
        assert_eq!(mib(false, Recompute::Full), 48.0);
    }

    /// (ii) A bigger budget never gives a more expensive setting; and the setting returned
    /// is the cheapest that fits (brute force over every candidate).
    #[test]
    fn bigger_budgets_never_cost_more_and_the_choice_is_optimal() {
        for m in paper_models() {
            let all: Vec<(Setting, u64)> = candidate_settings(&m, &CHOICES)
                .unwrap()
                .into_iter()
                .map(|s| (s, setting_memory(&m, &s).unwrap().total))
                .collect();
            let mut previous: Option<Setting> = None;
            let mut budget = GIB / 4;
            while budget <= 8192 * GIB {
                let got = cheapest_setting(&m, budget, &CHOICES).unwrap();
                let brute = all.iter().filter(|(_, total)| *total <= budget).map(|(s, _)| *s).min();
                assert_eq!(got.map(|(s, _)| s), brute, "{} at {budget} bytes", m.name);
                if let Some((s, mem)) = got {
                    assert!(mem.total <= budget);
                    if let Some(p) = previous {
                        assert!(s <= p, "{} at {budget} bytes: {s} after {p}", m.name);
                    }
                    previous = Some(s);
                } else {
                    assert!(previous.is_none(), "{} at {budget} bytes: none after a fit", m.name);
                }
                budget += budget / 16 + 1;
            }
            // at the largest budget everything fits: the cheapest candidate of all
            assert_eq!(previous, Some(all[0].0));
        }
    }

    /// (iii) Below the smallest setting (t = 16, SP on, full recomputation, 2-bit codes)
    /// nothing fits; at it, that setting is the answer.
    #[test]
    fn below_the_smallest_setting_nothing_fits() {
        for m in paper_models() {
            let smallest = Setting { tensor: 16, sequence: true, recompute: Recompute::Full, code_bits: Some(2) };
            let mem = setting_memory(&m, &smallest).unwrap();
            assert_eq!(cheapest_setting(&m, mem.total - 1, &CHOICES).unwrap(), None, "{}", m.name);
            assert_eq!(cheapest_setting(&m, mem.total, &CHOICES).unwrap(), Some((smallest, mem)), "{}", m.name);
            assert_eq!(cheapest_setting(&m, 1, &CHOICES).unwrap(), None);
        }
    }

    /// (iv) GPT-3 175B at 80 GiB, by hand (h = 12288, f = 4h, L = 96, p = 8: 12 layers per
    /// stage, s = 2048, b = 1, v = 51200).
    ///
    /// Parameters per layer and rank: `(4h² + 2hf + 3h + f)/t + 6h = (12h² + 7h)/t + 6h`;
    /// 12h² + 7h = 1,811,939,328 + 86,016 = 1,812,025,344.
    ///
    /// * t = 4: 453,006,336 + 73,728 = 453,080,064 per layer; × 12 = 5,436,960,768; embeddings
    ///   51200·12288/4 + 2048·12288 = 157,286,400 + 25,165,824; Ψ₁ = 5,619,412,992;
    ///   16Ψ₁ = 89,910,607,872 B > 80 GiB = 85,899,345,920 B: no setting with t ≤ 4 fits.
    /// * t = 8: 226,503,168 + 73,728 = 226,576,896 per layer; × 12 = 2,718,922,752;
    ///   embeddings 78,643,200 + 25,165,824; Ψ₁ = 2,822,731,776; 16Ψ₁ = 45,163,708,416 B.
    ///   The cheapest candidate at t = 8 is SP on, no recompute, 16-bit:
    ///   `sbh(34/t + 5as/(ht)) = sbh(4.25 + 10)`, sbh = 25,165,824 → 358,612,992 B per layer
    ///   (342 MiB), × 12 layers × 8 in flight = 34,426,847,232 B.
    ///   Total 79,590,555,648 B (74.12 GiB) ≤ 80 GiB: it fits.
    ///
    /// One byte below that total the next candidate is SP on, no recompute, 8-bit codes,
    /// whose activations are smaller.
    #[test]
    fn gpt3_at_80_gib_by_hand() {
        let gpt3 = paper_models()[1];
        let (s, mem) = cheapest_setting(&gpt3, 80 * GIB, &CHOICES).unwrap().unwrap();
        assert_eq!(s, Setting { tensor: 8, sequence: true, recompute: Recompute::None, code_bits: None });
        assert_eq!(mem.parameters, 2_822_731_776);
        assert_eq!(mem.model_state, 45_163_708_416);
        assert_eq!(mem.activations, 34_426_847_232);
        assert_eq!(mem.total, 79_590_555_648);
        let t4 = Setting { tensor: 4, sequence: true, recompute: Recompute::Full, code_bits: Some(2) };
        assert_eq!(setting_memory(&gpt3, &t4).unwrap().model_state, 89_910_607_872);
        let (next, _) = cheapest_setting(&gpt3, 79_590_555_647, &CHOICES).unwrap().unwrap();
        assert_eq!(next, Setting { tensor: 8, sequence: true, recompute: Recompute::None, code_bits: Some(8) });
    }

    #[test]
    fn the_order_is_the_documented_one() {
        use Recompute::{Full, None as No, Selective};
        let s = |tensor, sequence, recompute, code_bits| Setting { tensor, sequence, recompute, code_bits };
        let ordered = [
            s(4, false, Full, Some(2)),
            s(8, true, No, None),
            s(8, true, No, Some(8)),
            s(8, false, No, None),
            s(8, true, Selective, None),
            s(8, true, Selective, Some(8)),
            s(8, true, Full, None),
            s(8, true, No, Some(4)),
            s(8, true, Full, Some(4)),
            s(8, true, No, Some(2)),
            s(16, true, No, None),
        ];
        for w in ordered.windows(2) {
            assert!(w[0] < w[1], "{} before {}", w[0], w[1]);
        }
        // t not dividing a/h/f skipped; SP only where t > 1 divides s
        let m = paper_models()[0]; // 22B: a = 64
        let c = candidate_settings(&m, &[3, 16, 1, 16]).unwrap();
        assert!(c.iter().all(|s| s.tensor != 3));
        assert_eq!(c.len(), 12 + 24);
        assert!(c.iter().filter(|s| s.tensor == 1).all(|s| !s.sequence));
        let odd = paper_models()[1]; // 175B: t = 3 divides a, h, f but not s = 2048
        let c = candidate_settings(&odd, &[3]).unwrap();
        assert_eq!(c.len(), 12);
        assert!(c.iter().all(|s| !s.sequence));
        assert_eq!(cheapest_setting(&m, 80 * GIB, &[3, 5]).unwrap(), None);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let m = paper_models()[1];
        let invalid = |r: Result<Option<(Setting, SettingMemory)>>| matches!(r, Err(Error::InvalidArgument { .. }));
        assert!(invalid(cheapest_setting(&m, 80 * GIB, &[])));
        assert!(invalid(cheapest_setting(&m, 0, &CHOICES)));
        assert!(invalid(cheapest_setting(&m, 80 * GIB, &[8, 0])));
        for broken in 0..5 {
            let mut b = m;
            match broken {
                0 => b.pipeline = 0,
                1 => b.pipeline = 7, // does not divide 96
                2 => b.vocab = 0,
                3 => b.shape.heads = 0,
                _ => b.shape.hidden = 12289,
            }
            assert!(invalid(cheapest_setting(&b, 80 * GIB, &CHOICES)), "case {broken}");
        }
        let bad_bits = Setting { tensor: 8, sequence: true, recompute: Recompute::None, code_bits: Some(3) };
        assert!(matches!(setting_memory(&m, &bad_bits), Err(Error::InvalidArgument { .. })));
        let bad_t = Setting { tensor: 5, sequence: false, recompute: Recompute::None, code_bits: None };
        assert!(matches!(setting_memory(&m, &bad_t), Err(Error::InvalidArgument { .. })));
        // counts past u64: TooLarge from setting_memory, "does not fit" for the search
        let mut huge = m;
        huge.shape.hidden = 1 << 40;
        huge.shape.ffn = 1 << 42;
        huge.shape.heads = 1 << 4;
        let s = Setting { tensor: 1, sequence: false, recompute: Recompute::Full, code_bits: None };
        assert!(matches!(setting_memory(&huge, &s), Err(Error::TooLarge { .. })));
        assert_eq!(cheapest_setting(&huge, u64::MAX, &CHOICES).unwrap(), None);
    }

    #[test]
    fn llama3_8b_layer_and_parameters_match_the_formulas() {
        let m = llama3_models()[0];
        let (s, h, a, f, kv) = (8192u64, 4096u64, 32u64, 14336u64, 1024u64); // kv: 8 heads of 128
        let at = |tensor, sequence, recompute, code_bits| {
            setting_memory(&m, &Setting { tensor, sequence, recompute, code_bits }).unwrap()
        };
        // 16 bits, no dropout: LN₁ in, QKV in, Q, out-proj in, LN₂ in, FC₁ in (2sh each), K, V
        // (2s·kv each), gate, up, down in (2sf each), softmax output 2as²
        let layer = 12 * s * h + 4 * s * kv + 6 * s * f + 2 * a * s * s;
        assert_eq!(at(1, false, Recompute::None, None).activations, 32 * layer);
        // t = 2 with SP: everything split by 2 (K, V: 4 of the 8 KV heads)
        assert_eq!(at(2, true, Recompute::None, None).activations, 32 * layer / 2);
        // t = 16 > 8 KV heads: each rank keeps one KV head (replicated), the rest / 16
        let t16 = (12 * s * h + 6 * s * f + 2 * a * s * s) / 16 + 4 * s * 128;
        assert_eq!(at(16, true, Recompute::None, None).activations, 32 * t16);
        // 8-bit codes per head, selective, t = 1: x̂ codes of both norms (s·h bytes + 8 per
        // group of a + 4, one f32 per row), Q, K, V, out-proj in, gate, up
        let codes = |n: u64, groups: u64| n + 8 * groups + 4;
        let layer8 = 2 * (codes(s * h, a) + 4 * s)
            + codes(s * h, a)
            + 2 * codes(s * kv, 8)
            + codes(s * h, a)
            + 2 * codes(s * f, a);
        assert_eq!(at(1, false, Recompute::Selective, Some(8)).activations, 32 * layer8);
        // parameters: 32 layers of 2h² + 2h·kv + 3hf + 2h, embedding and untied head v·h
        // each, final norm h
        let per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h;
        let psi = 32 * per_layer + 2 * LLAMA3_VOCAB * h + h;
        assert_eq!(at(1, false, Recompute::None, None).parameters, psi);
        assert_eq!(psi, 8_030_261_248, "Llama 3 8B has 8.03 B parameters");
    }
}
