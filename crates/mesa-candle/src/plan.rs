//! The bytes a stack of [`TransformerLayer`](crate::TransformerLayer)s keeps alive for
//! backward, predicted with the framework-independent planner [`mesa_kernels::plan`].
//!
//! What one layer of this crate keeps ([`crate::layer`]'s table), per sequence of `N`
//! tokens, width `C`, `H` heads, FFN width `F`, codes of `k` bits (`⌈n·k/8⌉` bytes, plus
//! 8 bytes per head and a 4-byte counter per coded tensor):
//!
//! | tensor | bytes | planner item |
//! |---|---|---|
//! | the layer input `x` (candle keeps the op's argument) | `4NC` | `LayerInput` |
//! | LN₁, LN₂: codes of `x̂`, f32 mean and `1/σ` per row | `kNC/8 + 8N` each | `Norm1(Rows)`, `Norm2(Rows)` |
//! | Q, K, V codes (per head) | `kNC/8` each | `Q`, `K`, `V` |
//! | `√P` codes (softmax, no recomputation only) | `kHN²/8` | `Softmax` |
//! | attention output before `W_o` | `kNC/8` | `OutProjInput` |
//! | FFN pre-activation `u` | `kNF/8` | `GeluInput` |
//! | dropout masks | 0 (Philox keys) | — |
//! | QKV, FC₁, FC₂, `P·V` inputs | 0 (decoded from LN₁, LN₂, `u`, `P`) | — |
//! | linear attention's states | 0 (its core reruns in backward) | — |
//!
//! [`Recompute::Full`] keeps `x` only. A stack of `L` layers
//! also keeps its output (the head's input, `4NC` per sequence): that is the quantity of
//! [`measure`](crate::layer::measure::measure) for the stack — every layer's input included,
//! parameters and gradients excluded.
//!
//! # The whole training step
//!
//! [`training_step`] counts all of memory for one step of the training example
//! (`examples/train_shakespeare`, `run.rs`'s `train`): token embedding `[V, C]`, learnt
//! positions `[T, C]`, `L` layers, final LayerNorm, untied head `[V, C]`, cross-entropy;
//! f32 weights and gradients; candle-nn's AdamW with two f32 moments. Parameters
//! `Ψ = 2VC + TC + L(4C² + 2CF + 9C + F) + 2C`; weights `4Ψ` and AdamW's state `8Ψ` bytes
//! are alive throughout. The rest is traced phase by phase through what the code allocates
//! (`n = B·T` tokens; `u` = `[B, T, C]` f32, `f` = `[B, T, F]`, `a` = `[B, H, T, T]`, `ℓ` =
//! `[B·T, V]`; candle keeps every op's arguments and, for a result computed from a tracked
//! tensor, its graph):
//!
//! | phase | alive besides weights and state | at its peak |
//! |---|---|---|
//! | embed | ids and targets (u32), gathered rows and `h₀` (both kept: the table is a variable) | — |
//! | stack forward | the layers' inputs, codes and outputs so far | the last layer's forward: `S`, `P` `a` each and Q, K, V, or the FFN's `2f` with `x₂`, `r`, LN₂'s output |
//! | head | the stack's activations; a leaf copy of the output; the composed LayerNorm (5 `u`) and log-softmax/NLL (4 `ℓ`) graphs | max(7 `ℓ` gradients in log-softmax's backward, 12 `u` at the LayerNorm's division plus the head weight's `3·4VC`) |
//! | stack backward | activations; head gradients; `dy`; the product `h·dy` and the 4 `u` that `dy`'s own gradient keeps | a layer's backward (`layer/backward.rs`): decoded `P` `a`, `dP`, `dS` `a` each, Q̂, K̂, V̂ and the `u`-sized gradients held to its end; then the flat gradient (`Tensor::cat`) and candle's `zeros + g` accumulation, `3·4Ψ_layer` |
//! | optimizer step | activations (the output still holds the graph), every gradient | AdamW on the largest variable: 14 tensors of its size (every result keeps its operands through its graph until the variable is done) |
//!
//! The total is the largest phase ([`TrainingPlan::total`], each phase in
//! [`TrainingPlan::phases`]). Checked against the counting allocator over a step written as
//! the example's loop (`tests/plan_training.rs`: 8- and 4-bit, exact and running statistics,
//! selective and full recomputation, linear attention, stochastic rounding, two sizes): within
//! 1.3 %, every phase within 5 %. What is left out: `Tensor` and shape headers, the layout's
//! names, the running estimates' few bytes per head, kernel scratch of the host emulation —
//! a few KB per layer, below the measurement. Not modelled: post-LN, dropout (rejected), and
//! the plain-candle reference layer, whose graph keeps every intermediate of its composed ops:
//! [`reference_training_floor`] is only a floor under that peak.
use mesa_kernels::plan::{
    AttentionKind, BlockKind, CodeFormat, Dropout, LinearStates, MaskStorage, ModelShape, Parallelism, PlanConfig,
    Precision, Recompute as PlanRecompute, SavedPrecision,
};

