//! Audit of the staging ring and its pipelines (`cudalloc::staging`) and of
//! [`DeviceArena`]: the edge cases a user of the library hits (empty and huge requests,
//! zero and huge deadlines, dropped futures, closures that fail or panic midway, a ring
//! or arena dropped with work in flight), and the auto traits of their types.
//!
//! Most tests need a driver (`gpu!()`). Where the GPU must still be busy with a buffer,
//! a host function that sleeps a fixed time holds the stream ([`busy_for`]): unlike a
//! gate it needs nobody to open it, so a synchronizing call elsewhere in this binary
//! only waits for it, never deadlocks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{AllocError, Allocator, Layout};
use cudalloc::cuda::Stream;
use cudalloc::device::{DeviceArena, DevicePool};
use cudalloc::source::PinnedSource;
use cudalloc::staging::{NextStaged, Pipeline, Staged, StagingRing, ThreadedPipeline};
use cudalloc::{Arena, Error, PinnedAlloc, Pool};

use crate::support::{counting, poll};

const LONG: Duration = Duration::from_secs(10);
/// How long [`busy_for`] holds a stream in these tests: long enough that the host sees
/// the stream busy, short enough to keep the tests quick.
const HOLD: Duration = Duration::from_millis(300);

/// Queues a host function on `stream` that sleeps `d` and then sets the flag it returns:
/// everything queued on `stream` after it runs only once the flag is set.
fn busy_for(stream: &Stream, d: Duration) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(d);
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    done
}

/// Counts the drops that came before `done` was set (a value dropped while the GPU work
/// it stands for still ran).
struct DroppedEarly {
    done: Arc<AtomicBool>,
    early: Arc<AtomicUsize>,
}

impl Drop for DroppedEarly {
    fn drop(&mut self) {
        if !self.done.load(Ordering::SeqCst) {
            self.early.fetch_add(1, Ordering::SeqCst);
        }
    }
}

// ----- auto traits (no GPU) -------------------------------------------------------

fn send<T: Send>() {}
fn sync<T: Sync>() {}

/// `AmbiguousIfSync::<_>::some_item` resolves only when `T` is *not* `Sync` (two impls
/// apply otherwise): a compile-time "is not Sync" check without a crate.
trait AmbiguousIfSync<A> {
    fn some_item() {}
}
impl<T: ?Sized> AmbiguousIfSync<()> for T {}
impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}

trait AmbiguousIfSend<A> {
    fn some_item() {}
}
impl<T: ?Sized> AmbiguousIfSend<()> for T {}
impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}

#[test]
fn the_ring_its_leases_futures_and_pipelines_may_cross_threads() {
    send::<StagingRing<PinnedAlloc>>();
    sync::<StagingRing<PinnedAlloc>>();
    send::<Staged<PinnedAlloc>>();
    sync::<Staged<PinnedAlloc>>();
    send::<NextStaged<PinnedAlloc>>();
    send::<StagingRing<&'static Pool<PinnedSource>>>();
    send::<Pipeline<'static, PinnedAlloc>>();
    send::<ThreadedPipeline<'static, PinnedAlloc>>();
}

#[test]
fn a_device_arena_may_move_to_another_thread_but_is_never_shared_and_its_slices_stay() {
    send::<DeviceArena>();
    // Cells inside: `&DeviceArena` must not reach a second thread, so neither may a slice
    // (which holds one).
    <DeviceArena as AmbiguousIfSync<_>>::some_item();
    <cudalloc::device::ArenaSlice<'static, u32> as AmbiguousIfSend<_>>::some_item();
}

#[test]
fn a_ring_without_streams_is_refused_before_any_driver_call() {
    for (n, len) in [(0, 0), (1, 4096), (usize::MAX, usize::MAX)] {
        let err = StagingRing::new(PinnedAlloc, &[], n, len).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    }
}

// ----- the ring -------------------------------------------------------------------

fn one_stream_ring(per_stream: usize, len: usize) -> (Stream, StagingRing<PinnedAlloc>) {
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), per_stream, len).unwrap();
    (s, ring)
}

