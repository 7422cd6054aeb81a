//! One transformer layer in candle: plain candle ops vs mesa-candle's one-op layer that keeps
//! codes. Prints the bytes alive for backward after the forward, the peak during backward,
//! and the gradient parity per parameter.
//!
//! `cargo run --release -p mesa-candle --example candle_layer` (CPU: the kernels' host
//! emulation; `-- --small` for a quick run). Bytes are counted by a counting global
//! allocator: candle's CPU storage directly, the emulator's buffers (its own allocator)
//! through `mesa_kernels::HostMemoryObserver`.
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use mesa_candle::layer::measure::{measure, Measured};
use mesa_candle::layer::{reference, DropoutConfig, LayerConfig, NormPlacement, Recompute, TransformerLayer};
use mesa_candle::CountingAllocator;

#[global_allocator]
static COUNTER: CountingAllocator = CountingAllocator::new();

/// Cosine and relative error per parameter name.
type Parity = HashMap<&'static str, (f64, f64)>;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let n = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum::<f64>().sqrt();
    d / b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt()
}

fn main() -> candle_core::Result<()> {
    let small = std::env::args().any(|a| a == "--small");
    let (b, n, c, h, f) = if small { (2, 64, 64, 4, 256) } else { (2, 256, 256, 4, 1024) };
    let device = Device::Cpu;
    let base = LayerConfig {
        norm: NormPlacement::Pre,
        dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
        ..LayerConfig::new(c, h, f)
    };
    println!(
        "# one pre-LN causal softmax-attention layer, B={b} N={n} C={c} H={h} F={f}, f32, dropout 0.1, {}",
        if device.is_cpu() { "CPU (kernels: host emulation)" } else { "CUDA" }
    );
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, n, c), &device)?)?;
    let dy = Tensor::randn(0f32, 1.0, (b, n, c), &device)?;
    let input_bytes = b * n * c * 4;
    let seed = 0x5EED;

    // ---- the swap: a candle model's layer becomes one op over (x, flat parameters) ----
    let ours = TransformerLayer::new(base.clone(), &device)?;
    // the plain-candle layer with the same weights (one Var per checkpoint name)
    let vars = reference::variables(ours.layout(), ours.params().as_tensor(), DType::F32)?;

    let plain_run = || -> candle_core::Result<(Measured, candle_core::backprop::GradStore)> {
        measure(&COUNTER, input_bytes, &dy, || reference::forward(&base, &vars, x.as_tensor(), seed))
    };
    let _ = plain_run()?; // warm-up (thread pools, lazily built state)
    let (plain, plain_grads) = plain_run()?;

    println!();
    println!(
        "| layer | bits | recompute | alive after forward (MiB) | × plain | peak during backward (MiB) | × plain |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| plain candle f32 | — | — | {:.2} | 1.00 | {:.2} | 1.00 |",
        mib(plain.alive_after_forward),
        mib(plain.peak_during_backward)
    );
    let mut parity: Vec<(String, Parity)> = Vec::new();
    for bits in [8, 4, 2] {
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let config = LayerConfig { bits, recompute, ..base.clone() };
            let mut map = HashMap::new();
            for (name, t) in ours.layout().unflatten(ours.params().as_tensor())? {
                map.insert(name.to_string(), t);
            }
            let layer = TransformerLayer::from_tensors(config, &map, "", &device)?;
            let run = || measure(&COUNTER, input_bytes, &dy, || layer.forward_seeded(x.as_tensor(), seed));
            let _ = run()?;
            let (m, grads) = run()?;
            println!(
                "| mesa-candle | {bits} | {recompute:?} | {:.2} | {:.3} | {:.2} | {:.3} |",
                mib(m.alive_after_forward),
                m.alive_after_forward as f64 / plain.alive_after_forward as f64,
                mib(m.peak_during_backward),
                m.peak_during_backward as f64 / plain.peak_during_backward as f64
            );
            let flat =
                grads.get(layer.params().as_tensor()).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
            let mut per = HashMap::new();
            for (name, g) in layer.layout().unflatten(flat)? {
                let want = plain_grads
                    .get(vars[name].as_tensor())
                    .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
                let (g, want) = (g.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
                per.insert(name, (cosine(&g, &want), rel(&g, &want)));
            }
            let dx = grads
                .get(x.as_tensor())
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let dx_ref = plain_grads
                .get(x.as_tensor())
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            per.insert("x (layer input)", (cosine(&dx, &dx_ref), rel(&dx, &dx_ref)));
            parity.push((format!("{bits}-bit {recompute:?}"), per));
        }
    }

    println!();
    println!("gradient parity against the plain-candle f32 layer: cosine / relative error per parameter");
    println!("(attn.k_proj.bias: its true gradient is 0 — softmax ignores a shift of a whole row of scores — reported, not counted)");
    println!();
    let names: Vec<&'static str> =
        std::iter::once("x (layer input)").chain(ours.layout().entries().iter().map(|e| e.name)).collect();
    print!("| parameter |");
    for (label, _) in &parity {
        print!(" {label} |");
    }
    println!();
    println!("|---|{}", "---|".repeat(parity.len()));
    for name in &names {
        print!("| {name} |");
        for (_, per) in &parity {
            let (cos, r) = per[name];
            print!(" {cos:.5} / {r:.1e} |");
        }
        println!();
    }
    print!("| min cosine (counted) |");
    for (_, per) in &parity {
        let min = per.iter().filter(|(n, _)| **n != "attn.k_proj.bias").map(|(_, (c, _))| *c).fold(1.0, f64::min);
        print!(" {min:.5} |");
    }
    println!();

    // no saved tensor grows with N² under selective recomputation
    println!();
    println!("bytes alive after the forward vs sequence length (8 bits):");
    println!();
    println!("| N | plain candle f32 (MiB) | none (MiB) | selective (MiB) | full (MiB) |");
    println!("|---|---|---|---|---|");
    for len in [n / 2, n, 2 * n] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, len, c), &device)?)?;
        let dy = Tensor::randn(0f32, 1.0, (b, len, c), &device)?;
        let bytes = b * len * c * 4;
        let (p, _) = measure(&COUNTER, bytes, &dy, || reference::forward(&base, &vars, x.as_tensor(), seed))?;
        print!("| {len} | {:.2} |", mib(p.alive_after_forward));
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let mut map = HashMap::new();
            for (name, t) in ours.layout().unflatten(ours.params().as_tensor())? {
                map.insert(name.to_string(), t);
            }
            let layer = TransformerLayer::from_tensors(LayerConfig { recompute, ..base.clone() }, &map, "", &device)?;
            let (m, _) = measure(&COUNTER, bytes, &dy, || layer.forward_seeded(x.as_tensor(), seed))?;
            print!(" {:.2} |", mib(m.alive_after_forward));
        }
        println!();
    }
    Ok(())
}
