//! Causal linear attention across sequence shards (LASP: Sun et al. 2024, *Linear Attention
//! Sequence Parallelism*), as one candle op per rank with exact gradients.
//!
//! Rank `r` holds rows `o_r .. o_r + L_r` of the sequence: `q, k: [B, H, L_r, d]`,
//! `v: [B, H, L_r, D]`. Causal linear attention only needs, from the rows before the shard,
//! their state `S₀ = Σ_{s<o_r} φ(k_s) [v_s | 1]ᵀ` (`[B, H, M, W]` f32, `W = D + normalize`;
//! `mesa_kernels::linear_attention::state`), which the kernels take as an initial state:
//!
//! ```text
//! forward   all-gather every rank's B, H, d, D, M, W and dtype    (7 values: ranks that disagree fail here, on every rank)
//!           L_r  = Σ_{s ∈ shard r} φ(k_s) [v_s | 1]ᵀ          (the shard's own sum, one matmul)
//!           all-gather L_0 … L_{W−1}                              (B·H·M·W·4 bytes per rank)
//!           S0_r = (((0 + L_0) + L_1) + …) + L_{r−1}               (f32, rank order)
//!           out  = forward_with_state(φ(q), φ(k), v, initial = S0_r)
//! backward  dφq, dφk, dv, G_r = backward_with_state(d_final = 0)   (G_r = Σ_t φ(q_t) dO'_tᵀ, the gradient of S0_r)
//!           all-gather G_0 … G_{W−1}
//!           D_r  = (((0 + G_{W−1}) + G_{W−2}) + …) + G_{r+1}      (the gradient of the shard's final state)
//!           dφk += [v | 1] D_rᵀ,   dv += φ(k) D_r[:, :D]             (two matmuls)
//!           dq, dk = the feature map's backward
//! ```
//!
//! `D_r` is the final state's gradient because that state reaches every later row only
//! through the later shards' initial states: `D_r = Σ_{p>r} ∂loss/∂S0_p = Σ_{p>r} G_p`
//! (`S0_p` enters the kernel additively, so its gradient does not depend on its value).
//!
//! **Why an all-gather and not a ring.** A ring (rank `r` starts from rank `r−1`'s
//! `final_state_tensor`) sends `B·H·M·W·4` bytes per hop, but its `W−1` hops are serial and
//! each waits for the previous rank's whole forward: the ranks' attention runs one after the
//! other, `W` times the time of one shard. The all-gather moves `(W−1)·B·H·M·W·4` bytes into
//! every rank (a state is small: `M·W` per head, independent of `L`) in one collective that
//! waits for no attention, and every rank then runs its shard at once; the prefix costs
//! `(r + W)·B·H·M·W` additions. The same holds in the backward. `docs/sequence_parallel.md`,
//! "Linear attention across sequence shards (LASP)".
//!
//! **Exactness.** The gradients are those of one rank on the whole sequence up to rounding
//! (f32 sums in another order: the local sums are matmuls from zero, then the prefix over
//! ranks). Bitwise: the gathered sums are identical on every rank and the prefix and suffix
//! are added in fixed rank order, so every rank derives the same `S0_p` and `D_p` for every
//! `p` ([`ShardStates`]), and the results do not depend on the ranks' timing; with one rank
//! the op is bitwise the unsharded [`LinearAttention`]. It is not bitwise the unsharded op
//! for `W > 1` (that would take the serial ring: a hand-off of `final_state_tensor` at a
//! chunk boundary is bitwise one call, `tests/parallel/lasp.rs`).
//!
//! Every rank must run the backward through its output (a zero gradient is fine): the
//! backward meets the other ranks in a collective, as the forward does.
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use mesa_kernels::linear_attention::LinearAttentionSaved;

use super::Collectives;
use crate::attach::{attach, Backward};
use crate::bridge::common_device;
use crate::error::Error;
use crate::ops::{check_dtypes, check_rank, tensor_result, LinearAttention};

/// Causal linear attention on this rank's shard of a sequence split over `comm`'s ranks
/// (module docs): the outputs and gradients of [`LinearAttention`] on the whole sequence.
#[derive(Debug, Clone)]
pub struct ShardedLinearAttention {
    op: LinearAttention,
    comm: Arc<dyn Collectives>,
}

/// The states of one rank's forward ([`ShardedLinearAttention::forward_with_states`]): f32
/// `[B, H, M, W]` tensors outside any graph (column `D` the normaliser's `z` when normalised).
#[derive(Debug, Clone)]
pub struct ShardStates {
    /// `L_r`: this shard's own sum `Σ_s φ(k_s) [v_s | 1]ᵀ`.
    pub local: Tensor,
    /// `S0_r = Σ_{p<r} L_p` (rank order): the state the shard started from.
    pub initial: Tensor,
    /// `Σ_p L_p` (rank order): the whole sequence's final state, identical on every rank
    /// (e.g. the initial state of the sequence's continuation).
    pub total: Tensor,
}