#[test]
fn a_ring_of_no_buffers_or_empty_buffers_is_a_clear_error() {
    gpu!();
    let s = Stream::new(0).unwrap();
    for (n, len) in [(0, 4096), (1, 0), (0, 0)] {
        let err = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), n, len).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "({n}, {len}): {err:?}");
    }
    // Too many buffers or bytes: an error, never a panic or an abort.
    let streams = [s.clone(), s.clone()];
    for (n, len) in [
        (usize::MAX, 1),
        (usize::MAX / 2 + 1, 1),
        (1, usize::MAX),
        (1, isize::MAX as usize),
    ] {
        let err = StagingRing::new(PinnedAlloc, &streams, n, len).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { .. } | Error::InvalidArgument(_)),
            "({n}, {len}): {err:?}"
        );
    }
}

#[test]
fn every_buffer_is_leased_once_until_given_back_interleaved_by_stream() {
    gpu!();
    let streams = [
        Stream::new(0).unwrap(),
        Stream::new(0).unwrap(),
        Stream::new(0).unwrap(),
    ];
    let ring = StagingRing::new(PinnedAlloc, &streams, 2, 1000).unwrap();
    assert_eq!((ring.buffers(), ring.buffer_len()), (6, 1000));
    let leases: Vec<_> = (0..6).map(|_| ring.next(LONG).unwrap()).collect();
    let mut indices: Vec<_> = leases.iter().map(|l| l.index()).collect();
    // Consecutive leases of a fresh ring go to different streams.
    for pair in leases.windows(2) {
        assert_ne!(
            pair[0].stream(),
            pair[1].stream(),
            "consecutive leases share a stream"
        );
    }
    indices.sort_unstable();
    assert_eq!(indices, (0..6).collect::<Vec<_>>());
    let mut ptrs: Vec<_> = leases.iter().map(|l| l.as_ptr() as usize).collect();
    ptrs.sort_unstable();
    ptrs.dedup();
    assert_eq!(ptrs.len(), 6, "two leases share their bytes");
    assert!(leases
        .iter()
        .all(|l| l.len() == 1000 && l.iter().all(|&b| b == 0)));
    assert!(ring.try_next().unwrap().is_none());
    let err = ring.next(Duration::ZERO).unwrap_err();
    assert!(matches!(err, Error::TimedOut(_)), "{err:?}");
    drop(leases);
    let again: Vec<_> = (0..6).map(|_| ring.next(LONG).unwrap()).collect();
    assert_eq!(again.len(), 6);
}

#[test]
fn next_with_a_zero_deadline_returns_a_free_buffer_and_times_out_at_once_otherwise() {
    gpu!();
    let (s, ring) = one_stream_ring(1, 64);
    let lease = ring
        .next(Duration::ZERO)
        .expect("a free buffer, even with no time to wait");
    let t0 = Instant::now();
    let err = ring.next(Duration::ZERO).unwrap_err();
    assert!(matches!(err, Error::TimedOut(_)), "{err:?}");
    // The GPU still uses the buffer: a zero deadline does not wait for it either.
    let done = busy_for(&s, HOLD);
    drop(lease);
    let err = ring.next(Duration::ZERO).unwrap_err();
    assert!(matches!(err, Error::TimedOut(_)), "{err:?}");
    assert!(
        !done.load(Ordering::SeqCst),
        "the host function ended before the check"
    );
    assert!(t0.elapsed() < HOLD, "a zero deadline waited {:?}", t0.elapsed());
    // And a deadline long enough sees the buffer once the GPU is done.
    let again = ring.next(LONG).unwrap();
    assert!(
        done.load(Ordering::SeqCst),
        "handed out before the GPU was done with it"
    );
    assert_eq!(again.index(), 0);
}

#[test]
fn next_with_a_deadline_too_far_to_add_to_the_clock_waits_without_a_panic() {
    gpu!();
    let (s, ring) = one_stream_ring(1, 64);
    // Not `Duration::MAX` only: each of these overflows `Instant + timeout`.
    for timeout in [
        Duration::MAX,
        Duration::from_secs(u64::MAX),
        Duration::new(u64::MAX / 2, 0),
    ] {
        let lease = ring.next(timeout).unwrap();
        let done = busy_for(&s, Duration::from_millis(20));
        drop(lease);
        // The buffer is busy: it waits for the GPU, past the spin, with no deadline.
        let again = ring.next(timeout).unwrap();
        assert!(done.load(Ordering::SeqCst), "{timeout:?}: handed out too early");
        drop(again);
    }
}

