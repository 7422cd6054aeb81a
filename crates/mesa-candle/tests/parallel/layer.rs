//! The tensor- and sequence-parallel layer (`TransformerLayer::sharded`, t ranks as threads on
//! one device) against the unsharded layer and the f64 reference: at t = 1 it is the unsharded
//! layer bit for bit; at t = 2 and 4 its forward is exact to f32 arithmetic and its gradients,
//! reassembled from the ranks' slices, meet the same per-parameter target as the unsharded
//! layer's (tests/layer.rs). Replicated gradients are identical on every rank.
use super::common;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use common::{flat, Rng};
use mesa_candle::layer::{
    reference, Attention, DropoutConfig, LayerConfig, NormPlacement, ParamLayout, Recompute, TransformerLayer,
};
use mesa_candle::ops::{FeatureKind, GatedConfig};
use mesa_candle::parallel::{run_ranks, thread_group, Collectives, Rank};
use mesa_candle::{as_mesa_error, Error, Fault};
use mesa_kernels::linear_attention::LinearAttentionConfig;

const SEED: u64 = 0x5EED;

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    dot / (norm(a) * norm(b))
}

fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Rows `o..o+len` of axis 1.
fn rows(t: &Tensor, o: usize, len: usize) -> Tensor {
    t.narrow(1, o, len).unwrap().contiguous().unwrap()
}

