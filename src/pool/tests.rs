//! Unit tests of the pool on host memory: accounting, thread caches, the pending list,
//! limits, trim-and-retry, slot recycling.

use core::ptr::NonNull;

use allocator_api2::alloc::{Allocator, Layout};

use super::*;
use crate::cuda::MemoryType;
use crate::fence::fake::FlagFence;
use crate::source::HostSource;
use crate::sync::global::{AtomicUsize as GlobalUsize, Ordering as GOrd};

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

fn small_config() -> PoolConfig {
    PoolConfig {
        chunk_size: 256 << 10,
        large_threshold: 16 << 10,
        thread_cache_capacity: 8,
        ..PoolConfig::default()
    }
}

/// A host pool whose frees all go to the shared lists and registry.
fn without_thread_caches() -> Pool<HostSource> {
    Pool::with_config(
        HostSource,
        PoolConfig {
            thread_cache_capacity: 0,
            ..PoolConfig::default()
        },
    )
}

#[test]
fn hit_returns_the_block_just_freed_and_accounting_holds() {
    let pool = Pool::new(HostSource);
    let l = layout(100, 8);
    let a = pool.allocate(l).unwrap();
    assert_eq!(a.len(), 112);
    pool.shared.check_accounting().unwrap();
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(a.cast(), l) };
    let b = pool.allocate(l).unwrap();
    assert_eq!(a.cast::<u8>(), b.cast::<u8>(), "a hit pops the block just freed");
    let s = pool.stats();
    assert_eq!((s.live_blocks, s.misses, s.hits), (1, 1, 1));
    pool.shared.check_accounting().unwrap();
    // SAFETY: allocated above with `l`; freed with the returned length, also allowed.
    unsafe { pool.deallocate(b.cast(), layout(b.len(), 8)) };
    assert_eq!(pool.stats().live_bytes, 0);
    assert!(pool.trim() >= 2 << 20);
    let s = pool.stats();
    assert_eq!((s.source_bytes, s.cached_bytes, s.live_bytes), (0, 0, 0), "{s:?}");
}

#[test]
fn aligned_small_and_large_blocks() {
    let pool = Pool::with_config(HostSource, small_config());
    let mut live = Vec::new();
    for align in [1, 16, 64, 512, 4096, 8192, 1 << 20] {
        for size in [1, 24, align, 3 * align / 2 + 5, 20_000] {
            let l = layout(size, align);
            let p = pool.allocate(l).unwrap();
            assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0, "{l:?}");
            assert!(p.len() >= size);
            // SAFETY: the block holds at least `size` bytes.
            unsafe { p.cast::<u8>().as_ptr().write_bytes(0xAB, size) };
            live.push((p, l));
        }
    }
    pool.shared.check_accounting().unwrap();
    for (p, l) in live {
        // SAFETY: allocated above with `l`.
        unsafe { pool.deallocate(p.cast(), l) };
    }
    pool.shared.check_accounting().unwrap();
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0);
}

#[test]
fn large_blocks_reuse_the_smallest_free_extent_and_split_it() {
    let pool = without_thread_caches();
    let big = layout(3 << 20, 8);
    let p = pool.allocate(big).unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(p.cast(), big) };
    // 2 MiB from the cached 3 MiB segment: its start, split; the rest stays cached.
    let q = pool.allocate(layout(2 << 20, 8)).unwrap();
    assert_eq!(q.cast::<u8>(), p.cast::<u8>());
    assert_eq!(q.len(), 2 << 20, "split at the request");
    // 1 MiB: the rest of the segment, no new memory from the source.
    let r = pool.allocate(layout(1 << 20, 8)).unwrap();
    // SAFETY: both in the 3 MiB block allocated above.
    assert_eq!(r.cast::<u8>().as_ptr(), unsafe {
        p.cast::<u8>().as_ptr().add(2 << 20)
    });
    let s = pool.stats();
    assert_eq!(
        (s.misses, s.source_bytes, s.cached_bytes),
        (1, 3 << 20, 0),
        "{s:?}"
    );
    pool.shared.check_accounting().unwrap();
    // A segment with a live block is not returned by trim; its free extents stay cached.
    // SAFETY: allocated above; any size up to the returned length may be passed.
    unsafe { pool.deallocate(q.cast(), layout(q.len(), 8)) };
    assert_eq!(pool.trim(), 0);
    assert_eq!(pool.stats().cached_bytes, 2 << 20);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(r.cast(), layout(1 << 20, 8)) };
    pool.shared.check_accounting().unwrap();
    assert_eq!(
        pool.trim(),
        3 << 20,
        "the extents merged back into one free segment"
    );
    assert_eq!(pool.stats().source_bytes, 0);
}

