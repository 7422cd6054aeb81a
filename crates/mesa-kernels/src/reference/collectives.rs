//! Reference sequence-parallel collectives (f64): reduce-scatter, all-gather and all-reduce of
//! `[S, B, H]` tensors along `S`, written from Korthikanti et al. 2022 §4.2.2 (g and g-bar).
//!
//! Tensors are logical row-major `[rows, B, H]` vectors (use [`super::gather`] for a strided
//! view). `splits[r]` is the number of rows of rank `r`. Inconsistent lengths and sizes that
//! overflow are errors, never panics; empty shards and empty `B`/`H` give empty results.
use crate::error::{Error, Result};

/// First row of every shard and the total: `offsets[r]..offsets[r+1]` are rank `r`'s rows.
///
/// # Errors
/// [`Error::TooLarge`] when the sum of the splits overflows.
pub fn split_offsets(splits: &[usize]) -> Result<Vec<usize>> {
    let mut offsets = Vec::with_capacity(splits.len() + 1);
    let mut total = 0usize;
    offsets.push(total);
    for &s in splits {
        total = total.checked_add(s).ok_or_else(|| Error::too_large("split sizes", "their sum overflows"))?;
        offsets.push(total);
    }
    Ok(offsets)
}

fn count(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::too_large(what, format!("the element count of {dims:?} overflows")))
}

fn check_len(what: &str, v: &[f64], dims: &[usize]) -> Result<()> {
    let n = count(what, dims)?;
    if v.len() != n {
        return Err(Error::invalid_layout(what, format!("{} values for a {dims:?} tensor ({n})", v.len())));
    }
    Ok(())
}

/// Reduce-scatter: rank `r` receives `Σ_p inputs[p][rows of r] + bias[r][h] + residual[r]`.
///
/// `inputs[p]`: `[S, B, H]` with `S = Σ splits`; `bias[r]`: `[H]`; `residual[r]`:
/// `[splits[r], B, H]`. Sums in f64, in rank order, then bias, then residual.
///
/// # Errors
/// [`Error::InvalidArgument`] for a bias or residual list whose length is not the number of
/// ranks, [`Error::InvalidLayout`] for a vector of the wrong length, [`Error::TooLarge`] for
/// sizes that overflow.
pub fn reduce_scatter_seq(
    inputs: &[Vec<f64>],
    splits: &[usize],
    batch: usize,
    hidden: usize,
    bias: Option<&[Vec<f64>]>,
    residual: Option<&[Vec<f64>]>,
) -> Result<Vec<Vec<f64>>> {
    let offsets = split_offsets(splits)?;
    let seq = offsets[offsets.len() - 1];
    // S = 0: every shard is empty whatever B and H are
    let bh = if seq == 0 { 0 } else { count("B·H", &[batch, hidden])? };
    for x in inputs {
        check_len("input", x, &[seq, batch, hidden])?;
    }
    if let Some(b) = bias {
        if b.len() != splits.len() {
            return Err(Error::invalid_argument("bias", format!("{} biases for {} ranks", b.len(), splits.len())));
        }
        b.iter().try_for_each(|v| check_len("bias", v, &[hidden]))?;
    }
    if let Some(res) = residual {
        if res.len() != splits.len() {
            return Err(Error::invalid_argument(
                "residual",
                format!("{} residuals for {} ranks", res.len(), splits.len()),
            ));
        }
        for (v, &rows) in res.iter().zip(splits) {
            check_len("residual", v, &[rows, batch, hidden])?;
        }
    }
    // every index below is inside a length checked above (n, base + n <= S·B·H)
    Ok((0..splits.len())
        .map(|r| {
            let n = splits[r] * bh;
            let base = offsets[r] * bh;
            (0..n)
                .map(|i| {
                    let mut sum = 0.0f64;
                    for x in inputs {
                        sum += x[base + i];
                    }
                    if let Some(b) = bias {
                        sum += b[r][i % hidden];
                    }
                    if let Some(res) = residual {
                        sum += res[r][i];
                    }
                    sum
                })
                .collect()
        })
        .collect())
}

/// All-gather: the shards `[splits[p], B, H]` concatenated along the sequence, `[S, B, H]`
/// (what every rank receives).
#[must_use]
pub fn all_gather_seq(shards: &[Vec<f64>]) -> Vec<f64> {
    shards.iter().flat_map(|s| s.iter().copied()).collect()
}

/// All-reduce: the elementwise sum of the inputs (what `all_gather(reduce_scatter(x))` equals).
///
/// # Errors
/// [`Error::InvalidLayout`] when the inputs differ in length.
pub fn all_reduce(inputs: &[Vec<f64>]) -> Result<Vec<f64>> {
    let n = inputs.first().map_or(0, Vec::len);
    if let Some(x) = inputs.iter().find(|x| x.len() != n) {
        return Err(Error::invalid_layout("input", format!("{} values, the first input has {n}", x.len())));
    }
    Ok((0..n).map(|i| inputs.iter().map(|x| x[i]).sum()).collect())
}
