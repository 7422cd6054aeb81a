//! The crate's error type: every bad input and every failure is a value, never a panic.
//!
//! Variants name the domain of the problem and carry its facts as fields (which tensor,
//! which shapes, which argument and why), so a caller can match on them; driver errors keep
//! cudarc's [`DriverError`] as their [`source`](std::error::Error::source).
use std::fmt;

use cudarc::driver::DriverError;
use mesa_kernels_sys as sys;

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong, checked before any kernel is launched where possible.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// Two shapes that must agree do not (e.g. an op's input and output).
    ShapeMismatch {
        /// The tensor whose shape is wrong (e.g. `"output"`).
        what: String,
        /// The shape the op needs.
        expected: Vec<usize>,
        /// The shape it was given.
        got: Vec<usize>,
    },
    /// A shape, stride or grouping the op cannot take: wrong rank, an axis out of range, a
    /// group count that does not divide its axis, an empty grouped axis, an output view that
    /// overlaps itself.
    InvalidLayout {
        /// The tensor (e.g. `"input"`).
        what: String,
        /// What is wrong with it.
        why: String,
    },
    /// A scalar argument outside its domain (momentum, eps, world size, chunk, timeout, …).
    InvalidArgument {
        /// The argument's name.
        name: String,
        /// Its domain, and the value given.
        why: String,
    },
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
    /// Two tensors of one call share memory, and at least one of them is written. The op does
    /// not support that overlap (in-place calls are rejected unless the op's docs say
    /// otherwise): a kernel that re-reads an input it has overwritten gives wrong results.
    Aliasing {
        /// The tensor registered first.
        first: &'static str,
        /// The tensor that overlaps it.
        second: &'static str,
    },
    /// A size, index or grid does not fit: element counts or offsets that overflow, sizes past
    /// the kernels' limits, a grid that cannot be launched, memory that cannot be allocated.
    TooLarge {
        /// The quantity (e.g. `"input"`, `"cooperative grid"`).
        what: String,
        /// The limit that was passed.
        why: String,
    },
    /// A valid request that is not implemented (dtype, bit width, a layout the kernel does
    /// not take).
    Unsupported {
        /// The op or parameter.
        what: String,
        /// What is not supported.
        why: String,
    },
    /// Memory or a handle of one backend, device or context given to another (host memory to
    /// the CUDA backend, a buffer of another GPU, a quantizer of another stream).
    WrongBackend {
        /// The tensor or handle.
        what: String,
        /// Where it belongs instead.
        why: String,
    },
    /// The CUDA driver library is missing, no device is visible, or the device cannot be used.
    NoCudaDevice {
        /// Why the device cannot be used.
        why: String,
        /// The driver's error, when the driver reported one.
        source: Option<DriverError>,
    },
    /// The library was built without nvcc, so the CUDA kernels are not in it.
    CudaNotBuilt,
    /// The device cannot run the kernels in this build (no SASS or PTX for it).
    NoKernelImage {
        /// The device's compute capability, e.g. (9, 0).
        compute_capability: (i32, i32),
        /// The architectures built (`MESA_CUDA_ARCHS`).
        built: &'static str,
    },
    /// A CUDA driver call failed (through cudarc).
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A kernel launch reported a CUDA runtime error.
    CudaRuntime {
        /// The kernel entry point.
        op: &'static str,
        /// The `cudaError_t` value.
        code: i32,
    },
    /// A bounded wait expired (collectives): every output of the call is NaN.
    Timeout {
        /// The op.
        op: &'static str,
        /// Which wait, or which earlier call, timed out.
        why: String,
    },
    /// A check of the emulator failed during a launch (`MESA_EMU_CHECK`, the
    /// [`emulator`](crate::emulator) module): a kernel wrote past an allocation, a barrier or
    /// shuffle was reached by part of its threads, a block exceeded the launch bounds.
    EmulatorCheck {
        /// The kernel entry point.
        op: &'static str,
        /// The emulator's report: the check, the kernel, where, and the seed that replays it.
        report: String,
    },
    /// A kernel entry point rejected its arguments (a bug in this crate's checks if seen).
    KernelArgument {
        /// The kernel entry point.
        op: &'static str,
    },
}

