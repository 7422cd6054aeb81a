//! Saved activations in memory the caller owns (issue 42, "Codes in memory the caller owns"):
//! the `_to` producers and `_view` consumers against the owned path (`SavedActivation`),
//! bit for bit, over dtypes, bit widths, roundings and both statistics paths; and the typed
//! errors for buffers that are too small, too large, misaligned, not dense, or overlapping.
//!
//! The caller's buffers are placed at an offset inside larger, poisoned allocations, so a
//! kernel that ignored the view's offset or wrote past its end shows up in the bytes around
//! the view (which must stay poisoned) as well as in the parity.
mod common;

use half::{bf16, f16};
use mesa_kernels::fused::{
    gelu_backward, gelu_backward_view, gelu_forward, gelu_forward_to, layer_norm_backward, layer_norm_backward_view,
    layer_norm_forward, layer_norm_forward_to, softmax_backward, softmax_backward_view, softmax_forward,
    softmax_forward_to, swiglu_backward, swiglu_backward_view, swiglu_forward, swiglu_forward_to, GeluForm,
    LayerNormBackward, LayerNormBackwardView, LayerNormForward, LayerNormGrads, LayerNormSaveMut, SoftmaxCodes,
    SoftmaxInput, SoftmaxSave, SwigluGrads, SwigluInput, SwigluQuantizers, SwigluSaveMut, SwigluSavedView,
};
use mesa_kernels::rope::{rope_forward_save, rope_forward_save_to, RopeConfig, RopePairing};
use mesa_kernels::{
    saved_sizes, Buffer, Device, Element, Error, GroupParams, Grouping, Layout, QuantConfig, Quantizer, RawDeviceSlice,
    Rounding, SavedMeta, SavedSizes, SavedView, SavedViewMut, StatsMode, TensorMut, TensorRef,
};
use rand::rngs::StdRng;
use rand::RngExt;

/// Where the views start inside the caller's allocations (elements): codes 8 bytes in (keeps
/// their 8-byte alignment), parameters one group in, the counter one u32 in.
const CODE_OFF: usize = 8;
const PARAM_OFF: usize = 1;
const COUNTER_OFF: usize = 1;
/// Poisoned elements after each view.
const TAIL: usize = 8;
const POISON: u8 = 0xA5;

fn poison_params() -> GroupParams {
    let f = f32::from_bits(u32::from_ne_bytes([POISON; 4]));
    GroupParams { offset: f, scale: f }
}

/// One saved tensor's memory as a framework would allocate it (here: buffers of the
/// device, larger than needed, the views at an offset).
struct CallerSaved {
    sizes: SavedSizes,
    codes: Buffer<u8>,
    params: Buffer<GroupParams>,
    counter: Buffer<u32>,
}

impl CallerSaved {
    fn new(device: &Device, shape: &[usize], config: &QuantConfig) -> Self {
        CallerSaved::sized(device, saved_sizes(shape, config).expect("saved_sizes"))
    }

    fn sized(device: &Device, sizes: SavedSizes) -> Self {
        CallerSaved {
            sizes,
            codes: device.upload(&vec![POISON; CODE_OFF + sizes.code_bytes + TAIL]).expect("codes"),
            params: device.upload(&vec![poison_params(); PARAM_OFF + sizes.groups + TAIL]).expect("params"),
            counter: device.upload(&[u32::from_ne_bytes([POISON; 4]); COUNTER_OFF + 1 + TAIL]).expect("counter"),
        }
    }

    fn view_mut(&mut self) -> SavedViewMut<'_> {
        let (c, g) = (self.sizes.code_bytes, self.sizes.groups);
        SavedViewMut::new(
            TensorMut::new(&mut self.codes, &Layout::strided(&[c], &[1], CODE_OFF).unwrap()).unwrap(),
            TensorMut::new(&mut self.params, &Layout::strided(&[g], &[1], PARAM_OFF).unwrap()).unwrap(),
            TensorMut::new(&mut self.counter, &Layout::strided(&[1], &[1], COUNTER_OFF).unwrap()).unwrap(),
        )
        .expect("SavedViewMut::new")
    }

    fn view(&self, meta: SavedMeta) -> SavedView<'_> {
        let (c, g) = (self.sizes.code_bytes, self.sizes.groups);
        SavedView::new(
            TensorRef::new(&self.codes, &Layout::strided(&[c], &[1], CODE_OFF).unwrap()).unwrap(),
            TensorRef::new(&self.params, &Layout::strided(&[g], &[1], PARAM_OFF).unwrap()).unwrap(),
            meta,
        )
        .expect("SavedView::new")
    }

    /// The codes, parameter bits and counter in the views; panics when a byte around a view
    /// was written.
    fn read(&self) -> (Vec<u8>, Vec<u32>, u32) {
        let codes = self.codes.to_vec().unwrap();
        let params = self.params.to_vec().unwrap();
        let counter = self.counter.to_vec().unwrap();
        let (c, g) = (self.sizes.code_bytes, self.sizes.groups);
        assert!(
            codes[..CODE_OFF].iter().chain(&codes[CODE_OFF + c..]).all(|&b| b == POISON),
            "codes written outside the view"
        );
        let pbits = |p: &GroupParams| [p.offset.to_bits(), p.scale.to_bits()];
        let poison = pbits(&poison_params());
        assert!(
            params[..PARAM_OFF].iter().chain(&params[PARAM_OFF + g..]).all(|p| pbits(p) == poison),
            "parameters written outside the view"
        );
        let cp = u32::from_ne_bytes([POISON; 4]);
        assert!(
            counter[..COUNTER_OFF].iter().chain(&counter[COUNTER_OFF + 1..]).all(|&v| v == cp),
            "counter written outside the view"
        );
        let p: Vec<u32> = params[PARAM_OFF..PARAM_OFF + g].iter().flat_map(pbits).collect();
        (codes[CODE_OFF..CODE_OFF + c].to_vec(), p, counter[COUNTER_OFF])
    }
}

fn owned_parts(saved: &mesa_kernels::SavedActivation) -> (Vec<u8>, Vec<u32>, u32) {
    let p = saved.params().unwrap().iter().flat_map(|p| [p.offset.to_bits(), p.scale.to_bits()]).collect();
    (saved.codes().to_vec().unwrap(), p, saved.nonfinite_count().unwrap())
}

fn bits_of<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

fn random<T: Element>(rng: &mut StdRng, n: usize, center: f64, spread: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(center + spread * (rng.random::<f64>() * 2.0 - 1.0))).collect()
}

const SHAPE: [usize; 2] = [6, 40];

