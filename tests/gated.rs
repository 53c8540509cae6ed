//! GPU tests that hold a stream with a host function (a gate) while they queue work
//! behind it and check what the crate does meanwhile. They run in their own test binary,
//! one at a time (`GATED`): a synchronizing CUDA call elsewhere in the process
//! (`cuMemFreeHost` waits for the whole device) would wait for the gate while the test's
//! own CUDA calls wait for that call. Each gate is also released by a timer thread after
//! 10 s at the latest, so a test can fail but never hang.

#[macro_use]
#[path = "all/support.rs"]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use allocator_api2::vec::Vec;
use cudalloc::arena::Arena;
use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::PinnedSource;
use cudalloc::testing::DeviceMemory;
use cudalloc::{copy, PinnedAlloc};
use support::assert_balanced;

const MIB: usize = 1 << 20;

#[cfg(feature = "cudarc")]
#[path = "gated/cudarc.rs"]
mod cudarc;
#[path = "gated/device_arena.rs"]
mod device_arena;
#[path = "gated/device_input.rs"]
mod device_input;
#[path = "gated/device_multi.rs"]
mod device_multi;
#[path = "gated/device_pages_race.rs"]
mod device_pages_race;
#[path = "gated/device_race.rs"]
mod device_race;
#[path = "gated/futures.rs"]
mod futures;
#[path = "all/gpu_support.rs"]
mod gpu_support;
#[path = "gated/pool_async.rs"]
mod pool_async;
#[path = "gated/staging.rs"]
mod staging;
#[path = "gated/staging_threaded.rs"]
mod staging_threaded;

static GATED: Mutex<()> = Mutex::new(());

/// Runs one gated test at a time (a failed one does not poison the others).
fn one_at_a_time() -> MutexGuard<'static, ()> {
    GATED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A flag set by a timer thread once `signal` is set, or after 10 s at the latest.
fn gate_released_after(
    signal: &Arc<AtomicBool>,
    delay: Duration,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let release = Arc::new(AtomicBool::new(false));
    let (r, signal) = (release.clone(), signal.clone());
    let timer = std::thread::spawn(move || {
        let start = Instant::now();
        while !signal.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(delay);
        r.store(true, Ordering::Release);
    });
    (release, timer)
}

/// Holds `stream` with a host function until `release` is set.
fn hold(stream: &Stream, release: &Arc<AtomicBool>, done: Option<Arc<AtomicBool>>) {
    let r = release.clone();
    stream
        .launch_host_fn(move || {
            while !r.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            if let Some(d) = done {
                d.store(true, Ordering::Release);
            }
        })
        .unwrap();
}

/// Closes a gate on `stream`, runs `queue_copy_and_drop_source` (which queues a copy
/// behind it and drops the copy's pooled source), and returns `pool`'s pending blocks
/// counted while the gate was still closed.
fn pending_while_gated(
    stream: &Stream,
    pool: &Pool<PinnedSource>,
    queue_copy_and_drop_source: impl FnOnce(),
) -> usize {
    let checked = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&checked, Duration::ZERO);
    hold(stream, &release, None);
    queue_copy_and_drop_source();
    let pending = pool.stats().pending_blocks;
    let gate_was_closed = !release.load(Ordering::Acquire);
    checked.store(true, Ordering::Release);
    timer.join().unwrap();
    assert!(
        gate_was_closed,
        "the checks took 10 s: the gate opened before them"
    );
    pending
}

#[test]
fn stream_host_function_and_events_order_work() {
    gpu!();
    let _one = one_at_a_time();
    let stream = Stream::new(0).unwrap();
    let checked = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&checked, Duration::ZERO);
    hold(&stream, &release, Some(done.clone()));
    let event = stream.record_event().unwrap();
    let early = event.is_complete().unwrap();
    // Read after the query: the gate was closed all through it.
    let gate_was_closed = !release.load(Ordering::Acquire);
    checked.store(true, Ordering::Release);
    event.synchronize().unwrap();
    timer.join().unwrap();
    assert!(
        gate_was_closed,
        "the checks took 10 s: the gate opened before them"
    );
    assert!(!early, "event queued behind a held host function completed early");
    assert!(
        done.load(Ordering::Acquire),
        "the host function ran before the event completed"
    );
    assert!(event.is_complete().unwrap());
}

