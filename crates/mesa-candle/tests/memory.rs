//! Bytes alive for backward, measured with the counting allocator (its own test binary:
//! the global allocator counts every thread, so this file holds one test, and candle runs
//! single-threaded: [`common::single_threaded_candle`]).
//!
//! Targets (`docs/candle.md`): at 8 bits, bytes alive after one layer's forward ≤ 0.30× the
//! plain-candle f32 layer's, without and with selective recomputation; with selective
//! recomputation nothing kept grows with N².
mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use mesa_candle::layer::measure::measure;
use mesa_candle::layer::{reference, DropoutConfig, LayerConfig, Recompute, TransformerLayer};
use mesa_candle::CountingAllocator;

#[global_allocator]
static COUNTER: CountingAllocator = CountingAllocator::new();

fn alive(config: &LayerConfig, params: &HashMap<String, Tensor>, n: usize, plain: bool) -> usize {
    let (b, c) = (2, config.hidden);
    mesa_kernels::emulator::enable_for_tests();
    let device = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, n, c), &device).unwrap()).unwrap();
    let dy = Tensor::randn(0f32, 1.0, (b, n, c), &device).unwrap();
    let layer = TransformerLayer::from_tensors(config.clone(), params, "", &device).unwrap();
    let vars = reference::variables(layer.layout(), layer.params().as_tensor(), DType::F32).unwrap();
    let run = || {
        if plain {
            measure(&COUNTER, b * n * c * 4, &dy, || reference::forward(config, &vars, x.as_tensor(), 3)).unwrap().0
        } else {
            measure(&COUNTER, b * n * c * 4, &dy, || layer.forward_seeded(x.as_tensor(), 3)).unwrap().0
        }
    };
    let _ = run(); // warm-up
    run().alive_after_forward
}

#[test]
fn eight_bit_layer_keeps_under_thirty_percent_and_selective_nothing_quadratic() {
    common::single_threaded_candle();
    let base = LayerConfig {
        dropout: DropoutConfig { attention: 0.1, residual: 0.1, seed: 0 },
        ..LayerConfig::new(64, 4, 256)
    };
    let init = TransformerLayer::new(base.clone(), &Device::Cpu).unwrap();
    let params: HashMap<String, Tensor> = init
        .layout()
        .unflatten(init.params().as_tensor())
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let n = 64;
    let plain = alive(&base, &params, n, true);
    for recompute in [Recompute::None, Recompute::Selective] {
        let cfg = LayerConfig { recompute, ..base.clone() };
        let ours = alive(&cfg, &params, n, false);
        let ratio = ours as f64 / plain as f64;
        eprintln!("{recompute:?}: {ours} bytes vs plain {plain}: {ratio:.3}×");
        assert!(ratio <= 0.30, "{recompute:?}: {ratio:.3}× the plain layer's bytes (target ≤ 0.30)");
    }
    // doubling N at most doubles what selective recomputation keeps (every kept tensor is
    // O(N): codes, per-row statistics, the input and the output); the 2% are the per-group
    // parameters and graph bookkeeping. Without recomputation the N² softmax codes make it
    // grow faster, which this check catches (asserted too, so the check is known to bite).
    let grow = |recompute| {
        let cfg = LayerConfig { recompute, ..base.clone() };
        alive(&cfg, &params, 2 * n, false) as f64 / alive(&cfg, &params, n, false) as f64
    };
    let selective = grow(Recompute::Selective);
    let none = grow(Recompute::None);
    eprintln!("alive(2N)/alive(N): selective {selective:.3}, none {none:.3}");
    assert!(selective <= 2.02, "selective recomputation keeps something that grows faster than N: {selective:.3}");
    assert!(none > 2.02, "without recomputation the N² softmax codes should show: {none:.3}");
}
