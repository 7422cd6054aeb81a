//! The report's linear-attention section (SLiM / Performer) on the fixture's real Q/K/V.
//!
//! 1. Approximation: per (layer, batch) sample, q/k/v `[1, 28, 384]` are viewed (strides,
//!    no copy) as `[B=1, H=12, L=28, d=32]`. Exact softmax attention `softmax(qkᵀ/√d) v`
//!    (f64 reference) against normalised linear attention over FAVOR+ features (orthogonal
//!    random ω, seed 0, m = 64 and 256; queries stabilised per row, keys by the sequence
//!    maximum (bidirectional) or the constant bound max|ω_i|²/2 (causal)) and over ELU+1
//!    features of q and k, bidirectional (MiniLM is an encoder) and causal. Error: relative L2 of the output,
//!    ‖out − softmax‖ / ‖softmax‖ over all heads, mean and max over the samples.
//! 2. Memory (SLiM-style): the 18 samples' layer tokens concatenated into one sequence per
//!    head (L = 504, H = 12, ELU+1 features, M = D = 32, causal, normalised); for each chunk
//!    size the bytes the forward keeps for the backward (boundary states vs SLiM's final
//!    state, and the same at half the length to show what grows with L) and the time of
//!    forward + backward on the device (the emulation's time is labelled: not performance).
use std::time::Instant;

use mesa_kernels::feature_map::{self, FavorProjection, FavorStabilizer, FeatureMap};
use mesa_kernels::linear_attention::{
    backward, forward, saved_bytes, BackwardArgs, Dims, ForwardArgs, Grads, LinearAttentionConfig, MemoryMode,
};
use mesa_kernels::reference::{self, linear_attention as rla};
use mesa_kernels::{Buffer, Device, Layout, TensorMut, TensorRef};
use safetensors::SafeTensors;
use serde_json::{json, Value};

use super::Result;

const HEADS: usize = 12;
const FAVOR_FEATURES: [usize; 2] = [64, 256];
const CHUNKS: [usize; 4] = [8, 16, 32, 64];
/// The denominator guard of this section (see `attend`).
const EPS: f32 = 1e-30;

/// One (layer, batch) sample: q, k, v in logical [1, H, L, d] order (f32).
struct Sample {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

struct Approx {
    method: String,
    bidirectional: Vec<f64>,
    causal: Vec<f64>,
}

struct MemRow {
    mode: MemoryMode,
    chunk: usize,
    saved_bytes: usize,
    saved_bytes_half_len: usize,
    seconds: f64,
}

/// The section's results.
pub struct Section {
    backend: String,
    emulated: bool,
    samples: usize,
    len: usize,
    head_dim: usize,
    approx: Vec<Approx>,
    memory_len: usize,
    memory: Vec<MemRow>,
}

fn load(file: &SafeTensors) -> Result<Option<(Vec<Sample>, usize, usize)>> {
    let mut samples = Vec::new();
    let (mut len, mut dim) = (0, 0);
    for layer in 0.. {
        let mut found = false;
        for batch in 0.. {
            let get = |kind: &str| file.tensor(&format!("layer{layer}.batch{batch}.{kind}")).ok();
            let (Some(q), Some(k), Some(v)) = (get("q"), get("k"), get("v")) else { break };
            found = true;
            let shape = q.shape().to_vec();
            if shape.len() != 3 || shape[0] != 1 || shape[2] % HEADS != 0 || k.shape() != shape || v.shape() != shape {
                return Err(format!("layer{layer}.batch{batch}: q/k/v must be [1, N, 12·d], got {shape:?}").into());
            }
            (len, dim) = (shape[1], shape[2] / HEADS);
            // [1, N, H·d] viewed as [1, H, N, d]
            let view = Layout::strided(&[1, HEADS, len, dim], &[len * HEADS * dim, dim, HEADS * dim, 1], 0)?;
            let logical = |t: safetensors::tensor::TensorView<'_>| -> Result<Vec<f32>> {
                let x = super::widen(t.dtype(), t.data()).ok_or("q/k/v must be F32, F16 or BF16")?;
                Ok(reference::gather(&x, &view).into_iter().map(|a| a as f32).collect())
            };
            samples.push(Sample { q: logical(q)?, k: logical(k)?, v: logical(v)? });
        }
        if !found {
            break;
        }
    }
    Ok(if samples.is_empty() { None } else { Some((samples, len, dim)) })
}

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