/// Grows a `Vec<u8>` in `pool` to 16 MiB; returns how often its data moved once it was
/// larger than the large threshold, and checks the contents after every move.
fn grow_vec(pool: &Pool<HostSource>) -> usize {
    let mut v: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::new_in(pool);
    let mut moves = 0;
    let mut at = v.as_ptr();
    for i in 0..(16usize << 20) {
        v.push(i as u8);
        if v.as_ptr() != at {
            if v.capacity() > (1 << 20) {
                moves += 1;
            }
            assert!(v.iter().enumerate().all(|(j, &b)| b == j as u8), "contents kept");
            at = v.as_ptr();
        }
    }
    moves
}

#[test]
fn growing_large_blocks_grow_in_place() {
    for cache in [0, 8] {
        let pool = Pool::with_config(
            HostSource,
            PoolConfig {
                thread_cache_capacity: cache,
                ..PoolConfig::default()
            },
        );
        // The first round takes segments with room to double; its blocks move when a
        // segment is full.
        let first = grow_vec(&pool);
        assert!(first <= 3, "{first} moves");
        pool.shared.check_accounting().unwrap();
        let held = pool.stats().source_bytes;
        // Later rounds grow in place in the largest free extent: no move, no new memory.
        for _ in 0..3 {
            assert_eq!(grow_vec(&pool), 0, "cache {cache}");
            pool.shared.check_accounting().unwrap();
            assert_eq!(pool.stats().source_bytes, held);
        }
        let s = pool.stats();
        assert_eq!(s.live_bytes, 0, "{s:?}");
        pool.trim();
        assert_eq!(pool.stats().source_bytes, 0);
    }
}

#[test]
fn a_large_block_grows_in_place_only_into_free_memory() {
    let pool = without_thread_caches();
    let l4 = layout(4 << 20, 64);
    let seg = pool.allocate(l4).unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(seg.cast(), l4) };
    // Two 1 MiB blocks at the start of the cached 4 MiB segment.
    let l1 = layout(1 << 20, 64);
    let a = pool.allocate(l1).unwrap();
    let b = pool.allocate(l1).unwrap();
    // `b` grows in place into the free rest of the segment.
    // SAFETY: b was allocated with l1.
    let b2 = unsafe { pool.grow(b.cast(), l1, layout(2 << 20, 64)) }.unwrap();
    assert_eq!(b2.cast::<u8>(), b.cast::<u8>());
    assert_eq!(b2.len(), 2 << 20);
    // SAFETY: a is a live block of 1 MiB, filled before growing.
    unsafe { a.cast::<u8>().as_ptr().write_bytes(7, 1 << 20) };
    // `a` cannot (b follows it): it moves, contents kept.
    // SAFETY: a was allocated with l1; 2 MiB >= 1 MiB.
    let a2 = unsafe { pool.grow(a.cast(), l1, layout(2 << 20, 64)) }.unwrap();
    assert_ne!(a2.cast::<u8>(), a.cast::<u8>());
    // SAFETY: a2 holds 2 MiB, the first of which was copied.
    let copied = unsafe { core::slice::from_raw_parts(a2.cast::<u8>().as_ptr(), 1 << 20) };
    assert!(copied.iter().all(|&x| x == 7));
    assert_eq!(
        pool.stats().source_bytes,
        8 << 20,
        "a fresh segment with room to double"
    );
    pool.shared.check_accounting().unwrap();
    // SAFETY: allocated above with these sizes.
    unsafe {
        pool.deallocate(a2.cast(), layout(2 << 20, 64));
        pool.deallocate(b2.cast(), layout(2 << 20, 64));
    }
    pool.shared.check_accounting().unwrap();
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0);
}

