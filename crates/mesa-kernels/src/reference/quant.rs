//! Reference for activation compression (Mesa §3): group statistics, affine codes, the
//! running estimate, stochastic rounding, packing. f64 throughout, except where a value is
//! defined as an f32 quantity (the stored parameters), which is said per function.
use crate::error::{Error, Result};
use crate::layout::Grouping;

/// Group index of every element of a tensor of `shape`, in logical order. An empty tensor
/// (any dimension 0, including the grouped axis: zero groups) gives no index.
///
/// # Errors
/// As [`Grouping::num_groups`]; [`Error::TooLarge`] when the element count overflows `usize`
/// or the indices cannot be allocated.
pub fn group_index(shape: &[usize], grouping: &Grouping) -> Result<Vec<usize>> {
    let count = grouping.num_groups(shape)?;
    if shape.contains(&0) {
        return Ok(Vec::new());
    }
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::too_large("reference group index", format!("shape {shape:?} overflows usize")))?;
    let mut index = Vec::new();
    index
        .try_reserve_exact(n)
        .map_err(|_| Error::too_large("reference group index", format!("{n} indices cannot be allocated")))?;
    match *grouping {
        Grouping::Tensor => index.resize(n, 0),
        Grouping::Heads { axis } | Grouping::Channels { axis, .. } => {
            // no dimension is 0, so size, count (= size or a divisor of it) and span are >= 1,
            // and inner divides n (no overflow)
            let size = shape[axis];
            let span = size / count;
            let inner: usize = shape[axis + 1..].iter().product();
            index.extend((0..n).map(|i| ((i / inner) % size) / span));
        }
    }
    Ok(index)
}

/// Per-group statistics of one batch: min and max over finite values, count of others.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Minimum finite value (`+inf` if none).
    pub min: f64,
    /// Maximum finite value (`-inf` if none).
    pub max: f64,
    /// Number of NaN/±Inf values.
    pub nonfinite: usize,
}

/// Statistics per group.
#[must_use]
pub fn group_stats(x: &[f64], groups: &[usize], count: usize) -> Vec<Stats> {
    let mut s = vec![Stats { min: f64::INFINITY, max: f64::NEG_INFINITY, nonfinite: 0 }; count];
    for (&v, &g) in x.iter().zip(groups) {
        if v.is_finite() {
            s[g].min = s[g].min.min(v);
            s[g].max = s[g].max.max(v);
        } else {
            s[g].nonfinite += 1;
        }
    }
    s
}

/// Largest code at `bits` bits: `2^bits − 1` (exact up to 53 bits; `inf` past 1023).
#[must_use]
pub fn levels(bits: u32) -> f64 {
    f64::from(bits).exp2() - 1.0
}

/// (offset, scale) from a group's statistics: `(min, (max − min) / levels)`; a group
/// without finite values gets (0, 0).
#[must_use]
pub fn params_from_stats(s: &Stats, bits: u32) -> (f64, f64) {
    if s.min > s.max {
        return (0.0, 0.0);
    }
    (s.min, (s.max - s.min) / levels(bits))
}

/// Whether a batch with statistics `s` left the running estimate `(offset, scale)` (the f32
/// values stored on the device) by more than one step at `bits` bits:
/// `min < offset − scale` or `max > offset + (levels + 1)·scale`, evaluated in f64 from the
/// f32 values exactly as the kernels do. A group without finite values, or with non-finite
/// ones, never escapes (its saved scale is NaN or its estimate is kept).
#[must_use]
pub fn escapes_estimate(s: &Stats, offset: f32, scale: f32, bits: u32) -> bool {
    if s.min > s.max || s.nonfinite > 0 {
        return false;
    }
    let (o, d) = (f64::from(offset), f64::from(scale));
    s.min < o - d || s.max > o + (levels(bits) + 1.0) * d
}

/// One step of Mesa's running estimate (§3.3): `m · running + (1 − m) · batch`, per field.
#[must_use]
pub fn ema(running: (f64, f64), batch: (f64, f64), momentum: f64) -> (f64, f64) {
    (momentum * running.0 + (1.0 - momentum) * batch.0, momentum * running.1 + (1.0 - momentum) * batch.1)
}

/// The real-valued code position `t = (x − offset) / scale` (0 for a zero scale).
#[must_use]
pub fn position(x: f64, offset: f64, scale: f64) -> f64 {
    if scale > 0.0 {
        (x - offset) / scale
    } else {
        0.0
    }
}

/// Round-to-nearest code: `clamp(round_half_even(t), 0, levels)`.
#[must_use]
pub fn encode_nearest(x: f64, offset: f64, scale: f64, bits: u32) -> u32 {
    let t = position(x, offset, scale);
    t.round_ties_even().clamp(0.0, levels(bits)) as u32
}

