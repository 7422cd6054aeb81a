//! The character-level model: a token embedding, a stack of layers (mesa-candle's one-op
//! layer, or the plain-candle reference layer) and an untied LM head, in one of two designs
//! (`--arch`):
//!
//! - GPT: learnt position embedding, pre-LN GPT blocks, final LayerNorm;
//! - Llama: no position embedding (RoPE inside the layers), Llama blocks (pre-RMSNorm,
//!   grouped-query attention, SwiGLU), final RMSNorm written with candle's composed ops
//!   (candle-nn's fused `RmsNorm` records no backward).
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use mesa_candle::layer::{reference, Block, LayerConfig, ParamLayout, TransformerLayer};
use mesa_candle::region::checkpoint;

use crate::data::SplitMix;

/// Sizes of the model and the batch.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Vocabulary size `V`.
    pub vocab: usize,
    /// Context length `T`.
    pub context: usize,
    /// Layers `L`.
    pub layers: usize,
}

/// The layer stack: one of the two implementations of the same layer.
pub enum Stack {
    /// `layer::reference` with one f32 variable per weight: candle keeps every intermediate
    /// at full precision (run a).
    Plain(Vec<HashMap<&'static str, Var>>),
    /// mesa-candle's layer: one op per layer that keeps codes.
    Mesa(Vec<Arc<TransformerLayer>>),
}

/// The whole model.
pub struct Model {
    /// The layers' configuration.
    pub config: LayerConfig,
    tok: Var,
    /// Learnt positions (GPT; a Llama model has none).
    pos: Option<Var>,
    /// The layers.
    pub stack: Stack,
    /// The final norm's weight: LayerNorm (GPT) or RMSNorm (Llama).
    ln_w: Var,
    /// The final LayerNorm's bias (GPT; RMSNorm has none).
    ln_b: Option<Var>,
    head: Var,
    /// Every layer of the stack in a checkpoint region (`mesa_candle::region`).
    pub regions: bool,
}

fn normal(rng: &mut SplitMix, shape: &[usize], std: f64, device: &Device) -> candle_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
    Tensor::from_vec(v, shape, device)
}

/// GPT-2's and Llama's usual initialisation from the example's own generator (candle's CPU
/// generator cannot be seeded): norm weights 1, biases 0, every matrix and embedding
/// `N(0, 0.02²)`.
fn layer_tensors(
    layout: &ParamLayout,
    rng: &mut SplitMix,
    device: &Device,
) -> candle_core::Result<HashMap<String, Tensor>> {
    layout
        .entries()
        .iter()
        .map(|e| {
            // GPT's `ln_1.weight`, Llama's `input_layernorm.weight`, `post_attention_layernorm.weight`
            let norm = e.name.starts_with("ln_") || e.name.ends_with("layernorm.weight");
            let t = if norm && e.name.ends_with(".weight") {
                Tensor::ones(e.shape.as_slice(), DType::F32, device)?
            } else if e.name.ends_with(".bias") {
                Tensor::zeros(e.shape.as_slice(), DType::F32, device)?
            } else {
                normal(rng, &e.shape, 0.02, device)?
            };
            Ok((e.name.to_string(), t))
        })
        .collect()
}

pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

/// RMSNorm `x/√(mean(x²) + eps)·w` over the last axis in candle's composed ops, so that its
/// backward reaches `x` and `w` (candle-nn's fused `RmsNorm` records none).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

impl Model {
    /// A model initialised from `seed`; `plain` picks the reference layer (same weights for
    /// the same seed either way). `config.block` picks the design: a GPT block draws token
    /// embedding, positions, the layers and the head in this order, a Llama block the same
    /// without positions.
    pub fn new(
        config: LayerConfig,
        shape: Shape,
        plain: bool,
        seed: u64,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let mut rng = SplitMix(seed);
        let c = config.hidden;
        let tok = Var::from_tensor(&normal(&mut rng, &[shape.vocab, c], 0.02, device)?)?;
        let llama = matches!(config.block, Block::Llama(_));
        let pos =
            if llama { None } else { Some(Var::from_tensor(&normal(&mut rng, &[shape.context, c], 0.02, device)?)?) };
        let layout = ParamLayout::of(&config)?;
        let mut plain_layers = Vec::new();
        let mut mesa_layers = Vec::new();
        for _ in 0..shape.layers {
            let tensors = layer_tensors(&layout, &mut rng, device)?;
            if plain {
                let flat = layout.flatten(&tensors, "", device)?;
                plain_layers.push(reference::variables(&layout, &flat, DType::F32)?);
            } else {
                mesa_layers.push(Arc::new(TransformerLayer::from_tensors(config.clone(), &tensors, "", device)?));
            }
        }
        let stack = if plain { Stack::Plain(plain_layers) } else { Stack::Mesa(mesa_layers) };
        let ln_w = Var::from_tensor(&Tensor::ones(c, DType::F32, device)?)?;
        let ln_b = if llama { None } else { Some(Var::from_tensor(&Tensor::zeros(c, DType::F32, device)?)?) };
        let head = Var::from_tensor(&normal(&mut rng, &[shape.vocab, c], 0.02, device)?)?;
        Ok(Model { config, tok, pos, stack, ln_w, ln_b, head, regions: false })
    }

