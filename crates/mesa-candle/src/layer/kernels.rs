//! Tensor-level calls of our kernels for the layer: tensors of one device in the layer's
//! compute dtype (f32, f16 or bf16; each call dispatches on its input's dtype, and the
//! kernels compute in f32).
use candle_core::{DType, Tensor};
use mesa_kernels::fused::{
    gelu_backward, gelu_forward, layer_norm_backward, layer_norm_forward, softmax, softmax_backward,
    softmax_backward_plain, softmax_forward, LayerNormBackward, LayerNormForward, LayerNormGrads, SoftmaxBackwardPlain,
    SoftmaxInput,
};
use mesa_kernels::fused::{swiglu_backward, swiglu_forward, SavedSwiglu, SwigluGrads, SwigluInput, SwigluQuantizers};
use mesa_kernels::rope::{rope, rope_backward, rope_forward_save, RopeConfig};
use mesa_kernels::{GeluForm, Quantizer, SavedActivation, SavedLayerNorm, SoftmaxSave};

use crate::bridge::{dispatch_float, KernelFloat, Output, View};
use crate::error::KernelResult;

/// What the layer's kernels run on: the candle device and its kernel device.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    pub candle: candle_core::Device,
    pub kernels: mesa_kernels::Device,
}

const OP: &str = "transformer layer";

impl Ctx {
    fn out<T: KernelFloat>(&self, shape: &candle_core::Shape) -> candle_core::Result<Output<T>> {
        Output::<T>::zeros(&self.candle, &self.kernels, shape)
    }

    /// Codes of `x` by `q` (the forward's [`super::forward::Quantizers`]).
    pub fn quantize(&self, x: &Tensor, q: &mut Quantizer) -> candle_core::Result<SavedActivation> {
        let view = View::of(x)?;
        dispatch_float!(x.dtype(), OP, T => q.quantize(&view.tensor_ref::<T>()?).k())
    }

    /// The decoded tensor of `saved` (shape and dtype of the original).
    pub fn decode(&self, saved: &SavedActivation) -> candle_core::Result<Tensor> {
        let dtype = match saved.dtype() {
            mesa_kernels::DType::F16 => candle_core::DType::F16,
            mesa_kernels::DType::BF16 => candle_core::DType::BF16,
            _ => candle_core::DType::F32,
        };
        dispatch_float!(dtype, OP, T => {
            let mut out = self.out::<T>(&candle_core::Shape::from(saved.shape()))?;
            saved.dequantize(&self.kernels, &mut out.tensor_mut()?).k()?;
            out.into_tensor()
        })
    }

    /// LayerNorm forward saving `x̂` codes and statistics.
    pub fn layer_norm(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        eps: f32,
        q: &mut Quantizer,
    ) -> candle_core::Result<(Tensor, SavedLayerNorm)> {
        let (wc, bc) = (w.contiguous()?, b.contiguous()?);
        dispatch_float!(x.dtype(), OP, T => {
            let mut y = self.out::<T>(x.shape())?;
            let saved = {
                let (xv, wv, bv) = (View::of(x)?, View::of(&wc)?, View::of(&bc)?);
                let (xr, wr, br) = (xv.tensor_ref::<T>()?, wv.tensor_ref::<T>()?, bv.tensor_ref::<T>()?);
                let args = LayerNormForward { x: &xr, weight: Some(&wr), bias: Some(&br), eps };
                layer_norm_forward(&self.kernels, q, &args, &mut y.tensor_mut()?).k()?
            };
            Ok((y.into_tensor()?, saved))
        })
    }

    /// LayerNorm backward: `(dx, dw, db)`.
    pub fn layer_norm_backward(
        &self,
        saved: &SavedLayerNorm,
        w: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let cols = candle_core::Shape::from(w.dims());
        let wc = w.contiguous()?;
        dispatch_float!(dy.dtype(), OP, T => {
            let (mut dx, mut dw, mut db) = (self.out::<T>(dy.shape())?, self.out::<f32>(&cols)?, self.out::<f32>(&cols)?);
            {
                let (gv, wv) = (View::of(dy)?, View::of(&wc)?);
                let (gr, wr) = (gv.tensor_ref::<T>()?, wv.tensor_ref::<T>()?);
                let args = LayerNormBackward { saved, weight: Some(&wr), dy: &gr };
                let grads = LayerNormGrads {
                    dx: &mut dx.tensor_mut()?,
                    dweight: &mut dw.tensor_mut()?,
                    dbias: &mut db.tensor_mut()?,
                };
                layer_norm_backward(&self.kernels, &args, grads).k()?;
            }
            Ok((dx.into_tensor()?, dw.into_tensor()?, db.into_tensor()?))
        })
    }

