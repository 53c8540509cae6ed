//! GPU-use tracking, shared by every allocator of the crate: the [`Fence`] trait (a point
//! in a stream whose completion can be polled), `UseSet` (the uses recorded on one piece
//! of memory, at most one per stream, with poll / wait / abandon), and the crate-level
//! [`record_use`] / [`record_fence`], which find the allocator owning any pointer through
//! the range registry (`registry.rs`).
//!
//! `deallocate` has no stream argument, so an allocator cannot know by itself whether a copy
//! or kernel still reads a block. A recorded use attaches a fence to the memory; memory
//! freed while fences are unfinished is not handed out again (the pool keeps the block
//! pending; an arena waits before a reset) until they have completed. Fences are polled
//! with no lock held: they are driver calls.

pub(crate) mod registry;

use core::time::Duration;
use std::time::Instant;

use crate::cuda::{Event, PooledEvent, Stream, StreamId};
use crate::error::Result;
use crate::sync::Arc;

/// Something whose completion can be polled: typically a CUDA event recorded after a GPU
/// use of some memory. Allocators hold freed memory back until every fence recorded for it
/// has completed.
///
/// Implemented by [`cuda::Event`](crate::cuda::Event) and the crate's pooled events; tests
/// implement it with a flag to drive the pending logic without a GPU.
///
/// ```
/// use cudalloc::fence::Fence;
/// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
///
/// struct Flag(Arc<AtomicBool>);
/// // SAFETY: the flag is set only once the (simulated) use of the memory is over.
/// unsafe impl Fence for Flag {
///     fn is_complete(&self) -> cudalloc::Result<bool> {
///         Ok(self.0.load(Ordering::Acquire))
///     }
/// }
/// let done = Arc::new(AtomicBool::new(false));
/// let f = Flag(done.clone());
/// assert!(!f.is_complete().unwrap());
/// done.store(true, Ordering::Release);
/// assert!(f.is_complete().unwrap());
/// ```
///
/// # Safety
/// Allocators hand memory to a new owner once its fences report completion, so an
/// implementor promises:
/// 1. `is_complete` returns `Ok(true)` (and `wait` returns `Ok`) only when the use it stands
///    for no longer reads or writes the memory.
/// 2. Once it has reported completion it keeps doing so.
///
/// **A failed query is not completion** (one rule for every allocator of the crate, host
/// and device): an `Err` from `is_complete` is counted in
/// [`cuda::drop_errors`](crate::cuda::drop_errors) and the memory stays pending (it is
/// polled again later); an `Err` from `wait` where waiting was the last resort gives the
/// memory up, neither reused nor freed. A leak is better than memory handed to a new owner
/// while the GPU may still write it, and an error may come from the query alone (a lost
/// context, an invalid handle) while the work it stands for still runs.
///
/// A fence that never completes holds its memory back for good, but never a thread: an
/// allocation waits for it at most [`PoolConfig::pending_wait`](crate::pool::PoolConfig),
/// and a pool dropped while it guards a freed block waits that long (10 s for a pool
/// without a pending wait), then leaks the block's memory on purpose rather than free it
/// under the GPU, logs it, and counts it in [`cuda::drop_errors`](crate::cuda::drop_errors).
/// A dropped [`Arena`](crate::arena::Arena) does the same after its
/// [`ArenaConfig::drop_wait`](crate::arena::ArenaConfig::drop_wait) (10 s by default); an
/// arena's `reset` waits without a bound, as the caller asked.
pub unsafe trait Fence: Send + Sync + 'static {
    /// Whether the use has completed. Must not block.
    fn is_complete(&self) -> Result<bool>;

    /// Blocks until the use has completed. The default polls [`Fence::is_complete`],
    /// yielding between polls.
    fn wait(&self) -> Result<()> {
        while !self.is_complete()? {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// The stream the fence was recorded on, if it is a point in one stream's order. A
    /// later fence of the same stream completes after an earlier one, so a set of uses keeps
    /// only the latest per stream. A fence whose point is fixed only later (by
    /// [`Fence::seal`]) must return `None`: a fence of its stream recorded meanwhile may
    /// lie before its point, and must not replace it.
    fn stream_id(&self) -> Option<StreamId> {
        None
    }

    /// Called when the memory the fence guards is freed, before the fence is polled for
    /// its reuse. A fence whose point in its stream was not fixed when it was recorded
    /// (one recorded before the copy it guards was queued) fixes it now: every use of the
    /// memory was queued before the free. Until then it must report "not complete".
    fn seal(&self) -> Result<()> {
        Ok(())
    }

    /// A future that resolves once the fence has completed, woken by the driver (an
    /// [`EventCompleted`](crate::cuda::EventCompleted)), for the pools' async waits
    /// ([`Pool::allocate_async`](crate::pool::Pool::allocate_async)). `None` (the default):
    /// the fence cannot wake a task, and an async wait for it re-polls through the
    /// executor instead.
    fn completion(&self) -> Option<crate::cuda::EventCompleted> {
        None
    }
}

// SAFETY: an event reports completion once the work captured by its last record has
// completed (the driver's contract), and stays complete until recorded again, which the
// crate never does to an event it handed to an allocator.
unsafe impl Fence for Event {
    fn is_complete(&self) -> Result<bool> {
        Event::is_complete(self)
    }
    fn wait(&self) -> Result<()> {
        self.synchronize()
    }
    fn completion(&self) -> Option<crate::cuda::EventCompleted> {
        Some(self.completed())
    }
}

// SAFETY: as for `Event`; a pooled event is recorded once, then only queried until it
// goes back to its pool when the fence is dropped.
unsafe impl Fence for PooledEvent {
    fn is_complete(&self) -> Result<bool> {
        PooledEvent::is_complete(self)
    }
    fn wait(&self) -> Result<()> {
        self.synchronize()
    }
    fn completion(&self) -> Option<crate::cuda::EventCompleted> {
        Some(self.event().completed())
    }
    fn stream_id(&self) -> Option<StreamId> {
        Some(self.stream_id())
    }
}

/// A fence, shared so it can be polled outside a lock while its entry stays in place.
pub(crate) type SharedFence = Arc<Box<dyn Fence>>;

/// Runs `f` on a fence, turning a panic of a user's fence into an error: an allocator
/// polling fences must neither unwind past the blocks it took out of a list, nor lose them.
fn guarded<R>(what: &str, f: impl FnOnce() -> Result<R>) -> Option<Result<R>> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => Some(r),
        Err(_) => {
            crate::cuda::record_drop_error(what, "the fence panicked");
            None
        }
    }
}

