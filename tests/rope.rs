//! Rotary position embeddings against the f64 reference (`mesa_kernels::reference::rope`), on
//! every backend and dtype, both pairings, partial rotation, offsets and strided views; and the
//! saving forward (`rope_forward_save`, issue 40): its output is `rope`'s bit for bit, its codes
//! and parameters those of `Quantizer::quantize` on that output (a twin quantizer with the
//! same history), batch after batch, and they decode to within a step of the output.
//!
//! Tolerance (derived): the kernel rounds `inv_freq = base^(−2i/R)` (its exponent rounded
//! first: a relative error of `ln(base)·2⁻²⁴`, at most 13·2⁻²⁴ for base 5·10⁵, and `powf`'s
//! own 2 ulp), then `inv_freq/π` and `θ/π = p·inv_freq/π` (2⁻²⁴ each): `|Δθ| ≤ 20·2⁻²⁴·θ`;
//! `sincospif` within 2 ulp; the two products and the fused add three roundings of terms
//! below `|x_a| + |x_b|`. So `|y − ref| ≤ (|x_a| + |x_b|)·2⁻²⁴·(20θ + 8) + u_T·|ref| + σ_T/2`
//! (u_T the output's unit roundoff, σ_T its subnormal spacing: an f16 output below 2⁻¹⁴ is
//! rounded to a multiple of 2⁻²⁴, not to 11 bits; seen with `MESA_TEST_SEED=4971974327964789395`).
mod common;

use half::{bf16, f16};
use mesa_kernels::reference::{self, quant as rq, rope as rr};
use mesa_kernels::rope::{rope, rope_backward, rope_forward_save, RopeConfig, RopePairing};
use mesa_kernels::{
    DType, Device, Element, Error, Grouping, Layout, QuantConfig, Quantizer, RawDeviceSlice, Rounding, SavedActivation,
    StatsMode, TensorMut, TensorRef,
};
use rand::RngExt;

const EPS: f64 = 1.0 / 16_777_216.0;

/// Runs RoPE (or its inverse) of `x` viewed through `l` ([..., S, D]) into a dense output;
/// returns the output and the input's logical values.
fn run<T: Element>(device: &Device, cfg: &RopeConfig, x: &[T], l: &Layout, inverse: bool) -> (Vec<f64>, Vec<f64>) {
    let xb = device.upload(x).expect("up");
    let n: usize = l.shape().iter().product();
    let mut yb = device.upload(&vec![T::from_f64(f64::NAN); n]).expect("up");
    let dense = Layout::contiguous(l.shape());
    let xv = TensorRef::new(&xb, l).expect("view");
    let mut yv = TensorMut::new(&mut yb, &dense).expect("view");
    if inverse {
        rope_backward(device, cfg, &xv, &mut yv).expect("rope_backward");
    } else {
        rope(device, cfg, &xv, &mut yv).expect("rope");
    }
    let y = yb.to_vec().expect("down").iter().map(|v| v.to_f64()).collect();
    (y, reference::gather(x, l))
}

/// Checks one output against the reference with the bound of the module docs.
fn check(what: &str, y: &[f64], x: &[f64], shape: &[usize], cfg: &RopeConfig, inverse: bool, dtype: DType) {
    let (u_t, sub) = (common::unit_roundoff(dtype), common::subnormal_spacing(dtype));
    let (seq, dim) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let want = rr::rope(x, seq, dim, cfg, inverse);
    let r = cfg.rotary_dims.unwrap_or(dim);
    for (e, (got, w)) in y.iter().zip(&want).enumerate() {
        let (row, d) = (e / dim, e % dim);
        let p = (cfg.position_offset + row % seq) as f64;
        let tol = if d < r {
            let i = match cfg.pairing {
                RopePairing::Halves => d % (r / 2),
                RopePairing::Interleaved => d / 2,
            };
            let (a, b) = match cfg.pairing {
                RopePairing::Halves => (i, i + r / 2),
                RopePairing::Interleaved => (2 * i, 2 * i + 1),
            };
            let theta = p * f64::from(cfg.base).powf(-2.0 * i as f64 / r as f64);
            (x[row * dim + a].abs() + x[row * dim + b].abs()) * EPS * (20.0 * theta + 8.0) + u_t * w.abs() + 0.5 * sub
        } else {
            0.0 // passed through: the same bits
        };
        assert!((got - w).abs() <= tol, "{what}: element {e} (row {row}, dim {d}): {got} vs {w} (tol {tol})");
    }
}

