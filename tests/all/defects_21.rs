//! One regression test per defect of issue 21 that the host pools, the arenas and the
//! range registry had (numbered as there). Each failed before its fix. The counting
//! items (9, 11) are in `counting.rs`, the device items (3, 12) in the device tests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::vec::Vec;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;

use crate::model::Flag;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

// ---- item 1 ---------------------------------------------------------------------------

/// `with_pending_wait(Some(Duration::MAX))` made every failing allocation panic with
/// "overflow when adding duration to instant" (in `allocate`, in `Vec::try_reserve`, past
/// a limit). A wait that long must wait for as long as the GPU takes, and a request that
/// can never fit must fail with an error.
#[test]
fn defect_21_01_a_wait_forever_neither_panics_nor_gives_up() {
    for wait in [Duration::MAX, Duration::from_secs(u64::MAX)] {
        let pool = Pool::with_config(
            HostSource,
            PoolConfig::default()
                .with_limit(4 << 20)
                .with_pending_wait(Some(wait)),
        );
        // Never fits: an error at once, no panic.
        assert!(pool.allocate(layout(8 << 20, 64)).is_err());
        let mut v: Vec<u8, _> = Vec::new_in(&pool);
        assert!(v.try_reserve(16 << 20).is_err());

        // Fits once a pending block's GPU use completes: the allocation waits for it.
        let big = layout(3 << 20, 64);
        let p = pool.allocate(big).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        assert!(pool
            .record_fence(p.as_ptr() as *const u8, Flag(done.clone()))
            .unwrap());
        // SAFETY: allocated above with this layout, not used after.
        unsafe { pool.deallocate(p.cast(), big) };
        assert_eq!(pool.stats().pending_blocks, 1);
        let setter = {
            let done = done.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                done.store(true, Ordering::Release);
            })
        };
        let q = pool
            .allocate(big)
            .expect("waits for the pending block instead of failing");
        assert!(
            done.load(Ordering::Acquire),
            "handed out only after the use completed"
        );
        // SAFETY: allocated just above with this layout.
        unsafe { pool.deallocate(q.cast(), big) };
        setter.join().unwrap();
    }
}

// ---- item 2 ---------------------------------------------------------------------------

