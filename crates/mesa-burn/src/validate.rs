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
    let dtype = t.dtype();
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(dtype),
        other => Err(Error::Dtype { what, got: format!("{other:?}") }),
    }
}

/// `t` has the input's dtype and device.
pub(crate) fn same<const D: usize, const E: usize>(t: &Tensor<D>, x: &Tensor<E>, what: &'static str) -> Result<()> {
    if float(t, what)? != x.dtype() {
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
