//! The double-buffered pipeline over a [`StagingRing`]: the user gives the host fill, the
//! launch (work queued on the buffer's stream) and the drain (run once the batch's work
//! has completed); the helper leases the buffers, keeps up to `in_flight` batches queued
//! on the GPU and records and waits for the events, so batch i+1's fill and copy overlap
//! batch i's compute on as many streams as the ring has. A buffer's last batch is drained
//! before the buffer's next batch is launched, not before it is filled: with
//! [`Staged::last_use_queued`] after the upload, the fill of the next batch in a buffer
//! overlaps the kernels and the copy back of the last one.

use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;

use super::flight::{drain_before_launch, Flight, Lanes, RingLanes};
use super::{Staged, StagingRing};
use crate::error::Error;

/// A double-buffered pipeline over a [`StagingRing`], made by
/// [`StagingRing::pipeline`]: configure it, then [`run`](Self::run) it.
///
/// Each batch: a buffer of the ring is leased (once the GPU is done with its last use),
/// `fill` writes the batch into it on the host, `launch` queues the batch's work on the
/// buffer's stream (the copy to the device, kernels, a copy back) and returns what the
/// drain needs; the helper records an event after that work and calls `drain` with the
/// launch's value once the event has completed, while later batches are being filled and
/// run. Up to `in_flight` batches (default: the ring's buffer count) are launched and not
/// yet drained, a limit enforced before each launch (after the fill); consecutive batches
/// go to the ring's streams in turn.
///
/// A buffer is filled once the ring hands it out (the GPU is done with its last use), and
/// its last batch is drained before its next batch is launched: device buffers or host
/// outputs kept per ring buffer (indexed by [`Staged::index`], which only the launch
/// sees) are reused safely without a free list. Call [`Staged::last_use_queued`] in the
/// launch right after the upload: the ring then hands the buffer out once the upload has
/// completed, and the next batch's fill runs while the last one's kernels and copy back
/// do; without it the ring waits for everything the launch queued. With one buffer per
/// stream, [`run_split`](Self::run_split) also queues the buffer's next upload and kernels
/// before its last batch is drained (the hand-written loop's overlap), and only the copy
/// back into per-buffer state after.
#[derive(Debug)]
pub struct Pipeline<'r, A: Allocator> {
    pub(super) ring: &'r StagingRing<A>,
    pub(super) in_flight: usize,
    pub(super) timeout: Duration,
}

/// What a [`Pipeline::run`] did: the batches drained and where the issuing thread waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PipelineRun {
    /// Batches filled, launched and drained.
    pub batches: usize,
    /// Time spent waiting for a staging buffer the GPU still used.
    pub buffer_wait: Duration,
    /// Time spent waiting for a batch's work to complete before its drain.
    pub drain_wait: Duration,
}

impl<A: Allocator> StagingRing<A> {
    /// A double-buffered [`Pipeline`] over this ring (see its docs; `in_flight` defaults
    /// to [`buffers`](Self::buffers), the lease timeout to 10 s).
    ///
    /// ```
    /// use cudalloc::{copy, cuda::Stream, device::DevicePool, staging::StagingRing, PinnedAlloc};
    /// if let (Ok(a), Ok(b)) = (Stream::new(0), Stream::new(0)) {
    ///     let ring = StagingRing::new(PinnedAlloc, &[a, b], 2, 1 << 16).unwrap();
    ///     let pool = DevicePool::get(0).unwrap();
    ///     let run = ring
    ///         .pipeline()
    ///         .run(
    ///             8,
    ///             |batch, buf| {
    ///                 buf.fill(batch as u8); // the host fill
    ///                 Ok::<_, cudalloc::Error>(())
    ///             },
    ///             |_, buf| {
    ///                 let mut dev = pool.alloc::<u8>(buf.len(), buf.stream())?;
    ///                 // SAFETY: nothing uses `buf` after this copy (said just below); the
    ///                 // ring does not hand it out again before the copy has completed.
    ///                 unsafe { copy::host_to_device_async(buf, &mut dev, 0) }?;
    ///                 buf.last_use_queued()?; // the next fill need not wait for the rest
    ///                 // ... kernels on buf.stream() ...
    ///                 let mut back = vec![0u8; buf.len()];
    ///                 // SAFETY: `back` is read only by the drain, after the copy completed.
    ///                 unsafe { copy::device_to_host_async(&dev, 0, &mut back) }?;
    ///                 Ok((dev, back))
    ///             },
    ///             |batch, (_dev, back)| {
    ///                 assert!(back.iter().all(|&b| b == batch as u8)); // the host check
    ///                 Ok(())
    ///             },
    ///         )
    ///         .unwrap();
    ///     assert_eq!(run.batches, 8);
    /// }
    /// ```
    pub fn pipeline(&self) -> Pipeline<'_, A> {
        Pipeline {
            ring: self,
            in_flight: self.buffers(),
            timeout: Duration::from_secs(10),
        }
    }
}

