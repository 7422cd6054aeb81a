//! One training run, its measurements, and the table and JSON of all runs.
use std::time::Instant;

use candle_core::{Device, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use mesa_candle::layer::{Attention, CodeSite, LayerConfig, Recompute, TransformerLayer};
use mesa_candle::ops::FeatureKind;
use mesa_candle::CountingAllocator;
use mesa_kernels::linear_attention::{LinearAttentionConfig, MemoryMode};
use mesa_kernels::StatsMode;
use serde_json::{json, Value};

use crate::data::{self, Corpus};
use crate::model::{Model, Shape, Stack};

/// The data order's seed: the same batches for every run and every initialisation seed.
const DATA_SEED: u64 = 0x5EED_DA7A;

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
    pub eval_every: usize,
    pub val_windows: usize,
    /// Peak learning rate (linear warm-up over the first 10 % of steps, cosine to 10 %).
    pub lr: f64,
    /// Linear attention's chunk (run e).
    pub chunk: usize,
    /// Steps between two readings of the running estimate (run c).
    pub record_every: usize,
    /// Initialisation seeds of run a (the first is every other run's).
    pub seeds_a: Vec<u64>,
}

/// One run of the list.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub name: String,
    pub seed: u64,
    /// The plain-candle layer (full precision kept by candle's graph).
    pub plain: bool,
    pub config: LayerConfig,
}

impl RunSpec {
    /// Runs a (one per seed), b, c, d, e, f.
    pub fn all(s: &Settings) -> Vec<RunSpec> {
        let base = LayerConfig::new(s.hidden, s.heads, s.ffn);
        let seed = s.seeds_a[0];
        let mut runs: Vec<RunSpec> = s
            .seeds_a
            .iter()
            .map(|&seed| RunSpec { name: format!("a.s{seed}"), seed, plain: true, config: base.clone() })
            .collect();
        let mesa = |name: &str, config: LayerConfig| RunSpec { name: name.into(), seed, plain: false, config };
        let linear = Attention::Linear {
            config: LinearAttentionConfig {
                chunk: s.chunk,
                memory: MemoryMode::Slim,
                ..LinearAttentionConfig::causal()
            },
            map: FeatureKind::Elu1,
        };
        runs.push(mesa("b", LayerConfig { stats: StatsMode::Exact, ..base.clone() }));
        runs.push(mesa("c", LayerConfig { stats: StatsMode::Running, ..base.clone() }));
        runs.push(mesa("d", LayerConfig { bits: 4, ..base.clone() }));
        runs.push(mesa("e", LayerConfig { attention: linear, ..base.clone() }));
        runs.push(mesa("f", LayerConfig { recompute: Recompute::Selective, ..base.clone() }));
        // b with stochastic rounding (issue 30): must end within run a's seed-to-seed spread
        runs.push(mesa("g", LayerConfig { stats: StatsMode::Exact, stochastic_rounding: true, ..base }));
        runs
    }

    fn saved_precision(&self) -> String {
        if self.plain {
            "f32".into()
        } else {
            let rounding = if self.config.stochastic_rounding { ", stochastic" } else { "" };
            format!("{}-bit codes{rounding}", self.config.bits)
        }
    }

    fn bits(&self) -> u32 {
        if self.plain {
            32
        } else {
            self.config.bits
        }
    }

    fn attention(&self) -> &'static str {
        match self.config.attention {
            Attention::Softmax { .. } => "softmax",
            Attention::Linear { .. } => "linear",
        }
    }

    fn recompute(&self) -> &'static str {
        match self.config.recompute {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }

    fn stats(&self) -> &'static str {
        match (self.plain, self.config.stats) {
            (true, _) => "n/a",
            (false, StatsMode::Exact) => "exact",
            (false, StatsMode::Running) => "running",
        }
    }
}

/// The planner's prediction of the bytes alive for backward per step of the layer stack
/// (the quantity measured here): `mesa_candle::plan::layer_stack_saved_bytes` for our layer,
/// and for the plain-candle layer (run a) the plain-f32 estimate
/// (`reference_stack_estimate`; why it differs from the measurement: `docs/plan.md`).
fn planned_bytes_per_step(layer: &LayerConfig, plain: bool, layers: usize, batch: usize, seq: usize) -> Option<u64> {
    let planned = if plain {
        mesa_candle::plan::reference_stack_estimate(layer, layers, batch, seq)
    } else {
        mesa_candle::plan::layer_stack_saved_bytes(layer, layers, batch, seq)
    };
    planned.ok()
}

