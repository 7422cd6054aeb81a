//! Zero-copy bridge from candle's `Device`, `Storage` and `Layout` to mesa-kernels devices
//! and tensor views.
//!
//! * [`kernel_device`]: a CPU tensor runs on [`mesa_kernels::Device::emulator`] (the same
//!   kernel source compiled for the host), a CUDA tensor on candle's own stream
//!   ([`mesa_kernels::Device::from_stream`] with `CudaDevice::cuda_stream()`): every kernel
//!   is ordered after candle's kernels that wrote its inputs and before candle's kernels that
//!   read its outputs, with no event and no synchronisation (the contract of the crate docs).
//! * [`View`]: a candle tensor's storage read-locked and seen as a
//!   [`mesa_kernels::TensorRef`] through candle's own strides and start offset — no copy,
//!   also for transposed, narrowed or broadcast (stride 0) tensors, which the kernels read
//!   as they are.
//! * [`Output`]: memory a kernel writes (a host `Vec` or a `CudaSlice` on candle's stream),
//!   handed to candle as its storage without a copy ([`Output::into_tensor`]).
use candle_core::{CpuStorage, DType, Shape, Storage, Tensor};
use mesa_kernels::{Buffer, TensorMut, TensorRef};

use crate::error::{Error, KernelResult};

/// A float type both candle and the kernels hold: `f32`, `half::f16`, `half::bf16`.
#[cfg(not(feature = "cuda"))]
pub trait KernelFloat: mesa_kernels::Element + candle_core::WithDType {}
/// A float type both candle and the kernels hold: `f32`, `half::f16`, `half::bf16`.
#[cfg(feature = "cuda")]
pub trait KernelFloat: mesa_kernels::Element + candle_core::WithDType + candle_core::cuda::CudaDType {}
impl KernelFloat for f32 {}
impl KernelFloat for half::f16 {}
impl KernelFloat for half::bf16 {}

/// Runs `$body` with `$t` bound to the Rust type of candle dtype `$dtype` (f32, f16, bf16);
/// any other dtype is [`Error::UnsupportedDType`].
macro_rules! dispatch_float {
    ($dtype:expr, $op:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            other => Err(candle_core::Error::from($crate::error::Error::UnsupportedDType { op: $op, dtype: other })),
        }
    };
}
pub(crate) use dispatch_float;

/// The mesa-kernels device for a candle device: the host emulation for `Device::Cpu`,
/// candle's own CUDA stream for `Device::Cuda` (feature `cuda`).
///
/// # Errors
/// [`Error::UnsupportedDevice`] for Metal, and for CUDA without the `cuda` feature;
/// [`Error::Kernel`] (`CudaNotBuilt`) when the kernels were built without nvcc.
pub fn kernel_device(device: &candle_core::Device) -> candle_core::Result<mesa_kernels::Device> {
    match device {
        candle_core::Device::Cpu => Ok(mesa_kernels::Device::emulator()),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => mesa_kernels::Device::from_stream(d.cuda_stream()).k(),
        other => {
            Err(Error::UnsupportedDevice { op: "kernel_device", device: format!("{:?}", other.location()) }.into())
        }
    }
}

/// candle's layout (dims, strides and start offset, all in elements) as the kernels'.
///
/// # Errors
/// [`Error::Kernel`] when the view does not fit the kernels' limits.
pub fn kernel_layout(layout: &candle_core::Layout) -> candle_core::Result<mesa_kernels::Layout> {
    mesa_kernels::Layout::strided(layout.dims(), layout.stride(), layout.start_offset()).k()
}

/// The tensors of one call share a device, and one the kernels can use.
pub(crate) fn common_device(op: &'static str, tensors: &[&Tensor]) -> candle_core::Result<mesa_kernels::Device> {
    let first = tensors.first().ok_or(Error::InvalidArgument { name: "tensors", why: "none given".into() })?;
    if tensors.iter().any(|t| !t.device().same_device(first.device())) {
        return Err(Error::DeviceMismatch { op }.into());
    }
    kernel_device(first.device())
}

/// A candle tensor read-locked for a kernel: its storage and layout, seen without a copy.
#[derive(Debug)]
pub struct View<'a> {
    storage: candle_core::StorageRef<'a>,
    layout: mesa_kernels::Layout,
    dtype: DType,
}

impl<'a> View<'a> {
    /// Read-locks `t`'s storage (candle's `storage_and_layout`) for as long as the view lives.
    ///
    /// # Errors
    /// As [`kernel_layout`].
    pub fn of(t: &'a Tensor) -> candle_core::Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        Ok(View { layout: kernel_layout(layout)?, storage, dtype: t.dtype() })
    }