#[test]
fn copy_helpers_record_uses_and_round_trip() {
    gpu!();
    let _one = one_at_a_time();
    let stream = Stream::new(0).unwrap();
    let pool = Pool::new(PinnedSource::default());
    let mut src: Vec<u32, _> = Vec::new_in(&pool);
    src.extend(0..1 << 20);
    let mut dev = DevicePool::get(0)
        .unwrap()
        .alloc_zeroed::<u32>(1 << 20, &stream)
        .unwrap();
    let pending = pending_while_gated(&stream, &pool, || {
        // SAFETY: `src` is not written; dropping it early is what the pool protects.
        unsafe { copy::host_to_device_async(&src[1..], &mut dev, 1) }.unwrap();
        drop(src);
    });
    assert_eq!(pending, 1, "the freed block waits for the copy");
    let mut back: Vec<u32, _> = Vec::new_in(&pool);
    back.resize(1 << 20, 0);
    // SAFETY: `back` is not touched until the synchronize below.
    unsafe { copy::device_to_host_async(&dev, 0, &mut back) }.unwrap();
    stream.synchronize().unwrap();
    assert!(back[1..].iter().enumerate().all(|(i, &x)| x == i as u32 + 1));
    pool.collect_pending(); // stats() only reads
    assert_eq!(pool.stats().pending_blocks, 0);
    drop(back);
    pool.trim();
    assert_balanced(&pool.stats());
    assert_eq!(pool.stats().source_bytes, 0);
    // Memory from no pool needs no record.
    let plain = std::vec::Vec::from([0u8; 16]); // pageable heap memory
    assert!(!cudalloc::record_use(plain.as_ptr(), &stream).unwrap());
    // Memory of the process-wide pools is found.
    let pinned: Vec<u8, _> = Vec::with_capacity_in(64, PinnedAlloc);
    assert!(cudalloc::record_use(pinned.as_ptr(), &stream).unwrap());
    stream.synchronize().unwrap();
}

#[test]
fn arena_drop_waits_for_recorded_uses() {
    gpu!();
    let _one = one_at_a_time();
    let stream = Stream::new(0).unwrap();
    let arena = Arena::pinned();
    let mut dev = DeviceMemory::new(MIB, 0).unwrap();
    // The copy waits behind the gate until 50 ms after this thread starts dropping the
    // arena.
    let dropping = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&dropping, Duration::from_millis(50));
    {
        let mut v: Vec<u8, _> = Vec::with_capacity_in(MIB, &arena);
        v.resize(MIB, 1);
        hold(&stream, &release, None);
        // SAFETY: the arena's drop waits for the copy before freeing the memory.
        unsafe { dev.copy_from_host_async(0, &v, &stream) }.unwrap();
        assert!(arena.record_use(v.as_ptr(), &stream).unwrap());
        assert_eq!(arena.stats().pending_uses, 1);
    }
    let gate_was_closed = !release.load(Ordering::Acquire);
    dropping.store(true, Ordering::Release);
    drop(arena);
    assert!(
        release.load(Ordering::Acquire),
        "drop returned before the copy it had to wait for could run"
    );
    timer.join().unwrap();
    assert!(
        gate_was_closed,
        "queuing took 10 s: the gate opened before the drop"
    );
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

#[test]
fn device_buffer_async_copies_keep_a_pooled_source_from_reuse() {
    gpu!();
    let _one = one_at_a_time();
    let stream = Stream::new(0).unwrap();
    let pool = Pool::new(PinnedSource::default());
    let device = cudalloc::device::DevicePool::get(0).unwrap();
    let mut buf = device.alloc::<u32>(1 << 20, &stream).unwrap();
    let mut src: Vec<u32, _> = Vec::with_capacity_in(1 << 20, &pool);
    src.extend(0..1 << 20);
    let pending = pending_while_gated(&stream, &pool, || {
        // SAFETY: `src` is not written; dropping it early is what the pool protects.
        unsafe { buf.copy_from_host_async(&src) }.unwrap();
        drop(src);
    });
    assert_eq!(pending, 1, "the freed source waits for the copy");
    let back = buf.to_vec().unwrap();
    assert!(back.iter().enumerate().all(|(i, &x)| x == i as u32));
    pool.collect_pending(); // stats() only reads
    assert_eq!(pool.stats().pending_blocks, 0);
}

