//! Whether a CUDA library can be loaded, asked without cudarc's loader.
//!
//! cudarc's `is_culib_present` exists only with its `dynamic-loading` feature; in a graph
//! where another crate turns on `dynamic-linking` (candle-core's `cuda`) it is compiled out.
//! Asking the dynamic loader directly works in both: with `dynamic-linking` the library is
//! already mapped (the program could not have started otherwise) and the probe finds it.

/// File names of the CUDA driver library.
#[cfg(windows)]
pub(crate) const DRIVER: &[&str] = &["nvcuda.dll"];
/// File names of the CUDA driver library.
#[cfg(not(windows))]
pub(crate) const DRIVER: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// File names of NCCL.
#[cfg(all(feature = "nccl", not(windows)))]
pub(crate) const NCCL: &[&str] = &["libnccl.so.2", "libnccl.so"];
/// File names of NCCL.
#[cfg(all(feature = "nccl", windows))]
pub(crate) const NCCL: &[&str] = &["nccl.dll"];

/// True when one of `names` can be loaded by the platform's dynamic loader.
pub(crate) fn library_present(names: &[&str]) -> bool {
    names.iter().any(|name| {
        // SAFETY: loading a vendor library runs its initialisers, exactly what cudarc's loader
        // does with the same names a moment later; the handle is dropped (unloaded only when
        // nothing else holds it).
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}
