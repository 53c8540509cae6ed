//! What both pipelines run on: the ring as [`Lanes`] (leases, completions, waits), and
//! the batches launched and not yet drained ([`Flight`]): the in-flight limit, the drain
//! of a buffer's last batch before its next finish, the launch in two halves, and the wait
//! for every batch in flight after an error. One part for the single-threaded
//! [`Pipeline`](super::Pipeline) and the threaded one, so that both order a batch's work
//! the same way and their schedules are tested on the host against a model of the ring
//! (`threaded/tests.rs`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;

use super::{PipelineRun, Staged, StagingRing};
use crate::cuda::Event;
use crate::error::{Error, Result};

/// The ring's side of a pipeline run, apart so that the schedules are tested on the host
/// (a model of the ring, without a driver) and run on the ring unchanged.
pub(super) trait Lanes {
    /// A leased buffer: the workers write its bytes.
    type Lease: core::ops::DerefMut<Target = [u8]>;
    /// A launched batch's completion.
    type Done;
    /// A free buffer the GPU is done with, now, if any.
    fn try_lease(&self) -> Result<Option<Self::Lease>>;
    /// A free buffer, waiting for the GPU (with the pipeline's deadline).
    fn lease(&self) -> Result<Self::Lease>;
    /// Which buffer of the ring it is.
    fn index(lease: &Self::Lease) -> usize;
    /// After a launch: marks the end of the work queued so far with the lease (reusing a
    /// spare completion) and gives the buffer back. An error leaves no work untracked.
    fn launched(&self, lease: Self::Lease, spare: &mut Vec<Self::Done>) -> Result<Self::Done>;
    /// After a failed launch: waits for whatever it queued, then gives the buffer back.
    fn abandon(&self, lease: Self::Lease);
    /// Waits for a launched batch's work.
    fn wait(done: &Self::Done) -> Result<()>;
}

pub(super) struct RingLanes<'r, A: Allocator> {
    pub(super) ring: &'r StagingRing<A>,
    pub(super) timeout: Duration,
}

impl<A: Allocator> Lanes for RingLanes<'_, A> {
    type Lease = Staged<A>;
    type Done = Event;

    fn try_lease(&self) -> Result<Option<Staged<A>>> {
        self.ring.try_next()
    }

    fn lease(&self) -> Result<Staged<A>> {
        self.ring.next(self.timeout)
    }

    fn index(lease: &Staged<A>) -> usize {
        lease.index()
    }

    fn launched(&self, lease: Staged<A>, spare: &mut Vec<Event>) -> Result<Event> {
        let recorded = (|| {
            let done = match spare.pop() {
                Some(e) => e,
                None => Event::new(lease.stream().device())?,
            };
            done.record(lease.stream())?;
            Ok(done)
        })();
        if recorded.is_err() {
            // The batch's work is not tracked: wait for it before its value is dropped.
            let _ = lease.stream().synchronize();
        }
        // The lease, dropped here, records the ring's own event after the batch's work
        // (unless the launch did, with `last_use_queued`).
        drop(lease);
        recorded
    }

    fn abandon(&self, lease: Staged<A>) {
        let _ = lease.stream().synchronize();
    }

    fn wait(done: &Event) -> Result<()> {
        done.synchronize()
    }
}

/// Whether a buffer's last batch is drained before the buffer's next launch: always, but
/// for the negative controls of `test-hooks` ([`super::hooks::skip_release_events`]).
pub(super) fn drain_before_launch() -> bool {
    #[cfg(feature = "test-hooks")]
    if super::hooks::SKIP_RELEASE_EVENT.load(crate::sync::global::Ordering::SeqCst) {
        return false;
    }
    true
}

impl<B: Lanes, T> Drop for Flight<B, T> {
    /// Unwinding from a closure's panic: the batches in flight are waited for before
    /// their values are dropped, as after an error (empty otherwise: every run drains or
    /// abandons them).
    fn drop(&mut self) {
        self.abandon_all();
    }
}

/// A launched batch waiting for its drain.
struct InFlight<T, Done> {
    batch: usize,
    /// The ring's buffer it was staged in (`Lanes::index`).
    buffer: usize,
    done: Done,
    value: T,
}

/// The launched batches, oldest first, with what the launches and drains cost.
pub(super) struct Flight<B: Lanes, T> {
    queue: VecDeque<InFlight<T, B::Done>>,
    /// Completions of drained batches, recorded again by later ones.
    spare: Vec<B::Done>,
    /// The most batches launched and not yet drained.
    in_flight: usize,
    /// Whether a buffer's last batch is drained before the buffer's next finish (always,
    /// but for the negative controls of `test-hooks`).
    drain_before_launch: bool,
    /// Batches drained, and the waits for buffers (kept by the caller) and for batches.
    pub(super) run: PipelineRun,
}

