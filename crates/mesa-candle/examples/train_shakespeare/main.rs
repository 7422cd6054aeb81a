//! A character-level GPT trained on Shakespeare (fixtures/README.md) through mesa-candle's
//! layer: full-precision saving (the plain-candle layer) against 8- and 4-bit codes, exact
//! and running statistics, chunked linear attention (SLiM memory mode) and selective
//! recomputation, and stochastic rounding (run g: run b with it). Every run starts from the same initialisation (seed 0; run a also seeds 1
//! and 2) and sees the same batches; candle-nn's AdamW.
//!
//! ```text
//! cargo run --release -p mesa-candle --example train_shakespeare -- --config cpu [--json] [--out DIR]
//! ```
//!
//! `--steps N` shortens a configuration's schedule; `--only a.s0,b` runs just those runs. `--config smoke` (CI: a few steps of every run), `cpu` (the documented CPU run, host
//! emulation of the kernels), `gpu` (larger; needs the `cuda` feature; not yet run). Prints
//! a table (`--json`: one JSON object instead), writes the JSON as `results.json`, and
//! `loss.svg` and `running_estimate.svg`, to
//! `--out` (default `target/train_shakespeare`; created before the first run). `--fixtures DIR`
//! reads the text from DIR instead of the repository's `fixtures/` (a binary run elsewhere).
//! Bytes alive for backward are counted by a
//! counting global allocator around the layer stack (`docs/results.md` says how).
mod data;
mod model;
mod plot;
mod run;

use std::path::PathBuf;

use candle_core::Device;
use mesa_candle::CountingAllocator;

use run::{Curves, RunResult, RunSpec, Settings};

#[global_allocator]
static COUNTER: CountingAllocator = CountingAllocator::new();

fn settings(name: &str) -> Result<Settings, String> {
    // the CPU configuration is sized for the kernels' host emulation on 2 shared cores
    // (docs/results.md has its time); the GPU one below is the issue's suggested size and more
    let base = Settings {
        name: name.to_string(),
        layers: 2,
        hidden: 32,
        heads: 2,
        ffn: 128,
        context: 32,
        batch: 16,
        steps: 400,
        eval_every: 100,
        val_windows: 64,
        lr: 1e-2,
        chunk: 16,
        record_every: 5,
        seeds_a: vec![0, 1, 2],
    };
    match name {
        "smoke" => Ok(Settings {
            layers: 2,
            hidden: 32,
            heads: 2,
            ffn: 128,
            context: 32,
            batch: 4,
            steps: 4,
            eval_every: 2,
            val_windows: 8,
            chunk: 16,
            record_every: 1,
            seeds_a: vec![0, 1],
            ..base
        }),
        "cpu" => Ok(base),
        "gpu" => Ok(Settings {
            layers: 8,
            hidden: 512,
            heads: 8,
            ffn: 2048,
            context: 256,
            batch: 32,
            steps: 5000,
            eval_every: 250,
            val_windows: 512,
            lr: 1e-3,
            chunk: 64,
            record_every: 50,
            ..base
        }),
        other => Err(format!("--config {other}: expected smoke, cpu or gpu")),
    }
}

struct Args {
    settings: Settings,
    json: bool,
    out: PathBuf,
    /// `--only a.s0,b`: just these runs (all when empty).
    only: Vec<String>,
    /// `--fixtures DIR`: where `shakespeare_{train,val}.txt` are (default: the repository's).
    fixtures: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut config, mut json, mut out) = ("cpu".to_string(), false, PathBuf::from("target/train_shakespeare"));
    let mut steps = None;
    let mut only = Vec::new();
    let mut fixtures = data::default_fixtures();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => config = it.next().ok_or("--config needs a value")?,
            "--steps" => {
                let v = it.next().ok_or("--steps needs a value")?;
                steps =
                    Some(v.parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("--steps {v}: a positive integer"))?);
            }
            "--json" => json = true,
            "--only" => only = it.next().ok_or("--only needs run names")?.split(',').map(str::to_string).collect(),
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a value")?),
            "--fixtures" => fixtures = PathBuf::from(it.next().ok_or("--fixtures needs a directory")?),
            other => {
                return Err(format!(
                    "unknown argument {other} (--config smoke|cpu|gpu, --steps N, --only RUN[,RUN], --json, --out DIR, --fixtures DIR)"
                ))
            }
        }
    }
    let mut settings = settings(&config)?;
    if let Some(n) = steps {
        settings.steps = n;
        settings.eval_every = settings.eval_every.min(n);
    }
    let names: Vec<String> = RunSpec::all(&settings).into_iter().map(|r| r.name).collect();
    if let Some(bad) = only.iter().find(|n| !names.contains(n)) {
        return Err(format!("--only {bad}: the runs are {}", names.join(", ")));
    }
    Ok(Args { settings, json, out, only, fixtures })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let s = &args.settings;
    let device = if s.name == "gpu" {
        if !cfg!(feature = "cuda") {
            return Err(
                "--config gpu needs a build with `--features cuda` (and a GPU): it is too large for the CPU".into()
            );
        }
        Device::new_cuda(0).map_err(|e| format!("--config gpu: no CUDA device 0 ({e})"))?
    } else {
        Device::Cpu
    };
    // before any training: an unusable output directory fails now, not after the runs
    std::fs::create_dir_all(&args.out).map_err(|e| format!("--out {}: {e}", args.out.display()))?;
    let corpus = data::Corpus::load(&args.fixtures)?;
    let bigram = corpus.bigram_val_loss();
    COUNTER.observe_emulator()?;
    let mut results: Vec<RunResult> = Vec::new();
    let mut estimates = None;
    for spec in RunSpec::all(s).into_iter().filter(|r| args.only.is_empty() || args.only.contains(&r.name)) {
        eprintln!("run {} …", spec.name);
        let (result, recorded) = run::train(&COUNTER, &corpus, s, &spec, &device)?;
        eprintln!("  final val loss {:.4}, {:.1} s", result.final_val_loss, result.wall_s);
        if recorded.is_some() {
            estimates = recorded;
        }
        results.push(result);
    }
    let curves: Vec<Curves<'_>> = results.iter().map(|r| r.curves()).collect();
    plot::losses(&args.out.join("loss.svg"), &curves, bigram, s)?;
    if let Some(e) = &estimates {
        plot::estimates(&args.out.join("running_estimate.svg"), e)?;
    }
    let summary = run::Summary::new(s, &results, bigram, args.only.is_empty());
    let object = serde_json::to_string_pretty(&run::json(s, &results, &summary, &corpus))?;
    let json_path = args.out.join("results.json");
    std::fs::write(&json_path, &object).map_err(|e| format!("{}: {e}", json_path.display()))?;
    if args.json {
        println!("{object}");
    } else {
        run::print_table(s, &results, &summary, &corpus, device.is_cpu());
    }
    Ok(())
}
