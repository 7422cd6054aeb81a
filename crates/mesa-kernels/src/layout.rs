//! Strided tensor views and their validation.
//!
//! A [`Layout`] says where the elements of a logical tensor of `shape` live inside a buffer:
//! element `(i_0, …, i_{n-1})` is at `offset + Σ i_d · strides[d]` (in elements). Any
//! permutation (head axis anywhere), slicing (offset) and broadcasting (stride 0, inputs
//! only) is a layout; no op ever makes a permuted copy.
use mesa_kernels_sys as sys;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Maximum rank after merging contiguous dimensions (the kernels' fixed index arithmetic).
pub const MAX_DIMS: usize = sys::MESA_MAX_DIMS as usize;

/// A strided view: shape, strides and offset, all in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// Dense row-major layout of `shape` at offset 0.
    #[must_use]
    pub fn contiguous(shape: &[usize]) -> Self {
        let mut strides = vec![0usize; shape.len()];
        let mut s = 1usize;
        for d in (0..shape.len()).rev() {
            strides[d] = s;
            s = s.saturating_mul(shape[d]);
        }
        Layout { shape: shape.to_vec(), strides, offset: 0 }
    }

    /// An arbitrary strided view. Strides are in elements and may be 0 (broadcast) for
    /// inputs; outputs must not overlap themselves.
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] when `shape` and `strides` differ in length.
    pub fn strided(shape: &[usize], strides: &[usize], offset: usize) -> Result<Self> {
        if shape.len() != strides.len() {
            return Err(Error::invalid_layout(
                "layout",
                format!("shape has {} dimensions but strides has {}", shape.len(), strides.len()),
            ));
        }
        Ok(Layout { shape: shape.to_vec(), strides: strides.to_vec(), offset })
    }

    /// The view with dimensions `a` and `b` swapped (no data moves).
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] when an axis is out of range.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        if a >= self.shape.len() || b >= self.shape.len() {
            return Err(Error::invalid_layout(
                "layout",
                format!("transpose({a}, {b}) of a rank-{} layout", self.shape.len()),
            ));
        }
        let mut l = self.clone();
        l.shape.swap(a, b);
        l.strides.swap(a, b);
        Ok(l)
    }

    /// Logical shape.
    #[must_use]
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Strides in elements.
    #[must_use]
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Offset of the first element, in elements.
    #[must_use]
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements (0 for an empty tensor; 1 for rank 0). Saturates at `usize::MAX`
    /// (such a view is rejected by every op).
    #[must_use]
    pub fn numel(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX)
    }
    /// True when the view is dense row-major (offset aside).
    #[must_use]
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1usize;
        for d in (0..self.shape.len()).rev() {
            if self.shape[d] != 1 && self.strides[d] != expect {
                return false;
            }
            expect = expect.saturating_mul(self.shape[d]);
        }
        true
    }

    /// Checks the view against a buffer of `len` elements: every index reachable, every
    /// offset representable in the kernels' signed 64-bit arithmetic. Returns the number of
    /// elements.
    pub(crate) fn check_fits(&self, len: usize, what: &'static str) -> Result<usize> {
        if self.shape.contains(&0) {
            return Ok(0); // an empty view reaches no element, whatever its other dims
        }
        let numel =
            self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
                Error::too_large(what, format!("the element count of shape {:?} overflows", self.shape))
            })?;
        if numel == 0 {
            return Ok(0);
        }
        let mut last = self.offset;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            last = (n - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(|| Error::too_large(what, "its offsets overflow"))?;
        }
        if last >= i64::MAX as usize || numel >= i64::MAX as usize {
            return Err(Error::too_large(what, "offsets past 2^63 (the kernels index in signed 64 bits)"));
        }
        let needed = last + 1;
        if needed > len {
            return Err(Error::BufferTooShort { what, needed, len });
        }
        Ok(numel)
    }

    /// `[first, last + 1)`: the elements of the buffer the view can touch (offset included),
    /// or `None` for an empty view. Only for views that passed [`Layout::check_fits`].
    pub(crate) fn element_range(&self) -> Option<(usize, usize)> {
        if self.shape.contains(&0) {
            return None;
        }
        let mut last = self.offset;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            last = last.saturating_add((n - 1).saturating_mul(s));
        }
        Some((self.offset, last.saturating_add(1)))
    }

    /// Checks that no two indices of the view share an element (required of outputs).
    ///
    /// The test is the usual sufficient one: sorted by stride, every stride is at least the
    /// extent spanned by the faster dimensions. It accepts every permutation, slice and padded
    /// layout, and rejects broadcast (stride 0) and overlapping views; it also rejects a few
    /// exotic interleavings that happen not to collide (e.g. shape `[2, 2]`, strides `[3, 2]`).
    pub(crate) fn check_no_overlap(&self, what: &'static str) -> Result<()> {
        let mut dims: Vec<(usize, usize)> =
            self.shape.iter().copied().zip(self.strides.iter().copied()).filter(|&(n, _)| n > 1).collect();
        if self.numel() == 0 {
            return Ok(());
        }
        dims.sort_by_key(|&(_, s)| s);
        let mut extent = 1usize; // elements spanned by the faster dimensions
        for (n, s) in dims {
            if s < extent {
                return Err(Error::invalid_layout(
                    what,
                    format!(
                        "the view overlaps itself (stride {s} inside an extent of {extent}); outputs need distinct elements"
                    ),
                ));
            }
            extent = s.saturating_mul(n);
        }
        Ok(())
    }
}

