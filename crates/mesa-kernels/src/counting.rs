//! [`CountingAllocator`]: live heap bytes and their peak, for memory measurements.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting live bytes and their peak: how mesa-candle and mesa-burn
/// measure what a layer or a model keeps alive for backward.
///
/// A framework's CPU tensors (candle's CPU storage, burn's Flex) are ordinary heap memory; a
/// binary installs the counter with `#[global_allocator]`. What the host emulation
/// keeps in its own checked allocator ([`HostBuffer`](crate::HostBuffer): codes, statistics,
/// states) is counted too once the counter is also the [`HostMemoryObserver`](crate::HostMemoryObserver)
/// ([`CountingAllocator::observe_emulator`]). It counts every thread's allocations (the
/// framework's and the emulator's worker threads included), so measure in a process that does
/// nothing else at the time, after a warm-up, with one worker thread where the framework has a
/// pool (`RAYON_NUM_THREADS=1`): gemm keeps an L2-sized packing buffer per thread that has run a
/// product, allocated on its first one.
#[derive(Debug, Default)]
pub struct CountingAllocator {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl CountingAllocator {
    /// A counter at zero (usable in a `static`).
    #[must_use]
    pub const fn new() -> Self {
        CountingAllocator { current: AtomicUsize::new(0), peak: AtomicUsize::new(0) }
    }

    /// Bytes allocated and not yet freed.
    #[must_use]
    pub fn current(&self) -> usize {
        self.current.load(Ordering::SeqCst)
    }

    /// The largest [`CountingAllocator::current`] since the last [`CountingAllocator::reset_peak`].
    #[must_use]
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Makes this counter the process's [`crate::HostMemoryObserver`], so that the
    /// emulator's buffers are counted with the heap's.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] when another observer is installed.
    pub fn observe_emulator(&'static self) -> crate::Result<()> {
        crate::observe_host_memory(self)
    }

    /// Starts a new peak measurement at the current level.
    pub fn reset_peak(&self) {
        self.peak.store(self.current(), Ordering::SeqCst);
    }

    fn add(&self, bytes: usize) {
        let now = self.current.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn sub(&self, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::SeqCst);
    }
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are atomics and never
// allocate.
impl crate::HostMemoryObserver for CountingAllocator {
    fn allocated(&self, bytes: usize) {
        self.add(bytes);
    }
    fn freed(&self, bytes: usize) {
        self.sub(bytes);
    }
}

#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on to `System`.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.add(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.add(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (i.e. `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        self.sub(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc` and `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            self.sub(layout.size());
            self.add(new_size);
        }
        p
    }
}
