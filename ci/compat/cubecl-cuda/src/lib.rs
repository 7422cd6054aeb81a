//! cubecl-cuda and mesa-kernels share one cudarc (type-checked in CI, never linked).

/// The cudarc stream type both crates see is the same type: a stream from cudarc can be
/// handed to mesa-kernels in a graph that contains cubecl-cuda.
///
/// # Errors
/// `mesa_kernels::Error::CudaNotBuilt` when the kernels were built without nvcc.
pub fn from_stream(
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
) -> mesa_kernels::Result<mesa_kernels::Device> {
    mesa_kernels::Device::from_stream(stream)
}

/// cubecl's CUDA runtime type, named so that the crate is really compiled and linked in the
/// check.
pub type Runtime = cubecl_cuda::CudaRuntime;
