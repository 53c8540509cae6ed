//! Cross-stream reuse races, with the device pool's events and (under the `test-hooks`
//! feature) without them as negative controls.
//!
//! Every recipe is two device operations on two streams that nothing orders but the
//! pool's events: the late access queued behind a closed [`Gate`] on one stream, the
//! conflicting write (`cuMemsetD8Async`) on the other. The test lets the other stream run
//! for a while, then opens the gate. Without the event the write runs at once and the late
//! access lands after it: every byte is corrupted. With the event the other stream cannot
//! run until the gate opens (the test checks that it did not), and no byte is. Nothing
//! depends on timing, and nothing copies from pageable host memory, which the driver may
//! serialize with other streams (that hid the races in the first version of these tests).

use cudalloc::cuda::{copy_async, Stream};
use cudalloc::device::{DevicePool, DevicePoolConfig};

use crate::gpu_support::written_and_freed_behind_a_gate;
use crate::gpu_support::{fill, finishes_within, late_write, mismatches, stream, Gate, RUN_FOR};

/// A block the cache keeps by size class (below the page heap's threshold).
const N: usize = 1 << 20;
/// A large block: on the page heap where the device has one, kept in the thread's large
/// slots for its size, ordered across streams by the heap.
const LARGE: usize = 64 << 20;

fn pool(thread_cache: bool) -> DevicePool {
    DevicePool::new(
        0,
        DevicePoolConfig::default().with_thread_cache_bytes(if thread_cache { 256 << 20 } else { 0 }),
    )
    .unwrap()
}

pub(crate) fn set_guard(pool: &DevicePool, guard: bool) {
    #[cfg(feature = "test-hooks")]
    pool.set_event_guard(guard);
    #[cfg(not(feature = "test-hooks"))]
    assert!(
        guard,
        "the negative control needs the test-hooks feature: {pool:?}"
    );
}

/// What a race recipe saw.
struct Race {
    /// Bytes that ended up wrong.
    bad: usize,
    /// Whether the stream of the conflicting write finished before the gate opened.
    ran_ahead: bool,
}

/// S writes 0xAA into its block behind a gate and frees it; T takes the block and writes
/// 0xBB. T's data is corrupted if S's late write lands after it.
fn steal_race(pool: &DevicePool, guard: bool) -> Race {
    steal_race_of(pool, guard, N)
}

/// [`steal_race`] with blocks of `n` bytes.
fn steal_race_of(pool: &DevicePool, guard: bool, n: usize) -> Race {
    set_guard(pool, guard);
    let (s, t, gate, old) = written_and_freed_behind_a_gate(pool, n);
    let y = pool.alloc::<u8>(n, &t).unwrap();
    assert_eq!(
        y.device_ptr(),
        old,
        "T must take S's block for the test to mean anything"
    );
    // SAFETY: y's block, written on its own stream.
    let ran_ahead = unsafe { late_write(y.device_ptr(), n, &t, &gate, &s) };
    let bad = mismatches(&y.to_vec().unwrap(), 0xBB);
    let st = pool.stats();
    println!(
        "cross-stream take (event {}): T finished before S's late write: {ran_ahead}; {bad} of {n} \
         bytes corrupted; {} takes, {} events",
        if guard { "on" } else { "off" },
        st.steals,
        st.events
    );
    Race { bad, ran_ahead }
}