    /// Every trainable variable, the head's last.
    pub fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.tok.clone()];
        v.extend(self.pos.clone());
        match &self.stack {
            Stack::Plain(layers) => {
                for l in layers {
                    let mut names: Vec<_> = l.keys().copied().collect();
                    names.sort_unstable();
                    v.extend(names.into_iter().map(|n| l[n].clone()));
                }
            }
            Stack::Mesa(layers) => v.extend(layers.iter().map(|l| l.params().clone())),
        }
        v.extend(self.head_vars());
        v
    }

    /// The embeddings' variables (token; position, which a Llama model has not).
    pub fn embed_vars(&self) -> (Var, Option<Var>) {
        (self.tok.clone(), self.pos.clone())
    }

    /// Each layer's whole flat parameters (`ParamLayout::of` order), detached.
    pub fn layer_flats(&self) -> candle_core::Result<Vec<Tensor>> {
        let layout = ParamLayout::of(&self.config)?;
        match &self.stack {
            Stack::Plain(layers) => layers
                .iter()
                .map(|l| {
                    let named: HashMap<String, Tensor> =
                        l.iter().map(|(n, v)| (n.to_string(), v.as_tensor().detach())).collect();
                    layout.flatten(&named, "", self.tok.device())
                })
                .collect(),
            Stack::Mesa(layers) => Ok(layers.iter().map(|l| l.params().as_tensor().detach()).collect()),
        }
    }

    /// The head's variables: the final norm's weight (and the LayerNorm's bias), the LM head.
    pub fn head_vars(&self) -> Vec<Var> {
        let mut v = vec![self.ln_w.clone()];
        v.extend(self.ln_b.clone());
        v.push(self.head.clone());
        v
    }

    /// Token plus position embedding of `ids: [B, T]` → `[B, T, C]` (token embedding only
    /// in a Llama model).
    pub fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let t = ids.dim(1)?;
        let e = self.tok.as_tensor().embedding(&ids.flatten_all()?)?.reshape((ids.dim(0)?, t, self.config.hidden))?;
        match &self.pos {
            Some(pos) => e.broadcast_add(&pos.as_tensor().narrow(0, 0, t)?),
            None => Ok(e),
        }
    }

    /// The layer stack for training (graph kept for backward) at training step `step`: layer
    /// `i` gets the seed `step · layers + i` (its stochastic-rounding keys; no dropout here).
    pub fn stack_forward(&self, h: &Tensor, step: u64) -> candle_core::Result<Tensor> {
        let mut h = h.clone();
        match &self.stack {
            Stack::Plain(layers) => {
                for p in layers {
                    h = if self.regions {
                        let (config, p) = (self.config.clone(), p.clone());
                        checkpoint(&h, move |h| reference::forward(&config, &p, h, 0))?
                    } else {
                        reference::forward(&self.config, p, &h, 0)?
                    };
                }
            }
            Stack::Mesa(layers) => {
                for (i, l) in layers.iter().enumerate() {
                    let seed = step * layers.len() as u64 + i as u64;
                    h = if self.regions {
                        let l = Arc::clone(l);
                        checkpoint(&h, move |h| l.forward_seeded(h, seed))?
                    } else {
                        l.forward_seeded(&h, seed)?
                    };
                }
            }
        }
        Ok(h)
    }

    /// The layer stack for evaluation: the plain-candle forward of the same parameters (the
    /// layer's forward is exact, its codes only serve backward), so evaluating leaves the
    /// running estimates alone.
    pub fn stack_eval(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = h.detach();
        match &self.stack {
            Stack::Plain(layers) => {
                for p in layers {
                    h = reference::forward(&self.config, p, &h, 0)?.detach();
                }
            }
            Stack::Mesa(layers) => {
                for l in layers {
                    let p = reference::variables(l.layout(), &l.params().as_tensor().detach(), DType::F32)?;
                    h = reference::forward(&self.config, &p, &h, 0)?.detach();
                }
            }
        }
        Ok(h)
    }

    /// The head's logits `[B, T, V]` of the stack output `y: [B, T, C]`.
    fn logits(&self, y: &Tensor) -> candle_core::Result<Tensor> {
        let eps = f64::from(self.config.eps);
        let n = match &self.ln_b {
            Some(b) => layer_norm(y, self.ln_w.as_tensor(), b.as_tensor(), eps)?,
            None => rms_norm(y, self.ln_w.as_tensor(), eps)?,
        };
        n.broadcast_matmul(&self.head.as_tensor().t()?)
    }

    /// Mean next-character cross-entropy (nats) of the head on `y: [B, T, C]`.
    pub fn head_loss(&self, y: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::loss::cross_entropy(&self.logits(y)?.flatten_to(1)?, &targets.flatten_all()?)
    }

    /// Per-position cross-entropy (nats) `[B, T]` of the head on `y: [B, T, C]`, f64 on the host.
    pub fn head_nll(&self, y: &Tensor, targets: &Tensor) -> candle_core::Result<Vec<Vec<f64>>> {
        let logp = candle_nn::ops::log_softmax(&self.logits(y)?, D::Minus1)?;
        let picked = logp.gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?.squeeze(D::Minus1)?;
        let rows = picked.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        Ok(rows.into_iter().map(|r| r.into_iter().map(|v| -v).collect()).collect())
    }
}
