//! The pipeline with its host fill on worker threads ([`Pipeline::fill_threads`]): the
//! issuing thread leases the ring's buffers, launches and drains in batch order, while
//! `n` scoped workers fill the next batches. Where the fill bounds a pipeline, the fill
//! and the issue no longer share one thread: the launches, event waits and drains of the
//! batches before run while the workers write the next ones.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;

use super::flight::{Flight, Lanes, RingLanes};
use super::{Pipeline, PipelineRun, Staged};
use crate::error::Error;
// The workers are never part of a loom model: `std`'s primitives always.
use crate::sync::global::{lock, mpsc, AtomicBool, Mutex, Ordering};

/// A [`Pipeline`] whose host fill runs on worker threads, made by
/// [`Pipeline::fill_threads`]: configure it, then [`run`](Self::run) it.
///
/// The issuing (calling) thread leases the ring's buffers in turn, hands each to a
/// worker with its batch number, and launches the filled batches in batch order, then
/// drains them in batch order, as [`Pipeline::run`] does. Up to
/// [`ahead`](Self::ahead) batches are leased for filling and not yet launched (default:
/// the workers plus one, at most the ring's buffers), so a worker finds its next batch
/// waiting when it is done with one. Every guarantee of [`Pipeline`] holds: a buffer is
/// handed to a worker only once the GPU is done with its last use (the ring waits for its
/// event: with [`Staged::last_use_queued`], the batch's upload), and its last batch is
/// drained before its next batch is launched (state kept per buffer, seen by the launch
/// only, is free to reuse): a worker fills batch i+S while batch i's kernels and copy
/// back still run.
#[derive(Debug)]
pub struct ThreadedPipeline<'r, A: Allocator> {
    pipeline: Pipeline<'r, A>,
    threads: usize,
    ahead: Option<usize>,
}

/// What a [`ThreadedPipeline::run`] did: the pipeline's counts and waits, and where the
/// fill's time went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive] // more of where the time went may come
pub struct ThreadedRun {
    /// Batches drained, and the issuing thread's waits for buffers and for the GPU.
    pub pipeline: PipelineRun,
    /// Time the issuing thread waited for a worker to finish the next batch's fill: most
    /// of the run where the fill bounds it.
    pub fill_wait: Duration,
    /// The workers' fill calls, summed over the workers. Divided by the batches, the
    /// time of one fill inside the run: above the fill's time alone, the fill is slowed
    /// by what runs beside it (the copies' memory traffic, the other workers).
    pub fill_busy: Duration,
}

impl<'r, A: Allocator> Pipeline<'r, A> {
    /// Runs the fill on `n` scoped worker threads while this thread launches and drains
    /// (see [`ThreadedPipeline`]). The fill must then be `Fn + Sync`: the workers share it
    /// by reference, so it may borrow the caller's data (the input it copies from) without
    /// a clone per thread; state of its own goes behind a lock or in a thread-local.
    /// [`ThreadedPipeline::run`] refuses `n == 0`.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, staging::StagingRing, PinnedAlloc};
    /// if let (Ok(a), Ok(b)) = (Stream::new(0), Stream::new(0)) {
    ///     let ring = StagingRing::new(PinnedAlloc, &[a, b], 2, 1 << 16).unwrap();
    ///     let data: Vec<u8> = (0..=255).collect(); // borrowed by every worker
    ///     let run = ring
    ///         .pipeline()
    ///         .fill_threads(2)
    ///         .run(
    ///             8,
    ///             |batch, buf| {
    ///                 buf.fill(data[batch]); // on a worker
    ///                 Ok::<_, cudalloc::Error>(())
    ///             },
    ///             |batch, lease| Ok((batch, lease[0])), // queue the batch's work on lease.stream()
    ///             |batch, (b, first)| {
    ///                 assert_eq!((b, first), (batch, batch as u8)); // in batch order
    ///                 Ok(())
    ///             },
    ///         )
    ///         .unwrap();
    ///     assert_eq!(run.pipeline.batches, 8);
    /// }
    /// ```
    pub fn fill_threads(self, n: usize) -> ThreadedPipeline<'r, A> {
        ThreadedPipeline {
            pipeline: self,
            threads: n,
            ahead: None,
        }
    }
}