/// The configs every parity test runs: each bit width, both roundings, both statistics
/// paths, per-channel-group and per-tensor grouping.
fn configs() -> Vec<QuantConfig> {
    let mut v = Vec::new();
    for bits in [8, 4, 2] {
        for (rounding, stats, grouping) in [
            (Rounding::Nearest, StatsMode::Running, Grouping::Channels { axis: 1, groups: 4 }),
            (Rounding::Stochastic { seed: 7 }, StatsMode::Running, Grouping::Heads { axis: 0 }),
            (Rounding::Nearest, StatsMode::Exact, Grouping::Tensor),
        ] {
            v.push(QuantConfig { bits, grouping, rounding, momentum: 0.9, stats });
        }
    }
    v
}

/// Three batches (exact first batch, then one-pass with the running estimate; the third
/// leaves it far enough to widen groups), one NaN in the second batch.
fn batches<T: Element>(rng: &mut StdRng) -> Vec<Vec<T>> {
    let n = SHAPE.iter().product();
    let mut b = vec![random::<T>(rng, n, 0.5, 2.0), random::<T>(rng, n, 0.4, 2.1), random::<T>(rng, n, 3.0, 9.0)];
    b[1][17] = T::from_f64(f64::NAN);
    b
}

fn quantize_parity<T: Element>(device: &Device, rng: &mut StdRng) {
    for config in configs() {
        let mut owned_q = Quantizer::new(device, config).unwrap();
        let mut caller_q = Quantizer::new(device, config).unwrap();
        for (k, data) in batches::<T>(rng).iter().enumerate() {
            let what = format!("{} {config:?} batch {k}", T::DTYPE.name());
            let x = device.upload(data).unwrap();
            let xt = TensorRef::contiguous(&x, &SHAPE).unwrap();
            let owned = owned_q.quantize(&xt).unwrap();
            let mut caller = CallerSaved::new(device, &SHAPE, &config);
            let meta = caller_q.quantize_to(&xt, &mut caller.view_mut()).unwrap();
            assert_eq!(meta.shape(), owned.shape(), "{what}");
            assert_eq!((meta.bits(), meta.dtype(), meta.grouping()), (owned.bits(), owned.dtype(), owned.grouping()));
            assert_eq!(caller.read(), owned_parts(&owned), "{what}: codes, parameters, counter");
            assert_eq!(caller_q.running_params().unwrap(), owned_q.running_params().unwrap(), "{what}: running");
            // decode both into f32 and into T
            let n = data.len();
            let mut y1 = device.upload(&vec![f32::NAN; n]).unwrap();
            let mut y2 = device.upload(&vec![0.5f32; n]).unwrap();
            owned.dequantize(device, &mut TensorMut::contiguous(&mut y1, &SHAPE).unwrap()).unwrap();
            caller.view(meta.clone()).dequantize(device, &mut TensorMut::contiguous(&mut y2, &SHAPE).unwrap()).unwrap();
            assert_eq!(bits_of(&y1.to_vec().unwrap()), bits_of(&y2.to_vec().unwrap()), "{what}: decoded f32");
            let mut z = device.upload(&vec![T::from_f64(1.0); n]).unwrap();
            caller.view(meta).dequantize(device, &mut TensorMut::contiguous(&mut z, &SHAPE).unwrap()).unwrap();
            let z = z.to_vec().unwrap();
            let y1 = y1.to_vec().unwrap();
            for i in 0..n {
                let want = T::from_f64(f64::from(y1[i])).to_f64();
                assert!(want.to_bits() == z[i].to_f64().to_bits(), "{what}: decoded {} at {i}", T::DTYPE.name());
            }
        }
    }
}

#[test]
fn quantize_to_matches_the_owned_path_every_dtype_width_and_rounding() {
    let mut rng = common::rng("quantize_to_matches_the_owned_path");
    for device in common::backends() {
        quantize_parity::<f32>(&device, &mut rng);
        quantize_parity::<f16>(&device, &mut rng);
        quantize_parity::<bf16>(&device, &mut rng);
    }
}

fn gelu_parity<T: Element>(device: &Device, rng: &mut StdRng) {
    for config in configs() {
        for form in [GeluForm::Erf, GeluForm::Tanh] {
            let mut owned_q = Quantizer::new(device, config).unwrap();
            let mut caller_q = Quantizer::new(device, config).unwrap();
            for (k, data) in batches::<T>(rng).iter().enumerate() {
                let what = format!("{} {config:?} {form:?} batch {k}", T::DTYPE.name());
                let n = data.len();
                let x = device.upload(data).unwrap();
                let xt = TensorRef::contiguous(&x, &SHAPE).unwrap();
                let mut y1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let mut y2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
                let owned =
                    gelu_forward(device, &mut owned_q, form, &xt, &mut TensorMut::contiguous(&mut y1, &SHAPE).unwrap())
                        .unwrap();
                let mut caller = CallerSaved::new(device, &SHAPE, &config);
                let meta = gelu_forward_to(
                    device,
                    &mut caller_q,
                    form,
                    &xt,
                    &mut TensorMut::contiguous(&mut y2, &SHAPE).unwrap(),
                    &mut caller.view_mut(),
                )
                .unwrap();
                assert_eq!(bits_of(&y1.to_vec().unwrap()), bits_of(&y2.to_vec().unwrap()), "{what}: y");
                assert_eq!(caller.read(), owned_parts(&owned), "{what}: codes, parameters, counter");
                let dy = device.upload(&random::<T>(rng, n, 0.0, 1.0)).unwrap();
                let dyt = TensorRef::contiguous(&dy, &SHAPE).unwrap();
                let mut dx1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let mut dx2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
                gelu_backward(device, form, &owned, &dyt, &mut TensorMut::contiguous(&mut dx1, &SHAPE).unwrap())
                    .unwrap();
                gelu_backward_view(
                    device,
                    form,
                    &caller.view(meta),
                    &dyt,
                    &mut TensorMut::contiguous(&mut dx2, &SHAPE).unwrap(),
                )
                .unwrap();
                assert_eq!(bits_of(&dx1.to_vec().unwrap()), bits_of(&dx2.to_vec().unwrap()), "{what}: dx");
            }
        }
    }
}

#[test]
fn gelu_to_and_backward_view_match_the_owned_path() {
    let mut rng = common::rng("gelu_to_and_backward_view_match_the_owned_path");
    for device in common::backends() {
        gelu_parity::<f32>(&device, &mut rng);
        gelu_parity::<f16>(&device, &mut rng);
        gelu_parity::<bf16>(&device, &mut rng);
    }
}

/// Parts sized `codes`, `groups`, `counter` at the given offsets (elements) of fresh buffers.
struct Parts {
    codes: (Buffer<u8>, usize, usize),
    params: (Buffer<GroupParams>, usize, usize),
    counter: (Buffer<u32>, usize, usize),
}