#[test]
fn thread_caches_flush_when_full_and_at_thread_exit() {
    let pool = Pool::with_config(HostSource, small_config());
    let l = layout(48, 16);
    std::thread::scope(|s| {
        // Joined explicitly: a scope may end before its threads' locals are destroyed,
        // a join waits for that too.
        s.spawn(|| {
            let blocks: Vec<_> = (0..100).map(|_| pool.allocate(l).unwrap()).collect();
            for b in blocks {
                // SAFETY: allocated above.
                unsafe { pool.deallocate(b.cast(), l) };
            }
            let st = pool.stats();
            assert!(st.cached_blocks >= 100 && st.live_blocks == 0, "{st:?}");
        })
        .join()
        .unwrap();
    });
    // The thread exited: its cache went to the shared lists, so trim can release all.
    let st = pool.stats();
    assert_eq!(st.live_bytes, 0);
    pool.shared.check_accounting().unwrap();
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0);
}

#[test]
fn blocks_freed_with_unfinished_fences_wait_in_the_pending_list() {
    let pool = Pool::with_config(HostSource, small_config());
    let l = layout(64, 8);
    let a = pool.allocate(l).unwrap();
    let fence = FlagFence::default();
    // An interior pointer finds its block.
    pool.record_fence(a.cast::<u8>().as_ptr().wrapping_add(10), fence.clone())
        .unwrap();
    assert_eq!(pool.shared.uses.lock().uses_len(), 1);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l) };
    let s = pool.stats();
    assert_eq!(
        (s.pending_blocks, s.pending_bytes, s.live_blocks),
        (1, 64, 0),
        "{s:?}"
    );
    pool.shared.check_accounting().unwrap();
    // Not reused while the fence is unfinished.
    let mut taken = Vec::new();
    for _ in 0..50 {
        let b = pool.allocate(l).unwrap();
        assert_ne!(b.cast::<u8>(), a.cast::<u8>(), "a pending block was handed out");
        taken.push(b);
    }
    fence.complete();
    assert_eq!(pool.collect_pending(), 1);
    assert_eq!(pool.stats().pending_blocks, 0);
    pool.shared.check_accounting().unwrap();
    for b in taken {
        // SAFETY: allocated above.
        unsafe { pool.deallocate(b.cast(), l) };
    }
    // Trim flushes this thread's cache; the once-pending block is back in a free list.
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0);
}

#[cfg(feature = "test-hooks")]
#[test]
fn the_pending_switch_off_reuses_at_once() {
    let pool = Pool::with_config(HostSource, small_config());
    pool.set_pending_list_enabled(false);
    let l = layout(64, 8);
    let a = pool.allocate(l).unwrap();
    pool.record_fence(a.cast::<u8>().as_ptr(), FlagFence::default())
        .unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l) };
    assert_eq!(pool.stats().pending_blocks, 0);
    let b = pool.allocate(l).unwrap();
    assert_eq!(a.cast::<u8>(), b.cast::<u8>());
    // SAFETY: allocated above.
    unsafe { pool.deallocate(b.cast(), l) };
}

#[test]
fn large_pending_blocks_and_stream_dedup() {
    struct OnStream(FlagFence, crate::cuda::StreamId);
    // SAFETY: completes when its flag is set, which the test does after the use.
    unsafe impl Fence for OnStream {
        fn is_complete(&self) -> Result<bool> {
            self.0.is_complete()
        }
        fn stream_id(&self) -> Option<crate::cuda::StreamId> {
            Some(self.1)
        }
    }
    let pool = Pool::new(HostSource);
    let l = layout(4 << 20, 4096);
    let a = pool.allocate(l).unwrap();
    let first = FlagFence::default();
    let second = FlagFence::default();
    let stream = crate::cuda::StreamId::fresh();
    pool.record_fence(a.cast::<u8>().as_ptr(), OnStream(first.clone(), stream))
        .unwrap();
    // A later fence on the same stream replaces the earlier one.
    pool.record_fence(
        a.cast::<u8>().as_ptr().wrapping_add(4096),
        OnStream(second.clone(), stream),
    )
    .unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l) };
    assert_eq!(pool.stats().pending_bytes, 4 << 20);
    second.complete();
    pool.collect_pending();
    assert_eq!(
        pool.stats().pending_bytes,
        0,
        "only the latest fence of a stream counts"
    );
    pool.shared.check_accounting().unwrap();
    assert_eq!(pool.trim(), 4 << 20);
}

