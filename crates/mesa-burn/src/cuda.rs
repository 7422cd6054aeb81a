//! burn's CUDA backend (`CubeBackend` on a `cubecl::Device::Cuda`): mesa-kernels' CUDA kernels
//! on cubecl's memory, host-fenced. **Type-checked only** (`ci/compat/burn-cuda`): this code has
//! never been built into a binary or run (cubecl-cuda 0.11 cannot be linked on the machines that
//! wrote it, docs/burn.md).
//!
//! The contract, per kernel call (docs/burn.md, "CUDA"; [`fenced`]):
//! 1. every input is made contiguous and untiled (burn's `into_contiguous`, a no-op when it
//!    already is); every output and every saved buffer is a fresh contiguous cubecl allocation
//!    (`client.empty`) wrapped as a `CubeTensor`;
//! 2. each of those buffers is pinned with `client.get_resource` (the returned guard keeps the
//!    allocation alive and in place; taking it also orders cubecl's current stream after the
//!    stream the buffer was last used on);
//! 3. `client.sync()` is awaited on the calling thread: every cubecl write to the pinned
//!    buffers has completed (host synchronisation 1);
//! 4. the kernels run on mesa-kernels' own stream of the same device (a cached
//!    `mesa_kernels::Device::cuda(ordinal)`: cubecl and cudarc both use the device's primary
//!    context, so the pointers are valid in both) through `RawDeviceSlice`s;
//! 5. mesa's stream is synchronised (host synchronisation 2), then the guards are dropped.
//!
//! Cost: two host synchronisations per kernel call (an op makes one call in its forward and
//! one in its backward; Linear and RMSNorm none in an untracked forward), and the calling
//! thread waits for the kernels. No stream handle of cubecl's is public in cubecl-cuda 0.11,
//! so nothing cheaper (an event handshake between the two streams) is possible without a
//! change upstream.
//!
//! Every op has a CUDA implementation: GELU, LayerNorm, softmax (masked or not), SwiGLU and
//! linear attention run mesa-kernels' CUDA kernels under the contract above; Linear and
//! RMSNorm do their arithmetic with burn's own cubecl ops (matmul, reductions) and only
//! quantize (forward) and decode (backward) through mesa-kernels under it. What each op
//! keeps for backward is what it keeps on Flex, in cubecl's device memory (`CubeTensor`s:
//! codes `U8`, parameters and statistics `F32`); linear attention's saved states are
//! mesa-kernels `Buffer`s on mesa's device.
//!
//! The autodiff implementation is written once over [`CudaOps`]: `CubeBackend` implements it
//! with the functions here; with the `fusion` feature `Fusion<CubeBackend>` implements it by
//! registering the same functions as fusion custom operations (`src/fusion.rs`).
//!
//! Everything after validation is trusted: a kernel refusing its arguments, a cubecl error
//! while pinning or syncing, or a CUDA fault panics with the op's name (burn's ops are
//! infallible). Known ways that can happen on CUDA and not on Flex: an empty tensor (cubecl's
//! zero-byte allocations are untested here), and a cubecl allocation whose address is not
//! 8-byte aligned for the codes (`mesa_kernels::Error::Misaligned`; cubecl's pools are
//! expected to align far more, not checked).
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl_runtime::runtime::Runtime;
use half::{bf16, f16};
use mesa_kernels::fused::{
    LayerNormBackwardView, LayerNormForward, LayerNormGrads, LayerNormSaveMut, SoftmaxInput, SwigluGrads, SwigluInput,
    SwigluQuantizers, SwigluSaveMut, SwigluSavedView,
};
use mesa_kernels::linear_attention::{
    self, BackwardArgs, ForwardArgs, Grads as LaGrads, LinearAttentionConfig, LinearAttentionSaved,
};
use mesa_kernels::{
    fused, saved_sizes, Buffer, Device, GeluForm, GroupParams, Quantizer, RawDeviceSlice, SavedMeta, SavedSizes,
    SavedView, SavedViewMut, TensorMut, TensorRef,
};

use crate::autodiff::softmax_save_config;
use crate::config::Codes;
use crate::error::{Error, Result};
use crate::ops::MesaOps;

/// cubecl-cuda's server type (unnameable otherwise: its module is private).
type CudaServer = <CudaRuntime as Runtime>::Server;

/// The CUDA ordinal of a cubecl device, `None` for any other runtime.
pub(crate) fn ordinal(device: &CubeDevice) -> Option<usize> {
    match device {
        CubeDevice::Cuda(d) => Some(d.index),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// mesa-kernels' device (its own stream) for CUDA `ordinal`, made once per ordinal and
/// process, then shared.
///
/// # Errors
/// [`Error::Kernel`]: the library has no CUDA kernels (`MESA_CUDA_DISABLE`, no nvcc at build
/// time), no driver, or no such device.
pub(crate) fn mesa_device(ordinal: usize) -> Result<Device> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let mut map = DEVICES.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Device::cuda(ordinal)?;
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// After validation, a failure here is a mesa-burn bug (or a device fault): a panic naming
/// the op, as on Flex (`host::expect`).
fn expect<R, E: std::fmt::Display>(r: std::result::Result<R, E>, op: &'static str) -> R {
    r.unwrap_or_else(|e| panic!("mesa-burn {op} (CUDA): {e}"))
}

/// The element type of a float dtype the kernels run (validation let only these through).
macro_rules! with_float {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            other => {
                panic!("mesa-burn: dtype {other:?} reached a CUDA kernel (validation lets only f32/f16/bf16 through)")
            }
        }
    };
}

/// `t`, contiguous and untiled, and its shape.
pub(crate) fn contiguous(t: CubeTensor) -> (CubeTensor, Vec<usize>) {
    let t = into_contiguous(t);
    let shape = t.meta.shape().to_vec();
    (t, shape)
}

/// A fresh contiguous, uninitialised cubecl tensor of `shape` and `dtype` on `like`'s device.
fn empty_like(like: &CubeTensor, shape: &[usize], dtype: DType) -> CubeTensor {
    let bytes = shape.iter().product::<usize>() * dtype.size();
    let handle = like.client.empty(bytes);
    CubeTensor::new_contiguous(like.client.clone(), like.device.clone(), Shape::from(shape.to_vec()), handle, dtype)
}

/// Pinned cubecl buffers: their device addresses, valid while this value lives.
struct Pinned<G> {
    ptrs: Vec<u64>,
    _guards: Vec<G>,
}

/// Steps 2 and 3 of the contract: pins every tensor's buffer, then waits for cubecl's stream.
fn pin_and_fence(tensors: &[&CubeTensor], op: &'static str) -> Pinned<impl Sized> {
    let client = &tensors[0].client;
    let mut ptrs = Vec::with_capacity(tensors.len());
    let mut guards = Vec::with_capacity(tensors.len());
    for t in tensors {
        let guard = expect(client.get_resource::<CudaServer>(t.handle.clone()), op);
        ptrs.push(guard.resource().ptr);
        guards.push(guard);
    }
    expect(futures_lite::future::block_on(client.sync()), op);
    Pinned { ptrs, _guards: guards }
}

