//! A character-level GPT trained on the Shakespeare fixture (fixtures/README.md) in burn
//! 0.22.1 on `Autodiff<Flex>`, twice per seed: with burn's own ops (the f32 baseline) and
//! with mesa-burn's (`nn::{LayerNorm, Linear, Gelu}` and `softmax` with the causal mask,
//! 8-bit codes kept for backward; the kernels on the host emulator). Both runs of a seed
//! start from the same parameters and see the same batches, so they differ only by what
//! autodiff keeps for backward. The report pairs them by seed (`docs/results.md`).
//!
//! Model (`model.rs`): token and learnt position embeddings, pre-LN blocks (causal softmax
//! attention, GELU MLP), final LayerNorm, untied head; norm weights 1, biases 0, every matrix
//! and embedding `N(0, 0.02²)` from the example's own generator. burn's AdamW (β₂ 0.99, ε
//! 1e-8, weight decay 0.01), linear warm-up over 10 % of the steps, cosine to 10 %.
//!
//! ```text
//! cargo run --release --example train_shakespeare -- --config cpu [--seeds 0,1,2] [--steps N] [--fixtures DIR]
//! ```
//!
//! `--config smoke` (a few steps; the `#[test]` below runs it in CI) or `cpu` (the documented
//! run: the candle example's sizes and 800 steps; 829 s for seeds 0-2 on 2 cores at load 2-3). Prints a Markdown report: per-seed final validation loss, the paired difference
//! mesa − burn (mean ± SE, 95 % Student-t interval, "inconclusive" unless the interval lies
//! inside ±0.02 nats/char), and the bytes the second step's forward leaves alive for backward,
//! counted by the counting global allocator below.
mod data;
mod model;
mod train;

use std::path::PathBuf;

use mesa_burn::CountingAllocator;
use model::Ops;
use train::{RunResult, Settings};

/// Every heap allocation is counted (mesa-burn's codes on Flex are heap memory; softmax and
/// the other ops used here keep nothing in the emulator's own allocator).
#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::new();

fn live() -> isize {
    GLOBAL.current() as isize
}

/// Smallest difference of final validation loss worth reporting (nats per character).
const MIN_EFFECT: f64 = 0.02;

fn settings(name: &str) -> Result<Settings, String> {
    // The candle example's `cpu` configuration (docs/results.md). On this 2-core machine a
    // mesa step took 0.25 s on the emulator idle and 0.8 s under load 5 (a burn step 10-15
    // ms): three seeds of both variants took 829 s at load 2-3 (1085 s for 400 steps at load 5).
    let cpu = Settings {
        name: "cpu",
        layers: 2,
        hidden: 32,
        heads: 2,
        ffn: 128,
        context: 32,
        batch: 32,
        steps: 800,
        lr: 1e-2,
        val_chars: None,
    };
    match name {
        "cpu" => Ok(cpu),
        "smoke" => Ok(Settings { name: "smoke", batch: 8, steps: 8, val_chars: Some(2048), ..cpu }),
        other => Err(format!("unknown --config {other:?} (smoke, cpu)")),
    }
}

struct Args {
    settings: Settings,
    seeds: Vec<u64>,
    fixtures: PathBuf,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut config = None;
    let (mut seeds, mut steps, mut fixtures) = (vec![0, 1, 2], None, data::default_fixtures());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--config" => config = Some(value()?.clone()),
            "--seeds" => {
                seeds = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<u64>().map_err(|e| format!("--seeds: {s:?}: {e}")))
                    .collect::<Result<_, _>>()?;
            }
            "--steps" => {
                let v = value()?;
                steps = Some(v.parse::<usize>().ok().filter(|&n| n >= 2).ok_or_else(|| {
                    format!("--steps: {v:?} is not a whole number ≥ 2 (the second step is measured)")
                })?);
            }
            "--fixtures" => fixtures = PathBuf::from(value()?),
            "-h" | "--help" => {
                return Err(
                    "usage: train_shakespeare --config smoke|cpu [--seeds 0,1,2] [--steps N] [--fixtures DIR]".into()
                )
            }
            other => return Err(format!("unknown argument {other:?} (--help)")),
        }
    }
    let mut settings = settings(&config.ok_or("--config smoke|cpu is required")?)?;
    if let Some(n) = steps {
        settings.steps = n;
    }
    Ok(Args { settings, seeds, fixtures })
}

