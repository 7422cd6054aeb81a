//! `MesaOps` for `Autodiff<Flex, C>`: each op registers a hand-written backward whose state
//! is the codes of the tensor the backward needs (plus small statistics and handles to
//! parameters), never the op's full-precision input. The exception is linear attention,
//! whose kernels' backward reads `q`, `k`, `v` and the output: its state holds handles to
//! them (no copies) and the kernels' f32 states.
//!
//! Every op is marked compute-bound: a memory-bound op would, under balanced
//! checkpointing, keep (back up) its full-precision parents to recompute its output, which
//! is exactly what the codes replace.
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::Flex;
use burn::tensor::{DType, Shape};
use mesa_kernels::fused::{
    self, LayerNormBackwardView, LayerNormForward, LayerNormGrads, LayerNormSaveMut, SoftmaxCodes, SoftmaxInput,
    SoftmaxSave, SwigluGrads, SwigluInput, SwigluQuantizers, SwigluSaveMut, SwigluSavedView,
};
use mesa_kernels::linear_attention::{
    self, BackwardArgs, Grads as LaGrads, LinearAttentionConfig, LinearAttentionSaved,
};
use mesa_kernels::{GeluForm, Grouping, Quantizer, SavedView, TensorMut, TensorRef};

use crate::config::Codes;
use crate::host::{self, with_float, HostCodes};
use crate::ops::{
    cast, gelu_plain, layer_norm_plain, linear_attention_forward, linear_plain, rms_norm_plain, rows_2d, softmax_plain,
    swiglu_plain, MesaOps,
};

fn quantizer(codes: &Codes, op: &'static str) -> Quantizer {
    host::expect(Quantizer::new(&host::device(), codes.quant_config()), op)
}

// ---------------------------------------------------------------------------------- GELU

#[derive(Debug)]
struct GeluBackward {
    form: GeluForm,
}

impl Backward<Flex, 1> for GeluBackward {
    /// The codes of `x`.
    type State = Arc<HostCodes>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        unary::<Flex, _>(parents, node, grads, |dy| {
            let dy = host::positive(&dy);
            let layout = host::layout(&dy);
            let shape = layout.shape().to_vec();
            with_float!(host::dtype(&dy), T => {
                let mut dx = host::zeros::<T>(dy.layout().num_elements());
                {
                    let mut dxv = host::expect(TensorMut::contiguous(dx.as_mut_slice(), &shape), "gelu backward");
                    host::expect(
                        fused::gelu_backward_view(&host::device(), self.form, &state.view(), &host::view::<T>(&dy, &layout), &mut dxv),
                        "gelu backward",
                    );
                }
                host::tensor(dx, &shape)
            })
        });
    }
}

fn gelu_save(x: &FlexTensor, form: GeluForm, codes: &Codes) -> (FlexTensor, HostCodes) {
    let x = host::positive(x);
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    let mut q = quantizer(codes, "gelu");
    with_float!(host::dtype(&x), T => {
        let xv = host::view::<T>(&x, &layout);
        let mut y = host::zeros::<T>(x.layout().num_elements());
        let saved = HostCodes::write(&shape, &codes.quant_config(), "gelu", |view| {
            let mut yv = TensorMut::contiguous(y.as_mut_slice(), &shape)?;
            fused::gelu_forward_to(&host::device(), &mut q, form, &xv, &mut yv, view)
        });
        (host::tensor(y, &shape), saved)
    })
}

// ----------------------------------------------------------------------------- LayerNorm

#[derive(Debug)]
struct LayerNormBackward;

/// What the LayerNorm backward keeps: the codes of `x̂`, the per-row `rstd` (f32) and the
/// weight (a handle to the parameter's storage: no copy).
#[derive(Debug, Clone)]
struct LayerNormState {
    xhat: Arc<HostCodes>,
    rstd: Arc<Vec<f32>>,
    weight: FlexTensor,
}