/// Steps 2 to 5 of the contract: pins `tensors` (all of one client), fences cubecl's stream,
/// runs `run` with mesa's device and the buffers' device addresses (in `tensors`' order),
/// synchronises mesa's stream, unpins.
fn fenced<R>(tensors: &[&CubeTensor], op: &'static str, run: impl FnOnce(&Device, &[u64]) -> R) -> R {
    let device = device_of(tensors[0], op);
    let pinned = pin_and_fence(tensors, op);
    let r = run(&device, &pinned.ptrs);
    expect(device.synchronize(), op);
    drop(pinned);
    r
}

/// `len` elements of `T` at a pinned buffer's address.
///
/// # Safety
/// `ptr` comes from [`fenced`]'s addresses and the slice is used only inside its `run`: the
/// buffer is alive, in place and not used by cubecl until mesa's stream is synchronised.
unsafe fn raw<T>(ptr: u64, len: usize) -> RawDeviceSlice<T> {
    // SAFETY: the caller's contract
    unsafe { RawDeviceSlice::new(ptr, len) }
}

/// The mesa device for a tensor of this backend.
fn device_of(t: &CubeTensor, op: &'static str) -> Device {
    let ordinal =
        ordinal(&t.device).unwrap_or_else(|| panic!("mesa-burn {op}: not a CUDA device (validation refuses it)"));
    expect(mesa_device(ordinal), op)
}

/// The codes of one saved tensor in cubecl's device memory: packed codes (`U8`, whole 8-byte
/// words), the group parameters (`F32`, offset then scale per group) and the producer's meta.
#[derive(Debug, Clone)]
pub(crate) struct CudaCodes {
    codes: CubeTensor,
    code_bytes: usize,
    params: CubeTensor,
    groups: usize,
    meta: SavedMeta,
}

/// Device memory for one saved tensor, before its producer ran.
struct CodesAlloc {
    codes: CubeTensor,
    params: CubeTensor,
    sizes: SavedSizes,
}

/// The cubecl shapes of one saved tensor's memory for codes of `sizes`: the codes `U8`
/// `[8·⌈code_bytes/8⌉]` (whole 8-byte words) and the parameters `F32` `[2·groups]` (offset,
/// scale per group). The Fusion path declares its outputs with these.
pub(crate) fn codes_shapes(sizes: SavedSizes) -> (usize, usize) {
    (sizes.code_bytes.div_ceil(8) * 8, sizes.groups * 2)
}

impl CudaCodes {
    /// Codes already in cubecl memory, as [`CodesAlloc::finish`] keeps them: `codes` and
    /// `params` of [`codes_shapes`]`(sizes)`, written by a producer that returned `meta`.
    #[cfg(feature = "fusion")]
    pub(crate) fn from_parts(codes: CubeTensor, params: CubeTensor, sizes: SavedSizes, meta: SavedMeta) -> Self {
        CudaCodes { codes, code_bytes: sizes.code_bytes, params, groups: sizes.groups, meta }
    }

    /// The codes and parameters tensors and the producer's meta.
    #[cfg(feature = "fusion")]
    pub(crate) fn into_parts(self) -> (CubeTensor, CubeTensor, SavedMeta) {
        (self.codes, self.params, self.meta)
    }
}

impl CodesAlloc {
    /// Fresh cubecl allocations on `like`'s device for codes of `sizes`.
    fn new(like: &CubeTensor, sizes: SavedSizes) -> Self {
        let (words, params) = codes_shapes(sizes);
        CodesAlloc {
            codes: empty_like(like, &[words], DType::U8),
            params: empty_like(like, &[params], DType::F32),
            sizes,
        }
    }

    /// Keeps the memory with the producer's `meta`.
    fn finish(self, meta: SavedMeta) -> CudaCodes {
        CudaCodes {
            codes: self.codes,
            code_bytes: self.sizes.code_bytes,
            params: self.params,
            groups: self.sizes.groups,
            meta,
        }
    }
}

/// The producer's view of pinned codes (`c`), parameters (`p`) and a counter.
fn view_mut<'a>(
    c: &'a mut RawDeviceSlice<u8>,
    p: &'a mut RawDeviceSlice<GroupParams>,
    counter: &'a mut Buffer<u32>,
    sizes: SavedSizes,
    op: &'static str,
) -> SavedViewMut<'a> {
    expect(
        SavedViewMut::new(
            expect(TensorMut::contiguous(c, &[sizes.code_bytes]), op),
            expect(TensorMut::contiguous(p, &[sizes.groups]), op),
            expect(TensorMut::contiguous(counter, &[1]), op),
        ),
        op,
    )
}

/// The consumer's view of pinned codes (`c`) and parameters (`p`) of `saved`.
fn view<'a>(
    c: &'a RawDeviceSlice<u8>,
    p: &'a RawDeviceSlice<GroupParams>,
    saved: &CudaCodes,
    op: &'static str,
) -> SavedView<'a> {
    expect(
        SavedView::new(
            expect(TensorRef::contiguous(c, &[saved.code_bytes]), op),
            expect(TensorRef::contiguous(p, &[saved.groups]), op),
            saved.meta.clone(),
        ),
        op,
    )
}

/// A zeroed non-finite counter in mesa's memory (the producers count into it; nothing reads it
/// after the forward).
fn counter(device: &Device, op: &'static str) -> Buffer<u32> {
    expect(device.alloc_zeros::<u32>(1), op)
}

// ---------------------------------------------------------------------------------- GELU

/// GELU's forward on CUDA: `y`, and the codes of `x` when `codes` is given.
pub(crate) fn gelu_forward(x: CubeTensor, form: GeluForm, codes: Option<&Codes>) -> (CubeTensor, Option<CudaCodes>) {
    const OP: &str = "gelu";
    let (x, shape) = contiguous(x);
    let dtype = x.dtype;
    let n: usize = shape.iter().product();
    let y = empty_like(&x, &shape, dtype);
    let Some(codes) = codes else {
        fenced(&[&x, &y], OP, |device, ptrs| {
            with_float!(dtype, T => {
                // SAFETY: addresses of `fenced`, used inside it
                let (xs, mut ys) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n)) };
                let xv = expect(TensorRef::contiguous(&xs, &shape), OP);
                let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
                expect(fused::gelu(device, form, &xv, &mut yv), OP);
            })
        });
        return (y, None);
    };
    let config = codes.quant_config();
    let alloc = CodesAlloc::new(&x, expect(saved_sizes(&shape, &config), OP));
    let sizes = alloc.sizes;
    let meta = fenced(&[&x, &y, &alloc.codes, &alloc.params], OP, |device, ptrs| {
        let mut quantizer = expect(Quantizer::new(device, config), OP);
        let mut count = counter(device, OP);
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (xs, mut ys, mut cs, mut ps) = unsafe {
                (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<u8>(ptrs[2], sizes.code_bytes), raw::<GroupParams>(ptrs[3], sizes.groups))
            };
            let xv = expect(TensorRef::contiguous(&xs, &shape), OP);
            let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
            let mut saved = view_mut(&mut cs, &mut ps, &mut count, sizes, OP);
            expect(fused::gelu_forward_to(device, &mut quantizer, form, &xv, &mut yv, &mut saved), OP)
        })
    });
    (y, Some(alloc.finish(meta)))
}

