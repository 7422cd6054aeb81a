//! Independent CPU references (f64 accumulation) for every op: the oracle of the parity
//! tests, public so that frameworks can test their integration the same way.
//!
//! They share no code with the kernels: plain loops over logical indices, written from the
//! papers' equations, slow on purpose.
pub mod collectives;
pub mod fused;
pub mod gated_linear_attention;
pub mod linear_attention;
pub mod quant;
pub mod rope;

use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::layout::Layout;

/// Reads the elements of a strided view in logical (row-major) order, widened to f64.
///
/// # Errors
/// [`Error::BufferTooShort`] when the view reaches past `data`; [`Error::TooLarge`] when
/// its offsets overflow or its elements cannot be allocated.
pub fn try_gather<T: Element>(data: &[T], layout: &Layout) -> Result<Vec<f64>> {
    // every offset of a view that fits is below data.len(): no overflow, no bad index
    let n = layout.check_fits(data.len(), "reference input")?;
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| Error::too_large("reference input", format!("{n} elements cannot be allocated")))?;
    visit_offsets(layout, n, |off| out.push(data[off].to_f64()));
    Ok(out)
}

/// [`try_gather`] for test code that has validated its view.
///
/// # Panics
/// When [`try_gather`] returns an error (the view reaches past `data`).
#[must_use]
pub fn gather<T: Element>(data: &[T], layout: &Layout) -> Vec<f64> {
    try_gather(data, layout).unwrap_or_else(|e| panic!("reference::gather: {e}"))
}

/// Element offsets of a strided view, in logical order. Offsets past `usize::MAX` saturate
/// (no op accepts such a view).
///
/// # Panics
/// Only when the offsets do not fit in memory (as any `Vec` of that length).
#[must_use]
pub fn offsets(layout: &Layout) -> Vec<usize> {
    let n = if layout.shape().contains(&0) { 0 } else { layout.numel() };
    let mut out = Vec::with_capacity(n);
    visit_offsets(layout, n, |off| out.push(off));
    out
}

/// Calls `f` with the offset of each of the first `n` elements of the view, in logical order
/// (saturating arithmetic).
fn visit_offsets(layout: &Layout, n: usize, mut f: impl FnMut(usize)) {
    let shape = layout.shape();
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        f(idx
            .iter()
            .zip(layout.strides())
            .fold(layout.offset(), |acc, (&i, &s)| acc.saturating_add(i.saturating_mul(s))));
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}