/// A user `MemorySource` whose chunks are blocks of a crate `Pool`, as the trait invites.
struct PoolSource(&'static Pool<HostSource>);

// SAFETY: blocks of the pool are `size` bytes (the layout asked for), 4096-aligned,
// owned by this source until freed back to the pool; `deallocate` never panics.
unsafe impl cudalloc::source::MemorySource for PoolSource {
    fn align(&self) -> usize {
        4096
    }
    fn kind(&self) -> cudalloc::cuda::MemoryType {
        cudalloc::cuda::MemoryType::Pageable
    }
    fn allocate(&self, size: usize) -> cudalloc::Result<std::ptr::NonNull<u8>> {
        self.0
            .allocate(layout(size, 4096))
            .map(|p| p.cast())
            .map_err(|_| cudalloc::Error::OutOfMemory { requested: size })
    }
    unsafe fn deallocate(&self, ptr: std::ptr::NonNull<u8>, size: usize) {
        // SAFETY: obligation 1: `ptr` came from `allocate(size)`.
        unsafe { self.0.deallocate(ptr, layout(size, 4096)) }
    }
}
// SAFETY: the lower pool's memory is host memory.
unsafe impl cudalloc::source::HostVisible for PoolSource {}

/// A pool layered over another pool's blocks registered its chunks over the lower pool's
/// ranges in the process-wide registry: while it held a chunk, live blocks of the lower
/// pool answered `Ok(false)` to `record_fence` (unprotected), and once it freed a chunk
/// that started where a lower segment started, the lower segment was unregistered for
/// good, so a block freed there with a pending use was handed out again at once.
#[test]
fn defect_21_02_nested_pools_keep_every_owner_registered() {
    let lower: &'static Pool<HostSource> = Box::leak(Box::new(Pool::with_config(
        HostSource,
        PoolConfig::default()
            .with_thread_cache_capacity(0)
            .with_pending_wait(None),
    )));
    let upper = Pool::with_config(
        PoolSource(lower),
        PoolConfig::default()
            .with_thread_cache_capacity(0)
            .with_pending_wait(None),
    );
    // A cached 8 MiB segment of the lower pool: the upper pool's 2 MiB chunk is carved
    // from its start, and the lower pool's next large blocks from the rest of it.
    let seg = layout(8 << 20, 4096);
    let s = lower.allocate(seg).unwrap();
    // SAFETY: allocated just above with this layout.
    unsafe { lower.deallocate(s.cast(), seg) };
    let small = layout(64, 8);
    let up = upper.allocate(small).unwrap();
    // Blocks of the lower pool beside the upper pool's chunk: each must be protected.
    let blocks: std::vec::Vec<_> = (0..200)
        .map(|i| lower.allocate(layout(1024 + 64 * (i % 8), 64)).unwrap())
        .collect();
    let big: std::vec::Vec<_> = (0..4)
        .map(|_| lower.allocate(layout(1 << 20, 4096)).unwrap())
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    for p in blocks.iter().chain(&big) {
        assert!(
            cudalloc::record_fence(p.as_ptr() as *const u8, Flag(done.clone())).unwrap(),
            "a live block of the lower pool is protected while the upper pool holds a chunk"
        );
    }
    // The innermost owner answers for the upper pool's memory.
    assert!(cudalloc::record_fence(up.as_ptr() as *const u8, Flag(Arc::new(AtomicBool::new(true)))).unwrap());
    // SAFETY: allocated above with this layout.
    unsafe { upper.deallocate(up.cast(), small) };
    drop(upper); // its chunk goes back to the lower pool: unregistered as the upper's only
    for (i, p) in big.iter().enumerate() {
        assert!(
            cudalloc::record_fence(p.as_ptr() as *const u8, Flag(done.clone())).unwrap(),
            "large block {i} of the lower pool is still registered"
        );
        // SAFETY: allocated above with this layout, not used after.
        unsafe { lower.deallocate(p.cast(), layout(1 << 20, 4096)) };
    }
    assert_eq!(
        lower.stats().pending_blocks,
        4,
        "freed blocks with pending uses wait"
    );
    let again: std::vec::Vec<_> = (0..4)
        .map(|_| lower.allocate(layout(1 << 20, 4096)).unwrap())
        .collect();
    for q in &again {
        assert!(
            !big.iter().any(|b| b.as_ptr() as *mut u8 == q.as_ptr() as *mut u8),
            "a block with a pending use was handed out again"
        );
    }
    done.store(true, Ordering::Release);
    for q in again {
        // SAFETY: allocated above with this layout.
        unsafe { lower.deallocate(q.cast(), layout(1 << 20, 4096)) };
    }
    for (i, p) in blocks.into_iter().enumerate() {
        // SAFETY: allocated above with this layout.
        unsafe { lower.deallocate(p.cast(), layout(1024 + 64 * (i % 8), 64)) };
    }
}

// ---- item 4 ---------------------------------------------------------------------------

/// A fence that panics whenever it is asked.
struct Panicking;

// SAFETY: it never reports completion.
unsafe impl cudalloc::fence::Fence for Panicking {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        panic!("a broken fence")
    }
}

/// One fence that panics, recorded once on arena memory: the first reset gives that
/// memory up (documented), but the fence stayed in the arena's set, so every later reset
/// failed its wait and gave up every chunk again (30 batches of 1 MiB abandoned 34 GB of
/// address space with chunk growth). The arena gives the memory up once and works on.
#[test]
fn defect_21_04_an_arena_gives_up_once_after_a_bad_fence_and_works_on() {
    // The panicking fence makes `drop_errors` grow: alone in a child process with a driver.
    if crate::support::in_a_child_process_with_a_driver(
        "defects_21::defect_21_04_an_arena_gives_up_once_after_a_bad_fence_and_works_on",
    ) {
        return;
    }
    use cudalloc::arena::{Arena, ArenaConfig};
    let mut arena = Arena::with_config(HostSource, ArenaConfig::default());
    let first = arena.try_alloc_layout(layout(1 << 20, 64)).unwrap();
    assert!(cudalloc::record_fence(first.as_ptr(), Panicking).unwrap());
    arena.reset();
    let after_first = arena.stats();
    assert!(
        after_first.abandoned_bytes >= 1 << 20,
        "the guarded memory is given up"
    );
    for batch in 0..30 {
        let p = arena.try_alloc_layout(layout(1 << 20, 64)).unwrap();
        // SAFETY: a fresh 1 MiB block of the arena.
        unsafe { p.as_ptr().write_bytes(batch as u8, 1 << 20) };
        arena.reset();
    }
    let s = arena.stats();
    assert_eq!(
        s.abandoned_bytes, after_first.abandoned_bytes,
        "later resets abandon nothing: nothing was recorded on their chunks"
    );
    assert_eq!(s.gpu_wait_errors, after_first.gpu_wait_errors);
    assert_eq!(s.pending_uses, 0);
}

