//! The intra-node kernel over every rank's candle tensors at once: what the last rank to
//! arrive at a collective runs ([`super::group`]).
//!
//! Tensors are `[B, S_r, C]` (batch first, as the layer); the kernel's views are `[S_r, B, C]`.
//! With `B = 1` or equal shards the views are the tensors themselves, transposed (no copy).
//! Uneven shards with `B > 1` would give the ranks different strides, which the kernel does
//! not take: then every tensor is copied to a dense `[S_r, B, C]` first, and every output
//! back.
use candle_core::{Shape, Tensor};
use mesa_kernels::{Epilogue, Layout, SeqParallelGroup, SeqSplits, TensorMut, TensorRef};

use crate::bridge::{dispatch_float, kernel_device, KernelFloat, Output, View};
use crate::error::{Error, Fault, KernelResult};

/// Which collective a call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// `[B, S_r, C]` → `[B, S, C]`.
    AllGather,
    /// `[B, S, C]` partial sums (+ bias `[C]`, + residual `[B, S_r, C]`) → `[B, S_r, C]`.
    ReduceScatter { bias: bool, residual: bool },
    /// Any shape, summed over ranks, the same result on every rank.
    AllReduce,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather_seq",
            Op::ReduceScatter { .. } => "reduce_scatter_seq",
            Op::AllReduce => "all_reduce_sum",
        }
    }
}

/// One rank's arguments of a call.
pub(crate) struct Post {
    /// The rank's call index (its `k`-th collective).
    pub call: u64,
    pub op: Op,
    /// The split sizes the rank passed.
    pub splits: Vec<usize>,
    /// Input, then bias and residual when present (detached).
    pub tensors: Vec<Tensor>,
}

/// The kernel's state: its flag buffers on the ranks' device.
pub(crate) struct Kernels {
    location: candle_core::DeviceLocation,
    group: SeqParallelGroup,
}

fn mismatch(op: Op, why: String) -> Error {
    Error::Collective { op: op.name(), fault: Fault::Mismatch, why }
}

/// Checks that every rank posted the same call, runs it, and returns every rank's output
/// (in rank order).
pub(crate) fn run(kernels: &mut Option<Kernels>, world: usize, posts: Vec<Post>) -> Result<Vec<Tensor>, Error> {
    let first = &posts[0];
    let op = first.op;
    for (r, p) in posts.iter().enumerate() {
        if p.call != first.call || p.op != op {
            return Err(mismatch(
                op,
                format!(
                    "ranks are out of step: rank 0 made its call #{} ({:?}), rank {r} its call #{} ({:?})",
                    first.call, first.op, p.call, p.op
                ),
            ));
        }
        if p.op != Op::AllReduce {
            if p.splits.len() != world {
                return Err(mismatch(
                    op,
                    format!(
                        "rank {r} splits the sequence over {} ranks ({:?}); the group has {world}",
                        p.splits.len(),
                        p.splits
                    ),
                ));
            }
            if p.splits != first.splits {
                return Err(mismatch(
                    op,
                    format!("shard lengths disagree: rank 0 has {:?}, rank {r} has {:?}", first.splits, p.splits),
                ));
            }
        }
    }
    let t0 = &first.tensors[0];
    let names = |i: usize| match (op, i) {
        (_, 0) => "input",
        (Op::ReduceScatter { bias: true, .. }, 1) => "bias",
        _ => "residual",
    };
    for (r, p) in posts.iter().enumerate() {
        for (i, t) in p.tensors.iter().enumerate() {
            if t.dtype() != t0.dtype() {
                return Err(mismatch(
                    op,
                    format!(
                        "one dtype for all: rank {r}'s {} is {:?}, rank 0's input {:?}",
                        names(i),
                        t.dtype(),
                        t0.dtype()
                    ),
                ));
            }
            if !t.device().same_device(t0.device()) {
                return Err(Error::DeviceMismatch { op: op.name() });
            }
        }
    }
    let as_error = |e: candle_core::Error| match crate::error::as_mesa_error(&e) {
        Some(m) => m.clone(),
        None => mismatch(op, e.to_string()),
    };
    let device = kernel_device(t0.device()).map_err(as_error)?;
    let location = t0.device().location();
    if kernels.as_ref().is_none_or(|k| k.location != location) {
        *kernels = Some(Kernels { location, group: SeqParallelGroup::new(&device, world)? });
    }
    let group = &mut kernels.as_mut().ok_or(Error::StateConsumed { op: op.name() })?.group;
    let run = |group: &mut SeqParallelGroup| -> candle_core::Result<Vec<Tensor>> {
        dispatch_float!(t0.dtype(), op.name(), T => match op {
            Op::AllReduce => all_reduce::<T>(group, &device, &posts),
            _ => seq_collective::<T>(group, &device, &posts, op),
        })
    };
    run(group).map_err(as_error)
}

