//! Independent CPU references (f64 accumulation) for every op: the oracle of the parity
//! tests, public so that frameworks can test their integration the same way.
//!
//! They share no code with the kernels: plain loops over logical indices, written from the
//! papers' equations, slow on purpose.
pub mod collectives;
pub mod fused;
pub mod linear_attention;
pub mod quant;

use crate::dtype::Element;
use crate::layout::Layout;

/// Reads the elements of a strided view in logical (row-major) order, widened to f64.
///
/// Panics if the view reaches past `data` (references are test code; validate first).
#[must_use]
pub fn gather<T: Element>(data: &[T], layout: &Layout) -> Vec<f64> {
    let shape = layout.shape();
    let strides = layout.strides();
    let n = layout.numel();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let off = layout.offset() + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        out.push(data[off].to_f64());
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Element offsets of a strided view, in logical order.
#[must_use]
pub fn offsets(layout: &Layout) -> Vec<usize> {
    let shape = layout.shape();
    let n = layout.numel();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        out.push(layout.offset() + idx.iter().zip(layout.strides()).map(|(i, s)| i * s).sum::<usize>());
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}