impl Parts {
    fn new(device: &Device, codes: (usize, usize), groups: (usize, usize), counter: (usize, usize)) -> Self {
        Parts {
            codes: (device.alloc_zeros(codes.0 + codes.1 + 8).unwrap(), codes.0, codes.1),
            params: (device.alloc_zeros(groups.0 + groups.1 + 1).unwrap(), groups.0, groups.1),
            counter: (device.alloc_zeros(counter.0 + counter.1 + 1).unwrap(), counter.0, counter.1),
        }
    }
    fn view_mut(&mut self) -> SavedViewMut<'_> {
        fn part<T: mesa_kernels::Storage>(b: &mut (Buffer<T>, usize, usize)) -> TensorMut<'_, T> {
            let l = Layout::strided(&[b.2], &[1], b.1).unwrap();
            TensorMut::new(&mut b.0, &l).unwrap()
        }
        SavedViewMut::new(part(&mut self.codes), part(&mut self.params), part(&mut self.counter)).unwrap()
    }
}

/// A name, the (offset, length) of codes, parameters and counter, and the error expected.
type SizeCase = (&'static str, (usize, usize), (usize, usize), (usize, usize), fn(&Error) -> bool);

#[test]
fn wrong_sizes_misaligned_codes_and_bad_views_are_typed_errors_before_any_launch() {
    let device = common::emulator();
    let config = QuantConfig { grouping: Grouping::Channels { axis: 1, groups: 4 }, ..QuantConfig::per_tensor() };
    let sizes = saved_sizes(&SHAPE, &config).unwrap();
    assert_eq!(sizes.code_bytes, 240);
    assert_eq!((sizes.groups, sizes.param_bytes(), sizes.counter_bytes()), (4, 32, 4));
    let four = QuantConfig { bits: 4, ..config };
    assert_eq!(saved_sizes(&[3, 5], &QuantConfig { bits: 2, ..QuantConfig::per_tensor() }).unwrap().code_bytes, 4);
    assert_eq!(saved_sizes(&SHAPE, &four).unwrap().code_bytes, 120);
    assert!(matches!(saved_sizes(&SHAPE, &QuantConfig { bits: 3, ..config }), Err(Error::Unsupported { .. })));
    assert!(matches!(
        saved_sizes(&[6, 42], &config),
        Err(Error::InvalidLayout { .. }) | Err(Error::InvalidArgument { .. })
    ));

    let x = device.upload(&vec![1.0f32; 240]).unwrap();
    let xt = TensorRef::contiguous(&x, &SHAPE).unwrap();
    let mut q = Quantizer::new(&device, config).unwrap();
    let cases: [SizeCase; 7] = [
        ("codes one byte short", (0, 239), (0, 4), (0, 1), |e| {
            matches!(e, Error::BufferTooShort { what: "saved codes", needed: 240, len: 239 })
        }),
        ("parameters one group short", (0, 240), (0, 3), (0, 1), |e| {
            matches!(e, Error::BufferTooShort { what: "saved parameters", needed: 4, len: 3 })
        }),
        ("no counter", (0, 240), (0, 4), (0, 0), |e| {
            matches!(e, Error::BufferTooShort { what: "non-finite counter", needed: 1, len: 0 })
        }),
        ("codes one byte long", (0, 241), (0, 4), (0, 1), |e| matches!(e, Error::InvalidArgument { .. })),
        ("parameters one group long", (0, 240), (0, 5), (0, 1), |e| matches!(e, Error::InvalidArgument { .. })),
        ("codes at an odd byte", (1, 240), (0, 4), (0, 1), |e| {
            matches!(e, Error::Misaligned { what: "saved codes", align: 8 })
        }),
        ("codes 4 bytes in", (4, 240), (0, 4), (0, 1), |e| matches!(e, Error::Misaligned { align: 8, .. })),
    ];
    for (what, c, g, n, ok) in cases {
        let mut parts = Parts::new(&device, c, g, n);
        let r = q.quantize_to(&xt, &mut parts.view_mut());
        let e = r.expect_err(what);
        assert!(ok(&e), "{what}: {e:?}");
        assert_eq!(q.batches(), 0, "{what}: nothing may run");
        // the same parts for GELU's forward
        let mut y = device.alloc_zeros::<f32>(240).unwrap();
        let r = gelu_forward_to(
            &device,
            &mut q,
            GeluForm::Erf,
            &xt,
            &mut TensorMut::contiguous(&mut y, &SHAPE).unwrap(),
            &mut parts.view_mut(),
        );
        assert!(ok(&r.expect_err(what)), "{what} (GELU)");
        assert_eq!(q.batches(), 0, "{what}: nothing may run (GELU)");
    }

    // a part that is not a dense 1-D view
    let mut c = device.alloc_zeros::<u8>(480).unwrap();
    let mut p = device.alloc_zeros::<GroupParams>(4).unwrap();
    let mut n = device.alloc_zeros::<u32>(1).unwrap();
    let strided = TensorMut::new(&mut c, &Layout::strided(&[240], &[2], 0).unwrap()).unwrap();
    let r = SavedViewMut::new(
        strided,
        TensorMut::contiguous(&mut p, &[4]).unwrap(),
        TensorMut::contiguous(&mut n, &[1]).unwrap(),
    );
    assert!(matches!(r, Err(Error::InvalidLayout { .. })), "{r:?}");

    // a view whose meta does not match its parts
    let mut good = Parts::new(&device, (0, 240), (0, 4), (0, 1));
    let meta = q.quantize_to(&xt, &mut good.view_mut()).unwrap();
    assert_eq!(q.batches(), 1);
    let short = TensorRef::new(&good.codes.0, &Layout::contiguous(&[120])).unwrap();
    let params = TensorRef::new(&good.params.0, &Layout::contiguous(&[4])).unwrap();
    let r = SavedView::new(short, params, meta.clone());
    assert!(matches!(r, Err(Error::BufferTooShort { what: "saved codes", needed: 240, len: 120 })), "{r:?}");
    let codes = TensorRef::new(&good.codes.0, &Layout::contiguous(&[240])).unwrap();
    let params = TensorRef::new(&good.params.0, &Layout::contiguous(&[3])).unwrap();
    let r = SavedView::new(codes, params, meta.clone());
    assert!(matches!(r, Err(Error::BufferTooShort { what: "saved parameters", .. })), "{r:?}");

    // codes read from an odd byte: the consumers refuse them before launching
    let odd = TensorRef::new(&good.codes.0, &Layout::strided(&[240], &[1], 1).unwrap()).unwrap();
    let params = TensorRef::new(&good.params.0, &Layout::contiguous(&[4])).unwrap();
    let view = SavedView::new(odd, params, meta).unwrap();
    let mut y = device.alloc_zeros::<f32>(240).unwrap();
    let r = view.dequantize(&device, &mut TensorMut::contiguous(&mut y, &SHAPE).unwrap());
    assert!(matches!(r, Err(Error::Misaligned { what: "saved codes", align: 8 })), "{r:?}");
    let r = gelu_backward_view(&device, GeluForm::Erf, &view, &xt, &mut TensorMut::contiguous(&mut y, &SHAPE).unwrap());
    assert!(matches!(r, Err(Error::Misaligned { what: "saved codes", align: 8 })), "{r:?}");
}

#[test]
fn overlapping_caller_buffers_are_aliasing_errors_before_any_launch() {
    let device = common::emulator();
    let config = QuantConfig { grouping: Grouping::Channels { axis: 1, groups: 4 }, ..QuantConfig::per_tensor() };
    let sizes = saved_sizes(&SHAPE, &config).unwrap();
    let mut q = Quantizer::new(&device, config).unwrap();
    // one host allocation of 8-byte words holds everything, addressed by raw pointers (what a
    // framework's allocator hands over): x (f32), codes, params, counter at chosen offsets
    let mut arena = vec![0u64; 1024];
    let base = arena.as_mut_ptr() as u64;
    let x_bytes = 240 * 4;
    {
        let xs: &mut [f32] = bytemuck::cast_slice_mut(&mut arena[..x_bytes / 8]);
        xs.iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 / 7.0);
    }
    // SAFETY (all raw slices below): inside `arena`, which outlives every call
    let x = unsafe { RawDeviceSlice::<f32>::new(base, 240) };
    let xt = TensorRef::contiguous(&x, &SHAPE).unwrap();
    let raw = |codes_at: u64, params_at: u64, counter_at: u64| unsafe {
        (
            RawDeviceSlice::<u8>::new(base + codes_at, sizes.code_bytes),
            RawDeviceSlice::<GroupParams>::new(base + params_at, sizes.groups),
            RawDeviceSlice::<u32>::new(base + counter_at, 1),
        )
    };
    let free = x_bytes as u64; // first byte past x
    let cases = [
        ("codes over x", raw(free - 8, free + 256, free + 300)),
        ("parameters over the codes", raw(free, free + 232, free + 300)),
        ("counter over the parameters", raw(free, free + 256, free + 260)),
        ("parameters over x", raw(free, 8, free + 300)),
    ];
    for (what, (mut c, mut p, mut n)) in cases {
        let mut view = SavedViewMut::new(
            TensorMut::contiguous(&mut c, &[sizes.code_bytes]).unwrap(),
            TensorMut::contiguous(&mut p, &[sizes.groups]).unwrap(),
            TensorMut::contiguous(&mut n, &[1]).unwrap(),
        )
        .unwrap();
        let r = q.quantize_to(&xt, &mut view);
        assert!(matches!(r, Err(Error::Aliasing { .. })), "{what}: {r:?}");
        assert_eq!(q.batches(), 0, "{what}: nothing may run");
    }
    // a raw parameter pointer off its 4-byte alignment
    let (mut c, _, mut n) = raw(free, free + 256, free + 300);
    let mut p = unsafe { RawDeviceSlice::<GroupParams>::new(base + free + 258, sizes.groups) };
    let mut view = SavedViewMut::new(
        TensorMut::contiguous(&mut c, &[sizes.code_bytes]).unwrap(),
        TensorMut::contiguous(&mut p, &[sizes.groups]).unwrap(),
        TensorMut::contiguous(&mut n, &[1]).unwrap(),
    )
    .unwrap();
    let r = q.quantize_to(&xt, &mut view);
    assert!(matches!(r, Err(Error::Misaligned { what: "saved parameters", align: 4 })), "{r:?}");

    // disjoint raw parts work, and decode like an owned handle
    let (mut c, mut p, mut n) = raw(free, free + 256, free + 300);
    let mut view = SavedViewMut::new(
        TensorMut::contiguous(&mut c, &[sizes.code_bytes]).unwrap(),
        TensorMut::contiguous(&mut p, &[sizes.groups]).unwrap(),
        TensorMut::contiguous(&mut n, &[1]).unwrap(),
    )
    .unwrap();
    let meta = q.quantize_to(&xt, &mut view).unwrap();
    let mut owned_q = Quantizer::new(&device, config).unwrap();
    let owned = owned_q.quantize(&xt).unwrap();
    let codes = unsafe { std::slice::from_raw_parts((base + free) as *const u8, sizes.code_bytes) };
    assert_eq!(codes, owned.codes().to_vec().unwrap().as_slice());

    // backward: dx over the codes, over the parameters
    let read = view.as_view(meta).unwrap();
    let dy = device.upload(&vec![1.0f32; 240]).unwrap();
    let dyt = TensorRef::contiguous(&dy, &SHAPE).unwrap();
    for (what, at) in [("dx over the codes", free), ("dx over the parameters", free + 256 - 64)] {
        let mut dx = unsafe { RawDeviceSlice::<f32>::new(base + at, 240) };
        let r = gelu_backward_view(
            &device,
            GeluForm::Erf,
            &read,
            &dyt,
            &mut TensorMut::contiguous(&mut dx, &SHAPE).unwrap(),
        );
        assert!(matches!(r, Err(Error::Aliasing { .. })), "{what}: {r:?}");
        let mut y = unsafe { RawDeviceSlice::<f32>::new(base + at, 240) };
        let r = read.dequantize(&device, &mut TensorMut::contiguous(&mut y, &SHAPE).unwrap());
        assert!(matches!(r, Err(Error::Aliasing { .. })), "dequantize, {what}: {r:?}");
    }
    drop(arena);
}

