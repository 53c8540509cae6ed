//! Where a device cache's memory goes back: the release policy of a miss, the
//! out-of-memory path's release of everything, trim, blocks given up on when the GPU
//! cannot be waited for, and the cache's drop.

use super::{Cache, Gated, IDLE_SHIFT};
use crate::device::backend::Backend;
use crate::device::size_class::class_size;
use crate::device::thread_cache::{ThreadCache, ThreadStats};
use crate::sync::Ordering;
use crate::trace::{Code, Note};

impl<B: Backend> Cache<B> {
    /// The release policy of a miss: idle blocks (this thread's and the shared ones)
    /// beyond 1/32 of the live bytes (at least the learned allowance, `idle.rs`), or beyond
    /// the limit, go back to the backend, largest first.
    pub(super) fn make_room<P>(&self, tc: Option<&mut ThreadCache<B, P>>, need: usize) {
        let own = tc.as_ref().map_or(0, |t| t.bytes());
        let idle = own + self.shared.idle_bytes();
        let held = self.held.held();
        let live = held.saturating_sub(idle).saturating_add(need);
        let class_need = if need <= self.settings.max_cached_bytes {
            need
        } else {
            0
        };
        self.idle.saw_idle(idle, class_need);
        if idle == 0 {
            return;
        }
        let bound = (live >> IDLE_SHIFT).max(self.idle.allowance());
        let over_limit = held.saturating_add(need).saturating_sub(self.settings.limit);
        let excess = idle.saturating_sub(bound).max(over_limit);
        if excess > 0 {
            self.release_idle(tc, excess);
        }
    }

    /// Gives idle blocks of at least `excess` bytes back to the backend, largest first:
    /// this thread's, then the shared ones. Returns the bytes given back.
    pub(super) fn release_idle<P>(&self, tc: Option<&mut ThreadCache<B, P>>, excess: usize) -> usize {
        let mut out = tc.map(|t| t.take_largest(excess)).unwrap_or_default();
        let taken: usize = out.iter().map(|&(_, c, _)| class_size(c)).sum();
        if taken < excess {
            let mut sh = self.shared.lock();
            out.extend(sh.take_largest(excess - taken));
            let pruned = sh.prune();
            drop(sh);
            drop(pruned);
        }
        self.idle.released(out.iter().map(|&(_, c, _)| c));
        let mut released = 0;
        for (stream, class, ptr) in out {
            self.give_back(ptr, class_size(class), &stream);
            released += class_size(class);
        }
        released
    }

    /// Frees a block to the backend in `stream`'s order and stops counting it.
    pub(super) fn give_back(&self, ptr: u64, bytes: usize, stream: &B::Stream) {
        // SAFETY: the block came from this backend with `bytes` (its class size, or its
        // rounded size when uncached); it is free (no buffer owns it), taken out of every
        // list, and every use of it is ordered before the current end of `stream`, its
        // home stream (the protocol in the module docs).
        unsafe { self.backend.free(ptr, bytes, stream) };
        self.held.release(bytes);
        if bytes <= self.settings.max_cached_bytes {
            self.idle.held(bytes, false);
        }
        self.held_blocks.fetch_sub(1, Ordering::Relaxed);
        self.counters.released.fetch_add(1, Ordering::Relaxed);
    }

