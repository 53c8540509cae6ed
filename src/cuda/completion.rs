//! GPU completion as futures: [`Stream::idle`] and [`Event::completed`] resolve when the
//! driver says the work is done, runtime-agnostic (no executor in the crate's dependencies).
//!
//! The driver wakes them: a callback queued on the stream (`cuStreamAddCallback`, the host
//! function of `cuLaunchHostFunc` that is also called, with the error, when the context has
//! failed) sets a shared [`Signal`] and wakes the waker the future left there. Nothing
//! polls the GPU in a loop. The signal is an `Arc` shared by the future and the callback,
//! so either may go first: a future dropped before the GPU finishes clears its waker and
//! goes; the callback later finds no one to wake and frees the signal.

use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll, Waker};

use super::driver::CudaError;
use super::stream::{Event, Stream};
use crate::error::{Error, Result};
use crate::sync::global::{self, AtomicUsize, Ordering};
use crate::sync::{lock, Arc, Mutex};

/// Signals alive (a future or a queued callback still holds one): see
/// [`pending_completions`].
static LIVE_SIGNALS: AtomicUsize = AtomicUsize::new(0);

/// How many completion signals are alive: futures of [`Stream::idle`] /
/// [`Event::completed`] not yet dropped, and driver callbacks not yet run. Zero once every
/// such future is dropped and the GPU has finished the work they waited for: a future
/// dropped early leaks nothing.
///
/// ```
/// if let Ok(s) = cudalloc::cuda::Stream::new(0) {
///     drop(s.idle()); // dropped at once: its callback still runs, then frees the signal
///     s.synchronize().unwrap();
/// }
/// ```
pub fn pending_completions() -> usize {
    LIVE_SIGNALS.load(Ordering::Relaxed)
}

/// The state a future and the driver's callback share. The driver's thread calls
/// [`fire`](Signal::fire) once; the poller calls [`poll`](Signal::poll) and, when it gives
/// up, [`cancel`](Signal::cancel).
pub(crate) struct Signal {
    state: Mutex<SignalState>,
}

struct SignalState {
    /// `Some` once the driver called back: its status.
    done: Option<core::result::Result<(), CudaError>>,
    /// The waker of the last `Pending` poll; `None` after a wake or a cancel.
    waker: Option<Waker>,
}

impl Signal {
    pub(crate) fn new() -> Arc<Self> {
        LIVE_SIGNALS.fetch_add(1, Ordering::Relaxed);
        Arc::new(Self {
            state: Mutex::new(SignalState {
                done: None,
                waker: None,
            }),
        })
    }

    /// The driver's side: the work is done (or failed with `status`). Wakes the waker the
    /// last poll left, once, *under the lock*: once [`cancel`](Self::cancel) has returned,
    /// this never calls the cancelled future's waker (a waker must therefore not poll the
    /// future inline, which no executor's does).
    pub(crate) fn fire(&self, status: core::result::Result<(), CudaError>) {
        let mut state = lock(&self.state);
        if state.done.is_none() {
            state.done = Some(status);
        }
        if let Some(waker) = state.waker.take() {
            waker.wake();
        }
    }

    /// The poller's side: `Ready` with the driver's status once it called back; otherwise
    /// keeps `cx`'s waker (replacing an older one) and returns `Pending`.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<core::result::Result<(), CudaError>> {
        let mut state = lock(&self.state);
        if let Some(done) = state.done {
            return Poll::Ready(done);
        }
        match &mut state.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// The poller gives up (its future is dropped): the waker is dropped here, and the
    /// driver's callback, whenever it runs, wakes no one.
    pub(crate) fn cancel(&self) {
        let waker = lock(&self.state).waker.take();
        drop(waker);
    }

    /// Whether the driver has called back (for tests and `Debug`).
    pub(crate) fn is_done(&self) -> bool {
        lock(&self.state).done.is_some()
    }
}

