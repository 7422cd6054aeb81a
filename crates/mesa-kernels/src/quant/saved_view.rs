//! Saved activations in memory the caller owns: borrowed views of the codes, the per-group
//! parameters and the non-finite counter of one saved tensor ([`SavedViewMut`] for a
//! producer, [`SavedView`] for a consumer), and the sizes to allocate ([`saved_sizes`]).
//!
//! The parts are [`TensorMut`] / [`TensorRef`] views, so any memory those take works: a
//! [`Buffer`](crate::Buffer), a cudarc slice, a [`RawDeviceSlice`](crate::RawDeviceSlice)
//! from another framework's allocator (burn's), a host slice on the emulator. A
//! [`SavedActivation`](crate::SavedActivation) is the same thing with buffers it owns; its
//! methods run through these views (one code path).
//!
//! ```
//! use mesa_kernels::{
//!     saved_sizes, Device, GroupParams, QuantConfig, Quantizer, SavedView, SavedViewMut, TensorMut, TensorRef,
//! };
//!
//! # fn main() -> mesa_kernels::Result<()> {
//! let device = Device::emulator();
//! let config = QuantConfig::per_head(1);
//! let x = device.upload(&[0.5f32; 2 * 4 * 8])?;
//! let x = TensorRef::contiguous(&x, &[2, 4, 8])?;
//! // the caller's memory: here buffers of the device; a framework's allocations work alike
//! // (as `RawDeviceSlice`s), at any offset that keeps the codes 8-byte aligned
//! let sizes = saved_sizes(x.shape(), &config)?;
//! let mut codes = device.alloc_zeros::<u8>(sizes.code_bytes)?;
//! let mut params = device.alloc_zeros::<GroupParams>(sizes.groups)?;
//! let mut counter = device.alloc_zeros::<u32>(1)?;
//! let mut out = SavedViewMut::new(
//!     TensorMut::contiguous(&mut codes, &[sizes.code_bytes])?,
//!     TensorMut::contiguous(&mut params, &[sizes.groups])?,
//!     TensorMut::contiguous(&mut counter, &[1])?,
//! )?;
//! let mut quantizer = Quantizer::new(&device, config)?;
//! let meta = quantizer.quantize_to(&x, &mut out)?;
//! drop(out);
//! // later (a backward): the same memory and the meta
//! let saved = SavedView::new(
//!     TensorRef::contiguous(&codes, &[sizes.code_bytes])?,
//!     TensorRef::contiguous(&params, &[sizes.groups])?,
//!     meta,
//! )?;
//! let mut y = device.alloc_zeros::<f32>(64)?;
//! saved.dequantize(&device, &mut TensorMut::contiguous(&mut y, &[2, 4, 8])?)?;
//! assert_eq!(y.to_vec()?, vec![0.5; 64]);
//! # Ok(())
//! # }
//! ```
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::quant::{checked_numel, code_bytes, GroupParams, QuantConfig, SavedMeta};
use crate::tensor::{TensorMut, TensorRef};

/// Alignment in bytes the packed codes need (the kernels store 8 codes of one unit as one
/// word of up to 8 bytes).
pub const CODE_ALIGN: usize = 8;

/// What a caller allocates for one saved tensor ([`saved_sizes`]).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedSizes {
    /// Bytes of packed codes: `ceil(numel · bits / 8)` (u8 elements, [`CODE_ALIGN`]-byte
    /// aligned).
    pub code_bytes: usize,
    /// Parameter groups: entries of [`GroupParams`] (8 bytes each, two f32: offset then
    /// scale; 4-byte aligned).
    pub groups: usize,
}

impl SavedSizes {
    /// Bytes of the parameters: `8 · groups`.
    #[must_use]
    pub fn param_bytes(&self) -> usize {
        self.groups * std::mem::size_of::<GroupParams>()
    }

    /// Bytes of the non-finite counter: one u32.
    #[must_use]
    pub fn counter_bytes(&self) -> usize {
        std::mem::size_of::<u32>()
    }
}

/// The sizes of the codes and parameters that a tensor of `shape` saved with `config`
/// needs (what [`Quantizer::quantize_to`](crate::Quantizer::quantize_to) and the fused
/// producers' `_to` variants write). The non-finite counter is one u32 besides.
///
/// # Errors
/// [`Error::InvalidLayout`] (the grouping does not fit the shape), [`Error::TooLarge`]
/// (the element or byte count overflows), [`Error::Unsupported`] (bits not 8/4/2).
pub fn saved_sizes(shape: &[usize], config: &QuantConfig) -> Result<SavedSizes> {
    if !matches!(config.bits, 2 | 4 | 8) {
        return Err(Error::unsupported("bits", format!("{}-bit codes (supported: 8, 4, 2)", config.bits)));
    }
    let numel = checked_numel(shape, "saved activation")?;
    Ok(SavedSizes { code_bytes: code_bytes(numel, config.bits)?, groups: config.grouping.num_groups(shape)? })
}

