//! The state of a pool that its threads share: per-class free lists, the chunk registry,
//! the large-block cache, recorded uses and the pending list, the budget, and counters.
//!
//! Locks: one per size class (the shared free lists), one for the chunks, one for the
//! large blocks, one for uses and pending blocks, one for the thread registry. A thread
//! holds one at a time, except `trim`, which takes the chunk lock and then every class
//! lock in class order; nothing takes the chunk lock while holding a class lock. No
//! source or driver call runs under any of them.
//!
//! Accounting (exact when no thread is inside the pool):
//! `out + shared_cached + pending == held`, where `out` is the bytes handed out of the
//! shared state (live blocks plus blocks parked in thread caches), `shared_cached` the
//! free blocks in the lists and large cache plus uncarved chunk space, `pending` the
//! freed blocks waiting for fences, and `held` the bytes taken from the source.

use std::collections::HashMap;

use super::chunks::Chunks;
use super::large::{Large, Taken};

/// A large block handed out: pointer, usable bytes from it, base of its extent, and the
/// large epoch it was handed out in.
pub(crate) struct LargeTaken {
    pub(crate) ptr: BlockPtr,
    pub(crate) usable: usize,
    pub(crate) base: usize,
    pub(crate) epoch: u64,
}
use super::pending::{BlockKind, Fence, Pending, PendingBlock};
use super::size_class::{class_size, NUM_CLASSES};
use super::stats::PoolStats;
use super::thread_cache::{CacheCore, ThreadStats};
use super::{registry, Batch, BlockPtr};
use crate::error::{Error, Result};
use crate::source::{align_up, MemorySource, PAGE_SIZE};
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

/// A cap on bytes held from a source, which several pools may share (the process-wide
/// pinned pools share one).
pub(crate) struct Budget {
    limit: AtomicUsize,
    // held == sum of the bytes the pools sharing this budget hold from their sources
    held: AtomicUsize,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit: AtomicUsize::new(limit),
            held: AtomicUsize::new(0),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub(crate) fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    fn reserve(&self, n: usize) -> Result<()> {
        let held = self.held.fetch_add(n, Ordering::Relaxed);
        let limit = self.limit();
        if held.checked_add(n).is_none_or(|after| after > limit) {
            self.held.fetch_sub(n, Ordering::Relaxed);
            return Err(Error::LimitExceeded {
                requested: n,
                held,
                limit,
            });
        }
        Ok(())
    }

