//! Per-thread caches of free blocks: the hot path. A hit pops a block from the calling
//! thread's bin for its size class: no lock, no atomic read-modify-write.
//!
//! - [`CacheCore`] is one thread's cache for one pool: a bounded bin per size class, a
//!   few large blocks, and counters published as single-writer atomics (a `Relaxed` load
//!   by `stats()`, a `Relaxed` store by the owner, never a read-modify-write). It is an
//!   algorithm core: the owner thread has `&mut` to it; the pool's shared lists take its
//!   blocks on a flush. Loom models drive it directly.
//! - The thread-local table holds one `CacheCore` per pool, indexed by a slot the pool
//!   takes at creation (64 slots: pools beyond go straight to the shared lists). Under
//!   loom it is loom's thread-local, so the models run this very code. Slots are recycled, so each entry also carries the pool's unique id and an
//!   `Arc` to its shared state: a stale entry is flushed to its own pool when its slot is
//!   reused, and every entry is flushed when its thread exits.

use super::size_class::class_size;
use super::BlockPtr;
use crate::sync::{Arc, AtomicU64, AtomicUsize, Ordering};
use crate::thread_registry::ThreadCounters;

/// Large blocks a thread keeps for one pool.
const LARGE_ENTRIES: usize = 4;
/// A thread reuses a cached large block (whole: a thread cache does not split) only if
/// it is at most this many times the request.
pub(crate) const REUSE_FACTOR: usize = 2;
/// Large blocks a thread remembers having handed out (so their size is known on free
/// without a lookup under the pool's lock); a power of two.
const LENT_ENTRIES: usize = 8;
const _: () = assert!(LENT_ENTRIES.is_power_of_two());

/// One thread's counters for one pool; written only by that thread, read by `stats()`.
/// Aligned to its own cache lines so threads do not false-share them.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct ThreadStats {
    /// Bytes of blocks in the thread's cache.
    pub(crate) cached_bytes: AtomicUsize,
    /// Blocks in the thread's cache.
    pub(crate) cached_blocks: AtomicUsize,
    /// Allocations served from the thread's cache.
    pub(crate) allocs: AtomicU64,
}

impl ThreadCounters for ThreadStats {
    fn served(&self) -> u64 {
        self.allocs.load(Ordering::Relaxed)
    }
}

struct Bin {
    /// Free blocks of the class, most recently freed last; room for `cap` of them
    /// allocated at the bin's first use ([`Bin::reserve`]), never grown afterwards.
    items: Vec<BlockPtr>,
    /// The most blocks the bin holds.
    cap: usize,
}

/// Allocates the room for every large block a cache may hold, after a flush took the
/// list (see [`Bin::reserve`]).
#[cold]
#[inline(never)]
fn reserve_large(large: &mut Vec<(BlockPtr, usize)>) -> bool {
    crate::count::bookkeeping(|| large.try_reserve_exact(LARGE_ENTRIES).is_ok())
}

impl Bin {
    /// Allocates the room for `cap` blocks (the bin's first use); false if the memory
    /// cannot be had (the block then goes to the pool's shared lists). The cache's own
    /// bookkeeping: it lives as long as the thread, so a leak check's window on this
    /// thread does not count it (`count::bookkeeping`).
    #[cold]
    #[inline(never)]
    fn reserve(&mut self) -> bool {
        crate::count::bookkeeping(|| self.items.try_reserve_exact(self.cap).is_ok())
    }
}

/// A cache's contents, taken out: (class, blocks) per class with any, and the large
/// blocks with their sizes.
pub(crate) type Flushed = (Vec<(usize, Vec<BlockPtr>)>, Vec<(BlockPtr, usize)>);

/// One thread's cache of free blocks for one pool.
pub(crate) struct CacheCore {
    bins: Box<[Bin]>,
    /// Cached large blocks (base == the pointer handed out), with their sizes.
    large: Vec<(BlockPtr, usize)>,
    /// Large blocks this thread handed out: (address, size, large epoch at the time);
    /// address 0 marks an empty entry. An entry is trusted only while the pool's large
    /// epoch is unchanged: the epoch moves whenever large blocks go back to the source,
    /// after which an address may come back as a block of another size.
    lent: [(usize, usize, u64); LENT_ENTRIES],
    // bytes == sum over bins of len * class size + sum of large sizes; bytes <= max_bytes
    bytes: usize,
    // blocks == sum over bins of len + large.len()
    blocks: usize,
    max_bytes: usize,
    allocs: u64,
    stats: Arc<ThreadStats>,
}

