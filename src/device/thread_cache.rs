//! Per-thread bins of free device blocks, keyed by (stream, size class): the hot path.
//!
//! A hit pops a block from the calling thread's bin for its stream and class: no lock, no
//! atomic read-modify-write, no CUDA call. Stream order makes it safe: a block in the bin
//! of stream S was freed on S after every use of it was queued there, so work queued on S
//! after the new allocation runs after those uses.
//!
//! A [`ThreadCache`] is an algorithm core: its owner thread has `&mut` to it (through the
//! thread-local table of `local.rs`, or directly in CPU tests and loom models), and the
//! shared cache (`cache.rs`) takes its blocks when it overflows, when the thread exits,
//! and when [`ThreadStats::reclaim`] asks for them.
//!
//! Every buffer owns a handle of its stream and of its pool (`Arc`s: cloning one is an
//! atomic increment). A block freed into a bin keeps the handles of the buffer that freed
//! it, and the next buffer to take the block takes them too: a steady allocate/free cycle
//! moves handles and never touches a reference count. Blocks that reach a bin from the
//! shared lists carry no handles (the buffer that takes one clones its own).
//!
//! Handles in the bins are never the last of their stream or pool (the stream's entry in
//! the table holds its own, and every slow path's caller holds a handle of the pool), so
//! the slow paths here drop them freely: no drop in this file destroys a stream or a
//! pool. The thread's table entry holds the pool only weakly: when the program has
//! dropped every handle, the pool's collection takes the bins (`close.rs`).

mod published;
mod slow;

pub(crate) use published::ThreadStats;

use super::order::StreamOrder;
use super::size_class::class_size;
use crate::cuda::StreamId;
use crate::sync::{Arc, Ordering};

/// Streams a thread keeps bins for; a further stream evicts the one holding least.
pub(crate) const MAX_STREAMS: usize = 8;
/// The most blocks one bin keeps.
const MAX_BIN: usize = 64;
/// The most large blocks (not cached by class: the page heap's) a thread keeps for reuse
/// at the same size.
pub(crate) const LARGE_SLOTS: usize = 4;
/// Large misses in a row (no slot served them) after which the thread stops keeping large
/// blocks: sizes that do not repeat would only hold memory the heap could give to any
/// size. A miss for a size the thread freed lately (a ghost) starts keeping them again.
const LARGE_COLD: u32 = 8;

const _: () = assert!(MAX_STREAMS.is_power_of_two(), "slot indices are masked");

/// The handles a freed buffer leaves with its block: its stream's and its pool's.
pub(crate) type Handles<B, P> = (<B as StreamOrder>::Stream, P);

/// A bin entry's two handle fields as the pair they are (both or neither). Written out
/// rather than `Option::zip`, which the compiler left out of line in one of two pools
/// that share this code (19 instructions and a call per hit; callgrind, 2026-12-05).
#[inline(always)]
fn both<S, P>(stream: Option<S>, pool: Option<P>) -> Option<(S, P)> {
    match (stream, pool) {
        (Some(s), Some(p)) => Some((s, p)),
        _ => None,
    }
}

/// The two fields of a bin entry from a pair of handles ([`both`]'s inverse), written out
/// for the same reason.
#[inline(always)]
fn split<S, P>(handles: Option<(S, P)>) -> (Option<S>, Option<P>) {
    match handles {
        Some((s, p)) => (Some(s), Some(p)),
        None => (None, None),
    }
}

/// A block in a bin, with the handles of the buffer that freed it, if any: both or
/// neither. The handles are two fields rather than one `Option` of a pair, so that each
/// is moved as the word it is (see [`Bin::pop`]).
struct Entry<B: StreamOrder, P> {
    ptr: u64,
    stream: Option<B::Stream>,
    pool: Option<P>,
}

