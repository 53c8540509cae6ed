//! The shared part of a device pool's cache, and every slow path: per-stream lists of free
//! blocks, cross-stream hand-over, blocks waiting for recorded uses, the release policy,
//! the out-of-memory path, trim and statistics. Generic over its [`Backend`] so that CPU
//! tests and loom models run this code against a simulated GPU.
//!
//! # The protocol
//!
//! - A block belongs to one **home stream** at a time: the stream it was last freed on.
//!   All its earlier uses are ordered before the current end of that stream (a buffer is
//!   freed on the host after its work was queued on its stream; uses on other streams are
//!   either waited for before the block joins a list, or recorded with
//!   [`record_use`](super::DeviceBuffer::record_use) and gated, below).
//! - **Same stream**: a free block of S is handed to later work on S as it is. No mark.
//! - **Another stream** T takes blocks of S (first from the calling thread's own bins of
//!   other streams, then from the shared lists): the blocks leave S's list under the lock,
//!   so no one else can see them; then one mark is recorded on S (one per batch, never per
//!   free) and T waits for it (`cuStreamWaitEvent`, no host wait); only then are they
//!   handed to T (and become T's). The mark is recorded after the blocks left S and before
//!   T can use them: there is no moment at which a block is visible to another stream with
//!   a mark that predates its last use (CUB's caching allocator recorded its event after
//!   publishing the block, NVIDIA/cub#156).
//! - **Recorded uses**: a buffer freed with uses on other streams records one mark on each
//!   (at the free, so they follow all work queued there until then) and waits in its home
//!   stream's gated list. Slow paths poll the oldest gated blocks (`cuEventQuery`, no lock
//!   held); a block whose marks have all completed joins its home stream's free list.
//!   Nothing waits on the GPU for them (no false dependency between streams, PyTorch's
//!   choice); only the out-of-memory path and trim block the host on them.
//! - **No CUDA call under the lock**: marks, waits, queries, frees and the drops of stream
//!   handles (which may destroy a stream) all happen after it is released.
//!
//! # Memory
//!
//! Every cached block is one allocation of the driver pool of its class size: the driver
//! pool does the splitting and merging of large extents, in stream order. A miss that must
//! allocate first releases idle blocks (largest first, freed in their home stream's order,
//! where the driver pool can reuse them for any size) while idle bytes exceed 1/32 of live
//! bytes (at least the allowance learned in `cache/idle.rs`, which grows only when the
//! cache misses classes it gave back, up to twice the live class bytes and 64 MiB): a
//! workload that changes sizes keeps its memory near what it uses, one that repeats stops
//! missing once it has learned. The driver pool keeps what it gets back and carves
//! it for later requests, so its reservations drift above what the cache holds (trimming
//! the driver pool after each release was measured and rejected: BENCHMARKS.md).
//!
//! With [`Backing::PhysicalPages`](super::Backing::PhysicalPages) (the default where the
//! device supports it) the backend puts blocks of one allocation granule and more (2 MiB
//! on the H100 and H200) on its page heap (`pages/`) instead: runs of one large virtual
//! range over chunks of physical memory (16 MiB by default), freed runs coalescing and
//! staying mapped, so that
//! what a released block held serves a miss of any size with no driver call when it fits
//! (after a wait for the free's mark on the GPU when the miss is on another stream), and
//! idle chunks move to where blocks need them beyond an allowance (1/64 of the heap's
//! block bytes by default). RMM's random workload (4 streams) then reserves 1.119 of its
//! peak request on an H100 (the cache on the driver pool: 1.468; `cuMemAllocAsync`
//! alone: 1.264; BENCHMARKS.md, 2026-12-06); the cache above keeps only the blocks below
//! a granule by class, and the page heap's in the thread's large slots for their size.
//!
//! Out of memory: every idle block is released, other threads are asked for theirs, and
//! the allocation is retried; then the streams involved are synchronized, the driver pool
//! trimmed, and retried once more.

mod free;
mod idle;
mod lists;
mod release;
mod settings;
mod stats;

