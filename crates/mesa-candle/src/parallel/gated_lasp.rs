//! Gated linear attention across sequence shards (issue 41; LASP, Sun et al. 2024, with the
//! decay of Yang et al. 2024 §4 / Dao & Gu 2024 §3), as one candle op per rank with exact
//! gradients: [`ShardedGatedLinearAttention`].
//!
//! Rank `r` holds rows `o_r .. o_r + L_r` of the sequence: `q: [B, H, L_r, M]`,
//! `k: [B, H_kv, L_r, M]`, `v: [B, H_kv, L_r, D]` and the log-decay `a: [B, H_kv, L_r]` (per
//! step) or `[H_kv]` (per head, the same on every rank). With `S_t = exp(a_t)·S_{t−1} +
//! k_t v'_tᵀ` (`mesa_kernels::gated_linear_attention`), the shard's final state is affine in
//! the state it starts from, per batch row and KV head:
//!
//! ```text
//! F_r = exp(A_r)·S0_r + L_r,   A_r = Σ_{t ∈ shard r} a_t   (per head: A_r = L_r·a_h; 0 when L_r = 0)
//!                              L_r = Σ_s w_s k_s v'_sᵀ,  w_s = exp(Σ_{j ∈ shard, j > s} a_j)
//! ```
//!
//! (`L_r` the final state from a zero start; `w_s` is an exponential of a sum of the `a` after
//! `s`, never a difference, so a reset `a = −∞` gives `w = 0` before it and no NaN). Since
//! `S0_{r+1} = F_r`:
//!
//! ```text
//! forward   all-gather every rank's B, H, H_kv, M, D, W, dtype and decay kind  (ranks that disagree fail here, on every rank)
//!           all-gather (L_r, A_r)                                     (B·H_kv·(M·W + 1)·4 bytes per rank)
//!           S0_r = fold p = 0 .. r−1 of  S ← exp(A_p)·S + L_p, from S = 0   (f32, rank order)
//!           out  = gated forward from S0_r                              (rank 0: from no state)
//! backward  dq, dk, dv, da, G_r = gated backward, d_final = 0            (G_r = ∂loss_r/∂S0_r)
//!           all-gather G_0 … G_{W−1}
//!           D_r  = fold p = W−1 down to r+1 of  D ← G_p + exp(A_p)·D, from D = 0   (∂loss/∂F_r)
//!           dk_s += w_s·D_r v'_s,   dv_s += w_s·D_r[:, :D]ᵀ k_s,   da_t += exp(A_r)⟨D_r, S0_r⟩ + Σ_{s<t} c_s
//! ```
//!
//! with `c_s = w_s·k_sᵀ D_r v'_s`. Why: the total gradient of `S0_p` is `G_p` (through shard
//! `p`'s own rows) plus `exp(A_p)·∂loss/∂F_p` (through its final state), and `∂loss/∂F_p` is the
//! total gradient of `S0_{p+1}` (zero for the last rank), which unrolls into the fold for `D_r`.
//! The final state reaches the loss only through `⟨D_r, F_r⟩`, whose derivatives are: in `k_s`,
//! `w_s D_r v'_s`; in `v_s`, `w_s D_rᵀ k_s` (its first `D` columns); in `a_t`,
//! `⟨D_r, exp(Σ_{j ≥ t} a_j)·S_{t−1}⟩`, which, writing `S_{t−1} = exp(Λ_{t−1})·S0_r + Σ_{s<t}
//! exp(Σ_{s<j<t} a_j) k_s v'_sᵀ`, is `exp(A_r)⟨D_r, S0_r⟩ + Σ_{s<t} c_s` — a prefix sum with no
//! cancellation, exactly 0 on and before the shard's last reset (there `exp(A_r) = 0` and
//! `w_s = 0`), as the kernel's own `da` is on a reset row. These are the hand-off's terms of the
//! decay's gradient: every `∂S0_p/∂A_j` for `r < j < p` is carried by `D_r`'s products of
//! `exp(A_j)`, and `∂F_r/∂A_r` by the `exp(A_r)⟨D_r, S0_r⟩` term. Per-head decay sums `da` over
//! `B` and the rows.
//!
//! **Exactness.** The gathered `(L_p, A_p)` and `G_p` are identical on every rank and folded in
//! fixed rank order, so every rank derives the same `S0_p` and `D_p`; with one rank nothing is
//! gathered into the result (no initial state, no correction): the kernel calls are those of the
//! unsharded op, bitwise, in every dtype. `w_s` and `A_r` are summed in f64 on the host (the
//! decay, `B·H_kv·L_r` f32, is read back once per forward and once per backward: on CUDA two
//! synchronisations) and rounded once to f32; the rest of the hand-off is f32. Every rank must run the backward through its output (a
//! zero gradient is fine): the backward meets the other ranks in a collective.
//!
//! Scope: the identity feature map (RetNet, Mamba-2, GLA use `q`, `k` directly; apply a map
//! before the op otherwise), no initial state of the whole sequence. `docs/sequence_parallel.md`,
//! "Linear attention across sequence shards (LASP)".
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use mesa_kernels::gated_linear_attention::{GatedConfig, GatedSaved};

