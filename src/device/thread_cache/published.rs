//! What a thread cache publishes for other threads: its counters (read by `stats()` and
//! by the collection of a dropped pool), the reclaim flag others raise, and the claim on
//! the cache (`device/close.rs`).

use super::MAX_STREAMS;
use crate::sync::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, Ordering};
use crate::thread_registry::ThreadCounters;

/// One stream slot's published counters.
#[derive(Debug, Default)]
pub(crate) struct SlotStats {
    /// The stream's id (0: the slot is unused).
    pub(crate) id: AtomicU64,
    /// Bytes of free blocks of that stream in the thread's bins.
    pub(crate) bytes: AtomicU64,
    /// Free blocks of that stream in the thread's bins.
    pub(crate) blocks: AtomicU64,
}

/// One thread's counters for one pool, written only by that thread (plain stores, never
/// a read-modify-write) and read by `stats()` and by the collection of a dropped pool
/// (`device/close.rs`); the flag other threads set to ask for the thread's blocks back;
/// and the claim on the cache by which a dropped pool's last handle takes the blocks of a
/// thread that will not touch the pool again. Aligned to its own cache lines.
///
/// Invariant (the one `close.rs` relies on): the published parked handles (blocks minus
/// `bare`, over the slots) never exceed the pool handles the bins hold, plus those the
/// owner took out of them and has not dropped yet: a block's count is published after it
/// entered a bin, and its removal before its handles are dropped; where a block without
/// handles comes or goes, `bare` rises before the block count and falls after it, so that
/// no moment between the two stores counts a handle too many. Every change of a
/// slot's block count is seen in `hits` (the hot pop), `takes` (a slow path's removal),
/// or as a rise of the count itself (a push), so two equal readings of them all mean
/// that the owner changed nothing in between.
#[repr(align(128))]
#[derive(Debug, Default)]
pub(crate) struct ThreadStats {
    /// Set by `trim()`, the out-of-memory path of another thread and a pool's close: the
    /// owner moves its blocks to the shared cache at its next allocation or free.
    pub(crate) reclaim: AtomicBool,
    /// Allocations served from the bins.
    pub(crate) hits: AtomicU64,
    /// Removals of blocks by slow paths (each publishes before it drops handles).
    pub(crate) takes: AtomicU64,
    /// Blocks in the bins that carry no handles (put there by slow paths).
    pub(crate) bare: AtomicU64,
    /// Who may touch the cache besides its owner's operations: `close::FREE`, `BUSY`
    /// (the owner flushes it outside an operation), `EXITING`, `CLAIMED` (another thread
    /// takes its blocks), `GONE` (taken: empty for good).
    pub(crate) state: AtomicU8,
    /// The owner's cache (a `ThreadCache<B, P>` of the pool's types), for a claim; set
    /// once when the cache is boxed in the thread's table, where it stays until dropped.
    pub(crate) cache: AtomicPtr<()>,
    /// Per stream slot (the index of the stream in [`ThreadCache`]'s table).
    pub(crate) slots: [SlotStats; MAX_STREAMS],
}

impl ThreadStats {
    /// What the collection of a dropped pool reads of one thread: its monotonic counts
    /// (`hits`, `takes`), `bare`, and each slot's blocks (`Acquire`: the owner's changes
    /// before a publication are seen with it).
    pub(crate) fn reading(&self) -> [u64; 3 + MAX_STREAMS] {
        let mut r = [0; 3 + MAX_STREAMS];
        r[0] = self.hits.load(Ordering::Acquire);
        r[1] = self.takes.load(Ordering::Acquire);
        r[2] = self.bare.load(Ordering::Acquire);
        for (k, slot) in self.slots.iter().enumerate() {
            r[3 + k] = slot.blocks.load(Ordering::Acquire);
        }
        r
    }

    /// The pool handles a [`reading`](Self::reading) says the bins hold.
    pub(crate) fn parked(reading: &[u64; 3 + MAX_STREAMS]) -> u64 {
        let blocks: u64 = reading[3..].iter().sum();
        blocks.saturating_sub(reading[2])
    }
}

impl ThreadCounters for ThreadStats {
    fn served(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}