    fn release(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A pool's configuration after validation.
pub(crate) struct Settings {
    pub(crate) chunk_size: usize,
    /// Requests above this (or aligned beyond a page) are large blocks; a class size.
    pub(crate) large_threshold: usize,
    /// Classes `0..=max_class` are carved from chunks.
    pub(crate) max_class: usize,
    /// Thread-cache bin capacity per class (`max_class + 1` entries); empty: no caches.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) caps: Box<[usize]>,
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) thread_cache_bytes: usize,
}

/// The per-thread counters of a pool, and what threads that exited left behind.
#[derive(Default)]
struct ThreadRegistry {
    live: Vec<Arc<ThreadStats>>,
    retired_allocs: u64,
}

/// The state a pool's threads share.
pub(crate) struct Shared<S: MemorySource> {
    pub(crate) source: S,
    pub(crate) settings: Settings,
    /// Unique for the life of the process (slots are recycled, uids never).
    pub(crate) uid: u64,
    /// The thread-local table slot of this pool's caches, if it has one.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) slot: Option<usize>,
    pub(crate) budget: Arc<Budget>,
    // held == chunk bytes + large bytes: what this pool holds from the source.
    held: AtomicUsize,
    held_blocks: AtomicUsize,
    peak_held: AtomicUsize,
    // out == live + bytes in thread caches (see the module docs).
    out_bytes: AtomicUsize,
    out_blocks: AtomicUsize,
    peak_out: AtomicUsize,
    /// Free blocks per class.
    lists: Box<[Mutex<Vec<BlockPtr>>]>,
    chunks: Mutex<Chunks>,
    large: Mutex<Large>,
    pending: Mutex<Pending>,
    /// Number of blocks with recorded uses: `pending.uses_len()`, stored (Release) under
    /// the pending lock and read (Acquire) without it by `deallocate` (see `Pool::free`).
    pub(crate) uses: AtomicUsize,
    /// Number of pending blocks, stored under the pending lock; read without it to skip
    /// draining an empty list.
    pending_count: AtomicUsize,
    /// Test switch: with it off, freed blocks skip the pending list.
    pub(crate) pending_enabled: AtomicBool,
    threads: Mutex<ThreadRegistry>,
    /// Moves (under the large lock) whenever large blocks go back to the source; thread
    /// caches trust their record of a large block's size only within one epoch. Read
    /// Relaxed: the move happens-before any later handout of a reused address through
    /// the large lock, and the handout happens-before its free.
    pub(crate) large_epoch: AtomicU64,
    /// Counts drains while some block has uses; every `PRUNE_EVERY`th forgets the
    /// completed ones.
    prune_tick: AtomicUsize,
    /// Allocations not served by a thread-cache pop.
    shared_allocs: AtomicU64,
    misses: AtomicU64,
    failures: AtomicU64,
}

/// Slow-path drains per poll of the uses of live blocks.
const PRUNE_EVERY: usize = 16;

/// Whether trimming the cache could make a failed source request succeed.
fn worth_trimming(e: &Error, size: usize, limit: usize) -> bool {
    !matches!(
        e,
        Error::TooLarge { .. } | Error::NoDriver | Error::InvalidArgument(_)
    ) && size <= limit
}

impl<S: MemorySource> Shared<S> {
    pub(crate) fn new(
        source: S,
        settings: Settings,
        budget: Arc<Budget>,
        uid: u64,
        slot: Option<usize>,
    ) -> Self {
        let chunks = Chunks::new(settings.chunk_size, settings.max_class);
        Self {
            source,
            uid,
            slot,
            budget,
            held: AtomicUsize::new(0),
            held_blocks: AtomicUsize::new(0),
            peak_held: AtomicUsize::new(0),
            out_bytes: AtomicUsize::new(0),
            out_blocks: AtomicUsize::new(0),
            peak_out: AtomicUsize::new(0),
            lists: (0..=settings.max_class.min(NUM_CLASSES - 1))
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
            chunks: Mutex::new(chunks),
            large: Mutex::new(Large::new(
                align_up(settings.large_threshold, PAGE_SIZE)
                    .unwrap_or(PAGE_SIZE)
                    .max(PAGE_SIZE),
            )),
            pending: Mutex::new(Pending::default()),
            uses: AtomicUsize::new(0),
            pending_count: AtomicUsize::new(0),
            pending_enabled: AtomicBool::new(true),
            threads: Mutex::new(ThreadRegistry::default()),
            large_epoch: AtomicU64::new(0),
            prune_tick: AtomicUsize::new(0),
            shared_allocs: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            settings,
        }
    }

    fn count_out(&self, blocks: usize, bytes: usize) {
        let now = self
            .out_bytes
            .fetch_add(bytes, Ordering::Relaxed)
            .wrapping_add(bytes);
        self.out_blocks.fetch_add(blocks, Ordering::Relaxed);
        self.peak_out.fetch_max(now, Ordering::Relaxed);
    }

    fn uncount_out(&self, blocks: usize, bytes: usize) {
        self.out_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.out_blocks.fetch_sub(blocks, Ordering::Relaxed);
    }

    /// Counts an allocation handed out by a slow path (not a thread-cache pop).
    pub(crate) fn count_shared_alloc(&self) {
        self.shared_allocs.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a failed allocation.
    pub(crate) fn count_failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// A cache for a new thread, registered for `stats()`.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn new_cache(&self) -> CacheCore {
        let stats = Arc::new(ThreadStats::default());
        lock(&self.threads).live.push(stats.clone());
        CacheCore::new(&self.settings.caps, self.settings.thread_cache_bytes, stats)
    }

    // ---- the source -------------------------------------------------------------------

