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
//! bytes (at least 64 MiB): a workload that changes sizes keeps its memory near what it
//! uses, one that repeats never misses. The driver pool keeps what it gets back and carves
//! it for later requests, so its reservations drift above what the cache holds (trimming
//! the driver pool after each release was measured and rejected: BENCHMARKS.md).
//!
//! With [`Backing::PhysicalPages`](super::Backing::PhysicalPages) (the default where the
//! device supports it) the backend puts blocks of 2 granules and more (4 MiB on the H200)
//! on its page heap (`pages.rs`) instead: runs of one large virtual range over chunks of
//! physical memory (8 MiB by default), freed runs coalescing and staying mapped, so that
//! what a released block held serves a miss of any size with no driver call when it fits
//! (after a wait for the free's mark on the GPU when the miss is on another stream), and
//! idle chunks move to where blocks need them beyond an allowance (1/128 of the heap's
//! block bytes by default). On the simulated GPU RMM's random workload then reserves
//! 1.141 of its peak request (the driver pool: 1.212), on the H200 1.144 (1.472); the
//! cache above is unchanged (same classes, same idle bound), the cost is on the misses
//! that map.
//!
//! Out of memory: every idle block is released, other threads are asked for theirs, and
//! the allocation is retried; then the streams involved are synchronized, the driver pool
//! trimmed, and retried once more.

use std::collections::VecDeque;

use super::backend::Backend;
use super::reserve::Tally;
use super::size_class::{class_of, class_size, round_to_granule, MAX_CLASS_SIZE};
use super::thread_cache::{Evicted, ThreadCache, ThreadStats};
use crate::cuda::StreamId;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};
use crate::trace::{Code, Note};

/// A miss tolerates idle bytes up to 1/2^IDLE_SHIFT of the live bytes.
const IDLE_SHIFT: u32 = 5;
/// Gated blocks polled per stream on a slow path.
const POLL_PER_STREAM: usize = 4;

/// The cache's shape, fixed at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Requests up to this many bytes are cached by class (0: nothing is cached); larger
    /// blocks go to and from the backend directly.
    pub(crate) max_cached_bytes: usize,
    /// The largest class a thread cache keeps (`None`: no thread caches).
    pub(crate) thread_max_class: Option<usize>,
    /// The most bytes one thread's cache keeps for this pool.
    pub(crate) thread_cache_bytes: usize,
    /// The most bytes held from the backend (`usize::MAX` for no limit: the arithmetic
    /// needs no branch).
    pub(crate) limit: usize,
    /// Idle bytes a miss always tolerates (64 MiB by default).
    pub(crate) idle_floor: usize,
}

impl Settings {
    /// The settings of a cache keeping blocks up to `max_cached_bytes`, with thread caches
    /// of `thread_cache_bytes` (0: none), holding at most `limit` bytes (`None`: no
    /// limit).
    pub(crate) fn new(max_cached_bytes: usize, thread_cache_bytes: usize, limit: Option<usize>) -> Self {
        let max_cached_bytes = max_cached_bytes.min(MAX_CLASS_SIZE);
        let max_cached_bytes = match max_cached_bytes {
            0 => 0,
            // The largest class not above the setting.
            b => {
                let c = class_of(b);
                if class_size(c) > b {
                    if c == 0 {
                        0
                    } else {
                        class_size(c - 1)
                    }
                } else {
                    b
                }
            }
        };
        let thread_limit = thread_cache_bytes.min(max_cached_bytes);
        let thread_max_class = match thread_limit {
            0..=255 => None,
            b => {
                let c = class_of(b);
                Some(if class_size(c) > b { c - 1 } else { c })
            }
        };
        Self {
            max_cached_bytes,
            thread_max_class,
            thread_cache_bytes,
            limit: limit.unwrap_or(usize::MAX),
            idle_floor: 64 << 20,
        }
    }
}

/// A block freed while work recorded on other streams may still use it.
struct Gated<B: Backend> {
    ptr: u64,
    class: usize,
    /// One mark per other stream, recorded at the free.
    marks: Vec<B::Mark>,
}

