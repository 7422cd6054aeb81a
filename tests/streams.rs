//! The stream contract (crate docs, `docs/design.md`): an op runs on its device's stream; a
//! buffer owned by another stream is ordered by events both ways, whether or not its context
//! tracks events (candle's default device does not), so it may be dropped right after the
//! call. Plus the one-tensor-view promise: every kind of memory becomes the same view.
//!
//! Tolerance: codes from exact statistics with round-to-nearest decode within half a step
//! (`scale / 2`, Mesa Eq. 2) of the input; the f32 arithmetic of the decode (`fmaf`) adds at
//! most one ulp of the largest magnitude, covered by `+ 2 ulp(max|x|)`.
mod common;

use mesa_kernels::{
    reference, Device, Grouping, Layout, QuantConfig, Quantizer, RawDeviceSlice, StatsMode, TensorMut, TensorRef,
};
use rand::RngExt;

fn exact_config() -> QuantConfig {
    QuantConfig { grouping: Grouping::Tensor, stats: StatsMode::Exact, ..QuantConfig::per_tensor() }
}

/// Every decoded value within half a step of the input.
fn assert_within_half_step(host: &[f32], decoded: &[f32], scale: f32, what: &str) {
    let max = host.iter().fold(0f32, |m, v| m.max(v.abs()));
    let tol = 0.5 * f64::from(scale) + 2.0 * f64::from(max) * f64::from(f32::EPSILON);
    let mut worst = (0usize, 0f64);
    for (i, (a, b)) in host.iter().zip(decoded).enumerate() {
        let e = (f64::from(*a) - f64::from(*b)).abs();
        // a NaN error counts as the worst
        if e.is_nan() || (e > worst.1 && !worst.1.is_nan()) {
            worst = (i, e);
        }
    }
    // `<=` is false for a NaN error
    assert!(worst.1 <= tol, "{what}: element {} decodes {} away from its input (tolerance {tol})", worst.0, worst.1);
}

/// A buffer written on stream A, quantized on stream B, dropped at once, its memory then
/// reused on A: the codes must be those of the data A wrote. Run with event tracking on
/// (cudarc's default) and off (candle's default CUDA device). GPU only.
#[test]
fn buffer_of_another_stream_is_ordered_and_dropped_safely() {
    let Some(probe) = common::cuda_only("buffer_of_another_stream_is_ordered_and_dropped_safely") else {
        return;
    };
    let ctx = probe.stream().expect("a CUDA device has a stream").context().clone();
    let n = 1usize << 24; // 64 MiB of f32: a copy long enough to race with a kernel
    let mut rng = common::rng("cross_stream");
    let host: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    for tracked in [true, false] {
        if !tracked {
            // SAFETY: the slices below are synchronised by the op under test (that is what
            // this test checks) and by the explicit synchronisations at the end.
            unsafe { ctx.disable_event_tracking() };
        }
        let writer = ctx.new_stream().expect("stream A");
        let device = Device::from_stream(ctx.new_stream().expect("stream B")).expect("device on B");
        let mut x = writer.alloc_zeros::<f32>(n).expect("alloc on A");
        writer.memcpy_htod(&host, &mut x).expect("copy on A");
        let mut quantizer = Quantizer::new(&device, exact_config()).expect("quantizer");
        let saved = quantizer.quantize(&TensorRef::contiguous(&x, &[n]).expect("view")).expect("quantize on B");
        drop(x); // freed on A: must wait for the kernel on B
        let junk = writer.clone_htod(&vec![f32::NAN; n]).expect("reuse on A");
        let mut decoded = device.alloc_zeros::<f32>(n).expect("alloc");
        saved.dequantize(&device, &mut TensorMut::contiguous(&mut decoded, &[n]).expect("view")).expect("decode");
        device.synchronize().expect("sync B");
        writer.synchronize().expect("sync A");
        drop(junk);
        let what = if tracked { "event tracking on" } else { "event tracking off" };
        assert_eq!(saved.nonfinite_count().expect("count"), 0, "{what}: the kernel read reused memory");
        let p = saved.params().expect("params")[0];
        assert_within_half_step(&host, &decoded.to_vec().expect("read back"), p.scale, what);
        // the codes themselves against a host quantization with the stored parameters; a
        // position within 1e-3 of a rounding tie may round either way in f32
        let codes = reference::quant::unpack_codes(&saved.codes().to_vec().expect("codes"), n, 8);
        let (offset, scale) = (f64::from(p.offset), f64::from(p.scale));
        let wrong = host
            .iter()
            .zip(&codes)
            .filter(|&(&x, &c)| {
                let t = reference::quant::position(f64::from(x), offset, scale);
                let near_tie = ((t - t.floor()) - 0.5).abs() < 1e-3;
                !near_tie && c != reference::quant::encode_nearest(f64::from(x), offset, scale, 8)
            })
            .count();
        assert_eq!(wrong, 0, "{what}: {wrong} codes differ from the host quantization");
        if !tracked {
            // SAFETY: restores cudarc's default for later tests in this process.
            unsafe { ctx.enable_event_tracking() };
        }
    }
}

