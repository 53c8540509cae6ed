//! Bump arenas over any host-visible memory source: per-batch staging that costs a
//! pointer decrement per allocation and one [`Arena::reset`] per batch. Chunks come from
//! a [`MemorySource`](crate::source::MemorySource) (pinned memory for fast copies,
//! pageable memory for tests); memory that a GPU copy may still read is not reused or
//! freed until the uses recorded on it (by the crate's copy helpers, or
//! [`Arena::record_use`] / [`crate::record_use`] after other GPU work) have completed.
//!
//! An arena is a CUDA-free bump core (`bump.rs`) plus the set of recorded GPU uses of its
//! memory (the crate's [`fence`](crate::fence) module), shared with the range registry
//! so that `crate::record_use` finds the arena of any pointer into it.
//!
//! `&Arena<S>` implements allocator-api2 0.2's `Allocator`, the trait `&bumpalo::Bump`
//! implements, so `Vec<T, &A>`, `Box<T, &A>` and `hashbrown::HashMap` take either:
//!
//! ```
//! use allocator_api2::{boxed::Box, vec::Vec};
//! use cudalloc::{arena::Arena, source::HostSource};
//!
//! let mut arena = Arena::new(HostSource);
//! for batch in 0..3u32 {
//!     let mut v: Vec<u32, &Arena> = Vec::new_in(&arena);
//!     v.extend(0..1000);
//!     let total = Box::new_in(v.iter().sum::<u32>(), &arena);
//!     assert_eq!(*total, 499_500);
//!     drop((v, total));
//!     arena.reset(); // every block at once; the largest chunk is kept for the next batch
//!     assert_eq!(arena.chunk_count(), 1, "batch {batch}");
//! }
//! ```
//!
//! Design, after bumpalo: blocks are bumped *downward* from the top of the current chunk
//! (one subtraction, one mask, one comparison); a request that does not fit takes the
//! cold path, which starts a new chunk twice the size of the previous regular one. Only
//! the most recent block can be freed or grown in place; everything else is reclaimed by
//! [`Arena::reset`] or [`Arena::rewind`], which take `&mut self`, so the borrow checker
//! proves that no collection still lives in the memory they hand out again.

mod bump;

use core::cell::{Cell, RefCell};
use core::fmt;
use core::ptr::{self, NonNull};
use std::time::{Duration, Instant};

use allocator_api2::alloc::{AllocError, Allocator, Layout};

use bump::{Bump, Hooks};

use crate::cuda::{nvtx, MemoryType};
use crate::cuda::{PooledEvent, Stream};
use crate::error::Result;
use crate::fence::{registry, SharedFence, UseSet};
use crate::source::{HostSource, HostVisible, PinnedSource};
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, Mutex, Ordering};
use crate::util::dangling;

/// How an [`Arena`] sizes its chunks and how much it may hold.
///
/// ```
/// use cudalloc::arena::ArenaConfig;
/// let cfg = ArenaConfig::pinned().with_max_chunk(64 << 20).with_limit(1 << 30);
/// assert_eq!(cfg.first_chunk, 2 << 20);
/// assert_eq!(cfg.limit, Some(1 << 30));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ArenaConfig {
    /// Size of the first chunk in bytes. Every new chunk doubles the size of the next
    /// regular one; chunk sizes are rounded up to whole pages (4 KiB).
    pub first_chunk: usize,
    /// Where geometric growth stops (`None`: it never stops). A request larger than this
    /// still gets a chunk of its own size.
    pub max_chunk: Option<usize>,
    /// Most bytes the arena may hold from its source, all chunks together (`None`: no
    /// limit). A request that would pass it fails with `AllocError`, and the arena stays
    /// usable.
    pub limit: Option<usize>,
    /// How long a dropped arena waits for the recorded GPU uses of its memory before it
    /// gives the memory up instead of freeing it under the GPU (leaked on purpose, logged,
    /// counted in [`ArenaStats::abandoned_bytes`] and
    /// [`cuda::drop_errors`](crate::cuda::drop_errors)); a [`Fence`](crate::fence::Fence)
    /// that never completes must not hang a drop. Default 10 s. A reset waits without a
    /// bound: it is a wait the caller asked for.
    pub drop_wait: Duration,
    /// Whether the arena describes its memory to an attached NVTX tool (compute-sanitizer:
    /// chunks the GPU reaches are heaps, blocks live regions until freed, reset or
    /// rewound; see [`cuda::nvtx`](crate::cuda::nvtx)). Default `true`; nothing happens
    /// without a tool.
    pub nvtx: bool,
}

impl ArenaConfig {
    /// First chunk for pageable host memory: 64 KiB.
    pub const HOST_FIRST_CHUNK: usize = 64 << 10;
    /// First chunk for pinned, registered and managed memory: 2 MiB. A pinning call
    /// costs about 0.7 ms whatever its size, so small chunks would waste it.
    pub const PINNED_FIRST_CHUNK: usize = 2 << 20;
    /// The default [`drop_wait`](ArenaConfig::drop_wait): 10 s, as a pool's drop.
    pub const DROP_WAIT: Duration = Duration::from_secs(10);