#[test]
fn an_empty_tensor_zeroes_the_caller_parameters_and_counts_no_batch() {
    let device = common::emulator();
    let config = QuantConfig::per_head(1);
    let shape = [0, 3, 4];
    let x = device.alloc_zeros::<f32>(0).unwrap();
    let xt = TensorRef::contiguous(&x, &shape).unwrap();
    let mut q = Quantizer::new(&device, config).unwrap();
    let mut caller = CallerSaved::new(&device, &shape, &config);
    assert_eq!((caller.sizes.code_bytes, caller.sizes.groups), (0, 3));
    let meta = q.quantize_to(&xt, &mut caller.view_mut()).unwrap();
    assert_eq!(meta.shape(), &shape);
    let (codes, params, counter) = caller.read();
    assert!(codes.is_empty());
    assert_eq!((params, counter), (vec![0; 6], 0));
    assert_eq!(q.batches(), 0);
}

/// The configs of [`configs`] for rows of `cols` (channel groups of 4 only where they divide).
fn configs_for(cols: usize) -> Vec<QuantConfig> {
    configs()
        .into_iter()
        .map(|c| match c.grouping {
            Grouping::Channels { .. } if cols % 4 != 0 => QuantConfig { grouping: Grouping::Tensor, ..c },
            _ => c,
        })
        .collect()
}