use crate::error::Error;
use crate::layer::{Attention, Block, LayerConfig, Recompute};

mod training;

pub use training::{
    largest_training_batch, reference_training_floor, training_parameters, training_step, PhaseBytes, TrainingPlan,
    TrainingShape,
};

fn sizes(config: &LayerConfig, layers: usize, batch: usize, seq: usize) -> Result<ModelShape, Error> {
    config.validate()?;
    for (name, v) in [("layers", layers), ("batch", batch), ("seq", seq)] {
        if v == 0 {
            return Err(Error::InvalidArgument { name, why: "must be positive".into() });
        }
    }
    let u = |v: usize| v as u64; // usize ≤ 64 bits on every target candle builds for
    Ok(ModelShape {
        layers: u(layers),
        seq: u(seq),
        micro_batch: u(batch),
        hidden: u(config.hidden),
        heads: u(config.heads),
        ffn: u(config.ffn),
    })
}

fn recompute(r: Recompute) -> PlanRecompute {
    match r {
        Recompute::None => PlanRecompute::None,
        Recompute::Selective => PlanRecompute::Selective,
        Recompute::Full => PlanRecompute::Full,
    }
}

/// The planner's configuration of `layers` layers of `config` on inputs `[batch, seq, C]`
/// (no tensor parallelism: the layer runs on one device).
///
/// # Errors
/// [`Error::InvalidArgument`] from [`LayerConfig::validate`] or for a zero `layers`,
/// `batch` or `seq`.
pub fn plan_config(config: &LayerConfig, layers: usize, batch: usize, seq: usize) -> Result<PlanConfig, Error> {
    let shape = sizes(config, layers, batch, seq)?;
    let codes = Precision::Codes(CodeFormat::per_head(config.bits));
    let attention = match &config.attention {
        Attention::Softmax { .. } => AttentionKind::Softmax,
        Attention::Linear { config: la, .. } => AttentionKind::Linear {
            causal: la.causal,
            chunk: la.chunk as u64,
            features: shape.hidden / shape.heads,
            normalize: la.normalize,
            states: LinearStates::Rerun,
        },
        // counted as ungated causal linear attention of the same sizes (its φ(Q), φ(K)
        // copies stand for the gated core's scaled f32 queries and keys); an input gate keeps
        // nothing (recomputed from the projections' input in backward)
        Attention::Gated { config: g, .. } | Attention::InputGated { config: g } => AttentionKind::Linear {
            causal: true,
            chunk: g.chunk as u64,
            features: shape.hidden / shape.heads,
            normalize: g.normalize,
            states: LinearStates::Rerun,
        },
    };
    let (block, norm_row_bytes) = match config.block {
        // LayerNorm keeps mean and 1/σ per row, RMSNorm its rms
        Block::Gpt => (BlockKind::Gpt, 8),
        Block::Llama(l) => (BlockKind::Llama { kv_heads: l.kv_heads as u64 }, 4),
    };
    Ok(PlanConfig {
        block,
        shape,
        parallel: Parallelism::none(),
        dropout: Dropout {
            attention: f64::from(config.dropout.attention),
            residual: f64::from(config.dropout.residual),
            masks: MaskStorage::Regenerated,
        },
        recompute: recompute(config.recompute),
        saved: SavedPrecision {
            norm_row_bytes,
            shared_inputs: true,
            layer_input: Some(Precision::F32),
            ..SavedPrecision::uniform(codes)
        },
        attention,
    })
}