/// The uses recorded on one piece of memory: at most one fence per stream (the latest),
/// plus any number of fences without a stream. Algorithm core: `&mut self`, no lock;
/// callers take it out of their locked state before polling (driver calls).
#[derive(Default)]
pub(crate) struct UseSet {
    fences: Vec<SharedFence>,
}

impl UseSet {
    /// Adds `fence`; returns the fence of the same stream it supersedes, which the caller
    /// drops after releasing its locks (a pooled event goes back to its pool).
    pub(crate) fn record(&mut self, fence: SharedFence) -> Option<SharedFence> {
        if let Some(id) = fence.stream_id() {
            if let Some(old) = self.fences.iter_mut().find(|f| f.stream_id() == Some(id)) {
                return Some(core::mem::replace(old, fence));
            }
        }
        self.fences.push(fence);
        None
    }

    /// Puts back fences taken out (after a failed wait).
    pub(crate) fn absorb_back(&mut self, other: UseSet) {
        self.fences.extend(other.fences);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.fences.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.fences.len()
    }

    /// The fences, shared (to poll them without the owner's lock).
    pub(crate) fn fences(&self) -> &[SharedFence] {
        &self.fences
    }

    /// Forgets `fence` (found complete by a poll of a snapshot); true if it was here.
    pub(crate) fn forget(&mut self, fence: &SharedFence) -> bool {
        let before = self.fences.len();
        self.fences.retain(|f| !Arc::ptr_eq(f, fence));
        self.fences.len() != before
    }

