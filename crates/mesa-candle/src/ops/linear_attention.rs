//! Chunked linear attention (SLiM, Performer) with its feature maps, as one candle op over
//! `q`, `k`, `v`.
//!
//! The calls into `mesa_kernels::linear_attention` go through [`la_forward_with_state`],
//! [`la_backward`] and [`la_backward_with_state`] only, so a change of that API touches those
//! functions.
use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};
use mesa_kernels::feature_map::{self, FavorProjection, FavorStabilizer, FeatureBackwardArgs, FeatureMap};
use mesa_kernels::linear_attention::{
    self, BackwardArgs, ForwardArgs, Grads, LinearAttentionConfig, LinearAttentionSaved, StateGrads,
};
use mesa_kernels::{TensorMut, TensorRef};

use super::{check_dtypes, check_rank, f64_via_f32, tensor_result};
use crate::attach::{attach, Backward};
use crate::bridge::{common_device, dispatch_float, kernel_device, KernelFloat, Output, View};
use crate::error::{Error, KernelResult};

/// The feature map `φ` applied to queries and keys.
#[derive(Debug, Clone)]
pub enum FeatureKind {
    /// `max(x, 0)`.
    Relu,
    /// `elu(x) + 1` (Katharopoulos et al. 2020).
    Elu1,
    /// FAVOR+ positive random features (Choromanski et al. 2020, §2.3): queries stabilised
    /// by their row maximum, keys by the projection's bound (causal) or the sequence maximum
    /// (bidirectional); see `mesa_kernels::feature_map`.
    Favor(Arc<FavorProjection>),
}

/// Linear attention `out_t = Σ_{s≤t} (φ(q_t)·φ(k_s)) v_s / g(φ(q_t)·Σ_{s≤t} φ(k_s))` (causal;
/// bidirectional sums over all `s`), `q, k: [B, H, L, d]`, `v: [B, H, L, D]`, one dtype
/// (f32, f16, bf16, any strides); f16 and bf16 are computed in f32 and rounded once at the
/// results — output and gradients are bitwise the f32 op's on the same values, rounded to
/// the dtype (why: the private `f32_of`) —, f64 is computed in f32 ([`crate::ops`]).
///
/// Forward: the feature-map kernel, then the chunked attention kernel, which keeps its
/// states (per chunk, or the final one only in SLiM mode). Backward: exact gradients of
/// both, with `φ(q)`, `φ(k)` recomputed from `q` and `k` (which candle's graph holds as
/// the op's arguments anyway) — in SLiM mode the op itself keeps nothing of size `L` but the
/// `B·H·L` f32 denominators (when normalised). For f16 and bf16 the op keeps nothing: the
/// backward's normaliser term needs the f32 output, not the rounded one candle holds, so the
/// backward reruns the f32 forward (features, attention and its states) from `q, k, v`
/// first, one more forward pass instead of keeping `B·H·L·D` f32 of output.
#[derive(Debug, Clone)]
pub struct LinearAttention {
    config: LinearAttentionConfig,
    map: FeatureKind,
}

impl LinearAttention {
    /// Attention with `config` (causal or not, normalisation, chunk, memory mode) and `map`.
    #[must_use]
    pub fn new(config: LinearAttentionConfig, map: FeatureKind) -> Self {
        LinearAttention { config, map }
    }

    /// A FAVOR+ map of `features` orthogonal random features for inputs of dimension
    /// `in_dim`, drawn from `seed`, on the kernels' device for `device`.
    ///
    /// # Errors
    /// As `FavorProjection::orthogonal`, as [`Error::Kernel`].
    pub fn favor(
        device: &candle_core::Device,
        features: usize,
        in_dim: usize,
        seed: u64,
    ) -> candle_core::Result<FeatureKind> {
        let kernels = kernel_device(device)?;
        Ok(FeatureKind::Favor(Arc::new(FavorProjection::orthogonal(&kernels, features, in_dim, seed).k()?)))
    }

