//! Reference sequence-parallel collectives (f64): reduce-scatter, all-gather and all-reduce of
//! `[S, B, H]` tensors along `S`, written from Korthikanti et al. 2022 §4.2.2 (g and g-bar).
//!
//! Tensors are logical row-major `[rows, B, H]` vectors (use [`super::gather`] for a strided
//! view). `splits[r]` is the number of rows of rank `r`.

/// First row of every shard and the total: `offsets[r]..offsets[r+1]` are rank `r`'s rows.
#[must_use]
pub fn split_offsets(splits: &[usize]) -> Vec<usize> {
    let mut offsets = vec![0usize];
    for &s in splits {
        let last = offsets[offsets.len() - 1];
        offsets.push(last + s);
    }
    offsets
}

/// Reduce-scatter: rank `r` receives `Σ_p inputs[p][rows of r] + bias[r][h] + residual[r]`.
///
/// `inputs[p]`: `[S, B, H]` with `S = Σ splits`; `bias[r]`: `[H]`; `residual[r]`:
/// `[splits[r], B, H]`. `bh = B·H`, `h` = `H`. Sums in f64.
///
/// Panics on inconsistent lengths (test code).
#[must_use]
pub fn reduce_scatter_seq(
    inputs: &[Vec<f64>],
    splits: &[usize],
    batch: usize,
    hidden: usize,
    bias: Option<&[Vec<f64>]>,
    residual: Option<&[Vec<f64>]>,
) -> Vec<Vec<f64>> {
    let offsets = split_offsets(splits);
    let bh = batch * hidden;
    (0..splits.len())
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
        .collect()
}

/// All-gather: the shards `[splits[p], B, H]` concatenated along the sequence, `[S, B, H]`
/// (what every rank receives).
#[must_use]
pub fn all_gather_seq(shards: &[Vec<f64>]) -> Vec<f64> {
    shards.iter().flat_map(|s| s.iter().copied()).collect()
}

/// All-reduce: the elementwise sum of the inputs (what `all_gather(reduce_scatter(x))` equals).
#[must_use]
pub fn all_reduce(inputs: &[Vec<f64>]) -> Vec<f64> {
    let n = inputs.first().map_or(0, Vec::len);
    (0..n).map(|i| inputs.iter().map(|x| x[i]).sum()).collect()
}