/// GELU's backward on CUDA: `dx = dy·gelu'(x̃)` from the codes.
pub(crate) fn gelu_backward(dy: CubeTensor, form: GeluForm, saved: &CudaCodes) -> CubeTensor {
    const OP: &str = "gelu backward";
    let (dy, shape) = contiguous(dy);
    let dtype = dy.dtype;
    let n: usize = shape.iter().product();
    let dx = empty_like(&dy, &shape, dtype);
    fenced(&[&dy, &dx, &saved.codes, &saved.params], OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it; the codes were written by the
            // forward, synchronised before it returned
            let (dys, mut dxs, cs, ps) = unsafe {
                (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<u8>(ptrs[2], saved.code_bytes), raw::<GroupParams>(ptrs[3], saved.groups))
            };
            let sv = view(&cs, &ps, saved, OP);
            let dyv = expect(TensorRef::contiguous(&dys, &shape), OP);
            let mut dxv = expect(TensorMut::contiguous(&mut dxs, &shape), OP);
            expect(fused::gelu_backward_view(device, form, &sv, &dyv, &mut dxv), OP);
        })
    });
    dx
}

// ------------------------------------------------------------------------------- softmax

/// Softmax's forward on CUDA (optionally masked: `mask` of `x`'s shape): `y`, and the
/// square-root codes of `y` when `codes` is given.
pub(crate) fn softmax_forward(
    x: CubeTensor,
    mask: Option<CubeTensor>,
    codes: Option<&Codes>,
) -> (CubeTensor, Option<CudaCodes>) {
    const OP: &str = "softmax";
    let (x, shape) = contiguous(x);
    let mask = mask.map(|m| contiguous(m).0);
    let dtype = x.dtype;
    let n: usize = shape.iter().product();
    let y = empty_like(&x, &shape, dtype);
    let save = codes.map(softmax_save_config);
    let alloc = save.as_ref().map(|s| CodesAlloc::new(&x, expect(s.saved_sizes(&shape), OP)));
    let mut tensors = vec![&x, &y];
    if let Some(a) = alloc.as_ref() {
        tensors.extend([&a.codes, &a.params]);
    }
    if let Some(m) = mask.as_ref() {
        tensors.push(m);
    }
    let meta = fenced(&tensors, OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (xs, mut ys) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n)) };
            // SAFETY: as above (the mask, when given, is the last pinned buffer)
            let ms = mask.as_ref().map(|_| unsafe { raw::<T>(ptrs[ptrs.len() - 1], n) });
            let xv = expect(TensorRef::contiguous(&xs, &shape), OP);
            let mv = ms.as_ref().map(|m| expect(TensorRef::contiguous(m, &shape), OP));
            let mut input = SoftmaxInput::new(&xv);
            if let Some(mv) = mv.as_ref() {
                input = input.with_mask(mv);
            }
            let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
            match (save.as_ref(), alloc.as_ref()) {
                (Some(save), Some(a)) => {
                    let mut count = counter(device, OP);
                    // SAFETY: as above
                    let (mut cs, mut ps) = unsafe { (raw::<u8>(ptrs[2], a.sizes.code_bytes), raw::<GroupParams>(ptrs[3], a.sizes.groups)) };
                    let mut saved = view_mut(&mut cs, &mut ps, &mut count, a.sizes, OP);
                    Some(expect(fused::softmax_forward_to(device, save, &input, &mut yv, &mut saved), OP))
                }
                _ => {
                    expect(fused::softmax(device, &input, &mut yv), OP);
                    None
                }
            }
        })
    });
    (y, alloc.zip(meta).map(|(a, m)| a.finish(m)))
}

/// Softmax's backward on CUDA: `dx = ŷ·(dy − Σ dy·ŷ)` from the codes of `y`.
pub(crate) fn softmax_backward(dy: CubeTensor, saved: &CudaCodes) -> CubeTensor {
    const OP: &str = "softmax backward";
    let (dy, shape) = contiguous(dy);
    let dtype = dy.dtype;
    let n: usize = shape.iter().product();
    let dx = empty_like(&dy, &shape, dtype);
    fenced(&[&dy, &dx, &saved.codes, &saved.params], OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (dys, mut dxs, cs, ps) = unsafe {
                (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<u8>(ptrs[2], saved.code_bytes), raw::<GroupParams>(ptrs[3], saved.groups))
            };
            let sv = view(&cs, &ps, saved, OP);
            let dyv = expect(TensorRef::contiguous(&dys, &shape), OP);
            let mut dxv = expect(TensorMut::contiguous(&mut dxs, &shape), OP);
            expect(fused::softmax_backward_view(device, &sv, &dyv, &mut dxv), OP);
        })
    });
    dx
}

// -------------------------------------------------------------------------------- SwiGLU

/// SwiGLU's forward on CUDA: `y`, and the codes of `gate` and `up` when `codes` is given.
pub(crate) fn swiglu_forward(
    gate: CubeTensor,
    up: CubeTensor,
    codes: Option<&Codes>,
) -> (CubeTensor, Option<(CudaCodes, CudaCodes)>) {
    const OP: &str = "swiglu";
    let (g, shape) = contiguous(gate);
    let (u, _) = contiguous(up);
    let dtype = g.dtype;
    let n: usize = shape.iter().product();
    let y = empty_like(&g, &shape, dtype);
    let Some(codes) = codes else {
        fenced(&[&g, &u, &y], OP, |device, ptrs| {
            with_float!(dtype, T => {
                // SAFETY: addresses of `fenced`, used inside it
                let (gs, us, mut ys) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<T>(ptrs[2], n)) };
                let (gv, uv) = (expect(TensorRef::contiguous(&gs, &shape), OP), expect(TensorRef::contiguous(&us, &shape), OP));
                let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
                expect(fused::swiglu(device, &SwigluInput { gate: &gv, up: &uv }, &mut yv), OP);
            })
        });
        return (y, None);
    };
    let config = codes.quant_config();
    let sizes = expect(saved_sizes(&shape, &config), OP);
    let (ag, au) = (CodesAlloc::new(&g, sizes), CodesAlloc::new(&g, sizes));
    let meta = fenced(&[&g, &u, &y, &ag.codes, &ag.params, &au.codes, &au.params], OP, |device, ptrs| {
        let (mut qg, mut qu) = (expect(Quantizer::new(device, config), OP), expect(Quantizer::new(device, config), OP));
        let (mut count_g, mut count_u) = (counter(device, OP), counter(device, OP));
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (gs, us, mut ys) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<T>(ptrs[2], n)) };
            // SAFETY: as above
            let (mut cg, mut pg, mut cu, mut pu) = unsafe {
                (
                    raw::<u8>(ptrs[3], sizes.code_bytes),
                    raw::<GroupParams>(ptrs[4], sizes.groups),
                    raw::<u8>(ptrs[5], sizes.code_bytes),
                    raw::<GroupParams>(ptrs[6], sizes.groups),
                )
            };
            let (gv, uv) = (expect(TensorRef::contiguous(&gs, &shape), OP), expect(TensorRef::contiguous(&us, &shape), OP));
            let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
            let mut vg = view_mut(&mut cg, &mut pg, &mut count_g, sizes, OP);
            let mut vu = view_mut(&mut cu, &mut pu, &mut count_u, sizes, OP);
            expect(
                fused::swiglu_forward_to(
                    device,
                    SwigluQuantizers { gate: &mut qg, up: &mut qu },
                    &SwigluInput { gate: &gv, up: &uv },
                    &mut yv,
                    SwigluSaveMut { gate: &mut vg, up: &mut vu },
                ),
                OP,
            )
        })
    });
    (y, Some((ag.finish(meta.gate), au.finish(meta.up))))
}

