//! Helpers of the integration tests: deterministic data, tensors from and to `Vec<f32>`.
#![allow(dead_code)]
use burn::tensor::{DType, Device, Tensor, TensorData};

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
    [Device::flex().autodiff(), Device::flex().autodiff().gradient_checkpointing()]
}
