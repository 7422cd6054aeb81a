//! Forward parity of our Llama block ([`mesa_candle::layer::LlamaBlock`], one
//! [`TransformerLayer`] op per layer) with candle-transformers 0.11.1's `models::llama::Llama`,
//! built from the same tensors.
//!
//! candle-transformers' model: 2 layers, hidden 64, 8 query heads and 2 K/V heads (grouped-query
//! attention, 4 query heads per K/V head), intermediate 128, vocab 64, RoPE base 10 000, RMSNorm
//! ε 1e-5, separate `lm_head`, f32 on the CPU, its variables in a `VarMap` overwritten from a
//! seed. Ours: an embedding lookup, `TransformerLayer::from_tensors(LayerConfig::llama(64, 8, 2,
//! 128), &tensors, "model.layers.{i}.", ..)` per layer, the final RMSNorm in plain candle ops and
//! the head as a matrix product.
//!
//! `Llama::forward` returns the logits of the last position only. Run on every prefix
//! `ids[:, ..t]` it gives the logits at every position `t − 1`, which our model, causal, computes
//! in one pass over the whole sequence: this checks the causal mask at every position (at the
//! last one, a missing mask shows only through what the layers below passed on). Its `Cache`
//! holds the cos/sin tables (f32) and, with `use_kv_cache`, the keys and values of earlier
//! calls; one call from position 0 reads nothing from it (checked: bit-equal logits with and
//! without).
//!
//! Every logit must be within [`bound`] of candle-transformers'; and each deliberate break of our
//! side (RoPE's pairing, base or rotated dims, RMSNorm's ε, the other K/V head order, no causal
//! mask) must fail the same check, so that the bound is known to be tight enough to see them.
//! (Starting the positions at 1 is no break: the scores depend only on position differences.)
use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama;
use mesa_candle::layer::{Attention, Block, LlamaBlock};
use mesa_candle::ops::{RopeConfig, RopePairing};
use mesa_candle::{LayerConfig, TransformerLayer};

use crate::Rng;

const HIDDEN: usize = 64;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const FFN: usize = 128;
const LAYERS: usize = 2;
const BATCH: usize = 3;
const SEQ: usize = 24;
const EPS: f64 = 1e-5;
/// A second ε, on both sides: large enough that placing it elsewhere (outside the square root,
/// on the RMS instead of its square) would show.
const LARGE_EPS: f64 = 0.1;
const BASE: f32 = 10_000.0;

/// Tensors by checkpoint name (`model.layers.0.self_attn.q_proj.weight`, …).
type Tensors = HashMap<String, Tensor>;

/// The tolerance on `max |ours − theirs|` over all logits, as a fraction of their `max |logit|`.
///
/// Where it comes from (f32, `u = 2⁻²⁴`): an op whose result is a sum of `m` terms has a relative
/// error of at most `γ_m ≈ m·u`; along a chain of such ops, with each stage's condition number
/// taken as 1 (RMSNorm and softmax on the O(1) values here), the errors add up to `γ_M` with `M`
/// the sum of the `m` along the longest path from the embedding to a logit. Per layer: RMSNorm's
/// mean of squares (`C`), a Q/K/V projection (`C`), the rotation (2), a score (`d`), softmax's
/// normaliser and `P·V` (`N` each), the output projection (`C`), the residual add (1), RMSNorm
/// (`C`), gate or up (`C`), `silu(g)·u` (2), down (`F`), the residual add (1); then the final
/// RMSNorm and the head (`C` each). The RoPE angles are rounded differently on the two sides
/// (ours: `p·base^(−2i/d)/π` for `sincospif`, kernels/rope.cu; theirs: `p·inv_freq` then
/// `cos`, `sin`), each within about `20·u·θ` of the exact angle (rope.cu's estimate for ours;
/// theirs rounds fewer times), `θ ≤ N − 1`: a relative error of that size in each rotated query
/// and key, two per layer. Each side has its own error of this size: twice the sum. A
/// first-order estimate, not a worst case.
fn bound() -> f64 {
    let u = 2f64.powi(-24);
    let (c, d, f, n) = (HIDDEN, HIDDEN / HEADS, FFN, SEQ);
    let per_layer = c + c + 2 + d + n + n + c + 1 + c + c + 2 + f + 1;
    let chain = (LAYERS * per_layer + c + c) as f64 * u;
    let angles = (2 * LAYERS) as f64 * 20.0 * u * (n - 1) as f64;
    2.0 * (chain + angles)
}

fn config(eps: f64) -> llama::Config {
    llama::Config {
        hidden_size: HIDDEN,
        intermediate_size: FFN,
        vocab_size: crate::VOCAB,
        num_hidden_layers: LAYERS,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        use_flash_attn: false,
        rms_norm_eps: eps,
        rope_theta: BASE,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 32,
        tie_word_embeddings: false,
    }
}

