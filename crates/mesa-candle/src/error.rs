//! The crate's typed error, carried through candle as `candle_core::Error::Cuda`.
//!
//! **Why that variant.** Of candle-core 0.11's variants that carry a foreign error, only
//! `Error::Cuda(Box<dyn std::error::Error + Send + Sync>)` both displays it as it is
//! (`#[error(transparent)]`: our one-line message, nothing added) and can be downcast back
//! ([`as_mesa_error`]). The name is candle's and says nothing about CUDA: CPU errors travel
//! in it too. The alternatives: `WrappedContext` displays as `{wrapped:?}\n{context:?}` (a
//! Debug dump, then the message quoted on a second line), and `Wrapped` (displayed as is)
//! holds a `dyn Display` that cannot be downcast. Errors of a backward travel unchanged
//! (candle's backprop returns a custom op's `bwd` error with `?`); a caller's `.context(..)`
//! (candle's `Error::Context`, or `WrappedContext` from its `Context` trait) adds candle's
//! own lines around the message, and [`as_mesa_error`] looks through both.
use std::fmt;

/// What can go wrong in the bridge and the ops, before or instead of a kernel's own
/// [`mesa_kernels::Error`] (kept as [`Error::Kernel`]). Ops return `candle_core::Result`
/// (they run inside candle's autograd): this value travels inside it as
/// `candle_core::Error::Cuda` (module docs: the name is candle's, the error need not be
/// about CUDA), which displays this value's message as it is, and [`as_mesa_error`] gets it
/// back.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A kernel rejected its arguments or failed.
    Kernel(mesa_kernels::Error),
    /// The op does not take this candle dtype (the ops take f32, f16 and bf16, and f64
    /// computed in f32; the transformer layer takes f32).
    UnsupportedDType {
        /// The op.
        op: &'static str,
        /// The dtype given.
        dtype: candle_core::DType,
    },
    /// Tensors of one call with different dtypes: every op takes one dtype for all its
    /// tensors (f64 ones are computed in f32 together, [`crate::ops`]).
    DTypeMismatch {
        /// The op.
        op: &'static str,
        /// The tensor whose dtype differs, with the layout the op reads (e.g. `"weight [C]"`).
        what: String,
        /// The tensor whose dtype it must have (the op's first), with its layout.
        of: String,
        /// `of`'s dtype.
        expected: candle_core::DType,
        /// `what`'s dtype.
        got: candle_core::DType,
    },
    /// The tensor lives on a candle device the bridge cannot serve (Metal; CUDA without the
    /// `cuda` feature).
    UnsupportedDevice {
        /// The op.
        op: &'static str,
        /// The device, as candle names it.
        device: String,
    },
    /// Tensors of one call on different devices.
    DeviceMismatch {
        /// The op.
        op: &'static str,
    },
    /// A tensor of a rank the op does not take.
    Rank {
        /// The tensor, with the layout the op reads (e.g. `"queries [B, H, L, d]"`).
        what: String,
        /// The rank needed (the least rank, when `at_least`).
        expected: usize,
        /// Whether a larger rank is also accepted.
        at_least: bool,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A shape that does not fit the op or the layer's configuration.
    Shape {
        /// The tensor.
        what: String,
        /// The shape needed.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A configuration value outside its domain.
    InvalidArgument {
        /// The argument.
        name: &'static str,
        /// Its domain and the value given.
        why: String,
    },
    /// A checkpoint lacks a parameter of the layer.
    MissingParameter {
        /// The parameter's name (with the caller's prefix).
        name: String,
    },
    /// Candle called the forward of an op twice, or its backward after its saved state was
    /// released (a bug in this crate if seen).
    StateConsumed {
        /// The op.
        op: &'static str,
    },
    /// A checkpoint region's rerun in backward computed another output than its forward
    /// ([`crate::region`], "Randomness replays"): its gradients would be those of another
    /// function.
    RegionReplay {
        /// What differed, and the likely cause.
        why: String,
    },
    /// A collective of a tensor-parallel group ([`crate::parallel`]) failed. Every rank of
    /// the call gets the same error, and the group refuses later calls.
    Collective {
        /// The collective (`"all_gather_seq"`, `"reduce_scatter_seq"`, `"all_reduce_sum"`).
        op: &'static str,
        /// What went wrong.
        fault: Fault,
        /// The ranks and values involved.
        why: String,
    },
}

/// The kinds of [`Error::Collective`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The ranks' calls disagree: op or call order, split sizes, rank count, shapes, dtype.
    Mismatch,
    /// A rank reported an error of its own ([`crate::parallel::Collectives::fail`]).
    PeerFailed {
        /// The rank that failed.
        rank: usize,
    },
    /// A rank did not arrive within the group's timeout.
    Timeout,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Kernel(e) => write!(f, "mesa-kernels: {e}"),
            Error::UnsupportedDType { op, dtype } => {
                write!(
                    f,
                    "{op}: dtype {dtype:?} is not supported (ops: f32, f16, bf16, f64 computed in f32; layer: f32, f16, bf16)"
                )
            }
            Error::DTypeMismatch { op, what, of, expected, got } => {
                write!(
                    f,
                    "{op}: dtype {got:?} of {what} differs from {expected:?} of {of} (one dtype for all the op's tensors)"
                )
            }
            Error::UnsupportedDevice { op, device } => write!(f, "{op}: device {device} is not supported"),
            Error::DeviceMismatch { op } => write!(f, "{op}: tensors on different devices"),
            Error::Rank { what, expected, at_least, got } => {
                let least = if *at_least { "at least " } else { "" };
                write!(f, "{what}: expected rank {least}{expected}, got shape {got:?} (rank {})", got.len())
            }
            Error::Shape { what, expected, got } => write!(f, "{what}: expected shape {expected:?}, got {got:?}"),
            Error::InvalidArgument { name, why } => write!(f, "{name}: {why}"),
            Error::MissingParameter { name } => write!(f, "checkpoint has no parameter {name}"),
            Error::StateConsumed { op } => write!(f, "{op}: saved state already consumed"),
            Error::RegionReplay { why } => write!(f, "checkpoint region: rerun differs from forward: {why}"),
            Error::Collective { op, fault, why } => write!(f, "{op}: {fault:?}: {why}"),
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

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        // `Cuda` is candle's transparent variant for any boxed error (module docs), not a
        // claim about CUDA: it displays as our message and downcasts back
        candle_core::Error::Cuda(Box::new(e))
    }
}

