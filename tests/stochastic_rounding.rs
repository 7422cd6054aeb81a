//! Statistics of stochastic rounding (issue 30): unbiased at every width, on-grid values
//! fixed, independent between neighbours and between calls, reproducible from the seed — and
//! each statistic shown to reject the generator broken on purpose (`kernels/broken/stochastic.cu`).
//!
//! The rule under test (docs/kernels.md, "Stochastic rounding"): element `i` of call `k`
//! under seed `s` gets `code = (T + u) >> 16`, `T = rint(t · 2¹⁶)` clamped to `[0, L·2¹⁶]`
//! for the kernel's f32 position `t`, `u` 16 bits of Philox4x32-7 keyed by
//! `s + k·0x9E3779B97F4A7C15` at counter `i / 8`. So for a fixed `T`, the round-up indicator
//! `code − (T >> 16)` is Bernoulli with `p = (T mod 2¹⁶) / 2¹⁶` if the bits are uniform.
//!
//! Bounds (derived from the sample counts, not tuned), every one at 5σ (two-sided false-alarm
//! probability 5.7·10⁻⁷ per check, ~20 checks per run):
//! * unbiasedness: over the `n = 2²⁰` elements of one fraction, the mean indicator minus the
//!   mean `p` has σ = √(Σ p(1 − p)) / n (in code steps). `p` is computed here from the f32
//!   input, offset and scale exactly as the kernel computes `T` (f32 subtraction, the
//!   kernel's Newton reciprocal, one f32 product, round half-even), so the f32 rounding of the
//!   test values is accounted for; `p` itself is within 2⁻¹⁷ + 4·2⁻²⁴·max(1, t) of the exact
//!   fraction of the value in f64 (the 2⁻¹⁶ fixed-point grid and the f32 roundings), also
//!   asserted: the codes are unbiased for the value to that resolution.
//! * independence: the sample correlation of two indicator sequences of length `n` with true
//!   correlation 0 has σ ≈ 1/√n; asserted `|r| ≤ 5/√n` for adjacent elements (`i`, `i + 1`,
//!   all pairs of one fraction) and for one element in calls `k` and `k + 1`.
//! * on-grid: `T mod 2¹⁶ = 0` must give `code = T >> 16` for every element, whatever `u`.
//!
//! Every run is on the emulator with every check on (`Checks::ALL`, unless `MESA_EMU_CHECK`
//! says otherwise): the whole file takes ~6 s in release on a 2-core machine (2026-12-04),
//! so no subset of checks is needed for the 2²⁰-draw runs.
mod common;

use mesa_kernels::emulator::{self, Checks};
use mesa_kernels::reference::quant as rq;
use mesa_kernels::{
    Buffer, Device, GroupParams, Grouping, Layout, QuantConfig, Quantizer, Rounding, StatsMode, TensorRef,
};
use rand::RngExt;

/// The fractions of a code step the unbiasedness is checked at.
const FRACTIONS: [f64; 5] = [1e-4, 0.25, 0.5, 0.75, 1.0 - 1e-4];
/// Draws per fraction (one element each, one launch for all fractions).
const N: usize = 1 << 20;
/// Standard deviations every statistic is allowed.
const Z: f64 = 5.0;
/// The per-call key stride of `Quantizer` (crates/mesa-kernels/src/quant.rs).
const CALL_STRIDE: u64 = 0x9E37_79B9_7F4A_7C15;

/// `kernels/broken/stochastic.cu`'s arguments.
#[repr(C)]
struct BrokenRoundingArgs {
    codes: *mut u8,
    x: *const f32,
    n: i64,
    params: GroupParams,
    seed: u64,
    call: u64,
    bits: i32,
    fault: i32,
}

extern "C" {
    fn mesa_emu_broken_stochastic_rounding(a: *const BrokenRoundingArgs) -> i32;
}

/// What `kernels/broken/stochastic.cu` breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The library's generator (must give the library's codes).
    None = 0,
    /// Every element gets the bits 0x8000.
    ConstantUniform = 1,
    /// Element `2j + 1` reuses element `2j`'s bits.
    NeighbourBits = 2,
    /// The call counter is not advanced (the key is the seed for every call).
    CounterNotAdvanced = 3,
    /// The uniform is `(u + 1) / 2¹⁶ ∈ (0, 1]` instead of `[0, 1)`.
    UniformUpToOne = 4,
}