/// Two-sided 95 % quantile of Student's t with `df` degrees of freedom (1..=10; then the
/// normal's 1.96, a slight under-cover).
fn t95(df: usize) -> f64 {
    const T: [f64; 10] = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228];
    T.get(df.wrapping_sub(1)).copied().unwrap_or(1.96)
}

/// Mean and standard error of the mean (`None` with fewer than two values).
fn mean_se(xs: &[f64]) -> (f64, Option<f64>) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let se = (xs.len() > 1).then(|| (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) / n).sqrt());
    (mean, se)
}

/// Both variants of every seed: `(seed, burn, mesa)`.
type Pairs = Vec<(u64, RunResult, RunResult)>;

fn report(s: &Settings, pairs: &Pairs, vocab: usize) -> String {
    let mut out = format!(
        "Configuration {}: L={} C={} H={} F={} T={} B={}, {} steps, AdamW lr {} (warm-up 10 %, cosine to 10 %), \
         vocabulary {vocab} (uniform loss ln V = {:.4}), validation {} characters.\n\n",
        s.name,
        s.layers,
        s.hidden,
        s.heads,
        s.ffn,
        s.context,
        s.batch,
        s.steps,
        s.lr,
        (vocab as f64).ln(),
        s.val_chars.map_or("all".to_string(), |n| n.to_string()),
    );
    out += "| seed | burn: first loss | burn: final val | mesa: final val | mesa − burn | bytes alive for backward burn / mesa | wall s burn / mesa |\n|---|---:|---:|---:|---:|---:|---:|\n";
    for (seed, b, m) in pairs {
        out += &format!(
            "| {seed} | {:.4} | {:.4} | {:.4} | {:+.4} | {} / {} ({:.3}) | {:.0} / {:.0} |\n",
            b.first_loss,
            b.final_val,
            m.final_val,
            m.final_val - b.final_val,
            b.bytes_alive,
            m.bytes_alive,
            m.bytes_alive as f64 / b.bytes_alive as f64,
            b.wall_s,
            m.wall_s
        );
    }
    let d: Vec<f64> = pairs.iter().map(|(_, b, m)| m.final_val - b.final_val).collect();
    let (mean, se) = mean_se(&d);
    out += &match se {
        Some(se) => {
            let h = t95(d.len() - 1) * se;
            let (lo, hi) = (mean - h, mean + h);
            let verdict = if lo > -MIN_EFFECT && hi < MIN_EFFECT {
                format!("no effect worth reporting (interval inside ±{MIN_EFFECT})")
            } else {
                format!("inconclusive (interval not inside ±{MIN_EFFECT})")
            };
            format!(
                "\nmesa − burn, paired over {} seeds: {mean:+.4} ± {se:.4} (SE), 95 % interval [{lo:+.4}, {hi:+.4}]: {verdict}.\n",
                d.len()
            )
        }
        None => format!("\nmesa − burn: {mean:+.4} (one seed: no interval).\n"),
    };
    let spread = |f: fn(&(u64, RunResult, RunResult)) -> f64| {
        let v: Vec<f64> = pairs.iter().map(f).collect();
        v.iter().cloned().fold(f64::MIN, f64::max) - v.iter().cloned().fold(f64::MAX, f64::min)
    };
    out += &format!("burn's seed spread (max − min final val): {:.4}.\n", spread(|p| p.1.final_val));
    out
}

