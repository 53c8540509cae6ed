//! The caching pool: [`Pool<S>`] turns a slow source (a `cuMemHostAlloc` costs about
//! 0.7 ms) into an allocator whose common case is a pop from a per-thread list.
//!
//! ```
//! use allocator_api2::vec::Vec;
//! use cudalloc::{pool::Pool, source::HostSource};
//!
//! let pool = Pool::new(HostSource); // any source: PinnedSource, ManagedSource, ...
//! let mut v: Vec<u32, _> = Vec::new_in(&pool);
//! v.extend(0..1000);
//! drop(v);
//! let again: Vec<u32, _> = Vec::with_capacity_in(1000, &pool); // served from the cache
//! assert!(pool.stats().hits >= 1);
//! # drop(again);
//! ```
//!
//! # How it works
//!
//! - **Size classes** (`size_class.rs`): exact multiples of 16 up to 256 B, then 8 per
//!   power of two up to the large threshold (512 KiB by default), so a block wastes at
//!   most 12.5% of the request (15 bytes below 128 B). Small blocks are carved from
//!   **chunks** of 2 MiB (configurable) taken from the source, cut into page-aligned runs
//!   of one class each (`chunks.rs`).
//! - **Large blocks** (above the threshold, or aligned beyond a page) are extents of
//!   **segments** taken from the source at the request's page-rounded size (no
//!   power-of-two rounding). A request takes the smallest free extent that fits and
//!   splits off the rest; freed extents merge with free neighbours; a segment goes back
//!   to the source when it is wholly free. A block that grows (`Allocator::grow`, as a
//!   `Vec` does) extends in place into the free extent after it; when it must move, it
//!   goes to the largest free extent, or to a fresh segment with room to double, so a
//!   `Vec` of pinned memory growing again and again stops copying (`large.rs`).
//! - **Thread caches** (`thread_cache.rs`): each thread keeps, per pool, a bounded bin of
//!   free blocks per class (and a few large blocks). Allocating pops from the bin, freeing
//!   pushes to it: no lock, no atomic read-modify-write. A full bin moves half its blocks
//!   to the shared list of its class; a thread's cache is flushed when the thread exits.
//! - **Pending list** (`uses.rs`): [`Pool::record_use`] records an event on the stream
//!   of a GPU use of a block; a block freed while such events are unfinished waits in the
//!   pending list and is reused only once they have completed. Events are queried with
//!   no lock held and come from a per-device pool of reusable events.
//! - **Limits**: a cap on bytes held from the source ([`PoolConfig::limit`],
//!   [`Pool::set_limit`]); when the source fails or the cap is reached, the pool trims
//!   its cache and retries once, then waits up to [`PoolConfig::pending_wait`] (10 s by
//!   default) for pending blocks whose GPU uses are still running, then returns
//!   `AllocError`. [`Pool::trim`] returns cached memory to the source.
//! - **Statistics**: [`Pool::stats`].
//!
//! The pool writes nothing into the blocks it manages (no headers, no free-list links):
//! a freed managed block is not migrated back to the host, and a pinned block is not
//! written while a copy may still read it.
//!
//! # Thread caches and memory
//!
//! A thread's cache holds at most [`PoolConfig::thread_cache_bytes`] per pool. Its blocks
//! count as cached in [`Pool::stats`], but [`Pool::trim`] can return only what is in the
//! shared lists (and the calling thread's cache, which it flushes first): blocks parked
//! in another thread's cache go back when that thread exits or fills its cache. Dropping
//! a pool while other threads still hold its blocks in their caches keeps its memory
//! until those threads exit or use another pool in the same cache slot. Set
//! `thread_cache_capacity: 0` for a pool without thread caches.

mod accounting;
mod async_alloc;
#[cfg(feature = "debug-checks")]
mod checks;
mod chunks;
mod large;
mod shared;
pub(crate) mod size_class;
mod small;
mod stats;
mod thread_cache;
mod transfers;
mod uses;

#[cfg(all(test, loom))]
mod loom_models;

use core::ptr::NonNull;
use core::time::Duration;

use allocator_api2::alloc::{AllocError, Allocator, Layout};

pub use stats::PoolStats;

pub use async_alloc::AllocateAsync;
use shared::{OwnerRef, Settings, Shared};
use size_class::{class_of, class_of_aligned, class_size, MAX_CLASS_SIZE, QUANTUM};
use uses::BlockKind;

use crate::budget::Budget;
use crate::cuda::nvtx;
use crate::error::{Error, Result};
use crate::fence::{registry, Fence};
use crate::observe;
use crate::source::{HostVisible, MemorySource};
use crate::sync::Arc;
use crate::util::{align_up, dangling_block, PAGE_SIZE};

/// The address of a block the pool owns. Blocks change hands between threads (thread
/// caches, shared lists); whoever holds a `BlockPtr` in a list owns the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockPtr(NonNull<u8>);

// SAFETY: a BlockPtr is an address of memory owned by the pool; moving it between threads
// moves that ownership, and the pool's memory may be used from any thread.
unsafe impl Send for BlockPtr {}
// SAFETY: as above; a shared BlockPtr gives no access by itself.
unsafe impl Sync for BlockPtr {}