impl<B: Lanes, T> Flight<B, T> {
    pub(super) fn new(in_flight: usize, drain_before_launch: bool) -> Self {
        Self {
            // A hint only: `in_flight` is the caller's, and may be any number.
            queue: VecDeque::with_capacity(in_flight.min(64)),
            spare: Vec::new(),
            in_flight,
            drain_before_launch,
            run: PipelineRun::default(),
        }
    }

    /// Launches batch `batch` staged in `lease`, in two halves: `launch` (the upload and
    /// the kernels, which write nothing the drain of the buffer's last batch reads), then
    /// room (the in-flight limit, and that last batch drained, so that state kept per
    /// buffer is free), then `finish` (the rest, typically the copy back into that state),
    /// then the batch's completion is recorded and the lease goes back to the ring.
    ///
    /// On an error, work the batch queued is waited for before its values are dropped
    /// (through `Lanes::abandon` or `Lanes::launched`), so nothing of it still runs.
    pub(super) fn launch<V, E, L, N, D>(
        &mut self,
        lanes: &B,
        batch: usize,
        lease: B::Lease,
        (launch, finish, drain): (&mut L, &mut N, &mut D),
    ) -> core::result::Result<(), E>
    where
        E: From<Error>,
        L: FnMut(usize, &B::Lease) -> core::result::Result<V, E>,
        N: FnMut(usize, &B::Lease, V) -> core::result::Result<T, E>,
        D: FnMut(usize, T) -> core::result::Result<(), E>,
    {
        let buffer = B::index(&lease);
        let first = match launch(batch, &lease) {
            Ok(v) => v,
            Err(e) => {
                lanes.abandon(lease);
                return Err(e);
            }
        };
        // The drain may panic: `first` (work already queued) is then dropped only after
        // that work, as on an error.
        let room = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.make_room(buffer, drain)));
        match room {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                lanes.abandon(lease);
                drop(first);
                return Err(e);
            }
            Err(panic) => {
                lanes.abandon(lease);
                drop(first);
                std::panic::resume_unwind(panic);
            }
        }
        let value = match finish(batch, &lease, first) {
            Ok(v) => v,
            Err(e) => {
                lanes.abandon(lease);
                return Err(e);
            }
        };
        let done = match lanes.launched(lease, &mut self.spare) {
            Ok(done) => done,
            Err(e) => {
                // `launched` waited for the work: the value is free to drop.
                drop(value);
                return Err(e.into());
            }
        };
        self.queue.push_back(InFlight {
            batch,
            buffer,
            done,
            value,
        });
        Ok(())
    }

    /// Drains the oldest batches until fewer than the in-flight limit are launched and
    /// none of them is in buffer `buffer`.
    fn make_room<E, D>(&mut self, buffer: usize, drain: &mut D) -> core::result::Result<(), E>
    where
        E: From<Error>,
        D: FnMut(usize, T) -> core::result::Result<(), E>,
    {
        if self.queue.len() >= self.in_flight {
            self.drain_oldest(drain)?;
        }
        while self.drain_before_launch && self.queue.iter().any(|q| q.buffer == buffer) {
            self.drain_oldest(drain)?;
        }
        Ok(())
    }

    /// Drains every launched batch, in order.
    pub(super) fn drain_all<E, D>(&mut self, drain: &mut D) -> core::result::Result<(), E>
    where
        E: From<Error>,
        D: FnMut(usize, T) -> core::result::Result<(), E>,
    {
        while !self.queue.is_empty() {
            self.drain_oldest(drain)?;
        }
        Ok(())
    }

    /// Drains the oldest launched batch, once its work has completed.
    fn drain_oldest<E, D>(&mut self, drain: &mut D) -> core::result::Result<(), E>
    where
        E: From<Error>,
        D: FnMut(usize, T) -> core::result::Result<(), E>,
    {
        let Some(oldest) = self.queue.front() else {
            return Ok(());
        };
        let t0 = Instant::now();
        // An error leaves the batch in the queue: `abandon_all` waits for it.
        B::wait(&oldest.done)?;
        self.run.drain_wait += t0.elapsed();
        let Some(InFlight {
            batch, done, value, ..
        }) = self.queue.pop_front()
        else {
            return Ok(());
        };
        self.spare.push(done);
        drain(batch, value)?;
        self.run.batches += 1;
        Ok(())
    }

    /// After an error: waits for every batch still in flight before dropping its value
    /// (the values may hold memory the GPU still writes), undrained.
    pub(super) fn abandon_all(&mut self) {
        for b in self.queue.drain(..) {
            if B::wait(&b.done).is_err() {
                // Its state is unknown: leak the value rather than free memory in use.
                core::mem::forget(b.value);
            }
        }
    }
}
