//! Paired statistics over the seeds, the targets, and the table, JSON and Markdown of all runs.
use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::data::Corpus;
use crate::run::{Arch, RunResult, Settings, Variant};

/// The smallest difference in final validation loss worth reporting, nats per character
/// (about 1 % of the losses here): the f32 runs' seed spread must stay below it for the
/// configuration to tell compression apart from noise.
pub const MIN_EFFECT: f64 = 0.02;
/// The planner's aims: bytes alive for backward within 2 %, the whole step's peak within 5 %.
const PLANNED_SAVED_WITHIN: f64 = 0.02;
const PLANNED_PEAK_WITHIN: f64 = 0.05;
/// The CPU configuration's aim for the default set of runs, minutes.
const CPU_MINUTES: f64 = 20.0;

/// Two-sided 95 % quantile of Student's t with `df` degrees of freedom (df ≥ 1; past 30 the
/// normal's 1.96, at most 2 % narrower).
fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.wrapping_sub(1)).copied().unwrap_or(1.96)
}

/// A statistic for the report: `n/a` when it is undefined (one seed).
fn num(x: f64, digits: usize, sign: bool) -> String {
    match (x.is_finite(), sign) {
        (false, _) => "n/a".into(),
        (true, true) => format!("{x:+.digits$}"),
        (true, false) => format!("{x:.digits$}"),
    }
}

/// Mean, sample standard deviation and standard error of the mean.
fn mean_se(xs: &[f64]) -> (f64, f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, f64::NAN, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt(), var.sqrt() / n.sqrt())
}

/// A variant's final validation loss against its f32 baseline, paired seed by seed.
#[derive(Debug, Clone)]
pub struct Difference {
    pub variant: &'static str,
    pub baseline: &'static str,
    /// `(seed, variant − baseline)`.
    pub per_seed: Vec<(u64, f64)>,
    pub mean: f64,
    /// Standard error of the mean paired difference (`sd / √n`).
    pub se: f64,
    /// 95 % confidence interval (Student's t, `n − 1` degrees of freedom).
    pub ci95: (f64, f64),
}

fn final_of(results: &[RunResult], variant: &str, seed: u64) -> Option<f64> {
    results.iter().find(|r| r.spec.variant.name == variant && r.spec.seed == seed).map(|r| r.final_val_loss)
}

/// The paired difference of `v`, or `None` when fewer than one pair ran.
pub fn difference(results: &[RunResult], s: &Settings, v: &Variant) -> Option<Difference> {
    let baseline = v.baseline?;
    let per_seed: Vec<(u64, f64)> = s
        .seeds
        .iter()
        .filter_map(|&seed| Some((seed, final_of(results, v.name, seed)? - final_of(results, baseline, seed)?)))
        .collect();
    if per_seed.is_empty() {
        return None;
    }
    let d: Vec<f64> = per_seed.iter().map(|p| p.1).collect();
    let (mean, _, se) = mean_se(&d);
    let half = t95(d.len().saturating_sub(1).max(1)) * se;
    Some(Difference { variant: v.name, baseline, per_seed, mean, se, ci95: (mean - half, mean + half) })
}

/// One point of a paired-difference curve: `(step, mean, standard error)`.
pub type DiffPoint = (f64, f64, f64);

/// The paired difference at every evaluation.
pub fn difference_curve(results: &[RunResult], s: &Settings, v: &Variant) -> Vec<DiffPoint> {
    let Some(baseline) = v.baseline else { return Vec::new() };
    let pairs: Vec<(&RunResult, &RunResult)> = s
        .seeds
        .iter()
        .filter_map(|&seed| {
            let find = |n: &str| results.iter().find(|r| r.spec.variant.name == n && r.spec.seed == seed);
            Some((find(v.name)?, find(baseline)?))
        })
        .collect();
    let Some(first) = pairs.first() else { return Vec::new() };
    (0..first.0.evals.len())
        .map(|i| {
            let d: Vec<f64> = pairs.iter().map(|(r, b)| r.evals[i].2 - b.evals[i].2).collect();
            let (mean, _, se) = mean_se(&d);
            (first.0.evals[i].0 as f64, mean, se)
        })
        .collect()
}