    /// Defaults for pageable host memory: 64 KiB first chunk, unbounded growth, no limit.
    ///
    /// ```
    /// assert_eq!(cudalloc::arena::ArenaConfig::host().first_chunk, 64 << 10);
    /// ```
    pub const fn host() -> Self {
        Self {
            first_chunk: Self::HOST_FIRST_CHUNK,
            max_chunk: None,
            limit: None,
            drop_wait: Self::DROP_WAIT,
            nvtx: true,
        }
    }

    /// Defaults for pinned (and other CUDA) memory: 2 MiB first chunk, unbounded growth,
    /// no limit.
    ///
    /// ```
    /// assert_eq!(cudalloc::arena::ArenaConfig::pinned().first_chunk, 2 << 20);
    /// ```
    pub const fn pinned() -> Self {
        Self {
            first_chunk: Self::PINNED_FIRST_CHUNK,
            ..Self::host()
        }
    }

    /// The defaults for a kind of memory: [`ArenaConfig::host`] for pageable memory,
    /// [`ArenaConfig::pinned`] for memory whose every allocation is a driver call.
    ///
    /// ```
    /// use cudalloc::{arena::ArenaConfig, cuda::MemoryType};
    /// assert_eq!(ArenaConfig::for_kind(MemoryType::Registered), ArenaConfig::pinned());
    /// ```
    pub const fn for_kind(kind: MemoryType) -> Self {
        match kind {
            MemoryType::Pageable => Self::host(),
            MemoryType::PinnedHost | MemoryType::Registered | MemoryType::Managed | MemoryType::Device => {
                Self::pinned()
            }
        }
    }

    /// This configuration with the first chunk `bytes` large.
    ///
    /// ```
    /// let cfg = cudalloc::arena::ArenaConfig::host().with_first_chunk(1 << 20);
    /// assert_eq!(cfg.first_chunk, 1 << 20);
    /// ```
    pub const fn with_first_chunk(self, bytes: usize) -> Self {
        Self {
            first_chunk: bytes,
            ..self
        }
    }

    /// This configuration with geometric growth stopping at `bytes`.
    ///
    /// ```
    /// let cfg = cudalloc::arena::ArenaConfig::host().with_max_chunk(1 << 20);
    /// assert_eq!(cfg.max_chunk, Some(1 << 20));
    /// ```
    pub const fn with_max_chunk(self, bytes: usize) -> Self {
        Self {
            max_chunk: Some(bytes),
            ..self
        }
    }

    /// This configuration holding at most `bytes` from the source.
    ///
    /// ```
    /// let cfg = cudalloc::arena::ArenaConfig::host().with_limit(1 << 20);
    /// assert_eq!(cfg.limit, Some(1 << 20));
    /// ```
    pub const fn with_limit(self, bytes: usize) -> Self {
        Self {
            limit: Some(bytes),
            ..self
        }
    }

    /// This configuration with its NVTX annotations on or off ([`nvtx`](ArenaConfig::nvtx)).
    ///
    /// ```
    /// use cudalloc::arena::ArenaConfig;
    /// assert!(ArenaConfig::pinned().nvtx);
    /// assert!(!ArenaConfig::pinned().with_nvtx(false).nvtx);
    /// ```
    pub const fn with_nvtx(self, nvtx: bool) -> Self {
        Self { nvtx, ..self }
    }

    /// This configuration with a dropped arena waiting at most `wait` for its memory's
    /// GPU uses ([`drop_wait`](ArenaConfig::drop_wait)).
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = cudalloc::arena::ArenaConfig::pinned().with_drop_wait(Duration::from_secs(1));
    /// assert_eq!(cfg.drop_wait, Duration::from_secs(1));
    /// ```
    pub const fn with_drop_wait(self, wait: Duration) -> Self {
        Self {
            drop_wait: wait,
            ..self
        }
    }
}

impl Default for ArenaConfig {
    fn default() -> Self {
        Self::host()
    }
}

/// A position in an arena, from [`Arena::checkpoint`]; [`Arena::rewind`] frees every
/// block allocated after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Checkpoint {
    /// Chunks in use when it was taken.
    in_use: usize,
    /// Base address of the current chunk then (0 when there was none).
    base: usize,
    /// The bump pointer's address then.
    ptr: usize,
    /// The arena's process-unique id.
    arena: u64,
    /// The arena's reset epoch then.
    epoch: u64,
    /// How many NVTX regions the arena had recorded then (`Arena::regions`).
    regions: usize,
}

