//! `MesaOps` for `Autodiff<Flex, C>`: each op registers a hand-written backward whose state
//! is the codes of the tensor the backward needs (plus small statistics and handles to
//! parameters), never the op's full-precision input.
//!
//! Every op is marked compute-bound: a memory-bound op would, under balanced
//! checkpointing, keep (back up) its full-precision parents to recompute its output, which
//! is exactly what the codes replace.
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::Flex;
use burn::tensor::{DType, FloatDType, Shape};
use mesa_kernels::fused::{self, LayerNormBackwardView, LayerNormForward, LayerNormGrads, LayerNormSaveMut};
use mesa_kernels::{GeluForm, Quantizer, TensorMut, TensorRef};

use crate::config::Codes;
use crate::host::{self, with_float, HostCodes};
use crate::ops::{gelu_plain, layer_norm_plain, linear_plain, rows_2d, MesaOps};

fn quantizer(codes: &Codes, op: &'static str) -> Quantizer {
    host::expect(Quantizer::new(&host::device(), codes.quant_config()), op)
}

/// `t` cast to `dtype` (a no-op when it already has it).
fn cast(t: FlexTensor, dtype: DType) -> FlexTensor {
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
}
