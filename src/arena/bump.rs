//! The bump core of an arena: chunks from a source, a bump pointer moving down through
//! the current chunk, checkpoints, and the arithmetic of freeing and growing the most
//! recent block. It knows nothing of CUDA: whatever must happen before chunk memory is
//! reused or freed (waiting for GPU uses), and the registration of chunk ranges, the
//! owner does through [`Hooks`].
//!
//! Design, after bumpalo: blocks are bumped *downward* from the top of the current chunk
//! (one subtraction, one mask, one comparison); a request that does not fit takes the
//! cold path, which starts a new chunk twice the size of the previous regular one. Only
//! the most recent block can be freed or grown in place; everything else is reclaimed by
//! a reset or a rewind, which the owner calls under `&mut`.

use core::cell::{Cell, RefCell};
use core::ptr::{self, NonNull};

use allocator_api2::alloc::Layout;

use super::{ArenaConfig, Checkpoint};
use crate::cuda::nvtx;
use crate::error::{Error, Result};
use crate::source::HostVisible;
use crate::util::{align_up, PAGE_SIZE};

/// What the core asks of its owner around chunk memory.
pub(crate) trait Hooks {
    /// Called before memory that held blocks is reused (`freeing` false) or returned to
    /// the source (`freeing` true): blocks until the GPU no longer uses it. False: it
    /// could not make sure, and the memory must be given up.
    fn wait(&self, freeing: bool) -> bool;
    /// Every chunk was given up after a failed wait: the recorded uses guard nothing
    /// any more.
    fn forget_uses(&self);
    /// A chunk was taken from the source. False: the range overlaps memory the crate's
    /// allocators already hold in a way that cannot nest (a broken source), and the chunk
    /// must go back.
    fn added(&self, base: usize, size: usize) -> bool;
    /// A chunk goes back to the source (or is given up).
    fn removed(&self, base: usize, size: usize);
}

/// A chunk from the source.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunk {
    pub(crate) base: NonNull<u8>,
    pub(crate) size: usize,
    /// Where the bump pointer stood when the arena moved on to a later chunk; only
    /// meaningful for in-use chunks before the current one (`base <= left_at <= end`).
    pub(crate) left_at: usize,
}

impl Chunk {
    pub(crate) fn end(&self) -> usize {
        self.base.as_ptr() as usize + self.size
    }
}

/// Empty state: no current chunk. `start > ptr` makes every fast-path request fail.
const NO_START: usize = usize::MAX;

/// The bump allocator state.
pub(crate) struct Bump<S: HostVisible> {
    // Hot state. With a current chunk: `start <= ptr <= end`, all three inside it, and
    // blocks live in `ptr..end`. Without one: ptr is null, start == NO_START, end == 0.
    ptr: Cell<*mut u8>,
    start: Cell<usize>,
    end: Cell<usize>,
    /// `ptr <= guard <= end`: blocks in `guard..end` may be in GPU use (they existed when
    /// a use was last recorded), so freeing or growing the most recent block never
    /// reclaims memory past `guard`. Equal to `end` until a use is recorded; 0 with no
    /// chunk.
    guard: Cell<usize>,
    /// `chunks[..in_use]` hold blocks, the last of them is the current chunk;
    /// `chunks[in_use..]` are empty spares waiting for reuse.
    chunks: RefCell<Vec<Chunk>>,
    in_use: Cell<usize>,
    /// `chunks[..named]` may be named by a checkpoint of this epoch: a refill keeps such
    /// a chunk in use even when frees (newest first) emptied it, so that the checkpoint
    /// stays a position of the arena. Raised by `checkpoint`, set by `rewind` (a
    /// checkpoint naming a later chunk names a position the rewind undid), 0 in a new
    /// epoch.
    named: Cell<usize>,
    /// `held == chunks.iter().map(|c| c.size).sum()`, and `held <= limit`.
    held: Cell<usize>,
    /// Size of the next regular chunk: grows geometrically up to `max_chunk`.
    next_chunk: Cell<usize>,
    pub(crate) config: ArenaConfig,
    /// Bytes given up on (never reused, never freed) because a wait for the GPU failed.
    abandoned_bytes: Cell<usize>,
    /// Moves whenever every block is freed at once (a reset, a give-up): a checkpoint
    /// taken in an earlier epoch names no position of the current blocks.
    epoch: Cell<u64>,
    /// Chunks registered as NVTX heaps so far (`cuda::nvtx`; 0 without a tool or for
    /// memory no kernel reaches).
    heaps: Cell<usize>,
    pub(crate) source: S,
}