    /// Tells every fence that its memory was freed ([`Fence::seal`]). No lock may be held.
    pub(crate) fn seal(&self) {
        for f in &self.fences {
            if let Some(Err(e)) = guarded("sealing a fence", || f.seal()) {
                crate::cuda::record_drop_error("sealing a fence", e);
            }
        }
    }

    /// Queries the fences (no lock may be held: driver calls) and drops the completed
    /// ones; true when none is left. A fence whose query fails (counted) or panics stays,
    /// to be polled again ([`Fence`]'s rule).
    pub(crate) fn poll(&mut self) -> bool {
        self.fences.retain(|f| !poll_one(f));
        self.fences.is_empty()
    }

    /// Blocks until every fence has completed, or `deadline` passes (then false). Without a
    /// deadline it uses each fence's own blocking wait; with one it polls with a short,
    /// growing sleep. A fence whose wait fails or panics is kept and the wait fails (the
    /// caller gives the memory up rather than reuse it).
    pub(crate) fn wait(&mut self, deadline: Option<Instant>) -> bool {
        match deadline {
            None => {
                self.fences
                    .retain(|f| match guarded("waiting for a fence", || f.wait()) {
                        Some(Ok(())) => false,
                        Some(Err(e)) => {
                            crate::cuda::record_drop_error("waiting for a recorded GPU use", e);
                            true
                        }
                        None => true,
                    });
                self.fences.is_empty()
            }
            Some(deadline) => {
                let mut nap = Duration::from_micros(5);
                loop {
                    if self.poll() {
                        return true;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return false;
                    }
                    std::thread::sleep(nap.min(deadline - now));
                    nap = (nap * 2).min(Duration::from_millis(1));
                }
            }
        }
    }
}

/// Polls one fence: true when it completed; false while pending, after a failed query
/// (counted: [`Fence`]'s rule) or a panic.
pub(crate) fn poll_one(f: &SharedFence) -> bool {
    match guarded("querying a fence", || f.is_complete()) {
        Some(Ok(done)) => done,
        Some(Err(e)) => {
            crate::cuda::record_drop_error("querying a recorded GPU use", e);
            false
        }
        None => false,
    }
}

/// Records that work queued on `stream` uses the memory at `ptr`, if it belongs to one of
/// the crate's allocators (the pools behind [`PinnedAlloc`](crate::PinnedAlloc) and
/// [`ManagedAlloc`](crate::ManagedAlloc), a [`Pool`](crate::pool::Pool), an
/// [`Arena`](crate::arena::Arena), a host registration): memory freed before the work
/// completes is not handed out again until then. Returns whether an allocator of the crate
/// owns `ptr`; memory from elsewhere needs no record (nothing reuses it behind the caller's
/// back) and gives `Ok(false)`.
///
/// The copy helpers ([`crate::copy`], `DeviceBuffer`'s copies) call it themselves; call it
/// after queuing other work (a kernel, another library's copy) that reads or writes the
/// memory.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{cuda::Stream, PinnedAlloc};
/// if let Ok(stream) = Stream::new(0) {
///     let mut v: Vec<u8, _> = Vec::new_in(PinnedAlloc);
///     v.extend(0..=255);
///     // ... queue work reading `v` on `stream` through another API, then:
///     assert!(cudalloc::record_use(v.as_ptr(), &stream).unwrap());
///     drop(v); // the block is reused only after the work completes
/// }
/// let on_the_stack = [0u8; 16];
/// if let Ok(stream) = Stream::new(0) {
///     assert!(!cudalloc::record_use(on_the_stack.as_ptr(), &stream).unwrap());
/// }
/// ```
pub fn record_use(ptr: *const u8, stream: &Stream) -> Result<bool> {
    let Some(owner) = registry::find(ptr as usize) else {
        return Ok(false);
    };
    let event = PooledEvent::record(stream)?;
    owner.record(ptr as usize, Arc::new(Box::new(event)))
}

