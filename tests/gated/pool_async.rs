//! Async backpressure on the GPU (`Pool::allocate_async`): a pool at its limit whose freed
//! block is used by work held behind a gate is not woken before the gate opens, and is
//! woken by the driver (no re-polling) once the use completes.

use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use cudalloc::cuda::Stream;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::PinnedSource;

use crate::gpu_support::Gate;
use crate::support::{counting, poll};
use crate::MIB;

/// A pool capped at 4 MiB holding one 3 MiB block.
fn full_pool() -> (Pool<PinnedSource>, Layout, usize) {
    let config = PoolConfig::default()
        .with_limit(4 * MIB)
        .with_pending_wait(Some(Duration::from_secs(30)));
    let pool = Pool::with_config(PinnedSource::default(), config);
    let l = Layout::from_size_align(3 * MIB, 8).unwrap();
    let a = pool.try_allocate(l).unwrap();
    (pool, l, a.cast::<u8>().as_ptr() as usize)
}

#[test]
fn allocate_async_is_woken_by_the_driver_when_the_gpu_use_completes() {
    gpu!();
    let _one = crate::one_at_a_time();
    let s = Stream::new(0).unwrap();
    let (pool, l, a) = full_pool();
    let gate = Gate::hold(&s);
    assert!(pool.record_use(a as *const u8, &s).unwrap());
    // SAFETY: allocated by `full_pool` with `l`.
    unsafe { pool.deallocate(std::ptr::NonNull::new(a as *mut u8).unwrap(), l) };
    let (count, waker) = counting();
    let mut fut = pool.allocate_async(l);
    assert!(poll(&mut fut, &waker).is_pending());
    assert!(poll(&mut fut, &waker).is_pending());
    assert_eq!(
        count.wakes.load(Ordering::SeqCst),
        0,
        "woken while the GPU still uses the block"
    );
    gate.open();
    let t0 = Instant::now();
    while count.wakes.load(Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the driver never woke the allocation"
        );
        std::thread::park_timeout(Duration::from_millis(50));
    }
    let b = loop {
        if let Poll::Ready(r) = poll(&mut fut, &waker) {
            break r.unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "woken but never ready");
        std::thread::park_timeout(Duration::from_millis(10));
    };
    assert_eq!(b.cast::<u8>().as_ptr() as usize, a);
    assert!(s.is_idle().unwrap(), "handed out before the use completed");
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(b.cast(), l) };
    s.synchronize().unwrap();
}