/// What an arena holds and hands out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ArenaStats {
    /// Bytes held from the source, in all chunks (used, unused and spare).
    pub held_bytes: usize,
    /// Bytes handed out since the last reset, alignment padding and the abandoned tails
    /// of earlier chunks included: the bytes a reset would reclaim.
    pub used_bytes: usize,
    /// Chunks held.
    pub chunks: usize,
    /// GPU uses recorded on the arena's memory and not yet waited for.
    pub pending_uses: usize,
    /// Waits for recorded GPU uses that failed. Nonzero means the GPU reported an error
    /// and memory was abandoned rather than reused.
    pub gpu_wait_errors: u64,
    /// Bytes given up on (never reused, never freed) because a wait for the GPU failed.
    pub abandoned_bytes: usize,
}

/// The GPU uses recorded on an arena's memory, shared with the range registry (which may
/// record into it from any thread: a copy helper given a slice of the arena).
#[derive(Default)]
struct Uses {
    set: Mutex<UseSet>,
    /// Set when a use is recorded; the arena's thread turns it into protection of the
    /// blocks that exist then (`Bump::protect`) before it next frees or grows a block.
    recorded: AtomicBool,
    wait_errors: AtomicU64,
    /// The arena's place in allocation traces.
    trace: crate::trace::Tag,
}

impl Uses {
    fn record(&self, fence: SharedFence) {
        let superseded = lock(&self.set).record(fence);
        self.recorded.store(true, Ordering::Release);
        drop(superseded); // outside the lock
    }

    fn len(&self) -> usize {
        lock(&self.set).len()
    }
}

/// The arena's registry entry: records a use of any pointer into its chunks.
#[cfg_attr(loom, allow(dead_code))]
struct UsesRef(Arc<Uses>);

impl registry::UseRecorder for UsesRef {
    fn record(&self, _addr: usize, fence: SharedFence) -> Result<bool> {
        self.0.record(fence);
        Ok(true)
    }
}

/// What the bump core needs around chunk memory: waits for the recorded uses, chunk
/// ranges in the registry.
struct ArenaHooks<'a> {
    uses: &'a Uses,
    id: u64,
    /// The test switch: reuse without waiting.
    skip_wait: bool,
    /// When a wait gives up (`None`: never; the drop's bound).
    deadline: Option<Instant>,
}

impl<'a> ArenaHooks<'a> {
    fn new(uses: &'a Uses, id: u64, skip_wait: bool) -> Self {
        Self {
            uses,
            id,
            skip_wait,
            deadline: None,
        }
    }

    /// Waits that give up after `wait` from now.
    fn bounded(self, wait: Duration) -> Self {
        Self {
            deadline: Instant::now().checked_add(wait),
            ..self
        }
    }
}

impl Hooks for ArenaHooks<'_> {
    fn wait(&self, freeing: bool) -> bool {
        if self.skip_wait && !freeing {
            // The test switch pretends the wait happened: memory is reused at once, and
            // (as after a real wait) blocks are no longer protected.
            self.uses.recorded.store(false, Ordering::Relaxed);
            return true;
        }
        // Taken out of the lock to wait: driver calls. Fences that fail stay.
        let mut set = core::mem::take(&mut *lock(&self.uses.set));
        if set.is_empty() {
            return true;
        }
        // The memory is about to be reused or freed: every use of it was queued before
        // this point, so fences fixed only at the free are sealed now (the contract of
        // `Fence::seal`).
        set.seal();
        let ok = set.wait(self.deadline);
        if !ok {
            self.uses.wait_errors.fetch_add(1, Ordering::Relaxed);
            lock(&self.uses.set).absorb_back(set);
            return false;
        }
        self.uses.recorded.store(false, Ordering::Relaxed);
        true
    }
    fn added(&self, base: usize, size: usize) -> bool {
        if !registry::insert_range(base, size, self.id) {
            return false;
        }
        self.uses
            .trace
            .segment(crate::trace::Code::SegmentAlloc, base, size);
        true
    }
    fn removed(&self, base: usize, size: usize) {
        registry::remove_range(base, self.id);
        self.uses
            .trace
            .segment(crate::trace::Code::SegmentFree, base, size);
    }
    fn forget_uses(&self) {
        let forgotten = core::mem::take(&mut *lock(&self.uses.set));
        self.uses.recorded.store(false, Ordering::Relaxed);
        drop(forgotten); // outside the lock
    }
}

