//! The layer's gated linear attention ([`super::Attention::Gated`],
//! [`super::Attention::InputGated`], issue 41): the core `O = GLA(Q/√d, K, V)` with a fixed
//! log-decay per KV head or one per step from the input gate, on the kernels through the op's
//! calls ([`crate::ops::gated_linear_attention`]). K and V are the block's own heads (`[B, H_kv,
//! N, d]`, never repeated); the forward keeps nothing of the core (the Q, K, V codes are kept by
//! the block), the backward reruns it from the decoded Q̂, K̂, V̂ — `O(N)`, as linear attention
//! — and the input gate from the decoded input of the projections.
use std::collections::HashMap;

use candle_core::{DType, Tensor};

use super::forward::Plan;
use super::params::GateNames;
use super::Attention;
use crate::bridge::dispatch_float;
use crate::ops::gated_linear_attention::{gla_backward, gla_forward};
use crate::ops::GatedConfig;

impl Plan {
    /// The gated core of the call (`None` for other attention): for [`Attention::Gated`] the
    /// decays of its (the rank's) KV heads copied to the layer's device, for
    /// [`Attention::InputGated`] the call's `gate`'s (an error without one). Made when used,
    /// not kept in the plan: the plan lives until the backward and the planner counts its
    /// bytes as a fixed per-layer overhead.
    pub fn gated_core(&self, gate: Option<&InputGate>) -> candle_core::Result<Option<GatedCore>> {
        let scale = 1.0 / (self.config.head_dim() as f64).sqrt();
        match (&self.config.attention, gate) {
            (Attention::Gated { config, log_decay }, _) => {
                // the rank's KV heads (all without a group): H_kv/t from r·H_kv/t, or the one
                // its query heads read when t > H_kv
                let kv = self.local_kv_heads();
                let first = self.tp.as_ref().map_or(0, |tp| tp.comm.rank() * log_decay.len() / tp.comm.world_size());
                let mine = log_decay.get(first..first + kv).ok_or_else(|| crate::Error::InvalidArgument {
                    name: "log_decay",
                    why: format!("{} values: no KV heads {first}..{} for this rank", log_decay.len(), first + kv),
                })?;
                let decay = Tensor::from_vec(mine.to_vec(), kv, &self.ctx.candle)?;
                Ok(Some(GatedCore { config: *config, decay, scale }))
            }
            (Attention::InputGated { config }, Some(g)) => {
                Ok(Some(GatedCore { config: *config, decay: g.decay.clone(), scale }))
            }
            (Attention::InputGated { .. }, None) => {
                Err(crate::Error::StateConsumed { op: "input-gated attention" }.into())
            }
            _ => Ok(None),
        }
    }

