//! The activation-memory planner on named configurations: bytes kept for backward per layer
//! and for the stack, and the largest micro-batch that fits a budget.
//!
//! `cargo run --release -p mesa-candle --example plan -- [--budget-gib 80] [--seq N]`
//!
//! * the paper's GPT-3 175B and MT-NLG 530B settings (Korthikanti et al. 2022, Table 3:
//!   `t = 8`, `s = 2048`, `b = 1`), in the six settings of its Table 2 (16-bit activations,
//!   1-byte masks) and with 8-bit codes in place of the 16-bit activations (Mesa's
//!   re-investment of the saved memory in a larger micro-batch). Per tensor-parallel rank,
//!   all `L` layers: the first pipeline stage's activations under 1F1B (§4.4), embedding and
//!   output layer not included;
//! * the training example's own model ([`TRAIN_EXAMPLE`]: change it there), for the training example's
//!   runs (a)–(f) on mesa-candle's layer ([`mesa_candle::plan`]: every layer's input and the
//!   stack's output included); and the whole training step of the example (weights,
//!   gradients, AdamW's state, activations, the largest transient: [`training_step`]) with
//!   the largest batch that fits on that total;
//! * for the paper's 22B, 175B, 530B and 1T models (Table 3, with its pipeline depths), the
//!   cheapest setting — `t` from {1, 2, 4, 8, 16}, sequence parallelism, recomputation, 16-bit
//!   or 8/4/2-bit codes — whose memory per GPU fits the budget
//!   ([`mesa_kernels::plan::cheapest_setting`]: the order and what is counted are in its
//!   module docs): first pipeline stage, 16-bit weights and gradients, Adam in mixed precision
//!   (16 bytes per parameter), activations of `p` micro-batches in flight under 1F1B.
use std::fmt::Write as _;

use mesa_candle::layer::{Attention, LayerConfig, Recompute};
use mesa_candle::ops::FeatureKind;
use mesa_candle::plan::{largest_training_batch, training_step, TrainingShape};
use mesa_kernels::linear_attention::{LinearAttentionConfig, MemoryMode};
use mesa_kernels::plan::{
    cheapest_setting, largest_micro_batch, llama3_models, paper_models, BlockKind, CodeFormat, MaskStorage, ModelShape,
    Parallelism, PlanConfig, Precision, Recompute as PlanRecompute, SavedPrecision,
};

/// The training example's CPU configuration (`train_shakespeare --config cpu`): (layers,
/// hidden, heads, FFN, context, batch); no dropout; linear attention's chunk is [`TRAIN_CHUNK`].
const TRAIN_EXAMPLE: (usize, usize, usize, usize, usize, usize) = (2, 32, 2, 128, 32, 32);
const TRAIN_CHUNK: usize = 16;
/// The training example's character vocabulary (docs/results.md).
const TRAIN_VOCAB: usize = 80;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

fn fit(b: Option<u64>) -> String {
    b.map_or("none".into(), |b| b.to_string())
}

