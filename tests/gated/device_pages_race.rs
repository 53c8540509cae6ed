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
