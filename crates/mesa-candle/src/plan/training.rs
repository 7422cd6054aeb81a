//! The whole training step of the training example (`examples/train_shakespeare`): weights,
//! gradients, AdamW's state, the activations and the largest transient, phase by phase, from
//! what the code allocates (module docs of [`crate::plan`]).
use mesa_kernels::plan::{MemoryBreakdown, SavedTensor};

use super::plan_config;
use crate::error::Error;
use crate::layer::{Attention, LayerConfig, NormPlacement, Recompute};

/// The sizes of the training example's model and batch besides the layer's own
/// ([`LayerConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainingShape {
    /// Transformer layers `L`.
    pub layers: usize,
    /// Sequences per step `B`.
    pub batch: usize,
    /// Tokens per sequence `T` (the context; also the rows of the position embedding).
    pub seq: usize,
    /// Vocabulary `V` (rows of the token embedding and of the head).
    pub vocab: usize,
}

/// One phase of the step and its peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseBytes {
    /// `"embed"`, `"stack forward"`, `"head"`, `"stack backward"` or `"optimizer step"`.
    pub name: &'static str,
    /// The bytes alive at the phase's peak, by what they hold.
    pub bytes: MemoryBreakdown,
}

/// The plan of one training step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainingPlan {
    /// Parameters `Ψ` (elements): embeddings `(V + T)·C`, `L` layers of `4C² + 2CF + 9C + F`,
    /// final LayerNorm `2C`, head `V·C`.
    pub parameters: u64,
    /// The five phases in order, each at its peak.
    pub phases: Vec<PhaseBytes>,
    /// The step's peak (bytes): the largest phase's. `total.total` is the number to compare
    /// with a budget.
    pub total: MemoryBreakdown,
    /// The name of that phase.
    pub peak_phase: &'static str,
}

fn too_large(what: &str) -> Error {
    Error::Kernel(mesa_kernels::Error::TooLarge { what: format!("training plan: {what}"), why: "overflows u64".into() })
}

fn prod(factors: &[u64], what: &str) -> Result<u64, Error> {
    factors.iter().try_fold(1u64, |a, &f| a.checked_mul(f)).ok_or_else(|| too_large(what))
}

fn sum(terms: &[u64], what: &str) -> Result<u64, Error> {
    terms.iter().try_fold(0u64, |a, &f| a.checked_add(f)).ok_or_else(|| too_large(what))
}

/// What a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Weights,
    Gradients,
    State,
    Activations,
    Transient,
}

/// Live bytes by kind over a sequence of allocations and frees, with each phase's peak.
struct Tape {
    live: [u64; 5],
    peak: MemoryBreakdown,
    phases: Vec<PhaseBytes>,
}

impl Tape {
    fn new() -> Self {
        Tape { live: [0; 5], peak: MemoryBreakdown::default(), phases: Vec::new() }
    }

    fn now(&self) -> Result<MemoryBreakdown, Error> {
        let [w, g, s, a, t] = self.live;
        Ok(MemoryBreakdown::new(w, g, s, a, t)?)
    }

    fn alloc(&mut self, kind: Kind, bytes: u64) -> Result<(), Error> {
        let slot = &mut self.live[kind as usize];
        *slot = slot.checked_add(bytes).ok_or_else(|| too_large("live bytes"))?;
        let now = self.now()?;
        if now.total > self.peak.total {
            self.peak = now;
        }
        Ok(())
    }

    fn free(&mut self, kind: Kind, bytes: u64) -> Result<(), Error> {
        let slot = &mut self.live[kind as usize];
        // every free matches an earlier allocation; an underflow is a bug of this model
        *slot = slot.checked_sub(bytes).ok_or_else(|| too_large("freed more than allocated"))?;
        Ok(())
    }