// ---- item 5 ---------------------------------------------------------------------------

/// `Arena::rewind` with the checkpoint of another (empty) arena, or one taken before a
/// `reset`, freed every block of this arena instead of panicking as documented: a block
/// kept through a raw pointer across the rewind (the `Arena::checkpoint` example's
/// pattern) was overwritten by the next allocation.
#[test]
fn defect_21_05_rewind_refuses_foreign_and_stale_checkpoints() {
    use cudalloc::arena::Arena;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    let fill = |arena: &Arena<HostSource>, byte: u8| {
        let p = arena.try_alloc_layout(layout(4096, 8)).unwrap();
        // SAFETY: a fresh block of 4096 bytes.
        unsafe { p.as_ptr().write_bytes(byte, 4096) };
        p.as_ptr()
    };
    let kept_intact = |p: *mut u8, byte: u8| {
        // SAFETY: the block is live: nothing freed it.
        (0..4096).all(|i| unsafe { *p.add(i) } == byte)
    };

    let mut arena = Arena::new(HostSource);
    let other: Arena<HostSource> = Arena::new(HostSource);
    let keep = fill(&arena, 0xAB);
    let foreign = other.checkpoint();
    assert!(catch_unwind(AssertUnwindSafe(|| arena.rewind(foreign))).is_err());
    fill(&arena, 0x11);
    assert!(
        kept_intact(keep, 0xAB),
        "a block of another arena's checkpoint survived"
    );

    let mut arena = Arena::new(HostSource);
    let before_reset = arena.checkpoint();
    fill(&arena, 0x22);
    arena.reset();
    let keep = fill(&arena, 0xCD);
    assert!(catch_unwind(AssertUnwindSafe(|| arena.rewind(before_reset))).is_err());
    fill(&arena, 0x33);
    assert!(
        kept_intact(keep, 0xCD),
        "a checkpoint from before the reset freed nothing"
    );

    // A checkpoint of this arena still works.
    let mark = arena.checkpoint();
    fill(&arena, 0x44);
    arena.rewind(mark);
    assert!(kept_intact(keep, 0xCD));
}

// ---- item 6 ---------------------------------------------------------------------------

/// A `Pool` limit below the chunk size (2 MiB) failed every small request, even 1 byte in
/// an empty pool, with an error naming the chunk size, while a 600 KB request succeeded.
/// Small blocks now come from chunks that fit the limit, and an error at the limit names
/// what the request needed.
#[test]
fn defect_21_06_a_limit_below_the_chunk_size_serves_small_blocks() {
    use cudalloc::Error;
    const LIMIT: usize = 1 << 20;
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default().with_limit(LIMIT).with_pending_wait(None),
    );
    let one = pool
        .try_allocate(layout(1, 1))
        .expect("1 byte in an empty pool under 1 MiB");
    let mut held = vec![(one, layout(1, 1))];
    for size in [64, 256, 4096, 32 << 10, 100 << 10] {
        let l = layout(size, 8);
        held.push((pool.try_allocate(l).expect("small blocks under the limit"), l));
    }
    // Fill to the limit with 4 KiB blocks: the pool never holds more than the limit, and
    // the failure names a request that the limit really refuses.
    let l = layout(4096, 8);
    let err = loop {
        match pool.try_allocate(l) {
            Ok(p) => held.push((p, l)),
            Err(e) => break e,
        }
    };
    assert!(pool.stats().source_bytes <= LIMIT);
    match err {
        Error::LimitExceeded {
            requested,
            held,
            limit,
        } => {
            assert_eq!(limit, LIMIT);
            assert!(requested + held > limit);
            assert!(
                requested < 2 << 20,
                "names this request's need, not a 2 MiB chunk: {requested}"
            );
        }
        e => panic!("expected LimitExceeded, got {e:?}"),
    }
    for (p, l) in held {
        // SAFETY: allocated above with this layout.
        unsafe { pool.deallocate(p.cast(), l) };
    }
}