/// The running estimate of run c over training: `[reading][layer][head]`.
#[derive(Debug, Clone, Default)]
pub struct Estimates {
    pub steps: Vec<usize>,
    /// Per site ([`ESTIMATE_SITES`]): offsets and ranges.
    pub offset: Vec<Vec<Vec<Vec<f32>>>>,
    pub range: Vec<Vec<Vec<Vec<f32>>>>,
}

/// The sites whose running estimate is plotted.
pub const ESTIMATE_SITES: [(CodeSite, &str); 2] = [(CodeSite::Q, "Q"), (CodeSite::K, "K")];

fn record(est: &mut Estimates, step: usize, layers: &[TransformerLayer]) -> Result<(), mesa_candle::Error> {
    est.steps.push(step);
    if est.offset.is_empty() {
        est.offset = vec![Vec::new(); ESTIMATE_SITES.len()];
        est.range = vec![Vec::new(); ESTIMATE_SITES.len()];
    }
    for (i, (site, _)) in ESTIMATE_SITES.iter().enumerate() {
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
    pub wall_s: f64,
}

/// Points of the loss plot.
pub struct Curves<'a> {
    pub name: &'a str,
    pub val: Vec<(f64, f64)>,
    pub train: Vec<(f64, f64)>,
}

impl RunResult {
    pub fn curves(&self) -> Curves<'_> {
        Curves {
            name: &self.spec.name,
            val: self.evals.iter().map(|&(s, _, v)| (s as f64, v)).collect(),
            train: self.evals.iter().skip(1).map(|&(s, t, _)| (s as f64, t)).collect(),
        }
    }
}