use super::Collectives;
use crate::attach::{attach, Backward};
use crate::bridge::common_device;
use crate::bridge::dispatch_float;
use crate::error::Error;
use crate::ops::gated_linear_attention::{gated_shape, gla_backward, gla_forward, GatedShape, GlaGrads};
use crate::ops::{check_dtypes, tensor_result};

const OP: &str = "sharded gated linear attention";

/// Gated causal linear attention on this rank's shard of a sequence split over `comm`'s
/// ranks (module docs): the outputs and gradients of the gated attention on the whole sequence.
#[derive(Debug, Clone)]
pub struct ShardedGatedLinearAttention {
    config: GatedConfig,
    comm: Arc<dyn Collectives>,
}

/// The states of one rank's forward ([`ShardedGatedLinearAttention::forward_with_states`]):
/// f32 tensors outside any graph, states `[B, H_kv, M, W]` (column `D` the normaliser's `z`).
#[derive(Debug, Clone)]
pub struct GatedShardStates {
    /// `L_r`: this shard's final state from a zero start.
    pub local: Tensor,
    /// `A_r`: this shard's total log-decay `[B, H_kv]` (`−∞` when a reset is in the shard).
    pub log_decay: Tensor,
    /// `S0_r`: the state the shard started from (zero on rank 0).
    pub initial: Tensor,
    /// The whole sequence's final state (the fold over every rank), identical on every rank.
    pub total: Tensor,
}

/// Sizes of one rank's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dims {
    b: usize,
    h: usize,
    hkv: usize,
    l: usize,
    m: usize,
    d: usize,
    w: usize,
}

