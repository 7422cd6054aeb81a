//! Shared pieces of the mesa-candle tests: the device, seeded data, the f64 reference's
//! gradients, unit roundoffs.
#![allow(dead_code)]
use candle_core::{DType, Device, Tensor, Var};

/// The device the tests run our ops on. A build with feature `cuda` uses candle's CUDA
/// device 0 when one is usable (our kernels on candle's stream; they need the nvcc build,
/// so no `MESA_CUDA_DISABLE`); otherwise the CPU (the host emulation), saying that the CUDA
/// run was skipped. With `MESA_REQUIRE_GPU=1` a skipped CUDA run fails instead. (A `cuda`
/// build links libcuda and cuBLAS: without them its test binaries do not start at all.)
/// The references always run on the CPU in f64.
pub fn device() -> Device {
    let require = std::env::var("MESA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    #[cfg(feature = "cuda")]
    let why = match Device::new_cuda(0) {
        Ok(d) => return d,
        Err(e) => format!("no usable CUDA device 0 ({e})"),
    };
    #[cfg(not(feature = "cuda"))]
    let why = "built without feature `cuda` (cargo test -p mesa-candle --features cuda)".to_string();
    assert!(!require, "MESA_REQUIRE_GPU=1 but the CUDA run was skipped: {why}");
    eprintln!("CUDA run skipped: {why}; running on the CPU (host emulation)");
    Device::Cpu
}

/// Runs candle's CPU products on the calling thread, for tests that count heap bytes. The
/// counting allocator sees every thread, and gemm gives each thread that first runs a
/// product a packing buffer the size of the L2 cache (1 MiB here), kept in a thread-local
/// until the thread ends: with a pool of workers, one that first runs a product during a
/// measurement (which worker does depends on the schedule) shows as a MiB alive after the
/// forward. With `RAYON_NUM_THREADS=1` candle calls gemm without parallelism and rayon's
/// pool has one worker, so the warm-up allocates every such buffer. Call it first, before
/// any candle op (the variable is read when rayon's pool starts and at every product).
pub fn single_threaded_candle() {
    std::env::set_var("RAYON_NUM_THREADS", "1");
}

/// SplitMix64: a seeded stream of uniforms and Gaussians (fresh seed per run unless
/// `MESA_TEST_SEED` is set; the seed is printed so a failure can be replayed).
pub struct Rng(u64);

impl Rng {
    /// Also turns the emulator's checks on (every test starts here), as the kernels' own suite
    /// does: `docs/emulator.md`.
    pub fn new(test: &str) -> Self {
        mesa_kernels::emulator::enable_for_tests();
        let seed = std::env::var("MESA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        eprintln!("{test}: MESA_TEST_SEED={seed}");
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn gauss(&mut self) -> f64 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// A CPU tensor of `shape` in `dtype` with entries `mean + std·N(0,1)`, rounded to
    /// `dtype`. f64 entries are f32 values: the ops compute f64 in f32 (their inputs rounded
    /// to f32 once, `docs/candle.md`), so on these inputs the f64 path differs from the f32
    /// one only by its casts, and the f32 bounds hold; what the rounding of general f64
    /// inputs does is checked exactly by `tests/ops.rs`, `f64_is_computed_in_f32`.
    pub fn tensor(&mut self, shape: &[usize], mean: f64, std: f64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| mean + std * self.gauss()).collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        let t = if dtype == DType::F64 { t.to_dtype(DType::F32).unwrap() } else { t };
        t.to_dtype(dtype).unwrap()
    }
    /// [`Rng::tensor`] with general f64 entries (not rounded to f32).
    pub fn tensor_f64(&mut self, shape: &[usize], mean: f64, std: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| mean + std * self.gauss()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

/// Unit roundoff (half an ulp at 1) of the precision an op's results are computed and
/// stored in: the dtype's own, except f64, which the ops compute in f32 (`docs/candle.md`).
pub fn unit(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-53),
    }
}

/// Gradients of `Σ f(inputs) ⊙ dy` with respect to every input, by candle's autograd, on
/// the CPU (the references). `inputs` are made variables of their own dtype; the results
/// are f64 host vectors.
pub fn grads(
    inputs: &[Tensor],
    dy: &Tensor,
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    grads_on(&Device::Cpu, inputs, dy, f)
}

/// [`grads`] with `inputs` and `dy` moved to `device` first (our ops on [`device`]).
pub fn grads_on(
    device: &Device,
    inputs: &[Tensor],
    dy: &Tensor,
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let dy = dy.to_device(device).unwrap();
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(&t.to_device(device).unwrap()).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts).unwrap();
    let loss = (y.to_dtype(DType::F64).unwrap() * dy.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap();
    assert!(y.device().same_device(device), "the op's result is on the device of its inputs");
    let store = loss.backward().unwrap();
    let g = ts.iter().map(|t| flat(&store.get(t).expect("a gradient for every input").clone())).collect();
    (flat(&y), g)
}

/// A tensor's values as f64, in logical order.
pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// The same values as f64 CPU tensors (the reference's inputs: exactly the dtype-rounded
/// values).
pub fn to_f64(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F64).unwrap()).collect()
}

