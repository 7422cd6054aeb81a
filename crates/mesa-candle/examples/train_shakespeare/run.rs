//! The runs: their settings, one training run and what it measures.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use mesa_candle::layer::{Attention, Block, CodeSite, LayerConfig, Recompute, TransformerLayer};
use mesa_candle::ops::{FeatureKind, GatedConfig};
use mesa_candle::plan::TrainingShape;
use mesa_candle::CountingAllocator;
use mesa_kernels::linear_attention::{LinearAttentionConfig, MemoryMode};
use mesa_kernels::plan::MemoryBreakdown;
use mesa_kernels::StatsMode;

use crate::data::{self, Corpus};
use crate::model::{Model, Shape, Stack};
use crate::parity::Parity;

/// Sizes and schedule of one configuration (`--config`).
#[derive(Debug, Clone)]
pub struct Settings {
    pub name: String,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub ffn: usize,
    pub context: usize,
    pub batch: usize,
    pub steps: usize,
    /// Evaluations, evenly spaced, the last at the last step (each scores the whole
    /// validation text: about 1.5 s on one core in the CPU configuration).
    pub evals: usize,
    /// Characters of the validation text scored (`None`: all of it).
    pub val_chars: Option<usize>,
    /// Peak learning rate (linear warm-up over the first 10 % of steps, cosine to 10 %).
    pub lr: f64,
    /// Linear attention's chunk (runs e, h).
    pub chunk: usize,
    /// Steps between two readings of the running estimate (run c, first seed).
    pub record_every: usize,
    /// Gradient-parity probes over the run, evenly spaced (run a, first seed).
    pub parity_probes: usize,
    /// The seeds: each run trains once per seed, which sets its initialisation and its data
    /// order, so runs of one seed are paired.
    pub seeds: Vec<u64>,
    /// The variants trained by default (`--only` picks others).
    pub variants: Vec<&'static str>,
    /// Every layer in a checkpoint region (`--regions`).
    pub regions: bool,
    /// The model's design (`--arch`, `--kv-heads`).
    pub arch: Arch,
}

/// The model's design (`--arch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// GPT-2: learnt positions, pre-LN blocks (LayerNorm, biases, GELU), final LayerNorm.
    Gpt,
    /// Llama: no learnt positions (RoPE in the layers), Llama blocks (pre-RMSNorm, no biases,
    /// grouped-query attention with `kv_heads` K/V heads, SwiGLU), final RMSNorm.
    Llama {
        /// K/V heads `H_kv` (`--kv-heads`; dividing the heads).
        kv_heads: usize,
    },
}

impl Arch {
    /// `--kv-heads`' default: the largest divisor of `heads` below it (`H/2` for an even
    /// `H ≥ 2`, so that query heads share K/V heads), `1` for one head.
    pub fn default_kv_heads(heads: usize) -> usize {
        (1..heads).rev().find(|k| heads % k == 0).unwrap_or(1)
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt => "gpt",
            Arch::Llama { .. } => "llama",
        }
    }
}

impl Settings {
    /// Steps after which the model is evaluated.
    pub fn eval_steps(&self) -> Vec<usize> {
        let n = self.evals.clamp(1, self.steps);
        (1..=n).map(|i| i * self.steps / n).collect()
    }

    /// Steps between two gradient-parity probes.
    pub fn parity_every(&self) -> usize {
        (self.steps / self.parity_probes.max(1)).max(1)
    }

    /// Validation characters scored.
    pub fn val_len(&self, corpus: &Corpus) -> usize {
        self.val_chars.map_or(corpus.val.len(), |n| n.min(corpus.val.len()))
    }

    /// The layer of run a: a GPT block or a Llama block of the configuration's sizes.
    pub fn layer(&self) -> LayerConfig {
        match self.arch {
            Arch::Gpt => LayerConfig::new(self.hidden, self.heads, self.ffn),
            Arch::Llama { kv_heads } => LayerConfig::llama(self.hidden, self.heads, kv_heads, self.ffn),
        }
    }
}

/// One way of training: what the layer keeps for backward, and the f32 run it is compared with.
#[derive(Debug, Clone)]
pub struct Variant {
    pub name: &'static str,
    /// The plain-candle layer (full precision kept by candle's graph).
    pub plain: bool,
    pub config: LayerConfig,
    /// The f32 variant of the same attention, which this one is paired with (`None` for f32).
    pub baseline: Option<&'static str>,
}

