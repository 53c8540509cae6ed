//! The cache's free slow path: a block with recorded uses on other streams waits in its
//! home stream's gated list behind one mark per stream (or, when a stream cannot be marked,
//! after a host wait); a block too large to cache goes to the backend once its home stream
//! is ordered after its uses; the others go to the thread's bin (making room there) or the
//! shared list. Invariant: no freed block becomes reusable by another stream before every
//! recorded use is complete or ordered before it (the protocol in `cache.rs`).

use super::{Cache, Gated};
use crate::cuda::StreamId;
use crate::device::backend::Backend;
use crate::device::order::MarkSet;
use crate::device::size_class::{class_size, round_to_granule};
use crate::device::thread_cache::ThreadCache;
use crate::sync::Ordering;
use crate::trace::{Code, Note};

impl<B: Backend> Cache<B> {
    /// The free slow path: `ptr`, serving a request of `bytes`, freed on its home stream
    /// `stream` (whose handle the freed buffer gives up), with recorded uses on `uses`.
    pub(crate) fn free_slow<P>(
        &self,
        tc: Option<&mut ThreadCache<B, P>>,
        ptr: u64,
        bytes: usize,
        stream: B::Stream,
        uses: Vec<B::Stream>,
    ) {
        let home = B::stream_id(&stream);
        let Some(class) = self.class_for(bytes) else {
            let rounded = round_to_granule(bytes).unwrap_or(bytes);
            if let (Some(t), true) = (tc, uses.is_empty() && self.is_large(rounded)) {
                return self.free_large(t, ptr, rounded, stream);
            }
            return self.free_uncached(ptr, rounded, stream, uses);
        };
        let had_uses = !uses.is_empty();
        if self.guarded() && uses.iter().any(|u| B::stream_id(u) != home) {
            let Some(marks) = self.mark_uses(home, uses) else {
                return self.abandon(class_size(class));
            };
            if !marks.is_empty() {
                return self.push_gated(&stream, class, ptr, marks);
            } // else every use was waited for on the host: an ordinary free
        } else {
            drop(uses);
        }
        if had_uses {
            // Its free was recorded as requested only (`Owned::release`): reusable now.
            self.freed(ptr, bytes, &stream);
        }
        if let Some(t) = tc {
            if t.reclaim_requested() {
                self.flush_thread(t);
            }
            if t.holds_class(class) && self.put_in_thread(t, &stream, class, ptr) {
                return;
            }
        }
        self.give_blocks(&stream, class, vec![ptr]);
    }

    /// Keeps a freed block of `class` in the thread's bin of `stream`, making room there
    /// first (half of a full bin, and stale classes that fill the budget, go to the shared
    /// lists); false when it still does not fit.
    fn put_in_thread<P>(
        &self,
        t: &mut ThreadCache<B, P>,
        stream: &B::Stream,
        class: usize,
        ptr: u64,
    ) -> bool {
        let (i, evicted) = t.entry(stream);
        if let Some(ev) = evicted {
            self.give_evicted([ev]);
        }
        if t.bin_is_full(i, class) {
            let half = t.take_half(i, class);
            self.give_blocks(stream, class, half);
        }
        if !t.has_room(i, class) {
            // Stale classes fill the budget: make room for the working set.
            let others = t.take_all_but(i, class);
            self.give_evicted(others);
        }
        t.put_block(i, class, ptr)
    }

    /// One mark on each stream of `uses` other than `home`. A stream that cannot be
    /// marked is waited for on the host instead; `None` if that fails too.
    fn mark_uses(&self, home: StreamId, uses: Vec<B::Stream>) -> Option<MarkSet<B>> {
        let mut marks = MarkSet::of_uses(home, uses);
        let mut recorded = 0;
        let sealed = marks.seal(&self.backend, 0, &mut recorded);
        self.counters.marks.fetch_add(recorded, Ordering::Relaxed);
        match sealed {
            Ok(()) => Some(marks),
            Err(e) => {
                crate::cuda::record_drop_error("synchronizing a stream that used a device block", e);
                None
            }
        }
    }

    fn push_gated(&self, stream: &B::Stream, class: usize, ptr: u64, marks: MarkSet<B>) {
        self.shared.lock().push_gated(stream, Gated { ptr, class, marks });
    }

    /// Frees a block too large to cache: its home stream first waits for the recorded
    /// uses (on the GPU), then frees it in its order.
    fn free_uncached(&self, ptr: u64, bytes: usize, stream: B::Stream, uses: Vec<B::Stream>) {
        let home = B::stream_id(&stream);
        if self.guarded() {
            for u in uses.iter().filter(|u| B::stream_id(u) != home) {
                let ordered = self.order_after(u, &stream);
                if let Err(e) = ordered.or_else(|_| self.backend.synchronize(u)) {
                    crate::cuda::record_drop_error("ordering the free of a device block after its uses", e);
                    return self.abandon(bytes);
                }
            }
        }
        if !uses.is_empty() {
            // Ordered after its uses on the GPU: reusable (by the driver) from here on.
            self.freed(ptr, bytes, &stream);
        }
        self.give_back(ptr, bytes, &stream);
    }

    /// Records that the freed block at `ptr` (`bytes`) became reusable: its recorded uses
    /// on other streams completed, or are ordered before its home stream's next work.
    pub(super) fn freed(&self, ptr: u64, bytes: usize, home: &B::Stream) {
        self.backend.trace().event(|| Note {
            stream: B::stream_id(home).get(),
            ..Note::new(Code::FreeCompleted, ptr as usize, bytes)
        });
    }
}