impl ShardedGatedLinearAttention {
    /// Gated attention with `config` (normalisation, ε, chunk) on shards over `comm`.
    #[must_use]
    pub fn new(config: GatedConfig, comm: Arc<dyn Collectives>) -> Self {
        ShardedGatedLinearAttention { config, comm }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &GatedConfig {
        &self.config
    }

    /// The group.
    #[must_use]
    pub fn comm(&self) -> &Arc<dyn Collectives> {
        &self.comm
    }

    /// This rank's shard `q: [B, H, L_r, M]`, `k: [B, H_kv, L_r, M]`, `v: [B, H_kv, L_r, D]`,
    /// `a: [B, H_kv, L_r]` (per step) or `[H_kv]` (per head; the kind follows from the rank),
    /// f32, natural-log units, every value `≤ 0` or `−∞` (a reset) → its output
    /// `[B, H, L_r, D]`. Shards may have any lengths (0 included); `B`, `H`, `H_kv`, `M`, `D`,
    /// the dtype and the decay's kind must agree on every rank. `q`, `k`, `v` one of f32, f16,
    /// bf16: the kernels run in that dtype (16-bit on tensor cores, f32 states), as the candle
    /// op runs them; the hand-off's states and corrections are f32, the corrections of `dk`,
    /// `dv` added to the kernel's rounded values and rounded again. f64 is computed in f32
    /// (`a` then f32 or f64). Gradients reach `q`, `k`, `v` and `a`. A per-head decay is replicated: every rank
    /// must pass the same values (not checked), and each rank's gradient of it is its shard's
    /// part — their sum over the ranks (an all-reduce, as for any replicated parameter) is the
    /// whole sequence's. Two collective calls in the forward (the
    /// ranks' sizes, then their `(L_r, A_r)`) and one in the backward.
    ///
    /// # Errors
    /// [`Error::Rank`], [`Error::Shape`] (this rank's tensors disagree; or, on every rank, the
    /// ranks disagree on `B, H, H_kv, M, D, W` or the decay's kind — the message names the
    /// rank), [`Error::InvalidArgument`] (`H_kv` not dividing `H`; a decay value NaN or `> 0`),
    /// [`Error::DTypeMismatch`] (this rank's `q, k, v` differ, `a` not f32; or on every rank
    /// the ranks' dtypes differ), [`Error::UnsupportedDType`], [`Error::DeviceMismatch`], the
    /// collectives' [`Error::Collective`], the kernels' errors (chunk, ε) as [`Error::Kernel`].
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, a: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with_states(q, k, v, a)?.0)
    }

    /// [`ShardedGatedLinearAttention::forward`], also returning the states it combined.
    ///
    /// # Errors
    /// As [`ShardedGatedLinearAttention::forward`].
    pub fn forward_with_states(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        a: &Tensor,
    ) -> candle_core::Result<(Tensor, GatedShardStates)> {
        // an error of this rank's own must not leave its peers waiting for it
        super::tell_peers(self.comm.as_ref(), self.forward_inner(q, k, v, a))
    }

    fn forward_inner(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        a: &Tensor,
    ) -> candle_core::Result<(Tensor, GatedShardStates)> {
        check_dtypes(
            OP,
            &[(q, "queries [B, H, L_r, M]"), (k, "keys [B, H_kv, L_r, M]"), (v, "values [B, H_kv, L_r, D]")],
        )?;
        let dtype = q.dtype();
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {}
            DType::F64 => {
                let f = |t: &Tensor| if t.dtype() == DType::F64 { t.to_dtype(DType::F32) } else { Ok(t.clone()) };
                let (y, states) = self.forward_inner(&f(q)?, &f(k)?, &f(v)?, &f(a)?)?;
                return Ok((y.to_dtype(DType::F64)?, states));
            }
            other => return Err(Error::UnsupportedDType { op: OP, dtype: other }.into()),
        }
        if a.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch {
                op: OP,
                what: "log-decay a".into(),
                of: "the op (an f32 decay)".into(),
                expected: DType::F32,
                got: a.dtype(),
            }
            .into());
        }
        let dims = self.dims(q, k, v, a)?;
        let kernels = common_device(OP, &[q, k, v, a])?;
        let steps = decay_steps(a, dims)?;
        let (weights, total_decay) = suffix_weights(&steps, dims);
        let dev = q.device();
        let (kf, vf) = (f32_of(k)?, f32_of(v)?);
        let w = Tensor::from_vec(weights, (dims.b, dims.hkv, dims.l, 1), dev)?;
        let log_decay = Tensor::from_vec(total_decay, (dims.b, dims.hkv), dev)?;
        let local = local_state(&kf, &vf, &w, dims, self.config.normalize)?;
        agree(self.comm.as_ref(), dims, dtype, a.rank(), dev)?;
        let gathered = gather_states(self.comm.as_ref(), &local, &log_decay)?;
        // S0_r and the whole sequence's final state, folded in rank order from zero: the same on
        // every rank
        let r = self.comm.rank();
        let mut acc = local.zeros_like()?;
        let mut initial = acc.clone();
        for (p, (lp, ap)) in gathered.iter().enumerate() {
            if p == r {
                initial = acc.clone();
            }
            acc = fold(&acc, ap, lp)?;
        }
        let start = (r > 0).then_some(&initial);
        let a_c = a.detach().contiguous()?;
        // the kernels in the inputs' dtype (16-bit on tensor cores), as the candle op runs them
        let qkv = [&q.detach(), &k.detach(), &v.detach()];
        let (out, saved) = dispatch_float!(dtype, OP, T => {
            let (o, s) = gla_forward::<T>(&kernels, &self.config, qkv, &a_c, start)?;
            Ok::<_, candle_core::Error>((o.into_tensor()?, s))
        })?;
        // the op's arguments: q, k and v packed (candle's custom ops take at most three), a
        let n_k = k.elem_count();
        let kv = Tensor::cat(&[k.flatten_all()?, v.flatten_all()?], 0)?;
        let grad = ShardGrad {
            config: self.config,
            comm: Arc::clone(&self.comm),
            saved,
            kernels,
            dims,
            n_k,
            start: start.cloned(),
            gathered,
        };
        let y = attach(&[q, &kv, a], tensor_result(&out)?, grad)?;
        let states = GatedShardStates { local, log_decay, initial, total: acc };
        Ok((y, states))
    }

    /// Checks this rank's ranks, shapes and grouping.
    fn dims(&self, q: &Tensor, k: &Tensor, v: &Tensor, a: &Tensor) -> candle_core::Result<Dims> {
        let GatedShape { b, h, hkv, l, m, d } = gated_shape("sharded gated linear attention", q, k, v, a)?;
        Ok(Dims { b, h, hkv, l, m, d, w: d + usize::from(self.config.normalize) })
    }
}