#[test]
fn try_next_never_waits_and_sees_a_buffer_once_the_gpu_is_done() {
    gpu!();
    let (s, ring) = one_stream_ring(1, 64);
    let lease = ring.try_next().unwrap().expect("a fresh ring has a free buffer");
    assert!(ring.try_next().unwrap().is_none(), "its only buffer is leased");
    let done = busy_for(&s, HOLD);
    drop(lease);
    let t0 = Instant::now();
    assert!(
        ring.try_next().unwrap().is_none(),
        "handed out while the GPU used it"
    );
    assert!(t0.elapsed() < HOLD / 2, "try_next waited {:?}", t0.elapsed());
    s.synchronize().unwrap();
    assert!(done.load(Ordering::SeqCst));
    assert!(ring.try_next().unwrap().is_some(), "the GPU is done with it");
}

#[test]
fn a_dropped_next_async_holds_no_buffer_and_leaves_other_waiters_woken() {
    gpu!();
    let (s, ring) = one_stream_ring(1, 64);
    let (counter, waker) = counting();
    // Every buffer leased: both futures wait for a give-back.
    let lease = ring.next(LONG).unwrap();
    let mut dropped = ring.next_async();
    let mut kept = ring.next_async();
    assert!(poll(&mut dropped, &waker).is_pending());
    assert!(poll(&mut kept, &waker).is_pending());
    drop(dropped);
    // The buffer, busy on the GPU when given back: the kept future still gets it.
    let done = busy_for(&s, Duration::from_millis(50));
    drop(lease);
    let t0 = Instant::now();
    let got = loop {
        if let Poll::Ready(r) = poll(&mut kept, &waker) {
            break r.unwrap();
        }
        assert!(t0.elapsed() < LONG, "the waiting future was never ready");
        std::thread::park_timeout(Duration::from_millis(10));
    };
    assert!(done.load(Ordering::SeqCst), "handed out before the GPU was done");
    assert!(counter.wakes.load(Ordering::SeqCst) > 0, "never woken");
    assert_eq!(got.index(), 0);
    drop(got);
    // A future polled while the buffer is busy, then dropped, takes nothing with it.
    let lease = ring.next(LONG).unwrap();
    let _done = busy_for(&s, Duration::from_millis(50));
    drop(lease);
    let mut busy = ring.next_async();
    let _ = poll(&mut busy, &waker);
    drop(busy);
    assert_eq!(
        ring.next(LONG).unwrap().index(),
        0,
        "the dropped future kept the buffer"
    );
}

#[test]
fn a_lease_outlives_every_handle_of_its_ring() {
    gpu!();
    let (s, ring) = one_stream_ring(2, 256);
    let mut lease = ring.next(LONG).unwrap();
    let fut = ring.next_async();
    drop(ring);
    drop(fut);
    lease.fill(3);
    lease.record_use(&s).unwrap(); // its own stream: nothing to do
    lease.last_use_queued().unwrap();
    lease.last_use_queued().unwrap(); // twice is harmless
    assert!(lease.iter().all(|&b| b == 3));
    drop(lease);
    s.synchronize().unwrap();
}

/// An allocator of pinned memory that counts the frees made before `done` is set.
#[derive(Clone)]
struct WatchedFrees {
    done: Arc<AtomicBool>,
    frees: Arc<AtomicUsize>,
    early: Arc<AtomicUsize>,
}

