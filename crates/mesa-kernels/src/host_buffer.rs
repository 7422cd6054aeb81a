//! Host memory of the emulator backend: allocated by the emulator, so that its memory
//! checks (canaries, guard page, poison) cover every buffer it hands to kernels.
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::OnceLock;

use mesa_kernels_sys::emu as sys;

use crate::device::Storage;
use crate::error::{Error, Result};

/// Told of the bytes of every [`HostBuffer`] as it is allocated and freed, so that a host
/// measuring its memory (a counting global allocator, say) also sees the emulator's buffers,
/// which do not come from the Rust global allocator. Install one with
/// [`observe_host_memory`].
pub trait HostMemoryObserver: Sync {
    /// `bytes` (elements × element size; canaries and guard pages not counted) allocated.
    fn allocated(&self, bytes: usize);
    /// `bytes` freed, as given to [`HostMemoryObserver::allocated`] before.
    fn freed(&self, bytes: usize);
}

static OBSERVER: OnceLock<&'static dyn HostMemoryObserver> = OnceLock::new();

/// Installs the process's one [`HostMemoryObserver`]; buffers allocated before are not
/// reported, neither when allocated nor when freed (install it first thing). Installing the same observer again is a no-op.
///
/// # Errors
/// [`Error::InvalidArgument`] when another observer is installed already.
pub fn observe_host_memory(observer: &'static dyn HostMemoryObserver) -> Result<()> {
    let installed = *OBSERVER.get_or_init(|| observer);
    if std::ptr::addr_eq(installed as *const dyn HostMemoryObserver, observer as *const dyn HostMemoryObserver) {
        Ok(())
    } else {
        Err(Error::invalid_argument("observe_host_memory", "another observer is installed already"))
    }
}

fn bytes_of<T>(len: usize) -> usize {
    len * std::mem::size_of::<T>()
}

/// `len` elements of host memory from the emulator's allocator (`mesa_emu_alloc`): with
/// `MESA_EMU_CHECK=memcheck` it ends at canary bytes and a guard page, with `initcheck` a
/// buffer that is not zeroed by contract starts poisoned. Derefs to a slice.
pub struct HostBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Reported to the [`HostMemoryObserver`] when allocated (so reported when freed).
    observed: bool,
}

// SAFETY: the buffer owns its elements like a Vec<T> does.
unsafe impl<T: Send> Send for HostBuffer<T> {}
// SAFETY: shared access gives only &[T].
unsafe impl<T: Sync> Sync for HostBuffer<T> {}

impl<T: Storage> HostBuffer<T> {
    /// `len` elements, all bits zero (`zeroed`), or poisoned under initcheck (else zero).
    fn alloc(len: usize, zeroed: bool) -> Result<Self> {
        let too_large = || {
            Error::too_large(
                "host allocation",
                format!("cannot allocate {len} elements of {} bytes", std::mem::size_of::<T>()),
            )
        };
        if std::mem::align_of::<T>() > 16 {
            return Err(Error::unsupported("host allocation", "element alignment above 16 bytes"));
        }
        let bytes =
            len.checked_mul(std::mem::size_of::<T>()).filter(|&b| b <= isize::MAX as usize).ok_or_else(too_large)?;
        // SAFETY: returns null or `bytes` (at least 1) bytes aligned to 16.
        let p = unsafe { sys::mesa_emu_alloc(bytes, i32::from(zeroed)) };
        let ptr = NonNull::new(p.cast::<T>()).ok_or_else(too_large)?;
        let observer = OBSERVER.get();
        if let Some(o) = observer {
            o.allocated(bytes);
        }
        Ok(HostBuffer { ptr, len, observed: observer.is_some() })
    }

    /// `len` zeroed elements (valid: `Storage` types are valid as all-zero bits).
    pub(crate) fn zeroed(len: usize) -> Result<Self> {
        Self::alloc(len, true)
    }

    /// `len` elements a kernel writes before anything reads them: poisoned under initcheck
    /// (all bytes 0xff or 0x7f, by seed), zero otherwise. Only for the crate's plain numeric
    /// types, for which every bit pattern is a value.
    pub(crate) fn for_kernel(len: usize) -> Result<Self> {
        Self::alloc(len, false)
    }

    /// A copy of `data` in the emulator's allocator (checked under memcheck), for building
    /// a [`Buffer::Host`](crate::Buffer::Host) directly.
    ///
    /// # Errors
    /// [`Error::TooLarge`] when the allocation fails; [`Error::Unsupported`] for an element
    /// alignment above 16 bytes.
    pub fn from_slice(data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(data.len(), true)?;
        b.copy_from_slice(data);
        Ok(b)
    }
}

impl<T> Deref for HostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (zeroed, poisoned plain data or copied)
        // owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from mesa_emu_alloc and is freed once; `T: Copy` (Storage) has
        // no destructor to run.
        unsafe { sys::mesa_emu_free(self.ptr.as_ptr().cast()) }
        if let (true, Some(o)) = (self.observed, OBSERVER.get()) {
            o.freed(bytes_of::<T>(self.len));
        }
    }
}

impl<T> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({} elements)", self.len)
    }
}