    /// The tensor as a kernel input of element type `T` (candle's buffer, candle's strides).
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] when `T` is not the tensor's dtype;
    /// [`Error::UnsupportedDevice`] for a device the bridge cannot serve; the kernels'
    /// view checks as [`Error::Kernel`].
    pub fn tensor_ref<T: KernelFloat>(&self) -> candle_core::Result<TensorRef<'_, T>> {
        if self.dtype != <T as candle_core::WithDType>::DTYPE {
            return Err(Error::UnsupportedDType { op: "view", dtype: self.dtype }.into());
        }
        match &*self.storage {
            Storage::Cpu(s) => TensorRef::new(s.as_slice::<T>()?, &self.layout).k(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => TensorRef::new(s.as_cuda_slice::<T>()?, &self.layout).k(),
            other => {
                Err(Error::UnsupportedDevice { op: "view", device: format!("{:?}", other.device().location()) }.into())
            }
        }
    }
}

/// Where an [`Output`] lives: a host `Vec` for CPU tensors, a kernel buffer otherwise.
#[derive(Debug)]
enum OutputMemory<T> {
    Host(Vec<T>),
    Device(Buffer<T>),
}

/// Memory a kernel writes, then handed to candle as a tensor's storage (no copy): a zeroed
/// host `Vec` for CPU tensors, a zeroed `CudaSlice` on candle's stream for CUDA tensors.
#[derive(Debug)]
pub struct Output<T> {
    memory: OutputMemory<T>,
    shape: Shape,
    device: candle_core::Device,
}

impl<T: KernelFloat> Output<T> {
    /// A dense output of `shape` on `device` (`kernels` is [`kernel_device`] of it).
    ///
    /// # Errors
    /// Allocation errors as [`Error::Kernel`].
    pub fn zeros(
        device: &candle_core::Device,
        kernels: &mesa_kernels::Device,
        shape: &Shape,
    ) -> candle_core::Result<Self> {
        let memory = match device {
            // A Vec from the global allocator: candle takes it as is, and a counting allocator
            // sees it (the emulator's own buffers come from its checked allocator).
            candle_core::Device::Cpu => {
                let n = shape.elem_count();
                let mut v = Vec::new();
                v.try_reserve_exact(n).map_err(|_| {
                    Error::Kernel(mesa_kernels::Error::TooLarge {
                        what: "output".into(),
                        why: format!("cannot allocate {n} elements on the host"),
                    })
                })?;
                v.resize(n, <T as candle_core::WithDType>::from_f64(0.0));
                OutputMemory::Host(v)
            }
            _ => OutputMemory::Device(kernels.alloc_zeros::<T>(shape.elem_count()).k()?),
        };
        Ok(Output { memory, shape: shape.clone(), device: device.clone() })
    }

    /// The whole output as a dense kernel view.
    ///
    /// # Errors
    /// As [`TensorMut::contiguous`], as [`Error::Kernel`].
    pub fn tensor_mut(&mut self) -> candle_core::Result<TensorMut<'_, T>> {
        match &mut self.memory {
            OutputMemory::Host(v) => TensorMut::contiguous(v.as_mut_slice(), self.shape.dims()).k(),
            OutputMemory::Device(b) => TensorMut::contiguous(b, self.shape.dims()).k(),
        }
    }

    /// The output through `layout` (e.g. a transposed view of its contiguous shape; checked to
    /// fit the output's memory).
    pub(crate) fn tensor_mut_as(&mut self, layout: &mesa_kernels::Layout) -> candle_core::Result<TensorMut<'_, T>> {
        match &mut self.memory {
            OutputMemory::Host(v) => TensorMut::new(v.as_mut_slice(), layout).k(),
            OutputMemory::Device(b) => TensorMut::new(b, layout).k(),
        }
    }

    /// The written memory as candle storage (no copy).
    ///
    /// # Errors
    /// [`Error::UnsupportedDevice`] when the buffer's backend does not match the device.
    pub fn into_storage(self) -> candle_core::Result<(Storage, Shape)> {
        let storage = match (self.memory, &self.device) {
            (OutputMemory::Host(v), candle_core::Device::Cpu) => Storage::Cpu(T::to_cpu_storage_owned(v)),
            #[cfg(feature = "cuda")]
            (OutputMemory::Device(Buffer::Cuda(s)), candle_core::Device::Cuda(d)) => {
                Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(s, d.clone()))
            }
            (_, d) => {
                return Err(Error::UnsupportedDevice { op: "output", device: format!("{:?}", d.location()) }.into())
            }
        };
        Ok((storage, self.shape))
    }

    /// The written memory as a candle tensor outside any graph (no copy).
    ///
    /// # Errors
    /// As [`Output::into_storage`].
    pub fn into_tensor(self) -> candle_core::Result<Tensor> {
        let (storage, shape) = self.into_storage()?;
        Ok(Tensor::from_storage(storage, shape, candle_core::op::BackpropOp::none(), false))
    }
}

#[allow(dead_code)]
fn _assert_storage_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Storage>();
    is::<CpuStorage>();
}
