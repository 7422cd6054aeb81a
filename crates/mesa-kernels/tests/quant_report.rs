//! `Quantizer::batch_report` (Mesa §3.3, the running estimate's error) against an independent
//! reference: the decoded values of the saved codes (`SavedActivation::dequantize`), the
//! f64 statistics and escape test of `reference::quant`, and the input itself. Runs on the
//! emulation, and on CUDA device 0 when one is usable.
use mesa_kernels::fused::gelu_forward;
use mesa_kernels::quant::BatchReport;
use mesa_kernels::reference::quant as rq;
use mesa_kernels::{
    Device, GeluForm, GroupParams, Grouping, Layout, QuantConfig, Quantizer, Rounding, SavedActivation, StatsMode,
    TensorMut, TensorRef,
};

/// The emulation (checks on) and CUDA device 0 when usable.
fn backends() -> Vec<Device> {
    mesa_kernels::emulator::enable_for_tests();
    let mut devices = vec![Device::emulator()];
    if let Ok(d) = Device::cuda(0) {
        devices.push(d);
    }
    devices
}

/// A small deterministic generator (SplitMix64) of uniforms in `[0, 1)`.
struct Uniform(u64);

impl Uniform {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn quantize(device: &Device, q: &mut Quantizer, x: &[f32], shape: &[usize]) -> SavedActivation {
    let buf = device.upload(x).expect("upload");
    q.quantize(&TensorRef::new(&buf, &Layout::contiguous(shape)).expect("view")).expect("quantize")
}

fn decoded(device: &Device, saved: &SavedActivation) -> Vec<f32> {
    let mut buf = device.alloc_zeros::<f32>(saved.numel()).expect("alloc");
    let layout = Layout::contiguous(saved.shape());
    saved.dequantize(device, &mut TensorMut::new(&mut buf, &layout).expect("view")).expect("dequantize");
    buf.to_vec().expect("download")
}

/// What the reference finds in one batch: from the input `x`, its decoded values and the
/// saved parameters, per element `|x − x̂| / scale` (f64).
#[derive(Debug)]
struct Expected {
    /// Largest error over finite elements, in steps.
    max_error: f64,
    /// Largest error over elements outside `[offset, offset + levels·scale]` (f64), in steps.
    max_clamp: f64,
    clamped_groups: usize,
    nonfinite_groups: usize,
    /// One f32 ulp of the largest magnitude of a group (input or decoded), in its steps:
    /// the rounding of the code position, the decode and the f32 input itself.
    tolerance: f64,
}

fn expected(x: &[f32], xhat: &[f32], params: &[GroupParams], groups: &[usize], bits: u32) -> Expected {
    let top = rq::levels(bits) as u32;
    let count = params.len();
    let mut nonfinite = vec![false; count];
    for (&v, &g) in x.iter().zip(groups) {
        nonfinite[g] |= !v.is_finite();
    }
    let mut clamped = vec![false; count];
    let mut e = Expected { max_error: 0.0, max_clamp: 0.0, clamped_groups: 0, nonfinite_groups: 0, tolerance: 0.0 };
    // groups with NaN/Inf are left out of the figures, as the report documents
    for ((&v, &d), &g) in x.iter().zip(xhat).zip(groups).filter(|(_, &g)| !nonfinite[g]) {
        let (o, s) = (f64::from(params[g].offset), f64::from(params[g].scale));
        let (v, d) = (f64::from(v), f64::from(d));
        let hi = rq::decode(top, o, s);
        // a zero step decodes every code to the offset: exact or infinitely many steps off
        let err = match s > 0.0 {
            true => (v - d).abs() / s,
            false if v == d => 0.0,
            false => f64::INFINITY,
        };
        if s > 0.0 {
            e.tolerance = e.tolerance.max(f64::from(f32::EPSILON) * v.abs().max(d.abs()).max(hi.abs()) / s);
        }
        if v < o || v > hi {
            clamped[g] = true;
            e.max_clamp = e.max_clamp.max(err);
        }
        e.max_error = e.max_error.max(err);
    }
    e.nonfinite_groups = nonfinite.iter().filter(|&&b| b).count();
    e.clamped_groups = clamped.iter().filter(|&&b| b).count();
    e
}

/// The groups whose batch `x` escapes the estimate `est` by more than one step (reference).
fn escaping(x: &[f32], groups: &[usize], est: &[GroupParams], bits: u32) -> usize {
    let xd: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let stats = rq::group_stats(&xd, groups, est.len());
    stats.iter().zip(est).filter(|(s, p)| rq::escapes_estimate(s, p.offset, p.scale, bits)).count()
}

/// One batch as the test made it: its input, group of each element, rounding, how many
/// groups the reference says escape the estimate, and a name for messages.
struct Batch<'a> {
    x: &'a [f32],
    groups: &'a [usize],
    rounding: Rounding,
    widened: usize,
    what: &'a str,
}

