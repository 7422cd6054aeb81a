//! Ranks of one tensor-parallel group as threads of one process: a host rendezvous per
//! collective call, whose last arrival runs the intra-node kernel for every rank.
//!
//! Each call of a [`Rank`] posts its tensors and waits. When all `W` ranks have posted the
//! same call (their `k`-th collective), the last one checks that they agree — the same op,
//! the same split sizes, `W` of them, one dtype and device, fitting shapes — and runs the
//! kernel over all ranks' tensors at once ([`super::exec`]); every rank then takes its own
//! output. A disagreement is reported to every rank as the same [`Error::Collective`]
//! ([`Fault::Mismatch`]). A rank that does not arrive within the group's timeout makes every
//! waiting rank return [`Fault::Timeout`], naming the missing ranks; a rank that hit an error of
//! its own calls [`Rank::fail`] (or runs under [`run_ranks`], which does) and every rank
//! waiting, or arriving later, returns [`Fault::PeerFailed`] at once. Faults are sticky: the
//! group refuses every later call (an NCCL communicator is likewise aborted, not repaired).
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::exec::{self, Op, Post};
use super::Collectives;
use crate::error::{Error, Fault};

/// The group's shared state: the pending call and its results.
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Collective calls made so far, per rank (the index of its next call).
    calls: Vec<u64>,
    /// What each rank posted for the pending call.
    posts: Vec<Option<Post>>,
    /// Each rank's outcome of its last completed call, with that call's index.
    results: Vec<Option<(u64, Result<Tensor, Error>)>>,
    /// The first fault: every later call returns it.
    failed: Option<Error>,
    /// The intra-node kernel's flag buffers, made on first use on the ranks' device.
    kernels: Option<exec::Kernels>,
}

/// One rank of a thread group ([`thread_group`]): rank `r` of `W`, to be used by one thread.
/// Clones share the rank (and its call count).
#[derive(Clone)]
pub struct Rank {
    rank: usize,
    shared: Arc<Shared>,
}

impl fmt::Debug for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rank")
            .field("rank", &self.rank)
            .field("world", &self.shared.world)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

/// `world` ranks that meet in every collective, each to be moved to its own thread; every
/// wait is bounded by `timeout`. Their tensors must live on one candle device (the host
/// emulation, or one CUDA device whose stream all ranks share).
///
/// # Errors
/// [`Error::InvalidArgument`] for `world` outside `1..=16` (the intra-node kernel's
/// `MAX_RANKS`) or a zero timeout.
pub fn thread_group(world: usize, timeout: Duration) -> Result<Vec<Rank>, Error> {
    if world == 0 || world > mesa_kernels::collectives::MAX_RANKS {
        return Err(Error::InvalidArgument {
            name: "world",
            why: format!("{world} ranks is outside 1..={}", mesa_kernels::collectives::MAX_RANKS),
        });
    }
    if timeout.is_zero() {
        return Err(Error::InvalidArgument { name: "timeout", why: "must be longer than zero".into() });
    }
    let shared = Arc::new(Shared {
        world,
        timeout,
        state: Mutex::new(State {
            calls: vec![0; world],
            posts: (0..world).map(|_| None).collect(),
            results: (0..world).map(|_| None).collect(),
            failed: None,
            kernels: None,
        }),
        changed: Condvar::new(),
    });
    Ok((0..world).map(|rank| Rank { rank, shared: Arc::clone(&shared) }).collect())
}

