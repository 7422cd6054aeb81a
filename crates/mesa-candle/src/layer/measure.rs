//! Measuring what a layer keeps alive for backward, with the [`CountingAllocator`].
use candle_core::backprop::GradStore;
use candle_core::Tensor;

use mesa_kernels::CountingAllocator;

/// Bytes measured around one forward and backward ([`mesa_kernels::CountingAllocator`] says how).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// Heap bytes alive after the forward minus before it, plus the layer input's bytes:
    /// what candle's graph and the op keep for backward, the output included (parameters
    /// and the input were allocated before).
    pub alive_after_forward: usize,
    /// The peak during backward above the level before the forward, plus the input's bytes:
    /// decoded temporaries and the gradients being built included.
    pub peak_during_backward: usize,
}

/// Runs `forward`, then the backward of `Σ y ⊙ dy`, measuring with `counter` (which must be
/// the process's global allocator; it is made the emulator's memory observer here, before the
/// forward allocates anything). `input_bytes` is the layer input's size.
///
/// # Errors
/// The forward's and backward's errors; [`crate::Error::Kernel`] with
/// [`mesa_kernels::Error::InvalidArgument`] when another emulator memory observer is installed.
pub fn measure(
    counter: &'static CountingAllocator,
    input_bytes: usize,
    dy: &Tensor,
    forward: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<(Measured, GradStore)> {
    counter.observe_emulator().map_err(crate::Error::Kernel)?;
    let before = counter.current();
    let y = forward()?;
    let alive = counter.current().saturating_sub(before) + input_bytes;
    counter.reset_peak();
    let grads = (y * dy)?.sum_all()?.backward()?;
    let peak = counter.peak().saturating_sub(before) + input_bytes;
    Ok((Measured { alive_after_forward: alive, peak_during_backward: peak }, grads))
}