/// The decay per step `[B·H_kv·L]` in f64 (per head: broadcast over `B` and the rows), after
/// checking its values (NaN or `> 0`: [`Error::InvalidArgument`]). Read on the host.
fn decay_steps(a: &Tensor, d: Dims) -> candle_core::Result<Vec<f64>> {
    let values = a.detach().flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = values.iter().position(|x| x.is_nan() || *x > 0.0) {
        return Err(Error::InvalidArgument {
            name: "log-decay a",
            why: format!("element {i} is {}: a log-decay must be ≤ 0 (−∞ resets the state)", values[i]),
        }
        .into());
    }
    if a.rank() == 3 {
        return Ok(values.iter().map(|&x| f64::from(x)).collect());
    }
    let mut steps = Vec::with_capacity(d.b * d.hkv * d.l);
    for _ in 0..d.b {
        for &x in &values {
            steps.extend(std::iter::repeat_n(f64::from(x), d.l));
        }
    }
    Ok(steps)
}

/// `w_s = exp(Σ_{j > s} a_j)` `[B·H_kv·L]` and `A = Σ_j a_j` `[B·H_kv]` of each row's shard,
/// summed in f64 from the end (never a difference: `−∞` stays `−∞`), rounded once to f32.
fn suffix_weights(steps: &[f64], d: Dims) -> (Vec<f32>, Vec<f32>) {
    let mut w = vec![0f32; steps.len()];
    let mut total = vec![0f32; d.b * d.hkv];
    for (bh, t) in total.iter_mut().enumerate() {
        let mut acc = 0f64;
        for s in (0..d.l).rev() {
            w[bh * d.l + s] = acc.exp() as f32;
            acc += steps[bh * d.l + s];
        }
        *t = acc as f32;
    }
    (w, total)
}

/// `exp(A)·S + L` per batch row and KV head (`A: [B, H_kv]`, states `[B, H_kv, M, W]`).
fn fold(s: &Tensor, a: &Tensor, l: &Tensor) -> candle_core::Result<Tensor> {
    let (b, hkv) = a.dims2()?;
    s.broadcast_mul(&a.exp()?.reshape((b, hkv, 1, 1))?)? + l
}

/// `[v | 1]` (normalised) or `v`: `[B, H_kv, L, W]`.
fn values_with_ones(v: &Tensor, normalize: bool) -> candle_core::Result<Tensor> {
    if normalize {
        let (b, h, l, _) = v.dims4()?;
        Tensor::cat(&[v, &Tensor::ones((b, h, l, 1), DType::F32, v.device())?], 3)
    } else {
        Ok(v.clone())
    }
}

/// `L_r = Σ_s w_s k_s v'_sᵀ`, `[B, H_kv, M, W]` f32, contiguous (one matmul).
fn local_state(k: &Tensor, v: &Tensor, w: &Tensor, d: Dims, normalize: bool) -> candle_core::Result<Tensor> {
    if d.l == 0 {
        return Tensor::zeros((d.b, d.hkv, d.m, d.w), DType::F32, k.device());
    }
    let wk = k.broadcast_mul(w)?;
    wk.transpose(2, 3)?.contiguous()?.matmul(&values_with_ones(v, normalize)?.contiguous()?)?.contiguous()
}

/// Values of [`agree`]'s all-gather per rank: `B, H, H_kv, M, D, W`, the dtype's code and the
/// decay's rank.
const AGREE: usize = 8;

