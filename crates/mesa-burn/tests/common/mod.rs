//! Helpers of the integration tests: deterministic data, tensors from and to `Vec<f32>`.
//! Making a tensor or an autodiff device turns the emulator's checks on (every check, unless
//! `MESA_EMU_CHECK` says otherwise; docs/emulator.md), as the main workspace's tests do.
#![allow(dead_code)]
use burn::tensor::{DType, Device, Tensor, TensorData};
use mesa_burn::GeluForm;
use mesa_kernels::reference::fused as reference;

/// f32's unit roundoff, 2^-24.
pub const U: f64 = 1.0 / 16_777_216.0;

/// Deterministic values in `[lo, hi)` (a 64-bit LCG; the tests need spread, not quality).
pub fn data(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            lo + (hi - lo) * u
        })
        .collect()
}

/// A tensor of `shape` holding `v`, cast to `dtype`.
pub fn tensor<const D: usize>(v: &[f32], shape: [usize; D], dtype: DType, device: &Device) -> Tensor<D> {
    mesa_kernels::emulator::enable_for_tests();
    Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), device).cast(dtype)
}

/// The values of `t` as f32.
pub fn values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone().into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 data")
}

/// `x` rounded to `dtype` and back (what a tensor of that dtype holds).
pub fn rounded(v: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        DType::BF16 => v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
        _ => v.to_vec(),
    }
}

/// The quantization step of per-tensor codes over `v`: `(max − min)/(2^bits − 1)`.
pub fn step(v: &[f32], bits: u32) -> f64 {
    let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x as f64), hi.max(x as f64)));
    (hi - lo) / f64::from((1u32 << bits) - 1)
}

/// Asserts `|got_i − want_i| ≤ bound_i` for every element, naming the worst one.
pub fn assert_within(what: &str, got: &[f32], want: &[f32], bound: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    // (index, |Δ|/bound, |Δ|, bound) of the element closest to its bound
    let mut worst = (0usize, -1.0f64, 0.0f64, 0.0f64);
    for i in 0..got.len() {
        let d = (got[i] as f64 - want[i] as f64).abs();
        let b = bound(i);
        assert!(d <= b, "{what}[{i}]: |{} − {}| = {d:e} > bound {b:e}", got[i], want[i]);
        if d / b > worst.1 {
            worst = (i, d / b, d, b);
        }
    }
    eprintln!("{what}: worst |Δ|/bound = {:.3} at {} ({:e} / {:e})", worst.1, worst.0, worst.2, worst.3);
}

/// The two autodiff devices of Flex: no checkpointing and balanced checkpointing.
pub fn autodiff_devices() -> [Device; 2] {
    mesa_kernels::emulator::enable_for_tests();
    [Device::flex().autodiff(), Device::flex().autodiff().gradient_checkpointing()]
}

/// `max |gelu''|` over the line, from the f64 reference by central differences (the
/// Lipschitz constant of `gelu'`; 2φ(0) ≈ 0.798 for the erf form), with 1 % margin for the
/// grid.
pub fn gelu_second_derivative_bound(form: GeluForm) -> f64 {
    let h = 1e-4;
    let mut m = 0.0f64;
    let mut x = -12.0;
    while x <= 12.0 {
        let d2 = (reference::gelu_derivative(x + h, form) - reference::gelu_derivative(x - h, form)) / (2.0 * h);
        m = m.max(d2.abs());
        x += 1e-3;
    }
    m * 1.01
}

/// f32 error of one GELU or GELU' evaluation at `x` (value magnitude ≤ max(|x|, 1.2)): about
/// 8 roundings of size U, the erf/tanh argument's rounding amplified by its slope (≤ |x|
/// relative), doubled for the two implementations compared.
pub fn gelu_f32_error(x: f64) -> f64 {
    2.0 * U * (8.0 * x.abs().max(1.2) + x * x)
}

/// Linear attention's magnitudes (causal, normalised, `q`, `k` positive so every `A_ts = q_t·k_s`
/// and `g_t = Σ_{s≤t} A_ts + eps` is positive): each output and gradient's formula evaluated
/// on absolute values (Higham's Σ|terms|), `[out, dq, dk, dv]`, for `q, k: [BH, L, M]`,
/// `v, c (= dout): [BH, L, D]`.
pub fn linear_attention_magnitudes(
    q64: &[f64],
    k64: &[f64],
    v64: &[f64],
    c64: &[f64],
    (bhs, l, m, d): (usize, usize, usize, usize),
    eps: f64,
) -> [Vec<f64>; 4] {
    let (mut m_out, mut m_dq, mut m_dk, mut m_dv) =
        (vec![0.0; v64.len()], vec![0.0; q64.len()], vec![0.0; k64.len()], vec![0.0; v64.len()]);
    for bh in 0..bhs {
        let qi = |t: usize, j: usize| q64[(bh * l + t) * m + j];
        let ki = |s: usize, j: usize| k64[(bh * l + s) * m + j];
        let vi = |s: usize, j: usize| v64[(bh * l + s) * d + j];
        let ci = |t: usize, j: usize| c64[(bh * l + t) * d + j];
        let at = |t: usize, s: usize| (0..m).map(|j| qi(t, j) * ki(s, j)).sum::<f64>();
        for t in 0..l {
            let g = (0..=t).map(|s| at(t, s)).sum::<f64>() + eps;
            let num_abs: Vec<f64> = (0..d).map(|j| (0..=t).map(|s| at(t, s) * vi(s, j).abs()).sum::<f64>()).collect();
            for j in 0..d {
                m_out[(bh * l + t) * d + j] = num_abs[j] / g;
            }
            let dden = (0..d).map(|j| ci(t, j).abs() * num_abs[j]).sum::<f64>() / (g * g);
            for s in 0..=t {
                let da = (0..d).map(|j| ci(t, j).abs() * vi(s, j).abs()).sum::<f64>() / g + dden;
                for j in 0..m {
                    m_dq[(bh * l + t) * m + j] += da * ki(s, j);
                    m_dk[(bh * l + s) * m + j] += da * qi(t, j);
                }
                for j in 0..d {
                    m_dv[(bh * l + s) * d + j] += at(t, s) * ci(t, j).abs() / g;
                }
            }
        }
    }
    [m_out, m_dq, m_dk, m_dv]
}
