//! Backends and memory: a CUDA stream (through cudarc) or the host emulation.
//!
//! Every op takes a [`Device`] and buffers of that device. On CUDA, ops are stream-ordered:
//! they enqueue work on the device's stream and return without synchronising (except the
//! few methods documented as "synchronises", which read results back to the host). The
//! emulation runs the same kernel source on host threads, synchronously, on host memory.
//!
//! How ops are ordered against other streams: the crate docs, "Stream contract".
use std::panic::catch_unwind;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};

use crate::error::{Error, Result};
use crate::host_buffer::HostBuffer;

/// Plain data a [`Buffer`] can hold (element types, codes, per-group parameters).
pub trait Storage: Copy + Default + Send + Sync + DeviceRepr + ValidAsZeroBits + 'static {}
impl<T: Copy + Default + Send + Sync + DeviceRepr + ValidAsZeroBits + 'static> Storage for T {}

/// What [`Device::properties`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProperties {
    /// The GPU's name (`"host emulation"` for the emulation).
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for an H200; `None` for the emulation.
    pub compute_capability: Option<(i32, i32)>,
    /// Streaming multiprocessors; for the emulation, the host threads it may use.
    pub multiprocessors: usize,
    /// L2 cache size in bytes (0 for the emulation, which has none of its own).
    pub l2_cache_bytes: usize,
    /// Device memory in bytes (0 for the emulation, which uses host memory).
    pub memory_bytes: usize,
    /// Peak SM clock in kHz (0 for the emulation).
    pub clock_khz: usize,
}

/// Where kernels run.
#[derive(Clone)]
pub struct Device {
    kind: Kind,
}

#[derive(Clone)]
pub(crate) enum Kind {
    Cuda(Arc<CudaStream>),
    Emulator,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description())
    }
}

impl Device {
    /// The host emulation: the same kernel source compiled for the CPU. Always available.
    /// Not a performance backend; it exists so that every test runs on every machine.
    #[must_use]
    pub fn emulator() -> Self {
        Device { kind: Kind::Emulator }
    }