    fn maps(&self) -> (FeatureMap<'_>, FeatureMap<'_>) {
        match &self.map {
            FeatureKind::Relu => (FeatureMap::Relu, FeatureMap::Relu),
            FeatureKind::Elu1 => (FeatureMap::Elu1, FeatureMap::Elu1),
            FeatureKind::Favor(p) => {
                let keys = if self.config.causal { FavorStabilizer::Bound } else { FavorStabilizer::SequenceMax };
                (
                    FeatureMap::Favor { projection: p, stabilizer: FavorStabilizer::RowMax },
                    FeatureMap::Favor { projection: p, stabilizer: keys },
                )
            }
        }
    }

    /// `q, k: [B, H, L, d]`, `v: [B, H, L, D]` → `[B, H, L, D]`.
    ///
    /// # Errors
    /// [`Error::Rank`] (`q`, `k` or `v` not of rank 4), [`Error::Shape`] (disagreeing `B`,
    /// `H`, `L`, `d`), [`Error::DTypeMismatch`] (not one dtype), [`Error::UnsupportedDType`],
    /// [`Error::DeviceMismatch`], the kernels' errors as [`Error::Kernel`].
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        check_dtypes(
            "linear attention",
            &[(q, "queries [B, H, L, d]"), (k, "keys [B, H, L, d]"), (v, "values [B, H, L, D]")],
        )?;
        if let Some(y) = f64_via_f32("linear attention", &[q, k, v], |t| self.forward(&t[0], &t[1], &t[2]))? {
            return Ok(y);
        }
        check_rank("linear attention queries [B, H, L, d]", q, 4, false)?;
        check_rank("linear attention keys [B, H, L, d]", k, 4, false)?;
        check_rank("linear attention values [B, H, L, D]", v, 4, false)?;
        let (b, h, l, _) = q.dims4()?;
        if k.dims() != q.dims() {
            return Err(
                Error::Shape { what: "keys".into(), expected: q.dims().to_vec(), got: k.dims().to_vec() }.into()
            );
        }
        let dv = v.dims().get(3).copied().unwrap_or(0);
        if v.dims() != [b, h, l, dv] {
            return Err(
                Error::Shape { what: "values".into(), expected: vec![b, h, l, dv], got: v.dims().to_vec() }.into()
            );
        }
        let kernels = common_device("linear attention", &[q, k, v])?;
        if matches!(q.dtype(), DType::F16 | DType::BF16) {
            // computed in f32 from the 16-bit inputs, the output rounded once: see `f32_of`;
            // the states are dropped, the backward reruns this forward (type docs)
            let (out, _) = self.forward_detached::<f32>(&kernels, &f32_of(q)?, &f32_of(k)?, &f32_of(v)?)?;
            let out = tensor_result(&out.into_tensor()?.to_dtype(q.dtype())?)?;
            return attach(&[q, k, v], out, LinearAttentionGrad { op: self.clone(), saved: None, kernels });
        }
        dispatch_float!(q.dtype(), "linear attention", T => {
            let (out, saved) = self.forward_detached::<T>(&kernels, &q.detach(), &k.detach(), &v.detach())?;
            attach(&[q, k, v], out.into_storage()?, LinearAttentionGrad { op: self.clone(), saved: Some(saved), kernels })
        })
    }

    /// The forward on tensors outside any graph: the output (not yet a tensor) and the
    /// attention's saved states.
    pub(crate) fn forward_detached<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Output<T>, LinearAttentionSaved)> {
        let (phi_q, phi_k) = self.features::<T>(kernels, q, k)?;
        self.attention_with_state::<T>(kernels, &phi_q, &phi_k, v, None)
    }

    /// The backward on tensors outside any graph: `(dq, dk, dv)` from the forward's inputs
    /// and output (`φ` recomputed) and the saved states.
    pub(crate) fn backward_detached<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        saved: &LinearAttentionSaved,
        qkv: [&Tensor; 3],
        out: &Tensor,
        dout: &Tensor,
    ) -> candle_core::Result<[Tensor; 3]> {
        let [q, k, _] = qkv;
        let (phi_q, phi_k) = self.features::<T>(kernels, q, k)?;
        self.backward_from_features::<T>(kernels, saved, qkv, [&phi_q, &phi_k], out, dout)
    }

    /// [`LinearAttention::backward_detached`] with `φ(q)`, `φ(k)` given.
    fn backward_from_features<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        saved: &LinearAttentionSaved,
        qkv: [&Tensor; 3],
        phi: [&Tensor; 2],
        out: &Tensor,
        dout: &Tensor,
    ) -> candle_core::Result<[Tensor; 3]> {
        let [q, k, v] = qkv;
        let [phi_q, phi_k] = phi;
        let mut dphi_q = Output::<T>::zeros(q.device(), kernels, phi_q.shape())?;
        let mut dphi_k = Output::<T>::zeros(q.device(), kernels, phi_k.shape())?;
        let mut dv = Output::<T>::zeros(q.device(), kernels, v.shape())?;
        {
            let views = [View::of(phi_q)?, View::of(phi_k)?, View::of(v)?, View::of(out)?, View::of(dout)?];
            let [pq, pk, vv, o, d] = [0, 1, 2, 3, 4].map(|i| views[i].tensor_ref::<T>());
            let (pq, pk, vv, o, d) = (pq?, pk?, vv?, o?, d?);
            let args = LaBackward { q: &pq, k: &pk, v: &vv, out: &o, dout: &d };
            let grads =
                Grads { dq: &mut dphi_q.tensor_mut()?, dk: &mut dphi_k.tensor_mut()?, dv: &mut dv.tensor_mut()? };
            la_backward(kernels, saved, args, grads)?;
        }
        let (dphi_q, dphi_k) = (dphi_q.into_tensor()?, dphi_k.into_tensor()?);
        Ok([
            self.features_backward::<T>(kernels, q, phi_q, &dphi_q, true)?,
            self.features_backward::<T>(kernels, k, phi_k, &dphi_k, false)?,
            dv.into_tensor()?,
        ])
    }

    /// The configuration.
    pub(crate) fn config(&self) -> &LinearAttentionConfig {
        &self.config
    }

    /// `φ(q)`, `φ(k)` by the feature-map kernel (outside any graph).
    pub(crate) fn features_detached<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        self.features::<T>(kernels, q, k)
    }

    /// The feature map's backward: `dx = (∂φ/∂x)ᵀ dφ` from `x`, `φ(x)` and `dφ`, with the
    /// queries' map (`query`) or the keys'.
    pub(crate) fn features_backward<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        x: &Tensor,
        phi: &Tensor,
        dphi: &Tensor,
        query: bool,
    ) -> candle_core::Result<Tensor> {
        let (map_q, map_k) = self.maps();
        let map = if query { map_q } else { map_k };
        let mut dx = Output::<T>::zeros(x.device(), kernels, x.shape())?;
        {
            let (xv, pv, dv) = (View::of(x)?, View::of(phi)?, View::of(dphi)?);
            let (xr, pr, dr) = (xv.tensor_ref::<T>()?, pv.tensor_ref::<T>()?, dv.tensor_ref::<T>()?);
            let args = FeatureBackwardArgs { x: &xr, phi: Some(&pr), dphi: &dr, dx: &mut dx.tensor_mut()? };
            feature_map::backward(kernels, &map, args).k()?;
        }
        dx.into_tensor()
    }

    /// The attention alone (no feature map) on feature-mapped `φ(q)`, `φ(k)` and `v`, from
    /// `initial` (an f32 `[B, H, M, W]` contiguous state, `W = D + normalize`; `None`: zero),
    /// outside any graph (causal: the kernels reject a state otherwise). The output and the
    /// saved states (whose final state includes `initial`).
    pub(crate) fn attention_with_state<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        phi_q: &Tensor,
        phi_k: &Tensor,
        v: &Tensor,
        initial: Option<&Tensor>,
    ) -> candle_core::Result<(Output<T>, LinearAttentionSaved)> {
        let (b, h, l, _) = phi_q.dims4()?;
        let mut out = Output::<T>::zeros(phi_q.device(), kernels, &Shape::from((b, h, l, v.dim(3)?)))?;
        let saved = {
            let (pq, pk, vv) = (View::of(phi_q)?, View::of(phi_k)?, View::of(v)?);
            let s0 = initial.map(View::of).transpose()?;
            let s0 = s0.as_ref().map(View::tensor_ref::<f32>).transpose()?;
            la_forward_with_state(
                kernels,
                &self.config,
                &pq.tensor_ref::<T>()?,
                &pk.tensor_ref::<T>()?,
                &vv.tensor_ref::<T>()?,
                &mut out.tensor_mut()?,
                s0.as_ref(),
            )?
        };
        Ok((out, saved))
    }

    /// The backward of [`LinearAttention::attention_with_state`] with its state gradients:
    /// `[dφ(q), dφ(k), dv]` and the gradient of the initial state (f32 `[B, H, M, W]`), from
    /// the forward's inputs and output, the output's gradient and `d_final`, the final
    /// state's gradient (f32 `[B, H, M, W]` contiguous; `None`: zero).
    pub(crate) fn attention_backward_with_state<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        saved: &LinearAttentionSaved,
        phi_qkv: [&Tensor; 3],
        out: &Tensor,
        dout: &Tensor,
        d_final: Option<&Tensor>,
    ) -> candle_core::Result<([Tensor; 3], Tensor)> {
        let [phi_q, phi_k, v] = phi_qkv;
        let dev = phi_q.device();
        let mut dphi_q = Output::<T>::zeros(dev, kernels, phi_q.shape())?;
        let mut dphi_k = Output::<T>::zeros(dev, kernels, phi_k.shape())?;
        let mut dv = Output::<T>::zeros(dev, kernels, v.shape())?;
        let d = saved.dims();
        let width = d.dim + usize::from(self.config.normalize);
        let mut d_initial = Output::<f32>::zeros(dev, kernels, &Shape::from((d.batch, d.heads, d.feat, width)))?;
        {
            let views = [View::of(phi_q)?, View::of(phi_k)?, View::of(v)?, View::of(out)?, View::of(dout)?];
            let [pq, pk, vv, o, g] = [0, 1, 2, 3, 4].map(|i| views[i].tensor_ref::<T>());
            let (pq, pk, vv, o, g) = (pq?, pk?, vv?, o?, g?);
            let df = d_final.map(View::of).transpose()?;
            let df = df.as_ref().map(View::tensor_ref::<f32>).transpose()?;
            let args = LaBackward { q: &pq, k: &pk, v: &vv, out: &o, dout: &g };
            let grads =
                Grads { dq: &mut dphi_q.tensor_mut()?, dk: &mut dphi_k.tensor_mut()?, dv: &mut dv.tensor_mut()? };
            let mut d_init = d_initial.tensor_mut()?;
            let states = StateGrads { d_final: df.as_ref(), d_initial: Some(&mut d_init) };
            la_backward_with_state(kernels, saved, args, grads, states)?;
        }
        Ok(([dphi_q.into_tensor()?, dphi_k.into_tensor()?, dv.into_tensor()?], d_initial.into_tensor()?))
    }

    /// `φ(q)`, `φ(k)` by the feature-map kernel.
    fn features<T: KernelFloat>(
        &self,
        kernels: &mesa_kernels::Device,
        q: &Tensor,
        k: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (map_q, map_k) = self.maps();
        let phi = |x: &Tensor, map: &FeatureMap<'_>| -> candle_core::Result<Tensor> {
            let mut dims = x.dims().to_vec();
            dims[3] = map.out_dim(dims[3]);
            let mut out = Output::<T>::zeros(x.device(), kernels, &Shape::from(dims))?;
            let view = View::of(x)?;
            feature_map::forward(kernels, map, &view.tensor_ref::<T>()?, &mut out.tensor_mut()?).k()?;
            out.into_tensor()
        };
        Ok((phi(q, &map_q)?, phi(k, &map_k)?))
    }
}

