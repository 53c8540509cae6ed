//! Bump arenas over any host-visible memory source: per-batch staging that costs a
//! pointer decrement per allocation and one [`Arena::reset`] per batch. Chunks come from
//! a [`MemorySource`](crate::source::MemorySource) (pinned memory for fast copies,
//! pageable memory for tests); memory that a GPU copy may still read is not reused or
//! freed until the events recorded with [`Arena::record_use`] have completed.
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

use core::cell::{Cell, RefCell};
use core::fmt;
use core::ptr::{self, NonNull};

use allocator_api2::alloc::{AllocError, Allocator, Layout};

use crate::cuda::{PooledEvent, Stream};
use crate::error::{Error, Result};
use crate::source::{align_up, HostSource, HostVisible, MemoryKind, PinnedSource, PAGE_SIZE};

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
}

impl ArenaConfig {
    /// First chunk for pageable host memory: 64 KiB.
    pub const HOST_FIRST_CHUNK: usize = 64 << 10;
    /// First chunk for pinned, registered and managed memory: 2 MiB. A pinning call
    /// costs about 0.7 ms whatever its size, so small chunks would waste it.
    pub const PINNED_FIRST_CHUNK: usize = 2 << 20;

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
    /// use cudalloc::{arena::ArenaConfig, source::MemoryKind};
    /// assert_eq!(ArenaConfig::for_kind(MemoryKind::Registered), ArenaConfig::pinned());
    /// ```
    pub const fn for_kind(kind: MemoryKind) -> Self {
        match kind {
            MemoryKind::Pageable => Self::host(),
            MemoryKind::Pinned | MemoryKind::Registered | MemoryKind::Managed => Self::pinned(),
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
    /// GPU uses recorded ([`Arena::record_use`]) and not yet waited for.
    pub pending_uses: usize,
    /// Waits for recorded GPU uses that failed. Nonzero means the GPU reported an error
    /// and memory was abandoned rather than reused.
    pub gpu_wait_errors: u64,
    /// Bytes given up on (never reused, never freed) because a wait for the GPU failed.
    pub abandoned_bytes: usize,
}

/// A chunk from the source.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    base: NonNull<u8>,
    size: usize,
    /// Where the bump pointer stood when the arena moved on to a later chunk; only
    /// meaningful for in-use chunks before the current one (`base <= left_at <= end`).
    left_at: usize,
}

impl Chunk {
    fn end(&self) -> usize {
        self.base.as_ptr() as usize + self.size
    }
}

/// Empty state: no current chunk. `start > ptr` makes every fast-path request fail.
const NO_START: usize = usize::MAX;

/// Record-use events are pruned (completed ones dropped) when their count reaches a
/// power of two at least this large, so the list stays short at amortized O(1) cost.
const PRUNE_EVENTS_AT: usize = 64;

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
    // Hot state. With a current chunk: `start <= ptr <= end`, all three inside it, and
    // blocks live in `ptr..end`. Without one: ptr is null, start == NO_START, end == 0.
    ptr: Cell<*mut u8>,
    start: Cell<usize>,
    end: Cell<usize>,
    /// `ptr <= guard <= end`: blocks in `guard..end` may be in GPU use (they existed when
    /// `record_use` was last called), so freeing or growing the most recent block never
    /// reclaims memory past `guard`. Equal to `end` until `record_use`; 0 with no chunk.
    guard: Cell<usize>,
    /// `chunks[..in_use]` hold blocks, the last of them is the current chunk;
    /// `chunks[in_use..]` are empty spares (emptied by rewind) waiting for reuse.
    chunks: RefCell<Vec<Chunk>>,
    in_use: Cell<usize>,
    /// `held == chunks.iter().map(|c| c.size).sum()`, and `held <= limit`.
    held: Cell<usize>,
    /// Size of the next regular chunk: grows geometrically up to `max_chunk`.
    next_chunk: Cell<usize>,
    config: ArenaConfig,
    /// Events recorded after GPU work that may read the arena's memory; all of them
    /// complete before memory is reused (reset, rewind) or freed (drop, limits).
    /// They come from the per-device event pool.
    events: RefCell<Vec<PooledEvent>>,
    /// Test-only switch: reset and rewind skip waiting for `events` (freeing never does).
    wait_for_gpu: bool,
    gpu_wait_errors: Cell<u64>,
    abandoned_bytes: Cell<usize>,
    source: S,
}