fn train_all(args: &Args, corpus: &data::Corpus) -> Result<Pairs, String> {
    args.seeds
        .iter()
        .map(|&seed| {
            let b = train::run(&args.settings, corpus, Ops::Burn, seed, live)?;
            eprintln!(
                "seed {seed} burn: final val {:.4} ({:.1} s, training {:.1} s)",
                b.final_val, b.wall_s, b.train_s
            );
            let m = train::run(&args.settings, corpus, Ops::Mesa, seed, live)?;
            eprintln!(
                "seed {seed} mesa: final val {:.4} ({:.1} s, training {:.1} s)",
                m.final_val, m.wall_s, m.train_s
            );
            Ok((seed, b, m))
        })
        .collect()
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let result = parse(&argv).and_then(|args| {
        let corpus = data::Corpus::load(&args.fixtures)?;
        if corpus.train.len() < args.settings.context + 2 {
            return Err(format!("the training text is shorter than a window of {} + 1", args.settings.context));
        }
        let pairs = train_all(&args, &corpus)?;
        Ok(report(&args.settings, &pairs, corpus.vocab.len()))
    });
    match result {
        Ok(r) => print!("{r}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke configuration, one seed, both variants. The allocator's counter is
    /// process-wide: nextest (CI) runs each test in its own process; under `cargo test` the
    /// other two tests of this binary allocate a few bytes, briefly, beside it.
    #[test]
    fn smoke_trains_both_variants_and_the_codes_keep_fewer_bytes() {
        let args = parse(&["--config".into(), "smoke".into(), "--seeds".into(), "0".into()]).unwrap();
        let corpus = data::Corpus::load(&args.fixtures).unwrap();
        let pairs = train_all(&args, &corpus).unwrap();
        eprintln!("{}", report(&args.settings, &pairs, corpus.vocab.len()));
        let uniform = (corpus.vocab.len() as f64).ln();
        let (_, b, m) = &pairs[0];
        // The forward is the same function (mesa-burn's forwards are exact): at step 0 the
        // losses differ by f32 rounding only (~1e-7 relative per op, a few hundred ops;
        // measured: equal to the last bit).
        assert!(
            (b.first_loss - m.first_loss).abs() < 1e-4 * uniform,
            "first losses {} vs {}",
            b.first_loss,
            m.first_loss
        );
        for (what, r) in [("burn", b), ("mesa", m)] {
            assert!(r.final_val.is_finite(), "{what}: final validation loss {}", r.final_val);
            assert!(
                r.final_val < uniform - 0.5,
                "{what}: final validation loss {} not below ln V − 0.5 = {}",
                r.final_val,
                uniform - 0.5
            );
        }
        // Bytes alive for backward: burn's `linear` keeps its f32 input (the matmul's lhs, for
        // dW) and `gelu` its f32 input; mesa-burn's keep their 8-bit codes (1 byte each plus
        // one 8-byte group). Those inputs, per block: LN1's output (qkv), the attention output
        // (proj), LN2's output (fc), GELU's input and output (out); plus the final LN's output
        // (head): E = L·(3·N·C + 2·N·F) + N·C elements, N = B·T. The codes save 3 bytes of each;
        // LayerNorm and softmax keep codes where burn keeps f32 (more savings, not counted).
        let s = &args.settings;
        let n = s.batch * s.context;
        let e = (s.layers * (3 * n * s.hidden + 2 * n * s.ffn) + n * s.hidden) as isize;
        eprintln!(
            "first losses burn {} mesa {}; bytes alive burn {} mesa {}: saved {} ≥ 3·E = {}",
            b.first_loss,
            m.first_loss,
            b.bytes_alive,
            m.bytes_alive,
            b.bytes_alive - m.bytes_alive,
            3 * e
        );
        assert!(
            b.bytes_alive - m.bytes_alive >= 3 * e,
            "mesa keeps {} bytes for backward, burn {}: saved less than 3 bytes for each of the {e} f32 inputs of Linear and GELU",
            m.bytes_alive,
            b.bytes_alive
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        for bad in [
            &["--config", "gpu"][..],
            &["--seeds", "0,x", "--config", "cpu"],
            &["--config"],
            &["--steps", "1", "--config", "cpu"],
            &[],
        ] {
            let v: Vec<String> = bad.iter().map(|s| s.to_string()).collect();
            assert!(parse(&v).is_err(), "{bad:?} accepted");
        }
        assert!(data::Corpus::load(std::path::Path::new("/nonexistent")).is_err());
    }

    #[test]
    fn statistics_by_hand() {
        // d = 1, 2, 3: mean 2, sd 1, SE 1/√3; t(2) = 4.303
        let (m, se) = mean_se(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((se.unwrap() - 1.0 / 3f64.sqrt()).abs() < 1e-15);
        assert_eq!(t95(2), 4.303);
        assert_eq!(t95(30), 1.96);
    }
}