impl Variant {
    /// Every variant: f32 softmax (a), linear (h), gated (k) and input-gated (m) attention, and the compressed ones, on
    /// the layer of `s.arch` (a variant whose configuration the block rejects, e.g. linear
    /// attention in a Llama block, fails [`Variant::check`]).
    pub fn all(s: &Settings) -> Vec<Variant> {
        let base = s.layer();
        let linear = Attention::Linear {
            config: LinearAttentionConfig {
                chunk: s.chunk,
                memory: MemoryMode::Slim,
                ..LinearAttentionConfig::causal()
            },
            map: FeatureKind::Elu1,
        };
        // RetNet's decays, one per KV head (gated attention, issue 41)
        let gated = match Attention::retnet(base.kv_heads()) {
            Attention::Gated { config, log_decay } => {
                Attention::Gated { config: GatedConfig { chunk: s.chunk, ..config }, log_decay }
            }
            other => other,
        };
        // Mamba-2's input-dependent decay, one per step and KV head
        let input_gated = Attention::InputGated { config: GatedConfig { chunk: s.chunk, ..GatedConfig::default() } };
        let exact = LayerConfig { stats: StatsMode::Exact, ..base.clone() };
        let v = |name, plain, config, baseline| Variant { name, plain, config, baseline };
        vec![
            v("a", true, base.clone(), None),
            v("b", false, exact.clone(), Some("a")),
            v("c", false, LayerConfig { stats: StatsMode::Running, ..base.clone() }, Some("a")),
            v("d", false, LayerConfig { bits: 4, ..exact.clone() }, Some("a")),
            v("e", false, LayerConfig { attention: linear.clone(), ..exact.clone() }, Some("h")),
            v("f", false, LayerConfig { recompute: Recompute::Selective, ..exact.clone() }, Some("a")),
            v("g", false, LayerConfig { stochastic_rounding: true, ..exact.clone() }, Some("a")),
            v("h", true, LayerConfig { attention: linear, ..base.clone() }, None),
            v("i", false, LayerConfig { bits: 2, ..exact.clone() }, Some("a")),
            v("j", false, LayerConfig { attention: gated.clone(), ..exact.clone() }, Some("k")),
            v("k", true, LayerConfig { attention: gated, ..base.clone() }, None),
            v("l", false, LayerConfig { attention: input_gated.clone(), ..exact }, Some("m")),
            v("m", true, LayerConfig { attention: input_gated, ..base }, None),
        ]
    }

    /// Whether the variant exists for the block of its configuration: the reason it does not.
    pub fn check(&self) -> Result<(), String> {
        self.config.validate().map_err(|e| {
            let block = match self.config.block {
                Block::Gpt => "a GPT block",
                Block::Llama(_) => "a Llama block (--arch llama)",
            };
            format!(
                "variant {} ({}, {} attention) has no form in {block}: {e}",
                self.name,
                self.saved_precision(),
                self.attention()
            )
        })
    }

    pub fn saved_precision(&self) -> String {
        if self.plain {
            "f32".into()
        } else {
            let rounding = if self.config.stochastic_rounding { ", stochastic" } else { "" };
            format!("{}-bit codes{rounding}", self.config.bits)
        }
    }

    pub fn bits(&self) -> u32 {
        if self.plain {
            32
        } else {
            self.config.bits
        }
    }

    pub fn attention(&self) -> &'static str {
        match self.config.attention {
            Attention::Softmax { .. } => "softmax",
            Attention::Linear { .. } => "linear",
            Attention::Gated { .. } => "gated",
            Attention::InputGated { .. } => "input-gated",
        }
    }

    pub fn recompute(&self) -> &'static str {
        recompute_name(self.config.recompute)
    }

    pub fn stats(&self) -> &'static str {
        match (self.plain, self.config.stats) {
            (true, _) => "n/a",
            (false, StatsMode::Exact) => "exact",
            (false, StatsMode::Running) => "running",
        }
    }
}

pub fn recompute_name(r: Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    }
}

/// One variant at one seed.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// `variant.s<seed>`.
    pub name: String,
    pub variant: Variant,
    pub seed: u64,
    /// Read the running estimate (plotted) and probe gradient parity in this run.
    pub record: bool,
}

impl RunSpec {
    /// The runs of `variants` at every seed, seed by seed (so a cut-short batch of runs
    /// still holds complete pairs).
    pub fn all(s: &Settings, variants: &[Variant]) -> Vec<RunSpec> {
        let mut runs = Vec::new();
        for (i, &seed) in s.seeds.iter().enumerate() {
            for v in variants {
                runs.push(RunSpec { name: format!("{}.s{seed}", v.name), variant: v.clone(), seed, record: i == 0 });
            }
        }
        runs
    }
}