fn random<T: Element>(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.random::<f64>() * 4.0 - 2.0)).collect()
}

macro_rules! each_dtype {
    ($body:ident) => {
        $body::<f32>(DType::F32);
        $body::<f16>(DType::F16);
        $body::<bf16>(DType::BF16);
    };
}

#[test]
fn rope_matches_the_reference_every_dtype_pairing_and_view() {
    fn case<T: Element>(dtype: DType) {
        let mut rng = common::rng("rope_parity");
        for device in common::backends() {
            for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
                // [B, H, S, D] from position 5, all dims rotated (Llama 2's base)
                let cfg = RopeConfig { base: 10_000.0, pairing, rotary_dims: None, position_offset: 5 };
                let shape = [2, 3, 17, 64];
                let x: Vec<T> = random(&mut rng, shape.iter().product());
                let l = Layout::contiguous(&shape);
                for inverse in [false, true] {
                    let (y, xs) = run(&device, &cfg, &x, &l, inverse);
                    check(&format!("{dtype:?} {pairing:?} inverse {inverse}"), &y, &xs, &shape, &cfg, inverse, dtype);
                }
                // a [B, S, H, D] projection read as [B, H, S, D] (strided), half the dims rotated
                // (GPT-NeoX's rotary_pct 0.5), Llama 3's base, positions past 100 000
                let cfg = RopeConfig { base: 500_000.0, pairing, rotary_dims: Some(16), position_offset: 100_000 };
                let x: Vec<T> = random(&mut rng, 2 * 9 * 4 * 32);
                let l = Layout::contiguous(&[2, 9, 4, 32]).transpose(1, 2).expect("t");
                let (y, xs) = run(&device, &cfg, &x, &l, false);
                check(&format!("{dtype:?} {pairing:?} strided, partial"), &y, &xs, l.shape(), &cfg, false, dtype);
            }
        }
    }
    each_dtype!(case);
}

#[test]
fn the_backward_undoes_the_forward() {
    // RoPE is a rotation: RoPE⁻¹(RoPE(x)) = x within the two passes' bounds (f32)
    let mut rng = common::rng("rope_inverse");
    let device = common::emulator();
    let cfg = RopeConfig::llama(500_000.0);
    let shape = [4, 33, 128];
    let x: Vec<f32> = random(&mut rng, shape.iter().product());
    let l = Layout::contiguous(&shape);
    let (y, xs) = run(&device, &cfg, &x, &l, false);
    let y32: Vec<f32> = y.iter().map(|v| *v as f32).collect();
    let (back, _) = run(&device, &cfg, &y32, &l, true);
    for (e, (b, x0)) in back.iter().zip(&xs).enumerate() {
        let p = (e / 128 % 33) as f64;
        let tol = 4.0 * EPS * (20.0 * p + 8.0) * 4.0;
        assert!((b - x0).abs() <= tol, "element {e}: {b} vs {x0} (tol {tol})");
    }
}