/// `[B, S_r, C]` of a rank's tensor for this op, checked.
fn dims(
    op: Op,
    r: usize,
    what: &str,
    t: &Tensor,
    rows: usize,
    bc: Option<(usize, usize)>,
) -> candle_core::Result<(usize, usize)> {
    let d = t.dims();
    let ok = d.len() == 3 && d[1] == rows && bc.is_none_or(|(b, c)| d[0] == b && d[2] == c);
    if !ok {
        let (b, c) = bc.unwrap_or((d.first().copied().unwrap_or(0), d.last().copied().unwrap_or(0)));
        return Err(
            mismatch(op, format!("rank {r}'s {what}: expected [B, S, C] = {:?}, got {d:?}", [b, rows, c])).into()
        );
    }
    Ok((d[0], d[2]))
}

/// All-gather or reduce-scatter along axis 1 of `[B, S_r, C]` tensors.
fn seq_collective<T: KernelFloat>(
    group: &mut SeqParallelGroup,
    device: &mesa_kernels::Device,
    posts: &[Post],
    op: Op,
) -> candle_core::Result<Vec<Tensor>> {
    let sizes = &posts[0].splits;
    let splits = SeqSplits::new(sizes).k()?;
    let seq = splits.total();
    let gather = op == Op::AllGather;
    let in_rows = |r: usize| if gather { sizes[r] } else { seq };
    let out_rows = |r: usize| if gather { seq } else { sizes[r] };
    let (b, c) = dims(op, 0, "input", &posts[0].tensors[0], in_rows(0), None)?;
    let (has_bias, has_residual) = match op {
        Op::ReduceScatter { bias, residual } => (bias, residual),
        _ => (false, false),
    };
    for (r, p) in posts.iter().enumerate() {
        dims(op, r, "input", &p.tensors[0], in_rows(r), Some((b, c)))?;
        if has_bias && p.tensors[1].dims() != [c] {
            return Err(mismatch(op, format!("rank {r}'s bias: expected [{c}], got {:?}", p.tensors[1].dims())).into());
        }
        if has_residual {
            dims(op, r, "residual", &p.tensors[1 + usize::from(has_bias)], sizes[r], Some((b, c)))?;
        }
    }
    // [S_r, B, C] views: transposed tensors, or dense copies when their strides would differ
    let dense = b > 1 && sizes.iter().any(|&s| s != sizes[0]);
    let seq_first = |t: &Tensor| -> candle_core::Result<Tensor> {
        let t = t.transpose(0, 1)?;
        if dense {
            t.contiguous()
        } else {
            Ok(t)
        }
    };
    let inputs: Vec<Tensor> = posts.iter().map(|p| seq_first(&p.tensors[0])).collect::<candle_core::Result<_>>()?;
    let residuals: Vec<Tensor> = if has_residual {
        posts.iter().map(|p| seq_first(&p.tensors[1 + usize::from(has_bias)])).collect::<candle_core::Result<_>>()?
    } else {
        Vec::new()
    };
    let biases: Vec<Tensor> = if has_bias { posts.iter().map(|p| p.tensors[1].clone()).collect() } else { Vec::new() };
    let candle_dev = posts[0].tensors[0].device().clone();
    // outputs: [B, S_out, C] (viewed transposed) or dense [S_out, B, C]
    let out_shape = |r: usize| if dense { Shape::from((out_rows(r), b, c)) } else { Shape::from((b, out_rows(r), c)) };
    let mut outs: Vec<Output<T>> = (0..posts.len())
        .map(|r| Output::<T>::zeros(&candle_dev, device, &out_shape(r)))
        .collect::<candle_core::Result<_>>()?;
    {
        let in_views = inputs.iter().map(View::of).collect::<candle_core::Result<Vec<_>>>()?;
        let in_refs =
            in_views.iter().map(View::tensor_ref::<T>).collect::<candle_core::Result<Vec<TensorRef<'_, T>>>>()?;
        let res_views = residuals.iter().map(View::of).collect::<candle_core::Result<Vec<_>>>()?;
        let res_refs =
            res_views.iter().map(View::tensor_ref::<T>).collect::<candle_core::Result<Vec<TensorRef<'_, T>>>>()?;
        let bias_views = biases.iter().map(View::of).collect::<candle_core::Result<Vec<_>>>()?;
        let bias_refs =
            bias_views.iter().map(View::tensor_ref::<T>).collect::<candle_core::Result<Vec<TensorRef<'_, T>>>>()?;
        let mut out_refs: Vec<TensorMut<'_, T>> = outs
            .iter_mut()
            .enumerate()
            .map(|(r, o)| {
                let layout = if dense {
                    Layout::contiguous(&[out_rows(r), b, c])
                } else {
                    Layout::contiguous(&[b, out_rows(r), c]).transpose(0, 1).k()?
                };
                o.tensor_mut_as(&layout)
            })
            .collect::<candle_core::Result<_>>()?;
        if gather {
            group.all_gather_seq(&in_refs, &mut out_refs, &splits).k()?;
        } else {
            let epilogue = Epilogue {
                bias: has_bias.then_some(bias_refs.as_slice()),
                residual: has_residual.then_some(res_refs.as_slice()),
            };
            group.reduce_scatter_seq(&in_refs, &mut out_refs, &splits, &epilogue).k()?;
        }
    }
    outs.into_iter()
        .map(|o| {
            let t = o.into_tensor()?;
            if dense {
                t.transpose(0, 1)?.contiguous()
            } else {
                Ok(t)
            }
        })
        .collect()
}

