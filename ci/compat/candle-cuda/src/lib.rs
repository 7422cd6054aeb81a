//! candle's CUDA device handed to mesa-kernels: the stream of candle's `CudaDevice` becomes
//! a `mesa_kernels::Device`, so both run on one stream (type-checked in CI, never linked).

/// The mesa-kernels device for a candle device (candle's own stream for CUDA).
///
/// # Errors
/// As `mesa_candle::kernel_device`.
pub fn mesa_device(device: &candle_core::Device) -> candle_core::Result<mesa_kernels::Device> {
    mesa_candle::kernel_device(device)
}

/// The same through candle's CUDA types directly.
///
/// # Errors
/// `mesa_kernels::Error::CudaNotBuilt` when the kernels were built without nvcc.
pub fn from_candle_stream(device: &candle_core::CudaDevice) -> mesa_kernels::Result<mesa_kernels::Device> {
    mesa_kernels::Device::from_stream(device.cuda_stream())
}
