//! The page heap's cross-stream reuse (`Backing::PhysicalPages`): a block freed on stream
//! S, while S's work on it waits behind a gate, serves a block of stream T at once (its
//! memory stays mapped), and T's work waits for S's.

use cudalloc::device::{Backing, DevicePool, DevicePoolConfig, PageTuning};

use crate::device_race::{heap_counter, set_guard};
use crate::gpu_support::{fill, late_write, mismatches, stream, written_and_freed_behind_a_gate, Gate};

const N: usize = 64 << 20;

#[test]
fn a_page_freed_on_one_stream_serves_another_only_after_its_work() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    // No cache: every allocation and free goes to the page heap.
    let pool = DevicePool::new(
        0,
        DevicePoolConfig::default()
            .with_cache(false)
            .with_backing(Backing::PhysicalPages),
    )
    .unwrap();
    let (s, t, gate, old) = written_and_freed_behind_a_gate(&pool, N);
    let reserved = pool.stats().reserved_bytes;
    let y = pool.alloc::<u8>(N, &t).unwrap();
    assert_eq!(
        y.device_ptr(),
        old,
        "T's block takes S's freed memory at once (still mapped), ordered on the GPU"
    );
    assert_eq!(
        pool.stats().reserved_bytes,
        reserved,
        "T's block must be mapped from S's handle for the test to mean anything"
    );
    // SAFETY: y's block, written on its own stream.
    let ran_ahead = unsafe { late_write(y.device_ptr(), N, &t, &gate, &s) };
    let bad = mismatches(&y.to_vec().unwrap(), 0xBB);
    println!("pages: T finished before S's late write: {ran_ahead}; {bad} of {N} bytes corrupted");
    assert!(!ran_ahead, "T waited for S's work");
    assert_eq!(bad, 0);
    drop(y);
    pool.trim();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// Issue 23's groups on the H200: a cold 256 MiB block on a fresh default pool (pages,
/// 16 MiB chunks) is one handle, one map and one access call (not 16 of each), its
/// memory reads back what was written, and a trim gives it all back.
#[test]
fn a_cold_256_mib_block_on_a_fresh_default_pool_is_one_group() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    const BIG: usize = 256 << 20;
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let Some(before) = cudalloc::testing::page_heap_counters(&pool) else {
        println!("skipped: the device has no virtual memory management (the default pool is not on pages)");
        return;
    };
    assert!(before.contains("group_creates: 0,"), "{before}");
    let s = crate::gpu_support::stream();
    let mut x = pool.alloc::<u8>(BIG, &s).unwrap();
    let counters = cudalloc::testing::page_heap_counters(&pool).unwrap();
    println!("page heap after a cold 256 MiB block: {counters}");
    for want in [
        ", creates: 1,",
        ", group_creates: 1,",
        ", maps: 1,",
        ", accesses: 1,",
    ] {
        assert!(counters.contains(want), "{want} in {counters}");
    }
    let data: std::vec::Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
    x.copy_from_host(&data).unwrap();
    let back = x.to_vec().unwrap();
    let bad = back.iter().zip(&data).filter(|(a, b)| a != b).count();
    assert_eq!(bad, 0, "bytes read back differ");
    drop(x);
    s.synchronize().unwrap();
    pool.trim();
    assert_eq!(pool.stats().reserved_bytes, 0);
    let after = cudalloc::testing::page_heap_counters(&pool).unwrap();
    assert!(after.contains("group_releases: 1,"), "{after}");
}

/// What [`moved_chunk_race`] saw.
struct Moved {
    /// T's write finished before S's late writes were let go.
    ran_ahead: bool,
    /// Bytes of T's block that ended up wrong.
    bad: usize,
    /// Handles T's block took from S's idle chunks (maps less creates).
    moves: u64,
    /// Bytes of one chunk.
    chunk: usize,
}

/// An idle chunk moved while its work is pending (`reclaim.rs`: mapped anew at once, its
/// old mapping retired until the work completes, the new user ordered after it). On a
/// page-backed pool with no cache, one handle per chunk and an idle allowance of its
/// floor (4 chunks): S writes 0xAA into six one-chunk blocks behind a closed gate and
/// frees them; a live block after them keeps T's 8-chunk block out of their free run, so
/// T's block is mapped at fresh addresses and, six idle chunks being over the allowance,
/// takes two of their handles. T then writes 0xBB. Without the ordering S's late writes
/// land in T's block through the physical memory both mappings share.
fn moved_chunk_race(guard: bool) -> Moved {
    let pool = DevicePool::new(
        0,
        DevicePoolConfig::default()
            .with_cache(false)
            .with_backing(Backing::PhysicalPages)
            .with_pages(PageTuning::new(2 << 20, u32::MAX)),
    )
    .unwrap();
    set_guard(&pool, guard);
    let (s, t) = (stream(), stream());
    let first = pool.alloc::<u8>(2 << 20, &s).unwrap();
    let chunk = pool.stats().reserved_bytes as usize;
    let mut freed = vec![first];
    freed.extend((1..6).map(|_| pool.alloc::<u8>(chunk, &s).unwrap()));
    let fence = pool.alloc::<u8>(chunk, &s).unwrap();
    for (i, b) in freed.iter().chain([&fence]).enumerate() {
        assert_eq!(
            b.device_ptr(),
            freed[0].device_ptr() + (i * chunk) as u64,
            "S's blocks are side by side, the live one last"
        );
    }
    let gate = Gate::hold(&s);
    for b in &freed {
        // SAFETY: b's block, written on its own stream; the pool frees it in S's order.
        unsafe { fill(b.device_ptr(), 0xAA, chunk, &s) };
    }
    drop(freed);
    let counts = || {
        let c = |name| heap_counter(&pool, name).expect("a page heap");
        c("maps") - c("creates")
    };
    let before = counts();
    let n = 8 * chunk;
    let y = pool.alloc::<u8>(n, &t).unwrap();
    let moves = counts() - before;
    assert!(
        y.device_ptr() > fence.device_ptr(),
        "T's block is mapped past the live block"
    );
    // SAFETY: y's block, written on its own stream.
    let ran_ahead = unsafe { late_write(y.device_ptr(), n, &t, &gate, &s) };
    let bad = mismatches(&y.to_vec().unwrap(), 0xBB);
    println!(
        "moved chunk (ordering {}): {moves} handles moved, T finished before S's late writes: \
         {ran_ahead}; {bad} of {n} bytes corrupted; page heap {}",
        if guard { "on" } else { "off" },
        cudalloc::testing::page_heap_counters(&pool).unwrap_or_default()
    );
    drop((y, fence));
    pool.trim();
    assert_eq!(pool.stats().reserved_bytes, 0, "trim gave everything back");
    Moved {
        ran_ahead,
        bad,
        moves,
        chunk,
    }
}

#[test]
fn a_chunk_moved_while_its_work_is_pending_is_used_only_after_that_work() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    let m = moved_chunk_race(true);
    assert!(
        m.moves >= 1,
        "T's block must take a moved handle of {} bytes for the test to mean anything",
        m.chunk
    );
    assert!(!m.ran_ahead, "T waited for S's work");
    assert_eq!(m.bad, 0);
}

#[cfg(feature = "test-hooks")]
#[test]
fn without_the_heap_ordering_a_moved_chunk_is_corrupted() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    let m = moved_chunk_race(false);
    assert!(m.moves >= 1, "a handle moved");
    assert!(m.ran_ahead, "nothing held T");
    assert_eq!(
        m.bad as u64,
        m.moves * m.chunk as u64,
        "negative control: every moved chunk's bytes corrupted, no other"
    );
}