    /// Gives every idle block back to the backend: this thread's, the shared ones, and
    /// gated ones after waiting (on the host) for their recorded uses; asks every other
    /// thread to give its blocks to the shared lists. Returns the streams the frees were
    /// queued on.
    pub(super) fn release_all<P>(&self, tc: Option<&mut ThreadCache<B, P>>) -> Vec<B::Stream> {
        let own: Option<*const ThreadStats> = tc.as_ref().map(|t| &**t.stats() as *const ThreadStats);
        self.threads.visit(|s| {
            if own != Some(s as *const ThreadStats) {
                s.reclaim.store(true, Ordering::Relaxed);
            }
        });
        let mut blocks = tc.map(|t| t.take_largest(usize::MAX)).unwrap_or_default();
        let gated;
        {
            let mut sh = self.shared.lock();
            blocks.extend(sh.take_largest(usize::MAX));
            gated = sh.take_all_gated();
            let pruned = sh.prune();
            drop(sh);
            drop(pruned);
        }
        for (stream, mut g) in gated {
            if g.marks.wait_host(&self.backend) {
                self.freed(g.ptr, class_size(g.class), &stream);
                blocks.push((stream, g.class, g.ptr));
            } else {
                self.abandon(class_size(g.class));
            }
        }
        let mut touched: Vec<B::Stream> = Vec::new();
        for (stream, class, ptr) in blocks {
            self.give_back(ptr, class_size(class), &stream);
            if !touched.iter().any(|t| B::stream_id(t) == B::stream_id(&stream)) {
                touched.push(stream);
            }
        }
        touched
    }

    /// Gives up on a block the GPU may still use: never reused, never freed (a leak is
    /// better than corrupted data). It stays counted as held.
    #[cold]
    pub(super) fn abandon(&self, bytes: usize) {
        self.counters
            .abandoned_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        log::error!("cudalloc: a device block of {bytes} bytes is abandoned: the GPU may still use it");
    }

    /// The backend's reservations trimmed to `keep` bytes, recorded as a `Trim` of the
    /// bytes it gave back (0 when the backend cannot say what it reserves).
    pub(super) fn trim_backend_to(&self, keep: usize) {
        let before = self.backend.reserved();
        self.backend.trim_to(keep);
        self.counters.trims.fetch_add(1, Ordering::Relaxed);
        self.backend.trace().event(|| {
            let after = self.backend.reserved();
            let released = before.zip(after).map_or(0, |(b, a)| b.saturating_sub(a));
            Note::new(Code::Trim, 0, released)
        });
    }

    /// Gives every cached block back to the backend (this thread's, the shared ones and
    /// the gated ones, waiting for their uses), waits for those frees, returns the
    /// backend's idle memory to the device, drops the handles of streams with nothing
    /// cached, and asks other threads for their blocks (they give them at their next
    /// allocation or free on this pool). Returns the bytes the backend reserves less from
    /// the device (when it cannot say: the bytes of the blocks it got back).
    pub(crate) fn trim<P>(&self, mut tc: Option<&mut ThreadCache<B, P>>) -> usize {
        let (reserved_before, held_before) = (self.backend.reserved(), self.held.held());
        if let Some(t) = tc.as_deref_mut() {
            self.flush_thread(t);
        }
        let touched = self.release_all(tc);
        for s in &touched {
            if let Err(e) = self.backend.synchronize(s) {
                crate::cuda::record_drop_error("synchronizing a stream after releasing cached blocks", e);
            }
        }
        drop(touched);
        self.trim_backend_to(0);
        let idle_streams = self.shared.lock().prune();
        drop(idle_streams);
        match reserved_before.zip(self.backend.reserved()) {
            Some((before, after)) => before.saturating_sub(after),
            None => held_before.saturating_sub(self.held.held()),
        }
    }
}

impl<B: Backend> Drop for Cache<B> {
    fn drop(&mut self) {
        // No thread cache and no buffer refers to the cache any more (they hold the pool):
        // every block left is in the shared lists.
        for mut s in self.shared.take_all() {
            for (class, list) in s.free.iter().enumerate() {
                for &ptr in list {
                    self.give_back(ptr, class_size(class), &s.stream);
                }
            }
            let gated: Vec<Gated<B>> = s.drain_gated().collect();
            for g in gated {
                // The home stream waits for the recorded uses on the GPU; the host waits
                // only if that fails.
                let ordered = g.marks.order_before(&self.backend, &s.stream, &mut 0);
                if ordered {
                    self.give_back(g.ptr, class_size(g.class), &s.stream);
                } else {
                    self.abandon(class_size(g.class));
                }
            }
        }
    }
}