fn features(device: &Device, map: &FeatureMap<'_>, x: &[f32], l: usize, d: usize) -> Result<Buffer<f32>> {
    let m = map.out_dim(d);
    let xb = device.upload(x)?;
    let mut phi = device.alloc_zeros::<f32>(HEADS * l * m)?;
    feature_map::forward(
        device,
        map,
        &TensorRef::new(&xb, &Layout::contiguous(&[1, HEADS, l, d]))?,
        &mut TensorMut::new(&mut phi, &Layout::contiguous(&[1, HEADS, l, m]))?,
    )?;
    Ok(phi)
}

#[allow(clippy::too_many_arguments)]
fn attend(
    device: &Device,
    causal: bool,
    qf: &Buffer<f32>,
    kf: &Buffer<f32>,
    v: &[f32],
    l: usize,
    m: usize,
    d: usize,
) -> Result<Vec<f32>> {
    let base = if causal { LinearAttentionConfig::causal() } else { LinearAttentionConfig::bidirectional() };
    // positive features: the denominator is > 0 unless every product underflows, so the
    // guard only has to keep 0/0 away (an absolute ε of 1e-6 would swamp the tiny
    // denominators of causal FAVOR+ keys under the constant bound)
    let cfg = LinearAttentionConfig { eps: EPS, ..base };
    let lq = Layout::contiguous(&[1, HEADS, l, m]);
    let lv = Layout::contiguous(&[1, HEADS, l, d]);
    let vb = device.upload(v)?;
    let mut out = device.alloc_zeros::<f32>(HEADS * l * d)?;
    forward(
        device,
        &cfg,
        ForwardArgs {
            q: &TensorRef::new(qf, &lq)?,
            k: &TensorRef::new(kf, &lq)?,
            v: &TensorRef::new(&vb, &lv)?,
            out: &mut TensorMut::new(&mut out, &lv)?,
        },
    )?;
    Ok(out.to_vec()?)
}

impl Section {
    /// Measures the section, or `None` when the file has no `layer*.batch*.q/k/v`.
    pub fn measure(device: &Device, file: &SafeTensors) -> Result<Option<Section>> {
        let Some((samples, l, d)) = load(file)? else { return Ok(None) };
        let dims = rla::Dims { batch: 1, heads: HEADS, len: l, feat: d, dim: d };
        let wide = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
        let projections = FAVOR_FEATURES
            .iter()
            .map(|&m| FavorProjection::orthogonal(device, m, d, 0))
            .collect::<mesa_kernels::Result<Vec<_>>>()?;
        let mut approx: Vec<Approx> = FAVOR_FEATURES
            .iter()
            .map(|m| format!("FAVOR+ m={m}"))
            .chain(["ELU+1".to_string()])
            .map(|method| Approx { method, bidirectional: Vec::new(), causal: Vec::new() })
            .collect();
        for s in &samples {
            for causal in [false, true] {
                let exact = rla::softmax_attention(&rla::Attention {
                    q: &wide(&s.q),
                    k: &wide(&s.k),
                    v: &wide(&s.v),
                    dims,
                    causal,
                    normalize: None,
                })?;
                for (i, proj) in projections.iter().enumerate() {
                    let qmap = FeatureMap::Favor { projection: proj, stabilizer: FavorStabilizer::RowMax };
                    let kstab = if causal { FavorStabilizer::Bound } else { FavorStabilizer::SequenceMax };
                    let kmap = FeatureMap::Favor { projection: proj, stabilizer: kstab };
                    let (qf, kf) = (features(device, &qmap, &s.q, l, d)?, features(device, &kmap, &s.k, l, d)?);
                    let out = attend(device, causal, &qf, &kf, &s.v, l, proj.features(), d)?;
                    push(&mut approx[i], causal, rel_l2(&out, &exact));
                }
                let (qf, kf) = (
                    features(device, &FeatureMap::Elu1, &s.q, l, d)?,
                    features(device, &FeatureMap::Elu1, &s.k, l, d)?,
                );
                let out = attend(device, causal, &qf, &kf, &s.v, l, d, d)?;
                let last = approx.len() - 1;
                push(&mut approx[last], causal, rel_l2(&out, &exact));
            }
        }
        let (memory_len, memory) = memory_table(device, &samples, l, d)?;
        Ok(Some(Section {
            backend: device.description(),
            emulated: !device.is_cuda(),
            samples: samples.len(),
            len: l,
            head_dim: d,
            approx,
            memory_len,
            memory,
        }))
    }

