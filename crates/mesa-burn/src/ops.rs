//! The backend extension [`MesaOps`]: what `burn::backend::Dispatch` routes to, implemented
//! for `Flex` (inference: nothing saved) and for `Autodiff<Flex, C>` (the forward saves
//! codes; the hand-written backward reads them); with the `cuda` feature also for burn's
//! `CubeBackend` and `Autodiff<CubeBackend, C>`, with `fusion` for `Fusion<CubeBackend>`
//! (generated here by the `Fusion` selector) and `Autodiff<Fusion<CubeBackend>, C>`
//! (type-checked only, never run: docs/burn.md, "CUDA", "Fusion").
//!
//! Call these through the crate's functions ([`crate::gelu`], [`crate::layer_norm`],
//! [`crate::rms_norm`], [`crate::linear`], [`crate::softmax`], [`crate::swiglu`],
//! [`crate::linear_attention`]), which validate first: the trait methods themselves trust their arguments (a bad one panics
//! inside the backend, which is what the validating functions exist to prevent).
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Flex};
use burn::tensor::{DType, FloatDType, Shape};
use mesa_kernels::fused::{self, LayerNormForward, SoftmaxInput, SwigluInput};
use mesa_kernels::linear_attention::{self, ForwardArgs, LinearAttentionConfig, LinearAttentionSaved};
use mesa_kernels::{GeluForm, TensorMut};

use crate::config::Codes;
use crate::host::{self, with_float};

/// mesa-kernels' ops as one burn backend extension. Shapes are given per method; every
/// float tensor of one call has the same dtype (f32, f16 or bf16).
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cuda"), Fusion: cfg(feature = "fusion"))]
pub trait MesaOps: Backend {
    /// `y = gelu(x)` elementwise (`form`: erf or tanh), any shape. Under autodiff the
    /// backward keeps the codes of `x` (`codes`), not `x`.
    #[fusion(dtype = x, shape = x)]
    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, codes: Codes) -> FloatTensor<Self>;

    /// LayerNorm over the last axis: `y = (x − mean)·rstd·weight + bias`,
    /// `rstd = 1/sqrt(var + eps)` (biased variance). `x`: rank ≥ 1, last axis `C`;
    /// `weight`, `bias`: `[C]`. Under autodiff the backward keeps the codes of
    /// `x̂ = (x − mean)·rstd`, the per-row `rstd` (f32) and a handle to `weight` (no copy).
    #[fusion(dtype = x, shape = x)]
    fn mesa_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        codes: Codes,
    ) -> FloatTensor<Self>;

    /// `y = x·weight + bias` over the last axis (burn-nn's row layout). `x`: `[.., d_in]`,
    /// `weight`: `[d_in, d_out]`, `bias`: `[d_out]`; `y`: `[.., d_out]`. Under autodiff the
    /// backward keeps the codes of `x` and a handle to `weight` (no copy): `dx = dy·weightᵀ`
    /// exactly, `dweight = Q(x)ᵀ·dy` from the decoded codes, `dbias = Σ_rows dy`.
    #[fusion(dtype = x, shape = linear_shape(x, weight))]
    fn mesa_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        codes: Codes,
    ) -> FloatTensor<Self>;

    /// RMSNorm over the last axis: `y = x·rstd·weight`, `rstd = 1/sqrt(mean(x²) + eps)`,
    /// computed with Flex's own ops in f32 (as burn-nn's `RmsNorm`). `x`: rank ≥ 1, last axis
    /// `C`; `weight`: `[C]`. Under autodiff the backward keeps the codes of `x̂ = x·rstd`
    /// (f32), the per-row `rstd` (f32) and a handle to `weight`.
    #[fusion(dtype = x, shape = x)]
    fn mesa_rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32, codes: Codes) -> FloatTensor<Self>;

    /// Softmax over the last axis, `y = softmax(x)`, rank ≥ 1. Under autodiff the backward
    /// keeps square-root companded codes of `y` (fixed parameters: no statistics).
    #[fusion(dtype = x, shape = x)]
    fn mesa_softmax(x: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self>;

    /// [`MesaOps::mesa_softmax`] of `x + mask` (additive mask of `x`'s shape, `−inf` allowed;
    /// a fully masked row gives 0). Under autodiff a tracked mask gets `dmask = dx`.
    #[fusion(dtype = x, shape = x)]
    fn mesa_softmax_masked(x: FloatTensor<Self>, mask: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self>;

    /// SwiGLU, `y = silu(gate)·up` elementwise (`gate`, `up`, `y` one shape). Under autodiff
    /// the backward keeps the codes of `gate` and of `up`.
    #[fusion(dtype = gate, shape = gate)]
    fn mesa_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self>;

    /// Chunked linear attention (mesa-kernels' kernels): `q, k: [B, H, L, M]` (feature-mapped),
    /// `v: [B, H, L, D]` → `[B, H, L, D]`, causal or not, normalised or not (`config`). Under
    /// autodiff the backward keeps handles to `q`, `k`, `v` and the output (no copies; the
    /// kernels' backward reads them) and the kernels' saved states and denominators (f32).
    #[fusion(dtype = q, shape = v)]
    fn mesa_linear_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        config: LinearAttentionConfig,
    ) -> FloatTensor<Self>;
}