impl BlockPtr {
    pub(crate) fn new(p: NonNull<u8>) -> Self {
        Self(p)
    }
    #[inline(always)]
    pub(crate) fn addr(self) -> usize {
        self.0.as_ptr() as usize
    }
    #[inline(always)]
    pub(crate) fn as_non_null(self) -> NonNull<u8> {
        self.0
    }
    /// The address `offset` bytes further, keeping provenance (offsets stay within the
    /// chunk or block, which never ends at the top of the address space).
    #[inline(always)]
    pub(crate) fn add(self, offset: usize) -> Self {
        let p = self.0.as_ptr().wrapping_add(offset);
        // SAFETY: the offset stays inside an allocation above a non-null base, so the
        // result does not wrap to null.
        Self(unsafe { NonNull::new_unchecked(p) })
    }
}

/// The most blocks a refill moves at once.
pub(crate) const MAX_BATCH: usize = 32;

/// A fixed-capacity stack of blocks, to move a refill without allocating.
pub(crate) struct Batch {
    items: [BlockPtr; MAX_BATCH],
    len: usize,
}

impl Batch {
    pub(crate) fn new() -> Self {
        Self {
            items: [BlockPtr(NonNull::dangling()); MAX_BATCH],
            len: 0,
        }
    }
    pub(crate) fn push(&mut self, p: BlockPtr) {
        self.items[self.len] = p;
        self.len += 1;
    }
    pub(crate) fn pop(&mut self) -> Option<BlockPtr> {
        self.len = self.len.checked_sub(1)?;
        Some(self.items[self.len])
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Takes up to `n` blocks out.
    pub(crate) fn drain_up_to(&mut self, n: usize) -> impl Iterator<Item = BlockPtr> + '_ {
        let n = n.min(self.len);
        self.len -= n;
        self.items[self.len..self.len + n].iter().copied()
    }
    /// Takes every block out.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = BlockPtr> + '_ {
        self.drain_up_to(MAX_BATCH)
    }
}

/// How a [`Pool`] is shaped. Start from [`PoolConfig::default()`] and change what you
/// need with the `with_*` methods (the fields are public to read).
///
/// ```
/// use cudalloc::{pool::{Pool, PoolConfig}, source::HostSource};
/// let pool = Pool::with_config(
///     HostSource,
///     PoolConfig::default()
///         .with_limit(64 << 20)          // hold at most 64 MiB from the source
///         .with_thread_cache_capacity(16), // smaller thread caches
/// );
/// assert_eq!(pool.limit(), Some(64 << 20));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Bytes of each chunk taken from the source and carved into small blocks (default
    /// 2 MiB; rounded up to a page, at least 256 KiB).
    pub chunk_size: usize,
    /// Requests larger than this are large blocks, extents of segments at their
    /// page-rounded size (default 512 KiB; at most a quarter of a chunk and 1 MiB;
    /// rounded down to a size class). A free rest of at least this size is split off an
    /// extent; a smaller one stays with the block.
    pub large_threshold: usize,
    /// The most free blocks of one size class a thread keeps for this pool (default 64;
    /// fewer for large classes; 0 turns thread caches off).
    pub thread_cache_capacity: usize,
    /// The most bytes of free blocks a thread keeps for this pool (default 32 MiB).
    pub thread_cache_bytes: usize,
    /// The most bytes the pool may hold from its source (`None`, the default: no limit).
    pub limit: Option<usize>,
    /// Backpressure: how long an allocation that finds the pool at its limit (or its
    /// source out of memory) waits for freed blocks whose recorded GPU uses are still
    /// running, before it fails (default 10 s; `None`: it fails at once). A staging loop
    /// that outruns the GPU then runs at the GPU's pace instead of failing, and a `Vec`
    /// does not abort. A wait too long for the clock (`Duration::MAX`) waits for as long
    /// as the GPU work takes. A dropped pool waits as long for the uses of its freed
    /// blocks (10 s when `None`), then leaks what they guard (see [`Fence`]).
    pub pending_wait: Option<Duration>,
    /// Whether the pool describes its memory to an attached NVTX tool (compute-sanitizer:
    /// chunks the GPU reaches are heaps, blocks handed out live regions; see
    /// [`cuda::nvtx`](crate::cuda::nvtx)). Default `true`; nothing happens without a tool.
    pub nvtx: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            chunk_size: 2 << 20,
            large_threshold: 512 << 10,
            thread_cache_capacity: 64,
            thread_cache_bytes: 32 << 20,
            limit: None,
            pending_wait: Some(Duration::from_secs(10)),
            nvtx: true,
        }
    }
}

impl PoolConfig {
    /// This configuration with chunks of `bytes`.
    pub const fn with_chunk_size(self, bytes: usize) -> Self {
        Self {
            chunk_size: bytes,
            ..self
        }
    }

    /// This configuration with large blocks above `bytes`.
    pub const fn with_large_threshold(self, bytes: usize) -> Self {
        Self {
            large_threshold: bytes,
            ..self
        }
    }

    /// This configuration with thread-cache bins of at most `blocks` (0: no thread caches).
    ///
    /// ```
    /// let c = cudalloc::pool::PoolConfig::default().with_thread_cache_capacity(0);
    /// assert_eq!(c.thread_cache_capacity, 0);
    /// ```
    pub const fn with_thread_cache_capacity(self, blocks: usize) -> Self {
        Self {
            thread_cache_capacity: blocks,
            ..self
        }
    }