/// Sum over ranks of same-shape tensors, identical on every rank: a reduce-scatter of the
/// flattened `[1, n, 1]` tensors into even shards, then an all-gather of the shards.
fn all_reduce<T: KernelFloat>(
    group: &mut SeqParallelGroup,
    device: &mesa_kernels::Device,
    posts: &[Post],
) -> candle_core::Result<Vec<Tensor>> {
    let shape = posts[0].tensors[0].shape().clone();
    for (r, p) in posts.iter().enumerate() {
        if p.tensors[0].shape() != &shape {
            return Err(mismatch(
                Op::AllReduce,
                format!("rank {r}'s tensor is {:?}, rank 0's {:?}", p.tensors[0].dims(), shape.dims()),
            )
            .into());
        }
    }
    let n = shape.elem_count();
    let world = posts.len();
    let sizes: Vec<usize> = (0..world).map(|r| n / world + usize::from(r < n % world)).collect();
    let flat = |t: &Tensor| t.flatten_all()?.reshape((1, n, 1));
    let scatter_posts: Vec<Post> = posts
        .iter()
        .map(|p| {
            Ok(Post {
                call: p.call,
                op: Op::ReduceScatter { bias: false, residual: false },
                splits: sizes.clone(),
                tensors: vec![flat(&p.tensors[0])?],
            })
        })
        .collect::<candle_core::Result<_>>()?;
    let shards = seq_collective::<T>(group, device, &scatter_posts, scatter_posts[0].op)?;
    let gather_posts: Vec<Post> = shards
        .into_iter()
        .zip(posts)
        .map(|(s, p)| Post { call: p.call, op: Op::AllGather, splits: sizes.clone(), tensors: vec![s] })
        .collect();
    seq_collective::<T>(group, device, &gather_posts, Op::AllGather)?
        .into_iter()
        .map(|t| t.reshape(shape.clone()))
        .collect()
}
