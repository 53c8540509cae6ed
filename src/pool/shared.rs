//! The state a pool's threads share: a composition of parts that each own their invariant
//! and their lock, and the operations that cross them.
//!
//! - [`Accounting`]: bytes held from the source and handed out, the budget (its invariant
//!   `out + shared_cached + pending == held` is checked by [`Shared::check_accounting`]);
//! - [`SmallShared`]: per-class free lists and the chunks they are carved from (lock order
//!   there);
//! - [`LargeShared`]: large extents of segments and the epoch their reshaping moves;
//! - [`UseTracker`]: recorded GPU uses and the pending list, with the mirrors the lock-free
//!   free path reads, published by its guard;
//! - the thread registry (per-thread counters, for `stats()`).
//!
//! A thread holds one of these locks at a time (except `SmallShared::take_free_chunks`),
//! and no source or driver call runs under any of them.

use std::time::{Duration, Instant};

use super::accounting::Accounting;
use super::large::{LargeShared, LargeTaken};
use super::size_class::class_size;
use super::small::SmallShared;
use super::stats::PoolStats;
use super::thread_cache::{CacheCore, ThreadStats};
use super::transfers::{Transfer, Transfers};
use super::uses::{BlockKind, PendingBlock, UseTracker};
use super::{Batch, BlockPtr};
use crate::budget::Budget;
use crate::cuda::nvtx;
use crate::error::{Error, Result};
use crate::fence::{registry, SharedFence, UseSet};
use crate::source::MemorySource;
use crate::sync::{Arc, AtomicUsize, Ordering};
use crate::thread_registry::ThreadRegistry;
use crate::trace::Code;
use crate::util::{align_up, PAGE_SIZE};

/// A pool's configuration after validation.
pub(crate) struct Settings {
    pub(crate) chunk_size: usize,
    /// Requests above this (or aligned beyond a page) are large blocks; a class size.
    pub(crate) large_threshold: usize,
    /// Classes `0..=max_class` are carved from chunks.
    pub(crate) max_class: usize,
    /// Thread-cache bin capacity per class (`max_class + 1` entries); empty: no caches.
    pub(crate) caps: Box<[usize]>,
    pub(crate) thread_cache_bytes: usize,
    /// How long an allocation that finds the pool full waits for pending blocks' GPU
    /// uses to complete (backpressure); `None`: it fails at once.
    pub(crate) pending_wait: Option<Duration>,
    /// Whether chunks may be NVTX heaps (`PoolConfig::nvtx`).
    pub(crate) nvtx: bool,
}

/// The state a pool's threads share.
pub(crate) struct Shared<S: MemorySource> {
    pub(crate) source: S,
    pub(crate) settings: Settings,
    /// Unique for the life of the process (slots are recycled, uids never); also the
    /// pool's id in the range registry.
    pub(crate) uid: u64,
    /// The thread-local table slot of this pool's caches, if it has one.
    pub(crate) slot: Option<usize>,
    pub(crate) acct: Accounting,
    pub(crate) small: SmallShared,
    pub(crate) large: LargeShared,
    pub(crate) uses: UseTracker,
    /// The pool's place in allocation traces.
    pub(crate) trace: crate::trace::Tag,
    threads: ThreadRegistry<ThreadStats>,
    /// Moves of blocks between thread caches and the shared state, for `stats()`.
    pub(crate) transfers: Transfers,
    /// Counts drains while some block has uses; every `PRUNE_EVERY`th forgets the
    /// completed ones.
    prune_tick: AtomicUsize,
    /// Blocked allocations that waited for pending GPU uses (backpressure).
    waits: AtomicUsize,
    /// Test switch: with it off, freed blocks skip the pending list.
    #[cfg(feature = "test-hooks")]
    pub(crate) pending_enabled: crate::sync::AtomicBool,
    #[cfg(feature = "debug-checks")]
    pub(crate) checks: super::checks::LiveBlocks,
}

/// Slow-path drains per poll of the uses of live blocks.
const PRUNE_EVERY: usize = 16;

