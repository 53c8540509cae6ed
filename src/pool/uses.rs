//! Recorded GPU uses of a pool's live blocks, and the pending list of freed blocks that
//! wait for those uses to finish before they may be handed out again.
//!
//! [`UseTracker`] owns the lock over both and the two atomics that mirror them for the
//! lock-free free path (`Pool::free` reads "does any block have uses?" with one load). The
//! mirrors are published in one place: by the drop of the [`TrackerGuard`] every change
//! goes through, before the lock is released, so no editor can forget the Release store the
//! free path's correctness depends on.
//!
//! Fences are polled with no lock held: the list is taken out under the lock, polled, and
//! the unfinished part put back (the approach of PyTorch's host caching allocator).

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use super::BlockPtr;
use crate::fence::{SharedFence, UseSet};
use crate::sync::{lock, AtomicUsize, Mutex, MutexGuard, Ordering};

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
    pub(crate) fences: UseSet,
}

/// Uses recorded on live blocks and the pending list: the algorithm core behind the lock.
#[derive(Default)]
pub(crate) struct Tracker {
    /// Fences per live block, keyed by the block's address as handed out (small blocks)
    /// or its extent's base (large blocks).
    uses: HashMap<usize, UseSet>,
    /// Freed blocks with unfinished fences, oldest first.
    // pending_bytes == sum of list[i].size, plus the blocks a drain has taken out and not
    // yet settled (see `settle`); likewise pending_blocks.
    list: Vec<PendingBlock>,
    pending_bytes: usize,
    pending_blocks: usize,
    /// Lists taken out by drains ([`Tracker::take_list`]) and not yet settled.
    out: usize,
    /// The fences of the oldest block of the lists out: the oldest pending block while a
    /// drain polls (the list in here is then empty or younger), so that a backpressure
    /// wait meanwhile still finds something to wait for.
    out_oldest: Option<Vec<SharedFence>>,
    /// Blocks a drain found complete and settled (no longer pending) that it has not yet
    /// put back in a free list ([`UseTracker::returned`]): room on its way, which a
    /// backpressure wait meanwhile waits for rather than give up.
    returning: usize,
}

impl Tracker {
    /// Attaches `fence` to the block at `key`. Returns a superseded fence (same stream),
    /// which the caller drops after releasing the lock.
    pub(crate) fn record(&mut self, key: usize, fence: SharedFence) -> Option<SharedFence> {
        self.uses.entry(key).or_default().record(fence)
    }

    /// The fences recorded for the block at `key`, removed.
    pub(crate) fn take_uses(&mut self, key: usize) -> Option<UseSet> {
        self.uses.remove(&key)
    }

    /// Every fence recorded on a live block, with its block's key (shared, to be polled
    /// without the lock).
    pub(crate) fn snapshot_uses(&self) -> Vec<(usize, SharedFence)> {
        self.uses
            .iter()
            .flat_map(|(&k, set)| set.fences().iter().map(move |f| (k, f.clone())))
            .collect()
    }

    /// Forgets fences found complete (entries left empty go too): a completed use no
    /// longer holds its block back, and while no block has uses, frees skip the lock.
    pub(crate) fn forget_completed(&mut self, done: &[(usize, SharedFence)]) {
        for (key, fence) in done {
            if let Some(set) = self.uses.get_mut(key) {
                set.forget(fence);
                if set.is_empty() {
                    self.uses.remove(key);
                }
            }
        }
    }