#[test]
fn record_fence_outside_the_pool_records_nothing() {
    let pool = Pool::new(HostSource);
    let x = 5u64;
    let owned = pool
        .record_fence(&x as *const u64 as *const u8, FlagFence::default())
        .unwrap();
    assert!(!owned);
    assert_eq!(pool.shared.uses.lock().uses_len(), 0);
}

#[test]
fn limit_fails_cleanly_then_trim_and_retry_recovers() {
    let pool = Pool::with_config(
        HostSource,
        PoolConfig {
            limit: Some(4 << 20),
            thread_cache_capacity: 0,
            ..PoolConfig::default()
        },
    );
    let big = layout(3 << 20, 8);
    let a = pool.allocate(big).unwrap();
    // 3 MiB more would pass the 4 MiB cap, even after trimming (a is live).
    assert!(pool.allocate(big).is_err());
    assert_eq!(pool.stats().failures, 1);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), big) };
    // Now a 2 MiB chunk is wanted: over the cap until the cached 3 MiB block is trimmed.
    let small = layout(64, 8);
    let b = pool.allocate(small).expect("trim and retry makes room");
    assert_eq!(pool.stats().source_bytes, 2 << 20);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(b.cast(), small) };
    // Absurd sizes fail without panicking.
    assert!(pool.allocate(layout(1 << 50, 8)).is_err());
    assert!(pool.allocate(layout(isize::MAX as usize - 4095, 4096)).is_err());
}

/// A source that fails a set number of times, then delegates to HostSource.
struct Flaky(GlobalUsize);

// SAFETY: forwards to HostSource.
unsafe impl crate::source::MemorySource for Flaky {
    fn align(&self) -> usize {
        HostSource.align()
    }
    fn kind(&self) -> MemoryType {
        MemoryType::Pageable
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        if self.0.load(GOrd::Relaxed) > 0 {
            self.0.fetch_sub(1, GOrd::Relaxed);
            return Err(Error::OutOfMemory { requested: size });
        }
        HostSource.allocate(size)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: came from HostSource.allocate(size).
        unsafe { HostSource.deallocate(ptr, size) }
    }
}
// SAFETY: HostSource memory.
unsafe impl crate::source::HostVisible for Flaky {}

#[test]
fn a_failing_source_is_retried_once_after_trimming() {
    let pool = Pool::new(Flaky(GlobalUsize::new(1)));
    let l = layout(64, 8);
    let a = pool.allocate(l).expect("one failure, then the retry succeeds");
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l) };
    pool.source().0.store(2, GOrd::Relaxed);
    assert!(
        pool.allocate(layout(8 << 20, 8)).is_err(),
        "two failures: AllocError"
    );
    assert!(pool.allocate(layout(8 << 20, 8)).is_ok_and(|p| {
        // SAFETY: allocated just now.
        unsafe { pool.deallocate(p.cast(), layout(8 << 20, 8)) };
        true
    }));
}

#[test]
fn grow_and_shrink_in_place_within_a_class() {
    let pool = Pool::new(HostSource);
    let a = pool.allocate(layout(100, 8)).unwrap();
    // SAFETY: a was allocated with (100, 8); 110 and 97 map to the same 112-byte class.
    let b = unsafe { pool.grow(a.cast(), layout(100, 8), layout(110, 8)) }.unwrap();
    assert_eq!(a.cast::<u8>(), b.cast::<u8>());
    // SAFETY: b is live with (110, 8).
    let c = unsafe { pool.shrink(b.cast(), layout(110, 8), layout(97, 8)) }.unwrap();
    assert_eq!(a.cast::<u8>(), c.cast::<u8>());
    // SAFETY: c is live with (97, 8); 5000 is another class: moved, contents kept.
    unsafe { c.cast::<u8>().as_ptr().write_bytes(7, 97) };
    // SAFETY: as above.
    let d = unsafe { pool.grow_zeroed(c.cast(), layout(97, 8), layout(5000, 8)) }.unwrap();
    // SAFETY: d holds 5000 bytes.
    let bytes = unsafe { core::slice::from_raw_parts(d.cast::<u8>().as_ptr(), 5000) };
    assert!(bytes[..97].iter().all(|&x| x == 7) && bytes[97..].iter().all(|&x| x == 0));
    // SAFETY: d is live with (5000, 8).
    unsafe { pool.deallocate(d.cast(), layout(5000, 8)) };
    assert_eq!(pool.stats().live_blocks, 0);
}

