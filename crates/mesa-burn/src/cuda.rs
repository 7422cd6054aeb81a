//! burn's CUDA backend (`CubeBackend` on a `cubecl::Device::Cuda`): mesa-kernels' CUDA kernels
//! on cubecl's memory, host-fenced. **Type-checked only** (`ci/compat/burn-cuda`): this code has
//! never been built into a binary or run (cubecl-cuda 0.11 cannot be linked on the machines that
//! wrote it, docs/burn.md).
//!
//! The contract, per op (docs/burn.md, "CUDA"):
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
//! Cost: two host synchronisations per op (forward and backward each), and the calling
//! thread waits for the kernels. No stream handle of cubecl's is public in cubecl-cuda 0.11,
//! so nothing cheaper (an event handshake between the two streams) is possible without a
//! change upstream.
//!
//! Only GELU has a CUDA implementation. The other ops' methods exist because the backend
//! extension needs every method on every selected backend; [`crate::api`]'s validation
//! refuses a CUDA tensor for them with [`crate::Error::Backend`] before dispatch, so they are
//! unreachable through the crate's functions (called directly, they panic with a message).
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl_runtime::runtime::Runtime;
use half::{bf16, f16};
use mesa_kernels::linear_attention::LinearAttentionConfig;
use mesa_kernels::{
    fused, saved_sizes, Device, GeluForm, GroupParams, Quantizer, RawDeviceSlice, SavedMeta, SavedView, SavedViewMut,
    TensorMut, TensorRef,
};

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
            other => panic!("mesa-burn: dtype {other:?} reached a CUDA kernel (validation lets only f32/f16/bf16 through)"),
        }
    };
}

