//! What a pool holds from its source and what it has handed out, as counters that any
//! thread updates without a lock, and the budget its source allocations are reserved from.
//!
//! The invariant (exact whenever no thread is inside the pool), checked by
//! [`Accounting::check`] in debug builds and tests:
//! `out + shared_cached + pending == held`, where `out` is the bytes handed out of the
//! shared state (live blocks plus blocks parked in thread caches), `shared_cached` the free
//! blocks in the shared lists and large extents plus uncarved chunk space, `pending` the
//! freed blocks waiting for fences, and `held` the bytes taken from the source.

use crate::budget::Budget;
use crate::error::Result;

use crate::sync::{Arc, AtomicU64, AtomicUsize, Ordering};

pub(crate) struct Accounting {
    /// The cap this pool's source allocations are reserved from (possibly shared).
    pub(crate) budget: Arc<Budget>,
    // held == chunk bytes + large segment bytes
    held: AtomicUsize,
    held_blocks: AtomicUsize,
    peak_held: AtomicUsize,
    // out == live + bytes in thread caches
    out_bytes: AtomicUsize,
    out_blocks: AtomicUsize,
    peak_out: AtomicUsize,
    /// Allocations not served by a thread-cache pop.
    shared_allocs: AtomicU64,
    misses: AtomicU64,
    failures: AtomicU64,
}

/// A reading of the counters.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) held: usize,
    pub(crate) held_blocks: usize,
    pub(crate) peak_held: usize,
    pub(crate) out_bytes: usize,
    pub(crate) out_blocks: usize,
    pub(crate) peak_out: usize,
    pub(crate) shared_allocs: u64,
    pub(crate) misses: u64,
    pub(crate) failures: u64,
}

impl Accounting {
    pub(crate) fn new(budget: Arc<Budget>) -> Self {
        Self {
            budget,
            held: AtomicUsize::new(0),
            held_blocks: AtomicUsize::new(0),
            peak_held: AtomicUsize::new(0),
            out_bytes: AtomicUsize::new(0),
            out_blocks: AtomicUsize::new(0),
            peak_out: AtomicUsize::new(0),
            shared_allocs: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    /// Reserves `size` bytes of the budget for a source allocation about to be made.
    pub(crate) fn reserve(&self, size: usize) -> Result<()> {
        self.budget.reserve(size)
    }

    /// The source allocation reserved for failed: gives the reservation back.
    pub(crate) fn unreserve(&self, size: usize) {
        self.budget.release(size);
    }

    /// A source allocation of `size` bytes (reserved) succeeded.
    pub(crate) fn on_source_alloc(&self, size: usize) {
        let now = self.held.fetch_add(size, Ordering::Relaxed) + size;
        self.held_blocks.fetch_add(1, Ordering::Relaxed);
        self.peak_held.fetch_max(now, Ordering::Relaxed);
    }

    /// An allocation that had to take memory from the source.
    pub(crate) fn count_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// A source allocation of `size` bytes went back to the source.
    pub(crate) fn on_source_free(&self, size: usize) {
        self.held.fetch_sub(size, Ordering::Relaxed);
        self.held_blocks.fetch_sub(1, Ordering::Relaxed);
        self.budget.release(size);
    }

    /// Blocks handed out of the shared state (to a user or a thread cache).
    pub(crate) fn count_out(&self, blocks: usize, bytes: usize) {
        let now = self
            .out_bytes
            .fetch_add(bytes, Ordering::Relaxed)
            .wrapping_add(bytes);
        self.out_blocks.fetch_add(blocks, Ordering::Relaxed);
        self.peak_out.fetch_max(now, Ordering::Relaxed);
    }

    /// Blocks returned to the shared state (free lists, large extents, pending list).
    pub(crate) fn uncount_out(&self, blocks: usize, bytes: usize) {
        self.out_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.out_blocks.fetch_sub(blocks, Ordering::Relaxed);
    }

    /// An allocation handed out by a slow path (not a thread-cache pop).
    pub(crate) fn count_shared_alloc(&self) {
        self.shared_allocs.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn read(&self) -> Counts {
        Counts {
            held: self.held.load(Ordering::Relaxed),
            held_blocks: self.held_blocks.load(Ordering::Relaxed),
            peak_held: self.peak_held.load(Ordering::Relaxed),
            out_bytes: self.out_bytes.load(Ordering::Relaxed),
            out_blocks: self.out_blocks.load(Ordering::Relaxed),
            peak_out: self.peak_out.load(Ordering::Relaxed),
            shared_allocs: self.shared_allocs.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }

    /// Checks `out + shared_cached + pending == held` and `held == chunk + large bytes`,
    /// given the other parts' totals; only meaningful while no thread is inside the pool.
    pub(crate) fn check(
        &self,
        shared_cached: usize,
        pending: usize,
        chunk_bytes: usize,
        large_bytes: usize,
    ) -> Result<(), String> {
        let c = self.read();
        if c.held != chunk_bytes + large_bytes {
            return Err(format!(
                "held ({}) != chunk bytes ({chunk_bytes}) + large bytes ({large_bytes})",
                c.held
            ));
        }
        if c.out_bytes.wrapping_add(shared_cached).wrapping_add(pending) != c.held {
            return Err(format!(
                "out ({}) + shared cached ({shared_cached}) + pending ({pending}) != held ({})",
                c.out_bytes, c.held
            ));
        }
        Ok(())
    }
}