#[test]
fn a_block_freed_on_one_stream_is_taken_by_another_only_after_its_work() {
    gpu!();
    let _one = crate::one_at_a_time();
    for thread_cache in [true, false] {
        let pool = pool(thread_cache);
        let race = steal_race(&pool, true);
        assert!(
            !race.ran_ahead,
            "T waited for S's work (thread cache: {thread_cache})"
        );
        assert_eq!(race.bad, 0, "thread cache: {thread_cache}");
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
    let _one = crate::one_at_a_time();
    for thread_cache in [true, false] {
        let pool = pool(thread_cache);
        let race = steal_race(&pool, false);
        assert!(race.ran_ahead, "nothing held T (thread cache: {thread_cache})");
        assert_eq!(
            race.bad, N,
            "negative control: every byte corrupted (thread cache: {thread_cache})"
        );
    }
}

/// S's block x holds 0xAA; T copies it into z behind a gate (declared with `record_use`);
/// x is freed and the next allocation on S writes 0xBB into what it gets. T reads wrong
/// bytes if it is x's block and S's write lands first. Also returns whether the block was
/// gated after the free and whether S reused it at once.
fn record_use_race(pool: &DevicePool, guard: bool) -> (Race, u64, bool) {
    record_use_race_of(pool, guard, N)
}

/// [`record_use_race`] with blocks of `n` bytes.
fn record_use_race_of(pool: &DevicePool, guard: bool, n: usize) -> (Race, u64, bool) {
    set_guard(pool, guard);
    let (s, t) = (stream(), stream());
    let mut x = pool.alloc::<u8>(n, &s).unwrap();
    // SAFETY: x's block, on its own stream.
    unsafe { fill(x.device_ptr(), 0xAA, n, &s) };
    s.synchronize().unwrap(); // T reads x after this
    let z = pool.alloc::<u8>(n, &t).unwrap();
    let gate = Gate::hold(&t);
    // SAFETY: both are N-byte blocks of device 0; `x` is declared used on `t` below, so
    // its block is not reused before this copy (with the guard on); `z` lives on `t`.
    unsafe { copy_async(z.device_ptr(), 0, x.device_ptr(), 0, n, &t) }.unwrap();
    x.record_use(&t);
    let old = x.device_ptr();
    drop(x);
    let pending = pool.stats().pending_blocks;
    let w = pool.alloc::<u8>(n, &s).unwrap();
    let reused = w.device_ptr() == old;
    // SAFETY: w's block, on its own stream.
    let ran_ahead = unsafe { late_write(w.device_ptr(), n, &s, &gate, &t) };
    let bad = mismatches(&z.to_vec().unwrap(), 0xAA);
    println!(
        "record_use (event {}): block pending after the free: {pending}, reused at once: {reused}, \
         S finished before T's read: {ran_ahead}; {bad} of {n} bytes read wrong",
        if guard { "on" } else { "off" }
    );
    (Race { bad, ran_ahead }, pending, reused)
}

#[test]
fn a_block_used_on_another_stream_is_reused_after_that_work() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = pool(true);
    let (race, pending, reused) = record_use_race(&pool, true);
    // T's read is held by the gate, so its event cannot have completed at the allocation:
    // the block must still be waiting, and S gets another one.
    assert_eq!(pending, 1, "the freed block waits for T");
    assert!(!reused, "the block waited for the other stream");
    assert_eq!(race.bad, 0);
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
    let _one = crate::one_at_a_time();
    let pool = pool(true);
    let (race, pending, reused) = record_use_race(&pool, false);
    assert_eq!(pending, 0);
    assert!(reused);
    assert!(race.ran_ahead, "nothing held S");
    assert_eq!(race.bad, N, "negative control: every byte read wrong");
}

#[test]
fn a_device_copy_orders_both_streams() {
    gpu!();
    let _one = crate::one_at_a_time();
    // dst on T copies from src on S behind a gate; src is dropped at once and its block
    // reused on S and overwritten: S must wait for the copy, which reads the old contents.
    let pool = pool(true);
    let (s, t) = (stream(), stream());
    let src = pool.alloc::<u8>(N, &s).unwrap();
    // SAFETY: src's block, on its own stream.
    unsafe { fill(src.device_ptr(), 0xAA, N, &s) };
    let mut dst = pool.alloc::<u8>(N, &t).unwrap();
    let gate = Gate::hold(&t);
    dst.copy_from_device(&src).unwrap();
    let old = src.device_ptr();
    drop(src);
    let w = pool.alloc::<u8>(N, &s).unwrap();
    assert_eq!(w.device_ptr(), old, "S reuses src's block at once");
    // SAFETY: w's block, on its own stream (which waits for the copy first).
    unsafe { fill(w.device_ptr(), 0xBB, N, &s) };
    let ran_ahead = finishes_within(&s, RUN_FOR);
    gate.open();
    let bad = mismatches(&dst.to_vec().unwrap(), 0xAA);
    s.synchronize().unwrap();
    println!("copy_from_device across streams: S finished before the copy: {ran_ahead}; {bad} of {N} bytes read wrong");
    assert!(!ran_ahead, "S waited for the copy");
    assert_eq!(bad, 0);
}