/// The stack's output `[batch, seq, C]` f32.
fn output_bytes(shape: &ModelShape) -> Result<u64, Error> {
    [shape.micro_batch, shape.seq, shape.hidden, 4].iter().try_fold(1u64, |a, &f| a.checked_mul(f)).ok_or_else(|| {
        Error::Kernel(mesa_kernels::Error::TooLarge { what: "stack output".into(), why: "overflows u64".into() })
    })
}

fn stack_total(plan: &PlanConfig) -> Result<u64, Error> {
    let total = plan.total_bytes()?;
    total.checked_add(output_bytes(&plan.shape)?).ok_or_else(|| {
        Error::Kernel(mesa_kernels::Error::TooLarge { what: "stack".into(), why: "overflows u64".into() })
    })
}

/// Bytes alive for backward after the forward of `layers` layers of `config` on an input
/// `[batch, seq, C]` f32: every layer's input (the first one's included), what each layer
/// keeps (module docs), the stack's output, and per layer the host bytes of its boxed backward
/// state (a constant of this build, `size_of` of the op candle holds, about 2.7 KB);
/// parameters and gradients excluded. The
/// prediction of what [`measure`](crate::layer::measure::measure) reports for the stack.
/// Running-estimate and exact statistics give the same bytes (the parameters used are
/// stored with the codes either way).
///
/// # Errors
/// [`Error::InvalidArgument`] (configuration, zero sizes); [`Error::Kernel`] with
/// [`mesa_kernels::Error::TooLarge`] when the count overflows `u64`.
pub fn layer_stack_saved_bytes(config: &LayerConfig, layers: usize, batch: usize, seq: usize) -> Result<u64, Error> {
    let tensors = stack_total(&plan_config(config, layers, batch, seq)?)?;
    let state = (crate::layer::BACKWARD_STATE_BYTES as u64).checked_mul(layers as u64);
    state.and_then(|s| s.checked_add(tensors)).ok_or_else(|| {
        Error::Kernel(mesa_kernels::Error::TooLarge { what: "stack".into(), why: "overflows u64".into() })
    })
}

/// Bytes one rank of a tensor- and sequence-parallel group of `tensor` ranks keeps alive for
/// backward after the forward of `layers` [`TransformerLayer::sharded`](crate::TransformerLayer::sharded)
/// layers on its rows `[batch, seq/t, C]` — [`layer_stack_saved_bytes`] with the planner's
/// `Parallelism { tensor, sequence: true }` (Korthikanti et al. 2022, §4.2.2: every saved
/// tensor of the layer is the rank's `1/t`, the LayerNorm codes and the layer inputs along the
/// sequence, the rest along the heads and FFN units), the rank's rows of the stack's output,
/// and the op state per layer. `tensor = 1` is [`layer_stack_saved_bytes`].
///
/// # Errors
/// As [`layer_stack_saved_bytes`]; [`Error::InvalidArgument`] when `tensor` is 0 or does not
/// divide the heads, the FFN width and `seq`.
pub fn sharded_stack_saved_bytes(
    config: &LayerConfig,
    layers: usize,
    batch: usize,
    seq: usize,
    tensor: usize,
) -> Result<u64, Error> {
    let plan = sharded_plan_config(plan_config(config, layers, batch, seq)?, config, seq, tensor)?;
    let state = (crate::layer::BACKWARD_STATE_BYTES as u64).checked_mul(layers as u64);
    sharded_total(&plan, tensor, state)
}