    /// `x̂·w + b` from the saved codes of a LayerNorm: its output, decoded.
    pub fn layer_norm_output(&self, saved: &SavedLayerNorm, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        self.decode(saved.xhat())?.broadcast_mul(w)?.broadcast_add(b)
    }

    /// Softmax over the last axis with an additive mask; codes of the output when `save`.
    pub fn softmax(
        &self,
        s: &Tensor,
        mask: Option<&Tensor>,
        save: Option<&SoftmaxSave>,
    ) -> candle_core::Result<(Tensor, Option<SavedActivation>)> {
        let mask = mask.map(|m| m.to_dtype(s.dtype())?.broadcast_as(s.shape())).transpose()?;
        dispatch_float!(s.dtype(), OP, T => {
            let mut y = self.out::<T>(s.shape())?;
            let saved = {
                let sv = View::of(s)?;
                let mv = mask.as_ref().map(View::of).transpose()?;
                let sr = sv.tensor_ref::<T>()?;
                let mr = mv.as_ref().map(|m| m.tensor_ref::<T>()).transpose()?;
                let input = SoftmaxInput { x: &sr, mask: mr.as_ref() };
                match save {
                    Some(save) => Some(softmax_forward(&self.kernels, save, &input, &mut y.tensor_mut()?).k()?),
                    None => {
                        softmax(&self.kernels, &input, &mut y.tensor_mut()?).k()?;
                        None
                    }
                }
            };
            Ok((y.into_tensor()?, saved))
        })
    }

    /// Softmax backward from codes, or from a full-precision (recomputed) output.
    pub fn softmax_backward(&self, p: SoftmaxSource<'_>, dp: &Tensor) -> candle_core::Result<Tensor> {
        dispatch_float!(dp.dtype(), OP, T => {
            let mut ds = self.out::<T>(dp.shape())?;
            {
                let dv = View::of(dp)?;
                let dr = dv.tensor_ref::<T>()?;
                match p {
                    SoftmaxSource::Codes(saved) => {
                        softmax_backward(&self.kernels, saved, &dr, &mut ds.tensor_mut()?).k()?
                    }
                    SoftmaxSource::Plain(y) => {
                        let yv = View::of(y)?;
                        let yr = yv.tensor_ref::<T>()?;
                        softmax_backward_plain(
                            &self.kernels,
                            &SoftmaxBackwardPlain { y: &yr, dy: &dr },
                            &mut ds.tensor_mut()?,
                        )
                        .k()?;
                    }
                }
            }
            ds.into_tensor()
        })
    }

    /// GELU (erf) forward saving the codes of its input.
    pub fn gelu(&self, u: &Tensor, q: &mut Quantizer) -> candle_core::Result<(Tensor, SavedActivation)> {
        dispatch_float!(u.dtype(), OP, T => {
            let mut y = self.out::<T>(u.shape())?;
            let saved = {
                let uv = View::of(u)?;
                gelu_forward(&self.kernels, q, GeluForm::Erf, &uv.tensor_ref::<T>()?, &mut y.tensor_mut()?).k()?
            };
            Ok((y.into_tensor()?, saved))
        })
    }

    /// GELU backward from the codes of its input.
    pub fn gelu_backward(&self, saved: &SavedActivation, dy: &Tensor) -> candle_core::Result<Tensor> {
        dispatch_float!(dy.dtype(), OP, T => {
            let mut dx = self.out::<T>(dy.shape())?;
            {
                let dv = View::of(dy)?;
                gelu_backward(&self.kernels, GeluForm::Erf, saved, &dv.tensor_ref::<T>()?, &mut dx.tensor_mut()?).k()?;
            }
            dx.into_tensor()
        })
    }
}

/// What an RMSNorm of the layer keeps: the codes of `x̂` and the per-row `rms = 1/rstd`
/// (`[B, N, 1]` f32).
#[derive(Debug)]
pub(crate) struct SavedRms {
    pub xhat: SavedActivation,
    pub rms: Tensor,
}

impl SavedRms {
    pub fn size_in_bytes(&self) -> usize {
        self.xhat.size_in_bytes() + self.rms.elem_count() * 4
    }
}