impl ShardedLinearAttention {
    /// `op`'s attention (configuration and feature map) on shards over `comm`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `op` is bidirectional (a shard would need the rows
    /// after it too: causal only).
    pub fn new(op: LinearAttention, comm: Arc<dyn Collectives>) -> Result<Self, Error> {
        if !op.config().causal {
            return Err(Error::InvalidArgument {
                name: "config",
                why: "linear attention across sequence shards is causal only (bidirectional attention is not split)"
                    .into(),
            });
        }
        Ok(ShardedLinearAttention { op, comm })
    }

    /// The attention op.
    #[must_use]
    pub fn op(&self) -> &LinearAttention {
        &self.op
    }

    /// The group.
    #[must_use]
    pub fn comm(&self) -> &Arc<dyn Collectives> {
        &self.comm
    }

    /// This rank's shard `q, k: [B, H, L_r, d]`, `v: [B, H, L_r, D]` → its output
    /// `[B, H, L_r, D]`. Shards may have any lengths (0 included); `B`, `H`, `d`, `D` must
    /// agree on every rank. Dtypes as [`LinearAttention`] (all computed in f32, 16-bit
    /// results rounded once: bitwise the f32 op's results, rounded; for 16-bit inputs the op
    /// keeps `S0_r`, `B·H·M·W` f32, instead of the attention's states, and the backward reruns
    /// the shard's f32 attention from it). Two collective calls in the forward (the ranks'
    /// dims, then their states) and one in the backward.
    ///
    /// # Errors
    /// [`Error::Rank`], [`Error::Shape`] (this rank's tensors disagree; or, on every rank,
    /// the ranks disagree on `B, H, d, D` — the message names each rank's values — or on the
    /// states' `M, W`: another feature map or normalisation), [`Error::DTypeMismatch`] (this
    /// rank's tensors, or on every rank the ranks' dtypes, differ), [`Error::UnsupportedDType`],
    /// [`Error::DeviceMismatch`], the collectives' [`Error::Collective`], the kernels'
    /// errors as [`Error::Kernel`].
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with_states(q, k, v)?.0)
    }

    /// [`ShardedLinearAttention::forward`], also returning the states it combined.
    ///
    /// # Errors
    /// As [`ShardedLinearAttention::forward`].
    pub fn forward_with_states(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, ShardStates)> {
        // an error of this rank's own must not leave its peers waiting for it
        super::tell_peers(self.comm.as_ref(), self.forward_inner(q, k, v))
    }

    fn forward_inner(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<(Tensor, ShardStates)> {
        check_dtypes(
            "sharded linear attention",
            &[(q, "queries [B, H, L_r, d]"), (k, "keys [B, H, L_r, d]"), (v, "values [B, H, L_r, D]")],
        )?;
        let dtype = q.dtype();
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {}
            DType::F64 => {
                // computed in f32 inside candle's graph, as the per-rank ops do (`crate::ops`)
                let f = |t: &Tensor| if t.dtype() == DType::F64 { t.to_dtype(DType::F32) } else { Ok(t.clone()) };
                let (y, states) = self.forward_inner(&f(q)?, &f(k)?, &f(v)?)?;
                return Ok((y.to_dtype(DType::F64)?, states));
            }
            other => return Err(Error::UnsupportedDType { op: "sharded linear attention", dtype: other }.into()),
        }
        check_rank("sharded linear attention queries [B, H, L_r, d]", q, 4, false)?;
        check_rank("sharded linear attention keys [B, H, L_r, d]", k, 4, false)?;
        check_rank("sharded linear attention values [B, H, L_r, D]", v, 4, false)?;
        let (b, h, l, _) = q.dims4()?;
        if k.dims() != q.dims() {
            return Err(
                Error::Shape { what: "keys".into(), expected: q.dims().to_vec(), got: k.dims().to_vec() }.into()
            );
        }
        let dv = v.dim(3)?;
        if v.dims() != [b, h, l, dv] {
            return Err(
                Error::Shape { what: "values".into(), expected: vec![b, h, l, dv], got: v.dims().to_vec() }.into()
            );
        }
        let kernels = common_device("sharded linear attention", &[q, k, v])?;
        let (qf, kf, vf) = (f32_of(q)?, f32_of(k)?, f32_of(v)?);
        let (phi_q, phi_k) = self.op.features_detached::<f32>(&kernels, &qf, &kf)?;
        let normalize = self.op.config().normalize;
        let local = local_state(&phi_k, &vf, normalize)?;
        let (_, _, m, w) = local.dims4()?;
        agree(self.comm.as_ref(), [b, h, q.dim(3)?, dv, m, w], dtype, q.device())?;
        let locals = gather_states(self.comm.as_ref(), &local)?;
        // S0_r and the total, added in rank order from zero: the same on every rank
        let r = self.comm.rank();
        let mut acc = local.zeros_like()?;
        let mut initial = acc.clone();
        for (p, lp) in locals.iter().enumerate() {
            if p == r {
                initial = acc.clone();
            }
            acc = (acc + lp)?;
        }
        let start = (r > 0).then_some(&initial);
        let (out, saved) = self.op.attention_with_state::<f32>(&kernels, &phi_q, &phi_k, &vf, start)?;
        let (op, comm) = (self.op.clone(), Arc::clone(&self.comm));
        let y = if dtype == DType::F32 {
            let grad = LaspGrad { op, comm, kept: Kept::States(Box::new(saved)), kernels };
            attach(&[q, k, v], out.into_storage()?, grad)?
        } else {
            // 16-bit: the backward reruns this f32 attention from S0_r (`Kept::Start`)
            let grad = LaspGrad { op, comm, kept: Kept::Start(start.cloned()), kernels };
            attach(&[q, k, v], tensor_result(&out.into_tensor()?.to_dtype(dtype)?)?, grad)?
        };
        Ok((y, ShardStates { local, initial, total: acc }))
    }
}

