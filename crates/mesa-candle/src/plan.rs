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
use mesa_kernels::plan::{
    AttentionKind, CodeFormat, Dropout, LinearStates, MaskStorage, ModelShape, Parallelism, PlanConfig, Precision,
    Recompute as PlanRecompute, SavedPrecision,
};

use crate::error::Error;
use crate::layer::{Attention, LayerConfig, Recompute};

mod training;

pub use training::{
    largest_training_batch, training_parameters, training_step, PhaseBytes, TrainingPlan, TrainingShape,
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
    };
    Ok(PlanConfig {
        shape,
        parallel: Parallelism::none(),
        dropout: Dropout {
            attention: f64::from(config.dropout.attention),
            residual: f64::from(config.dropout.residual),
            masks: MaskStorage::Regenerated,
        },
        recompute: recompute(config.recompute),
        saved: SavedPrecision {
            norm_row_bytes: 8,
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