// SAFETY: every call is forwarded to `PinnedAlloc`, whose contract this keeps; the
// counters only observe.
unsafe impl Allocator for WatchedFrees {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        PinnedAlloc.allocate(layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        self.frees.fetch_add(1, Ordering::SeqCst);
        if !self.done.load(Ordering::SeqCst) {
            self.early.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: the caller's obligations, passed on; `allocate` was `PinnedAlloc`'s.
        unsafe { PinnedAlloc.deallocate(ptr, layout) }
    }
}

/// Found by this audit: the last handle of a ring freed its buffers at once, while the
/// GPU work recorded on them (the events the ring waits for before a reuse) still ran:
/// the allocator could hand the bytes to anyone while a copy or a kernel used them.
#[test]
fn dropping_a_ring_frees_no_buffer_the_gpu_still_uses() {
    gpu!();
    let s = Stream::new(0).unwrap();
    let alloc = WatchedFrees {
        done: Arc::new(AtomicBool::new(false)),
        frees: Arc::new(AtomicUsize::new(0)),
        early: Arc::new(AtomicUsize::new(0)),
    };
    let ring = StagingRing::new(alloc.clone(), std::slice::from_ref(&s), 2, 4096).unwrap();
    let (a, b) = (ring.next(LONG).unwrap(), ring.next(LONG).unwrap());
    // Both buffers' last uses are behind a sleeping host function (a kernel or a copy
    // that reads them).
    let flag = alloc.done.clone();
    s.launch_host_fn(move || {
        std::thread::sleep(HOLD);
        flag.store(true, Ordering::SeqCst);
    })
    .unwrap();
    drop((a, b));
    drop(ring);
    assert_eq!(
        alloc.frees.load(Ordering::SeqCst),
        2,
        "the ring did not free its buffers"
    );
    assert_eq!(
        alloc.early.load(Ordering::SeqCst),
        0,
        "the ring freed a buffer while the GPU still used it"
    );
}

#[test]
fn buffers_from_a_pool_and_an_arena_are_leased_written_and_given_back() {
    gpu!();
    let s = Stream::new(0).unwrap();
    let pool = Pool::new(PinnedSource::default());
    let arena = Arena::pinned();
    {
        let from_pool = StagingRing::new(&pool, std::slice::from_ref(&s), 2, 3000).unwrap();
        let from_arena = StagingRing::new(&arena, std::slice::from_ref(&s), 2, 3000).unwrap();
        for _ in 0..5 {
            let mut x = from_pool.next(LONG).unwrap();
            let mut y = from_arena.next(LONG).unwrap();
            assert_eq!((x.len(), y.len()), (3000, 3000));
            x.fill(1);
            y.fill(2);
            let _ = busy_for(&s, Duration::from_millis(2));
        }
        assert_eq!(from_pool.buffers() + from_arena.buffers(), 4);
    }
    s.synchronize().unwrap();
    crate::support::assert_balanced(&pool.stats());
}

// ----- the pipelines --------------------------------------------------------------

#[test]
fn a_pipeline_of_no_batches_calls_nothing_and_reports_nothing() {
    gpu!();
    let (_s, ring) = one_stream_ring(2, 64);
    let mut calls = 0;
    let run = ring
        .pipeline()
        .run(
            0,
            |_, _| {
                calls += 1;
                Ok::<_, Error>(())
            },
            |_, _| Ok(()),
            |_, ()| Ok(()),
        )
        .unwrap();
    assert_eq!((run.batches, calls), (0, 0));
    let run = ring
        .pipeline()
        .fill_threads(3)
        .run(0, |_, _| Ok::<_, Error>(()), |_, _| Ok(()), |_, ()| Ok(()))
        .unwrap();
    assert_eq!(run.pipeline.batches, 0);
    assert_eq!(ring.try_next().unwrap().map(|l| l.index()), Some(0));
}

/// What a pipeline run's closures saw.
#[derive(Default)]
struct Seen {
    filled: Vec<usize>,
    launched: Vec<(usize, usize)>,
    drained: Vec<usize>,
}

#[test]
fn one_batch_and_more_streams_than_batches_are_each_filled_launched_and_drained_once() {
    gpu!();
    let streams: Vec<_> = (0..4).map(|_| Stream::new(0).unwrap()).collect();
    let ring = StagingRing::new(PinnedAlloc, &streams, 1, 128).unwrap();
    for batches in [1, 3] {
        let seen = std::cell::RefCell::new(Seen::default());
        let run = ring
            .pipeline()
            .run(
                batches,
                |b, bytes| {
                    bytes.fill(b as u8 + 1);
                    seen.borrow_mut().filled.push(b);
                    Ok::<_, Error>(())
                },
                |b, lease| {
                    assert!(lease.iter().all(|&x| x == b as u8 + 1), "batch {b} filled wrong");
                    seen.borrow_mut().launched.push((b, lease.index()));
                    Ok(b)
                },
                |b, v| {
                    assert_eq!(b, v);
                    seen.borrow_mut().drained.push(b);
                    Ok(())
                },
            )
            .unwrap();
        let seen = seen.into_inner();
        let all: Vec<_> = (0..batches).collect();
        assert_eq!(run.batches, batches);
        assert_eq!((&seen.filled, &seen.drained), (&all, &all));
        let mut buffers: Vec<_> = seen.launched.iter().map(|&(_, k)| k).collect();
        buffers.sort_unstable();
        buffers.dedup();
        assert_eq!(buffers.len(), batches, "more streams than batches: a buffer each");
    }
    // The threaded pipeline: more workers and streams than batches.
    for batches in [1, 3] {
        let drained = std::sync::Mutex::new(Vec::new());
        let run = ring
            .pipeline()
            .fill_threads(8)
            .run(
                batches,
                |b, bytes| {
                    bytes.fill(b as u8);
                    Ok::<_, Error>(())
                },
                |b, lease| Ok((b, lease[0])),
                |b, (v, first)| {
                    assert_eq!((b, first), (v, b as u8));
                    drained.lock().unwrap().push(b);
                    Ok(())
                },
            )
            .unwrap();
        assert_eq!(run.pipeline.batches, batches);
        assert_eq!(drained.into_inner().unwrap(), (0..batches).collect::<Vec<_>>());
    }
}

/// Every buffer of `ring` can be leased again (none lost or still leased).
fn every_buffer_back<A: Allocator>(ring: &StagingRing<A>) {
    let all: Vec<_> = (0..ring.buffers()).map(|_| ring.next(LONG).unwrap()).collect();
    let mut indices: Vec<_> = all.iter().map(|l| l.index()).collect();
    indices.sort_unstable();
    assert_eq!(indices, (0..ring.buffers()).collect::<Vec<_>>());
}

#[test]
fn an_error_of_any_closure_midway_is_returned_and_every_buffer_comes_back() {
    gpu!();
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let ring = StagingRing::new(PinnedAlloc, &streams, 2, 256).unwrap();
    const FAIL: Error = Error::InvalidArgument("batch 5 fails");
    let at = |b: usize| if b == 5 { Err(FAIL) } else { Ok(()) };
    for which in ["fill", "launch", "finish", "drain"] {
        let drained = std::cell::Cell::new(0);
        let fails = |what: &str, b: usize| if which == what { at(b) } else { Ok(()) };
        let drain = |b: usize, v: usize| {
            assert_eq!(b, v);
            fails("drain", b)?;
            drained.set(drained.get() + 1);
            Ok(())
        };
        let err = ring
            .pipeline()
            .run_split(
                9,
                |b, _| fails("fill", b),
                |b, _| fails("launch", b),
                |b, _, ()| fails("finish", b).map(|()| b),
                drain,
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument("batch 5 fails")),
            "{which}: {err:?}"
        );
        assert!(drained.get() <= 5, "{which}: drained {} batches", drained.get());
        every_buffer_back(&ring);
        // The same through the threaded pipeline (no split there).
        if which == "finish" {
            continue;
        }
        let threaded = ring.pipeline().fill_threads(2);
        let err = threaded
            .run(
                9,
                |b, _| fails("fill", b),
                |b, _| fails("launch", b).map(|()| b),
                drain,
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument("batch 5 fails")),
            "threaded {which}: {err:?}"
        );
        every_buffer_back(&ring);
    }
}

