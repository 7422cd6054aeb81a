//! [`Error`]: what mesa-burn's functions return for bad input, before anything is dispatched.
use std::fmt;

/// Why a mesa-burn op refused its input. Every check runs on the calling thread before the
/// op enters burn (no kernel has run and no autodiff node exists when one is returned).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's float dtype is not one the kernels run (f32, f16, bf16).
    Dtype {
        /// Which argument.
        what: &'static str,
        /// Its dtype, as burn prints it.
        got: String,
    },
    /// Two arguments of one op have different dtypes (the kernels take one element type).
    DtypeMismatch {
        /// Which argument differs from the input.
        what: &'static str,
    },
    /// A shape that does not fit the op (the message says what was expected).
    Shape {
        /// Which argument.
        what: &'static str,
        /// Expected versus given.
        why: String,
    },
    /// A configuration value out of range (bits not 8/4/2, eps not positive and finite, …).
    Config {
        /// Which value.
        what: &'static str,
        /// Why it is refused.
        why: String,
    },
    /// A tensor of a backend mesa-burn does not run on: it runs on Flex (with or without
    /// autodiff) and, with the `cuda` feature, on a CUDA device of burn's CUDA backend.
    Backend {
        /// Which argument.
        what: &'static str,
    },
    /// A byte count of [`crate::plan`] overflows `usize`.
    Overflow {
        /// What was being counted.
        what: &'static str,
    },
    /// mesa-kernels refused the arguments (sizes of the saved codes, grouping).
    Kernel(mesa_kernels::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Dtype { what, got } => write!(f, "{what}: dtype {got} (supported: f32, f16, bf16)"),
            Error::DtypeMismatch { what } => write!(f, "{what}: dtype differs from the input's"),
            Error::Shape { what, why } => write!(f, "{what}: {why}"),
            Error::Config { what, why } => write!(f, "{what}: {why}"),
            Error::Backend { what } => {
                write!(f, "{what}: mesa-burn runs on the Flex backend (and on CUDA with its `cuda` feature) only")
            }
            Error::Overflow { what } => write!(f, "{what}: the byte count overflows usize"),
            Error::Kernel(e) => write!(f, "mesa-kernels: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Kernel(e) => Some(e),
            _ => None,
        }
    }
}

impl From<mesa_kernels::Error> for Error {
    fn from(e: mesa_kernels::Error) -> Self {
        Error::Kernel(e)
    }
}

/// `Result` with mesa-burn's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
