//! Error against memory of the two memory modes of linear-attention backward as the sequence
//! grows (the measurement behind `MemoryMode`, docs/linear_attention.md).
//!
//! ```sh
//! cargo run --release --example la_memory_modes            # L = 16, 256, 1K, 4K, 16K
//! cargo run --release --example la_memory_modes -- 256 1024
//! ```
//!
//! Causal, normalised attention, B = H = 1, M = D = 8, chunk 64 (4 for L < 256), f32
//! inputs: positive features (uniform in [0.05, 1], as ELU+1 / FAVOR+ produce), values and
//! upstream gradients uniform in [−1, 1], from a fixed seed. Errors are relative L2,
//! ‖kernel − ref‖ / ‖ref‖, against the f64 O(L²) reference. "causal dq" is issue 13's
//! measure on the same inputs with the keys and values of the last 16 rows (L/4 when
//! shorter) multiplied by
//! 1e4: max |dq − dq_ref| over the rows before them divided by the largest |dq_ref| there.
//! Memory: what the forward saves (states; denominators, 4 B per row) and the backward's
//! scratch. Times
//! are the host emulation's (NOT performance: they only compare the two modes' work).
use std::time::Instant;

use mesa_kernels::linear_attention::{
    backward, backward_workspace_bytes, forward, BackwardArgs, Dims, ForwardArgs, Grads, LinearAttentionConfig,
    MemoryMode,
};
use mesa_kernels::reference::linear_attention as rla;
use mesa_kernels::{Device, Layout};
use mesa_kernels::{TensorMut, TensorRef};

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// Issue 13's error at earlier positions: rows `..t0` of `[L, M]`.
fn early_error(got: &[f32], want: &[f64], t0: usize, m: usize) -> f64 {
    let err = got[..t0 * m].iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).abs()).fold(0.0, f64::max);
    err / want[..t0 * m].iter().map(|w| w.abs()).fold(0.0, f64::max)
}

struct Run {
    out: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    state: usize,
    den: usize,
    secs: f64,
}

type Inputs<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// The reference's output and gradients `(out, (dq, dk, dv))`.
type Reference = (Vec<f64>, (Vec<f64>, Vec<f64>, Vec<f64>));

fn run(
    device: &Device,
    cfg: &LinearAttentionConfig,
    l: usize,
    m: usize,
    d: usize,
    x: Inputs<'_>,
) -> mesa_kernels::Result<Run> {
    let (q, k, v, g) = x;
    let lq = Layout::contiguous(&[1, 1, l, m]);
    let lv = Layout::contiguous(&[1, 1, l, d]);
    let mut out = vec![0f32; l * d];
    let (mut dq, mut dk, mut dv) = (vec![0f32; l * m], vec![0f32; l * m], vec![0f32; l * d]);
    let start = Instant::now();
    let saved = forward(
        device,
        cfg,
        ForwardArgs {
            q: &TensorRef::new(q, &lq)?,
            k: &TensorRef::new(k, &lq)?,
            v: &TensorRef::new(v, &lv)?,
            out: &mut TensorMut::new(&mut out, &lv)?,
        },
    )?;
    backward(
        device,
        &saved,
        BackwardArgs {
            q: &TensorRef::new(q, &lq)?,
            k: &TensorRef::new(k, &lq)?,
            v: &TensorRef::new(v, &lv)?,
            out: Some(&TensorRef::new(&out, &lv)?),
            dout: &TensorRef::new(g, &lv)?,
            grads: Grads {
                dq: &mut TensorMut::new(&mut dq, &lq)?,
                dk: &mut TensorMut::new(&mut dk, &lq)?,
                dv: &mut TensorMut::new(&mut dv, &lv)?,
            },
        },
    )?;
    let secs = start.elapsed().as_secs_f64();
    Ok(Run { out, dq, dk, dv, state: saved.state_bytes(), den: saved.denominator_bytes(), secs })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lens: Vec<usize> = {
        let v: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
        if v.is_empty() {
            vec![16, 256, 1024, 4096, 16384]
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
    println!("causal normalised linear attention, B=H=1, M=D={m}, f32; rel-L2 error vs f64 reference");
    println!(
        "{:>6} {:>5} {:<15} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>8} {:>9} {:>8}",
        "L", "chunk", "mode", "out", "dq", "dk", "dv", "causal dq", "states B", "den B", "scratch B", "emu s"
    );
    for &l in &lens {
        let chunk = if l < 256 { 4 } else { 64 };
        let q: Vec<f32> = (0..l * m).map(|_| next(0.05, 1.0) as f32).collect();
        let k: Vec<f32> = (0..l * m).map(|_| next(0.05, 1.0) as f32).collect();
        let v: Vec<f32> = (0..l * d).map(|_| next(-1.0, 1.0) as f32).collect();
        let g: Vec<f32> = (0..l * d).map(|_| next(-1.0, 1.0) as f32).collect();
        // the last 16 rows' (a quarter's, for short sequences) keys and values x1e4 (issue 13)
        let t0 = l - (l / 4).min(16);
        let kb: Vec<f32> = k.iter().enumerate().map(|(i, &x)| if i >= t0 * m { x * 1e4 } else { x }).collect();
        let vb: Vec<f32> = v.iter().enumerate().map(|(i, &x)| if i >= t0 * d { x * 1e4 } else { x }).collect();
        let w = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
        let dims = rla::Dims { batch: 1, heads: 1, len: l, feat: m, dim: d };
        let att = |k: &[f32], v: &[f32]| -> mesa_kernels::Result<Reference> {
            let (qw, kw, vw) = (w(&q), w(k), w(v));
            let a = rla::Attention { q: &qw, k: &kw, v: &vw, dims, causal: true, normalize: Some(1e-6) };
            Ok((rla::forward(&a)?.0, rla::backward(&a, &w(&g))?))
        };
        let (ro, (rdq, rdk, rdv)) = att(&k, &v)?;
        let (_, (bdq, _, _)) = att(&kb, &vb)?;
        for memory in [MemoryMode::BoundaryStates, MemoryMode::Slim] {
            let cfg = LinearAttentionConfig { memory, chunk, ..LinearAttentionConfig::causal() };
            let r = run(&device, &cfg, l, m, d, (&q, &k, &v, &g))?;
            let big = run(&device, &cfg, l, m, d, (&q, &kb, &vb, &g))?;
            let scratch = backward_workspace_bytes(&Dims { batch: 1, heads: 1, len: l, feat: m, dim: d }, &cfg)?;
            println!(
                "{:>6} {:>5} {:<15} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>10.2e} {:>9} {:>8} {:>9} {:>8.3}",
                l,
                chunk,
                format!("{memory:?}"),
                rel_l2(&r.out, &ro),
                rel_l2(&r.dq, &rdq),
                rel_l2(&r.dk, &rdk),
                rel_l2(&r.dv, &rdv),
                early_error(&big.dq, &bdq, t0, m),
                r.state,
                r.den,
                scratch,
                r.secs
            );
        }
    }
    println!("(emulator times: host emulation, not performance)");
    Ok(())
}
