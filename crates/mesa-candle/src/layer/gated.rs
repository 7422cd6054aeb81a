//! The layer's gated linear attention ([`super::Attention::Gated`], issue 41): the core
//! `O = GLA(Q/√d, K, V)` with a fixed log-decay per KV head, on the kernels through the op's
//! calls ([`crate::ops::gated_linear_attention`]). K and V are the block's own heads (`[B, H_kv,
//! N, d]`, never repeated); the forward keeps nothing of the core (the Q, K, V codes are kept by
//! the block), the backward reruns it from the decoded Q̂, K̂, V̂ — `O(N)`, as linear attention.
use candle_core::Tensor;

use super::forward::Plan;
use super::Attention;
use crate::bridge::dispatch_float;
use crate::ops::gated_linear_attention::{gla_backward, gla_forward};
use crate::ops::GatedConfig;

impl Plan {
    /// The gated core of the call (`None` for other attention), its decays copied to the
    /// layer's device. Made when used, not kept in the plan: the plan lives until the backward
    /// and the planner counts its bytes as a fixed per-layer overhead.
    pub fn gated_core(&self) -> candle_core::Result<Option<GatedCore>> {
        let Attention::Gated { config, log_decay } = &self.config.attention else { return Ok(None) };
        let decay = Tensor::from_vec(log_decay.clone(), log_decay.len(), &self.ctx.candle)?;
        let scale = 1.0 / (self.config.head_dim() as f64).sqrt();
        Ok(Some(GatedCore { config: *config, decay, scale }))
    }
}

/// The core of one call: the kernel's configuration and the log-decays `[H_kv]` (f32, on the
/// layer's device; no gradient: they are fixed).
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

    /// `(dQ, dK, dV)` of [`GatedCore::forward`] at `q, k, v` (decoded) for the output gradient
    /// `d_o` (all of one dtype): the forward rerun first (its final state, and its output when
    /// normalised).
    pub fn backward(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let qs = (q * self.scale)?;
        let g = dispatch_float!(q.dtype(), "gated linear attention backward", T => {
            let (o, saved) = gla_forward::<T>(kernels, &self.config, [&qs, k, v], &self.decay, None)?;
            let o = self.config.normalize.then(|| o.into_tensor()).transpose()?;
            gla_backward::<T>(kernels, &self.config, &saved, [&qs, k, v], &self.decay, None, o.as_ref(), d_o, None, false)
        })?;
        let [dq, dk, dv] = g.dqkv;
        Ok(((dq * self.scale)?, dk, dv))
    }
}
