//! Checks that run before an op is dispatched: a failure is an [`Error`], never a panic
//! inside a backend.
use burn::backend::DispatchDevice;
use burn::tensor::{DType, Tensor};

use crate::config::Codes;
use crate::error::{Error, Result};

/// `t` lives on Flex (with or without autodiff) and has a float dtype the kernels run.
pub(crate) fn float<const D: usize>(t: &Tensor<D>, what: &'static str) -> Result<DType> {
    let device = t.device().without_autodiff();
    if !matches!(device.as_dispatch(), DispatchDevice::Flex(_)) {
        return Err(Error::Backend { what });
    }
    float_dtype(t.dtype(), what)
}

/// [`float`], or (with the `cuda` feature) a tensor on a CUDA device of burn's CUDA backend
/// that mesa-kernels can run on: for the ops with a CUDA implementation (all of them).
pub(crate) fn float_or_cuda<const D: usize>(t: &Tensor<D>, what: &'static str) -> Result<DType> {
    #[cfg(feature = "cuda")]
    {
        let device = t.device().without_autodiff();
        if let DispatchDevice::Cube(cube) = device.as_dispatch() {
            crate::cuda::check_device(cube, what)?;
            return float_dtype(t.dtype(), what);
        }
    }
    float(t, what)
}

fn float_dtype(dtype: DType, what: &'static str) -> Result<DType> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(dtype),
        other => Err(Error::Dtype { what, got: format!("{other:?}") }),
    }
}

/// `t` has the input's dtype and device (the input `x` was validated first: its backend is
/// one the op runs on).
pub(crate) fn same<const D: usize, const E: usize>(t: &Tensor<D>, x: &Tensor<E>, what: &'static str) -> Result<()> {
    if float_or_cuda(t, what)? != x.dtype() {
        return Err(Error::DtypeMismatch { what });
    }
    if t.device() != x.device() {
        return Err(Error::Shape { what, why: "on another device than the input".into() });
    }
    Ok(())
}

/// The codes' bits, and their sizes for `shape` (the grouping fits, nothing overflows).
pub(crate) fn codes(codes: &Codes, shape: &[usize]) -> Result<()> {
    codes.check()?;
    let _sizes = mesa_kernels::saved_sizes(shape, &codes.quant_config())?;
    Ok(())
}

/// `[n]`.
pub(crate) fn vector(t: &Tensor<1>, n: usize, what: &'static str) -> Result<()> {
    let [len] = t.dims();
    if len != n {
        return Err(Error::Shape { what, why: format!("[{len}] given, [{n}] expected (the input's last axis)") });
    }
    Ok(())
}

/// The last axis of a normalisation input: rank ≥ 1 and `C` > 0.
pub(crate) fn last_axis(dims: &[usize]) -> Result<usize> {
    match dims.last() {
        None => Err(Error::Shape { what: "x", why: "a normalisation needs rank ≥ 1".into() }),
        Some(0) => Err(Error::Shape { what: "x", why: "rows of length 0 have no statistics".into() }),
        Some(&c) => Ok(c),
    }
}

/// Rank ≥ 1 (rows along the last axis, possibly empty).
pub(crate) fn last_axis_any(dims: &[usize]) -> Result<()> {
    if dims.is_empty() {
        return Err(Error::Shape { what: "x", why: "rows along the last axis need rank ≥ 1".into() });
    }
    Ok(())
}

/// `eps` as the f32 the kernels add: positive and finite.
pub(crate) fn eps(eps: f64) -> Result<f32> {
    let e = eps as f32;
    if !(e > 0.0 && e.is_finite()) {
        return Err(Error::Config { what: "eps", why: format!("must be positive and finite in f32, got {eps}") });
    }
    Ok(e)
}
