//! The page heap's cross-stream reuse (`Backing::PhysicalPages`): a block freed on stream
//! S, while S's work on it waits behind a gate, serves a block of stream T at once (its
//! memory stays mapped), and T's work waits for S's.

use cudalloc::device::{Backing, DevicePool, DevicePoolConfig};

use crate::gpu_support::{late_write, mismatches, written_and_freed_behind_a_gate};

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