    /// CUDA device `ordinal`, on a new non-blocking stream of its primary context.
    ///
    /// The context object made here does not track buffer uses with cudarc's events (as
    /// candle's devices do not): every op of this crate is ordered on the device's one
    /// stream, and buffers of another stream are ordered by the op itself (the crate docs,
    /// "Stream contract"), so an op costs the host no event record or wait per buffer. A
    /// caller that uses this device's buffers on a stream of its own, outside this crate's
    /// ops, orders those uses itself (`CudaStream::join`, events), as cudarc's
    /// `disable_event_tracking` requires.
    ///
    /// # Errors
    /// [`Error::CudaNotBuilt`] when the library has no CUDA kernels; [`Error::NoCudaDevice`]
    /// when the driver library is missing, no device is visible (`CUDA_VISIBLE_DEVICES=""`)
    /// or the context cannot be created. Never panics.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        if !mesa_kernels_sys::CUDA_BUILT {
            return Err(Error::CudaNotBuilt);
        }
        if !Device::driver_library_present() {
            return Err(Error::NoCudaDevice {
                why: "the CUDA driver library (libcuda) is not installed".into(),
                source: None,
            });
        }
        let ctx = catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| Error::NoCudaDevice { why: "the CUDA driver could not be initialised".into(), source: None })?
            .map_err(|e| Error::NoCudaDevice { why: format!("device {ordinal}"), source: Some(e) })?;
        // SAFETY: nothing has been allocated through this context object yet, and the
        // crate orders every use of its buffers (the doc comment above)
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        Ok(Device { kind: Kind::Cuda(stream) })
    }

    /// Uses an existing cudarc stream: the integration path for a framework. With candle,
    /// pass the stream of its `CudaDevice` (`cuda_device.cuda_stream()`), so that every op is
    /// ordered after candle's own kernels with no event at all (the crate docs, "Stream
    /// contract").
    ///
    /// # Errors
    /// [`Error::CudaNotBuilt`] when the library has no CUDA kernels.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Self> {
        if !mesa_kernels_sys::CUDA_BUILT {
            return Err(Error::CudaNotBuilt);
        }
        Ok(Device { kind: Kind::Cuda(stream) })
    }

    /// True when the CUDA driver library (libcuda) can be loaded. Asks the dynamic loader,
    /// so it answers whichever way cudarc links the driver (its `dynamic-loading` or, in a
    /// graph with candle-core's `cuda`, `dynamic-linking`).
    #[must_use]
    pub fn driver_library_present() -> bool {
        crate::probe::library_present(crate::probe::DRIVER)
    }

    /// CUDA device 0 if it can be used, otherwise the emulation.
    #[must_use]
    pub fn best_available() -> Self {
        Device::cuda(0).unwrap_or_else(|_| Device::emulator())
    }

    /// True for a CUDA device.
    #[must_use]
    pub fn is_cuda(&self) -> bool {
        matches!(self.kind, Kind::Cuda(_))
    }

    /// The cudarc stream of a CUDA device.
    #[must_use]
    pub fn stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.kind {
            Kind::Cuda(s) => Some(s),
            Kind::Emulator => None,
        }
    }

    /// A short human-readable name: the GPU's name and compute capability, or the emulation.
    #[must_use]
    pub fn description(&self) -> String {
        match &self.kind {
            Kind::Cuda(s) => {
                let ctx = s.context();
                let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
                match ctx.compute_capability() {
                    Ok((a, b)) => format!("cuda:{} ({name}, sm_{a}{b})", ctx.ordinal()),
                    Err(_) => format!("cuda:{} ({name})", ctx.ordinal()),
                }
            }
            Kind::Emulator => "host emulation (not a performance backend)".into(),
        }
    }

    /// Short backend name: `"cuda"` or `"emulator"`.
    #[must_use]
    pub fn backend_name(&self) -> &'static str {
        match self.kind {
            Kind::Cuda(_) => "cuda",
            Kind::Emulator => "emulator",
        }
    }

    /// What the device is: queried from the driver for CUDA (never written in), so that
    /// benchmarks size their working sets from the real L2 and grids from the real SM count.
    ///
    /// # Errors
    /// A driver error from a CUDA attribute query. The emulation always answers.
    pub fn properties(&self) -> Result<DeviceProperties> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        match &self.kind {
            Kind::Cuda(s) => {
                let ctx = s.context();
                let attr = |a: A| -> Result<usize> {
                    let v = ctx.attribute(a)?;
                    Ok(usize::try_from(v).unwrap_or(0))
                };
                let (major, minor) = ctx.compute_capability()?;
                Ok(DeviceProperties {
                    name: ctx.name()?,
                    compute_capability: Some((major, minor)),
                    multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                    l2_cache_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
                    memory_bytes: ctx.total_mem()?,
                    clock_khz: attr(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?,
                })
            }
            Kind::Emulator => Ok(DeviceProperties {
                name: "host emulation".into(),
                compute_capability: None,
                multiprocessors: std::thread::available_parallelism().map_or(1, usize::from),
                l2_cache_bytes: 0,
                memory_bytes: 0,
                clock_khz: 0,
            }),
        }
    }

    /// Waits for all work enqueued on this device's stream (no-op for the emulation).
    ///
    /// # Errors
    /// A CUDA error reported by the stream.
    pub fn synchronize(&self) -> Result<()> {
        match &self.kind {
            Kind::Cuda(s) => Ok(s.synchronize()?),
            Kind::Emulator => Ok(()),
        }
    }

    /// Allocates `len` zeroed elements.
    ///
    /// # Errors
    /// [`Error::TooLarge`] when the allocation fails (host) or a CUDA allocation error.
    pub fn alloc_zeros<T: Storage>(&self, len: usize) -> Result<Buffer<T>> {
        check_alloc_size::<T>(len)?;
        match &self.kind {
            Kind::Cuda(s) => Ok(Buffer::Cuda(s.alloc_zeros::<T>(len)?)),
            Kind::Emulator => Ok(Buffer::Host(HostBuffer::zeroed(len)?)),
        }
    }

    /// Allocates `len` elements whose contents are unspecified until a kernel writes them
    /// (stream-ordered `cuMemAllocAsync` on CUDA; host memory for the emulation, poisoned
    /// under its initcheck, zeroed otherwise).
    pub(crate) fn alloc_for_kernel<T: Storage>(&self, len: usize) -> Result<Buffer<T>> {
        check_alloc_size::<T>(len)?;
        match &self.kind {
            // SAFETY: every caller hands the buffer to a kernel that writes all `len`
            // elements before anything reads them.
            Kind::Cuda(s) => Ok(Buffer::Cuda(unsafe { s.alloc::<T>(len) }?)),
            Kind::Emulator => Ok(Buffer::Host(HostBuffer::for_kernel(len)?)),
        }
    }

    /// Copies host data to a new buffer of this device.
    ///
    /// # Errors
    /// A CUDA allocation or copy error.
    pub fn upload<T: Storage>(&self, data: &[T]) -> Result<Buffer<T>> {
        match &self.kind {
            Kind::Cuda(s) => Ok(Buffer::Cuda(s.clone_htod(data)?)),
            Kind::Emulator => Ok(Buffer::Host(HostBuffer::from_slice(data)?)),
        }
    }

    /// Copies host data into an existing buffer of this device (same length).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] on a length mismatch, [`Error::WrongBackend`], or a CUDA error.
    pub fn copy_into<T: Storage>(&self, data: &[T], dst: &mut Buffer<T>) -> Result<()> {
        if data.len() != dst.len() {
            return Err(Error::shape_mismatch("copy source", &[dst.len()], &[data.len()]));
        }
        match (&self.kind, dst) {
            (Kind::Cuda(s), Buffer::Cuda(d)) => Ok(s.memcpy_htod(data, d)?),
            (Kind::Emulator, Buffer::Host(d)) => {
                d.copy_from_slice(data);
                Ok(())
            }
            _ => Err(Error::wrong_backend("copy destination", "the buffer belongs to another backend than the device")),
        }
    }

    pub(crate) fn kind(&self) -> &Kind {
        &self.kind
    }

    /// The device's compute capability (CUDA only), for error messages.
    pub(crate) fn compute_capability(&self) -> Option<(i32, i32)> {
        match &self.kind {
            Kind::Cuda(s) => s.context().compute_capability().ok(),
            Kind::Emulator => None,
        }
    }
}