// SAFETY: the raw pointers (the bump pointer and the chunk bases) point into chunks the
// arena owns exclusively; the `Cell`s and `RefCell`s are reached only through the arena.
// Moving it to another thread moves that ownership, and nothing about a chunk is tied to
// the thread that allocated it (sources are `Send + Sync`, events are `Send`). Blocks
// handed out borrow the arena (`&Arena`), so none can be in use while it moves. It stays
// `!Sync`: the cells make concurrent allocation a data race.
unsafe impl<S: HostVisible> Send for Arena<S> {}

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
    /// buffers that copy to the GPU at full PCIe speed. There is no fallback: without a
    /// driver every allocation fails with `AllocError`.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// let arena = cudalloc::arena::Arena::pinned();
    /// let mut staging: Vec<f32, _> = Vec::new_in(&arena);
    /// assert_eq!(staging.try_reserve(1024).is_ok(), cudalloc::cuda::driver_available());
    /// ```
    pub fn pinned() -> Self {
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
        Self {
            ptr: Cell::new(ptr::null_mut()),
            start: Cell::new(NO_START),
            end: Cell::new(0),
            guard: Cell::new(0),
            chunks: RefCell::new(Vec::new()),
            in_use: Cell::new(0),
            held: Cell::new(0),
            next_chunk: Cell::new(config.first_chunk.max(PAGE_SIZE)),
            config,
            events: RefCell::new(Vec::new()),
            wait_for_gpu: true,
            gpu_wait_errors: Cell::new(0),
            abandoned_bytes: Cell::new(0),
            source,
        }
    }

    /// The source chunks come from.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The configuration.
    pub fn config(&self) -> &ArenaConfig {
        &self.config
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
        match self.try_alloc_fast(layout.size(), layout.align()) {
            Some(p) => Ok(p),
            None => self.alloc_slow(layout.size(), layout.align()),
        }
    }

    #[inline(always)]
    fn alloc_block(&self, size: usize, align: usize) -> Result<NonNull<u8>, AllocError> {
        if size == 0 {
            return Ok(dangling(align));
        }
        match self.try_alloc_fast(size, align) {
            Some(p) => Ok(p),
            None => self.alloc_slow_logged(size, align).ok_or(AllocError),
        }
    }

    /// The cold path for `Allocator` callers, which learn nothing but failure: the reason
    /// goes to the log. Returns an `Option` so that the hot loop keeps it in registers.
    #[cold]
    #[inline(never)]
    fn alloc_slow_logged(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        match self.alloc_slow(size, align) {
            Ok(p) => Some(p),
            Err(e) => {
                log::debug!("cudalloc: arena allocation of {size} bytes (align {align}) failed: {e}");
                None
            }
        }
    }

    /// The hot path: bump down within the current chunk. One branch; `size > 0`.
    #[inline(always)]
    fn try_alloc_fast(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        debug_assert!(size > 0 && align.is_power_of_two());
        let ptr = self.ptr.get();
        let (below, underflow) = (ptr as usize).overflowing_sub(size);
        let new = below & !(align - 1);
        if underflow | (new < self.start.get()) {
            return None;
        }
        // `new` lies in start..=ptr, inside the current chunk: same provenance.
        let p = ptr.with_addr(new);
        self.ptr.set(p);
        // SAFETY: new >= start, the base address of a chunk, which is non-null.
        Some(unsafe { NonNull::new_unchecked(p) })
    }

    /// The cold path: move to a chunk with room for the request, then bump in it.
    #[cold]
    fn alloc_slow(&self, size: usize, align: usize) -> Result<NonNull<u8>> {
        // A chunk is aligned to the source's alignment; a larger alignment needs up to
        // `align - 1` bytes of slack wherever the chunk lands.
        let need = if align <= self.source.align() {
            size
        } else {
            size.checked_add(align - 1).ok_or(Error::TooLarge {
                requested: size,
                limit: isize::MAX as usize,
            })?
        };
        self.refill(need)?;
        let p = self.try_alloc_fast(size, align);
        debug_assert!(
            p.is_some(),
            "a fresh chunk of at least {need} bytes must fit {size} bytes aligned {align}"
        );
        p.ok_or(Error::InvalidArgument("arena refill produced a chunk too small"))
    }

    /// Makes a chunk of at least `need` bytes current: a spare if one fits, else a new
    /// chunk from the source.
    fn refill(&self, need: usize) -> Result<()> {
        let mut chunks = self.chunks.borrow_mut();
        let in_use = self.in_use.get();
        if in_use > 0 {
            chunks[in_use - 1].left_at = self.ptr.get() as usize;
        }
        let idx = match chunks[in_use..].iter().position(|c| c.size >= need) {
            Some(i) => in_use + i,
            None => {
                let chunk = self.new_chunk(need, &mut chunks)?;
                chunks.push(chunk);
                chunks.len() - 1
            }
        };
        chunks.swap(in_use, idx);
        self.in_use.set(in_use + 1);
        self.enter(&chunks[in_use]);
        drop(chunks);
        self.debug_check();
        Ok(())
    }

    /// A new chunk of at least `need` bytes from the source, within the limit.
    fn new_chunk(&self, need: usize, chunks: &mut Vec<Chunk>) -> Result<Chunk> {
        let regular = self.next_chunk.get();
        let dedicated = need > regular;
        let mut size = align_up(need.max(regular), PAGE_SIZE).unwrap_or(need);
        if let Some(limit) = self.config.limit {
            if need > limit.saturating_sub(self.held.get()) {
                // Spares hold memory no block uses: give it back and look again.
                self.free_spares(chunks);
            }
            let room = limit.saturating_sub(self.held.get());
            if need > room {
                return Err(Error::LimitExceeded {
                    requested: need,
                    held: self.held.get(),
                    limit,
                });
            }
            size = size.min(room);
        }
        let base = match self.source.allocate(size) {
            Ok(p) => p,
            Err(e) if size > need => {
                log::debug!("cudalloc: arena chunk of {size} bytes failed ({e}); trying {need} bytes");
                size = need;
                self.source.allocate(size)?
            }
            Err(e) => return Err(e),
        };
        debug_assert_eq!(
            base.as_ptr() as usize % self.source.align(),
            0,
            "source broke its alignment promise"
        );
        self.held.set(self.held.get() + size);
        let grown = if dedicated { regular } else { size };
        let cap = self.config.max_chunk.unwrap_or(usize::MAX);
        self.next_chunk.set(grown.saturating_mul(2).min(cap).max(regular));
        Ok(Chunk {
            base,
            size,
            left_at: base.as_ptr() as usize + size,
        })
    }

    /// Returns the spare chunks to the source, after the GPU is done with them.
    fn free_spares(&self, chunks: &mut Vec<Chunk>) {
        let in_use = self.in_use.get();
        if chunks.len() == in_use {
            return;
        }
        if !self.wait_gpu() {
            let spare: usize = chunks[in_use..].iter().map(|c| c.size).sum();
            self.abandoned_bytes.set(self.abandoned_bytes.get() + spare);
            self.held.set(self.held.get() - spare);
            chunks.truncate(in_use);
            return;
        }
        for c in chunks.drain(in_use..) {
            self.held.set(self.held.get() - c.size);
            // SAFETY: the chunk came from `self.source.allocate(c.size)`; spares hold no
            // blocks (rewind emptied them under `&mut self`), and every recorded GPU
            // use has completed (waited for just above).
            unsafe { self.source.deallocate(c.base, c.size) };
        }
    }

    /// Makes `chunk` the current chunk, empty.
    fn enter(&self, chunk: &Chunk) {
        self.start.set(chunk.base.as_ptr() as usize);
        self.end.set(chunk.end());
        self.guard.set(chunk.end());
        self.ptr.set(chunk.base.as_ptr().wrapping_add(chunk.size));
    }

    /// Back to the empty state (no current chunk).
    fn leave_all(&self) {
        self.ptr.set(ptr::null_mut());
        self.start.set(NO_START);
        self.end.set(0);
        self.guard.set(0);
        self.in_use.set(0);
    }

    /// Whether `ptr..ptr+size` is the most recent block of the current chunk, and its
    /// memory is not protected for the GPU (so it may be reclaimed or moved).
    #[inline]
    fn is_last(&self, ptr: NonNull<u8>, size: usize) -> bool {
        // `size <= guard - ptr` also rules out a block of another chunk that starts
        // exactly at the end of an empty current chunk. With no chunk, `self.ptr` is null.
        ptr.as_ptr() == self.ptr.get() && size <= self.guard.get().wrapping_sub(ptr.as_ptr() as usize)
    }

    /// # Safety
    /// 1. `ptr..ptr+size` is a live block of this arena, not used after this call.
    #[inline]
    unsafe fn dealloc_block(&self, ptr: NonNull<u8>, size: usize) {
        // Only the most recent block can be handed back; the rest wait for a reset.
        if size != 0 && self.is_last(ptr, size) {
            self.ptr.set(self.ptr.get().wrapping_add(size));
        }
    }

    /// # Safety
    /// 1. `ptr` is a live block of this arena allocated with `old`.
    /// 2. `new.size() >= old.size()`.
    #[inline]
    unsafe fn grow_block(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<u8>, AllocError> {
        let old_size = old.size();
        debug_assert!(new.size() >= old_size);
        if old_size != 0 && old.align() >= new.align() && self.is_last(ptr, old_size) {
            let delta = new.size() - old_size;
            if delta == 0 {
                return Ok(ptr);
            }
            // Grow downward over the free space just below the block: the new block ends
            // at or before the old one ends, and the contents move down (they overlap).
            if let Some(p) = self.try_alloc_fast(delta, old.align()) {
                // SAFETY: ptr..ptr+old_size is the live block (obligation 1); p..p+new
                // lies in the current chunk between the bump pointer and the old block's
                // end, so it is ours; `copy` allows the overlap.
                unsafe { ptr::copy(ptr.as_ptr(), p.as_ptr(), old_size) };
                return Ok(p);
            }
        }
        let p = self.alloc_block(new.size(), new.align())?;
        // SAFETY: the old block has old_size bytes (obligation 1); the new block is fresh,
        // so the two do not overlap, and it has at least new.size() >= old_size bytes.
        unsafe { ptr::copy_nonoverlapping(ptr.as_ptr(), p.as_ptr(), old_size) };
        Ok(p)
    }

    /// # Safety
    /// 1. `ptr` is a live block of this arena allocated with `old`.
    /// 2. `new.size() <= old.size()`.
    #[inline]
    unsafe fn shrink_block(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<u8>, AllocError> {
        let (old_size, new_size) = (old.size(), new.size());
        debug_assert!(new_size <= old_size);
        if ptr.as_ptr() as usize & (new.align() - 1) != 0 {
            let p = self.alloc_block(new_size, new.align())?;
            // SAFETY: the old block holds old_size >= new_size bytes; the new one is fresh.
            unsafe { ptr::copy_nonoverlapping(ptr.as_ptr(), p.as_ptr(), new_size) };
            return Ok(p);
        }
        // Move the most recent block up to give back its tail, when that reclaims at
        // least half of it (so the ranges do not overlap), as bumpalo does.
        let delta = (old_size - new_size) & !(new.align() - 1);
        if delta > 0 && delta >= old_size.div_ceil(2) && self.is_last(ptr, old_size) {
            let p = self.ptr.get().wrapping_add(delta);
            // SAFETY: ptr..ptr+old_size is the live block (obligation 1). delta is at
            // least half of old_size and delta + new_size <= old_size, so new_size <=
            // delta: p..p+new_size = ptr+delta..ptr+delta+new_size lies inside the old
            // block and does not overlap ptr..ptr+new_size.
            unsafe { ptr::copy_nonoverlapping(ptr.as_ptr(), p, new_size) };
            self.ptr.set(p);
            // SAFETY: p lies inside the block, which is non-null.
            return Ok(unsafe { NonNull::new_unchecked(p) });
        }
        Ok(ptr)
    }

    // ----- reuse -----

    /// Frees every block at once. The largest chunk is kept (and becomes current); the
    /// others go back to the source. Waits first for the GPU uses recorded with
    /// [`record_use`](Arena::record_use).
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
        let must_free = self.chunks.get_mut().len() > 1;
        if (self.wait_for_gpu || must_free) && !self.wait_gpu() {
            return self.abandon_all();
        }
        let chunks = self.chunks.get_mut();
        if chunks.is_empty() {
            return;
        }
        // The first of the largest: keeps the oldest chunk when sizes tie.
        let keep = chunks.iter().enumerate().fold(
            0,
            |best, (i, c)| if c.size > chunks[best].size { i } else { best },
        );
        chunks.swap(0, keep);
        for c in chunks.drain(1..) {
            self.held.set(self.held.get() - c.size);
            // SAFETY: the chunk came from `self.source.allocate(c.size)`; `&mut self`
            // means no block of the arena is borrowed any more, and every recorded GPU
            // use has completed (`must_free` forced the wait above).
            unsafe { self.source.deallocate(c.base, c.size) };
        }
        let kept = chunks[0];
        self.in_use.set(1);
        self.enter(&kept);
        self.debug_check();
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
        let in_use = self.in_use.get();
        let base = if in_use == 0 { 0 } else { self.start.get() };
        Checkpoint {
            in_use,
            base,
            ptr: self.ptr.get() as usize,
        }
    }

    /// Frees every block allocated after `checkpoint` was taken. Chunks emptied by it are
    /// kept as spares for the next allocations (until [`reset`](Arena::reset) or drop).
    /// Waits first for the GPU uses recorded with [`record_use`](Arena::record_use).
    /// Taking `&mut self` proves that no collection still borrows the arena.
    ///
    /// # Panics
    /// If `checkpoint` does not describe a position this arena's blocks still reach: one
    /// of another arena, one taken after a position already rewound to, or one from
    /// before a reset that emptied its chunk.
    ///
    /// ```should_panic
    /// use core::alloc::Layout;
    /// let mut arena = cudalloc::arena::Arena::host();
    /// let early = arena.checkpoint();
    /// arena.try_alloc_layout(Layout::new::<u64>()).unwrap();
    /// let late = arena.checkpoint();
    /// arena.rewind(early);
    /// arena.rewind(late); // later than where the arena now stands
    /// ```
    pub fn rewind(&mut self, checkpoint: Checkpoint) {
        assert!(
            self.reaches(&checkpoint),
            "Arena::rewind: {checkpoint:?} is not a position of this arena's current blocks"
        );
        if self.wait_for_gpu && !self.wait_gpu() {
            return self.abandon_all();
        }
        let Checkpoint { in_use, ptr, .. } = checkpoint;
        if in_use == 0 {
            self.leave_all();
        } else {
            let chunk = self.chunks.get_mut()[in_use - 1];
            self.in_use.set(in_use);
            self.enter(&chunk);
            self.ptr.set(chunk.base.as_ptr().with_addr(ptr));
        }
        self.debug_check();
    }

    /// Whether rewinding to `cp` only frees blocks (moves the bump pointer up).
    fn reaches(&mut self, cp: &Checkpoint) -> bool {
        let in_use = self.in_use.get();
        if cp.in_use > in_use {
            return false;
        }
        if cp.in_use == 0 {
            return true;
        }
        let c = self.chunks.get_mut()[cp.in_use - 1];
        let now = if cp.in_use == in_use {
            self.ptr.get() as usize
        } else {
            c.left_at
        };
        c.base.as_ptr() as usize == cp.base && (now..=c.end()).contains(&cp.ptr)
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

    /// Records that GPU work queued on `stream` so far may read (or write) the arena's
    /// memory: [`reset`](Arena::reset), [`rewind`](Arena::rewind) and drop wait for it
    /// before the memory is reused or freed. Call it after queueing an async copy from or
    /// to an arena block.
    ///
    /// Until the next reset or rewind, the blocks that exist when it is called are not
    /// handed out again even when freed: freeing the most recent block or growing it in
    /// place stops at them.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{arena::Arena, cuda::Stream, testing::DeviceMemory};
    /// if let Ok(stream) = Stream::new(0) {
    ///     let mut arena = Arena::pinned();
    ///     let mut dev = DeviceMemory::new(4096, 0).unwrap();
    ///     {
    ///         let mut batch: Vec<u8, _> = Vec::new_in(&arena);
    ///         batch.resize(4096, 7);
    ///         // SAFETY: the arena keeps `batch`'s memory from reuse until the copy is done.
    ///         unsafe { dev.copy_from_host_async(0, &batch, &stream) }.unwrap();
    ///         arena.record_use(&stream).unwrap();
    ///     }
    ///     arena.reset(); // waits for the copy
    /// }
    /// ```
    pub fn record_use(&self, stream: &Stream) -> Result<()> {
        let event = PooledEvent::record(stream)?;
        let mut events = self.events.borrow_mut();
        let n = events.len();
        if n >= PRUNE_EVENTS_AT && n.is_power_of_two() {
            events.retain(|e| !matches!(e.is_complete(), Ok(true)));
        }
        events.push(event);
        self.protect_blocks();
        Ok(())
    }

    /// Keeps every block that exists now from being reclaimed by a free or an in-place
    /// grow (only reset, rewind and drop reuse them, after waiting).
    fn protect_blocks(&self) {
        if self.in_use.get() > 0 {
            self.guard.set(self.ptr.get() as usize);
        }
    }

    /// Blocks until every recorded GPU use has completed. False if a wait failed: the
    /// failed events are kept (later waits fail again), and the caller must not reuse
    /// or free the memory.
    fn wait_gpu(&self) -> bool {
        let mut events = self.events.borrow_mut();
        if events.is_empty() {
            return true;
        }
        events.retain(|e| match e.synchronize() {
            Ok(()) => false,
            Err(err) => {
                self.gpu_wait_errors.set(self.gpu_wait_errors.get() + 1);
                crate::cuda::record_drop_error("arena: waiting for a recorded GPU use", err);
                true
            }
        });
        events.is_empty()
    }

    /// Gives up on every chunk after a failed wait: the GPU may still use them, so they
    /// are neither reused nor freed (a leak is better than corrupted data).
    fn abandon_all(&mut self) {
        let held = self.held.replace(0);
        self.abandoned_bytes.set(self.abandoned_bytes.get() + held);
        self.chunks.get_mut().clear();
        self.leave_all();
        log::error!("cudalloc: arena abandons {held} bytes the GPU may still be using");
    }

    /// Test-only: with `false`, [`reset`](Arena::reset) and [`rewind`](Arena::rewind)
    /// reuse memory without waiting for recorded GPU uses, which shows the race the wait
    /// prevents. Chunks still go back to the source only after the wait.
    #[doc(hidden)]
    pub fn set_wait_for_gpu(&mut self, wait: bool) {
        self.wait_for_gpu = wait;
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
        self.held.get()
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
        if self.in_use.get() == 0 {
            0
        } else {
            self.ptr.get() as usize - self.start.get()
        }
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
        let in_use = self.in_use.get();
        if in_use == 0 {
            return 0;
        }
        let chunks = self.chunks.borrow();
        let earlier: usize = chunks[..in_use - 1].iter().map(|c| c.end() - c.left_at).sum();
        earlier + (self.end.get() - self.ptr.get() as usize)
    }

    /// Number of chunks held (in use and spare).
    pub fn chunk_count(&self) -> usize {
        self.chunks.borrow().len()
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
            held_bytes: self.held.get(),
            used_bytes: self.used_bytes(),
            chunks: self.chunk_count(),
            pending_uses: self.events.borrow().len(),
            gpu_wait_errors: self.gpu_wait_errors.get(),
            abandoned_bytes: self.abandoned_bytes.get(),
        }
    }

    /// Checks the invariants stated on the fields (debug builds only).
    fn debug_check(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let chunks = self.chunks.borrow();
        let in_use = self.in_use.get();
        let held: usize = chunks.iter().map(|c| c.size).sum();
        debug_assert_eq!(
            held,
            self.held.get(),
            "held bytes {} != sum of chunk sizes {held}",
            self.held.get()
        );
        debug_assert!(
            in_use <= chunks.len(),
            "in_use {in_use} > {} chunks",
            chunks.len()
        );
        if let Some(limit) = self.config.limit {
            debug_assert!(held <= limit, "held {held} bytes past the limit of {limit}");
        }
        let (start, ptr, end) = (self.start.get(), self.ptr.get() as usize, self.end.get());
        let guard = self.guard.get();
        if in_use == 0 {
            debug_assert!(
                ptr == 0 && start == NO_START && end == 0 && guard == 0,
                "empty arena with ptr {ptr:#x}"
            );
        } else {
            let c = &chunks[in_use - 1];
            debug_assert!(
                c.base.as_ptr() as usize == start
                    && start <= ptr
                    && ptr <= guard
                    && guard <= end
                    && end == c.end(),
                "bump pointer {ptr:#x} or guard {guard:#x} outside current chunk {start:#x}..{end:#x}"
            );
        }
    }
}

