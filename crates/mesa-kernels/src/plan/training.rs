//! The memory of a whole training step: weights, gradients, optimizer state, the activations
//! kept for backward ([`PlanConfig`]) and the largest transient of the step.
//!
//! Per parameter, with `w`, `g`, `s` the bytes per element of the weights, the gradients and
//! one optimizer-state tensor, `k` the optimizer's state tensors ([`Optimizer::states`]: Adam
//! and AdamW 2 — the first and second moment of Kingma & Ba 2015, Algorithm 1; SGD with
//! momentum 1; plain SGD 0) and `m` the bytes of an optional full-precision master copy:
//!
//! ```text
//! weights          Ψ·w
//! gradients        Ψ·g
//! optimizer state  Ψ·(k·s + m)
//! total            weights + gradients + optimizer state + activations + transient
//! ```
//!
//! `Ψ` is the parameter count ([`layer_parameters`] per layer plus the caller's extra
//! parameters: embeddings, head). All f32 ([`TrainingPrecision::f32`]) costs `4 + 4 + 8 = 16`
//! bytes per parameter with Adam; 16-bit mixed precision with Adam
//! ([`TrainingPrecision::mixed16`]) costs `2 + 2 + 12`: 16-bit weights and gradients, and an
//! f32 master copy, momentum and variance — the `K = 12` accounting of Rajbhandari et al.
//! 2020, *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, §3.1.
//!
//! The transient is what a framework allocates besides, at the step's peak (a logits tensor
//! and its gradient, the decoded tensors of one layer's backward, an optimizer's
//! temporaries): framework-specific, so the caller gives it (`mesa_candle::plan` derives it
//! for candle). This module counts every byte as live at once: a bound when a framework frees
//! the activations before it allocates its gradients.
//!
//! Every sum and product is checked: a count past `u64` is [`Error::TooLarge`], also in debug
//! builds.
use super::{largest_fit, PlanConfig};
use crate::error::{Error, Result};

/// The optimizer, by the state it keeps per parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Optimizer {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one tensor (the velocity).
    SgdMomentum,
    /// Adam (Kingma & Ba 2015, Algorithm 1): the first and second moment estimates `m`, `v`.
    Adam,
    /// AdamW (Loshchilov & Hutter 2019): Adam's two moments; the weight decay keeps nothing.
    AdamW,
}

impl Optimizer {
    /// State tensors per parameter tensor, each the parameter's size: 0, 1 or 2.
    #[must_use]
    pub fn states(self) -> u64 {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::SgdMomentum => 1,
            Optimizer::Adam | Optimizer::AdamW => 2,
        }
    }
}

/// Bytes per element of what a training step keeps per parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainingPrecision {
    /// Bytes per weight (f32: 4, bf16/fp16: 2).
    pub weight: u64,
    /// Bytes per gradient element.
    pub gradient: u64,
    /// Bytes per element of each optimizer-state tensor.
    pub state: u64,
    /// Bytes per element of a full-precision master copy of the weights kept by the
    /// optimizer (mixed precision: 4), 0 for none.
    pub master: u64,
}

impl TrainingPrecision {
    /// Everything f32: weights, gradients and state 4 bytes, no master copy.
    #[must_use]
    pub fn f32() -> Self {
        TrainingPrecision { weight: 4, gradient: 4, state: 4, master: 0 }
    }

    /// 16-bit mixed precision (Rajbhandari et al. 2020, §3.1): 16-bit weights and gradients,
    /// f32 optimizer state and an f32 master copy (with Adam: `2 + 2 + 12` bytes per
    /// parameter).
    #[must_use]
    pub fn mixed16() -> Self {
        TrainingPrecision { weight: 2, gradient: 2, state: 4, master: 4 }
    }
}

/// Bytes of a training step by what they hold (all counts in bytes).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryBreakdown {
    /// The parameters.
    pub weights: u64,
    /// The gradients alive (all of them after the backward; fewer during it).
    pub gradients: u64,
    /// The optimizer's state, master copy included.
    pub optimizer_state: u64,
    /// Activations kept for backward (and, during a backward, those not yet freed).
    pub activations: u64,
    /// The largest transient: temporaries alive at the peak besides the terms above.
    pub transient: u64,
    /// The sum of the five.
    pub total: u64,
}

pub(super) fn too_large(what: &str) -> Error {
    Error::too_large(format!("plan: {what}"), "the byte count overflows u64")
}

pub(super) fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| too_large(what))
}

pub(super) fn add(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| too_large(what))
}

impl MemoryBreakdown {
    /// The breakdown of the five terms (bytes) and their checked sum.
    ///
    /// # Errors
    /// [`Error::TooLarge`] when the sum overflows `u64`.
    pub fn new(weights: u64, gradients: u64, optimizer_state: u64, activations: u64, transient: u64) -> Result<Self> {
        let total = [gradients, optimizer_state, activations, transient]
            .iter()
            .try_fold(weights, |acc, &v| acc.checked_add(v))
            .ok_or_else(|| too_large("training step total"))?;
        Ok(MemoryBreakdown { weights, gradients, optimizer_state, activations, transient, total })
    }