/// A 16-bit input of the op as f32 (outside the graph). With 16-bit inputs the op computes
/// in f32 and rounds only its results: the gradient with respect to the features, `dφ`,
/// grows like `1/z` where a position's normaliser `z = φ(q_t)·Σ_{s≤t} φ(k_s)` is small
/// (FAVOR+ features of a key far below the stabiliser's maximum) and overflows f16 there,
/// although `dk = (∂φ/∂k)ᵀ dφ` is of ordinary size — kept in f16, `dφ` turned such a `dk`
/// into ±inf. The backward reruns the f32 forward instead of reading the output candle
/// holds: the normaliser's term `(dO·O)/z` from the rounded `O` is off by up to `u·|dO||O|/z`,
/// which exceeds one rounding of `dq`, `dk` where that term and the numerator's cancel
/// (values with a common offset: a dq 8e-6 off against 8e-6 allowed, f16).
fn f32_of(t: &Tensor) -> candle_core::Result<Tensor> {
    t.detach().to_dtype(DType::F32)
}

/// The attention forward from an initial state, `None` for zero (thin wrapper over
/// `mesa_kernels::linear_attention::forward_with_state`).
pub(crate) fn la_forward_with_state<'b, T: KernelFloat>(
    kernels: &mesa_kernels::Device,
    config: &LinearAttentionConfig,
    q: &TensorRef<'b, T>,
    k: &TensorRef<'b, T>,
    v: &TensorRef<'b, T>,
    out: &mut TensorMut<'b, T>,
    initial: Option<&TensorRef<'_, f32>>,
) -> candle_core::Result<LinearAttentionSaved> {
    linear_attention::forward_with_state(kernels, config, ForwardArgs { q, k, v, out }, initial).k()
}