/// One tensor of test values: `FRACTIONS.len()` segments of `N` values at `c + f` code steps
/// (`c` cycling over the codes), then `N` values on the grid, then the range's two ends.
struct Case {
    bits: u32,
    x: Vec<f32>,
    params: GroupParams,
    /// The kernel's fixed-point position of every element.
    fixed: Vec<u32>,
}

impl Case {
    /// Values from `lo` in steps of `step` (the range `[lo, lo + L·step]`, rounded to f32).
    fn new(bits: u32, lo: f32, step: f64, segment: usize) -> Case {
        let levels = rq::levels(bits);
        let lo64 = f64::from(lo);
        let hi = (lo64 + levels * step) as f32;
        let mut x = Vec::with_capacity((FRACTIONS.len() + 1) * segment + 2);
        for f in FRACTIONS {
            x.extend((0..segment).map(|k| (lo64 + ((k % levels as usize) as f64 + f) * step) as f32));
        }
        x.extend((0..segment).map(|k| (lo64 + (k % (levels as usize + 1)) as f64 * step) as f32));
        x.extend([lo, hi]);
        let params = exact_params(&x, bits);
        let fixed = x.iter().map(|&v| kernel_fixed_position(v, params, bits)).collect();
        Case { bits, x, params, fixed }
    }

    fn segment(&self, s: usize) -> std::ops::Range<usize> {
        let n = (self.x.len() - 2) / (FRACTIONS.len() + 1);
        s * n..(s + 1) * n
    }
}

/// Exact mode's parameters of one group: offset = min, scale = (max − min) / L in f64 rounded
/// up to f32 (quant_finalize).
fn exact_params(x: &[f32], bits: u32) -> GroupParams {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let step = (f64::from(hi) - f64::from(lo)) / rq::levels(bits);
    let mut scale = step as f32;
    if f64::from(scale) < step {
        scale = f32::from_bits(scale.to_bits() + 1);
    }
    GroupParams { offset: lo, scale }
}

/// The kernel's `T = min(rint(fl(fl(x − offset) · fl(1/scale · 2¹⁶))), L · 2¹⁶)` (normal
/// scale, finite difference: the fast path's arithmetic, bit for bit): `reciprocal` of
/// quant_common.cuh is Newton's iteration from a bit-pattern seed, three fused steps.
fn kernel_fixed_position(x: f32, p: GroupParams, bits: u32) -> u32 {
    let s = p.scale;
    let mut r = f32::from_bits(0x7EF3_11C3 - s.to_bits());
    for _ in 0..3 {
        r = r.mul_add((-s).mul_add(r, 1.0), r);
    }
    let t16 = (x - p.offset) * (r * rq::ROUNDING_ONE as f32);
    let max = ((1u32 << bits) - 1) << 16;
    if t16 > 0.0 {
        (f64::from(t16).round_ties_even().min(f64::from(max))) as u32
    } else {
        0
    }
}

/// Codes of calls `0..calls` of one `Quantizer` (exact statistics, one group) on `case`.
fn library_codes(device: &Device, case: &Case, seed: u64, calls: u64) -> Vec<Vec<u32>> {
    let config = QuantConfig {
        bits: case.bits,
        grouping: Grouping::Tensor,
        rounding: Rounding::Stochastic { seed },
        momentum: 0.9,
        stats: StatsMode::Exact,
    };
    let mut q = Quantizer::new(device, config).expect("quantizer");
    let buf = device.upload(&case.x).expect("upload");
    let layout = Layout::contiguous(&[case.x.len()]);
    (0..calls)
        .map(|_| {
            let saved = q.quantize(&TensorRef::new(&buf, &layout).expect("view")).expect("quantize");
            assert_eq!(saved.params().expect("params"), vec![case.params], "exact-mode parameters");
            rq::unpack_codes(&saved.codes().to_vec().expect("codes"), case.x.len(), case.bits)
        })
        .collect()
}

/// Codes of call `call` from the broken generator.
fn broken_codes(case: &Case, seed: u64, call: u64, fault: Fault) -> Vec<u32> {
    let device = Device::emulator();
    let x = device.upload(&case.x).expect("upload");
    let mut codes = device.upload(&vec![0xAAu8; case.x.len()]).expect("upload");
    let (Buffer::Host(xh), Buffer::Host(ch)) = (&x, &mut codes) else { panic!("emulator buffers are host buffers") };
    let args = BrokenRoundingArgs {
        codes: ch.as_mut_ptr(),
        x: xh.as_ptr(),
        n: case.x.len() as i64,
        params: case.params,
        seed,
        call,
        bits: case.bits as i32,
        fault: fault as i32,
    };
    // SAFETY: `codes` and `x` hold `n` elements each; the kernel writes codes[0..n) only.
    let status = unsafe { mesa_emu_broken_stochastic_rounding(&args) };
    assert_eq!(status, 0, "{:?}", emulator::take_report());
    codes.to_vec().expect("download").into_iter().map(u32::from).collect()
}