    /// `n` times `step`, which must leave the same net bytes each time and not lower the total
    /// (every layer's forward or backward): the first `n − 1` are applied as their net change
    /// (their peaks are below the last one's, which starts higher), the last is traced. `O(1)`
    /// in `n`.
    fn repeat(&mut self, n: usize, mut step: impl FnMut(&mut Tape) -> Result<(), Error>) -> Result<(), Error> {
        if n == 0 {
            return Ok(());
        }
        let mut probe = Tape { live: self.live, peak: MemoryBreakdown::default(), phases: Vec::new() };
        step(&mut probe)?;
        let times = (n - 1) as u64;
        for (i, kind) in
            [Kind::Weights, Kind::Gradients, Kind::State, Kind::Activations, Kind::Transient].into_iter().enumerate()
        {
            let (after, before) = (probe.live[i], self.live[i]);
            if after >= before {
                self.alloc(kind, prod(&[after - before, times], "repeated layers")?)?;
            } else {
                self.free(kind, prod(&[before - after, times], "repeated layers")?)?;
            }
        }
        step(self)
    }

    /// Ends the current phase: records its peak and starts the next at the current level.
    fn end_phase(&mut self, name: &'static str) -> Result<(), Error> {
        self.phases.push(PhaseBytes { name, bytes: self.peak });
        self.peak = self.now()?;
        Ok(())
    }
}

/// Sizes in bytes (f32) of the tensors the step allocates.
struct Sizes {
    /// `[B, T]` u32 (token ids, targets).
    ids: u64,
    /// `[B, T, C]` f32.
    tok: u64,
    /// `[B, T, F]` f32.
    ffn: u64,
    /// `[B, H, T, T]` f32.
    att: u64,
    /// `[T, T]` f32 (the causal mask).
    mask: u64,
    /// `[B·T, V]` f32.
    logits: u64,
    /// `[B·T]` f32 (a per-row statistic).
    row: u64,
    /// One layer's flat parameters (and gradient), `4Ψ_layer`.
    layer_params: u64,
    /// `[C, C]` plus its bias: one attention projection's gradient.
    proj_cc: u64,
    /// `[F, C]` plus its bias `[F]`: FC₁'s gradient.
    proj_cf: u64,
    /// `[C, F]` plus its bias `[C]`: FC₂'s gradient.
    proj_fc: u64,
    /// LayerNorm weight and bias gradients.
    norm: u64,
    /// Codes per layer: LN₁ (with row statistics), Q, K, V, P (0 under selective
    /// recomputation and for linear attention; full recomputation: those of its rerun),
    /// attention output, LN₂ (with rows), FFN input.
    codes: [u64; 8],
    /// The op's boxed backward state.
    state: u64,
    /// `[V, C]` f32: the token table or the head.
    embedding: u64,
    /// `[T, C]` f32: the positions.
    positions: u64,
}

impl Sizes {
    fn new(config: &LayerConfig, shape: &TrainingShape) -> Result<Self, Error> {
        let u = |v: usize| v as u64; // usize ≤ 64 bits on every target candle builds for
        let (b, t, c, f, h, v) =
            (u(shape.batch), u(shape.seq), u(config.hidden), u(config.ffn), u(config.heads), u(shape.vocab));
        let n = prod(&[b, t], "tokens")?;
        let layer =
            sum(&[prod(&[4, c, c], "layer")?, prod(&[2, c, f], "layer")?, prod(&[9, c], "layer")?, f], "layer")?;
        // the codes the forward saves, from the activation planner (softmax codes only when kept)
        let mut keep = config.clone();
        if keep.recompute == Recompute::Full {
            keep.recompute = Recompute::None;
        }
        let items = plan_config(&keep, 1, shape.batch, shape.seq)?.layer_bytes()?.items;
        let of = |which: &[SavedTensor]| -> Result<u64, Error> {
            sum(&items.iter().filter(|i| which.contains(&i.tensor)).map(|i| i.bytes).collect::<Vec<_>>(), "codes")
        };
        use SavedTensor as S;
        let codes = [
            of(&[S::Norm1, S::Norm1Rows])?,
            of(&[S::Q])?,
            of(&[S::K])?,
            of(&[S::V])?,
            of(&[S::Softmax])?,
            of(&[S::OutProjInput])?,
            of(&[S::Norm2, S::Norm2Rows])?,
            of(&[S::GeluInput])?,
        ];
        let s = Sizes {
            ids: prod(&[n, 4], "ids")?,
            tok: prod(&[n, c, 4], "[B, T, C]")?,
            ffn: prod(&[n, f, 4], "[B, T, F]")?,
            att: prod(&[b, h, t, t, 4], "[B, H, T, T]")?,
            mask: prod(&[t, t, 4], "mask")?,
            logits: prod(&[n, v, 4], "logits")?,
            row: prod(&[n, 4], "rows")?,
            layer_params: prod(&[layer, 4], "layer parameters")?,
            proj_cc: prod(&[sum(&[prod(&[c, c], "")?, c], "")?, 4], "projection")?,
            proj_cf: prod(&[sum(&[prod(&[c, f], "")?, f], "")?, 4], "projection")?,
            proj_fc: prod(&[sum(&[prod(&[c, f], "")?, c], "")?, 4], "projection")?,
            norm: prod(&[c, 8], "norm")?,
            codes,
            state: crate::layer::BACKWARD_STATE_BYTES as u64,
            embedding: prod(&[v, c, 4], "embedding")?,
            positions: prod(&[t, c, 4], "positions")?,
        };
        // every size, all together, 64 times over fits u64: the tape's small multiples and
        // sums of these below cannot overflow (the tape's running totals are checked)
        let all = sum(
            &[
                s.ids,
                s.tok,
                s.ffn,
                s.att,
                s.mask,
                s.logits,
                s.row,
                s.layer_params,
                s.proj_cc,
                s.proj_cf,
                s.proj_fc,
                s.norm,
                sum(&s.codes, "codes")?,
                s.state,
                s.embedding,
                s.positions,
            ],
            "step",
        )?;
        prod(&[all, 64], "step")?;
        Ok(s)
    }
}