/// Rows whose codes start on a byte, and rows of 13 (4 and 2 bits: the second code pass).
const SHAPES: [[usize; 2]; 2] = [SHAPE, [4, 13]];

fn upload_t<T: Element>(device: &Device, rng: &mut StdRng, n: usize, center: f64, spread: f64) -> Buffer<T> {
    device.upload(&random::<T>(rng, n, center, spread)).unwrap()
}

fn layer_norm_parity<T: Element>(device: &Device, rng: &mut StdRng) {
    for shape in SHAPES {
        let (rows, cols) = (shape[0], shape[1]);
        let n = rows * cols;
        for config in configs_for(cols) {
            let mut owned_q = Quantizer::new(device, config).unwrap();
            let mut caller_q = Quantizer::new(device, config).unwrap();
            let w = upload_t::<T>(device, rng, cols, 1.0, 0.5);
            let b = upload_t::<T>(device, rng, cols, 0.0, 0.5);
            let wv = TensorRef::contiguous(&w, &[cols]).unwrap();
            let bv = TensorRef::contiguous(&b, &[cols]).unwrap();
            for k in 0..3 {
                let what = format!("{} {shape:?} {config:?} batch {k}", T::DTYPE.name());
                let x = upload_t::<T>(device, rng, n, k as f64, 1.0 + 3.0 * k as f64);
                let xt = TensorRef::contiguous(&x, &shape).unwrap();
                let args = LayerNormForward { x: &xt, weight: Some(&wv), bias: Some(&bv), eps: 1e-5 };
                let mut y1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let mut y2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
                let owned = layer_norm_forward(
                    device,
                    &mut owned_q,
                    &args,
                    &mut TensorMut::contiguous(&mut y1, &shape).unwrap(),
                )
                .unwrap();
                let mut caller = CallerSaved::new(device, &shape, &config);
                let mut mean = device.upload(&vec![f32::NAN; rows + 2]).unwrap();
                let mut rstd = device.upload(&vec![f32::NAN; rows + 2]).unwrap();
                let mut mean_v = TensorMut::new(&mut mean, &Layout::strided(&[rows], &[1], 1).unwrap()).unwrap();
                let mut rstd_v = TensorMut::new(&mut rstd, &Layout::strided(&[rows], &[1], 2).unwrap()).unwrap();
                let mut xview = caller.view_mut();
                let meta = layer_norm_forward_to(
                    device,
                    &mut caller_q,
                    &args,
                    &mut TensorMut::contiguous(&mut y2, &shape).unwrap(),
                    LayerNormSaveMut { xhat: &mut xview, mean: &mut mean_v, rstd: &mut rstd_v },
                )
                .unwrap();
                drop(xview);
                assert_eq!(bits_of(&y1.to_vec().unwrap()), bits_of(&y2.to_vec().unwrap()), "{what}: y");
                assert_eq!(caller.read(), owned_parts(owned.xhat()), "{what}: codes, parameters, counter");
                let mean = mean.to_vec().unwrap();
                let rstd = rstd.to_vec().unwrap();
                assert_eq!(bits_of(&mean[1..=rows]), bits_of(&owned.mean().to_vec().unwrap()), "{what}: mean");
                assert_eq!(bits_of(&rstd[2..rows + 2]), bits_of(&owned.rstd().to_vec().unwrap()), "{what}: rstd");
                assert!(mean[0].is_nan() && mean[rows + 1].is_nan() && rstd[..2].iter().all(|v| v.is_nan()));

                let dy = upload_t::<T>(device, rng, n, 0.0, 1.0);
                let dyt = TensorRef::contiguous(&dy, &shape).unwrap();
                let grads = |which: usize| {
                    let mut dx = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                    let mut dw = device.upload(&vec![f32::NAN; cols]).unwrap();
                    let mut db = device.upload(&vec![f32::NAN; cols]).unwrap();
                    let g = LayerNormGrads {
                        dx: &mut TensorMut::contiguous(&mut dx, &shape).unwrap(),
                        dweight: &mut TensorMut::contiguous(&mut dw, &[cols]).unwrap(),
                        dbias: &mut TensorMut::contiguous(&mut db, &[cols]).unwrap(),
                    };
                    if which == 0 {
                        let a = LayerNormBackward { saved: &owned, weight: Some(&wv), dy: &dyt };
                        layer_norm_backward(device, &a, g).unwrap();
                    } else {
                        let xhat = caller.view(meta.clone());
                        let rstd_r = TensorRef::new(&rstd, &Layout::strided(&[rows], &[1], 2).unwrap()).unwrap();
                        let a = LayerNormBackwardView { xhat: &xhat, rstd: &rstd_r, weight: Some(&wv), dy: &dyt };
                        layer_norm_backward_view(device, &a, g).unwrap();
                    }
                    (bits_of(&dx.to_vec().unwrap()), bits_of(&dw.to_vec().unwrap()), bits_of(&db.to_vec().unwrap()))
                };
                let (a, b) = (grads(0), grads(1));
                assert_eq!(a, b, "{what}: dx, dweight, dbias");
            }
        }
    }
}

#[test]
fn layer_norm_to_and_backward_view_match_the_owned_path() {
    let mut rng = common::rng("layer_norm_to_and_backward_view_match_the_owned_path");
    for device in common::backends() {
        layer_norm_parity::<f32>(&device, &mut rng);
        layer_norm_parity::<f16>(&device, &mut rng);
        layer_norm_parity::<bf16>(&device, &mut rng);
    }
}

