//! The character-level GPT: token and learnt position embeddings, pre-LN blocks (causal
//! softmax attention, GELU MLP), final LayerNorm, untied head. One set of parameters (the
//! `mesa_burn::nn` modules, which have burn-nn's parameter layout) and two forwards: burn's
//! own ops ([`Ops::Burn`], the f32 baseline) or mesa-burn's ([`Ops::Mesa`], 8-bit codes
//! kept for backward). The two compute the same function; only what autodiff keeps for
//! backward, and so the gradients, differ.
use burn::module::{Module, Param};
use burn::tensor::{activation, module as bm, Device, Int, Tensor, TensorData};
use mesa_burn::nn::{Gelu, LayerNorm, Linear};
use mesa_burn::Codes;

use crate::data::SplitMix;

/// Which ops the forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ops {
    /// burn's `layer_norm`, `linear`, `gelu` and `softmax`: f32 kept for backward.
    Burn,
    /// mesa-burn's `LayerNorm`, `Linear`, `Gelu` and `softmax` (with the causal mask): 8-bit
    /// codes kept for backward.
    Mesa,
}

/// Sizes of the model.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Vocabulary `V`.
    pub vocab: usize,
    /// Layers `L`.
    pub layers: usize,
    /// Hidden width `C`.
    pub hidden: usize,
    /// Heads `H` (dividing `C`).
    pub heads: usize,
    /// FFN width `F`.
    pub ffn: usize,
    /// Context `T`.
    pub context: usize,
}

/// One pre-LN block: `x + proj(attn(ln1(x)))`, then `x + out(gelu(fc(ln2(x))))`.
#[derive(Module, Debug)]
pub struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    gelu: Gelu,
    out: Linear,
}

/// The model.
#[derive(Module, Debug)]
pub struct Model {
    tok: Param<Tensor<2>>,
    pos: Param<Tensor<2>>,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
    heads: usize,
}

const BITS: u32 = 8;

fn normal(rng: &mut SplitMix, shape: [usize; 2], device: &Device) -> Param<Tensor<2>> {
    let v: Vec<f32> = (0..shape[0] * shape[1]).map(|_| (rng.normal() * 0.02) as f32).collect();
    Param::from_tensor(Tensor::from_data(TensorData::new(v, shape), device))
}

fn vector(value: f32, n: usize, device: &Device) -> Param<Tensor<1>> {
    Param::from_tensor(Tensor::from_data(TensorData::new(vec![value; n], [n]), device))
}

fn linear(rng: &mut SplitMix, d_in: usize, d_out: usize, bias: bool, device: &Device) -> Linear {
    Linear { weight: normal(rng, [d_in, d_out], device), bias: bias.then(|| vector(0.0, d_out, device)), bits: BITS }
}

fn layer_norm(c: usize, device: &Device) -> LayerNorm {
    LayerNorm { gamma: vector(1.0, c, device), beta: vector(0.0, c, device), epsilon: 1e-5, bits: BITS }
}

impl Model {
    /// GPT-2's initialisation from `rng`: norm weights 1, biases 0, every matrix and
    /// embedding `N(0, 0.02²)`; the same numbers for both [`Ops`].
    pub fn new(s: &Sizes, rng: &mut SplitMix, device: &Device) -> Self {
        let (c, f) = (s.hidden, s.ffn);
        let tok = normal(rng, [s.vocab, c], device);
        let pos = normal(rng, [s.context, c], device);
        let blocks = (0..s.layers)
            .map(|_| Block {
                ln1: layer_norm(c, device),
                qkv: linear(rng, c, 3 * c, true, device),
                proj: linear(rng, c, c, true, device),
                ln2: layer_norm(c, device),
                fc: linear(rng, c, f, true, device),
                gelu: Gelu { approximate: false, bits: BITS },
                out: linear(rng, f, c, true, device),
            })
            .collect();
        Model {
            tok,
            pos,
            blocks,
            ln_f: layer_norm(c, device),
            head: linear(rng, c, s.vocab, false, device),
            heads: s.heads,
        }
    }