    /// Weights, full gradients and optimizer state of `parameters` parameters at `precision`
    /// with `optimizer`; activations and transient 0.
    ///
    /// # Errors
    /// [`Error::TooLarge`] on overflow.
    pub fn of_parameters(parameters: u64, precision: TrainingPrecision, optimizer: Optimizer) -> Result<Self> {
        let per_state = mul(optimizer.states(), precision.state, "optimizer state per parameter")?;
        let per_param = add(per_state, precision.master, "optimizer state per parameter")?;
        MemoryBreakdown::new(
            mul(parameters, precision.weight, "weights")?,
            mul(parameters, precision.gradient, "gradients")?,
            mul(parameters, per_param, "optimizer state")?,
            0,
            0,
        )
    }

    /// `self` with `activations` and `transient` bytes added to its terms.
    ///
    /// # Errors
    /// [`Error::TooLarge`] on overflow.
    pub fn with(self, activations: u64, transient: u64) -> Result<Self> {
        MemoryBreakdown::new(
            self.weights,
            self.gradients,
            self.optimizer_state,
            add(self.activations, activations, "activations")?,
            add(self.transient, transient, "transient")?,
        )
    }
}

/// Parameters of one standard transformer layer of width `h` and FFN width `f` (elements):
/// Q, K, V and output projections `4h²` plus their biases `4h`, the FFN `2hf` plus biases
/// `f + h`, two LayerNorms (weight and bias) `4h`:
///
/// ```text
/// 4h² + 2hf + 9h + f
/// ```
///
/// With tensor parallelism `t` (Megatron's split: QKV and FC₁ by columns with their biases,
/// out-projection and FC₂ by rows, their biases and the norms replicated), per rank:
/// `(4h² + 2hf + 3h + f)/t + 6h`.
///
/// A Llama block ([`BlockKind::Llama`](super::BlockKind)), no biases, `k = kv_heads·h/a` K/V
/// rows: `2h² + 2hk + 3hf + 2h`; per rank `(2h² + 3hf)/t + 2h·k_r + 2h` with `k_r` the
/// rank's K/V rows (`k/t`, or one head's `h/a` when `t > kv_heads`).
///
/// # Errors
/// [`PlanConfig::validate`]'s errors; [`Error::TooLarge`] on overflow.
pub fn layer_parameters(config: &PlanConfig) -> Result<u64> {
    config.validate()?;
    let (h, f, t) = (config.shape.hidden, config.shape.ffn, config.parallel.tensor);
    let what = "layer parameters";
    let sum = |terms: &[u64]| terms.iter().try_fold(0u64, |acc, &v| acc.checked_add(v)).ok_or_else(|| too_large(what));
    match config.block {
        super::BlockKind::Gpt => {
            let split = sum(&[mul(mul(4, h, what)?, h, what)?, mul(mul(2, h, what)?, f, what)?, mul(3, h, what)?, f])?;
            add(split / t, mul(6, h, what)?, what)
        }
        super::BlockKind::Llama { kv_heads } => {
            // Q and W_o: h² each; K and V: h·(kv_heads·h/a) each, a rank holding kv_heads/t
            // heads or one; gate, up, down: h·f each; two RMSNorm weights, no biases
            let kv_rows = mul((kv_heads / t).max(1), h / config.shape.heads, what)?;
            let split = sum(&[mul(mul(2, h, what)?, h, what)?, mul(mul(3, h, what)?, f, what)?])?;
            add(add(split / t, mul(mul(2, h, what)?, kv_rows, what)?, what)?, mul(2, h, what)?, what)
        }
    }
}

/// A training step: the layer stack of [`PlanConfig`] plus the rest of the model, trained by
/// `optimizer` at `precision`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainingConfig {
    /// The layer stack: its parameters ([`layer_parameters`] × `L`) and saved activations
    /// ([`PlanConfig::total_bytes`]).
    pub stack: PlanConfig,
    /// Parameters outside the layers (elements): embeddings, final norm, output head.
    pub extra_parameters: u64,
    /// Bytes per element of weights, gradients and optimizer state.
    pub precision: TrainingPrecision,
    /// The optimizer.
    pub optimizer: Optimizer,
}

impl TrainingConfig {
    /// `Ψ = L · layer_parameters + extra_parameters` (elements).
    ///
    /// # Errors
    /// [`PlanConfig::validate`]'s errors; [`Error::TooLarge`] on overflow.
    pub fn parameters(&self) -> Result<u64> {
        let layers = mul(layer_parameters(&self.stack)?, self.stack.shape.layers, "parameters")?;
        add(layers, self.extra_parameters, "parameters")
    }

    /// Every term counted live at once (module docs): weights, all gradients, optimizer state,
    /// the stack's saved activations, and the caller's `transient` bytes.
    ///
    /// # Errors
    /// [`PlanConfig::validate`]'s errors; [`Error::TooLarge`] on overflow.
    pub fn breakdown(&self, transient: u64) -> Result<MemoryBreakdown> {
        MemoryBreakdown::of_parameters(self.parameters()?, self.precision, self.optimizer)?
            .with(self.stack.total_bytes()?, transient)
    }
}