/// Checks `report` against the reference for the batch saved as `saved`.
fn check(device: &Device, report: &BatchReport, saved: &SavedActivation, batch: &Batch<'_>) -> Expected {
    let Batch { x, groups, rounding, widened, what } = *batch;
    let params = saved.params().expect("params");
    let e = expected(x, &decoded(device, saved), &params, groups, saved.bits());
    let r = match rounding {
        Rounding::Nearest => 0.5,
        Rounding::Stochastic { .. } => 1.0,
    };
    let tol = 2.0 * e.tolerance;
    assert_eq!(report.groups, params.len(), "{what}: groups");
    assert_eq!(report.widened_groups, widened, "{what}: widened groups");
    assert_eq!(report.clamped_groups, e.clamped_groups, "{what}: clamped groups ({e:?})");
    assert_eq!(report.nonfinite_groups, e.nonfinite_groups, "{what}: non-finite groups");
    assert!(
        (report.max_clamp_steps - e.max_clamp).abs() <= tol,
        "{what}: largest clamp {} steps, reference {} (tolerance {tol})",
        report.max_clamp_steps,
        e.max_clamp
    );
    assert_eq!(report.max_error_steps, report.max_clamp_steps.max(r), "{what}: max(clamp, rounding bound)");
    assert!(
        e.max_error <= report.max_error_steps + tol,
        "{what}: reference error {} steps above the reported bound {}",
        e.max_error,
        report.max_error_steps
    );
    if report.max_clamp_steps > r {
        assert!((e.max_error - report.max_error_steps).abs() <= tol, "{what}: the bound is attained: {e:?}");
    }
    e
}

fn running(bits: u32, grouping: Grouping, rounding: Rounding) -> QuantConfig {
    QuantConfig { bits, grouping, rounding, momentum: 0.9, stats: StatsMode::Running }
}