/// Stochastic code for a uniform `u` on the grid `k / 2¹⁶`, `k < 2¹⁶` ([`rounding_uniform`]):
/// `clamp(floor(t' + u), 0, levels)` with `t'` = `t` rounded half-even to a multiple of 2⁻¹⁶
/// ([`stochastic_round`]; the kernels' fixed-point rounding, docs/kernels.md "Stochastic
/// rounding"): a `t` on a level keeps its code, `P(code = floor(t') + 1) = frac(t')`.
#[must_use]
pub fn encode_stochastic(x: f64, offset: f64, scale: f64, bits: u32, u: f64) -> u32 {
    stochastic_round(position(x, offset, scale), u).clamp(0.0, levels(bits)) as u32
}

/// `floor(t' + u)`, `t' = round_half_even(t · 2¹⁶) / 2¹⁶`: stochastic rounding of `t` with a
/// uniform `u = k / 2¹⁶` (`k < 2¹⁶`), exact in f64 for `|t| < 2³⁶` (beyond, the encoders clamp).
/// The kernels compute `(min(rint(t · 2¹⁶), L · 2¹⁶) + k) >> 16` in integers, the same code
/// after the clamp. NaN stays NaN and clamps to 0 in the encoders.
#[must_use]
pub fn stochastic_round(t: f64, u: f64) -> f64 {
    ((t * ROUNDING_ONE).round_ties_even() / ROUNDING_ONE + u).floor()
}

/// One code step in the fixed point of stochastic rounding: 2¹⁶ (16 random bits per element).
pub const ROUNDING_ONE: f64 = 65_536.0;

/// Philox rounds of stochastic rounding's generator (Salmon et al., SC'11, their table of
/// generators: the smallest round count of Philox4x32 that passes TestU01's SmallCrush, Crush
/// and BigCrush, their "Crush-resistant" count; 10 is their default, with a safety margin).
pub const ROUNDING_ROUNDS: u32 = 7;

/// The 16 random bits of stochastic rounding for logical element `index` under `key` (the
/// call's key: [`crate::Quantizer`] uses `seed + call · 0x9E3779B97F4A7C15`): half
/// `index % 2` (low half first) of word `(index % 8) / 2` of Philox4x32-7 at counter
/// `index / 8` — one generator call per unit of 8 elements, as the kernels.
#[must_use]
pub fn rounding_bits(key: u64, index: u64) -> u32 {
    let w = philox4x32(index / 8, key, ROUNDING_ROUNDS)[((index % 8) / 2) as usize];
    if index % 2 == 1 {
        w >> 16
    } else {
        w & 0xffff
    }
}

/// [`rounding_bits`] as the uniform `k / 2¹⁶ ∈ [0, 1)` that [`encode_stochastic`] takes.
#[must_use]
pub fn rounding_uniform(key: u64, index: u64) -> f64 {
    f64::from(rounding_bits(key, index)) / ROUNDING_ONE
}

/// Decoded value `code · scale + offset`.
#[must_use]
pub fn decode(code: u32, offset: f64, scale: f64) -> f64 {
    f64::from(code) * scale + offset
}

/// Philox4x32-10 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3"):
/// counter `(lo, hi, 0, 0)`, key `(lo, hi)`.
#[must_use]
pub fn philox4x32_10(counter: u64, key: u64) -> [u32; 4] {
    philox4x32(counter, key, 10)
}

/// Philox4x32 with `rounds` rounds (the paper's Philox4x32-R): counter `(lo, hi, 0, 0)`,
/// key `(lo, hi)`, the round key bumped by the Weyl constants after each round.
#[must_use]
pub fn philox4x32(counter: u64, key: u64, rounds: u32) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let mut c = [counter as u32, (counter >> 32) as u32, 0, 0];
    let mut k = [key as u32, (key >> 32) as u32];
    for _ in 0..rounds {
        let p0 = M0 * u64::from(c[0]);
        let p1 = M1 * u64::from(c[2]);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// A 24-bit uniform from Philox4x32-10 for element `index` under key `seed`: word
/// `index % 4` of block `index / 4`, top 24 bits, scaled to `[0, 1)` (the dropout masks of
/// `mesa-candle`; stochastic rounding uses [`rounding_uniform`]).
#[must_use]
pub fn uniform(seed: u64, index: u64) -> f64 {
    let w = philox4x32_10(index / 4, seed)[(index % 4) as usize];
    f64::from(w >> 8) / 16_777_216.0
}

/// Unpacks `numel` codes of `bits` bits (first element in the least significant bits).
///
/// Widths are 1, 2, 4 or 8 bits (whole codes per byte); any other width gives no code, and
/// codes past the end of `bytes` are not produced: the result is then shorter than `numel`.
#[must_use]
pub fn unpack_codes(bytes: &[u8], numel: usize, bits: u32) -> Vec<u32> {
    if !matches!(bits, 1 | 2 | 4 | 8) {
        return Vec::new();
    }
    let per = (8 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    let available = bytes.len().saturating_mul(per).min(numel);
    (0..available).map(|i| (u32::from(bytes[i / per]) >> ((i % per) as u32 * bits)) & mask).collect()
}