    fn source_alloc(&self, size: usize) -> Result<BlockPtr> {
        self.budget.reserve(size)?;
        match self.source.allocate(size) {
            Ok(p) => {
                let now = self.held.fetch_add(size, Ordering::Relaxed) + size;
                self.held_blocks.fetch_add(1, Ordering::Relaxed);
                self.peak_held.fetch_max(now, Ordering::Relaxed);
                registry::insert_range(p.as_ptr() as usize, size, self.uid);
                Ok(BlockPtr::new(p))
            }
            Err(e) => {
                self.budget.release(size);
                Err(e)
            }
        }
    }

    /// # Safety
    /// 1. `p` came from `self.source_alloc(size)` and nothing uses it any more.
    unsafe fn source_free(&self, p: BlockPtr, size: usize) {
        registry::remove_range(p.addr());
        // SAFETY: obligation 1; source_alloc returned this block of `size` bytes.
        unsafe { self.source.deallocate(p.as_non_null(), size) };
        self.held.fetch_sub(size, Ordering::Relaxed);
        self.held_blocks.fetch_sub(1, Ordering::Relaxed);
        self.budget.release(size);
    }

    // ---- small blocks -----------------------------------------------------------------

    /// Takes up to `want` (at least one, at most the batch's room) free blocks of `class`
    /// into `out`: from the shared list, else carved from a chunk, else from a new chunk
    /// (trimming and retrying once if the source fails). Touches no thread cache.
    pub(crate) fn take_small(&self, class: usize, want: usize, out: &mut Batch) -> Result<()> {
        debug_assert!(out.is_empty() && want >= 1);
        {
            let mut list = lock(&self.lists[class]);
            let n = want.min(list.len());
            let from = list.len() - n;
            for p in list.drain(from..) {
                out.push(p);
            }
        }
        if out.is_empty() {
            self.carve(class, want, out)?;
        }
        self.count_out(out.len(), out.len() * class_size(class));
        Ok(())
    }