/// Free blocks of one class of one stream, most recently freed last.
struct Bin<B: StreamOrder, P> {
    /// Each block with the handles of the buffer that freed it, if any. Its capacity is
    /// the bin's (allocated at the first block, by a slow path): `len < capacity` is the
    /// fast path's test for room.
    entries: Vec<Entry<B, P>>,
    /// The class's block size.
    size: usize,
}

impl<B: StreamOrder, P> Bin<B, P> {
    /// Takes the newest block. Its fields are read one by one, as `push_within_capacity`
    /// writes them: a read as wide as two earlier stores cannot be forwarded from the
    /// store buffer and waits for them to reach the cache (a dozen cycles on the hit,
    /// where the block was pushed a few dozen instructions earlier).
    #[inline(always)]
    fn pop(&mut self) -> Option<(u64, Option<Handles<B, P>>)> {
        let n = self.entries.len().checked_sub(1)?;
        // SAFETY: `n < len`: the entry is initialized; `set_len(n)` first gives up the
        // vector's claim on it, so the reads below move it out exactly once.
        unsafe {
            self.entries.set_len(n);
            let e = self.entries.as_ptr().add(n);
            let ptr = core::ptr::addr_of!((*e).ptr).read();
            let stream = core::ptr::addr_of!((*e).stream).read();
            let pool = core::ptr::addr_of!((*e).pool).read();
            Some((ptr, both(stream, pool)))
        }
    }

    /// Keeps a block with its handles; the caller checked `len < capacity`.
    #[inline(always)]
    fn push_within_capacity(&mut self, ptr: u64, handles: Option<Handles<B, P>>) {
        let n = self.entries.len();
        debug_assert!(n < self.entries.capacity(), "bin full");
        let (stream, pool) = split(handles);
        // SAFETY: `n < capacity` (checked by the caller, `put`): the slot is allocated
        // and uninitialized; every field is written before `set_len` counts it.
        unsafe {
            let e = self.entries.as_mut_ptr().add(n);
            core::ptr::addr_of_mut!((*e).ptr).write(ptr);
            core::ptr::addr_of_mut!((*e).stream).write(stream);
            core::ptr::addr_of_mut!((*e).pool).write(pool);
            self.entries.set_len(n + 1);
        }
    }
}

/// What a thread cache gives back to the shared cache: a stream's handle, its blocks by
/// class, and its large blocks (address, bytes) for the backend.
pub(crate) struct Evicted<B: StreamOrder> {
    pub(crate) stream: B::Stream,
    pub(crate) blocks: Vec<(usize, Vec<u64>)>,
    pub(crate) large: Vec<(u64, usize)>,
}

/// A large block freed into the thread's cache: reused only by an allocation of the same
/// block size on the same stream (no rounding to a class, so it holds no memory that its
/// request did not ask for), and given back to the backend at the thread's next
/// allocation of a large block that it does not serve, so that it holds memory only
/// between a free and the next miss.
struct Large<B: StreamOrder, P> {
    ptr: u64,
    bytes: usize,
    /// The slot of its stream.
    slot: usize,
    /// The handles of the buffer that freed it (none from a slow path): both or neither,
    /// two fields as in [`Entry`].
    stream: Option<B::Stream>,
    pool: Option<P>,
}

