//! The state carried across calls (chunk-wise processing of a long sequence, streaming
//! inference): an initial state into the forward, its gradient out of the backward, and the
//! final state's gradient into the backward.
//!
//! A state is an f32 tensor `[B, H, M, W]`, contiguous (row-major), `W = D + normalize`:
//! columns `0..D` hold `S = Σ_s k_s v_sᵀ`, column `D` (normalised attention) the
//! normaliser's `z = Σ_s k_s` — the layout of [`super::LinearAttentionSaved::final_state`].
//! With an initial state `S₀' = [S₀ | z₀]` the causal forward computes
//!
//! ```text
//! out_t = q_tᵀ (S₀ + Σ_{s≤t} k_s v_sᵀ) / g(q_t · (z₀ + Σ_{s≤t} k_s)),   S_L' = S₀' + Σ_s k_s [v_s | 1]ᵀ
//! ```
//!
//! so a sequence split at any row into two calls, the second starting from the first's final
//! state, gives the one-call outputs (within rounding). Backward, with `dO'_t = [dnum_t | dden_t]`
//! (module docs of [`super`]) and `dS_L'` the final state's gradient:
//!
//! ```text
//! dS₀' = dS_L' + Σ_t q_t dO'_tᵀ          dk_s += dS_L' [v_s | 1]         dv_s += dS_Lᵀ k_s   (columns 0..D)
//! dq_t  = (S₀' + Σ_{s≤t} k_s [v_s | 1]ᵀ) dO'_t
//! ```
//!
//! Causal attention only (a bidirectional call has no "before" and "after").
use crate::error::{Error, Result};
use crate::tensor::{TensorMut, TensorRef};

/// The state gradients of [`super::backward_with_state`].
#[derive(Debug, Default)]
pub struct StateGrads<'a, 'b> {
    /// The gradient of the final state `[B, H, M, W]` f32 (contiguous); `None`: zero (the
    /// final state is not used downstream).
    pub d_final: Option<&'a TensorRef<'b, f32>>,
    /// Written: the gradient of the initial state `[B, H, M, W]` f32 (contiguous); `None`: not
    /// wanted. Its value does not depend on whether the forward had an initial state.
    pub d_initial: Option<&'a mut TensorMut<'b, f32>>,
}

/// `[B, H, M, W]` of a call.
pub(crate) fn state_shape(batch: usize, heads: usize, feat: usize, width: usize) -> [usize; 4] {
    [batch, heads, feat, width]
}

/// A state tensor must have `want`'s shape and be contiguous (the kernels index it densely).
pub(crate) fn check_state(shape: &[usize], contiguous: bool, want: [usize; 4], what: &str) -> Result<()> {
    if shape != want {
        return Err(Error::shape_mismatch(what, &want, shape));
    }
    if !contiguous {
        return Err(Error::invalid_layout(what, "a state must be a contiguous (row-major) [B, H, M, W] f32 tensor"));
    }
    Ok(())
}

/// States in or out are for causal attention only.
pub(crate) fn require_causal(causal: bool, what: &str) -> Result<()> {
    if causal {
        Ok(())
    } else {
        Err(Error::invalid_argument(what, "bidirectional attention takes no state in or out (causal only)"))
    }
}