// ---- item 7 ---------------------------------------------------------------------------

/// Without a driver the fallback ignored the pinned cap: after `PinnedAlloc::set_limit(
/// Some(0))` a 64 MiB `Vec<u8, PinnedAlloc>` succeeded. The fallback keeps the cap (and
/// with a driver the pools do), so the same assertions hold on every machine. Runs in a
/// child process: the cap is process-wide.
#[test]
fn defect_21_07_the_pinned_cap_holds_with_and_without_a_driver() {
    use cudalloc::PinnedAlloc;
    if crate::support::in_a_child_process(
        "defects_21::defect_21_07_the_pinned_cap_holds_with_and_without_a_driver",
    ) {
        return;
    }
    PinnedAlloc::set_limit(Some(0));
    let mut v: Vec<u8, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    assert!(v.try_reserve_exact(64 << 20).is_err(), "a cap of 0 pins nothing");
    PinnedAlloc::set_limit(Some(100 << 20));
    v.try_reserve_exact(64 << 20).expect("64 MiB under a 100 MiB cap");
    let mut w: Vec<u8, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    assert!(
        w.try_reserve_exact(64 << 20).is_err(),
        "128 MiB held would pass the cap"
    );
    drop(v);
    PinnedAlloc::trim();
    w.try_reserve_exact(64 << 20)
        .expect("room again once the first is freed");
}

// ---- item 8 (and issue 22 item 2) -----------------------------------------------------

/// `Pool::stats()` read the thread caches' counts and the handed-out counts at different
/// moments: read while another thread moved blocks between its cache and the shared lists,
/// `live_blocks` wrapped to near 2^64 ("16384.0 PiB live"), and read right after scoped
/// threads ended (their caches are flushed by thread-local destructors, which may run
/// after `thread::scope` returns) it counted a flushing cache's blocks as live: the soak's
/// "4 live and 0 pending blocks at the end".
#[test]
fn defect_21_08_stats_read_during_cache_moves_are_consistent() {
    const WORKERS: usize = 3;
    const HOLD: usize = 48;
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default()
            .with_thread_cache_capacity(8)
            .with_pending_wait(None),
    );
    let l = layout(64, 8);
    let mut wrong = std::vec::Vec::new();
    let started = std::time::Instant::now();
    let mut rounds = 0;
    while rounds < 40 || (started.elapsed() < Duration::from_secs(2) && wrong.is_empty()) {
        rounds += 1;
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..WORKERS {
                s.spawn(|| {
                    let mut held = std::vec::Vec::with_capacity(HOLD);
                    for _ in 0..50 {
                        held.extend((0..HOLD).map(|_| pool.allocate(l).unwrap()));
                        for p in held.drain(..) {
                            // SAFETY: allocated just above with this layout.
                            unsafe { pool.deallocate(p.cast(), l) };
                        }
                    }
                    // Ends with blocks in its cache: flushed by its thread-local destructor.
                });
            }
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let st = pool.stats();
                    assert!(
                        st.live_blocks <= WORKERS * HOLD,
                        "live_blocks {} while at most {} are live",
                        st.live_blocks,
                        WORKERS * HOLD
                    );
                }
            });
            std::thread::sleep(Duration::from_millis(5));
            stop.store(true, Ordering::Relaxed);
        });
        // Every block was freed: none is live, whether or not the workers' caches have
        // been flushed yet.
        let st = pool.stats();
        if st.live_blocks != 0 {
            wrong.push((rounds, st.live_blocks));
        }
    }
    assert!(
        wrong.is_empty(),
        "live blocks after every block was freed (round, live): {wrong:?}"
    );
}

// ---- item 10 --------------------------------------------------------------------------