impl<'r, A: Allocator> Pipeline<'r, A> {
    /// At most `n` batches launched and not yet drained (at least 1; 2 on one stream is
    /// double buffering). More than the ring's buffers adds nothing: a batch waits for a
    /// buffer anyway. [`run`](Self::run) refuses 0.
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n;
        self
    }

    /// How long one batch waits at most for a free staging buffer (default 10 s) before
    /// [`run`](Self::run) fails with [`Error::TimedOut`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs `batches` batches: for each, `fill(batch, bytes)` on the host, then
    /// `launch(batch, &lease)` queues its work on `lease.stream()` and returns a value
    /// (device buffers, a host buffer a copy back writes), then, once that work has
    /// completed, `drain(batch, value)`. Batches are drained in order; a buffer's last
    /// batch before the buffer's next launch. Returns what it did ([`PipelineRun`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for `in_flight(0)` (before any call); the first
    /// error of a closure or of the driver (a CUDA error, [`Error::TimedOut`] for a
    /// buffer), converted into `E`. On an error the batches in flight are waited for
    /// (their values are dropped only once the GPU is done with them) and not drained.
    pub fn run<T, E, F, L, D>(
        &self,
        batches: usize,
        fill: F,
        mut launch: L,
        drain: D,
    ) -> core::result::Result<PipelineRun, E>
    where
        E: From<Error>,
        F: FnMut(usize, &mut [u8]) -> core::result::Result<(), E>,
        L: FnMut(usize, &Staged<A>) -> core::result::Result<T, E>,
        D: FnMut(usize, T) -> core::result::Result<(), E>,
    {
        // The whole launch waits for the buffer's last drain: it is the second half of a
        // split launch whose first half queues nothing.
        self.run_split(
            batches,
            fill,
            |_, _| Ok(()),
            |batch, lease, ()| launch(batch, lease),
            drain,
        )
    }

    /// [`run`](Self::run) with the launch in two halves, so that a buffer's next batch is
    /// queued on the GPU before its last batch is drained, as a hand-written loop does:
    /// `launch(batch, &lease)` queues the upload and the kernels, and must not write what
    /// the drain of the buffer's last batch reads (kept per buffer, [`Staged::index`]);
    /// then the helper drains that batch (and any beyond the in-flight limit); then
    /// `finish(batch, &lease, launched)` queues the rest, typically the copy back into the
    /// buffer's host output, and returns the drain's value. The stream stays busy while
    /// the host checks the last batch: with one buffer per stream the upload and the
    /// kernels of batch i+S no longer wait for batch i's check.
    ///
    /// Device memory that the launch overwrites (the buffer's device input and output) is
    /// ordered by the stream: its last batch's kernels and copy back were queued on the
    /// same stream before it. Errors as for [`run`](Self::run); work queued by a launch
    /// whose finish did not run is waited for before its value is dropped.
    ///
    /// ```
    /// use cudalloc::{copy, cuda::Stream, device::DevicePool, staging::StagingRing, PinnedAlloc};
    /// if let (Ok(a), Ok(b)) = (Stream::new(0), Stream::new(0)) {
    ///     // One buffer per stream, with a device buffer and a host output kept per buffer.
    ///     let streams = [a, b];
    ///     let ring = StagingRing::new(PinnedAlloc, &streams, 1, 1 << 16).unwrap();
    ///     let pool = DevicePool::get(0).unwrap();
    ///     // Buffer k is on stream k.
    ///     let dev: Vec<_> = streams
    ///         .iter()
    ///         .map(|s| pool.alloc::<u8>(1 << 16, s).unwrap())
    ///         .collect();
    ///     let dev = std::cell::RefCell::new(dev);
    ///     let outputs = std::cell::RefCell::new(vec![vec![0u8; 1 << 16]; 2]);
    ///     let run = ring
    ///         .pipeline()
    ///         .run_split(
    ///             8,
    ///             |batch, buf| {
    ///                 buf.fill(batch as u8); // the host fill
    ///                 Ok::<_, cudalloc::Error>(())
    ///             },
    ///             |_, buf| {
    ///                 // SAFETY: nothing uses `buf` after this copy (said just below); the
    ///                 // ring does not hand it out again before the copy has completed.
    ///                 unsafe { copy::host_to_device_async(buf, &mut dev.borrow_mut()[buf.index()], 0) }?;
    ///                 buf.last_use_queued()?;
    ///                 // ... kernels on buf.stream() ...
    ///                 Ok(())
    ///             },
    ///             |_, buf, ()| {
    ///                 // The buffer's last batch has been drained: its output is free.
    ///                 let out = &mut outputs.borrow_mut()[buf.index()];
    ///                 // SAFETY: the drain reads `out` only after this copy completed, and
    ///                 // the next copy into it is queued only after that drain.
    ///                 unsafe { copy::device_to_host_async(&dev.borrow()[buf.index()], 0, out) }?;
    ///                 Ok(buf.index())
    ///             },
    ///             |batch, k| {
    ///                 assert!(outputs.borrow()[k].iter().all(|&b| b == batch as u8));
    ///                 Ok(())
    ///             },
    ///         )
    ///         .unwrap();
    ///     assert_eq!(run.batches, 8);
    /// }
    /// ```
    pub fn run_split<T, U, E, F, L, N, D>(
        &self,
        batches: usize,
        fill: F,
        launch: L,
        finish: N,
        drain: D,
    ) -> core::result::Result<PipelineRun, E>
    where
        E: From<Error>,
        F: FnMut(usize, &mut [u8]) -> core::result::Result<(), E>,
        L: FnMut(usize, &Staged<A>) -> core::result::Result<T, E>,
        N: FnMut(usize, &Staged<A>, T) -> core::result::Result<U, E>,
        D: FnMut(usize, U) -> core::result::Result<(), E>,
    {
        let lanes = RingLanes {
            ring: self.ring,
            timeout: self.timeout,
        };
        let halves = (fill, launch, finish, drain);
        run_on(&lanes, self.in_flight, drain_before_launch(), batches, halves)
    }
}