    /// The device of the parameters (plain Flex after [`Module::valid`]).
    pub fn device(&self) -> Device {
        self.tok.val().device()
    }

    /// Mean cross-entropy (nats per character) of the next-character targets `y` `[B, T]`
    /// given the inputs `x` `[B, T]`.
    ///
    /// # Errors
    /// A mesa-burn op refusing its arguments.
    pub fn loss(&self, x: Tensor<2, Int>, y: Tensor<2, Int>, ops: Ops) -> mesa_burn::Result<Tensor<1>> {
        let [b, t] = x.dims();
        let logits = self.logits(x, ops)?;
        let v = logits.dims()[2];
        let logp = activation::log_softmax(logits.reshape([b * t, v]), 1);
        Ok(logp.gather(1, y.reshape([b * t, 1])).mean().neg())
    }

    fn logits(&self, x: Tensor<2, Int>, ops: Ops) -> mesa_burn::Result<Tensor<3>> {
        let [b, t] = x.dims();
        let c = self.pos.dims()[1];
        let pos = self.pos.val().narrow(0, 0, t).reshape([1, t, c]);
        let mut h = bm::embedding(self.tok.val(), x) + pos;
        let mask = causal_mask(t, &h.device());
        for blk in &self.blocks {
            let a = norm(&blk.ln1, h.clone(), ops)?;
            let a = self.attention(lin(&blk.qkv, a, ops)?, mask.clone(), [b, t, c], ops)?;
            h = h + lin(&blk.proj, a, ops)?;
            let m = lin(&blk.fc, norm(&blk.ln2, h.clone(), ops)?, ops)?;
            let m = match ops {
                Ops::Burn => activation::gelu(m),
                Ops::Mesa => blk.gelu.forward(m)?,
            };
            h = h + lin(&blk.out, m, ops)?;
        }
        lin(&self.head, norm(&self.ln_f, h, ops)?, ops)
    }

    /// Causal softmax attention of `qkv` `[B, T, 3C]` → `[B, T, C]`.
    fn attention(
        &self,
        qkv: Tensor<3>,
        mask: Tensor<4>,
        [b, t, c]: [usize; 3],
        ops: Ops,
    ) -> mesa_burn::Result<Tensor<3>> {
        let (h, d) = (self.heads, c / self.heads);
        let split = |i: usize| qkv.clone().narrow(2, i * c, c).reshape([b, t, h, d]).swap_dims(1, 2);
        let (q, k, v) = (split(0), split(1), split(2));
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(1.0 / (d as f64).sqrt());
        let p = match ops {
            Ops::Burn => activation::softmax(scores + mask, 3),
            Ops::Mesa => mesa_burn::softmax(scores, Some(mask), Codes::bits(BITS))?,
        };
        Ok(p.matmul(v).swap_dims(1, 2).reshape([b, t, c]))
    }
}

/// `[1, 1, T, T]`: 0 on and below the diagonal, −∞ above.
fn causal_mask(t: usize, device: &Device) -> Tensor<4> {
    let m: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_data(TensorData::new(m, [1, 1, t, t]), device)
}

fn norm(l: &LayerNorm, x: Tensor<3>, ops: Ops) -> mesa_burn::Result<Tensor<3>> {
    match ops {
        Ops::Burn => Ok(bm::layer_norm(x, l.gamma.val(), Some(l.beta.val()), l.epsilon)),
        Ops::Mesa => l.forward(x),
    }
}

fn lin(l: &Linear, x: Tensor<3>, ops: Ops) -> mesa_burn::Result<Tensor<3>> {
    match ops {
        Ops::Burn => Ok(bm::linear(x, l.weight.val(), l.bias.as_ref().map(Param::val))),
        Ops::Mesa => l.forward(x),
    }
}