impl Drop for Signal {
    fn drop(&mut self) {
        LIVE_SIGNALS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a completion future waits on: already known, or the driver's signal.
enum Wait {
    Ready(Option<Result<()>>),
    Signal(Arc<Signal>),
}

impl Wait {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match self {
            // A future polled again after `Ready` returns `Ok(())` rather than panic.
            Wait::Ready(out) => Poll::Ready(out.take().unwrap_or(Ok(()))),
            Wait::Signal(signal) => signal.poll(cx).map(|r| r.map_err(Error::Cuda)),
        }
    }

    fn cancel(&self) {
        if let Wait::Signal(signal) = self {
            signal.cancel();
        }
    }

    /// Queues the signal's callback on `stream` behind the work queued so far.
    fn queue_on(stream: &Stream) -> Self {
        let signal = Signal::new();
        let theirs = signal.clone();
        match stream.add_callback(move |status| theirs.fire(status)) {
            Ok(()) => Wait::Signal(signal),
            Err(e) => Wait::Ready(Some(Err(e))),
        }
    }
}

/// One completion future type: `Send`, `'static`, `Unpin`, a [`Wait`] it polls and
/// cancels on drop. Two public types, not one generic, so that each names what it waits
/// for in signatures and errors.
macro_rules! completion_future {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[must_use = "a future does nothing unless awaited or polled"]
        pub struct $name {
            wait: Wait,
        }

        impl Future for $name {
            type Output = Result<()>;
            fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
                self.get_mut().wait.poll(cx)
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                self.wait.cancel();
            }
        }

        impl core::fmt::Debug for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("done", &self.wait.is_done())
                    .finish()
            }
        }
    };
}

completion_future! {
    /// The future of [`Stream::idle`]: resolves once all work queued on the stream before the
    /// call has completed, with the stream's error if it failed. `Send` and `'static`: spawn
    /// it, select on it, drop it (dropped early it leaks nothing and wakes no one).
    StreamIdle
}

completion_future! {
    /// The future of [`Event::completed`]: resolves once the work the event captured (its
    /// last record before the call) has completed, with the error if it failed. `Send` and
    /// `'static`, cancel-safe like [`StreamIdle`].
    EventCompleted
}

impl Wait {
    fn is_done(&self) -> bool {
        match self {
            Wait::Ready(_) => true,
            Wait::Signal(s) => s.is_done(),
        }
    }
}

impl Stream {
    /// A future that resolves once all work queued on this stream *before this call* has
    /// completed: [`synchronize`](Stream::synchronize) without a blocked thread, for any
    /// async runtime. The driver wakes it (a callback queued on the stream now, which
    /// later work on the stream waits for, as for [`launch_host_fn`](Stream::launch_host_fn));
    /// if the stream is idle already it is ready at once. A failure of the stream's work
    /// (or of queuing the callback) is the output's `Err`.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
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
    ///     s.launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(5))).unwrap();
    ///     let idle = s.idle(); // captures the sleep queued above
    ///     block_on(idle).unwrap(); // or `s.idle().await` in async code
    ///     assert!(s.is_idle().unwrap());
    /// }
    /// ```
    pub fn idle(&self) -> StreamIdle {
        let wait = match self.is_idle() {
            Ok(true) => Wait::Ready(Some(Ok(()))),
            Err(e) => Wait::Ready(Some(Err(e))),
            Ok(false) => Wait::queue_on(self),
        };
        StreamIdle { wait }
    }
}

impl Event {
    /// A future that resolves once the work this event captured (its last
    /// [`record`](Event::record) before this call) has completed; ready at once if it
    /// has. A failure is the output's `Err`. Unlike [`Stream::idle`] it does not wait for
    /// work queued on the event's stream after the record: a helper stream of the crate
    /// waits for the event on the GPU and carries the driver's callback, so the event's
    /// own stream is not held up. Re-recording the event later does not move the future.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
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
    ///     s.launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(5))).unwrap();
    ///     let copied = s.record_event().unwrap();
    ///     block_on(copied.completed()).unwrap();
    ///     assert!(copied.is_complete().unwrap());
    /// }
    /// ```
    pub fn completed(&self) -> EventCompleted {
        let wait = match self.is_complete() {
            Ok(true) => Wait::Ready(Some(Ok(()))),
            Err(e) => Wait::Ready(Some(Err(e))),
            Ok(false) => waiter_wait(self),
        };
        EventCompleted { wait }
    }
}