/// One stream's shared lists.
struct StreamLists<B: Backend> {
    id: StreamId,
    /// A live handle of the stream: marks are recorded on it when another stream takes
    /// its blocks, and its blocks are freed to the backend in its order.
    stream: B::Stream,
    /// Free blocks by class (grown on demand), most recently freed last.
    free: Vec<Vec<u64>>,
    // bytes == sum over free of len * class size
    bytes: usize,
    // blocks == sum over free of len
    blocks: usize,
    /// Blocks waiting for their recorded uses, oldest first.
    gated: VecDeque<Gated<B>>,
    /// Gated blocks being polled outside the lock; the entry stays while it is nonzero.
    polling: usize,
}

impl<B: Backend> StreamLists<B> {
    fn is_empty(&self) -> bool {
        self.blocks == 0 && self.gated.is_empty() && self.polling == 0
    }
}

/// The shared lists of every stream, behind the cache's lock.
struct Shared<B: Backend> {
    streams: Vec<StreamLists<B>>,
    // bytes == sum over streams of bytes (free blocks)
    bytes: usize,
    blocks: usize,
    // pending_* count gated blocks, those being polled included
    pending_bytes: usize,
    pending_blocks: usize,
}

impl<B: Backend> Shared<B> {
    fn index(&self, id: StreamId) -> Option<usize> {
        self.streams.iter().position(|s| s.id == id)
    }

    /// The index of `stream`'s lists, making them (with a clone of the handle: an atomic
    /// increment, no CUDA call) if needed.
    fn entry(&mut self, stream: &B::Stream) -> usize {
        let id = B::stream_id(stream);
        match self.index(id) {
            Some(i) => i,
            None => {
                self.streams.push(StreamLists {
                    id,
                    stream: stream.clone(),
                    free: Vec::new(),
                    bytes: 0,
                    blocks: 0,
                    gated: VecDeque::new(),
                    polling: 0,
                });
                self.streams.len() - 1
            }
        }
    }

    fn push_free(&mut self, i: usize, class: usize, blocks: impl IntoIterator<Item = u64>) {
        let s = &mut self.streams[i];
        if s.free.len() <= class {
            s.free.resize_with(class + 1, Vec::new);
        }
        let before = s.free[class].len();
        s.free[class].extend(blocks);
        let n = s.free[class].len() - before;
        let bytes = n * class_size(class);
        s.bytes += bytes;
        s.blocks += n;
        self.bytes += bytes;
        self.blocks += n;
    }

    /// Takes up to `n` (at least one, if any) free blocks of `class` of stream index `i`,
    /// the oldest first.
    fn take_free(&mut self, i: usize, class: usize, n: usize) -> Vec<u64> {
        let s = &mut self.streams[i];
        let Some(list) = s.free.get_mut(class) else {
            return Vec::new();
        };
        let k = n.max(1).min(list.len());
        let taken: Vec<u64> = list.drain(..k).collect();
        let bytes = k * class_size(class);
        s.bytes -= bytes;
        s.blocks -= k;
        self.bytes -= bytes;
        self.blocks -= k;
        taken
    }

    /// Takes the largest free blocks of any stream until at least `excess` bytes.
    fn take_largest(&mut self, mut excess: usize) -> Vec<(B::Stream, usize, u64)> {
        let mut out = Vec::new();
        let top = self.streams.iter().map(|s| s.free.len()).max().unwrap_or(0);
        for class in (0..top).rev() {
            for i in 0..self.streams.len() {
                while excess > 0 {
                    let taken = self.take_free(i, class, 1);
                    let Some(&ptr) = taken.first() else { break };
                    out.push((self.streams[i].stream.clone(), class, ptr));
                    excess = excess.saturating_sub(class_size(class));
                }
            }
            if excess == 0 {
                break;
            }
        }
        out
    }

    /// Takes out the lists of streams with nothing cached, to be dropped (with their
    /// stream handles, which may destroy a stream) after the lock is released: the cache
    /// keeps a handle only of streams whose blocks it holds.
    fn prune(&mut self) -> Vec<StreamLists<B>> {
        if self.streams.iter().all(|s| !s.is_empty()) {
            return Vec::new();
        }
        let (keep, empty): (Vec<_>, Vec<_>) = core::mem::take(&mut self.streams)
            .into_iter()
            .partition(|s| !s.is_empty());
        self.streams = keep;
        empty
    }

