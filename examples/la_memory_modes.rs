//! Error and emulator time of the two memory modes of linear-attention backward as the
//! sequence grows (the measurement behind `MemoryMode::default`, docs/linear_attention.md).
//!
//! ```sh
//! cargo run --release --example la_memory_modes            # L = 256, 1K, 4K, 16K
//! cargo run --release --example la_memory_modes -- 256 1024
//! ```
//!
//! Causal, normalised attention, B = H = 1, M = D = 8, chunk 64, f32 inputs: positive
//! features (uniform in [0.05, 1], as ELU+1 / FAVOR+ produce), values and upstream
//! gradients uniform in [−1, 1], from a fixed seed. Errors are relative L2,
//! ‖kernel − ref‖ / ‖ref‖, against the f64 O(L²) reference. Times are the host emulation's
//! (NOT performance: they only compare the two modes' work on the same machine).
use std::time::Instant;

use mesa_kernels::linear_attention::{
    backward, forward, BackwardArgs, ForwardArgs, Grads, LinearAttentionConfig, MemoryMode,
};
use mesa_kernels::reference::linear_attention as rla;
use mesa_kernels::{Device, Layout};
use mesa_kernels::{TensorMut, TensorRef};

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lens: Vec<usize> = {
        let v: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
        if v.is_empty() {
            vec![256, 1024, 4096, 16384]
        } else {
            v
        }
    };
    let device = Device::emulator();
    let (m, d) = (8usize, 8usize);
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move |lo: f64, hi: f64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        lo + (hi - lo) * ((state >> 11) as f64 / (1u64 << 53) as f64)
    };
    println!("causal normalised linear attention, B=H=1, M=D={m}, chunk 64, f32; rel-L2 error vs f64 reference");
    println!(
        "{:>6} {:<15} {:>10} {:>10} {:>10} {:>10} {:>12} {:>14}",
        "L", "mode", "out", "dq", "dk", "dv", "saved B", "emu fwd+bwd s"
    );
    for &l in &lens {
        let q: Vec<f32> = (0..l * m).map(|_| next(0.05, 1.0) as f32).collect();
        let k: Vec<f32> = (0..l * m).map(|_| next(0.05, 1.0) as f32).collect();
        let v: Vec<f32> = (0..l * d).map(|_| next(-1.0, 1.0) as f32).collect();
        let g: Vec<f32> = (0..l * d).map(|_| next(-1.0, 1.0) as f32).collect();
        let w = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
        let dims = rla::Dims { batch: 1, heads: 1, len: l, feat: m, dim: d };
        let (ro, _) = rla::forward(&rla::Attention {
            q: &w(&q),
            k: &w(&k),
            v: &w(&v),
            dims,
            causal: true,
            normalize: Some(1e-6),
        })?;
        let (rdq, rdk, rdv) = rla::backward(
            &rla::Attention { q: &w(&q), k: &w(&k), v: &w(&v), dims, causal: true, normalize: Some(1e-6) },
            &w(&g),
        )?;
        let lq = Layout::contiguous(&[1, 1, l, m]);
        let lv = Layout::contiguous(&[1, 1, l, d]);
        for memory in [MemoryMode::BoundaryStates, MemoryMode::Slim] {
            let cfg = LinearAttentionConfig { memory, ..LinearAttentionConfig::causal() };
            let mut out = vec![0f32; l * d];
            let (mut dq, mut dk, mut dv) = (vec![0f32; l * m], vec![0f32; l * m], vec![0f32; l * d]);
            let start = Instant::now();
            let saved = forward(
                &device,
                &cfg,
                ForwardArgs {
                    q: &TensorRef::new(&q, &lq)?,
                    k: &TensorRef::new(&k, &lq)?,
                    v: &TensorRef::new(&v, &lv)?,
                    out: &mut TensorMut::new(&mut out, &lv)?,
                },
            )?;
            backward(
                &device,
                &saved,
                BackwardArgs {
                    q: &TensorRef::new(&q, &lq)?,
                    k: &TensorRef::new(&k, &lq)?,
                    v: &TensorRef::new(&v, &lv)?,
                    out: Some(&TensorRef::new(&out, &lv)?),
                    dout: &TensorRef::new(&g, &lv)?,
                    grads: Grads {
                        dq: &mut TensorMut::new(&mut dq, &lq)?,
                        dk: &mut TensorMut::new(&mut dk, &lq)?,
                        dv: &mut TensorMut::new(&mut dv, &lv)?,
                    },
                },
            )?;
            let secs = start.elapsed().as_secs_f64();
            println!(
                "{:>6} {:<15} {:>10.2e} {:>10.2e} {:>10.2e} {:>10.2e} {:>12} {:>14.3}",
                l,
                format!("{memory:?}"),
                rel_l2(&out, &ro),
                rel_l2(&dq, &rdq),
                rel_l2(&dk, &rdk),
                rel_l2(&dv, &rdv),
                saved.state_bytes(),
                secs
            );
        }
    }
    println!("(emulator times: host emulation, not performance)");
    Ok(())
}