/// Overwrites every variable from `rng` (sorted by name): norm weights uniform in [0.5, 1.5]
/// (not 1, so that a weight applied to the wrong channel shows), the embedding table N(0, 1),
/// other matrices `[out, in]` N(0, 1/in) (attention far from uniform). Returns them by name.
fn seeded(varmap: &VarMap, rng: &mut Rng) -> Result<Tensors> {
    let data = varmap.data().lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let sorted: BTreeMap<&String, &candle_core::Var> = data.iter().collect();
    let mut out = HashMap::new();
    for (name, var) in sorted {
        let dims = var.dims().to_vec();
        let n: usize = dims.iter().product();
        let values: Vec<f32> = match dims.as_slice() {
            [_] => (0..n).map(|_| (0.5 + rng.uniform()) as f32).collect(),
            [_, cols] => {
                let std = if name.contains("embed") { 1.0 } else { 1.0 / (*cols as f64).sqrt() };
                (0..n).map(|_| (std * rng.gauss()) as f32).collect()
            }
            _ => candle_core::bail!("{name}: unexpected shape {dims:?}"),
        };
        let t = Tensor::from_vec(values, dims.as_slice(), &Device::Cpu)?;
        var.set(&t)?;
        out.insert(name.clone(), t);
    }
    Ok(out)
}

/// RMSNorm in plain candle ops, f32: `x / sqrt(mean(x²) + ε) · w`.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&rms)?.broadcast_mul(w)
}

/// Our model: embedding, [`TransformerLayer`]s with `cfg`, final RMSNorm, head.
struct Ours {
    embed: Tensor,
    layers: Vec<TransformerLayer>,
    norm: Tensor,
    head: Tensor,
    eps: f64,
}

impl Ours {
    fn new(cfg: &LayerConfig, t: &Tensors) -> Result<Self> {
        let get = |name: &str| t.get(name).cloned().ok_or_else(|| candle_core::Error::Msg(format!("no {name}")));
        let layers = (0..LAYERS)
            .map(|i| TransformerLayer::from_tensors(cfg.clone(), t, &format!("model.layers.{i}."), &Device::Cpu))
            .collect::<Result<Vec<_>>>()?;
        Ok(Ours {
            embed: get("model.embed_tokens.weight")?,
            layers,
            norm: get("model.norm.weight")?,
            head: get("lm_head.weight")?,
            eps: f64::from(cfg.eps),
        })
    }

    /// The logits at every position, `[B, N, V]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, n) = ids.dims2()?;
        let mut x = self.embed.index_select(&ids.flatten_all()?, 0)?.reshape((b, n, HIDDEN))?;
        for layer in &self.layers {
            x = layer.forward_seeded(&x, 0)?;
        }
        rms_norm(&x, &self.norm, self.eps)?.broadcast_matmul(&self.head.t()?)
    }
}

/// Our layer configuration: Llama's, with candle-transformers' ε and base.
fn ours_config(eps: f64) -> LayerConfig {
    let cfg = LayerConfig { eps: eps as f32, ..LayerConfig::llama(HIDDEN, HEADS, KV_HEADS, FFN) };
    with_rope(cfg, |r| r.base = BASE)
}

fn with_rope(mut cfg: LayerConfig, change: impl FnOnce(&mut RopeConfig)) -> LayerConfig {
    if let Block::Llama(LlamaBlock { rope, .. }) = &mut cfg.block {
        change(rope);
    }
    cfg
}

/// The tensors with each layer's query heads reordered so that, in our layer, original query
/// head `i` reads K/V head `i mod H_kv` instead of `⌊i/(H/H_kv)⌋` (the rows of `q_proj` and the
/// columns of `o_proj` move together: nothing else changes).
fn other_kv_order(t: &Tensors) -> Result<Tensors> {
    let (d, rep) = (HIDDEN / HEADS, HEADS / KV_HEADS);
    // slot j gets the head i with i mod H_kv = ⌊j/rep⌋ (slot j reads K/V head ⌊j/rep⌋)
    let source: Vec<usize> = (0..HEADS).map(|j| (j % rep) * KV_HEADS + j / rep).collect();
    let mut out = t.clone();
    for l in 0..LAYERS {
        for (name, axis) in [("q_proj", 0), ("o_proj", 1)] {
            let key = format!("model.layers.{l}.self_attn.{name}.weight");
            let w = &t[&key];
            let parts = source.iter().map(|&i| w.narrow(axis, i * d, d)).collect::<Result<Vec<_>>>()?;
            out.insert(key, Tensor::cat(&parts, axis)?);
        }
    }
    Ok(out)
}

/// candle-transformers' logits at every position `[B, N, V]`: the last position of each prefix.
fn theirs(model: &llama::Llama, cfg: &llama::Config, ids: &Tensor) -> Result<Tensor> {
    let mut cache = llama::Cache::new(false, DType::F32, cfg, &Device::Cpu)?;
    let last = (1..=ids.dim(1)?)
        .map(|t| model.forward(&ids.narrow(1, 0, t)?.contiguous()?, 0, &mut cache))
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&last, 1)
}