fn paper(
    out: &mut String,
    name: &str,
    shape: ModelShape,
    t: u64,
    budget: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    writeln!(
        out,
        "\n## {name}: L={} s={} b={} h={} a={} f={} t={t}\n",
        shape.layers, shape.seq, shape.micro_batch, shape.hidden, shape.heads, shape.ffn
    )?;
    writeln!(out, "| setting | per layer | {} layers | largest micro-batch in {} |", shape.layers, human(budget))?;
    writeln!(out, "|---|---:|---:|---:|")?;
    let tp = |sequence| Parallelism { tensor: t, sequence };
    let rows = [
        ("no parallelism: sbh(34 + 5as/h)", Parallelism::none(), PlanRecompute::None),
        ("tensor parallel: sbh(10 + 24/t + 5as/(ht))", tp(false), PlanRecompute::None),
        ("tensor + sequence parallel: sbh(34/t + 5as/(ht))", tp(true), PlanRecompute::None),
        ("tensor parallel + selective: sbh(10 + 24/t)", tp(false), PlanRecompute::Selective),
        ("tensor + sequence parallel + selective: 34sbh/t", tp(true), PlanRecompute::Selective),
        ("full recomputation: 2sbh", tp(false), PlanRecompute::Full),
    ];
    for (label, parallel, recompute) in rows {
        let cfg = PlanConfig::megatron(shape, parallel, recompute);
        let plan = cfg.plan()?;
        let b = largest_micro_batch(&cfg, budget)?;
        writeln!(out, "| {label} | {} | {} | {} |", human(plan.layer.total), human(plan.total), fit(b))?;
    }
    // the same with 8-bit codes (one offset and scale per head), masks regenerated from a
    // seed, the FC inputs rebuilt from their producers' codes
    for (label, recompute) in
        [("TP + SP, 8-bit codes", PlanRecompute::None), ("TP + SP + selective, 8-bit codes", PlanRecompute::Selective)]
    {
        let mut cfg = PlanConfig::megatron(shape, tp(true), recompute);
        cfg.dropout.masks = MaskStorage::Regenerated;
        cfg.saved = SavedPrecision {
            norm_row_bytes: 8,
            shared_inputs: true,
            ..SavedPrecision::uniform(Precision::Codes(CodeFormat::per_head(8)))
        };
        let plan = cfg.plan()?;
        let b = largest_micro_batch(&cfg, budget)?;
        writeln!(out, "| {label} | {} | {} | {} |", human(plan.layer.total), human(plan.total), fit(b))?;
    }
    Ok(())
}

fn train_example(out: &mut String, budget: u64) -> Result<(), Box<dyn std::error::Error>> {
    let (layers, hidden, heads, ffn, seq, batch) = TRAIN_EXAMPLE;
    writeln!(out,
        "\n## training example: L={layers} hidden={hidden} heads={heads} FFN={ffn} context={seq} batch={batch} (mesa-candle's layer, f32 model)\n"
    )?;
    writeln!(out, "| run | bytes alive for backward | largest batch in {} |", human(budget))?;
    writeln!(out, "|---|---:|---:|")?;
    let base = LayerConfig::new(hidden, heads, ffn);
    let estimate = mesa_candle::plan::reference_stack_estimate(&base, layers, batch, seq)?;
    let fits = mesa_candle::plan::largest_reference_batch(&base, layers, seq, budget)?;
    writeln!(
        out,
        "| (a) f32, plain-f32 estimate (candle's graph keeps more: docs/plan.md) | {} | {} |",
        human(estimate),
        fit(fits)
    )?;
    let linear =
        LinearAttentionConfig { chunk: TRAIN_CHUNK, memory: MemoryMode::Slim, ..LinearAttentionConfig::causal() };
    let runs = [
        ("(b), (c) 8-bit codes", base.clone()),
        ("(d) 4-bit codes", LayerConfig { bits: 4, ..base.clone() }),
        (
            "(e) linear attention (SLiM), 8-bit codes",
            LayerConfig { attention: Attention::Linear { config: linear, map: FeatureKind::Elu1 }, ..base.clone() },
        ),
        ("(f) 8-bit codes, selective recomputation", LayerConfig { recompute: Recompute::Selective, ..base.clone() }),
    ];
    for (name, cfg) in &runs {
        let bytes = mesa_candle::plan::layer_stack_saved_bytes(cfg, layers, batch, seq)?;
        let b = mesa_candle::plan::largest_batch(cfg, layers, seq, budget)?;
        writeln!(out, "| {name} | {} | {} |", human(bytes), fit(b))?;
    }
    // the whole step: weights, gradients, AdamW's state, activations and the largest transient
    writeln!(
        out,
        "\n## training example, whole training step (vocabulary {TRAIN_VOCAB}; mesa_candle::plan::training_step)\n"
    )?;
    writeln!(
        out,
        "| run | weights | gradients | optimizer state | activations | transient | total (peak phase) | largest batch that fits on the total in {} |",
        human(budget)
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    let shape = TrainingShape { layers, batch, seq, vocab: TRAIN_VOCAB };
    for (name, cfg) in &runs {
        let plan = training_step(cfg, &shape)?;
        let m = plan.total;
        let b = largest_training_batch(cfg, &shape, budget)?;
        writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} ({}) | {} |",
            human(m.weights),
            human(m.gradients),
            human(m.optimizer_state),
            human(m.activations),
            human(m.transient),
            human(m.total),
            plan.peak_phase,
            fit(b)
        )?;
    }
    Ok(())
}