    /// The input gate of [`Attention::InputGated`] at the projections' input `x_in`
    /// (`[B, N, C]`, the whole sequence), `None` for other attention.
    pub fn input_gate(&self, params: &Tensor, x_in: &Tensor) -> candle_core::Result<Option<InputGate>> {
        if !matches!(self.config.attention, Attention::InputGated { .. }) {
            return Ok(None);
        }
        let names = GateNames::of(self.config.block);
        let f = |name: &str| self.w(params, name)?.to_dtype(DType::F32);
        let (w, b, a_log) = (f(names.weight)?, f(names.bias)?, f(names.a_log)?);
        // z = x̂·Wᵀ + b: [B, N, H_kv] in f32
        let z = x_in.to_dtype(DType::F32)?.broadcast_matmul(&w.t()?)?.broadcast_add(&b)?;
        // softplus(z) = max(z, 0) + ln(1 + e^−|z|), without overflow
        let softplus = (z.relu()? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
        let decay = softplus.broadcast_mul(&a_log.exp()?.neg()?)?.transpose(1, 2)?.contiguous()?;
        Ok(Some(InputGate { z, decay }))
    }

    /// The gate's gradients from the decay's `da` (`[B, H_kv, N]`, f32): `dx_in` (`x_in`'s
    /// dtype) and the parameters' gradients, inserted into `grads`:
    /// `dz = da·(−e^{A_log})·σ(z)`, `dW = Σ dzᵀ x̂`, `db = Σ dz`, `dA_log = Σ da·a`,
    /// `dx̂ = dz·W`; nothing from a step whose decay overflowed to `−∞` (a reset).
    pub fn input_gate_backward(
        &self,
        params: &Tensor,
        x_in: &Tensor,
        gate: &InputGate,
        da: &Tensor,
        grads: &mut HashMap<&'static str, Tensor>,
    ) -> candle_core::Result<Tensor> {
        let names = GateNames::of(self.config.block);
        let f = |name: &str| self.w(params, name)?.to_dtype(DType::F32);
        let (w, a_log) = (f(names.weight)?, f(names.a_log)?);
        let (b, n, c) = x_in.dims3()?;
        let kv = w.dim(0)?;
        // a step whose decay overflowed to −∞ (e^{A_log}·softplus(z) past f32's range) is a
        // reset: no gradient reaches the gate through it (the kernel's da is 0 there), rather
        // than 0·∞ = NaN
        let live = gate.decay.ne(f64::NEG_INFINITY)?;
        let zeros = gate.decay.zeros_like()?;
        let d_a_log = live.where_cond(&(da * &gate.decay)?, &zeros)?.sum((0, 2))?;
        let sigmoid = (gate.z.neg()?.exp()? + 1.0)?.recip()?;
        let dz = da.transpose(1, 2)?.broadcast_mul(&a_log.exp()?.neg()?)?.mul(&sigmoid)?;
        let dz = live.transpose(1, 2)?.where_cond(&dz, &zeros.transpose(1, 2)?)?.reshape((b * n, kv))?;
        let xf = x_in.to_dtype(DType::F32)?.reshape((b * n, c))?;
        grads.insert(names.weight, dz.t()?.matmul(&xf)?);
        grads.insert(names.bias, dz.sum(0)?);
        grads.insert(names.a_log, d_a_log);
        dz.matmul(&w)?.reshape((b, n, c))?.to_dtype(x_in.dtype())
    }
}

/// The input gate of one call ([`Attention::InputGated`]): its pre-activation and the decay
/// it gives the kernel.
#[derive(Debug)]
pub(crate) struct InputGate {
    /// `z = x̂·Wᵀ + b`, `[B, N, H_kv]` f32.
    z: Tensor,
    /// `a = −e^{A_log}·softplus(z)`, `[B, H_kv, N]` f32 contiguous.
    decay: Tensor,
}

/// The core of one call: the kernel's configuration and the log-decays, `[H_kv]` (fixed) or
/// `[B, H_kv, N]` (an input gate's), f32 on the layer's device.
#[derive(Debug)]
pub(crate) struct GatedCore {
    pub config: GatedConfig,
    pub decay: Tensor,
    /// `1/√d`, applied to the queries (as softmax attention's logits).
    pub scale: f64,
}

impl GatedCore {
    /// `q: [B, H, N, d]`, `k, v: [B, H_kv, N, d]` → `[B, H, N, d]`, in `q`'s dtype (f32, f16
    /// or bf16; 16-bit on tensor cores, as the op runs them with the identity map, `q/√d`
    /// rounded to the dtype).
    pub fn forward(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let qs = (q * self.scale)?;
        dispatch_float!(q.dtype(), "gated linear attention", T => {
            let (o, _final_state) = gla_forward::<T>(kernels, &self.config, [&qs, k, v], &self.decay, None)?;
            o.into_tensor()
        })
    }

    /// `([dQ, dK, dV], da)` of [`GatedCore::forward`] at `q, k, v` (decoded) for the output
    /// gradient `d_o` (all of one dtype; `da` f32, shaped as the decay): the forward rerun first
    /// (its final state, and its output when normalised).
    pub fn backward(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<([Tensor; 3], Tensor)> {
        let qs = (q * self.scale)?;
        let g = dispatch_float!(q.dtype(), "gated linear attention backward", T => {
            let (o, saved) = gla_forward::<T>(kernels, &self.config, [&qs, k, v], &self.decay, None)?;
            let o = self.config.normalize.then(|| o.into_tensor()).transpose()?;
            gla_backward::<T>(kernels, &self.config, &saved, [&qs, k, v], &self.decay, None, o.as_ref(), d_o, None, false)
        })?;
        let [dq, dk, dv] = g.dqkv;
        Ok(([(dq * self.scale)?, dk, dv], g.da))
    }
}