/// Parameters `Ψ` of the training example's model (elements): token embedding `V·C`,
/// learnt positions `T·C`, `L` layers of `4C² + 2CF + 9C + F`
/// ([`mesa_kernels::plan::layer_parameters`]), the final LayerNorm `2C`, the untied head
/// `V·C`. With Llama blocks: no positions (RoPE), the final RMSNorm `C`. An input gate
/// ([`Attention::InputGated`]) adds `C·H_kv + 2·H_kv` per layer.
///
/// # Errors
/// [`Error::InvalidArgument`] from [`LayerConfig::validate`] or for a zero size;
/// [`Error::Kernel`] with [`mesa_kernels::Error::TooLarge`] on overflow.
pub fn training_parameters(config: &LayerConfig, shape: &TrainingShape) -> Result<u64, Error> {
    let stack = plan_config(config, shape.layers, shape.batch, shape.seq)?;
    if shape.vocab == 0 {
        return Err(Error::InvalidArgument { name: "vocab", why: "must be positive".into() });
    }
    let layers = prod(&[mesa_kernels::plan::layer_parameters(&stack)?, stack.shape.layers], "parameters")?;
    let (v, t, c) = (shape.vocab as u64, stack.shape.seq, stack.shape.hidden);
    let (positions, norm) = match config.block {
        crate::layer::Block::Gpt => (prod(&[t, c], "positions")?, prod(&[2, c], "norm")?),
        crate::layer::Block::Llama(_) => (0, c),
    };
    // an input gate's decay projection, bias and A_log per layer (Attention::InputGated)
    let gate = if config.attention.is_input_gated() {
        let kv = config.kv_heads() as u64;
        prod(&[sum(&[prod(&[c, kv], "gate")?, prod(&[2, kv], "gate")?], "gate")?, stack.shape.layers], "gate")?
    } else {
        0
    };
    sum(&[prod(&[2, v, c], "embeddings")?, positions, layers, norm, gate], "parameters")
}

