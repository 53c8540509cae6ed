//! Staging rings: a fixed set of host-visible buffers, each bound to a stream, handed out
//! in turn once the GPU work that last used a buffer has completed. The event bookkeeping
//! of a hand-written staging loop (a buffer per stream, an event per buffer, a wait before
//! each refill) in one type, blocking ([`StagingRing::next`], with a deadline), non-blocking
//! ([`StagingRing::try_next`]) and async ([`StagingRing::next_async`]).
//!
//! A lease ([`Staged`]) derefs to its bytes. Queue any work that uses them on the lease's
//! [`stream`](Staged::stream): the crate's copies, cudarc's copies through the stream's
//! view, kernels. When the lease is dropped the ring records an event at the end of that
//! stream, so every use queued there while the lease lived is covered and nobody records
//! an event by hand; the buffer is handed out again only once that event has completed.
//! Work on another stream is covered by [`Staged::record_use`]. Where the buffer's last
//! use is an upload followed by kernels and a copy back, [`Staged::last_use_queued`]
//! records the event right after the upload: the ring hands the buffer out again once
//! the upload has completed, while the rest of the batch still runs.
//!
//! [`StagingRing::pipeline`] runs the whole double-buffered loop over a ring: the user
//! gives the host fill, the launch and the drain ([`Pipeline`]), the fill on worker threads
//! if asked ([`Pipeline::fill_threads`], [`ThreadedPipeline`]).
//!
//! ```
//! use cudalloc::{cuda::Stream, staging::StagingRing, PinnedAlloc};
//! use std::time::Duration;
//! if let Ok(stream) = Stream::new(0) {
//!     let ring = StagingRing::new(PinnedAlloc, &[stream], 2, 1 << 20).unwrap();
//!     let pool = cudalloc::device::DevicePool::get(0).unwrap();
//!     for batch in 0..8u8 {
//!         let mut buf = ring.next(Duration::from_secs(10)).unwrap(); // polls up to 200 us, then parks until the GPU is done
//!         buf.fill(batch);
//!         let mut dev = pool.alloc::<u8>(buf.len(), buf.stream()).unwrap();
//!         // SAFETY: `buf` is not written again before the ring hands it out, which is
//!         // after the copy has completed.
//!         unsafe { cudalloc::copy::host_to_device_async(&buf, &mut dev, 0) }.unwrap();
//!     } // each lease, dropped, records its stream's event
//! }
//! ```

use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll, Waker};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use allocator_api2::vec::Vec;

use crate::cuda::{Event, EventCompleted, Stream};
use crate::error::{Error, Result};
use crate::sync::global::{AtomicBool, Ordering};
use crate::sync::{lock, Arc, Mutex};

mod flight;
mod pipeline;
mod threaded;
pub use pipeline::{Pipeline, PipelineRun};
pub use threaded::{ThreadedPipeline, ThreadedRun};

/// A ring of host-visible staging buffers from any allocator of host memory (
/// [`PinnedAlloc`](crate::PinnedAlloc), `&Pool<S>`, `&Arena<S>`, ...), `per_stream` of them
/// for each of its streams, handed out in turn once the GPU is done with them. A cheap,
/// cloneable handle (clones share the ring): tasks and threads share one ring.
///
/// See the [module docs](self) for how uses are recorded.
pub struct StagingRing<A: Allocator> {
    inner: Arc<RingInner<A>>,
}

impl<A: Allocator> Clone for StagingRing<A> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<A: Allocator> core::fmt::Debug for StagingRing<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StagingRing")
            .field("buffers", &self.inner.buffers)
            .field("buffer_len", &self.inner.buffer_len)
            .field("free", &lock(&self.inner.state).free.len())
            .finish()
    }
}

struct RingInner<A: Allocator> {
    state: Mutex<RingState<A>>,
    buffers: usize,
    buffer_len: usize,
}

impl<A: Allocator> Drop for RingInner<A> {
    /// The last handle and the last lease are gone: the buffers go back to their
    /// allocator, but only once the GPU is done with them (the events the ring waits for
    /// before a reuse), so that no copy or kernel still queued reads or writes memory the
    /// allocator may hand to someone else. A buffer whose event cannot be waited for is
    /// leaked, as a lease whose use could not be recorded is.
    fn drop(&mut self) {
        for slot in core::mem::take(&mut lock(&self.state).free) {
            let Some(e) = &slot.last_use else { continue };
            if let Err(e) = e.synchronize() {
                crate::cuda::record_drop_error("waiting for a staging buffer's last use", e);
                core::mem::forget(slot.buf);
            }
        }
    }
}

