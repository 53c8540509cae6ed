//! The staging ring (`cudalloc::staging`): never hands out a buffer the GPU still reads
//! (a copy held behind a gate, 0 corrupted bytes, and the negative control that skips the
//! ring's event), deadline expiry, the async path woken by the driver and by give-backs,
//! buffers from each source (`PinnedAlloc`, a `Pool`, an `Arena`); `Staged::last_use_queued`
//! (the buffer handed out while the rest of its batch is held; `record_use` after it).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudalloc::source::PinnedSource;
use cudalloc::staging::{Staged, StagingRing};
use cudalloc::{copy, Arena, Error, PinnedAlloc, Pool};

use crate::gpu_support::Gate;
use crate::MIB;

/// Leases the ring's only buffer, fills it with 0xAA and queues its copy to the device
/// behind a closed gate; then takes the buffer again (`try_next`), writes 0x55 into it if
/// it got it, opens the gate and returns how many bytes of the copy are not 0xAA.
fn race(len: usize) -> (bool, usize) {
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, len).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let mut dev = pool.alloc::<u8>(len, &s).unwrap();
    let gate = Gate::hold(&s);
    {
        let mut buf = ring.try_next().unwrap().expect("a fresh ring has a free buffer");
        buf.fill(0xAA);
        // SAFETY: the buffer is not written while leased after this; the ring keeps it
        // from the next lease until the copy has completed (the property under test).
        unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.unwrap();
    }
    let got = ring.try_next().unwrap().map(|mut buf| {
        buf.fill(0x55); // the next batch's fill: a race if the copy has not run yet
    });
    gate.open();
    let back = dev.to_vec().unwrap();
    s.synchronize().unwrap();
    (got.is_some(), back.iter().filter(|&&b| b != 0xAA).count())
}

#[test]
fn a_ring_never_hands_out_a_buffer_the_gpu_still_reads() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (got, corrupted) = race(64 * MIB);
    assert!(!got, "try_next handed out the buffer while its copy was queued");
    assert_eq!(corrupted, 0, "corrupted bytes");
}

/// The negative control: a ring that hands buffers out without waiting for their event
/// corrupts the queued copy (every byte, as the copy runs after the refill), so the race
/// test above can fail.
#[cfg(feature = "test-hooks")]
#[test]
fn without_its_event_the_ring_corrupts_the_queued_copy() {
    gpu!();
    let _one = crate::one_at_a_time();
    // The hook is process-wide: alone in a child process.
    if crate::support::in_a_child_process("staging::without_its_event_the_ring_corrupts_the_queued_copy") {
        return;
    }
    cudalloc::staging::hooks::skip_release_events(true);
    let (got, corrupted) = race(64 * MIB);
    cudalloc::staging::hooks::skip_release_events(false);
    assert!(got, "the hooked ring handed the buffer out at once");
    assert_eq!(corrupted, 64 * MIB, "the refill reached the copy");
}

#[test]
fn next_times_out_while_the_gpu_uses_every_buffer() {
    gpu!();
    let _one = crate::one_at_a_time();
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, 4096).unwrap();
    // Every buffer leased: times out.
    let lease = ring.next(Duration::from_secs(10)).unwrap();
    let err = ring.next(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(err, Error::TimedOut(_)), "{err:?}");
    // Given back, but the GPU is held before its last use completes: times out.
    let gate = Gate::hold(&s);
    drop(lease);
    let err = ring.next(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(err, Error::TimedOut(_)), "{err:?}");
    gate.open();
    let again = ring.next(Duration::from_secs(10)).unwrap();
    assert_eq!(again.index(), 0);
    assert!(
        s.is_idle().unwrap(),
        "handed out before its stream passed the use"
    );
}

/// A waker that counts its wake-ups and unparks the test thread.
struct CountingWaker {
    wakes: AtomicUsize,
    thread: std::thread::Thread,
}
impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