/// A pipeline whose batch 1 queues a sleeping host function and returns a value that
/// notes if it is dropped before that function ended; the drain of batch 0 panics.
/// Returns how many values were dropped early, and checks the ring afterwards.
fn panicking_drain(threaded: bool) -> usize {
    let s = Stream::new(0).unwrap();
    // Two buffers on one stream, two batches in flight: batch 1 is launched (its host
    // function sleeping) when batch 2's launch drains batch 0, whose drain panics.
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 2, 64).unwrap();
    let early = Arc::new(AtomicUsize::new(0));
    let launch = |b: usize, lease: &Staged<PinnedAlloc>| {
        let done = if b == 0 {
            Arc::new(AtomicBool::new(true))
        } else {
            busy_for(lease.stream(), HOLD)
        };
        Ok::<_, Error>(DroppedEarly {
            done,
            early: early.clone(),
        })
    };
    let drain = |b: usize, _v: DroppedEarly| {
        assert_ne!(b, 0, "the drain of batch 0 panics (on purpose)");
        Ok(())
    };
    let out = catch_unwind(AssertUnwindSafe(|| {
        if threaded {
            ring.pipeline()
                .fill_threads(2)
                .run(4, |_, _| Ok(()), launch, drain)
                .map(|r| r.pipeline)
        } else {
            ring.pipeline().run(4, |_, _| Ok(()), launch, drain)
        }
    }));
    assert!(out.is_err(), "the drain's panic did not reach the caller");
    // The ring is whole: every buffer can be leased again.
    every_buffer_back(&ring);
    s.synchronize().unwrap();
    early.load(Ordering::SeqCst)
}

/// Found by this audit: on an error a pipeline waits for the batches in flight before
/// their values are dropped ("their values are dropped only once the GPU is done with
/// them"), but a panic in a closure (a drain's `assert!`, as the docs' examples do)
/// dropped them at once, while the GPU could still write into them.
#[test]
fn a_panic_in_a_drain_drops_no_value_of_a_batch_still_running() {
    gpu!();
    assert_eq!(
        panicking_drain(false),
        0,
        "a launched batch's value dropped while it ran"
    );
}

