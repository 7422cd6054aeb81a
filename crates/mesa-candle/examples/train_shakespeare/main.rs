//! A character-level GPT (or Llama: `--arch llama`) trained on Shakespeare
//! (fixtures/README.md) through mesa-candle's layer, each run at several seeds and compared
//! seed by seed with its f32 baseline (`docs/results.md` has the numbers,
//! `scripts/train-results.sh` makes them):
//!
//! | variant | saved for backward | compared with | `--arch llama` |
//! |---|---|---|---|
//! | a | f32 (plain-candle layer), softmax attention | — | yes |
//! | b | 8-bit codes, exact statistics | a | yes |
//! | c | 8-bit codes, running estimate (Mesa §3.3) | a | yes |
//! | d | 4-bit codes | a | yes |
//! | e | 8-bit codes, chunked linear attention (ELU+1, SLiM memory mode) | h | no |
//! | f | 8-bit codes, selective recomputation (not in the default set) | a | yes |
//! | g | 8-bit codes, stochastic rounding (not in the default set) | a | yes |
//! | h | f32 (plain-candle layer), linear attention | — | no |
//! | i | 2-bit codes (not in the default set) | a | yes |
//! | j | 8-bit codes, gated linear attention (RetNet's decays, issue 41; not in the default set) | k | yes |
//! | k | f32 (plain-candle layer), gated linear attention (not in the default set) | — | yes |
//! | l | 8-bit codes, gated linear attention with Mamba-2's input-dependent decay (`Attention::InputGated`; not in the default set) | m | yes |
//! | m | f32 (plain-candle layer), input-gated linear attention (not in the default set) | — | yes |
//!
//! `--arch gpt` (the default): token and learnt position embeddings, pre-LN GPT blocks
//! (`LayerConfig::new`), final LayerNorm, untied head. `--arch llama`: token embedding only
//! (RoPE, base 10 000, inside the layers), Llama blocks (`LayerConfig::llama`: pre-RMSNorm, no
//! biases, grouped-query attention, SwiGLU of the configuration's FFN width F), a final
//! RMSNorm in candle's composed ops, untied head; norm weights 1, every matrix and embedding
//! `N(0, 0.02²)`. `--kv-heads N` (llama only, dividing the heads) sets the K/V heads;
//! default: the largest divisor of the heads below them (H/2 for an even H, 1 for the `cpu`
//! configuration's 2 heads), so that query heads share K/V heads. The Llama block takes
//! softmax or gated attention (its query heads sharing each KV head's decay or gate): its default set
//! is a, b, c, d, and `--only e` or `h` is an error;
//! `--tp` needs `--arch gpt`.
//!
//! Each seed sets the initialisation and the data order. Validation scores every
//! transition of the validation text; candle-nn's AdamW. Run a's first seed also probes
//! gradient parity (8, 4, 2 bits, with and without selective recomputation) along its
//! trajectory; run c's first seed records the running estimate of every coded tensor.
//!
//! ```text
//! cargo run --release -p mesa-candle --example train_shakespeare -- --config cpu [--arch llama] [--out DIR]
//! ```
//!
//! `--config smoke` (CI: a few steps of each variant), `cpu` (the documented CPU run, host
//! emulation of the kernels), `gpu` (larger; needs the `cuda` feature; not yet run).
//! `--only a,b` trains just those variants, `--seeds 0,1` other seeds, `--steps N` another
//! schedule length, `--batch B` another batch, `--lr X` another peak learning rate. Prints the report (Markdown; `--json`: the JSON instead) and writes
//! `results.json`, `results.md`, `loss.svg`, `grad_parity.svg` and `running_estimate.svg`
//! to `--out` (default `target/train_shakespeare`, created before the first run).
//! `--tp N` (N in 1..=4, dividing the heads and the FFN width) also trains every run on N
//! tensor- and sequence-parallel ranks (threads; `tp.rs`) from the same seed and compares the
//! two step by step: `tp.md`, `tp.json` and `loss_tp.svg` in `--out` (the report and
//! `results.json` are unchanged), the table also printed after the report.
//! `--regions` runs every layer of the stack inside a checkpoint region
//! (`mesa_candle::region`): the forward keeps each layer's input only, the backward reruns
//! the layer (the report's bytes and times then describe the regions).
//! `--replot-tp DIR` redraws `DIR/loss_tp.svg` and prints the table from `DIR/tp.json`.
//! `--fixtures DIR` reads the text from DIR instead of the repository's `fixtures/`. Bytes
//! are counted by a counting global allocator (`docs/results.md` says how).
mod data;
mod model;
mod parity;
mod plot;
mod report;
mod run;
mod tp;

use std::path::PathBuf;

use candle_core::Device;
use mesa_candle::CountingAllocator;

use run::{Arch, RunResult, RunSpec, Settings, Variant};

#[global_allocator]
static COUNTER: CountingAllocator = CountingAllocator::new();

/// The default set of variants (every configuration); f, g, i, j, k, l and m run with `--only`.
const DEFAULT_VARIANTS: [&str; 6] = ["a", "h", "b", "c", "d", "e"];