/// Like [`record_use`], with any [`Fence`] in place of a CUDA event recorded now.
///
/// ```
/// use allocator_api2::{alloc::{Allocator, Layout}, vec::Vec};
/// use cudalloc::{fence::Fence, pool::Pool, source::HostSource};
/// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
///
/// struct Flag(Arc<AtomicBool>);
/// // SAFETY: the flag is set only once the simulated use is over.
/// unsafe impl Fence for Flag {
///     fn is_complete(&self) -> cudalloc::Result<bool> { Ok(self.0.load(Ordering::Acquire)) }
/// }
/// let pool = Pool::new(HostSource);
/// let v: Vec<u8, _> = Vec::with_capacity_in(64, &pool);
/// let done = Arc::new(AtomicBool::new(false));
/// assert!(cudalloc::record_fence(v.as_ptr(), Flag(done.clone())).unwrap());
/// drop(v);
/// assert_eq!(pool.stats().pending_blocks, 1); // held back until the flag is set
/// done.store(true, Ordering::Release);
/// pool.trim();
/// assert_eq!(pool.stats().pending_blocks, 0);
/// ```
pub fn record_fence(ptr: *const u8, fence: impl Fence) -> Result<bool> {
    let Some(owner) = registry::find(ptr as usize) else {
        return Ok(false);
    };
    owner.record(ptr as usize, Arc::new(Box::new(fence)))
}

/// A fence for tests and models: complete once its flag is set.
#[cfg(test)]
pub(crate) mod fake {
    use super::Fence;
    use crate::error::Result;
    use crate::sync::{Arc, AtomicBool, Ordering};

    #[derive(Clone, Default)]
    pub(crate) struct FlagFence(pub(crate) Arc<AtomicBool>);

    impl FlagFence {
        pub(crate) fn complete(&self) {
            self.0.store(true, Ordering::Release);
        }
    }

    // SAFETY: tests set the flag only once they no longer use the memory.
    unsafe impl Fence for FlagFence {
        fn is_complete(&self) -> Result<bool> {
            Ok(self.0.load(Ordering::Acquire))
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::fake::FlagFence;
    use super::*;

    struct Panics;
    // SAFETY: never reports completion.
    unsafe impl Fence for Panics {
        fn is_complete(&self) -> Result<bool> {
            panic!("a fence that panics")
        }
    }

    fn shared(f: impl Fence) -> SharedFence {
        Arc::new(Box::new(f))
    }

    #[test]
    fn poll_drops_completed_fences_and_keeps_the_rest() {
        let (a, b) = (FlagFence::default(), FlagFence::default());
        let mut set = UseSet::default();
        set.record(shared(a.clone()));
        set.record(shared(b.clone()));
        assert!(!set.poll());
        a.complete();
        assert!(!set.poll());
        assert_eq!(set.len(), 1);
        b.complete();
        assert!(set.poll());
    }

    #[test]
    fn a_panicking_fence_is_kept_not_lost_and_not_taken_as_complete() {
        let errors = crate::cuda::drop_errors();
        let mut set = UseSet::default();
        set.record(shared(Panics));
        assert!(!set.poll(), "a panic is not completion");
        assert_eq!(set.len(), 1, "nor is the fence lost");
        assert!(crate::cuda::drop_errors() > errors, "the panic is counted");
        assert!(!set.wait(Some(Instant::now() + Duration::from_millis(5))));
        assert!(
            !set.wait(None),
            "a blocking wait on it fails instead of unwinding"
        );
    }

    #[test]
    fn wait_with_a_deadline_returns_when_fences_complete() {
        let f = FlagFence::default();
        let mut set = UseSet::default();
        set.record(shared(f.clone()));
        let setter = std::thread::spawn({
            let f = f.clone();
            move || {
                std::thread::sleep(Duration::from_millis(20));
                f.complete();
            }
        });
        assert!(set.wait(Some(Instant::now() + Duration::from_secs(10))));
        setter.join().unwrap();
        let mut never = UseSet::default();
        never.record(shared(FlagFence::default()));
        let t = Instant::now();
        assert!(!never.wait(Some(t + Duration::from_millis(30))));
        assert!(t.elapsed() >= Duration::from_millis(30));
    }
}
