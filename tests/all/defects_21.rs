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
    fn kind(&self) -> cudalloc::source::MemoryKind {
        cudalloc::source::MemoryKind::Pageable
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
