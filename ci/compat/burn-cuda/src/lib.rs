//! mesa-burn compiles in a graph with burn's CUDA backend (type-checked in CI, never linked):
//! one cudarc for mesa-kernels and cubecl-cuda, and the backend-extension routing generated
//! with the `Cube` variant of burn's dispatch present. mesa-burn has no CUDA implementation
//! yet: a CUDA tensor reaching it is refused with `mesa_burn::Error::Backend` before dispatch.

/// GELU through mesa-burn on any device of this graph (CUDA ones answer
/// `mesa_burn::Error::Backend`).
///
/// # Errors
/// As `mesa_burn::gelu`.
pub fn gelu(x: burn::tensor::Tensor<2>) -> mesa_burn::Result<burn::tensor::Tensor<2>> {
    mesa_burn::gelu(x, mesa_burn::GeluForm::Erf, mesa_burn::Codes::default())
}

/// A CUDA device of burn's backend, named so that the crate is really in the check.
#[must_use]
pub fn cuda_device() -> burn::tensor::Device {
    burn::tensor::Device::cuda(0)
}