impl Ctx {
    /// RMSNorm forward `x̂·w`, `x̂ = x/rms` ([`crate::ops::RmsNorm`]'s arithmetic, in f32 for
    /// every dtype), saving the f32 codes of `x̂` and `rms`; the output in `x`'s dtype.
    pub fn rms_norm(
        &self,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        q: &mut Quantizer,
    ) -> candle_core::Result<(Tensor, SavedRms)> {
        let rms = crate::ops::rms_norm::rms_of(x, eps)?;
        let xhat = x.to_dtype(DType::F32)?.broadcast_div(&rms)?;
        let y = xhat.broadcast_mul(&w.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
        let xhat = self.quantize(&xhat, q)?;
        Ok((y, SavedRms { xhat, rms }))
    }

    /// RMSNorm backward from the codes, in f32: `(dx, dw)`, `dx` in `dy`'s dtype, `dw` in f32
    /// (as LayerNorm's kernels write it; the layer rounds it to the parameters' dtype).
    pub fn rms_norm_backward(
        &self,
        saved: &SavedRms,
        w: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (wf, dyf) = (w.to_dtype(DType::F32)?, dy.to_dtype(DType::F32)?);
        let (dx, dw) = crate::ops::rms_norm::rms_norm_grads(&self.decode(&saved.xhat)?, &saved.rms, &wf, &dyf)?;
        Ok((dx.to_dtype(dy.dtype())?, dw))
    }

    /// `x̂·w` from the saved codes of an RMSNorm: its output, decoded, in `w`'s dtype.
    pub fn rms_norm_output(&self, saved: &SavedRms, w: &Tensor) -> candle_core::Result<Tensor> {
        self.decode(&saved.xhat)?.broadcast_mul(&w.to_dtype(DType::F32)?)?.to_dtype(w.dtype())
    }

    /// RoPE of `x: [B, heads, N, d]`, or its inverse (the backward).
    pub fn rope(&self, x: &Tensor, config: &RopeConfig, inverse: bool) -> candle_core::Result<Tensor> {
        dispatch_float!(x.dtype(), OP, T => {
            let mut y = self.out::<T>(x.shape())?;
            {
                let xv = View::of(x)?;
                let (xr, mut yr) = (xv.tensor_ref::<T>()?, y.tensor_mut()?);
                if inverse {
                    rope_backward(&self.kernels, config, &xr, &mut yr).k()?;
                } else {
                    rope(&self.kernels, config, &xr, &mut yr).k()?;
                }
            }
            y.into_tensor()
        })
    }

    /// RoPE of `x: [B, heads, N, d]` saving the codes of its output by `q`, in the same pass
    /// (rotate, then encode).
    pub fn rope_save(
        &self,
        x: &Tensor,
        config: &RopeConfig,
        q: &mut Quantizer,
    ) -> candle_core::Result<(Tensor, SavedActivation)> {
        dispatch_float!(x.dtype(), OP, T => {
            let mut y = self.out::<T>(x.shape())?;
            let saved = {
                let xv = View::of(x)?;
                rope_forward_save(&self.kernels, q, config, &xv.tensor_ref::<T>()?, &mut y.tensor_mut()?).k()?
            };
            Ok((y.into_tensor()?, saved))
        })
    }

    /// SwiGLU `silu(g)·u` saving the codes of `g` and `u`.
    pub fn swiglu(
        &self,
        g: &Tensor,
        u: &Tensor,
        quantizers: SwigluQuantizers<'_>,
    ) -> candle_core::Result<(Tensor, SavedSwiglu)> {
        dispatch_float!(g.dtype(), OP, T => {
            let mut y = self.out::<T>(g.shape())?;
            let saved = {
                let (gv, uv) = (View::of(g)?, View::of(u)?);
                let (gr, ur) = (gv.tensor_ref::<T>()?, uv.tensor_ref::<T>()?);
                let input = SwigluInput { gate: &gr, up: &ur };
                swiglu_forward(&self.kernels, quantizers, &input, &mut y.tensor_mut()?).k()?
            };
            Ok((y.into_tensor()?, saved))
        })
    }

    /// SwiGLU backward from the codes: `(dg, du)`.
    pub fn swiglu_backward(&self, saved: &SavedSwiglu, dy: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        dispatch_float!(dy.dtype(), OP, T => {
            let (mut dg, mut du) = (self.out::<T>(dy.shape())?, self.out::<T>(dy.shape())?);
            {
                let dv = View::of(dy)?;
                let grads = SwigluGrads { gate: &mut dg.tensor_mut()?, up: &mut du.tensor_mut()? };
                swiglu_backward(&self.kernels, saved, &dv.tensor_ref::<T>()?, grads).k()?;
            }
            Ok((dg.into_tensor()?, du.into_tensor()?))
        })
    }
}

/// Where the softmax backward gets the probabilities.
pub(crate) enum SoftmaxSource<'a> {
    /// The forward's codes.
    Codes(&'a SavedActivation),
    /// Recomputed at full precision (selective recomputation).
    Plain(&'a Tensor),
}