/// The round-up indicators `code − (T >> 16)`; an error when one is not 0 or 1.
fn indicators(case: &Case, codes: &[u32]) -> Result<Vec<u8>, String> {
    case.fixed
        .iter()
        .zip(codes)
        .enumerate()
        .map(|(i, (&t, &c))| match c.checked_sub(t >> 16) {
            Some(d @ (0 | 1)) => Ok(d as u8),
            _ => Err(format!("element {i}: code {c} for fixed position {t:#x} (not floor or floor + 1)")),
        })
        .collect()
}

/// Values on the grid never move: `T mod 2¹⁶ = 0` gives `code = T >> 16`, for every element.
fn check_on_grid(case: &Case, codes: &[u32]) -> Result<usize, String> {
    let mut on = 0usize;
    for (i, (&t, &c)) in case.fixed.iter().zip(codes).enumerate() {
        if t % (1 << 16) == 0 {
            on += 1;
            if c != t >> 16 {
                return Err(format!("on-grid element {i} (x = {}, code {}) moved to {c}", case.x[i], t >> 16));
            }
        }
    }
    Ok(on)
}

/// Mean indicator of every fraction within Z σ of the mean probability (module docs).
fn check_unbiased(case: &Case, ind: &[u8]) -> Result<(), String> {
    let levels = rq::levels(case.bits);
    let (lo, step) = (f64::from(case.params.offset), f64::from(case.params.scale));
    for (s, f) in FRACTIONS.iter().enumerate() {
        let r = case.segment(s);
        let n = r.len() as f64;
        let (mut mean_p, mut var, mut mean_up) = (0.0, 0.0, 0.0);
        for i in r {
            let p = f64::from(case.fixed[i] % (1 << 16)) / rq::ROUNDING_ONE;
            // the resolution: p against the exact fraction of the f32 value
            let t = (f64::from(case.x[i]) - lo) / step;
            let exact = t - t.floor();
            let resolution = 0.5 / rq::ROUNDING_ONE + 4.0 * 2f64.powi(-24) * t.max(1.0);
            assert!(
                (p - exact).abs() <= resolution || (exact - p).abs() > 1.0 - resolution,
                "element {i}: kernel fraction {p} vs exact {exact} (t = {t}, resolution {resolution})"
            );
            assert!(t < levels, "the test values stay inside the range");
            mean_p += p;
            var += p * (1.0 - p);
            mean_up += f64::from(ind[i]);
        }
        let sigma = var.sqrt() / n;
        let (mean_p, mean_up) = (mean_p / n, mean_up / n);
        if (mean_up - mean_p).abs() > Z * sigma {
            return Err(format!(
                "{} bits, fraction {f}: mean round-up {mean_up:.6e} vs {mean_p:.6e} ({:.1} sigma, sigma {sigma:.2e})",
                case.bits,
                (mean_up - mean_p).abs() / sigma
            ));
        }
        eprintln!(
            "  {} bits, fraction {f}: mean {mean_up:.6e}, expected {mean_p:.6e}, {:+.2} sigma",
            case.bits,
            (mean_up - mean_p) / sigma
        );
    }
    Ok(())
}

/// Sample correlation of two 0/1 sequences (0 when one is constant: no variation to correlate).
fn correlation(a: &[u8], b: &[u8]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().map(|&v| f64::from(v)).sum::<f64>() / n, b.iter().map(|&v| f64::from(v)).sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let (dx, dy) = (f64::from(x) - ma, f64::from(y) - mb);
        sab += dx * dy;
        saa += dx * dx;
        sbb += dy * dy;
    }
    if saa == 0.0 || sbb == 0.0 {
        return 0.0;
    }
    sab / (saa * sbb).sqrt()
}