/// The tensor-parallel sizes the cheapest-setting table tries.
const TENSOR_CHOICES: [u64; 5] = [1, 2, 4, 8, 16];

fn cheapest(out: &mut String, budget: u64) -> Result<(), Box<dyn std::error::Error>> {
    writeln!(
        out,
        "\n## cheapest setting per GPU in {} (t from {TENSOR_CHOICES:?}; order: fewest t, 16/8 bits before 4 before 2, least recompute, SP on, 16 before 8 bits)\n",
        human(budget)
    )?;
    writeln!(out, "| model | cheapest setting | weights+grads+optimizer per GPU | activations per GPU | total |")?;
    writeln!(out, "|---|---|---:|---:|---:|")?;
    for m in paper_models().into_iter().chain(llama3_models()) {
        let s = &m.shape;
        let name = match m.block {
            BlockKind::Gpt => format!("{} (L={} h={} a={} p={})", m.name, s.layers, s.hidden, s.heads, m.pipeline),
            BlockKind::Llama { kv_heads } => format!(
                "{} (L={} h={} a={} kv={kv_heads} f={} s={} p={})",
                m.name, s.layers, s.hidden, s.heads, s.ffn, s.seq, m.pipeline
            ),
        };
        match cheapest_setting(&m, budget, &TENSOR_CHOICES)? {
            Some((setting, mem)) => writeln!(
                out,
                "| {name} | {setting} | {} | {} | {} |",
                human(mem.model_state),
                human(mem.activations),
                human(mem.total)
            )?,
            None => writeln!(out, "| {name} | none fits | | | |")?,
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(text) => {
            // a closed pipe (`| head`) ends the output quietly
            let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The whole report, built before anything is printed (an error prints no partial table).
fn run() -> Result<String, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut budget_gib = 80.0f64;
    let mut seq = 2048u64;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--budget-gib" => {
                let v = it.next().ok_or("--budget-gib needs a value")?;
                budget_gib = v.parse().map_err(|e| format!("--budget-gib {v}: {e}"))?;
            }
            "--seq" => {
                let v = it.next().ok_or("--seq needs a value")?;
                seq = v.parse().map_err(|e| format!("--seq {v}: {e}"))?;
            }
            "--help" | "-h" => {
                return Ok(
                    "cargo run --release -p mesa-candle --example plan -- [--budget-gib 80] [--seq 2048]\n".into()
                );
            }
            other => return Err(format!("unknown argument {other} (--help)").into()),
        }
    }
    if !(budget_gib.is_finite() && budget_gib > 0.0) {
        return Err("--budget-gib must be positive".into());
    }
    let budget = (budget_gib * GIB) as u64;
    let mut out = String::new();
    writeln!(out, "# activation memory per rank, planned (mesa_kernels::plan); budget {}", human(budget))?;
    let gpt3 = ModelShape { layers: 96, seq, micro_batch: 1, hidden: 12288, heads: 96, ffn: 4 * 12288 };
    let mtnlg = ModelShape { layers: 105, seq, micro_batch: 1, hidden: 20480, heads: 128, ffn: 4 * 20480 };
    paper(&mut out, "GPT-3 175B", gpt3, 8, budget)?;
    paper(&mut out, "MT-NLG 530B", mtnlg, 8, budget)?;
    train_example(&mut out, budget)?;
    cheapest(&mut out, budget)?;
    Ok(out)
}
