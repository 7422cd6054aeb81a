//! Ranks as threads (`parallel::thread_group`): the collectives against host sums, the
//! conjugate operators' gradients against one process on the whole sequence, and every fault
//! a group must report on all ranks (docs/sequence_parallel.md).
use super::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use mesa_candle::parallel::{run_ranks, thread_group, Collectives, Rank, SeqParallel};
use mesa_candle::{as_mesa_error, Error, Fault};

fn rand(rng: &mut common::Rng, shape: &[usize]) -> Vec<f32> {
    (0..shape.iter().product::<usize>()).map(|_| (rng.uniform() * 2.0 - 1.0) as f32).collect()
}

fn fault_of(e: &candle_core::Error) -> Option<Fault> {
    match as_mesa_error(e) {
        Some(Error::Collective { fault, .. }) => Some(*fault),
        _ => None,
    }
}

/// Rows `o..o+len` of axis 1 of a `[B, S, C]` host array.
fn rows(x: &[f32], (b, s, c): (usize, usize, usize), o: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(b * len * c);
    for bi in 0..b {
        out.extend_from_slice(&x[(bi * s + o) * c..(bi * s + o + len) * c]);
    }
    out
}

/// All-gather returns every shard bit for bit; reduce-scatter with bias and residual returns
/// `((Σ_p partial_p) + bias) + residual` summed in f32 in rank order — bitwise, as the kernel's
/// contract says — for even and uneven shards (uneven with B > 1 takes the dense copy path).
#[test]
fn collectives_match_host_sums_bitwise() {
    let mut rng = common::Rng::new(module_path!());
    for (world, splits) in [(2, vec![3, 3]), (2, vec![4, 1]), (4, vec![2, 2, 2, 2]), (4, vec![3, 0, 2, 1])] {
        let (b, c) = (2, 8);
        let s: usize = splits.iter().sum();
        let x = rand(&mut rng, &[b, s, c]);
        let partials: Vec<Vec<f32>> = (0..world).map(|_| rand(&mut rng, &[b, s, c])).collect();
        let bias = rand(&mut rng, &[c]);
        let residual = rand(&mut rng, &[b, s, c]);
        let offsets: Vec<usize> = (0..world).map(|r| splits[..r].iter().sum()).collect();
        let ranks = thread_group(world, Duration::from_secs(20)).unwrap();
        let out = run_ranks(ranks, |rank: Rank| {
            let r = rank.rank();
            let shard = Tensor::from_vec(rows(&x, (b, s, c), offsets[r], splits[r]), (b, splits[r], c), &Device::Cpu)?;
            let full = rank.all_gather_seq(&shard, &splits)?;
            let part = Tensor::from_vec(partials[r].clone(), (b, s, c), &Device::Cpu)?;
            let bias = Tensor::from_vec(bias.clone(), c, &Device::Cpu)?;
            let res =
                Tensor::from_vec(rows(&residual, (b, s, c), offsets[r], splits[r]), (b, splits[r], c), &Device::Cpu)?;
            let y = rank.reduce_scatter_seq(&part, &splits, Some(&bias), Some(&res))?;
            Ok((full.flatten_all()?.to_vec1::<f32>()?, y.flatten_all()?.to_vec1::<f32>()?))
        });
        for (r, o) in out.into_iter().enumerate() {
            let (full, y) = o.unwrap();
            assert_eq!(full, x, "all-gather, rank {r}, splits {splits:?}");
            let (o, len) = (offsets[r], splits[r]);
            let mut want = Vec::new();
            for bi in 0..b {
                for si in o..o + len {
                    for (ci, &bias_c) in bias.iter().enumerate() {
                        let i = (bi * s + si) * c + ci;
                        let mut acc = 0f32;
                        for p in &partials {
                            acc += p[i];
                        }
                        want.push((acc + bias_c) + residual[i]);
                    }
                }
            }
            assert_eq!(y, want, "reduce-scatter, rank {r}, splits {splits:?}");
        }
    }
}