fn learning_rate(s: &Settings, step: usize) -> f64 {
    let warm = (s.steps / 10).max(1);
    if step < warm {
        return s.lr * (step + 1) as f64 / warm as f64;
    }
    let t = (step - warm) as f64 / (s.steps - warm).max(1) as f64;
    s.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

fn val_loss(model: &Model, corpus: &Corpus, s: &Settings, device: &Device) -> candle_core::Result<f64> {
    let starts = data::val_starts(corpus.val.len(), s.context, s.val_windows);
    let mut total = 0.0;
    for chunk in starts.chunks(s.batch) {
        let (x, y) = data::windows(&corpus.val, chunk, s.context, device)?;
        let h = model.stack_eval(&model.embed(&x)?.detach())?;
        let loss = model.head_loss(&h, &y)?.detach().to_scalar::<f32>()?;
        total += f64::from(loss) * chunk.len() as f64;
    }
    Ok(total / starts.len() as f64)
}

/// Trains one run; the running estimate's readings for a run with running statistics.
pub fn train(
    counter: &'static CountingAllocator,
    corpus: &Corpus,
    s: &Settings,
    spec: &RunSpec,
    device: &Device,
) -> Result<(RunResult, Option<Estimates>), Box<dyn std::error::Error>> {
    let shape = Shape { vocab: corpus.vocab.len(), context: s.context, layers: s.layers };
    let model = Model::new(spec.config.clone(), shape, spec.plain, spec.seed, device)?;
    let params = ParamsAdamW { lr: s.lr, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.01 };
    let mut opt = AdamW::new(model.vars(), params)?;
    let order = data::train_order(corpus.train.len(), s.context, s.batch, s.steps, DATA_SEED);
    let running = !spec.plain && spec.config.stats == StatsMode::Running;
    let mut est = running.then(Estimates::default);
    let start = Instant::now();
    let mut evals = vec![(0, f64::NAN, val_loss(&model, corpus, s, device)?)];
    let (mut train_sum, mut train_n) = (0.0, 0usize);
    let (mut saved, mut saved_range, mut peak_max) = (0usize, (usize::MAX, 0usize), 0usize);
    for (step, starts) in order.iter().enumerate() {
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
        train_sum += f64::from(loss.to_scalar::<f32>()?);
        train_n += 1;
        let mut head_grads = loss.backward()?;
        drop(loss);
        let dy = head_grads.remove(leaf.as_tensor()).ok_or("no gradient for the stack's output")?;
        let head: Vec<_> = model.head_vars().into_iter().map(|v| (head_grads.remove(v.as_tensor()), v)).collect();
        drop((head_grads, leaf));
        // the stack's backward, as mesa_candle::layer::measure: peak above the level before it
        let level = counter.current();
        counter.reset_peak();
        let mut grads = (&h * &dy)?.sum_all()?.backward()?;
        let peak = counter.peak().saturating_sub(level) + alive;
        for (g, v) in head {
            if let Some(g) = g {
                grads.insert(v.as_tensor(), g);
            }
        }
        opt.step(&grads)?;
        drop((grads, h, h0));
        saved = alive;
        if step > 0 || s.steps == 1 {
            saved_range = (saved_range.0.min(alive), saved_range.1.max(alive));
        }
        peak_max = peak_max.max(peak);
        if let (Some(e), Stack::Mesa(layers)) = (est.as_mut(), &model.stack) {
            if step % s.record_every == 0 || step + 1 == s.steps {
                record(e, step + 1, layers)?;
            }
        }
        if (step + 1) % s.eval_every == 0 || step + 1 == s.steps {
            evals.push((step + 1, train_sum / train_n.max(1) as f64, val_loss(&model, corpus, s, device)?));
            (train_sum, train_n) = (0.0, 0);
        }
    }
    let final_val_loss = evals.last().map_or(f64::NAN, |e| e.2);
    let planned = planned_bytes_per_step(&spec.config, spec.plain, s.layers, s.batch, s.context);
    let result = RunResult {
        spec: spec.clone(),
        evals,
        final_val_loss,
        saved_bytes: saved,
        saved_range,
        peak_bytes: peak_max,
        planned,
        wall_s: start.elapsed().as_secs_f64(),
    };
    Ok((result, est))
}

/// Run a's spread and the targets.
pub struct Summary {
    pub bigram: f64,
    /// Run a at the first seed (`a.s0`), if it ran.
    pub a: Option<f64>,
    /// Max − min of the final validation loss over the run-a seeds that ran (0 for one).
    pub a_spread: f64,
    /// Run a.s0's bytes alive for backward, if it ran.
    pub a_bytes: Option<usize>,
    pub checks: Vec<(String, bool)>,
}

/// The planner's aim: within 2 % of the measured bytes for the runs of our layer.
const PLANNED_WITHIN: f64 = 0.02;
/// The CPU configuration's aim for all runs together, minutes.
const CPU_MINUTES: f64 = 20.0;

impl Summary {
    /// The targets that the runs in `results` allow: those against run a need `a.s0`;
    /// the time aim applies to the `cpu` configuration with every run.
    pub fn new(s: &Settings, results: &[RunResult], bigram: f64, all_runs: bool) -> Self {
        let get = |n: &str| results.iter().find(|r| r.spec.name == n);
        let a_runs: Vec<&RunResult> = results.iter().filter(|r| r.spec.plain).collect();
        let a0 = get(&format!("a.s{}", s.seeds_a[0]));
        let (a, a_bytes) = (a0.map(|r| r.final_val_loss), a0.map(|r| r.saved_bytes));
        let (lo, hi) = a_runs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
            (lo.min(r.final_val_loss), hi.max(r.final_val_loss))
        });
        let a_spread = if a_runs.is_empty() { 0.0 } else { hi - lo };
        let mut checks = Vec::new();
        if let Some(a) = a {
            checks.push((format!("a ({a:.4}) < bigram ({bigram:.4})"), a < bigram));
            let tol = (0.01 * a).max(a_spread);
            for n in ["b", "c", "f", "g"] {
                if let Some(r) = get(n) {
                    let d = r.final_val_loss - a;
                    checks.push((
                        format!("|{n} − a| = {:.4} ≤ max(1 % of a, a's spread) = {tol:.4}", d.abs()),
                        d.abs() <= tol,
                    ));
                }
            }
        }
        if let (Some(b), Some(c)) = (get("b"), get("c")) {
            let d = (c.final_val_loss - b.final_val_loss).abs();
            checks.push((
                format!("|c − b| = {d:.4} ≤ 0.5 % of b = {:.4}", 0.005 * b.final_val_loss),
                d <= 0.005 * b.final_val_loss,
            ));
        }
        if let (Some(b), Some(a_bytes)) = (get("b"), a_bytes) {
            let ratio = b.saved_bytes as f64 / a_bytes as f64;
            checks.push((format!("bytes b / a = {ratio:.3} ≤ 0.30"), ratio <= 0.30));
        }
        for r in results.iter().filter(|r| !r.spec.plain) {
            if let Some(p) = r.planned {
                let rel = (r.saved_bytes as f64 - p as f64).abs() / r.saved_bytes as f64;
                checks.push((
                    format!(
                        "planned vs measured bytes, {}: {p} / {} ({:.2} %) ≤ {:.0} %",
                        r.spec.name,
                        r.saved_bytes,
                        100.0 * rel,
                        100.0 * PLANNED_WITHIN
                    ),
                    rel <= PLANNED_WITHIN,
                ));
            }
        }
        if s.name == "cpu" && all_runs {
            let total: f64 = results.iter().map(|r| r.wall_s).sum();
            checks.push((
                format!("all runs in {total:.0} s ≤ {CPU_MINUTES:.0} min (this machine, as loaded now)"),
                total <= 60.0 * CPU_MINUTES,
            ));
        }
        Summary { bigram, a, a_spread, a_bytes, checks }
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The table (Markdown).
pub fn print_table(s: &Settings, results: &[RunResult], sum: &Summary, corpus: &Corpus, cpu: bool) {
    println!(
        "# train_shakespeare --config {}: L={} C={} H={} F={} T={} B={}, {} steps, AdamW lr {} (warm-up, cosine), {}",
        s.name,
        s.layers,
        s.hidden,
        s.heads,
        s.ffn,
        s.context,
        s.batch,
        s.steps,
        s.lr,
        if cpu { "CPU (kernels: host emulation)" } else { "CUDA" }
    );
    println!(
        "# text: {} train / {} validation characters, vocabulary {}; bigram baseline (add-one, fitted on train): {:.4} nats/char\n",
        corpus.train.len(),
        corpus.val.len(),
        corpus.vocab.len(),
        sum.bigram
    );
    let steps: Vec<usize> = results.first().map(|r| r.evals.iter().map(|e| e.0).collect()).unwrap_or_default();
    let mut head = String::from("| run | saved | stats | attention | recompute |");
    for st in &steps[1..] {
        head += &format!(" train/val @{st} |");
    }
    head += " final val | bytes alive for backward | peak in backward | planned | wall s |";
    println!("{head}");
    println!("{}", "|---".repeat(head.matches('|').count() - 1) + "|");
    for r in results {
        let mut row = format!(
            "| {} | {} | {} | {} | {} |",
            r.spec.name,
            r.spec.saved_precision(),
            r.spec.stats(),
            r.spec.attention(),
            r.spec.recompute()
        );
        for e in &r.evals[1..] {
            row += &format!(" {:.3} / {:.3} |", e.1, e.2);
        }
        let planned = r.planned.map_or("n/a".to_string(), |p| format!("{:.2} MiB", mib(p as usize)));
        let vs_a = sum.a_bytes.map_or(String::new(), |a| format!(" ({:.3}× a)", r.saved_bytes as f64 / a as f64));
        row += &format!(
            " {:.4} | {:.2} MiB{vs_a} | {:.2} MiB | {planned} | {:.0} |",
            r.final_val_loss,
            mib(r.saved_bytes),
            mib(r.peak_bytes),
            r.wall_s
        );
        println!("{row}");
    }
    match sum.a {
        Some(a) => println!("\nrun a (seed {}): {a:.4}, seed-to-seed spread {:.4}", s.seeds_a[0], sum.a_spread),
        None => println!("\nrun a.s{} not run: the targets against run a are left out", s.seeds_a[0]),
    }
    for (what, ok) in &sum.checks {
        println!("target {}: {what}", if *ok { "met" } else { "NOT met" });
    }
}

/// The `--json` object.
pub fn json(s: &Settings, results: &[RunResult], sum: &Summary, corpus: &Corpus) -> Value {
    let runs: Vec<Value> = results
        .iter()
        .map(|r| {
            json!({
                "name": r.spec.name,
                "seed": r.spec.seed,
                "saved_precision": r.spec.saved_precision(),
                "bits": r.spec.bits(),
                "stats": r.spec.stats(),
                "attention": r.spec.attention(),
                "recompute": r.spec.recompute(),
                "final_val_loss": r.final_val_loss,
                "saved_bytes_per_step": r.saved_bytes,
                "saved_bytes_min_max": [r.saved_range.0, r.saved_range.1],
                "peak_backward_bytes": r.peak_bytes,
                "planned_bytes_per_step": r.planned,
                "wall_s": r.wall_s,
                "evals": r.evals.iter().map(|e| json!({"step": e.0, "train_loss": if e.1.is_nan() { Value::Null } else { json!(e.1) }, "val_loss": e.2})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "config": s.name,
        "sizes": {"layers": s.layers, "hidden": s.hidden, "heads": s.heads, "ffn": s.ffn, "context": s.context, "batch": s.batch, "steps": s.steps},
        "vocab": corpus.vocab.len(),
        "bigram_val_loss": sum.bigram,
        "a_seed_spread": sum.a_spread,
        "targets": sum.checks.iter().map(|(w, ok)| json!({"target": w, "met": ok})).collect::<Vec<_>>(),
        "runs": runs,
    })
}