    /// This configuration with thread caches of at most `bytes` per thread.
    pub const fn with_thread_cache_bytes(self, bytes: usize) -> Self {
        Self {
            thread_cache_bytes: bytes,
            ..self
        }
    }

    /// This configuration holding at most `bytes` from the source.
    pub const fn with_limit(self, bytes: usize) -> Self {
        Self {
            limit: Some(bytes),
            ..self
        }
    }

    /// This configuration waiting at most `wait` for pending blocks when full (`None`:
    /// failing at once).
    ///
    /// ```
    /// use std::time::Duration;
    /// let c = cudalloc::pool::PoolConfig::default().with_pending_wait(None);
    /// assert_eq!(c.pending_wait, None);
    /// let c = c.with_pending_wait(Some(Duration::from_millis(500)));
    /// assert_eq!(c.pending_wait, Some(Duration::from_millis(500)));
    /// ```
    pub const fn with_pending_wait(self, wait: Option<Duration>) -> Self {
        Self {
            pending_wait: wait,
            ..self
        }
    }

    /// This configuration with its NVTX annotations on or off ([`nvtx`](PoolConfig::nvtx)):
    /// off, the pool's memory looks to compute-sanitizer as before (one allocation per
    /// chunk), as for the whole process with `CUDALLOC_NVTX=0`.
    ///
    /// ```
    /// let c = cudalloc::pool::PoolConfig::default();
    /// assert!(c.nvtx);
    /// assert!(!c.with_nvtx(false).nvtx);
    /// ```
    pub const fn with_nvtx(self, nvtx: bool) -> Self {
        Self { nvtx, ..self }
    }

    fn settings(&self) -> Settings {
        const MIN_CHUNK: usize = 256 << 10;
        let chunk_size = align_up(self.chunk_size.max(MIN_CHUNK), PAGE_SIZE).unwrap_or(MIN_CHUNK);
        let threshold = self
            .large_threshold
            .clamp(QUANTUM, (chunk_size / 4).min(MAX_CLASS_SIZE));
        let mut max_class = class_of(threshold);
        if class_size(max_class) > threshold {
            max_class -= 1;
        }
        let capacity = self.thread_cache_capacity.min(4096);
        let caps: Box<[usize]> = if capacity == 0 || self.thread_cache_bytes == 0 {
            Box::new([])
        } else {
            (0..=max_class)
                .map(|c| (self.thread_cache_bytes / 16 / class_size(c)).clamp(1, capacity))
                .collect()
        };
        Settings {
            chunk_size,
            large_threshold: class_size(max_class),
            max_class,
            caps,
            thread_cache_bytes: self.thread_cache_bytes,
            pending_wait: self.pending_wait,
            nvtx: self.nvtx,
        }
    }
}

/// A caching allocator over the memory source `S`: size classes carved from chunks,
/// large blocks as extents of segments, per-thread caches, GPU-aware reuse, a limit with
/// backpressure, statistics. See the [module docs](self) for how it works.
///
/// `Pool` implements allocator-api2's `Allocator` (so does `&Pool`) when `S` is
/// [`HostVisible`]. Blocks may be freed by any thread.
///
/// ```
/// use allocator_api2::{boxed::Box, vec::Vec};
/// use cudalloc::{pool::Pool, source::HostSource};
/// let pool = Pool::new(HostSource);
/// let b = Box::new_in([1u64; 64], &pool);
/// let v: Vec<u8, _> = Vec::with_capacity_in(10 << 20, &pool); // a large block
/// assert_eq!(pool.stats().live_blocks, 2);
/// drop((b, v));
/// pool.trim();
/// assert_eq!(pool.stats().source_bytes, 0);
/// ```
pub struct Pool<S: MemorySource + 'static> {
    shared: Arc<Shared<S>>,
}

impl<S: MemorySource + 'static> core::fmt::Debug for Pool<S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Pool")
            .field("kind", &self.shared.source.kind())
            .field("uid", &self.shared.uid)
            .finish()
    }
}