/// `t`, contiguous and untiled, and its shape.
fn contiguous(t: CubeTensor) -> (CubeTensor, Vec<usize>) {
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
fn pin_and_fence(
    tensors: &[&CubeTensor],
    op: &'static str,
) -> Pinned<impl Sized> {
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

/// The mesa device for a tensor of this backend.
fn device_of(t: &CubeTensor, op: &'static str) -> Device {
    let ordinal = ordinal(&t.device).unwrap_or_else(|| panic!("mesa-burn {op}: not a CUDA device (validation refuses it)"));
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

/// GELU's forward on CUDA: `y`, and the codes of `x` when `codes` is given.
fn gelu_forward(x: CubeTensor, form: GeluForm, codes: Option<&Codes>) -> (CubeTensor, Option<CudaCodes>) {
    const OP: &str = "gelu";
    let (x, shape) = contiguous(x);
    let dtype = x.dtype;
    let n: usize = shape.iter().product();
    let y = empty_like(&x, &shape, dtype);
    let device = device_of(&x, OP);
    let Some(codes) = codes else {
        let pinned = pin_and_fence(&[&x, &y], OP);
        with_float!(dtype, T => {
            // SAFETY: both buffers are pinned (alive, not relocated) until `pinned` drops, after
            // the synchronisation below; cubecl's writes to `x` completed at the fence, and
            // nothing of cubecl's touches `y` before this op returns it
            let (xs, mut ys) = unsafe { (RawDeviceSlice::<T>::new(pinned.ptrs[0], n), RawDeviceSlice::<T>::new(pinned.ptrs[1], n)) };
            let xv = expect(TensorRef::contiguous(&xs, &shape), OP);
            let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
            expect(fused::gelu(&device, form, &xv, &mut yv), OP);
        });
        expect(device.synchronize(), OP);
        drop(pinned);
        return (y, None);
    };
    let config = codes.quant_config();
    let sizes = expect(saved_sizes(&shape, &config), OP);
    let code_bytes = sizes.code_bytes.div_ceil(8) * 8;
    let codes_t = empty_like(&x, &[code_bytes], DType::U8);
    let params_t = empty_like(&x, &[sizes.groups * 2], DType::F32);
    let mut quantizer = expect(Quantizer::new(&device, config), OP);
    // the non-finite counter (zeroed; nothing reads it after the forward): mesa's own buffer
    let mut counter = expect(device.alloc_zeros::<u32>(1), OP);
    let pinned = pin_and_fence(&[&x, &y, &codes_t, &params_t], OP);
    let meta = with_float!(dtype, T => {
        // SAFETY: as above; the codes and parameters are fresh allocations of this op
        let (xs, mut ys, mut cs, mut ps) = unsafe {
            (
                RawDeviceSlice::<T>::new(pinned.ptrs[0], n),
                RawDeviceSlice::<T>::new(pinned.ptrs[1], n),
                RawDeviceSlice::<u8>::new(pinned.ptrs[2], code_bytes),
                RawDeviceSlice::<GroupParams>::new(pinned.ptrs[3], sizes.groups),
            )
        };
        let xv = expect(TensorRef::contiguous(&xs, &shape), OP);
        let mut yv = expect(TensorMut::contiguous(&mut ys, &shape), OP);
        let mut view = expect(
            SavedViewMut::new(
                expect(TensorMut::contiguous(&mut cs, &[sizes.code_bytes]), OP),
                expect(TensorMut::contiguous(&mut ps, &[sizes.groups]), OP),
                expect(TensorMut::contiguous(&mut counter, &[1]), OP),
            ),
            OP,
        );
        expect(fused::gelu_forward_to(&device, &mut quantizer, form, &xv, &mut yv, &mut view), OP)
    });
    expect(device.synchronize(), OP);
    drop(pinned);
    let saved = CudaCodes { codes: codes_t, code_bytes: sizes.code_bytes, params: params_t, groups: sizes.groups, meta };
    (y, Some(saved))
}

/// GELU's backward on CUDA: `dx = dy·gelu'(x̃)` from the codes.
fn gelu_backward(dy: CubeTensor, form: GeluForm, saved: &CudaCodes) -> CubeTensor {
    const OP: &str = "gelu backward";
    let (dy, shape) = contiguous(dy);
    let dtype = dy.dtype;
    let n: usize = shape.iter().product();
    let dx = empty_like(&dy, &shape, dtype);
    let device = device_of(&dy, OP);
    let pinned = pin_and_fence(&[&dy, &dx, &saved.codes, &saved.params], OP);
    with_float!(dtype, T => {
        // SAFETY: all four buffers pinned until after the synchronisation below; the codes
        // were written by the forward (synchronised before it returned)
        let (dys, mut dxs, cs, ps) = unsafe {
            (
                RawDeviceSlice::<T>::new(pinned.ptrs[0], n),
                RawDeviceSlice::<T>::new(pinned.ptrs[1], n),
                RawDeviceSlice::<u8>::new(pinned.ptrs[2], saved.code_bytes),
                RawDeviceSlice::<GroupParams>::new(pinned.ptrs[3], saved.groups),
            )
        };
        let view = expect(
            SavedView::new(
                expect(TensorRef::contiguous(&cs, &[saved.code_bytes]), OP),
                expect(TensorRef::contiguous(&ps, &[saved.groups]), OP),
                saved.meta.clone(),
            ),
            OP,
        );
        let dyv = expect(TensorRef::contiguous(&dys, &shape), OP);
        let mut dxv = expect(TensorMut::contiguous(&mut dxs, &shape), OP);
        expect(fused::gelu_backward_view(&device, form, &view, &dyv, &mut dxv), OP);
    });
    expect(device.synchronize(), OP);
    drop(pinned);
    dx
}

/// The methods without a CUDA implementation: unreachable through the crate's functions.
fn not_on_cuda(op: &'static str) -> ! {
    panic!("mesa-burn {op}: no CUDA implementation in this version (mesa_burn::{op} refuses CUDA tensors with Error::Backend)")
}

impl MesaOps for CubeBackend {
    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, _codes: Codes) -> FloatTensor<Self> {
        gelu_forward(x, form, None).0
    }

    fn mesa_layer_norm(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _bias: FloatTensor<Self>,
        _eps: f32,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        not_on_cuda("layer_norm")
    }

    fn mesa_linear(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _bias: FloatTensor<Self>,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        not_on_cuda("linear")
    }

    fn mesa_rms_norm(_x: FloatTensor<Self>, _weight: FloatTensor<Self>, _eps: f32, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("rms_norm")
    }

    fn mesa_softmax(_x: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("softmax")
    }

    fn mesa_softmax_masked(_x: FloatTensor<Self>, _mask: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("softmax")
    }

    fn mesa_swiglu(_gate: FloatTensor<Self>, _up: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("swiglu")
    }

    fn mesa_linear_attention(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _config: LinearAttentionConfig,
    ) -> FloatTensor<Self> {
        not_on_cuda("linear_attention")
    }
}

#[derive(Debug)]
struct GeluBackward {
    form: GeluForm,
}

impl Backward<CubeBackend, 1> for GeluBackward {
    /// The codes of `x`, in cubecl's device memory.
    type State = Arc<CudaCodes>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Ops { parents, node, state } = ops;
        unary::<CubeBackend, _>(parents, node, grads, |dy| gelu_backward(dy, self.form, &state));
    }
}

impl<C: CheckpointStrategy> MesaOps for Autodiff<CubeBackend, C> {
    fn mesa_gelu(x: FloatTensor<Self>, form: GeluForm, codes: Codes) -> FloatTensor<Self> {
        let (x, guard) = x.into_parts();
        match (GeluBackward { form }).prepare::<C>([guard]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, saved) = gelu_forward(x, form, Some(&codes));
                prep.finish(Arc::new(saved.expect("codes were asked for")), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(gelu_forward(x, form, None).0),
        }
    }

    fn mesa_layer_norm(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _bias: FloatTensor<Self>,
        _eps: f32,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        not_on_cuda("layer_norm")
    }

    fn mesa_linear(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _bias: FloatTensor<Self>,
        _codes: Codes,
    ) -> FloatTensor<Self> {
        not_on_cuda("linear")
    }

    fn mesa_rms_norm(_x: FloatTensor<Self>, _weight: FloatTensor<Self>, _eps: f32, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("rms_norm")
    }

    fn mesa_softmax(_x: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("softmax")
    }

    fn mesa_softmax_masked(_x: FloatTensor<Self>, _mask: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("softmax")
    }

    fn mesa_swiglu(_gate: FloatTensor<Self>, _up: FloatTensor<Self>, _codes: Codes) -> FloatTensor<Self> {
        not_on_cuda("swiglu")
    }

    fn mesa_linear_attention(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _config: LinearAttentionConfig,
    ) -> FloatTensor<Self> {
        not_on_cuda("linear_attention")
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
