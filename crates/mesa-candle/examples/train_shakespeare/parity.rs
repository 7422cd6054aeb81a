//! Gradient parity along the f32 trajectory: every `k` steps of run a (first seed), the
//! layer stack's parameter gradients through mesa-candle's layer — 8, 4 and 2-bit codes,
//! with and without selective recomputation, exact statistics — against the f32 gradients of
//! the same weights, batch and output gradient.
use std::collections::HashMap;

use candle_core::{backprop::GradStore, Tensor, Var};
use mesa_candle::layer::{LayerConfig, Recompute, TransformerLayer};
use mesa_kernels::StatsMode;

use crate::run::recompute_name;

/// The probed configurations: (bits, recomputation).
pub const PROBES: [(u32, Recompute); 6] = [
    (8, Recompute::None),
    (8, Recompute::Selective),
    (4, Recompute::None),
    (4, Recompute::Selective),
    (2, Recompute::None),
    (2, Recompute::Selective),
];

/// Parameters left out of the worst case: the key bias's exact gradient is zero (softmax is
/// invariant to a shift of each row's scores, and `q·b_k` shifts a row by a constant), so its
/// cosine and relative error measure rounding only.
pub const ZERO_GRADIENT: [&str; 1] = ["attn.k_proj.bias"];

/// One parameter's agreement at one probe.
#[derive(Debug, Clone, Copy)]
pub struct Agreement {
    /// `⟨g, ĝ⟩ / (‖g‖ ‖ĝ‖)` (f64).
    pub cosine: f64,
    /// `‖ĝ − g‖ / ‖g‖` (f64).
    pub rel_err: f64,
}

/// One probed configuration over the run.
#[derive(Debug, Clone)]
pub struct Series {
    pub bits: u32,
    pub recompute: Recompute,
    /// `layer<i>.<name>` → one [`Agreement`] per probe, in the order of [`Parity::steps`].
    pub params: Vec<(String, Vec<Agreement>)>,
}

impl Series {
    pub fn label(&self) -> String {
        format!("{}-bit, recompute {}", self.bits, recompute_name(self.recompute))
    }

    /// The worst parameter at probe `i` (lowest cosine, highest relative error), the
    /// zero-gradient parameters left out.
    pub fn worst(&self, i: usize) -> Agreement {
        let kept = self.params.iter().filter(|(n, _)| !ZERO_GRADIENT.iter().any(|z| n.ends_with(z)));
        kept.fold(Agreement { cosine: f64::INFINITY, rel_err: 0.0 }, |w, (_, a)| Agreement {
            cosine: w.cosine.min(a[i].cosine),
            rel_err: w.rel_err.max(a[i].rel_err),
        })
    }
}

/// Every probe of a run.
#[derive(Debug, Clone)]
pub struct Parity {
    pub run: String,
    pub every: usize,
    /// The step of each probe (before its update, 0-based).
    pub steps: Vec<usize>,
    pub series: Vec<Series>,
}

fn agreement(reference: &Tensor, ours: &Tensor) -> candle_core::Result<Agreement> {
    let g = reference.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
    let h = ours.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
    let (mut gh, mut gg, mut hh, mut dd) = (0.0, 0.0, 0.0, 0.0);
    for (a, b) in g.iter().zip(&h) {
        gh += a * b;
        gg += a * a;
        hh += b * b;
        dd += (b - a) * (b - a);
    }
    let norm = gg.sqrt();
    Ok(Agreement {
        cosine: if norm > 0.0 && hh > 0.0 { gh / (norm * hh.sqrt()) } else { f64::NAN },
        rel_err: if norm > 0.0 { dd.sqrt() / norm } else { f64::NAN },
    })
}

impl Parity {
    pub fn new(run: &str, every: usize) -> Self {
        let series = PROBES.iter().map(|&(bits, recompute)| Series { bits, recompute, params: Vec::new() }).collect();
        Parity { run: run.to_string(), every, steps: Vec::new(), series }
    }

    /// Probes every configuration at one step: `layers` are the f32 run's variables,
    /// `input` the stack's input, `dy` the loss gradient at the stack's output and `grads`
    /// the f32 gradients of this step.
    pub fn probe(
        &mut self,
        step: usize,
        base: &LayerConfig,
        layers: &[HashMap<&'static str, Var>],
        input: &Tensor,
        dy: &Tensor,
        grads: &GradStore,
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.steps.push(step);
        let device = input.device();
        for series in &mut self.series {
            let config = LayerConfig {
                bits: series.bits,
                recompute: series.recompute,
                stats: StatsMode::Exact,
                stochastic_rounding: false,
                ..base.clone()
            };
            let mut ours = Vec::with_capacity(layers.len());
            for l in layers {
                let tensors: HashMap<String, Tensor> =
                    l.iter().map(|(n, v)| (n.to_string(), v.as_tensor().detach())).collect();
                ours.push(TransformerLayer::from_tensors(config.clone(), &tensors, "", device)?);
            }
            let mut h = input.clone();
            for (i, l) in ours.iter().enumerate() {
                h = l.forward_seeded(&h, i as u64)?;
            }
            let got = (&h * dy)?.sum_all()?.backward()?;
            let mut k = 0;
            for (i, (l, plain)) in ours.iter().zip(layers).enumerate() {
                let flat = got.get(l.params().as_tensor()).ok_or("no gradient for a probed layer")?;
                for e in l.layout().entries() {
                    let ours = flat.narrow(0, e.offset, e.numel())?;
                    let reference = grads.get(plain[e.name].as_tensor()).ok_or("no f32 gradient for a parameter")?;
                    let a = agreement(reference, &ours)?;
                    if series.params.len() <= k {
                        series.params.push((format!("layer{i}.{}", e.name), Vec::new()));
                    }
                    series.params[k].1.push(a);
                    k += 1;
                }
            }
        }
        Ok(())
    }
}