fn softmax_parity<T: Element>(device: &Device, rng: &mut StdRng) {
    for shape in SHAPES {
        let n = shape[0] * shape[1];
        for bits in [8, 4, 2] {
            for (codes, rounding) in
                [(SoftmaxCodes::Sqrt, Rounding::Nearest), (SoftmaxCodes::Linear, Rounding::Stochastic { seed: 3 })]
            {
                let save = SoftmaxSave { bits, codes, grouping: Grouping::Heads { axis: 0 }, rounding };
                let what = format!("{} {shape:?} {save:?}", T::DTYPE.name());
                let mut data = random::<T>(rng, n, 0.0, 4.0);
                data[3] = T::from_f64(f64::NAN);
                let x = device.upload(&data).unwrap();
                let xt = TensorRef::contiguous(&x, &shape).unwrap();
                let input = SoftmaxInput::new(&xt);
                let mut y1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let mut y2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
                let owned =
                    softmax_forward(device, &save, &input, &mut TensorMut::contiguous(&mut y1, &shape).unwrap())
                        .unwrap();
                let mut caller = CallerSaved::sized(device, save.saved_sizes(&shape).unwrap());
                let meta = softmax_forward_to(
                    device,
                    &save,
                    &input,
                    &mut TensorMut::contiguous(&mut y2, &shape).unwrap(),
                    &mut caller.view_mut(),
                )
                .unwrap();
                assert_eq!(meta.companding(), owned.companding());
                assert_eq!(bits_of(&y1.to_vec().unwrap()), bits_of(&y2.to_vec().unwrap()), "{what}: y");
                let parts = caller.read();
                assert!(parts.2 > 0, "{what}: the NaN row is counted");
                assert_eq!(parts, owned_parts(&owned), "{what}: codes, parameters, counter");
                let dy = upload_t::<T>(device, rng, n, 0.0, 1.0);
                let dyt = TensorRef::contiguous(&dy, &shape).unwrap();
                let mut dx1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let mut dx2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
                softmax_backward(device, &owned, &dyt, &mut TensorMut::contiguous(&mut dx1, &shape).unwrap()).unwrap();
                softmax_backward_view(
                    device,
                    &caller.view(meta),
                    &dyt,
                    &mut TensorMut::contiguous(&mut dx2, &shape).unwrap(),
                )
                .unwrap();
                assert_eq!(bits_of(&dx1.to_vec().unwrap()), bits_of(&dx2.to_vec().unwrap()), "{what}: dx");
            }
        }
    }
    // an empty input: the fixed parameters, a zero counter, in the caller's poisoned memory
    let save = SoftmaxSave { bits: 4, ..SoftmaxSave::per_head(1) };
    let shape = [0, 3, 8];
    let x = device.alloc_zeros::<T>(0).unwrap();
    let mut y = device.alloc_zeros::<T>(0).unwrap();
    let xt = TensorRef::contiguous(&x, &shape).unwrap();
    let owned =
        softmax_forward(device, &save, &SoftmaxInput::new(&xt), &mut TensorMut::contiguous(&mut y, &shape).unwrap())
            .unwrap();
    let mut caller = CallerSaved::sized(device, save.saved_sizes(&shape).unwrap());
    let _meta = softmax_forward_to(
        device,
        &save,
        &SoftmaxInput::new(&xt),
        &mut TensorMut::contiguous(&mut y, &shape).unwrap(),
        &mut caller.view_mut(),
    )
    .unwrap();
    let parts = caller.read();
    assert_eq!(parts.1.len(), 6);
    assert_eq!(parts, owned_parts(&owned), "empty softmax");
}

#[test]
fn softmax_to_and_backward_view_match_the_owned_path() {
    let mut rng = common::rng("softmax_to_and_backward_view_match_the_owned_path");
    for device in common::backends() {
        softmax_parity::<f32>(&device, &mut rng);
        softmax_parity::<f16>(&device, &mut rng);
        softmax_parity::<bf16>(&device, &mut rng);
    }
}

fn swiglu_parity<T: Element>(device: &Device, rng: &mut StdRng) {
    let n = SHAPE.iter().product();
    for config in configs() {
        let up_config = QuantConfig { bits: if config.bits == 2 { 8 } else { 2 }, ..config };
        let (mut og, mut ou) = (Quantizer::new(device, config).unwrap(), Quantizer::new(device, up_config).unwrap());
        let (mut cg, mut cu) = (Quantizer::new(device, config).unwrap(), Quantizer::new(device, up_config).unwrap());
        for k in 0..3 {
            let what = format!("{} {config:?} batch {k}", T::DTYPE.name());
            let g = upload_t::<T>(device, rng, n, 0.0, 2.0 + 3.0 * k as f64);
            let u = upload_t::<T>(device, rng, n, 1.0, 1.0 + k as f64);
            let (gt, ut) = (TensorRef::contiguous(&g, &SHAPE).unwrap(), TensorRef::contiguous(&u, &SHAPE).unwrap());
            let input = SwigluInput { gate: &gt, up: &ut };
            let mut y1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
            let mut y2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
            let owned = swiglu_forward(
                device,
                SwigluQuantizers { gate: &mut og, up: &mut ou },
                &input,
                &mut TensorMut::contiguous(&mut y1, &SHAPE).unwrap(),
            )
            .unwrap();
            let mut gate = CallerSaved::new(device, &SHAPE, &config);
            let mut up = CallerSaved::new(device, &SHAPE, &up_config);
            let (mut gv, mut uv) = (gate.view_mut(), up.view_mut());
            let metas = swiglu_forward_to(
                device,
                SwigluQuantizers { gate: &mut cg, up: &mut cu },
                &input,
                &mut TensorMut::contiguous(&mut y2, &SHAPE).unwrap(),
                SwigluSaveMut { gate: &mut gv, up: &mut uv },
            )
            .unwrap();
            drop((gv, uv));
            assert_eq!(bits_of(&y1.to_vec().unwrap()), bits_of(&y2.to_vec().unwrap()), "{what}: y");
            assert_eq!(gate.read(), owned_parts(&owned.gate), "{what}: gate codes");
            assert_eq!(up.read(), owned_parts(&owned.up), "{what}: up codes");
            let dy = upload_t::<T>(device, rng, n, 0.0, 1.0);
            let dyt = TensorRef::contiguous(&dy, &SHAPE).unwrap();
            let out = |which: usize| {
                let mut dg = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let mut du = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
                let grads = SwigluGrads {
                    gate: &mut TensorMut::contiguous(&mut dg, &SHAPE).unwrap(),
                    up: &mut TensorMut::contiguous(&mut du, &SHAPE).unwrap(),
                };
                if which == 0 {
                    swiglu_backward(device, &owned, &dyt, grads).unwrap();
                } else {
                    let (gr, ur) = (gate.view(metas.gate.clone()), up.view(metas.up.clone()));
                    swiglu_backward_view(device, SwigluSavedView { gate: &gr, up: &ur }, &dyt, grads).unwrap();
                }
                (bits_of(&dg.to_vec().unwrap()), bits_of(&du.to_vec().unwrap()))
            };
            let (a, b) = (out(0), out(1));
            assert_eq!(a, b, "{what}: dg, du");
        }
    }
}

#[test]
fn swiglu_to_and_backward_view_match_the_owned_path() {
    let mut rng = common::rng("swiglu_to_and_backward_view_match_the_owned_path");
    for device in common::backends() {
        swiglu_parity::<f32>(&device, &mut rng);
        swiglu_parity::<f16>(&device, &mut rng);
        swiglu_parity::<bf16>(&device, &mut rng);
    }
}

