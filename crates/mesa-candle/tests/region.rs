//! Checkpoint regions (`mesa_candle::region`): the gradients of a model with regions against
//! the same model without them — bit for bit where the rerun is the same computation and every
//! variable is read in one place (the module docs' "Exactness"), within the rounding of the
//! reordered sums otherwise — dropout replayed, an unreplayable generator refused, regions
//! holding candle-nn's ops, our ops, the transformer layer and the sharded layer on two ranks.
mod common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{flat, Rng};
use mesa_candle::layer::{DropoutConfig, LayerConfig, TransformerLayer};
use mesa_candle::ops::{Dropout, LayerNorm};
use mesa_candle::parallel::{run_ranks, thread_group, Collectives, Rank};
use mesa_candle::region::{checkpoint, Checkpointed, Region};
use mesa_candle::{as_mesa_error, Error};
use mesa_kernels::{QuantConfig, StatsMode};

/// A pre-LN MLP block of candle-nn's ops with one of ours: `x + W₂ gelu(W₁ LN(x))`.
#[derive(Clone)]
struct Block {
    norm: Arc<LayerNorm>,
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
    norm_w: Tensor,
    norm_b: Tensor,
}

impl Block {
    fn new(vb: VarBuilder, c: usize, f: usize) -> Block {
        Block {
            norm: Arc::new(LayerNorm::new(1e-5, QuantConfig { stats: StatsMode::Exact, ..QuantConfig::per_tensor() })),
            fc1: candle_nn::linear(c, f, vb.pp("fc1")).unwrap(),
            fc2: candle_nn::linear(f, c, vb.pp("fc2")).unwrap(),
            norm_w: vb.get_with_hints(c, "ln.weight", candle_nn::Init::Const(1.0)).unwrap(),
            norm_b: vb.get_with_hints(c, "ln.bias", candle_nn::Init::Const(0.0)).unwrap(),
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.norm.forward(x, &self.norm_w, &self.norm_b)?;
        let h = self.fc1.forward(&h)?.gelu_erf()?;
        x + self.fc2.forward(&h)?
    }
}

/// Every gradient of `Σ model(x) ⊙ dy` (the variables in `vars`' order, then `x`'s) and the
/// loss, as host vectors.
fn run(vars: &[Var], x: &Tensor, dy: &Tensor, model: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> Vec<Vec<f64>> {
    let xv = Var::from_tensor(x).unwrap();
    let y = model(xv.as_tensor()).unwrap();
    let loss = (&y * dy).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let mut out: Vec<Vec<f64>> =
        vars.iter().map(|v| flat(g.get(v.as_tensor()).expect("every parameter has a gradient"))).collect();
    out.push(flat(g.get(xv.as_tensor()).expect("the input has a gradient")));
    out.push(flat(&loss));
    out
}

fn bits(v: &[Vec<f64>]) -> Vec<Vec<u64>> {
    v.iter().map(|g| g.iter().map(|x| x.to_bits()).collect()).collect()
}

fn stack(c: usize, f: usize, layers: usize) -> (VarMap, Vec<Block>) {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let blocks = (0..layers).map(|i| Block::new(vb.pp(format!("h{i}")), c, f)).collect();
    (map, blocks)
}

/// Three blocks, each a region: every gradient and the loss bit for bit those of the stack
/// without regions (each variable is read in one block, the rerun is the same computation).
#[test]
fn a_stack_of_regions_gives_the_same_gradients_bit_for_bit() {
    let mut rng = Rng::new("stack");
    let (c, f) = (16, 32);
    let (map, blocks) = stack(c, f, 3);
    let vars = map.all_vars();
    let x = rng.tensor(&[2, 5, c], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[2, 5, c], 0.0, 1.0, DType::F32);
    let plain = run(&vars, &x, &dy, |x| blocks.iter().try_fold(x.clone(), |h, b| b.forward(&h)));
    let wrapped: Vec<Checkpointed<Block>> = blocks.iter().cloned().map(Checkpointed::new).collect();
    let regions = run(&vars, &x, &dy, |x| wrapped.iter().try_fold(x.clone(), |h, b| b.forward(&h)));
    assert_eq!(bits(&plain), bits(&regions), "gradients with regions differ from those without");
    // nested: one region around the stack of regions
    let nested = run(&vars, &x, &dy, |x| {
        let w = wrapped.clone();
        checkpoint(x, move |x| w.iter().try_fold(x.clone(), |h, b| b.forward(&h)))
    });
    assert_eq!(bits(&plain), bits(&nested), "nested regions");
}

/// A variable read inside and outside a region (a tied weight), an extra tracked input and a
/// captured tracked tensor: every gradient reaches its variable; the tied one equals the
/// region-free one within the rounding of its reordered sum of two terms
/// (`|δ| ≤ γ₂(|g₁| + |g₂|)` per element, `γ₂ = 2u/(1 − 2u)`, f32).
#[test]
fn tied_weights_extra_inputs_and_captured_tensors_get_their_gradients() {
    let mut rng = Rng::new("tied");
    let c = 8;
    let w = Var::from_tensor(&rng.tensor(&[c, c], 0.0, 0.3, DType::F32)).unwrap();
    let bias = Var::from_tensor(&rng.tensor(&[c], 0.0, 1.0, DType::F32)).unwrap();
    let gate = rng.tensor(&[3, c], 0.0, 1.0, DType::F32);
    let x = rng.tensor(&[3, c], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[3, c], 0.0, 1.0, DType::F32);
    let gv = Var::from_tensor(&gate).unwrap();
    let vars = [w.clone(), bias.clone(), gv.clone()];
    let body = |x: &Tensor, g: &Tensor, w: &Tensor, shift: &Tensor| -> candle_core::Result<Tensor> {
        (x.matmul(w)?.tanh()? * g.tanh()?)?.broadcast_add(shift)
    };
    // outside the region, w is read once more
    let model = |inner: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>, x: &Tensor| inner(x)?.matmul(w.as_tensor());
    let shift = (bias.as_tensor() * 2.0).unwrap(); // tracked, captured by the region
    let (ws, ss, gs) = (w.as_tensor().clone(), shift.clone(), gv.as_tensor().clone());
    let plain = run(&vars, &x, &dy, |x| model(&|x| body(x, &gs, &ws, &ss), x));
    let regions = run(&vars, &x, &dy, |x| {
        model(
            &|x| {
                let (w, s) = (ws.clone(), ss.clone());
                Region::new().run(&[x, &gs], move |t| body(&t[0], &t[1], &w, &s))
            },
            x,
        )
    });
    let u = 2f64.powi(-24);
    let gamma2 = 2.0 * u / (1.0 - 2.0 * u);
    for (i, name) in ["w", "bias", "gate", "x", "loss"].iter().enumerate() {
        if *name == "w" {
            // |δ| ≤ γ₂·(|g₁| + |g₂|) ≤ γ₂·(|g| + 2|g₂|): bounded here by γ₂·4·max|g| per element
            let scale = plain[i].iter().fold(0f64, |m, v| m.max(v.abs()));
            for (a, b) in plain[i].iter().zip(&regions[i]) {
                assert!((a - b).abs() <= 4.0 * gamma2 * scale.max(1.0), "{name}: {a} vs {b}");
            }
        } else if *name != "loss" {
            assert_eq!(plain[i], regions[i], "{name}: read in one place only, so bit for bit");
        }
    }
}

/// Our transformer layer inside a region (its own dropout keyed by the region's stream):
/// bit for bit the layer without a region, when both use the same seed.
#[test]
fn the_transformer_layer_in_a_region_is_bitwise_the_layer() {
    let mut rng = Rng::new("layer");
    let config = LayerConfig {
        dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
        ..LayerConfig::new(16, 2, 32)
    };
    let layer = TransformerLayer::new(config.clone(), &Device::Cpu).unwrap();
    let vars = [layer.params().clone()];
    let x = rng.tensor(&[2, 6, 16], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[2, 6, 16], 0.0, 1.0, DType::F32);
    let plain = run(&vars, &x, &dy, |x| layer.forward_seeded(x, 11));
    let layer = Arc::new(layer);
    let regions = run(&vars, &x, &dy, |x| {
        let l = layer.clone();
        checkpoint(x, move |x| l.forward_seeded(x, 11))
    });
    assert_eq!(bits(&plain), bits(&regions));
    // the layer as a Module in a region: its seed from the region's stream, replayed
    let wrapped = Checkpointed::new(TransformerLayer::new(config, &Device::Cpu).unwrap());
    let vars = [wrapped.inner().params().clone()];
    let _ = run(&vars, &x, &dy, |x| wrapped.forward(x));
}

/// Dropout inside a region: the backward's rerun draws the forward's mask. With `y = D(x)`
/// in f64, `∂L/∂x = dy ⊙ y / x` (to the rounding of that quotient, 2 ulps), zero exactly
/// where `y` is; a second region draws another mask.
#[test]
fn dropout_in_a_region_replays_its_mask() {
    let mut rng = Rng::new("dropout");
    let x = (rng.tensor_f64(&[4, 64], 0.0, 1.0).abs().unwrap() + 0.5).unwrap();
    let dy = rng.tensor_f64(&[4, 64], 0.0, 1.0);
    let xv = Var::from_tensor(&x).unwrap();
    let drop = Dropout::new(0.5);
    let y = checkpoint(xv.as_tensor(), move |x| drop.forward(x, true)).unwrap();
    let y2 = checkpoint(xv.as_tensor(), move |x| drop.forward(x, true)).unwrap();
    let g = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = flat(g.get(xv.as_tensor()).unwrap());
    let (yv, xs, dys) = (flat(&y), flat(&x), flat(&dy));
    let kept = yv.iter().filter(|v| **v != 0.0).count();
    assert!((64..=192).contains(&kept), "{kept} of 256 kept at p = 0.5");
    for i in 0..yv.len() {
        let want = dys[i] * yv[i] / xs[i];
        assert!((dx[i] - want).abs() <= 4.0 * f64::EPSILON * want.abs(), "dx[{i}] = {} vs {want}", dx[i]);
        assert_eq!(dx[i] == 0.0, yv[i] == 0.0, "dx[{i}] zero exactly where y is");
    }
    assert_ne!(flat(&y2), yv, "two regions draw two masks");
}

/// candle-nn's dropout draws from a generator the rerun cannot replay: the backward fails
/// with `RegionReplay`, not with the gradient of another mask.
#[test]
fn a_region_with_an_unreplayable_generator_fails_its_backward() {
    let x = Var::new(&[[1f32, 2., 3., 4., 5., 6., 7., 8.]; 8], &Device::Cpu).unwrap();
    let y = checkpoint(x.as_tensor(), |x| candle_nn::ops::dropout(x, 0.5)).unwrap();
    let e = y.sum_all().unwrap().backward().expect_err("the rerun draws another mask");
    assert!(matches!(as_mesa_error(&e), Some(Error::RegionReplay { .. })), "{e}");
    // outputs whose sum does not see the mask (a checksum would pass them): rows normalised
    // after the dropout, and a 16-bit output whose 16-bit sum saturates
    let y = checkpoint(x.as_tensor(), |x| candle_nn::ops::softmax(&candle_nn::ops::dropout(x, 0.5)?, 1)).unwrap();
    let e = (y * x.as_tensor()).unwrap().sum_all().unwrap().backward().expect_err("softmax of another mask");
    assert!(matches!(as_mesa_error(&e), Some(Error::RegionReplay { .. })), "{e}");
    let h = Var::from_tensor(&Tensor::ones((64, 1024), DType::F16, &Device::Cpu).unwrap()).unwrap();
    let y = checkpoint(h.as_tensor(), |x| candle_nn::ops::dropout(x, 0.5)).unwrap();
    let e = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().expect_err("f16, another mask");
    assert!(matches!(as_mesa_error(&e), Some(Error::RegionReplay { .. })), "{e}");
    // no inputs
    let e = Region::new().run(&[], |t| Ok(t[0].clone())).expect_err("no inputs");
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { name: "inputs", .. })), "{e}");
    let e = Dropout::new(1.0).forward(x.as_tensor(), true).expect_err("p = 1");
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { .. })), "{e}");
}

