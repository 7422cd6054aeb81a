//! Two checks on candle-transformers 0.11.1's models, CPU, f32 (the numbers are in
//! `docs/results.md`):
//!
//! * **forward parity of our Llama block** ([`llama_parity`]): candle-transformers' `Llama`
//!   (grouped-query attention) and the same weights in [`mesa_candle::TransformerLayer`]s built
//!   with `LayerConfig::llama`, logits compared at every position within an f32 rounding bound,
//!   and deliberate breaks of our side shown to fail;
//! * **checkpoint regions** ([`mesa_candle::region`]) on models no one here wrote: its Llama and
//!   T5 encoder at tiny configurations, weights in a `candle_nn::VarMap` (trainable variables),
//!   trained a few steps of AdamW on cross-entropy with and without a region, from the same
//!   initial weights (issue 39).
//!
//! For the regions: neither model makes its blocks public (Llama's `Block`, T5's `T5Block` are
//! private), so the region wraps each model's whole forward: candle keeps the token ids and the
//! model's output, the backward reruns the forward. The program prints, per model:
//! * the loss at every step with and without the region, and whether they are equal bit for bit;
//! * at step 0, each parameter's gradient: max |with − without| and max |without|, or that the
//!   parameter got **no gradient** (candle-nn 0.11.1's fused `rms_norm`, `layer_norm`,
//!   `softmax_last_dim` and `rope` are `apply_op*_no_bwd`: nothing flows through them);
//! * the heap bytes alive after the forward (the loss computed, before backward) and the peak
//!   during backward, by [`CountingAllocator`], candle single-threaded (`RAYON_NUM_THREADS=1`);
//! * the time of a training step (forward, backward, AdamW), and the median time of a forward
//!   and backward over many passes, the two paths alternated.
//!
//! Exits with an error when a check fails. Run:
//! `cd interop/candle-transformers && MESA_CUDA_DISABLE=1 cargo run --release`.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::loss::cross_entropy;
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use candle_transformers::models::{llama, t5};
use mesa_candle::region::checkpoint;
use mesa_candle::CountingAllocator;

mod llama_parity;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

const STEPS: usize = 5;
const BATCH: usize = 8;
const SEQ: usize = 16;
const VOCAB: usize = 64;
const HIDDEN: usize = 64;
const SEED: u64 = 39;
/// The weights and ids of the forward parity check.
const PARITY_SEED: u64 = 1;
/// Forward-and-backward passes timed per path.
const TIMED: usize = 51;

/// SplitMix64: the token ids and the initial weights.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f64 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    fn ids(&mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<u32> = (0..n).map(|_| (self.next_u64() % VOCAB as u64) as u32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }
}

/// Overwrites every variable with seeded values (candle's CPU generator cannot be seeded):
/// norm weights 1, vectors 0, embedding tables N(0, 1), other matrices `[out, in]` N(0, 1/in).
/// Returns a copy of them, to restore before each run.
fn seeded_weights(varmap: &VarMap, rng: &mut Rng) -> Result<BTreeMap<String, Tensor>> {
    let data = varmap.data().lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let sorted: BTreeMap<&String, &candle_core::Var> = data.iter().collect();
    let mut init = BTreeMap::new();
    for (name, var) in sorted {
        let dims = var.dims().to_vec();
        let n: usize = dims.iter().product();
        let values: Vec<f32> = if dims.len() == 1 {
            let one = name.contains("norm");
            vec![if one { 1.0 } else { 0.0 }; n]
        } else {
            let embedding = name.contains("embed") || name.contains("relative_attention_bias");
            let std = if embedding { 1.0 } else { 1.0 / (dims[dims.len() - 1] as f64).sqrt() };
            (0..n).map(|_| (std * rng.gauss()) as f32).collect()
        };
        let t = Tensor::from_vec(values, dims.as_slice(), &Device::Cpu)?;
        var.set(&t)?;
        init.insert(name.clone(), t);
    }
    Ok(init)
}

/// What one training run saw.
struct Run {
    losses: Vec<f32>,
    /// step 0's gradient of every variable (`None`: candle's backward gave it none)
    grads0: BTreeMap<String, Option<Tensor>>,
    alive: Vec<usize>,
    peak_backward: Vec<usize>,
    ms: Vec<f64>,
}