/// Runs `f(rank)` for every rank on its own scoped thread and returns the outcomes in rank
/// order. A rank whose `f` returns an error, or panics, calls [`Rank::fail`] first, so that
/// its peers stop waiting for it ([`Fault::PeerFailed`]); a panic is returned as that error.
pub fn run_ranks<R, F>(ranks: Vec<Rank>, f: F) -> Vec<candle_core::Result<R>>
where
    R: Send,
    F: Fn(Rank) -> candle_core::Result<R> + Sync,
{
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let f = &f;
                scope.spawn(move || {
                    let guard = rank.clone();
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank)));
                    match out {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => {
                            guard.fail(&e.to_string());
                            Err(e)
                        }
                        Err(panic) => {
                            let why = panic
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                                .unwrap_or_else(|| "panicked".into());
                            guard.fail(&format!("panicked: {why}"));
                            Err(Error::Collective {
                                op: "run_ranks",
                                fault: Fault::PeerFailed { rank: guard.rank },
                                why: format!("rank {} panicked: {why}", guard.rank),
                            }
                            .into())
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::InvalidArgument { name: "run_ranks", why: "a rank's thread could not be joined".into() }
                        .into())
                })
            })
            .collect()
    })
}

impl Rank {
    fn lock(&self) -> MutexGuard<'_, State> {
        // a panic while holding the lock leaves whole values only (every update is one
        // assignment); keep going and let the sticky fault speak
        self.shared.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The group's timeout (every wait of a call is bounded by it).
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// One collective call: post, wait for the others (or be the last and run it), return
    /// this rank's output.
    fn call(&self, op: Op, splits: &[usize], tensors: Vec<Tensor>) -> Result<Tensor, Error> {
        let r = self.rank;
        let mut st = self.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let call = st.calls[r];
        st.calls[r] += 1;
        st.posts[r] = Some(Post { call, op, splits: splits.to_vec(), tensors });
        if st.posts.iter().all(Option::is_some) {
            let posts: Vec<Post> = st.posts.iter_mut().filter_map(Option::take).collect();
            let outcome = exec::run(&mut st.kernels, self.shared.world, posts);
            match outcome {
                Ok(outs) => {
                    for (p, out) in outs.into_iter().enumerate() {
                        st.results[p] = Some((call, Ok(out)));
                    }
                }
                Err(e) => {
                    // ranks that disagree are out of step: nothing later can be trusted
                    st.failed = Some(e.clone());
                    for slot in &mut st.results {
                        *slot = Some((call, Err(e.clone())));
                    }
                }
            }
            self.shared.changed.notify_all();
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some((c, res)) = st.results[r].take() {
                if c == call {
                    return res;
                }
            }
            if let Some(e) = st.failed.clone() {
                st.posts[r] = None;
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.shared.world).filter(|&p| st.posts[p].is_none()).collect();
                let e = Error::Collective {
                    op: op.name(),
                    fault: Fault::Timeout,
                    why: format!(
                        "rank {r} waited {:?} at its collective call #{call}; ranks {missing:?} never arrived",
                        self.shared.timeout
                    ),
                };
                st.failed = Some(e.clone());
                st.posts[r] = None;
                self.shared.changed.notify_all();
                return Err(e);
            }
            st = self.shared.changed.wait_timeout(st, deadline - now).map_or_else(|p| p.into_inner().0, |(g, _)| g);
        }
    }
}

impl Collectives for Rank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather_seq(&self, shard: &Tensor, splits: &[usize]) -> Result<Tensor, Error> {
        self.call(Op::AllGather, splits, vec![shard.detach()])
    }

    fn reduce_scatter_seq(
        &self,
        partial: &Tensor,
        splits: &[usize],
        bias: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor, Error> {
        let mut tensors = vec![partial.detach()];
        tensors.extend(bias.map(Tensor::detach));
        tensors.extend(residual.map(Tensor::detach));
        self.call(Op::ReduceScatter { bias: bias.is_some(), residual: residual.is_some() }, splits, tensors)
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor, Error> {
        self.call(Op::AllReduce, &[], vec![x.detach()])
    }

    fn fail(&self, why: &str) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(Error::Collective {
                op: "tensor-parallel group",
                fault: Fault::PeerFailed { rank: self.rank },
                why: format!("rank {} failed: {why}", self.rank),
            });
        }
        self.shared.changed.notify_all();
    }
}