#[test]
fn bad_input_is_an_error() {
    let device = common::emulator();
    let xb = device.upload(&[1.0f32; 64]).expect("up");
    let mut yb = device.alloc_zeros::<f32>(64).expect("alloc");
    let l = Layout::contiguous(&[4, 16]);
    let x = TensorRef::new(&xb, &l).expect("v");
    let mut y = TensorMut::new(&mut yb, &l).expect("v");
    let odd = RopeConfig { rotary_dims: Some(7), ..RopeConfig::llama(10_000.0) };
    assert!(matches!(rope(&device, &odd, &x, &mut y), Err(Error::InvalidLayout { .. })));
    let wide = RopeConfig { rotary_dims: Some(18), ..RopeConfig::llama(10_000.0) };
    assert!(matches!(rope(&device, &wide, &x, &mut y), Err(Error::InvalidLayout { .. })));
    for base in [1.0, f32::NAN, f32::INFINITY, -3.0] {
        let cfg = RopeConfig::llama(base);
        assert!(matches!(rope(&device, &cfg, &x, &mut y), Err(Error::InvalidLayout { .. })), "base {base}");
    }
    let far = RopeConfig { position_offset: 1 << 24, ..RopeConfig::llama(10_000.0) };
    assert!(matches!(rope(&device, &far, &x, &mut y), Err(Error::InvalidLayout { .. })));
    let flat = Layout::contiguous(&[64]);
    let (x1, mut y1) = (TensorRef::new(&xb, &flat).expect("v"), TensorMut::new(&mut yb, &flat).expect("v"));
    assert!(matches!(rope(&device, &RopeConfig::llama(10_000.0), &x1, &mut y1), Err(Error::InvalidLayout { .. })));
    let other = Layout::contiguous(&[8, 8]);
    let mut y2 = TensorMut::new(&mut yb, &other).expect("v");
    assert!(matches!(rope(&device, &RopeConfig::llama(10_000.0), &x, &mut y2), Err(Error::ShapeMismatch { .. })));
}

// ---------------------------------------------------------------------------------------
// The saving forward (issue 40): rotate, then encode, in one pass.

/// Values of a storage type, bit for bit (through f64: injective on finite values, and the
/// inputs here are finite).
fn bits_of<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// One batch: `rope_forward_save` of `x` (viewed through `l`) with `q`, against `rope` then
/// `Quantizer::quantize` with the twin `t` (same configuration and history): the same output
/// bits, the same codes, parameters and non-finite count, the same widened groups; the output
/// within the bound of the module docs of the f64 reference; the codes within a step of the
/// output (half a step for round to nearest with the batch's own range: `exact`).
fn check_save<T: Element>(
    device: &Device,
    (q, t): (&mut Quantizer, &mut Quantizer),
    cfg: &RopeConfig,
    (x, l): (&[T], &Layout),
    exact: bool,
    what: &str,
) -> SavedActivation {
    let shape = l.shape().to_vec();
    let n: usize = shape.iter().product();
    let dense = Layout::contiguous(&shape);
    let xb = device.upload(x).expect("up");
    let mut y = device.upload(&vec![T::from_f64(f64::NAN); n]).expect("up");
    let saved = rope_forward_save(
        device,
        q,
        cfg,
        &TensorRef::new(&xb, l).expect("v"),
        &mut TensorMut::new(&mut y, &dense).expect("v"),
    )
    .expect("rope_forward_save");
    // the output: rope's, bit for bit
    let mut y2 = device.upload(&vec![T::from_f64(f64::NAN); n]).expect("up");
    rope(device, cfg, &TensorRef::new(&xb, l).expect("v"), &mut TensorMut::new(&mut y2, &dense).expect("v"))
        .expect("rope");
    let (yh, y2h) = (y.to_vec().expect("down"), y2.to_vec().expect("down"));
    assert!(bits_of(&yh) == bits_of(&y2h), "{what}: the saving forward's output differs from rope's");
    let ys: Vec<f64> = yh.iter().map(|v| v.to_f64()).collect();
    check(what, &ys, &reference::gather(x, l), &shape, cfg, false, T::DTYPE);
    // the codes: Quantizer::quantize's of that output, bit for bit
    let want = t.quantize(&TensorRef::new(&y2, &dense).expect("v")).expect("twin quantize");
    assert_eq!(
        saved.codes().to_vec().expect("c"),
        want.codes().to_vec().expect("c"),
        "{what}: codes vs Quantizer::quantize"
    );
    assert_eq!(saved.params().expect("p"), want.params().expect("p"), "{what}: params vs Quantizer::quantize");
    assert_eq!(saved.nonfinite_count().expect("n"), 0, "{what}: non-finite count");
    assert_eq!(q.widened_groups().expect("w"), t.widened_groups().expect("w"), "{what}: widened groups");
    assert_eq!(q.running_params().expect("r"), t.running_params().expect("r"), "{what}: running estimate");
    assert_eq!((saved.shape(), saved.bits(), saved.grouping()), (&shape[..], q.config().bits, q.config().grouping));
    // the codes decode to within a step of the stored output: half a step (and the f32
    // rounding of the position (y − o)·(1/s), a few ulps of at most 2^bits − 1) when the
    // batch's own range was used and rounding is to nearest, a step otherwise (stochastic:
    // floor or ceiling; running estimate: up to a step beyond its range without widening)
    let codes = rq::unpack_codes(&saved.codes().to_vec().expect("c"), n, saved.bits());
    let params = saved.params().expect("p");
    let groups = rq::group_index(&shape, &saved.grouping()).expect("groups");
    let nearest = q.config().rounding == Rounding::Nearest;
    let steps = if exact && nearest { 0.5 } else { 1.0 } + 4.0 * rq::levels(saved.bits()) * EPS;
    for (i, (&c, &v)) in codes.iter().zip(&ys).enumerate() {
        let p = params[groups[i]];
        let dec = rq::decode(c, f64::from(p.offset), f64::from(p.scale));
        let tol = steps * f64::from(p.scale) + 2.0 * EPS * v.abs();
        assert!((dec - v).abs() <= tol, "{what}: element {i} decodes to {dec}, stored {v} (tol {tol})");
    }
    saved
}