/// SwiGLU's backward on CUDA: `(dgate, dup)` from the codes of `gate` and `up`.
pub(crate) fn swiglu_backward(dy: CubeTensor, gate: &CudaCodes, up: &CudaCodes) -> (CubeTensor, CubeTensor) {
    const OP: &str = "swiglu backward";
    let (dy, shape) = contiguous(dy);
    let dtype = dy.dtype;
    let n: usize = shape.iter().product();
    let (dg, du) = (empty_like(&dy, &shape, dtype), empty_like(&dy, &shape, dtype));
    fenced(&[&dy, &dg, &du, &gate.codes, &gate.params, &up.codes, &up.params], OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (dys, mut dgs, mut dus) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<T>(ptrs[2], n)) };
            // SAFETY: as above
            let (cg, pg, cu, pu) = unsafe {
                (
                    raw::<u8>(ptrs[3], gate.code_bytes),
                    raw::<GroupParams>(ptrs[4], gate.groups),
                    raw::<u8>(ptrs[5], up.code_bytes),
                    raw::<GroupParams>(ptrs[6], up.groups),
                )
            };
            let (sg, su) = (view(&cg, &pg, gate, OP), view(&cu, &pu, up, OP));
            let dyv = expect(TensorRef::contiguous(&dys, &shape), OP);
            let mut dgv = expect(TensorMut::contiguous(&mut dgs, &shape), OP);
            let mut duv = expect(TensorMut::contiguous(&mut dus, &shape), OP);
            expect(
                fused::swiglu_backward_view(
                    device,
                    SwigluSavedView { gate: &sg, up: &su },
                    &dyv,
                    SwigluGrads { gate: &mut dgv, up: &mut duv },
                ),
                OP,
            );
        })
    });
    (dg, du)
}

// ----------------------------------------------------------------------------- LayerNorm

/// LayerNorm's forward on CUDA: `y`, and what the backward keeps when `codes` is given (the
/// weight kept is the contiguous one the kernel read).
pub(crate) fn layer_norm_forward(
    x: CubeTensor,
    weight: CubeTensor,
    bias: CubeTensor,
    eps: f32,
    codes: Option<&Codes>,
) -> (CubeTensor, Option<LayerNormSaved<CubeBackend>>) {
    const OP: &str = "layer_norm";
    let (x, shape) = contiguous(x);
    let (w, _) = contiguous(weight);
    let (b, _) = contiguous(bias);
    let dtype = x.dtype;
    let n: usize = shape.iter().product();
    let cols = *shape.last().expect("rank ≥ 1 (validated)");
    let rows = n.checked_div(cols).unwrap_or(0);
    let y = empty_like(&x, &shape, dtype);
    let Some(codes) = codes else {
        fenced(&[&x, &w, &b, &y], OP, |device, ptrs| {
            with_float!(dtype, T => {
                // SAFETY: addresses of `fenced`, used inside it
                let (xs, ws, bs, mut ys) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], cols), raw::<T>(ptrs[2], cols), raw::<T>(ptrs[3], n)) };
                let (xv, wv, bv) = (
                    expect(TensorRef::contiguous(&xs, &shape), OP),
                    expect(TensorRef::contiguous(&ws, &[cols]), OP),
                    expect(TensorRef::contiguous(&bs, &[cols]), OP),
                );
                let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
                let args = LayerNormForward { x: &xv, weight: Some(&wv), bias: Some(&bv), eps };
                expect(fused::layer_norm(device, &args, &mut yv), OP);
            })
        });
        return (y, None);
    };
    let config = codes.quant_config();
    let alloc = CodesAlloc::new(&x, expect(saved_sizes(&shape, &config), OP));
    let sizes = alloc.sizes;
    let rstd = empty_like(&x, &[rows], DType::F32);
    let meta = fenced(&[&x, &w, &b, &y, &alloc.codes, &alloc.params, &rstd], OP, |device, ptrs| {
        let mut quantizer = expect(Quantizer::new(device, config), OP);
        let mut count = counter(device, OP);
        // the per-row mean: written by the kernel, not kept (mesa's memory, freed after the op)
        let mut mean = expect(device.alloc_zeros::<f32>(rows), OP);
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (xs, ws, bs, mut ys) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], cols), raw::<T>(ptrs[2], cols), raw::<T>(ptrs[3], n)) };
            // SAFETY: as above
            let (mut cs, mut ps, mut rs) = unsafe {
                (raw::<u8>(ptrs[4], sizes.code_bytes), raw::<GroupParams>(ptrs[5], sizes.groups), raw::<f32>(ptrs[6], rows))
            };
            let (xv, wv, bv) = (
                expect(TensorRef::contiguous(&xs, &shape), OP),
                expect(TensorRef::contiguous(&ws, &[cols]), OP),
                expect(TensorRef::contiguous(&bs, &[cols]), OP),
            );
            let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
            let mut mv = expect(TensorMut::contiguous(&mut mean, &[rows]), OP);
            let mut rv = expect(TensorMut::contiguous(&mut rs, &[rows]), OP);
            let mut saved = view_mut(&mut cs, &mut ps, &mut count, sizes, OP);
            let args = LayerNormForward { x: &xv, weight: Some(&wv), bias: Some(&bv), eps };
            let save = LayerNormSaveMut { xhat: &mut saved, mean: &mut mv, rstd: &mut rv };
            expect(fused::layer_norm_forward_to(device, &mut quantizer, &args, &mut yv, save), OP)
        })
    });
    (y, Some(LayerNormSaved { xhat: alloc.finish(meta), rstd, weight: w }))
}

/// LayerNorm's backward on CUDA: `(dx, dweight, dbias)`, the parameter gradients in the
/// weight's dtype (the kernel accumulates them in f32; burn's cast converts). The weight is
/// made contiguous first (a no-op for the one [`layer_norm_forward`] kept).
pub(crate) fn layer_norm_backward(
    dy: CubeTensor,
    state: &LayerNormSaved<CubeBackend>,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    const OP: &str = "layer_norm backward";
    let (dy, shape) = contiguous(dy);
    let dtype = dy.dtype;
    let n: usize = shape.iter().product();
    let cols = *shape.last().expect("rank ≥ 1");
    let rows = n.checked_div(cols).unwrap_or(0);
    let dx = empty_like(&dy, &shape, dtype);
    let (dw, db) = (empty_like(&dy, &[cols], DType::F32), empty_like(&dy, &[cols], DType::F32));
    let (w, _) = contiguous(state.weight.clone());
    let xhat = &state.xhat;
    fenced(&[&dy, &dx, &dw, &db, &xhat.codes, &xhat.params, &state.rstd, &w], OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (dys, mut dxs, mut dws, mut dbs) = unsafe { (raw::<T>(ptrs[0], n), raw::<T>(ptrs[1], n), raw::<f32>(ptrs[2], cols), raw::<f32>(ptrs[3], cols)) };
            // SAFETY: as above
            let (cs, ps, rs, ws) = unsafe {
                (raw::<u8>(ptrs[4], xhat.code_bytes), raw::<GroupParams>(ptrs[5], xhat.groups), raw::<f32>(ptrs[6], rows), raw::<T>(ptrs[7], cols))
            };
            let sv = view(&cs, &ps, xhat, OP);
            let rv = expect(TensorRef::contiguous(&rs, &[rows]), OP);
            let wv = expect(TensorRef::contiguous(&ws, &[cols]), OP);
            let dyv = expect(TensorRef::contiguous(&dys, &shape), OP);
            let mut dxv = expect(TensorMut::contiguous(&mut dxs, &shape), OP);
            let mut dwv = expect(TensorMut::contiguous(&mut dws, &[cols]), OP);
            let mut dbv = expect(TensorMut::contiguous(&mut dbs, &[cols]), OP);
            let args = LayerNormBackwardView { xhat: &sv, rstd: &rv, weight: Some(&wv), dy: &dyv };
            expect(fused::layer_norm_backward_view(device, &args, LayerNormGrads { dx: &mut dxv, dweight: &mut dwv, dbias: &mut dbv }), OP);
        })
    });
    (dx, cast::<CubeBackend>(dw, w.dtype), cast::<CubeBackend>(db, w.dtype))
}

