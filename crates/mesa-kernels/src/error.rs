//! The crate's error type: every bad input and every failure is a value, never a panic.
use std::fmt;

use mesa_kernels_sys as sys;

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong, checked before any kernel is launched where possible.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// Shapes disagree, or a shape/stride/grouping is invalid for the op.
    Shape(String),
    /// A buffer is shorter than the view (offset, shape, strides) needs.
    BufferTooShort {
        /// What the buffer is (e.g. "input").
        what: &'static str,
        /// Elements the view reaches (largest offset + 1).
        needed: usize,
        /// Elements the buffer holds.
        len: usize,
    },
    /// A pointer is not aligned to its element size.
    Misaligned {
        /// What the buffer is.
        what: &'static str,
        /// Required alignment in bytes.
        align: usize,
    },
    /// A size or index does not fit the kernels' 64-bit signed arithmetic, or a grid limit.
    TooLarge(String),
    /// A valid request that is not implemented (dtype, bit width, ...).
    Unsupported(String),
    /// A buffer of one backend was given to another (e.g. host memory to the CUDA backend).
    WrongBackend(String),
    /// The CUDA driver library is missing, no device is visible, or the device cannot be used.
    NoCudaDevice(String),
    /// The library was built without nvcc, so the CUDA kernels are not in it.
    CudaNotBuilt,
    /// The device cannot run the kernels in this build (no SASS or PTX for it).
    NoKernelImage {
        /// The device's compute capability, e.g. (9, 0).
        compute_capability: (i32, i32),
        /// The architectures built (`MESA_CUDA_ARCHS`).
        built: &'static str,
    },
    /// A CUDA runtime or driver error (code and message).
    Cuda(String),
    /// A bounded wait expired (collectives).
    Timeout(String),
    /// A kernel entry point rejected its arguments (a bug in this crate's checks if seen).
    KernelArgument(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Shape(m) => write!(f, "shape error: {m}"),
            Error::BufferTooShort { what, needed, len } => {
                write!(f, "{what} buffer too short: the view reaches {needed} elements, the buffer has {len}")
            }
            Error::Misaligned { what, align } => write!(f, "{what} pointer is not aligned to {align} bytes"),
            Error::TooLarge(m) => write!(f, "too large: {m}"),
            Error::Unsupported(m) => write!(f, "unsupported: {m}"),
            Error::WrongBackend(m) => write!(f, "wrong backend: {m}"),
            Error::NoCudaDevice(m) => write!(f, "no usable CUDA device: {m}"),
            Error::CudaNotBuilt => write!(
                f,
                "mesa-kernels was built without CUDA kernels (nvcc was not found at build time); \
                 set NVCC or CUDA_HOME and rebuild, or use the emulator backend"
            ),
            Error::NoKernelImage { compute_capability: (ma, mi), built } => write!(
                f,
                "no kernel image for this GPU (compute capability {ma}.{mi}); the library was built for [{built}]; \
                 rebuild with MESA_CUDA_ARCHS including {ma}{mi}"
            ),
            Error::Cuda(m) => write!(f, "CUDA error: {m}"),
            Error::Timeout(m) => write!(f, "timeout: {m}"),
            Error::KernelArgument(op) => write!(f, "kernel entry point `{op}` rejected its arguments"),
        }
    }
}

impl std::error::Error for Error {}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(format!("{e:?}"))
    }
}

/// cudaErrorNoKernelImageForDevice (CUDA runtime).
const CUDA_ERROR_NO_KERNEL_IMAGE: i32 = 209;
/// cudaErrorMemoryAllocation.
const CUDA_ERROR_MEMORY_ALLOCATION: i32 = 2;
/// cudaErrorInsufficientDriver.
const CUDA_ERROR_INSUFFICIENT_DRIVER: i32 = 35;
/// cudaErrorNoDevice.
const CUDA_ERROR_NO_DEVICE: i32 = 100;
/// cudaErrorUnsupportedPtxVersion.
const CUDA_ERROR_UNSUPPORTED_PTX: i32 = 222;
/// cudaErrorCooperativeLaunchTooLarge (also: the device has no cooperative launch).
const CUDA_ERROR_COOPERATIVE_TOO_LARGE: i32 = 720;

/// Turns a kernel entry point's status into a `Result`.
///
/// `cc` is the device's compute capability, used to explain a missing kernel image.
pub(crate) fn check_status(op: &'static str, status: sys::MesaStatus, cc: Option<(i32, i32)>) -> Result<()> {
    let code = status as u32;
    match code {
        sys::MESA_STATUS_OK => Ok(()),
        sys::MESA_STATUS_INVALID_ARGUMENT => Err(Error::KernelArgument(op)),
        sys::MESA_STATUS_CUDA_NOT_BUILT => Err(Error::CudaNotBuilt),
        sys::MESA_STATUS_UNSUPPORTED => Err(Error::Unsupported(format!("{op}: rejected by the kernel launcher"))),
        sys::MESA_STATUS_TIMEOUT => Err(Error::Timeout(format!("{op}: a bounded wait expired"))),
        c if c >= sys::MESA_STATUS_CUDA_ERROR_BASE => {
            let cuda = (c - sys::MESA_STATUS_CUDA_ERROR_BASE) as i32;
            match cuda {
                CUDA_ERROR_NO_KERNEL_IMAGE | CUDA_ERROR_UNSUPPORTED_PTX => {
                    Err(Error::NoKernelImage { compute_capability: cc.unwrap_or((0, 0)), built: sys::CUDA_ARCHS })
                }
                CUDA_ERROR_INSUFFICIENT_DRIVER => Err(Error::NoCudaDevice(format!(
                    "{op}: the CUDA driver is older than the runtime the kernels were built with (cudaError {cuda})"
                ))),
                CUDA_ERROR_NO_DEVICE => Err(Error::NoCudaDevice(format!("{op}: no CUDA device (cudaError {cuda})"))),
                CUDA_ERROR_COOPERATIVE_TOO_LARGE => Err(Error::TooLarge(format!(
                    "{op}: the cooperative grid cannot be co-resident on this device (or it lacks cooperative \
                     launch); use fewer ranks per device or fewer blocks per rank"
                ))),
                CUDA_ERROR_MEMORY_ALLOCATION => Err(Error::TooLarge(format!("{op}: out of memory (cudaError {cuda})"))),
                _ => Err(Error::Cuda(format!("{op}: cudaError {cuda}"))),
            }
        }
        other => Err(Error::Cuda(format!("{op}: unknown status {other}"))),
    }
}