struct RingState<A: Allocator> {
    /// Buffers not leased, in the order they were given back (the front was used
    /// longest ago). `free.len() + leased == buffers`.
    free: VecDeque<Slot<A>>,
    /// Tasks and threads waiting for a buffer to be given back, by future
    /// ([`NextStaged::id`]): one entry each, which the future's drop removes, so that a
    /// dropped future is woken by no later give-back and timed-out waits leave nothing.
    waiters: std::vec::Vec<(u64, Waker)>,
    /// Takers now checking buffers moved out of `free` (with the lock released).
    scanning: usize,
    /// A taker found `free` empty while `scanning > 0`: the put-back wakes the waiters.
    missed: bool,
}

impl<A: Allocator> RingState<A> {
    fn register(&mut self, (id, waker): (u64, &Waker)) {
        match self.waiters.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) => w.clone_from(waker),
            None => self.waiters.push((id, waker.clone())),
        }
    }

    /// The wakers to wake, taken out (woken with no lock held).
    fn take_waiters(&mut self) -> std::vec::Vec<(u64, Waker)> {
        core::mem::take(&mut self.waiters)
    }
}

/// Wakes the wakers taken out by [`RingState::take_waiters`].
fn wake_all(waiters: std::vec::Vec<(u64, Waker)>) {
    waiters.into_iter().for_each(|(_, w)| w.wake());
}

/// Numbers the ring's futures ([`NextStaged::id`]).
static NEXT_WAITER: crate::sync::global::AtomicU64 = crate::sync::global::AtomicU64::new(0);

impl<A: Allocator> RingState<A> {
    fn forget_waiter(&mut self, id: u64) {
        self.waiters.retain(|(i, _)| *i != id);
    }
}

struct Slot<A: Allocator> {
    buf: Vec<u8, A>,
    stream: Stream,
    /// Recorded on `stream` after the last lease's last use ([`Staged::last_use_queued`],
    /// or when it was dropped); made on the first lease (not recorded: complete). `None`
    /// before the first lease, and after a failed record (the stream was waited for).
    last_use: Option<Event>,
    index: usize,
}

impl<A: Allocator> Slot<A> {
    /// Whether the GPU is done with the buffer (an error counts as an error, not as done:
    /// the ring has no way to know the buffer is free).
    fn is_free(&self) -> Result<bool> {
        self.last_use.as_ref().map_or(Ok(true), Event::is_complete)
    }
}

/// What one attempt to take a buffer found.
enum Take<A: Allocator> {
    Ready(Slot<A>),
    /// Every free buffer is still in use by the GPU: the completions of the one used
    /// longest ago on each stream.
    Pending(std::vec::Vec<EventCompleted>),
    /// Every buffer is leased.
    Empty,
}