#[test]
fn quant_report_follows_a_shifting_range_inside_clamped_and_widened() {
    for device in backends() {
        let (n, bits, levels) = (64usize, 8u32, 255.0f32);
        let shape = [n];
        let groups = vec![0usize; n];
        let mut q = Quantizer::new(&device, running(bits, Grouping::Tensor, Rounding::Nearest)).expect("quantizer");
        q.set_batch_report(true);
        assert!(q.batch_report().expect("report").is_none(), "nothing before the first batch");
        let mut u = Uniform(7);
        // batch 0: exact statistics of [0, 1]
        let x0: Vec<f32> = (0..n).map(|i| i as f32 / (n - 1) as f32).collect();
        let saved = quantize(&device, &mut q, &x0, &shape);
        let rep = q.batch_report().expect("report").expect("recorded");
        assert!(!rep.one_pass && rep.batches == 1);
        let e = check(
            &device,
            &rep,
            &saved,
            &Batch { x: &x0, groups: &groups, rounding: Rounding::Nearest, widened: 0, what: "batch 0" },
        );
        assert_eq!((rep.clamped_groups, rep.max_clamp_steps, rep.max_error_steps), (0, 0.0, 0.5));
        assert!(e.max_error > 0.4, "i/63 on a 1/255 grid errs by up to ~1/2 step: {e:?}");
        // batch 1: strictly inside the estimate
        let x1: Vec<f32> = (0..n).map(|_| 0.1 + 0.8 * u.next()).collect();
        let saved = quantize(&device, &mut q, &x1, &shape);
        let rep = q.batch_report().expect("report").expect("recorded");
        assert!(rep.one_pass && rep.batches == 2);
        check(
            &device,
            &rep,
            &saved,
            &Batch { x: &x1, groups: &groups, rounding: Rounding::Nearest, widened: 0, what: "batch 1 (inside)" },
        );
        assert_eq!((rep.clamped_groups, rep.max_clamp_steps), (0, 0.0));
        // batch 2: 0.7 step over the top and 0.4 below the estimate: clamped, not widened
        let est = q.running_params().expect("running").expect("estimate");
        let (o, s) = (est[0].offset, est[0].scale);
        let mut x2: Vec<f32> = (0..n).map(|_| o + u.next() * levels * s).collect();
        x2[3] = o + (levels + 0.7) * s;
        x2[40] = o - 0.4 * s;
        assert_eq!(escaping(&x2, &groups, &est, bits), 0);
        let saved = quantize(&device, &mut q, &x2, &shape);
        assert_eq!(saved.params().expect("params"), est, "encoded with the estimate");
        let rep = q.batch_report().expect("report").expect("recorded");
        let e = check(
            &device,
            &rep,
            &saved,
            &Batch { x: &x2, groups: &groups, rounding: Rounding::Nearest, widened: 0, what: "batch 2 (clamped)" },
        );
        assert_eq!(rep.clamped_groups, 1);
        assert!((rep.max_clamp_steps - 0.7).abs() < 1e-3, "{rep:?}");
        assert!((rep.max_error_steps - e.max_error).abs() <= 2.0 * e.tolerance, "attained: {rep:?} {e:?}");
        assert_eq!(q.widened_groups().expect("widened"), Some(0));
        // batch 3: 5 steps over the top: widened, saved with its own range, nothing clamped
        let est = q.running_params().expect("running").expect("estimate");
        let (o, s) = (est[0].offset, est[0].scale);
        let mut x3: Vec<f32> = (0..n).map(|_| o + u.next() * levels * s).collect();
        x3[11] = o + (levels + 5.0) * s;
        assert_eq!(escaping(&x3, &groups, &est, bits), 1);
        let saved = quantize(&device, &mut q, &x3, &shape);
        assert_ne!(saved.params().expect("params"), est, "widened: the batch's own range");
        let rep = q.batch_report().expect("report").expect("recorded");
        check(
            &device,
            &rep,
            &saved,
            &Batch { x: &x3, groups: &groups, rounding: Rounding::Nearest, widened: 1, what: "batch 3 (widened)" },
        );
        assert_eq!((rep.widened_groups, rep.clamped_groups, rep.max_error_steps), (1, 0, 0.5));
        assert_eq!(q.widened_groups().expect("widened"), Some(1));
        // an empty tensor is no batch: the report stays
        let empty = quantize(&device, &mut q, &[], &[0]);
        assert_eq!(empty.numel(), 0);
        assert_eq!(q.batch_report().expect("report"), Some(rep));
        // off: no report, and none until a batch after turning it on again
        q.set_batch_report(false);
        assert!(q.batch_report().expect("report").is_none());
        q.set_batch_report(true);
        assert!(q.batch_report().expect("report").is_none(), "no batch recorded since");
        quantize(&device, &mut q, &x1, &shape);
        assert_eq!(q.batch_report().expect("report").map(|r| r.batches), Some(5));
    }
}

/// Four groups of `[2, 4, 16]` (per head, axis 1): inside, 0.6 step below, escaped
/// (widened), and one NaN; for 4-bit codes, both roundings.
#[test]
fn quant_report_per_group_mix_against_the_decoded_values() {
    for device in backends() {
        for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 0x5eed }] {
            let (bits, levels) = (4u32, 15.0f32);
            let shape = [2usize, 4, 16];
            let grouping = Grouping::Heads { axis: 1 };
            let groups = rq::group_index(&shape, &grouping).expect("groups");
            let n = groups.len();
            let mut q = Quantizer::new(&device, running(bits, grouping, rounding)).expect("quantizer");
            q.set_batch_report(true);
            let mut u = Uniform(11);
            let x0: Vec<f32> = groups.iter().map(|&g| g as f32 + (g + 1) as f32 * u.next()).collect();
            let saved = quantize(&device, &mut q, &x0, &shape);
            let rep = q.batch_report().expect("report").expect("recorded");
            check(&device, &rep, &saved, &Batch { x: &x0, groups: &groups, rounding, widened: 0, what: "batch 0" });
            let est = q.running_params().expect("running").expect("estimate");
            let mut x1: Vec<f32> = groups
                .iter()
                .map(|&g| {
                    let (o, s) = (est[g].offset, est[g].scale);
                    match g {
                        2 => o + 3.0 * levels * s * u.next(), // far over the top
                        _ => o + levels * s * (0.05 + 0.9 * u.next()),
                    }
                })
                .collect();
            let first = |g: usize| groups.iter().position(|&h| h == g).expect("group");
            x1[first(1) + 5] = est[1].offset - 0.6 * est[1].scale;
            x1[first(3) + 2] = f32::NAN;
            x1[first(2)] = est[2].offset + 3.0 * levels * est[2].scale; // the escape is certain
            let widened = escaping(&x1, &groups, &est, bits);
            assert_eq!(widened, 1, "only group 2 escapes");
            let saved = quantize(&device, &mut q, &x1, &shape);
            assert_eq!(saved.nonfinite_count().expect("nonfinite"), 1);
            let rep = q.batch_report().expect("report").expect("recorded");
            let what = format!("{rounding:?} batch 1");
            check(&device, &rep, &saved, &Batch { x: &x1, groups: &groups, rounding, widened, what: &what });
            assert_eq!((rep.groups, rep.widened_groups, rep.clamped_groups, rep.nonfinite_groups), (4, 1, 1, 1));
            assert!((rep.max_clamp_steps - 0.6).abs() < 1e-3, "{what}: {rep:?}");
            assert_eq!(n, 128);
        }
    }
}