/// `len` elements of `T` fit in `isize::MAX` bytes (cudarc multiplies unchecked).
fn check_alloc_size<T>(len: usize) -> Result<()> {
    match len.checked_mul(std::mem::size_of::<T>()) {
        Some(bytes) if bytes <= isize::MAX as usize => Ok(()),
        _ => Err(Error::too_large(
            "allocation",
            format!("{len} elements of {} bytes do not fit in memory", std::mem::size_of::<T>()),
        )),
    }
}

/// An owned buffer of one backend: device memory (a cudarc `CudaSlice`) or host memory
/// for the emulation (from the emulator's allocator, which its memory checks guard).
pub enum Buffer<T> {
    /// CUDA device memory.
    Cuda(CudaSlice<T>),
    /// Host memory (emulation backend).
    Host(HostBuffer<T>),
}

impl<T> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Buffer::Cuda(s) => write!(f, "Buffer::Cuda({} elements)", s.len()),
            Buffer::Host(v) => write!(f, "Buffer::Host({} elements)", v.len()),
        }
    }
}

impl<T> std::fmt::Debug for MemRef<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemRef({}, {} elements)", self.describe(), self.len())
    }
}

impl<T> std::fmt::Debug for MemMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemMut({}, {} elements)", self.describe(), self.len())
    }
}

impl<T: Storage> Buffer<T> {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Buffer::Cuda(s) => s.len(),
            Buffer::Host(v) => v.len(),
        }
    }

    /// True when empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    #[must_use]
    pub fn size_in_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }

    /// Copies the contents to the host. Synchronises the buffer's stream on CUDA.
    ///
    /// # Errors
    /// A CUDA copy error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        match self {
            Buffer::Cuda(s) => Ok(s.stream().clone_dtoh(s)?),
            Buffer::Host(v) => Ok(v.to_vec()),
        }
    }
}

/// A device allocation that cudarc does not own (a framework's own allocator), given as a
/// raw device pointer and a length in elements. It carries no stream: it is assumed to be
/// ordered on the op's stream (the crate docs, "Stream contract"). On the emulator backend
/// the address is a host address.
#[derive(Debug)]
pub struct RawDeviceSlice<T> {
    ptr: u64,
    len: usize,
    _t: std::marker::PhantomData<*const T>,
}

impl<T> Clone for RawDeviceSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RawDeviceSlice<T> {}

impl<T> RawDeviceSlice<T> {
    /// Wraps `len` elements of device memory at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be a device allocation of the device the op runs on (a host allocation for
    /// the emulator), valid for `len` elements of `T` for as long as work using it is pending
    /// on the op's stream, and not be written by other work concurrently with an op that
    /// reads it (or read/written concurrently with an op that writes it). Overlap between the
    /// tensors of one call is detected and rejected ([`Error::Aliasing`]); nothing else about
    /// the pointer can be checked.
    #[must_use]
    pub unsafe fn new(ptr: u64, len: usize) -> Self {
        RawDeviceSlice { ptr, len, _t: std::marker::PhantomData }
    }

    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn device_address(&self) -> u64 {
        self.ptr
    }
}

/// Read access to memory an op can use: implemented for [`Buffer`], cudarc's `CudaSlice` /
/// `CudaView`, [`RawDeviceSlice`] (CUDA) and host slices / `Vec` (emulation).
pub trait DeviceMemory<T> {
    /// A borrowed view of the memory.
    fn mem_ref(&self) -> MemRef<'_, T>;
}

/// Write access to memory an op can use (see [`DeviceMemory`]).
pub trait DeviceMemoryMut<T> {
    /// A mutably borrowed view of the memory.
    fn mem_mut(&mut self) -> MemMut<'_, T>;
}