#[test]
fn swiglu_checks_both_saved_tensors_before_the_first_pass() {
    let device = common::emulator();
    let config = QuantConfig::per_tensor();
    let n = SHAPE.iter().product();
    let g = device.upload(&vec![1.0f32; n]).unwrap();
    let u = device.upload(&vec![2.0f32; n]).unwrap();
    let (gt, ut) = (TensorRef::contiguous(&g, &SHAPE).unwrap(), TensorRef::contiguous(&u, &SHAPE).unwrap());
    let input = SwigluInput { gate: &gt, up: &ut };
    let (mut qg, mut qu) = (Quantizer::new(&device, config).unwrap(), Quantizer::new(&device, config).unwrap());
    let mut y = device.alloc_zeros::<f32>(n).unwrap();
    // the up projection's codes are one byte short, or overlap the gate's codes
    let mut gate = Parts::new(&device, (0, 240), (0, 1), (0, 1));
    let mut short = Parts::new(&device, (0, 239), (0, 1), (0, 1));
    let (mut gv, mut sv) = (gate.view_mut(), short.view_mut());
    let r = swiglu_forward_to(
        &device,
        SwigluQuantizers { gate: &mut qg, up: &mut qu },
        &input,
        &mut TensorMut::contiguous(&mut y, &SHAPE).unwrap(),
        SwigluSaveMut { gate: &mut gv, up: &mut sv },
    );
    assert!(matches!(r, Err(Error::BufferTooShort { what: "saved codes", .. })), "{r:?}");
    assert_eq!((qg.batches(), qu.batches()), (0, 0), "nothing may run");
    drop((gv, sv));
    let mut arena = vec![0u64; 128];
    let addr = arena.as_mut_ptr() as u64;
    // SAFETY: inside `arena`, which outlives the call
    let (mut c1, mut c2) =
        unsafe { (RawDeviceSlice::<u8>::new(addr, 240), RawDeviceSlice::<u8>::new(addr + 200, 240)) };
    let (mut p1, mut p2) =
        (device.alloc_zeros::<GroupParams>(1).unwrap(), device.alloc_zeros::<GroupParams>(1).unwrap());
    let (mut n1, mut n2) = (device.alloc_zeros::<u32>(1).unwrap(), device.alloc_zeros::<u32>(1).unwrap());
    let mut v1 = SavedViewMut::new(
        TensorMut::contiguous(&mut c1, &[240]).unwrap(),
        TensorMut::contiguous(&mut p1, &[1]).unwrap(),
        TensorMut::contiguous(&mut n1, &[1]).unwrap(),
    )
    .unwrap();
    let mut v2 = SavedViewMut::new(
        TensorMut::contiguous(&mut c2, &[240]).unwrap(),
        TensorMut::contiguous(&mut p2, &[1]).unwrap(),
        TensorMut::contiguous(&mut n2, &[1]).unwrap(),
    )
    .unwrap();
    let r = swiglu_forward_to(
        &device,
        SwigluQuantizers { gate: &mut qg, up: &mut qu },
        &input,
        &mut TensorMut::contiguous(&mut y, &SHAPE).unwrap(),
        SwigluSaveMut { gate: &mut v1, up: &mut v2 },
    );
    assert!(matches!(r, Err(Error::Aliasing { .. })), "{r:?}");
    assert_eq!((qg.batches(), qu.batches()), (0, 0), "nothing may run");
    drop((v1, v2));
    drop(arena);
}

fn rope_parity<T: Element>(device: &Device, rng: &mut StdRng) {
    let shape = [2, 6, 16];
    let n = shape.iter().product();
    let cfg = RopeConfig { base: 10_000.0, pairing: RopePairing::Halves, rotary_dims: None, position_offset: 3 };
    for config in configs().into_iter().map(|c| match c.grouping {
        Grouping::Channels { .. } => QuantConfig { grouping: Grouping::Channels { axis: 2, groups: 4 }, ..c },
        _ => c,
    }) {
        let mut owned_q = Quantizer::new(device, config).unwrap();
        let mut caller_q = Quantizer::new(device, config).unwrap();
        for k in 0..3 {
            let what = format!("{} {config:?} batch {k}", T::DTYPE.name());
            let x = upload_t::<T>(device, rng, n, 0.0, 1.0 + 4.0 * k as f64);
            let xt = TensorRef::contiguous(&x, &shape).unwrap();
            let mut y1 = device.upload(&vec![T::from_f64(9.0); n]).unwrap();
            let mut y2 = device.upload(&vec![T::from_f64(-9.0); n]).unwrap();
            let owned = rope_forward_save(
                device,
                &mut owned_q,
                &cfg,
                &xt,
                &mut TensorMut::contiguous(&mut y1, &shape).unwrap(),
            )
            .unwrap();
            let mut caller = CallerSaved::new(device, &shape, &config);
            let meta = rope_forward_save_to(
                device,
                &mut caller_q,
                &cfg,
                &xt,
                &mut TensorMut::contiguous(&mut y2, &shape).unwrap(),
                &mut caller.view_mut(),
            )
            .unwrap();
            assert_eq!(bits_of(&y1.to_vec().unwrap()), bits_of(&y2.to_vec().unwrap()), "{what}: y");
            assert_eq!(caller.read(), owned_parts(&owned), "{what}: codes, parameters, counter");
            let mut d1 = device.upload(&vec![f32::NAN; n]).unwrap();
            let mut d2 = device.upload(&vec![0.0f32; n]).unwrap();
            owned.dequantize(device, &mut TensorMut::contiguous(&mut d1, &shape).unwrap()).unwrap();
            caller.view(meta).dequantize(device, &mut TensorMut::contiguous(&mut d2, &shape).unwrap()).unwrap();
            assert_eq!(bits_of(&d1.to_vec().unwrap()), bits_of(&d2.to_vec().unwrap()), "{what}: decoded");
        }
    }
}

#[test]
fn rope_save_to_matches_the_owned_path() {
    let mut rng = common::rng("rope_save_to_matches_the_owned_path");
    for device in common::backends() {
        rope_parity::<f32>(&device, &mut rng);
        rope_parity::<f16>(&device, &mut rng);
        rope_parity::<bf16>(&device, &mut rng);
    }
}

/// Shapes for [`saved_meta_contiguous_equals_what_the_producers_return`]: 1-D, 2-D, a rank-4
/// tensor with an axis of 1, a last axis that puts 4- and 2-bit rows off a byte boundary, and
/// an empty one.
const META_SHAPES: [&[usize]; 5] = [&[17], &[6, 40], &[2, 1, 3, 8], &[4, 13], &[0, 3, 8]];

/// Groupings that fit `shape`: one group, one per index along axis 0, and channel groups of
/// the last axis where 2 divide it.
fn meta_groupings(shape: &[usize]) -> Vec<Grouping> {
    let last = shape.len() - 1;
    let mut g = vec![Grouping::Tensor, Grouping::Heads { axis: 0 }];
    if shape[last] % 2 == 0 {
        g.push(Grouping::Channels { axis: last, groups: 2 });
    }
    g
}