impl<A: Allocator + Clone> StagingRing<A> {
    /// A ring of `per_stream` buffers of `buffer_len` bytes (zeroed) for each of `streams`,
    /// allocated from `alloc` now. Errors: [`Error::InvalidArgument`] for no streams, no
    /// buffers or empty buffers; [`Error::OutOfMemory`] when `alloc` fails.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, staging::StagingRing, Arena, PinnedAlloc, Pool};
    /// if let (Ok(a), Ok(b)) = (Stream::new(0), Stream::new(0)) {
    ///     let streams = [a, b];
    ///     let ring = StagingRing::new(PinnedAlloc, &streams, 2, 1 << 16).unwrap();
    ///     assert_eq!((ring.buffers(), ring.buffer_len()), (4, 1 << 16));
    ///     let pool = Pool::new(cudalloc::source::PinnedSource::default());
    ///     let from_pool = StagingRing::new(&pool, &streams, 1, 4096).unwrap();
    ///     let arena = Arena::pinned();
    ///     let from_arena = StagingRing::new(&arena, &streams, 1, 4096).unwrap();
    ///     # drop((from_pool, from_arena));
    /// }
    /// assert!(StagingRing::new(PinnedAlloc, &[], 1, 4096).is_err()); // no streams
    /// ```
    pub fn new(alloc: A, streams: &[Stream], per_stream: usize, buffer_len: usize) -> Result<Self> {
        if streams.is_empty() || per_stream == 0 || buffer_len == 0 {
            return Err(Error::InvalidArgument(
                "a staging ring needs at least one stream, one buffer per stream, and buffers of at least one byte",
            ));
        }
        let buffers = streams
            .len()
            .checked_mul(per_stream)
            .ok_or(Error::InvalidArgument("too many staging buffers"))?;
        let mut free = VecDeque::new();
        free.try_reserve_exact(buffers).map_err(|_| Error::OutOfMemory {
            requested: buffers.saturating_mul(core::mem::size_of::<Slot<A>>()),
        })?;
        // Interleaved by stream (s0, s1, .., s0, s1, ..): handed out in turn, consecutive
        // leases go to different streams, as a multi-stream pipeline wants.
        for round in 0..per_stream {
            for (k, stream) in streams.iter().enumerate() {
                let mut buf = Vec::new_in(alloc.clone());
                buf.try_reserve_exact(buffer_len)
                    .map_err(|_| Error::OutOfMemory {
                        requested: buffer_len,
                    })?;
                buf.resize(buffer_len, 0);
                free.push_back(Slot {
                    buf,
                    stream: stream.clone(),
                    last_use: None,
                    index: round * streams.len() + k,
                });
            }
        }
        Ok(Self {
            inner: Arc::new(RingInner {
                state: Mutex::new(RingState {
                    free,
                    waiters: std::vec::Vec::new(),
                    scanning: 0,
                    missed: false,
                }),
                buffers,
                buffer_len,
            }),
        })
    }
}

impl<A: Allocator> StagingRing<A> {
    /// How many buffers the ring holds.
    pub fn buffers(&self) -> usize {
        self.inner.buffers
    }

    /// The length of each buffer in bytes.
    pub fn buffer_len(&self) -> usize {
        self.inner.buffer_len
    }

    /// The next buffer the GPU is done with, if there is one now. Never blocks.
    ///
    /// `None` while another thread's `next`, `try_next` or future is checking the free
    /// buffers' events (they are out of the list for that moment), even if one of them
    /// is free: a caller that must have a buffer waits with [`next`](Self::next) or
    /// [`next_async`](Self::next_async), which see every buffer given back.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, staging::StagingRing, PinnedAlloc};
    /// if let Ok(s) = Stream::new(0) {
    ///     let ring = StagingRing::new(PinnedAlloc, &[s], 1, 4096).unwrap();
    ///     let lease = ring.try_next().unwrap().expect("a fresh ring has a free buffer");
    ///     assert!(ring.try_next().unwrap().is_none(), "its only buffer is leased");
    ///     drop(lease);
    /// }
    /// ```
    pub fn try_next(&self) -> Result<Option<Staged<A>>> {
        match self.take(None, false)? {
            Take::Ready(slot) => self.lease(slot).map(Some),
            Take::Pending(_) | Take::Empty => Ok(None),
        }
    }

