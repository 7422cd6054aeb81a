//! Compression report: what Mesa's 8-bit activation compression saves on real activations,
//! and what it costs in accuracy.
//!
//! ```sh
//! cargo run --release --example compress_report             # table for the MiniLM fixture
//! cargo run --release --example compress_report -- --json   # the same as one JSON object
//! cargo run --release --example compress_report -- --input my_activations.safetensors
//! cargo run --release --example compress_report -- --help
//! ```
//!
//! By default it reads `fixtures/minilm_activations.safetensors` (real all-MiniLM-L6-v2
//! activations, 6 layers × 3 batches; see `fixtures/README.md`). Every saved activation of
//! every layer gets its own [`Quantizer`], fed the 3 batches in order as in training: batch 0
//! is quantized with its exact statistics, later batches in one pass with the running
//! estimate (EMA, momentum 0.9); a group whose batch leaves the estimate by more than one
//! step is saved with its exact range and encoded again (the report counts these widened
//! groups), so no element ends more than one step from its code's value. Per tensor it prints the bytes kept for backward (codes + per-group
//! parameters) against f32 and bf16, the relative L2 error of the decoded copy, the largest
//! error in quantization steps, and two comparisons: per-tensor instead of head-wise
//! parameters, and exact per-batch statistics instead of the running estimate.
//!
//! Groupings (Mesa's head-wise quantization, no permuted copies):
//! q/k/v `[B, N, H·D]` are viewed as `[B, N, H, D]` with one group per head on axis 2,
//! attention probabilities `[B, H, N, N]` one group per head on axis 1, and the GELU and
//! LayerNorm inputs `[B, N, C]` 12 channel groups on axis 2.
//!
//! It runs on the GPU when one is usable, else on the host emulation (`MESA_REQUIRE_GPU=1`
//! makes a missing GPU an error).
//! Errors are measured in f64 against the f32 input, using [`mesa_kernels::reference`].
mod block;

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use half::{bf16, f16};
use mesa_kernels::reference::{self, quant::group_index};
use mesa_kernels::{
    Device, Grouping, Layout, QuantConfig, Quantizer, Rounding, SavedActivation, StatsMode, TensorMut, TensorRef,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

mod linear_attention;

/// The default input, and how the report names it.
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/minilm_activations.safetensors");
const FIXTURE_NAME: &str = "fixtures/minilm_activations.safetensors";
/// Heads of MiniLM; also Mesa's number of channel groups for the GELU and LayerNorm inputs.
const HEADS: usize = 12;
/// The compression targets of the issue (8-bit codes).
const TARGET_VS_BF16: f64 = 1.95;
const TARGET_VS_F32: f64 = 3.9;

const HELP: &str = "\
compress_report: Mesa activation compression (mesa-kernels) on real activations

USAGE:
    cargo run --release --example compress_report -- [OPTIONS]

OPTIONS:
    --input FILE       a safetensors file to report on (default: the MiniLM fixture,
                       fixtures/minilm_activations.safetensors)
    --json             print the report as one JSON object instead of tables
    --bits N           bits per code: 8 (default), 4 or 2
    --stochastic SEED  stochastic rounding with this Philox seed (default: round to nearest)
    --no-block         skip the transformer-block section (run by default on the fixture)
    -h, --help         this text

WHAT IS MEASURED (per tensor):
    bytes kept for backward (codes + 8 bytes per group + 4-byte non-finite counter) against
    the f32 and bf16 sizes; relative L2 error |x^ - x| / |x| of the decoded copy (f64, over
    finite inputs); the largest error in quantization steps of the element's group (above
    0.5 with round to nearest, or 1 with stochastic rounding, means the element was clamped
    within one step of the running range; a group beyond that is widened to its exact range
    and encoded again: `widened`); and the relative L2 error of the same tensor quantized
    per-tensor (one group) and with exact per-batch statistics. The summary gives, for the
    batches quantized with the running estimate (1 and later), the largest error in steps and
    the mean relative L2 error beside that of exact statistics. A group whose input holds NaN or Inf
    decodes to NaN (Mesa keeps no finite range for it): its errors show as NaN (null in
    JSON) and the summary counts the non-finite inputs.