    /// Removes and returns the fences of every block in `start..end` (blocks being
    /// returned to the source; such entries are stale: their blocks are free).
    pub(crate) fn take_uses_in(&mut self, start: usize, end: usize) -> Vec<UseSet> {
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

    /// Takes the whole list out, to be polled without the lock; a non-empty list must be
    /// given back with [`Tracker::settle`]. Until then its oldest block's fences stay
    /// readable ([`Tracker::oldest_fences`]).
    pub(crate) fn take_list(&mut self) -> Vec<PendingBlock> {
        let list = core::mem::take(&mut self.list);
        if let Some(first) = list.first() {
            // A list already out holds older blocks than this one.
            if self.out == 0 {
                self.out_oldest = Some(first.fences.fences().to_vec());
            }
            self.out += 1;
        }
        list
    }

    /// Puts back the blocks still waiting of a list taken out (before any pushed
    /// meanwhile: oldest first) and accounts for the `done` ones, which the caller
    /// returns to the free lists.
    pub(crate) fn settle(&mut self, mut waiting: Vec<PendingBlock>, done: &[PendingBlock]) {
        debug_assert!(self.out > 0, "settle without a list taken out");
        self.out = self.out.saturating_sub(1);
        if self.out == 0 {
            self.out_oldest = None;
        }
        waiting.append(&mut self.list);
        self.list = waiting;
        self.returning += done.len();
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

    /// The fences of the oldest pending block (shared), to wait for without the lock:
    /// while a drain has the list out, those of the oldest block it took. `None` when
    /// nothing is pending.
    pub(crate) fn oldest_fences(&self) -> Option<Vec<SharedFence>> {
        self.out_oldest
            .clone()
            .or_else(|| self.list.first().map(|b| b.fences.fences().to_vec()))
    }

    /// The fences of every pending block, block by block (shared), to wait for without
    /// the lock while the list stays in place.
    pub(crate) fn pending_fences(&self) -> Vec<Vec<SharedFence>> {
        self.list.iter().map(|b| b.fences.fences().to_vec()).collect()
    }

    /// Whether a drain is putting completed blocks back in the free lists (see
    /// [`Tracker::settle`] and [`UseTracker::returned`]).
    pub(crate) fn returning(&self) -> bool {
        self.returning != 0
    }

    /// Pending bytes and blocks.
    pub(crate) fn totals(&self) -> (usize, usize) {
        (self.pending_bytes, self.pending_blocks)
    }

    /// Blocks with recorded uses.
    pub(crate) fn uses_len(&self) -> usize {
        self.uses.len()
    }

    /// Everything, for a pool being dropped.
    pub(crate) fn take_all(&mut self) -> (Vec<PendingBlock>, Vec<UseSet>) {
        self.pending_bytes = 0;
        self.pending_blocks = 0;
        self.out_oldest = None;
        (
            core::mem::take(&mut self.list),
            self.uses.drain().map(|(_, f)| f).collect(),
        )
    }
}

/// The tracker behind its lock, with the mirrors the lock-free paths read.
#[derive(Default)]
pub(crate) struct UseTracker {
    state: Mutex<Tracker>,
    /// `state.uses_len()`, published (Release) by every guard before it unlocks, read
    /// (Acquire) by `Pool::free` without the lock: see the argument there.
    uses: AtomicUsize,
    /// `state.totals().1` (pending blocks), published likewise; read Relaxed to skip
    /// draining an empty list (a stale value only costs or saves one drain).
    pending: AtomicUsize,
    /// How many times a drain has finished putting completed blocks back in the free
    /// lists (under the lock, Release; read Acquire): an allocation that failed at the cap
    /// tries again if it moved since before the attempt, whose look at the free lists may
    /// have come just before the blocks.
    returns: AtomicUsize,
}

/// Exclusive access to the tracker; publishes the mirrors when dropped, lock still held.
pub(crate) struct TrackerGuard<'a> {
    guard: MutexGuard<'a, Tracker>,
    mirrors: &'a UseTracker,
}

impl Deref for TrackerGuard<'_> {
    type Target = Tracker;
    fn deref(&self) -> &Tracker {
        &self.guard
    }
}

impl DerefMut for TrackerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Tracker {
        &mut self.guard
    }
}

impl Drop for TrackerGuard<'_> {
    fn drop(&mut self) {
        // Runs before the `guard` field is dropped, so both stores happen under the lock.
        self.mirrors.uses.store(self.guard.uses_len(), Ordering::Release);
        self.mirrors
            .pending
            .store(self.guard.totals().1, Ordering::Relaxed);
    }
}

impl UseTracker {
    pub(crate) fn lock(&self) -> TrackerGuard<'_> {
        TrackerGuard {
            guard: lock(&self.state),
            mirrors: self,
        }
    }

    /// Whether some live block has recorded uses (Acquire: see `Pool::free`).
    #[inline(always)]
    pub(crate) fn any_uses(&self) -> bool {
        self.uses.load(Ordering::Acquire) != 0
    }

    /// Whether some live block may have recorded uses, without ordering (a hint).
    #[inline]
    pub(crate) fn any_uses_hint(&self) -> bool {
        self.uses.load(Ordering::Relaxed) != 0
    }

    /// Whether some freed block may be pending (a hint).
    #[inline]
    pub(crate) fn any_pending(&self) -> bool {
        self.pending.load(Ordering::Relaxed) != 0
    }

    /// The count of finished returns (see the field); Acquire, so that the blocks of
    /// every return it counts are seen in the free lists.
    #[inline]
    pub(crate) fn returns(&self) -> usize {
        self.returns.load(Ordering::Acquire)
    }

    /// A drain has put back in the free lists the `n` completed blocks it settled.
    pub(crate) fn returned(&self, n: usize) {
        let mut t = self.lock();
        debug_assert!(t.returning >= n, "{n} blocks returned of {} settled", t.returning);
        t.returning -= n;
        self.returns.fetch_add(1, Ordering::Release);
    }

    /// Whether room may have come back since `seen` (a [`UseTracker::returns`] read before
    /// a failed attempt) or is coming back: a drain is putting blocks back, or finished
    /// doing so since.
    pub(crate) fn room_returning(&self, seen: usize) -> bool {
        self.lock().returning() || self.returns() != seen
    }
}

impl PendingBlock {
    /// Queries the fences (no lock may be held: these are driver calls), dropping the
    /// completed ones; true when none is left.
    pub(crate) fn poll(&mut self) -> bool {
        self.fences.poll()
    }
}