/// `[.., d_out]`: Linear's output shape for `x` `[.., d_in]` and `weight` `[d_in, d_out]` (the
/// Fusion selector's output metadata).
#[cfg(feature = "fusion")]
fn linear_shape(x: &Shape, weight: &Shape) -> Shape {
    let mut shape = x.clone();
    let last = shape.len() - 1;
    shape[last] = weight[1];
    shape
}

impl MesaOps for Flex {
    fn mesa_rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32, _codes: Codes) -> FloatTensor<Self> {
        rms_norm_plain(x, weight, eps).0
    }

    fn mesa_softmax(x: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        softmax_plain(&x, None)
    }

    fn mesa_softmax_masked(x: FloatTensor<Self>, mask: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        softmax_plain(&x, Some(&mask))
    }

    fn mesa_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        swiglu_plain(&gate, &up)
    }

    fn mesa_linear_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        config: LinearAttentionConfig,
    ) -> FloatTensor<Self> {
        linear_attention_forward(&q, &k, &v, &config).0
    }

    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, _codes: Codes) -> FloatTensor<Self> {
        gelu_plain(&x, form)
    }

    fn mesa_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        layer_norm_plain(&x, &weight, &bias, eps)
    }

    fn mesa_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        linear_plain(x, weight, bias)
    }
}

/// GELU without saving anything (the emulator's plain kernel).
pub(crate) fn gelu_plain(x: &FlexTensor, form: GeluForm) -> FlexTensor {
    let x = host::positive(x);
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    with_float!(host::dtype(&x), T => {
        let mut y = host::zeros::<T>(x.layout().num_elements());
        {
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "gelu");
            host::expect(fused::gelu(&host::device(), form, &host::view::<T>(&x, &layout), &mut yv), "gelu");
        }
        host::tensor(y, &shape)
    })
}

/// LayerNorm without saving anything.
pub(crate) fn layer_norm_plain(x: &FlexTensor, weight: &FlexTensor, bias: &FlexTensor, eps: f32) -> FlexTensor {
    let (x, w, b) = (host::positive(x), weight.to_contiguous(), bias.to_contiguous());
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    with_float!(host::dtype(&x), T => {
        let (xv, wv, bv) = (host::view::<T>(&x, &layout), host::view::<T>(&w, &host::layout(&w)), host::view::<T>(&b, &host::layout(&b)));
        let mut y = host::zeros::<T>(x.layout().num_elements());
        {
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "layer_norm");
            let args = LayerNormForward { x: &xv, weight: Some(&wv), bias: Some(&bv), eps };
            host::expect(fused::layer_norm(&host::device(), &args, &mut yv), "layer_norm");
        }
        host::tensor(y, &shape)
    })
}

/// `x` as `[rows, last]` (rows = product of the leading axes).
pub(crate) fn rows_2d(x: FlexTensor) -> (FlexTensor, Vec<usize>) {
    let shape: Vec<usize> = x.layout().shape().to_vec();
    let last = *shape.last().expect("rank ≥ 1 (validated)");
    let rows = shape[..shape.len() - 1].iter().product::<usize>();
    (Flex::float_reshape(x, Shape::from(vec![rows, last])), shape)
}

/// `x·weight + bias` with Flex's own matmul (exact, the same as burn's linear).
pub(crate) fn linear_plain(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
    let d_out = weight.layout().shape()[1];
    let (x2, mut shape) = rows_2d(x);
    let y = Flex::float_matmul(x2, weight);
    let y = Flex::float_add(y, Flex::float_reshape(bias, Shape::from(vec![1, d_out])));
    *shape.last_mut().expect("rank ≥ 1") = d_out;
    Flex::float_reshape(y, Shape::from(shape))
}