// ----------------------------------------------------- quantize / decode (Linear, RMSNorm)

/// The codes of `x` (made contiguous first) in cubecl's device memory (mesa's quantizer).
pub(crate) fn quantize(x: CubeTensor, codes: &Codes, op: &'static str) -> CudaCodes {
    let (x, shape) = contiguous(x);
    let dtype = x.dtype;
    let n: usize = shape.iter().product();
    let config = codes.quant_config();
    let alloc = CodesAlloc::new(&x, expect(saved_sizes(&shape, &config), op));
    let sizes = alloc.sizes;
    let meta = fenced(&[&x, &alloc.codes, &alloc.params], op, |device, ptrs| {
        let mut quantizer = expect(Quantizer::new(device, config), op);
        let mut count = counter(device, op);
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (xs, mut cs, mut ps) = unsafe { (raw::<T>(ptrs[0], n), raw::<u8>(ptrs[1], sizes.code_bytes), raw::<GroupParams>(ptrs[2], sizes.groups)) };
            let xv = expect(TensorRef::contiguous(&xs, &shape), op);
            let mut saved = view_mut(&mut cs, &mut ps, &mut count, sizes, op);
            expect(quantizer.quantize_to(&xv, &mut saved), op)
        })
    });
    alloc.finish(meta)
}

/// The decoded tensor of `saved` (its shape, element `dtype`): a new contiguous cubecl tensor.
pub(crate) fn decode(saved: &CudaCodes, dtype: DType, op: &'static str) -> CubeTensor {
    let shape = saved.meta.shape().to_vec();
    let n: usize = shape.iter().product();
    let out = empty_like(&saved.codes, &shape, dtype);
    fenced(&[&out, &saved.codes, &saved.params], op, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (mut os, cs, ps) = unsafe { (raw::<T>(ptrs[0], n), raw::<u8>(ptrs[1], saved.code_bytes), raw::<GroupParams>(ptrs[2], saved.groups)) };
            let sv = view(&cs, &ps, saved, op);
            let mut ov = expect(TensorMut::contiguous(&mut os, &shape), op);
            expect(sv.dequantize(device, &mut ov), op);
        })
    });
    out
}

// ---------------------------------------------------------------------- linear attention

/// Linear attention's forward on CUDA: the output (contiguous, `v`'s shape), the contiguous
/// inputs, and the kernels' saved states (mesa-kernels `Buffer`s on mesa's device).
pub(crate) fn linear_attention_forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    config: &LinearAttentionConfig,
) -> (CubeTensor, [CubeTensor; 3], LinearAttentionSaved) {
    const OP: &str = "linear_attention";
    let ((q, qs), (k, _), (v, vs)) = (contiguous(q), contiguous(k), contiguous(v));
    let dtype = q.dtype;
    let (nq, nv): (usize, usize) = (qs.iter().product(), vs.iter().product());
    let out = empty_like(&q, &vs, dtype);
    let saved = fenced(&[&q, &k, &v, &out], OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (qr, kr, vr, mut or) = unsafe { (raw::<T>(ptrs[0], nq), raw::<T>(ptrs[1], nq), raw::<T>(ptrs[2], nv), raw::<T>(ptrs[3], nv)) };
            let (qv, kv, vv) = (
                expect(TensorRef::contiguous(&qr, &qs), OP),
                expect(TensorRef::contiguous(&kr, &qs), OP),
                expect(TensorRef::contiguous(&vr, &vs), OP),
            );
            let mut ov = expect(TensorMut::contiguous(&mut or, &vs), OP);
            expect(linear_attention::forward(device, config, ForwardArgs { q: &qv, k: &kv, v: &vv, out: &mut ov }), OP)
        })
    });
    (out, [q, k, v], saved)
}

/// Linear attention's backward on CUDA: `[dq, dk, dv]` from the forward's inputs and output
/// (made contiguous: a no-op for the ones [`linear_attention_forward`] returned) and its saved
/// states.
pub(crate) fn linear_attention_backward(
    [q, k, v, out]: [CubeTensor; 4],
    dout: CubeTensor,
    saved: &LinearAttentionSaved,
) -> [CubeTensor; 3] {
    const OP: &str = "linear_attention backward";
    let ((q, qs), (k, _), (v, _), (out, _)) = (contiguous(q), contiguous(k), contiguous(v), contiguous(out));
    let (dout, vs) = contiguous(dout);
    let dtype = dout.dtype;
    let (nq, nv): (usize, usize) = (qs.iter().product(), vs.iter().product());
    let (dq, dk, dv) = (empty_like(&dout, &qs, dtype), empty_like(&dout, &qs, dtype), empty_like(&dout, &vs, dtype));
    fenced(&[&q, &k, &v, &out, &dout, &dq, &dk, &dv], OP, |device, ptrs| {
        with_float!(dtype, T => {
            // SAFETY: addresses of `fenced`, used inside it
            let (qr, kr, vr, or, dor) = unsafe {
                (raw::<T>(ptrs[0], nq), raw::<T>(ptrs[1], nq), raw::<T>(ptrs[2], nv), raw::<T>(ptrs[3], nv), raw::<T>(ptrs[4], nv))
            };
            // SAFETY: as above
            let (mut dqr, mut dkr, mut dvr) = unsafe { (raw::<T>(ptrs[5], nq), raw::<T>(ptrs[6], nq), raw::<T>(ptrs[7], nv)) };
            let (qv, kv, vv, ov, dov) = (
                expect(TensorRef::contiguous(&qr, &qs), OP),
                expect(TensorRef::contiguous(&kr, &qs), OP),
                expect(TensorRef::contiguous(&vr, &vs), OP),
                expect(TensorRef::contiguous(&or, &vs), OP),
                expect(TensorRef::contiguous(&dor, &vs), OP),
            );
            let mut dqv = expect(TensorMut::contiguous(&mut dqr, &qs), OP);
            let mut dkv = expect(TensorMut::contiguous(&mut dkr, &qs), OP);
            let mut dvv = expect(TensorMut::contiguous(&mut dvr, &vs), OP);
            let args = BackwardArgs {
                q: &qv,
                k: &kv,
                v: &vv,
                out: Some(&ov),
                dout: &dov,
                grads: LaGrads { dq: &mut dqv, dk: &mut dkv, dv: &mut dvv },
            };
            expect(linear_attention::backward(device, saved, args), OP);
        })
    });
    [dq, dk, dv]
}