/// The tensors of [`la_backward`].
pub(crate) struct LaBackward<'a, 'b, T> {
    pub q: &'a TensorRef<'b, T>,
    pub k: &'a TensorRef<'b, T>,
    pub v: &'a TensorRef<'b, T>,
    pub out: &'a TensorRef<'b, T>,
    pub dout: &'a TensorRef<'b, T>,
}

/// The attention backward (thin wrapper over `mesa_kernels::linear_attention::backward`).
pub(crate) fn la_backward<'b, T: KernelFloat>(
    kernels: &mesa_kernels::Device,
    saved: &LinearAttentionSaved,
    args: LaBackward<'_, 'b, T>,
    grads: Grads<'_, 'b, T>,
) -> candle_core::Result<()> {
    let LaBackward { q, k, v, out, dout } = args;
    linear_attention::backward(kernels, saved, BackwardArgs { q, k, v, out: Some(out), dout, grads }).k()
}

/// [`la_backward`] with the state gradients (thin wrapper over
/// `mesa_kernels::linear_attention::backward_with_state`).
pub(crate) fn la_backward_with_state<'b, T: KernelFloat>(
    kernels: &mesa_kernels::Device,
    saved: &LinearAttentionSaved,
    args: LaBackward<'_, 'b, T>,
    grads: Grads<'_, 'b, T>,
    states: StateGrads<'_, '_>,
) -> candle_core::Result<()> {
    let LaBackward { q, k, v, out, dout } = args;
    let args = BackwardArgs { q, k, v, out: Some(out), dout, grads };
    linear_attention::backward_with_state(kernels, saved, args, states).k()
}