fn until_woken(c: &CountingWaker) -> bool {
    let t0 = Instant::now();
    while c.wakes.load(Ordering::SeqCst) == 0 {
        if t0.elapsed() > Duration::from_secs(10) {
            return false;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
    true
}

/// A ring of one 4 KiB buffer on a new stream, and a waker that counts its wake-ups.
fn one_buffer_and_a_counting_waker() -> (Stream, StagingRing<PinnedAlloc>, Arc<CountingWaker>, Waker) {
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, 4096).unwrap();
    let counter = Arc::new(CountingWaker {
        wakes: AtomicUsize::new(0),
        thread: std::thread::current(),
    });
    let waker = Waker::from(counter.clone());
    (s, ring, counter, waker)
}

#[test]
fn next_async_is_woken_by_the_gpu_and_by_a_give_back() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (s, ring, counter, waker) = one_buffer_and_a_counting_waker();
    let mut cx = Context::from_waker(&waker);

    // Every buffer leased: pending until the lease is dropped (no GPU work: free at once).
    let lease = ring.try_next().unwrap().unwrap();
    let mut next = ring.next_async();
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
    drop(lease);
    assert!(until_woken(&counter), "a give-back did not wake the waiting task");
    // Ready once the (empty) work before the give-back's event has completed.
    let lease = ready(&mut next, &mut cx).unwrap();
    drop(next);

    // Given back behind held work: pending until the driver says the work is done.
    let gate = Gate::hold(&s);
    drop(lease);
    counter.wakes.store(0, Ordering::SeqCst);
    let mut next = ring.next_async();
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
    gate.open();
    assert!(until_woken(&counter), "the driver did not wake the waiting task");
    let lease = ready(&mut next, &mut cx).unwrap();
    assert_eq!(lease.len(), 4096);
    // A future dropped while waiting holds nothing.
    let mut waiting = ring.next_async();
    assert!(Pin::new(&mut waiting).poll(&mut cx).is_pending());
    drop(waiting);
    drop(lease);
    assert_eq!(ring.next(Duration::from_secs(10)).unwrap().index(), 0);
}

/// Found by review (2026-12-06): a future dropped while it waited left its waker with the
/// ring, so the next give-back woke a task that no longer waited (and timed-out `next`
/// calls piled wakers up while every buffer stayed busy).
#[test]
fn a_dropped_next_async_is_not_woken_by_a_later_give_back() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (_s, ring, counter, waker) = one_buffer_and_a_counting_waker();
    let mut cx = Context::from_waker(&waker);
    let lease = ring.try_next().unwrap().unwrap();
    // Timed-out waits of another thread leave nothing behind either.
    for _ in 0..3 {
        assert!(matches!(ring.next(Duration::ZERO), Err(Error::TimedOut(_))));
    }
    let mut next = ring.next_async();
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
    drop(next);
    drop(lease);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        counter.wakes.load(Ordering::SeqCst),
        0,
        "a dropped future was woken"
    );
    // A live one still is.
    let lease = ring.try_next().unwrap().unwrap();
    let mut next = ring.next_async();
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
    drop(lease);
    assert!(until_woken(&counter), "a give-back did not wake the waiting task");
    drop(ready(&mut next, &mut cx).unwrap());
}

/// Found by review (2026-12-06): `next(Duration::MAX)` panicked adding the timeout to the
/// clock, and a ring of `usize::MAX` buffers panicked on its list's capacity; now the
/// first waits for as long as it takes and the second is an error.
#[test]
fn a_ring_takes_any_timeout_and_refuses_any_count_without_a_panic() {
    gpu!();
    let _one = crate::one_at_a_time();
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 2, 4096).unwrap();
    let first = ring.next(Duration::MAX).unwrap();
    // The second waits past the spin for a give-back, with no deadline.
    let second = std::thread::scope(|t| {
        let waiter = t.spawn(|| ring.next(Duration::MAX).map(|l| l.index()));
        let held = ring.next(Duration::MAX).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        drop(held);
        waiter.join().unwrap()
    });
    assert!(second.is_ok(), "{second:?}");
    drop(first);
    // The same numbers through the pipeline helper: it runs (each batch on the host).
    let mut drained = 0;
    let run = ring
        .pipeline()
        .in_flight(usize::MAX)
        .timeout(Duration::MAX)
        .run(
            5,
            |_, bytes| {
                bytes.fill(1);
                Ok::<_, Error>(())
            },
            |_, _| Ok(()),
            |_, ()| {
                drained += 1;
                Ok(())
            },
        )
        .unwrap();
    assert_eq!((run.batches, drained), (5, 5));
    for per_stream in [usize::MAX, usize::MAX / 2] {
        let err = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), per_stream, 4096).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { .. } | Error::InvalidArgument(_)),
            "{err:?}"
        );
    }
}