/// The sharded layer on two ranks (threads), each rank's layer in a region: the rerun issues
/// the same collectives in the same order on both ranks; every gradient bit for bit that of
/// the same ranks without regions.
#[test]
fn regions_on_tensor_and_sequence_parallel_ranks() {
    let mut rng = Rng::new("ranks");
    let config = LayerConfig::new(16, 2, 32);
    let full = TransformerLayer::new(config.clone(), &Device::Cpu).unwrap().params().as_tensor().clone();
    let (b, n, c) = (2, 8, 16);
    let x = rng.tensor(&[b, n, c], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[b, n, c], 0.0, 1.0, DType::F32);
    let splits = vec![n / 2, n / 2];
    let go = |region: bool| -> Vec<Vec<f64>> {
        let ranks = thread_group(2, Duration::from_secs(60)).unwrap();
        run_ranks(ranks, |rank: Rank| {
            let o = rank.rank() * n / 2;
            let layer = Arc::new(TransformerLayer::sharded(config.clone(), &full, Arc::new(rank))?);
            let xv = Var::from_tensor(&x.narrow(1, o, n / 2)?.contiguous()?)?;
            let y = if region {
                let (l, s) = (layer.clone(), splits.clone());
                checkpoint(xv.as_tensor(), move |x| l.forward_shard(x, &s, 5))?
            } else {
                layer.forward_shard(xv.as_tensor(), &splits, 5)?
            };
            let g = (&y * dy.narrow(1, o, n / 2)?)?.sum_all()?.backward()?;
            Ok(vec![flat(&y), flat(g.get(xv.as_tensor()).unwrap()), flat(g.get(layer.params().as_tensor()).unwrap())])
        })
        .into_iter()
        .flat_map(Result::unwrap)
        .collect()
    };
    assert_eq!(bits(&go(false)), bits(&go(true)));
}

