//! Dropout masks regenerated from a counter-based seed instead of stored.
//!
//! Element `i` of stream `s` under seed `k` is kept when the Philox4x32-10 uniform
//! (`mesa_kernels::reference::quant::uniform`, 24 bits of Philox4x32-10 per element)
//! keyed by `k ⊕ s·φ64` at counter `i` is `≥ p`; kept elements are scaled by `1/(1 − p)`.
//! The forward and the backward (and a recomputed forward) call the same function with the
//! same seed: the same mask, zero bytes kept for it.
//!
//! The masks are generated on the host (and copied to the device for CUDA tensors): `O(n)`
//! host work per use. A device kernel over the same counter would avoid the copy; it is not
//! written.

use candle_core::Tensor;

/// The streams of one layer (one key each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropoutSite {
    /// The attention probabilities `P`.
    Attention = 1,
    /// The attention block's output, before the residual add.
    AttentionResidual = 2,
    /// The FFN block's output, before the residual add.
    FfnResidual = 3,
}

/// The Philox key of `site` under `seed`.
#[must_use]
pub fn site_key(seed: u64, site: DropoutSite) -> u64 {
    seed ^ (site as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The mask of `site` for a tensor of `shape` (row-major element index as the counter), as
/// f32 values `0` or `1/(1 − p)` on `device`; `None` when `p = 0`.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for `p` outside `[0, 1)` (NaN
/// included) or a shape whose element count overflows `usize`; an allocation the host
/// cannot make as [`Error::Kernel`](crate::Error::Kernel) (`TooLarge`); candle's errors.
pub fn mask(
    seed: u64,
    site: DropoutSite,
    p: f32,
    shape: &[usize],
    device: &candle_core::Device,
) -> candle_core::Result<Option<Tensor>> {
    keyed_mask(site_key(seed, site), p, shape, device)
}

/// The mask of Philox key `key` (as [`mask`], without the site), for [`crate::ops::Dropout`].
pub(crate) fn keyed_mask(
    key: u64,
    p: f32,
    shape: &[usize],
    device: &candle_core::Device,
) -> candle_core::Result<Option<Tensor>> {
    if !(0.0..1.0).contains(&p) {
        return Err(crate::Error::InvalidArgument { name: "p", why: format!("must be in [0, 1), got {p}") }.into());
    }
    if p == 0.0 {
        return Ok(None);
    }
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| crate::Error::InvalidArgument {
        name: "shape",
        why: format!("{shape:?} has more elements than usize holds"),
    })?;
    let scale = 1.0 / (1.0 - p);
    let threshold = f64::from(p);
    let mut values: Vec<f32> = Vec::new();
    values.try_reserve_exact(n).map_err(|_| host_too_large(n))?;
    for block in 0..n.div_ceil(4) as u64 {
        // one Philox block gives the uniforms of elements 4b..4b+3 (as `uniform(key, i)`)
        let words = mesa_kernels::reference::quant::philox4x32_10(block, key);
        for w in words.iter().take(n - values.len()) {
            let u = f64::from(w >> 8) / 16_777_216.0;
            values.push(if u >= threshold { scale } else { 0.0 });
        }
    }
    Ok(Some(Tensor::from_vec(values, shape, device)?))
}

/// The error of a host allocation of `n` f32 values that failed.
fn host_too_large(n: usize) -> crate::Error {
    crate::Error::Kernel(mesa_kernels::Error::TooLarge {
        what: "dropout mask".into(),
        why: format!("cannot allocate {n} f32 values on the host"),
    })
}

/// `x ⊙ mask` (nothing when there is no mask).
pub(crate) fn apply(x: &Tensor, mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match mask {
        // masks are made in f32: a 16-bit layer multiplies by their rounding (1/(1 − p) to
        // the dtype's precision, 0 exactly)
        Some(m) if m.dtype() != x.dtype() => x.broadcast_mul(&m.to_dtype(x.dtype())?),
        Some(m) => x.broadcast_mul(m),
        None => Ok(x.clone()),
    }
}