    /// The text table.
    pub fn print(&self) {
        println!("\nlinear attention (SLiM / Performer) on the fixture's q/k/v");
        println!(
            "  {} samples (layer x batch), [B=1, H={HEADS}, L={}, d={}]; normalised linear attention vs exact softmax attention",
            self.samples, self.len, self.head_dim
        );
        println!("  rel-L2 error of the output, mean / max over the samples:");
        println!("  {:<14}  {:>21}  {:>21}", "features", "bidirectional", "causal");
        for a in &self.approx {
            println!("  {:<14}  {}  {}", a.method, mean_max(&a.bidirectional), mean_max(&a.causal));
        }
        let label = if self.emulated { "emulator s (not performance)" } else { "GPU s" };
        println!(
            "\n  saved for backward (causal, normalised, ELU+1, H={HEADS}, M=D={}, L={} = the samples' tokens concatenated):",
            self.head_dim, self.memory_len
        );
        println!(
            "  {:<15} {:>5} {:>12} {:>14} {:>11} {:>30}",
            "mode",
            "chunk",
            "saved B",
            "saved B (L/2)",
            "B / token",
            format!("fwd+bwd {label}")
        );
        for r in &self.memory {
            println!(
                "  {:<15} {:>5} {:>12} {:>14} {:>11.1} {:>30.3}",
                mode_name(r.mode),
                r.chunk,
                r.saved_bytes,
                r.saved_bytes_half_len,
                r.saved_bytes as f64 / (self.memory_len * HEADS) as f64,
                r.seconds
            );
        }
        println!("  (saved bytes = states; normalised attention also keeps 4 bytes of denominator per token and head)");
    }

    /// The `linear_attention` JSON value.
    pub fn to_json(&self) -> Value {
        json!({
            "backend": self.backend,
            "samples": self.samples,
            "heads": HEADS,
            "len": self.len,
            "head_dim": self.head_dim,
            "error_metric": "relative L2 of the attention output vs exact softmax attention",
            "approximation": self.approx.iter().map(|a| json!({
                "features": a.method,
                "bidirectional": stats_json(&a.bidirectional),
                "causal": stats_json(&a.causal),
            })).collect::<Vec<_>>(),
            "memory": {
                "len": self.memory_len,
                "time_label": if self.emulated { "host emulation, not performance" } else { "GPU" },
                "rows": self.memory.iter().map(|r| json!({
                    "mode": mode_name(r.mode),
                    "chunk": r.chunk,
                    "saved_bytes": r.saved_bytes,
                    "saved_bytes_half_len": r.saved_bytes_half_len,
                    "seconds_fwd_bwd": r.seconds,
                })).collect::<Vec<_>>(),
            },
        })
    }
}

fn push(a: &mut Approx, causal: bool, e: f64) {
    if causal {
        a.causal.push(e);
    } else {
        a.bidirectional.push(e);
    }
}