/// Adjacent elements' indicators uncorrelated, in every fraction with p(1 − p) not tiny (the
/// segments at 1e-4 and 1 − 1e-4 have ~100 round-ups: their correlation is not normal).
fn check_adjacent(case: &Case, ind: &[u8]) -> Result<(), String> {
    for (s, f) in FRACTIONS.iter().enumerate().take(FRACTIONS.len() - 1).skip(1) {
        let r = case.segment(s);
        let seg = &ind[r];
        let bound = Z / ((seg.len() - 1) as f64).sqrt();
        let c = correlation(&seg[..seg.len() - 1], &seg[1..]);
        if c.abs() > bound {
            return Err(format!("{} bits, fraction {}: adjacent correlation {c:.4} > {bound:.4}", case.bits, f));
        }
    }
    Ok(())
}

/// One element's indicators in two calls uncorrelated (the same fractions).
fn check_calls(case: &Case, first: &[u8], second: &[u8]) -> Result<(), String> {
    for (s, f) in FRACTIONS.iter().enumerate().take(FRACTIONS.len() - 1).skip(1) {
        let r = case.segment(s);
        let bound = Z / (r.len() as f64).sqrt();
        let c = correlation(&first[r.clone()], &second[r]);
        if c.abs() > bound {
            return Err(format!("{} bits, fraction {}: call-to-call correlation {c:.4} > {bound:.4}", case.bits, f));
        }
    }
    Ok(())
}

fn with_checks<R>(checks: Checks, f: impl FnOnce() -> R) -> R {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (before, seed) = emulator::checks();
    if std::env::var_os("MESA_EMU_CHECK").is_none() {
        emulator::set_checks(checks, seed);
    }
    let r = f();
    emulator::set_checks(before, seed);
    r
}

fn fresh_seed(name: &str) -> u64 {
    let seed = common::rng(name).random::<u64>();
    eprintln!("{name}: generator seed {seed:#x}");
    seed
}