    fn carve(&self, class: usize, want: usize, out: &mut Batch) -> Result<()> {
        let size = self.settings.chunk_size;
        for attempt in 0..2 {
            if lock(&self.chunks).carve(class, want, out) > 0 {
                return Ok(());
            }
            // No chunk has room: a new one, asked for with no lock held.
            match self.source_alloc(size) {
                Ok(p) => {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    let mut chunks = lock(&self.chunks);
                    chunks.add(p, size);
                    let got = chunks.carve(class, want, out);
                    debug_assert!(
                        got > 0,
                        "a fresh chunk of {size} bytes holds a run of class {class}"
                    );
                    return Ok(());
                }
                Err(e) if attempt == 0 && worth_trimming(&e, size, self.budget.limit()) => {
                    log::debug!("cudalloc: pool source failed ({e}); trimming and retrying once");
                    self.trim();
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the second attempt returns")
    }

    /// Returns blocks of `class` that were handed out (to a user or a thread cache) to
    /// the shared list.
    pub(crate) fn give_small(&self, class: usize, blocks: impl IntoIterator<Item = BlockPtr>) {
        let n = {
            let mut list = lock(&self.lists[class]);
            let before = list.len();
            list.extend(blocks);
            list.len() - before
        };
        self.uncount_out(n, n * class_size(class));
    }

    // ---- large blocks -----------------------------------------------------------------

    /// A large block of `need` bytes (a page multiple) aligned to `align`: from a cached
    /// extent (the smallest that fits; the largest for a `growing` block), else from a
    /// fresh segment (trimming and retrying once if the source fails). Returns the
    /// block, its usable bytes from the pointer, and the large epoch just after it was
    /// taken (a thread cache's record of the block is good while the epoch stays).
    pub(crate) fn take_large(&self, need: usize, align: usize, growing: bool) -> Result<LargeTaken> {
        let take = |this: &Self| {
            let mut large = lock(&this.large);
            let taken = if growing {
                large.take_for_growth(need, align)
            } else {
                large.take(need, align)
            }?;
            Some(this.taken_large(taken))
        };
        if let Some(hit) = take(self) {
            return Ok(hit);
        }
        // A growing block gets a segment with room to double in place; if that much
        // memory is not to be had, one of its own size.
        if growing {
            if let Some(room) = need.checked_mul(2) {
                if let Ok(t) = self.alloc_large_fresh(need, align, room) {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    return Ok(t);
                }
            }
        }
        for attempt in 0..2 {
            match self.alloc_large_fresh(need, align, need) {
                Ok(t) => {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    return Ok(t);
                }
                Err(e) if attempt == 0 && worth_trimming(&e, need, self.budget.limit()) => {
                    log::debug!("cudalloc: pool source failed ({e}); trimming and retrying once");
                    self.trim();
                    if let Some(hit) = take(self) {
                        return Ok(hit);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the second attempt returns")
    }

    /// Accounts for a block just taken from the large registry; called under its lock,
    /// so the epoch read is the one the block was handed out in.
    fn taken_large(&self, t: Taken) -> LargeTaken {
        let epoch = if t.reshaped {
            self.large_epoch.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.large_epoch.load(Ordering::Relaxed)
        };
        self.count_out(1, t.size);
        LargeTaken {
            ptr: t.user,
            usable: t.size - (t.user.addr() - t.base.addr()),
            base: t.base.addr(),
            epoch,
        }
    }

    /// A fresh segment of `room` bytes (at least `need`) with a block of `need` bytes
    /// aligned to `align` taken from its start.
    fn alloc_large_fresh(&self, need: usize, align: usize, room: usize) -> Result<LargeTaken> {
        let too_large = Error::TooLarge {
            requested: room,
            limit: isize::MAX as usize,
        };
        // Sources that promise less than a page return pages in practice (cuMemHostAlloc,
        // cuMemAllocManaged): ask for `room` and over-allocate only if the block is not
        // aligned enough. Beyond a page, over-allocate at once.
        let mut total = if align <= self.source.align().max(PAGE_SIZE) {
            room
        } else {
            room.checked_add(align).ok_or(too_large)?
        };
        let mut base = self.source_alloc(total)?;
        let fits = |base: BlockPtr, total: usize| {
            align_up(base.addr(), align).is_some_and(|u| u - base.addr() + need <= total)
        };
        if !fits(base, total) {
            // SAFETY: allocated just above and never handed out.
            unsafe { self.source_free(base, total) };
            total = room.checked_add(align).ok_or(too_large)?;
            base = self.source_alloc(total)?;
            if !fits(base, total) {
                // SAFETY: as above.
                unsafe { self.source_free(base, total) };
                return Err(Error::InvalidArgument(
                    "the source returned a block below its alignment",
                ));
            }
        }
        let mut large = lock(&self.large);
        let taken = large
            .insert_segment(base, total, need, align)
            .expect("checked by fits");
        Ok(self.taken_large(taken))
    }

    /// Grows the live large block holding `addr` in place so that `need` bytes from
    /// `addr` are usable; returns the usable bytes from `addr`, or `None` if it cannot.
    pub(crate) fn grow_large_in_place(&self, addr: usize, need: usize) -> Option<usize> {
        let mut large = lock(&self.large);
        let (usable, grown) = large.grow_in_place(addr, need)?;
        if grown > 0 {
            self.large_epoch.fetch_add(1, Ordering::Relaxed);
            self.count_out(0, grown);
        }
        Some(usable)
    }

    /// Returns the large block holding `addr` to the large cache; `from_out` when it was
    /// handed out (by a user or a thread cache) rather than pending.
    pub(crate) fn give_large(&self, addr: usize, from_out: bool) {
        let given = {
            let mut large = lock(&self.large);
            let given = large.give_back(addr);
            if given.is_some_and(|(_, _, merged)| merged) {
                self.large_epoch.fetch_add(1, Ordering::Relaxed);
            }
            given
        };
        match given {
            Some((_, size, _)) if from_out => self.uncount_out(1, size),
            Some(_) => {}
            None => {
                log::error!("cudalloc: freeing {addr:#x}, which is no live block of this pool (double free?)")
            }
        }
    }

    // ---- recorded uses and the pending list --------------------------------------------

    /// The key of the block holding `addr` (its address for small blocks, its base for
    /// large ones), if `addr` is in one.
    fn use_key(&self, addr: usize) -> Option<usize> {
        if let Some((block, _)) = lock(&self.chunks).find_block(addr) {
            return Some(block);
        }
        lock(&self.large).find(addr).map(|(base, _, _)| base)
    }

    /// Attaches `fence` to the block holding `addr`.
    pub(crate) fn record_fence(&self, addr: usize, fence: Box<dyn Fence>) -> Result<()> {
        let key = self
            .use_key(addr)
            .ok_or(Error::InvalidArgument("the pointer is in no block of this pool"))?;
        let superseded = {
            let mut p = lock(&self.pending);
            let old = p.record(key, fence);
            self.uses.store(p.uses_len(), Ordering::Release);
            old
        };
        drop(superseded); // outside the lock: a pooled event goes back to its pool
        Ok(())
    }

    /// Whether the pool could find the block holding `addr`.
    pub(crate) fn owns(&self, addr: usize) -> bool {
        self.use_key(addr).is_some()
    }

    /// Called by `deallocate` when some block has recorded uses: if this one has, moves
    /// it to the pending list (or, with the list switched off, forgets the uses) and
    /// returns true if it took the block.
    pub(crate) fn defer_free(&self, ptr: BlockPtr, kind: BlockKind) -> bool {
        let (key, size) = match kind {
            BlockKind::Small(c) => (ptr.addr(), class_size(c)),
            BlockKind::Large => match lock(&self.large).find(ptr.addr()) {
                Some((base, size, false)) => (base, size),
                _ => return false,
            },
        };
        let forgotten = {
            let mut p = lock(&self.pending);
            let fences = p.take_uses(key);
            self.uses.store(p.uses_len(), Ordering::Release);
            match fences {
                Some(fences) if self.pending_enabled.load(Ordering::Relaxed) => {
                    p.push(PendingBlock {
                        ptr,
                        kind,
                        size,
                        fences,
                    });
                    self.pending_count.store(p.totals().1, Ordering::Relaxed);
                    drop(p);
                    self.uncount_out(1, size);
                    return true;
                }
                other => other,
            }
        };
        drop(forgotten);
        false
    }

    /// Returns the pending blocks whose fences have all completed to the free lists, and
    /// now and then forgets completed uses of live blocks. Fences are queried with no
    /// lock held.
    pub(crate) fn drain(&self) {
        if self.uses.load(Ordering::Relaxed) != 0
            && self.prune_tick.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == 0
        {
            self.forget_completed_uses();
        }
        self.drain_pending();
    }

    /// `drain`, always forgetting completed uses (for `trim` and `stats`).
    fn drain_all(&self) {
        if self.uses.load(Ordering::Relaxed) != 0 {
            self.forget_completed_uses();
        }
        self.drain_pending();
    }

    /// Polls the fences of live blocks (without the lock) and forgets the completed ones.
    /// A long-lived block whose uses are recorded again and again (a staging buffer
    /// copied every frame) would otherwise keep `uses` nonzero and every free of the
    /// pool on the slow path.
    fn forget_completed_uses(&self) {
        let snapshot = lock(&self.pending).snapshot_uses();
        let done: Vec<_> = snapshot
            .into_iter()
            .filter(|(_, f)| match f.is_complete() {
                Ok(done) => done,
                Err(e) => {
                    crate::cuda::record_drop_error("querying a fence of a live block", e);
                    true
                }
            })
            .collect();
        if !done.is_empty() {
            let mut p = lock(&self.pending);
            p.forget_completed(&done);
            self.uses.store(p.uses_len(), Ordering::Release);
        }
        drop(done); // outside the lock: pooled events go back to their pool
    }

    fn drain_pending(&self) {
        if self.pending_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let list = lock(&self.pending).take_list();
        if list.is_empty() {
            return;
        }
        let (mut done, mut waiting) = (Vec::new(), Vec::new());
        for mut b in list {
            if b.poll() {
                done.push(b);
            } else {
                waiting.push(b);
            }
        }
        {
            let mut p = lock(&self.pending);
            p.settle(waiting, &done);
            self.pending_count.store(p.totals().1, Ordering::Relaxed);
        }
        for b in done {
            match b.kind {
                BlockKind::Small(c) => lock(&self.lists[c]).push(b.ptr),
                BlockKind::Large => self.give_large(b.ptr.addr(), false),
            }
        }
    }

    // ---- thread caches ----------------------------------------------------------------

    /// Moves every block of a thread's cache back to the shared lists.
    pub(crate) fn flush_cache(&self, core: &mut CacheCore) {
        let (small, large) = core.take_all();
        for (class, blocks) in small {
            self.give_small(class, blocks);
        }
        for (p, _) in large {
            self.give_large(p.addr(), true);
        }
    }

    /// Merges an exiting thread's counters into the totals.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn retire_cache(&self, stats: &Arc<ThreadStats>) {
        let mut t = lock(&self.threads);
        t.retired_allocs += stats.allocs.load(Ordering::Relaxed);
        t.live.retain(|s| !Arc::ptr_eq(s, stats));
    }

    // ---- trim and stats ---------------------------------------------------------------

    /// Returns cached memory to the source: free large blocks and chunks whose blocks are
    /// all free in the shared lists (after flushing the calling thread's cache and
    /// draining the pending list). Returns the bytes released. Blocks in other threads'
    /// caches stay there (flushed when those threads exit or fill their caches).
    pub(crate) fn trim(&self) -> usize {
        #[cfg(not(loom))]
        if let Some(slot) = self.slot {
            super::thread_cache::tls::with_entry(slot, self.uid, |core| self.flush_cache(core));
        }
        self.drain_all();
        let mut released = 0;
        let large = {
            let mut l = lock(&self.large);
            self.large_epoch.fetch_add(1, Ordering::Relaxed);
            l.take_free()
        };
        for (p, size) in large {
            // SAFETY: free blocks of the large cache came from source_alloc and are in no
            // list any more.
            unsafe { self.source_free(p, size) };
            released += size;
        }
        let chunks = self.take_free_chunks();
        if !chunks.is_empty() {
            let stale = {
                let mut p = lock(&self.pending);
                let stale: Vec<_> = chunks
                    .iter()
                    .flat_map(|(c, size)| p.take_uses_in(c.addr(), c.addr() + size))
                    .collect();
                self.uses.store(p.uses_len(), Ordering::Release);
                stale
            };
            drop(stale);
        }
        for (p, size) in chunks {
            // SAFETY: the chunk came from source_alloc; all its carved blocks were free in
            // the shared lists and have been removed from them, under their locks.
            unsafe { self.source_free(p, size) };
            released += size;
        }
        released
    }

    /// Removes every chunk whose carved blocks are all in the shared lists (and those
    /// blocks), for the caller to release.
    fn take_free_chunks(&self) -> Vec<(BlockPtr, usize)> {
        let mut chunks = lock(&self.chunks);
        // Lock order: chunks, then every class list in class order.
        let mut lists: Vec<_> = self.lists.iter().map(lock).collect();
        let mut free: HashMap<usize, usize> = HashMap::new();
        for list in &lists {
            for b in list.iter() {
                if let Some(base) = chunks.chunk_of(b.addr()) {
                    *free.entry(base).or_default() += 1;
                }
            }
        }
        let release: Vec<usize> = chunks
            .bases()
            .filter(|b| free.get(b).copied().unwrap_or(0) == chunks.carved_blocks(*b))
            .collect();
        if release.is_empty() {
            return Vec::new();
        }
        for list in &mut lists {
            list.retain(|b| {
                chunks
                    .chunk_of(b.addr())
                    .is_none_or(|base| release.binary_search(&base).is_err())
            });
        }
        drop(lists);
        release.into_iter().filter_map(|b| chunks.remove(b)).collect()
    }

    /// A snapshot of the counters (drains the pending list first).
    pub(crate) fn stats(&self) -> PoolStats {
        self.drain_all();
        let (tc_bytes, tc_blocks, thread_allocs) = {
            let t = lock(&self.threads);
            t.live
                .iter()
                .fold((0usize, 0usize, t.retired_allocs), |(b, n, a), s| {
                    (
                        b + s.cached_bytes.load(Ordering::Relaxed),
                        n + s.cached_blocks.load(Ordering::Relaxed),
                        a + s.allocs.load(Ordering::Relaxed),
                    )
                })
        };
        let (mut list_bytes, mut list_blocks) = (0, 0);
        for (class, list) in self.lists.iter().enumerate() {
            let n = lock(list).len();
            list_bytes += n * class_size(class);
            list_blocks += n;
        }
        let slack = lock(&self.chunks).slack();
        let (large_bytes, large_blocks) = lock(&self.large).free_totals();
        let (pending_bytes, pending_blocks) = lock(&self.pending).totals();
        let out_bytes = self.out_bytes.load(Ordering::Relaxed);
        let out_blocks = self.out_blocks.load(Ordering::Relaxed);
        let allocs = thread_allocs + self.shared_allocs.load(Ordering::Relaxed);
        let misses = self.misses.load(Ordering::Relaxed);
        PoolStats {
            live_bytes: out_bytes.wrapping_sub(tc_bytes),
            live_blocks: out_blocks.wrapping_sub(tc_blocks),
            peak_bytes: self.peak_out.load(Ordering::Relaxed),
            cached_bytes: tc_bytes + list_bytes + slack + large_bytes,
            cached_blocks: tc_blocks + list_blocks + large_blocks,
            pending_bytes,
            pending_blocks,
            source_bytes: self.held.load(Ordering::Relaxed),
            source_blocks: self.held_blocks.load(Ordering::Relaxed),
            peak_source_bytes: self.peak_held.load(Ordering::Relaxed),
            limit: self.budget.limit(),
            hits: allocs.saturating_sub(misses),
            misses,
            fallbacks: 0,
            failures: self.failures.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
impl<S: MemorySource> Shared<S> {
    /// Checks the accounting equations that hold when no thread is inside the pool.
    pub(crate) fn check_accounting(&self) {
        let (_, chunk_bytes) = lock(&self.chunks).totals();
        let (large_bytes, _) = lock(&self.large).held_totals();
        let held = self.held.load(Ordering::Relaxed);
        assert_eq!(
            held,
            chunk_bytes + large_bytes,
            "held == chunk bytes + large bytes"
        );
        let s = self.stats();
        assert_eq!(
            s.live_bytes + s.cached_bytes + s.pending_bytes,
            s.source_bytes,
            "live + cached + pending == held: {s:?}"
        );
    }
}

impl<S: MemorySource> Drop for Shared<S> {
    fn drop(&mut self) {
        // Blocks still pending may still be read by the GPU: wait before freeing.
        let (pending, uses) = lock(&self.pending).take_all();
        for b in &pending {
            for f in &b.fences {
                if let Err(e) = f.wait() {
                    crate::cuda::record_drop_error("waiting for a pending block of a dropped pool", e);
                }
            }
        }
        drop(uses);
        drop(pending);
        let large = lock(&self.large).drain();
        let chunks = lock(&self.chunks).drain();
        for (p, size) in large.into_iter().chain(chunks) {
            // SAFETY: every chunk and large block came from source_alloc; the pool is
            // being dropped, so no block is in use (the Allocator contract: a pool
            // outlives its blocks).
            unsafe { self.source_free(p, size) };
        }
    }
}

#[cfg(not(loom))]
impl<S: MemorySource> super::thread_cache::tls::CacheOwner for Shared<S> {
    fn flush_all(&self, core: &mut CacheCore) {
        self.flush_cache(core);
    }
    fn retire(&self, stats: &Arc<ThreadStats>) {
        self.retire_cache(stats);
    }
}

#[cfg(not(loom))]
impl<S: MemorySource> registry::UseRecorder for Shared<S> {
    fn record(&self, addr: usize, fence: Box<dyn Fence>) -> Result<()> {
        self.record_fence(addr, fence)
    }
}