/// The largest micro-batch `b` whose [`TrainingConfig::breakdown`] total, with the transient
/// `transient(&config at b)` bytes, is at most `budget` bytes; `None` when `b = 1` does not
/// fit. `transient` must not decrease with the batch.
///
/// # Errors
/// [`PlanConfig::validate`]'s errors (other than the micro-batch's) and those of `transient`
/// other than [`Error::TooLarge`] (a batch whose count overflows does not fit).
pub fn largest_training_batch(
    config: &TrainingConfig,
    budget: u64,
    mut transient: impl FnMut(&TrainingConfig) -> Result<u64>,
) -> Result<Option<u64>> {
    largest_fit(budget, |b| {
        let mut c = *config;
        c.stack.shape.micro_batch = b;
        let t = transient(&c)?;
        Ok(c.breakdown(t)?.total)
    })
}

#[cfg(test)]
mod tests {
    use super::super::{ModelShape, Parallelism, Recompute};
    use super::*;

    fn config(b: u64) -> TrainingConfig {
        let shape = ModelShape { layers: 2, seq: 32, micro_batch: b, hidden: 64, heads: 4, ffn: 256 };
        TrainingConfig {
            stack: PlanConfig::megatron(shape, Parallelism::none(), Recompute::None),
            extra_parameters: 1000,
            precision: TrainingPrecision::f32(),
            optimizer: Optimizer::AdamW,
        }
    }

    #[test]
    fn parameter_and_byte_counts() {
        let c = config(4);
        let (h, f) = (64u64, 256u64);
        assert_eq!(layer_parameters(&c.stack).unwrap(), 4 * h * h + 2 * h * f + 9 * h + f);
        let psi = 2 * (4 * h * h + 2 * h * f + 9 * h + f) + 1000;
        assert_eq!(c.parameters().unwrap(), psi);
        let m = c.breakdown(7).unwrap();
        assert_eq!((m.weights, m.gradients, m.optimizer_state), (4 * psi, 4 * psi, 8 * psi));
        assert_eq!(m.activations, c.stack.total_bytes().unwrap());
        assert_eq!(m.total, 16 * psi + m.activations + 7);
        // ZeRO §3.1: 2 + 2 + 12 bytes per parameter with Adam in 16-bit mixed precision
        let z = MemoryBreakdown::of_parameters(10, TrainingPrecision::mixed16(), Optimizer::Adam).unwrap();
        assert_eq!((z.weights, z.gradients, z.optimizer_state, z.total), (20, 20, 120, 160));
        let s = MemoryBreakdown::of_parameters(10, TrainingPrecision::f32(), Optimizer::SgdMomentum).unwrap();
        assert_eq!(s.total, 120);
        // tensor parallelism: the split matrices and biases divided, the rest replicated
        let mut t = c;
        t.stack.parallel.tensor = 2;
        assert_eq!(layer_parameters(&t.stack).unwrap(), (4 * h * h + 2 * h * f + 3 * h + f) / 2 + 6 * h);
    }

    #[test]
    fn overflow_and_zero_sizes_are_typed_errors() {
        let e = MemoryBreakdown::of_parameters(u64::MAX / 2, TrainingPrecision::f32(), Optimizer::Adam).unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
        let e = MemoryBreakdown::new(u64::MAX, 1, 0, 0, 0).unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
        let mut c = config(1);
        c.extra_parameters = u64::MAX;
        assert!(matches!(c.parameters().unwrap_err(), Error::TooLarge { .. }));
        let mut c = config(1);
        c.stack.shape.hidden = 1 << 40;
        c.stack.shape.heads = 1;
        c.stack.shape.ffn = 1 << 40;
        assert!(matches!(c.breakdown(0).unwrap_err(), Error::TooLarge { .. }));
        for zero in [0, 1, 2] {
            let mut c = config(1);
            match zero {
                0 => c.stack.shape.layers = 0,
                1 => c.stack.shape.hidden = 0,
                _ => c.stack.shape.seq = 0,
            }
            assert!(matches!(c.breakdown(0).unwrap_err(), Error::InvalidArgument { .. }));
        }
    }

    #[test]
    fn largest_training_batch_is_the_last_that_fits() {
        let c = config(1);
        let transient = |c: &TrainingConfig| Ok(1000 * c.stack.shape.micro_batch);
        let total = |b: u64| config(b).breakdown(1000 * b).unwrap().total;
        assert_eq!(largest_training_batch(&c, total(1) - 1, transient).unwrap(), None);
        let budget = total(37) + 5;
        assert_eq!(largest_training_batch(&c, budget, transient).unwrap(), Some(37));
        assert_eq!(largest_training_batch(&c, total(37), transient).unwrap(), Some(37));
        // a batch whose count overflows does not fit; other errors are returned
        assert!(largest_training_batch(&c, u64::MAX, transient).unwrap().is_some());
        let e = largest_training_batch(&c, budget, |_| Err(Error::invalid_argument("t", "bad"))).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }));
    }
}
