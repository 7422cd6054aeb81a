//! mesa-burn with its `cuda` and `fusion` features compiles in a graph with burn's CUDA backend
//! and burn's `fusion` (type-checked in CI, never linked): one cudarc for mesa-kernels and
//! cubecl-cuda, mesa-burn's `CubeBackend` code (host-fenced on mesa's stream, codes in
//! cubecl's memory) and its `Fusion<CubeBackend>` and `Autodiff<Fusion<CubeBackend>>` code
//! (fusion custom operations running the former), and the backend-extension routing generated
//! with the `Cube` selector on, which with burn's `fusion` names `Fusion<CubeBackend>`.

/// GELU through mesa-burn on any device of this graph (Flex, or a CUDA device of burn's CUDA
/// backend), with or without autodiff.
///
/// # Errors
/// As `mesa_burn::gelu`.
pub fn gelu(x: burn::tensor::Tensor<2>) -> mesa_burn::Result<burn::tensor::Tensor<2>> {
    mesa_burn::gelu(x, mesa_burn::GeluForm::Erf, mesa_burn::Codes::default())
}

/// GELU's forward and backward on CUDA device `index` at 4 bits: the gradient of
/// `sum(gelu(x))` with respect to `x` (`[rows, cols]`, f32), read back to the host.
///
/// # Errors
/// As `mesa_burn::gelu` (no CUDA device, mesa-kernels without CUDA kernels, ...).
pub fn gelu_grad_on_cuda(index: usize, rows: usize, cols: usize) -> mesa_burn::Result<Vec<f32>> {
    let device = burn::tensor::Device::cuda(index).autodiff();
    let x = burn::tensor::Tensor::<2>::ones([rows, cols], &device).require_grad();
    let y = mesa_burn::gelu(x.clone(), mesa_burn::GeluForm::Tanh, mesa_burn::Codes::bits(4))?;
    let grads = y.sum().backward();
    let dx = x.grad(&grads).expect("x requires a gradient");
    Ok(dx.into_data().try_to_vec::<f32>().expect("an f32 gradient"))
}

/// A CUDA device of burn's backend, named so that the crate is really in the check.
#[must_use]
pub fn cuda_device() -> burn::tensor::Device {
    burn::tensor::Device::cuda(0)
}