/// One thread's cache of free blocks for one pool. `P` is the pool handle buffers own.
///
/// Laid out for the hot path's chain of loads: the stream ids sit in the cache itself,
/// and the bins of every stream in one array, so a hit reads the table entry, the bin,
/// and the block.
pub(crate) struct ThreadCache<B: StreamOrder, P> {
    /// The stream in each slot (`None`: the slot is free). Slot `i` has the bins
    /// `bins[i * classes..(i + 1) * classes]` and publishes to `stats.slots[i]`.
    ids: [Option<StreamId>; MAX_STREAMS],
    /// The slot used last, tried first.
    last: usize,
    /// The bins of the slots made so far (grown a slot at a time).
    bins: Vec<Bin<B, P>>,
    /// Classes held (`0..classes`).
    classes: usize,
    /// A live handle of each slot's stream (to record a mark on it when another stream
    /// takes its blocks, and to free them to the driver in its order).
    streams: [Option<B::Stream>; MAX_STREAMS],
    /// The most blocks each class's bin keeps.
    caps: Box<[u32]>,
    /// Large blocks, most recently freed last (at most [`LARGE_SLOTS`]); counted in their
    /// slot's bytes and blocks like the bins'.
    large: Vec<Large<B, P>>,
    /// Large misses in a row ([`LARGE_COLD`]).
    large_misses: u32,
    /// The (stream, size) of the last large blocks freed while not kept.
    ghosts: [(Option<StreamId>, usize); LARGE_SLOTS],
    ghost_next: usize,
    // bytes == sum over bins of len * size == sum over slots of stats.slots[i].bytes;
    // bytes <= max_bytes
    bytes: usize,
    max_bytes: usize,
    hits: u64,
    /// The owner's copies of `stats.takes` and `stats.bare`.
    takes: u64,
    bare: u64,
    /// The published counters; the per-slot byte and block counts live only there (the
    /// owner is their one writer).
    stats: Arc<ThreadStats>,
}

impl<B: StreamOrder, P> ThreadCache<B, P> {
    /// An empty cache holding classes `0..caps.len()` (bin `c` at most `caps[c]` blocks)
    /// and at most `max_bytes` bytes.
    pub(crate) fn new(caps: Box<[u32]>, max_bytes: usize, stats: Arc<ThreadStats>) -> Self {
        Self {
            ids: [None; MAX_STREAMS],
            last: 0,
            bins: Vec::new(),
            classes: caps.len(),
            streams: [const { None }; MAX_STREAMS],
            caps,
            large: Vec::with_capacity(LARGE_SLOTS),
            large_misses: 0,
            ghosts: [(None, 0); LARGE_SLOTS],
            ghost_next: 0,
            bytes: 0,
            max_bytes,
            hits: 0,
            takes: 0,
            bare: 0,
            stats,
        }
    }

    /// The bin capacities for a cache of `max_bytes` holding classes up to `max_class`:
    /// a bin holds at most an eighth of the budget (at least one block) and 64 blocks.
    pub(crate) fn caps_for(max_class: usize, max_bytes: usize) -> Box<[u32]> {
        (0..=max_class)
            .map(|c| (max_bytes / 8 / class_size(c)).clamp(1, MAX_BIN) as u32)
            .collect()
    }

    /// The counters this cache publishes.
    pub(crate) fn stats(&self) -> &Arc<ThreadStats> {
        &self.stats
    }

    /// Bytes of free blocks in the cache.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether another thread asked for this cache's blocks.
    #[inline(always)]
    pub(crate) fn reclaim_requested(&self) -> bool {
        self.stats.reclaim.load(Ordering::Relaxed)
    }

    /// Whether the cache holds blocks of `class` at all.
    #[inline(always)]
    pub(crate) fn holds_class(&self, class: usize) -> bool {
        class < self.caps.len()
    }

    /// The slot of stream `id`: the one used last, else (with `SEARCH`) a search.
    #[inline(always)]
    fn find<const SEARCH: bool>(&mut self, id: StreamId) -> Option<usize> {
        let last = self.last & (MAX_STREAMS - 1);
        if self.ids[last] == Some(id) {
            return Some(last);
        }
        if SEARCH {
            self.search(id)
        } else {
            None
        }
    }

    #[cold]
    #[inline(never)]
    fn search(&mut self, id: StreamId) -> Option<usize> {
        let i = self.ids.iter().position(|&s| s == Some(id))?;
        self.last = i;
        Some(i)
    }