/// How elements share quantization parameters (Mesa §3.3 "head-wise" quantization).
///
/// The tensor is seen as `[outer, groups, inner]` around one axis: no data is permuted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping {
    /// One group for the whole tensor.
    Tensor,
    /// One group per index along `axis` — per head for `[B,H,N,D]` (axis 1) or `[B,N,H,D]`
    /// (axis 2).
    Heads {
        /// The head axis.
        axis: usize,
    },
    /// `groups` groups of consecutive indices along `axis` (e.g. channel groups of the
    /// hidden dimension of `[B,N,C]`, axis 2). `groups` must divide the axis length.
    Channels {
        /// The axis that is split.
        axis: usize,
        /// Number of groups.
        groups: usize,
    },
}

impl Grouping {
    /// Number of groups for a tensor of `shape`.
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] when the axis is out of range or `groups` does not divide it.
    pub fn num_groups(&self, shape: &[usize]) -> Result<usize> {
        Ok(self.resolve(shape)?.2)
    }

    /// (axis, span, count) with the checks.
    pub(crate) fn resolve(&self, shape: &[usize]) -> Result<(Option<usize>, usize, usize)> {
        match *self {
            Grouping::Tensor => Ok((None, 1, 1)),
            Grouping::Heads { axis } => {
                let n = *shape.get(axis).ok_or_else(|| {
                    Error::invalid_layout(
                        "grouping",
                        format!("group axis {axis} out of range for rank {}", shape.len()),
                    )
                })?;
                Ok((Some(axis), 1, n))
            }
            Grouping::Channels { axis, groups } => {
                let n = *shape.get(axis).ok_or_else(|| {
                    Error::invalid_layout(
                        "grouping",
                        format!("group axis {axis} out of range for rank {}", shape.len()),
                    )
                })?;
                if groups == 0 || n % groups != 0 {
                    return Err(Error::invalid_layout(
                        "grouping",
                        format!("{groups} groups do not divide axis {axis} of length {n}"),
                    ));
                }
                Ok((Some(axis), n / groups, groups))
            }
        }
    }
}

/// Kernel-ready description of a view: merged dimensions, group axis kept intact.
pub(crate) struct KernelView {
    pub desc: sys::MesaTensorDesc,
    pub grouping: sys::MesaGrouping,
}

/// Merges adjacent dimensions that are contiguous with each other (never across the group
/// axis) and drops size-1 dimensions, so that most views reach the kernels as 1–3 dims.
/// Logical (row-major) element order is unchanged.
pub(crate) fn kernel_view(layout: &Layout, grouping: &Grouping, dtype: DType) -> Result<KernelView> {
    let (axis, span, count) = grouping.resolve(layout.shape())?;
    // Segments: dims before the axis, the axis, dims after; merged independently.
    let mut dims: Vec<(usize, usize, bool)> = Vec::new(); // (size, stride, is_group_axis)
    let push_segment = |range: std::ops::Range<usize>, out: &mut Vec<(usize, usize, bool)>| {
        let mut seg: Vec<(usize, usize)> = Vec::new();
        for d in range {
            let (n, s) = (layout.shape[d], layout.strides[d]);
            if n == 1 {
                continue;
            }
            if let Some(last) = seg.last_mut() {
                if last.1 == s.saturating_mul(n) {
                    // saturating: an empty view (another dim 0) may have huge dims; it is
                    // never launched, and a non-empty one was checked to fit
                    last.0 = last.0.saturating_mul(n);
                    last.1 = s;
                    continue;
                }
            }
            seg.push((n, s));
        }
        out.extend(seg.into_iter().map(|(n, s)| (n, s, false)));
    };
    let rank = layout.shape.len();
    match axis {
        None => push_segment(0..rank, &mut dims),
        Some(a) => {
            push_segment(0..a, &mut dims);
            dims.push((layout.shape[a], layout.strides[a], true));
            push_segment(a + 1..rank, &mut dims);
        }
    }
    if dims.len() > MAX_DIMS {
        return Err(Error::unsupported(
            "layout",
            format!("a view with {} non-mergeable dimensions (at most {MAX_DIMS})", dims.len()),
        ));
    }
    let mut desc = sys::MesaTensorDesc { ndim: dims.len() as i32, dtype: dtype.to_sys(), ..Default::default() };
    let mut group_dim = -1i32;
    for (k, &(n, s, g)) in dims.iter().enumerate() {
        desc.shape[k] = n as i64;
        desc.strides[k] = s as i64;
        if g {
            group_dim = k as i32;
        }
    }
    let grouping = if axis.is_some() {
        sys::MesaGrouping { dim: group_dim, _pad: 0, span: span as i64, count: count as i64 }
    } else {
        sys::MesaGrouping { dim: -1, _pad: 0, span: 1, count: 1 }
    };
    Ok(KernelView { desc, grouping })
}