/// `y_r = ḡ(g(LN-free x_r)·W_r, b, x_r)` on each rank against one process on the whole
/// sequence, `y = x·Σ_r W_r + b + x`, forward and gradients (x, every W_r, b, the replicated
/// scale `γ`), in f64 on the host. Error bound: each value is a sum of at most `t·C + 2`
/// products of O(1) terms, rounded in f32 (`2⁻²⁴` per operation): `1e-5·(1 + |ref|)` is about
/// 4× the worst case `(t·C + 2)·2⁻²⁴·Σ|terms|` for these sizes.
#[test]
fn conjugate_operators_give_the_unsharded_gradients() {
    let mut rng = common::Rng::new(module_path!());
    for world in [1usize, 2, 4] {
        let (b, s, c) = (2, 8, 4);
        let x = rand(&mut rng, &[b, s, c]);
        let ws: Vec<Vec<f32>> = (0..world).map(|_| rand(&mut rng, &[c, c])).collect();
        let bias = rand(&mut rng, &[c]);
        let gamma = rand(&mut rng, &[c]);
        let coef = rand(&mut rng, &[b, s, c]);
        // reference: f64, one process
        let dev = Device::Cpu;
        let xr = Var::from_vec(x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), (b, s, c), &dev).unwrap();
        let wr: Vec<Var> = ws
            .iter()
            .map(|w| Var::from_vec(w.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), (c, c), &dev).unwrap())
            .collect();
        let br = Var::from_vec(bias.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), c, &dev).unwrap();
        let gr = Var::from_vec(gamma.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), c, &dev).unwrap();
        let cr = Tensor::from_vec(coef.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), (b, s, c), &dev).unwrap();
        let h = xr.as_tensor().broadcast_mul(gr.as_tensor()).unwrap();
        let mut y = (xr.as_tensor() + br.as_tensor().broadcast_as((b, s, c)).unwrap()).unwrap();
        for w in &wr {
            y = (y + h.broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap()).unwrap();
        }
        let loss = (&y * &cr).unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let (dx, db, dg) = (
            host(g.get(xr.as_tensor()).unwrap()),
            host(g.get(br.as_tensor()).unwrap()),
            host(g.get(gr.as_tensor()).unwrap()),
        );
        let dws: Vec<Vec<f64>> = wr.iter().map(|w| host(g.get(w.as_tensor()).unwrap())).collect();
        let y_ref = host(&y);

        let splits = mesa_kernels::SeqSplits::even(s, world).unwrap().sizes();
        let offsets: Vec<usize> = (0..world).map(|r| splits[..r].iter().sum()).collect();
        let ranks = thread_group(world, Duration::from_secs(20)).unwrap();
        let outs = run_ranks(ranks, |rank: Rank| {
            let r = rank.rank();
            let sp = SeqParallel::even(Arc::new(rank), s).map_err(candle_core::Error::from)?;
            let (o, len) = sp.shard();
            let xs = Var::from_vec(rows(&x, (b, s, c), o, len), (b, len, c), &dev)?;
            let w = Var::from_vec(ws[r].clone(), (c, c), &dev)?;
            let bv = Var::from_vec(bias.clone(), c, &dev)?;
            let gv = Var::from_vec(gamma.clone(), c, &dev)?;
            let h = xs.as_tensor().broadcast_mul(&sp.replicated(gv.as_tensor())?)?;
            let full = sp.gather(&h)?;
            let partial = full.broadcast_matmul(&w.as_tensor().t()?)?;
            let y = sp.scatter(&partial, bv.as_tensor(), Some(xs.as_tensor()))?;
            let cs = Tensor::from_vec(rows(&coef, (b, s, c), o, len), (b, len, c), &dev)?;
            let grads = (&y * &cs)?.sum_all()?.backward()?;
            let v = |t: &Tensor| -> candle_core::Result<Vec<f32>> { t.flatten_all()?.to_vec1::<f32>() };
            Ok((
                v(&y)?,
                v(grads.get(xs.as_tensor()).expect("dx"))?,
                v(grads.get(w.as_tensor()).expect("dw"))?,
                v(grads.get(bv.as_tensor()).expect("db"))?,
                v(grads.get(gv.as_tensor()).expect("dgamma"))?,
            ))
        });
        let close = |got: &[f32], want: &[f64], what: &str| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                assert!((f64::from(g) - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w} (t = {world})");
            }
        };
        for (r, o) in outs.into_iter().enumerate() {
            let (y, dxs, dw, dbias, dgamma) = o.unwrap();
            let (off, len) = (offsets[r], splits[r]);
            let pick = |v: &[f64]| -> Vec<f64> {
                let mut out = Vec::new();
                for bi in 0..b {
                    out.extend_from_slice(&v[(bi * s + off) * c..(bi * s + off + len) * c]);
                }
                out
            };
            close(&y, &pick(&y_ref), "y");
            close(&dxs, &pick(&dx), "dx");
            close(&dw, &dws[r], "dW_r");
            close(&dbias, &db, "db (complete on every rank)");
            close(&dgamma, &dg, "dγ (summed over ranks)");
        }
    }
}

/// Runs `f` on a 2- or 4-rank group with a short timeout; returns each rank's outcome and
/// the wall time.
fn faulty<F>(world: usize, timeout: Duration, f: F) -> (Vec<candle_core::Result<()>>, Duration)
where
    F: Fn(Rank) -> candle_core::Result<()> + Sync,
{
    let ranks = thread_group(world, timeout).unwrap();
    let t0 = Instant::now();
    let out = run_ranks(ranks, f);
    (out, t0.elapsed())
}

