//! The activation-memory planner (`mesa_kernels::plan`) against Korthikanti et al. 2022,
//! *Reducing Activation Recomputation in Large Transformer Models*, Table 2 (bytes per layer
//! and rank, 16-bit activations, 1-byte dropout masks): one test per row, each on the
//! paper's GPT-3 175B and MT-NLG 530B shapes (Table 3: t = 8, s = 2048, b = 1) and on a
//! small shape with other t and b. The expected values are the paper's formulas evaluated
//! in exact integer arithmetic (u128, every division exact), written here independently of
//! the planner's itemisation; tolerance 0 (the byte counts are integers).
use mesa_kernels::plan::{
    largest_fit, largest_micro_batch, largest_sequence, AttentionKind, CodeFormat, LinearStates, MaskStorage,
    ModelShape, Parallelism, PlanConfig, Precision, Recompute, SavedPrecision, SavedTensor,
};
use mesa_kernels::Error;

/// (name, shape, t): the paper's Table 3 rows for GPT-3 and MT-NLG, and a small shape.
fn shapes() -> Vec<(&'static str, ModelShape, u64)> {
    let gpt3 = ModelShape { layers: 96, seq: 2048, micro_batch: 1, hidden: 12288, heads: 96, ffn: 4 * 12288 };
    let mtnlg = ModelShape { layers: 105, seq: 2048, micro_batch: 1, hidden: 20480, heads: 128, ffn: 4 * 20480 };
    let small = ModelShape { layers: 3, seq: 96, micro_batch: 3, hidden: 48, heads: 6, ffn: 4 * 48 };
    vec![("GPT-3 175B", gpt3, 8), ("MT-NLG 530B", mtnlg, 8), ("small", small, 2), ("small t=3", small, 3)]
}

fn sbh(s: &ModelShape) -> u128 {
    u128::from(s.seq) * u128::from(s.micro_batch) * u128::from(s.hidden)
}

/// `5as²b`: `sbh · 5as/h` without the division.
fn attn(s: &ModelShape) -> u128 {
    5 * u128::from(s.heads) * u128::from(s.seq) * u128::from(s.seq) * u128::from(s.micro_batch)
}

fn planned(shape: ModelShape, t: u64, sequence: bool, recompute: Recompute) -> (u64, u64) {
    let cfg = PlanConfig::megatron(shape, Parallelism { tensor: t, sequence }, recompute);
    let plan = cfg.plan().unwrap();
    (plan.layer.total, plan.total)
}

fn check_row(row: &str, sequence: bool, recompute: Recompute, t_used: bool, want: impl Fn(&ModelShape, u128) -> u128) {
    for (name, shape, t) in shapes() {
        let t = if t_used { t } else { 1 };
        let expected = want(&shape, u128::from(t));
        let (layer, total) = planned(shape, t, sequence, recompute);
        eprintln!("{row}, {name} (t = {t}): {layer} bytes per layer (paper: {expected})");
        assert_eq!(u128::from(layer), expected, "{row}, {name}");
        assert_eq!(u128::from(total), expected * u128::from(shape.layers), "{row}, {name}: L layers");
    }
}

#[test]
fn table2_no_parallelism() {
    // sbh(34 + 5as/h)
    check_row("no parallelism", false, Recompute::None, false, |s, _| 34 * sbh(s) + attn(s));
}

#[test]
fn table2_tensor_parallel() {
    // sbh(10 + 24/t + 5as/(ht))
    check_row("tensor parallel", false, Recompute::None, true, |s, t| 10 * sbh(s) + 24 * sbh(s) / t + attn(s) / t);
}

#[test]
fn table2_tensor_and_sequence_parallel() {
    // sbh(34/t + 5as/(ht))
    check_row("tensor + sequence parallel", true, Recompute::None, true, |s, t| 34 * sbh(s) / t + attn(s) / t);
}

#[test]
fn table2_tensor_parallel_selective_recompute() {
    // sbh(10 + 24/t)
    check_row("tensor parallel + selective", false, Recompute::Selective, true, |s, t| 10 * sbh(s) + 24 * sbh(s) / t);
}

#[test]
fn table2_tensor_sequence_parallel_selective_recompute() {
    // sbh(34/t)
    check_row("tensor + sequence parallel + selective", true, Recompute::Selective, true, |s, t| 34 * sbh(s) / t);
}

#[test]
fn table2_full_recompute() {
    // 2sbh: the layer input; the paper's row is independent of t (tensor parallelism
    // replicates the input), so it is checked with and without tensor parallelism
    check_row("full recompute", false, Recompute::Full, false, |s, _| 2 * sbh(s));
    check_row("full recompute, tensor parallel", false, Recompute::Full, true, |s, _| 2 * sbh(s));
}