impl<S: MemorySource + 'static> Pool<S> {
    /// A pool over `source` with the default configuration.
    pub fn new(source: S) -> Self {
        Self::with_config(source, PoolConfig::default())
    }

    /// A pool over `source` shaped by `config`.
    pub fn with_config(source: S, config: PoolConfig) -> Self {
        Self::with_budget(source, config, Arc::new(Budget::new(config.limit)))
    }

    /// A pool whose limit is `budget`, which other pools may share (`config.limit` is
    /// ignored).
    pub(crate) fn with_budget(source: S, config: PoolConfig, budget: Arc<Budget>) -> Self {
        let settings = config.settings();
        let uid = registry::new_owner_id();
        let slot = if settings.caps.is_empty() {
            None
        } else {
            thread_cache::tls::acquire_slot()
        };
        let shared = Arc::new(Shared::new(source, settings, budget, uid, slot));
        registry::add_owner(uid, OwnerRef(shared.clone()));
        Self { shared }
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.shared.source
    }

    /// This pool, named `name` in traces (the handles' pools: `PinnedAlloc`, ...).
    pub(crate) fn traced_as(self, name: &'static str) -> Self {
        self.shared.trace.set_name(name);
        self
    }

    /// The cap on bytes held from the source (`None`: no limit).
    pub fn limit(&self) -> Option<usize> {
        self.shared.acct.budget.limit()
    }

    /// Changes the cap on bytes held from the source (`None`: no limit). Lowering it
    /// below what is held releases nothing by itself (see [`Pool::trim`]); allocations
    /// that would exceed it trim the cache, retry once, wait for pending blocks (see
    /// [`PoolConfig::pending_wait`]), and fail.
    ///
    /// ```
    /// use allocator_api2::alloc::{Allocator, Layout};
    /// use cudalloc::{pool::Pool, source::HostSource};
    /// let pool = Pool::new(HostSource);
    /// pool.set_limit(Some(4 << 20));
    /// assert!(pool.allocate(Layout::from_size_align(8 << 20, 8).unwrap()).is_err());
    /// pool.set_limit(None);
    /// assert!(pool.allocate(Layout::from_size_align(8 << 20, 8).unwrap()).is_ok());
    /// ```
    pub fn set_limit(&self, bytes: Option<usize>) {
        self.shared.acct.budget.set_limit(bytes);
    }

    /// Returns cached memory to the source: wholly free segments, and chunks all of whose
    /// blocks are free. Flushes the calling thread's cache and returns completed pending
    /// blocks first; blocks in other threads' caches stay there. Returns the bytes
    /// released.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{pool::Pool, source::HostSource};
    /// let pool = Pool::new(HostSource);
    /// drop(Vec::<u8, _>::with_capacity_in(1000, &pool));
    /// assert!(pool.stats().cached_bytes > 0);
    /// assert!(pool.trim() > 0);
    /// assert_eq!(pool.stats().cached_bytes, 0);
    /// ```
    pub fn trim(&self) -> usize {
        self.shared.trim()
    }

    /// Waits for the recorded GPU uses of every pending block, then returns all cached
    /// memory to the source ([`Pool::trim`]); returns the bytes released. Call it before
    /// exit under compute-sanitizer's leak check (or see
    /// [`release_cached_memory`](crate::release_cached_memory)), which otherwise reports
    /// every cached block as leaked.
    pub fn release(&self) -> usize {
        self.shared.release()
    }

    /// Returns the pending blocks whose recorded GPU uses have completed to the free
    /// lists (the pool also does this on its slow paths); returns how many it returned.
    pub fn collect_pending(&self) -> usize {
        self.shared.drain_all()
    }

    /// A snapshot of the pool's counters (see [`PoolStats`]). It only reads: blocks whose
    /// GPU uses completed since the pool last looked still count as pending (see
    /// [`Pool::collect_pending`]).
    pub fn stats(&self) -> PoolStats {
        self.shared.stats()
    }

    /// Records that work queued on `stream` (a copy, a kernel) uses the block holding
    /// `ptr`: if the block is freed before that work completes, it is not handed out
    /// again until then. Returns whether `ptr` is in this pool's memory (`Ok(false)`, and
    /// nothing recorded, for memory it does not own), as [`crate::record_use`] does for
    /// every allocator of the crate.
    ///
    /// The crate's copy helpers ([`crate::copy`]) record their uses themselves; call this
    /// after queuing other work that reads or writes a pooled block. Errors: `NoDriver`
    /// without a driver; `InvalidArgument` if `ptr` is in this pool's memory but in no
    /// block.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{cuda::Stream, pool::Pool, source::PinnedSource};
    /// if let Ok(stream) = Stream::new(0) {
    ///     let pool = Pool::new(PinnedSource::default());
    ///     let v: Vec<u8, _> = Vec::with_capacity_in(256, &pool);
    ///     // ... queue work reading `v` on `stream` through another API, then:
    ///     assert!(pool.record_use(v.as_ptr(), &stream).unwrap());
    ///     drop(v); // safe: the block waits for the work before reuse
    ///     assert!(!pool.record_use([0u8; 4].as_ptr(), &stream).unwrap(), "not this pool's");
    /// }
    /// ```
    pub fn record_use(&self, ptr: *const u8, stream: &crate::cuda::Stream) -> Result<bool> {
        if !self.owns(ptr) {
            return Ok(false);
        }
        let event = crate::cuda::PooledEvent::record(stream)?;
        self.record_fence(ptr, event)
    }

    /// Like [`Pool::record_use`], with any [`Fence`] in place of a CUDA event: the block
    /// holding `ptr` is not reused after it is freed until `fence` reports completion.
    ///
    /// ```
    /// use allocator_api2::alloc::{Allocator, Layout};
    /// use cudalloc::{fence::Fence, pool::Pool, source::HostSource};
    /// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
    ///
    /// struct Flag(Arc<AtomicBool>);
    /// // SAFETY: the flag is set only once the simulated use is over.
    /// unsafe impl Fence for Flag {
    ///     fn is_complete(&self) -> cudalloc::Result<bool> { Ok(self.0.load(Ordering::Acquire)) }
    /// }
    /// let pool = Pool::new(HostSource);
    /// let layout = Layout::from_size_align(64, 8).unwrap();
    /// let p = pool.allocate(layout).unwrap();
    /// let done = Arc::new(AtomicBool::new(false));
    /// assert!(pool.record_fence(p.as_ptr() as *const u8, Flag(done.clone())).unwrap());
    /// unsafe { pool.deallocate(p.cast(), layout) };
    /// assert_eq!(pool.stats().pending_blocks, 1);
    /// done.store(true, Ordering::Release);
    /// assert_eq!(pool.collect_pending(), 1);
    /// assert_eq!(pool.stats().pending_blocks, 0);
    /// ```
    pub fn record_fence(&self, ptr: *const u8, fence: impl Fence) -> Result<bool> {
        match self
            .shared
            .record_fence(ptr as usize, Arc::new(Box::new(fence)))?
        {
            true => Ok(true),
            false if self.owns(ptr) => Err(Error::InvalidArgument("the pointer is in no block of this pool")),
            false => Ok(false),
        }
    }

    /// Whether `ptr` lies in memory this pool holds from its source.
    fn owns(&self, ptr: *const u8) -> bool {
        let addr = ptr as usize;
        self.shared.small.find_block(addr).is_some() || self.shared.large.find(addr).is_some() || {
            registry::holds(self.shared.uid, addr)
        }
    }

    /// Test switch: with `false`, blocks freed with unfinished recorded uses are reused
    /// at once (the bug the pending list prevents), so a test can show that it fails.
    #[cfg(feature = "test-hooks")]
    pub fn set_pending_list_enabled(&self, enabled: bool) {
        self.shared
            .pending_enabled
            .store(enabled, crate::sync::Ordering::Relaxed);
    }

    // ---- classification ---------------------------------------------------------------

    /// The class serving `size` (nonzero) at `align`, or `None` for a large block.
    #[inline(always)]
    fn classify(&self, size: usize, align: usize) -> Option<usize> {
        if size <= self.shared.settings.large_threshold && align <= QUANTUM {
            Some(class_of(size))
        } else {
            self.classify_aligned(size, align)
        }
    }

    #[inline]
    fn classify_aligned(&self, size: usize, align: usize) -> Option<usize> {
        if align > PAGE_SIZE || size > self.shared.settings.large_threshold {
            return None;
        }
        class_of_aligned(size, align).filter(|&c| c <= self.shared.settings.max_class)
    }

    // ---- thread cache access ----------------------------------------------------------

    /// Runs `f` on this thread's cache for this pool, if it has one.
    #[inline(always)]
    fn with_cache<R>(&self, f: impl FnOnce(&mut thread_cache::CacheCore) -> R) -> Option<R> {
        let slot = self.shared.slot?;
        thread_cache::tls::with_entry(slot, self.shared.uid, f)
    }

    /// Makes sure this thread has a cache for this pool (creating it, evicting a stale
    /// cache of a dropped pool from the slot); false if it cannot have one.
    fn ensure_cache(&self) -> bool {
        use thread_cache::tls;
        let Some(slot) = self.shared.slot else {
            return false;
        };
        if tls::has_entry(slot, self.shared.uid) {
            return true;
        }
        let entry = Box::new(tls::CacheEntry {
            uid: self.shared.uid,
            core: self.shared.new_cache(),
            owner: Box::new(OwnerRef(self.shared.clone())),
        });
        let displaced = tls::swap(slot, Some(entry));
        // Dropped with no borrow of the table live: flushing it may free its pool.
        drop(displaced);
        tls::has_entry(slot, self.shared.uid)
    }

    // ---- allocation -------------------------------------------------------------------

    /// Allocates a block for `layout`, saying why on failure (`Allocator::allocate` says
    /// only `AllocError`). The block may be larger than asked; its length says how large.
    ///
    /// ```
    /// use allocator_api2::alloc::Layout;
    /// use cudalloc::{pool::Pool, source::HostSource};
    /// let pool = Pool::new(HostSource);
    /// let block = pool.try_allocate(Layout::from_size_align(100, 8).unwrap()).unwrap();
    /// assert_eq!(block.len(), 112); // its size class
    /// assert!(pool.try_allocate(Layout::from_size_align(1 << 50, 8).unwrap()).is_err());
    /// # unsafe { allocator_api2::alloc::Allocator::deallocate(&pool, block.cast(), Layout::from_size_align(100, 8).unwrap()) };
    /// ```
    #[inline]
    pub fn try_allocate(&self, layout: Layout) -> Result<NonNull<[u8]>> {
        let size = layout.size();
        if size == 0 {
            return Ok(dangling_block(layout));
        }
        let block = match self.classify(size, layout.align()) {
            Some(class) => match self.try_alloc_fast(class) {
                Some(p) => NonNull::slice_from_raw_parts(p.as_non_null(), class_size(class)),
                None => self
                    .alloc_small_slow(class)
                    .inspect_err(|e| self.shared.trace.failure(layout, e))?,
            },
            None => match self.try_alloc_large_fast(layout) {
                Some(block) => block,
                None => self
                    .alloc_large(layout, false)
                    .inspect_err(|e| self.shared.trace.failure(layout, e))?,
            },
        };
        #[cfg(feature = "debug-checks")]
        self.shared.checks.on_alloc(block.cast::<u8>().as_ptr() as usize);
        // One branch for the recorder and an NVTX tool together (`observe`).
        if observe::wanted(observe::ALL) {
            self.observe_alloc(block, layout);
        }
        Ok(block)
    }

    /// An allocation seen by the recorder and by an NVTX tool (a live region of exactly
    /// the request, when the chunk is a heap), whichever is on.
    #[cold]
    #[inline(never)]
    fn observe_alloc(&self, block: NonNull<[u8]>, layout: Layout) {
        let ptr = block.cast::<u8>().as_ptr();
        self.shared.trace.alloc(ptr, layout, block.len());
        if nvtx::on() {
            nvtx::region_register(ptr as u64, layout.size());
        }
    }

    /// A free seen by an NVTX tool (freed, the block is no longer a live region, wherever
    /// it goes next) and by the recorder (`completed`: reusable at once), whichever is
    /// on; before the block goes anywhere another thread could take it.
    #[cold]
    #[inline(never)]
    fn observe_free(&self, ptr: NonNull<u8>, size: usize, completed: bool) {
        if nvtx::on() {
            nvtx::region_unregister(ptr.as_ptr() as u64);
        }
        self.shared.trace.free(ptr.as_ptr(), size, completed);
    }

    /// The hot path: a pop from this thread's bin.
    #[inline(always)]
    fn try_alloc_fast(&self, class: usize) -> Option<BlockPtr> {
        self.with_cache(|c| c.pop(class)).flatten()
    }

    /// The large-block hot path: a cached block from this thread's cache, if one fits.
    #[inline(always)]
    fn try_alloc_large_fast(&self, layout: Layout) -> Option<NonNull<[u8]>> {
        let need = align_up(layout.size(), PAGE_SIZE)?;
        let epoch = self.shared.large.epoch();
        let (p, size) = self
            .with_cache(|c| c.take_large(need, layout.align(), epoch))
            .flatten()?;
        Some(NonNull::slice_from_raw_parts(p.as_non_null(), size))
    }

    #[cold]
    #[inline(never)]
    fn alloc_small_slow(&self, class: usize) -> Result<NonNull<[u8]>> {
        crate::count::bookkeeping(|| {
            let sh = &*self.shared;
            sh.drain();
            let size = class_size(class);
            let mut batch = Batch::new();
            let cached = self.ensure_cache();
            let want = if cached {
                self.with_cache(|c| c.refill_count(class).min(c.room(class) + 1))
                    .unwrap_or(1)
                    .clamp(1, MAX_BATCH)
            } else {
                1
            };
            let _moving = match sh.take_small(class, want, &mut batch) {
                Ok(moving) => moving,
                Err(e) => return Err(self.failed(e)),
            };
            let Some(first) = batch.pop() else {
                return Err(self.failed(Error::OutOfMemory { requested: size }));
            };
            if !batch.is_empty() {
                self.with_cache(|c| {
                    if c.has_bin(class) {
                        let room = c.room(class);
                        c.fill(class, batch.drain_up_to(room));
                    }
                });
                if !batch.is_empty() {
                    sh.give_small(class, batch.drain());
                }
            }
            sh.acct.count_shared_alloc();
            Ok(NonNull::slice_from_raw_parts(first.as_non_null(), size))
        })
    }

    /// A large block from the shared extents or the source (after this thread's cache
    /// missed); `growing` when it replaces a smaller block being grown (it then goes where
    /// it has room to keep growing in place, and skips this thread's cache).
    #[cold]
    #[inline(never)]
    fn alloc_large(&self, layout: Layout, growing: bool) -> Result<NonNull<[u8]>> {
        crate::count::bookkeeping(|| {
            let sh = &*self.shared;
            let need = match align_up(layout.size(), PAGE_SIZE) {
                Some(n) if n <= isize::MAX as usize => n,
                _ => {
                    return Err(self.failed(Error::TooLarge {
                        requested: layout.size(),
                        limit: isize::MAX as usize,
                    }))
                }
            };
            if growing {
                // A growing block looks at every free extent: this thread's cached large
                // blocks go back to the shared extents first (where they merge with their
                // neighbours), as they would on a flush.
                let _moving = sh.transfers.begin();
                for (p, _) in self.with_cache(|c| c.take_large_blocks()).unwrap_or_default() {
                    sh.give_large(p.addr(), true);
                }
            }
            sh.drain();
            let t = sh
                .take_large(need, layout.align(), growing)
                .map_err(|e| self.failed(e))?;
            sh.acct.count_shared_alloc();
            if t.ptr.addr() == t.base && self.ensure_cache() {
                // The epoch the block was handed out in: if it moves before the free, the
                // entry is merely distrusted then.
                self.with_cache(|c| c.lend(t.base, t.usable, t.epoch));
            }
            Ok(NonNull::slice_from_raw_parts(t.ptr.as_non_null(), t.usable))
        })
    }

    #[cold]
    fn failed(&self, e: Error) -> Error {
        self.shared.acct.count_failure();
        e
    }

    // ---- free -------------------------------------------------------------------------

    /// # Safety
    /// 1. `ptr` was allocated by this pool for `layout` (any size between the request and
    ///    the returned length), and is not used after this call.
    #[inline]
    unsafe fn free(&self, ptr: NonNull<u8>, layout: Layout) {
        let size = layout.size();
        if size == 0 {
            return;
        }
        #[cfg(feature = "debug-checks")]
        self.shared
            .checks
            .on_free(ptr.as_ptr() as usize, || self.owns(ptr.as_ptr()));
        let p = BlockPtr::new(ptr);
        // Which blocks have recorded uses, with one load and no lock in the common case.
        // - A use recorded on this block is seen: its record happens-before this free (the
        //   caller orders the two, or makes both on one thread), and the mirror is written
        //   only under the tracker's lock, so every value in its modification order from
        //   that record until this block's free counts this block's entry; by write-read
        //   coherence this load reads one of them, hence nonzero.
        // - Acquire, because the mirror also drops when completed uses are forgotten:
        //   reading that store (Release, after the thread that forgot them saw the fences
        //   complete) makes this free, and so the block's next owner, happen after the
        //   completion was observed.
        // A stale nonzero value only sends a free down the slow path, which takes the lock.
        let uses = self.shared.uses.any_uses();
        // One branch for both observers; a block without uses is reusable at once: both
        // its events (requested, completed) in one recorder call.
        if observe::wanted(observe::ALL) {
            self.observe_free(ptr, size, !uses);
        }
        if uses {
            return self.free_with_uses(p, layout);
        }
        self.place_unused(p, layout);
    }

    /// Frees a block with no recorded uses whose free was recorded as requested only.
    #[inline(always)]
    fn free_unused(&self, p: BlockPtr, layout: Layout) {
        self.shared.trace.free_completed(p.addr(), layout.size());
        self.place_unused(p, layout);
    }

    /// Puts a block with no recorded uses back: to this thread's cache, else the shared
    /// state.
    #[inline(always)]
    fn place_unused(&self, p: BlockPtr, layout: Layout) {
        match self.classify(layout.size(), layout.align()) {
            Some(class) => {
                if !self.try_free_fast(class, p) {
                    self.free_small_slow(class, p);
                }
            }
            None => self.free_large(p),
        }
    }

    /// The hot path: a push to this thread's bin, if it has room.
    #[inline(always)]
    fn try_free_fast(&self, class: usize, p: BlockPtr) -> bool {
        self.with_cache(|c| c.push(class, p)).unwrap_or(false)
    }

    #[cold]
    #[inline(never)]
    fn free_with_uses(&self, p: BlockPtr, layout: Layout) {
        crate::count::bookkeeping(|| {
            let class = self.classify(layout.size(), layout.align());
            let kind = class.map_or(BlockKind::Large, BlockKind::Small);
            if !self.shared.defer_free(p, kind) {
                self.free_unused(p, layout);
            }
        })
    }

    #[cold]
    #[inline(never)]
    fn free_small_slow(&self, class: usize, p: BlockPtr) {
        crate::count::bookkeeping(|| {
            let sh = &*self.shared;
            // A thread that only frees (a consumer) gets a cache too: its frees then reach the
            // shared list in batches rather than one lock each.
            self.ensure_cache();
            let _moving = sh.transfers.begin();
            let cached = self.with_cache(|c| {
                // Bin full: half of it to the shared list. Still no room (the byte budget):
                // the whole cache.
                let half = c.take_half(class);
                sh.give_small(class, half);
                c.push(class, p) || {
                    sh.flush_cache(c);
                    c.push(class, p)
                }
            });
            if cached != Some(true) {
                sh.give_small(class, [p]);
            }
        })
    }

    /// The large-block free: to this thread's cache if it handed the block out and has
    /// room, else to the shared extents (the cold part).
    #[inline(always)]
    fn free_large(&self, p: BlockPtr) {
        let epoch = self.shared.large.epoch();
        if self.with_cache(|c| c.push_large(p, epoch)) != Some(true) {
            self.free_large_shared(p);
        }
    }

    #[cold]
    #[inline(never)]
    fn free_large_shared(&self, p: BlockPtr) {
        crate::count::bookkeeping(|| {
            self.shared.give_large(p.addr(), true);
        })
    }
}