/// Three batches through a quantizer and its twin: a first (exact statistics), one stretched
/// and shifted past the running estimate (groups widened), one back in range.
fn batches<T: Element>(
    device: &Device,
    rng: &mut rand::rngs::StdRng,
    config: QuantConfig,
    cfg: &RopeConfig,
    l: &Layout,
    what: &str,
) {
    let mut q = Quantizer::new(device, config).expect("q");
    let mut t = Quantizer::new(device, config).expect("q");
    // a buffer that holds the view (its offset and strides)
    let len = l.shape().iter().zip(l.strides()).map(|(d, s)| (d - 1) * s).sum::<usize>() + l.offset() + 1;
    for (b, (scale, shift)) in [(1.0, 0.0), (3.0, 0.75), (1.0, 0.0)].into_iter().enumerate() {
        let x: Vec<T> = (0..len).map(|_| T::from_f64((rng.random::<f64>() * 4.0 - 2.0) * scale + shift)).collect();
        let exact = b == 0 || config.stats == StatsMode::Exact;
        check_save(device, (&mut q, &mut t), cfg, (&x, l), exact, &format!("{what}, batch {b}"));
        if b == 1 && config.stats == StatsMode::Running {
            // the stretched batch left the estimate: its groups were encoded again
            assert!(q.widened_groups().expect("w").is_some_and(|w| w > 0), "{what}: no group widened");
        }
    }
    assert_eq!(q.batches(), 3);
}