impl Error {
    pub(crate) fn shape_mismatch(what: impl Into<String>, expected: &[usize], got: &[usize]) -> Self {
        Error::ShapeMismatch { what: what.into(), expected: expected.to_vec(), got: got.to_vec() }
    }
    pub(crate) fn invalid_layout(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::InvalidLayout { what: what.into(), why: why.into() }
    }
    pub(crate) fn invalid_argument(name: impl Into<String>, why: impl Into<String>) -> Self {
        Error::InvalidArgument { name: name.into(), why: why.into() }
    }
    pub(crate) fn too_large(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::TooLarge { what: what.into(), why: why.into() }
    }
    pub(crate) fn unsupported(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::Unsupported { what: what.into(), why: why.into() }
    }
    pub(crate) fn wrong_backend(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::WrongBackend { what: what.into(), why: why.into() }
    }
    pub(crate) fn timeout(op: &'static str, why: impl Into<String>) -> Self {
        Error::Timeout { op, why: why.into() }
    }
    pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> Self {
        move |source| Error::Driver { op, source }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ShapeMismatch { what, expected, got } => {
                write!(f, "shape mismatch: {what} has shape {got:?}, expected {expected:?}")
            }
            Error::InvalidLayout { what, why } => write!(f, "invalid layout of {what}: {why}"),
            Error::InvalidArgument { name, why } => write!(f, "invalid argument `{name}`: {why}"),
            Error::BufferTooShort { what, needed, len } => {
                write!(f, "{what} buffer too short: the view reaches {needed} elements, the buffer has {len}")
            }
            Error::Misaligned { what, align } => write!(f, "{what} pointer is not aligned to {align} bytes"),
            Error::Aliasing { first, second } => {
                write!(f, "{first} and {second} share memory and one of them is written; this op needs them distinct")
            }
            Error::TooLarge { what, why } => write!(f, "too large: {what}: {why}"),
            Error::Unsupported { what, why } => write!(f, "unsupported: {what}: {why}"),
            Error::WrongBackend { what, why } => write!(f, "wrong backend: {what}: {why}"),
            Error::NoCudaDevice { why, source } => match source {
                Some(e) => write!(f, "no usable CUDA device: {why} ({e:?})"),
                None => write!(f, "no usable CUDA device: {why}"),
            },
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
            Error::Driver { op, source } => write!(f, "CUDA driver error in {op}: {source:?}"),
            Error::CudaRuntime { op, code } => write!(f, "CUDA error in {op}: cudaError {code}"),
            Error::Timeout { op, why } => write!(f, "timeout in {op}: {why}"),
            Error::EmulatorCheck { op, report } => write!(f, "emulator check failed in {op}: {report}"),
            Error::KernelArgument { op } => {
                write!(f, "kernel entry point `{op}` rejected its arguments (a bug in mesa-kernels' checks)")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Driver { source, .. } => Some(source),
            Error::NoCudaDevice { source: Some(source), .. } => Some(source),
            _ => None,
        }
    }
}

impl From<DriverError> for Error {
    fn from(source: DriverError) -> Self {
        Error::Driver { op: "a CUDA driver call", source }
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
        sys::MESA_STATUS_INVALID_ARGUMENT => Err(Error::KernelArgument { op }),
        sys::MESA_STATUS_CUDA_NOT_BUILT => Err(Error::CudaNotBuilt),
        sys::MESA_STATUS_UNSUPPORTED => Err(Error::unsupported(op, "rejected by the kernel launcher")),
        sys::MESA_STATUS_TIMEOUT => Err(Error::timeout(op, "a bounded wait expired")),
        c if c >= sys::MESA_STATUS_CUDA_ERROR_BASE => {
            let cuda = (c - sys::MESA_STATUS_CUDA_ERROR_BASE) as i32;
            match cuda {
                CUDA_ERROR_NO_KERNEL_IMAGE | CUDA_ERROR_UNSUPPORTED_PTX => {
                    Err(Error::NoKernelImage { compute_capability: cc.unwrap_or((0, 0)), built: sys::CUDA_ARCHS })
                }
                CUDA_ERROR_INSUFFICIENT_DRIVER => Err(Error::NoCudaDevice {
                    why: format!(
                        "{op}: the CUDA driver is older than the runtime the kernels were built with (cudaError {cuda})"
                    ),
                    source: None,
                }),
                CUDA_ERROR_NO_DEVICE => {
                    Err(Error::NoCudaDevice { why: format!("{op}: no CUDA device (cudaError {cuda})"), source: None })
                }
                CUDA_ERROR_COOPERATIVE_TOO_LARGE => Err(Error::too_large(
                    op,
                    "the cooperative grid cannot be co-resident on this device (or it lacks cooperative \
                     launch); use fewer ranks per device or fewer blocks per rank",
                )),
                CUDA_ERROR_MEMORY_ALLOCATION => Err(Error::too_large(op, format!("out of memory (cudaError {cuda})"))),
                _ => Err(Error::CudaRuntime { op, code: cuda }),
            }
        }
        other => Err(Error::CudaRuntime { op, code: other as i32 }),
    }
}