/// [`reference_stack_estimate`] per rank of `tensor` ranks (the plain-f32 estimate with
/// `Parallelism { tensor, sequence: true }`, and the rank's rows of the output).
///
/// # Errors
/// As [`sharded_stack_saved_bytes`].
pub fn sharded_reference_estimate(
    config: &LayerConfig,
    layers: usize,
    batch: usize,
    seq: usize,
    tensor: usize,
) -> Result<u64, Error> {
    let plan = sharded_plan_config(reference_plan_config(config, layers, batch, seq)?, config, seq, tensor)?;
    sharded_total(&plan, tensor, Some(0))
}

/// The plan's bytes per rank, the rank's rows of the stack's output and `extra` (`None`: the
/// count overflowed).
fn sharded_total(plan: &PlanConfig, tensor: usize, extra: Option<u64>) -> Result<u64, Error> {
    let output = output_bytes(&plan.shape)? / tensor as u64;
    [plan.total_bytes()?, output].into_iter().try_fold(extra.unwrap_or(u64::MAX), u64::checked_add).ok_or_else(|| {
        Error::Kernel(mesa_kernels::Error::TooLarge { what: "stack".into(), why: "overflows u64".into() })
    })
}

fn sharded_plan_config(
    mut plan: PlanConfig,
    config: &LayerConfig,
    seq: usize,
    tensor: usize,
) -> Result<PlanConfig, Error> {
    if tensor == 0 || config.heads % tensor != 0 || config.ffn % tensor != 0 || seq % tensor != 0 {
        return Err(Error::InvalidArgument {
            name: "tensor",
            why: format!("{tensor} must divide heads {}, ffn {} and seq {seq}", config.heads, config.ffn),
        });
    }
    plan.parallel = Parallelism { tensor: tensor as u64, sequence: tensor > 1 };
    Ok(plan)
}

/// The planner's configuration for the plain-f32 estimate of the reference layer
/// ([`crate::layer::reference`]): the paper's accounting (Korthikanti et al. 2022, §4.1)
/// at 4 bytes per element, the dropout masks as the f32 tensors the reference multiplies
/// by, every input stored, the layer input as LN₁'s input; recomputation as configured.
///
/// # Errors
/// As [`plan_config`].
pub fn reference_plan_config(
    config: &LayerConfig,
    layers: usize,
    batch: usize,
    seq: usize,
) -> Result<PlanConfig, Error> {
    let mut plan = plan_config(config, layers, batch, seq)?;
    plan.dropout.masks = MaskStorage::Stored { bytes: 4 };
    plan.saved = SavedPrecision::uniform(Precision::F32);
    if let AttentionKind::Linear { .. } = plan.attention {
        // the reference writes linear attention as its masked quadratic form A = φ(Q)φ(K)ᵀ
        plan.attention = AttentionKind::Softmax;
    }
    Ok(plan)
}

/// The plain-f32 estimate of what `layers` reference layers keep, plus the stack's output
/// ([`reference_plan_config`]). Candle's graph keeps more (every intermediate of the
/// composed ops): `docs/plan.md` compares it with the measurement.
///
/// # Errors
/// As [`layer_stack_saved_bytes`].
pub fn reference_stack_estimate(config: &LayerConfig, layers: usize, batch: usize, seq: usize) -> Result<u64, Error> {
    stack_total(&reference_plan_config(config, layers, batch, seq)?)
}