/// Issue 12, defect 9: recorded uses were keyed by the raw stream handle. A stream
/// destroyed while its copy is in flight can have its handle reused by a new stream; a use
/// recorded on the new stream then replaced the old one's, and the block was handed out
/// again once the new stream's work completed, while the old copy still read it. Uses are
/// keyed by a process-unique stream id now.
#[test]
fn defect_09_a_use_on_a_new_stream_never_replaces_one_on_a_destroyed_stream() {
    gpu!();
    under_a_sanitizer!("which serializes the device (the race cannot happen)");
    let _one = one_at_a_time();
    let pool = Pool::new(PinnedSource::default());
    let mut dev = DeviceMemory::new(MIB, 0).unwrap();
    let mut v: Vec<u8, _> = Vec::with_capacity_in(MIB, &pool);
    v.resize(MIB, 9);
    let checked = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&checked, Duration::ZERO);
    let old_raw = {
        let a = Stream::new(0).unwrap();
        hold(&a, &release, None);
        // SAFETY: `v` is not written until the copy completes (the block stays pending
        // after the drop below until then).
        unsafe { dev.copy_from_host_async(0, &v, &a) }.unwrap();
        a.as_raw()
    }; // `a` is destroyed with its copy still queued behind the gate
    let b = Stream::new(0).unwrap();
    let reused = b.as_raw() == old_raw;
    assert!(pool.record_use(v.as_ptr(), &b).unwrap());
    b.synchronize().unwrap(); // the new stream's use is complete
    drop(v);
    pool.collect_pending();
    let pending = pool.stats().pending_blocks;
    let gate_was_closed = !release.load(Ordering::Acquire);
    checked.store(true, Ordering::Release);
    timer.join().unwrap();
    println!(
        "defect 9: the new stream {} the destroyed stream's raw handle",
        if reused { "reused" } else { "did not reuse" }
    );
    assert!(
        gate_was_closed,
        "the checks took 10 s: the gate opened before them"
    );
    assert_eq!(
        pending, 1,
        "the block was released while a destroyed stream's copy still read it"
    );
    drop(dev); // synchronizes: the old copy is done
    assert_eq!(pool.collect_pending(), 1);
}

/// Issue 11, item 2 (backpressure), on the GPU: a pool capped at 256 MiB, 200 staging
/// rounds of 64 MiB, each copied to the device behind 20 ms of queued work and dropped at
/// once. The loop outruns the GPU (alone: with other tests in the process, their CUDA
/// calls paced it with the GPU, so it runs in this binary, one at a time); the pool must wait for the oldest copies instead of
/// failing (a `Vec` would abort the process): no `AllocError`, 0 corrupted bytes, never
/// more than the cap held.
#[test]
fn backpressure_staging_loop_outrunning_the_gpu_waits_instead_of_failing() {
    gpu!();
    let _one = one_at_a_time();
    const CAP: usize = 256 << 20;
    const ROUND: usize = 64 << 20;
    const ROUNDS: usize = 200;
    let stream = Stream::new(0).unwrap();
    let pool = Pool::with_config(PinnedSource::default(), PoolConfig::default().with_limit(CAP));
    let mut devs: std::vec::Vec<DeviceMemory> = (0..ROUNDS)
        .map(|_| DeviceMemory::new(ROUND, 0).unwrap())
        .collect();
    let fill = |round: usize| (round as u8).wrapping_mul(37) ^ 0x5A;
    let mut peak = 0;
    // Grow the pool to its cap before the loop: growing calls cuMemHostAlloc, which may
    // wait for the device, pacing the loop with the GPU so that nothing is ever pending
    // when the cap is reached (seen on the H200: 0 waits, 128 MiB held at most).
    let warm: std::vec::Vec<Vec<u8, _>> = (0..CAP / ROUND)
        .map(|_| {
            let mut v = Vec::new_in(&pool);
            v.try_reserve_exact(ROUND).unwrap();
            v
        })
        .collect();
    drop(warm);
    assert_eq!(pool.stats().source_bytes, CAP);
    // The GPU starts 1 s late: the loop reaches the cap within its first rounds however
    // slow the host is (other tests share its cores), and must wait.
    stream
        .launch_host_fn(|| std::thread::sleep(std::time::Duration::from_secs(1)))
        .unwrap();
    let t = std::time::Instant::now();
    for (round, dev) in devs.iter_mut().enumerate() {
        let mut v: Vec<u8, _> = Vec::new_in(&pool);
        v.try_reserve_exact(ROUND)
            .unwrap_or_else(|_| panic!("round {round}: AllocError at the cap"));
        v.resize(ROUND, fill(round));
        stream
            .launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(20)))
            .unwrap();
        // SAFETY: `v` is dropped right after, never written again; the pool keeps its
        // block pending until the copy completes.
        unsafe { dev.copy_from_host_async(0, &v, &stream) }.unwrap();
        drop(v);
        peak = peak.max(pool.stats().source_bytes);
    }
    let queued = t.elapsed();
    stream.synchronize().unwrap();
    let mut corrupted = 0usize;
    let mut back = vec![0u8; ROUND];
    for (round, dev) in devs.iter().enumerate() {
        dev.copy_to_host(&mut back, &stream).unwrap();
        corrupted += back.iter().filter(|&&b| b != fill(round)).count();
    }
    let s = pool.stats();
    println!(
        "backpressure: {ROUNDS} rounds of 64 MiB under a 256 MiB cap queued in {queued:?}; peak held {} MiB; {} waits; {corrupted} corrupted bytes",
        peak >> 20,
        s.pending_waits
    );
    assert_eq!(corrupted, 0);
    assert!(peak <= CAP);
    assert_eq!(s.failures, 0, "{s:?}");
    assert!(
        s.pending_waits > 0,
        "the loop never had to wait: the test proves nothing"
    );
    drop(devs);
    pool.release();
}