// ------------------------------------------------------- burn's own ops, any backend

/// `t` in `dtype` (burn's cast; a no-op when it already has it).
pub(crate) fn cast<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    if t.dtype() == dtype {
        return t;
    }
    let to = match dtype {
        DType::F32 => FloatDType::F32,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        other => panic!("mesa-burn: dtype {other:?} (validation lets only f32/f16/bf16 through)"),
    };
    B::float_cast(t, to)
}

/// The shape of a float tensor.
fn dims<B: Backend>(t: &FloatTensor<B>) -> Vec<usize> {
    t.shape().to_vec()
}

/// `t` as `[rows, last]` (rows = product of the leading axes) and its original shape.
fn rows_2d<B: Backend>(t: FloatTensor<B>) -> (FloatTensor<B>, Vec<usize>) {
    let shape = dims::<B>(&t);
    let last = *shape.last().expect("rank ≥ 1 (validated)");
    let rows = shape[..shape.len() - 1].iter().product::<usize>();
    (B::float_reshape(t, Shape::from(vec![rows, last])), shape)
}

/// `t` reshaped.
fn reshape<B: Backend>(t: FloatTensor<B>, shape: Vec<usize>) -> FloatTensor<B> {
    B::float_reshape(t, Shape::from(shape))
}

/// `x·weight + bias` with the backend's own matmul (exact, the same as burn's linear).
pub(crate) fn linear_plain<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let d_out = dims::<B>(&weight)[1];
    let (x2, mut shape) = rows_2d::<B>(x);
    let y = B::float_matmul(x2, weight);
    let y = B::float_add(y, reshape::<B>(bias, vec![1, d_out]));
    *shape.last_mut().expect("rank ≥ 1") = d_out;
    reshape::<B>(y, shape)
}

/// RMSNorm with the backend's own ops in f32: `(y in x's dtype, x̂ [rows, C] f32, rstd [rows, 1] f32)`.
pub(crate) fn rms_norm_plain<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f32,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dtype = x.dtype();
    let (x2, shape) = rows_2d::<B>(cast::<B>(x, DType::F32));
    let cols = dims::<B>(&x2)[1];
    let ms = B::float_mean_dim(B::float_mul(x2.clone(), x2.clone()), 1);
    let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(ms, eps.into())));
    let xhat = B::float_mul(x2, rstd.clone());
    let w = reshape::<B>(cast::<B>(weight, DType::F32), vec![1, cols]);
    let y = reshape::<B>(B::float_mul(xhat.clone(), w), shape);
    (cast::<B>(y, dtype), xhat, rstd)
}

// ------------------------------------------------------------------ the kernels, per backend

/// A backend whose tensors mesa's CUDA kernels run on, for the autodiff ops below (written once
/// for both): `CubeBackend` runs each kernel call now, host-fenced (the functions above);
/// with the `fusion` feature `Fusion<CubeBackend>` registers it as a fusion custom operation
/// that runs the same function later, on the fusion server (`src/fusion.rs`). Linear's
/// matmuls, RMSNorm's arithmetic and the casts are the backend's own ops. Every argument was
/// validated before dispatch.
pub(crate) trait CudaOps: MesaOps {
    /// The codes of one saved tensor.
    type Codes: Clone + std::fmt::Debug + Send + Sync + 'static;
    /// Linear attention's saved states (the kernels' [`LinearAttentionSaved`]).
    type LaSaved: Clone + std::fmt::Debug + Send + Sync + 'static;

    /// GELU's forward: `y` and the codes of `x`.
    fn gelu_save(x: FloatTensor<Self>, form: GeluForm, codes: &Codes) -> (FloatTensor<Self>, Self::Codes);
    /// GELU's `dx` from the codes of `x`.
    fn gelu_grad(dy: FloatTensor<Self>, form: GeluForm, x: &Self::Codes) -> FloatTensor<Self>;
    /// Softmax's forward (a mask of `x`'s shape): `y` and the square-root codes of `y`.
    fn softmax_save(
        x: FloatTensor<Self>,
        mask: Option<FloatTensor<Self>>,
        codes: &Codes,
    ) -> (FloatTensor<Self>, Self::Codes);
    /// Softmax's `dx` from the codes of `y`.
    fn softmax_grad(dy: FloatTensor<Self>, y: &Self::Codes) -> FloatTensor<Self>;
    /// SwiGLU's forward: `y` and the codes of `gate` and of `up`.
    fn swiglu_save(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        codes: &Codes,
    ) -> (FloatTensor<Self>, Self::Codes, Self::Codes);
    /// SwiGLU's `(dgate, dup)` from the codes.
    fn swiglu_grad(
        dy: FloatTensor<Self>,
        gate: &Self::Codes,
        up: &Self::Codes,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// LayerNorm's forward: `y` and what its backward keeps.
    fn layer_norm_save(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        codes: &Codes,
    ) -> (FloatTensor<Self>, LayerNormSaved<Self>);
    /// LayerNorm's `(dx, dweight, dbias)`, the parameter gradients in the weight's dtype.
    fn layer_norm_grad(
        dy: FloatTensor<Self>,
        saved: &LayerNormSaved<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// The codes of `x` (mesa's quantizer).
    fn quantize_codes(x: FloatTensor<Self>, codes: &Codes, op: &'static str) -> Self::Codes;
    /// The decoded tensor of `saved`, element `dtype`.
    fn decode_codes(saved: &Self::Codes, dtype: DType, op: &'static str) -> FloatTensor<Self>;
    /// Linear attention's forward: the output and what its backward keeps.
    fn linear_attention_save(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        config: &LinearAttentionConfig,
    ) -> (FloatTensor<Self>, LinearAttentionState<Self>);
    /// Linear attention's `[dq, dk, dv]`.
    fn linear_attention_grad(dout: FloatTensor<Self>, state: &LinearAttentionState<Self>) -> [FloatTensor<Self>; 3];
}

/// What LayerNorm's backward keeps: the codes of `x̂`, the per-row `rstd` (`F32` `[rows]`) and
/// the weight (a handle to the parameter's tensor: no copy when it is contiguous).
#[derive(Debug, Clone)]
pub(crate) struct LayerNormSaved<B: CudaOps> {
    pub(crate) xhat: B::Codes,
    pub(crate) rstd: FloatTensor<B>,
    pub(crate) weight: FloatTensor<B>,
}

/// What linear attention's backward keeps: handles to `q`, `k`, `v` and the output (the
/// kernels' backward reads them) and the kernels' saved states (mesa `Buffer`s on mesa's
/// device).
#[derive(Debug, Clone)]
pub(crate) struct LinearAttentionState<B: CudaOps> {
    pub(crate) q: FloatTensor<B>,
    pub(crate) k: FloatTensor<B>,
    pub(crate) v: FloatTensor<B>,
    pub(crate) out: FloatTensor<B>,
    pub(crate) saved: B::LaSaved,
}

impl CudaOps for CubeBackend {
    /// In cubecl's device memory.
    type Codes = CudaCodes;
    type LaSaved = Arc<LinearAttentionSaved>;

    fn gelu_save(x: CubeTensor, form: GeluForm, codes: &Codes) -> (CubeTensor, CudaCodes) {
        let (y, saved) = gelu_forward(x, form, Some(codes));
        (y, saved.expect("codes were asked for"))
    }

    fn gelu_grad(dy: CubeTensor, form: GeluForm, x: &CudaCodes) -> CubeTensor {
        gelu_backward(dy, form, x)
    }

    fn softmax_save(x: CubeTensor, mask: Option<CubeTensor>, codes: &Codes) -> (CubeTensor, CudaCodes) {
        let (y, saved) = softmax_forward(x, mask, Some(codes));
        (y, saved.expect("codes were asked for"))
    }

    fn softmax_grad(dy: CubeTensor, y: &CudaCodes) -> CubeTensor {
        softmax_backward(dy, y)
    }

    fn swiglu_save(gate: CubeTensor, up: CubeTensor, codes: &Codes) -> (CubeTensor, CudaCodes, CudaCodes) {
        let (y, saved) = swiglu_forward(gate, up, Some(codes));
        let (g, u) = saved.expect("codes were asked for");
        (y, g, u)
    }

    fn swiglu_grad(dy: CubeTensor, gate: &CudaCodes, up: &CudaCodes) -> (CubeTensor, CubeTensor) {
        swiglu_backward(dy, gate, up)
    }

    fn layer_norm_save(
        x: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        eps: f32,
        codes: &Codes,
    ) -> (CubeTensor, LayerNormSaved<Self>) {
        let (y, saved) = layer_norm_forward(x, weight, bias, eps, Some(codes));
        (y, saved.expect("codes were asked for"))
    }

    fn layer_norm_grad(dy: CubeTensor, saved: &LayerNormSaved<Self>) -> (CubeTensor, CubeTensor, CubeTensor) {
        layer_norm_backward(dy, saved)
    }

    fn quantize_codes(x: CubeTensor, codes: &Codes, op: &'static str) -> CudaCodes {
        quantize(x, codes, op)
    }

    fn decode_codes(saved: &CudaCodes, dtype: DType, op: &'static str) -> CubeTensor {
        decode(saved, dtype, op)
    }

    fn linear_attention_save(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        config: &LinearAttentionConfig,
    ) -> (CubeTensor, LinearAttentionState<Self>) {
        let (out, [q, k, v], saved) = linear_attention_forward(q, k, v, config);
        (out.clone(), LinearAttentionState { q, k, v, out, saved: Arc::new(saved) })
    }

    fn linear_attention_grad(dout: CubeTensor, s: &LinearAttentionState<Self>) -> [CubeTensor; 3] {
        linear_attention_backward([s.q.clone(), s.k.clone(), s.v.clone(), s.out.clone()], dout, &s.saved)
    }
}

impl MesaOps for CubeBackend {
    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, _codes: Codes) -> FloatTensor<Self> {
        gelu_forward(x, form, None).0
    }

    fn mesa_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        layer_norm_forward(x, weight, bias, eps, None).0
    }

    fn mesa_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        linear_plain::<Self>(x, weight, bias)
    }

    fn mesa_rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32, _codes: Codes) -> FloatTensor<Self> {
        rms_norm_plain::<Self>(x, weight, eps).0
    }