impl CacheCore {
    /// A cache with bins of the given capacities (one per class, in class order) and at
    /// most `max_bytes` bytes in all.
    pub(crate) fn new(caps: &[usize], max_bytes: usize, stats: Arc<ThreadStats>) -> Self {
        Self {
            bins: caps
                .iter()
                .map(|&cap| Bin {
                    items: Vec::new(),
                    cap,
                })
                .collect(),
            // Room for every large block it may hold, allocated at its first push.
            large: Vec::new(),
            lent: [(0, 0, 0); LENT_ENTRIES],
            bytes: 0,
            blocks: 0,
            max_bytes,
            allocs: 0,
            stats,
        }
    }

    /// The counters this cache publishes.
    pub(crate) fn stats(&self) -> &Arc<ThreadStats> {
        &self.stats
    }

    #[inline(always)]
    fn publish(&self) {
        self.stats.cached_bytes.store(self.bytes, Ordering::Relaxed);
        self.stats.cached_blocks.store(self.blocks, Ordering::Relaxed);
    }

    /// Whether the block at `addr` is in this cache (of `class`, or a large one).
    pub(crate) fn holds(&self, class: Option<usize>, addr: usize) -> bool {
        match class {
            Some(c) => self
                .bins
                .get(c)
                .is_some_and(|b| b.items.iter().any(|p| p.addr() == addr)),
            None => self.large.iter().any(|(p, _)| p.addr() == addr),
        }
    }

    /// Pops a free block of `class`: the allocation fast path.
    #[inline(always)]
    pub(crate) fn pop(&mut self, class: usize) -> Option<BlockPtr> {
        let p = self.bins[class].items.pop()?;
        self.bytes -= class_size(class);
        self.blocks -= 1;
        self.allocs += 1;
        self.stats.allocs.store(self.allocs, Ordering::Relaxed);
        self.publish();
        Some(p)
    }

    /// Pushes a freed block of `class` if the bin and the byte budget have room: the free
    /// fast path.
    #[inline(always)]
    pub(crate) fn push(&mut self, class: usize, p: BlockPtr) -> bool {
        let size = class_size(class);
        let bin = &mut self.bins[class];
        if bin.items.len() >= bin.cap || self.bytes + size > self.max_bytes {
            return false;
        }
        if bin.items.capacity() == 0 && !bin.reserve() {
            return false;
        }
        bin.items.push(p);
        self.bytes += size;
        self.blocks += 1;
        self.publish();
        true
    }

    /// How many blocks of `class` a refill should bring: half the bin.
    pub(crate) fn refill_count(&self, class: usize) -> usize {
        (self.bins[class].cap / 2).max(1)
    }

    /// Room left in the bin of `class`.
    pub(crate) fn room(&self, class: usize) -> usize {
        let bin = &self.bins[class];
        let by_bytes = (self.max_bytes - self.bytes) / class_size(class);
        (bin.cap - bin.items.len()).min(by_bytes)
    }

    /// Whether the bin of `class` has its room allocated (allocating it if not): false
    /// only when the memory for it cannot be had.
    pub(crate) fn has_bin(&mut self, class: usize) -> bool {
        let bin = &mut self.bins[class];
        bin.items.capacity() != 0 || bin.reserve()
    }

    /// Adds refilled blocks (at most [`CacheCore::room`] of them) to a bin that
    /// [`CacheCore::has_bin`] allocated.
    pub(crate) fn fill(&mut self, class: usize, blocks: impl Iterator<Item = BlockPtr>) {
        let bin = &mut self.bins[class];
        debug_assert!(
            bin.items.capacity() >= bin.cap,
            "a bin filled before its room was allocated"
        );
        let before = bin.items.len();
        bin.items.extend(blocks);
        let n = bin.items.len() - before;
        debug_assert!(
            bin.items.len() <= bin.cap,
            "bin over capacity: {} > {}",
            bin.items.len(),
            bin.cap
        );
        self.bytes += n * class_size(class);
        self.blocks += n;
        debug_assert!(
            self.bytes <= self.max_bytes,
            "cache over budget: {} > {}",
            self.bytes,
            self.max_bytes
        );
        self.publish();
    }