    /// The bin of `class` of slot `i` (a class this cache holds, a slot made).
    #[inline(always)]
    fn bin(&mut self, i: usize, class: usize) -> Option<&mut Bin<B, P>> {
        if class >= self.classes {
            return None;
        }
        self.bins.get_mut(i * self.classes + class)
    }

    /// The bin of `class` of slot `i`, `i` a slot [`find`](Self::find) returned (the hot
    /// paths): its bins are made with it (`entry`), so only the class is checked.
    #[inline(always)]
    fn found_bin(&mut self, i: usize, class: usize) -> Option<&mut Bin<B, P>> {
        if class >= self.classes {
            return None;
        }
        let k = i * self.classes + class;
        debug_assert!(k < self.bins.len(), "slot {i} has no bins");
        // SAFETY: slot `i` holds a stream (`find` found it), and `entry` made the bins of
        // slots `0..=i` before it put the stream there; `bins` never shrinks. So
        // `k < (i + 1) * classes <= bins.len()`.
        Some(unsafe { self.bins.get_unchecked_mut(k) })
    }

    /// Adds `blocks` blocks of `size` bytes each (negative: removes) to slot `i`'s
    /// published counts.
    #[inline(always)]
    fn count(&mut self, i: usize, blocks: isize, size: usize) {
        let bytes = blocks * size as isize;
        self.bytes = self.bytes.wrapping_add_signed(bytes);
        let slot = &self.stats.slots[i & (MAX_STREAMS - 1)];
        let (b, n) = (
            slot.bytes.load(Ordering::Relaxed),
            slot.blocks.load(Ordering::Relaxed),
        );
        slot.bytes
            .store(b.wrapping_add_signed(bytes as i64), Ordering::Relaxed);
        // Release: a collection that reads the count sees the bins as they were when it
        // was published (a plain `mov` on x86-64).
        slot.blocks
            .store(n.wrapping_add_signed(blocks as i64), Ordering::Release);
    }

    /// A slow path's removal of `blocks` blocks (`bare` of them without handles) of
    /// `size` bytes from slot `i`: published (`takes` first) before the caller drops
    /// their handles.
    pub(super) fn count_taken(&mut self, i: usize, blocks: usize, bare: usize, size: usize) {
        if blocks == 0 {
            return;
        }
        self.takes += 1;
        self.stats.takes.store(self.takes, Ordering::Relaxed);
        self.count(i, -(blocks as isize), size);
        self.add_bare(-(bare as i64));
    }

    /// Adds `n` (negative: removes) to the blocks without handles.
    #[inline(always)]
    fn add_bare(&mut self, n: i64) {
        if n != 0 {
            self.bare = self.bare.wrapping_add_signed(n);
            self.stats.bare.store(self.bare, Ordering::Relaxed);
        }
    }

    /// Bytes of free blocks of slot `i`.
    fn slot_bytes(&self, i: usize) -> usize {
        self.stats.slots[i].bytes.load(Ordering::Relaxed) as usize
    }

    /// The allocation fast path: a free block of `class` freed on stream `id`, with the
    /// handles of the buffer that freed it if it left them. `None` on a miss, or when
    /// another thread asked for the blocks.
    #[inline(always)]
    pub(crate) fn pop(&mut self, id: StreamId, class: usize) -> Option<(u64, Option<Handles<B, P>>)> {
        if self.reclaim_requested() {
            return None;
        }
        let i = self.find::<true>(id)?;
        let bin = self.found_bin(i, class)?;
        let (ptr, handles) = bin.pop()?;
        let size = bin.size;
        self.hits += 1;
        self.stats.hits.store(self.hits, Ordering::Relaxed);
        self.count(i, -1, size);
        if handles.is_none() {
            self.add_bare(-1);
        }
        Some((ptr, handles))
    }

