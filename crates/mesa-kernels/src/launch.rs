//! The launch builder: the one place where memory becomes kernel addresses and where
//! kernels are called.
//!
//! An op creates a [`Launch`] for its device, registers every tensor and buffer its kernels
//! read or write ([`Launch::input`], [`Launch::output`], [`Launch::read_buffer`],
//! [`Launch::write_buffer`]), fills its argument structs with the addresses these return,
//! calls [`Launch::launch`] once per kernel and ends with [`Launch::finish`]. The builder
//!
//! * checks that each memory belongs to the device's backend and CUDA context and that raw
//!   pointers are aligned;
//! * rejects two registrations whose address ranges overlap when either is written
//!   ([`Error::Aliasing`]) — no kernel of this crate supports in-place calls;
//! * orders the work against buffers owned by another stream, both ways: before the first
//!   kernel the op's stream waits for everything enqueued so far on each such stream; at
//!   `finish` each such stream waits for the op's kernels, so a later free or write there
//!   is ordered after them (this holds whether or not the buffer's context tracks events);
//! * holds cudarc's guards ([`SyncOnDrop`]) until every kernel is enqueued, so the read and
//!   write events cudarc records for a tracked `CudaSlice` cover the kernels.
//!
//! Addresses handed out are plain values for the `#[repr(C)]` argument structs; they are only
//! used by [`Launch::launch`] of the same builder, while its guards are held.
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use mesa_kernels_sys as sys;

use crate::device::{Buffer, Device, Kind, MemMut, MemRef, Storage};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::{TensorMut, TensorRef};

/// One registered address range (bytes), for the aliasing check.
#[derive(Debug, Clone, Copy)]
struct Access {
    what: &'static str,
    start: u64,
    end: u64,
    write: bool,
}

/// The launch builder of one op call (see the module docs).
pub(crate) struct Launch<'a> {
    device: &'a Device,
    accesses: Vec<Access>,
    /// Streams other than the op's that own registered buffers (each once).
    foreign: Vec<Arc<CudaStream>>,
    /// cudarc's guards: dropped after the last kernel is enqueued (field order: after
    /// `foreign`'s back-joins, which `finish`/`drop` do first).
    guards: Vec<SyncOnDrop<'a>>,
    finished: bool,
}

impl std::fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("device", self.device)
            .field("accesses", &self.accesses)
            .field("foreign_streams", &self.foreign.len())
            .finish()
    }
}

/// `[offset, offset + extent)` in bytes of a view, or `None` when it is empty.
fn byte_range<T>(base: u64, layout: &Layout) -> Option<(u64, u64)> {
    let (first, end) = layout.element_range()?;
    let elem = std::mem::size_of::<T>() as u64;
    Some((base + first as u64 * elem, base + end as u64 * elem))
}

impl<'a> Launch<'a> {
    /// A builder for kernels on `device`.
    pub(crate) fn new(device: &'a Device) -> Self {
        Launch { device, accesses: Vec::new(), foreign: Vec::new(), guards: Vec::new(), finished: false }
    }

