//! Flex tensors on the host emulator: views of a `FlexTensor`'s storage for the kernels,
//! outputs wrapped back as `FlexTensor`s, and [`HostCodes`], the saved codes an op's
//! autodiff state owns.
//!
//! Everything here runs after validation ([`crate::validate`]); a kernel refusing its
//! arguments at this point is a bug in mesa-burn, reported by a panic that names the op.
use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};
use half::{bf16, f16};
use mesa_kernels::{
    saved_sizes, Device, GroupParams, Layout, QuantConfig, SavedMeta, SavedView, SavedViewMut, TensorMut, TensorRef,
    MAX_DIMS,
};

/// A float element both burn and the kernels know: f32, f16, bf16.
pub(crate) trait Float: mesa_kernels::Element + burn::tensor::Element + bytemuck::Pod {}
impl Float for f32 {}
impl Float for f16 {}
impl Float for bf16 {}

/// Runs `$body` with `$T` bound to the element type of `$dtype` (f32, f16 or bf16; anything
/// else was refused by validation).
macro_rules! with_float {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            burn::tensor::DType::F32 => {
                type $T = f32;
                $body
            }
            burn::tensor::DType::F16 => {
                type $T = half::f16;
                $body
            }
            burn::tensor::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            other => panic!("mesa-burn: dtype {other:?} reached a kernel (validation lets only f32/f16/bf16 through)"),
        }
    };
}
pub(crate) use with_float;

/// The emulator device (the kernels compiled for the host).
pub(crate) fn device() -> Device {
    Device::emulator()
}

/// Unwraps a kernel result after validation: a failure is a mesa-burn bug.
pub(crate) fn expect<R>(r: mesa_kernels::Result<R>, op: &'static str) -> R {
    r.unwrap_or_else(|e| panic!("mesa-burn {op}: the kernel refused validated arguments: {e}"))
}

/// `t` in a layout the kernels take: non-negative strides (a flipped view is copied), and a
/// strided view of more than [`MAX_DIMS`] axes copied contiguous (the kernels merge adjacent
/// axes and take at most `MAX_DIMS` of what remains; copying every such view, mergeable or
/// not, costs a copy only at ranks above it).
pub(crate) fn positive(t: &FlexTensor) -> FlexTensor {
    let l = t.layout();
    if l.strides().iter().any(|&s| s < 0) || (l.shape().len() > MAX_DIMS && !t.is_contiguous()) {
        t.to_contiguous()
    } else {
        t.clone()
    }
}

/// The kernels' layout of a Flex tensor with non-negative strides ([`positive`]).
pub(crate) fn layout(t: &FlexTensor) -> Layout {
    let l = t.layout();
    let strides: Vec<usize> = l.strides().iter().map(|&s| s as usize).collect();
    expect(Layout::strided(l.shape(), &strides, l.start_offset()), "layout")
}

/// A kernel view of `t`'s storage (any non-negative strides, offset kept).
pub(crate) fn view<'a, T: Float>(t: &'a FlexTensor, layout: &Layout) -> TensorRef<'a, T> {
    expect(TensorRef::new(t.storage::<T>(), layout), "input view")
}

/// A contiguous Flex tensor of `shape` holding `v`.
pub(crate) fn tensor<T: Float>(v: Vec<T>, shape: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(v, shape.to_vec()))
}

/// Zeros of `T` for an output of `n` elements.
pub(crate) fn zeros<T: Float>(n: usize) -> Vec<T> {
    vec![T::from_f64(0.0); n]
}

/// The dtype of a Flex tensor.
pub(crate) fn dtype(t: &FlexTensor) -> DType {
    t.dtype()
}

/// The codes, parameters and meta of one saved tensor, in memory this value owns (what an
/// op's autodiff state holds instead of the full-precision tensor).
///
/// Bytes: [`HostCodes::bytes`] = `8·⌈⌈numel·bits/8⌉/8⌉ + 8·groups` (codes in whole 8-byte
/// words, for the kernels' [`mesa_kernels::quant::CODE_ALIGN`]), plus this struct's fixed fields
/// and the meta's shape and strides.
#[derive(Debug)]
pub struct HostCodes {
    words: Vec<u64>,
    code_bytes: usize,
    params: Vec<GroupParams>,
    meta: SavedMeta,
}

impl HostCodes {
    /// Memory for the codes of a tensor of `shape` saved with `config` (zeroed), to be
    /// written through [`CodesBuf::view_mut`] and kept with [`CodesBuf::finish`].
    pub(crate) fn alloc(shape: &[usize], config: &QuantConfig, op: &'static str) -> CodesBuf {
        HostCodes::alloc_sized(expect(saved_sizes(shape, config), op), op)
    }

    /// [`HostCodes::alloc`] for sizes known otherwise (softmax's fixed-parameter codes).
    pub(crate) fn alloc_sized(sizes: mesa_kernels::SavedSizes, op: &'static str) -> CodesBuf {
        CodesBuf {
            words: vec![0u64; code_words(&sizes)],
            code_bytes: sizes.code_bytes,
            params: vec![GroupParams::default(); sizes.groups],
            counter: [0u32; 1],
            op,
        }
    }