/// One layer's forward (`layer/forward.rs`, pre-LN), the input alive. The training forward
/// (`rerun` false) leaves the codes (activations; under full recomputation none: they are
/// dropped at its end) and the output (activations). The rerun of a full recomputation's
/// backward keeps every code, `P`'s included (transient, freed by the caller) and leaves its
/// output (transient).
fn layer_forward(tape: &mut Tape, s: &Sizes, config: &LayerConfig, rerun: bool) -> Result<(), Error> {
    use Kind::Transient as T;
    let (u, f) = (s.tok, s.ffn);
    let full = config.recompute == Recompute::Full && !rerun;
    let codes = if full || rerun { T } else { Kind::Activations };
    let out = if rerun { T } else { Kind::Activations };
    let keep_p = rerun || config.recompute == Recompute::None;
    let mut coded = 0u64;
    let mut code = |tape: &mut Tape, bytes: u64| -> Result<(), Error> {
        coded = coded.checked_add(bytes).ok_or_else(|| too_large("codes"))?;
        tape.alloc(codes, bytes)
    };
    tape.alloc(T, u)?; // LN₁ output
    code(tape, s.codes[0])?;
    for _ in 0..3 {
        // Q, K, V: the product, its bias added, split into heads (contiguous)
        tape.alloc(T, u)?;
        tape.alloc(T, u)?;
        tape.free(T, u)?;
        tape.alloc(T, u)?;
        tape.free(T, u)?;
    }
    tape.free(T, u)?; // LN₁ output
    for c in &s.codes[1..4] {
        code(tape, *c)?;
    }
    match config.attention {
        Attention::Softmax { .. } => {
            // S = QKᵀ, scaled; the causal mask; P (its codes without recomputation); P·V
            tape.alloc(T, s.att)?;
            tape.alloc(T, s.att)?;
            tape.free(T, s.att)?;
            tape.alloc(T, s.mask)?;
            tape.alloc(T, s.att)?;
            if keep_p {
                code(tape, s.codes[4])?;
            }
            tape.free(T, s.att + s.mask)?;
            tape.alloc(T, u)?;
            tape.free(T, s.att)?;
        }
        // (an input gate's z and decay, 8·B·N·H_kv bytes, are not counted)
        Attention::Linear { .. } | Attention::Gated { .. } | Attention::InputGated { .. } => {
            // φ(Q), φ(K) and the output (states: the final one, a few KB, not counted)
            tape.alloc(T, 3 * u)?;
            tape.free(T, 2 * u)?;
        }
    }
    tape.free(T, 3 * u)?; // Q, K, V
    tape.alloc(T, u)?; // heads merged
    tape.free(T, u)?; // the attention output by head
    code(tape, s.codes[5])?;
    tape.alloc(T, 2 * u)?; // out-projection: product, bias added
    tape.free(T, 2 * u)?; // product, merged output
    tape.alloc(T, u)?; // x₂ = x + r (r's first binding, shadowed by its dropout, lives on)
    tape.alloc(T, u)?; // LN₂ output
    code(tape, s.codes[6])?;
    tape.alloc(T, 2 * f)?; // FC₁: product, bias added
    tape.free(T, f + u)?; // product, LN₂ output
    tape.alloc(T, f)?; // GELU output
    code(tape, s.codes[7])?;
    tape.free(T, f)?; // u
    tape.alloc(T, 2 * u)?; // FC₂: product, bias added
    tape.free(T, u + f)?; // product, GELU output
    tape.alloc(out, u)?; // y = x₂ + f
    tape.free(T, 3 * u)?; // r, x₂, f
    if full {
        tape.free(T, coded)?;
    }
    Ok(())
}