/// The planner's region mode reproduces Korthikanti et al. 2022's full-recomputation row:
/// `2sbh` bytes per layer at 16 bits (Table 2), on GPT-3 175B (`h = 12288`) and MT-NLG 530B
/// (`h = 20480`) at `s = 2048, b = 1`: 48 MiB and 80 MiB; `2sbh/t` per rank under sequence
/// parallelism (`t = 8`), `2sbh` under tensor parallelism alone (the input is replicated).
#[test]
fn the_region_planner_gives_the_papers_full_recomputation_row() {
    use mesa_candle::plan::region_plan_config;
    use mesa_kernels::plan::{ModelShape, Parallelism, Precision};
    for (h, a, layers, mib) in [(12288u64, 96u64, 96u64, 48u64), (20480, 128, 105, 80)] {
        let (s, b) = (2048u64, 1u64);
        let shape = ModelShape { layers, seq: s, micro_batch: b, hidden: h, heads: a, ffn: 4 * h };
        let none = region_plan_config(shape, Parallelism::none(), Precision::Half).plan().unwrap();
        assert_eq!(none.layer.total, 2 * s * b * h);
        assert_eq!(none.layer.total, mib << 20);
        assert_eq!(none.total, layers * 2 * s * b * h);
        let tp = region_plan_config(shape, Parallelism { tensor: 8, sequence: false }, Precision::Half);
        assert_eq!(tp.plan().unwrap().layer.total, 2 * s * b * h);
        let sp = region_plan_config(shape, Parallelism { tensor: 8, sequence: true }, Precision::Half);
        assert_eq!(sp.plan().unwrap().layer.total, 2 * s * b * h / 8);
    }
}