    /// Checks the counts against the lists (debug builds).
    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let (mut bytes, mut blocks, mut pending) = (0, 0, 0);
            for s in &self.streams {
                let b: usize = s
                    .free
                    .iter()
                    .enumerate()
                    .map(|(c, l)| l.len() * class_size(c))
                    .sum();
                let n: usize = s.free.iter().map(Vec::len).sum();
                debug_assert_eq!((b, n), (s.bytes, s.blocks), "stream {} counts", s.id);
                bytes += b;
                blocks += n;
                pending += s.gated.len() + s.polling;
            }
            debug_assert_eq!((bytes, blocks), (self.bytes, self.blocks), "shared counts");
            debug_assert_eq!(pending, self.pending_blocks, "pending blocks");
        }
    }
}

/// Event counters of a cache (read-modify-writes happen only on slow paths).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Blocks allocated from the backend.
    pub(crate) misses: AtomicU64,
    /// Batches of blocks one stream took from another.
    pub(crate) steals: AtomicU64,
    /// Marks recorded to order a stream after another (steals and recorded uses).
    pub(crate) marks: AtomicU64,
    /// Allocations that failed.
    pub(crate) failures: AtomicU64,
    /// Blocks given back to the backend.
    pub(crate) released: AtomicU64,
    /// Out-of-memory recoveries attempted (release everything, retry).
    pub(crate) oom_recoveries: AtomicU64,
    /// Times the backend's idle reservations were trimmed (out-of-memory recoveries and
    /// `trim`).
    pub(crate) trims: AtomicU64,
    /// Bytes given up on (never reused, never freed) because a wait for the GPU failed.
    pub(crate) abandoned_bytes: AtomicU64,
}

/// What [`Cache::snapshot`] reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) held_bytes: u64,
    pub(crate) held_blocks: u64,
    pub(crate) peak_held_bytes: u64,
    pub(crate) cached_bytes: u64,
    pub(crate) cached_blocks: u64,
    pub(crate) pending_bytes: u64,
    pub(crate) pending_blocks: u64,
    /// (stream id, cached bytes, cached blocks), the shared lists and thread caches merged.
    pub(crate) per_stream: Vec<(u64, u64, u64)>,
    pub(crate) thread_caches: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) steals: u64,
    pub(crate) marks: u64,
    pub(crate) failures: u64,
    pub(crate) released: u64,
    pub(crate) oom_recoveries: u64,
    pub(crate) trims: u64,
    pub(crate) abandoned_bytes: u64,
}

/// A device pool's cache over its backend. See the [module docs](self).
pub(crate) struct Cache<B: Backend> {
    pub(crate) backend: B,
    pub(crate) settings: Settings,
    shared: Mutex<Shared<B>>,
    /// Mirror of the shared free bytes (stored under the lock), for the release policy.
    shared_bytes: AtomicUsize,
    /// Mirror of the number of gated blocks (stored under the lock): polls are skipped
    /// without locking when it is 0.
    gated: AtomicUsize,
    // held == bytes of blocks from the backend not yet given back: live + cached (shared
    // and thread caches) + pending + in transit between them; held <= settings.limit
    held: Tally,
    held_blocks: AtomicUsize,
    pub(crate) counters: Counters,
    /// Every thread cache's published counters.
    threads: Mutex<Vec<Arc<ThreadStats>>>,
    /// Hits of thread caches that are gone.
    retired_hits: AtomicU64,
    /// Whether cross-stream hand-overs and recorded uses are ordered by marks (always,
    /// except in negative-control tests).
    guard: AtomicBool,
}

