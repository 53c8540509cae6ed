//! GPU completion as futures (`Stream::idle`, `Event::completed`) on a real stream: woken by
//! the driver once the queued work completes (held behind gates, so the order does not
//! depend on timing), woken once, in the GPU's order; a dropped future wakes no one and
//! leaks nothing; a failed kernel is the output's error. The waker hand-over itself is
//! loom-modelled in `src/cuda/completion.rs`.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use cudalloc::cuda::{pending_completions, Module, Stream};
use cudalloc::Error;

use crate::gpu_support::Gate;
use crate::support::{counting, poll, CountingWaker};

/// Waits (parked, no spinning) until `counter` has been woken at least once; a guard
/// against a hang, not a timing assertion.
fn until_woken(counter: &CountingWaker) -> bool {
    let t0 = Instant::now();
    while counter.wakes.load(Ordering::SeqCst) == 0 {
        if t0.elapsed() > Duration::from_secs(10) {
            return false;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
    true
}

/// Polls `f` to completion with `waker`, parking between polls (at most 10 s).
fn finish<F: Future + Unpin>(f: &mut F, counter: &CountingWaker, waker: &Waker) -> F::Output {
    loop {
        let seen = counter.wakes.load(Ordering::SeqCst);
        if let Poll::Ready(v) = poll(f, waker) {
            return v;
        }
        let t0 = Instant::now();
        while counter.wakes.load(Ordering::SeqCst) == seen {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the future was never woken"
            );
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }
}

#[test]
fn stream_idle_waits_for_the_queued_work_and_is_woken_once() {
    gpu!();
    let _one = crate::one_at_a_time();
    let s = Stream::new(0).unwrap();
    let gate = Gate::hold(&s);
    let mut idle = s.idle();
    let (count, waker) = counting();
    assert!(
        poll(&mut idle, &waker).is_pending(),
        "ready while the stream is held"
    );
    assert!(
        poll(&mut idle, &waker).is_pending(),
        "a second poll: still pending"
    );
    assert_eq!(
        count.wakes.load(Ordering::SeqCst),
        0,
        "woken before the work completed"
    );
    gate.open();
    assert!(until_woken(&count), "the driver never woke the future");
    assert!(matches!(poll(&mut idle, &waker), Poll::Ready(Ok(()))));
    s.synchronize().unwrap();
    assert_eq!(count.wakes.load(Ordering::SeqCst), 1, "woken exactly once");
    // An idle stream's future is ready at once.
    assert!(matches!(poll(&mut s.idle(), &waker), Poll::Ready(Ok(()))));
}

/// Futures resolve in the GPU's order, never before their work: `b`'s event lies after
/// `a`'s (b waits for it on the GPU), so when `b`'s future resolves `a`'s event has
/// completed. (One gate only: host functions of every stream share one driver thread, so
/// a second gate would hold every callback.)
#[test]
fn futures_complete_in_the_order_the_gpu_completes_their_work() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (a, b) = (Stream::new(0).unwrap(), Stream::new(0).unwrap());
    let gate = Gate::hold(&a);
    let on_a = a.record_event().unwrap();
    b.wait(&on_a).unwrap();
    let on_b = b.record_event().unwrap();
    let mut fa = on_a.completed();
    let mut fb = on_b.completed();
    let mut fb_idle = b.idle();
    let (ca, wa) = counting();
    let (cb, wb) = counting();
    assert!(
        poll(&mut fa, &wa).is_pending(),
        "a's event resolved while a is held"
    );
    assert!(poll(&mut fb, &wb).is_pending() && poll(&mut fb_idle, &wb).is_pending());
    assert_eq!(
        ca.wakes.load(Ordering::SeqCst) + cb.wakes.load(Ordering::SeqCst),
        0
    );
    gate.open();
    assert!(matches!(finish(&mut fb, &cb, &wb), Ok(())));
    assert!(
        on_a.is_complete().unwrap(),
        "b's future resolved before a's earlier work"
    );
    assert!(matches!(finish(&mut fb_idle, &cb, &wb), Ok(())));
    assert!(matches!(finish(&mut fa, &ca, &wa), Ok(())));
    assert_eq!(
        ca.wakes.load(Ordering::SeqCst),
        1,
        "a's future woken exactly once"
    );
    a.synchronize().unwrap();
    b.synchronize().unwrap();
}

/// An event's future waits for the event, not for work queued on its stream after it:
/// the later work is a GPU-side wait for a value in pinned memory
/// (`cuStreamWaitValue32`), which holds the stream without the driver's host-function
/// thread (where the future's callback runs).
#[test]
fn an_event_future_does_not_wait_for_later_work_on_its_stream() {
    gpu!();
    let _one = crate::one_at_a_time();
    use cudarc::driver::sys;
    let s = Stream::new(0).unwrap();
    let flag: allocator_api2::boxed::Box<std::sync::atomic::AtomicU32, cudalloc::PinnedAlloc> =
        allocator_api2::boxed::Box::new_in(std::sync::atomic::AtomicU32::new(0), cudalloc::PinnedAlloc);
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `flag` is pinned host memory of the crate's pool, mapped for the device.
    let rc = unsafe {
        sys::cuMemHostGetDevicePointer_v2(
            &mut dptr,
            (&*flag as *const std::sync::atomic::AtomicU32).cast_mut().cast(),
            0,
        )
    };
    assert_eq!(
        rc,
        sys::CUresult::CUDA_SUCCESS,
        "device address of the pinned flag"
    );
    /// Releases the GPU-side wait when dropped (a failing test included).
    struct Release<'a>(&'a std::sync::atomic::AtomicU32);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            self.0.store(1, Ordering::SeqCst);
        }
    }
    let first = Gate::hold(&s);
    let event = s.record_event().unwrap();
    let release = Release(&flag);
    // SAFETY: `dptr` stays valid until the wait has passed (`flag` outlives the
    // synchronize below; `release` sets it, even on a panic, before `flag` is dropped).
    let rc = unsafe {
        sys::cuStreamWaitValue32_v2(
            s.as_raw().cast(),
            dptr,
            1,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
        )
    };
    assert_eq!(
        rc,
        sys::CUresult::CUDA_SUCCESS,
        "cuStreamWaitValue32 (stream memory operations)"
    );
    let mut done = event.completed();
    let (count, waker) = counting();
    assert!(poll(&mut done, &waker).is_pending());
    first.open();
    assert!(matches!(finish(&mut done, &count, &waker), Ok(())));
    assert!(!s.is_idle().unwrap(), "the later wait still holds the stream");
    drop(release);
    s.synchronize().unwrap();
}