/// Per variant: the mean validation loss over the seeds at every evaluation.
pub fn mean_curve(results: &[RunResult], v: &Variant) -> Vec<(f64, f64)> {
    let runs: Vec<&RunResult> = results.iter().filter(|r| r.spec.variant.name == v.name).collect();
    let Some(first) = runs.first() else { return Vec::new() };
    (0..first.evals.len())
        .map(|i| (first.evals[i].0 as f64, runs.iter().map(|r| r.evals[i].2).sum::<f64>() / runs.len() as f64))
        .collect()
}

/// One target: a fixed id (the same in every configuration), what was checked, and whether
/// it was met (`None`: not applicable to this configuration or these runs).
pub struct Target {
    pub id: String,
    pub what: String,
    pub met: Option<bool>,
}

/// Everything the table, the JSON and the Markdown report.
pub struct Summary {
    pub bigram: f64,
    pub val_len: usize,
    /// Max − min of the final validation loss over the seeds, per f32 variant that ran.
    pub spreads: Vec<(&'static str, f64)>,
    pub differences: Vec<Difference>,
    pub targets: Vec<Target>,
    pub total_wall_s: f64,
}

fn seed0<'a>(results: &'a [RunResult], s: &Settings, v: &str) -> Option<&'a RunResult> {
    results.iter().find(|r| r.spec.variant.name == v && r.spec.seed == s.seeds[0])
}

impl Summary {
    /// `default_set`: the configuration's default variants ran, each at every seed.
    pub fn new(s: &Settings, variants: &[Variant], results: &[RunResult], corpus: &Corpus, default_set: bool) -> Self {
        let val_len = s.val_len(corpus);
        let bigram = corpus.bigram_val_loss(val_len);
        let mut spreads = Vec::new();
        for v in variants.iter().filter(|v| v.plain) {
            let finals: Vec<f64> =
                results.iter().filter(|r| r.spec.variant.name == v.name).map(|r| r.final_val_loss).collect();
            // a spread needs two seeds
            if finals.len() > 1 {
                let (lo, hi) =
                    finals.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| (l.min(x), h.max(x)));
                spreads.push((v.name, hi - lo));
            }
        }
        let differences: Vec<Difference> = variants.iter().filter_map(|v| difference(results, s, v)).collect();
        let mut targets = Vec::new();
        let mut push = |id: String, what: String, met: Option<bool>| targets.push(Target { id, what, met });
        let a_mean = {
            let a: Vec<f64> = results.iter().filter(|r| r.spec.variant.name == "a").map(|r| r.final_val_loss).collect();
            (!a.is_empty()).then(|| a.iter().sum::<f64>() / a.len() as f64)
        };
        push(
            "a_below_bigram".into(),
            match a_mean {
                Some(a) => format!("run a ({a:.4}, mean over seeds) < bigram ({bigram:.4}) on the same positions"),
                None => "run a did not run".into(),
            },
            a_mean.map(|a| a < bigram),
        );
        for (name, spread) in &spreads {
            push(
                format!("spread_{name}"),
                format!("f32 run {name}: seed spread {spread:.4} < smallest effect worth reporting {MIN_EFFECT}"),
                Some(*spread < MIN_EFFECT),
            );
        }
        for d in &differences {
            let v = variants.iter().find(|v| v.name == d.variant).map_or(32, Variant::bits);
            if v == 8 {
                push(
                    format!("equivalent_{}", d.variant),
                    format!(
                        "{} − {}: 95 % interval [{}, {}] inside ±{MIN_EFFECT} (no effect worth reporting)",
                        d.variant,
                        d.baseline,
                        num(d.ci95.0, 4, true),
                        num(d.ci95.1, 4, true)
                    ),
                    (d.per_seed.len() > 1).then(|| d.ci95.0 > -MIN_EFFECT && d.ci95.1 < MIN_EFFECT),
                );
            }
        }
        if let (Some(b), Some(a)) = (seed0(results, s, "b"), seed0(results, s, "a")) {
            let ratio = b.saved_bytes as f64 / a.saved_bytes as f64;
            push(
                "bytes_b_over_a".into(),
                format!("bytes alive for backward b / a = {ratio:.3} ≤ 0.30"),
                Some(ratio <= 0.30),
            );
        }
        for v in variants.iter().filter(|v| !v.plain) {
            let Some(r) = seed0(results, s, v.name) else { continue };
            if let Some(p) = r.planned {
                let rel = (r.saved_bytes as f64 - p as f64).abs() / r.saved_bytes as f64;
                push(
                    format!("planned_saved_{}", v.name),
                    format!(
                        "{}: planned / measured bytes alive for backward {p} / {} ({:.2} %) ≤ {:.0} %",
                        r.spec.name,
                        r.saved_bytes,
                        100.0 * rel,
                        100.0 * PLANNED_SAVED_WITHIN
                    ),
                    Some(rel <= PLANNED_SAVED_WITHIN),
                );
            }
            let m = r.memory;
            let (what, met) = match m.planned.map(|p| p.total) {
                Some(p) => {
                    let rel = (m.measured_peak as f64 - p as f64).abs() / m.measured_peak as f64;
                    (
                        format!(
                            "{}: planned / measured peak of the training step {p} / {} ({:.2} %) ≤ {:.0} %",
                            r.spec.name,
                            m.measured_peak,
                            100.0 * rel,
                            100.0 * PLANNED_PEAK_WITHIN
                        ),
                        Some(rel <= PLANNED_PEAK_WITHIN),
                    )
                }
                None => match &r.not_planned {
                    Some(why) => (format!("{}: not planned ({why})", r.spec.name), None),
                    None => (format!("{}: no planned peak", r.spec.name), None),
                },
            };
            push(format!("planned_peak_{}", v.name), what, met);
        }
        let total_wall_s: f64 = results.iter().map(|r| r.wall_s).sum();
        push(
            "cpu_minutes".into(),
            format!("default set of runs in {total_wall_s:.0} s ≤ {CPU_MINUTES:.0} min (configuration cpu; this machine, as loaded now)"),
            (s.name == "cpu" && default_set).then_some(total_wall_s <= 60.0 * CPU_MINUTES),
        );
        Summary { bigram, val_len, spreads, differences, targets, total_wall_s }
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn met(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "n/a",
    }
}