use super::backend::Backend;
use super::reserve::Tally;
use super::size_class::{class_of, class_size, round_to_granule, MAX_CLASS_SIZE};
use super::thread_cache::{Evicted, ThreadCache, ThreadStats};
use crate::cuda::StreamId;
use crate::error::{Error, Result};
use crate::sync::{AtomicBool, AtomicUsize, Ordering};
use crate::thread_registry::ThreadRegistry;
use idle::IdleAllowance;
use lists::{Gated, SharedLists};
pub(crate) use settings::Settings;
use stats::Counters;

/// A miss tolerates idle bytes up to 1/2^IDLE_SHIFT of the live bytes.
const IDLE_SHIFT: u32 = 5;
/// Gated blocks polled per stream on a slow path.
const POLL_PER_STREAM: usize = 4;

/// A device pool's cache over its backend. See the [module docs](self).
pub(crate) struct Cache<B: Backend> {
    pub(crate) backend: B,
    pub(crate) settings: Settings,
    /// The shared lists (their guard publishes the mirrors of their counts).
    shared: SharedLists<B>,
    // held == bytes of blocks from the backend not yet given back: live + cached (shared
    // and thread caches) + pending + in transit between them; held <= settings.limit
    held: Tally,
    held_blocks: AtomicUsize,
    /// The idle bytes a miss keeps where 1/32 of the live ones is less, learned from the misses.
    idle: IdleAllowance,
    pub(crate) counters: Counters,
    /// Every thread cache's published counters.
    threads: ThreadRegistry<ThreadStats>,
    /// Whether cross-stream hand-overs and recorded uses are ordered by marks (always,
    /// except in negative-control tests).
    guard: AtomicBool,
    /// The pool has no user handle left (`close.rs`): reclaim requests stay up.
    pub(crate) closing: AtomicBool,
}

impl<B: Backend> Cache<B> {
    pub(crate) fn new(backend: B, settings: Settings) -> Self {
        Self {
            backend,
            settings,
            shared: SharedLists::new(),
            held: Tally::new(Some(settings.limit).filter(|&l| l != usize::MAX)),
            held_blocks: AtomicUsize::new(0),
            idle: IdleAllowance::new(settings.idle_start, settings.idle_cap, settings.max_cached_bytes),
            counters: Counters::default(),
            threads: ThreadRegistry::new(),
            guard: AtomicBool::new(true),
            closing: AtomicBool::new(false),
        }
    }

    /// Whether a block of `bytes` (rounded, not cached by class) is kept in the thread
    /// caches' large slots when freed.
    #[inline(always)]
    pub(crate) fn is_large(&self, bytes: usize) -> bool {
        bytes <= self.settings.max_large_bytes && bytes > self.settings.max_cached_bytes
    }

    /// The class serving `bytes` (nonzero), or `None`: not cached.
    #[inline(always)]
    pub(crate) fn class_for(&self, bytes: usize) -> Option<usize> {
        if bytes <= self.settings.max_cached_bytes {
            Some(class_of(bytes))
        } else {
            None
        }
    }

    /// Bytes of the block that serves a request of `bytes` (nonzero).
    pub(crate) fn block_bytes(&self, bytes: usize) -> Option<usize> {
        match self.class_for(bytes) {
            Some(c) => Some(class_size(c)),
            None => round_to_granule(bytes),
        }
    }