/// Helper streams, per device, that wait for one event each and carry its callback: taken
/// from here by [`Event::completed`], given back by the callback (which moves the handle,
/// never drops it: a driver thread must not destroy a stream). As many as there were
/// pending event futures at once; kept for the life of the process.
static WAITERS: global::Mutex<Vec<(usize, Stream)>> = global::Mutex::new(Vec::new());

fn waiter_wait(event: &Event) -> Wait {
    let device = event.device();
    let taken = {
        let mut free = global::lock(&WAITERS);
        let at = free.iter().rposition(|(d, _)| *d == device);
        at.map(|i| free.swap_remove(i).1)
    };
    let waiter = match taken.map_or_else(|| Stream::new(device), Ok) {
        Ok(s) => s,
        Err(e) => return Wait::Ready(Some(Err(e))),
    };
    if let Err(e) = waiter.wait(event) {
        global::lock(&WAITERS).push((device, waiter));
        return Wait::Ready(Some(Err(e)));
    }
    let signal = Signal::new();
    let theirs = signal.clone();
    // The callback owns a clone of the waiter and puts it back; `add_callback` returns it
    // to us (inside the closure it drops) only when the launch fails.
    let back = waiter.clone();
    let queued = waiter.add_callback(move |status| {
        theirs.fire(status);
        global::lock(&WAITERS).push((device, back));
    });
    match queued {
        Ok(()) => Wait::Signal(signal),
        Err(e) => {
            global::lock(&WAITERS).push((device, waiter));
            Wait::Ready(Some(Err(e)))
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::global::AtomicUsize as StdAtomicUsize;
    use std::task::Wake;

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Counting(StdAtomicUsize);
    impl Wake for Counting {
        fn wake(self: global::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn counting() -> (global::Arc<Counting>, Waker) {
        let c = global::Arc::new(Counting::default());
        (c.clone(), Waker::from(c))
    }

    fn err() -> CudaError {
        CudaError::new(cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED)
    }

    #[test]
    fn fired_after_a_pending_poll_wakes_once_and_is_ready() {
        let s = Signal::new();
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        assert!(s.poll(&mut cx).is_pending());
        assert!(s.poll(&mut cx).is_pending(), "a second poll keeps one waker");
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        s.fire(Ok(()));
        s.fire(Ok(())); // a second fire finds no waker and keeps the first status
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken exactly once");
        assert_eq!(s.poll(&mut cx), Poll::Ready(Ok(())));
        assert_eq!(s.poll(&mut cx), Poll::Ready(Ok(())), "ready stays ready");
    }

    #[test]
    fn the_latest_waker_is_the_one_woken() {
        let s = Signal::new();
        let (first, w1) = counting();
        let (second, w2) = counting();
        assert!(s.poll(&mut Context::from_waker(&w1)).is_pending());
        assert!(s.poll(&mut Context::from_waker(&w2)).is_pending());
        s.fire(Ok(()));
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_error_reaches_the_output() {
        let s = Signal::new();
        let (_, waker) = counting();
        s.fire(Err(err()));
        let mut w = Wait::Signal(s);
        match w.poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(Err(Error::Cuda(e))) => assert_eq!(e, err()),
            other => panic!("expected the CUDA error, got {other:?}"),
        }
    }

    #[test]
    fn a_cancelled_future_is_not_woken_and_frees_its_waker() {
        let s = Signal::new();
        let (count, waker) = counting();
        assert!(s.poll(&mut Context::from_waker(&waker)).is_pending());
        drop(waker);
        assert_eq!(global::Arc::strong_count(&count), 2, "the signal holds the waker");
        let theirs = s.clone();
        let fut = StreamIdle {
            wait: Wait::Signal(s),
        };
        drop(fut);
        assert_eq!(
            global::Arc::strong_count(&count),
            1,
            "the waker went with the future"
        );
        theirs.fire(Ok(()));
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "no one woken");
        assert_eq!(Arc::strong_count(&theirs), 1, "only the callback's share is left");
    }

    #[test]
    fn futures_complete_in_the_order_their_signals_fire() {
        let (a, b) = (Signal::new(), Signal::new());
        let (count, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        let mut fa = Wait::Signal(a.clone());
        let mut fb = Wait::Signal(b.clone());
        assert!(fa.poll(&mut cx).is_pending() && fb.poll(&mut cx).is_pending());
        b.fire(Ok(()));
        assert!(fb.poll(&mut cx).is_ready());
        assert!(fa.poll(&mut cx).is_pending(), "a has not fired");
        a.fire(Ok(()));
        assert!(fa.poll(&mut cx).is_ready());
        assert_eq!(count.0.load(Ordering::SeqCst), 2, "one wake per signal");
    }
}

/// Loom models of the waker hand-over between the driver's thread (which fires the
/// signal) and the poller (which polls, re-polls with another waker, or cancels). Run with
/// `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib loom`.
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use crate::sync::{thread, AtomicBool, AtomicUsize as LoomAtomicUsize};
    use std::task::Wake;

    /// A waker that counts its wakes and fails the model if woken after its future was
    /// dropped.
    #[derive(Default)]
    struct Probe {
        wakes: LoomAtomicUsize,
        dropped: AtomicBool,
    }
    impl Wake for Probe {
        fn wake(self: global::Arc<Self>) {
            assert!(
                !self.dropped.load(Ordering::SeqCst),
                "woke a future that was dropped"
            );
            self.wakes.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The driver fires while the poller waits on it: the poller always wakes and gets
    /// the status (a lost wake-up is a deadlock, which loom reports), for success and for
    /// an error.
    #[test]
    fn loom_a_wake_up_is_never_lost() {
        for status in [
            Ok(()),
            Err(CudaError::new(
                cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
            )),
        ] {
            loom::model(move || {
                let signal = Signal::new();
                let theirs = signal.clone();
                let driver = thread::spawn(move || theirs.fire(status));
                let out = loom::future::block_on(core::future::poll_fn(|cx| signal.poll(cx)));
                assert_eq!(out, status);
                driver.join().unwrap();
            });
        }
    }

    /// The poller polls once and drops its future while the driver fires: the waker is
    /// called at most once, never after the drop, and the signal is freed by whoever goes
    /// last.
    #[test]
    fn loom_a_cancelled_future_is_never_woken() {
        loom::model(|| {
            let signal = Signal::new();
            let theirs = signal.clone();
            let probe = global::Arc::new(Probe::default());
            let driver = thread::spawn(move || theirs.fire(Ok(())));
            let waker = Waker::from(probe.clone());
            let first = signal.poll(&mut Context::from_waker(&waker));
            drop(waker);
            signal.cancel();
            probe.dropped.store(true, Ordering::SeqCst);
            drop(signal);
            driver.join().unwrap();
            let wakes = probe.wakes.load(Ordering::SeqCst);
            assert!(wakes <= 1, "woken {wakes} times");
            if first.is_ready() {
                assert_eq!(wakes, 0, "a ready poll needs no wake");
            }
            assert_eq!(global::Arc::strong_count(&probe), 1, "the waker was freed");
        });
    }

    /// The poller re-polls with a new waker while the driver fires: if the last poll was
    /// `Pending`, the last waker is woken, once; an older waker never is after it was
    /// replaced.
    #[test]
    fn loom_the_latest_waker_is_woken() {
        loom::model(|| {
            let signal = Signal::new();
            let theirs = signal.clone();
            let (old, new) = (
                global::Arc::new(Probe::default()),
                global::Arc::new(Probe::default()),
            );
            let driver = thread::spawn(move || theirs.fire(Ok(())));
            let first = signal.poll(&mut Context::from_waker(&Waker::from(old.clone())));
            let second = if first.is_pending() {
                let p = signal.poll(&mut Context::from_waker(&Waker::from(new.clone())));
                // `old` was replaced (or already woken): a wake from now on is a bug.
                old.dropped.store(true, Ordering::SeqCst);
                Some(p)
            } else {
                None
            };
            driver.join().unwrap();
            let (o, n) = (old.wakes.load(Ordering::SeqCst), new.wakes.load(Ordering::SeqCst));
            assert!(o + n <= 1, "one wake in all: {o} + {n}");
            if let Some(Poll::Pending) = second {
                assert_eq!(n, 1, "the latest waker was not woken");
            }
            assert!(signal
                .poll(&mut Context::from_waker(&Waker::from(new.clone())))
                .is_ready());
        });
    }
}