/// Per rank: `(y_r, dx_r, flat parameter gradient of the rank)` of `Σ y ⊙ dy` on `t` ranks.
fn sharded_run(
    config: &LayerConfig,
    full: &Tensor,
    x: &Tensor,
    dy: &Tensor,
    t: usize,
) -> Vec<(Tensor, Tensor, Tensor)> {
    let n = x.dim(1).unwrap();
    let splits = mesa_kernels::SeqSplits::even(n, t).unwrap().sizes();
    let ranks = thread_group(t, Duration::from_secs(60)).unwrap();
    run_ranks(ranks, |rank: Rank| {
        let r = rank.rank();
        let (o, len) = (splits[..r].iter().sum::<usize>(), splits[r]);
        let layer = TransformerLayer::sharded(config.clone(), full, Arc::new(rank))?;
        let xv = Var::from_tensor(&rows(x, o, len))?;
        let y = layer.forward_shard(xv.as_tensor(), &splits, SEED)?;
        let g = (&y * rows(dy, o, len))?.sum_all()?.backward()?;
        let dx = g.get(xv.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no dx".into()))?;
        let dp =
            g.get(layer.params().as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no dparams".into()))?;
        Ok((y, dx, dp))
    })
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// The whole layer's gradient from the ranks' slices: sharded entries concatenated along
/// their split axis, replicated ones checked identical on every rank (bit for bit).
fn unshard(config: &LayerConfig, per_rank: &[Tensor]) -> Vec<(&'static str, Tensor)> {
    let t = per_rank.len();
    let local = ParamLayout::sharded_of(config, t).unwrap();
    let whole = ParamLayout::of(config).unwrap();
    let parts: Vec<Vec<(&'static str, Tensor)>> = per_rank.iter().map(|g| local.unflatten(g).unwrap()).collect();
    whole
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let pieces: Vec<Tensor> = parts.iter().map(|p| p[i].1.clone()).collect();
            let l = &local.entries()[i].shape;
            let g = if l == &e.shape {
                for (r, p) in pieces.iter().enumerate() {
                    assert_eq!(flat(p), flat(&pieces[0]), "{}: replicated gradient differs on rank {r}", e.name);
                }
                pieces[0].clone()
            } else if l[0] != e.shape[0] && l[0] * t > e.shape[0] {
                // a Llama block's K or V with t > H_kv: each KV head on t/H_kv ranks, its
                // gradient summed over them (bit for bit the same on each)
                let group = l[0] * t / e.shape[0];
                for (r, p) in pieces.iter().enumerate() {
                    let first = &pieces[r / group * group];
                    assert_eq!(flat(p), flat(first), "{}: replicated KV gradient differs on rank {r}", e.name);
                }
                Tensor::cat(&pieces.iter().step_by(group).cloned().collect::<Vec<_>>(), 0).unwrap()
            } else {
                let axis = usize::from(l[0] == e.shape[0]);
                Tensor::cat(&pieces, axis).unwrap()
            };
            (e.name, g)
        })
        .collect()
}

fn inputs(what: &str, c: usize) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(what);
    let (b, n) = (2, 24);
    let x = rng.tensor(&[b, n, c], 0.0, 1.0, DType::F32);
    let dy = rng.tensor(&[b, n, c], 0.0, 1.0, DType::F32);
    (x, dy, rng.tensor(&[1], 0.0, 1.0, DType::F32))
}

/// The same parameters for every run: the unsharded layer's initialisation.
fn full_params(config: &LayerConfig) -> Tensor {
    TransformerLayer::new(config.clone(), &Device::Cpu).unwrap().params().as_tensor().clone()
}

/// t = 1 through the group (an all-gather and a reduce-scatter of one rank) is the unsharded
/// layer bit for bit: the same products, `(partial + bias) + residual` in the same order.
#[test]
fn one_rank_is_the_unsharded_layer_bitwise() {
    for (norm_at, recompute) in [(NormPlacement::Pre, Recompute::None), (NormPlacement::Post, Recompute::Selective)] {
        let config = LayerConfig {
            norm: norm_at,
            recompute,
            dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
            ..LayerConfig::new(32, 4, 128)
        };
        let (x, dy, _) = inputs("one rank", 32);
        let full = full_params(&config);
        let layer = TransformerLayer::from_tensors(
            config.clone(),
            &ParamLayout::new(32, 128).unflatten(&full).unwrap().into_iter().map(|(n, t)| (n.to_string(), t)).collect(),
            "",
            &Device::Cpu,
        )
        .unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let y = layer.forward_seeded(xv.as_tensor(), SEED).unwrap();
        let g = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let got = sharded_run(&config, &full, &x, &dy, 1);
        let (ys, dxs, dps) = &got[0];
        assert_eq!(flat(ys), flat(&y), "{norm_at:?} {recompute:?}: forward");
        assert_eq!(flat(dxs), flat(g.get(xv.as_tensor()).unwrap()), "{norm_at:?}: dx");
        assert_eq!(flat(dps), flat(g.get(layer.params().as_tensor()).unwrap()), "{norm_at:?}: dparams");
    }
}

/// t ranks against the f64 reference on the whole sequence: forward within the unsharded
/// layer's bound (`1e-4·max|y|`: ≤ 12 chained f32 ops over sums of ≤ 128 terms; the
/// reduce-scatter adds t partial sums, t ≤ 4, in f32), every gradient at cosine ≥ 0.999 (the
/// 8-bit target of tests/layer.rs; the LayerNorm codes now take their ranges over the rank's
/// rows only).
fn check(config: &LayerConfig, what: &str) {
    let (x, dy, _) = inputs(what, config.hidden);
    let full = full_params(config);
    let vars = reference::variables(&ParamLayout::of(config).unwrap(), &full, DType::F64).unwrap();
    let x64 = Var::from_tensor(&x.to_dtype(DType::F64).unwrap()).unwrap();
    let y_ref = reference::forward(config, &vars, x64.as_tensor(), SEED).unwrap();
    let g_ref = (&y_ref * dy.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let top = flat(&y_ref).iter().fold(0.0f64, |a, v| a.max(v.abs()));
    for t in [2, 4] {
        let got = sharded_run(config, &full, &x, &dy, t);
        let y = Tensor::cat(&got.iter().map(|g| g.0.clone()).collect::<Vec<_>>(), 1).unwrap();
        let err = flat(&y).iter().zip(flat(&y_ref)).fold(0.0f64, |a, (p, q)| a.max((p - q).abs()));
        assert!(err <= 1e-4 * top, "{what} t={t}: forward max error {err:.3e} > 1e-4·{top:.3e}");
        let dx = Tensor::cat(&got.iter().map(|g| g.1.clone()).collect::<Vec<_>>(), 1).unwrap();
        let mut grads = vec![("x", flat(&dx), flat(g_ref.get(x64.as_tensor()).unwrap()))];
        for (name, g) in unshard(config, &got.iter().map(|g| g.2.clone()).collect::<Vec<_>>()) {
            grads.push((name, flat(&g), flat(g_ref.get(vars[name].as_tensor()).unwrap())));
        }
        let largest = grads.iter().map(|(_, _, w)| norm(w)).fold(0.0, f64::max);
        let mut failures = 0;
        for (name, ours, want) in &grads {
            if norm(want) <= 1e-9 * largest {
                continue; // a true gradient of zero (the key bias of softmax attention)
            }
            let cos = cosine(ours, want);
            eprintln!("{what} t={t} {name}: cosine {cos:.6}");
            failures += usize::from(cos < 0.999);
        }
        assert_eq!(failures, 0, "{what} t={t}: {failures} parameters with cosine < 0.999 (listed above)");
    }
}

fn config(norm_at: NormPlacement, recompute: Recompute) -> LayerConfig {
    LayerConfig {
        norm: norm_at,
        recompute,
        dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
        ..LayerConfig::new(32, 4, 128)
    }
}

#[test]
fn sharded_softmax_layer_matches_the_reference_at_two_and_four_ranks() {
    for (norm_at, recompute) in [
        (NormPlacement::Pre, Recompute::None),
        (NormPlacement::Pre, Recompute::Selective),
        (NormPlacement::Pre, Recompute::Full),
        (NormPlacement::Post, Recompute::Selective),
    ] {
        check(&config(norm_at, recompute), &format!("{norm_at:?} {recompute:?}"));
    }
}

#[test]
fn sharded_linear_attention_layer_matches_the_reference_at_two_and_four_ranks() {
    let la = LinearAttentionConfig { chunk: 16, ..LinearAttentionConfig::causal() };
    let cfg = LayerConfig {
        attention: Attention::Linear { config: la, map: FeatureKind::Elu1 },
        dropout: DropoutConfig { attention: 0.0, residual: 0.1, seed: 0 },
        ..config(NormPlacement::Pre, Recompute::None)
    };
    check(&cfg, "linear attention");
}

/// Gated attention with fixed decays split over 2 and 4 ranks: each rank runs its query heads
/// with its KV heads' decays — GPT (RetNet's four decays, one per head, and given ones with a
/// head of no memory) and Llama (KV heads split, 4 of them; replicated, 2 and 1 at t = 4).
/// Giving every rank the first KV heads' decays on purpose fails it.
#[test]
fn sharded_gated_layer_matches_the_reference_at_two_and_four_ranks() {
    let no_attention_dropout = DropoutConfig { attention: 0.0, residual: 0.1, seed: 0 };
    let given = Attention::Gated {
        config: GatedConfig { chunk: 8, ..GatedConfig::default() },
        log_decay: vec![-0.05, -0.7, f32::NEG_INFINITY, -0.01],
    };
    for (attention, recompute, what) in
        [(Attention::retnet(4), Recompute::None, "gpt retnet"), (given, Recompute::Full, "gpt given decays")]
    {
        let cfg = LayerConfig { attention, dropout: no_attention_dropout, ..config(NormPlacement::Pre, recompute) };
        check(&cfg, what);
    }
    for kv in [4, 2, 1] {
        let cfg = LayerConfig {
            attention: Attention::retnet(kv),
            dropout: no_attention_dropout,
            ..LayerConfig::llama(64, 8, kv, 128)
        };
        check(&cfg, &format!("llama retnet H_kv {kv}"));
    }
}

/// The Llama block split over 2 and 4 ranks: K/V heads split (8 query heads, 4 KV heads at
/// t = 2 and 4) and replicated (2 KV heads at t = 4: each on two ranks, gradients summed), with
/// every recomputation; against the f64 reference on the whole sequence as above.
#[test]
fn sharded_llama_block_matches_the_reference_at_two_and_four_ranks() {
    let llama = |kv, recompute| LayerConfig {
        recompute,
        dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
        ..LayerConfig::llama(64, 8, kv, 128)
    };
    for (kv, recompute) in [(4, Recompute::None), (2, Recompute::Selective), (1, Recompute::Full)] {
        check(&llama(kv, recompute), &format!("llama H_kv {kv} {recompute:?}"));
    }
}

/// t = 1 through the group is the unsharded Llama block bit for bit.
#[test]
fn one_rank_is_the_unsharded_llama_block_bitwise() {
    let config = LayerConfig {
        dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
        ..LayerConfig::llama(32, 4, 2, 64)
    };
    let (x, dy, _) = inputs("one rank llama", 32);
    let full = full_params(&config);
    let named = ParamLayout::of(&config).unwrap().unflatten(&full).unwrap();
    let map = named.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
    let layer = TransformerLayer::from_tensors(config.clone(), &map, "", &Device::Cpu).unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let y = layer.forward_seeded(xv.as_tensor(), SEED).unwrap();
    let g = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let got = sharded_run(&config, &full, &x, &dy, 1);
    assert_eq!(flat(&got[0].0), flat(&y), "forward");
    assert_eq!(flat(&got[0].1), flat(g.get(xv.as_tensor()).unwrap()), "dx");
    assert_eq!(flat(&got[0].2), flat(g.get(layer.params().as_tensor()).unwrap()), "dparams");
}

/// A rank whose input has the wrong number of rows fails, and its peers learn it at once.
#[test]
fn a_rank_with_the_wrong_rows_fails_every_rank() {
    let config = config(NormPlacement::Pre, Recompute::None);
    let full = full_params(&config);
    let ranks = thread_group(2, Duration::from_secs(30)).unwrap();
    let t0 = std::time::Instant::now();
    let out = run_ranks(ranks, |rank: Rank| {
        let r = rank.rank();
        let layer = TransformerLayer::sharded(config.clone(), &full, Arc::new(rank))?;
        let len = if r == 1 { 5 } else { 4 };
        let x = Tensor::zeros((1, len, 32), DType::F32, &Device::Cpu)?;
        layer.forward_shard(&x, &[4, 4], SEED).map(|_| ())
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(matches!(as_mesa_error(out[1].as_ref().unwrap_err()), Some(Error::Shape { .. })));
    assert!(matches!(
        as_mesa_error(out[0].as_ref().unwrap_err()),
        Some(Error::Collective { fault: Fault::PeerFailed { rank: 1 }, .. })
    ));
    // 16-bit parameters on ranks are refused when the layer is made (its forward is f32 only)
    let bf16 = LayerConfig { param_dtype: DType::BF16, ..config.clone() };
    let ranks = thread_group(2, Duration::from_secs(30)).unwrap();
    let e = TransformerLayer::sharded(bf16, &full, Arc::new(ranks[0].clone())).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::UnsupportedDType { .. })), "{e}");
    // and a t that does not divide the heads is refused before any collective
    let ranks = thread_group(3, Duration::from_secs(30)).unwrap();
    let e = TransformerLayer::sharded(config.clone(), &full, Arc::new(ranks[0].clone())).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { name: "tensor", .. })), "{e}");
}

