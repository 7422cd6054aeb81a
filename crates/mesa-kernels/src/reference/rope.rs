//! Reference for [`crate::rope`]: rotary position embeddings in f64 (Su et al. 2021, eq. 34),
//! a plain loop over the rows of logical `[rows, S, D]` data. Shares no code with the kernel.
use crate::rope::{RopeConfig, RopePairing};

/// `RoPE(x)` (or its inverse, the rotation by `−θ`) of logical data `[.., seq, dim]` with the
/// angles in f64: `θ = p·base^(−2i/R)`. A trailing partial row (data not a multiple of `dim`)
/// is copied; `seq == 0` or `dim < 2` gives `x` back.
#[must_use]
pub fn rope(x: &[f64], seq: usize, dim: usize, config: &RopeConfig, inverse: bool) -> Vec<f64> {
    let mut y = x.to_vec();
    if seq == 0 || dim < 2 {
        return y;
    }
    let r = config.rotary_dims.unwrap_or(dim).min(dim) / 2 * 2;
    for (row, chunk) in x.chunks_exact(dim).enumerate() {
        let p = (config.position_offset + row % seq) as f64;
        for i in 0..r / 2 {
            let (a, b) = match config.pairing {
                RopePairing::Halves => (i, i + r / 2),
                RopePairing::Interleaved => (2 * i, 2 * i + 1),
            };
            let theta = p * f64::from(config.base).powf(-2.0 * i as f64 / r as f64);
            let (s, c) = if inverse { (-theta.sin(), theta.cos()) } else { (theta.sin(), theta.cos()) };
            y[row * dim + a] = chunk[a] * c - chunk[b] * s;
            y[row * dim + b] = chunk[a] * s + chunk[b] * c;
        }
    }
    y
}