#[test]
fn a_panic_in_a_threaded_runs_drain_drops_no_value_of_a_batch_still_running() {
    gpu!();
    assert_eq!(
        panicking_drain(true),
        0,
        "a launched batch's value dropped while it ran"
    );
}

/// Found by this audit: in a split run, the launch half's value is held across the drain
/// of the buffer's last batch; a panic in that drain dropped it while the work the launch
/// queued still ran (an error there waits for the stream first).
#[test]
fn a_panic_in_a_drain_between_the_halves_of_a_split_launch_drops_nothing_still_running() {
    gpu!();
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, 64).unwrap();
    let early = Arc::new(AtomicUsize::new(0));
    let out = catch_unwind(AssertUnwindSafe(|| {
        ring.pipeline().run_split(
            3,
            |_, _| Ok::<_, Error>(()),
            |b, lease| {
                let done = if b == 0 {
                    Arc::new(AtomicBool::new(true))
                } else {
                    busy_for(lease.stream(), HOLD)
                };
                Ok(DroppedEarly {
                    done,
                    early: early.clone(),
                })
            },
            |_, _, v| Ok(v),
            |b, _v| {
                assert_ne!(b, 0, "the drain of batch 0 panics (on purpose)");
                Ok(())
            },
        )
    }));
    assert!(out.is_err(), "the drain's panic did not reach the caller");
    every_buffer_back(&ring);
    s.synchronize().unwrap();
    assert_eq!(
        early.load(Ordering::SeqCst),
        0,
        "the launch half's value dropped while its work ran"
    );
}

#[test]
fn a_panic_in_a_fill_or_a_launch_leaves_every_buffer_in_the_ring() {
    gpu!();
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let ring = StagingRing::new(PinnedAlloc, &streams, 1, 64).unwrap();
    for panic_in_fill in [true, false] {
        let fill = |b: usize| {
            assert!(!(panic_in_fill && b == 3), "fill panics (on purpose)");
            Ok::<_, Error>(())
        };
        let launch = |b: usize| {
            assert!(panic_in_fill || b != 3, "launch panics (on purpose)");
            Ok(())
        };
        let out = catch_unwind(AssertUnwindSafe(|| {
            ring.pipeline()
                .run(6, |b, _| fill(b), |b, _| launch(b), |_, ()| Ok(()))
        }));
        assert!(out.is_err());
        every_buffer_back(&ring);
        let out = catch_unwind(AssertUnwindSafe(|| {
            let threaded = ring.pipeline().fill_threads(2);
            threaded.run(6, |b, _| fill(b), |b, _| launch(b), |_, ()| Ok(()))
        }));
        assert!(out.is_err());
        every_buffer_back(&ring);
    }
}

#[test]
fn a_pipelines_counts_and_waits_add_up() {
    gpu!();
    let (s, ring) = one_stream_ring(2, 64);
    let t0 = Instant::now();
    let mut drained = 0;
    let run = ring
        .pipeline()
        .in_flight(1)
        .run(
            6,
            |_, _| Ok::<_, Error>(()),
            |_, lease| {
                let _ = busy_for(lease.stream(), Duration::from_millis(5));
                Ok(())
            },
            |_, ()| {
                drained += 1;
                Ok(())
            },
        )
        .unwrap();
    let wall = t0.elapsed();
    assert_eq!((run.batches, drained), (6, 6));
    assert!(run.buffer_wait + run.drain_wait <= wall, "{run:?} in {wall:?}");
    // With one batch in flight each batch's 5 ms is waited for by its drain.
    assert!(run.drain_wait >= Duration::from_millis(20), "{run:?}");
    let threaded = ring
        .pipeline()
        .fill_threads(2)
        .run(
            6,
            |_, bytes| {
                std::thread::sleep(Duration::from_millis(1));
                bytes.fill(1);
                Ok::<_, Error>(())
            },
            |_, _| Ok(()),
            |_, ()| Ok(()),
        )
        .unwrap();
    assert_eq!(threaded.pipeline.batches, 6);
    assert!(threaded.fill_busy >= Duration::from_millis(6), "{threaded:?}");
    s.synchronize().unwrap();
}

// ----- DeviceArena ----------------------------------------------------------------

fn arena() -> (DevicePool, Stream, DeviceArena) {
    let pool = DevicePool::get(0).unwrap();
    let stream = Stream::new(0).unwrap();
    let arena = DeviceArena::new(&pool, &stream).unwrap();
    (pool, stream, arena)
}

