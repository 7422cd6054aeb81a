//! The one tensor-view type of the crate: memory of some backend plus a [`Layout`].
//!
//! Every op takes its inputs as [`TensorRef`] and its outputs as [`TensorMut`]. Both are
//! built from anything that implements [`DeviceMemory`] / [`DeviceMemoryMut`] — a
//! [`Buffer`](crate::Buffer), a cudarc `CudaSlice` / `CudaView` (candle's storage), a
//! [`RawDeviceSlice`](crate::RawDeviceSlice), a host slice or sub-slice (`&v[k..]`, the
//! emulator's memory) — and checked once, at construction: the view must fit its buffer, and
//! an output view must not overlap itself. An op therefore never sees an out-of-bounds view.
//!
//! ```
//! use mesa_kernels::{Device, Layout, TensorMut, TensorRef};
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::emulator();
//! let x = device.upload(&[0.0f32; 24])?;
//! // [2, 3, 4] dense, and its transpose as a strided view of the same memory
//! let dense = TensorRef::contiguous(&x, &[2, 3, 4])?;
//! let t = TensorRef::new(&x, &dense.layout().transpose(1, 2)?)?;
//! assert_eq!(t.shape(), &[2, 4, 3]);
//! // a view that reaches past the buffer is an error, not a read out of bounds
//! assert!(TensorRef::contiguous(&x, &[5, 5]).is_err());
//! let mut y = device.alloc_zeros::<f32>(24)?;
//! let y = TensorMut::contiguous(&mut y, &[2, 3, 4])?;
//! assert_eq!(y.numel(), 24);
//! # Ok(())
//! # }
//! ```
use std::fmt;

use crate::device::{DeviceMemory, DeviceMemoryMut, MemMut, MemRef};
use crate::error::Result;
use crate::layout::Layout;

/// A read-only tensor: borrowed memory of one backend viewed through a [`Layout`] (shape,
/// strides and offset in elements). Strides may be 0 (broadcast).
pub struct TensorRef<'a, T> {
    mem: MemRef<'a, T>,
    layout: Layout,
}

/// A writable tensor: mutably borrowed memory of one backend viewed through a [`Layout`]
/// whose elements are all distinct (no stride 0, no self-overlap).
pub struct TensorMut<'a, T> {
    mem: MemMut<'a, T>,
    layout: Layout,
}

impl<'a, T> TensorRef<'a, T> {
    /// `mem` viewed through `layout`.
    ///
    /// # Errors
    /// [`Error::BufferTooShort`](crate::Error::BufferTooShort) when the view reaches past the
    /// memory; [`Error::TooLarge`](crate::Error::TooLarge) when its element count or offsets
    /// overflow the kernels' signed 64-bit arithmetic.
    pub fn new(mem: &'a (impl DeviceMemory<T> + ?Sized), layout: &Layout) -> Result<Self> {
        let mem = mem.mem_ref();
        let layout = layout.clone();
        layout.check_fits(mem.len(), "tensor")?;
        Ok(TensorRef { mem, layout })
    }

    /// `mem` as a dense row-major tensor of `shape` at offset 0.
    ///
    /// # Errors
    /// As [`TensorRef::new`].
    pub fn contiguous(mem: &'a (impl DeviceMemory<T> + ?Sized), shape: &[usize]) -> Result<Self> {
        TensorRef::new(mem, &Layout::contiguous(shape))
    }

    /// The view.
    #[must_use]
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Logical shape.
    #[must_use]
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
    /// Number of elements of the view.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }
    /// The same memory through another layout (checked again).
    ///
    /// # Errors
    /// As [`TensorRef::new`].
    pub fn with_layout(&self, layout: &Layout) -> Result<TensorRef<'_, T>> {
        layout.check_fits(self.mem.len(), "tensor")?;
        Ok(TensorRef { mem: self.mem.reborrow(), layout: layout.clone() })
    }

    pub(crate) fn mem(&self) -> &MemRef<'a, T> {
        &self.mem
    }
}

impl<'a, T> TensorMut<'a, T> {
    /// `mem` viewed through `layout`.
    ///
    /// # Errors
    /// [`Error::BufferTooShort`](crate::Error::BufferTooShort),
    /// [`Error::TooLarge`](crate::Error::TooLarge) as for [`TensorRef::new`], and
    /// [`Error::InvalidLayout`](crate::Error::InvalidLayout) when two indices of the view share
    /// an element (broadcast or overlapping strides; see [`Layout`]).
    pub fn new(mem: &'a mut (impl DeviceMemoryMut<T> + ?Sized), layout: &Layout) -> Result<Self> {
        let mem = mem.mem_mut();
        let layout = layout.clone();
        layout.check_fits(mem.len(), "output tensor")?;
        layout.check_no_overlap("output tensor")?;
        Ok(TensorMut { mem, layout })
    }

    /// `mem` as a dense row-major tensor of `shape` at offset 0.
    ///
    /// # Errors
    /// As [`TensorMut::new`].
    pub fn contiguous(mem: &'a mut (impl DeviceMemoryMut<T> + ?Sized), shape: &[usize]) -> Result<Self> {
        TensorMut::new(mem, &Layout::contiguous(shape))
    }

    /// The view.
    #[must_use]
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Logical shape.
    #[must_use]
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
    /// Number of elements of the view.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }
    /// A read-only view of the same elements, borrowing this one.
    #[must_use]
    pub fn as_ref(&self) -> TensorRef<'_, T> {
        TensorRef { mem: self.mem.reborrow(), layout: self.layout.clone() }
    }

    pub(crate) fn mem_mut(&mut self) -> &mut MemMut<'a, T> {
        &mut self.mem
    }
}

impl<T> fmt::Debug for TensorRef<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorRef")
            .field("memory", &self.mem.describe())
            .field("elements", &self.mem.len())
            .field("layout", &self.layout)
            .finish()
    }
}

impl<T> fmt::Debug for TensorMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorMut")
            .field("memory", &self.mem.describe())
            .field("elements", &self.mem.len())
            .field("layout", &self.layout)
            .finish()
    }
}