    /// Takes the older half (at least one) of the bin of `class`, for the shared list.
    pub(crate) fn take_half(&mut self, class: usize) -> Vec<BlockPtr> {
        let bin = &mut self.bins[class];
        let n = bin.items.len().div_ceil(2);
        let taken: Vec<BlockPtr> = bin.items.drain(..n).collect();
        self.bytes -= n * class_size(class);
        self.blocks -= n;
        self.publish();
        taken
    }

    /// Takes every cached large block, with its size.
    pub(crate) fn take_large_blocks(&mut self) -> Vec<(BlockPtr, usize)> {
        let large = core::mem::take(&mut self.large);
        for (_, size) in &large {
            self.bytes -= size;
        }
        self.blocks -= large.len();
        self.publish();
        large
    }

    /// Takes every block of every class (and every large block), leaving the cache empty.
    pub(crate) fn take_all(&mut self) -> Flushed {
        let small = self
            .bins
            .iter_mut()
            .enumerate()
            .filter(|(_, b)| !b.items.is_empty())
            .map(|(c, b)| (c, core::mem::take(&mut b.items)))
            .collect();
        let large = core::mem::take(&mut self.large);
        self.bytes = 0;
        self.blocks = 0;
        self.lent = [(0, 0, 0); LENT_ENTRIES];
        self.publish();
        (small, large)
    }

    /// Takes a cached large block of at least `need` bytes (and at most twice that) whose
    /// base is `align`-aligned: the one freed last if it fits (the common case of a buffer
    /// of one size allocated again and again, one test), else the smallest that fits.
    /// `align` is a `Layout`'s: a power of two, so the alignment test is a mask (a `%`
    /// by a run-time value is a division, a quarter of the whole hit's time).
    #[inline(always)]
    pub(crate) fn take_large(&mut self, need: usize, align: usize, epoch: u64) -> Option<(BlockPtr, usize)> {
        debug_assert!(align.is_power_of_two());
        let (bound, mask) = (need.saturating_mul(REUSE_FACTOR), align.wrapping_sub(1));
        let fits =
            move |&(p, size): &(BlockPtr, usize)| size >= need && size <= bound && p.addr() & mask == 0;
        let i = match self.large.last() {
            Some(last) if fits(last) => self.large.len() - 1,
            _ => self.take_large_index(fits)?,
        };
        let (p, size) = self.large.swap_remove(i);
        self.bytes -= size;
        self.blocks -= 1;
        self.allocs += 1;
        self.stats.allocs.store(self.allocs, Ordering::Relaxed);
        self.publish();
        self.lend(p.addr(), size, epoch);
        Some((p, size))
    }

    /// The smallest cached large block that `fits`, by index.
    #[cold]
    fn take_large_index(&self, fits: impl Fn(&(BlockPtr, usize)) -> bool) -> Option<usize> {
        let (i, _) = self
            .large
            .iter()
            .enumerate()
            .filter(|(_, e)| fits(e))
            .min_by_key(|(_, (_, size))| *size)?;
        Some(i)
    }