impl<A: Allocator> ThreadedPipeline<'_, A> {
    /// As [`Pipeline::in_flight`]: at most `n` batches launched and not yet drained.
    pub fn in_flight(mut self, n: usize) -> Self {
        self.pipeline = self.pipeline.in_flight(n);
        self
    }

    /// As [`Pipeline::timeout`]: how long one lease waits at most for a free buffer.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.pipeline = self.pipeline.timeout(timeout);
        self
    }

    /// At most `n` batches leased for filling and not yet launched (default: the workers
    /// plus one). Clamped to the ring's buffers; more than the workers lets a worker start
    /// its next batch at once, fewer leaves workers idle. [`run`](Self::run) refuses 0.
    pub fn ahead(mut self, n: usize) -> Self {
        self.ahead = Some(n);
        self
    }

    fn ahead_now(&self) -> usize {
        self.ahead
            .unwrap_or(self.threads.saturating_add(1))
            .min(self.pipeline.ring.buffers())
    }
}

impl<A: Allocator + Send> ThreadedPipeline<'_, A> {
    /// Runs `batches` batches as [`Pipeline::run`] does, with `fill(batch, bytes)` called
    /// on the worker threads: `launch(batch, &lease)` and then, once its work completed,
    /// `drain(batch, value)` on the calling thread, both in batch order. Returns what it
    /// did ([`ThreadedRun`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for `fill_threads(0)`, `ahead(0)` or
    /// `in_flight(0)` (before any call); else the first error the calling thread sees (a
    /// fill's, a launch's, a drain's, or the driver's, converted into `E`). An error stops
    /// the run: no further batch is filled or launched, the batches in flight are waited
    /// for before their values are dropped and are not drained, and every buffer is back
    /// in the ring. A panic in a fill is resumed on the calling thread after the same
    /// clean-up.
    pub fn run<T, E, F, L, D>(
        &self,
        batches: usize,
        fill: F,
        launch: L,
        drain: D,
    ) -> core::result::Result<ThreadedRun, E>
    where
        E: From<Error> + Send,
        F: Fn(usize, &mut [u8]) -> core::result::Result<(), E> + Sync,
        L: FnMut(usize, &Staged<A>) -> core::result::Result<T, E>,
        D: FnMut(usize, T) -> core::result::Result<(), E>,
    {
        let lanes = RingLanes {
            ring: self.pipeline.ring,
            timeout: self.pipeline.timeout,
        };
        let shape = Shape {
            threads: self.threads,
            ahead: self.ahead_now(),
            in_flight: self.pipeline.in_flight,
            drain_before_launch: super::flight::drain_before_launch(),
        };
        run_threaded(&lanes, shape, batches, fill, launch, drain)
    }
}

/// The numbers of a threaded run.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) threads: usize,
    pub(super) ahead: usize,
    pub(super) in_flight: usize,
    /// Whether a buffer's last batch is drained before the buffer's next launch: always,
    /// but for the negative controls of `test-hooks`.
    pub(super) drain_before_launch: bool,
}

/// What a worker gives back: the batch, its lease, the fill's outcome (or its panic) and
/// how long the fill took.
type Filled<Lease, E> = (
    usize,
    Lease,
    std::thread::Result<core::result::Result<(), E>>,
    Duration,
);

/// The issuing thread's side: leases, hands out, launches and drains.
struct Issuer<B: Lanes, T, E> {
    /// The fill's waits and work (its `pipeline` part is the flight's, at the end).
    run: ThreadedRun,
    flight: Flight<B, T>,
    /// Filled batches not yet launched, by batch.
    ready: BTreeMap<usize, B::Lease>,
    /// Batches handed to the workers and not yet given back.
    at_workers: usize,
    _e: core::marker::PhantomData<E>,
}