/// Polls `next` until it is ready (parked between polls; at most 10 s: a hang guard).
fn ready<F: Future + Unpin>(next: &mut F, cx: &mut Context<'_>) -> F::Output {
    let t0 = Instant::now();
    loop {
        if let Poll::Ready(r) = Pin::new(&mut *next).poll(cx) {
            return r;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never ready");
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// Eight batches through a ring of two buffers on two streams: each batch's bytes arrive
/// intact (the ring waited for each buffer's previous copy before the refill).
fn batches_arrive_intact<A: Allocator + Clone>(alloc: A, what: &str) {
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let len = 4 * MIB;
    let ring = StagingRing::new(alloc, &streams, 1, len).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let mut on_device = Vec::new();
    for batch in 0..8u8 {
        let mut buf = ring.next(Duration::from_secs(10)).unwrap();
        assert!(
            streams.contains(buf.stream()),
            "{what}: a buffer of another stream"
        );
        let mut dev = pool.alloc::<u8>(len, buf.stream()).unwrap();
        // Held a moment so that the refill of this buffer must wait for the GPU.
        let gate = Gate::hold(buf.stream());
        buf.fill(batch.wrapping_mul(37));
        // SAFETY: the ring keeps the buffer from the next lease until the copy completed.
        unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.unwrap();
        drop(buf);
        drop(gate);
        on_device.push((batch, dev));
    }
    for (batch, dev) in on_device {
        let back = dev.to_vec().unwrap();
        let wrong = back.iter().filter(|&&b| b != batch.wrapping_mul(37)).count();
        assert_eq!(wrong, 0, "{what}: batch {batch} arrived with {wrong} wrong bytes");
    }
}

#[test]
fn buffers_from_each_source_stage_intact_batches() {
    gpu!();
    let _one = crate::one_at_a_time();
    batches_arrive_intact(PinnedAlloc, "PinnedAlloc");
    let pool = Pool::new(PinnedSource::default());
    batches_arrive_intact(&pool, "Pool<PinnedSource>");
    let arena = Arena::pinned();
    batches_arrive_intact(&arena, "Arena::pinned");
}

/// Four batches through a pipeline of one buffer with 4 batches in flight (more than the
/// ring's buffers), its stream held by a gate from the start: the copy of batch 0 is queued
/// behind the gate when batch 1 wants the buffer. The gate opens in `fill(3)` (after its
/// write) and, if `opener` is set, from a thread after 100 ms. With `fill_threads` > 0 the
/// fills run on that many worker threads (`Pipeline::fill_threads`), else on the caller.
/// Returns the bytes that arrived wrong and whether `fill(1)` ran after the thread had
/// opened the gate.
pub(crate) fn pipeline_behind_a_gate(opener: bool, fill_threads: usize) -> (usize, bool) {
    let len = 4 * MIB;
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, len).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let pattern = |b: usize| (b as u8).wrapping_mul(37).wrapping_add(1);
    // Allocated before the gate: nothing below allocates while the stream is held.
    let mut values: Vec<_> = (0..4)
        .map(|_| {
            let dev = pool.alloc::<u8>(len, &s).unwrap();
            let mut back: allocator_api2::vec::Vec<u8, PinnedAlloc> =
                allocator_api2::vec::Vec::new_in(PinnedAlloc);
            back.resize(len, 0);
            (dev, back)
        })
        .collect();
    s.synchronize().unwrap();
    let opened = AtomicUsize::new(0);
    let fill1_after_open = AtomicBool::new(false);
    let mut wrong = 0;
    let gate = Gate::hold(&s);
    std::thread::scope(|scope| {
        if opener {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                opened.store(1, Ordering::SeqCst);
                gate.open();
            });
        }
        let fill = |b: usize, buf: &mut [u8]| {
            if b == 1 {
                fill1_after_open.store(opened.load(Ordering::SeqCst) == 1, Ordering::SeqCst);
            }
            buf.fill(pattern(b));
            if b == 3 {
                gate.open();
            }
            Ok::<_, Error>(())
        };
        let launch = |_, buf: &Staged<PinnedAlloc>| {
            let (mut dev, mut back) = values.pop().expect("a value per batch");
            // SAFETY: the pipeline and the ring keep `buf` from the next fill until the
            // copy has completed (the property under test).
            unsafe { copy::host_to_device_async(buf, &mut dev, 0) }?;
            // SAFETY: `back` is read by the drain only, after the batch completed.
            unsafe { copy::device_to_host_async(&dev, 0, &mut back) }?;
            Ok((dev, back))
        };
        let drain = |b: usize, (_dev, back): (_, allocator_api2::vec::Vec<u8, PinnedAlloc>)| {
            wrong += back.iter().filter(|&&x| x != pattern(b)).count();
            Ok(())
        };
        let pipeline = ring.pipeline().in_flight(4);
        if fill_threads > 0 {
            pipeline
                .fill_threads(fill_threads)
                .run(4, fill, launch, drain)
                .map(drop)
        } else {
            pipeline.run(4, fill, launch, drain).map(drop)
        }
        .unwrap();
    });
    (wrong, fill1_after_open.load(Ordering::SeqCst))
}