/// The metas the producers return for a contiguous input of `shape`: `Quantizer::quantize_to`,
/// GELU's, LayerNorm's (x̂; rank ≥ 2 rows), SwiGLU's (both inputs) and softmax's.
fn producer_metas<T: Element>(device: &Device, shape: &[usize], config: QuantConfig) -> Vec<(&'static str, SavedMeta)> {
    let n: usize = shape.iter().product();
    let mut rng = common::rng("producer_metas");
    let x = upload_t::<T>(device, &mut rng, n, 0.5, 2.0);
    let xt = TensorRef::contiguous(&x, shape).unwrap();
    let mut y = device.upload(&vec![T::from_f64(0.0); n]).unwrap();
    let mut out = Vec::new();
    let mut q = Quantizer::new(device, config).unwrap();
    let mut saved = CallerSaved::new(device, shape, &config);
    out.push(("quantize_to", q.quantize_to(&xt, &mut saved.view_mut()).unwrap()));
    let meta = gelu_forward_to(
        device,
        &mut q,
        GeluForm::Erf,
        &xt,
        &mut TensorMut::contiguous(&mut y, shape).unwrap(),
        &mut saved.view_mut(),
    )
    .unwrap();
    out.push(("gelu_forward_to", meta));
    let cols = shape[shape.len() - 1];
    let rows = n.checked_div(cols).unwrap_or(0);
    let mut mean = device.upload(&vec![0f32; rows]).unwrap();
    let mut rstd = device.upload(&vec![0f32; rows]).unwrap();
    let args = LayerNormForward { x: &xt, weight: None, bias: None, eps: 1e-5 };
    let mut xhat = saved.view_mut();
    let save = LayerNormSaveMut {
        xhat: &mut xhat,
        mean: &mut TensorMut::contiguous(&mut mean, &[rows]).unwrap(),
        rstd: &mut TensorMut::contiguous(&mut rstd, &[rows]).unwrap(),
    };
    let meta =
        layer_norm_forward_to(device, &mut q, &args, &mut TensorMut::contiguous(&mut y, shape).unwrap(), save).unwrap();
    out.push(("layer_norm_forward_to", meta));
    let mut qu = Quantizer::new(device, config).unwrap();
    let mut up_saved = CallerSaved::new(device, shape, &config);
    let metas = swiglu_forward_to(
        device,
        SwigluQuantizers { gate: &mut q, up: &mut qu },
        &SwigluInput { gate: &xt, up: &xt },
        &mut TensorMut::contiguous(&mut y, shape).unwrap(),
        SwigluSaveMut { gate: &mut saved.view_mut(), up: &mut up_saved.view_mut() },
    )
    .unwrap();
    out.push(("swiglu_forward_to gate", metas.gate));
    out.push(("swiglu_forward_to up", metas.up));
    out
}

/// The constructors a deferred executor uses to build a backward's state before the producer
/// has run (`SavedMeta::contiguous`, `SoftmaxSave::saved_meta`) give exactly the meta the
/// producers return for a contiguous input: every producer, dtype, bit width, grouping and
/// rounding here, an empty tensor included. Bad input is a typed error.
#[test]
fn saved_meta_contiguous_equals_what_the_producers_return() {
    fn run<T: Element>(device: &Device) {
        for shape in META_SHAPES {
            for grouping in meta_groupings(shape) {
                for bits in [8, 4, 2] {
                    for (rounding, stats) in
                        [(Rounding::Nearest, StatsMode::Exact), (Rounding::Stochastic { seed: 5 }, StatsMode::Running)]
                    {
                        let config = QuantConfig { bits, grouping, rounding, momentum: 0.9, stats };
                        let want = SavedMeta::contiguous(shape, T::DTYPE, &config).unwrap();
                        for (producer, meta) in producer_metas::<T>(device, shape, config) {
                            assert_eq!(want, meta, "{producer} {} {shape:?} {config:?}", T::DTYPE.name());
                        }
                        for codes in [SoftmaxCodes::Sqrt, SoftmaxCodes::Linear] {
                            let save = SoftmaxSave { bits, codes, grouping, rounding };
                            let n: usize = shape.iter().product();
                            let x = device.upload(&vec![T::from_f64(0.25); n]).unwrap();
                            let xt = TensorRef::contiguous(&x, shape).unwrap();
                            let mut y = device.upload(&vec![T::from_f64(0.0); n]).unwrap();
                            let mut caller = CallerSaved::sized(device, save.saved_sizes(shape).unwrap());
                            let meta = softmax_forward_to(
                                device,
                                &save,
                                &SoftmaxInput::new(&xt),
                                &mut TensorMut::contiguous(&mut y, shape).unwrap(),
                                &mut caller.view_mut(),
                            )
                            .unwrap();
                            assert_eq!(save.saved_meta(shape, T::DTYPE).unwrap(), meta, "softmax {shape:?} {save:?}");
                        }
                    }
                }
            }
        }
    }
    for device in common::backends() {
        run::<f32>(&device);
        run::<f16>(&device);
        run::<bf16>(&device);
    }
    // what a producer would refuse is refused here, typed
    let dt = mesa_kernels::DType::F32;
    let bad_bits = QuantConfig { bits: 3, ..QuantConfig::per_tensor() };
    assert!(matches!(SavedMeta::contiguous(&[4], dt, &bad_bits), Err(Error::Unsupported { .. })));
    let bad_momentum = QuantConfig { momentum: 1.5, ..QuantConfig::per_tensor() };
    assert!(matches!(SavedMeta::contiguous(&[4], dt, &bad_momentum), Err(Error::InvalidArgument { .. })));
    let bad_axis = QuantConfig::per_head(2);
    assert!(matches!(SavedMeta::contiguous(&[4, 4], dt, &bad_axis), Err(Error::InvalidLayout { .. })));
    let bad_groups = QuantConfig { grouping: Grouping::Channels { axis: 1, groups: 3 }, ..QuantConfig::per_tensor() };
    assert!(matches!(SavedMeta::contiguous(&[4, 4], dt, &bad_groups), Err(Error::InvalidLayout { .. })));
    let huge = [usize::MAX / 2, 3];
    assert!(matches!(SavedMeta::contiguous(&huge, dt, &QuantConfig::per_tensor()), Err(Error::TooLarge { .. })));
    let bad_save = SoftmaxSave { bits: 5, ..SoftmaxSave::per_head(0) };
    assert!(matches!(bad_save.saved_meta(&[2, 4], dt), Err(Error::Unsupported { .. })));
}