impl<S: MemorySource + 'static> Drop for Pool<S> {
    fn drop(&mut self) {
        use thread_cache::tls;
        if let Some(slot) = self.shared.slot {
            if tls::has_entry(slot, self.shared.uid) {
                drop(tls::swap(slot, None));
            }
            tls::release_slot(slot);
        }
        drop(registry::remove_owner(self.shared.uid));
    }
}

// SAFETY: blocks are exclusive (a block is in exactly one place: a thread cache, a shared
// list, the pending list, or a user's hands), of at least the layout's size and aligned
// (size classes are multiples of the alignment and runs are page-aligned; large blocks
// are over-allocated when needed), host-visible (S: HostVisible), and freed with any size
// between the request and the returned length (the class of such a size is the same).
unsafe impl<S: HostVisible + 'static> Allocator for Pool<S> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.try_allocate(layout).map_err(|e| {
            log::debug!("cudalloc: pool allocation of {layout:?} failed: {e}");
            AllocError
        })
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller's obligations are `free`'s.
        unsafe { self.free(ptr, layout) }
    }

    unsafe fn grow(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the caller's obligations (ptr allocated for `old`, new.size() >= old.size()).
        unsafe { self.resize(ptr, old, new) }
    }

    unsafe fn grow_zeroed(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: as in `grow`; the grown block holds block.len() >= new.size() >= old.size()
        // bytes. The contract zeroes every byte past the old size up to the returned length
        // (a block reused in place or from the cache holds an earlier owner's bytes there).
        unsafe { zero_grown(self.resize(ptr, old, new), old.size()) }
    }

    unsafe fn shrink(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the caller's obligations (ptr allocated for `old`, new.size() <= old.size()).
        unsafe { self.resize(ptr, old, new) }
    }
}

