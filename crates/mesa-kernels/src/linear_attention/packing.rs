//! Variable-length sequences packed into one call (flash-linear-attention's `cu_seqlens`):
//! `B = 1`, and the rows `o_n..o_{n+1}` of every head are sequence `n`. Every sequence starts
//! from the zero state (or its own initial state) and no state crosses from one sequence to
//! the next: the result equals one call per sequence. States are per (sequence, head),
//! `[N, H, M, W]`.
//!
//! Shared by [`crate::linear_attention`] and [`crate::gated_linear_attention`].
use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device};
use crate::error::{Error, Result};
use crate::launch::Launch;
use crate::linear_attention::to_i64;

/// The checked offsets of a packed call, on the device.
pub(crate) struct Packing {
    /// `N`, the number of sequences.
    pub(crate) n: usize,
    /// `Σ_n ⌈len_n / C⌉`: chunks of all sequences (the boundary states' count per head).
    pub(crate) nchunks: usize,
    /// `[N + 1]` row offsets.
    pub(crate) offsets: Buffer<i64>,
    /// `[N + 1]` first global chunk of each sequence.
    pub(crate) chunks: Buffer<i64>,
}

impl std::fmt::Debug for Packing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packing").field("n", &self.n).field("nchunks", &self.nchunks).finish()
    }
}

/// Checks `offsets` (`0 = o_0 ≤ o_1 ≤ … ≤ o_N = len`, `N ≥ 1`, `batch = 1`) and uploads them
/// with the chunk offsets for chunks of `chunk` rows.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `"seq_offsets"` for any violation; a CUDA error from
/// the upload.
pub(crate) fn pack(device: &Device, offsets: &[usize], batch: usize, len: usize, chunk: usize) -> Result<Packing> {
    let bad = |why: String| Error::invalid_argument("seq_offsets", why);
    if batch != 1 {
        return Err(bad(format!("packed sequences need B = 1 (the sequences are rows of one batch), got B = {batch}")));
    }
    match (offsets.first(), offsets.last()) {
        (Some(0), Some(&last)) if offsets.len() >= 2 && last == len => {}
        _ => {
            return Err(bad(format!(
                "expected N + 1 ≥ 2 offsets from 0 to L = {len}, got {} offsets {:?}…",
                offsets.len(),
                &offsets[..offsets.len().min(4)]
            )))
        }
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(bad(format!("offsets decrease at {i}: {} > {}", offsets[i], offsets[i + 1])));
    }
    // each offset ≤ len, a tensor extent: fits i64 (checked by the caller's shape checks)
    let rows: Vec<i64> = offsets.iter().map(|&o| o as i64).collect();
    let mut chunks = Vec::with_capacity(offsets.len());
    let mut total = 0usize;
    chunks.push(0i64);
    for w in offsets.windows(2) {
        // ≤ len chunks in all (chunk ≥ 1)
        total += (w[1] - w[0]).div_ceil(chunk);
        chunks.push(total as i64);
    }
    Ok(Packing {
        n: offsets.len() - 1,
        nchunks: total,
        offsets: device.upload(&rows)?,
        chunks: device.upload(&chunks)?,
    })
}

/// The kernels' view of `packing` (registered with `launch`); `None`: not packed.
///
/// # Errors
/// [`Error::WrongBackend`] (buffers of another backend), [`Error::TooLarge`].
pub(crate) fn to_sys<'a>(packing: Option<&'a Packing>, launch: &mut Launch<'a>) -> Result<sys::MesaLaPacking> {
    Ok(match packing {
        Some(p) => sys::MesaLaPacking {
            seq_offsets: launch.read_buffer(&p.offsets, "seq_offsets")?,
            chunk_offsets: launch.read_buffer(&p.chunks, "chunk offsets")?,
            nseq: to_i64(p.n, "sequences")?,
            nchunks: to_i64(p.nchunks, "chunks")?,
        },
        None => {
            sys::MesaLaPacking { seq_offsets: std::ptr::null(), chunk_offsets: std::ptr::null(), nseq: 0, nchunks: 0 }
        }
    })
}