#[test]
fn saving_forward_is_rope_then_quantize_bit_for_bit() {
    // the Llama layer's case: queries [B, H, N, d] with head-wise codes, every dtype, width,
    // rounding and statistics mode (round to nearest on dense views: the dense kernel;
    // stochastic rounding and the statistics pass: the general one)
    fn case<T: Element>(dtype: DType) {
        let mut rng = common::rng("rope_save_parity");
        for device in common::backends() {
            let cfg = RopeConfig { position_offset: 3, ..RopeConfig::llama(10_000.0) };
            let l = Layout::contiguous(&[2, 4, 24, 64]);
            for bits in [8, 4, 2] {
                for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 40 }] {
                    for stats in [StatsMode::Running, StatsMode::Exact] {
                        let config = QuantConfig { bits, rounding, stats, ..QuantConfig::per_head(1) };
                        batches::<T>(
                            &device,
                            &mut rng,
                            config,
                            &cfg,
                            &l,
                            &format!("{dtype:?} {bits}-bit {rounding:?} {stats:?}"),
                        );
                    }
                }
            }
        }
    }
    each_dtype!(case);
}

#[test]
fn saving_forward_every_pairing_rotation_and_view() {
    fn case<T: Element>(dtype: DType) {
        let mut rng = common::rng("rope_save_views");
        for device in common::backends() {
            for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
                let full = RopeConfig { base: 10_000.0, pairing, rotary_dims: None, position_offset: 0 };
                let partial =
                    |r| RopeConfig { base: 500_000.0, pairing, rotary_dims: Some(r), position_offset: 100_000 };
                let cases: Vec<(&str, RopeConfig, Layout, Grouping)> = vec![
                    // dense, every dim rotated (the dense kernel)
                    ("dense [B, H, N, d]", full, Layout::contiguous(&[2, 3, 17, 64]), Grouping::Heads { axis: 1 }),
                    // dense, half the dims rotated (Llama 3's base, positions past 100 000)
                    ("partial rotation", partial(16), Layout::contiguous(&[2, 2, 9, 32]), Grouping::Heads { axis: 1 }),
                    // the halves of a row in different channel groups (group changes inside an item)
                    (
                        "channel groups",
                        full,
                        Layout::contiguous(&[2, 2, 5, 64]),
                        Grouping::Channels { axis: 3, groups: 2 },
                    ),
                    // a [B, N, H, d] projection read as [B, H, N, d] (the general kernel)
                    (
                        "transposed view",
                        full,
                        Layout::contiguous(&[2, 9, 3, 32]).transpose(1, 2).expect("t"),
                        Grouping::Heads { axis: 1 },
                    ),
                    // R/2 not a multiple of 8 on a dense view (the general kernel)
                    ("40 dims", partial(20), Layout::contiguous(&[3, 7, 40]), Grouping::Heads { axis: 0 }),
                    // rows of 6: units straddle rows and positions, one group
                    ("rows of 6", partial(4), Layout::contiguous(&[3, 5, 6]), Grouping::Tensor),
                ];
                for (name, cfg, l, grouping) in cases {
                    for (bits, rounding) in
                        [(8, Rounding::Nearest), (4, Rounding::Nearest), (2, Rounding::Stochastic { seed: 7 })]
                    {
                        let config = QuantConfig { bits, rounding, grouping, ..QuantConfig::per_tensor() };
                        batches::<T>(
                            &device,
                            &mut rng,
                            config,
                            &cfg,
                            &l,
                            &format!("{dtype:?} {pairing:?} {name} {bits}-bit"),
                        );
                    }
                }
            }
        }
    }
    each_dtype!(case);
}