/// `Pool::record_fence` on memory that was freed returned `Ok(true)`, though the block
/// was handed out again at once; a use recorded after the free protects nothing, and the
/// docs say memory in no block gets `InvalidArgument`.
#[test]
fn defect_21_10_recording_on_a_freed_block_is_refused() {
    let done = || Flag(Arc::new(AtomicBool::new(false)));
    // Through this thread's cache, through the shared lists (no cache), and large blocks.
    for cache in [64, 0] {
        let pool = Pool::with_config(
            HostSource,
            PoolConfig::default()
                .with_thread_cache_capacity(cache)
                .with_pending_wait(None),
        );
        for size in [64, 4096, 1 << 20] {
            let l = layout(size, 8);
            let p = pool.allocate(l).unwrap();
            let keep = pool.allocate(l).unwrap(); // so the memory stays the pool's
                                                  // SAFETY: allocated above with this layout, not used after.
            unsafe { pool.deallocate(p.cast(), l) };
            let got = pool.record_fence(p.as_ptr() as *const u8, done());
            assert!(
                matches!(got, Err(cudalloc::Error::InvalidArgument(_))),
                "size {size}, cache {cache}: {got:?}"
            );
            assert!(matches!(
                cudalloc::record_fence(p.as_ptr() as *const u8, done()),
                Err(cudalloc::Error::InvalidArgument(_))
            ));
            assert_eq!(pool.stats().pending_blocks, 0);
            // A live block still takes the record.
            assert!(pool
                .record_fence(keep.as_ptr() as *const u8, Flag(Arc::new(AtomicBool::new(true))))
                .unwrap());
            // SAFETY: allocated above with this layout.
            unsafe { pool.deallocate(keep.cast(), l) };
        }
    }
}

// ---- issue 22 item 4 ------------------------------------------------------------------

/// A fence that never completes.
struct Never;

// SAFETY: it never reports completion.
unsafe impl cudalloc::fence::Fence for Never {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        Ok(false)
    }
}

/// A `Pool` dropped while a freed block waits for a fence that never completes spun
/// forever. The drop ends after the pool's pending wait, leaks that memory on purpose and
/// counts it. (In a child process with a driver: it makes `drop_errors` grow.)
#[test]
fn defect_22_04_a_pool_dropped_with_a_fence_that_never_completes_ends() {
    if crate::support::in_a_child_process_with_a_driver(
        "defects_21::defect_22_04_a_pool_dropped_with_a_fence_that_never_completes_ends",
    ) {
        return;
    }
    let before = cudalloc::cuda::drop_errors();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let pool = Pool::with_config(
            HostSource,
            PoolConfig::default().with_pending_wait(Some(Duration::from_millis(50))),
        );
        let l = layout(4096, 8);
        let p = pool.allocate(l).unwrap();
        assert!(pool.record_fence(p.as_ptr() as *const u8, Never).unwrap());
        // SAFETY: allocated above with this layout, not used after.
        unsafe { pool.deallocate(p.cast(), l) };
        drop(pool);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the drop ends (it waited forever before)");
    assert!(cudalloc::cuda::drop_errors() > before, "the leak is counted");
}

/// An `Arena` dropped while its memory waits for a fence that never completes waited
/// forever. The drop ends after its `drop_wait`, gives the memory up on purpose (counted
/// in `abandoned_bytes` before the drop's end and in `drop_errors`).
#[test]
fn defect_22_04_an_arena_dropped_with_a_fence_that_never_completes_ends() {
    if crate::support::in_a_child_process_with_a_driver(
        "defects_21::defect_22_04_an_arena_dropped_with_a_fence_that_never_completes_ends",
    ) {
        return;
    }
    let before = cudalloc::cuda::drop_errors();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let arena = cudalloc::arena::Arena::with_config(
            HostSource,
            cudalloc::arena::ArenaConfig::host().with_drop_wait(Duration::from_millis(50)),
        );
        let v: Vec<u8, _> = Vec::with_capacity_in(4096, &arena);
        assert!(cudalloc::fence::record_fence(v.as_ptr(), Never).unwrap());
        drop(v);
        drop(arena);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the drop ends (it waited forever before)");
    assert!(cudalloc::cuda::drop_errors() > before, "the leak is counted");
}
