//! Recorded GPU uses of live blocks, and the pending list of freed blocks that wait for
//! those uses to finish before they may be handed out again.
//!
//! `deallocate` has no stream argument, so the pool cannot know by itself whether a copy
//! or kernel still reads a block. `record_use` attaches a [`Fence`] (a CUDA event recorded
//! on the stream of the use) to the block; a block freed with unfinished fences goes to
//! the pending list and returns to the free lists once they have all completed. Fences
//! are queried with no lock held: the list is taken out under the lock, queried, and the
//! unfinished part put back (the approach of PyTorch's host caching allocator).

use std::collections::HashMap;

use super::BlockPtr;
use crate::cuda::{Event, StreamId};
use crate::error::Result;
use crate::sync::Arc;

/// Something whose completion can be polled: a CUDA event recorded after a GPU use of a
/// block. The pool holds a freed block back until every fence recorded for it completes.
///
/// Implemented by [`cuda::Event`](crate::cuda::Event) and by the crate's pooled events;
/// tests implement it with a flag to drive the pending logic without a GPU.
///
/// ```
/// use cudalloc::pool::Fence;
/// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
///
/// struct Flag(Arc<AtomicBool>);
/// impl Fence for Flag {
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
pub trait Fence: Send + Sync + 'static {
    /// Whether the use has completed. Must not block. An error (a failed kernel, a lost
    /// device) is logged by the pool and treated as completion: the GPU no longer runs
    /// the work, and keeping the block forever would leak it.
    fn is_complete(&self) -> Result<bool>;

    /// Blocks until the use has completed (used when a pool is dropped with blocks still
    /// pending). The default polls [`Fence::is_complete`], yielding between polls.
    fn wait(&self) -> Result<()> {
        while !self.is_complete()? {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// An identifier of the stream the fence was recorded on, if it is a point in one
    /// stream's order. A later fence of the same stream completes after an earlier one,
    /// so the pool keeps only the latest per stream and block.
    fn stream_id(&self) -> Option<StreamId> {
        None
    }
}

impl Fence for Event {
    fn is_complete(&self) -> Result<bool> {
        Event::is_complete(self)
    }
    fn wait(&self) -> Result<()> {
        self.synchronize()
    }
}

impl Fence for crate::cuda::PooledEvent {
    fn is_complete(&self) -> Result<bool> {
        crate::cuda::PooledEvent::is_complete(self)
    }
    fn wait(&self) -> Result<()> {
        self.synchronize()
    }
    fn stream_id(&self) -> Option<StreamId> {
        Some(self.stream_id())
    }
}

/// A fence, shared so it can be polled outside the lock while its entry stays in place.
pub(crate) type SharedFence = Arc<Box<dyn Fence>>;
pub(crate) type Fences = Vec<SharedFence>;

/// Which free list a block returns to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockKind {
    /// A block of a size class, carved from a chunk.
    Small(usize),
    /// A large block (an extent of a segment); `ptr` is the pointer handed out (it may
    /// lie above the extent's base when the request was over-aligned).
    Large,
}

/// A freed block waiting for its fences.
pub(crate) struct PendingBlock {
    pub(crate) ptr: BlockPtr,
    pub(crate) kind: BlockKind,
    /// Block bytes, as counted in the statistics.
    pub(crate) size: usize,
    pub(crate) fences: Fences,
}

impl PendingBlock {
    /// Queries the fences (no lock may be held: these are driver calls), dropping the
    /// completed ones; true when none is left.
    pub(crate) fn poll(&mut self) -> bool {
        self.fences.retain(|f| match f.is_complete() {
            Ok(done) => !done,
            Err(e) => {
                crate::cuda::record_drop_error("querying a fence of a pending block", e);
                false
            }
        });
        self.fences.is_empty()
    }
}

/// Uses recorded on live blocks and the pending list; kept behind one lock.
#[derive(Default)]
pub(crate) struct Pending {
    /// Fences per live block, keyed by the block's address as handed out.
    uses: HashMap<usize, Fences>,
    /// Freed blocks with unfinished fences.
    // pending_bytes == sum of list[i].size, plus the blocks a drain has taken out and not
    // yet settled (see `settle`).
    list: Vec<PendingBlock>,
    pending_bytes: usize,
    pending_blocks: usize,
}