#[test]
fn paper_ratios_and_block_split() {
    // §4.1: attention block 11sbh + 5as²b, MLP block 19sbh, the two norms' inputs 4sbh; §5: 5as/h = 80 for GPT-3 and
    // 64 for MT-NLG (so the s² terms are more than half of the total)
    for (name, shape, _) in shapes() {
        let cfg = PlanConfig::megatron(shape, Parallelism::none(), Recompute::None);
        let layer = cfg.layer_bytes().unwrap();
        use SavedTensor::*;
        let sum = |set: &[SavedTensor]| -> u128 {
            layer.items.iter().filter(|i| set.contains(&i.tensor)).map(|i| u128::from(i.bytes)).sum()
        };
        let attention = sum(&[
            QkvInput,
            Q,
            K,
            Softmax,
            SoftmaxDropoutMask,
            SoftmaxDropoutOutput,
            V,
            OutProjInput,
            AttentionResidualMask,
        ]);
        let mlp = sum(&[Fc1Input, GeluInput, Fc2Input, FfnResidualMask]);
        let norms = sum(&[Norm1, Norm2]);
        assert_eq!(attention, 11 * sbh(&shape) + attn(&shape), "{name}: attention block");
        assert_eq!(mlp, 19 * sbh(&shape), "{name}: MLP block");
        assert_eq!(norms, 4 * sbh(&shape), "{name}: norms");
        assert_eq!(attention + mlp + norms, u128::from(layer.total), "{name}: every item is in one block");
    }
    let [(_, gpt3, _), (_, mtnlg, _), ..] = shapes()[..] else { unreachable!() };
    assert_eq!(5 * gpt3.heads * gpt3.seq / gpt3.hidden, 80);
    assert_eq!(5 * mtnlg.heads * mtnlg.seq / mtnlg.hidden, 64);
}

fn ours(shape: ModelShape, bits: u32) -> PlanConfig {
    let codes = Precision::Codes(CodeFormat::per_head(bits));
    PlanConfig {
        block: mesa_kernels::plan::BlockKind::Gpt,
        shape,
        parallel: Parallelism::none(),
        dropout: mesa_kernels::plan::Dropout { attention: 0.1, residual: 0.1, masks: MaskStorage::Regenerated },
        recompute: Recompute::None,
        saved: SavedPrecision {
            norm_row_bytes: 8,
            shared_inputs: true,
            layer_input: Some(Precision::F32),
            ..SavedPrecision::uniform(codes)
        },
        attention: AttentionKind::Softmax,
    }
}

#[test]
fn codes_cost_bits_per_element_plus_statistics() {
    // one [s, b, h] tensor of 8/4/2-bit codes with a groups: ⌈sbh·bits/8⌉ + 8a + 4 bytes
    let shape = ModelShape { layers: 1, seq: 5, micro_batch: 3, hidden: 12, heads: 4, ffn: 20 };
    for bits in [8u32, 4, 2] {
        let layer = ours(shape, bits).layer_bytes().unwrap();
        let norm = layer.items.iter().find(|i| i.tensor == SavedTensor::Norm1).unwrap();
        assert_eq!(norm.bytes, (180 * u64::from(bits)).div_ceil(8) + 8 * 4 + 4, "{bits} bits");
        // the odd GeLU tensor: 300 elements; at 2 bits 75 bytes exactly
        let gelu = layer.items.iter().find(|i| i.tensor == SavedTensor::GeluInput).unwrap();
        assert_eq!(gelu.bytes, (300 * u64::from(bits)).div_ceil(8) + 36);
        // no stored masks, no stored FC inputs, the layer input in f32, the row statistics
        for absent in [SavedTensor::SoftmaxDropoutMask, SavedTensor::QkvInput, SavedTensor::Fc2Input] {
            assert!(layer.items.iter().all(|i| i.tensor != absent), "{absent:?} is not kept");
        }
        assert_eq!(layer.items[0].tensor, SavedTensor::LayerInput);
        assert_eq!(layer.items[0].bytes, 180 * 4);
        assert!(layer.items.iter().any(|i| i.tensor == SavedTensor::Norm2Rows && i.bytes == 15 * 8));
    }
}

#[test]
fn linear_attention_states_per_memory_mode() {
    // b·a·M·W f32 final state, ⌈s/C⌉ more in boundary mode, b·a·s denominators: the sizes of
    // mesa_kernels::linear_attention::saved_bytes for the same call
    use mesa_kernels::linear_attention::{saved_bytes, Dims, LinearAttentionConfig, MemoryMode};
    let shape = ModelShape { layers: 1, seq: 100, micro_batch: 2, hidden: 32, heads: 4, ffn: 64 };
    for (states, memory) in
        [(LinearStates::Boundary, MemoryMode::BoundaryStates), (LinearStates::Slim, MemoryMode::Slim)]
    {
        let mut cfg = ours(shape, 8);
        cfg.dropout.attention = 0.0;
        cfg.attention = AttentionKind::Linear { causal: true, chunk: 16, features: 8, normalize: true, states };
        let layer = cfg.layer_bytes().unwrap();
        let got = layer.items.iter().find(|i| i.tensor == SavedTensor::LinearStates).unwrap().bytes;
        let dims = Dims { batch: 2, heads: 4, len: 100, feat: 8, dim: 8 };
        let la = LinearAttentionConfig { chunk: 16, memory, ..LinearAttentionConfig::causal() };
        assert_eq!(got as usize, saved_bytes(&dims, &la).unwrap(), "{states:?}");
        assert!(layer.items.iter().all(|i| i.tensor != SavedTensor::Softmax));
    }
}

