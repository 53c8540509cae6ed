//! Async backpressure (`Pool::allocate_async`): a pool at its limit whose freed block the
//! GPU still uses resolves, without a blocked thread, once the use completes: woken by
//! the driver for the crate's events, re-polled through the executor for fences that
//! cannot wake a task; requests that waiting cannot help fail at once, as the sync path.
//! The GPU test (a use held behind a gate) is in the gated binary
//! (`tests/gated/pool_async.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;
use cudalloc::Error;

use crate::model::Flag;
use crate::support::{counting, poll};

const MIB: usize = 1 << 20;

/// A pool capped at 4 MiB, holding one 3 MiB block that was freed while `fence` guards it.
fn full_pool<S: cudalloc::source::HostVisible + 'static>(source: S) -> (Pool<S>, Layout, usize) {
    // A sync wait long enough to notice if the async path used it (it must not).
    let config = PoolConfig::default()
        .with_limit(4 * MIB)
        .with_pending_wait(Some(Duration::from_secs(30)));
    let pool = Pool::with_config(source, config);
    let l = Layout::from_size_align(3 * MIB, 8).unwrap();
    let a = pool.try_allocate(l).unwrap();
    (pool, l, a.cast::<u8>().as_ptr() as usize)
}

#[test]
fn allocate_async_at_the_cap_waits_for_a_pending_block_without_blocking() {
    let (pool, l, a) = full_pool(HostSource);
    let done = Arc::new(AtomicBool::new(false));
    assert!(pool.record_fence(a as *const u8, Flag(done.clone())).unwrap());
    // SAFETY: allocated by `full_pool` with `l`.
    unsafe { pool.deallocate(std::ptr::NonNull::new(a as *mut u8).unwrap(), l) };
    assert_eq!(pool.stats().pending_blocks, 1);

    let (count, waker) = counting();
    let mut fut = pool.allocate_async(l);
    let t0 = Instant::now();
    assert!(poll(&mut fut, &waker).is_pending(), "the only room is pending");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the poll took the sync path's 30 s wait"
    );
    // A flag cannot wake a task: the future asks to be polled again.
    assert!(
        count.wakes.load(Ordering::SeqCst) >= 1,
        "not rescheduled: it would hang"
    );
    assert!(poll(&mut fut, &waker).is_pending());
    done.store(true, Ordering::Release);
    let b = match poll(&mut fut, &waker) {
        Poll::Ready(r) => r.unwrap(),
        Poll::Pending => panic!("pending after the fence completed"),
    };
    assert_eq!(b.cast::<u8>().as_ptr() as usize, a, "the freed block came back");
    // Nothing pending and no room: fails at once, as the sync path would.
    let mut again = pool.allocate_async(l);
    match poll(&mut again, &waker) {
        Poll::Ready(Err(Error::LimitExceeded { .. })) => {}
        other => panic!("expected LimitExceeded at once, got {other:?}"),
    }
    // Larger than the cap: waiting cannot help.
    let huge = Layout::from_size_align(8 * MIB, 8).unwrap();
    assert!(matches!(
        poll(&mut pool.allocate_async(huge), &waker),
        Poll::Ready(Err(_))
    ));
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(b.cast(), l) };
    // A dropped future holds nothing: the block is free.
    drop(again);
    let c = pool.try_allocate(l).unwrap();
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(c.cast(), l) };
}

/// The handle's async path: a block of the default pinned pool (the fallback without a
/// driver), freed through the handle; zero size is a dangling block, as `allocate`'s.
#[test]
fn pinned_alloc_allocate_async_gives_a_block_the_handle_frees() {
    let (_, waker) = counting();
    for size in [0, 100, 3 * MIB] {
        let l = Layout::from_size_align(size, 64).unwrap();
        let mut fut = cudalloc::PinnedAlloc::allocate_async(l);
        let block = match poll(&mut fut, &waker) {
            Poll::Ready(r) => r.unwrap(),
            Poll::Pending => panic!("pending with room in the pool"),
        };
        assert!(block.len() >= size);
        assert_eq!(block.cast::<u8>().as_ptr() as usize % 64, 0, "aligned");
        if size > 0 {
            // SAFETY: the block holds `size` writable bytes.
            unsafe { std::ptr::write_bytes(block.cast::<u8>().as_ptr(), 0x5A, size) };
        }
        // SAFETY: allocated with `l` by the default pinned handle's path.
        unsafe { cudalloc::PinnedAlloc.deallocate(block.cast(), l) };
    }
}