BATCHES:
    Tensors named like `<prefix>.batch<b>.<suffix>` form one series `<prefix>.<suffix>`,
    quantized by one quantizer in order of b (batch 0: exact statistics, later batches:
    the running estimate, one pass). Any other tensor is a series of one batch.
    A tensor's kind (the summary's rows) is its series name without the dot-separated parts
    that end in a digit, e.g. `layer3.q` -> `q`.

GROUPING:
    fixture:  q/k/v [B,N,C] viewed as [B,N,12,C/12], one group per head (axis 2);
              rank-4 tensors one group per head on axis 1 ([B,H,N,N] attention probs);
              rank-3 tensors 12 channel groups on axis 2.
    --input:  rank 4: one group per index of axis 1 (heads of [B,H,N,D] / [B,H,N,N]);
              rank 3: 12 groups of consecutive channels on the last axis if 12 divides it,
                      else 1;
              any other rank: one group for the whole tensor.
    Every tensor must be F32, F16 or BF16 (widened exactly to f32 and quantized from f32).
";

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("compress_report: {e}\nRun with --help for usage.");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compress_report: error: {e}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------
// Command line

struct Options {
    input: Option<PathBuf>,
    json: bool,
    bits: u32,
    rounding: Rounding,
    no_block: bool,
}

/// The options, or `None` for `--help`.
fn parse_args(args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let mut options = Options { input: None, json: false, bits: 8, rounding: Rounding::Nearest, no_block: false };
    let mut args = args;
    while let Some(arg) = args.next() {
        // `--flag=value` and `--flag value` both work.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg, None),
        };
        let mut value =
            |what: &str| inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{flag} needs {what}"));
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--json" => options.json = true,
            "--no-block" => options.no_block = true,
            "--input" => options.input = Some(PathBuf::from(value("a file name")?)),
            "--bits" => options.bits = parse_bits(&value("a bit width (8, 4 or 2)")?)?,
            "--stochastic" => {
                let text = value("a seed")?;
                let seed = text.parse().map_err(|_| format!("--stochastic: bad seed `{text}`"))?;
                options.rounding = Rounding::Stochastic { seed };
            }
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    Ok(Some(options))
}

/// The GPU when one is usable, else the emulation (saying why on stderr);
/// `MESA_REQUIRE_GPU=1` turns a missing GPU into an error.
fn pick_device() -> Result<Device> {
    match Device::cuda(0) {
        Ok(device) => Ok(device),
        Err(e) if std::env::var("MESA_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            Err(format!("MESA_REQUIRE_GPU=1 but the CUDA backend is unavailable: {e}").into())
        }
        Err(e) => {
            eprintln!("note: running on the host emulation ({e})");
            Ok(Device::emulator())
        }
    }
}

fn parse_bits(text: &str) -> Result<u32> {
    match text.parse() {
        Ok(bits @ (2 | 4 | 8)) => Ok(bits),
        _ => Err(format!("--bits: `{text}` is not one of 8, 4, 2").into()),
    }
}