fn mean_max(v: &[f64]) -> String {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let max = v.iter().copied().fold(0.0, f64::max);
    format!("{mean:>9.3e} / {max:>9.3e}")
}

fn stats_json(v: &[f64]) -> Value {
    json!({ "mean": v.iter().sum::<f64>() / v.len().max(1) as f64, "max": v.iter().copied().fold(0.0, f64::max) })
}

fn mode_name(m: MemoryMode) -> &'static str {
    match m {
        MemoryMode::BoundaryStates => "boundary_states",
        MemoryMode::Slim => "slim",
    }
}

/// Chunk size vs saved bytes and time, on the samples' tokens concatenated per head.
fn memory_table(device: &Device, samples: &[Sample], l: usize, d: usize) -> Result<(usize, Vec<MemRow>)> {
    let total = samples.len() * l;
    // [1, H, total, d]: head h's rows are the samples' rows one after another
    let concat = |pick: &dyn Fn(&Sample) -> &Vec<f32>| -> Vec<f32> {
        let mut out = Vec::with_capacity(HEADS * total * d);
        for h in 0..HEADS {
            for s in samples {
                out.extend_from_slice(&pick(s)[h * l * d..(h + 1) * l * d]);
            }
        }
        out
    };
    let (q, k, v) = (concat(&|s| &s.q), concat(&|s| &s.k), concat(&|s| &s.v));
    let qf = features(device, &FeatureMap::Elu1, &q, total, d)?;
    let kf = features(device, &FeatureMap::Elu1, &k, total, d)?;
    let vb = device.upload(&v)?;
    let gb = device.upload(&v.iter().map(|x| x * 0.5).collect::<Vec<f32>>())?;
    let layout = Layout::contiguous(&[1, HEADS, total, d]);
    let mut rows = Vec::new();
    let configs = CHUNKS.iter().map(|&c| (MemoryMode::BoundaryStates, c)).chain([(MemoryMode::Slim, 64)]);
    for (mode, chunk) in configs {
        let cfg = LinearAttentionConfig { chunk, memory: mode, ..LinearAttentionConfig::causal() };
        let dims = |len| Dims { batch: 1, heads: HEADS, len, feat: d, dim: d };
        let den_bytes = HEADS * total * 4;
        let mut out = device.alloc_zeros::<f32>(HEADS * total * d)?;
        let mut dq = device.alloc_zeros::<f32>(HEADS * total * d)?;
        let mut dk = device.alloc_zeros::<f32>(HEADS * total * d)?;
        let mut dv = device.alloc_zeros::<f32>(HEADS * total * d)?;
        device.synchronize()?;
        let start = Instant::now();
        let saved = forward(
            device,
            &cfg,
            ForwardArgs {
                q: &TensorRef::new(&qf, &layout)?,
                k: &TensorRef::new(&kf, &layout)?,
                v: &TensorRef::new(&vb, &layout)?,
                out: &mut TensorMut::new(&mut out, &layout)?,
            },
        )?;
        backward(
            device,
            &saved,
            BackwardArgs {
                q: &TensorRef::new(&qf, &layout)?,
                k: &TensorRef::new(&kf, &layout)?,
                v: &TensorRef::new(&vb, &layout)?,
                out: Some(&TensorRef::new(&out, &layout)?),
                dout: &TensorRef::new(&gb, &layout)?,
                grads: Grads {
                    dq: &mut TensorMut::new(&mut dq, &layout)?,
                    dk: &mut TensorMut::new(&mut dk, &layout)?,
                    dv: &mut TensorMut::new(&mut dv, &layout)?,
                },
            },
        )?;
        device.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        rows.push(MemRow {
            mode,
            chunk,
            saved_bytes: saved.state_bytes(),
            saved_bytes_half_len: saved_bytes(&dims(total / 2), &cfg)? - HEADS * (total / 2) * 4,
            seconds,
        });
        debug_assert_eq!(saved.size_in_bytes(), saved.state_bytes() + den_bytes);
    }
    Ok((total, rows))
}