/// Values of [`agree`]'s all-gather per rank: `B, H, d, D, M, W` and the dtype's code.
const DIMS: usize = 7;

/// The dtype codes of [`agree`] (exact in f32).
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Checks, by one all-gather of [`DIMS`] values per rank, that every rank agrees with rank 0
/// on `dims` (`B, H, d, D`, then the states' `M, W`) and the input dtype, else the same error
/// on every rank naming the user's tensors. It runs before any state travels: the states'
/// sizes follow from these values, and an all-gather of different sizes would fail in the
/// collective with its own layout's words (the intra-node group's) or not at all (NCCL).
fn agree(comm: &dyn Collectives, dims: [usize; 6], dtype: DType, device: &Device) -> candle_core::Result<()> {
    // dims as f32 are exact below 2²⁴ each; f64 inputs arrive here as f32
    let code = DTYPES.iter().position(|&d| d == dtype).unwrap_or(DTYPES.len());
    let mine: Vec<f32> = dims.iter().chain([&code]).map(|&x| x as f32).collect();
    let world = comm.world_size();
    let all = comm.all_gather_seq(&Tensor::from_vec(mine, (1, 1, DIMS), device)?, &vec![1; world])?;
    let all = all.flatten_all()?.to_vec1::<f32>()?;
    let as_dims = |x: &[f32]| x.iter().map(|&v| v as usize).collect::<Vec<_>>();
    // compared with rank 0's, so that every rank reports the same error
    let first = &all[..DIMS];
    for (p, other) in all.chunks(DIMS).enumerate() {
        let (expected, got) = (as_dims(first), as_dims(other));
        let pick = |x: &[usize], i: [usize; 4]| i.map(|i| x[i]).to_vec();
        if expected[..4] != got[..4] {
            let what = format!(
                "sharded linear attention: [B, H, d, D] of rank {p}'s queries, keys [B, H, L_r, d] and values \
                 [B, H, L_r, D] (every rank's must be rank 0's)"
            );
            return Err(Error::Shape { what, expected: expected[..4].to_vec(), got: got[..4].to_vec() }.into());
        }
        if expected[4..6] != got[4..6] {
            let what = format!(
                "sharded linear attention: rank {p}'s states [B, H, M, W] (every rank's must be rank 0's: one feature \
                 map and normalisation)"
            );
            let (expected, got) = (pick(&expected, [0, 1, 4, 5]), pick(&got, [0, 1, 4, 5]));
            return Err(Error::Shape { what, expected, got }.into());
        }
        if expected[6] != got[6] {
            let dtype = |c: usize| DTYPES.get(c).copied().unwrap_or(DType::F64);
            return Err(Error::DTypeMismatch {
                op: "sharded linear attention",
                what: format!("rank {p}'s queries, keys and values"),
                of: "rank 0's".into(),
                expected: dtype(expected[6]),
                got: dtype(got[6]),
            }
            .into());
        }
    }
    Ok(())
}

/// Every rank's `[B, H, M, W]` state in rank order (one all-gather); the ranks agreed on
/// the dims in the forward ([`agree`]).
fn gather_states(comm: &dyn Collectives, state: &Tensor) -> candle_core::Result<Vec<Tensor>> {
    let (b, h, m, w) = state.dims4()?;
    let n = state.elem_count();
    let world = comm.world_size();
    let gathered = comm.all_gather_seq(&state.flatten_all()?.reshape((1, 1, n))?, &vec![1; world])?;
    (0..world).map(|p| gathered.narrow(1, p, 1)?.reshape((b, h, m, w))).collect()
}

