//! Loom models of the pool's concurrent structures, on host memory. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib`.
//!
//! Each model keeps to two or three threads and a handful of operations. Thread caches
//! are driven directly (`CacheCore` owned by each model thread, as the thread-local
//! table would), since loom threads share one OS thread's locals.

use allocator_api2::alloc::{Allocator, Layout};

use super::pending::fake::FlagFence;
use super::shared::{Budget, Shared};
use super::size_class::class_size;
use super::*;
use crate::source::HostSource;
use crate::sync::{thread, Arc};

/// A small pool shape: few classes (few locks for loom to track), small chunks.
fn config() -> PoolConfig {
    PoolConfig {
        chunk_size: 256 << 10,
        large_threshold: 256,
        thread_cache_capacity: 4,
        ..PoolConfig::default()
    }
}

fn shared() -> Arc<Shared<HostSource>> {
    let config = config();
    Arc::new(Shared::new(
        HostSource,
        config.settings(),
        Arc::new(Budget::new(usize::MAX)),
        0,
        None,
    ))
}

/// Two threads refill their caches from one shared list, pop, push back, and flush
/// (as at thread exit) while the other works: no block is ever held by both, and the
/// accounting balances at the end.
#[test]
fn thread_cache_refill_and_flush() {
    loom::model(|| {
        let sh = shared();
        let class = 2;
        let worker = |sh: Arc<Shared<HostSource>>| {
            move || {
                let mut cache = sh.new_cache();
                let mut batch = Batch::new();
                sh.take_small(class, 2, &mut batch).unwrap();
                let got = batch.len();
                cache.fill(class, batch.drain());
                let a = cache.pop(class).unwrap();
                assert!(cache.push(class, a));
                // Full bin: flush half, as the free slow path does.
                let half = cache.take_half(class);
                sh.give_small(class, half);
                // Thread exit.
                sh.flush_cache(&mut cache);
                sh.retire_cache(cache.stats());
                got
            }
        };
        let t1 = thread::spawn(worker(sh.clone()));
        let t2 = thread::spawn(worker(sh.clone()));
        let n1 = t1.join().unwrap();
        let n2 = t2.join().unwrap();
        assert!(n1 >= 1 && n2 >= 1);
        sh.check_accounting();
        let s = sh.stats();
        assert_eq!(s.live_blocks, 0, "{s:?}");
        assert_eq!(
            s.live_bytes + s.cached_bytes + s.pending_bytes,
            s.source_bytes,
            "{s:?}"
        );
        // Every carved block is back in the list exactly once: 2 to 4 were carved.
        assert!(s.cached_blocks <= 4 && s.cached_blocks >= 2, "{s:?}");
    });
}

/// Two threads allocate and free through the shared lists (no thread caches) while one
/// of them also trims: live blocks stay distinct and usable, nothing leaks.
#[test]
fn shared_free_lists_with_trim() {
    loom::model(|| {
        let pool = Arc::new(Pool::with_config(
            HostSource,
            PoolConfig {
                thread_cache_capacity: 0,
                ..config()
            },
        ));
        let l = Layout::from_size_align(48, 16).unwrap();
        let t = {
            let pool = pool.clone();
            thread::spawn(move || {
                let p = pool.allocate(l).unwrap();
                // SAFETY: a fresh 48-byte block.
                unsafe { p.cast::<u8>().as_ptr().write_bytes(1, 48) };
                let addr = p.cast::<u8>().as_ptr() as usize;
                // SAFETY: allocated above.
                unsafe { pool.deallocate(p.cast(), l) };
                addr
            })
        };
        let q = pool.allocate(l).unwrap();
        // SAFETY: a fresh 48-byte block.
        unsafe { q.cast::<u8>().as_ptr().write_bytes(2, 48) };
        pool.trim();
        // q is live: its chunk must have survived the trim.
        assert!(pool.stats().source_bytes >= 256 << 10);
        // SAFETY: q is still live.
        assert_eq!(unsafe { q.cast::<u8>().as_ptr().read() }, 2);
        let _ = t.join().unwrap();
        // SAFETY: allocated above.
        unsafe { pool.deallocate(q.cast(), l) };
        let s = pool.stats();
        assert_eq!(
            s.live_bytes + s.cached_bytes + s.pending_bytes,
            s.source_bytes,
            "{s:?}"
        );
        pool.trim();
        assert_eq!(pool.stats().source_bytes, 0);
    });
}

/// One thread frees a block with an unfinished fence while another completes the fence
/// and drains, and the main thread allocates the same class: it never receives the block
/// before the fence is complete, and the block is back in a free list at the end.
#[test]
fn pending_list_waits_for_fences() {
    loom::model(|| {
        let pool = Arc::new(Pool::with_config(
            HostSource,
            PoolConfig {
                thread_cache_capacity: 0,
                ..config()
            },
        ));
        let l = Layout::from_size_align(64, 8).unwrap();
        let block = pool.allocate(l).unwrap();
        let addr = block.cast::<u8>().as_ptr() as usize;
        let fence = FlagFence::default();
        pool.record_fence(addr as *const u8, fence.clone()).unwrap();
        let freer = {
            let pool = pool.clone();
            let ptr = BlockPtr::new(block.cast());
            thread::spawn(move || {
                // SAFETY: allocated above, freed once, here.
                unsafe { pool.deallocate(ptr.as_non_null(), l) };
            })
        };
        let completer = {
            let pool = pool.clone();
            let fence = fence.clone();
            thread::spawn(move || {
                fence.complete();
                pool.shared.drain();
            })
        };
        let other = pool.allocate(l).unwrap();
        if other.cast::<u8>().as_ptr() as usize == addr {
            assert!(
                fence.is_complete().unwrap(),
                "a block was reused before its fence completed"
            );
        }
        freer.join().unwrap();
        completer.join().unwrap();
        // SAFETY: allocated above.
        unsafe { pool.deallocate(other.cast(), l) };
        let s = pool.stats();
        assert_eq!((s.pending_blocks, s.live_blocks), (0, 0), "{s:?}");
        assert_eq!(s.cached_bytes, s.source_bytes, "{s:?}");
        assert_eq!(class_size(super::size_class::class_of(64)), 64);
    });
}

/// A thread holds a block from its cache while another trims: the chunk under a block in
/// a thread cache (or in use) is never released; after the flush it is.
#[test]
fn trim_never_releases_a_chunk_with_cached_blocks() {
    loom::model(|| {
        let sh = shared();
        let class = 1;
        let holder = {
            let sh = sh.clone();
            thread::spawn(move || {
                let mut cache = sh.new_cache();
                let mut batch = Batch::new();
                sh.take_small(class, 2, &mut batch).unwrap();
                cache.fill(class, batch.drain());
                let live = cache.pop(class).unwrap();
                // One block live, one parked in the cache: the chunk must stay.
                assert!(sh.stats().source_bytes > 0);
                assert!(cache.push(class, live));
                sh.flush_cache(&mut cache);
                sh.retire_cache(cache.stats());
            })
        };
        sh.trim();
        holder.join().unwrap();
        sh.check_accounting();
        sh.trim();
        assert_eq!(sh.stats().source_bytes, 0);
    });
}