/// `STEPS` steps of AdamW on `loss()` from the weights `init`.
fn train(varmap: &VarMap, init: &BTreeMap<String, Tensor>, loss: &dyn Fn() -> Result<Tensor>) -> Result<Run> {
    let vars: BTreeMap<String, candle_core::Var> = {
        let data = varmap.data().lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        data.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
    };
    for (name, var) in &vars {
        var.set(&init[name])?;
    }
    let mut opt = AdamW::new(vars.values().cloned().collect(), ParamsAdamW { lr: 1e-2, ..Default::default() })?;
    let mut run = Run { losses: vec![], grads0: BTreeMap::new(), alive: vec![], peak_backward: vec![], ms: vec![] };
    for step in 0..STEPS {
        let t0 = Instant::now();
        let before = ALLOC.current();
        let l = loss()?;
        run.alive.push(ALLOC.current().saturating_sub(before));
        ALLOC.reset_peak();
        let grads = l.backward()?;
        run.peak_backward.push(ALLOC.peak().saturating_sub(before));
        opt.step(&grads)?;
        run.ms.push(t0.elapsed().as_secs_f64() * 1e3);
        run.losses.push(l.to_scalar::<f32>()?);
        if step == 0 {
            for (name, var) in &vars {
                run.grads0.insert(name.clone(), grads.get(var.as_tensor()).cloned());
            }
        }
    }
    Ok(run)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

fn max_abs(t: &Tensor) -> Result<f32> {
    t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of a forward and backward (no optimizer step), the two paths alternated
/// `TIMED` times each so that other load on the machine hits both alike.
fn time_both(plain: &dyn Fn() -> Result<Tensor>, region: &dyn Fn() -> Result<Tensor>) -> Result<(f64, f64)> {
    let (mut a, mut b) = (vec![], vec![]);
    for _ in 0..TIMED {
        for (f, out) in [(plain, &mut a), (region, &mut b)] {
            let t0 = Instant::now();
            drop(f()?.backward()?);
            out.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok((median(a), median(b)))
}

/// Warms both paths up (gemm's per-thread buffers, the model's caches), trains without and with
/// the region, and prints the comparison. Returns whether everything was bitwise equal.
fn compare(
    name: &str,
    varmap: &VarMap,
    init: &BTreeMap<String, Tensor>,
    plain: &dyn Fn() -> Result<Tensor>,
    region: &dyn Fn() -> Result<Tensor>,
) -> Result<bool> {
    for f in [plain, region] {
        let l = f()?;
        drop(l.backward()?);
    }
    let a = train(varmap, init, plain)?;
    let b = train(varmap, init, region)?;

    println!("\n## {name}\n");
    println!("| step | loss without region | loss with region | equal bits |");
    println!("|---|---|---|---|");
    let mut same = true;
    for (i, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        let eq = x.to_bits() == y.to_bits();
        same &= eq;
        println!("| {i} | {x:.9} | {y:.9} | {} |", if eq { "yes" } else { "NO" });
    }
    let loss_diff = a.losses.iter().zip(&b.losses).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    println!("\nmax |Δloss| over the steps: {loss_diff:e}\n");

    println!("Step 0's gradients (max |with − without|, max |without|):\n");
    println!("| parameter | shape | max abs diff | max abs grad |");
    println!("|---|---|---|---|");
    let (mut none, mut worst, mut with_grad) = (vec![], 0f32, 0usize);
    for (pname, ga) in &a.grads0 {
        let gb = &b.grads0[pname];
        let shape = format!("{:?}", init[pname].dims());
        match (ga, gb) {
            (None, None) => none.push(pname.clone()),
            (Some(ga), Some(gb)) => {
                with_grad += 1;
                let d = max_abs(&(ga - gb)?)?;
                worst = worst.max(d);
                same &= bits(ga)? == bits(gb)?;
                println!("| {pname} | {shape} | {d:e} | {:.3e} |", max_abs(ga)?);
            }
            (ga, gb) => {
                same = false;
                println!("| {pname} | {shape} | MISMATCH: without {}, with {} | |", ga.is_some(), gb.is_some());
            }
        }
    }
    println!(
        "\n{with_grad} of {} parameters got a gradient (max abs diff over them: {worst:e}); {} got **none**, \
         with and without the region:\n",
        a.grads0.len(),
        none.len()
    );
    for n in &none {
        println!("- {n} {:?}", init[n].dims());
    }
    // bytes per step, once when every step measured the same
    let per_step = |v: &[usize]| {
        if v.iter().all(|b| *b == v[0]) {
            format!("{} (every step)", v[0])
        } else {
            v.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
        }
    };
    println!("\n| | without region | with region |");
    println!("|---|---|---|");
    println!("| bytes alive after the forward (loss computed) | {} | {} |", per_step(&a.alive), per_step(&b.alive));
    println!("| peak bytes during backward | {} | {} |", per_step(&a.peak_backward), per_step(&b.peak_backward));
    println!(
        "| ms per training step (median of {STEPS}) | {:.2} | {:.2} |",
        median(a.ms.clone()),
        median(b.ms.clone())
    );
    let (ta, tb) = time_both(plain, region)?;
    println!("| ms per forward + backward (median of {TIMED}, alternated) | {ta:.2} | {tb:.2} |");
    println!("\n{name}: losses and step-0 gradients bitwise equal with and without the region: {same}");
    Ok(same)
}

fn lock_err<T>(e: std::sync::PoisonError<T>) -> candle_core::Error {
    candle_core::Error::Msg(format!("poisoned lock: {e}"))
}

/// Llama: 2 layers, hidden 64, 4 heads, intermediate 128, vocab 64; logits of the last
/// position (`Llama::forward`), cross-entropy against one fixed random id per sequence.
fn llama(rng: &mut Rng) -> Result<bool> {
    let dev = Device::Cpu;
    let cfg = llama::Config {
        hidden_size: HIDDEN,
        intermediate_size: 2 * HIDDEN,
        vocab_size: VOCAB,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: SEQ,
        tie_word_embeddings: false,
    };
    let varmap = VarMap::new();
    let model = Arc::new(llama::Llama::load(VarBuilder::from_varmap(&varmap, DType::F32, &dev), &cfg)?);
    let init = seeded_weights(&varmap, rng)?;
    let cache = Arc::new(Mutex::new(llama::Cache::new(false, DType::F32, &cfg, &dev)?));
    let ids = rng.ids(&[BATCH, SEQ])?;
    let targets = rng.ids(&[BATCH])?;
    let forward = Arc::new(move |ids: &Tensor| -> Result<Tensor> {
        let mut cache = cache.lock().map_err(lock_err)?;
        model.forward(ids, 0, &mut cache)
    });
    let f = forward.clone();
    let plain = || cross_entropy(&f(&ids)?, &targets);
    let region = || {
        let f = forward.clone();
        cross_entropy(&checkpoint(&ids, move |t| f(t))?, &targets)
    };
    compare(
        "candle-transformers Llama (2 layers, hidden 64, 4 heads, vocab 64, batch 8 × seq 16)",
        &varmap,
        &init,
        &plain,
        &region,
    )
}

/// T5 encoder: 2 layers, d_model 64, 4 heads of 16, d_ff 128, vocab 64, ReLU; its composed
/// RMSNorm (T5LayerNorm) has a backward. A Linear head (outside the region) to the vocabulary,
/// cross-entropy against fixed random ids at every position.
fn t5_encoder(rng: &mut Rng) -> Result<bool> {
    let dev = Device::Cpu;
    let cfg = t5::Config {
        vocab_size: VOCAB,
        d_model: HIDDEN,
        d_kv: 16,
        d_ff: 2 * HIDDEN,
        num_layers: 2,
        num_heads: 4,
        relative_attention_num_buckets: 32,
        relative_attention_max_distance: 128,
        use_cache: false,
        ..t5::Config::default()
    };
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let encoder = Arc::new(Mutex::new(t5::T5EncoderModel::load(vb.clone(), &cfg)?));
    let head = candle_nn::linear(HIDDEN, VOCAB, vb.pp("head"))?;
    let init = seeded_weights(&varmap, rng)?;
    let ids = rng.ids(&[BATCH, SEQ])?;
    let targets = rng.ids(&[BATCH * SEQ])?;
    let forward = Arc::new(move |ids: &Tensor| -> Result<Tensor> { encoder.lock().map_err(lock_err)?.forward(ids) });
    let loss = |h: Tensor| cross_entropy(&head.forward(&h)?.reshape((BATCH * SEQ, VOCAB))?, &targets);
    let f = forward.clone();
    let plain = || loss(f(&ids)?);
    let region = || {
        let f = forward.clone();
        loss(checkpoint(&ids, move |t| f(t))?)
    };
    compare(
        "candle-transformers T5 encoder (2 layers, d_model 64, 4 heads × 16, d_ff 128, vocab 64, batch 8 × seq 16) + Linear head",
        &varmap,
        &init,
        &plain,
        &region,
    )
}

fn main() -> Result<()> {
    // before any candle op: rayon's pool and gemm read it (crates/mesa-candle/tests/common)
    std::env::set_var("RAYON_NUM_THREADS", "1");
    println!("# candle-transformers 0.11.1 models (CPU, candle single-threaded)");
    let parity = llama_parity::run(&mut Rng(PARITY_SEED))?;
    println!("\n# Checkpoint regions\n\n{STEPS} steps of AdamW (lr 1e-2), weights and ids from seed {SEED}, f32.");
    let mut rng = Rng(SEED);
    let a = llama(&mut rng)?;
    let b = t5_encoder(&mut rng)?;
    if !parity {
        candle_core::bail!(
            "our Llama block's forward is not within the bound of candle-transformers', or a break passed"
        );
    }
    if !(a && b) {
        candle_core::bail!("a model's losses or gradients differ with the region");
    }
    Ok(())
}