    /// Runs `produce` with a view of freshly allocated memory for `shape` saved with
    /// `config`, and keeps what it wrote. `produce` returns the producer's meta.
    pub(crate) fn write(
        shape: &[usize],
        config: &QuantConfig,
        op: &'static str,
        produce: impl FnOnce(&mut SavedViewMut<'_>) -> mesa_kernels::Result<SavedMeta>,
    ) -> HostCodes {
        let mut buf = HostCodes::alloc(shape, config, op);
        let meta = expect(produce(&mut buf.view_mut()), op);
        buf.finish(meta)
    }

    /// The reading view for a backward.
    pub(crate) fn view(&self) -> SavedView<'_> {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        let codes = expect(TensorRef::contiguous(&bytes[..self.code_bytes], &[self.code_bytes]), "saved codes");
        let params = expect(TensorRef::contiguous(self.params.as_slice(), &[self.params.len()]), "saved params");
        expect(SavedView::new(codes, params, self.meta.clone()), "saved view")
    }

    /// Heap bytes of the codes and parameters: `8·⌈code_bytes/8⌉ + 8·groups` (the formula
    /// docs/burn.md and tests/memory.rs count; checked by this module's test).
    #[must_use]
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn bytes(&self) -> usize {
        self.words.len() * 8 + self.params.len() * std::mem::size_of::<GroupParams>()
    }

    /// Decodes into a new contiguous Flex tensor of element `T` (the saved tensor's shape).
    pub(crate) fn decode<T: Float>(&self) -> FlexTensor {
        let shape = self.meta.shape().to_vec();
        let n: usize = shape.iter().product();
        let mut out = zeros::<T>(n);
        {
            let mut y = expect(TensorMut::contiguous(out.as_mut_slice(), &shape), "decode");
            expect(self.view().dequantize(&device(), &mut y), "decode");
        }
        tensor(out, &shape)
    }
}

/// 8-byte words of codes [`HostCodes`] allocates for `sizes`.
fn code_words(sizes: &mesa_kernels::SavedSizes) -> usize {
    sizes.code_bytes.div_ceil(8)
}

/// Heap bytes of the codes and parameters [`HostCodes`] keeps for `sizes` (what
/// [`HostCodes::bytes`] reports and [`crate::plan`] counts); `None` on overflow.
pub(crate) fn heap_bytes(sizes: &mesa_kernels::SavedSizes) -> Option<usize> {
    code_words(sizes).checked_mul(8)?.checked_add(sizes.groups.checked_mul(std::mem::size_of::<GroupParams>())?)
}

/// Codes being written (see [`HostCodes::alloc`]).
#[derive(Debug)]
pub(crate) struct CodesBuf {
    words: Vec<u64>,
    code_bytes: usize,
    params: Vec<GroupParams>,
    counter: [u32; 1],
    op: &'static str,
}

impl CodesBuf {
    /// The producer's view of this memory.
    pub(crate) fn view_mut(&mut self) -> SavedViewMut<'_> {
        let op = self.op;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words);
        let groups = self.params.len();
        expect(
            SavedViewMut::new(
                expect(TensorMut::contiguous(&mut bytes[..self.code_bytes], &[self.code_bytes]), op),
                expect(TensorMut::contiguous(self.params.as_mut_slice(), &[groups]), op),
                expect(TensorMut::contiguous(&mut self.counter[..], &[1]), op),
            ),
            op,
        )
    }

    /// Keeps the codes and parameters (the counter is dropped: no backward reads it) with
    /// the `meta` the producer returned.
    pub(crate) fn finish(self, meta: SavedMeta) -> HostCodes {
        HostCodes { words: self.words, code_bytes: self.code_bytes, params: self.params, meta }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Codes;
    use mesa_kernels::Quantizer;

    /// The byte formula of [`HostCodes::bytes`] (what docs/burn.md and tests/memory.rs
    /// count): codes in whole 8-byte words plus 8 bytes per group; and the codes decode
    /// within half a step.
    #[test]
    fn host_codes_bytes_and_round_trip() {
        let x: Vec<f32> = (0..15).map(|i| i as f32 * 0.5 - 3.0).collect();
        // (bits, ⌈15·bits/8⌉ code bytes → whole words, + one 8-byte group)
        for (bits, expect) in [(8, 16 + 8), (4, 8 + 8), (2, 8 + 8)] {
            let codes = Codes::bits(bits);
            let mut q = Quantizer::new(&device(), codes.quant_config()).unwrap();
            let xv = TensorRef::contiguous(x.as_slice(), &[3, 5]).unwrap();
            let saved = HostCodes::write(&[3, 5], &codes.quant_config(), "test", |v| q.quantize_to(&xv, v));
            assert_eq!(saved.bytes(), expect, "{bits} bits");
            assert_eq!(crate::plan::codes(&[3, 5], &codes), Ok(expect), "the planner, {bits} bits");
            let back = saved.decode::<f32>();
            let half_step = 7.0 / f64::from((1u32 << bits) - 1) / 2.0;
            for (a, b) in back.storage::<f32>().iter().zip(&x) {
                assert!(f64::from((a - b).abs()) <= half_step * (1.0 + 1e-6), "{bits} bits: {a} vs {b}");
            }
        }
    }
}