/// `t` cast to `dtype` (a no-op when it already has it).
pub(crate) fn cast(t: FlexTensor, dtype: DType) -> FlexTensor {
    if t.dtype() == dtype {
        return t;
    }
    let to = match dtype {
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => FloatDType::F32,
    };
    Flex::float_cast(t, to)
}

/// RMSNorm with Flex's ops in f32: `(y in x's dtype, x̂ [rows, C] f32, rstd [rows, 1] f32)`.
pub(crate) fn rms_norm_plain(x: FlexTensor, weight: FlexTensor, eps: f32) -> (FlexTensor, FlexTensor, FlexTensor) {
    let dtype = x.dtype();
    let (x2, shape) = rows_2d(cast(x, DType::F32));
    let cols = x2.layout().shape()[1];
    let ms = Flex::float_mean_dim(Flex::float_mul(x2.clone(), x2.clone()), 1);
    let rstd = Flex::float_recip(Flex::float_sqrt(Flex::float_add_scalar(ms, eps.into())));
    let xhat = Flex::float_mul(x2, rstd.clone());
    let w = Flex::float_reshape(cast(weight, DType::F32), Shape::from(vec![1, cols]));
    let y = Flex::float_reshape(Flex::float_mul(xhat.clone(), w), Shape::from(shape));
    (cast(y, dtype), xhat, rstd)
}

/// Softmax (optionally masked) without saving anything.
pub(crate) fn softmax_plain(x: &FlexTensor, mask: Option<&FlexTensor>) -> FlexTensor {
    let x = host::positive(x);
    let mask = mask.map(host::positive);
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    with_float!(host::dtype(&x), T => {
        let xv = host::view::<T>(&x, &layout);
        let ml = mask.as_ref().map(host::layout);
        let mv = mask.as_ref().zip(ml.as_ref()).map(|(m, l)| host::view::<T>(m, l));
        let mut input = SoftmaxInput::new(&xv);
        if let Some(mv) = mv.as_ref() {
            input = input.with_mask(mv);
        }
        let mut y = host::zeros::<T>(x.layout().num_elements());
        {
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "softmax");
            host::expect(fused::softmax(&host::device(), &input, &mut yv), "softmax");
        }
        host::tensor(y, &shape)
    })
}

/// SwiGLU without saving anything.
pub(crate) fn swiglu_plain(gate: &FlexTensor, up: &FlexTensor) -> FlexTensor {
    let (g, u) = (host::positive(gate), host::positive(up));
    let (gl, ul) = (host::layout(&g), host::layout(&u));
    let shape = gl.shape().to_vec();
    with_float!(host::dtype(&g), T => {
        let (gv, uv) = (host::view::<T>(&g, &gl), host::view::<T>(&u, &ul));
        let mut y = host::zeros::<T>(g.layout().num_elements());
        {
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "swiglu");
            host::expect(fused::swiglu(&host::device(), &SwigluInput { gate: &gv, up: &uv }, &mut yv), "swiglu");
        }
        host::tensor(y, &shape)
    })
}

/// Linear attention's forward on the emulator: the output (contiguous, `v`'s shape) and what
/// its backward needs.
pub(crate) fn linear_attention_forward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    config: &LinearAttentionConfig,
) -> (FlexTensor, LinearAttentionSaved) {
    let (q, k, v) = (host::positive(q), host::positive(k), host::positive(v));
    let (ql, kl, vl) = (host::layout(&q), host::layout(&k), host::layout(&v));
    let shape = vl.shape().to_vec();
    with_float!(host::dtype(&q), T => {
        let (qv, kv, vv) = (host::view::<T>(&q, &ql), host::view::<T>(&k, &kl), host::view::<T>(&v, &vl));
        let mut out = host::zeros::<T>(v.layout().num_elements());
        let saved = {
            let mut ov = host::expect(TensorMut::contiguous(out.as_mut_slice(), &shape), "linear_attention");
            host::expect(
                linear_attention::forward(&host::device(), config, ForwardArgs { q: &qv, k: &kv, v: &vv, out: &mut ov }),
                "linear_attention",
            )
        };
        (host::tensor(out, &shape), saved)
    })
}