fn run(options: &Options) -> Result<()> {
    let start = Instant::now();
    let path = options.input.as_deref().unwrap_or(Path::new(FIXTURE));
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{} is not a valid safetensors file: {e}", path.display()))?;
    let series = load_series(&file, options.input.is_none())?;

    let device = pick_device()?;
    let mut rows = Vec::new();
    for s in &series {
        rows.extend(quantize_series(&device, s, options)?);
    }
    let report = Report {
        input: match &options.input {
            Some(path) => path.display().to_string(),
            None => FIXTURE_NAME.to_string(),
        },
        model: model_name(&bytes),
        backend: device.description(),
        bits: options.bits,
        rounding: options.rounding,
        momentum: QuantConfig::per_head(0).momentum,
        summary: Summary::of(&rows),
        rows,
        seconds: start.elapsed().as_secs_f64(),
    };
    // the transformer-block section (block.rs): on the default fixture only
    let block = match options.input.is_none() && !options.no_block {
        true => Some(block::run(&device, &block::block_fixture())?),
        false => None,
    };
    // the linear-attention section (linear_attention.rs)
    let linear_attention = linear_attention::Section::measure(&device, &file)?;
    if options.json {
        let mut value = report.to_json();
        if let Some(b) = &block {
            value["block"] = b.to_json();
        }
        if let (Some(obj), Some(la)) = (value.as_object_mut(), &linear_attention) {
            obj.insert("linear_attention".into(), la.to_json());
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        report.print();
        if let Some(b) = &block {
            b.print();
        }
        if let Some(la) = &linear_attention {
            la.print();
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Loading: tensors -> series of batches, each with its grouping

/// One tensor of the file, widened exactly to f32.
struct Activation {
    name: String,
    batch: usize,
    /// Shape in the file.
    shape: Vec<usize>,
    /// Shape it is quantized as (q/k/v of the fixture: `[B, N, H, D]`).
    view: Vec<usize>,
    dtype: Dtype,
    data: Vec<f32>,
}

/// The batches one quantizer sees, in order.
struct Series {
    kind: String,
    grouping: Grouping,
    batches: Vec<Activation>,
}

fn load_series(file: &SafeTensors, fixture: bool) -> Result<Vec<Series>> {
    // natural sort key of the series name -> (series name, its batches)
    let mut by_name: BTreeMap<String, (String, Vec<Activation>)> = BTreeMap::new();
    for (name, view) in file.tensors() {
        let data = widen(view.dtype(), view.data())
            .ok_or_else(|| format!("tensor `{name}` has dtype {}; supported: F32, F16, BF16", view.dtype()))?;
        let (series, batch) = split_batch(&name).unwrap_or_else(|| (name.clone(), 0));
        let shape = view.shape().to_vec();
        let act = Activation { view: shape.clone(), name, batch, shape, dtype: view.dtype(), data };
        by_name.entry(natural_key(&series)).or_insert_with(|| (series, Vec::new())).1.push(act);
    }
    if by_name.is_empty() {
        return Err("the file holds no tensors".into());
    }
    let mut all = Vec::new();
    for (series_name, mut batches) in by_name.into_values() {
        batches.sort_by_key(|a| a.batch);
        let kind = kind_of(&series_name);
        let grouping = plan_grouping(&kind, &mut batches, fixture)?;
        all.push(Series { kind, grouping, batches });
    }
    Ok(all)
}

/// Exact widening of F32/F16/BF16 little-endian bytes; `None` for other dtypes.
fn widen(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let values = match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        _ => return None,
    };
    Some(values)
}

/// `a.batch2.b` -> (`a.b`, 2): a dot-separated part `batch<digits>` with parts on both sides.
fn split_batch(name: &str) -> Option<(String, usize)> {
    let mut parts: Vec<&str> = name.split('.').collect();
    let inner = 1..parts.len().saturating_sub(1);
    let (pos, batch) = inner.into_iter().find_map(|i| Some((i, batch_number(parts[i])?)))?;
    parts.remove(pos);
    Some((parts.join("."), batch))
}

/// `batch12` -> 12.
fn batch_number(part: &str) -> Option<usize> {
    let digits = part.strip_prefix("batch")?;
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The series name without its numbered parts: `layer3.q` -> `q`.
fn kind_of(series: &str) -> String {
    let parts: Vec<&str> = series.split('.').filter(|p| !p.ends_with(|c: char| c.is_ascii_digit())).collect();
    if parts.is_empty() {
        series.to_string()
    } else {
        parts.join(".")
    }
}

/// Sort key that orders numbers by value (`layer2` before `layer10`).
fn natural_key(name: &str) -> String {
    let mut key = String::new();
    let mut digits = String::new();
    for c in name.chars().chain(std::iter::once('\0')) {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        if !digits.is_empty() {
            key.extend(std::iter::repeat_n('0', 20usize.saturating_sub(digits.len())));
            key.push_str(&digits);
            digits.clear();
        }
        if c != '\0' {
            key.push(c);
        }
    }
    key
}

/// The grouping of a series (from its first batch); sets each batch's view shape.
fn plan_grouping(kind: &str, batches: &mut [Activation], fixture: bool) -> Result<Grouping> {
    let head_split = fixture && matches!(kind, "q" | "k" | "v");
    if head_split {
        for act in batches.iter_mut() {
            act.view = split_heads(&act.name, &act.shape)?;
        }
        return Ok(Grouping::Heads { axis: 2 });
    }
    let shape = &batches[0].shape;
    Ok(match shape.len() {
        4 => Grouping::Heads { axis: 1 },
        3 if shape[2] % HEADS == 0 => Grouping::Channels { axis: 2, groups: HEADS },
        3 => Grouping::Channels { axis: 2, groups: 1 },
        _ => Grouping::Tensor,
    })
}

/// `[B, N, H·D]` -> `[B, N, H, D]` (same memory: the head axis stays where it is).
fn split_heads(name: &str, shape: &[usize]) -> Result<Vec<usize>> {
    match *shape {
        [b, n, c] if c % HEADS == 0 => Ok(vec![b, n, HEADS, c / HEADS]),
        _ => Err(format!("`{name}`: expected [B, N, {HEADS}·D], got {shape:?}").into()),
    }
}

/// The `model` entry of the file's metadata, if any.
fn model_name(bytes: &[u8]) -> Option<String> {
    let (_, metadata) = SafeTensors::read_metadata(bytes).ok()?;
    metadata.metadata().as_ref()?.get("model").cloned()
}

// ---------------------------------------------------------------------------------------
// Quantizing and measuring

/// What one tensor (one batch of a series) measured.
struct Row {
    name: String,
    kind: String,
    batch: usize,
    shape: Vec<usize>,
    view: Vec<usize>,
    dtype: Dtype,
    grouping: Grouping,
    groups: usize,
    numel: usize,
    bytes_saved: usize,
    nonfinite: u32,
    /// Groups saved with their exact range because the batch left the running estimate by
    /// more than one step (`None`: a batch with exact statistics).
    widened: Option<u32>,
    /// Head-wise, running estimate (the configuration under test).
    error: ErrorStats,
    /// One group for the whole tensor, running estimate.
    rel_l2_per_tensor: f64,
    /// Head-wise, exact statistics of every batch.
    rel_l2_exact: f64,
}

impl Row {
    fn bytes_f32(&self) -> usize {
        self.numel * 4
    }
    fn bytes_bf16(&self) -> usize {
        self.numel * 2
    }
}

/// Three quantizers for one series: the configuration under test and two comparisons.
struct Quantizers {
    headwise: Quantizer,
    per_tensor: Quantizer,
    exact: Quantizer,
}

impl Quantizers {
    fn new(device: &Device, grouping: Grouping, options: &Options) -> Result<Self> {
        let config =
            QuantConfig { bits: options.bits, grouping, rounding: options.rounding, ..QuantConfig::per_head(0) };
        let per_tensor = QuantConfig { grouping: Grouping::Tensor, ..config };
        let exact = QuantConfig { stats: StatsMode::Exact, ..config };
        Ok(Quantizers {
            headwise: Quantizer::new(device, config)?,
            per_tensor: Quantizer::new(device, per_tensor)?,
            exact: Quantizer::new(device, exact)?,
        })
    }
}

fn quantize_series(device: &Device, series: &Series, options: &Options) -> Result<Vec<Row>> {
    let mut quantizers = Quantizers::new(device, series.grouping, options)?;
    let bound = match options.rounding {
        Rounding::Nearest => 0.5,
        Rounding::Stochastic { .. } => 1.0,
    };
    let mut rows = Vec::new();
    for act in &series.batches {
        if act.view.contains(&0) {
            // nothing to quantize or measure (an empty grouped axis has no group at all)
            eprintln!("compress_report: skipping `{}`: shape {:?} has no elements", act.name, act.shape);
            continue;
        }
        rows.push(measure(device, &mut quantizers, series, act, bound).map_err(|e| format!("`{}`: {e}", act.name))?);
    }
    Ok(rows)
}

fn measure(device: &Device, q: &mut Quantizers, series: &Series, act: &Activation, bound: f64) -> Result<Row> {
    let layout = Layout::contiguous(&act.view);
    let x = device.upload(&act.data)?;
    let x = TensorRef::new(&x, &layout)?;
    let input = reference::try_gather(&act.data, &layout)?; // f64, logical order

    let saved = q.headwise.quantize(&x)?;
    let widened = q.headwise.widened_groups()?;
    let decoded = reference::try_gather(&decode(device, &saved, &layout)?, &layout)?;
    let scales: Vec<f64> = saved.params()?.iter().map(|p| f64::from(p.scale)).collect();
    let groups = group_index(&act.view, &series.grouping)?;
    let error = ErrorStats::measure(&input, &decoded, &groups, &scales, bound);

    let per_tensor = reference::try_gather(&decode(device, &q.per_tensor.quantize(&x)?, &layout)?, &layout)?;
    let exact_stats = reference::try_gather(&decode(device, &q.exact.quantize(&x)?, &layout)?, &layout)?;
    Ok(Row {
        name: act.name.clone(),
        kind: series.kind.clone(),
        batch: act.batch,
        shape: act.shape.clone(),
        view: act.view.clone(),
        dtype: act.dtype,
        grouping: series.grouping,
        groups: saved.num_groups(),
        numel: saved.numel(),
        bytes_saved: saved.size_in_bytes(),
        nonfinite: saved.nonfinite_count()?,
        widened,
        error,
        rel_l2_per_tensor: rel_l2(&input, &per_tensor),
        rel_l2_exact: rel_l2(&input, &exact_stats),
    })
}

/// Decodes a saved activation to f32 on the host.
fn decode(device: &Device, saved: &SavedActivation, layout: &Layout) -> Result<Vec<f32>> {
    let mut out = device.alloc_zeros::<f32>(layout.numel())?;
    saved.dequantize(device, &mut TensorMut::new(&mut out, layout)?)?;
    Ok(out.to_vec()?)
}

/// Error of a decoded tensor against its input.
struct ErrorStats {
    rel_l2: f64,
    /// Largest `|x̂ − x| / scale` of the element's group.
    max_steps: f64,
    /// Elements whose error exceeds the rounding bound: clamped within one step of the
    /// running range.
    clamped: usize,
}

impl ErrorStats {
    fn measure(x: &[f64], decoded: &[f64], groups: &[usize], scales: &[f64], bound: f64) -> Self {
        let mut max_steps = 0.0f64;
        let mut clamped = 0;
        for ((&v, &d), &g) in x.iter().zip(decoded).zip(groups) {
            if !v.is_finite() {
                continue;
            }
            let steps = steps(v, d, scales[g]);
            // f32 decoding (code · scale + offset) adds a rounding far below 1e-3 steps.
            if steps > bound + 1e-3 {
                clamped += 1;
            }
            max_steps = nan_max(max_steps, steps);
        }
        ErrorStats { rel_l2: rel_l2(x, decoded), max_steps, clamped }
    }
}

/// `|x̂ − x|` in steps of `scale` (0 for an exact value, even with a zero scale).
fn steps(x: f64, decoded: f64, scale: f64) -> f64 {
    let err = (decoded - x).abs();
    if err == 0.0 {
        0.0
    } else {
        err / scale
    }
}

/// `‖x̂ − x‖ / ‖x‖` over the finite inputs (NaN where a finite input decodes to NaN).
fn rel_l2(x: &[f64], decoded: &[f64]) -> f64 {
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (&v, &d) in x.iter().zip(decoded) {
        if v.is_finite() {
            err += (d - v).powi(2);
            norm += v * v;
        }
    }
    if err == 0.0 {
        0.0
    } else {
        (err / norm).sqrt()
    }
}

/// Maximum that propagates NaN (a poisoned group must show, not vanish).
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

// ---------------------------------------------------------------------------------------
// Summary

#[derive(Default)]
struct MeanMax {
    sum: f64,
    max: f64,
    count: usize,
}

impl MeanMax {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.max = nan_max(self.max, v);
        self.count += 1;
    }
    fn mean(&self) -> f64 {
        self.sum / self.count as f64
    }
    fn to_json(&self) -> Value {
        json!({ "mean": self.mean(), "max": self.max })
    }
}

#[derive(Default)]
struct KindSummary {
    kind: String,
    groupings: Vec<String>,
    tensors: usize,
    headwise: MeanMax,
    per_tensor: MeanMax,
    exact: MeanMax,
    max_steps: f64,
    clamped: usize,
}

/// The tensors quantized with the running estimate (batches 1 and later).
#[derive(Default)]
struct RunningSummary {
    tensors: usize,
    max_steps: f64,
    rel_l2_running: MeanMax,
    rel_l2_exact: MeanMax,
    widened: u64,
    groups: u64,
}

impl RunningSummary {
    fn of(rows: &[Row]) -> Self {
        let mut r = RunningSummary::default();
        for row in rows.iter().filter(|row| row.widened.is_some()) {
            r.tensors += 1;
            r.max_steps = nan_max(r.max_steps, row.error.max_steps);
            r.rel_l2_running.add(row.error.rel_l2);
            r.rel_l2_exact.add(row.rel_l2_exact);
            r.widened += u64::from(row.widened.unwrap_or(0));
            r.groups += row.groups as u64;
        }
        r
    }
    fn to_json(&self) -> Value {
        json!({
            "tensors": self.tensors,
            "max_error_steps": self.max_steps,
            "rel_l2_error_mean": self.rel_l2_running.mean(),
            "rel_l2_exact_stats_mean": self.rel_l2_exact.mean(),
            "widened_groups": self.widened,
            "groups": self.groups,
        })
    }
}

struct Summary {
    running: RunningSummary,
    tensors: usize,
    numel: usize,
    bytes_f32: usize,
    bytes_bf16: usize,
    bytes_saved: usize,
    nonfinite: u64,
    kinds: Vec<KindSummary>,
}

impl Summary {
    fn of(rows: &[Row]) -> Self {
        let mut kinds: Vec<KindSummary> = Vec::new();
        for row in rows {
            let pos = match kinds.iter().position(|k| k.kind == row.kind) {
                Some(pos) => pos,
                None => {
                    kinds.push(KindSummary { kind: row.kind.clone(), ..KindSummary::default() });
                    kinds.len() - 1
                }
            };
            let k = &mut kinds[pos];
            let grouping = grouping_name(&row.grouping);
            if !k.groupings.contains(&grouping) {
                k.groupings.push(grouping);
            }
            k.tensors += 1;
            k.headwise.add(row.error.rel_l2);
            k.per_tensor.add(row.rel_l2_per_tensor);
            k.exact.add(row.rel_l2_exact);
            k.max_steps = nan_max(k.max_steps, row.error.max_steps);
            k.clamped += row.error.clamped;
        }
        Summary {
            running: RunningSummary::of(rows),
            tensors: rows.len(),
            numel: rows.iter().map(|r| r.numel).sum(),
            bytes_f32: rows.iter().map(Row::bytes_f32).sum(),
            bytes_bf16: rows.iter().map(Row::bytes_bf16).sum(),
            bytes_saved: rows.iter().map(|r| r.bytes_saved).sum(),
            nonfinite: rows.iter().map(|r| u64::from(r.nonfinite)).sum(),
            kinds,
        }
    }

    fn vs_f32(&self) -> f64 {
        ratio(self.bytes_f32, self.bytes_saved)
    }
    fn vs_bf16(&self) -> f64 {
        ratio(self.bytes_bf16, self.bytes_saved)
    }
}

fn ratio(original: usize, saved: usize) -> f64 {
    original as f64 / saved as f64
}

fn grouping_name(grouping: &Grouping) -> String {
    match grouping {
        Grouping::Tensor => "tensor".into(),
        Grouping::Heads { axis } => format!("heads(axis={axis})"),
        Grouping::Channels { axis, groups } => format!("channels(axis={axis}, groups={groups})"),
    }
}

fn rounding_name(rounding: Rounding) -> String {
    match rounding {
        Rounding::Nearest => "nearest".into(),
        Rounding::Stochastic { seed } => format!("stochastic(seed={seed})"),
    }
}

// ---------------------------------------------------------------------------------------
// Output

struct Report {
    input: String,
    model: Option<String>,
    backend: String,
    bits: u32,
    rounding: Rounding,
    momentum: f32,
    rows: Vec<Row>,
    summary: Summary,
    seconds: f64,
}

impl Report {
    fn print(&self) {
        self.print_header();
        self.print_tensors();
        self.print_summary();
    }

    fn print_header(&self) {
        println!("mesa-kernels activation compression report");
        let model = self.model.as_ref().map(|m| format!(" ({m})")).unwrap_or_default();
        println!("input    : {}{model}, {} tensors", self.input, self.rows.len());
        println!("backend  : {}", self.backend);
        println!(
            "codes    : {}-bit, rounding {}, running estimate (momentum {}; batch 0: exact statistics)",
            self.bits,
            rounding_name(self.rounding),
            self.momentum
        );
        println!(
            "columns  : shape as quantized; rel-L2 = |x^-x|/|x|; steps = max |x^-x| / scale of \
             the group;\n           clamped = elements beyond the rounding bound (within one step \
             outside the running range);\n           per-tensor = one group, running; exact = head-wise, \
             exact statistics\n"
        );
    }

    fn print_tensors(&self) {
        let w = self.rows.iter().map(|r| r.name.len()).max().unwrap_or(6).max(6);
        println!(
            "{:<w$}  {:<14} {:>9} {:>8} {:>6} {:>6}  {:>9} {:>7} {:>7}  {:>10} {:>10}",
            "tensor",
            "shape",
            "f32 B",
            "saved B",
            "x f32",
            "x bf16",
            "rel-L2",
            "steps",
            "clamped",
            "per-tensor",
            "exact"
        );
        for r in &self.rows {
            println!(
                "{:<w$}  {:<14} {:>9} {:>8} {:>6.3} {:>6.3}  {:>9.3e} {:>7.2} {:>7}  {:>10.3e} {:>10.3e}",
                r.name,
                shape_text(&r.view),
                r.bytes_f32(),
                r.bytes_saved,
                ratio(r.bytes_f32(), r.bytes_saved),
                ratio(r.bytes_bf16(), r.bytes_saved),
                r.error.rel_l2,
                r.error.max_steps,
                r.error.clamped,
                r.rel_l2_per_tensor,
                r.rel_l2_exact,
            );
        }
    }

    fn print_summary(&self) {
        let s = &self.summary;
        println!("\nsummary: {} tensors, {} elements", s.tensors, s.numel);
        println!("  original bytes : {} (f32), {} (bf16)", s.bytes_f32, s.bytes_bf16);
        println!("  saved bytes    : {}", s.bytes_saved);
        println!(
            "  ratio vs f32   : {:.3}x (target >= {TARGET_VS_F32}x: {})",
            s.vs_f32(),
            met(s.vs_f32() >= TARGET_VS_F32)
        );
        println!(
            "  ratio vs bf16  : {:.3}x (target >= {TARGET_VS_BF16}x: {})",
            s.vs_bf16(),
            met(s.vs_bf16() >= TARGET_VS_BF16)
        );
        println!("  non-finite inputs: {}", s.nonfinite);
        let r = &s.running;
        if r.tensors > 0 {
            println!(
                "  running estimate (batches 1+, {} tensors): max error {:.3} steps; rel-L2 mean {:.3e} \
                 (exact statistics {:.3e}, ratio {:.3}); widened groups {} of {}",
                r.tensors,
                r.max_steps,
                r.rel_l2_running.mean(),
                r.rel_l2_exact.mean(),
                r.rel_l2_running.mean() / r.rel_l2_exact.mean(),
                r.widened,
                r.groups
            );
        }
        println!("  backend        : {}", self.backend);
        println!("  time           : {:.2} s\n", self.seconds);
        print_kind_table(&s.kinds);
    }

    fn to_json(&self) -> Value {
        let s = &self.summary;
        json!({
            "input": self.input,
            "model": self.model,
            "backend": self.backend,
            "bits": self.bits,
            "rounding": rounding_name(self.rounding),
            "momentum": self.momentum,
            "tensors": self.rows.iter().map(row_json).collect::<Vec<_>>(),
            "summary": {
                "tensors": s.tensors,
                "elements": s.numel,
                "bytes_original_f32": s.bytes_f32,
                "bytes_original_bf16": s.bytes_bf16,
                "bytes_saved": s.bytes_saved,
                "compression_vs_f32": s.vs_f32(),
                "compression_vs_bf16": s.vs_bf16(),
                "target_vs_f32": TARGET_VS_F32,
                "target_vs_bf16": TARGET_VS_BF16,
                "target_vs_f32_met": s.vs_f32() >= TARGET_VS_F32,
                "target_vs_bf16_met": s.vs_bf16() >= TARGET_VS_BF16,
                "nonfinite_inputs": s.nonfinite,
                "running_estimate": s.running.to_json(),
                "backend": self.backend,
                "seconds": self.seconds,
                "kinds": s.kinds.iter().map(kind_json).collect::<Vec<_>>(),
            },
        })
    }
}

fn print_kind_table(kinds: &[KindSummary]) {
    let w = kinds.iter().map(|k| k.kind.len()).max().unwrap_or(4).max(4);
    let g = kinds.iter().map(|k| k.groupings.join(" / ").len()).max().unwrap_or(8).max(8);
    println!("  rel-L2 error per kind (mean / max over its tensors):");
    println!(
        "  {:<w$}  {:<g$}  {:>21}  {:>21}  {:>21}  {:>9} {:>7}",
        "kind", "grouping", "head-wise (running)", "per-tensor (running)", "head-wise (exact)", "max steps", "clamped"
    );
    for k in kinds {
        println!(
            "  {:<w$}  {:<g$}  {}  {}  {}  {:>9.2} {:>7}",
            k.kind,
            k.groupings.join(" / "),
            mean_max_text(&k.headwise),
            mean_max_text(&k.per_tensor),
            mean_max_text(&k.exact),
            k.max_steps,
            k.clamped
        );
    }
}

fn mean_max_text(m: &MeanMax) -> String {
    format!("{:>9.3e} / {:>9.3e}", m.mean(), m.max)
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

fn shape_text(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(","))
}

fn row_json(r: &Row) -> Value {
    json!({
        "name": r.name,
        "kind": r.kind,
        "batch": r.batch,
        "shape": r.shape,
        "quantized_shape": r.view,
        "dtype": r.dtype.to_string(),
        "grouping": grouping_name(&r.grouping),
        "groups": r.groups,
        "elements": r.numel,
        "bytes_original": r.bytes_f32(),
        "bytes_bf16": r.bytes_bf16(),
        "bytes_saved": r.bytes_saved,
        "compression_vs_f32": ratio(r.bytes_f32(), r.bytes_saved),
        "compression_vs_bf16": ratio(r.bytes_bf16(), r.bytes_saved),
        "rel_l2_error": r.error.rel_l2,
        "max_error_steps": r.error.max_steps,
        "clamped": r.error.clamped,
        "widened_groups": r.widened,
        "rel_l2_per_tensor": r.rel_l2_per_tensor,
        "rel_l2_exact_stats": r.rel_l2_exact,
        "nonfinite_inputs": r.nonfinite,
    })
}

fn kind_json(k: &KindSummary) -> Value {
    json!({
        "kind": k.kind,
        "groupings": k.groupings,
        "tensors": k.tensors,
        "rel_l2_error": k.headwise.to_json(),
        "rel_l2_per_tensor": k.per_tensor.to_json(),
        "rel_l2_exact_stats": k.exact.to_json(),
        "max_error_steps": k.max_steps,
        "clamped": k.clamped,
    })
}