#[test]
fn a_borrowed_stream_handle_is_kept_alive_by_the_cache() {
    gpu!();
    let _one = crate::one_at_a_time();
    // A stream dropped by its user while the cache holds its blocks stays alive until
    // trim: taking its block from another stream records an event on it (on a destroyed
    // stream that would fail, and the take would allocate anew and count a failure).
    let pool = pool(false);
    let s = Stream::new(0).unwrap();
    let x = pool.alloc::<u8>(1 << 20, &s).unwrap();
    let old = x.device_ptr();
    drop(x);
    drop(s);
    let t = stream();
    let y = pool.alloc::<u8>(1 << 20, &t).unwrap();
    assert_eq!(y.device_ptr(), old);
    let st = pool.stats();
    assert_eq!((st.steals, st.events, st.failures), (1, 1, 0), "{st:?}");
    drop(y);
    pool.trim();
    let st = pool.stats();
    assert_eq!(
        (st.held_bytes, st.failures, st.abandoned_bytes),
        (0, 0, 0),
        "{st:?}"
    );
    assert!(
        st.per_stream.is_empty(),
        "trim dropped the stream handles: {st:?}"
    );
}

/// The page heap's counter `name` (`marks`, `waits`) of `pool`, if it has a heap.
pub(crate) fn heap_counter(pool: &DevicePool, name: &str) -> Option<u64> {
    let c = cudalloc::testing::page_heap_counters(pool)?;
    let at = c.find(&format!("{name}: "))? + name.len() + 2;
    c[at..]
        .split(|ch: char| !ch.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_large_block_freed_on_one_stream_is_taken_by_another_only_after_its_work() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    for thread_cache in [true, false] {
        let pool = pool(thread_cache);
        let race = steal_race_of(&pool, true, LARGE);
        assert!(
            !race.ran_ahead,
            "T waited for S's work (thread cache: {thread_cache})"
        );
        assert_eq!(race.bad, 0, "thread cache: {thread_cache}");
        if heap_counter(&pool, "marks").is_some() {
            // S's work was pending when T took the memory: one mark on S, one wait on T,
            // and none at the free.
            assert_eq!(
                heap_counter(&pool, "marks"),
                Some(1),
                "thread cache: {thread_cache}"
            );
            assert_eq!(
                heap_counter(&pool, "waits"),
                Some(1),
                "thread cache: {thread_cache}"
            );
        }
    }
}

#[cfg(feature = "test-hooks")]
#[test]
fn without_the_heap_ordering_a_taken_large_block_is_corrupted() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    for thread_cache in [true, false] {
        let pool = pool(thread_cache);
        let race = steal_race_of(&pool, false, LARGE);
        assert!(race.ran_ahead, "nothing held T (thread cache: {thread_cache})");
        assert_eq!(
            race.bad, LARGE,
            "negative control: every byte corrupted (thread cache: {thread_cache})"
        );
    }
}

#[test]
fn a_large_block_used_on_another_stream_is_reused_after_that_work() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    let pool = pool(true);
    let (race, _, _) = record_use_race_of(&pool, true, LARGE);
    assert!(!race.ran_ahead, "S waited for T's read");
    assert_eq!(race.bad, 0);
}

#[cfg(feature = "test-hooks")]
#[test]
fn without_the_event_a_large_block_used_on_another_stream_is_corrupted() {
    gpu!();
    backings_in_use!();
    let _one = crate::one_at_a_time();
    let pool = pool(true);
    let (race, _, reused) = record_use_race_of(&pool, false, LARGE);
    assert!(reused, "S took the block at once");
    assert!(race.ran_ahead, "nothing held S");
    assert_eq!(race.bad, LARGE, "negative control: every byte read wrong");
}