/// The planner's configuration of a stack of checkpoint regions ([`crate::region`]), one
/// per layer of `shape`, whose inputs are kept at `input` precision: every layer keeps only
/// its input — the planner's full recomputation (Korthikanti et al. 2022, §5: `2sbh` per
/// layer at 16 bits; `2sbh/t` per rank when `parallel` has sequence parallelism, which
/// shards the input along the sequence). Whatever runs inside the regions (candle's ops, ours,
/// the layer op) does not change it.
#[must_use]
pub fn region_plan_config(shape: ModelShape, parallel: Parallelism, input: Precision) -> PlanConfig {
    PlanConfig {
        block: BlockKind::Gpt,
        shape,
        parallel,
        dropout: Dropout { attention: 0.0, residual: 0.0, masks: MaskStorage::Regenerated },
        recompute: PlanRecompute::Full,
        saved: SavedPrecision { layer_input: Some(input), ..SavedPrecision::uniform(input) },
        attention: AttentionKind::Softmax,
    }
}

/// Host bytes one region leaves in candle's graph besides its input and output: its op and
/// the anchor ops of its parameters, their results and their backward state — counted by
/// [`region_stack_saved_bytes`] per region of `parameters` variables, as a bound from the
/// types' sizes (a `Tensor`'s header, the one-element anchors and the closure's captures are
/// a few hundred bytes each).
#[must_use]
pub fn region_state_bytes(parameters: usize) -> u64 {
    crate::region::state_bytes(parameters) as u64
}

/// Bytes alive for backward after the forward of a stack of `shape.layers` checkpoint
/// regions ([`crate::region`]) on one device, each region's output the next one's input, all
/// `[micro_batch, seq, hidden]` at `input` precision: every region's input, the last one's
/// output, and [`region_state_bytes`] per region of `parameters` variables. The prediction of
/// what [`measure`](crate::layer::measure::measure) reports for such a stack, whatever runs
/// inside each region.
///
/// # Errors
/// [`Error::Kernel`] with the planner's errors ([`mesa_kernels::Error::InvalidArgument`] for
/// zero sizes, [`mesa_kernels::Error::TooLarge`] on overflow).
pub fn region_stack_saved_bytes(shape: ModelShape, input: Precision, parameters: usize) -> Result<u64, Error> {
    let plan = region_plan_config(shape, Parallelism::none(), input);
    let per_element = match input {
        Precision::F32 => 4,
        Precision::Half => 2,
        Precision::Codes(_) => {
            return Err(Error::InvalidArgument {
                name: "input",
                why: "a region keeps its input as it is: f32 or half".into(),
            })
        }
    };
    let output =
        [shape.micro_batch, shape.seq, shape.hidden, per_element].iter().try_fold(1u64, |a, &f| a.checked_mul(f));
    let state = region_state_bytes(parameters).checked_mul(shape.layers);
    [Some(plan.total_bytes()?), output, state]
        .into_iter()
        .try_fold(0u64, |a, b| b.and_then(|b| a.checked_add(b)))
        .ok_or_else(|| {
            Error::Kernel(mesa_kernels::Error::TooLarge { what: "region stack".into(), why: "overflows u64".into() })
        })
}

/// The largest batch `b ≥ 1` with `bytes(b) ≤ budget`, for `bytes` not decreasing in `b`
/// (overflow counts as not fitting).
fn largest(budget: u64, bytes: impl Fn(usize) -> Result<u64, Error>) -> Result<Option<u64>, Error> {
    let fit = mesa_kernels::plan::largest_fit(budget, |b| {
        let b = usize::try_from(b)
            .map_err(|_| mesa_kernels::Error::TooLarge { what: "batch".into(), why: "past usize".into() })?;
        bytes(b).map_err(|e| match e {
            Error::Kernel(k) => k,
            other => mesa_kernels::Error::InvalidArgument { name: "plan".into(), why: other.to_string() },
        })
    })?;
    Ok(fit)
}

/// The largest batch for which [`layer_stack_saved_bytes`] is at most `budget` bytes;
/// `None` when batch 1 does not fit.
///
/// # Errors
/// As [`layer_stack_saved_bytes`] (overflow counts as not fitting).
pub fn largest_batch(config: &LayerConfig, layers: usize, seq: usize, budget: u64) -> Result<Option<u64>, Error> {
    plan_config(config, layers, 1, seq)?;
    largest(budget, |b| layer_stack_saved_bytes(config, layers, b, seq))
}