    /// The next buffer the GPU is done with, waiting for one at most `timeout`. For the
    /// first [`NEXT_SPIN`] it asks the buffers' events in a loop (as
    /// `Event::synchronize` spins), so that a copy about to end costs no wake-up; then
    /// it sleeps until the driver says the buffer's last use completed, or a lease is
    /// given back. Errors: [`Error::TimedOut`] when none is free in time; a CUDA error of
    /// the buffer's last use.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, staging::StagingRing, Error, PinnedAlloc};
    /// use std::time::Duration;
    /// if let Ok(s) = Stream::new(0) {
    ///     let ring = StagingRing::new(PinnedAlloc, &[s], 1, 4096).unwrap();
    ///     let lease = ring.next(Duration::from_secs(1)).unwrap();
    ///     // Its only buffer is leased: the second call times out.
    ///     let err = ring.next(Duration::from_millis(1)).unwrap_err();
    ///     assert!(matches!(err, Error::TimedOut(_)));
    ///     drop(lease);
    ///     assert_eq!(ring.next(Duration::from_secs(1)).unwrap().index(), 0);
    /// }
    /// ```
    pub fn next(&self, timeout: Duration) -> Result<Staged<A>> {
        let start = Instant::now();
        // A timeout too long to add to the clock (`Duration::MAX`) waits for as long as
        // it takes.
        let deadline = start.checked_add(timeout);
        let spin_until = start + NEXT_SPIN.min(timeout);
        loop {
            if let Take::Ready(slot) = self.take(None, false)? {
                return self.lease(slot);
            }
            if Instant::now() >= spin_until {
                break;
            }
            std::thread::yield_now();
        }
        let mut fut = self.next_async();
        let waker = Waker::from(global_thread_waker());
        let mut cx = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(out) = Pin::new(&mut fut).poll(&mut cx) {
                return out;
            }
            let Some(deadline) = deadline else {
                std::thread::park();
                continue;
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut(
                    "no staging buffer became free: the GPU still uses them or they are all leased",
                ));
            }
            std::thread::park_timeout(deadline - now);
        }
    }

    /// A future of the next buffer the GPU is done with: [`next`](Self::next) without a
    /// blocked thread. Cancel-safe: dropped, it holds no buffer.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, staging::StagingRing, PinnedAlloc};
    /// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     use std::task::{Context, Poll, Wake, Waker};
    /// #     struct T(std::thread::Thread);
    /// #     impl Wake for T { fn wake(self: std::sync::Arc<Self>) { self.0.unpark() } }
    /// #     let waker = Waker::from(std::sync::Arc::new(T(std::thread::current())));
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop {
    /// #         if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) { return v; }
    /// #         std::thread::park();
    /// #     }
    /// # }
    /// if let Ok(s) = Stream::new(0) {
    ///     let ring = StagingRing::new(PinnedAlloc, &[s], 2, 4096).unwrap();
    ///     // In async code: `let mut buf = ring.next_async().await?;`
    ///     let mut buf = block_on(ring.next_async()).unwrap();
    ///     buf[0] = 7;
    /// }
    /// ```
    pub fn next_async(&self) -> NextStaged<A> {
        NextStaged {
            ring: self.clone(),
            waiting: std::vec::Vec::new(),
            id: NEXT_WAITER.fetch_add(1, crate::sync::global::Ordering::Relaxed),
            registered: false,
        }
    }

    /// A lease of `slot`, its event made on its first lease (so that
    /// [`Staged::last_use_queued`] can record it through `&self`). An error gives the
    /// buffer back.
    fn lease(&self, mut slot: Slot<A>) -> Result<Staged<A>> {
        if slot.last_use.is_none() {
            match Event::new(slot.stream.device()) {
                // Not recorded yet: it counts as complete, as `None` did.
                Ok(e) => slot.last_use = Some(e),
                Err(e) => {
                    self.give_back(slot);
                    return Err(e);
                }
            }
        }
        Ok(Staged {
            ring: self.clone(),
            slot: Some(slot),
            recorded_early: AtomicBool::new(false),
        })
    }

    /// Takes the first free buffer the GPU is done with. The driver queries run with the
    /// ring's lock released: the free buffers are moved out, checked, and the rest put
    /// back in front, in order. A taker that finds the list empty meanwhile is woken by
    /// that put-back (`missed`); one that finds only buffers in use leaves `waker` to be
    /// woken by the next give-back (registered after the put-back's wake-ups: a poller
    /// never wakes itself, so two waiting tasks cannot wake each other in a loop).
    fn take(&self, waker: Option<(u64, &Waker)>, want_future: bool) -> Result<Take<A>> {
        let mut candidates = {
            let mut state = lock(&self.inner.state);
            if state.free.is_empty() {
                if state.scanning > 0 {
                    state.missed = true;
                }
                if let Some(w) = waker {
                    state.register(w);
                }
                return Ok(Take::Empty);
            }
            state.scanning += 1;
            core::mem::take(&mut state.free)
        };
        let mut out = Ok(Take::Empty);
        for (i, slot) in candidates.iter().enumerate() {
            match slot.is_free() {
                Ok(true) => {
                    out = Ok(candidates.remove(i).map_or(Take::Empty, Take::Ready));
                    break;
                }
                Ok(false) => {}
                Err(e) => {
                    out = Err(e);
                    break;
                }
            }
        }
        if want_future && matches!(out, Ok(Take::Empty)) {
            // Every free buffer is in use: on each stream, the one used longest ago
            // completes first; wait for whichever of those does. (A slot without a use is
            // free, so `last_use` is `Some` here.)
            let mut firsts: std::vec::Vec<(crate::cuda::StreamId, EventCompleted)> = std::vec::Vec::new();
            for slot in &candidates {
                if let (Some(event), false) = (
                    &slot.last_use,
                    firsts.iter().any(|(id, _)| *id == slot.stream.id()),
                ) {
                    firsts.push((slot.stream.id(), event.completed()));
                }
            }
            out = Ok(Take::Pending(firsts.into_iter().map(|(_, f)| f).collect()));
        }
        let ready = matches!(out, Ok(Take::Ready(_)));
        let wake = {
            let mut state = lock(&self.inner.state);
            candidates.append(&mut state.free);
            state.free = candidates;
            state.scanning -= 1;
            let wake = if state.missed && !state.free.is_empty() {
                state.missed = false;
                state.take_waiters()
            } else {
                std::vec::Vec::new()
            };
            if let (false, Some(w)) = (ready, waker) {
                state.register(w);
            }
            wake
        };
        wake_all(wake);
        out
    }

    /// A lease given back: its buffer goes to the back of the free list.
    fn give_back(&self, slot: Slot<A>) {
        let waiters = {
            let mut state = lock(&self.inner.state);
            state.free.push_back(slot);
            state.take_waiters()
        };
        wake_all(waiters);
    }
}