#[test]
fn largest_fit_matches_a_brute_force_search() {
    let base = ModelShape { layers: 2, seq: 24, micro_batch: 1, hidden: 16, heads: 4, ffn: 64 };
    let configs = [
        PlanConfig::megatron(base, Parallelism::none(), Recompute::None),
        PlanConfig::megatron(base, Parallelism { tensor: 2, sequence: true }, Recompute::Selective),
        ours(base, 4),
    ];
    for cfg in configs {
        for budget in (0..200_000u64).step_by(7919) {
            let brute_b = (1..=2000u64).take_while(|&b| {
                let mut c = cfg;
                c.shape.micro_batch = b;
                c.total_bytes().unwrap() <= budget
            });
            let want_b = brute_b.last();
            assert_eq!(largest_micro_batch(&cfg, budget).unwrap(), want_b, "{cfg:?} budget {budget}");
            // sequence: every valid length (a multiple of t under sequence parallelism)
            let step = if cfg.parallel.sequence { cfg.parallel.tensor } else { 1 };
            let want_s = (1..=400u64)
                .map(|k| k * step)
                .filter(|&s| {
                    let mut c = cfg;
                    c.shape.seq = s;
                    c.total_bytes().unwrap() <= budget
                })
                .max();
            assert_eq!(largest_sequence(&cfg, budget).unwrap(), want_s, "{cfg:?} budget {budget}");
        }
    }
    // the search's edge cases: nothing fits, everything fits, overflow counts as not fitting
    assert_eq!(largest_fit(10, |_| Ok(11)).unwrap(), None);
    assert_eq!(largest_fit(10, |_| Ok(0)).unwrap(), Some(u64::MAX));
    assert_eq!(
        largest_fit(u64::MAX, |k| k.checked_mul(3).ok_or(Error::TooLarge { what: "x".into(), why: "y".into() }))
            .unwrap(),
        Some(u64::MAX / 3)
    );
    let e = largest_fit(10, |_| Err(Error::InvalidArgument { name: "n".into(), why: "w".into() })).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }));
}

#[test]
fn bad_configurations_are_typed_errors() {
    let good = ModelShape { layers: 2, seq: 16, micro_batch: 2, hidden: 16, heads: 4, ffn: 64 };
    let none = Parallelism::none();
    let mut bad: Vec<PlanConfig> = Vec::new();
    for field in 0..6 {
        let mut s = good;
        match field {
            0 => s.layers = 0,
            1 => s.seq = 0,
            2 => s.micro_batch = 0,
            3 => s.hidden = 0,
            4 => s.heads = 0,
            _ => s.ffn = 0,
        }
        bad.push(PlanConfig::megatron(s, none, Recompute::None));
    }
    bad.push(PlanConfig::megatron(ModelShape { hidden: 18, ..good }, none, Recompute::None)); // h % a
    bad.push(PlanConfig::megatron(good, Parallelism { tensor: 0, sequence: false }, Recompute::None));
    bad.push(PlanConfig::megatron(good, Parallelism { tensor: 3, sequence: false }, Recompute::None)); // a % t
                                                                                                       // f % t (h % t follows from a % t and h % a)
    bad.push(PlanConfig::megatron(
        ModelShape { ffn: 66, ..good },
        Parallelism { tensor: 4, sequence: false },
        Recompute::None,
    ));
    bad.push(PlanConfig::megatron(
        ModelShape { seq: 15, ..good },
        Parallelism { tensor: 2, sequence: true },
        Recompute::None,
    )); // s % t
    let mut p = PlanConfig::megatron(good, none, Recompute::None);
    p.dropout.attention = 1.0;
    bad.push(p);
    p.dropout.attention = f64::NAN;
    bad.push(p);
    let mut c = ours(good, 3);
    bad.push(c);
    c = ours(good, 8);
    c.attention =
        AttentionKind::Linear { causal: true, chunk: 0, features: 4, normalize: true, states: LinearStates::Slim };
    bad.push(c);
    for cfg in bad {
        let e = cfg.plan().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{cfg:?}: {e}");
    }
    // overflow: a typed error, not a wrap or a panic (debug builds included)
    let huge = ModelShape { seq: u64::MAX / 2, micro_batch: 1 << 20, ..good };
    for recompute in [Recompute::None, Recompute::Full] {
        let e = PlanConfig::megatron(huge, none, recompute).plan().unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    }
    let e = PlanConfig::megatron(ModelShape { layers: u64::MAX, ..good }, none, Recompute::Full).plan().unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
}
