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

/// A latch: set once, waited for with a deadline (no test can hang on it).
#[derive(Default, Clone)]
struct Latch(Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>);

impl Latch {
    fn set(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
    fn wait(&self, timeout: Duration) -> bool {
        let (m, c) = &*self.0;
        let g = m.lock().unwrap();
        *c.wait_timeout_while(g, timeout, |set| !*set).unwrap().0
    }
}

/// A fence complete once `done` is set. Asked on the thread named "drainer", it says it
/// is inside the query (`entered`) and stays there until `release` (at most 10 s): a
/// driver query that takes a while, as `cuEventQuery` can under load.
struct SlowQuery {
    done: Arc<AtomicBool>,
    entered: Latch,
    release: Latch,
}

// SAFETY: the tests set `done` only once they no longer touch the block.
unsafe impl cudalloc::fence::Fence for SlowQuery {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        if std::thread::current().name() == Some("drainer") {
            self.entered.set();
            self.release.wait(Duration::from_secs(10));
        }
        Ok(self.done.load(Ordering::Acquire))
    }
}

/// A pool at its cap whose only room is a freed block behind a `SlowQuery`, and a thread
/// ("drainer") inside `collect_pending`'s query of that fence (the pending list out of
/// the pool's lock) while `during` runs; `during` gets the flag that completes the use
/// and the latch that ends the query.
fn while_another_thread_polls_the_pending_list<R>(
    during: impl FnOnce(&Pool<HostSource>, Layout, &Arc<AtomicBool>, &Latch) -> R,
) -> (Pool<HostSource>, Layout, R) {
    let (pool, l, a) = full_pool(HostSource);
    let (done, entered, release) = (
        Arc::new(AtomicBool::new(false)),
        Latch::default(),
        Latch::default(),
    );
    let fence = SlowQuery {
        done: done.clone(),
        entered: entered.clone(),
        release: release.clone(),
    };
    assert!(pool.record_fence(a as *const u8, fence).unwrap());
    // SAFETY: allocated by `full_pool` with `l`.
    unsafe { pool.deallocate(std::ptr::NonNull::new(a as *mut u8).unwrap(), l) };
    assert_eq!(pool.stats().pending_blocks, 1);
    let out = std::thread::scope(|s| {
        let drainer = std::thread::Builder::new()
            .name("drainer".into())
            .spawn_scoped(s, || pool.collect_pending())
            .unwrap();
        assert!(
            entered.wait(Duration::from_secs(10)),
            "the drainer never queried the fence"
        );
        let out = during(&pool, l, &done, &release);
        release.set();
        drainer.join().unwrap();
        out
    });
    done.store(true, Ordering::Release);
    (pool, l, out)
}

/// Found by review (2026-12-06): while a drain had the pending list out of the lock, the
/// backpressure saw nothing pending, and `allocate_async` failed at once with
/// `LimitExceeded` where a pending block was about to make room.
#[test]
fn allocate_async_waits_while_another_thread_polls_the_pending_list() {
    let (pool, l, first) = while_another_thread_polls_the_pending_list(|pool, l, _, _| {
        let (_, waker) = counting();
        poll(&mut pool.allocate_async(l), &waker).map(|r| r.map(|b| b.cast::<u8>().as_ptr() as usize))
    });
    assert!(
        first.is_pending(),
        "allocate_async gave up although a pending block could make room: {first:?}"
    );
    // Once the use completed, the block comes back.
    let (_, waker) = counting();
    let mut again = pool.allocate_async(l);
    let t0 = Instant::now();
    let b = loop {
        if let Poll::Ready(r) = poll(&mut again, &waker) {
            break r.unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never resolved");
    };
    // SAFETY: allocated just above with `l`.
    unsafe { pool.deallocate(b.cast(), l) };
}

/// The sync path's bounded wait (30 s here) in the same window: it waits for the pending
/// block (its use completes 200 ms later) instead of failing at once.
#[test]
fn the_sync_wait_waits_while_another_thread_polls_the_pending_list() {
    let (pool, l, (out, took)) = while_another_thread_polls_the_pending_list(|pool, l, done, release| {
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                done.store(true, Ordering::Release);
                release.set();
            });
            let t0 = Instant::now();
            let out = pool.try_allocate(l);
            (out, t0.elapsed())
        })
    });
    let b = out.unwrap_or_else(|e| {
        panic!("failed after {took:?} although a pending block was about to make room: {e:?}")
    });
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(b.cast(), l) };
}