/// A tensor outside the graph in f32 (the computation's precision for every dtype).
fn f32_of(t: &Tensor) -> candle_core::Result<Tensor> {
    t.detach().to_dtype(DType::F32)
}

/// `[v | 1]` (normalised) or `v`: `[B, H, L, W]`.
fn values_with_ones(v: &Tensor, normalize: bool) -> candle_core::Result<Tensor> {
    if normalize {
        let (b, h, l, _) = v.dims4()?;
        Tensor::cat(&[v, &Tensor::ones((b, h, l, 1), DType::F32, v.device())?], 3)
    } else {
        Ok(v.clone())
    }
}

/// The shard's own state `Σ_s φ(k_s) [v_s | 1]ᵀ`, `[B, H, M, W]` f32, contiguous.
fn local_state(phi_k: &Tensor, v: &Tensor, normalize: bool) -> candle_core::Result<Tensor> {
    let (b, h, l, m) = phi_k.dims4()?;
    let w = v.dim(3)? + usize::from(normalize);
    if l == 0 {
        return Tensor::zeros((b, h, m, w), DType::F32, phi_k.device());
    }
    phi_k.transpose(2, 3)?.contiguous()?.matmul(&values_with_ones(v, normalize)?.contiguous()?)?.contiguous()
}

struct LaspGrad {
    op: LinearAttention,
    comm: Arc<dyn Collectives>,
    kept: Kept,
    kernels: mesa_kernels::Device,
}

/// What the forward keeps for the backward.
enum Kept {
    /// f32 inputs: the attention's states (its output is candle's result, f32).
    States(Box<LinearAttentionSaved>),
    /// 16-bit inputs: `S0_r` (`None` on rank 0), from which the backward reruns the shard's
    /// f32 attention: the normaliser's gradient needs the f32 output, not the rounded one
    /// candle holds (`crate::ops::LinearAttention`, same reason).
    Start(Option<Tensor>),
}

impl Backward for LaspGrad {
    fn name(&self) -> &'static str {
        "mesa-sharded-linear-attention"
    }
    fn backward(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        super::tell_peers(self.comm.as_ref(), self.backward_inner(args, res, grad))
    }
}

impl LaspGrad {
    fn backward_inner(
        &self,
        args: &[&Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let dtype = args[0].dtype();
        let (q, k, v) = (f32_of(args[0])?, f32_of(args[1])?, f32_of(args[2])?);
        let dout = f32_of(grad)?;
        let kernels = &self.kernels;
        let (phi_q, phi_k) = self.op.features_detached::<f32>(kernels, &q, &k)?;
        let rerun;
        let (saved, out) = match &self.kept {
            Kept::States(saved) => (saved.as_ref(), f32_of(res)?),
            Kept::Start(start) => {
                let (out, saved) = self.op.attention_with_state::<f32>(kernels, &phi_q, &phi_k, &v, start.as_ref())?;
                rerun = saved;
                (&rerun, out.into_tensor()?)
            }
        };
        let ([dphi_q, mut dphi_k, mut dv], g_local) =
            self.op.attention_backward_with_state::<f32>(kernels, saved, [&phi_q, &phi_k, &v], &out, &dout, None)?;
        let gs = gather_states(self.comm.as_ref(), &g_local)?;
        // D_r = Σ_{p>r} G_p, added from the last rank down (the order a ring's hand-off would
        // take): the same on every rank
        let r = self.comm.rank();
        if r + 1 < gs.len() && phi_k.dim(2)? > 0 {
            let mut d_final = g_local.zeros_like()?;
            for gp in gs[r + 1..].iter().rev() {
                d_final = (d_final + gp)?;
            }
            let normalize = self.op.config().normalize;
            let dim = v.dim(3)?;
            // dφk_s += D_r [v_s | 1],  dv_s += D_r[:, :D]ᵀ φk_s
            let v1 = values_with_ones(&v, normalize)?.contiguous()?;
            dphi_k = (dphi_k + v1.matmul(&d_final.transpose(2, 3)?.contiguous()?)?)?;
            dv = (dv + phi_k.contiguous()?.matmul(&d_final.narrow(3, 0, dim)?.contiguous()?)?)?;
        }
        let dq = self.op.features_backward::<f32>(kernels, &q, &phi_q, &dphi_q, true)?;
        let dk = self.op.features_backward::<f32>(kernels, &k, &phi_k, &dphi_k, false)?;
        [dq, dk, dv].into_iter().map(|g| Ok(Some(if dtype == DType::F32 { g } else { g.to_dtype(dtype)? }))).collect()
    }
}
