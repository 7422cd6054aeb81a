//! Bitwise digests of every result of the activation-compression kernels (quantize and
//! dequantize, GELU, softmax, LayerNorm: forward outputs, codes, parameters, statistics,
//! backward outputs) on fixed data, for the contraction check of `.ci/run` and for the
//! GPU-vs-emulator comparison (docs/design.md, "Numerics that must agree between the builds").
//!
//! * `MESA_DIGEST_FILE=<path>`: the emulator's digests are written there, one `name hash`
//!   line per result. CI builds the emulator twice — FMA contraction off (the default) and
//!   `MESA_EMU_FP_CONTRACT=fast` (`-ffp-contract=fast -mfma`) — and fails when the two files
//!   differ: a difference means some kernel leaves a rounding to the compiler, and nvcc,
//!   which contracts by default, would then round differently from the emulator.
//! * On a GPU (the bundle), the results documented as bitwise equal across backends are
//!   compared with the emulator's: everything except what goes through `expf` or the hardware
//!   approximations `ex2.approx`/`rcp.approx`
//!   (GELU outputs and gradients, softmax outputs, codes and gradients), whose libraries
//!   differ by ulps (tests/fused.rs bounds those).
mod common;

use half::{bf16, f16};
use mesa_kernels::fused::{
    self, gelu_backward, gelu_backward_plain, gelu_forward, layer_norm_backward, layer_norm_forward, softmax_backward,
    softmax_forward, GeluBackwardPlain, LayerNormBackward, LayerNormForward, LayerNormGrads, SoftmaxInput,
};
use mesa_kernels::{
    Buffer, DType, Device, Element, GeluForm, Layout, QuantConfig, Quantizer, Rounding, SavedActivation, SoftmaxCodes,
    SoftmaxSave, StatsMode, Storage, TensorMut, TensorRef,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// One digest: the case's name, whether the docs promise it bitwise across backends, the hash.
struct Digest {
    name: String,
    cross_backend: bool,
    hash: u64,
}

/// FNV-1a over the bits of every value.
fn fnv(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The bits of a value, every NaN counted as one (NaN payloads and signs differ between GPUs
/// and CPUs and mean nothing here).
fn canonical(v: f64) -> u64 {
    if v.is_nan() {
        u64::MAX
    } else {
        v.to_bits()
    }
}

struct Recorder {
    out: Vec<Digest>,
}

impl Recorder {
    fn values<T: Element>(&mut self, name: String, cross_backend: bool, b: &Buffer<T>) {
        let v = b.to_vec().expect("download");
        self.out.push(Digest { name, cross_backend, hash: fnv(v.iter().map(|x| canonical(x.to_f64()))) });
    }
    fn saved(&mut self, name: &str, cross_backend: bool, s: &SavedActivation) {
        let codes = s.codes().to_vec().expect("codes");
        let params = s.params().expect("params");
        let words = codes
            .iter()
            .map(|&c| u64::from(c))
            .chain(params.iter().flat_map(|p| [canonical(f64::from(p.offset)), canonical(f64::from(p.scale))]))
            .chain(std::iter::once(u64::from(s.nonfinite_count().expect("count"))));
        self.out.push(Digest { name: format!("{name}/codes+params"), cross_backend, hash: fnv(words) });
    }
}

fn data<T: Element>(rng: &mut StdRng, n: usize, center: f64, spread: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(center + spread * (rng.random::<f64>() * 2.0 - 1.0))).collect()
}

fn run_all(device: &Device) -> Vec<Digest> {
    let mut r = Recorder { out: Vec::new() };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        match dtype {
            DType::F32 => cases::<f32>(device, &mut r),
            DType::F16 => cases::<f16>(device, &mut r),
            DType::BF16 => cases::<bf16>(device, &mut r),
        }
    }
    r.out
}

fn cases<T: Element + Storage>(device: &Device, r: &mut Recorder) {
    let dt = format!("{:?}", T::DTYPE);
    let mut rng = StdRng::seed_from_u64(0x0D16_E575 ^ T::DTYPE as u64);
    // quantize + dequantize: widths, roundings, running estimate over two batches
    for bits in [8u32, 4, 2] {
        for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 99 }] {
            let shape = [2, 4, 33, 8];
            let l = Layout::contiguous(&shape);
            let config = QuantConfig { bits, rounding, ..QuantConfig::per_head(1) };
            let mut q = Quantizer::new(device, config).expect("q");
            for batch in 0..2 {
                let x: Vec<T> = data(&mut rng, 2 * 4 * 33 * 8, 0.3 * f64::from(batch), 3.0);
                let xb = device.upload(&x).expect("up");
                let s = q.quantize(&TensorRef::new(&xb, &l).expect("view")).expect("quantize");
                let name = format!("quantize/{dt}/{bits}b/{rounding:?}/batch{batch}");
                r.saved(&name, true, &s);
                let mut out = device.alloc_zeros::<T>(x.len()).expect("alloc");
                s.dequantize(device, &mut TensorMut::new(&mut out, &l).expect("view")).expect("dequantize");
                r.values(format!("{name}/dequantized"), true, &out);
            }
        }
    }
    // GELU: forward with codes, backward from codes, plain backward
    for form in [GeluForm::Erf, GeluForm::Tanh] {
        let shape = [3, 7, 40];
        let n = 3 * 7 * 40;
        let l = Layout::contiguous(&shape);
        let x: Vec<T> = data(&mut rng, n, -1.0, 7.0);
        let dy: Vec<T> = data(&mut rng, n, 0.0, 1.0);
        let (xb, dyb) = (device.upload(&x).expect("up"), device.upload(&dy).expect("up"));
        let config = QuantConfig { bits: 4, rounding: Rounding::Stochastic { seed: 5 }, ..fused::channel_groups(2, 4) };
        let mut q = Quantizer::new(device, config).expect("q");
        let mut y = device.alloc_zeros::<T>(n).expect("alloc");
        let s = gelu_forward(
            device,
            &mut q,
            form,
            &TensorRef::new(&xb, &l).expect("v"),
            &mut TensorMut::new(&mut y, &l).expect("v"),
        )
        .expect("gelu_forward");
        let name = format!("gelu/{dt}/{form:?}");
        r.values(format!("{name}/y"), false, &y);
        r.saved(&name, true, &s);
        let mut dx = device.alloc_zeros::<T>(n).expect("alloc");
        gelu_backward(
            device,
            form,
            &s,
            &TensorRef::new(&dyb, &l).expect("v"),
            &mut TensorMut::new(&mut dx, &l).expect("v"),
        )
        .expect("gelu_backward");
        r.values(format!("{name}/dx"), false, &dx);
        let mut dxp = device.alloc_zeros::<T>(n).expect("alloc");
        let plain = GeluBackwardPlain {
            form,
            x: &TensorRef::new(&xb, &l).expect("v"),
            dy: &TensorRef::new(&dyb, &l).expect("v"),
        };
        gelu_backward_plain(device, &plain, &mut TensorMut::new(&mut dxp, &l).expect("v")).expect("plain");
        r.values(format!("{name}/dx_plain"), false, &dxp);
    }
    // softmax: fused codes (rows on a byte) and the separate pass (197 at 4 bits), warp,
    // block and streaming rows, companded and linear codes, nearest and stochastic
    for (rows, cols, bits) in [(12usize, 64usize, 8u32), (6, 197, 4), (2, 2000, 2), (1, 5000, 8)] {
        for codes in [SoftmaxCodes::Sqrt, SoftmaxCodes::Linear] {
            let rounding = if bits == 4 { Rounding::Stochastic { seed: 3 } } else { Rounding::Nearest };
            let l = Layout::contiguous(&[rows / 2, 2, cols]);
            let n = rows * cols;
            let x: Vec<T> = data(&mut rng, n, 0.0, 4.0);
            let dy: Vec<T> = data(&mut rng, n, 0.0, 1.0);
            let (xb, dyb) = (device.upload(&x).expect("up"), device.upload(&dy).expect("up"));
            let save = SoftmaxSave { bits, codes, rounding, ..SoftmaxSave::per_head(1) };
            let mut y = device.alloc_zeros::<T>(n).expect("alloc");
            let s = softmax_forward(
                device,
                &save,
                &SoftmaxInput { x: &TensorRef::new(&xb, &l).expect("v"), mask: None },
                &mut TensorMut::new(&mut y, &l).expect("v"),
            )
            .expect("softmax_forward");
            let name = format!("softmax/{dt}/{rows}x{cols}/{bits}b/{codes:?}");
            r.values(format!("{name}/y"), false, &y);
            r.saved(&name, false, &s);
            let mut dx = device.alloc_zeros::<T>(n).expect("alloc");
            softmax_backward(
                device,
                &s,
                &TensorRef::new(&dyb, &l).expect("v"),
                &mut TensorMut::new(&mut dx, &l).expect("v"),
            )
            .expect("softmax_backward");
            r.values(format!("{name}/dx"), false, &dx);
        }
    }
    // LayerNorm: warp (64, 385), block (2500) and streaming (5000) rows, 7 columns at 4 bits
    // (separate code pass), rows near 1e20 (scaled path); y, mean, rstd, codes, dx, dw, db
    for (rows, cols, bits, center, spread) in [
        (9usize, 64usize, 8u32, 0.5, 3.0),
        (5, 385, 4, -2.0, 1.0),
        (3, 2500, 8, 1.0, 2.0),
        (2, 5000, 2, 0.0, 1.0),
        (6, 7, 4, 0.0, 1.0),
        (3, 64, 8, 1e20, 1e19),
    ] {
        if center > 1e4 && T::DTYPE == DType::F16 {
            continue; // beyond f16's range
        }
        let l = Layout::contiguous(&[rows, cols]);
        let n = rows * cols;
        let x: Vec<T> = data(&mut rng, n, center, spread);
        let w: Vec<T> = data(&mut rng, cols, 1.0, 0.5);
        let b: Vec<T> = data(&mut rng, cols, 0.0, 0.5);
        let dy: Vec<T> = data(&mut rng, n, 0.0, 1.0);
        let (xb, wb, bb, dyb) = (
            device.upload(&x).expect("up"),
            device.upload(&w).expect("up"),
            device.upload(&b).expect("up"),
            device.upload(&dy).expect("up"),
        );
        let (wv, bv) =
            (TensorRef::contiguous(&wb, &[cols]).expect("w"), TensorRef::contiguous(&bb, &[cols]).expect("b"));
        let config = QuantConfig { bits, stats: StatsMode::Exact, ..QuantConfig::per_tensor() };
        let mut q = Quantizer::new(device, config).expect("q");
        let mut y = device.alloc_zeros::<T>(n).expect("alloc");
        let args =
            LayerNormForward { x: &TensorRef::new(&xb, &l).expect("v"), weight: Some(&wv), bias: Some(&bv), eps: 1e-5 };
        let s = layer_norm_forward(device, &mut q, &args, &mut TensorMut::new(&mut y, &l).expect("v")).expect("ln fwd");
        let name = format!("layernorm/{dt}/{rows}x{cols}/{bits}b/{center:e}");
        r.values(format!("{name}/y"), true, &y);
        r.values(format!("{name}/mean"), true, s.mean());
        r.values(format!("{name}/rstd"), true, s.rstd());
        r.saved(&name, true, s.xhat());
        let mut dx = device.alloc_zeros::<T>(n).expect("alloc");
        let mut dw = device.alloc_zeros::<f32>(cols).expect("alloc");
        let mut db = device.alloc_zeros::<f32>(cols).expect("alloc");
        let dyv = TensorRef::new(&dyb, &l).expect("v");
        layer_norm_backward(
            device,
            &LayerNormBackward { saved: &s, weight: Some(&wv), dy: &dyv },
            LayerNormGrads {
                dx: &mut TensorMut::new(&mut dx, &l).expect("v"),
                dweight: &mut TensorMut::contiguous(&mut dw, &[cols]).expect("v"),
                dbias: &mut TensorMut::contiguous(&mut db, &[cols]).expect("v"),
            },
        )
        .expect("ln bwd");
        r.values(format!("{name}/dx"), true, &dx);
        r.values(format!("{name}/dweight"), true, &dw);
        r.values(format!("{name}/dbias"), true, &db);
    }
}

#[test]
fn digests_of_every_compression_kernel_result() {
    let emu = run_all(&common::emulator());
    let text: String = emu.iter().map(|d| format!("{} {:016x}\n", d.name, d.hash)).collect();
    eprintln!("emulator built with FMA contraction {}: {} digests", mesa_kernels_sys::EMU_FP_CONTRACT, emu.len());
    if let Some(path) = std::env::var_os("MESA_DIGEST_FILE") {
        std::fs::write(&path, &text).expect("write MESA_DIGEST_FILE");
    }
    // the same twice: nothing in these results depends on scheduling
    let again = run_all(&common::emulator());
    assert!(emu.iter().zip(&again).all(|(a, b)| a.hash == b.hash), "emulator results are not reproducible");
    if let Some(gpu) = common::cuda_only("digests_of_every_compression_kernel_result (GPU vs emulator)") {
        let g = run_all(&gpu);
        let differ: Vec<&str> = emu
            .iter()
            .zip(&g)
            .filter(|(e, g)| e.cross_backend && e.hash != g.hash)
            .map(|(e, _)| e.name.as_str())
            .collect();
        assert!(
            differ.is_empty(),
            "results documented as bitwise equal differ between GPU and emulator:\n{}",
            differ.join("\n")
        );
    }
}