/// The plain-candle layer on t ranks (`reference::forward_sharded`, f32, candle's autograd
/// through `SeqParallel`'s conjugate operators) against the unsharded f64 reference: no codes,
/// so every gradient agrees to f32 arithmetic — normwise relative error ≤ 1e-4 (≤ 12 chained
/// ops over sums of ≤ 128 terms, γ_128 ≈ 7.6e-6 each), forward as in `check`.
#[test]
fn sharded_reference_layer_matches_the_unsharded_one() {
    for (attention, norm_at) in [
        (Attention::Softmax { causal: true }, NormPlacement::Pre),
        (Attention::Softmax { causal: true }, NormPlacement::Post),
        // each rank its heads' decays (distinct per head, so a wrong slice shows)
        (Attention::retnet(4), NormPlacement::Pre),
        (
            Attention::Linear {
                config: LinearAttentionConfig { chunk: 16, ..LinearAttentionConfig::causal() },
                map: FeatureKind::Elu1,
            },
            NormPlacement::Pre,
        ),
    ] {
        let dropout = match attention {
            Attention::Softmax { .. } => DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
            Attention::Linear { .. } | Attention::Gated { .. } | Attention::InputGated { .. } => {
                DropoutConfig { attention: 0.0, residual: 0.1, seed: 0 }
            }
        };
        let config = LayerConfig { attention, norm: norm_at, dropout, ..LayerConfig::new(32, 4, 128) };
        let what = format!("reference {norm_at:?} {:?}", config.attention);
        let (x, dy, _) = inputs(&what, 32);
        let full = full_params(&config);
        let whole = ParamLayout::new(32, 128);
        let vars = reference::variables(&whole, &full, DType::F64).unwrap();
        let x64 = Var::from_tensor(&x.to_dtype(DType::F64).unwrap()).unwrap();
        let y_ref = reference::forward(&config, &vars, x64.as_tensor(), SEED).unwrap();
        let g_ref = (&y_ref * dy.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let top = flat(&y_ref).iter().fold(0.0f64, |a, v| a.max(v.abs()));
        for t in [1, 2, 4] {
            let n = x.dim(1).unwrap();
            let splits = mesa_kernels::SeqSplits::even(n, t).unwrap().sizes();
            let ranks = thread_group(t, Duration::from_secs(60)).unwrap();
            let got: Vec<(Tensor, Tensor, Tensor)> = run_ranks(ranks, |rank: Rank| {
                let r = rank.rank();
                let (o, len) = (splits[..r].iter().sum::<usize>(), splits[r]);
                let sp = mesa_candle::parallel::SeqParallel::with_splits(Arc::new(rank), splits.clone());
                let local = ParamLayout::sharded(32, 128, t)?;
                let flat_local = Var::from_tensor(&whole.shard(&full, r, t)?)?;
                let pv = reference::variables(&local, flat_local.as_tensor(), DType::F32)?;
                let xv = Var::from_tensor(&rows(&x, o, len))?;
                let y = reference::forward_sharded(&config, &pv, xv.as_tensor(), SEED, &sp)?;
                let g = (&y * rows(&dy, o, len))?.sum_all()?.backward()?;
                let dparams = local
                    .entries()
                    .iter()
                    .map(|e| {
                        g.get(pv[e.name].as_tensor())
                            .map(|t| t.flatten_all())
                            .unwrap_or_else(|| Tensor::zeros(e.numel(), DType::F32, &Device::Cpu))
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok((y, g.get(xv.as_tensor()).cloned().unwrap(), Tensor::cat(&dparams, 0)?))
            })
            .into_iter()
            .map(Result::unwrap)
            .collect();
            let y = Tensor::cat(&got.iter().map(|g| g.0.clone()).collect::<Vec<_>>(), 1).unwrap();
            let err = flat(&y).iter().zip(flat(&y_ref)).fold(0.0f64, |a, (p, q)| a.max((p - q).abs()));
            assert!(err <= 1e-4 * top, "{what} t={t}: forward max error {err:.3e}");
            let dx = Tensor::cat(&got.iter().map(|g| g.1.clone()).collect::<Vec<_>>(), 1).unwrap();
            let mut grads = vec![("x", flat(&dx), flat(g_ref.get(x64.as_tensor()).unwrap()))];
            for (name, g) in unshard(&config, &got.iter().map(|g| g.2.clone()).collect::<Vec<_>>()) {
                grads.push((name, flat(&g), flat(g_ref.get(vars[name].as_tensor()).unwrap())));
            }
            let largest = grads.iter().map(|(_, _, w)| norm(w)).fold(0.0, f64::max);
            for (name, ours, want) in &grads {
                let diff = ours.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
                // relative to the gradient; a true zero (k_proj.bias: softmax ignores a shift of
                // a row of scores) is f32 rounding noise of cancelling sums, bounded by the f32
                // unit roundoff of the largest gradient (it was 1e-10·largest, which noise of
                // 1.3e-10·largest broke in about 1 run in 30: the weights are unseeded)
                let u32 = 2f64.powi(-24);
                if norm(want) < u32 * largest {
                    assert!(diff <= u32 * largest, "{what} t={t} {name}: {diff:.2e} above f32 noise of {largest:.2e}");
                } else {
                    let rel = diff / norm(want);
                    assert!(rel <= 1e-4, "{what} t={t} {name}: relative error {rel:.2e}");
                }
            }
        }
    }
}

/// Without `run_ranks` too: a rank whose own input is bad (here f16) tells its peers, which
/// return `PeerFailed` at once instead of waiting out the group's timeout.
#[test]
fn a_rank_with_a_bad_input_tells_its_peers_itself() {
    let config = config(NormPlacement::Pre, Recompute::None);
    let full = full_params(&config);
    let ranks = thread_group(2, Duration::from_secs(30)).unwrap();
    let t0 = std::time::Instant::now();
    let out: Vec<candle_core::Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let (config, full) = (config.clone(), full.clone());
                scope.spawn(move || {
                    let r = rank.rank();
                    let layer = TransformerLayer::sharded(config, &full, Arc::new(rank))?;
                    let dtype = if r == 1 { DType::F16 } else { DType::F32 };
                    let x = Tensor::zeros((1, 4, 32), dtype, &Device::Cpu)?;
                    layer.forward_shard(&x, &[4, 4], SEED).map(|_| ())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert!(matches!(as_mesa_error(out[1].as_ref().unwrap_err()), Some(Error::UnsupportedDType { .. })));
    assert!(matches!(
        as_mesa_error(out[0].as_ref().unwrap_err()),
        Some(Error::Collective { fault: Fault::PeerFailed { rank: 1 }, .. })
    ));
}

/// Input-gated attention is not done for a sharded layer: refused when it is made.
#[test]
fn a_sharded_layer_refuses_input_gated_attention() {
    let config = LayerConfig { attention: Attention::input_gated(), ..LayerConfig::new(32, 4, 128) };
    let full = full_params(&config);
    let comm: Arc<dyn Collectives> = Arc::new(thread_group(1, Duration::from_secs(5)).unwrap().remove(0));
    let e = TransformerLayer::sharded(config, &full, comm).unwrap_err();
    assert!(matches!(as_mesa_error(&e), Some(Error::InvalidArgument { name: "attention", .. })), "{e}");
}
