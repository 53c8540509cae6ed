//! Stream order, as the device cache and the page heap use it: "mark a point on stream
//! S", "make T wait for it", "has it completed?". `CudaBackend` implements it with pooled
//! CUDA events; the simulated GPU (`device/fake.rs`) with vector clocks. Split from the
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