/// One layer's backward (`layer/backward.rs`, then candle's accumulation of the op's two
/// gradients). Alive on entry: the gradient of the layer's output (`u`, transient); on
/// exit: the gradient of its input (`u`, transient) and of its parameters (gradients).
fn layer_backward(tape: &mut Tape, s: &Sizes, config: &LayerConfig) -> Result<(), Error> {
    use Kind::Transient as T;
    let (u, f, att) = (s.tok, s.ffn, s.att);
    let rerun = config.recompute == Recompute::Full;
    if rerun {
        // the forward again, keeping its codes for this backward only
        layer_forward(tape, s, config, true)?;
        tape.free(T, u)?; // its output
    }
    tape.alloc(T, 2 * f)?; // û decoded, GELU(û)
    tape.free(T, f)?;
    tape.alloc(T, f)?; // d g
    tape.alloc(T, s.proj_fc)?; // dW₂, db₂
    tape.free(T, f)?; // GELU(û)
    tape.alloc(T, f)?; // d u
    tape.free(T, f)?; // d g
    tape.alloc(T, 2 * u)?; // LN₂ output from its codes: decoded, scaled, shifted
    tape.free(T, u)?;
    tape.alloc(T, u)?;
    tape.free(T, u)?;
    tape.alloc(T, u)?; // d h₂
    tape.alloc(T, s.proj_cf)?; // dW₁, db₁
    tape.free(T, u + f)?; // LN₂ output, d u
    tape.alloc(T, u)?; // LN₂ backward dx
    tape.alloc(T, s.norm)?;
    tape.alloc(T, u)?; // d x₂
    tape.free(T, u)?;
    tape.alloc(T, u)?; // attention output decoded
    tape.alloc(T, u)?; // d a
    tape.alloc(T, s.proj_cc)?; // dW_o, db_o
    tape.alloc(T, u)?; // d o by head
    tape.free(T, u)?; // d a
    tape.alloc(T, 3 * u)?; // Q, K, V decoded
    let grads_qkv = match config.attention {
        Attention::Softmax { .. } => {
            let selective = config.recompute == Recompute::Selective;
            if selective {
                // P recomputed from Q̂, K̂: S, scaled, mask, P (kept to the end of the block)
                tape.alloc(T, 2 * att)?;
                tape.free(T, att)?;
                tape.alloc(T, s.mask + att)?;
                tape.free(T, att + s.mask)?;
            } else {
                tape.alloc(T, att)?; // P decoded
            }
            tape.alloc(T, u)?; // dV
            if !selective {
                tape.free(T, att)?;
            }
            tape.alloc(T, 2 * att)?; // dP, dS
            tape.free(T, att)?;
            for _ in 0..2 {
                tape.alloc(T, 2 * u)?; // dQ (dK): product, scaled
                tape.free(T, u)?;
            }
            tape.free(T, att)?; // dS
            if selective {
                tape.free(T, att)?;
            }
            3 * u
        }
        // (an input gate's z and decay, 8·B·N·H_kv bytes, are not counted)
        Attention::Linear { .. } | Attention::Gated { .. } | Attention::InputGated { .. } => {
            // the core rerun: φ(Q̂), φ(K̂), output; its backward: φ again, dφ(Q), dφ(K), dV,
            // then dQ, dK through the feature map
            tape.alloc(T, 3 * u)?;
            tape.free(T, 2 * u)?;
            tape.alloc(T, 5 * u)?;
            tape.alloc(T, 2 * u)?;
            tape.free(T, 4 * u)?;
            tape.free(T, u)?; // the rerun output
            3 * u
        }
    };
    tape.free(T, 4 * u)?; // Q̂, K̂, V̂, attention output
    tape.alloc(T, 2 * u)?; // LN₁ output from its codes
    tape.free(T, u)?;
    tape.alloc(T, u)?;
    tape.free(T, u)?;
    for i in 0..3 {
        tape.alloc(T, 2 * u)?; // heads merged, d input of the projection
        tape.alloc(T, s.proj_cc)?;
        tape.free(T, u)?; // merged
        if i > 0 {
            tape.alloc(T, u)?; // the sum of the input's gradients
            tape.free(T, 2 * u)?;
        }
        tape.free(T, grads_qkv / 3)?;
    }
    tape.alloc(T, u)?; // LN₁ backward dx
    tape.alloc(T, s.norm)?;
    tape.alloc(T, u)?; // dx = d x₂ + dx_ln
    tape.free(T, u)?;
    // returning: d h₂, d x₂, d o, LN₁ output, d input freed; the flat gradient concatenated
    tape.free(T, 5 * u)?;
    tape.alloc(T, s.layer_params)?;
    tape.free(T, s.layer_params)?; // the per-weight gradients
    if rerun {
        tape.free(T, s.codes.iter().sum())?;
    }
    // candle: each argument's gradient added to a zeros_like in the gradient store
    tape.alloc(T, 2 * u)?;
    tape.free(T, 2 * u)?; // zeros, dx
    tape.alloc(T, s.layer_params)?;
    tape.alloc(Kind::Gradients, s.layer_params)?;
    tape.free(T, 2 * s.layer_params)?; // zeros, flat
    tape.free(T, u)?; // the output's gradient
    Ok(())
}