#[test]
fn empty_requests_and_zero_sized_elements_take_no_memory() {
    gpu!();
    let (_pool, _s, arena) = arena();
    {
        let a = arena.alloc::<u8>(0).unwrap();
        let b = arena.alloc_zeroed::<u64>(0).unwrap();
        assert_eq!((a.device_ptr(), a.len(), b.device_ptr()), (0, 0, 0));
        assert!(a.to_vec().unwrap().is_empty());
        // Any number of zero-sized elements: no overflow, no memory.
        let units = arena.alloc::<()>(usize::MAX).unwrap();
        assert_eq!(
            (units.device_ptr(), units.len(), units.byte_len()),
            (0, usize::MAX, 0)
        );
        let zeroed = arena.alloc_zeroed::<[u32; 0]>(usize::MAX).unwrap();
        assert_eq!(zeroed.device_ptr(), 0);
        let mut host = [[0u32; 0]; 3];
        let mut three = arena.alloc::<[u32; 0]>(3).unwrap();
        three.copy_from_host(&host).unwrap();
        three.copy_to_host(&mut host).unwrap();
    }
    let st = arena.stats();
    assert_eq!((st.chunks, st.capacity_bytes, st.used_bytes), (0, 0, 0), "{st:?}");
}

#[test]
fn an_overflowing_or_huge_request_is_a_clear_error_and_changes_nothing() {
    gpu!();
    let (_pool, _s, arena) = arena();
    let first = arena.alloc::<u8>(1).unwrap().device_ptr();
    let before = arena.stats();
    let cases: [(&str, Result<u64, Error>); 6] = [
        (
            "len * size overflows",
            arena.alloc::<u64>(usize::MAX / 4).map(|s| s.device_ptr()),
        ),
        (
            "usize::MAX bytes",
            arena.alloc::<u8>(usize::MAX).map(|s| s.device_ptr()),
        ),
        (
            "rounding overflows",
            arena.alloc::<u8>(usize::MAX - 100).map(|s| s.device_ptr()),
        ),
        (
            "isize::MAX bytes",
            arena.alloc::<u8>(isize::MAX as usize).map(|s| s.device_ptr()),
        ),
        ("1 PiB", arena.alloc::<u8>(1 << 50).map(|s| s.device_ptr())),
        (
            "1 PiB zeroed",
            arena.alloc_zeroed::<u32>(1 << 48).map(|s| s.device_ptr()),
        ),
    ];
    for (what, r) in cases {
        let err = r.unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { .. } | Error::DeviceOutOfMemory { .. }),
            "{what}: {err:?}"
        );
    }
    assert_eq!(arena.stats(), before, "a failed request changed the arena");
    // Still usable: the next slice follows the first.
    let next = arena.alloc::<u8>(1).unwrap().device_ptr();
    assert_eq!(next, first + 256);
}

#[test]
fn chunk_sizes_of_zero_or_beyond_the_largest_are_clamped() {
    gpu!();
    let pool = DevicePool::get(0).unwrap();
    let s = Stream::new(0).unwrap();
    let small = DeviceArena::with_chunk_size(&pool, &s, 0).unwrap();
    let odd = DeviceArena::with_chunk_size(&pool, &s, 1000).unwrap();
    let huge = DeviceArena::with_chunk_size(&pool, &s, usize::MAX).unwrap();
    assert_eq!(
        huge.stats().capacity_bytes,
        0,
        "an arena takes no memory before its first slice"
    );
    let _a = small.alloc::<u8>(1).unwrap();
    let _b = odd.alloc::<u8>(1).unwrap();
    assert_eq!(small.stats().capacity_bytes, 256);
    assert_eq!(odd.stats().capacity_bytes, 1024);
    // Slices past the first chunk go to new chunks, doubling, or of their own size.
    let _c = small.alloc::<u8>(300).unwrap();
    let _d = small.alloc::<u8>(5000).unwrap();
    let st = small.stats();
    assert_eq!((st.chunks, st.capacity_bytes), (3, 256 + 512 + 5120), "{st:?}");
    assert!(
        st.used_bytes <= st.capacity_bytes && st.used_bytes % 256 == 0,
        "{st:?}"
    );
}