/// Zeroes `block` from byte `from` to its end.
///
/// # Safety
/// 1. `block` is writable for its whole length and `from <= block.len()`.
pub(crate) unsafe fn zero_tail(block: NonNull<[u8]>, from: usize) {
    debug_assert!(from <= block.len());
    // SAFETY: obligation 1.
    unsafe {
        block
            .cast::<u8>()
            .as_ptr()
            .add(from)
            .write_bytes(0, block.len() - from)
    };
}

/// What `grow_zeroed` adds to `grow`: zeroes the grown block from byte `old` to its end
/// and passes it on (or passes the failure on).
///
/// # Safety
/// 1. A grown block is writable for its whole length and holds at least `old` bytes.
#[inline]
pub(crate) unsafe fn zero_grown(
    grown: Result<NonNull<[u8]>, AllocError>,
    old: usize,
) -> Result<NonNull<[u8]>, AllocError> {
    let block = grown?;
    // SAFETY: obligation 1.
    unsafe { zero_tail(block, old) };
    Ok(block)
}

/// The move of a grow or shrink by copying: copies the first min(old, new) bytes of
/// `ptr`'s block into `block`, then frees the old block through `a`.
///
/// # Safety
/// 1. `ptr` was allocated by `a` for `old` and is not used after this call.
/// 2. `block` is live, distinct from `ptr`'s block and holds at least `new.size()` bytes.
#[inline]
pub(crate) unsafe fn move_block<A: Allocator>(
    a: &A,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
    block: NonNull<[u8]>,
) {
    // SAFETY: both blocks hold at least min(old, new) bytes and are distinct (obligation
    // 2); obligation 1 lets us free the old block.
    unsafe {
        core::ptr::copy_nonoverlapping(
            ptr.as_ptr(),
            block.cast::<u8>().as_ptr(),
            old.size().min(new.size()),
        );
        a.deallocate(ptr, old);
    }
}