/// Random123's known-answer vectors (kat_vectors: counter 0, key 0) for the generator and its
/// round counts: 10 (dropout) and 7 (stochastic rounding).
#[test]
fn philox_known_answers() {
    assert_eq!(rq::philox4x32(0, 0, 10), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
    assert_eq!(rq::philox4x32(0, 0, 7), [0x5f6f_b709, 0x0d89_3f64, 0x4f12_1f81, 0x4f73_0a48]);
    assert_eq!(rq::philox4x32_10(0, 0), rq::philox4x32(0, 0, 10));
    // the bits of stochastic rounding: halves of the 7-round words, low half first
    let w = rq::philox4x32(0, 0, rq::ROUNDING_ROUNDS);
    for i in 0..8u64 {
        let word = w[(i / 2) as usize];
        assert_eq!(rq::rounding_bits(0, i), if i % 2 == 0 { word & 0xffff } else { word >> 16 });
    }
    assert_eq!(rq::rounding_bits(0, 8), rq::philox4x32(1, 0, 7)[0] & 0xffff);
}

/// Unbiasedness, on-grid values and adjacent independence at 8, 4 and 2 bits; call-to-call
/// independence at 8 bits (calls 0 and 1 of one Quantizer): 2²⁰ draws per fraction.
#[test]
fn unbiased_and_independent_at_every_width() {
    let seed = fresh_seed("sr_statistics");
    with_checks(Checks::ALL, || {
        let device = Device::emulator();
        for bits in [8u32, 4, 2] {
            // a step of 2^-6 and an offset on its grid: every on-grid value exact in f32
            let case = Case::new(bits, -1.25, 2f64.powi(-6), N);
            let calls = if bits == 8 { 2 } else { 1 };
            let codes = library_codes(&device, &case, seed ^ u64::from(bits), calls);
            let on = check_on_grid(&case, &codes[0]).unwrap_or_else(|e| panic!("{e}"));
            assert!(on > N, "{bits} bits: {on} elements on the grid (the grid segment and the ends)");
            let ind = indicators(&case, &codes[0]).unwrap_or_else(|e| panic!("{e}"));
            check_unbiased(&case, &ind).unwrap_or_else(|e| panic!("{e}"));
            check_adjacent(&case, &ind).unwrap_or_else(|e| panic!("{e}"));
            if calls == 2 {
                assert!(check_on_grid(&case, &codes[1]).is_ok());
                let next = indicators(&case, &codes[1]).unwrap_or_else(|e| panic!("{e}"));
                check_calls(&case, &ind, &next).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    });
}

/// Same seed and call counter: the same codes (a second Quantizer replays the first's calls);
/// the next call or another seed: other codes. On the dense path and on a strided view of the
/// same values (the codes do not depend on the path), with every emulator check.
#[test]
fn reproducible_from_seed_and_counter_with_every_check() {
    let seed = fresh_seed("sr_replay");
    with_checks(Checks::ALL, || replay(seed));
}

fn replay(seed: u64) {
    let device = Device::emulator();
    // a step that is no power of two: positions rounded in f32 (the kernel's, exactly)
    let case = Case::new(8, -0.5, 0.0049, 1 << 12);
    let a = library_codes(&device, &case, seed, 3);
    let b = library_codes(&device, &case, seed, 3);
    assert_eq!(a, b, "same seed and counter must give the same codes");
    assert_ne!(a[0], a[1], "the next call must give other codes");
    assert_ne!(a[0], library_codes(&device, &case, seed ^ 1, 1)[0], "another seed must give other codes");
    for (k, codes) in a.iter().enumerate() {
        check_on_grid(&case, codes).unwrap_or_else(|e| panic!("{e}"));
        indicators(&case, codes).unwrap_or_else(|e| panic!("{e}"));
        // the reference rule and generator, element by element (the f32 position on the
        // 2^-16 grid is the kernel's: exact)
        let key = seed.wrapping_add((k as u64).wrapping_mul(CALL_STRIDE));
        for (i, &c) in codes.iter().enumerate() {
            let expect = (case.fixed[i] + rq::rounding_bits(key, i as u64)) >> 16;
            assert_eq!(c, expect, "call {k}, element {i}");
        }
    }
    // a strided view of the same logical values (every second element of a buffer twice as
    // long): the strided kernel, the same codes
    let n = case.x.len();
    let spread: Vec<f32> = case.x.iter().flat_map(|&v| [v, 0.0]).collect();
    let buf = device.upload(&spread).expect("upload");
    let layout = Layout::strided(&[n], &[2], 0).expect("layout");
    let config = QuantConfig {
        bits: 8,
        grouping: Grouping::Tensor,
        rounding: Rounding::Stochastic { seed },
        momentum: 0.9,
        stats: StatsMode::Exact,
    };
    let mut q = Quantizer::new(&device, config).expect("quantizer");
    let saved = q.quantize(&TensorRef::new(&buf, &layout).expect("view")).expect("quantize");
    assert_eq!(rq::unpack_codes(&saved.codes().to_vec().expect("codes"), n, 8), a[0], "strided path");
}

/// Each break of the generator fails the statistic that exists to catch it, with the same
/// functions and bounds as the healthy runs above; the healthy broken kernel (no fault) gives
/// the library's codes bit for bit, so the harness itself is the library's arithmetic.
#[test]
fn each_broken_generator_fails_its_statistic() {
    let seed = fresh_seed("sr_broken");
    with_checks(Checks::ALL, || {
        let device = Device::emulator();
        let case = Case::new(8, -1.25, 2f64.powi(-6), N);
        let library = library_codes(&device, &case, seed, 2);
        assert_eq!(broken_codes(&case, seed, 0, Fault::None), library[0], "the harness is the library (call 0)");
        assert_eq!(broken_codes(&case, seed, 1, Fault::None), library[1], "the harness is the library (call 1)");
        let ind = |codes: &[u32]| indicators(&case, codes).unwrap_or_else(|e| panic!("{e}"));

        let constant = ind(&broken_codes(&case, seed, 0, Fault::ConstantUniform));
        let e = check_unbiased(&case, &constant).expect_err("a constant uniform must fail unbiasedness");
        eprintln!("constant uniform: {e}");

        let neighbour = ind(&broken_codes(&case, seed, 0, Fault::NeighbourBits));
        let e = check_adjacent(&case, &neighbour).expect_err("reused neighbour bits must fail adjacent independence");
        eprintln!("neighbour's bits: {e}");

        let first = ind(&broken_codes(&case, seed, 0, Fault::CounterNotAdvanced));
        let second = ind(&broken_codes(&case, seed, 1, Fault::CounterNotAdvanced));
        let e = check_calls(&case, &first, &second).expect_err("a counter not advanced must fail call independence");
        eprintln!("counter not advanced: {e}");

        let up_to_one = broken_codes(&case, seed, 0, Fault::UniformUpToOne);
        let e = check_on_grid(&case, &up_to_one).expect_err("a uniform reaching 1 must move on-grid values");
        eprintln!("uniform in (0, 1]: {e}");
    });
}