/// Asserts `|got − want| ≤ bound` elementwise, naming the worst element.
pub fn assert_within(what: &str, got: &[f64], want: &[f64], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0usize, 0f64);
    for i in 0..got.len() {
        let err = (got[i] - want[i]).abs();
        assert!(got[i].is_finite(), "{what}[{i}] = {} is not finite", got[i]);
        let ratio = err / bound[i].max(f64::MIN_POSITIVE);
        if ratio > worst.1 {
            worst = (i, ratio);
        }
    }
    let i = worst.0;
    assert!(
        worst.1 <= 1.0,
        "{what}[{i}]: got {}, want {}, |err| = {:.3e} > bound {:.3e}",
        got[i],
        want[i],
        (got[i] - want[i]).abs(),
        bound[i]
    );
    eprintln!("{what}: worst error / bound = {:.3}", worst.1);
}

/// f32's unit roundoff, `2⁻²⁴`.
const U32: f64 = 1.0 / 16_777_216.0;

/// `x̂` and `rstd` of each row, in f64.
pub fn normalized(x: &[f64], cols: usize, eps: f64, center: bool) -> (Vec<f64>, Vec<f64>) {
    let mut xhat = vec![0.0; x.len()];
    let mut rstd = vec![0.0; x.len() / cols];
    for (r, row) in x.chunks(cols).enumerate() {
        let mean = if center { row.iter().sum::<f64>() / cols as f64 } else { 0.0 };
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
        rstd[r] = 1.0 / (var + eps).sqrt();
        for c in 0..cols {
            xhat[r * cols + c] = (row[c] - mean) * rstd[r];
        }
    }
    (xhat, rstd)
}

/// The decoding terms of a norm's gradients: `|Δdx_i| ≤ rstd·(h|m| + |x̂_i|·h·mean|g| +
/// h²·mean|g|)`, `m = mean(g·x̂)`, `g = dy·w` (the centring term of LayerNorm has no `x̂`);
/// `|Δdw_j| ≤ Σ_rows |dy_j|·h`; plus the f32 sums over a row (`C·u₃₂` of the magnitudes).
pub struct NormBounds {
    pub dx: Vec<f64>,
    pub dw: Vec<f64>,
    pub db: Vec<f64>,
}

#[allow(clippy::needless_range_loop)] // rows and columns index four arrays at once
pub fn norm_bounds(xhat: &[f64], rstd: &[f64], w: &[f64], dy: &[f64], h: f64) -> NormBounds {
    let cols = w.len();
    let rows = xhat.len() / cols;
    let mut dx = vec![0.0; xhat.len()];
    let (mut dw, mut db) = (vec![0.0; cols], vec![0.0; cols]);
    for r in 0..rows {
        let i0 = r * cols;
        let g: Vec<f64> = (0..cols).map(|c| dy[i0 + c] * w[c]).collect();
        let m = (0..cols).map(|c| g[c] * xhat[i0 + c]).sum::<f64>() / cols as f64;
        let mg = g.iter().map(|v| v.abs()).sum::<f64>() / cols as f64;
        for c in 0..cols {
            let x = xhat[i0 + c].abs();
            let arith = 8.0 * cols as f64 * U32 * (g[c].abs() + mg * (1.0 + x));
            dx[i0 + c] = rstd[r] * (h * m.abs() + x * h * mg + h * h * mg + arith);
            dw[c] += dy[i0 + c].abs() * (h + 4.0 * rows as f64 * U32 * (1.0 + x));
            db[c] += dy[i0 + c].abs() * 4.0 * rows as f64 * U32;
        }
    }
    NormBounds { dx, dw, db }
}