    /// The free fast path: keeps a freed block of `class` of stream `id` with the freed
    /// buffer's handles. Gives the handles back when the block does not fit (unknown
    /// stream, bin full or not yet allocated, over budget): the caller takes the slow
    /// path. A reclaim request is read *after* the push, by the caller
    /// ([`reclaim_requested`](Self::reclaim_requested)): the push is published first, so
    /// that a pool's close, which raises the flag and then reads the counts, sees either
    /// the block or its flag read by this thread (`close.rs`). Without `SEARCH`, only
    /// into the slot of the stream used last (no search, so no call: the free's common
    /// case, which leaves any other to a push with the search).
    #[inline(always)]
    pub(crate) fn push<const SEARCH: bool>(
        &mut self,
        id: StreamId,
        class: usize,
        ptr: u64,
        stream: B::Stream,
        pool: P,
    ) -> Result<(), Handles<B, P>> {
        let Some(i) = self.find::<SEARCH>(id) else {
            return Err((stream, pool));
        };
        let room = self.max_bytes - self.bytes;
        let Some(bin) = self.found_bin(i, class) else {
            return Err((stream, pool));
        };
        let size = bin.size;
        if bin.entries.len() >= bin.entries.capacity() || size > room {
            return Err((stream, pool));
        }
        bin.push_within_capacity(ptr, Some((stream, pool)));
        self.count(i, 1, size);
        Ok(())
    }

    /// The allocation fast path of a large block: one of `bytes` freed on stream `id`,
    /// with its buffer's handles. `None` on a miss, or when another thread asked for the
    /// blocks.
    #[inline(always)]
    pub(crate) fn pop_large(&mut self, id: StreamId, bytes: usize) -> Option<(u64, Option<Handles<B, P>>)> {
        if self.reclaim_requested() {
            return None;
        }
        let i = self.find::<true>(id)?;
        let k = self.large.iter().rposition(|l| l.bytes == bytes && l.slot == i)?;
        let taken = self.take_large_at(k);
        self.large_misses = 0;
        self.hits += 1;
        self.stats.hits.store(self.hits, Ordering::Relaxed);
        self.count(i, -1, bytes);
        if taken.1.is_none() {
            self.add_bare(-1);
        }
        Some(taken)
    }

    /// Takes large block `k` (`swap_remove`, its fields read one by one as
    /// `push_large` writes them: see `Bin::pop`). In a steady cycle `k` is the last.
    #[inline(always)]
    fn take_large_at(&mut self, k: usize) -> (u64, Option<Handles<B, P>>) {
        let n = self.large.len() - 1;
        debug_assert!(k <= n, "large slot {k} of {}", n + 1);
        // SAFETY: `k <= n < len` (the caller found entry `k`): entry `k` is initialized.
        // `set_len(n)` gives up the vector's claim on entry `n`; entry `k` is moved out
        // by the reads, and entry `n`, when another, moved into its place, so every
        // entry below `n` is initialized and none is owned twice.
        unsafe {
            let base = self.large.as_mut_ptr();
            let e = base.add(k);
            let ptr = core::ptr::addr_of!((*e).ptr).read();
            let stream = core::ptr::addr_of!((*e).stream).read();
            let pool = core::ptr::addr_of!((*e).pool).read();
            if k != n {
                core::ptr::copy_nonoverlapping(base.add(n), e, 1);
            }
            self.large.set_len(n);
            (ptr, both(stream, pool))
        }
    }

