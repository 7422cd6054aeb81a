//! The largest micro-batch or sequence length that fits a memory budget.
use super::PlanConfig;
use crate::error::{Error, Result};

/// The largest `k ≥ 1` with `bytes(k) ≤ budget`, for a `bytes` that does not decrease with
/// `k`; `None` when even `k = 1` does not fit. A `k` whose count overflows
/// ([`Error::TooLarge`]) counts as not fitting; any other error is returned.
///
/// Doubling until the budget is passed, then bisection: `O(log k)` calls of `bytes`.
///
/// # Errors
/// The errors of `bytes` other than [`Error::TooLarge`].
pub fn largest_fit(budget: u64, mut bytes: impl FnMut(u64) -> Result<u64>) -> Result<Option<u64>> {
    let mut fits = |k: u64| -> Result<bool> {
        match bytes(k) {
            Ok(v) => Ok(v <= budget),
            Err(Error::TooLarge { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    };
    if !fits(1)? {
        return Ok(None);
    }
    // invariant: fits(lo) and (hi = None or !fits(hi))
    let mut lo = 1u64;
    let mut hi = None;
    while hi.is_none() {
        match lo.checked_mul(2) {
            Some(next) if fits(next)? => lo = next,
            Some(next) => hi = Some(next),
            None => {
                if fits(u64::MAX)? {
                    return Ok(Some(u64::MAX));
                }
                hi = Some(u64::MAX);
            }
        }
    }
    let mut hi = hi.unwrap_or(u64::MAX);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// The largest micro-batch `b` for which [`PlanConfig::total_bytes`] of `config` (with its
/// `micro_batch` replaced) is at most `budget` bytes; `None` when `b = 1` does not fit.
///
/// # Errors
/// [`PlanConfig::validate`]'s errors (other than the micro-batch's).
pub fn largest_micro_batch(config: &PlanConfig, budget: u64) -> Result<Option<u64>> {
    largest_fit(budget, |b| {
        let mut c = *config;
        c.shape.micro_batch = b;
        c.total_bytes()
    })
}

/// The largest sequence length `s` for which [`PlanConfig::total_bytes`] of `config` (with
/// its `seq` replaced) is at most `budget` bytes, a multiple of `t` under sequence
/// parallelism; `None` when no length fits.
///
/// # Errors
/// [`PlanConfig::validate`]'s errors (other than the sequence's).
pub fn largest_sequence(config: &PlanConfig, budget: u64) -> Result<Option<u64>> {
    let step = if config.parallel.sequence { config.parallel.tensor.max(1) } else { 1 };
    let k = largest_fit(budget, |k| {
        let mut c = *config;
        c.shape.seq = k.checked_mul(step).ok_or_else(|| Error::too_large("plan: seq", "overflows u64"))?;
        c.total_bytes()
    })?;
    Ok(k.map(|k| k * step))
}