impl<S: HostVisible> Drop for Arena<S> {
    fn drop(&mut self) {
        // Always wait here, whatever the test switch says: this frees the memory.
        if !self.wait_gpu() {
            return self.abandon_all();
        }
        for c in self.chunks.get_mut().drain(..) {
            // SAFETY: the chunk came from `self.source.allocate(c.size)`; the arena is
            // going away, so no block is borrowed, and recorded GPU uses have completed.
            unsafe { self.source.deallocate(c.base, c.size) };
        }
    }
}

impl<S: HostVisible + fmt::Debug> fmt::Debug for Arena<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("source", &self.source)
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A non-null pointer aligned to `align`, for zero-size blocks; never dereferenced.
#[inline]
fn dangling(align: usize) -> NonNull<u8> {
    // SAFETY: an alignment is never zero.
    unsafe { NonNull::new_unchecked(ptr::without_provenance_mut(align)) }
}

// SAFETY: blocks are carved from chunks the arena owns, disjoint while live (the bump
// pointer only moves up past a block when that block is freed, or under `&mut self`),
// host-visible (S: HostVisible), aligned as asked, and valid until freed, reset,
// rewound (both need `&mut Arena`, so no `&Arena` copy is alive) or the arena is dropped.
// Copies of `&Arena` share the one arena, so any of them may free any block.
unsafe impl<S: HostVisible> Allocator for &Arena<S> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let p = self.alloc_block(layout.size(), layout.align())?;
        Ok(NonNull::slice_from_raw_parts(p, layout.size()))
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the trait's caller passes a live block of this arena.
        unsafe { self.dealloc_block(ptr, layout.size()) }
    }

    #[inline]
    unsafe fn grow(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the trait's caller passes a live block allocated with `old`, and
        // `new.size() >= old.size()`.
        let p = unsafe { self.grow_block(ptr, old, new) }?;
        Ok(NonNull::slice_from_raw_parts(p, new.size()))
    }

    #[inline]
    unsafe fn grow_zeroed(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: as in `grow`.
        let p = unsafe { self.grow_block(ptr, old, new) }?;
        // SAFETY: the block has new.size() bytes; the tail past old.size() is ours to zero.
        unsafe { ptr::write_bytes(p.as_ptr().add(old.size()), 0, new.size() - old.size()) };
        Ok(NonNull::slice_from_raw_parts(p, new.size()))
    }

    #[inline]
    unsafe fn shrink(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the trait's caller passes a live block allocated with `old`, and
        // `new.size() <= old.size()`.
        let p = unsafe { self.shrink_block(ptr, old, new) }?;
        Ok(NonNull::slice_from_raw_parts(p, new.size()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn bumps_downward_within_a_chunk() {
        let arena = Arena::host();
        let a = arena.try_alloc_layout(layout(16, 8)).unwrap();
        let b = arena.try_alloc_layout(layout(16, 8)).unwrap();
        assert_eq!(a.as_ptr() as usize - b.as_ptr() as usize, 16);
        assert_eq!(arena.end.get() - a.as_ptr() as usize, 16);
        arena.debug_check();
    }

    #[test]
    fn empty_arena_fails_the_fast_path_for_any_request() {
        let arena = Arena::host();
        for (size, align) in [(1, 1), (8, 8), (usize::MAX / 2, 1), (4096, 1 << 20)] {
            assert!(arena.try_alloc_fast(size, align).is_none());
        }
        arena.debug_check();
    }

    #[test]
    fn left_at_records_where_a_chunk_was_left() {
        let arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(PAGE_SIZE));
        arena.try_alloc_layout(layout(1000, 8)).unwrap();
        arena.try_alloc_layout(layout(PAGE_SIZE, 8)).unwrap();
        let chunks = arena.chunks.borrow();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].end() - chunks[0].left_at, 1000);
        drop(chunks);
        assert_eq!(arena.used_bytes(), 1000 + PAGE_SIZE);
    }

    #[test]
    fn next_chunk_doubles_and_stops_at_max_chunk() {
        let cfg = ArenaConfig::host()
            .with_first_chunk(PAGE_SIZE)
            .with_max_chunk(4 * PAGE_SIZE);
        let arena = Arena::with_config(HostSource, cfg);
        let mut sizes = Vec::new();
        for _ in 0..5 {
            arena.alloc_slow(1, 1).unwrap();
            sizes.push(arena.chunks.borrow().last().unwrap().size);
        }
        // New chunks go to index in_use - 1 (the end here: there are no spares).
        assert_eq!(sizes, [1, 2, 4, 4, 4].map(|n| n * PAGE_SIZE));
    }

    #[test]
    fn dedicated_chunk_does_not_inflate_growth() {
        let arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(PAGE_SIZE));
        arena.alloc_slow(1 << 20, 1).unwrap();
        assert_eq!(arena.next_chunk.get(), 2 * PAGE_SIZE);
    }

    #[test]
    fn over_aligned_requests_get_slack() {
        let arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(PAGE_SIZE));
        let p = arena.try_alloc_layout(layout(1, 1 << 21)).unwrap();
        assert_eq!(p.as_ptr() as usize % (1 << 21), 0);
        assert!(arena.allocated_bytes() >= (1 << 21));
        arena.debug_check();
    }

    #[test]
    fn is_last_rejects_a_block_at_the_end_of_an_empty_chunk() {
        let arena = Arena::host();
        let p = arena.try_alloc_layout(layout(8, 8)).unwrap();
        // SAFETY: p is the most recent block.
        unsafe { arena.dealloc_block(p, 8) };
        let end = NonNull::new(arena.ptr.get()).unwrap();
        assert!(
            !arena.is_last(end, 8),
            "a block at the end of the chunk lies outside it"
        );
        assert!(arena.is_last(end, 0));
    }

    #[test]
    fn protected_blocks_are_not_reclaimed_by_free_or_grow() {
        let arena = Arena::host();
        let a = arena.try_alloc_layout(layout(64, 8)).unwrap();
        arena.protect_blocks(); // what record_use does after recording its event
                                // SAFETY: `a` is the most recent block.
        unsafe { arena.dealloc_block(a, 64) };
        let b = arena.try_alloc_layout(layout(64, 8)).unwrap();
        assert_ne!(a, b, "a protected block was handed out again");
        // SAFETY: `b` is the most recent block, unprotected: freeing it reclaims it.
        unsafe { arena.dealloc_block(b, 64) };
        assert_eq!(arena.try_alloc_layout(layout(64, 8)).unwrap(), b);
        arena.debug_check();
    }

    #[test]
    fn rewind_validation() {
        let mut arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(PAGE_SIZE));
        let empty = arena.checkpoint();
        arena.try_alloc_layout(layout(100, 8)).unwrap();
        let one = arena.checkpoint();
        arena.try_alloc_layout(layout(2 * PAGE_SIZE, 8)).unwrap();
        let two = arena.checkpoint();
        assert!(arena.reaches(&empty) && arena.reaches(&one) && arena.reaches(&two));
        arena.rewind(one);
        assert!(!arena.reaches(&two), "a later position is no longer reachable");
        assert!(arena.reaches(&one) && arena.reaches(&empty));
        let other = Arena::host();
        other.try_alloc_layout(layout(1, 1)).unwrap();
        assert!(!arena.reaches(&other.checkpoint()), "another arena's position");
    }
}