/// How long [`StagingRing::next`] asks the buffers' events in a loop before it sleeps
/// until the driver's callback: a future's wake-up took 15-20 us on the H200 where
/// `Event::synchronize` took 3 us (BENCHMARKS.md), and a pipeline waits for a buffer
/// once a batch.
///
/// ```
/// assert_eq!(cudalloc::staging::NEXT_SPIN.as_micros(), 200);
/// ```
pub const NEXT_SPIN: Duration = Duration::from_micros(200);

/// A waker that unparks the calling thread ([`StagingRing::next`]'s blocking wait).
fn global_thread_waker() -> crate::sync::global::Arc<ThreadWaker> {
    crate::sync::global::Arc::new(ThreadWaker(std::thread::current()))
}

struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: crate::sync::global::Arc<Self>) {
        self.0.unpark();
    }
}

/// The future of [`StagingRing::next_async`].
#[must_use = "a future does nothing unless awaited or polled"]
pub struct NextStaged<A: Allocator> {
    ring: StagingRing<A>,
    /// While every free buffer is in use: the completions of the one used longest ago on
    /// each stream (empty otherwise).
    waiting: std::vec::Vec<EventCompleted>,
    /// Its key among the ring's waiters.
    id: u64,
    /// Whether it may have left its waker with the ring (removed at drop).
    registered: bool,
}

impl<A: Allocator> Drop for NextStaged<A> {
    fn drop(&mut self) {
        if self.registered {
            lock(&self.ring.inner.state).forget_waiter(self.id);
        }
    }
}

impl<A: Allocator> core::fmt::Debug for NextStaged<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("NextStaged")
            .field("waiting", &self.waiting)
            .finish()
    }
}

impl<A: Allocator> Future for NextStaged<A> {
    type Output = Result<Staged<A>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            if !this.waiting.is_empty() {
                let mut any_done = false;
                for done in &mut this.waiting {
                    match Pin::new(done).poll(cx) {
                        Poll::Ready(Ok(())) => any_done = true,
                        Poll::Ready(Err(e)) => {
                            this.waiting.clear();
                            return Poll::Ready(Err(e));
                        }
                        Poll::Pending => {}
                    }
                }
                if !any_done {
                    // Registered with the ring as well: a give-back wakes it too.
                    this.registered = true;
                    return match this.ring.take_now((this.id, cx.waker())) {
                        Some(slot) => {
                            this.waiting.clear();
                            Poll::Ready(slot.and_then(|s| this.ring.lease(s)))
                        }
                        None => Poll::Pending,
                    };
                }
                this.waiting.clear();
            }
            this.registered = true;
            match this.ring.take(Some((this.id, cx.waker())), true) {
                Err(e) => return Poll::Ready(Err(e)),
                Ok(Take::Ready(slot)) => return Poll::Ready(this.ring.lease(slot)),
                // (Never empty: a free buffer without a use is ready.)
                Ok(Take::Pending(done)) if done.is_empty() => return Poll::Pending,
                Ok(Take::Pending(done)) => this.waiting = done,
                Ok(Take::Empty) => return Poll::Pending,
            }
        }
    }
}

