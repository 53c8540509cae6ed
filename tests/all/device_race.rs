//! Cross-stream reuse races, with the device pool's events and (under the `test-hooks`
//! feature) without them as negative controls. Each test queues ~20 ms of delay ahead of
//! the copy that uses the old block, so that without the event the new owner's write
//! lands first: with nothing queued ahead, the DMA outruns the host and no race shows.

use cudalloc::cuda::{copy_async, Stream};
use cudalloc::device::{DevicePool, DevicePoolConfig};

use crate::device::{delay, mismatches, stream};

const N: usize = 64 << 20;

fn pool(thread_cache: bool) -> DevicePool {
    DevicePool::new(
        0,
        DevicePoolConfig {
            thread_cache_bytes: if thread_cache { 256 << 20 } else { 0 },
            ..Default::default()
        },
    )
    .unwrap()
}

/// A block written on S behind a delay, freed, then taken by T and written there: returns
/// the bytes of T's data that S's late write destroyed.
fn steal_race(pool: &DevicePool, guard: bool) -> usize {
    #[cfg(feature = "test-hooks")]
    pool.set_event_guard(guard);
    #[cfg(not(feature = "test-hooks"))]
    assert!(guard, "the negative control needs the test-hooks feature");
    let (s, t) = (stream(), stream());
    let a = pool.from_host(&vec![0xAAu8; N], &s).unwrap();
    let mut x = pool.alloc::<u8>(N, &s).unwrap();
    delay(&s, 20);
    x.copy_from_device(&a).unwrap(); // lands on x's block 20 ms from now
    let old = x.device_ptr();
    drop(x);
    let mut y = pool.alloc::<u8>(N, &t).unwrap();
    assert_eq!(
        y.device_ptr(),
        old,
        "T must take S's block for the test to mean anything"
    );
    y.copy_from_host(&vec![0xBBu8; N]).unwrap();
    s.synchronize().unwrap();
    let bad = mismatches(&y.to_vec().unwrap(), 0xBB);
    let st = pool.stats();
    println!(
        "cross-stream take (event {}): {bad} of {N} bytes corrupted; {} takes, {} events",
        if guard { "on" } else { "off" },
        st.steals,
        st.events
    );
    bad
}

#[test]
fn a_block_freed_on_one_stream_is_taken_by_another_only_after_its_work() {
    gpu!();
    for thread_cache in [true, false] {
        let pool = pool(thread_cache);
        assert_eq!(steal_race(&pool, true), 0, "thread cache: {thread_cache}");
        assert_eq!(pool.stats().steals, 1);
        assert_eq!(
            pool.stats().events,
            1,
            "one event for the take, none for the frees"
        );
    }
}

#[cfg(feature = "test-hooks")]
#[test]
fn without_the_event_a_taken_block_is_corrupted() {
    gpu!();
    for thread_cache in [true, false] {
        let pool = pool(thread_cache);
        let bad = steal_race(&pool, false);
        assert!(
            bad > 0,
            "negative control: no corruption without the event (thread cache: {thread_cache})"
        );
    }
}

/// A block read on T behind a delay (declared with `record_use` when `declare`), freed on
/// S, then reused on S and overwritten: returns the bytes T read wrong.
fn record_use_race(pool: &DevicePool, guard: bool) -> (usize, bool) {
    #[cfg(feature = "test-hooks")]
    pool.set_event_guard(guard);
    #[cfg(not(feature = "test-hooks"))]
    assert!(guard, "the negative control needs the test-hooks feature");
    let (s, t) = (stream(), stream());
    let mut x = pool.from_host(&vec![0xAAu8; N], &s).unwrap();
    let z = pool.alloc::<u8>(N, &t).unwrap();
    delay(&t, 20);
    // SAFETY: both are N-byte blocks of device 0; `x` is declared used on `t` below, so
    // its block is not reused before this copy (with the guard on); `z` lives on `t`.
    unsafe { copy_async(z.device_ptr(), 0, x.device_ptr(), 0, N, &t) }.unwrap();
    x.record_use(&t);
    let old = x.device_ptr();
    drop(x);
    let pending = pool.stats().pending_blocks;
    let mut w = pool.alloc::<u8>(N, &s).unwrap();
    let reused = w.device_ptr() == old;
    w.copy_from_host(&vec![0xBBu8; N]).unwrap();
    t.synchronize().unwrap();
    let bad = mismatches(&z.to_vec().unwrap(), 0xAA);
    println!(
        "record_use (event {}): block pending after the free: {pending}, reused at once: {reused}, {bad} of {N} bytes read wrong",
        if guard { "on" } else { "off" }
    );
    (bad, reused)
}

#[test]
fn a_block_used_on_another_stream_is_reused_after_that_work() {
    gpu!();
    let pool = pool(true);
    let (bad, reused) = record_use_race(&pool, true);
    assert_eq!(bad, 0);
    assert!(!reused, "the block waited for the other stream");
    // Once the use completed, the next miss moves the block back to its stream's list.
    let st = pool.stats();
    assert_eq!(st.pending_blocks, 1, "stats() has no side effect: {st:?}");
    let s = stream();
    drop(pool.alloc::<u8>(4096, &s).unwrap());
    assert_eq!(pool.stats().pending_blocks, 0);
}

#[cfg(feature = "test-hooks")]
#[test]
fn without_the_event_a_block_used_on_another_stream_is_corrupted() {
    gpu!();
    let pool = pool(true);
    let (bad, reused) = record_use_race(&pool, false);
    assert!(reused);
    assert!(bad > 0, "negative control: no corruption without the event");
}

#[test]
fn a_device_copy_orders_both_streams() {
    gpu!();
    // dst on T copies from src on S behind a delay; src is dropped at once and its block
    // reused on S and overwritten: the copy must still read the old contents.
    let pool = pool(true);
    let (s, t) = (stream(), stream());
    let src = pool.from_host(&vec![0xAAu8; N], &s).unwrap();
    let mut dst = pool.alloc::<u8>(N, &t).unwrap();
    delay(&t, 20);
    dst.copy_from_device(&src).unwrap();
    let old = src.device_ptr();
    drop(src);
    let mut w = pool.alloc::<u8>(N, &s).unwrap();
    assert_eq!(w.device_ptr(), old, "S reuses src's block at once");
    w.copy_from_host(&vec![0xBBu8; N]).unwrap(); // S waits for the copy first
    let bad = mismatches(&dst.to_vec().unwrap(), 0xAA);
    println!("copy_from_device across streams: {bad} of {N} bytes read wrong");
    assert_eq!(bad, 0);
}

#[test]
fn a_borrowed_stream_handle_is_kept_alive_by_the_cache() {
    gpu!();
    // A stream dropped by its user while the cache holds its blocks stays alive until
    // trim: taking its block from another stream records an event on it.
    let errors = cudalloc::cuda::drop_errors();
    let pool = pool(false);
    let s = Stream::new(0).unwrap();
    let x = pool.alloc::<u8>(1 << 20, &s).unwrap();
    let old = x.device_ptr();
    drop(x);
    drop(s);
    let t = stream();
    let y = pool.alloc::<u8>(1 << 20, &t).unwrap();
    assert_eq!(y.device_ptr(), old);
    assert_eq!(pool.stats().events, 1);
    drop(y);
    pool.trim();
    assert_eq!(cudalloc::cuda::drop_errors(), errors);
}