impl Backward<Flex, 3> for LayerNormBackward {
    type State = LayerNormState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [px, pw, pb] = parents;
        let dy = host::positive(&grads.consume::<Flex>(&node));
        let layout = host::layout(&dy);
        let shape = layout.shape().to_vec();
        let cols = *shape.last().expect("rank ≥ 1");
        let w = state.weight.to_contiguous();
        let wdtype = w.dtype();
        let (dx, dw, db) = with_float!(host::dtype(&dy), T => {
            let mut dx = host::zeros::<T>(dy.layout().num_elements());
            let (mut dw, mut db) = (vec![0f32; cols], vec![0f32; cols]);
            {
                let mut dxv = host::expect(TensorMut::contiguous(dx.as_mut_slice(), &shape), "layer_norm backward");
                let mut dwv = host::expect(TensorMut::contiguous(dw.as_mut_slice(), &[cols]), "layer_norm backward");
                let mut dbv = host::expect(TensorMut::contiguous(db.as_mut_slice(), &[cols]), "layer_norm backward");
                let rstd = host::expect(TensorRef::contiguous(state.rstd.as_slice(), &[state.rstd.len()]), "layer_norm backward");
                let wv = host::view::<T>(&w, &host::layout(&w));
                let dyv = host::view::<T>(&dy, &layout);
                let xhat = state.xhat.view();
                let args = LayerNormBackwardView { xhat: &xhat, rstd: &rstd, weight: Some(&wv), dy: &dyv };
                host::expect(
                    fused::layer_norm_backward_view(&host::device(), &args, LayerNormGrads { dx: &mut dxv, dweight: &mut dwv, dbias: &mut dbv }),
                    "layer_norm backward",
                );
            }
            (host::tensor(dx, &shape), host::tensor(dw, &[cols]), host::tensor(db, &[cols]))
        });
        if let Some(p) = px {
            grads.register::<Flex>(p.id, dx);
        }
        if let Some(p) = pw {
            grads.register::<Flex>(p.id, cast(dw, wdtype));
        }
        if let Some(p) = pb {
            grads.register::<Flex>(p.id, cast(db, wdtype));
        }
    }
}

fn layer_norm_save(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: &FlexTensor,
    eps: f32,
    codes: &Codes,
) -> (FlexTensor, LayerNormState) {
    let (x, w, b) = (host::positive(x), weight.to_contiguous(), bias.to_contiguous());
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    let cols = *shape.last().expect("rank ≥ 1");
    let rows = x.layout().num_elements().checked_div(cols).unwrap_or(0);
    let mut q = quantizer(codes, "layer_norm");
    let (mut mean, mut rstd) = (vec![0f32; rows], vec![0f32; rows]);
    with_float!(host::dtype(&x), T => {
        let (xv, wv, bv) = (host::view::<T>(&x, &layout), host::view::<T>(&w, &host::layout(&w)), host::view::<T>(&b, &host::layout(&b)));
        let mut y = host::zeros::<T>(x.layout().num_elements());
        let mut buf = HostCodes::alloc(&shape, &codes.quant_config(), "layer_norm");
        let meta = {
            let mut view = buf.view_mut();
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "layer_norm");
            let mut mv = host::expect(TensorMut::contiguous(mean.as_mut_slice(), &[rows]), "layer_norm");
            let mut rv = host::expect(TensorMut::contiguous(rstd.as_mut_slice(), &[rows]), "layer_norm");
            let args = LayerNormForward { x: &xv, weight: Some(&wv), bias: Some(&bv), eps };
            let save = LayerNormSaveMut { xhat: &mut view, mean: &mut mv, rstd: &mut rv };
            host::expect(fused::layer_norm_forward_to(&host::device(), &mut q, &args, &mut yv, save), "layer_norm")
        };
        let xhat = buf.finish(meta);
        let state = LayerNormState { xhat: Arc::new(xhat), rstd: Arc::new(rstd), weight: w.clone() };
        (host::tensor(y, &shape), state)
    })
}

// -------------------------------------------------------------------------------- Linear

#[derive(Debug)]
struct LinearBackward;

/// What the Linear backward keeps: the codes of `x` and the weight (a handle: no copy).
#[derive(Debug, Clone)]
struct LinearState {
    x: Arc<HostCodes>,
    weight: FlexTensor,
}