impl Pending {
    /// Blocks with recorded uses (what the lock-free check on `deallocate` reads).
    pub(crate) fn uses_len(&self) -> usize {
        self.uses.len()
    }

    /// Attaches `fence` to the block at `key`. Returns a superseded fence (same stream),
    /// which the caller drops after releasing the lock.
    pub(crate) fn record(&mut self, key: usize, fence: Box<dyn Fence>) -> Option<SharedFence> {
        let fence = Arc::new(fence);
        let fences = self.uses.entry(key).or_default();
        if let Some(id) = fence.stream_id() {
            if let Some(old) = fences.iter_mut().find(|f| f.stream_id() == Some(id)) {
                return Some(core::mem::replace(old, fence));
            }
        }
        fences.push(fence);
        None
    }

    /// The fences recorded for the block at `key`, removed.
    pub(crate) fn take_uses(&mut self, key: usize) -> Option<Fences> {
        self.uses.remove(&key)
    }

    /// Every fence recorded on a live block, with its block's key (clones, to be polled
    /// without the lock).
    pub(crate) fn snapshot_uses(&self) -> Vec<(usize, SharedFence)> {
        self.uses
            .iter()
            .flat_map(|(&k, fs)| fs.iter().map(move |f| (k, f.clone())))
            .collect()
    }

    /// Forgets fences found complete (entries left empty go too): a completed use no
    /// longer holds its block back, and while no block has uses, frees skip the lock.
    pub(crate) fn forget_completed(&mut self, done: &[(usize, SharedFence)]) {
        for (key, fence) in done {
            if let Some(fences) = self.uses.get_mut(key) {
                fences.retain(|f| !Arc::ptr_eq(f, fence));
                if fences.is_empty() {
                    self.uses.remove(key);
                }
            }
        }
    }

    /// Removes and returns the fences of every block in `start..end` (blocks being
    /// returned to the source; such entries are stale: their blocks are free).
    pub(crate) fn take_uses_in(&mut self, start: usize, end: usize) -> Vec<Fences> {
        let keys: Vec<usize> = self
            .uses
            .keys()
            .copied()
            .filter(|k| (start..end).contains(k))
            .collect();
        keys.into_iter().filter_map(|k| self.uses.remove(&k)).collect()
    }

    /// Adds a freed block to the pending list.
    pub(crate) fn push(&mut self, block: PendingBlock) {
        self.pending_bytes += block.size;
        self.pending_blocks += 1;
        self.list.push(block);
    }

    /// Takes the whole list out, to be polled without the lock.
    pub(crate) fn take_list(&mut self) -> Vec<PendingBlock> {
        core::mem::take(&mut self.list)
    }

    /// Puts back the blocks still waiting and accounts for the `done` ones, which the
    /// caller returns to the free lists.
    pub(crate) fn settle(&mut self, waiting: Vec<PendingBlock>, done: &[PendingBlock]) {
        self.list.extend(waiting);
        for b in done {
            self.pending_bytes -= b.size;
            self.pending_blocks -= 1;
        }
        debug_assert!(
            self.pending_blocks >= self.list.len(),
            "pending_blocks {} below the list's {}",
            self.pending_blocks,
            self.list.len()
        );
    }

    /// Pending bytes and blocks.
    pub(crate) fn totals(&self) -> (usize, usize) {
        (self.pending_bytes, self.pending_blocks)
    }

    /// Everything, for a pool being dropped.
    pub(crate) fn take_all(&mut self) -> (Vec<PendingBlock>, Vec<Fences>) {
        self.pending_bytes = 0;
        self.pending_blocks = 0;
        (
            core::mem::take(&mut self.list),
            self.uses.drain().map(|(_, f)| f).collect(),
        )
    }
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

    impl Fence for FlagFence {
        fn is_complete(&self) -> Result<bool> {
            Ok(self.0.load(Ordering::Acquire))
        }
    }
}