/// The dtype codes of [`agree`] (exact in f32).
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Checks, by one all-gather, that every rank agrees with rank 0 on the sizes, the dtype and
/// the decay's kind, else the same error on every rank. It runs before any state travels: the
/// states' sizes follow from these values.
fn agree(comm: &dyn Collectives, d: Dims, dtype: DType, decay_rank: usize, device: &Device) -> candle_core::Result<()> {
    let code = DTYPES.iter().position(|&x| x == dtype).unwrap_or(DTYPES.len());
    // exact in f32 below 2²⁴ each
    let mine: Vec<f32> = [d.b, d.h, d.hkv, d.m, d.d, d.w, code, decay_rank].iter().map(|&x| x as f32).collect();
    let world = comm.world_size();
    let all = comm.all_gather_seq(&Tensor::from_vec(mine, (1, 1, AGREE), device)?, &vec![1; world])?;
    let all: Vec<usize> = all.flatten_all()?.to_vec1::<f32>()?.iter().map(|&x| x as usize).collect();
    let first = &all[..AGREE];
    for (p, other) in all.chunks(AGREE).enumerate() {
        if first[..6] != other[..6] {
            let what = format!(
                "{OP}: [B, H, H_kv, M, D, W] of rank {p}'s queries [B, H, L_r, M], keys [B, H_kv, L_r, M], values \
                 [B, H_kv, L_r, D] and states (every rank's must be rank 0's)"
            );
            return Err(Error::Shape { what, expected: first[..6].to_vec(), got: other[..6].to_vec() }.into());
        }
        if first[6] != other[6] {
            let dtype = |c: usize| DTYPES.get(c).copied().unwrap_or(DType::F64);
            return Err(Error::DTypeMismatch {
                op: OP,
                what: format!("rank {p}'s queries, keys and values"),
                of: "rank 0's".into(),
                expected: dtype(first[6]),
                got: dtype(other[6]),
            }
            .into());
        }
        if first[7] != other[7] {
            let what = format!(
                "{OP}: the rank of rank {p}'s log-decay a (every rank's decay must be of rank 0's kind: [B, H_kv, L_r] \
                 per step or [H_kv] per head)"
            );
            return Err(Error::Shape { what, expected: vec![first[7]], got: vec![other[7]] }.into());
        }
    }
    Ok(())
}

/// Every rank's `([B, H_kv, M, W] state, [B, H_kv] log-decay)` in rank order (one all-gather);
/// `decay: None` gathers the states only. The ranks agreed on the sizes ([`agree`]).
fn gather(
    comm: &dyn Collectives,
    state: &Tensor,
    decay: Option<&Tensor>,
) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    let (b, h, m, w) = state.dims4()?;
    let n = state.elem_count();
    let mut flat = vec![state.flatten_all()?];
    flat.extend(decay.map(Tensor::flatten_all).transpose()?);
    let flat = Tensor::cat(&flat, 0)?;
    let c = flat.elem_count();
    let world = comm.world_size();
    let gathered = comm.all_gather_seq(&flat.reshape((1, 1, c))?, &vec![1; world])?;
    (0..world)
        .map(|p| {
            let row = gathered.narrow(1, p, 1)?.flatten_all()?;
            let s = row.narrow(0, 0, n)?.reshape((b, h, m, w))?;
            let a = if decay.is_some() {
                row.narrow(0, n, b * h)?.reshape((b, h))?
            } else {
                Tensor::zeros((b, h), DType::F32, state.device())?
            };
            Ok((s, a))
        })
        .collect()
}

fn gather_states(comm: &dyn Collectives, state: &Tensor, decay: &Tensor) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    gather(comm, state, Some(decay))
}

/// A tensor outside the graph in f32.
fn f32_of(t: &Tensor) -> candle_core::Result<Tensor> {
    t.detach().to_dtype(DType::F32)
}

struct ShardGrad {
    config: GatedConfig,
    comm: Arc<dyn Collectives>,
    saved: GatedSaved,
    kernels: mesa_kernels::Device,
    dims: Dims,
    /// Elements of `k` in the packed `k`, `v`.
    n_k: usize,
    /// `S0_r` (`None` on rank 0).
    start: Option<Tensor>,
    /// Every rank's `(L_p, A_p)`.
    gathered: Vec<(Tensor, Tensor)>,
}

impl Backward for ShardGrad {
    fn name(&self) -> &'static str {
        "mesa-sharded-gated-linear-attention"
    }
    fn backward(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        super::tell_peers(self.comm.as_ref(), self.backward_inner(args, res, grad))
    }
}

