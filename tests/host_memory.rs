//! The emulator's host buffers are reported to a `HostMemoryObserver`, so that a host that
//! counts its memory (mesa-candle's counting allocator) sees the codes and states the kernels
//! keep: they come from the emulator's checked allocator, not from Rust's global allocator.
//! One test in its own binary: the observer is process-wide.
mod common;

use std::sync::atomic::{AtomicIsize, Ordering};

use mesa_kernels::{observe_host_memory, Error, HostMemoryObserver};

#[derive(Debug, Default)]
struct Count(AtomicIsize);

impl HostMemoryObserver for Count {
    fn allocated(&self, bytes: usize) {
        self.0.fetch_add(bytes as isize, Ordering::SeqCst);
    }
    fn freed(&self, bytes: usize) {
        self.0.fetch_sub(bytes as isize, Ordering::SeqCst);
    }
}

static COUNT: Count = Count(AtomicIsize::new(0));
static OTHER: Count = Count(AtomicIsize::new(0));

#[test]
fn host_buffers_are_reported_when_allocated_and_freed() {
    let device = common::emulator();
    // allocated before the observer: reported neither when allocated nor when freed
    let early = device.alloc_zeros::<f32>(1000).expect("alloc");
    observe_host_memory(&COUNT).expect("first observer");
    observe_host_memory(&COUNT).expect("the same observer again");
    assert!(matches!(observe_host_memory(&OTHER), Err(Error::InvalidArgument { .. })));

    let a = device.alloc_zeros::<f32>(12_345).expect("alloc");
    let b = device.alloc_zeros::<u8>(7).expect("alloc");
    assert_eq!(COUNT.0.load(Ordering::SeqCst), 12_345 * 4 + 7);
    drop(a);
    assert_eq!(COUNT.0.load(Ordering::SeqCst), 7);
    drop(early);
    drop(b);
    assert_eq!(COUNT.0.load(Ordering::SeqCst), 0);
}