/// A bump arena: allocation is a pointer decrement; blocks are freed all at once by
/// [`reset`](Arena::reset), or back to a [`checkpoint`](Arena::checkpoint) by
/// [`rewind`](Arena::rewind). Chunks come from the source `S`; `&Arena<S>` is an
/// [`Allocator`].
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{arena::{Arena, ArenaConfig}, source::HostSource};
///
/// let mut arena = Arena::with_config(HostSource, ArenaConfig::host().with_limit(1 << 20));
/// {
///     let mut v = Vec::new_in(&arena);
///     v.extend_from_slice(&[1.0f32; 1000]);
///     assert!(v.try_reserve(4 << 20).is_err()); // past the limit: AllocError
///     v.push(2.0);                              // and still usable
///     assert_eq!(v.len(), 1001);
/// }
/// arena.reset();
/// assert!(arena.allocated_bytes() <= 1 << 20);
/// ```
///
/// An arena is `Send` but not `Sync`: it can move to another thread, but two threads
/// cannot allocate from it at once.
///
/// ```
/// let arena = cudalloc::arena::Arena::new(cudalloc::source::HostSource);
/// std::thread::spawn(move || {
///     let v = allocator_api2::vec::Vec::<u8, _>::with_capacity_in(10, &arena);
///     assert!(v.capacity() >= 10);
/// })
/// .join()
/// .unwrap();
/// ```
///
/// ```compile_fail
/// fn shared<T: Sync>(_: &T) {}
/// shared(&cudalloc::arena::Arena::new(cudalloc::source::HostSource));
/// ```
pub struct Arena<S: HostVisible = HostSource> {
    bump: Bump<S>,
    /// The addresses of the blocks registered as NVTX regions, oldest first (only with a
    /// tool attached and chunks that are heaps): unregistered at a reset, a rewind past
    /// them and the drop. A freed block's record may stay (see `unannotate`).
    regions: RefCell<Vec<usize>>,
    /// The most records a checkpoint taken since the last reset counts: a free never pops
    /// a record below it, so that a rewind to any such checkpoint finds every block
    /// allocated after it. May exceed `regions.len()` after a rewind.
    regions_floor: Cell<usize>,
    uses: Arc<Uses>,
    /// The arena's id in the range registry.
    id: u64,
    /// Test switch: reset and rewind skip waiting for recorded uses (freeing never does).
    #[cfg(feature = "test-hooks")]
    skip_wait: bool,
}

// SAFETY: the bump core's raw pointers (the bump pointer and the chunk bases) point into
// chunks the arena owns exclusively; its `Cell`s and `RefCell`s are reached only through
// the arena. Moving it to another thread moves that ownership, and nothing about a chunk
// is tied to the thread that allocated it (sources are `Send + Sync`; the recorded uses
// are behind a mutex). Blocks handed out borrow the arena (`&Arena`), so none can be in
// use while it moves. It stays `!Sync`: the cells make concurrent allocation a data race.
unsafe impl<S: HostVisible> Send for Arena<S> {}

/// [`Bump::grow_in_place`] or [`Bump::shrink_in_place`], for `Arena::resize`.
type InPlace<S> = unsafe fn(&Bump<S>, NonNull<u8>, Layout, Layout) -> Option<NonNull<u8>>;

impl Arena<HostSource> {
    /// An arena over pageable host memory with the default configuration.
    ///
    /// ```
    /// let arena = cudalloc::arena::Arena::host();
    /// let b = allocator_api2::boxed::Box::new_in(7u64, &arena);
    /// assert_eq!(*b, 7);
    /// ```
    pub fn host() -> Self {
        Self::new(HostSource)
    }
}

impl Default for Arena<HostSource> {
    fn default() -> Self {
        Self::host()
    }
}

impl Arena<PinnedSource> {
    /// An arena over pinned memory with default flags and a 2 MiB first chunk: staging
    /// buffers that copy to the GPU at full PCIe speed. Without a driver it falls back to
    /// pageable memory, as [`PinnedAlloc`](crate::PinnedAlloc) does (logged once, counted
    /// by [`fallback_allocations`](crate::fallback_allocations));
    /// [`Arena::pinned_strict`] fails instead.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// let arena = cudalloc::arena::Arena::pinned();
    /// let mut staging: Vec<f32, _> = Vec::new_in(&arena);
    /// staging.extend_from_slice(&[1.0, 2.0]); // pinned, or pageable without a GPU
    /// assert_eq!(staging.len(), 2);
    /// ```
    pub fn pinned() -> Self {
        Self::with_config(PinnedSource::with_fallback(), ArenaConfig::pinned())
    }

    /// An arena over pinned memory that fails (`AllocError`) without a driver.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// let arena = cudalloc::arena::Arena::pinned_strict();
    /// let mut staging: Vec<f32, _> = Vec::new_in(&arena);
    /// assert_eq!(staging.try_reserve(1024).is_ok(), cudalloc::cuda::driver_available());
    /// ```
    pub fn pinned_strict() -> Self {
        Self::with_config(PinnedSource::default(), ArenaConfig::pinned())
    }
}

impl<S: HostVisible> Arena<S> {
    /// An arena over `source`, configured for its kind of memory
    /// ([`ArenaConfig::for_kind`]). No memory is taken until the first allocation.
    ///
    /// ```
    /// use cudalloc::{arena::Arena, source::HostSource};
    /// let arena = Arena::new(HostSource);
    /// assert_eq!(arena.allocated_bytes(), 0);
    /// ```
    pub fn new(source: S) -> Self {
        let config = ArenaConfig::for_kind(source.kind());
        Self::with_config(source, config)
    }