    /// The free fast path of a large block of `bytes` of stream `id`: kept with the
    /// buffer's handles (`None` from a slow path) while the stream has a slot, a large
    /// slot is free and the budget has room; else the handles come back (the caller
    /// takes the slow path).
    #[inline(always)]
    pub(crate) fn push_large(
        &mut self,
        id: StreamId,
        bytes: usize,
        ptr: u64,
        handles: Option<Handles<B, P>>,
    ) -> Result<(), Option<Handles<B, P>>> {
        if self.large_misses >= LARGE_COLD {
            self.ghosts[self.ghost_next % LARGE_SLOTS] = (Some(id), bytes);
            self.ghost_next = self.ghost_next.wrapping_add(1);
            return Err(handles);
        }
        if self.large.len() >= LARGE_SLOTS || bytes > self.max_bytes - self.bytes {
            return Err(handles);
        }
        let Some(i) = self.find::<true>(id) else {
            return Err(handles);
        };
        let n = self.large.len();
        debug_assert!(n < self.large.capacity(), "large slots allocated at LARGE_SLOTS");
        let bare = handles.is_none();
        let (stream, pool) = split(handles);
        // SAFETY: `n < LARGE_SLOTS` (checked above) and the vector is made with that
        // capacity and never shrunk: entry `n` is allocated and uninitialized. Its fields
        // are written one by one (see `Bin::pop`) before `set_len` counts it.
        unsafe {
            let e = self.large.as_mut_ptr().add(n);
            core::ptr::addr_of_mut!((*e).ptr).write(ptr);
            core::ptr::addr_of_mut!((*e).bytes).write(bytes);
            core::ptr::addr_of_mut!((*e).slot).write(i);
            core::ptr::addr_of_mut!((*e).stream).write(stream);
            core::ptr::addr_of_mut!((*e).pool).write(pool);
            self.large.set_len(n + 1);
        }
        if bare {
            self.add_bare(1);
        }
        self.count(i, 1, bytes);
        Ok(())
    }

    /// Notes a large allocation of `bytes` on stream `id` that no slot served: one more
    /// miss in a row, or, for a size the thread freed lately without keeping it, a reason
    /// to keep large blocks again.
    pub(crate) fn large_missed(&mut self, id: StreamId, bytes: usize) {
        if self.ghosts.contains(&(Some(id), bytes)) {
            self.large_misses = 0;
            self.ghosts = [(None, 0); LARGE_SLOTS];
        } else {
            self.large_misses = self.large_misses.saturating_add(1);
        }
    }

    /// Whether the large slots are all taken.
    pub(crate) fn large_full(&self) -> bool {
        self.large.len() >= LARGE_SLOTS
    }

    /// Takes the large blocks of slot `i` (every slot: `None`), dropping their handles;
    /// each with a handle of its stream.
    pub(crate) fn take_large(&mut self, i: Option<usize>) -> Vec<(B::Stream, u64, usize)> {
        let mut out = Vec::new();
        let mut k = 0;
        while k < self.large.len() {
            let slot = self.large[k].slot;
            let stream = match &self.streams[slot] {
                Some(s) if i.is_none_or(|i| slot == i) => s.clone(),
                _ => {
                    k += 1;
                    continue;
                }
            };
            let l = self.large.remove(k);
            self.count_taken(slot, 1, usize::from(l.pool.is_none()), l.bytes);
            out.push((stream, l.ptr, l.bytes));
            drop(l); // its handles, after the removal was published
        }
        out
    }

    /// The large blocks of slot `i`, as an eviction carries them.
    fn evict_large(&mut self, i: usize) -> Vec<(u64, usize)> {
        self.take_large(Some(i))
            .into_iter()
            .map(|(_, p, b)| (p, b))
            .collect()
    }

    /// Puts a block of `class` into the bins of slot `i`, taking `handles` with it, if its
    /// bin (allocated) and the budget have room; false (`handles` untouched) if not.
    #[inline(always)]
    fn put(&mut self, i: usize, class: usize, ptr: u64, handles: &mut Option<Handles<B, P>>) -> bool {
        let room = self.max_bytes - self.bytes;
        let Some(bin) = self.bin(i, class) else {
            return false;
        };
        let size = bin.size;
        if bin.entries.len() >= bin.entries.capacity() || size > room {
            return false;
        }
        let handles = handles.take();
        let bare = handles.is_none();
        bin.push_within_capacity(ptr, handles);
        if bare {
            self.add_bare(1);
        }
        self.count(i, 1, size);
        true
    }
}