#[test]
fn slices_are_distinct_granule_aligned_and_used_bytes_follow_them() {
    gpu!();
    let (_pool, _s, mut arena) = arena();
    for _round in 0..2 {
        let mut spans = Vec::new();
        for (i, len) in [1usize, 255, 256, 257, 4 << 20, 3, (4 << 20) + 1, 7]
            .into_iter()
            .enumerate()
        {
            let sl = arena.alloc::<u8>(len).unwrap();
            assert_eq!(sl.device_ptr() % 256, 0, "slice {i} of {len} bytes");
            spans.push((sl.device_ptr(), sl.device_ptr() + len as u64));
            let st = arena.stats();
            assert!(
                st.used_bytes <= st.capacity_bytes && st.used_bytes % 256 == 0,
                "{st:?}"
            );
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "slices overlap: {w:?}");
        }
        let chunks = arena.stats().chunks;
        arena.reset();
        let st = arena.stats();
        assert_eq!((st.used_bytes, st.chunks), (0, chunks), "{st:?}");
    }
}

#[test]
fn rewind_refuses_checkpoints_of_other_arenas_stale_ones_and_later_positions_changing_nothing() {
    gpu!();
    let (pool, s, mut arena) = arena();
    let mut other = DeviceArena::new(&pool, &s).unwrap();
    let _ = arena.alloc::<u8>(100).unwrap();
    let early = arena.checkpoint();
    let _ = arena.alloc::<u8>(100).unwrap();
    let late = arena.checkpoint();
    let _ = other.alloc::<u8>(100).unwrap();
    assert!(other.rewind(early).is_err(), "another arena's checkpoint");
    arena.rewind(early).unwrap();
    let here = arena.stats();
    assert!(arena.rewind(late).is_err(), "a position past the current one");
    assert_eq!(arena.stats(), here, "a refused rewind changed the arena");
    arena.rewind(early).unwrap(); // the current position itself: nothing to do
    arena.reset();
    assert!(arena.rewind(early).is_err(), "a checkpoint from before a reset");
    // A checkpoint of an empty arena, rewound to after it grew chunks.
    let mut fresh = DeviceArena::new(&pool, &s).unwrap();
    let start = fresh.checkpoint();
    let a = fresh.alloc::<u8>(64 << 20).unwrap().device_ptr();
    fresh.rewind(start).unwrap();
    assert_eq!(fresh.stats().used_bytes, 0);
    assert_eq!(
        fresh.alloc::<u8>(1).unwrap().device_ptr(),
        a,
        "the chunk is reused"
    );
}

#[test]
fn a_reset_while_the_gpu_still_writes_the_arena_orders_the_next_writes_after_it() {
    gpu!();
    let (_pool, _s, mut arena) = arena();
    let other = Stream::new(0).unwrap();
    let len = 1 << 20;
    let ptr = {
        let x = arena.alloc::<u8>(len).unwrap();
        // The first use, on another stream, behind a sleeping host function: 0xAA.
        let done = busy_for(&other, HOLD);
        // SAFETY: the slice's range, kept by the arena until the reset orders its stream
        // after `other` (declared just below).
        unsafe { cudalloc::cuda::memset_d8_async(x.device_ptr(), 0xAA, len, &other) }.unwrap();
        x.record_use(&other);
        assert!(!done.load(Ordering::SeqCst));
        x.device_ptr()
    };
    let t0 = Instant::now();
    arena.reset();
    assert!(t0.elapsed() < HOLD / 2, "a reset waited on the host");
    let y = arena.alloc_zeroed::<u8>(len).unwrap();
    assert_eq!(y.device_ptr(), ptr, "the memory is reused");
    // The zeroing ran after the foreign write, not before it.
    assert!(
        y.to_vec().unwrap().iter().all(|&b| b == 0),
        "the foreign write landed after the reuse"
    );
    assert_eq!(arena.stats().foreign_waits, 1);
}

#[test]
fn dropping_an_arena_with_work_in_flight_neither_waits_nor_panics() {
    gpu!();
    let pool = DevicePool::get(0).unwrap();
    let s = Stream::new(0).unwrap();
    let other = Stream::new(0).unwrap();
    let arena = DeviceArena::new(&pool, &s).unwrap();
    let done = busy_for(&s, HOLD);
    {
        let x = arena.alloc_zeroed::<u32>(1024).unwrap();
        x.record_use(&other);
    }
    let t0 = Instant::now();
    drop(arena);
    assert!(t0.elapsed() < HOLD / 2, "the drop waited on the host");
    assert!(!done.load(Ordering::SeqCst));
    s.synchronize().unwrap();
    other.synchronize().unwrap();
}