#[test]
fn saving_forward_bad_input_is_an_error_and_no_batch() {
    let device = common::emulator();
    let xb = device.upload(&[1.0f32; 64]).expect("up");
    let mut yb = device.alloc_zeros::<f32>(64).expect("alloc");
    let l = Layout::contiguous(&[2, 2, 16]);
    let x = TensorRef::new(&xb, &l).expect("v");
    let mut q = Quantizer::new(&device, QuantConfig::per_head(0)).expect("q");
    let llama = RopeConfig::llama(10_000.0);
    // the rotation's checks, as rope's
    let odd = RopeConfig { rotary_dims: Some(7), ..llama };
    let r = rope_forward_save(&device, &mut q, &odd, &x, &mut TensorMut::new(&mut yb, &l).expect("v"));
    assert!(matches!(r, Err(Error::InvalidLayout { .. })), "{r:?}");
    let other = Layout::contiguous(&[4, 16]);
    let r = rope_forward_save(&device, &mut q, &llama, &x, &mut TensorMut::new(&mut yb, &other).expect("v"));
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
    // a grouping the shape does not have
    let mut q3 = Quantizer::new(&device, QuantConfig::per_head(3)).expect("q");
    let r = rope_forward_save(&device, &mut q3, &llama, &x, &mut TensorMut::new(&mut yb, &l).expect("v"));
    assert!(matches!(r, Err(Error::InvalidLayout { .. })), "{r:?}");
    // in place: the output over the input
    let mut storage = vec![0.5f32; 64];
    // SAFETY: the emulator runs each kernel synchronously on this thread; `storage` outlives
    // both slices and is not touched while they are in use.
    let (xr, mut yr) = unsafe {
        (
            RawDeviceSlice::<f32>::new(storage.as_mut_ptr() as u64, 64),
            RawDeviceSlice::<f32>::new(storage.as_mut_ptr() as u64, 64),
        )
    };
    let r = rope_forward_save(
        &device,
        &mut q,
        &llama,
        &TensorRef::new(&xr, &l).expect("v"),
        &mut TensorMut::new(&mut yr, &l).expect("v"),
    );
    assert!(matches!(r, Err(Error::Aliasing { .. })), "{r:?}");
    assert_eq!(q.batches(), 0, "a rejected call is no batch");
    // an empty tensor: an empty handle, no batch
    let empty = Layout::contiguous(&[2, 0, 16]);
    let saved = rope_forward_save(
        &device,
        &mut q,
        &llama,
        &TensorRef::new(&xb, &empty).expect("v"),
        &mut TensorMut::new(&mut yb, &empty).expect("v"),
    )
    .expect("empty");
    assert_eq!((saved.numel(), q.batches()), (0, 0));
    // then a real batch goes through
    rope_forward_save(&device, &mut q, &llama, &x, &mut TensorMut::new(&mut yb, &l).expect("v")).expect("batch");
    assert_eq!(q.batches(), 1);
}

#[test]
fn huge_empty_tensors_are_never_a_panic() {
    // no element, but products of dimensions (and offset + sequence) that overflow: each call
    // is Ok (nothing to do) or a clean error, never a panic (run once with overflow checks:
    // docs/fused.md) and never the "bug in this crate" kind
    let device = common::emulator();
    let empty = device.upload::<f32>(&[]).expect("up");
    let mut out = device.upload::<f32>(&[]).expect("up");
    let huge = usize::MAX / 2;
    for shape in [[0, huge, 4], [huge, 0, 4], [huge, 4, 0]] {
        let l = Layout::contiguous(&shape);
        for offset in [0, huge + 2] {
            let cfg = RopeConfig { position_offset: offset, ..RopeConfig::llama(10_000.0) };
            let (x, mut y) = (TensorRef::new(&empty, &l).expect("v"), TensorMut::new(&mut out, &l).expect("v"));
            let r = rope(&device, &cfg, &x, &mut y);
            assert!(!matches!(r, Err(Error::KernelArgument { .. })), "rope {shape:?}: {r:?}");
            for grouping in [Grouping::Tensor, Grouping::Heads { axis: 0 }, Grouping::Channels { axis: 2, groups: 2 }] {
                let mut q = Quantizer::new(&device, QuantConfig { grouping, ..QuantConfig::per_tensor() }).expect("q");
                let r = rope_forward_save(&device, &mut q, &cfg, &x, &mut y).map(|s| s.numel());
                assert!(
                    matches!(r, Ok(0) | Err(Error::InvalidLayout { .. } | Error::TooLarge { .. })),
                    "{shape:?} {grouping:?}: {r:?}"
                );
                assert_eq!(q.batches(), 0);
            }
        }
    }
}