    /// The entry of `lent` for the large block at `addr` (page-aligned): a direct-mapped
    /// table, so that lending and the free's lookup are one index each. The page number
    /// is hashed (Fibonacci hashing, top bits of the product): its low bits alone would
    /// put blocks of one power-of-two size, handed out side by side, in one entry.
    #[inline(always)]
    fn lent_slot(addr: usize) -> usize {
        const BITS: u32 = LENT_ENTRIES.trailing_zeros();
        ((addr / super::PAGE_SIZE) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize
            >> (usize::BITS - BITS)
    }

    /// Remembers that this thread handed out the large block at `addr` of `size` bytes
    /// (forgetting a block that shares its entry: the pool's registry stays
    /// authoritative, and that block's free takes the shared path).
    #[inline(always)]
    pub(crate) fn lend(&mut self, addr: usize, size: usize, epoch: u64) {
        self.lent[Self::lent_slot(addr)] = (addr, size, epoch);
    }

    /// Caches a freed large block if this thread handed it out and it fits the budget.
    /// Returns false when the block must go to the pool's shared cache.
    #[inline(always)]
    pub(crate) fn push_large(&mut self, p: BlockPtr, epoch: u64) -> bool {
        let e = &mut self.lent[Self::lent_slot(p.addr())];
        if e.0 != p.addr() {
            return false;
        }
        let (size, lent_at) = (e.1, e.2);
        *e = (0, 0, 0);
        if lent_at != epoch || self.large.len() >= LARGE_ENTRIES || self.bytes + size > self.max_bytes {
            return false;
        }
        if self.large.capacity() == 0 && !reserve_large(&mut self.large) {
            return false;
        }
        self.large.push((p, size));
        self.bytes += size;
        self.blocks += 1;
        self.publish();
        true
    }
}

/// The thread-local table of caches, one per pool slot.
pub(crate) mod tls {
    use super::{CacheCore, ThreadStats};
    use crate::slot_table::{SlotBits, SlotEntry, SlotTable};
    use crate::sync::{thread_local_const, Arc};

    /// The shared state a cache flushes into: its pool's, type-erased.
    pub(crate) trait CacheOwner: Send + Sync {
        /// Moves every block of `core` to the pool's shared lists.
        fn flush_all(&self, core: &mut CacheCore);
        /// Merges the thread's counters into the pool's totals; they stop being read.
        fn retire(&self, stats: &Arc<ThreadStats>);
    }

    /// One thread's cache for one pool, with what it needs to flush itself.
    pub(crate) struct CacheEntry {
        pub(crate) uid: u64,
        pub(crate) core: CacheCore,
        pub(crate) owner: Box<dyn CacheOwner>,
    }

    impl Drop for CacheEntry {
        fn drop(&mut self) {
            self.owner.flush_all(&mut self.core);
            self.owner.retire(self.core.stats());
        }
    }

    impl SlotEntry for CacheEntry {
        fn uid(&self) -> u64 {
            self.uid
        }
    }

    thread_local_const! {
        static TABLE: SlotTable<CacheEntry> = SlotTable::new();
    }

    /// The slots of host pools (64: later ones, while 64 are alive, use shared lists).
    static SLOTS: SlotBits = SlotBits::new();

    /// Runs `f` on this thread's cache for the pool `uid` in `slot`, if there is one.
    /// `None` when the slot is empty or holds another pool's cache, or while the thread's
    /// locals are being destroyed.
    ///
    /// `f` must not reach the thread-local table again (it runs with `&mut` to the
    /// entry): callers pass closures that touch only the cache and the pool's shared
    /// lists, never a source, a user callback or another pool.
    #[inline(always)]
    pub(crate) fn with_entry<R>(slot: usize, uid: u64, f: impl FnOnce(&mut CacheCore) -> R) -> Option<R> {
        TABLE
            .try_with(|t| {
                // SAFETY: `f` does not reach the table (this function's contract, above).
                unsafe { t.with(slot, uid, |e| f(&mut e.core)) }
            })
            .ok()
            .flatten()
    }

    /// Puts `entry` in `slot` (or empties it) and returns what the caller must drop after
    /// this returns (dropping flushes into a pool and may free a pool): the previous
    /// entry, or `entry` itself while the thread's locals are being destroyed.
    pub(crate) fn swap(slot: usize, entry: Option<Box<CacheEntry>>) -> Option<Box<CacheEntry>> {
        let mut entry = Some(entry);
        let swapped = TABLE.try_with(|t| t.replace(slot, entry.take().flatten()));
        swapped.unwrap_or_else(|_| entry.flatten())
    }

    /// Whether this thread has a cache for pool `uid` in `slot`.
    pub(crate) fn has_entry(slot: usize, uid: u64) -> bool {
        with_entry(slot, uid, |_| ()).is_some()
    }

    /// Takes a free slot, if any.
    pub(crate) fn acquire_slot() -> Option<usize> {
        SLOTS.acquire()
    }

    /// Gives a slot back (its stale entries in other threads are found by their uid).
    pub(crate) fn release_slot(slot: usize) {
        SLOTS.release(slot);
    }
}