impl<S: HostVisible> Bump<S> {
    pub(crate) fn new(source: S, config: ArenaConfig) -> Self {
        Self {
            ptr: Cell::new(ptr::null_mut()),
            start: Cell::new(NO_START),
            end: Cell::new(0),
            guard: Cell::new(0),
            chunks: RefCell::new(Vec::new()),
            in_use: Cell::new(0),
            named: Cell::new(0),
            held: Cell::new(0),
            next_chunk: Cell::new(config.first_chunk.max(PAGE_SIZE)),
            config,
            abandoned_bytes: Cell::new(0),
            epoch: Cell::new(0),
            heaps: Cell::new(0),
            source,
        }
    }

    // ----- allocation -----

    /// The hot path: bump down within the current chunk. One branch; `size > 0`.
    #[inline(always)]
    pub(crate) fn try_alloc_fast(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
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
    pub(crate) fn alloc_slow(&self, size: usize, align: usize, hooks: &impl Hooks) -> Result<NonNull<u8>> {
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
        self.refill(need, hooks)?;
        let p = self.try_alloc_fast(size, align);
        debug_assert!(
            p.is_some(),
            "a fresh chunk of at least {need} bytes must fit {size} bytes aligned {align}"
        );
        p.ok_or(Error::InvalidArgument("arena refill produced a chunk too small"))
    }

    /// Makes a chunk of at least `need` bytes current: a spare if one fits, else a new
    /// chunk from the source. An empty current chunk (after a reset, say) goes back to the
    /// spares first, so that under a limit it can be freed to make room.
    fn refill(&self, need: usize, hooks: &impl Hooks) -> Result<()> {
        let mut chunks = self.chunks.borrow_mut();
        let mut in_use = self.in_use.get();
        if in_use > 0 {
            if self.ptr.get() as usize == self.end.get() && in_use > self.named.get() {
                // Holds no block, and no checkpoint names it (one taken while it is
                // empty names the position before it: see `checkpoint`): a spare now.
                in_use -= 1;
            } else {
                chunks[in_use - 1].left_at = self.ptr.get() as usize;
            }
        }
        self.in_use.set(in_use);
        let idx = match chunks[in_use..].iter().position(|c| c.size >= need) {
            Some(i) => in_use + i,
            None => match self.new_chunk(need, &mut chunks, hooks) {
                Ok(chunk) => {
                    chunks.push(chunk);
                    chunks.len() - 1
                }
                Err(e) => {
                    // Back to where we were: the current chunk (if any) stays current.
                    self.restore_current(&chunks);
                    return Err(e);
                }
            },
        };
        chunks.swap(in_use, idx);
        self.in_use.set(in_use + 1);
        self.enter(&chunks[in_use]);
        drop(chunks);
        self.debug_check();
        Ok(())
    }

    /// After a failed refill: the last in-use chunk stays (or becomes again) current,
    /// where it stood.
    fn restore_current(&self, chunks: &[Chunk]) {
        let in_use = self.in_use.get();
        let current = self.start.get();
        if in_use > 0 && chunks[in_use - 1].base.as_ptr() as usize == current {
            return; // it was not demoted: nothing moved
        }
        // The current chunk was an empty one demoted to the spares (still at index
        // in_use, as nothing was removed before it) or freed by `free_spares`.
        match chunks.get(in_use) {
            Some(c) if c.base.as_ptr() as usize == current => {
                self.in_use.set(in_use + 1);
            }
            _ if in_use > 0 => {
                let c = chunks[in_use - 1];
                self.enter(&c);
                self.ptr.set(c.base.as_ptr().with_addr(c.left_at));
                // Its blocks may have been protected while it was current: keep them so.
                self.guard.set(c.left_at);
            }
            _ => self.leave_all(),
        }
    }

    /// A new chunk of at least `need` bytes from the source, within the limit.
    fn new_chunk(&self, need: usize, chunks: &mut Vec<Chunk>, hooks: &impl Hooks) -> Result<Chunk> {
        let regular = self.next_chunk.get();
        let dedicated = need > regular;
        let mut size = align_up(need.max(regular), PAGE_SIZE).unwrap_or(need);
        if let Some(limit) = self.config.limit {
            if need > limit.saturating_sub(self.held.get()) {
                // Spares hold memory no block uses: give it back and look again.
                self.free_spares(chunks, hooks);
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
        if !hooks.added(base.as_ptr() as usize, size) {
            // SAFETY: allocated just above with this size and never handed out.
            unsafe { self.source.deallocate(base, size) };
            return Err(Error::InvalidArgument(
                "the arena's source returned memory that overlaps memory the crate's allocators already hold",
            ));
        }
        // Memory a kernel reaches is an NVTX heap: the owner's blocks are regions in it.
        if self.config.nvtx && nvtx::on() && nvtx::host_heap_register(&self.source, base, size) {
            self.heaps.set(self.heaps.get() + 1);
        }
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
    fn free_spares(&self, chunks: &mut Vec<Chunk>, hooks: &impl Hooks) {
        let in_use = self.in_use.get();
        if chunks.len() == in_use {
            return;
        }
        if !hooks.wait(true) {
            for c in chunks.drain(in_use..) {
                self.give_up(c, hooks);
            }
            return;
        }
        for c in chunks.drain(in_use..) {
            self.free_chunk(c, hooks);
        }
    }

    /// Returns a chunk to the source.
    fn free_chunk(&self, c: Chunk, hooks: &impl Hooks) {
        hooks.removed(c.base.as_ptr() as usize, c.size);
        self.heap_gone(&c);
        self.held.set(self.held.get() - c.size);
        // SAFETY: the chunk came from `self.source.allocate(c.size)`; callers pass chunks
        // that hold no live block and whose GPU uses have completed (waited for).
        unsafe { self.source.deallocate(c.base, c.size) };
    }

    /// Gives a chunk up after a failed wait: the GPU may still use it, so it is neither
    /// reused nor freed (a leak is better than corrupted data).
    fn give_up(&self, c: Chunk, hooks: &impl Hooks) {
        hooks.removed(c.base.as_ptr() as usize, c.size);
        self.heap_gone(&c);
        self.held.set(self.held.get() - c.size);
        self.abandoned_bytes.set(self.abandoned_bytes.get() + c.size);
    }

    /// The chunk leaves the arena: no longer an NVTX heap (nothing if it was none).
    fn heap_gone(&self, c: &Chunk) {
        if nvtx::on() {
            nvtx::heap_unregister(c.base.as_ptr() as u64);
        }
    }

    /// Whether some chunk became an NVTX heap (so the owner's blocks are worth describing
    /// as regions).
    #[inline(always)]
    pub(crate) fn has_heaps(&self) -> bool {
        self.heaps.get() > 0
    }

    /// Makes `chunk` the current chunk, empty.
    fn enter(&self, chunk: &Chunk) {
        self.start.set(chunk.base.as_ptr() as usize);
        self.end.set(chunk.end());
        self.guard.set(chunk.end());
        self.ptr.set(chunk.base.as_ptr().wrapping_add(chunk.size));
    }

    /// Every block is freed at once: the checkpoints taken so far name no position.
    fn new_epoch(&self) {
        self.epoch.set(self.epoch.get() + 1);
        self.named.set(0);
    }

    /// Back to the empty state (no current chunk).
    fn leave_all(&self) {
        self.ptr.set(ptr::null_mut());
        self.start.set(NO_START);
        self.end.set(0);
        self.guard.set(0);
        self.in_use.set(0);
    }

    // ----- freeing and resizing the most recent block -----

    /// Keeps every block that exists now from being reclaimed by a free or an in-place
    /// grow (only reset, rewind and drop reuse them, after waiting).
    pub(crate) fn protect(&self) {
        if self.in_use.get() > 0 {
            self.guard.set(self.ptr.get() as usize);
        }
    }

    /// Whether `ptr..ptr+size` is the most recent block of the current chunk, and its
    /// memory is not protected for the GPU (so it may be reclaimed or moved).
    #[inline]
    pub(crate) fn is_last(&self, ptr: NonNull<u8>, size: usize) -> bool {
        // `size <= guard - ptr` also rules out a block of another chunk that starts
        // exactly at the end of an empty current chunk. With no chunk, `self.ptr` is null.
        ptr.as_ptr() == self.ptr.get() && size <= self.guard.get().wrapping_sub(ptr.as_ptr() as usize)
    }

    /// # Safety
    /// 1. `ptr..ptr+size` is a live block of this arena, not used after this call.
    #[inline]
    pub(crate) unsafe fn dealloc(&self, ptr: NonNull<u8>, size: usize) {
        // Only the most recent block can be handed back; the rest wait for a reset.
        if size != 0 && self.is_last(ptr, size) {
            self.ptr.set(self.ptr.get().wrapping_add(size));
        }
    }

    /// Grows the most recent block in place, downward over the free space below it
    /// (contents moved down, the ranges may overlap); `None` if it is not the most recent
    /// block or there is no room.
    ///
    /// # Safety
    /// 1. `ptr` is a live block of this arena allocated with `old`; `new.size() >= old.size()`.
    #[inline]
    pub(crate) unsafe fn grow_in_place(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Option<NonNull<u8>> {
        let old_size = old.size();
        if old_size == 0 || old.align() < new.align() || !self.is_last(ptr, old_size) {
            return None;
        }
        let delta = new.size() - old_size;
        if delta == 0 {
            return Some(ptr);
        }
        let p = self.try_alloc_fast(delta, old.align())?;
        // SAFETY: ptr..ptr+old_size is the live block (obligation 1); p..p+new lies in the
        // current chunk between the bump pointer and the old block's end, so it is ours;
        // `copy` allows the overlap.
        unsafe { ptr::copy(ptr.as_ptr(), p.as_ptr(), old_size) };
        Some(p)
    }

    /// Shrinks the most recent block by moving it up over its tail when that reclaims at
    /// least half of it (so the ranges do not overlap), as bumpalo does; else leaves it.
    /// `None` if the block is not aligned for `new` (the caller moves it).
    ///
    /// # Safety
    /// 1. `ptr` is a live block of this arena allocated with `old`; `new.size() <= old.size()`.
    #[inline]
    pub(crate) unsafe fn shrink_in_place(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Option<NonNull<u8>> {
        let (old_size, new_size) = (old.size(), new.size());
        if ptr.as_ptr() as usize & (new.align() - 1) != 0 {
            return None;
        }
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
            return Some(unsafe { NonNull::new_unchecked(p) });
        }
        Some(ptr)
    }

    // ----- reuse -----

    /// Frees every block: keeps the largest chunk (current, empty) and returns the others
    /// to the source. `hooks.wait()` runs first when memory will be reused or freed; if
    /// it fails, every chunk is given up instead.
    pub(crate) fn reset(&mut self, hooks: &impl Hooks) {
        self.new_epoch();
        if self.chunks.get_mut().is_empty() {
            return;
        }
        let freeing = self.chunks.get_mut().len() > 1;
        if !hooks.wait(freeing) {
            return self.give_up_all(hooks);
        }
        let mut chunks = core::mem::take(self.chunks.get_mut());
        // The first of the largest: keeps the oldest chunk when sizes tie.
        let keep = chunks.iter().enumerate().fold(
            0,
            |best, (i, c)| if c.size > chunks[best].size { i } else { best },
        );
        chunks.swap(0, keep);
        for c in chunks.drain(1..) {
            self.free_chunk(c, hooks);
        }
        let kept = chunks[0];
        *self.chunks.get_mut() = chunks;
        self.in_use.set(1);
        self.enter(&kept);
        self.debug_check();
    }

    /// The current position. An empty current chunk is not named: the position is the
    /// end of the blocks before it (so a refill may recycle that chunk).
    pub(crate) fn checkpoint(&self) -> Checkpoint {
        let mut in_use = self.in_use.get();
        let mut ptr = self.ptr.get() as usize;
        let mut base = if in_use == 0 { 0 } else { self.start.get() };
        if in_use > 0 && ptr == self.end.get() {
            in_use -= 1;
            if in_use == 0 {
                (base, ptr) = (0, 0);
            } else {
                let c = self.chunks.borrow()[in_use - 1];
                (base, ptr) = (c.base.as_ptr() as usize, c.left_at);
            }
        }
        self.named.set(self.named.get().max(in_use));
        Checkpoint {
            in_use,
            base,
            ptr,
            arena: 0,
            epoch: self.epoch.get(),
            regions: 0,
        }
    }

    /// Whether `cp` names a position in the arena's current chunks (so that rewinding to
    /// it only frees blocks: the bump pointer never moves down).
    pub(crate) fn reaches(&mut self, cp: &Checkpoint) -> bool {
        if cp.epoch != self.epoch.get() {
            return false;
        }
        let in_use = self.in_use.get();
        if cp.in_use > in_use {
            return false;
        }
        if cp.in_use == 0 {
            return true;
        }
        let c = self.chunks.get_mut()[cp.in_use - 1];
        c.base.as_ptr() as usize == cp.base && (cp.base..=c.end()).contains(&cp.ptr)
    }

    /// Frees every block allocated after `cp` (which `reaches` accepted); emptied chunks
    /// become spares. `hooks.wait()` runs first; if it fails, every chunk is given up.
    pub(crate) fn rewind(&mut self, cp: Checkpoint, hooks: &impl Hooks) {
        if !hooks.wait(false) {
            return self.give_up_all(hooks);
        }
        let Checkpoint { in_use, ptr, .. } = cp;
        self.named.set(in_use);
        if in_use == 0 {
            self.leave_all();
        } else {
            let chunk = self.chunks.get_mut()[in_use - 1];
            // Where the chunk's blocks end now: above the mark when the blocks after it
            // were freed already (the newest one reclaimed, or an earlier rewind); the
            // pointer then stays there (it only moves up, never over a live block).
            let now = if in_use == self.in_use.get() {
                self.ptr.get() as usize
            } else {
                chunk.left_at
            };
            self.in_use.set(in_use);
            self.enter(&chunk);
            self.ptr.set(chunk.base.as_ptr().with_addr(ptr.max(now)));
        }
        self.debug_check();
    }

    /// Gives up every chunk after a failed wait.
    fn give_up_all(&mut self, hooks: &impl Hooks) {
        self.new_epoch();
        let chunks = core::mem::take(self.chunks.get_mut());
        let held: usize = chunks.iter().map(|c| c.size).sum();
        for c in chunks {
            self.give_up(c, hooks);
        }
        // The uses whose wait failed guard memory that is given up now: they no longer
        // hold anything back (kept, every later reset would fail and give up chunks
        // nothing was recorded on).
        hooks.forget_uses();
        self.leave_all();
        log::error!("cudalloc: arena abandons {held} bytes the GPU may still be using");
    }

    /// Returns every chunk to the source (the arena is going away), or gives them all up
    /// if the wait fails.
    pub(crate) fn release_all(&mut self, hooks: &impl Hooks) {
        if self.chunks.get_mut().is_empty() {
            return;
        }
        if !hooks.wait(true) {
            return self.give_up_all(hooks);
        }
        for c in core::mem::take(self.chunks.get_mut()) {
            self.free_chunk(c, hooks);
        }
        self.leave_all();
    }

    // ----- queries -----

    /// Whether `addr` lies in one of the arena's chunks.
    pub(crate) fn contains(&self, addr: usize) -> bool {
        self.chunks
            .borrow()
            .iter()
            .any(|c| (c.base.as_ptr() as usize..c.end()).contains(&addr))
    }

    pub(crate) fn held(&self) -> usize {
        self.held.get()
    }

    pub(crate) fn abandoned_bytes(&self) -> usize {
        self.abandoned_bytes.get()
    }

    /// Bytes left in the current chunk.
    pub(crate) fn chunk_capacity(&self) -> usize {
        if self.in_use.get() == 0 {
            0
        } else {
            self.ptr.get() as usize - self.start.get()
        }
    }

    /// Bytes handed out since the last reset, padding and abandoned chunk tails included.
    pub(crate) fn used_bytes(&self) -> usize {
        let in_use = self.in_use.get();
        if in_use == 0 {
            return 0;
        }
        let chunks = self.chunks.borrow();
        let earlier: usize = chunks[..in_use - 1].iter().map(|c| c.end() - c.left_at).sum();
        earlier + (self.end.get() - self.ptr.get() as usize)
    }

    pub(crate) fn chunk_count(&self) -> usize {
        self.chunks.borrow().len()
    }

    /// Checks the invariants stated on the fields (debug builds only).
    pub(crate) fn debug_check(&self) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::HostSource;

    struct NoGpu;
    impl Hooks for NoGpu {
        fn wait(&self, _freeing: bool) -> bool {
            true
        }
        fn added(&self, _: usize, _: usize) -> bool {
            true
        }
        fn forget_uses(&self) {}
        fn removed(&self, _: usize, _: usize) {}
    }

    fn bump(first: usize) -> Bump<HostSource> {
        Bump::new(HostSource, ArenaConfig::host().with_first_chunk(first))
    }

    fn alloc(b: &Bump<HostSource>, size: usize, align: usize) -> NonNull<u8> {
        b.try_alloc_fast(size, align)
            .map_or_else(|| b.alloc_slow(size, align, &NoGpu), Ok)
            .unwrap()
    }

    #[test]
    fn bumps_downward_within_a_chunk() {
        let b = bump(64 << 10);
        let x = alloc(&b, 16, 8);
        let y = alloc(&b, 16, 8);
        assert_eq!(x.as_ptr() as usize - y.as_ptr() as usize, 16);
        assert_eq!(b.end.get() - x.as_ptr() as usize, 16);
        b.debug_check();
    }

    #[test]
    fn empty_arena_fails_the_fast_path_for_any_request() {
        let b = bump(64 << 10);
        for (size, align) in [(1, 1), (8, 8), (usize::MAX / 2, 1), (4096, 1 << 20)] {
            assert!(b.try_alloc_fast(size, align).is_none());
        }
        b.debug_check();
    }

    #[test]
    fn left_at_records_where_a_chunk_was_left() {
        let b = bump(PAGE_SIZE);
        alloc(&b, 1000, 8);
        alloc(&b, PAGE_SIZE, 8);
        let chunks = b.chunks.borrow();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].end() - chunks[0].left_at, 1000);
        drop(chunks);
        assert_eq!(b.used_bytes(), 1000 + PAGE_SIZE);
    }

    #[test]
    fn next_chunk_doubles_and_stops_at_max_chunk() {
        let b = Bump::new(
            HostSource,
            ArenaConfig::host()
                .with_first_chunk(PAGE_SIZE)
                .with_max_chunk(4 * PAGE_SIZE),
        );
        let mut sizes = Vec::new();
        for _ in 0..5 {
            b.alloc_slow(1, 1, &NoGpu).unwrap();
            sizes.push(b.chunks.borrow()[b.in_use.get() - 1].size);
        }
        assert_eq!(sizes, [1, 2, 4, 4, 4].map(|n| n * PAGE_SIZE));
    }

    #[test]
    fn dedicated_chunk_does_not_inflate_growth() {
        let b = bump(PAGE_SIZE);
        b.alloc_slow(1 << 20, 1, &NoGpu).unwrap();
        assert_eq!(b.next_chunk.get(), 2 * PAGE_SIZE);
    }

    #[test]
    fn over_aligned_requests_get_slack() {
        let b = bump(PAGE_SIZE);
        let p = alloc(&b, 1, 1 << 21);
        assert_eq!(p.as_ptr() as usize % (1 << 21), 0);
        assert!(b.held() >= (1 << 21));
        b.debug_check();
    }

    #[test]
    fn is_last_rejects_a_block_at_the_end_of_an_empty_chunk() {
        let b = bump(64 << 10);
        let p = alloc(&b, 8, 8);
        // SAFETY: p is the most recent block.
        unsafe { b.dealloc(p, 8) };
        let end = NonNull::new(b.ptr.get()).unwrap();
        assert!(
            !b.is_last(end, 8),
            "a block at the end of the chunk lies outside it"
        );
        assert!(b.is_last(end, 0));
    }

    #[test]
    fn protected_blocks_are_not_reclaimed_by_free_or_grow() {
        let b = bump(64 << 10);
        let x = alloc(&b, 64, 8);
        b.protect(); // what recording a use leads to
                     // SAFETY: `x` is the most recent block.
        unsafe { b.dealloc(x, 64) };
        let y = alloc(&b, 64, 8);
        assert_ne!(x, y, "a protected block was handed out again");
        // SAFETY: `y` is the most recent block, unprotected: freeing it reclaims it.
        unsafe { b.dealloc(y, 64) };
        assert_eq!(alloc(&b, 64, 8), y);
        b.debug_check();
    }

    #[test]
    fn a_rewind_never_moves_the_pointer_down() {
        let mut b = bump(4 * PAGE_SIZE);
        let keep = alloc(&b, 100, 8);
        let early = b.checkpoint();
        let newest = alloc(&b, 200, 8);
        let mark = b.checkpoint();
        // SAFETY: the most recent block, unprotected: freeing it reclaims it, and the
        // pointer moves above `mark`.
        unsafe { b.dealloc(newest, 200) };
        let used = b.used_bytes();
        assert!(b.reaches(&mark));
        b.rewind(mark, &NoGpu);
        assert_eq!(b.used_bytes(), used, "nothing after the mark was live");
        b.rewind(early, &NoGpu);
        assert_eq!(b.used_bytes(), used);
        assert_eq!(alloc(&b, 200, 8), newest, "the space above stays free");
        assert_ne!(keep, newest);
        b.debug_check();
    }

    #[test]
    fn rewind_validation() {
        let mut b = bump(PAGE_SIZE);
        let empty = b.checkpoint();
        alloc(&b, 100, 8);
        let one = b.checkpoint();
        alloc(&b, 2 * PAGE_SIZE, 8);
        let two = b.checkpoint();
        assert!(b.reaches(&empty) && b.reaches(&one) && b.reaches(&two));
        b.rewind(one, &NoGpu);
        assert!(!b.reaches(&two), "a later position is no longer reachable");
        assert!(b.reaches(&one) && b.reaches(&empty));
        let other = bump(PAGE_SIZE);
        alloc(&other, 1, 1);
        assert!(!b.reaches(&other.checkpoint()), "another arena's position");
    }

    /// Issue 12, defect 4: after a reset, the kept chunk counted against the limit and a
    /// request larger than it failed, though a fresh arena with the same limit serves it.
    #[test]
    fn a_reset_arena_serves_what_a_fresh_one_with_the_same_limit_serves() {
        let limit = 1 << 20;
        let mut b = Bump::new(
            HostSource,
            ArenaConfig::host().with_first_chunk(256 << 10).with_limit(limit),
        );
        alloc(&b, 1000, 8);
        b.reset(&NoGpu);
        assert_eq!(b.held(), 256 << 10);
        let big = alloc(&b, 900 << 10, 8);
        assert!(b.held() <= limit);
        assert!(b.contains(big.as_ptr() as usize));
        b.debug_check();
        // And a checkpoint taken on the empty kept chunk still rewinds.
        b.reset(&NoGpu);
        let cp = b.checkpoint();
        alloc(&b, 1000 << 10, 8);
        assert!(b.reaches(&cp));
        b.rewind(cp, &NoGpu);
        assert_eq!(b.used_bytes(), 0);
        b.debug_check();
    }

    #[test]
    fn a_failed_refill_leaves_the_current_chunk_current() {
        let b = Bump::new(
            HostSource,
            ArenaConfig::host()
                .with_first_chunk(PAGE_SIZE)
                .with_limit(2 * PAGE_SIZE),
        );
        let x = alloc(&b, 96, 8);
        assert!(b.alloc_slow(4 * PAGE_SIZE, 8, &NoGpu).is_err());
        b.debug_check();
        let y = alloc(&b, 96, 8);
        assert_eq!(
            x.as_ptr() as usize - y.as_ptr() as usize,
            96,
            "still bumping in the same chunk"
        );
        let e = Bump::new(
            HostSource,
            ArenaConfig::host()
                .with_first_chunk(PAGE_SIZE)
                .with_limit(PAGE_SIZE),
        );
        alloc(&e, 1, 1);
        let p = NonNull::new(e.ptr.get()).unwrap();
        // SAFETY: the block just allocated is the most recent.
        unsafe { e.dealloc(p, 1) };
        // Too large even after freeing the empty chunk to make room: it fails, and the
        // arena is empty and usable.
        assert!(e.alloc_slow(2 * PAGE_SIZE, 8, &NoGpu).is_err());
        e.debug_check();
        assert_eq!(e.held(), 0);
        alloc(&e, 8, 8);
        e.debug_check();
    }
}