/// Borrowed memory of some backend.
pub enum MemRef<'a, T> {
    /// cudarc device memory.
    Cuda(CudaView<'a, T>),
    /// Foreign device memory.
    Raw(RawDeviceSlice<T>),
    /// Host memory.
    Host(&'a [T]),
}

/// Mutably borrowed memory of some backend.
pub enum MemMut<'a, T> {
    /// cudarc device memory.
    Cuda(CudaViewMut<'a, T>),
    /// Foreign device memory.
    Raw(RawDeviceSlice<T>),
    /// Host memory.
    Host(&'a mut [T]),
}

impl<T> MemRef<'_, T> {
    /// A shorter-lived copy of the same borrow.
    pub(crate) fn reborrow(&self) -> MemRef<'_, T> {
        match self {
            MemRef::Cuda(v) => MemRef::Cuda(v.slice(..)),
            MemRef::Raw(r) => MemRef::Raw(*r),
            MemRef::Host(s) => MemRef::Host(s),
        }
    }

    /// The backend, for `Debug` output.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            MemRef::Cuda(_) => "cuda (cudarc)",
            MemRef::Raw(_) => "raw device pointer",
            MemRef::Host(_) => "host",
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            MemRef::Cuda(v) => cudarc::driver::DeviceSlice::len(v),
            MemRef::Raw(r) => r.len,
            MemRef::Host(s) => s.len(),
        }
    }
}

impl<T> MemMut<'_, T> {
    /// A read-only borrow of the same memory.
    pub(crate) fn reborrow(&self) -> MemRef<'_, T> {
        match self {
            MemMut::Cuda(v) => MemRef::Cuda(v.slice(..)),
            MemMut::Raw(r) => MemRef::Raw(*r),
            MemMut::Host(s) => MemRef::Host(s),
        }
    }

    /// The backend, for `Debug` output.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            MemMut::Cuda(_) => "cuda (cudarc)",
            MemMut::Raw(_) => "raw device pointer",
            MemMut::Host(_) => "host",
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            MemMut::Cuda(v) => cudarc::driver::DeviceSlice::len(v),
            MemMut::Raw(r) => r.len,
            MemMut::Host(s) => s.len(),
        }
    }
}

impl<T> DeviceMemory<T> for Buffer<T> {
    fn mem_ref(&self) -> MemRef<'_, T> {
        match self {
            Buffer::Cuda(s) => MemRef::Cuda(s.as_view()),
            Buffer::Host(v) => MemRef::Host(v),
        }
    }
}
impl<T> DeviceMemoryMut<T> for Buffer<T> {
    fn mem_mut(&mut self) -> MemMut<'_, T> {
        match self {
            Buffer::Cuda(s) => MemMut::Cuda(s.as_view_mut()),
            Buffer::Host(v) => MemMut::Host(v),
        }
    }
}
impl<T> DeviceMemory<T> for CudaSlice<T> {
    fn mem_ref(&self) -> MemRef<'_, T> {
        MemRef::Cuda(self.as_view())
    }
}
impl<T> DeviceMemoryMut<T> for CudaSlice<T> {
    fn mem_mut(&mut self) -> MemMut<'_, T> {
        MemMut::Cuda(self.as_view_mut())
    }
}
impl<T> DeviceMemory<T> for CudaView<'_, T> {
    fn mem_ref(&self) -> MemRef<'_, T> {
        MemRef::Cuda(self.slice(..))
    }
}
impl<T> DeviceMemoryMut<T> for CudaViewMut<'_, T> {
    fn mem_mut(&mut self) -> MemMut<'_, T> {
        MemMut::Cuda(self.slice_mut(..))
    }
}
impl<T> DeviceMemory<T> for RawDeviceSlice<T> {
    fn mem_ref(&self) -> MemRef<'_, T> {
        MemRef::Raw(*self)
    }
}
impl<T> DeviceMemoryMut<T> for RawDeviceSlice<T> {
    fn mem_mut(&mut self) -> MemMut<'_, T> {
        MemMut::Raw(*self)
    }
}
impl<T> DeviceMemory<T> for [T] {
    fn mem_ref(&self) -> MemRef<'_, T> {
        MemRef::Host(self)
    }
}
impl<T> DeviceMemoryMut<T> for [T] {
    fn mem_mut(&mut self) -> MemMut<'_, T> {
        MemMut::Host(self)
    }
}
impl<T> DeviceMemory<T> for Vec<T> {
    fn mem_ref(&self) -> MemRef<'_, T> {
        MemRef::Host(self)
    }
}
impl<T> DeviceMemoryMut<T> for Vec<T> {
    fn mem_mut(&mut self) -> MemMut<'_, T> {
        MemMut::Host(self)
    }
}