impl Backward<Flex, 3> for LinearBackward {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [px, pw, pb] = parents;
        let dy = grads.consume::<Flex>(&node);
        let (dy2, shape) = rows_2d(dy);
        let d_in = state.weight.layout().shape()[0];
        if let Some(p) = px {
            // dx = dy·Wᵀ (exact: W is the parameter itself)
            let dx = Flex::float_matmul(dy2.clone(), Flex::float_transpose(state.weight.clone()));
            let mut xshape = shape.clone();
            *xshape.last_mut().expect("rank ≥ 1") = d_in;
            grads.register::<Flex>(p.id, Flex::float_reshape(dx, Shape::from(xshape)));
        }
        if let Some(p) = pw {
            // dW = Q(x)ᵀ·dy, x decoded from its codes in dy's dtype
            let xq = with_float!(host::dtype(&dy2), T => state.x.decode::<T>());
            let (xq2, _) = rows_2d(xq);
            let dw = Flex::float_matmul(Flex::float_transpose(xq2), dy2.clone());
            grads.register::<Flex>(p.id, cast(dw, state.weight.dtype()));
        }
        if let Some(p) = pb {
            let d_out = dy2.layout().shape()[1];
            let db = Flex::float_reshape(Flex::float_sum_dim(dy2, 0), Shape::from(vec![d_out]));
            grads.register::<Flex>(p.id, cast(db, state.weight.dtype()));
        }
    }
}

fn quantize_input(x: &FlexTensor, codes: &Codes) -> HostCodes {
    let x = host::positive(x);
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    let mut q = quantizer(codes, "linear");
    with_float!(host::dtype(&x), T => {
        let xv = host::view::<T>(&x, &layout);
        HostCodes::write(&shape, &codes.quant_config(), "linear", |view| q.quantize_to(&xv, view))
    })
}

// ------------------------------------------------------------------------------- RMSNorm

#[derive(Debug)]
struct RmsNormBackward;

/// What the RMSNorm backward keeps: the codes of `x̂` (f32 `[rows, C]`), `rstd` (`[rows, 1]`
/// f32) and the weight (a handle: no copy).
#[derive(Debug, Clone)]
struct RmsNormState {
    xhat: Arc<HostCodes>,
    rstd: FlexTensor,
    weight: FlexTensor,
}

impl Backward<Flex, 2> for RmsNormBackward {
    type State = RmsNormState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [px, pw] = parents;
        let dy = grads.consume::<Flex>(&node);
        let dtype = dy.dtype();
        let (dy2, shape) = rows_2d(cast(dy, DType::F32));
        let cols = dy2.layout().shape()[1];
        let xt = state.xhat.decode::<f32>();
        if let Some(p) = px {
            // dx = rstd·(g − x̃·mean(g·x̃)), g = dy·w
            let w = Flex::float_reshape(cast(state.weight.clone(), DType::F32), Shape::from(vec![1, cols]));
            let g = Flex::float_mul(dy2.clone(), w);
            let m = Flex::float_mean_dim(Flex::float_mul(g.clone(), xt.clone()), 1);
            let dx = Flex::float_mul(Flex::float_sub(g, Flex::float_mul(xt.clone(), m)), state.rstd.clone());
            grads.register::<Flex>(p.id, cast(Flex::float_reshape(dx, Shape::from(shape)), dtype));
        }
        if let Some(p) = pw {
            // dw = Σ_rows dy·x̃
            let dw = Flex::float_reshape(Flex::float_sum_dim(Flex::float_mul(dy2, xt), 0), Shape::from(vec![cols]));
            grads.register::<Flex>(p.id, cast(dw, state.weight.dtype()));
        }
    }
}

// ------------------------------------------------------------------------------- softmax

#[derive(Debug)]
struct SoftmaxBackward;