/// A host sub-slice, a whole host buffer and a raw pointer to the same elements are one
/// tensor view: the same codes, within half a step of the input (emulator; on CUDA the
/// raw-pointer form of a cudarc buffer).
#[test]
fn every_kind_of_memory_is_one_view() {
    let mut rng = common::rng("every_kind_of_memory_is_one_view");
    let device = common::emulator();
    let full: Vec<f32> = (0..3 + 4 * 37).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let layout = Layout::contiguous(&[4, 37]);
    let sub = &full[3..];
    let mut q = Quantizer::new(&device, exact_config()).expect("quantizer");
    let a = q.quantize(&TensorRef::new(sub, &layout).expect("sub-slice view")).expect("sub-slice");
    let offset = Layout::strided(&[4, 37], &[37, 1], 3).expect("layout");
    let b = q.quantize(&TensorRef::new(&full, &offset).expect("offset view")).expect("offset view");
    // SAFETY: `full` outlives the call and nothing writes it meanwhile.
    let raw = unsafe { RawDeviceSlice::<f32>::new(sub.as_ptr() as u64, sub.len()) };
    let c = q.quantize(&TensorRef::new(&raw, &layout).expect("raw view")).expect("raw pointer");
    let codes = a.codes().to_vec().expect("codes");
    assert_eq!(codes, b.codes().to_vec().expect("codes"), "offset view differs from the sub-slice");
    assert_eq!(codes, c.codes().to_vec().expect("codes"), "raw pointer differs from the sub-slice");
    let mut out = vec![0f32; sub.len()];
    a.dequantize(&device, &mut TensorMut::new(&mut out[..], &layout).expect("out")).expect("decode");
    assert_within_half_step(sub, &out, a.params().expect("params")[0].scale, "sub-slice");
    // a view past the end of the sub-slice is an error at construction, not a read
    let too_long = Layout::strided(&[4, 37], &[37, 1], 1).expect("layout");
    assert!(matches!(TensorRef::new(sub, &too_long), Err(mesa_kernels::Error::BufferTooShort { .. })));
}

/// The properties benches size their working sets from are queried, not written in: the
/// emulation says it has no L2 or device memory; a GPU reports an L2, SMs, memory and clock
/// that an sm_80+ part has (every such part has ≥ 1 MB of L2, ≥ 1 GB and ≥ 1 SM).
#[test]
fn device_properties_are_queried() {
    let emu = Device::emulator().properties().expect("emulator properties");
    assert_eq!(emu.name, "host emulation");
    assert_eq!((emu.compute_capability, emu.l2_cache_bytes, emu.memory_bytes, emu.clock_khz), (None, 0, 0, 0));
    assert!(emu.multiprocessors >= 1);
    let Some(gpu) = common::cuda_only("device_properties_are_queried (GPU part)") else {
        return;
    };
    let p = gpu.properties().expect("GPU properties");
    let (major, _) = p.compute_capability.expect("a GPU has a compute capability");
    assert!(major >= 8, "{p:?}");
    assert!(
        p.multiprocessors >= 1 && p.l2_cache_bytes >= 1 << 20 && p.memory_bytes >= 1 << 30 && p.clock_khz > 0,
        "{p:?}"
    );
}
