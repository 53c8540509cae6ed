//! Tests that make the crate meet errors on purpose: fences that panic or fail. They run
//! in their own process, because every such error is counted in the process-wide
//! `cudalloc::cuda::drop_errors()`, which the GPU tests of the other binaries assert is
//! zero.

use std::sync::atomic::{AtomicUsize, Ordering};

use allocator_api2::alloc::{Allocator, Layout};
use cudalloc::fence::Fence;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

// ---- issue 12, defect 5 ---------------------------------------------------------------

/// A fence that panics on its first poll, then reports completion.
struct PanicsOnce {
    polls: AtomicUsize,
}

// SAFETY: it reports completion only from its second poll on, when the test no longer
// uses the block.
unsafe impl Fence for PanicsOnce {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        if self.polls.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("a fence that panics once");
        }
        Ok(true)
    }
}

/// A block whose fence panicked once must not stay pending forever (the pending list was
/// taken out before polling and dropped by the unwind).
#[test]
fn defect_05_a_fence_that_panics_once_does_not_strand_its_block() {
    let pool = Pool::with_config(HostSource, PoolConfig::default().with_thread_cache_capacity(0));
    let l = layout(64, 8);
    let a = pool.allocate(l).unwrap();
    let b = pool.allocate(l).unwrap();
    let fence = PanicsOnce {
        polls: AtomicUsize::new(0),
    };
    assert!(pool.record_fence(a.cast::<u8>().as_ptr(), fence).unwrap());
    assert!(pool
        .record_fence(
            b.cast::<u8>().as_ptr(),
            PanicsOnce {
                polls: AtomicUsize::new(1)
            }
        )
        .unwrap());
    // SAFETY: allocated above.
    unsafe {
        pool.deallocate(a.cast(), l);
        pool.deallocate(b.cast(), l);
    }
    assert_eq!(pool.stats().pending_blocks, 2);
    // The first drain meets the panic: the other block still comes back, and nothing is
    // lost or unwound into the caller.
    assert_eq!(pool.collect_pending(), 1);
    assert_eq!(pool.stats().pending_blocks, 1);
    // The next drain finds the once-panicking fence complete.
    assert_eq!(pool.collect_pending(), 1);
    let s = pool.stats();
    assert_eq!((s.pending_blocks, s.live_blocks), (0, 0), "{s:?}");
    assert_eq!(s.live_bytes + s.cached_bytes + s.pending_bytes, s.source_bytes);
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0, "every block came back");
}