/// The report in Markdown: the configuration, the paired table, gradient parity, the
/// running estimate, memory and the targets (`print`ed by default, `results.md` in `--out`).
pub fn markdown(s: &Settings, variants: &[Variant], results: &[RunResult], sum: &Summary, corpus: &Corpus) -> String {
    let mut o = String::new();
    let arch = match s.arch {
        Arch::Gpt => String::new(),
        Arch::Llama { kv_heads } => format!(
            ", Llama (`--arch llama`: no position embedding, RoPE base 10 000, pre-RMSNorm, grouped-query attention with H_kv={kv_heads}, SwiGLU, final RMSNorm)"
        ),
    };
    let _ = writeln!(
        o,
        "Configuration `{}`{arch}: L={} C={} H={} F={} T={} B={}, {} steps, AdamW lr {} (warm-up 10 %, cosine to 10 %), seeds {:?} (each sets the initialisation and the data order; runs of one seed are paired). Validation: all {} transitions of the first {} validation characters (non-overlapping windows of {}, the last aligned to the end); bigram (add-one, fitted on train) on the same transitions: {:.4} nats/char. Smallest effect worth reporting: {MIN_EFFECT} nats/char.\n",
        s.name, s.layers, s.hidden, s.heads, s.ffn, s.context, s.batch, s.steps, s.lr, s.seeds,
        sum.val_len - 1, sum.val_len, s.context, sum.bigram
    );
    let _ = writeln!(
        o,
        "| run | saved | stats | attention | recompute | final val per seed | mean | − baseline (paired, mean ± SE) | 95 % interval | bytes alive for backward (seed {}) | wall s (all seeds) |",
        s.seeds[0]
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|---|");
    for v in variants {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.spec.variant.name == v.name).collect();
        if runs.is_empty() {
            continue;
        }
        let finals: Vec<String> = runs.iter().map(|r| format!("{:.4}", r.final_val_loss)).collect();
        let mean = runs.iter().map(|r| r.final_val_loss).sum::<f64>() / runs.len() as f64;
        let (diff, ci) = match sum.differences.iter().find(|d| d.variant == v.name) {
            Some(d) => (
                format!("{} {:+.4} ± {}", d.baseline, d.mean, num(d.se, 4, false)),
                format!("[{}, {}]", num(d.ci95.0, 4, true), num(d.ci95.1, 4, true)),
            ),
            None if v.plain => ("baseline".into(), "—".into()),
            None => (format!("— ({} did not run)", v.baseline.unwrap_or("?")), "—".into()),
        };
        let bytes = runs
            .iter()
            .find(|r| r.spec.seed == s.seeds[0])
            .map_or("—".into(), |r| format!("{:.3} MiB", mib(r.saved_bytes)));
        let wall: f64 = runs.iter().map(|r| r.wall_s).sum();
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {mean:.4} | {diff} | {ci} | {bytes} | {wall:.0} |",
            v.name,
            v.saved_precision(),
            v.stats(),
            v.attention(),
            v.recompute(),
            finals.join(" / ")
        );
    }
    let spreads: Vec<String> = sum.spreads.iter().map(|(n, x)| format!("{n}: {x:.4}")).collect();
    let _ = writeln!(
        o,
        "\nf32 seed spread (max − min of the final validation loss over the seeds): {}; smallest effect worth reporting: {MIN_EFFECT}. All runs: {:.0} s.\n",
        if spreads.is_empty() { "none (fewer than two seeds of an f32 run)".to_string() } else { spreads.join(", ") },
        sum.total_wall_s
    );
    if let Some(p) = results.iter().find_map(|r| r.parity.as_ref()) {
        // the zero-gradient parameters the block has (a Llama block has no key bias)
        let zero: Vec<&str> = crate::parity::ZERO_GRADIENT
            .into_iter()
            .filter(|z| p.series.iter().flat_map(|se| &se.params).any(|(n, _)| n.ends_with(z)))
            .collect();
        let left_out = if zero.is_empty() {
            String::new()
        } else {
            format!(", `{}` left out — its exact gradient is 0", zero.join(", "))
        };
        let _ = writeln!(
            o,
            "Gradient parity along run {}'s trajectory (probes every {} steps, {} probes; the stack's parameter gradients through our layer, exact statistics, against the f32 gradients of the same weights, batch and output gradient; worst over parameters{left_out}):\n",
            p.run,
            p.every,
            p.steps.len(),
        );
        let _ = writeln!(o, "| codes | recompute | worst cosine, first probe | worst cosine, last probe | lowest over probes | worst rel. error, last probe | highest over probes |");
        let _ = writeln!(o, "|---|---|---|---|---|---|---|");
        for se in &p.series {
            let n = p.steps.len();
            let worst: Vec<_> = (0..n).map(|i| se.worst(i)).collect();
            let lo = worst.iter().map(|w| w.cosine).fold(f64::INFINITY, f64::min);
            let hi = worst.iter().map(|w| w.rel_err).fold(0.0, f64::max);
            if let (Some(f), Some(l)) = (worst.first(), worst.last()) {
                let _ = writeln!(
                    o,
                    "| {}-bit | {} | {:.5} | {:.5} | {lo:.5} | {:.4} | {hi:.4} |",
                    se.bits,
                    crate::run::recompute_name(se.recompute),
                    f.cosine,
                    l.cosine,
                    l.rel_err
                );
            }
        }
        let _ = writeln!(o);
    }
    let coded: Vec<&RunResult> = results.iter().filter(|r| r.codes.is_some()).collect();
    if !coded.is_empty() {
        let names: Vec<String> = coded[0].codes.iter().flatten().map(|c| format!("{:?}", c.site)).collect();
        let _ = writeln!(
            o,
            "Running estimate in training (Mesa §3.3, momentum 0.9): per run and coded tensor, the groups saved with the batch's own range because it left the estimate by more than one step (widened, of all group-batches: groups × layers × steps), and the largest error of a saved element in quantization steps (bound ½ inside the range, exact above it).\n"
        );
        let _ = writeln!(o, "| run | {} |", names.join(" | "));
        let _ = writeln!(o, "|---|{}", "---|".repeat(names.len()));
        for r in coded {
            let cells: Vec<String> = r
                .codes
                .iter()
                .flatten()
                .map(|c| format!("{} / {} widened, {:.3}", c.widened, c.groups, c.max_error_steps))
                .collect();
            let _ = writeln!(o, "| {} | {} |", r.spec.name, cells.join(" | "));
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(
        o,
        "Memory of a training step (seed {}): the counter's peak during a step above its level before the model was built (weights, AdamW state, batch, activations, gradients and transients), after the first step, against the planner's total.\n",
        s.seeds[0]
    );
    let _ = writeln!(
        o,
        "| run | measured peak | planned: weights + grads + AdamW + activations + transient = total (peak phase) | planned / measured | bytes alive for backward: measured, planned / measured |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    for r in results.iter().filter(|r| r.spec.seed == s.seeds[0]) {
        let m = r.memory;
        let kib = |b: u64| format!("{:.0}", b as f64 / 1024.0);
        let (planned, ratio) = match m.planned {
            Some(p) => (
                format!(
                    "{} + {} + {} + {} + {} = {} KiB ({})",
                    kib(p.weights),
                    kib(p.gradients),
                    kib(p.optimizer_state),
                    kib(p.activations),
                    kib(p.transient),
                    kib(p.total),
                    m.planned_phase.unwrap_or("?")
                ),
                format!("{:.4}", p.total as f64 / m.measured_peak as f64),
            ),
            None if r.spec.variant.plain => ("— (plain layer: the planner gives a floor only)".into(), "—".into()),
            None => match &r.not_planned {
                // the reason is in the targets below
                Some(_) => ("— (not planned)".into(), "—".into()),
                None => ("—".into(), "—".into()),
            },
        };
        let saved = match (r.planned, &r.not_planned) {
            (Some(p), _) => format!("{:.4}", p as f64 / r.saved_bytes as f64),
            (None, Some(_)) => "not planned".into(),
            (None, None) => "—".into(),
        };
        let _ = writeln!(
            o,
            "| {} | {} KiB | {planned} | {ratio} | {} KiB, {saved} |",
            r.spec.name,
            kib(m.measured_peak as u64),
            kib(r.saved_bytes as u64)
        );
    }
    let _ = writeln!(o);
    for t in &sum.targets {
        let _ = writeln!(o, "- {}: {}", met(t.met), t.what);
    }
    let _ = corpus;
    o
}

/// The JSON object (`results.json`).
///
/// A Llama model's object has three more keys: `arch`, `sizes.kv_heads` and each run's
/// `not_planned` (a GPT model's keeps the keys of the committed CPU results, which CI checks
/// with `scripts/train-json-shape.py`).
pub fn json(s: &Settings, results: &[RunResult], sum: &Summary, corpus: &Corpus) -> Value {
    let llama = matches!(s.arch, Arch::Llama { .. });
    let runs: Vec<Value> = results
        .iter()
        .map(|r| {
            let v = &r.spec.variant;
            let mut run = json!({
                "name": r.spec.name,
                "variant": v.name,
                "seed": r.spec.seed,
                "saved_precision": v.saved_precision(),
                "bits": v.bits(),
                "stats": v.stats(),
                "attention": v.attention(),
                "recompute": v.recompute(),
                "baseline": v.baseline,
                "final_val_loss": r.final_val_loss,
                "saved_bytes_per_step": r.saved_bytes,
                "saved_bytes_min_max": [r.saved_range.0, r.saved_range.1],
                "peak_backward_bytes": r.peak_bytes,
                "planned_bytes_per_step": r.planned,
                "step_peak_bytes": {
                    "measured": r.memory.measured_peak,
                    "planned": r.memory.planned.map(|p| json!({
                        "weights": p.weights, "gradients": p.gradients, "optimizer_state": p.optimizer_state,
                        "activations": p.activations, "transient": p.transient, "total": p.total,
                    })),
                    "planned_peak_phase": r.memory.planned_phase,
                },
                "wall_s": r.wall_s,
                "evals": r.evals.iter().map(|e| json!({"step": e.0, "train_loss": if e.1.is_nan() { Value::Null } else { json!(e.1) }, "val_loss": e.2})).collect::<Vec<_>>(),
            });
            if llama {
                run["not_planned"] = json!(r.not_planned);
            }
            run
        })
        .collect();
    let parity = results.iter().find_map(|r| r.parity.as_ref()).map(|p| {
        json!({
            "run": p.run,
            "every": p.every,
            "steps": p.steps,
            "configs": p.series.iter().map(|se| json!({
                "bits": se.bits,
                "recompute": crate::run::recompute_name(se.recompute),
                "params": se.params.iter().map(|(name, a)| json!({
                    "name": name,
                    "cosine": a.iter().map(|x| x.cosine).collect::<Vec<_>>(),
                    "rel_err": a.iter().map(|x| x.rel_err).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    });
    let codes: Vec<Value> = results
        .iter()
        .filter_map(|r| {
            let c = r.codes.as_ref()?;
            Some(json!({
                "run": r.spec.name,
                "sites": c.iter().map(|c| json!({
                    "site": format!("{:?}", c.site),
                    "group_batches": c.groups,
                    "widened": c.widened,
                    "max_error_steps": c.max_error_steps,
                })).collect::<Vec<_>>(),
            }))
        })
        .collect();
    let mut object = json!({
        "config": s.name,
        "sizes": {"layers": s.layers, "hidden": s.hidden, "heads": s.heads, "ffn": s.ffn, "context": s.context, "batch": s.batch, "steps": s.steps},
        "seeds": s.seeds,
        "vocab": corpus.vocab.len(),
        "val_chars": sum.val_len,
        "bigram_val_loss": sum.bigram,
        "min_effect": MIN_EFFECT,
        "f32_seed_spread": sum.spreads.iter().map(|(n, x)| json!({"variant": n, "spread": x})).collect::<Vec<_>>(),
        "differences": sum.differences.iter().map(|d| json!({
            "variant": d.variant,
            "baseline": d.baseline,
            "per_seed": d.per_seed.iter().map(|(s, x)| json!({"seed": s, "difference": x})).collect::<Vec<_>>(),
            "mean": d.mean,
            "se": if d.se.is_nan() { Value::Null } else { json!(d.se) },
            "ci95": [d.ci95.0, d.ci95.1],
        })).collect::<Vec<_>>(),
        "targets": sum.targets.iter().map(|t| json!({"id": t.id, "target": t.what, "met": t.met})).collect::<Vec<_>>(),
        "gradient_parity": parity,
        "running_estimate": codes,
        "total_wall_s": sum.total_wall_s,
        "runs": runs,
    });
    if llama {
        object["arch"] = json!(s.arch.name());
        object["sizes"]["kv_heads"] = json!(s.layer().kv_heads());
    }
    object
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error_by_hand() {
        // differences 0.01, 0.02, 0.06: mean 0.03, sample variance ((−0.02)² + (−0.01)² + 0.03²)/2
        // = 0.0007, sd = √0.0007, se = sd/√3
        let (mean, sd, se) = mean_se(&[0.01, 0.02, 0.06]);
        assert!((mean - 0.03).abs() < 1e-15, "{mean}");
        assert!((sd - 0.0007f64.sqrt()).abs() < 1e-15, "{sd}");
        assert!((se - (0.0007f64 / 3.0).sqrt()).abs() < 1e-15, "{se}");
        // one value: no spread to estimate
        let (m, sd, se) = mean_se(&[0.5]);
        assert_eq!(m, 0.5);
        assert!(sd.is_nan() && se.is_nan());
    }

    #[test]
    fn student_t_quantiles() {
        // two-sided 95 %: t(1) = 12.706, t(2) = 4.303 (3 seeds), t(10) = 2.228, then the normal's
        assert_eq!(t95(1), 12.706);
        assert_eq!(t95(2), 4.303);
        assert_eq!(t95(10), 2.228);
        assert_eq!(t95(11), 2.201);
        assert_eq!(t95(30), 2.042);
        assert_eq!(t95(31), 1.96);
    }
}
