//! [`Codes`]: how an op keeps a tensor for backward.
use mesa_kernels::{Grouping, QuantConfig, Rounding, StatsMode};

use crate::error::{Error, Result};

/// The codes an op keeps for backward instead of a full-precision tensor: bits per element
/// (8, 4 or 2) and rounding, with one scale/offset pair for the whole tensor and each call's
/// exact min/max (the codes are a function of the data alone, so an op keeps no state
/// between calls).
///
/// Decoding error: with nearest rounding each decoded element is within `scale/2` of the
/// value it encodes, `scale = (max − min)/(2^bits − 1)` over the tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Codes {
    /// Bits per code: 8, 4 or 2.
    pub bits: u32,
    /// Round to nearest (error ≤ scale/2, deterministic) or stochastically (unbiased).
    pub rounding: Rounding,
}

impl Default for Codes {
    /// 8 bits, round to nearest.
    fn default() -> Self {
        Codes { bits: 8, rounding: Rounding::Nearest }
    }
}

impl Codes {
    /// `bits` per code (8, 4 or 2), round to nearest.
    #[must_use]
    pub fn bits(bits: u32) -> Self {
        Codes { bits, ..Codes::default() }
    }

    /// The same codes, rounded stochastically, keyed by `seed`. Every call of an op with
    /// these codes uses this seed (no state between calls): vary it per step, e.g. with the
    /// step number, or the rounding noise repeats across steps.
    #[must_use]
    pub fn stochastic(self, seed: u64) -> Self {
        Codes { rounding: Rounding::Stochastic { seed }, ..self }
    }

    /// Refuses bits other than 8, 4 and 2.
    ///
    /// # Errors
    /// [`Error::Config`].
    pub fn check(&self) -> Result<()> {
        if matches!(self.bits, 2 | 4 | 8) {
            Ok(())
        } else {
            Err(Error::Config { what: "bits", why: format!("{} bits per code (supported: 8, 4, 2)", self.bits) })
        }
    }

    /// The kernels' quantizer configuration (one group per tensor, exact statistics).
    #[must_use]
    pub fn quant_config(&self) -> QuantConfig {
        QuantConfig {
            bits: self.bits,
            grouping: Grouping::Tensor,
            rounding: self.rounding,
            momentum: 0.9,
            stats: StatsMode::Exact,
        }
    }
}