    fn mesa_softmax(x: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        softmax_forward(x, None, None).0
    }

    fn mesa_softmax_masked(x: FloatTensor<Self>, mask: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        softmax_forward(x, Some(mask), None).0
    }

    fn mesa_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        swiglu_forward(gate, up, None).0
    }

    fn mesa_linear_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        config: LinearAttentionConfig,
    ) -> FloatTensor<Self> {
        linear_attention_forward(q, k, v, &config).0
    }
}

// ------------------------------------------------------------------------ the backwards

#[derive(Debug)]
struct GeluBackward {
    form: GeluForm,
}

impl<B: CudaOps> Backward<B, 1> for GeluBackward {
    /// The codes of `x`.
    type State = Arc<B::Codes>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        unary::<B, _>(parents, node, grads, |dy| B::gelu_grad(dy, self.form, &state));
    }
}

#[derive(Debug)]
struct SoftmaxBackward;

/// `dx` from the codes of `y`, for `x` (parent 0) and an additive mask (parent 1: `dm = dx`,
/// as on Flex).
fn softmax_grad<B: CudaOps>(parents: &[Option<NodeId>], dy: FloatTensor<B>, saved: &B::Codes, grads: &mut Gradients) {
    if parents.iter().all(Option::is_none) {
        return;
    }
    let dx = B::softmax_grad(dy, saved);
    for id in parents.iter().flatten() {
        grads.register::<B>(*id, dx.clone());
    }
}

impl<B: CudaOps> Backward<B, 1> for SoftmaxBackward {
    /// The square-root codes of `y`.
    type State = Arc<B::Codes>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px] = ops.parents;
        softmax_grad::<B>(&[px.map(|p| p.id)], dy, &ops.state, grads);
    }
}

impl<B: CudaOps> Backward<B, 2> for SoftmaxBackward {
    /// The square-root codes of `y`.
    type State = Arc<B::Codes>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px, pm] = ops.parents;
        softmax_grad::<B>(&[px.map(|p| p.id), pm.map(|p| p.id)], dy, &ops.state, grads);
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: CudaOps> Backward<B, 2> for SwigluBackward {
    /// The codes of `gate` and of `up`.
    type State = Arc<(B::Codes, B::Codes)>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [pg, pu] = parents;
        let dy = grads.consume::<B>(&node);
        if pg.is_none() && pu.is_none() {
            return;
        }
        let (dg, du) = B::swiglu_grad(dy, &state.0, &state.1);
        if let Some(p) = pg {
            grads.register::<B>(p.id, dg);
        }
        if let Some(p) = pu {
            grads.register::<B>(p.id, du);
        }
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl<B: CudaOps> Backward<B, 3> for LayerNormBackward {
    /// The codes of `x̂`, the per-row `rstd` and the weight.
    type State = Arc<LayerNormSaved<B>>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [px, pw, pb] = parents;
        let dy = grads.consume::<B>(&node);
        let (dx, dw, db) = B::layer_norm_grad(dy, &state);
        if let Some(p) = px {
            grads.register::<B>(p.id, dx);
        }
        if let Some(p) = pw {
            grads.register::<B>(p.id, dw);
        }
        if let Some(p) = pb {
            grads.register::<B>(p.id, db);
        }
    }
}

/// What Linear's backward keeps: the codes of `x` and the weight (a handle).
#[derive(Debug, Clone)]
struct LinearSaved<B: CudaOps> {
    x: B::Codes,
    weight: FloatTensor<B>,
}

#[derive(Debug)]
struct LinearBackward;

impl<B: CudaOps> Backward<B, 3> for LinearBackward {
    /// The codes of `x` and the weight.
    type State = Arc<LinearSaved<B>>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [px, pw, pb] = parents;
        let dy = grads.consume::<B>(&node);
        let (dy2, shape) = rows_2d::<B>(dy);
        let d_in = dims::<B>(&state.weight)[0];
        let wdtype = state.weight.dtype();
        if let Some(p) = px {
            // dx = dy·Wᵀ (exact)
            let dx = B::float_matmul(dy2.clone(), B::float_transpose(state.weight.clone()));
            let mut xshape = shape.clone();
            *xshape.last_mut().expect("rank ≥ 1") = d_in;
            grads.register::<B>(p.id, reshape::<B>(dx, xshape));
        }
        if let Some(p) = pw {
            // dW = Q(x)ᵀ·dy, x decoded from its codes in dy's dtype
            let (xq2, _) = rows_2d::<B>(B::decode_codes(&state.x, dy2.dtype(), "linear backward"));
            let dw = B::float_matmul(B::float_transpose(xq2), dy2.clone());
            grads.register::<B>(p.id, cast::<B>(dw, wdtype));
        }
        if let Some(p) = pb {
            let d_out = dims::<B>(&dy2)[1];
            let db = reshape::<B>(B::float_sum_dim(dy2, 0), vec![d_out]);
            grads.register::<B>(p.id, cast::<B>(db, wdtype));
        }
    }
}