/// The planner's prediction of the bytes alive for backward per step of the layer stack
/// (the quantity measured here): `mesa_candle::plan::layer_stack_saved_bytes` for our layer,
/// and for the plain-candle layer the plain-f32 estimate (`reference_stack_estimate`; why it
/// differs from the measurement: `docs/plan.md`). An error (a block the planner does not
/// model) is the run's "not planned".
fn planned_bytes_per_step(
    layer: &LayerConfig,
    plain: bool,
    layers: usize,
    batch: usize,
    seq: usize,
) -> Result<u64, mesa_candle::Error> {
    if plain {
        mesa_candle::plan::reference_stack_estimate(layer, layers, batch, seq)
    } else {
        mesa_candle::plan::layer_stack_saved_bytes(layer, layers, batch, seq)
    }
}

/// The running estimate over training: `[site][reading][layer][head]`, sites as `sites`.
#[derive(Debug, Clone, Default)]
pub struct Estimates {
    pub run: String,
    /// The block's coded tensors (`LayerConfig::sites`: `CodeSite::GPT` or `CodeSite::ALL`).
    pub sites: Vec<CodeSite>,
    pub steps: Vec<usize>,
    pub offset: Vec<Vec<Vec<Vec<f32>>>>,
    pub range: Vec<Vec<Vec<Vec<f32>>>>,
}

fn record(est: &mut Estimates, step: usize, layers: &[Arc<TransformerLayer>]) -> Result<(), mesa_candle::Error> {
    est.steps.push(step);
    if est.offset.is_empty() {
        est.offset = vec![Vec::new(); est.sites.len()];
        est.range = vec![Vec::new(); est.sites.len()];
    }
    for (i, site) in est.sites.iter().enumerate() {
        let (mut off, mut rng) = (Vec::new(), Vec::new());
        for l in layers {
            let levels = ((1u32 << l.config().bits) - 1) as f32;
            let p = l.running_params(*site)?.unwrap_or_default();
            off.push(p.iter().map(|g| g.offset).collect());
            rng.push(p.iter().map(|g| g.scale * levels).collect());
        }
        est.offset[i].push(off);
        est.range[i].push(rng);
    }
    Ok(())
}

/// How the running estimate's codes fared over a run, per site (summed over layers and steps;
/// Mesa §3.3, `TransformerLayer::code_report`).
#[derive(Debug, Clone, Copy)]
pub struct SiteCodes {
    pub site: CodeSite,
    /// Group-batches: groups × layers × steps.
    pub groups: u64,
    /// Of those, saved with the batch's own range (it left the estimate by more than a step).
    pub widened: u64,
    /// The largest error of any saved element in quantization steps (bound, exact when
    /// above half a step: `CodeReport::max_error_steps`).
    pub max_error_steps: f64,
}

impl SiteCodes {
    fn new(site: CodeSite) -> Self {
        SiteCodes { site, groups: 0, widened: 0, max_error_steps: 0.0 }
    }
}

fn tally(codes: &mut [SiteCodes], layers: &[Arc<TransformerLayer>]) -> Result<(), mesa_candle::Error> {
    for c in codes.iter_mut() {
        for l in layers {
            if let Some(r) = l.code_report(c.site)? {
                c.groups += r.groups as u64;
                c.widened += r.widened_groups as u64;
                c.max_error_steps = c.max_error_steps.max(r.max_error_steps);
            }
        }
    }
    Ok(())
}

/// Memory of the whole training step (weights, optimizer state, activations, gradients and
/// transients), measured and planned.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepMemory {
    /// The model's and optimizer's bytes (the counter after `AdamW::new` minus before the
    /// model) plus the counter's peak during a step above its level at the step's start;
    /// largest over the steps after the first (the first allocates a process's lazy state).
    pub measured_peak: usize,
    /// The planner's total, `mesa_candle::plan::training_step` (`None` for the plain layer,
    /// which the planner bounds from below only).
    pub planned: Option<MemoryBreakdown>,
    /// The phase of the step where the planner puts the peak.
    pub planned_phase: Option<&'static str>,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub spec: RunSpec,
    /// `(step, mean training loss since the previous evaluation, validation loss)`.
    pub evals: Vec<(usize, f64, f64)>,
    pub final_val_loss: f64,
    /// Bytes alive for backward after the stack's forward, at the last step.
    pub saved_bytes: usize,
    /// Their smallest and largest value over the steps after the first.
    pub saved_range: (usize, usize),
    /// Peak during the stack's backward, the largest over the steps.
    pub peak_bytes: usize,
    pub planned: Option<u64>,
    pub memory: StepMemory,
    /// Why the planner predicted nothing for this run (its error: e.g. a block it does not
    /// model), `None` when it did.
    pub not_planned: Option<String>,
    /// Per site of the block (`LayerConfig::sites`), under running statistics.
    pub codes: Option<Vec<SiteCodes>>,
    pub estimates: Option<Estimates>,
    pub parity: Option<Parity>,
    pub wall_s: f64,
    /// The training loss of every step (`--tp` compares them step by step).
    pub step_losses: Vec<f64>,
}