/// The memory of one training step of the training example (`run.rs`, `train`), phase by
/// phase (module docs of [`crate::plan`]): f32 weights and gradients, candle-nn's AdamW with
/// two f32 moments per parameter, the activations the stack keeps, and every transient the
/// code allocates, traced through the phases. The step's peak is [`TrainingPlan::total`].
///
/// Modelled: mesa-candle's pre-LN [`crate::TransformerLayer`] of the GPT block without
/// dropout (the example's runs), softmax or linear attention, any bit width, exact or running
/// statistics, any recomputation.
///
/// # Errors
/// [`Error::InvalidArgument`] from [`LayerConfig::validate`], for a zero size, for post-LN,
/// dropout or the Llama block (not modelled); [`Error::Kernel`] with [`mesa_kernels::Error::TooLarge`] when
/// a count overflows `u64`.
pub fn training_step(config: &LayerConfig, shape: &TrainingShape) -> Result<TrainingPlan, Error> {
    use Kind::{Activations as A, Gradients as G, Transient as T};
    let parameters = training_parameters(config, shape)?;
    if config.block != crate::layer::Block::Gpt {
        let why = "the step's transients are modelled for the GPT block; a Llama block's saved bytes: \
                   plan::layer_stack_saved_bytes";
        return Err(Error::InvalidArgument { name: "block", why: why.into() });
    }
    if config.norm != NormPlacement::Pre {
        return Err(Error::InvalidArgument { name: "norm", why: "the plan models the example's pre-LN layer".into() });
    }
    if config.dropout.attention != 0.0 || config.dropout.residual != 0.0 {
        return Err(Error::InvalidArgument {
            name: "dropout",
            why: "the plan models the example's runs, without dropout (masks not counted)".into(),
        });
    }
    let s = Sizes::new(config, shape)?;
    let (u, lg, r) = (s.tok, s.logits, s.row);
    let (embedding, positions) = (s.embedding, s.positions);
    let head = embedding + s.norm; // the head's weight, the final LayerNorm's weight and bias
    let mut tape = Tape::new();
    tape.alloc(Kind::Weights, prod(&[parameters, 4], "weights")?)?;
    tape.alloc(Kind::State, prod(&[parameters, 8], "optimizer state")?)?;
    // embed: ids and targets, the gathered rows, plus the positions
    tape.alloc(A, 2 * s.ids)?;
    tape.alloc(A, 2 * u)?; // the gathered rows (kept by the graph: the token table is a variable), h₀
    tape.end_phase("embed")?;
    tape.repeat(shape.layers, |tape| {
        layer_forward(tape, &s, config, false)?;
        tape.alloc(A, s.state)
    })?;
    tape.end_phase("stack forward")?;
    // head on a leaf copy of the output: the composed LayerNorm keeps 5 [B,T,C] and 4 rows,
    // log-softmax and NLL keep 4 [B·T,V] (logits, shifted, exp, log-probabilities) and 4 rows
    let kept = sum(&[prod(&[5, u], "head")?, prod(&[4, lg], "head")?, prod(&[8, r], "head")?], "head")?;
    tape.alloc(T, u)?;
    tape.alloc(T, kept)?;
    // its backward (candle's backprop: each node's gradient is added to a zeros_like in the
    // store; a gradient computed from a tracked tensor keeps its inputs alive through its
    // graph until its node is processed): in log-softmax up to 7 [B·T,V] gradients at once;
    // later, at the LayerNorm's division x_c/σ, 12 [B,T,C] (the incoming gradient with the
    // zeros and product it holds, 4; d x_c with its zeros and quotient, 3; the gradient of
    // the broadcast σ with its zeros, g·x_c, σ² and the quotient, 5) beside the head weight's
    // gradient with its zeros and product (3·V·C f32)
    tape.alloc(T, prod(&[7, lg], "head backward")?)?;
    tape.free(T, prod(&[7, lg], "head backward")?)?;
    let norm_part = sum(&[prod(&[12, u], "head backward")?, prod(&[3, embedding], "head backward")?], "head")?;
    tape.alloc(T, norm_part)?;
    tape.free(T, norm_part)?;
    tape.alloc(G, head)?;
    tape.alloc(T, u)?; // dy: the gradient of the leaf
    tape.free(T, sum(&[kept, u], "head")?)?; // the loss and the leaf dropped
    tape.end_phase("head")?;
    // the stack's backward through (h · dy).sum(): the product; its gradient d (from zeros);
    // h's gradient d·dy (from zeros); dy's gradient d·h (from zeros), which keeps d·h, its
    // zeros and d alive through its graph while the store holds it: 4 [B,T,C] to the end
    tape.alloc(T, u)?;
    tape.alloc(T, 2 * u)?;
    tape.free(T, u)?;
    tape.alloc(T, 3 * u)?;
    tape.free(T, 2 * u)?;
    tape.alloc(T, 3 * u)?;
    tape.repeat(shape.layers, |tape| layer_backward(tape, &s, config))?;
    // the embedding: h₀ = rows + positions; each addend's gradient from zeros (the incoming
    // one freed after both), the positions' gradient; the rows' reshape (from zeros); the token
    // table's gradient (index_add onto zeros)
    for _ in 0..2 {
        tape.alloc(T, 2 * u)?;
        tape.free(T, u)?;
    }
    tape.free(T, u)?;
    tape.alloc(G, positions)?;
    tape.free(T, u)?;
    tape.alloc(T, 2 * u)?;
    tape.free(T, 2 * u)?;
    tape.alloc(T, embedding)?;
    tape.alloc(G, embedding)?;
    tape.free(T, embedding + u)?;
    tape.free(T, u)?; // the product (h · dy), at the end of the backward's statement
    tape.end_phase("stack backward")?;
    // AdamW (candle-nn 0.11 optim.rs): per variable of n elements, 14 f32 tensors of n alive
    // at the end of its update — the moments and the weights are variables, so every result
    // keeps its operands in its graph: m·β₁, g·(1−β₁), m′; v·β₂, g²·(1−β₂), v′; m̂, v̂, the
    // decayed weights, √v̂, √v̂ + ε, the update, ·lr, the new weights
    let largest = s.layer_params.max(embedding).max(positions);
    tape.alloc(T, prod(&[14, largest], "optimizer temporaries")?)?;
    tape.free(T, prod(&[14, largest], "optimizer temporaries")?)?;
    tape.end_phase("optimizer step")?;
    let phases = tape.phases;
    let peak = phases.iter().copied().max_by_key(|p| p.bytes.total);
    let (total, peak_phase) = peak.map_or((MemoryBreakdown::default(), ""), |p| (p.bytes, p.name));
    Ok(TrainingPlan { parameters, phases, total, peak_phase })
}