/// Whether trimming the cache could make a failed source request succeed.
fn worth_trimming(e: &Error, size: usize, limit: Option<usize>) -> bool {
    !matches!(
        e,
        Error::TooLarge { .. } | Error::NoDriver | Error::InvalidArgument(_)
    ) && limit.is_none_or(|l| size <= l)
}

std::thread_local! {
    /// Set while [`without_backpressure`] runs an allocation: a full pool fails at once
    /// instead of blocking the thread (the async path waits by itself).
    static NO_BACKPRESSURE: core::cell::Cell<bool> = const { core::cell::Cell::new(false) };
}

/// Runs `f` (an allocation) with the pools' blocking wait for pending blocks off on this
/// thread.
pub(crate) fn without_backpressure<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            NO_BACKPRESSURE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(NO_BACKPRESSURE.with(|c| c.replace(true)));
    f()
}

/// Whether waiting for pending blocks could make a failed request succeed: the pool or
/// its source is full, not the request absurd.
pub(crate) fn worth_waiting(e: &Error) -> bool {
    match e {
        Error::LimitExceeded { requested, limit, .. } => requested <= limit,
        Error::OutOfMemory { .. } => true,
        Error::Cuda(c) => c.is_out_of_memory(),
        _ => false,
    }
}

impl<S: MemorySource> Shared<S> {
    pub(crate) fn new(
        source: S,
        settings: Settings,
        budget: Arc<Budget>,
        uid: u64,
        slot: Option<usize>,
    ) -> Self {
        let min_split = align_up(settings.large_threshold, PAGE_SIZE)
            .unwrap_or(PAGE_SIZE)
            .max(PAGE_SIZE);
        Self {
            source,
            uid,
            slot,
            acct: Accounting::new(budget),
            small: SmallShared::new(settings.chunk_size, settings.max_class),
            large: LargeShared::new(min_split),
            uses: UseTracker::default(),
            trace: crate::trace::Tag::new(crate::trace::pool_name::<S>),
            threads: ThreadRegistry::new(),
            transfers: Transfers::default(),
            prune_tick: AtomicUsize::new(0),
            waits: AtomicUsize::new(0),
            #[cfg(feature = "test-hooks")]
            pending_enabled: crate::sync::AtomicBool::new(true),
            #[cfg(feature = "debug-checks")]
            checks: Default::default(),
            settings,
        }
    }

    /// A cache for a new thread, registered for `stats()`.
    pub(crate) fn new_cache(&self) -> CacheCore {
        let stats = self.threads.register();
        CacheCore::new(&self.settings.caps, self.settings.thread_cache_bytes, stats)
    }

    // ---- the source -------------------------------------------------------------------

    fn source_alloc(&self, size: usize) -> Result<BlockPtr> {
        self.acct.reserve(size)?;
        match self.source.allocate(size) {
            Ok(p) => {
                if !registry::insert_range(p.as_ptr() as usize, size, self.uid) {
                    // SAFETY: allocated just above with this size and never handed out.
                    unsafe { self.source.deallocate(p, size) };
                    self.acct.unreserve(size);
                    return Err(Error::InvalidArgument(
                        "the pool's source returned memory that overlaps memory the crate's allocators already hold",
                    ));
                }
                self.acct.on_source_alloc(size);
                self.trace.segment(Code::SegmentAlloc, p.as_ptr() as usize, size);
                // Memory a kernel reaches is an NVTX heap: its blocks are regions while
                // handed out (`Pool::try_allocate`, `Pool::free`).
                if self.settings.nvtx && nvtx::on() {
                    nvtx::host_heap_register(&self.source, p, size);
                }
                Ok(BlockPtr::new(p))
            }
            Err(e) => {
                self.acct.unreserve(size);
                Err(e)
            }
        }
    }

    /// # Safety
    /// 1. `p` came from `self.source_alloc(size)` and nothing uses it any more.
    unsafe fn source_free(&self, p: BlockPtr, size: usize) {
        registry::remove_range(p.addr(), self.uid);
        self.trace.segment(Code::SegmentFree, p.addr(), size);
        if nvtx::on() {
            nvtx::heap_unregister(p.addr() as u64);
        }
        // SAFETY: obligation 1; source_alloc returned this block of `size` bytes.
        unsafe { self.source.deallocate(p.as_non_null(), size) };
        self.acct.on_source_free(size);
    }