/// The schedule of [`ThreadedPipeline::run`] over any [`Lanes`].
pub(super) fn run_threaded<B, T, E, F, L, D>(
    lanes: &B,
    shape: Shape,
    batches: usize,
    fill: F,
    mut launch: L,
    mut drain: D,
) -> core::result::Result<ThreadedRun, E>
where
    B: Lanes,
    B::Lease: Send,
    E: From<Error> + Send,
    F: Fn(usize, &mut [u8]) -> core::result::Result<(), E> + Sync,
    L: FnMut(usize, &B::Lease) -> core::result::Result<T, E>,
    D: FnMut(usize, T) -> core::result::Result<(), E>,
{
    if shape.threads == 0 || shape.ahead == 0 || shape.in_flight == 0 {
        return Err(Error::InvalidArgument(
            "a threaded pipeline needs at least one fill thread, one batch ahead and one in flight",
        )
        .into());
    }
    let mut issuer: Issuer<B, T, E> = Issuer {
        run: ThreadedRun::default(),
        flight: Flight::new(shape.in_flight, shape.drain_before_launch),
        ready: BTreeMap::new(),
        at_workers: 0,
        _e: core::marker::PhantomData,
    };
    let mut finish = |batch: usize, lease: &B::Lease, ()| launch(batch, lease);
    let stop = AtomicBool::new(false);
    let (job_tx, job_rx) = mpsc::channel::<(usize, B::Lease)>();
    let (done_tx, done_rx) = mpsc::channel::<Filled<B::Lease, E>>();
    let job_rx = Mutex::new(job_rx);
    let (fill, stop_ref, job_rx_ref) = (&fill, &stop, &job_rx);
    let mut panic = None;
    // More workers than batches, or than batches filled ahead, would only wait.
    let workers = shape.threads.min(shape.ahead).min(batches);
    let out = std::thread::scope(|scope| {
        let mut started = 0;
        for _ in 0..workers {
            let done_tx = done_tx.clone();
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || loop {
                // One worker waits in `recv` at a time; the others wait for the lock.
                let job = lock(job_rx_ref).recv();
                let Ok((batch, mut lease)) = job else { return };
                let t0 = Instant::now();
                let outcome = if stop_ref.load(Ordering::Relaxed) {
                    Ok(Ok(())) // the run is stopping: give the lease back unfilled
                } else {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fill(batch, &mut lease)))
                };
                if done_tx.send((batch, lease, outcome, t0.elapsed())).is_err() {
                    return;
                }
            });
            // The system may refuse a thread: the run goes on with those it has.
            if spawned.is_err() {
                break;
            }
            started += 1;
        }
        drop(done_tx);
        if started == 0 && workers > 0 {
            return Err(Error::InvalidArgument("the system started no fill thread").into());
        }
        let mut filled = |issuer: &mut Issuer<B, T, E>| -> core::result::Result<(), E> {
            let t0 = Instant::now();
            let got = done_rx.recv();
            issuer.run.fill_wait += t0.elapsed();
            let Ok((batch, lease, outcome, took)) = got else {
                return Err(Error::InvalidArgument("the fill threads stopped").into());
            };
            issuer.at_workers -= 1;
            issuer.run.fill_busy += took;
            issuer.ready.insert(batch, lease);
            match outcome {
                Ok(r) => r,
                Err(p) => {
                    panic = Some(p);
                    Err(Error::InvalidArgument("a fill panicked").into())
                }
            }
        };
        let mut schedule = || -> core::result::Result<(), E> {
            let (mut next_fill, mut next_launch) = (0, 0);
            while next_launch < batches {
                if let Some(lease) = issuer.ready.remove(&next_launch) {
                    // One closure for the whole launch: the second half of a split launch
                    // whose first half queues nothing.
                    let halves = (
                        &mut |_: usize, _: &B::Lease| Ok::<(), E>(()),
                        &mut finish,
                        &mut drain,
                    );
                    issuer.flight.launch(lanes, next_launch, lease, halves)?;
                    next_launch += 1;
                    continue;
                }
                let leased = next_fill - next_launch; // at the workers or ready
                if next_fill < batches && leased < shape.ahead {
                    // Wait for the GPU only when no worker is busy: a fill coming back
                    // first is launched first.
                    let t0 = Instant::now();
                    let lease = if issuer.at_workers == 0 {
                        Some(lanes.lease()?)
                    } else {
                        lanes.try_lease()?
                    };
                    issuer.flight.run.buffer_wait += t0.elapsed();
                    if let Some(lease) = lease {
                        // Filled at once, even while the buffer's last batch still runs:
                        // that batch is drained before this one's launch.
                        issuer.at_workers += 1;
                        if let Err(mpsc::SendError((_, lease))) = job_tx.send((next_fill, lease)) {
                            issuer.at_workers -= 1;
                            drop(lease);
                            return Err(Error::InvalidArgument("the fill threads stopped").into());
                        }
                        next_fill += 1;
                        continue;
                    }
                }
                filled(&mut issuer)?;
            }
            issuer.flight.drain_all(&mut drain)
        };
        let out = schedule();
        // Stop the workers and take back the leases they hold (unlaunched: nothing of
        // theirs is queued on the GPU).
        stop.store(true, Ordering::Relaxed);
        drop(job_tx);
        while issuer.at_workers > 0 {
            match done_rx.recv() {
                Ok((_, lease, outcome, _)) => {
                    issuer.at_workers -= 1;
                    drop(lease);
                    if let (Err(p), None) = (outcome, &panic) {
                        panic = Some(p);
                    }
                }
                Err(_) => break,
            }
        }
        out
    });
    issuer.ready.clear();
    if out.is_err() {
        issuer.flight.abandon_all();
    }
    if let Some(p) = panic {
        std::panic::resume_unwind(p);
    }
    out.map(|()| ThreadedRun {
        pipeline: issuer.flight.run,
        ..issuer.run
    })
}

#[cfg(all(test, not(loom)))]
mod tests;