impl<A: Allocator> StagingRing<A> {
    /// A free buffer the GPU is done with, if any, without making a future; registers
    /// `waker` for the next give-back.
    fn take_now(&self, waker: (u64, &Waker)) -> Option<Result<Slot<A>>> {
        match self.take(Some(waker), false) {
            Ok(Take::Ready(slot)) => Some(Ok(slot)),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// A leased staging buffer: derefs to its bytes; queue its uses on [`stream`](Self::stream).
/// Dropped, it records an event on that stream and goes back to its ring, which hands it
/// out again once the event has completed. [`last_use_queued`](Self::last_use_queued)
/// records that event earlier, right after the buffer's last use (an upload), so that the
/// ring hands the buffer out again before the rest of the batch's work has completed.
pub struct Staged<A: Allocator> {
    ring: StagingRing<A>,
    /// `Some` until dropped.
    slot: Option<Slot<A>>,
    /// Set by `last_use_queued` (before it records the slot's event, cleared again if the
    /// record fails): the drop records nothing more. An atomic because launch closures
    /// hold `&Staged` and `Staged` is `Sync`; `record_use` reads it after its wait, so a
    /// wait queued concurrently is either before the early record or recorded again.
    recorded_early: AtomicBool,
}

impl<A: Allocator> core::fmt::Debug for Staged<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Staged")
            .field("index", &self.index())
            .field("len", &self.len())
            .field("stream", &self.stream().id())
            .finish()
    }
}

impl<A: Allocator> Staged<A> {
    fn slot(&self) -> &Slot<A> {
        // The slot is taken only in `drop`.
        self.slot
            .as_ref()
            .unwrap_or_else(|| unreachable!("a lease holds its slot until dropped"))
    }

    /// The stream this buffer is bound to: queue its copies and kernels here.
    pub fn stream(&self) -> &Stream {
        &self.slot().stream
    }

    /// Which of the ring's buffers this is (`0..ring.buffers()`).
    pub fn index(&self) -> usize {
        self.slot().index
    }