    /// Runs `attempt` (which takes memory, trimming and retrying once on failure); if the
    /// pool is full while freed blocks wait for GPU work, waits for the oldest of them (at
    /// most the configured time) and tries again: a staging loop that outruns the GPU
    /// slows down to its pace instead of failing.
    fn with_backpressure<T>(&self, mut attempt: impl FnMut(&Self) -> Result<T>) -> Result<T> {
        let mut seen = self.uses.returns();
        let mut err = match attempt(self) {
            Ok(t) => return Ok(t),
            Err(e) => e,
        };
        let Some(wait) = self.settings.pending_wait else {
            return Err(err);
        };
        if NO_BACKPRESSURE.with(core::cell::Cell::get) {
            return Err(err); // an async allocation waits without the thread
        }
        // A wait too long to add to the clock (`Duration::MAX`) waits forever.
        let deadline = Instant::now().checked_add(wait);
        while worth_waiting(&err) && self.wait_for_room(deadline, seen) {
            seen = self.uses.returns();
            err = match attempt(self) {
                Ok(t) => return Ok(t),
                Err(e) => e,
            };
        }
        Err(err)
    }

    /// Waits (until `deadline`; `None`: for as long as it takes) for the GPU uses of the
    /// oldest pending block, then returns every completed pending block to the free lists;
    /// with nothing pending, for the blocks a drain is putting back. False when no room
    /// was pending or coming back since `seen` (a [`UseTracker::returns`] read before the
    /// failed attempt), or the deadline passed.
    fn wait_for_room(&self, deadline: Option<Instant>, seen: usize) -> bool {
        let Some(fences) = self.uses.lock().oldest_fences() else {
            return self.uses.room_returning(seen) && self.wait_for_returns(deadline);
        };
        self.waits.fetch_add(1, Ordering::Relaxed);
        let mut set = UseSet::default();
        for f in fences {
            set.record(f);
        }
        let done = set.wait(deadline);
        if self.drain_pending() == 0 && done {
            // Another thread has the list out and returns the block when it settles:
            // let it run rather than spin on the lock.
            crate::sync::thread::yield_now();
        }
        done
    }