/// The schedule of [`Pipeline::run_split`] over any [`Lanes`] (the ring, or a model of it
/// in the tests): lease, fill, and [`Flight::launch`], batch by batch, then drain the rest.
pub(super) fn run_on<B, V, T, E, F, L, N, D>(
    lanes: &B,
    in_flight: usize,
    drain_before_launch: bool,
    batches: usize,
    (mut fill, mut launch, mut finish, mut drain): (F, L, N, D),
) -> core::result::Result<PipelineRun, E>
where
    B: Lanes,
    E: From<Error>,
    F: FnMut(usize, &mut [u8]) -> core::result::Result<(), E>,
    L: FnMut(usize, &B::Lease) -> core::result::Result<V, E>,
    N: FnMut(usize, &B::Lease, V) -> core::result::Result<T, E>,
    D: FnMut(usize, T) -> core::result::Result<(), E>,
{
    if in_flight == 0 {
        return Err(Error::InvalidArgument("a pipeline needs at least one batch in flight").into());
    }
    let mut flight: Flight<B, T> = Flight::new(in_flight, drain_before_launch);
    let out = (|| {
        for batch in 0..batches {
            let t0 = Instant::now();
            let mut lease = lanes.lease()?;
            flight.run.buffer_wait += t0.elapsed();
            // The ring handed it out: the GPU is done with its bytes (the fill sees
            // nothing else), while the buffer's last batch may still run.
            fill(batch, &mut lease)?;
            flight.launch(lanes, batch, lease, (&mut launch, &mut finish, &mut drain))?;
        }
        flight.drain_all(&mut drain)
    })();
    if out.is_err() {
        flight.abandon_all();
    }
    out.map(|()| flight.run)
}