/// Recording changes nothing that is saved (the finalize then runs as its own launch), on the
/// quantize-on-save path and on a fused producer (GELU); the report follows both.
#[test]
fn quant_report_leaves_codes_and_estimate_bit_for_bit() {
    for device in backends() {
        let shape = [4usize, 8, 32];
        let layout = Layout::contiguous(&shape);
        let config = running(8, Grouping::Heads { axis: 1 }, Rounding::Stochastic { seed: 3 });
        let (mut plain, mut recorded) =
            (Quantizer::new(&device, config).expect("q"), Quantizer::new(&device, config).expect("q"));
        let (mut gelu_plain, mut gelu_recorded) =
            (Quantizer::new(&device, config).expect("q"), Quantizer::new(&device, config).expect("q"));
        recorded.set_batch_report(true);
        gelu_recorded.set_batch_report(true);
        let mut u = Uniform(5);
        let mut seen = (0usize, 0usize); // widened, clamped
        for batch in 0..4 {
            // group g spans [−m/2, m/2], m growing with the batch by g's rate: per mille
            // (inside the estimate's one-step band: clamps) or by half (widens)
            let rate = |g: usize| [0.0, 0.003, 0.006, 0.5][g % 4];
            let x: Vec<f32> = (0..layout.numel())
                .map(|i| {
                    let base = match i % 32 {
                        0 => -0.5,
                        1 => 0.5,
                        _ => u.next() - 0.5,
                    };
                    base * (1.0 + batch as f32 * rate(i / 32 % 8))
                })
                .collect();
            let a = quantize(&device, &mut plain, &x, &shape);
            let b = quantize(&device, &mut recorded, &x, &shape);
            assert_eq!(a.codes().to_vec().expect("codes"), b.codes().to_vec().expect("codes"), "batch {batch}");
            assert_eq!(a.params().expect("p"), b.params().expect("p"), "batch {batch}");
            assert_eq!(plain.running_params().expect("r"), recorded.running_params().expect("r"));
            assert!(plain.batch_report().expect("report").is_none(), "off by default");
            let rep = recorded.batch_report().expect("report").expect("on");
            let widened = recorded.widened_groups().expect("widened").unwrap_or(0) as usize;
            let groups = rq::group_index(&shape, &config.grouping).expect("groups");
            check(
                &device,
                &rep,
                &b,
                &Batch { x: &x, groups: &groups, rounding: config.rounding, widened, what: "quantize" },
            );
            // GELU saves its input x: the same report from its fused finalize path
            let buf = device.upload(&x).expect("up");
            let view = TensorRef::new(&buf, &layout).expect("view");
            let (mut y1, mut y2) =
                (device.alloc_zeros::<f32>(x.len()).expect("y"), device.alloc_zeros::<f32>(x.len()).expect("y"));
            let mut out1 = TensorMut::new(&mut y1, &layout).expect("y");
            let g1 = gelu_forward(&device, &mut gelu_plain, GeluForm::Erf, &view, &mut out1).expect("gelu");
            let mut out2 = TensorMut::new(&mut y2, &layout).expect("y");
            let g2 = gelu_forward(&device, &mut gelu_recorded, GeluForm::Erf, &view, &mut out2).expect("gelu");
            assert_eq!(g1.codes().to_vec().expect("codes"), g2.codes().to_vec().expect("codes"), "gelu {batch}");
            assert_eq!(gelu_recorded.batch_report().expect("report"), Some(rep), "gelu batch {batch}");
            seen.0 += rep.widened_groups;
            seen.1 += rep.clamped_groups;
        }
        assert!(seen.0 > 0 && seen.1 > 0, "the case must widen and clamp: {seen:?}");
    }
}
