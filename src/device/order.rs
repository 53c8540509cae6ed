//! Stream order, as the device cache and the page heap use it: "mark a point on stream
//! S", "make T wait for it", "has it completed?". `CudaBackend` implements it with pooled
//! CUDA events; the simulated GPU (`device/fake/`) with vector clocks. Split from the
//! memory side (`Backend`) so that the page heap and the thread caches, which only order,
//! do not depend on the backends.

use crate::cuda::StreamId;
use crate::error::Result;
use crate::trace::Tag;

/// Stream order: streams, marks recorded on them, and waits for marks.
pub(crate) trait StreamOrder: Send + Sync + 'static {
    /// A live handle of a stream (the cache keeps one for every stream whose blocks it
    /// holds, to record marks on it later).
    type Stream: Clone + Send + Sync + 'static;
    /// A point recorded on a stream (a CUDA event).
    type Mark: Send + 'static;

    /// The stream's process-unique id (never the raw handle, which the driver reuses).
    fn stream_id(stream: &Self::Stream) -> StreamId;
    /// Records a mark at the current end of `stream`.
    fn mark(&self, stream: &Self::Stream) -> Result<Self::Mark>;
    /// Makes work queued on `stream` from now on wait for `mark` (no host wait).
    fn wait(&self, stream: &Self::Stream, mark: &Self::Mark) -> Result<()>;
    /// Whether the work before `mark` has completed (never blocks).
    fn is_complete(&self, mark: &Self::Mark) -> Result<bool>;
    /// Blocks the host until the work before `mark` has completed.
    fn wait_host(&self, mark: &Self::Mark) -> Result<()>;
    /// Whether all work queued on `stream` so far has completed (never blocks; an error
    /// counts as "not known").
    fn is_idle(&self, stream: &Self::Stream) -> Result<bool>;
    /// Blocks the host until all work queued on `stream` has completed.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;
    /// The pool's trace tag: the cache, the hot path and the page heap record through it.
    fn trace(&self) -> &Tag;
}

/// The uses of one piece of device memory on streams other than its home stream, as one
/// set for the cache's gated blocks and the arena's recorded uses (the page heap's stamps
/// are to follow): first the streams (a use is declared while its work may still be
/// queued), then, [sealed](MarkSet::seal) when the memory is freed and every use has been
/// queued, one mark at the end of each, at most one per stream (the latest by `seq`).
/// Completed marks are dropped as polls find them, so a set polled again asks only about
/// the rest. Algorithm core: `&mut self`, no lock; every method makes driver calls, so
/// callers hold no lock around them.
///
/// A failed query or wait is never taken as completion (the rule stated on
/// [`Fence`](crate::fence::Fence)): the memory stays pending, and where a wait was the last
/// resort it is given up (neither reused nor freed).
pub(crate) struct MarkSet<O: StreamOrder> {
    /// Streams with uses, not yet marked (one per stream).
    streams: Vec<O::Stream>,
    /// (stream, seq, mark): the latest mark of each stream, not yet found complete.
    marks: Vec<(StreamId, u64, O::Mark)>,
}

impl<O: StreamOrder> Default for MarkSet<O> {
    fn default() -> Self {
        Self {
            streams: Vec::new(),
            marks: Vec::new(),
        }
    }
}

impl<O: StreamOrder> MarkSet<O> {
    /// The uses on `uses` other than `home` (each stream once).
    pub(crate) fn of_uses(home: StreamId, uses: Vec<O::Stream>) -> Self {
        let mut set = Self::default();
        for u in uses {
            if O::stream_id(&u) != home {
                set.add(u);
            }
        }
        set
    }

    /// Declares a use on `stream` (kept once per stream).
    pub(crate) fn add(&mut self, stream: O::Stream) {
        let id = O::stream_id(&stream);
        if !self.streams.iter().any(|s| O::stream_id(s) == id) {
            self.streams.push(stream);
        }
    }

    /// Streams and marks not yet found complete.
    pub(crate) fn len(&self) -> usize {
        self.streams.len() + self.marks.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps `mark` of stream `id` recorded at `seq`, unless the set has a later one of
    /// that stream; returns the mark that goes (to be dropped after the caller's locks).
    pub(crate) fn insert(&mut self, id: StreamId, seq: u64, mark: O::Mark) -> Option<O::Mark> {
        match self.marks.iter_mut().find(|m| m.0 == id) {
            Some(m) if m.1 >= seq => Some(mark),
            Some(m) => Some(core::mem::replace(m, (id, seq, mark)).2),
            None => {
                self.marks.push((id, seq, mark));
                None
            }
        }
    }

    /// Records one mark at the current end of each declared stream (at `seq`), after all
    /// work queued there so far; a stream that cannot be marked is waited for on the host
    /// instead. Counts the marks recorded in `recorded`; the error is that of a host wait
    /// that failed too (the memory must then be given up). The stream handles are dropped
    /// here.
    pub(crate) fn seal(&mut self, order: &O, seq: u64, recorded: &mut u64) -> Result<()> {
        for s in core::mem::take(&mut self.streams) {
            match order.mark(&s) {
                Ok(m) => {
                    drop(self.insert(O::stream_id(&s), seq, m));
                    *recorded += 1;
                }
                Err(e) => {
                    log::warn!("cudalloc: could not record a use of device memory ({e}); synchronizing");
                    order.synchronize(&s)?;
                }
            }
        }
        Ok(())
    }

    /// Whether every mark has completed (never blocks; streams not sealed yet count as
    /// pending). Completed marks are dropped; a failed query leaves its mark pending.
    pub(crate) fn poll(&mut self, order: &O) -> bool {
        self.marks
            .retain(|(_, _, m)| !matches!(order.is_complete(m), Ok(true)));
        self.is_empty()
    }

    /// Makes work queued on `stream` from now on wait for every mark on the GPU (on the
    /// host where that fails). False if a wait failed both ways: the memory must be given
    /// up. Counts the marks waited for in `waits`.
    pub(crate) fn order_before(&self, order: &O, stream: &O::Stream, waits: &mut u64) -> bool {
        debug_assert!(self.streams.is_empty(), "ordering after an unsealed set");
        self.marks.iter().all(|(_, _, m)| {
            *waits += 1;
            order.wait(stream, m).is_ok() || order.wait_host(m).is_ok()
        })
    }

    /// Blocks the host until every mark has completed. False if a wait failed (recorded
    /// as a drop error): the memory must be given up.
    pub(crate) fn wait_host(&mut self, order: &O) -> bool {
        debug_assert!(self.streams.is_empty(), "waiting for an unsealed set");
        let ok = self.marks.iter().all(|(_, _, m)| match order.wait_host(m) {
            Ok(()) => true,
            Err(e) => {
                crate::cuda::record_drop_error("waiting for a recorded use of device memory", e);
                false
            }
        });
        if ok {
            self.marks.clear();
        }
        ok
    }
}