    /// The device the kernels run on.
    pub(crate) fn device(&self) -> &'a Device {
        self.device
    }

    fn note(&mut self, what: &'static str, range: Option<(u64, u64)>, write: bool) -> Result<()> {
        let Some((start, end)) = range else { return Ok(()) };
        if start == end {
            return Ok(());
        }
        for a in &self.accesses {
            if (a.write || write) && a.start < end && start < a.end {
                return Err(Error::Aliasing { first: a.what, second: what });
            }
        }
        self.accesses.push(Access { what, start, end, write });
        Ok(())
    }

    /// Checks that a cudarc buffer of `owner` can be used on the op's stream `op`, and
    /// makes the op's stream wait for `owner`'s work when they differ.
    fn adopt_stream(&mut self, owner: &Arc<CudaStream>, op: &CudaStream, what: &'static str) -> Result<()> {
        if owner.context().cu_ctx() != op.context().cu_ctx() {
            return Err(Error::wrong_backend(
                what,
                format!(
                    "the buffer belongs to another CUDA context (device {}) than the op's stream (device {})",
                    owner.context().ordinal(),
                    op.context().ordinal()
                ),
            ));
        }
        if owner.cu_stream() == op.cu_stream() || self.foreign.iter().any(|s| s.cu_stream() == owner.cu_stream()) {
            return Ok(());
        }
        op.join(owner).map_err(Error::driver("ordering the op after the buffer's stream"))?;
        self.foreign.push(owner.clone());
        Ok(())
    }

    fn raw_address<T>(&self, ptr: u64, what: &'static str) -> Result<u64> {
        let align = std::mem::align_of::<T>() as u64;
        if ptr % align != 0 {
            return Err(Error::Misaligned { what, align: align as usize });
        }
        Ok(ptr)
    }

    /// Registers memory the kernels read; returns its base address (element 0 of `m`).
    fn read_mem<T>(&mut self, m: &'a MemRef<'_, T>, layout: &Layout, what: &'static str) -> Result<u64> {
        let device: &'a Device = self.device;
        let base = match (device.kind(), m) {
            (Kind::Cuda(s), MemRef::Cuda(v)) => {
                self.adopt_stream(v.stream(), s, what)?;
                let (p, guard) = v.device_ptr(s);
                self.guards.push(guard);
                p
            }
            (Kind::Cuda(_) | Kind::Emulator, MemRef::Raw(r)) => self.raw_address::<T>(r.device_address(), what)?,
            (Kind::Emulator, MemRef::Host(h)) => h.as_ptr() as u64,
            (Kind::Emulator, MemRef::Cuda(_)) => {
                return Err(Error::wrong_backend(what, "CUDA device memory given to the emulator"))
            }
            (Kind::Cuda(_), MemRef::Host(_)) => {
                return Err(Error::wrong_backend(what, "host memory given to the CUDA backend"))
            }
        };
        self.note(what, byte_range::<T>(base, layout), false)?;
        Ok(base)
    }

    /// Registers memory the kernels write (and may read); returns its base address.
    fn write_mem<T>(&mut self, m: &'a mut MemMut<'_, T>, layout: &Layout, what: &'static str) -> Result<u64> {
        let device: &'a Device = self.device;
        let base = match (device.kind(), m) {
            (Kind::Cuda(s), MemMut::Cuda(v)) => {
                let owner = v.stream().clone();
                self.adopt_stream(&owner, s, what)?;
                let (p, guard) = v.device_ptr_mut(s);
                self.guards.push(guard);
                p
            }
            (Kind::Cuda(_) | Kind::Emulator, MemMut::Raw(r)) => self.raw_address::<T>(r.device_address(), what)?,
            (Kind::Emulator, MemMut::Host(h)) => h.as_mut_ptr() as u64,
            (Kind::Emulator, MemMut::Cuda(_)) => {
                return Err(Error::wrong_backend(what, "CUDA device memory given to the emulator"))
            }
            (Kind::Cuda(_), MemMut::Host(_)) => {
                return Err(Error::wrong_backend(what, "host memory given to the CUDA backend"))
            }
        };
        self.note(what, byte_range::<T>(base, layout), true)?;
        Ok(base)
    }

    /// Registers a tensor the kernels read; returns the address of its first element (the
    /// layout's offset applied), for the kernel's `(pointer, MesaTensorDesc)` pair.
    pub(crate) fn input<T>(&mut self, t: &'a TensorRef<'_, T>, what: &'static str) -> Result<*const c_void> {
        let base = self.read_mem(t.mem(), t.layout(), what)?;
        Ok(offset_address::<T>(base, t.layout().offset()) as *const c_void)
    }

    /// Registers a tensor the kernels write; returns the address of its first element.
    pub(crate) fn output<T>(&mut self, t: &'a mut TensorMut<'_, T>, what: &'static str) -> Result<*mut c_void> {
        let layout = t.layout().clone();
        let base = self.write_mem(t.mem_mut(), &layout, what)?;
        Ok(offset_address::<T>(base, layout.offset()) as *mut c_void)
    }

    /// Registers a whole buffer the kernels read (codes, parameters, states).
    pub(crate) fn read_buffer<T: Storage>(&mut self, b: &'a Buffer<T>, what: &'static str) -> Result<*const T> {
        let layout = Layout::contiguous(&[b.len()]);
        let device: &'a Device = self.device;
        let base = match (device.kind(), b) {
            (Kind::Cuda(s), Buffer::Cuda(v)) => {
                self.adopt_stream(v.stream(), s, what)?;
                let (p, guard) = v.device_ptr(s);
                self.guards.push(guard);
                p
            }
            (Kind::Emulator, Buffer::Host(h)) => h.as_ptr() as u64,
            _ => return Err(Error::wrong_backend(what, "the buffer belongs to another backend than the device")),
        };
        self.note(what, byte_range::<T>(base, &layout), false)?;
        Ok(base as *const T)
    }

    /// Registers a whole buffer the kernels write (and may read).
    pub(crate) fn write_buffer<T: Storage>(&mut self, b: &'a mut Buffer<T>, what: &'static str) -> Result<*mut T> {
        let layout = Layout::contiguous(&[b.len()]);
        let device: &'a Device = self.device;
        let base = match (device.kind(), b) {
            (Kind::Cuda(s), Buffer::Cuda(v)) => {
                let owner = v.stream().clone();
                self.adopt_stream(&owner, s, what)?;
                let (p, guard) = v.device_ptr_mut(s);
                self.guards.push(guard);
                p
            }
            (Kind::Emulator, Buffer::Host(h)) => h.as_mut_ptr() as u64,
            _ => return Err(Error::wrong_backend(what, "the buffer belongs to another backend than the device")),
        };
        self.note(what, byte_range::<T>(base, &layout), true)?;
        Ok(base as *mut T)
    }

    /// Calls one kernel entry point of the right build: `cuda` on the device's stream (with
    /// the stream's context bound to this thread), `emu` for the emulation (synchronous).
    ///
    /// # Safety
    /// Every pointer in `args` must come from this builder's registrations (or be null where
    /// the kernel's header allows it), and the sizes in `args` must describe no more memory
    /// than was registered: the kernel header's contract for `A`.
    pub(crate) unsafe fn launch<A>(
        &mut self,
        kernel: &'static str,
        args: &A,
        cuda: unsafe extern "C" fn(*const A, *mut c_void) -> sys::MesaStatus,
        emu: unsafe extern "C" fn(*const A, *mut c_void) -> sys::MesaStatus,
    ) -> Result<()> {
        let status = match self.device.kind() {
            Kind::Cuda(s) => {
                // a launch from a thread whose current context is another device's would go
                // to the wrong device: bind the stream's context first
                s.context().bind_to_thread().map_err(Error::driver("binding the stream's context"))?;
                // SAFETY: forwarded from the caller's contract; the guards of every
                // registered buffer are held by `self` until after this call.
                unsafe { cuda(args, s.cu_stream() as *mut c_void) }
            }
            Kind::Emulator => {
                // SAFETY: forwarded from the caller's contract.
                let status = unsafe { emu(args, std::ptr::null_mut()) };
                if let Some(report) = crate::emulator::take_report() {
                    return Err(Error::EmulatorCheck { op: kernel, report });
                }
                status
            }
        };
        let cc = if status == 0 { None } else { self.device.compute_capability() };
        crate::error::check_status(kernel, status, cc)
    }

    /// Orders the buffers' own streams after the kernels, then releases cudarc's guards
    /// (which record the read/write events on the op's stream).
    ///
    /// # Errors
    /// A driver error from recording or waiting an event.
    pub(crate) fn finish(mut self) -> Result<()> {
        self.finished = true;
        self.join_back()
    }

    fn join_back(&mut self) -> Result<()> {
        let Kind::Cuda(op) = self.device.kind() else { return Ok(()) };
        let mut first_err = None;
        for owner in self.foreign.drain(..) {
            if let Err(e) = owner.join(op) {
                first_err.get_or_insert(Error::Driver { op: "ordering the buffer's stream after the op", source: e });
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Launch<'_> {
    fn drop(&mut self) {
        if !self.finished {
            // an op that returned early (an error after some kernels were enqueued): keep the
            // ordering promise anyway; a failure is recorded in the context like cudarc's own
            // drop-time errors
            if let (Err(Error::Driver { source, .. }), Kind::Cuda(op)) = (self.join_back(), self.device.kind()) {
                op.context().record_err(Err::<(), _>(source));
            }
        }
        // the guards (and their event records) drop after this, with the fields
    }
}

/// `base + offset` elements of `T`, as an address.
fn offset_address<T>(base: u64, offset: usize) -> u64 {
    // the view was checked to fit its buffer (TensorRef/TensorMut::new), so this is inside
    // the allocation
    base.wrapping_add((offset as u64).wrapping_mul(std::mem::size_of::<T>() as u64))
}