/// A kernel's error as a candle error (`?` on a `mesa_kernels::Result` inside this crate).
pub(crate) fn kernel(e: mesa_kernels::Error) -> candle_core::Error {
    Error::Kernel(e).into()
}

/// Extension: `.k()?` turns a `mesa_kernels::Result` into a `candle_core::Result`.
pub(crate) trait KernelResult<T> {
    fn k(self) -> candle_core::Result<T>;
}

impl<T> KernelResult<T> for mesa_kernels::Result<T> {
    fn k(self) -> candle_core::Result<T> {
        self.map_err(kernel)
    }
}

/// The mesa-candle error inside a candle error, if that is what it is (tests match on it):
/// as the crate sends it (`candle_core::Error::Cuda`, module docs), and inside candle's
/// backtrace, path and context wrappers (`WithBacktrace`, `WithPath`, `Context`, and
/// `WrappedContext`, which candle's `Context` trait makes of a `Result`).
#[must_use]
pub fn as_mesa_error(e: &candle_core::Error) -> Option<&Error> {
    // ours, or a candle error carried by candle's `Context` trait
    fn boxed<'a>(b: &'a (dyn std::error::Error + Send + Sync + 'static)) -> Option<&'a Error> {
        b.downcast_ref::<Error>().or_else(|| b.downcast_ref::<candle_core::Error>().and_then(as_mesa_error))
    }
    match e {
        candle_core::Error::Cuda(b) => boxed(b.as_ref()),
        candle_core::Error::WrappedContext { wrapped, .. } => boxed(wrapped.as_ref()),
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::Context { inner, .. }
        | candle_core::Error::WithPath { inner, .. } => as_mesa_error(inner),
        _ => None,
    }
}