struct LinearAttentionGrad {
    op: LinearAttention,
    /// The forward's states; `None` for 16-bit inputs, whose backward reruns the f32 forward.
    saved: Option<LinearAttentionSaved>,
    kernels: mesa_kernels::Device,
}

impl Backward for LinearAttentionGrad {
    fn name(&self) -> &'static str {
        "mesa-linear-attention"
    }
    fn backward(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let (q, k, v) = (args[0].detach(), args[1].detach(), args[2].detach());
        let dtype = q.dtype();
        let Some(saved) = &self.saved else {
            // 16-bit: the f32 forward again, for its f32 output (`res` is rounded) and states
            let (q, k, v, grad) = (f32_of(&q)?, f32_of(&k)?, f32_of(&v)?, f32_of(grad)?);
            let (phi_q, phi_k) = self.op.features::<f32>(&self.kernels, &q, &k)?;
            let (out, saved) = self.op.attention_with_state::<f32>(&self.kernels, &phi_q, &phi_k, &v, None)?;
            let out = out.into_tensor()?;
            let grads = self.op.backward_from_features::<f32>(
                &self.kernels,
                &saved,
                [&q, &k, &v],
                [&phi_q, &phi_k],
                &out,
                &grad,
            )?;
            return grads.into_iter().map(|g| Ok(Some(g.to_dtype(dtype)?))).collect();
        };
        dispatch_float!(q.dtype(), "linear attention backward", T => {
            let [dq, dk, dv] = self.op.backward_detached::<T>(&self.kernels, saved, [&q, &k, &v], res, grad)?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        })
    }
}