#[test]
fn slots_are_recycled_and_stale_caches_flushed_to_their_own_pool() {
    let l = layout(32, 8);
    let first = Pool::new(HostSource);
    let slot = first.shared.slot;
    let shared = first.shared.clone();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (back_tx, back_rx) = std::sync::mpsc::channel::<()>();
        let first_ref = &first;
        let t = s.spawn(move || {
            let p = first_ref.allocate(l).unwrap();
            // SAFETY: allocated above.
            unsafe { first_ref.deallocate(p.cast(), l) }; // parked in this thread's cache
            back_tx.send(()).unwrap();
            rx.recv().unwrap();
        });
        back_rx.recv().unwrap();
        let st = shared.stats();
        assert!(st.cached_blocks >= 1 && st.live_blocks == 0, "{st:?}");
        tx.send(()).unwrap();
        t.join().unwrap();
    });
    drop(first);
    // The slot may now go to a new pool; the old state outlived its handle safely.
    let second = Pool::new(HostSource);
    if second.shared.slot == slot {
        let p = second.allocate(l).unwrap();
        // SAFETY: allocated above.
        unsafe { second.deallocate(p.cast(), l) };
    }
    assert_eq!(shared.stats().live_blocks, 0);
    shared.check_accounting().unwrap();
}

#[test]
fn many_pools_beyond_the_slots_use_shared_lists() {
    let pools: Vec<_> = (0..70)
        .map(|_| Pool::with_config(HostSource, small_config()))
        .collect();
    let l = layout(200, 8);
    for pool in &pools {
        let p = pool.allocate(l).unwrap();
        // SAFETY: allocated above.
        unsafe { pool.deallocate(p.cast(), l) };
        pool.shared.check_accounting().unwrap();
    }
    assert!(pools.iter().any(|p| p.shared.slot.is_none()));
}

#[test]
fn completed_uses_of_live_blocks_are_forgotten() {
    let pool = Pool::with_config(HostSource, small_config());
    let l = layout(64, 8);
    let a = pool.allocate(l).unwrap();
    let fence = FlagFence::default();
    pool.record_fence(a.cast::<u8>().as_ptr(), fence.clone()).unwrap();
    pool.collect_pending();
    assert_eq!(pool.shared.uses.lock().uses_len(), 1, "an unfinished use is kept");
    fence.complete();
    pool.collect_pending();
    assert_eq!(
        pool.shared.uses.lock().uses_len(),
        0,
        "frees are back on the fast path"
    );
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l) };
    assert_eq!(pool.stats().pending_blocks, 0);
}

#[test]
fn a_large_block_split_from_a_cached_extent_is_thread_cached_when_freed() {
    let pool = Pool::new(HostSource);
    let l8 = layout(8 << 20, 16);
    let big = pool.allocate(l8).unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(big.cast(), l8) };
    // Into the shared registry, as a flush at thread exit would.
    pool.with_cache(|c| pool.shared.flush_cache(c));
    let l1 = layout(1 << 20, 16);
    let a = pool.allocate(l1).unwrap();
    assert_eq!(a.cast::<u8>(), big.cast::<u8>(), "split from the cached extent");
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l1) };
    // The split moved the epoch before the block was lent: its record is still good, so
    // the free went to this thread's cache, and the next pair is a lock-free hit.
    let cached = pool.with_cache(|c| c.take_large_blocks()).unwrap();
    assert_eq!(cached.len(), 1);
    assert_eq!(
        (cached[0].0.addr(), cached[0].1),
        (a.cast::<u8>().as_ptr() as usize, 1 << 20)
    );
    for (p, _) in cached {
        pool.shared.give_large(p.addr(), true);
    }
    pool.shared.check_accounting().unwrap();
    assert_eq!(pool.trim(), 8 << 20, "merged back into one free segment");
}