impl ShardGrad {
    fn backward_inner(
        &self,
        args: &[&Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let Dims { b, hkv, l, m, d, .. } = self.dims;
        // the kernels in the inputs' dtype, as the forward (a normalised backward reads the
        // output as rounded to it, as the candle op's)
        let dtype = args[0].dtype();
        let q = args[0].detach();
        let kv = args[1].detach();
        let k = kv.narrow(0, 0, self.n_k)?.reshape((b, hkv, l, m))?;
        let v = kv.narrow(0, self.n_k, b * hkv * l * d)?.reshape((b, hkv, l, d))?;
        let a = args[2].detach().contiguous()?;
        let dout = grad.detach().to_dtype(dtype)?;
        let out = self.config.normalize.then(|| res.detach());
        let GlaGrads { dqkv: [dq, mut dk, mut dv], mut da, d_initial } = dispatch_float!(dtype, "sharded gated linear attention backward", T => gla_backward::<T>(
            &self.kernels,
            &self.config,
            &self.saved,
            [&q, &k, &v],
            &a,
            self.start.as_ref(),
            out.as_ref(),
            &dout,
            None,
            self.start.is_some(),
        ))?;
        let g_local = match d_initial {
            Some(g) => g,
            None => self.gathered[0].0.zeros_like()?,
        };
        let gs = gather(self.comm.as_ref(), &g_local, None)?;
        // D_r = fold from the last rank down to r + 1 of D ← G_p + exp(A_p)·D: the same on
        // every rank
        let r = self.comm.rank();
        if r + 1 < gs.len() && l > 0 {
            let mut d_final = g_local.zeros_like()?;
            for p in (r + 1..gs.len()).rev() {
                d_final = fold(&d_final, &self.gathered[p].1, &gs[p].0)?;
            }
            // in f32, added to the kernel's dk, dv (16-bit: rounded once more)
            let (dk_add, dv_add, da_add) = self.final_state_terms(&a, &f32_of(&k)?, &f32_of(&v)?, &d_final)?;
            dk = (dk.to_dtype(DType::F32)? + dk_add)?.to_dtype(dtype)?;
            dv = (dv.to_dtype(DType::F32)? + dv_add)?.to_dtype(dtype)?;
            da = (da + da_add)?;
        }
        let dkv = Tensor::cat(&[dk.flatten_all()?, dv.flatten_all()?], 0)?;
        Ok(vec![Some(dq), Some(dkv), Some(da)])
    }

    /// The gradients of `⟨D_r, F_r⟩` in `k`, `v` and `a` (module docs).
    fn final_state_terms(
        &self,
        a: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d_final: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let dims = self.dims;
        let Dims { b, hkv, l, d, .. } = dims;
        let dev = k.device();
        let steps = decay_steps(a, dims)?;
        let (weights, _) = suffix_weights(&steps, dims);
        let w = Tensor::from_vec(weights, (b, hkv, l, 1), dev)?;
        let v1 = values_with_ones(v, self.config.normalize)?.contiguous()?;
        // dk_s += w_s·D_r v'_s,  dv_s += w_s·D_r[:, :D]ᵀ k_s
        let dk_add = v1.matmul(&d_final.transpose(2, 3)?.contiguous()?)?.broadcast_mul(&w)?;
        let dv_add = k.contiguous()?.matmul(&d_final.narrow(3, 0, d)?.contiguous()?)?.broadcast_mul(&w)?;
        // c_s = k_s·(w_s·D_r v'_s);  da_t += exp(A_r)⟨D_r, S0_r⟩ + Σ_{s<t} c_s
        let c = (k * &dk_add)?.sum(3)?.flatten_all()?.to_vec1::<f32>()?;
        let a_r = &self.gathered[self.comm.rank()].1;
        let e: Vec<f32> = match &self.start {
            Some(s0) => (s0 * d_final)?.sum((2, 3))?.mul(&a_r.exp()?)?.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0.0; b * hkv],
        };
        let mut da = vec![0f32; b * hkv * l];
        for bh in 0..b * hkv {
            let mut acc = f64::from(e[bh]);
            for t in 0..l {
                da[bh * l + t] = acc as f32;
                acc += f64::from(c[bh * l + t]);
            }
        }
        let da = Tensor::from_vec(da, (b, hkv, l), dev)?;
        // per head: summed over B and the rows
        let da = if a.rank() == 1 { da.sum((0, 2))? } else { da };
        Ok((dk_add, dv_add, da))
    }
}