/// The largest batch for which [`reference_stack_estimate`] is at most `budget` bytes.
///
/// # Errors
/// As [`largest_batch`].
pub fn largest_reference_batch(
    config: &LayerConfig,
    layers: usize,
    seq: usize,
    budget: u64,
) -> Result<Option<u64>, Error> {
    plan_config(config, layers, 1, seq)?;
    largest(budget, |b| reference_stack_estimate(config, layers, b, seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_sizes_and_configurations_are_typed_errors() {
        let good = LayerConfig::new(16, 4, 64);
        for (l, b, n) in [(0, 1, 1), (1, 0, 1), (1, 1, 0)] {
            let e = layer_stack_saved_bytes(&good, l, b, n).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
        for bad in [LayerConfig { heads: 3, ..good.clone() }, LayerConfig { bits: 3, ..good.clone() }] {
            let e = layer_stack_saved_bytes(&bad, 1, 1, 1).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
        // overflow: a typed error in debug builds too, never a panic
        let e = layer_stack_saved_bytes(&good, usize::MAX, usize::MAX, usize::MAX).unwrap_err();
        assert!(matches!(e, Error::Kernel(mesa_kernels::Error::TooLarge { .. })), "{e}");
        let e = largest_batch(&good, 0, 1, 1 << 30).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }

    #[test]
    fn training_step_errors_are_typed() {
        let good = LayerConfig::new(16, 4, 64);
        let shape = TrainingShape { layers: 2, batch: 4, seq: 8, vocab: 80 };
        for bad in [
            TrainingShape { layers: 0, ..shape },
            TrainingShape { batch: 0, ..shape },
            TrainingShape { seq: 0, ..shape },
            TrainingShape { vocab: 0, ..shape },
        ] {
            let e = training_step(&good, &bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
        let dropout =
            LayerConfig { dropout: crate::layer::DropoutConfig { residual: 0.1, ..good.dropout }, ..good.clone() };
        assert!(matches!(training_step(&dropout, &shape).unwrap_err(), Error::InvalidArgument { .. }));
        // overflow: a typed error in debug builds too, never a panic or a wrap
        for huge in [
            TrainingShape { batch: usize::MAX, ..shape },
            TrainingShape { vocab: usize::MAX, ..shape },
            TrainingShape { layers: usize::MAX, ..shape },
            TrainingShape { seq: usize::MAX / 2, ..shape },
        ] {
            let e = training_step(&good, &huge).unwrap_err();
            assert!(matches!(e, Error::Kernel(mesa_kernels::Error::TooLarge { .. })), "{e}");
        }
        // a layer count that fits u64 but no machine: answered at once (no per-layer loop)
        let deep = training_step(&good, &TrainingShape { layers: 1 << 40, ..shape }).unwrap();
        assert!(deep.total.total > 1 << 50);
        // a layer whose parameters' bytes overflow usize is refused by the config itself
        let wide = LayerConfig::new(1 << 31, 1, 1 << 31);
        let e = training_step(&wide, &shape).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { name: "hidden", .. }), "{e}");
        // one that fits usize but whose step overflows the planner's u64 counts: TooLarge
        let wide = LayerConfig::new(1 << 28, 1, 1 << 28);
        let e = training_step(&wide, &TrainingShape { batch: 1 << 40, ..shape }).unwrap_err();
        assert!(matches!(e, Error::Kernel(mesa_kernels::Error::TooLarge { .. })), "{e}");
    }

    #[test]
    fn training_step_counts_every_term() {
        let cfg = LayerConfig::new(16, 4, 64);
        let shape = TrainingShape { layers: 2, batch: 4, seq: 8, vocab: 80 };
        let plan = training_step(&cfg, &shape).unwrap();
        let (c, f, v, t) = (16u64, 64u64, 80u64, 8u64);
        let psi = 2 * v * c + t * c + 2 * (4 * c * c + 2 * c * f + 9 * c + f) + 2 * c;
        assert_eq!(plan.parameters, psi);
        // an input gate adds its C·H_kv + 2·H_kv per layer, as the layer's own layout has them
        let gated = LayerConfig { attention: crate::layer::Attention::input_gated(), ..cfg.clone() };
        let extra = crate::layer::ParamLayout::of(&gated).unwrap().total()
            - crate::layer::ParamLayout::of(&cfg).unwrap().total();
        assert_eq!(extra as u64, 4 * c + 2 * 4);
        assert_eq!(training_step(&gated, &shape).unwrap().parameters, psi + 2 * extra as u64);
        let names: Vec<_> = plan.phases.iter().map(|p| p.name).collect();
        assert_eq!(names, ["embed", "stack forward", "head", "stack backward", "optimizer step"]);
        for p in &plan.phases {
            let b = p.bytes;
            assert_eq!((b.weights, b.optimizer_state), (4 * psi, 8 * psi), "{}", p.name);
            assert_eq!(b.total, b.weights + b.gradients + b.optimizer_state + b.activations + b.transient);
            assert!(b.total <= plan.total.total);
        }
        let opt = plan.phases[4].bytes;
        assert_eq!(opt.gradients, 4 * psi, "every gradient is alive at the optimizer step");
        // the stack's activations (the planner of saved bytes) plus the batch's ids and targets
        // and the gathered embedding rows
        let stack = layer_stack_saved_bytes(&cfg, 2, 4, 8).unwrap();
        assert_eq!(opt.activations, stack + 2 * 4 * 32 + 4 * 32 * c);
        assert_eq!(plan.peak_phase, plan.phases.iter().max_by_key(|p| p.bytes.total).unwrap().name);
        // a floor for the reference layer: at least weights, gradients, state and its estimate
        let floor = reference_training_floor(&cfg, &shape).unwrap();
        assert_eq!(floor.total, 16 * psi + reference_stack_estimate(&cfg, 2, 4, 8).unwrap());
    }

    #[test]
    fn largest_training_batch_is_the_last_that_fits() {
        let cfg = LayerConfig::new(16, 4, 64);
        let shape = TrainingShape { layers: 2, batch: 1, seq: 8, vocab: 80 };
        let at = |b: usize| training_step(&cfg, &TrainingShape { batch: b, ..shape }).unwrap().total.total;
        assert_eq!(largest_training_batch(&cfg, &shape, at(1) - 1).unwrap(), None);
        for budget in [at(1), at(7) + 1, at(40) - 1, 1 << 26] {
            let b = largest_training_batch(&cfg, &shape, budget).unwrap().unwrap() as usize;
            assert!(at(b) <= budget && at(b + 1) > budget, "{b} for {budget}");
        }
        let e = largest_training_batch(&cfg, &TrainingShape { layers: 0, ..shape }, 1 << 30).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }

    #[test]
    fn largest_batch_is_the_last_batch_that_fits() {
        let cfg = LayerConfig::new(16, 4, 64);
        let one = layer_stack_saved_bytes(&cfg, 2, 1, 8).unwrap();
        assert_eq!(largest_batch(&cfg, 2, 8, one - 1).unwrap(), None);
        let budget = 10 * one;
        let b = largest_batch(&cfg, 2, 8, budget).unwrap().unwrap() as usize;
        assert!(layer_stack_saved_bytes(&cfg, 2, b, 8).unwrap() <= budget);
        assert!(layer_stack_saved_bytes(&cfg, 2, b + 1, 8).unwrap() > budget);
        let r = largest_reference_batch(&cfg, 2, 8, budget).unwrap().unwrap() as usize;
        assert!(r < b, "the f32 reference fits fewer sequences ({r}) than 8-bit codes ({b})");
    }
}