fn shard(len: usize) -> Tensor {
    Tensor::ones((1, len, 4), candle_core::DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn shard_lengths_that_disagree_fail_on_every_rank() {
    let (out, _) = faulty(2, Duration::from_secs(20), |rank| {
        let splits = if rank.rank() == 0 { vec![4, 4] } else { vec![5, 3] };
        rank.all_gather_seq(&shard(splits[rank.rank()]), &splits)?;
        Ok(())
    });
    for (r, o) in out.iter().enumerate() {
        let e = o.as_ref().expect_err("must fail");
        assert_eq!(fault_of(e), Some(Fault::Mismatch), "rank {r}: {e}");
        assert!(e.to_string().contains("shard lengths disagree"), "rank {r}: {e}");
    }
}

#[test]
fn a_rank_count_that_disagrees_fails_on_every_rank() {
    let (out, _) = faulty(2, Duration::from_secs(20), |rank| {
        // rank 1 was configured for 4 ranks
        let splits = if rank.rank() == 0 { vec![4, 4] } else { vec![2, 2, 2, 2] };
        rank.all_gather_seq(&shard(splits[rank.rank()]), &splits)?;
        Ok(())
    });
    for (r, o) in out.iter().enumerate() {
        let e = o.as_ref().expect_err("must fail");
        assert_eq!(fault_of(e), Some(Fault::Mismatch), "rank {r}: {e}");
        assert!(e.to_string().contains("over 4 ranks"), "rank {r}: {e}");
    }
}

#[test]
fn ranks_out_of_step_fail_on_every_rank() {
    let (out, _) = faulty(2, Duration::from_secs(20), |rank| {
        if rank.rank() == 0 {
            rank.all_gather_seq(&shard(4), &[4, 4])?;
        } else {
            rank.all_reduce_sum(&shard(4))?;
        }
        Ok(())
    });
    for (r, o) in out.iter().enumerate() {
        let e = o.as_ref().expect_err("must fail");
        assert_eq!(fault_of(e), Some(Fault::Mismatch), "rank {r}: {e}");
        assert!(e.to_string().contains("out of step"), "rank {r}: {e}");
    }
}

/// Rank 1 fails between two collectives: the others return `PeerFailed` at once (well within
/// the 20 s timeout), not after it.
#[test]
fn a_rank_error_mid_step_fails_every_rank_at_once() {
    let (out, elapsed) = faulty(4, Duration::from_secs(20), |rank| {
        rank.all_gather_seq(&shard(2), &[2, 2, 2, 2])?;
        if rank.rank() == 1 {
            return Err(Error::InvalidArgument { name: "test", why: "rank 1's own error".into() }.into());
        }
        rank.all_gather_seq(&shard(2), &[2, 2, 2, 2])?;
        Ok(())
    });
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(out[1].as_ref().unwrap_err().to_string().contains("rank 1's own error"));
    for r in [0, 2, 3] {
        let e = out[r].as_ref().expect_err("must fail");
        assert_eq!(fault_of(e), Some(Fault::PeerFailed { rank: 1 }), "rank {r}: {e}");
    }
}

/// Rank 2 never calls: every other rank returns `Timeout` naming it, after the timeout and
/// not much later; the group then refuses further calls.
#[test]
fn a_rank_that_never_arrives_times_out_on_every_rank() {
    let timeout = Duration::from_millis(300);
    let (out, elapsed) = faulty(4, timeout, |rank| {
        if rank.rank() == 2 {
            return Ok(());
        }
        rank.all_gather_seq(&shard(2), &[2, 2, 2, 2])?;
        Ok(())
    });
    assert!(elapsed >= timeout && elapsed < timeout * 10, "took {elapsed:?}");
    assert!(out[2].is_ok());
    for r in [0, 1, 3] {
        let e = out[r].as_ref().expect_err("must fail");
        assert_eq!(fault_of(e), Some(Fault::Timeout), "rank {r}: {e}");
        assert!(e.to_string().contains("[2]"), "rank {r}: {e}");
    }
}

/// The all-reduce is the rank-order f32 sum, identical on every rank.
#[test]
fn all_reduce_is_the_rank_order_sum_on_every_rank() {
    let mut rng = common::Rng::new(module_path!());
    let world = 4;
    let xs: Vec<Vec<f32>> = (0..world).map(|_| rand(&mut rng, &[3, 7])).collect();
    let ranks = thread_group(world, Duration::from_secs(20)).unwrap();
    let out = run_ranks(ranks, |rank: Rank| {
        let x = Tensor::from_vec(xs[rank.rank()].clone(), (3, 7), &Device::Cpu)?;
        rank.all_reduce_sum(&x)?.flatten_all()?.to_vec1::<f32>()
    });
    let want: Vec<f32> = (0..21).map(|i| xs.iter().fold(0f32, |acc, x| acc + x[i])).collect();
    for o in out {
        assert_eq!(o.unwrap(), want);
    }
}

/// A rank that panics between two collectives: `run_ranks` reports the panic as that rank's
/// error and its peers return `PeerFailed` at once, not after the timeout.
#[test]
fn a_rank_that_panics_fails_every_rank_at_once() {
    let (out, elapsed) = faulty(2, Duration::from_secs(20), |rank| {
        rank.all_gather_seq(&shard(2), &[2, 2])?;
        assert!(rank.rank() != 1, "rank 1 breaks on purpose");
        rank.all_gather_seq(&shard(2), &[2, 2])?;
        Ok(())
    });
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(out[1].as_ref().unwrap_err().to_string().contains("rank 1 breaks on purpose"));
    assert_eq!(fault_of(out[0].as_ref().unwrap_err()), Some(Fault::PeerFailed { rank: 1 }));
}
