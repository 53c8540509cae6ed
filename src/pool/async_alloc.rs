//! The pools' async backpressure: [`Pool::allocate_async`], an allocation that waits for
//! freed blocks the GPU still uses without blocking a thread (the sync path's bounded
//! wait parks the thread instead).

use core::future::Future;
use core::pin::Pin;
use core::ptr::NonNull;
use core::task::{Context, Poll};

use allocator_api2::alloc::Layout;

use super::shared::{without_backpressure, worth_waiting};
use super::Pool;
use crate::cuda::EventCompleted;
use crate::error::Result;
use crate::source::HostVisible;

impl<S: HostVisible + 'static> Pool<S> {
    /// Allocates a block for `layout` as [`try_allocate`](Pool::try_allocate) does, but
    /// where a full pool (at its limit, or its source out of memory) would block the
    /// thread waiting for freed blocks the GPU still uses (backpressure), the future
    /// waits instead, woken by the driver when the oldest such block's uses complete, and
    /// then tries again: a staging task on an async runtime slows to the GPU's pace
    /// without parking a worker. It has no deadline (drop it, or race it against a timer
    /// of your runtime); it fails as `try_allocate` does when nothing is pending that
    /// could free memory. Fences that cannot wake a task (user fences without
    /// [`Fence::completion`](crate::fence::Fence::completion)) are re-polled through the
    /// executor. Free the block with `Allocator::deallocate(&pool, ..)`, as any block of
    /// the pool. Cancel-safe: dropped, it holds nothing.
    ///
    /// ```
    /// use allocator_api2::alloc::{Allocator, Layout};
    /// use cudalloc::{pool::Pool, source::HostSource};
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
    /// let pool = Pool::new(HostSource);
    /// let layout = Layout::from_size_align(4096, 8).unwrap();
    /// // In async code: `pool.allocate_async(layout).await?`
    /// let block = block_on(pool.allocate_async(layout)).unwrap();
    /// // SAFETY: allocated above with `layout`.
    /// unsafe { pool.deallocate(block.cast(), layout) };
    /// ```
    pub fn allocate_async(&self, layout: Layout) -> AllocateAsync<'_, S> {
        AllocateAsync {
            pool: self,
            layout,
            waiting: Vec::new(),
        }
    }
}

/// The future of [`Pool::allocate_async`].
#[must_use = "a future does nothing unless awaited or polled"]
pub struct AllocateAsync<'p, S: HostVisible + 'static> {
    pool: &'p Pool<S>,
    layout: Layout,
    /// The completions of the oldest pending block's uses, while the pool is full.
    waiting: Vec<EventCompleted>,
}

impl<S: HostVisible + 'static> core::fmt::Debug for AllocateAsync<'_, S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AllocateAsync")
            .field("layout", &self.layout)
            .field("waiting_for", &self.waiting.len())
            .finish()
    }
}

impl<S: HostVisible + 'static> Future for AllocateAsync<'_, S> {
    type Output = Result<NonNull<[u8]>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        // Completed at once more than twice in one poll: yield to the executor rather
        // than spin here (another thread keeps taking what is freed).
        for _ in 0..3 {
            if !this.waiting.is_empty() {
                // A block is free once all its uses completed; an error counts as
                // completion, as for the pools' fences.
                this.waiting.retain_mut(|f| Pin::new(f).poll(cx).is_pending());
                if !this.waiting.is_empty() {
                    return Poll::Pending;
                }
                this.pool.shared.drain_pending();
            }
            let seen = this.pool.shared.uses.returns();
            let err = match without_backpressure(|| this.pool.try_allocate(this.layout)) {
                Ok(block) => return Poll::Ready(Ok(block)),
                Err(e) if !worth_waiting(&e) => return Poll::Ready(Err(e)),
                Err(e) => e,
            };
            let Some(completions) = this.pool.shared.oldest_pending_completions() else {
                if this.pool.shared.uses.room_returning(seen) {
                    // A drain on another thread is putting blocks back (it holds no lock
                    // and is done in a few locks' time): try again.
                    continue;
                }
                return Poll::Ready(Err(err));
            };
            if completions.iter().any(Option::is_none) {
                // A fence that cannot wake us: poll again through the executor.
                this.pool.shared.drain_pending();
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this.waiting = completions.into_iter().flatten().collect();
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