/// What RMSNorm's backward keeps: the codes of `x̂` (f32 `[rows, C]`), `rstd` (`[rows, 1]`
/// f32) and the weight (a handle).
#[derive(Debug, Clone)]
struct RmsNormSaved<B: CudaOps> {
    xhat: B::Codes,
    rstd: FloatTensor<B>,
    weight: FloatTensor<B>,
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: CudaOps> Backward<B, 2> for RmsNormBackward {
    type State = Arc<RmsNormSaved<B>>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let [px, pw] = parents;
        let dy = grads.consume::<B>(&node);
        let dtype = dy.dtype();
        let (dy2, shape) = rows_2d::<B>(cast::<B>(dy, DType::F32));
        let cols = dims::<B>(&dy2)[1];
        let xt = B::decode_codes(&state.xhat, DType::F32, "rms_norm backward");
        if let Some(p) = px {
            // dx = rstd·(g − x̃·mean(g·x̃)), g = dy·w
            let w = reshape::<B>(cast::<B>(state.weight.clone(), DType::F32), vec![1, cols]);
            let g = B::float_mul(dy2.clone(), w);
            let m = B::float_mean_dim(B::float_mul(g.clone(), xt.clone()), 1);
            let dx = B::float_mul(B::float_sub(g, B::float_mul(xt.clone(), m)), state.rstd.clone());
            grads.register::<B>(p.id, cast::<B>(reshape::<B>(dx, shape), dtype));
        }
        if let Some(p) = pw {
            // dw = Σ_rows dy·x̃
            let dw = reshape::<B>(B::float_sum_dim(B::float_mul(dy2, xt), 0), vec![cols]);
            grads.register::<B>(p.id, cast::<B>(dw, state.weight.dtype()));
        }
    }
}

#[derive(Debug)]
struct LinearAttentionBackward;

impl<B: CudaOps> Backward<B, 3> for LinearAttentionBackward {
    type State = LinearAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        let dout = grads.consume::<B>(&node);
        let grads_qkv = B::linear_attention_grad(dout, &state);
        for (p, g) in parents.into_iter().zip(grads_qkv) {
            if let Some(p) = p {
                grads.register::<B>(p.id, g);
            }
        }
    }
}

// ------------------------------------------------------------------------ the autodiff impl

/// The autodiff ops on CUDA, for `Autodiff<CubeBackend, C>` and (with `fusion`)
/// `Autodiff<Fusion<CubeBackend>, C>`: each registers its hand-written backward, whose state is
/// what the backend's `CudaOps` returns.
impl<B: CudaOps, C: CheckpointStrategy> MesaOps for Autodiff<B, C> {
    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, codes: Codes) -> FloatTensor<Self> {
        let (x, guard) = x.into_parts();
        match <GeluBackward as Backward<B, 1>>::prepare::<C>(GeluBackward { form }, [guard]).compute_bound().stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, saved) = B::gelu_save(x, form, &codes);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::mesa_gelu(x, form, codes)),
        }
    }

    fn mesa_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        codes: Codes,
    ) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (w, gw) = weight.into_parts();
        let (b, gb) = bias.into_parts();
        match <LayerNormBackward as Backward<B, 3>>::prepare::<C>(LayerNormBackward, [gx, gw, gb])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, saved) = B::layer_norm_save(x, w, b, eps, &codes);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::mesa_layer_norm(x, w, b, eps, codes)),
        }
    }

    fn mesa_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        codes: Codes,
    ) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (w, gw) = weight.into_parts();
        let (b, gb) = bias.into_parts();
        match <LinearBackward as Backward<B, 3>>::prepare::<C>(LinearBackward, [gx, gw, gb]).compute_bound().stateful()
        {
            OpsKind::Tracked(prep) => {
                let saved = B::quantize_codes(x.clone(), &codes, "linear");
                let y = linear_plain::<B>(x, w.clone(), b);
                prep.finish(Arc::new(LinearSaved { x: saved, weight: w }), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(linear_plain::<B>(x, w, b)),
        }
    }

    fn mesa_rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32, codes: Codes) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (w, gw) = weight.into_parts();
        match <RmsNormBackward as Backward<B, 2>>::prepare::<C>(RmsNormBackward, [gx, gw]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, xhat, rstd) = rms_norm_plain::<B>(x, w.clone(), eps);
                let saved = B::quantize_codes(xhat, &codes, "rms_norm");
                prep.finish(Arc::new(RmsNormSaved { xhat: saved, rstd, weight: w }), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(rms_norm_plain::<B>(x, w, eps).0),
        }
    }

    fn mesa_softmax(x: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        match <SoftmaxBackward as Backward<B, 1>>::prepare::<C>(SoftmaxBackward, [gx]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, saved) = B::softmax_save(x, None, &codes);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::mesa_softmax(x, codes)),
        }
    }

    fn mesa_softmax_masked(x: FloatTensor<Self>, mask: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self> {
        let (x, gx) = x.into_parts();
        let (mask, gm) = mask.into_parts();
        match <SoftmaxBackward as Backward<B, 2>>::prepare::<C>(SoftmaxBackward, [gx, gm]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, saved) = B::softmax_save(x, Some(mask), &codes);
                prep.finish(Arc::new(saved), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::mesa_softmax_masked(x, mask, codes)),
        }
    }

    fn mesa_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, codes: Codes) -> FloatTensor<Self> {
        let (g, gg) = gate.into_parts();
        let (u, gu) = up.into_parts();
        match <SwigluBackward as Backward<B, 2>>::prepare::<C>(SwigluBackward, [gg, gu]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, sg, su) = B::swiglu_save(g, u, &codes);
                prep.finish(Arc::new((sg, su)), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::mesa_swiglu(g, u, codes)),
        }
    }

    fn mesa_linear_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        config: LinearAttentionConfig,
    ) -> FloatTensor<Self> {
        let (q, gq) = q.into_parts();
        let (k, gk) = k.into_parts();
        let (v, gv) = v.into_parts();
        match <LinearAttentionBackward as Backward<B, 3>>::prepare::<C>(LinearAttentionBackward, [gq, gk, gv])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, state) = B::linear_attention_save(q, k, v, &config);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::mesa_linear_attention(q, k, v, config)),
        }
    }
}

/// Validation of a CUDA tensor for an op with a CUDA implementation: the device is CUDA and
/// mesa-kernels can run on it (built with kernels, driver present, the ordinal exists).
///
/// # Errors
/// [`Error::Backend`] (another cubecl runtime), [`Error::Kernel`] (mesa-kernels' device).
pub(crate) fn check_device(device: &CubeDevice, what: &'static str) -> Result<()> {
    let ordinal = ordinal(device).ok_or(Error::Backend { what })?;
    mesa_device(ordinal).map(|_| ())
}