/// `dx` from the codes of `y`, registered for `x` (parent 0) and for an additive mask
/// (parent 1): `y = softmax(x + m)`, so `dm = dx`. A broadcast mask was expanded by
/// [`crate::softmax`] before dispatch, and the expand's own backward sums `dm` over the
/// broadcast axes.
fn softmax_backward(parents: &[Option<NodeId>], dy: FlexTensor, y: &HostCodes, grads: &mut Gradients) {
    if parents.iter().all(Option::is_none) {
        return;
    }
    let dy = host::positive(&dy);
    let layout = host::layout(&dy);
    let shape = layout.shape().to_vec();
    let dx = with_float!(host::dtype(&dy), T => {
        let mut dx = host::zeros::<T>(dy.layout().num_elements());
        {
            let mut dxv = host::expect(TensorMut::contiguous(dx.as_mut_slice(), &shape), "softmax backward");
            host::expect(
                fused::softmax_backward_view(&host::device(), &y.view(), &host::view::<T>(&dy, &layout), &mut dxv),
                "softmax backward",
            );
        }
        host::tensor(dx, &shape)
    });
    for id in parents.iter().flatten() {
        grads.register::<Flex>(*id, dx.clone());
    }
}

impl Backward<Flex, 1> for SoftmaxBackward {
    /// The codes of `y`.
    type State = Arc<HostCodes>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<Flex>(&ops.node);
        let [px] = ops.parents;
        softmax_backward(&[px.map(|p| p.id)], dy, &ops.state, grads);
    }
}

impl Backward<Flex, 2> for SoftmaxBackward {
    /// The codes of `y`.
    type State = Arc<HostCodes>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<Flex>(&ops.node);
        let [px, pm] = ops.parents;
        softmax_backward(&[px.map(|p| p.id), pm.map(|p| p.id)], dy, &ops.state, grads);
    }
}

/// The save configuration of softmax's codes: square-root companded, one group.
pub(crate) fn softmax_save_config(codes: &Codes) -> SoftmaxSave {
    SoftmaxSave { bits: codes.bits, codes: SoftmaxCodes::Sqrt, grouping: Grouping::Tensor, rounding: codes.rounding }
}

fn softmax_save(x: &FlexTensor, mask: Option<&FlexTensor>, codes: &Codes) -> (FlexTensor, HostCodes) {
    let x = host::positive(x);
    let mask = mask.map(host::positive);
    let layout = host::layout(&x);
    let shape = layout.shape().to_vec();
    let save = softmax_save_config(codes);
    with_float!(host::dtype(&x), T => {
        let xv = host::view::<T>(&x, &layout);
        let ml = mask.as_ref().map(host::layout);
        let mv = mask.as_ref().zip(ml.as_ref()).map(|(m, l)| host::view::<T>(m, l));
        let mut input = SoftmaxInput::new(&xv);
        if let Some(mv) = mv.as_ref() {
            input = input.with_mask(mv);
        }
        let mut y = host::zeros::<T>(x.layout().num_elements());
        let mut buf = HostCodes::alloc_sized(host::expect(save.saved_sizes(&shape), "softmax"), "softmax");
        let meta = {
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "softmax");
            host::expect(fused::softmax_forward_to(&host::device(), &save, &input, &mut yv, &mut buf.view_mut()), "softmax")
        };
        (host::tensor(y, &shape), buf.finish(meta))
    })
}

// -------------------------------------------------------------------------------- SwiGLU

#[derive(Debug)]
struct SwigluBackward;

/// What the SwiGLU backward keeps: the codes of `gate` and of `up`.
#[derive(Debug, Clone)]
struct SwigluState {
    gate: Arc<HostCodes>,
    up: Arc<HostCodes>,
}