/// Where a producer writes one saved tensor, in the caller's memory: `codes` (u8,
/// [`SavedSizes::code_bytes`] elements, [`CODE_ALIGN`]-byte aligned), `params`
/// ([`GroupParams`], [`SavedSizes::groups`] elements) and `nonfinite` (one u32, the count of
/// NaN/±Inf inputs), each a dense 1-D view.
///
/// Lifetime: the memory must stay valid until the work writing it has completed on the
/// op's stream, and until every consumer reading it (a backward) has been enqueued and run;
/// nothing here keeps it alive past the borrow.
#[derive(Debug)]
pub struct SavedViewMut<'a> {
    pub(crate) codes: TensorMut<'a, u8>,
    pub(crate) params: TensorMut<'a, GroupParams>,
    pub(crate) nonfinite: TensorMut<'a, u32>,
}

/// The saved tensor a consumer (a backward, [`SavedView::dequantize`]) reads, in the
/// caller's memory: `codes` and `params` as written through a [`SavedViewMut`], and the
/// [`SavedMeta`] the producer returned.
#[derive(Debug)]
pub struct SavedView<'a> {
    pub(crate) codes: TensorRef<'a, u8>,
    pub(crate) params: TensorRef<'a, GroupParams>,
    pub(crate) meta: SavedMeta,
}

/// A view is dense and one-dimensional (offset allowed).
fn check_flat(layout: &Layout, what: &'static str) -> Result<()> {
    if layout.shape().len() != 1 || !layout.is_contiguous() {
        return Err(Error::invalid_layout(what, format!("a dense 1-D view is needed; got {layout:?}")));
    }
    Ok(())
}

/// `len` elements given where `needed` are needed: too few → [`Error::BufferTooShort`],
/// too many → [`Error::InvalidArgument`] (the sizes would not describe this tensor).
fn check_len(what: &'static str, needed: usize, len: usize) -> Result<()> {
    match len.cmp(&needed) {
        std::cmp::Ordering::Equal => Ok(()),
        std::cmp::Ordering::Less => Err(Error::BufferTooShort { what, needed, len }),
        std::cmp::Ordering::Greater => Err(Error::invalid_argument(
            what,
            format!("{len} elements given; this saved tensor has exactly {needed} (view a prefix)"),
        )),
    }
}

/// The codes' first byte is [`CODE_ALIGN`]-byte aligned (`addr`: its address).
pub(crate) fn check_code_address(addr: usize, what: &'static str) -> Result<()> {
    if addr % CODE_ALIGN != 0 {
        return Err(Error::Misaligned { what, align: CODE_ALIGN });
    }
    Ok(())
}

impl<'a> SavedViewMut<'a> {
    /// The three parts of a saved tensor in the caller's memory (sized by [`saved_sizes`];
    /// the sizes and the codes' alignment are checked by the producer, against the tensor
    /// it saves).
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] when a part is not a dense 1-D view.
    pub fn new(
        codes: TensorMut<'a, u8>,
        params: TensorMut<'a, GroupParams>,
        nonfinite: TensorMut<'a, u32>,
    ) -> Result<Self> {
        check_flat(codes.layout(), "saved codes")?;
        check_flat(params.layout(), "saved parameters")?;
        check_flat(nonfinite.layout(), "non-finite counter")?;
        Ok(SavedViewMut { codes, params, nonfinite })
    }

    /// Read access for a consumer, with the `meta` the producer returned.
    ///
    /// # Errors
    /// As [`SavedView::new`].
    pub fn as_view(&self, meta: SavedMeta) -> Result<SavedView<'_>> {
        SavedView::new(self.codes.as_ref(), self.params.as_ref(), meta)
    }

    /// Checks the sizes against the tensor `meta` describes.
    pub(crate) fn check_sizes(&self, meta: &SavedMeta) -> Result<SavedSizes> {
        let sizes = meta.sizes()?;
        check_len("saved codes", sizes.code_bytes, self.codes.numel())?;
        check_len("saved parameters", sizes.groups, self.params.numel())?;
        check_len("non-finite counter", 1, self.nonfinite.numel())?;
        Ok(sizes)
    }
}

impl<'a> SavedView<'a> {
    /// A saved tensor in the caller's memory: `codes` and `params` as a producer wrote them
    /// for `meta` (its return value).
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] (a part not a dense 1-D view, or `meta`'s grouping not
    /// fitting its shape), [`Error::BufferTooShort`] / [`Error::InvalidArgument`] (a part
    /// shorter / longer than `meta` needs).
    pub fn new(codes: TensorRef<'a, u8>, params: TensorRef<'a, GroupParams>, meta: SavedMeta) -> Result<Self> {
        check_flat(codes.layout(), "saved codes")?;
        check_flat(params.layout(), "saved parameters")?;
        let sizes = meta.sizes()?;
        check_len("saved codes", sizes.code_bytes, codes.numel())?;
        check_len("saved parameters", sizes.groups, params.numel())?;
        Ok(SavedView { codes, params, meta })
    }

    /// What the codes encode (shape, dtype, bits, grouping, companding).
    #[must_use]
    pub fn meta(&self) -> &SavedMeta {
        &self.meta
    }
}