#[test]
fn a_dropped_future_wakes_no_one_and_leaks_nothing() {
    gpu!();
    let _one = crate::one_at_a_time();
    // Alone in a process: `pending_completions` counts every future of the process.
    if crate::support::in_a_child_process("futures::a_dropped_future_wakes_no_one_and_leaks_nothing") {
        return;
    }
    let s = Stream::new(0).unwrap();
    let gate = Gate::hold(&s);
    let event = s.record_event().unwrap();
    let (count, waker) = counting();
    let mut idle = s.idle();
    let mut done = event.completed();
    assert!(poll(&mut idle, &waker).is_pending() && poll(&mut done, &waker).is_pending());
    assert_eq!(pending_completions(), 2);
    assert_eq!(Arc::strong_count(&count), 4, "each future's signal holds a waker");
    drop((idle, done));
    assert_eq!(Arc::strong_count(&count), 2, "the wakers went with the futures");
    gate.open();
    s.synchronize().unwrap();
    // The event's callback runs on a helper stream: wait (bounded) until it has.
    let t0 = Instant::now();
    while pending_completions() != 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        pending_completions(),
        0,
        "a signal outlived its future and its callback"
    );
    assert_eq!(
        count.wakes.load(Ordering::SeqCst),
        0,
        "a dropped future was woken"
    );
    // Many futures dropped unpolled: nothing left either.
    for _ in 0..100 {
        let g = Gate::hold(&s);
        drop(s.idle());
        drop(s.record_event().unwrap().completed());
        drop(g);
    }
    s.synchronize().unwrap();
    let t0 = Instant::now();
    while pending_completions() != 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pending_completions(), 0);
}

/// A kernel that traps: the context fails.
const TRAP_PTX: &str = "\
.version 8.0
.target sm_75
.address_size 64
.visible .entry trap_now()
{
\ttrap;
}
";

#[test]
fn a_failed_kernel_is_the_futures_error() {
    gpu!();
    under_a_sanitizer!("which reports the trap this test provokes");
    let _one = crate::one_at_a_time();
    // A trap ruins the context of the whole process: alone in a child.
    if crate::support::in_a_child_process("futures::a_failed_kernel_is_the_futures_error") {
        return;
    }
    let s = Stream::new(0).unwrap();
    let kernel = Module::load_ptx(0, TRAP_PTX)
        .unwrap()
        .function("trap_now")
        .unwrap();
    let gate = Gate::hold(&s);
    // SAFETY: the kernel has no parameters and touches no memory; the kernel handle
    // (and its module) lives past the stream's synchronization below.
    unsafe { kernel.launch((1, 1, 1), (1, 1, 1), 0, &s, &mut []) }.unwrap();
    let after = s.record_event().unwrap();
    let mut idle = s.idle();
    let mut done = after.completed();
    let (count, waker) = counting();
    assert!(poll(&mut idle, &waker).is_pending(), "queued behind the gate");
    let _ = poll(&mut done, &waker);
    gate.open();
    let out = finish(&mut idle, &count, &waker);
    assert!(
        matches!(out, Err(Error::Cuda(_))),
        "the stream's failure: {out:?}"
    );
    let out = finish(&mut done, &count, &waker);
    assert!(matches!(out, Err(Error::Cuda(_))), "the event's failure: {out:?}");
    // A future made after the failure: the error at once.
    assert!(matches!(
        poll(&mut s.idle(), &waker),
        Poll::Ready(Err(Error::Cuda(_)))
    ));
    let _ = s.synchronize();
}