#[test]
fn a_pipeline_with_more_batches_in_flight_than_buffers_waits_for_the_gpu() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (wrong, fill1_after_open) = pipeline_behind_a_gate(true, 0);
    assert!(
        fill1_after_open,
        "batch 1 refilled the buffer while batch 0's copy was held"
    );
    assert_eq!(wrong, 0, "bytes arrived wrong");
}

/// The negative control: without the ring's events (and without the pipeline's drain of
/// a buffer's last batch before its refill, its second guard) the pipeline refills the
/// buffer behind the held copies, and batches 0-2 arrive with batch 3's bytes.
#[cfg(feature = "test-hooks")]
#[test]
fn without_the_rings_events_a_pipeline_refills_buffers_the_gpu_still_reads() {
    gpu!();
    let _one = crate::one_at_a_time();
    if crate::support::in_a_child_process(
        "staging::without_the_rings_events_a_pipeline_refills_buffers_the_gpu_still_reads",
    ) {
        return;
    }
    cudalloc::staging::hooks::skip_release_events(true);
    let (wrong, _) = pipeline_behind_a_gate(false, 0);
    cudalloc::staging::hooks::skip_release_events(false);
    assert_eq!(wrong, 3 * 4 * MIB, "the refills did not reach the held copies");
}

/// Polls `event` until it has completed (never a blocking synchronize: the stream may be
/// held behind a gate); false after 10 s (a hang guard, not a timed assertion).
fn completes(event: &cudalloc::cuda::Event) -> bool {
    let t0 = Instant::now();
    while !event.is_complete().unwrap() {
        if t0.elapsed() > Duration::from_secs(10) {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

/// Leases the ring's only buffer, fills it with 0xAA and queues its copy to the device,
/// then (with `early`, after `last_use_queued`) a closed gate on the buffer's stream: the
/// rest of the batch (kernels, a copy back) held. Once the copy has completed the lease is
/// dropped and the buffer taken again (`try_next`) with the gate still closed; if it is
/// got, 0x55 is written into it (the next batch's fill). Opens the gate; returns whether
/// the buffer was got and how many bytes of the copy are not 0xAA.
fn refill_behind_the_rest_of_the_batch(early: bool) -> (bool, usize) {
    let len = 4 * MIB;
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, len).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let mut dev = pool.alloc::<u8>(len, &s).unwrap();
    let copied = cudalloc::cuda::Event::new(0).unwrap();
    let mut buf = ring.try_next().unwrap().expect("a fresh ring has a free buffer");
    buf.fill(0xAA);
    // SAFETY: nothing uses the buffer after this copy; the ring keeps it from the next
    // lease until the copy has completed (with `early`, the property under test).
    unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.unwrap();
    copied.record(&s).unwrap();
    if early {
        buf.last_use_queued().unwrap();
    }
    let gate = Gate::hold(&s);
    assert!(completes(&copied), "the copy did not complete");
    drop(buf);
    let got = ring.try_next().unwrap().map(|mut next| next.fill(0x55));
    gate.open();
    let back = dev.to_vec().unwrap();
    s.synchronize().unwrap();
    (got.is_some(), back.iter().filter(|&&b| b != 0xAA).count())
}

#[test]
fn after_last_use_queued_the_ring_hands_the_buffer_out_while_the_batch_still_runs() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (got, corrupted) = refill_behind_the_rest_of_the_batch(true);
    assert!(got, "the ring waited for the work queued after last_use_queued");
    assert_eq!(corrupted, 0, "the refill reached the copy");
    // The control: without it, the lease's drop records after the held work.
    let (got, corrupted) = refill_behind_the_rest_of_the_batch(false);
    assert!(!got, "the ring handed the buffer out before the held work ran");
    assert_eq!(corrupted, 0);
}

/// Leases a buffer of stream A, queues its copy on stream B behind a closed gate, calls
/// `last_use_queued` (nothing queued on A) and then, with `record`, `record_use(B)`;
/// drops the lease and takes the buffer again (`try_next`) with the gate still closed,
/// writing 0x55 into it if got. Opens the gate; returns whether the buffer was got and
/// how many bytes of the copy are not 0xAA.
fn use_on_another_stream_after_last_use_queued(record: bool) -> (bool, usize) {
    let len = 4 * MIB;
    let (a, b) = (Stream::new(0).unwrap(), Stream::new(0).unwrap());
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&a), 1, len).unwrap();
    let pool = DevicePool::get(0).unwrap();
    // Allocated before the gate: nothing below allocates while the stream is held.
    let mut dev = pool.alloc::<u8>(len, &b).unwrap();
    b.synchronize().unwrap();
    let gate = Gate::hold(&b);
    let mut buf = ring.try_next().unwrap().expect("a fresh ring has a free buffer");
    buf.fill(0xAA);
    // SAFETY: nothing writes the buffer while leased after this; with `record`, the ring
    // keeps it from the next lease until the copy (on `b`) has completed.
    unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.unwrap();
    buf.last_use_queued().unwrap();
    if record {
        buf.record_use(&b).unwrap();
    }
    drop(buf);
    let got = ring.try_next().unwrap().map(|mut next| next.fill(0x55));
    gate.open();
    let back = dev.to_vec().unwrap();
    b.synchronize().unwrap();
    (got.is_some(), back.iter().filter(|&&x| x != 0xAA).count())
}

#[test]
fn record_use_after_last_use_queued_still_covers_the_other_stream() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (got, corrupted) = use_on_another_stream_after_last_use_queued(true);
    assert!(!got, "handed out while the other stream's copy was held");
    assert_eq!(corrupted, 0, "corrupted bytes");
    // The negative control: without `record_use` the check sees the refill reach the copy.
    let (got, corrupted) = use_on_another_stream_after_last_use_queued(false);
    assert!(got, "the ring waited for a stream it was not told about");
    assert_eq!(corrupted, 4 * MIB, "the refill did not reach the held copy");
}