    /// An arena over `source` with `config`. No memory is taken until the first
    /// allocation.
    ///
    /// ```
    /// use cudalloc::{arena::{Arena, ArenaConfig}, source::HostSource};
    /// let arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(1 << 20));
    /// let b = allocator_api2::boxed::Box::new_in(1u8, &arena);
    /// assert_eq!(arena.allocated_bytes(), 1 << 20);
    /// # drop(b);
    /// ```
    pub fn with_config(source: S, config: ArenaConfig) -> Self {
        let uses = Arc::new(Uses {
            trace: crate::trace::Tag::new(crate::trace::arena_name::<S>),
            ..Uses::default()
        });
        let id = registry::new_owner_id();
        registry::add_owner(id, UsesRef(uses.clone()));
        Self {
            bump: Bump::new(source, config),
            regions: RefCell::new(Vec::new()),
            regions_floor: Cell::new(0),
            uses,
            id,
            #[cfg(feature = "test-hooks")]
            skip_wait: false,
        }
    }

    /// The source chunks come from.
    pub fn source(&self) -> &S {
        &self.bump.source
    }

    /// The configuration.
    pub fn config(&self) -> &ArenaConfig {
        &self.bump.config
    }

    fn hooks(&self) -> ArenaHooks<'_> {
        ArenaHooks::new(&self.uses, self.id, false)
    }

    /// Whether reuse skips the wait (the test switch).
    fn skips_wait(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        return self.skip_wait;
        #[cfg(not(feature = "test-hooks"))]
        false
    }

    // ----- allocation -----

    /// Allocates a block for `layout` and returns its address, or says why it could not.
    /// Zero-size requests get a dangling, aligned pointer and never reach the source.
    ///
    /// ```
    /// use core::alloc::Layout;
    /// let arena = cudalloc::arena::Arena::host();
    /// let p = arena.try_alloc_layout(Layout::from_size_align(100, 64).unwrap()).unwrap();
    /// assert_eq!(p.as_ptr() as usize % 64, 0);
    /// assert!(arena.try_alloc_layout(Layout::from_size_align(1 << 50, 8).unwrap()).is_err());
    /// ```
    #[inline]
    pub fn try_alloc_layout(&self, layout: Layout) -> Result<NonNull<u8>> {
        if layout.size() == 0 {
            return Ok(dangling(layout.align()));
        }
        let p = match self.bump.try_alloc_fast(layout.size(), layout.align()) {
            Some(p) => p,
            None => self
                .bump
                .alloc_slow(layout.size(), layout.align(), &self.hooks())
                .inspect_err(|e| self.uses.trace.failure(layout, e))?,
        };
        self.uses.trace.alloc(p.as_ptr(), layout, layout.size());
        if nvtx::on() {
            self.annotate(p, layout.size());
        }
        Ok(p)
    }

    #[inline(always)]
    fn alloc_block(&self, size: usize, align: usize) -> Result<NonNull<u8>, AllocError> {
        if size == 0 {
            return Ok(dangling(align));
        }
        let p = match self.bump.try_alloc_fast(size, align) {
            Some(p) => p,
            None => self.alloc_slow_logged(size, align).ok_or(AllocError)?,
        };
        if nvtx::on() {
            self.annotate(p, size);
        }
        Ok(p)
    }

    // ----- NVTX regions (`cuda::nvtx`) -----

    /// The block at `p` (`size` bytes, nonzero) is a live region, if some chunk is an NVTX
    /// heap (pinned or managed memory with a tool attached), and recorded for the next
    /// reset or rewind.
    #[cold]
    #[inline(never)]
    fn annotate(&self, p: NonNull<u8>, size: usize) {
        if self.bump.has_heaps() {
            nvtx::region_register(p.as_ptr() as u64, size);
            self.regions.borrow_mut().push(p.as_ptr() as usize);
        }
    }

    /// The block at `p` is freed (or moved by a resize): no longer a live region. Its
    /// record is dropped when it is the newest one past every checkpoint taken (the usual
    /// case: the newest block freed or resized), else left for the next reset or rewind,
    /// whose unregistration of a region no longer live does nothing.
    #[cold]
    #[inline(never)]
    fn unannotate(&self, p: NonNull<u8>) {
        if !self.bump.has_heaps() {
            return;
        }
        let addr = p.as_ptr() as usize;
        nvtx::region_unregister(addr as u64);
        let mut regions = self.regions.borrow_mut();
        if regions.last() == Some(&addr) && regions.len() > self.regions_floor.get() {
            regions.pop();
        }
    }

    /// A block resized in place (`old` moved to `new`, either may be empty): a live
    /// region of its new length.
    #[cold]
    #[inline(never)]
    fn reannotate(&self, old: (NonNull<u8>, usize), new: (NonNull<u8>, usize)) {
        if old.1 != 0 {
            self.unannotate(old.0);
        }
        if new.1 != 0 {
            self.annotate(new.0, new.1);
        }
    }

    /// The blocks recorded from the `from`-th on are no longer live regions (a reset, a
    /// rewind to a checkpoint taken with `from` recorded, the drop). A block allocated
    /// after another at the same address (the first freed) comes later in the record, so
    /// the earlier record is unregistered only together with the later one.
    fn unannotate_from(&self, from: usize) {
        let mut regions = self.regions.borrow_mut();
        let from = from.min(regions.len());
        for addr in regions.drain(from..) {
            nvtx::region_unregister(addr as u64);
        }
    }

    /// The cold path for `Allocator` callers, which learn nothing but failure: the reason
    /// goes to the log. Returns an `Option` so that the hot loop keeps it in registers.
    #[cold]
    #[inline(never)]
    fn alloc_slow_logged(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        match self.bump.alloc_slow(size, align, &self.hooks()) {
            Ok(p) => Some(p),
            Err(e) => {
                log::debug!("cudalloc: arena allocation of {size} bytes (align {align}) failed: {e}");
                None
            }
        }
    }

    /// Before freeing or growing a block in place: if a use was recorded since the last
    /// look, the blocks that exist now are protected from reclaiming.
    #[inline(always)]
    fn protect_if_used(&self) {
        if self.uses.recorded.load(Ordering::Acquire) {
            self.bump.protect();
        }
    }

    /// `grow` and `shrink`: the block at `ptr` (allocated with `old`) resized in place by
    /// `in_place` where it manages, else moved to a new block with its first
    /// `min(old, new)` bytes.
    ///
    /// # Safety
    /// 1. `ptr` is a live block of this arena allocated with `old`, and the pair meets
    ///    `in_place`'s contract (`Bump::grow_in_place`: `new.size() >= old.size()`;
    ///    `Bump::shrink_in_place`: `new.size() <= old.size()`).
    #[inline(always)]
    unsafe fn resize(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
        in_place: InPlace<S>,
    ) -> Result<NonNull<[u8]>, AllocError> {
        self.protect_if_used();
        // SAFETY: obligation 1.
        let p = if let Some(p) = unsafe { in_place(&self.bump, ptr, old, new) } {
            if nvtx::on() {
                self.reannotate((ptr, old.size()), (p, new.size()));
            }
            p
        } else {
            let p = self
                .alloc_block(new.size(), new.align())
                .inspect_err(|e| self.uses.trace.failure(new, e))?;
            // SAFETY: the old block holds old.size() bytes (obligation 1) and the new one
            // at least new.size(); it is fresh, so the two do not overlap.
            unsafe { ptr::copy_nonoverlapping(ptr.as_ptr(), p.as_ptr(), old.size().min(new.size())) };
            // The new block is a region already (`alloc_block`); the old one is no longer.
            if nvtx::on() && old.size() != 0 {
                self.unannotate(ptr);
            }
            p
        };
        self.uses
            .trace
            .resized((ptr.as_ptr(), old), (p.as_ptr(), new, new.size()));
        Ok(NonNull::slice_from_raw_parts(p, new.size()))
    }

    // ----- reuse -----

    /// Frees every block at once. The largest chunk is kept (and becomes current); the
    /// others go back to the source. Waits first for the GPU uses recorded on the
    /// arena's memory.
    ///
    /// ```
    /// use allocator_api2::{boxed::Box, vec::Vec};
    /// let mut arena = cudalloc::arena::Arena::host();
    /// let b = Box::new_in(1u8, &arena); // first chunk: 64 KiB
    /// let v: Vec<u8, _> = Vec::with_capacity_in(1 << 20, &arena); // a chunk of its own
    /// assert_eq!(arena.chunk_count(), 2);
    /// drop((b, v));
    /// arena.reset();
    /// assert_eq!(arena.chunk_count(), 1);
    /// assert_eq!(arena.used_bytes(), 0);
    /// ```
    pub fn reset(&mut self) {
        let hooks = ArenaHooks::new(&self.uses, self.id, self.skips_wait());
        self.unannotate_from(0);
        self.regions_floor.set(0);
        self.bump.reset(&hooks);
    }

    /// The current position: [`rewind`](Arena::rewind) to it frees everything allocated
    /// after it, for nested scopes of temporary data.
    ///
    /// ```
    /// use allocator_api2::{boxed::Box, vec::Vec};
    /// let mut arena = cudalloc::arena::Arena::host();
    /// let keep = Box::into_raw(Box::new_in(42u64, &arena)); // outlives the scope below
    /// let mark = arena.checkpoint();
    /// let before = arena.used_bytes();
    /// let mut tmp: Vec<u64, _> = Vec::new_in(&arena);
    /// tmp.extend(0..100_000);
    /// assert_eq!(tmp.len(), 100_000);
    /// drop(tmp);
    /// arena.rewind(mark);
    /// assert_eq!(arena.used_bytes(), before);
    /// assert_eq!(unsafe { *keep }, 42); // allocated before the mark: untouched
    /// ```
    pub fn checkpoint(&self) -> Checkpoint {
        let regions = self.regions.borrow().len();
        self.regions_floor.set(self.regions_floor.get().max(regions));
        Checkpoint {
            arena: self.id,
            regions,
            ..self.bump.checkpoint()
        }
    }

    /// Frees every block allocated after `checkpoint` was taken. Chunks emptied by it are
    /// kept as spares for the next allocations (until [`reset`](Arena::reset) or drop).
    /// Waits first for the GPU uses recorded on the arena's memory. Taking `&mut self`
    /// proves that no collection still borrows the arena.
    ///
    /// A checkpoint below where the arena stands (every block after it freed already: the
    /// newest block reclaimed by its free, or an earlier rewind to an earlier checkpoint)
    /// frees nothing: the bump pointer only ever moves up. Frees that empty the
    /// checkpoint's chunk do not retire it: the chunk stays the arena's (empty, not
    /// recycled for later blocks) until a rewind to that checkpoint or an earlier one, or
    /// a reset.
    ///
    /// # Panics
    /// If `checkpoint` is not a position in this arena's current chunks: one of another
    /// arena (even an empty one), one taken before the last [`reset`](Arena::reset) (or
    /// before a failed GPU wait gave every chunk up), or one in a chunk that an earlier
    /// rewind emptied.
    ///
    /// ```should_panic
    /// use core::alloc::Layout;
    /// let mut arena = cudalloc::arena::Arena::host();
    /// let other = cudalloc::arena::Arena::host();
    /// other.try_alloc_layout(Layout::new::<u64>()).unwrap();
    /// arena.try_alloc_layout(Layout::new::<u64>()).unwrap();
    /// arena.rewind(other.checkpoint()); // another arena's position
    /// ```
    pub fn rewind(&mut self, checkpoint: Checkpoint) {
        assert!(
            checkpoint.arena == self.id && self.bump.reaches(&checkpoint),
            "Arena::rewind: {checkpoint:?} is not a position of this arena's current blocks"
        );
        let hooks = ArenaHooks::new(&self.uses, self.id, self.skips_wait());
        self.unannotate_from(checkpoint.regions);
        self.bump.rewind(checkpoint, &hooks);
    }

    /// Runs `f` with the arena and frees everything it allocated when it returns. What
    /// `f` returns cannot borrow the arena.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// let mut arena = cudalloc::arena::Arena::host();
    /// let sum = arena.scope(|a| {
    ///     let mut v: Vec<u32, _> = Vec::new_in(a);
    ///     v.extend(1..=100);
    ///     v.iter().sum::<u32>()
    /// });
    /// assert_eq!(sum, 5050);
    /// assert_eq!(arena.used_bytes(), 0);
    /// ```
    pub fn scope<R>(&mut self, f: impl FnOnce(&Self) -> R) -> R {
        let mark = self.checkpoint();
        let result = f(self);
        self.rewind(mark);
        result
    }

    // ----- the GPU -----

    /// Records that work queued on `stream` (a copy, a kernel) uses the arena memory at
    /// `ptr`: [`reset`](Arena::reset), [`rewind`](Arena::rewind) and drop wait for it
    /// before the memory is reused or freed, and until then blocks that exist now are not
    /// reclaimed by a free or an in-place grow. Returns whether `ptr` is in this arena's
    /// memory (`Ok(false)`, nothing recorded, otherwise), as [`crate::record_use`] does
    /// for every allocator of the crate, which also finds arenas.
    ///
    /// The crate's copy helpers record their uses themselves; call this after queuing
    /// other work on arena memory.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{arena::Arena, cuda::Stream};
    /// if let Ok(stream) = Stream::new(0) {
    ///     let mut arena = Arena::pinned();
    ///     {
    ///         let mut batch: Vec<u8, _> = Vec::new_in(&arena);
    ///         batch.resize(4096, 7);
    ///         // ... queue work reading `batch` on `stream` through another API, then:
    ///         assert!(arena.record_use(batch.as_ptr(), &stream).unwrap());
    ///     }
    ///     arena.reset(); // waits for that work
    /// }
    /// ```
    pub fn record_use(&self, ptr: *const u8, stream: &Stream) -> Result<bool> {
        if !self.bump.contains(ptr as usize) {
            return Ok(false);
        }
        let event = PooledEvent::record(stream)?;
        self.uses.record(Arc::new(Box::new(event)));
        Ok(true)
    }

    /// Test switch: with `true`, [`reset`](Arena::reset) and [`rewind`](Arena::rewind)
    /// reuse memory without waiting for recorded GPU uses, which shows the race the wait
    /// prevents. Chunks still go back to the source only after the wait.
    #[cfg(feature = "test-hooks")]
    pub fn set_skip_gpu_wait(&mut self, skip: bool) {
        self.skip_wait = skip;
    }

    // ----- statistics -----

    /// Bytes held from the source in all chunks (bumpalo's `allocated_bytes`).
    ///
    /// ```
    /// let arena = cudalloc::arena::Arena::host();
    /// let b = allocator_api2::boxed::Box::new_in(1u8, &arena);
    /// assert_eq!(arena.allocated_bytes(), 64 << 10);
    /// # drop(b);
    /// ```
    pub fn allocated_bytes(&self) -> usize {
        self.bump.held()
    }

    /// Bytes left in the current chunk (bumpalo's `chunk_capacity`).
    ///
    /// ```
    /// let arena = cudalloc::arena::Arena::host();
    /// assert_eq!(arena.chunk_capacity(), 0); // no chunk yet
    /// let b = allocator_api2::boxed::Box::new_in(1u8, &arena);
    /// assert_eq!(arena.chunk_capacity(), (64 << 10) - 1);
    /// # drop(b);
    /// ```
    pub fn chunk_capacity(&self) -> usize {
        self.bump.chunk_capacity()
    }

    /// Bytes handed out since the last reset, padding and abandoned chunk tails
    /// included.
    ///
    /// ```
    /// let arena = cudalloc::arena::Arena::host();
    /// let b = allocator_api2::boxed::Box::new_in([0u8; 100], &arena);
    /// assert_eq!(arena.used_bytes(), 100);
    /// # drop(b);
    /// ```
    pub fn used_bytes(&self) -> usize {
        self.bump.used_bytes()
    }

    /// Number of chunks held (in use and spare).
    pub fn chunk_count(&self) -> usize {
        self.bump.chunk_count()
    }

    /// All statistics at once.
    ///
    /// ```
    /// let arena = cudalloc::arena::Arena::host();
    /// let s = arena.stats();
    /// assert_eq!((s.held_bytes, s.chunks, s.pending_uses), (0, 0, 0));
    /// ```
    pub fn stats(&self) -> ArenaStats {
        ArenaStats {
            held_bytes: self.bump.held(),
            used_bytes: self.bump.used_bytes(),
            chunks: self.bump.chunk_count(),
            pending_uses: self.uses.len(),
            gpu_wait_errors: self.uses.wait_errors.load(Ordering::Relaxed),
            abandoned_bytes: self.bump.abandoned_bytes(),
        }
    }
}