impl Backward<Flex, 2> for SwigluBackward {
    type State = SwigluState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [pg, pu] = parents;
        let dy = host::positive(&grads.consume::<Flex>(&node));
        let layout = host::layout(&dy);
        let shape = layout.shape().to_vec();
        let (dg, du) = with_float!(host::dtype(&dy), T => {
            let n = dy.layout().num_elements();
            let (mut dg, mut du) = (host::zeros::<T>(n), host::zeros::<T>(n));
            {
                let mut dgv = host::expect(TensorMut::contiguous(dg.as_mut_slice(), &shape), "swiglu backward");
                let mut duv = host::expect(TensorMut::contiguous(du.as_mut_slice(), &shape), "swiglu backward");
                let (gv, uv): (SavedView<'_>, SavedView<'_>) = (state.gate.view(), state.up.view());
                host::expect(
                    fused::swiglu_backward_view(
                        &host::device(),
                        SwigluSavedView { gate: &gv, up: &uv },
                        &host::view::<T>(&dy, &layout),
                        SwigluGrads { gate: &mut dgv, up: &mut duv },
                    ),
                    "swiglu backward",
                );
            }
            (host::tensor(dg, &shape), host::tensor(du, &shape))
        });
        if let Some(p) = pg {
            grads.register::<Flex>(p.id, dg);
        }
        if let Some(p) = pu {
            grads.register::<Flex>(p.id, du);
        }
    }
}

fn swiglu_save(gate: &FlexTensor, up: &FlexTensor, codes: &Codes) -> (FlexTensor, SwigluState) {
    let (g, u) = (host::positive(gate), host::positive(up));
    let (gl, ul) = (host::layout(&g), host::layout(&u));
    let shape = gl.shape().to_vec();
    let config = codes.quant_config();
    let (mut qg, mut qu) = (quantizer(codes, "swiglu"), quantizer(codes, "swiglu"));
    with_float!(host::dtype(&g), T => {
        let (gv, uv) = (host::view::<T>(&g, &gl), host::view::<T>(&u, &ul));
        let mut y = host::zeros::<T>(g.layout().num_elements());
        let (mut bg, mut bu) = (HostCodes::alloc(&shape, &config, "swiglu"), HostCodes::alloc(&shape, &config, "swiglu"));
        let meta = {
            let mut yv = host::expect(TensorMut::contiguous(y.as_mut_slice(), &shape), "swiglu");
            let (mut vg, mut vu) = (bg.view_mut(), bu.view_mut());
            host::expect(
                fused::swiglu_forward_to(
                    &host::device(),
                    SwigluQuantizers { gate: &mut qg, up: &mut qu },
                    &SwigluInput { gate: &gv, up: &uv },
                    &mut yv,
                    SwigluSaveMut { gate: &mut vg, up: &mut vu },
                ),
                "swiglu",
            )
        };
        let state = SwigluState { gate: Arc::new(bg.finish(meta.gate)), up: Arc::new(bu.finish(meta.up)) };
        (host::tensor(y, &shape), state)
    })
}

// ---------------------------------------------------------------------- linear attention

#[derive(Debug)]
struct LinearAttentionBackward;

/// What linear attention's backward keeps: handles to `q`, `k`, `v` and the output (the
/// kernels' backward reads them; no copies) and the kernels' saved states.
#[derive(Debug, Clone)]
struct LinearAttentionState {
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    out: FlexTensor,
    saved: Arc<LinearAttentionSaved>,
}

impl Backward<Flex, 3> for LinearAttentionBackward {
    type State = LinearAttentionState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [pq, pk, pv] = parents;
        let dout = host::positive(&grads.consume::<Flex>(&node));
        let (q, k, v, out) =
            (host::positive(&state.q), host::positive(&state.k), host::positive(&state.v), host::positive(&state.out));
        let (ql, kl, vl, ol, dl) =
            (host::layout(&q), host::layout(&k), host::layout(&v), host::layout(&out), host::layout(&dout));
        let (qs, vs) = (ql.shape().to_vec(), vl.shape().to_vec());
        let (dq, dk, dv) = with_float!(host::dtype(&dout), T => {
            let (mut dq, mut dk, mut dv) = (host::zeros::<T>(q.layout().num_elements()), host::zeros::<T>(k.layout().num_elements()), host::zeros::<T>(v.layout().num_elements()));
            {
                let mut dqv = host::expect(TensorMut::contiguous(dq.as_mut_slice(), &qs), "linear_attention backward");
                let mut dkv = host::expect(TensorMut::contiguous(dk.as_mut_slice(), &qs), "linear_attention backward");
                let mut dvv = host::expect(TensorMut::contiguous(dv.as_mut_slice(), &vs), "linear_attention backward");
                let (qv, kv, vv, ov, dov) = (
                    host::view::<T>(&q, &ql),
                    host::view::<T>(&k, &kl),
                    host::view::<T>(&v, &vl),
                    host::view::<T>(&out, &ol),
                    host::view::<T>(&dout, &dl),
                );
                let args = BackwardArgs {
                    q: &qv,
                    k: &kv,
                    v: &vv,
                    out: Some(&ov),
                    dout: &dov,
                    grads: LaGrads { dq: &mut dqv, dk: &mut dkv, dv: &mut dvv },
                };
                host::expect(linear_attention::backward(&host::device(), &state.saved, args), "linear_attention backward");
            }
            (host::tensor(dq, &qs), host::tensor(dk, &qs), host::tensor(dv, &vs))
        });
        for (p, g) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(p) = p {
                grads.register::<Flex>(p.id, g);
            }
        }
    }
}