    /// Waits (until `deadline`) while a drain puts completed blocks back in the free
    /// lists: it holds no lock meanwhile, and is done within a few locks' time. False
    /// once the deadline has passed, even with nothing left to wait for, so that other
    /// threads' drains cannot keep an attempt going past it.
    fn wait_for_returns(&self, deadline: Option<Instant>) -> bool {
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            if !self.uses.lock().returning() {
                return true;
            }
            crate::sync::thread::yield_now();
        }
    }

    // ---- small blocks -----------------------------------------------------------------

    /// Takes up to `want` (at least one, at most the batch's room) free blocks of `class`
    /// into `out`: from the shared list, else carved from a chunk, else from a new chunk
    /// (trimming and retrying once if the source fails, then waiting for pending blocks).
    /// Touches no thread cache. The blocks are counted as handed out from here on; the
    /// returned transfer lasts until the caller has put those it keeps in its thread
    /// cache (so that `stats()` never sees them in neither place).
    pub(crate) fn take_small(&self, class: usize, want: usize, out: &mut Batch) -> Result<Transfer<'_>> {
        debug_assert!(out.is_empty() && want >= 1);
        self.with_backpressure(|this| {
            this.small.take_listed(class, want, out);
            if out.is_empty() {
                this.carve(class, want, out)?;
            }
            Ok(())
        })?;
        let moving = self.transfers.begin();
        self.acct.count_out(out.len(), out.len() * class_size(class));
        Ok(moving)
    }

    fn carve(&self, class: usize, want: usize, out: &mut Batch) -> Result<()> {
        let mut size = self.settings.chunk_size;
        let mut trimmed = false;
        loop {
            if self.small.carve(class, want, out) > 0 {
                return Ok(());
            }
            // No chunk has room: a new one, asked for with no lock held.
            let e = match self.source_alloc(size) {
                Ok(p) => {
                    self.acct.count_miss();
                    let got = self.small.add_chunk_and_carve(p, size, class, want, out);
                    debug_assert!(
                        got > 0,
                        "a fresh chunk of {size} bytes holds a run of class {class}"
                    );
                    return Ok(());
                }
                Err(e) => e,
            };
            if !trimmed && worth_trimming(&e, size, self.acct.budget.limit()) {
                log::debug!("cudalloc: pool source failed ({e}); trimming and retrying once");
                trimmed = true;
                self.trim();
                // Trimming may have completed pending blocks of this class.
                self.small.take_listed(class, want, out);
                if !out.is_empty() {
                    return Ok(());
                }
                continue;
            }
            // The smallest chunk that holds a run of this class: runs start on a page.
            let pad = if self.source.align() < PAGE_SIZE {
                PAGE_SIZE
            } else {
                0
            };
            let least = self.small.run_len(class).saturating_add(pad);
            if matches!(e, Error::LimitExceeded { .. }) && size > least {
                // The limit leaves no room for a whole chunk (it is below the chunk size,
                // or the pool is near it, even after a trim): a chunk just large enough
                // for this block. A limit smaller than a chunk then serves small blocks as
                // it serves large ones, and an error names what the request needs.
                size = least;
                continue;
            }
            return Err(e);
        }
    }

    /// Returns blocks of `class` that were handed out (to a user or a thread cache) to
    /// the shared list.
    pub(crate) fn give_small(&self, class: usize, blocks: impl IntoIterator<Item = BlockPtr>) {
        let n = self.small.give(class, blocks);
        self.acct.uncount_out(n, n * class_size(class));
    }

    // ---- large blocks -----------------------------------------------------------------

    /// A large block of `need` bytes (a page multiple) aligned to `align`: from a cached
    /// extent (the smallest that fits; the largest for a `growing` block), else from a
    /// fresh segment (trimming and retrying once if the source fails, then waiting for
    /// pending blocks).
    pub(crate) fn take_large(&self, need: usize, align: usize, growing: bool) -> Result<LargeTaken> {
        let t = self.with_backpressure(|this| this.take_large_once(need, align, growing))?;
        self.acct.count_out(1, t.size);
        Ok(t)
    }

    fn take_large_once(&self, need: usize, align: usize, growing: bool) -> Result<LargeTaken> {
        if let Some(hit) = self.large.take(need, align, growing) {
            return Ok(hit);
        }
        // A growing block gets a segment with room to double in place; if that much
        // memory is not to be had, one of its own size.
        if growing {
            if let Some(room) = need.checked_mul(2) {
                if let Ok(t) = self.alloc_large_fresh(need, align, room) {
                    return Ok(t);
                }
            }
        }
        for attempt in 0..2 {
            match self.alloc_large_fresh(need, align, need) {
                Ok(t) => return Ok(t),
                Err(e) if attempt == 0 && worth_trimming(&e, need, self.acct.budget.limit()) => {
                    log::debug!("cudalloc: pool source failed ({e}); trimming and retrying once");
                    self.trim();
                    if let Some(hit) = self.large.take(need, align, growing) {
                        return Ok(hit);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the second attempt returns")
    }

    /// A fresh segment of `room` bytes (at least `need`) with a block of `need` bytes
    /// aligned to `align` taken from its start.
    fn alloc_large_fresh(&self, need: usize, align: usize, room: usize) -> Result<LargeTaken> {
        let too_large = || Error::TooLarge {
            requested: room,
            limit: isize::MAX as usize,
        };
        // Sources that promise less than a page return pages in practice (cuMemHostAlloc,
        // cuMemAllocManaged): ask for `room` and over-allocate only if the block is not
        // aligned enough. Beyond a page, over-allocate at once.
        let mut total = if align <= self.source.align().max(PAGE_SIZE) {
            room
        } else {
            room.checked_add(align).ok_or_else(too_large)?
        };
        if total > isize::MAX as usize {
            return Err(too_large());
        }
        let mut base = self.source_alloc(total)?;
        let fits = |base: BlockPtr, total: usize| {
            align_up(base.addr(), align).is_some_and(|u| u - base.addr() + need <= total)
        };
        if !fits(base, total) {
            // SAFETY: allocated just above and never handed out.
            unsafe { self.source_free(base, total) };
            total = room.checked_add(align).ok_or_else(too_large)?;
            base = self.source_alloc(total)?;
            if !fits(base, total) {
                // SAFETY: as above.
                unsafe { self.source_free(base, total) };
                return Err(Error::InvalidArgument(
                    "the source returned a block below its alignment",
                ));
            }
        }
        self.acct.count_miss();
        Ok(self
            .large
            .insert_segment(base, total, need, align)
            .expect("checked by fits"))
    }

    /// Grows the live large block holding `addr` in place so that `need` bytes from
    /// `addr` are usable; returns the usable bytes from `addr`, or `None` if it cannot.
    pub(crate) fn grow_large_in_place(&self, addr: usize, need: usize) -> Option<usize> {
        let (usable, grown) = self.large.grow_in_place(addr, need)?;
        if grown > 0 {
            self.acct.count_out(0, grown);
        }
        Some(usable)
    }

    /// Returns the large block holding `addr` to the free extents; `from_out` when it was
    /// handed out (by a user or a thread cache) rather than pending.
    pub(crate) fn give_large(&self, addr: usize, from_out: bool) {
        match self.large.give_back(addr) {
            Some((_, size)) if from_out => self.acct.uncount_out(1, size),
            Some(_) => {}
            None => {
                #[cfg(feature = "debug-checks")]
                panic!("cudalloc: freeing {addr:#x}, which is no live block of this pool (double free?)");
                #[cfg(not(feature = "debug-checks"))]
                log::error!("cudalloc: freeing {addr:#x}, which is no live block of this pool (double free?)")
            }
        }
    }

    // ---- recorded uses and the pending list -------------------------------------------

    /// The key of the block holding `addr` (its address for small blocks, its base for
    /// large ones), if `addr` is in one.
    fn use_key(&self, addr: usize) -> Option<usize> {
        if let Some((block, _)) = self.small.find_block(addr) {
            return Some(block);
        }
        self.large.find(addr).map(|(base, _, _)| base)
    }

    /// Whether the block at `key` (from `use_key`) is free: in the shared free lists or
    /// extents, or in the calling thread's cache. A block freed into another thread's
    /// cache is not seen (those caches are that thread's alone); `debug-checks` builds
    /// see every freed block.
    fn is_freed(&self, key: usize) -> bool {
        let class = self.small.find_block(key).map(|(_, class)| class);
        // Small blocks are remembered by the address handed out, which is their key.
        #[cfg(feature = "debug-checks")]
        if class.is_some() && !self.checks.is_live(key) {
            return true;
        }
        let shared = match class {
            Some(c) => self.small.is_listed(c, key),
            None => self.large.find(key).is_some_and(|(_, _, free)| free),
        };
        shared
            || self.slot.is_some_and(|slot| {
                super::thread_cache::tls::with_entry(slot, self.uid, |core| core.holds(class, key))
                    .unwrap_or(false)
            })
    }

    /// Attaches `fence` to the block holding `addr`: `Ok(false)` if `addr` is not in this
    /// pool's memory, an error if it is but in no block.
    pub(crate) fn record_fence(&self, addr: usize, fence: SharedFence) -> Result<bool> {
        let Some(key) = self.use_key(addr) else {
            return Ok(false);
        };
        if self.is_freed(key) {
            return Err(Error::InvalidArgument(
                "the pointer is in a freed block of this pool (a use recorded after the free protects nothing)",
            ));
        }
        let superseded = self.uses.lock().record(key, fence);
        drop(superseded); // outside the lock: a pooled event goes back to its pool
        Ok(true)
    }

    /// Called by `deallocate` when some block has recorded uses: if this one has, seals
    /// them (the block is being freed: every use of it was queued before) and moves the
    /// block to the pending list; returns true if it took the block.
    pub(crate) fn defer_free(&self, ptr: BlockPtr, kind: BlockKind) -> bool {
        let (key, size) = match kind {
            BlockKind::Small(c) => (ptr.addr(), class_size(c)),
            BlockKind::Large => match self.large.find(ptr.addr()) {
                Some((base, size, false)) => (base, size),
                _ => return false,
            },
        };
        let Some(fences) = self.uses.lock().take_uses(key) else {
            return false;
        };
        fences.seal(); // driver calls: no lock held
        #[cfg(feature = "test-hooks")]
        if !self.pending_enabled.load(Ordering::Relaxed) {
            drop(fences);
            return false;
        }
        self.uses.lock().push(PendingBlock {
            ptr,
            kind,
            size,
            fences,
        });
        self.acct.uncount_out(1, size);
        true
    }

    /// Returns the pending blocks whose fences have all completed to the free lists, and
    /// now and then forgets completed uses of live blocks. Fences are polled with no lock
    /// held.
    pub(crate) fn drain(&self) {
        if self.uses.any_uses_hint() && self.prune_tick.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == 0 {
            self.forget_completed_uses();
        }
        self.drain_pending();
    }

    /// `drain`, always forgetting completed uses; returns the blocks it returned.
    pub(crate) fn drain_all(&self) -> usize {
        if self.uses.any_uses_hint() {
            self.forget_completed_uses();
        }
        self.drain_pending()
    }

    /// Polls the fences of live blocks (without the lock) and forgets the completed ones.
    /// A long-lived block whose uses are recorded again and again (a staging buffer
    /// copied every frame) would otherwise keep every free of the pool on the slow path.
    fn forget_completed_uses(&self) {
        let snapshot = self.uses.lock().snapshot_uses();
        let done: Vec<_> = snapshot
            .into_iter()
            .filter(|(_, f)| crate::fence::poll_one(f))
            .collect();
        if !done.is_empty() {
            self.uses.lock().forget_completed(&done);
        }
        drop(done); // outside the lock: pooled events go back to their pool
    }

    /// The completions of the oldest pending block's uses, for an async wait (each `None`
    /// where a fence cannot wake a task); `None` when nothing is pending.
    pub(crate) fn oldest_pending_completions(&self) -> Option<Vec<Option<crate::cuda::EventCompleted>>> {
        let fences = self.uses.lock().oldest_fences()?;
        Some(fences.iter().map(|f| f.completion()).collect())
    }

    /// Returns the pending blocks whose fences completed to the free lists; returns how
    /// many. The list is taken out, polled without the lock, and settled; a panic while
    /// polling cannot lose it (fences are polled under `catch_unwind`).
    pub(crate) fn drain_pending(&self) -> usize {
        if !self.uses.any_pending() {
            return 0;
        }
        let list = self.uses.lock().take_list();
        if list.is_empty() {
            return 0;
        }
        let (mut done, mut waiting) = (Vec::new(), Vec::new());
        for mut b in list {
            if b.poll() {
                done.push(b);
            } else {
                waiting.push(b);
            }
        }
        self.uses.lock().settle(waiting, &done);
        let n = done.len();
        for b in done {
            self.trace.free_completed(b.ptr.addr(), b.size);
            match b.kind {
                BlockKind::Small(c) => {
                    self.small.give(c, [b.ptr]);
                }
                BlockKind::Large => self.give_large(b.ptr.addr(), false),
            }
        }
        if n > 0 {
            self.uses.returned(n);
        }
        n
    }

    // ---- thread caches ----------------------------------------------------------------

    /// Moves every block of a thread's cache back to the shared lists.
    pub(crate) fn flush_cache(&self, core: &mut CacheCore) {
        let _moving = self.transfers.begin();
        let (small, large) = core.take_all();
        for (class, blocks) in small {
            self.give_small(class, blocks);
        }
        for (p, _) in large {
            self.give_large(p.addr(), true);
        }
    }

    /// Merges an exiting thread's counters into the totals.
    pub(crate) fn retire_cache(&self, stats: &Arc<ThreadStats>) {
        self.threads.retire(stats);
    }

    // ---- trim and stats ---------------------------------------------------------------

    /// Returns cached memory to the source: wholly free segments and chunks whose blocks
    /// are all free in the shared lists (after flushing the calling thread's cache and
    /// draining the pending list). Returns the bytes released. Blocks in other threads'
    /// caches stay there (flushed when those threads exit or fill their caches).
    pub(crate) fn trim(&self) -> usize {
        if let Some(slot) = self.slot {
            super::thread_cache::tls::with_entry(slot, self.uid, |core| self.flush_cache(core));
        }
        self.drain_all();
        let mut released = 0;
        for (p, size) in self.large.take_free() {
            // SAFETY: wholly free segments came from source_alloc and are in no list any
            // more.
            unsafe { self.source_free(p, size) };
            released += size;
        }
        let chunks = self.small.take_free_chunks();
        if !chunks.is_empty() {
            let stale: Vec<UseSet> = {
                let mut t = self.uses.lock();
                chunks
                    .iter()
                    .flat_map(|(c, size)| t.take_uses_in(c.addr(), c.addr() + size))
                    .collect()
            };
            drop(stale); // outside the lock
        }
        for (p, size) in chunks {
            // SAFETY: the chunk came from source_alloc; all its carved blocks were free in
            // the shared lists and have been removed from them, under their locks.
            unsafe { self.source_free(p, size) };
            released += size;
        }
        self.trace.segment(Code::Trim, 0, released);
        released
    }

    /// Waits for every pending block's GPU uses (blocking), returns them to the free
    /// lists, then trims; returns the bytes released.
    pub(crate) fn release(&self) -> usize {
        // The list stays in place (a backpressure wait meanwhile sees what is pending):
        // the waits are on shared copies of the fences, and the drain in `trim` returns
        // the blocks whose fences completed. A block whose wait fails stays pending.
        let sets = self.uses.lock().pending_fences();
        for fences in sets {
            let mut set = UseSet::default();
            for f in fences {
                set.record(f);
            }
            set.wait(None);
        }
        self.trim()
    }

    /// A snapshot of the counters. Reads only: pending blocks whose uses completed since
    /// the last drain still count as pending.
    pub(crate) fn stats(&self) -> PoolStats {
        // The thread caches' counts and the handed-out counts in one consistent read
        // (see `transfers`); if moves go on for longer than 10 ms, a clamped estimate.
        let (((tc_bytes, tc_blocks, thread_allocs), c), _) =
            self.transfers.read(64, std::time::Duration::from_millis(10), || {
                (self.thread_cache_totals(), self.acct.read())
            });
        let (list_bytes, list_blocks) = self.small.listed_totals();
        let slack = self.small.slack();
        let (large_bytes, large_blocks) = self.large.free_totals();
        let (pending_bytes, pending_blocks) = self.uses.lock().totals();
        let allocs = thread_allocs + c.shared_allocs;
        PoolStats {
            live_bytes: c.out_bytes.saturating_sub(tc_bytes),
            live_blocks: c.out_blocks.saturating_sub(tc_blocks),
            peak_bytes: c.peak_out,
            cached_bytes: tc_bytes + list_bytes + slack + large_bytes,
            cached_blocks: tc_blocks + list_blocks + large_blocks,
            pending_bytes,
            pending_blocks,
            source_bytes: c.held,
            source_blocks: c.held_blocks,
            peak_source_bytes: c.peak_held,
            limit: self.acct.budget.limit(),
            hits: allocs.saturating_sub(c.misses),
            misses: c.misses,
            fallbacks: 0,
            failures: c.failures,
            pending_waits: self.waits.load(Ordering::Relaxed) as u64,
        }
    }

    /// Threads with a live cache for this pool (models wait for exiting threads with it).
    #[cfg(all(test, loom))]
    pub(crate) fn live_threads(&self) -> usize {
        self.threads.visit(|_| {}).threads
    }

    /// Bytes and blocks parked in thread caches, and the allocations threads served.
    fn thread_cache_totals(&self) -> (usize, usize, u64) {
        let (mut bytes, mut blocks) = (0, 0);
        let seen = self.threads.visit(|s| {
            bytes += s.cached_bytes.load(Ordering::Relaxed);
            blocks += s.cached_blocks.load(Ordering::Relaxed);
        });
        (bytes, blocks, seen.served)
    }

    /// Checks the accounting equations (see [`Accounting`]); exact only while no thread
    /// is inside the pool: tests call it at quiet points, and debug builds when the pool
    /// is dropped.
    pub(crate) fn check_accounting(&self) -> Result<(), String> {
        let (_, chunk_bytes) = self.small.chunk_totals();
        let (large_held, _) = self.large.held_totals();
        let shared_cached = self.small.listed_totals().0 + self.small.slack() + self.large.free_totals().0;
        let (pending_bytes, _) = self.uses.lock().totals();
        self.acct
            .check(shared_cached, pending_bytes, chunk_bytes, large_held)
    }
}

impl<S: MemorySource> Drop for Shared<S> {
    fn drop(&mut self) {
        // No thread is inside the pool (every thread cache held a reference): the
        // accounting must add up exactly. An internal bug if not; debug builds stop here.
        if cfg!(debug_assertions) {
            if let Err(e) = self.check_accounting() {
                log::error!("cudalloc: pool accounting broken at drop: {e}");
                debug_assert!(false, "pool accounting broken at drop: {e}");
            }
        }
        // Blocks still pending may still be read by the GPU: wait before freeing, but not
        // forever (a fence that never completes must not hang the drop): for the pool's
        // pending wait, or `DROP_WAIT` if it has none, in all. The chunk or segment of a
        // block whose wait fails or times out is leaked rather than freed under the GPU.
        let (pending, uses) = self.uses.lock().take_all();
        let wait = self.settings.pending_wait.unwrap_or(DROP_WAIT);
        let deadline = Instant::now().checked_add(wait);
        let mut unsafe_to_free: Vec<usize> = Vec::new();
        for mut b in pending {
            if !b.fences.wait(deadline) {
                unsafe_to_free.push(b.ptr.addr());
            }
        }
        drop(uses);
        let mut leaked = 0;
        let large = self.large.drain();
        let chunks = self.small.drain();
        for (p, size) in large.into_iter().chain(chunks) {
            if unsafe_to_free
                .iter()
                .any(|a| (p.addr()..p.addr() + size).contains(a))
            {
                leaked += size;
                registry::remove_range(p.addr(), self.uid);
                if nvtx::on() {
                    nvtx::heap_unregister(p.addr() as u64);
                }
                continue;
            }
            // SAFETY: every chunk and segment came from source_alloc; the pool is being
            // dropped, so no block is in use (the Allocator contract: a pool outlives its
            // blocks) and pending blocks' uses have completed.
            unsafe { self.source_free(p, size) };
        }
        if leaked > 0 {
            crate::cuda::record_drop_error(
                "dropping a pool",
                format!(
                    "{} freed blocks' recorded GPU uses did not complete within {wait:?}: {leaked} bytes are leaked on purpose (never freed under the GPU)",
                    unsafe_to_free.len()
                ),
            );
        }
    }
}

/// How long a dropped pool without a pending wait of its own waits for the recorded GPU
/// uses of its freed blocks before it leaks their memory.
const DROP_WAIT: Duration = Duration::from_secs(10);

/// A pool's shared state as the thread-cache table and the range registry see it: an
/// owned reference behind a trait object (a `Box` around the `Arc`, so no unsized `Arc`
/// coercion is needed, which loom's `Arc` lacks).
pub(crate) struct OwnerRef<S: MemorySource>(pub(crate) Arc<Shared<S>>);

impl<S: MemorySource> super::thread_cache::tls::CacheOwner for OwnerRef<S> {
    fn flush_all(&self, core: &mut CacheCore) {
        self.0.flush_cache(core);
    }
    fn retire(&self, stats: &Arc<ThreadStats>) {
        self.0.retire_cache(stats);
    }
}

impl<S: MemorySource> registry::UseRecorder for OwnerRef<S> {
    fn record(&self, addr: usize, fence: SharedFence) -> Result<bool> {
        match self.0.record_fence(addr, fence)? {
            true => Ok(true),
            // In this pool's registered memory but in no block: chunk space not carved yet.
            false => Err(Error::InvalidArgument("the pointer is in no block of this pool")),
        }
    }
}