impl<S: HostVisible> Drop for Arena<S> {
    fn drop(&mut self) {
        // Always waits, whatever the test switch says: this frees the memory. Not forever:
        // memory whose uses did not complete in time is given up, never freed under the GPU.
        let hooks = ArenaHooks::new(&self.uses, self.id, false).bounded(self.bump.config.drop_wait);
        self.unannotate_from(0);
        let abandoned = self.bump.abandoned_bytes();
        self.bump.release_all(&hooks);
        let given_up = self.bump.abandoned_bytes() - abandoned;
        if given_up > 0 {
            crate::cuda::record_drop_error(
                "dropping an arena",
                format!(
                    "recorded GPU uses did not complete within {:?}: {given_up} bytes are leaked on purpose (never freed under the GPU)",
                    self.bump.config.drop_wait
                ),
            );
        }
        drop(registry::remove_owner(self.id));
    }
}

impl<S: HostVisible + fmt::Debug> fmt::Debug for Arena<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("source", &self.bump.source)
            .field("config", &self.bump.config)
            .field("stats", &self.stats())
            .finish()
    }
}

// SAFETY: blocks are carved from chunks the arena owns, disjoint while live (the bump
// pointer only moves up past a block when that block is freed, or under `&mut self`),
// host-visible (S: HostVisible), aligned as asked, and valid until freed, reset,
// rewound (both need `&mut Arena`, so no `&Arena` copy is alive) or the arena is dropped.
// Copies of `&Arena` share the one arena, so any of them may free any block.
unsafe impl<S: HostVisible> Allocator for &Arena<S> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let p = self
            .alloc_block(layout.size(), layout.align())
            .inspect_err(|e| self.uses.trace.failure(layout, e))?;
        self.uses.trace.alloc(p.as_ptr(), layout, layout.size());
        Ok(NonNull::slice_from_raw_parts(p, layout.size()))
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        self.uses.trace.free(ptr.as_ptr(), layout.size(), true);
        if nvtx::on() && layout.size() != 0 {
            self.unannotate(ptr);
        }
        self.protect_if_used();
        // SAFETY: the trait's caller passes a live block of this arena.
        unsafe { self.bump.dealloc(ptr, layout.size()) }
    }

    #[inline]
    unsafe fn grow(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the trait's caller passes a live block allocated with `old`, and
        // `new.size() >= old.size()`: `grow_in_place`'s contract.
        unsafe { self.resize(ptr, old, new, Bump::grow_in_place) }
    }

    #[inline]
    unsafe fn grow_zeroed(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: as in `grow`; the grown block has new.size() >= old.size() bytes (its
        // length) and the tail past old.size() is ours to zero.
        unsafe { crate::pool::zero_grown(self.grow(ptr, old, new), old.size()) }
    }

    #[inline]
    unsafe fn shrink(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the trait's caller passes a live block allocated with `old`, and
        // `new.size() <= old.size()`: `shrink_in_place`'s contract.
        unsafe { self.resize(ptr, old, new, Bump::shrink_in_place) }
    }
}