/// `(max |a − b|, max |b|)`.
fn errors(a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
    let m = |t: &Tensor| -> Result<f64> { Ok(f64::from(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)) };
    Ok((m(&(a - b)?)?, m(b)?))
}

/// Runs the check and the deliberate breaks; prints them. Returns whether the check passed and
/// every break failed it.
pub fn run(rng: &mut Rng) -> Result<bool> {
    let dev = Device::Cpu;
    let cfg = config(EPS);
    let varmap = VarMap::new();
    let model = llama::Llama::load(VarBuilder::from_varmap(&varmap, DType::F32, &dev), &cfg)?;
    let tensors = seeded(&varmap, rng)?;
    let ids = rng.ids(&[BATCH, SEQ])?;
    // the same variables (a VarMap hands out the ones it has), the other ε
    let large_cfg = config(LARGE_EPS);
    let large = llama::Llama::load(VarBuilder::from_varmap(&varmap, DType::F32, &dev), &large_cfg)?;
    let references = [theirs(&model, &cfg, &ids)?, theirs(&large, &large_cfg, &ids)?];

    let mut kv_cache = llama::Cache::new(true, DType::F32, &cfg, &dev)?;
    let with_kv = model.forward(&ids, 0, &mut kv_cache)?;
    let kv_same = crate::bits(&with_kv)? == crate::bits(&references[0].narrow(1, SEQ - 1, 1)?.squeeze(1)?)?;

    let tol = bound();
    let u = 2f64.powi(-24);
    println!("\n## Forward parity: our Llama block against candle-transformers' `llama::Llama`\n");
    println!(
        "{LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, {KV_HEADS} K/V heads, intermediate {FFN}, vocab {}, \
         batch {BATCH} × seq {SEQ}, RoPE base {BASE}, ε {EPS:e} (and {LARGE_EPS} on both sides), f32. \
         Theirs: the last position of every prefix.",
        crate::VOCAB
    );
    println!("`use_kv_cache` true vs false, whole sequence: bit-equal logits: {kv_same}");
    println!("max abs logit (theirs, every position): {:.4}", errors(&references[0], &references[0])?.1);
    println!("\nBound: {tol:.3e} × max abs logit (= {:.0}·2⁻²⁴).\n", tol / u);
    println!("| our side | must pass | max abs error, every position | ÷ max abs logit | last position only, ÷ max abs logit | within the bound |");
    println!("|---|---|---|---|---|---|");
    let ours = || ours_config(EPS);
    // (our side, its tensors if changed, candle-transformers' ε: 0 = EPS, 1 = LARGE_EPS, must pass)
    let rows: Vec<(&str, LayerConfig, Option<Tensors>, usize, bool)> = vec![
        ("as configured", ours(), None, 0, true),
        ("as configured, ε 0.1 on both sides", ours_config(LARGE_EPS), None, 1, true),
        (
            "RoPE pairing interleaved (GPT-J)",
            with_rope(ours(), |r| r.pairing = RopePairing::Interleaved),
            None,
            0,
            false,
        ),
        ("RoPE base 500 000", with_rope(ours(), |r| r.base = 500_000.0), None, 0, false),
        (
            "RoPE on half of each head's dims",
            with_rope(ours(), |r| r.rotary_dims = Some(HIDDEN / HEADS / 2)),
            None,
            0,
            false,
        ),
        ("RMSNorm ε 1e-3", ours_config(1e-3), None, 0, false),
        ("query head i reads K/V head i mod H_kv", ours(), Some(other_kv_order(&tensors)?), 0, false),
        ("no causal mask", LayerConfig { attention: Attention::Softmax { causal: false }, ..ours() }, None, 0, false),
    ];
    let mut ok = kv_same;
    for (name, layer_cfg, changed, reference, must_pass) in rows {
        let theirs = &references[reference];
        let logits = Ours::new(&layer_cfg, changed.as_ref().unwrap_or(&tensors))?.forward(&ids)?;
        let (err, scale) = errors(&logits, theirs)?;
        let last = |t: &Tensor| t.narrow(1, SEQ - 1, 1);
        let (err_last, scale_last) = errors(&last(&logits)?, &last(theirs)?)?;
        let pass = err <= tol * scale;
        ok &= pass == must_pass;
        println!(
            "| {name} | {} | {err:.3e} | {:.3e} | {:.3e} | {} |",
            if must_pass { "yes" } else { "no" },
            err / scale,
            err_last / scale_last,
            if pass { "yes" } else { "**no**" }
        );
    }
    println!(
        "\nForward parity with candle-transformers (the configured model within the bound, every break outside it): {ok}"
    );
    Ok(ok)
}