/// The largest batch for which [`training_step`]'s total, with `shape.batch` replaced, is at
/// most `budget` bytes; `None` when batch 1 does not fit.
///
/// # Errors
/// As [`training_step`] (a batch whose count overflows does not fit).
pub fn largest_training_batch(config: &LayerConfig, shape: &TrainingShape, budget: u64) -> Result<Option<u64>, Error> {
    training_step(config, &TrainingShape { batch: 1, ..*shape })?;
    super::largest(budget, |b| Ok(training_step(config, &TrainingShape { batch: b, ..*shape })?.total.total))
}

/// A floor under the peak of a training step on the plain-candle reference layer
/// (`plain = true` in the example): weights, gradients and AdamW's state of the same
/// parameters (f32), plus the plain-f32 estimate of the stack's activations
/// ([`super::reference_stack_estimate`]). All of these are alive together during the
/// optimizer step (the stack's output still holds the graph), so the peak is at least this;
/// candle's graph keeps every intermediate of the composed reference ops besides, which this
/// does not model: it is not a prediction (`docs/plan.md`). Activations and transient of the
/// head and the optimizer are not counted.
///
/// # Errors
/// As [`training_parameters`].
pub fn reference_training_floor(config: &LayerConfig, shape: &TrainingShape) -> Result<MemoryBreakdown, Error> {
    let psi = training_parameters(config, shape)?;
    let acts = super::reference_stack_estimate(config, shape.layers, shape.batch, shape.seq)?;
    let per = mesa_kernels::plan::TrainingPrecision::f32();
    Ok(MemoryBreakdown::of_parameters(psi, per, mesa_kernels::plan::Optimizer::AdamW)?.with(acts, 0)?)
}