pub fn learning_rate(s: &Settings, step: usize) -> f64 {
    let warm = (s.steps / 10).max(1);
    if step < warm {
        return s.lr * (step + 1) as f64 / warm as f64;
    }
    let t = (step - warm) as f64 / (s.steps - warm).max(1) as f64;
    s.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// Windows of the validation text per evaluation batch.
pub const VAL_BATCH: usize = 256;

/// Mean cross-entropy over every transition of the scored validation text
/// ([`data::val_windows`]), with the plain-candle forward of the run's parameters.
fn val_loss(model: &Model, corpus: &Corpus, s: &Settings, device: &Device) -> candle_core::Result<f64> {
    let len = s.val_len(corpus);
    let windows = data::val_windows(len, s.context);
    let (mut total, mut count) = (0.0, 0usize);
    for chunk in windows.chunks(VAL_BATCH) {
        let starts: Vec<usize> = chunk.iter().map(|w| w.0).collect();
        let (x, y) = data::windows(&corpus.val, &starts, s.context, device)?;
        let h = model.stack_eval(&model.embed(&x)?.detach())?;
        for (row, &(_, skip)) in model.head_nll(&h, &y)?.iter().zip(chunk) {
            total += row[skip..].iter().sum::<f64>();
            count += row.len() - skip;
        }
    }
    Ok(total / count as f64)
}

/// The seed of run `seed`'s data order (one per seed, shared by the runs it pairs).
pub fn data_seed(seed: u64) -> u64 {
    0x5EED_DA7A ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Trains one run.
pub fn train(
    counter: &'static CountingAllocator,
    corpus: &Corpus,
    s: &Settings,
    spec: &RunSpec,
    device: &Device,
) -> Result<RunResult, Box<dyn std::error::Error>> {
    let v = &spec.variant;
    let shape = Shape { vocab: corpus.vocab.len(), context: s.context, layers: s.layers };
    let base_level = counter.current();
    let mut model = Model::new(v.config.clone(), shape, v.plain, spec.seed, device)?;
    model.regions = s.regions;
    let params = ParamsAdamW { lr: s.lr, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.01 };
    let mut opt = AdamW::new(model.vars(), params)?;
    let model_bytes = counter.current().saturating_sub(base_level);
    let order = data::train_order(corpus.train.len(), s.context, s.batch, s.steps, data_seed(spec.seed));
    let running = !v.plain && v.config.stats == StatsMode::Running;
    let sites = v.config.sites();
    let mut est = (running && spec.record).then(|| Estimates {
        run: spec.name.clone(),
        sites: sites.to_vec(),
        ..Estimates::default()
    });
    let mut codes = running.then(|| sites.iter().copied().map(SiteCodes::new).collect::<Vec<_>>());
    let mut parity = (v.plain && spec.record && v.name == "a").then(|| Parity::new(&spec.name, s.parity_every()));
    let eval_at = s.eval_steps();
    let start = Instant::now();
    let mut evals = Vec::with_capacity(eval_at.len());
    let (mut train_sum, mut train_n) = (0.0, 0usize);
    let mut step_losses = Vec::with_capacity(s.steps);
    let (mut saved, mut saved_range, mut peak_max, mut step_peak) = (0usize, (usize::MAX, 0usize), 0usize, 0usize);
    for (step, starts) in order.iter().enumerate() {
        let step_level = counter.current();
        counter.reset_peak();
        opt.set_learning_rate(learning_rate(s, step));
        let (x, y) = data::windows(&corpus.train, starts, s.context, device)?;
        let h0 = model.embed(&x)?;
        let input_bytes = h0.elem_count() * h0.dtype().size_in_bytes();
        // the stack's forward: every byte it leaves alive is kept for its backward
        let before = counter.current();
        let h = model.stack_forward(&h0, step as u64)?;
        let alive = counter.current().saturating_sub(before) + input_bytes;
        // the head on a leaf: its backward gives dL/dh (the head is not measured)
        let leaf = Var::from_tensor(&h.detach())?;
        let loss = model.head_loss(leaf.as_tensor(), &y)?;
        let step_loss = f64::from(loss.to_scalar::<f32>()?);
        step_losses.push(step_loss);
        train_sum += step_loss;
        train_n += 1;
        let mut head_grads = loss.backward()?;
        drop(loss);
        let dy = head_grads.remove(leaf.as_tensor()).ok_or("no gradient for the stack's output")?;
        let head: Vec<_> = model.head_vars().into_iter().map(|v| (head_grads.remove(v.as_tensor()), v)).collect();
        drop((head_grads, leaf));
        // the stack's backward, as mesa_candle::layer::measure: peak above the level before it
        let level = counter.current();
        let mut whole_peak = counter.peak();
        counter.reset_peak();
        let mut grads = (&h * &dy)?.sum_all()?.backward()?;
        let peak = counter.peak().saturating_sub(level) + alive;
        for (g, v) in head {
            if let Some(g) = g {
                grads.insert(v.as_tensor(), g);
            }
        }
        whole_peak = whole_peak.max(counter.peak());
        if let (Some(p), Stack::Plain(layers)) = (parity.as_mut(), &model.stack) {
            if step % s.parity_every() == 0 || step + 1 == s.steps {
                p.probe(step, &v.config, layers, &h0.detach(), &dy, &grads)?;
            }
        }
        counter.reset_peak();
        opt.step(&grads)?;
        whole_peak = whole_peak.max(counter.peak());
        drop((grads, h, h0, dy));
        saved = alive;
        if step > 0 || s.steps == 1 {
            saved_range = (saved_range.0.min(alive), saved_range.1.max(alive));
            step_peak = step_peak.max(whole_peak.saturating_sub(step_level) + model_bytes);
        }
        peak_max = peak_max.max(peak);
        if let Stack::Mesa(layers) = &model.stack {
            if let Some(c) = codes.as_mut() {
                tally(c, layers)?;
            }
            if let Some(e) = est.as_mut() {
                if step % s.record_every == 0 || step + 1 == s.steps {
                    record(e, step + 1, layers)?;
                }
            }
        }
        if eval_at.contains(&(step + 1)) {
            evals.push((step + 1, train_sum / train_n.max(1) as f64, val_loss(&model, corpus, s, device)?));
            (train_sum, train_n) = (0.0, 0);
        }
    }
    let final_val_loss = evals.last().map_or(f64::NAN, |e| e.2);
    let mut not_planned = None;
    let planned = if s.regions {
        // the planner's region mode: each region's input and the last output; the plain layer
        // reads one variable per weight, ours one flat variable
        let parameters = match &model.stack {
            Stack::Plain(layers) => layers.first().map_or(0, HashMap::len),
            Stack::Mesa(_) => 1,
        };
        let shape = mesa_kernels::plan::ModelShape {
            layers: s.layers as u64,
            seq: s.context as u64,
            micro_batch: s.batch as u64,
            hidden: s.hidden as u64,
            heads: s.heads as u64,
            ffn: s.ffn as u64,
        };
        Some(mesa_candle::plan::region_stack_saved_bytes(shape, mesa_kernels::plan::Precision::F32, parameters)?)
    } else {
        planned_bytes_per_step(&v.config, v.plain, s.layers, s.batch, s.context)
            .map_err(|e| not_planned = Some(e.to_string()))
            .ok()
    };
    // the whole-step planner does not model regions (their backward's rerun)
    let whole = if v.plain || s.regions {
        None
    } else {
        let shape = TrainingShape { layers: s.layers, batch: s.batch, seq: s.context, vocab: corpus.vocab.len() };
        match mesa_candle::plan::training_step(&v.config, &shape) {
            Ok(p) => Some(p),
            // a block the planner does not model yet: reported as not planned, the run stands
            Err(e) if v.config.block != Block::Gpt => {
                not_planned.get_or_insert(e.to_string());
                None
            }
            Err(e) => return Err(e.into()),
        }
    };
    Ok(RunResult {
        spec: spec.clone(),
        evals,
        final_val_loss,
        saved_bytes: saved,
        saved_range,
        peak_bytes: peak_max,
        planned,
        not_planned,
        memory: StepMemory {
            measured_peak: step_peak,
            planned: whole.as_ref().map(|p| p.total),
            planned_phase: whole.as_ref().map(|p| p.peak_phase),
        },
        codes,
        estimates: est,
        parity,
        wall_s: start.elapsed().as_secs_f64(),
        step_losses,
    })
}