impl<S: HostVisible + 'static> Pool<S> {
    /// Grow or shrink: in place when both layouts map to the same size class, or when a
    /// large block grows into the free extent after it; else allocate, copy and free
    /// (a large block grown by copying goes where it has room to grow in place next
    /// time).
    ///
    /// # Safety
    /// 1. `ptr` was allocated by this pool for `old` and is not used after this call
    ///    except through the returned block.
    unsafe fn resize(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let mut growing = false;
        if old.size() != 0 && new.size() != 0 {
            let from = self.classify(old.size(), old.align());
            let to = self.classify(new.size(), new.align());
            match (from, to) {
                (Some(a), Some(b)) if a == b => {
                    self.shared
                        .trace
                        .resized((ptr.as_ptr(), old), (ptr.as_ptr(), new, class_size(a)));
                    resized_region(ptr, new.size());
                    return Ok(NonNull::slice_from_raw_parts(ptr, class_size(a)));
                }
                (None, None) if new.size() > old.size() && ptr.as_ptr() as usize % new.align() == 0 => {
                    let need = align_up(new.size(), PAGE_SIZE).ok_or(AllocError)?;
                    if let Some(usable) = self.shared.grow_large_in_place(ptr.as_ptr() as usize, need) {
                        self.shared
                            .trace
                            .resized((ptr.as_ptr(), old), (ptr.as_ptr(), new, usable));
                        resized_region(ptr, new.size());
                        return Ok(NonNull::slice_from_raw_parts(ptr, usable));
                    }
                    growing = true;
                }
                (_, None) => growing = new.size() > old.size(),
                _ => {}
            }
        }
        let block = if growing {
            let block = self.alloc_large(new, true).map_err(|e| {
                self.shared.trace.failure(new, &e);
                log::debug!("cudalloc: pool allocation of {new:?} failed: {e}");
                AllocError
            })?;
            #[cfg(feature = "debug-checks")]
            self.shared.checks.on_alloc(block.cast::<u8>().as_ptr() as usize);
            self.observe_alloc(block, new);
            block
        } else {
            self.allocate(new)?
        };
        // SAFETY: obligation 1; the new block is fresh, so distinct, and holds new.size()
        // bytes.
        unsafe { move_block(self, ptr, old, new, block) };
        Ok(block)
    }
}

/// A block resized in place is a live region of its new length (NVTX).
#[inline(always)]
fn resized_region(ptr: NonNull<u8>, bytes: usize) {
    if nvtx::on() {
        nvtx::region_unregister(ptr.as_ptr() as u64);
        nvtx::region_register(ptr.as_ptr() as u64, bytes);
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