impl<B: Backend> Cache<B> {
    pub(crate) fn new(backend: B, settings: Settings) -> Self {
        Self {
            backend,
            settings,
            shared: Mutex::new(Shared {
                streams: Vec::new(),
                bytes: 0,
                blocks: 0,
                pending_bytes: 0,
                pending_blocks: 0,
            }),
            shared_bytes: AtomicUsize::new(0),
            gated: AtomicUsize::new(0),
            held: Tally::new(Some(settings.limit).filter(|&l| l != usize::MAX)),
            held_blocks: AtomicUsize::new(0),
            counters: Counters::default(),
            threads: Mutex::new(Vec::new()),
            retired_hits: AtomicU64::new(0),
            guard: AtomicBool::new(true),
        }
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

    fn mirror(&self, sh: &Shared<B>) {
        self.shared_bytes.store(sh.bytes, Ordering::Relaxed);
        self.gated.store(sh.pending_blocks, Ordering::Relaxed);
        sh.debug_check();
    }

    // ---- thread caches ----------------------------------------------------------------

    /// A new thread cache, registered for statistics and reclaim; `None` when the
    /// settings have none.
    pub(crate) fn new_thread_cache<P>(&self) -> Option<ThreadCache<B, P>> {
        let max_class = self.settings.thread_max_class?;
        let bytes = self.settings.thread_cache_bytes;
        let stats = Arc::new(ThreadStats::default());
        lock(&self.threads).push(stats.clone());
        Some(ThreadCache::new(
            ThreadCache::<B, P>::caps_for(max_class, bytes),
            bytes,
            stats,
        ))
    }

    /// Flushes a thread cache that goes away and stops reading its counters.
    pub(crate) fn retire_thread_cache<P>(&self, tc: &mut ThreadCache<B, P>) {
        self.flush_thread(tc);
        let stats = tc.stats();
        self.retired_hits
            .fetch_add(stats.hits.load(Ordering::Relaxed), Ordering::Relaxed);
        stats.hits.store(0, Ordering::Relaxed);
        let me: *const ThreadStats = &**stats;
        lock(&self.threads).retain(|s| !core::ptr::eq(&**s, me));
    }

    /// Moves every block of a thread cache to the shared lists (its handles are dropped
    /// outside the lock).
    pub(crate) fn flush_thread<P>(&self, tc: &mut ThreadCache<B, P>) {
        let evicted = tc.take_all();
        self.give_evicted(evicted);
    }

    fn give_evicted(&self, evicted: impl IntoIterator<Item = Evicted<B>>) {
        let mut handles = Vec::new();
        {
            let mut sh = lock(&self.shared);
            for ev in evicted {
                if !ev.blocks.is_empty() {
                    let i = sh.entry(&ev.stream);
                    for (class, blocks) in ev.blocks {
                        sh.push_free(i, class, blocks);
                    }
                }
                handles.push(ev.stream);
            }
            self.mirror(&sh);
        }
        drop(handles);
    }

    /// Adds free blocks of `class` to `stream`'s shared list.
    fn give_blocks(&self, stream: &B::Stream, class: usize, blocks: Vec<u64>) {
        let mut sh = lock(&self.shared);
        let i = sh.entry(stream);
        sh.push_free(i, class, blocks);
        self.mirror(&sh);
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
            let mut sh = lock(&self.shared);
            let i = sh.index(B::stream_id(stream))?;
            let got = sh.take_free(i, class, want);
            let pruned = sh.prune();
            self.mirror(&sh);
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
        let mut sh = lock(&self.shared);
        let i = sh
            .streams
            .iter()
            .position(|s| s.id != not && s.free.get(class).is_some_and(|l| !l.is_empty()))?;
        let blocks = sh.take_free(i, class, want);
        let victim = sh.streams[i].stream.clone();
        let pruned = sh.prune();
        self.mirror(&sh);
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

    /// The release policy of a miss: idle blocks (this thread's and the shared ones)
    /// beyond 1/32 of the live bytes (at least the floor), or beyond the limit, go back
    /// to the backend, largest first.
    fn make_room<P>(&self, tc: Option<&mut ThreadCache<B, P>>, need: usize) {
        let own = tc.as_ref().map_or(0, |t| t.bytes());
        let idle = own + self.shared_bytes.load(Ordering::Relaxed);
        if idle == 0 {
            return;
        }
        let held = self.held.held();
        let live = held.saturating_sub(idle);
        let bound = (live.saturating_add(need) >> IDLE_SHIFT).max(self.settings.idle_floor);
        let over_limit = held.saturating_add(need).saturating_sub(self.settings.limit);
        let excess = idle.saturating_sub(bound).max(over_limit);
        if excess > 0 {
            self.release_idle(tc, excess);
        }
    }

    /// Gives idle blocks of at least `excess` bytes back to the backend, largest first:
    /// this thread's, then the shared ones. Returns the bytes given back.
    fn release_idle<P>(&self, tc: Option<&mut ThreadCache<B, P>>, excess: usize) -> usize {
        let mut out = tc.map(|t| t.take_largest(excess)).unwrap_or_default();
        let taken: usize = out.iter().map(|&(_, c, _)| class_size(c)).sum();
        if taken < excess {
            let mut sh = lock(&self.shared);
            out.extend(sh.take_largest(excess - taken));
            let pruned = sh.prune();
            self.mirror(&sh);
            drop(sh);
            drop(pruned);
        }
        let mut released = 0;
        for (stream, class, ptr) in out {
            self.give_back(ptr, class_size(class), &stream);
            released += class_size(class);
        }
        released
    }

    /// Frees a block to the backend in `stream`'s order and stops counting it.
    fn give_back(&self, ptr: u64, bytes: usize, stream: &B::Stream) {
        // SAFETY: the block came from this backend with `bytes` (its class size, or its
        // rounded size when uncached); it is free (no buffer owns it), taken out of every
        // list, and every use of it is ordered before the current end of `stream`, its
        // home stream (the protocol in the module docs).
        unsafe { self.backend.free(ptr, bytes, stream) };
        self.held.release(bytes);
        self.held_blocks.fetch_sub(1, Ordering::Relaxed);
        self.counters.released.fetch_add(1, Ordering::Relaxed);
    }

    /// Gives every idle block back to the backend: this thread's, the shared ones, and
    /// gated ones after waiting (on the host) for their recorded uses; asks every other
    /// thread to give its blocks to the shared lists. Returns the streams the frees were
    /// queued on.
    fn release_all<P>(&self, tc: Option<&mut ThreadCache<B, P>>) -> Vec<B::Stream> {
        let own: Option<*const ThreadStats> = tc.as_ref().map(|t| &**t.stats() as *const ThreadStats);
        for s in lock(&self.threads).iter() {
            if own != Some(&**s as *const ThreadStats) {
                s.reclaim.store(true, Ordering::Relaxed);
            }
        }
        let mut blocks = tc.map(|t| t.take_largest(usize::MAX)).unwrap_or_default();
        let mut gated = Vec::new();
        {
            let mut sh = lock(&self.shared);
            blocks.extend(sh.take_largest(usize::MAX));
            let (mut bytes, mut n) = (0, 0);
            for s in &mut sh.streams {
                for g in s.gated.drain(..) {
                    bytes += class_size(g.class);
                    n += 1;
                    gated.push((s.stream.clone(), g));
                }
            }
            sh.pending_bytes -= bytes;
            sh.pending_blocks -= n;
            let pruned = sh.prune();
            self.mirror(&sh);
            drop(sh);
            drop(pruned);
        }
        for (stream, g) in gated {
            if self.wait_marks_on_host(&g.marks) {
                self.freed(g.ptr, class_size(g.class), &stream);
                blocks.push((stream, g.class, g.ptr));
            } else {
                self.abandon(class_size(g.class));
            }
        }
        let mut touched: Vec<B::Stream> = Vec::new();
        for (stream, class, ptr) in blocks {
            self.give_back(ptr, class_size(class), &stream);
            if !touched.iter().any(|t| B::stream_id(t) == B::stream_id(&stream)) {
                touched.push(stream);
            }
        }
        touched
    }

    fn wait_marks_on_host(&self, marks: &[B::Mark]) -> bool {
        marks.iter().all(|m| match self.backend.wait_host(m) {
            Ok(()) => true,
            Err(e) => {
                crate::cuda::record_drop_error("waiting for a recorded use of a device block", e);
                false
            }
        })
    }

    /// Gives up on a block the GPU may still use: never reused, never freed (a leak is
    /// better than corrupted data). It stays counted as held.
    #[cold]
    fn abandon(&self, bytes: usize) {
        self.counters
            .abandoned_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        log::error!("cudalloc: a device block of {bytes} bytes is abandoned: the GPU may still use it");
    }

    /// Moves gated blocks whose recorded uses have completed to their home stream's free
    /// list: the oldest few of each stream, queried with no lock held.
    fn poll_gated(&self) {
        if self.gated.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut batch: Vec<(B::Stream, Gated<B>)> = Vec::new();
        {
            let mut sh = lock(&self.shared);
            for s in &mut sh.streams {
                let n = s.gated.len().min(POLL_PER_STREAM);
                s.polling += n;
                for g in s.gated.drain(..n) {
                    batch.push((s.stream.clone(), g));
                }
            }
        }
        if batch.is_empty() {
            return;
        }
        let done: Vec<bool> = batch
            .iter()
            .map(|(_, g)| {
                g.marks
                    .iter()
                    .all(|m| matches!(self.backend.is_complete(m), Ok(true)))
            })
            .collect();
        // Marks of finished blocks and handle clones are dropped after the lock.
        let mut after_lock: Vec<(B::Stream, Vec<B::Mark>)> = Vec::with_capacity(batch.len());
        {
            let mut sh = lock(&self.shared);
            // Back in reverse, so that the waiting ones keep their order at the front.
            for ((stream, g), complete) in batch.into_iter().zip(done).rev() {
                let i = sh.entry(&stream);
                sh.streams[i].polling -= 1;
                let marks = if complete {
                    self.freed(g.ptr, class_size(g.class), &stream);
                    sh.pending_bytes -= class_size(g.class);
                    sh.pending_blocks -= 1;
                    sh.push_free(i, g.class, [g.ptr]);
                    g.marks
                } else {
                    sh.streams[i].gated.push_front(g);
                    Vec::new()
                };
                after_lock.push((stream, marks));
            }
            self.mirror(&sh);
        }
        drop(after_lock);
    }

    // ---- free -------------------------------------------------------------------------

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
            return self.free_uncached(ptr, rounded, stream, uses);
        };
        if self.guarded() && uses.iter().any(|u| B::stream_id(u) != home) {
            match self.mark_uses(home, &uses) {
                Some(marks) if !marks.is_empty() => return self.push_gated(&stream, class, ptr, marks),
                Some(_) => {} // every use was waited for on the host: an ordinary free
                None => return self.abandon(class_size(class)),
            }
        }
        if !uses.is_empty() {
            // Its free was recorded as requested only (`Owned::release`): reusable now.
            self.freed(ptr, bytes, &stream);
        }
        drop(uses);
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
    fn mark_uses(&self, home: StreamId, uses: &[B::Stream]) -> Option<Vec<B::Mark>> {
        let mut marks = Vec::with_capacity(uses.len());
        for u in uses.iter().filter(|u| B::stream_id(u) != home) {
            match self.backend.mark(u) {
                Ok(m) => {
                    self.counters.marks.fetch_add(1, Ordering::Relaxed);
                    marks.push(m);
                }
                Err(e) => {
                    log::warn!("cudalloc: could not record a use of a device block ({e}); synchronizing");
                    if let Err(e) = self.backend.synchronize(u) {
                        crate::cuda::record_drop_error("synchronizing a stream that used a device block", e);
                        return None;
                    }
                }
            }
        }
        Some(marks)
    }

    fn push_gated(&self, stream: &B::Stream, class: usize, ptr: u64, marks: Vec<B::Mark>) {
        let mut sh = lock(&self.shared);
        let i = sh.entry(stream);
        sh.streams[i].gated.push_back(Gated { ptr, class, marks });
        sh.pending_bytes += class_size(class);
        sh.pending_blocks += 1;
        self.mirror(&sh);
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
    fn freed(&self, ptr: u64, bytes: usize, home: &B::Stream) {
        self.backend.trace().event(|| Note {
            stream: B::stream_id(home).get(),
            ..Note::new(Code::FreeCompleted, ptr as usize, bytes)
        });
    }

    /// The backend's reservations trimmed to `keep` bytes, recorded as a `Trim` of the
    /// bytes it gave back (0 when the backend cannot say what it reserves).
    fn trim_backend_to(&self, keep: usize) {
        let before = self.backend.reserved();
        self.backend.trim_to(keep);
        self.counters.trims.fetch_add(1, Ordering::Relaxed);
        self.backend.trace().event(|| {
            let after = self.backend.reserved();
            let released = before.zip(after).map_or(0, |(b, a)| b.saturating_sub(a));
            Note::new(Code::Trim, 0, released)
        });
    }

    // ---- trim and statistics ----------------------------------------------------------

    /// Gives every cached block back to the backend (this thread's, the shared ones and
    /// the gated ones, waiting for their uses), waits for those frees, returns the
    /// backend's idle memory to the device, drops the handles of streams with nothing
    /// cached, and asks other threads for their blocks (they give them at their next
    /// allocation or free on this pool). Returns the bytes the backend reserves less from
    /// the device (when it cannot say: the bytes of the blocks it got back).
    pub(crate) fn trim<P>(&self, mut tc: Option<&mut ThreadCache<B, P>>) -> usize {
        let (reserved_before, held_before) = (self.backend.reserved(), self.held.held());
        if let Some(t) = tc.as_deref_mut() {
            self.flush_thread(t);
        }
        let touched = self.release_all(tc);
        for s in &touched {
            if let Err(e) = self.backend.synchronize(s) {
                crate::cuda::record_drop_error("synchronizing a stream after releasing cached blocks", e);
            }
        }
        drop(touched);
        self.trim_backend_to(0);
        let idle_streams = {
            let mut sh = lock(&self.shared);
            let pruned = sh.prune();
            self.mirror(&sh);
            pruned
        };
        drop(idle_streams);
        match reserved_before.zip(self.backend.reserved()) {
            Some((before, after)) => before.saturating_sub(after),
            None => held_before.saturating_sub(self.held.held()),
        }
    }

    /// A snapshot of the counters: no side effect, no CUDA call.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut per_stream: Vec<(u64, u64, u64)> = Vec::new();
        let mut add = |id: u64, bytes: u64, blocks: u64| {
            if blocks == 0 {
                return;
            }
            match per_stream.iter_mut().find(|e| e.0 == id) {
                Some(e) => {
                    e.1 += bytes;
                    e.2 += blocks;
                }
                None => per_stream.push((id, bytes, blocks)),
            }
        };
        let (mut cached_bytes, mut cached_blocks, pending_bytes, pending_blocks) = {
            let sh = lock(&self.shared);
            for s in &sh.streams {
                add(s.id.get(), s.bytes as u64, s.blocks as u64);
            }
            (
                sh.bytes as u64,
                sh.blocks as u64,
                sh.pending_bytes as u64,
                sh.pending_blocks as u64,
            )
        };
        let mut hits = self.retired_hits.load(Ordering::Relaxed);
        let threads = lock(&self.threads);
        for t in threads.iter() {
            hits += t.hits.load(Ordering::Relaxed);
            for slot in &t.slots {
                let id = slot.id.load(Ordering::Relaxed);
                if id != 0 {
                    let (b, n) = (
                        slot.bytes.load(Ordering::Relaxed),
                        slot.blocks.load(Ordering::Relaxed),
                    );
                    cached_bytes += b;
                    cached_blocks += n;
                    add(id, b, n);
                }
            }
        }
        let thread_caches = threads.len() as u64;
        drop(threads);
        per_stream.sort_unstable();
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            held_bytes: self.held.held() as u64,
            held_blocks: self.held_blocks.load(Ordering::Relaxed) as u64,
            peak_held_bytes: self.held.peak() as u64,
            cached_bytes,
            cached_blocks,
            pending_bytes,
            pending_blocks,
            per_stream,
            thread_caches,
            hits,
            misses: load(&c.misses),
            steals: load(&c.steals),
            marks: load(&c.marks),
            failures: load(&c.failures),
            released: load(&c.released),
            oom_recoveries: load(&c.oom_recoveries),
            trims: load(&c.trims),
            abandoned_bytes: load(&c.abandoned_bytes),
        }
    }

    /// Resets the peak of held bytes to the current value.
    pub(crate) fn reset_peak(&self) {
        self.held.reset_peak();
    }

    /// Counts a failure that happened before the cache was reached (a request that can
    /// never fit).
    pub(crate) fn count_failure(&self) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
    }
}

impl<B: Backend> Drop for Cache<B> {
    fn drop(&mut self) {
        // No thread cache and no buffer refers to the cache any more (they hold the pool):
        // every block left is in the shared lists.
        let streams = core::mem::take(&mut lock(&self.shared).streams);
        for mut s in streams {
            for (class, list) in s.free.iter().enumerate() {
                for &ptr in list {
                    self.give_back(ptr, class_size(class), &s.stream);
                }
            }
            for g in s.gated.drain(..) {
                // The home stream waits for the recorded uses on the GPU; the host waits
                // only if that fails.
                let ordered = g
                    .marks
                    .iter()
                    .all(|m| self.backend.wait(&s.stream, m).is_ok() || self.backend.wait_host(m).is_ok());
                if ordered {
                    self.give_back(g.ptr, class_size(g.class), &s.stream);
                } else {
                    self.abandon(class_size(g.class));
                }
            }
        }
    }
}