fn settings(name: &str) -> Result<Settings, String> {
    // The CPU configuration: the f32 runs' seed spread must fall below report::MIN_EFFECT.
    // Measured spreads of run a over seeds 0-2 (steps x batch, context 32): 400 x 16: 0.045,
    // 800 x 16: 0.024, 1600 x 16: 0.015, 800 x 32: 0.0135 (docs/results.md). The larger
    // batch costs the host emulation less per token than more steps. The GPU one is larger.
    let base = Settings {
        name: name.to_string(),
        layers: 2,
        hidden: 32,
        heads: 2,
        ffn: 128,
        context: 32,
        batch: 32,
        steps: 800,
        evals: 10,
        val_chars: None,
        lr: 1e-2,
        chunk: 16,
        record_every: 5,
        parity_probes: 10,
        seeds: vec![0, 1, 2],
        variants: DEFAULT_VARIANTS.to_vec(),
        regions: false,
        arch: Arch::Gpt,
    };
    match name {
        "smoke" => Ok(Settings {
            batch: 4,
            steps: 3,
            evals: 1,
            val_chars: Some(2048),
            record_every: 1,
            parity_probes: 2,
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
    /// `--fixtures DIR`: where `shakespeare_{train,val}.txt` are (default: the repository's).
    fixtures: PathBuf,
    /// The configuration's default variants at its default seeds and steps.
    default_set: bool,
    /// `--tp N`: also train every run on N ranks and compare.
    tp: Option<usize>,
    /// `--replot-tp DIR`: redraw `DIR/loss_tp.svg` from `DIR/tp.json`, train nothing.
    replot_tp: Option<PathBuf>,
}

fn list<T: std::str::FromStr>(flag: &str, v: &str) -> Result<Vec<T>, String> {
    v.split(',').map(|x| x.trim().parse::<T>().map_err(|_| format!("{flag} {v}: a comma-separated list"))).collect()
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut config, mut json, mut out) = ("cpu".to_string(), false, PathBuf::from("target/train_shakespeare"));
    let (mut steps, mut batch, mut lr, mut only, mut seeds) = (None, None, None, None::<Vec<String>>, None::<Vec<u64>>);
    let mut fixtures = data::default_fixtures();
    let (mut tp, mut replot_tp, mut regions) = (None, None, false);
    let (mut arch, mut kv_heads) = ("gpt".to_string(), None);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--config" => config = value()?,
            "--arch" => arch = value()?,
            "--kv-heads" => {
                let v = value()?;
                kv_heads = Some(
                    v.parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("--kv-heads {v}: a positive integer"))?,
                );
            }
            "--steps" => {
                let v = value()?;
                steps =
                    Some(v.parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("--steps {v}: a positive integer"))?);
            }
            "--batch" => {
                let v = value()?;
                batch =
                    Some(v.parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("--batch {v}: a positive integer"))?);
            }
            "--lr" => {
                let v = value()?;
                lr = Some(v.parse::<f64>().ok().filter(|&x| x > 0.0 && x.is_finite()).ok_or(format!("--lr {v}: a positive number"))?);
            }
            "--tp" => {
                let v = value()?;
                tp = Some(v.parse::<usize>().map_err(|_| format!("--tp {v}: a number of ranks, 1 to 4"))?);
            }
            "--replot-tp" => replot_tp = Some(PathBuf::from(value()?)),
            "--json" => json = true,
            "--regions" => regions = true,
            "--only" => only = Some(list("--only", &value()?)?),
            "--seeds" => seeds = Some(list("--seeds", &value()?)?),
            "--out" => out = PathBuf::from(value()?),
            "--fixtures" => fixtures = PathBuf::from(value()?),
            other => {
                return Err(format!(
                    "unknown argument {other} (--config smoke|cpu|gpu, --arch gpt|llama, --kv-heads N, --steps N, --batch B, --lr X, --only VARIANT[,VARIANT], --seeds S[,S], --tp N, --regions, --json, --out DIR, --fixtures DIR)"
                ))
            }
        }
    }
    let mut settings = settings(&config)?;
    settings.regions = regions;
    settings.arch = match (arch.as_str(), kv_heads) {
        ("gpt", None) => Arch::Gpt,
        ("gpt", Some(_)) => return Err("--kv-heads: a GPT block has as many K/V heads as heads (--arch llama)".into()),
        ("llama", k) => Arch::Llama { kv_heads: k.unwrap_or_else(|| Arch::default_kv_heads(settings.heads)) },
        (other, _) => return Err(format!("--arch {other}: expected gpt or llama")),
    };
    settings.layer().validate().map_err(|e| format!("--arch {arch} with --config {config}: {e}"))?;
    let default_set = steps.is_none() && batch.is_none() && lr.is_none() && only.is_none() && seeds.is_none();
    if let Some(x) = lr {
        settings.lr = x;
    }
    if let Some(b) = batch {
        settings.batch = b;
    }
    if let Some(n) = steps {
        settings.steps = n;
    }
    if let Some(seeds) = seeds {
        if seeds.is_empty() {
            return Err("--seeds: at least one".into());
        }
        if let Some(d) = seeds.iter().enumerate().find_map(|(i, s)| seeds[..i].contains(s).then_some(s)) {
            return Err(format!("--seeds: seed {d} given twice (each seed is one pair of runs)"));
        }
        settings.seeds = seeds;
    }
    let all = Variant::all(&settings);
    let names: Vec<&'static str> = all.iter().map(|v| v.name).collect();
    // the default set holds the variants the block has (a Llama block: no linear attention)
    settings.variants.retain(|n| all.iter().any(|v| v.name == *n && v.check().is_ok()));
    if let Some(only) = only {
        settings.variants = Vec::new();
        for n in &only {
            let v =
                all.iter().find(|v| v.name == n).ok_or(format!("--only {n}: the variants are {}", names.join(", ")))?;
            v.check().map_err(|e| format!("--only {n}: {e}"))?;
            settings.variants.push(v.name);
        }
    }
    if let Some(t) = tp {
        tp::check(&settings, t)?;
        // the sharded layer refuses input-gated attention: say so before any run
        for n in &settings.variants {
            if all.iter().any(|v| v.name == *n && v.config.attention.is_input_gated()) {
                return Err(format!("--tp {t}: variant {n} (input-gated attention) has no sharded form"));
            }
        }
    }
    Ok(Args { settings, json, out, fixtures, default_set, tp, replot_tp })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // before any candle op: gemm gives each thread that first runs a product a packing buffer
    // it keeps (1 MiB here), so with a pool of workers the step's peak would depend on which
    // worker ran a product when (mesa_candle::memory); one worker makes it reproducible
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let args = args()?;
    let s = &args.settings;
    if let Some(dir) = &args.replot_tp {
        // redraw loss_tp.svg and tp.md from a --tp run's tp.json (no training)
        let text = std::fs::read_to_string(dir.join("tp.json")).map_err(|e| format!("{}: {e}", dir.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let mut s = s.clone();
        s.steps = v["steps"].as_u64().ok_or("tp.json: no steps")? as usize;
        s.batch = v["batch"].as_u64().ok_or("tp.json: no batch")? as usize;
        let pairs = tp::from_json(&v, &Variant::all(&s))?;
        plot::losses_tp(&dir.join("loss_tp.svg"), &s, &pairs)?;
        println!("{}", tp::markdown(&s, &pairs));
        return Ok(());
    }
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
    if corpus.train.len() < s.context + 2 || s.val_len(&corpus) < s.context + 2 {
        return Err(format!(
            "{}: the training and the validation text need at least context + 2 = {} characters",
            args.fixtures.display(),
            s.context + 2
        )
        .into());
    }
    COUNTER.observe_emulator()?;
    let variants: Vec<Variant> = Variant::all(s).into_iter().filter(|v| s.variants.contains(&v.name)).collect();
    let mut results: Vec<RunResult> = Vec::new();
    let mut pairs: Vec<tp::Pair> = Vec::new();
    for spec in RunSpec::all(s, &variants) {
        eprintln!("run {} …", spec.name);
        let result = run::train(&COUNTER, &corpus, s, &spec, &device)?;
        eprintln!("  final val loss {:.4}, {:.1} s", result.final_val_loss, result.wall_s);
        if let Some(t) = args.tp {
            eprintln!("run {} on {t} ranks …", spec.name);
            let many = tp::train_tp(&corpus, s, &spec, t, &device)?;
            let pair = tp::Pair::new(&result, &many);
            eprintln!(
                "  final val loss {:.4}, {:.1} s; step losses: max rel. diff {:.2e}, first step over {:.0e}: {}",
                many.final_val_loss,
                many.wall_s,
                pair.max_rel,
                tp::TARGET_REL,
                pair.first_over.map_or("none".into(), |s| s.to_string())
            );
            pairs.push(pair);
        }
        results.push(result);
    }
    let summary = report::Summary::new(s, &variants, &results, &corpus, args.default_set);
    plot::losses(&args.out.join("loss.svg"), s, &variants, &results, summary.bigram)?;
    if let Some(p) = results.iter().find_map(|r| r.parity.as_ref()) {
        plot::parity(&args.out.join("grad_parity.svg"), p, s)?;
    }
    if let Some(e) = results.iter().find_map(|r| r.estimates.as_ref()) {
        plot::estimates(&args.out.join("running_estimate.svg"), e)?;
    }
    let write = |name: &str, text: &str| {
        let path = args.out.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    let object = serde_json::to_string_pretty(&report::json(s, &results, &summary, &corpus))?;
    write("results.json", &object)?;
    let md = report::markdown(s, &variants, &results, &summary, &corpus);
    write("results.md", &md)?;
    println!("{}", if args.json { &object } else { &md });
    if args.tp.is_some() {
        let table = tp::markdown(s, &pairs);
        write("tp.md", &table)?;
        write("tp.json", &serde_json::to_string_pretty(&tp::json(s, &pairs))?)?;
        plot::losses_tp(&args.out.join("loss_tp.svg"), s, &pairs)?;
        if args.json {
            eprintln!("{table}");
        } else {
            println!("{table}");
        }
    }
    Ok(())
}