// ------------------------------------------------------------------------------ the impl

impl<C: CheckpointStrategy> MesaOps for Autodiff<Flex, C> {
    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, codes: Codes) -> FloatTensor<Self> {
        let (x, guard) = x.into_parts();
        match (GeluBackward { form }).prepare::<C>([guard]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, saved) = gelu_save(&x, form, &codes);
                // x is dropped here: the node keeps only `saved`
                drop(x);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(gelu_plain(&x, form)),
        }
    }

    fn mesa_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        codes: Codes,
    ) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (w, gw) = weight.into_parts();
        let (b, gb) = bias.into_parts();
        match LayerNormBackward.prepare::<C>([gx, gw, gb]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, state) = layer_norm_save(&x, &w, &b, eps, &codes);
                drop(x);
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(layer_norm_plain(&x, &w, &b, eps)),
        }
    }

    fn mesa_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        codes: Codes,
    ) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (w, gw) = weight.into_parts();
        let (b, gb) = bias.into_parts();
        match LinearBackward.prepare::<C>([gx, gw, gb]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let saved = quantize_input(&x, &codes);
                let y = linear_plain(x, w.clone(), b);
                prep.finish(LinearState { x: Arc::new(saved), weight: w }, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(linear_plain(x, w, b)),
        }
    }

    fn mesa_rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32, codes: Codes) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (w, gw) = weight.into_parts();
        match RmsNormBackward.prepare::<C>([gx, gw]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, xhat, rstd) = rms_norm_plain(x, w.clone(), eps);
                let saved = quantize_input(&xhat, &codes);
                drop(xhat);
                prep.finish(RmsNormState { xhat: Arc::new(saved), rstd, weight: w }, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(rms_norm_plain(x, w, eps).0),
        }
    }

    fn mesa_softmax(x: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        match <SoftmaxBackward as Backward<Flex, 1>>::prepare::<C>(SoftmaxBackward, [gx]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, saved) = softmax_save(&x, None, &codes);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(softmax_plain(&x, None)),
        }
    }

    fn mesa_softmax_masked(x: FloatTensor<Self>, mask: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (m, gm) = mask.into_parts();
        match <SoftmaxBackward as Backward<Flex, 2>>::prepare::<C>(SoftmaxBackward, [gx, gm]).compute_bound().stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, saved) = softmax_save(&x, Some(&m), &codes);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(softmax_plain(&x, Some(&m))),
        }
    }

    fn mesa_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self> {
        let (g, gg) = gate.into_parts();
        let (u, gu) = up.into_parts();
        match SwigluBackward.prepare::<C>([gg, gu]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, state) = swiglu_save(&g, &u, &codes);
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(swiglu_plain(&g, &u)),
        }
    }

    fn mesa_linear_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        config: LinearAttentionConfig,
    ) -> FloatTensor<Self> {
        let (q, gq) = q.into_parts();
        let (k, gk) = k.into_parts();
        let (v, gv) = v.into_parts();
        match LinearAttentionBackward.prepare::<C>([gq, gk, gv]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, saved) = linear_attention_forward(&q, &k, &v, &config);
                let state = LinearAttentionState { q, k, v, out: out.clone(), saved: Arc::new(saved) };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(linear_attention_forward(&q, &k, &v, &config).0),
        }
    }
}