    /// Records that work queued on `other` (not the buffer's own stream) so far uses the
    /// buffer: the buffer's stream waits for it on the GPU, so the event recorded when the
    /// lease is dropped covers it too (as [`Stream::wait_for`]: on the host if the GPU-side
    /// wait cannot be queued). After [`last_use_queued`](Self::last_use_queued) the event
    /// is recorded again, after the wait: the use is covered either way.
    pub fn record_use(&self, other: &Stream) -> Result<()> {
        if other == self.stream() {
            return Ok(());
        }
        self.stream().wait_for(other)?;
        if self.recorded_early.load(Ordering::SeqCst) {
            if let Err(e) = self.record_last_use() {
                // Left to the drop, which records after the wait.
                self.recorded_early.store(false, Ordering::SeqCst);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Says that the work queued so far on the lease's [`stream`](Self::stream) is the last
    /// that uses this buffer: records the ring's event for it now, so the ring hands the
    /// buffer out again once *that* work has completed (the upload of a batch), not once
    /// everything queued on the stream until the lease is dropped has (its kernels and the
    /// copy back). The drop then records nothing more. Use on another stream is still
    /// covered by [`record_use`](Self::record_use), before or after this call.
    ///
    /// Safe: it changes when the ring reuses the buffer, and every GPU use of the buffer
    /// queued after it is the caller's: the crate's asynchronous copies
    /// ([`copy::host_to_device_async`](crate::copy::host_to_device_async),
    /// [`copy::device_to_host_async`](crate::copy::device_to_host_async)) are `unsafe`,
    /// and their contract (the host memory is not written, or not touched, until the copy
    /// has completed) is broken by a copy queued after this call: the ring may hand the
    /// buffer to the next writer before it runs. (cudarc's plain-slice copies of pinned
    /// memory are a hole of cudarc's, as everywhere in the crate: see `PinnedView`.)
    /// Errors: a CUDA error of the record, which leaves the drop to record as before.
    ///
    /// ```
    /// use cudalloc::{copy, cuda::Stream, device::DevicePool, staging::StagingRing, PinnedAlloc};
    /// use std::time::Duration;
    /// if let Ok(s) = Stream::new(0) {
    ///     let ring = StagingRing::new(PinnedAlloc, &[s.clone()], 1, 1 << 16).unwrap();
    ///     let pool = DevicePool::get(0).unwrap();
    ///     let mut dev = pool.alloc::<u8>(ring.buffer_len(), &s).unwrap();
    ///     let mut buf = ring.next(Duration::from_secs(10)).unwrap();
    ///     buf.fill(7);
    ///     // SAFETY: nothing uses `buf` after this copy; the ring keeps it from the next
    ///     // lease until the copy has completed (the event recorded below).
    ///     unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.unwrap();
    ///     buf.last_use_queued().unwrap(); // the upload is the buffer's last use
    ///     // ... kernels on `dev` on buf.stream(): the ring does not wait for them ...
    ///     drop(buf);
    ///     let again = ring.next(Duration::from_secs(10)).unwrap(); // once the upload is done
    ///     assert_eq!(again.index(), 0);
    /// }
    /// ```
    pub fn last_use_queued(&self) -> Result<()> {
        // Set before the record: a `record_use` that does not see it waited before it.
        self.recorded_early.store(true, Ordering::SeqCst);
        let recorded = self.record_last_use();
        if recorded.is_err() {
            self.recorded_early.store(false, Ordering::SeqCst);
        }
        recorded
    }

    /// Records the slot's event (made by the lease) at the end of its stream.
    fn record_last_use(&self) -> Result<()> {
        let slot = self.slot();
        match &slot.last_use {
            Some(e) => e.record(&slot.stream),
            None => Err(Error::InvalidArgument(
                "a staging buffer leased without its event",
            )),
        }
    }
}

impl<A: Allocator> core::ops::Deref for Staged<A> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.slot().buf
    }
}

impl<A: Allocator> core::ops::DerefMut for Staged<A> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.slot {
            Some(slot) => &mut slot.buf,
            None => unreachable!("a lease holds its slot until dropped"),
        }
    }
}

impl<A: Allocator> Drop for Staged<A> {
    fn drop(&mut self) {
        let Some(mut slot) = self.slot.take() else { return };
        #[cfg(feature = "test-hooks")]
        if hooks::SKIP_RELEASE_EVENT.load(Ordering::SeqCst) {
            slot.last_use = None;
            return self.ring.give_back(slot);
        }
        if *self.recorded_early.get_mut() && slot.last_use.is_some() {
            // `last_use_queued` recorded the event after the buffer's last use.
            return self.ring.give_back(slot);
        }
        let recorded = match &slot.last_use {
            Some(e) => e.record(&slot.stream),
            None => Event::new(slot.stream.device()).and_then(|e| {
                e.record(&slot.stream)?;
                slot.last_use = Some(e);
                Ok(())
            }),
        };
        if let Err(e) = recorded {
            // Without the event, wait for the stream on the host; if even that fails the
            // buffer's state is unknown: it leaves the ring (leaked, never reused).
            crate::cuda::record_drop_error("recording a staging buffer's use", e);
            if let Err(e) = slot.stream.synchronize() {
                crate::cuda::record_drop_error("waiting for a staging buffer's stream", e);
                core::mem::forget(slot.buf);
                return;
            }
            slot.last_use = None;
        }
        self.ring.give_back(slot);
    }
}

/// Switches for negative controls in tests (feature `test-hooks`; never in a program).
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks {
    use crate::sync::global::AtomicBool;

    pub(super) static SKIP_RELEASE_EVENT: AtomicBool = AtomicBool::new(false);

    /// Makes every staging ring hand a given-back buffer out at once, without waiting for
    /// the GPU (the defect the ring exists to prevent), and every pipeline launch a batch
    /// in a buffer without draining the buffer's last batch first: for negative controls.
    pub fn skip_release_events(skip: bool) {
        SKIP_RELEASE_EVENT.store(skip, crate::sync::global::Ordering::SeqCst);
    }
}
