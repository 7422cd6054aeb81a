//! Host memory of the emulator backend: allocated by the emulator, so that its memory
//! checks (canaries, guard page, poison) cover every buffer it hands to kernels.
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use mesa_kernels_sys::emu as sys;

use crate::device::Storage;
use crate::error::{Error, Result};

/// `len` elements of host memory from the emulator's allocator (`mesa_emu_alloc`): with
/// `MESA_EMU_CHECK=memcheck` it ends at canary bytes and a guard page, with `initcheck` a
/// buffer that is not zeroed by contract starts poisoned. Derefs to a slice.
pub struct HostBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
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
        Ok(HostBuffer { ptr, len })
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

    /// A copy of `data`.
    pub(crate) fn from_slice(data: &[T]) -> Result<Self> {
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
    }
}

impl<T> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({} elements)", self.len)
    }
}
