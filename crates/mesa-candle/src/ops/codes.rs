//! How an op keeps a tensor for backward: [`Codes`], the ops' one quantization setting.
use mesa_kernels::{Grouping, QuantConfig, Rounding, StatsMode};

/// The codes an op keeps for backward (Mesa §3): bits, rounding and where the range comes
/// from; one group per tensor. Converts into the kernels' [`QuantConfig`], so it is what every
/// op's `new` and [`crate::nn`]'s configs take.
///
/// The default is 8-bit codes, round to nearest, **exact statistics** (each call's own
/// min/max, two passes: the codes are a function of the data alone, as in
/// [`crate::LayerConfig`]). Mesa's running estimate is opt-in ([`Codes::running`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Codes {
    /// Bits per code: 8, 4 or 2 (checked by the kernels when the op runs).
    pub bits: u32,
    /// Round to nearest (deterministic, error ≤ step/2) or stochastic ([`Rounding`]).
    pub rounding: Rounding,
    /// Each call's exact range ([`StatsMode::Exact`]) or Mesa's running estimate
    /// ([`StatsMode::Running`], kept by the op across calls).
    pub stats: StatsMode,
    /// Momentum of the running estimate, in `[0, 1]` (Mesa: 0.9); unused with exact statistics.
    pub momentum: f32,
}

impl Default for Codes {
    /// 8 bits, round to nearest, exact statistics (momentum 0.9 for a later opt-in).
    fn default() -> Self {
        Codes { bits: 8, rounding: Rounding::Nearest, stats: StatsMode::Exact, momentum: 0.9 }
    }
}

impl Codes {
    /// The defaults with `bits` per code (8, 4 or 2).
    #[must_use]
    pub fn bits(bits: u32) -> Self {
        Codes { bits, ..Codes::default() }
    }

    /// The same codes with Mesa's running estimate of the range (one pass per call after the
    /// first, momentum [`Codes::momentum`]; error ≤ one step: [`StatsMode::Running`]).
    #[must_use]
    pub fn running(self) -> Self {
        Codes { stats: StatsMode::Running, ..self }
    }

    /// The same codes rounded stochastically, batch 0 keyed by `seed` ([`Rounding::Stochastic`]).
    #[must_use]
    pub fn stochastic(self, seed: u64) -> Self {
        Codes { rounding: Rounding::Stochastic { seed }, ..self }
    }
}

impl From<Codes> for QuantConfig {
    /// One group for the whole tensor.
    fn from(c: Codes) -> Self {
        QuantConfig {
            bits: c.bits,
            grouping: Grouping::Tensor,
            rounding: c.rounding,
            momentum: c.momentum,
            stats: c.stats,
        }
    }
}