    /// Turns the marks that order cross-stream hand-overs and recorded uses off (negative
    /// controls only) or on.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub(crate) fn set_guard(&self, on: bool) {
        self.guard.store(on, Ordering::Relaxed);
    }

    fn guarded(&self) -> bool {
        self.guard.load(Ordering::Relaxed)
    }

    // ---- thread caches ----------------------------------------------------------------

    /// A new thread cache, registered for statistics and reclaim; `None` when the
    /// settings have none.
    pub(crate) fn new_thread_cache<P>(&self) -> Option<ThreadCache<B, P>> {
        let max_class = self.settings.thread_max_class?;
        let bytes = self.settings.thread_cache_bytes;
        let stats = self.threads.register();
        Some(ThreadCache::new(
            ThreadCache::<B, P>::caps_for(max_class, bytes),
            bytes,
            stats,
        ))
    }

    /// The registered threads' published counters.
    pub(crate) fn threads(&self) -> &ThreadRegistry<ThreadStats> {
        &self.threads
    }

    /// Flushes a thread cache that goes away and stops reading its counters.
    pub(crate) fn retire_thread_cache<P>(&self, tc: &mut ThreadCache<B, P>) {
        self.flush_thread(tc);
        self.threads.retire(tc.stats());
    }

    /// Moves every block of a thread cache to the shared lists (its handles are dropped
    /// outside the lock).
    pub(crate) fn flush_thread<P>(&self, tc: &mut ThreadCache<B, P>) {
        // The request is consumed before the blocks are taken, so that one made meanwhile
        // stays; a closed pool's stays up (each push then looks for the collection,
        // `close.rs`), its close having raised `closing` before the flags.
        let stats = tc.stats();
        stats.reclaim.swap(false, Ordering::SeqCst);
        if self.closing.load(Ordering::SeqCst) {
            stats.reclaim.store(true, Ordering::SeqCst);
        }
        let evicted = tc.take_all();
        self.give_evicted(evicted);
    }

    /// Gives blocks taken from a thread cache to the shared lists (large ones to the
    /// backend); their stream handles are dropped after the lock.
    pub(crate) fn give_evicted(&self, evicted: impl IntoIterator<Item = Evicted<B>>) {
        let mut handles = Vec::new();
        let mut large = Vec::new();
        {
            let mut sh = self.shared.lock();
            for ev in evicted {
                if !ev.blocks.is_empty() {
                    let i = sh.entry(&ev.stream);
                    for (class, blocks) in ev.blocks {
                        sh.push_free(i, class, blocks);
                    }
                }
                if !ev.large.is_empty() {
                    large.push((ev.stream.clone(), ev.large));
                }
                handles.push(ev.stream);
            }
        }
        // Large blocks go back to the backend (the page heap serves them to any size).
        for (stream, blocks) in large {
            for (ptr, bytes) in blocks {
                self.give_back(ptr, bytes, &stream);
            }
        }
        drop(handles);
    }

    /// The slow free of a large block of `bytes` (rounded) with no recorded uses, whose
    /// slots were full or whose stream had no slot in `t`: into the large slots (making
    /// the stream's slot, and room), else back to the backend.
    fn free_large<P>(&self, t: &mut ThreadCache<B, P>, ptr: u64, bytes: usize, stream: B::Stream) {
        if t.reclaim_requested() {
            self.flush_thread(t);
        }
        let (_, evicted) = t.entry(&stream);
        if let Some(ev) = evicted {
            self.give_evicted([ev]);
        }
        if t.large_full() {
            self.give_large(t);
        }
        if t.push_large(B::stream_id(&stream), bytes, ptr, None).is_err() {
            self.give_back(ptr, bytes, &stream);
        }
    }

    /// Gives this thread's large blocks back to the backend (at a large allocation they
    /// do not serve: they hold memory only between a free and the thread's next miss).
    fn give_large<P>(&self, tc: &mut ThreadCache<B, P>) {
        for (stream, ptr, bytes) in tc.take_large(None) {
            self.give_back(ptr, bytes, &stream);
        }
    }

    /// Adds free blocks of `class` to `stream`'s shared list.
    fn give_blocks(&self, stream: &B::Stream, class: usize, blocks: Vec<u64>) {
        let mut sh = self.shared.lock();
        let i = sh.entry(stream);
        sh.push_free(i, class, blocks);
    }

    /// Puts blocks of `class` that `stream` may use into the thread's bins, what does
    /// not fit into the shared list.
    fn keep<P>(
        &self,
        tc: Option<&mut ThreadCache<B, P>>,
        stream: &B::Stream,
        class: usize,
        mut blocks: Vec<u64>,
    ) {
        if let Some(t) = tc {
            if t.holds_class(class) {
                let (i, evicted) = t.entry(stream);
                if let Some(ev) = evicted {
                    self.give_evicted([ev]);
                }
                blocks.retain(|&p| !t.put_block(i, class, p));
            }
        }
        if !blocks.is_empty() {
            self.give_blocks(stream, class, blocks);
        }
    }

    // ---- allocation -------------------------------------------------------------------

    /// The allocation slow path: a block for `bytes` (nonzero) that work queued on
    /// `stream` from now on may use. `tc` is the calling thread's cache, if it has one.
    pub(crate) fn alloc_slow<P>(
        &self,
        mut tc: Option<&mut ThreadCache<B, P>>,
        bytes: usize,
        stream: &B::Stream,
    ) -> Result<u64> {
        debug_assert!(bytes > 0);
        let Some(class) = self.class_for(bytes) else {
            let rounded = round_to_granule(bytes).ok_or(Error::TooLarge {
                requested: bytes,
                limit: MAX_CLASS_SIZE,
            })?;
            if let Some(t) = tc.as_deref_mut() {
                if t.reclaim_requested() {
                    self.flush_thread(t);
                }
                self.give_large(t);
                if self.is_large(rounded) {
                    t.large_missed(B::stream_id(stream), rounded);
                }
            }
            return self.alloc_backend(tc, rounded, stream);
        };
        if let Some(t) = tc.as_deref_mut() {
            if t.reclaim_requested() {
                self.flush_thread(t);
            }
            if let Some(p) = t.take_block(stream, class) {
                return Ok(p);
            }
        }
        self.poll_gated();
        if let Some(p) = self.take_same_stream(tc.as_deref_mut(), class, stream) {
            return Ok(p);
        }
        if let Some(p) = self.steal(tc.as_deref_mut(), class, stream) {
            return Ok(p);
        }
        self.idle.missed(class);
        self.alloc_backend(tc, class_size(class), stream)
    }

    /// Blocks of `class` freed on `stream` itself, from the shared list: no mark needed.
    fn take_same_stream<P>(
        &self,
        tc: Option<&mut ThreadCache<B, P>>,
        class: usize,
        stream: &B::Stream,
    ) -> Option<u64> {
        let want = tc.as_ref().map_or(1, |t| t.refill_count(class)).max(1);
        let (mut got, pruned) = {
            let mut sh = self.shared.lock();
            let i = sh.index(B::stream_id(stream))?;
            let got = sh.take_free(i, class, want);
            let pruned = sh.prune();
            (got, pruned)
        };
        drop(pruned);
        let first = got.pop()?;
        if !got.is_empty() {
            self.keep(tc, stream, class, got);
        }
        Some(first)
    }

    /// Blocks of `class` of another stream: the calling thread's first, then the shared
    /// lists'; ordered after that stream's work by one mark before they are handed over.
    fn steal<P>(
        &self,
        mut tc: Option<&mut ThreadCache<B, P>>,
        class: usize,
        taker: &B::Stream,
    ) -> Option<u64> {
        let id = B::stream_id(taker);
        let want = tc.as_ref().map_or(1, |t| t.refill_count(class)).max(1);
        let taken = match tc.as_deref_mut() {
            Some(t) => t.take_from_other_stream(id, class, want),
            None => None,
        };
        let (victim, mut blocks) = match taken {
            Some(t) => t,
            None => self.take_other_stream(id, class, want)?,
        };
        // The blocks left the victim's lists; no one else can see them. Order the taker
        // after everything queued on the victim so far, before it can use any of them.
        if let Err(e) = self.order_after(&victim, taker) {
            log::warn!("cudalloc: could not order a stream after another ({e}); allocating anew");
            self.counters.failures.fetch_add(1, Ordering::Relaxed);
            self.give_blocks(&victim, class, blocks);
            return None;
        }
        self.counters.steals.fetch_add(1, Ordering::Relaxed);
        drop(victim);
        let first = blocks.pop()?;
        if !blocks.is_empty() {
            self.keep(tc, taker, class, blocks);
        }
        Some(first)
    }

    /// Orders work queued on `taker` from now on after all work queued on `victim` so
    /// far: one mark on `victim`, one wait on `taker` (no host wait).
    fn order_after(&self, victim: &B::Stream, taker: &B::Stream) -> Result<()> {
        if !self.guarded() || B::stream_id(victim) == B::stream_id(taker) {
            return Ok(());
        }
        let mark = self.backend.mark(victim)?;
        self.counters.marks.fetch_add(1, Ordering::Relaxed);
        self.backend.wait(taker, &mark)
    }

    fn take_other_stream(&self, not: StreamId, class: usize, want: usize) -> Option<(B::Stream, Vec<u64>)> {
        let mut sh = self.shared.lock();
        let i = sh.other_with(not, class)?;
        let blocks = sh.take_free(i, class, want);
        let victim = sh.streams[i].stream.clone();
        let pruned = sh.prune();
        drop(sh);
        drop(pruned);
        Some((victim, blocks))
    }

    /// A new block of `bytes` from the backend, releasing idle blocks first when there are
    /// too many, and recovering from out of memory.
    fn alloc_backend<P>(
        &self,
        mut tc: Option<&mut ThreadCache<B, P>>,
        bytes: usize,
        stream: &B::Stream,
    ) -> Result<u64> {
        self.make_room(tc.as_deref_mut(), bytes);
        let first = match self.reserve_and_alloc(bytes, stream) {
            Ok(p) => return Ok(p),
            Err(e) if e.is_out_of_memory() => e,
            Err(e) => return Err(self.failed(e)),
        };
        log::debug!("cudalloc: device pool out of memory for {bytes} bytes ({first}); releasing the cache");
        self.counters.oom_recoveries.fetch_add(1, Ordering::Relaxed);
        let touched = self.release_all(tc);
        match self.reserve_and_alloc(bytes, stream) {
            Ok(p) => return Ok(p),
            Err(e) if e.is_out_of_memory() => {}
            Err(e) => return Err(self.failed(e)),
        }
        // The released blocks' frees may not have completed; wait for them and give the
        // driver pool's idle memory back to the device (it may be fragmented), once.
        for s in &touched {
            if let Err(e) = self.backend.synchronize(s) {
                crate::cuda::record_drop_error("synchronizing a stream after releasing cached blocks", e);
            }
        }
        self.trim_backend_to(0);
        self.reserve_and_alloc(bytes, stream).map_err(|e| self.failed(e))
    }

    #[cold]
    fn failed(&self, e: Error) -> Error {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        e
    }

    /// Reserves `bytes` against the limit, then allocates them from the backend.
    fn reserve_and_alloc(&self, bytes: usize, stream: &B::Stream) -> Result<u64> {
        self.held.reserve(bytes)?;
        match self.backend.alloc(bytes, stream) {
            Ok(p) => {
                if bytes <= self.settings.max_cached_bytes {
                    self.idle.held(bytes, true);
                }
                self.held_blocks.fetch_add(1, Ordering::Relaxed);
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                Ok(p)
            }
            Err(e) => {
                self.held.release(bytes);
                Err(e)
            }
        }
    }

    /// Moves gated blocks whose recorded uses have completed to their home stream's free
    /// list: the oldest few of each stream, queried with no lock held.
    fn poll_gated(&self) {
        if self.shared.gated() == 0 {
            return;
        }
        let batch = self.shared.lock().take_polls(POLL_PER_STREAM);
        if batch.is_empty() {
            return;
        }
        let mut batch = batch;
        let done: Vec<bool> = batch
            .iter_mut()
            .map(|(_, g)| g.marks.poll(&self.backend))
            .collect();
        // Marks of finished blocks and handle clones are dropped after the lock.
        let mut after_lock: Vec<(B::Stream, Option<Gated<B>>)> = Vec::with_capacity(batch.len());
        {
            let mut sh = self.shared.lock();
            // Back in reverse, so that the waiting ones keep their order at the front.
            for ((stream, g), complete) in batch.into_iter().zip(done).rev() {
                if complete {
                    self.freed(g.ptr, class_size(g.class), &stream);
                }
                let finished = sh.polled(&stream, g, complete);
                after_lock.push((stream, finished));
            }
        }
        drop(after_lock);
    }
}
