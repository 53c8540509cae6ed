//! The numbers behind [`Counting`](super::Counting): one shard of counters per thread,
//! written by that thread alone and summed when read, so the hot path of an allocation
//! is a handful of plain loads and stores, with no locked instruction; and the
//! [`Snapshot`] and [`Delta`] they are read as, with the leak verdict on a delta.

use core::fmt;
use core::ops::Sub;

use crate::sync::{AtomicU64, Ordering::Relaxed};

/// Threads that get a private shard at a time; later threads share one, with atomic
/// read-modify-writes. A thread gives its shard back when it exits.
pub(crate) const SHARDS: usize = if cfg!(loom) { 2 } else { 16 };

/// The most net bytes a shard keeps to itself before adding them to the shared live
/// total that `peak_bytes` is taken from, at first; see [`Counters`] for what this bounds.
pub(crate) const PEAK_SLACK: u64 = if cfg!(loom) { 8 } else { 4096 };

/// The most a shard's slack grows to: a block larger than the slack would otherwise
/// add to the shared total (a locked instruction on a line every thread writes) at each
/// of its allocations and frees.
pub(crate) const MAX_SLACK: u64 = if cfg!(loom) { 16 } else { 1 << 30 };

/// Counters of one thread (or, for [`Counters::shared`], of every thread without a
/// shard of its own).
///
/// Invariant: a private shard is written only by the thread that holds its slot, so an
/// update is `store(load() + d)`; the slot handoff (release when a thread exits,
/// acquire when the next one claims it) orders one owner's writes before the next's.
/// The shared shard is written with `fetch_add` by any number of threads.
///
/// The shard's *pending* bytes (its net change not yet added to `Counters::committed`)
/// are not a counter of their own: they are `bytes_allocated - bytes_freed - mark`, so an
/// allocation or a free writes two words (its count and its bytes), not three, and no
/// store of one operation feeds the next one's arithmetic through memory but its own
/// counter's (the free's pending reads the allocation's bytes only for a comparison).
#[cfg_attr(not(loom), repr(align(128)))] // two cache lines: no false sharing between owners
#[derive(Debug)]
struct Shard {
    allocs: AtomicU64,
    frees: AtomicU64,
    reallocs: AtomicU64,
    bytes_allocated: AtomicU64,
    bytes_freed: AtomicU64,
    /// Sum of `new - old` over reallocations that grew a block.
    bytes_grown: AtomicU64,
    /// `bytes_allocated - bytes_freed` (wrapping) when the shard last committed: its
    /// pending bytes are what moved since, `|pending| <= slack` between operations.
    /// Always 0 in the shared shard, which commits every change.
    mark: AtomicU64,
    /// How far `pending` may stray from 0: `PEAK_SLACK`, raised (up to `MAX_SLACK`) to
    /// the size of any larger single change this shard committed.
    slack: AtomicU64,
    /// `-slack` (an `i64`), kept beside it so that a free's fast path is one comparison.
    floor: AtomicU64,
}

macro_rules! shard_new {
    ($($kw:ident)?) => {
        $($kw)? fn new() -> Self {
            Self {
                allocs: AtomicU64::new(0),
                frees: AtomicU64::new(0),
                reallocs: AtomicU64::new(0),
                bytes_allocated: AtomicU64::new(0),
                bytes_freed: AtomicU64::new(0),
                bytes_grown: AtomicU64::new(0),
                mark: AtomicU64::new(0),
                slack: AtomicU64::new(PEAK_SLACK),
                floor: AtomicU64::new(PEAK_SLACK.wrapping_neg()),
            }
        }
    };
}

impl Shard {
    #[cfg(not(loom))]
    shard_new!(const);
    #[cfg(loom)]
    shard_new!();

    /// The pending bytes (an `i64`) if the totals were `allocated` and `freed`.
    #[inline(always)]
    fn pending_at(&self, allocated: u64, freed: u64) -> i64 {
        allocated
            .wrapping_sub(freed)
            .wrapping_sub(self.mark.load(Relaxed)) as i64
    }

    /// The pending bytes now (read by the owner).
    #[inline(always)]
    fn pending(&self) -> i64 {
        self.pending_at(self.bytes_allocated.load(Relaxed), self.bytes_freed.load(Relaxed))
    }
}

/// Adds `d` to a counter that only the calling thread writes: a load and a store, no
/// locked instruction (Relaxed: the value publishes no other memory).
#[inline(always)]
fn add_owned(counter: &AtomicU64, d: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(d), Relaxed);
}

/// The counters of one [`Counting`](super::Counting) allocator: totals of allocations,
/// frees, reallocations, failures and bytes, and the peak of live bytes. What a reader
/// can rely on (exact totals, an approximate peak under concurrency) is documented on
/// `Counting`, under "Precision".
///
/// Every counter is a Relaxed atomic: they are statistics, and nothing else in memory is
/// published through them. A reader that needs exact numbers (a leak check after
/// `join`) gets them from the happens-before edge that the join (or any other
/// synchronization) already provides.
#[derive(Debug)]
pub(crate) struct Counters {
    shards: [Shard; SHARDS],
    shared: Shard,
    /// Sum of the net bytes the shards have pushed out of `pending` (an `i64`):
    /// `live_bytes == committed + sum(shard.pending)`.
    committed: AtomicU64,
    /// The highest `committed + pending` any allocation saw.
    peak: AtomicU64,
    /// `peak - committed`, less [`BLOCKED`] while any [`Counters::block_fast_path`] is in
    /// force (an `i64`): how far a thread's `pending` may rise before its estimate of
    /// live bytes (`committed + pending`) sets a new peak. Kept by the same deltas that
    /// change `committed` and `peak` (so it converges to the exact value whatever the
    /// interleaving), so that an allocation's fast path reads one shared word, in a line
    /// written only at commits and new peaks, instead of two and a sum.
    room: AtomicU64,
    /// [`Counters::block_fast_path`]s in force: only the first takes [`BLOCKED`] off the
    /// room and only the last gives it back (one `BLOCKED` per block wrapped the room
    /// round to a large positive value at three at once, opening the fast path).
    blocks: AtomicU64,
    failures: AtomicU64,
}

/// What [`Counters::block_fast_path`] takes off [`Counters::room`]: more than any byte
/// count can make up, so that while it is in force every allocation takes the full path.
const BLOCKED: u64 = 1 << 62;

macro_rules! counters_new {
    ($($kw:ident)?, $shards:expr) => {
        /// Counters at zero.
        pub(crate) $($kw)? fn new() -> Self {
            Self {
                shards: $shards,
                shared: Shard::new(),
                committed: AtomicU64::new(0),
                peak: AtomicU64::new(0),
                room: AtomicU64::new(0),
                blocks: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            }
        }
    };
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}

impl Counters {
    #[cfg(not(loom))]
    counters_new!(const, [const { Shard::new() }; SHARDS]);
    #[cfg(loom)]
    counters_new!(, core::array::from_fn(|_| Shard::new()));

    /// The counters now: sums over every thread's shard, each true at some moment but
    /// not all at the same moment while other threads allocate (so the live bytes, and
    /// the peak taken from them, may briefly include blocks never live together).
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for shard in self.shards.iter().chain(core::iter::once(&self.shared)) {
            s.allocs = s.allocs.wrapping_add(shard.allocs.load(Relaxed));
            s.frees = s.frees.wrapping_add(shard.frees.load(Relaxed));
            s.reallocs = s.reallocs.wrapping_add(shard.reallocs.load(Relaxed));
            s.bytes_allocated = s
                .bytes_allocated
                .wrapping_add(shard.bytes_allocated.load(Relaxed));
            s.bytes_freed = s.bytes_freed.wrapping_add(shard.bytes_freed.load(Relaxed));
            s.bytes_grown = s.bytes_grown.wrapping_add(shard.bytes_grown.load(Relaxed));
        }
        s.failures = self.failures.load(Relaxed);
        // The peak is never below what is live now (this also settles the slack).
        s.peak_bytes = self.peak.load(Relaxed).max(s.live_bytes());
        s
    }

    /// The fast path's room, and what it must equal once the threads are joined
    /// (`peak - committed`, less [`BLOCKED`] while blocked): tests.
    #[cfg(test)]
    pub(crate) fn room_now(&self) -> i64 {
        self.room.load(Relaxed) as i64
    }

    #[cfg(test)]
    pub(crate) fn room_exact(&self) -> i64 {
        (self.peak.load(Relaxed) as i64).wrapping_sub(self.committed.load(Relaxed) as i64)
    }

    /// Allocations counted on private shards (tests of the slot handoff).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn shards_written(&self) -> u64 {
        self.shards.iter().map(|s| s.allocs.load(Relaxed)).sum()
    }

    /// Counts an allocation of `size` bytes by the thread holding `slot` (any value
    /// `>= SHARDS` means the shared shard).
    #[inline(always)]
    pub(crate) fn record_alloc(&self, slot: usize, size: u64) {
        match self.shards.get(slot) {
            Some(shard) => {
                add_owned(&shard.allocs, 1);
                add_owned(&shard.bytes_allocated, size);
                let live = self.settle(shard, size);
                self.note_peak(live);
            }
            None => self.record_alloc_shared(size),
        }
    }

    /// The common case of [`Counters::record_alloc`], all or nothing: counts the
    /// allocation and returns `true` if the thread holds private shard `slot`, its
    /// pending bytes stay within its slack, its estimate of live bytes sets no new
    /// peak (nothing to commit, no shared line to write) and no `ProcessWindow` is open
    /// (both read from the room); otherwise writes nothing and
    /// returns `false`, for the caller to take [`Counters::record_alloc`].
    ///
    /// What it writes (two plain stores to the thread's own shard) is what
    /// `record_alloc` writes in that case, so the counts are the same either way.
    #[inline(always)]
    pub(crate) fn try_record_alloc(&self, slot: usize, size: u64) -> bool {
        let Some(shard) = self.shards.get(slot) else {
            return false;
        };
        // `size` is a live block's (below 2^63 less the slack): no overflow. Within the
        // room, `committed + pending <= peak`: no new peak.
        let allocated = shard.bytes_allocated.load(Relaxed).wrapping_add(size);
        let pending = shard.pending_at(allocated, shard.bytes_freed.load(Relaxed));
        if pending > shard.slack.load(Relaxed) as i64 || pending > self.room.load(Relaxed) as i64 {
            return false;
        }
        shard.bytes_allocated.store(allocated, Relaxed);
        add_owned(&shard.allocs, 1);
        true
    }

    /// The common case of [`Counters::record_free`], all or nothing (see
    /// [`Counters::try_record_alloc`]): `false`, having written nothing, where the free
    /// would take the pending bytes below the slack (a commit).
    #[inline(always)]
    pub(crate) fn try_record_free(&self, slot: usize, size: u64) -> bool {
        let Some(shard) = self.shards.get(slot) else {
            return false;
        };
        let freed = shard.bytes_freed.load(Relaxed).wrapping_add(size);
        let pending = shard.pending_at(shard.bytes_allocated.load(Relaxed), freed);
        if pending < shard.floor.load(Relaxed) as i64 {
            return false;
        }
        shard.bytes_freed.store(freed, Relaxed);
        add_owned(&shard.frees, 1);
        true
    }

    /// Counts a free of `size` bytes (see [`Counters::record_alloc`] for `slot`).
    #[inline(always)]
    pub(crate) fn record_free(&self, slot: usize, size: u64) {
        match self.shards.get(slot) {
            Some(shard) => {
                add_owned(&shard.frees, 1);
                add_owned(&shard.bytes_freed, size);
                self.settle_down(shard, size);
            }
            None => self.record_free_shared(size),
        }
    }

    /// Counts a reallocation from `old` to `new` bytes: one realloc; `old` bytes freed and
    /// `new` allocated, so `live_bytes == bytes_allocated - bytes_freed` holds; and, when
    /// it grew, `new - old` bytes grown.
    #[inline(always)]
    pub(crate) fn record_realloc(&self, slot: usize, old: u64, new: u64) {
        match self.shards.get(slot) {
            Some(shard) => {
                add_owned(&shard.reallocs, 1);
                add_owned(&shard.bytes_allocated, new);
                add_owned(&shard.bytes_freed, old);
                let live = self.settle(shard, new.abs_diff(old));
                if new > old {
                    add_owned(&shard.bytes_grown, new - old);
                    self.note_peak(live);
                }
            }
            None => self.record_realloc_shared(old, new),
        }
    }

    /// Counts a request the inner allocator refused.
    #[cold]
    pub(crate) fn record_failure(&self) {
        self.failures.fetch_add(1, Relaxed);
    }

    /// Pushes the shard's pending bytes (its totals already count the change, of `size`
    /// bytes either way) to `committed` once they leave `[-slack, slack]`; returns this
    /// thread's estimate of live bytes.
    #[inline(always)]
    fn settle(&self, shard: &Shard, size: u64) -> i64 {
        let pending = shard.pending();
        if pending.unsigned_abs() <= shard.slack.load(Relaxed) {
            (self.committed.load(Relaxed) as i64).wrapping_add(pending)
        } else {
            self.commit(shard, pending, size)
        }
    }

    /// [`Counters::settle`] for a change that cannot raise the peak (a free): no estimate
    /// of live bytes, so no load of the shared total.
    #[inline(always)]
    fn settle_down(&self, shard: &Shard, size: u64) {
        let pending = shard.pending();
        if pending.unsigned_abs() > shard.slack.load(Relaxed) {
            self.commit(shard, pending, size);
        }
    }

    #[cold]
    #[inline(never)]
    fn commit(&self, shard: &Shard, pending: i64, size: u64) -> i64 {
        // A change larger than the slack by itself (a large block) would commit again at
        // its free and at every later allocation of its size: raise the slack to it.
        let size = size.min(MAX_SLACK);
        if size > shard.slack.load(Relaxed) {
            shard.slack.store(size, Relaxed);
            shard.floor.store(size.wrapping_neg(), Relaxed);
        }
        add_owned(&shard.mark, pending as u64);
        self.add_committed(pending)
    }

    /// Adds `delta` to `committed` (and takes it off the room); returns the new total.
    #[inline(always)]
    fn add_committed(&self, delta: i64) -> i64 {
        let d = delta as u64;
        self.room.fetch_sub(d, Relaxed);
        (self.committed.fetch_add(d, Relaxed) as i64).wrapping_add(delta)
    }

    /// Sends every allocation down the full path (through [`Counters::try_record_alloc`]
    /// failing) until the matching [`Counters::unblock_fast_path`]: for a `ProcessWindow`,
    /// which must see every allocation of every thread.
    ///
    /// Whatever the interleaving of blocks and unblocks, the room holds at most two
    /// `BLOCKED` off at once (a last unblock not yet applied beside a new first block),
    /// still negative as an `i64`, and is blocked from the first block's return to the
    /// last unblock's call.
    pub(crate) fn block_fast_path(&self) {
        if self.blocks.fetch_add(1, Relaxed) == 0 {
            self.room.fetch_sub(BLOCKED, Relaxed);
        }
    }

    /// Ends one [`Counters::block_fast_path`].
    pub(crate) fn unblock_fast_path(&self) {
        if self.blocks.fetch_sub(1, Relaxed) == 1 {
            self.room.fetch_add(BLOCKED, Relaxed);
        }
    }

    /// Raises the peak to `live`; the load first keeps the common case (no new peak) free
    /// of locked instructions. Relaxed: `fetch_max` is atomic, so no raise is lost.
    #[inline(always)]
    fn note_peak(&self, live: i64) {
        if live > 0 && live as u64 > self.peak.load(Relaxed) {
            let before = self.peak.fetch_max(live as u64, Relaxed);
            if live as u64 > before {
                // Each raise adds exactly what it raised by: the raises of racing threads
                // sum to the final peak's rise.
                self.room.fetch_add(live as u64 - before, Relaxed);
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn record_alloc_shared(&self, size: u64) {
        self.shared.allocs.fetch_add(1, Relaxed);
        self.shared.bytes_allocated.fetch_add(size, Relaxed);
        let live = self.add_committed(size as i64);
        self.note_peak(live);
    }

    #[cold]
    #[inline(never)]
    fn record_free_shared(&self, size: u64) {
        self.shared.frees.fetch_add(1, Relaxed);
        self.shared.bytes_freed.fetch_add(size, Relaxed);
        self.add_committed((size as i64).wrapping_neg());
    }

    #[cold]
    #[inline(never)]
    fn record_realloc_shared(&self, old: u64, new: u64) {
        self.shared.reallocs.fetch_add(1, Relaxed);
        self.shared.bytes_allocated.fetch_add(new, Relaxed);
        self.shared.bytes_freed.fetch_add(old, Relaxed);
        let delta = new.wrapping_sub(old);
        let live = self.add_committed(delta as i64);
        if new > old {
            self.shared.bytes_grown.fetch_add(new - old, Relaxed);
            self.note_peak(live);
        }
    }
}

/// The counters of an allocator at one moment ([`Counting::snapshot`](super::Counting::snapshot)),
/// or of a thread ([`Window`](super::Window)). Totals count from the allocator's
/// creation; subtract an earlier snapshot for what happened in between.
///
/// ```
/// use allocator_api2::boxed::Box;
/// use cudalloc::count::Counting;
/// let counting = Counting::new(std::alloc::System);
/// let before = counting.snapshot();
/// let b = Box::new_in([0u8; 32], &counting);
/// let after = counting.snapshot();
/// assert_eq!(after.live_bytes(), 32);
/// assert_eq!((after - before).net_bytes(), 32);
/// println!("{after}");
/// # drop(b);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Snapshot {
    /// Successful allocations (reallocations not included).
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Successful reallocations (`realloc`, `grow`, `shrink`).
    pub reallocs: u64,
    /// Requests the inner allocator refused (allocations and reallocations).
    pub failures: u64,
    /// Bytes handed out: allocations plus the new size of every reallocation.
    pub bytes_allocated: u64,
    /// Bytes given back: frees plus the old size of every reallocation.
    pub bytes_freed: u64,
    /// Bytes that reallocations added to the blocks they grew (`new - old`, summed over
    /// the reallocations that grew; already included in the two totals above).
    pub bytes_grown: u64,
    /// The most bytes live at once (see [`Counting`](super::Counting) on its precision).
    pub peak_bytes: u64,
}

impl Snapshot {
    /// Blocks allocated and not yet freed.
    pub fn live_count(&self) -> u64 {
        self.allocs.saturating_sub(self.frees)
    }

    /// Bytes allocated and not yet freed.
    pub fn live_bytes(&self) -> u64 {
        self.bytes_allocated.saturating_sub(self.bytes_freed)
    }

    /// What happened between `earlier` and `self`; the same as `self - earlier`.
    pub fn delta(&self, earlier: &Snapshot) -> Delta {
        Delta {
            allocs: self.allocs.wrapping_sub(earlier.allocs),
            frees: self.frees.wrapping_sub(earlier.frees),
            reallocs: self.reallocs.wrapping_sub(earlier.reallocs),
            failures: self.failures.wrapping_sub(earlier.failures),
            bytes_allocated: self.bytes_allocated.wrapping_sub(earlier.bytes_allocated),
            bytes_freed: self.bytes_freed.wrapping_sub(earlier.bytes_freed),
            bytes_grown: self.bytes_grown.wrapping_sub(earlier.bytes_grown),
        }
    }
}

impl Sub for Snapshot {
    type Output = Delta;
    fn sub(self, earlier: Snapshot) -> Delta {
        self.delta(&earlier)
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "live {} blocks / {} B, peak {} B; {} allocs, {} frees, {} reallocs, {} failures; \
             {} B allocated, {} B freed, {} B grown by reallocation",
            self.live_count(),
            self.live_bytes(),
            self.peak_bytes,
            self.allocs,
            self.frees,
            self.reallocs,
            self.failures,
            self.bytes_allocated,
            self.bytes_freed,
            self.bytes_grown
        )
    }
}

/// What happened between two snapshots, or in a window: counts of operations and bytes,
/// and the leak verdict on them. The net values are signed, since frees of blocks
/// allocated earlier count too.
///
/// # The leak verdict
///
/// Counters know how many blocks and bytes came and went, not which block was which, so
/// the verdict ([`is_balanced`](Delta::is_balanced)) reads:
///
/// - more blocks allocated than freed is a leak ([`leaked_count`](Delta::leaked_count));
/// - more bytes allocated than freed is a leak, *except* the bytes that reallocations
///   grew blocks by ([`bytes_grown`](Delta::bytes_grown)). A `Vec` that existed before a
///   window and grew inside it is not a leak of the window: the block is not the
///   window's, and its owner frees the growth with it. Its bytes are held, though: they
///   show in `bytes_grown` and [`net_bytes`](Delta::net_bytes), which a test that must
///   bound the memory it holds can assert on.
///
/// A block allocated *in* the window, grown and kept is still a leak (one block more),
/// reported with its full size. What counts cannot tell apart: a window that frees an
/// older block and keeps a new one of the same count is balanced in blocks, and is
/// reported only for bytes that growth does not explain. (A window's [`LeakReport`]
/// does not rest on this verdict alone: the table of blocks allocated in the window
/// catches such a swap exactly.)
///
/// [`LeakReport`]: super::LeakReport
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::count::{Counting, Window};
/// let counting = Counting::new(std::alloc::System);
/// let mut older: Vec<u8, _> = Vec::with_capacity_in(16, &counting);
/// let w = Window::open();
/// older.reserve_exact(10_000); // grows a block the window did not allocate
/// let d = w.check().expect("growth of an older block is no leak");
/// assert_eq!((d.reallocs, d.net_count(), d.net_bytes(), d.bytes_grown), (1, 0, 9984, 9984));
/// assert!(d.to_string().contains("net +0 blocks, +9984 B"), "{d}");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Delta {
    /// Allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Reallocations.
    pub reallocs: u64,
    /// Refused requests.
    pub failures: u64,
    /// Bytes allocated (allocations plus the new size of reallocations).
    pub bytes_allocated: u64,
    /// Bytes freed (frees plus the old size of reallocations).
    pub bytes_freed: u64,
    /// Bytes that reallocations grew blocks by (included in the two totals above).
    pub bytes_grown: u64,
}

impl Delta {
    /// Allocations minus frees.
    pub fn net_count(&self) -> i64 {
        self.allocs.wrapping_sub(self.frees) as i64
    }

    /// Bytes allocated minus bytes freed, growth of blocks by reallocation included.
    pub fn net_bytes(&self) -> i64 {
        self.bytes_allocated.wrapping_sub(self.bytes_freed) as i64
    }

    /// Net bytes that growth by reallocation does not explain: what allocations kept
    /// beyond what frees gave back.
    fn unexplained_bytes(&self) -> i64 {
        self.net_bytes().wrapping_sub(self.bytes_grown as i64)
    }

    /// Blocks allocated and not freed: the net count, or 0 if more was freed.
    pub fn leaked_count(&self) -> u64 {
        self.net_count().max(0) as u64
    }

    /// Bytes not freed when something leaked (see [`Delta::is_balanced`]): the net bytes,
    /// or 0 if more was freed; 0 when nothing leaked, even if blocks grew.
    pub fn leaked_bytes(&self) -> u64 {
        if self.is_balanced() {
            0
        } else {
            self.net_bytes().max(0) as u64
        }
    }

    /// Whether nothing leaked: no more blocks allocated than freed, and no more bytes
    /// than frees and growth by reallocation account for (see "The leak verdict" above).
    pub fn is_balanced(&self) -> bool {
        self.net_count() <= 0 && self.unexplained_bytes() <= 0
    }
}

impl fmt::Display for Delta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} allocs, {} frees, {} reallocs, {} failures; {} B allocated, {} B freed; \
             net {:+} blocks, {:+} B",
            self.allocs,
            self.frees,
            self.reallocs,
            self.failures,
            self.bytes_allocated,
            self.bytes_freed,
            self.net_count(),
            self.net_bytes()
        )?;
        if self.bytes_grown != 0 {
            write!(f, " (reallocations grew blocks by {} B)", self.bytes_grown)?;
        }
        Ok(())
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::sync::{thread, Arc};

    /// Two threads with private shards and one on the shared shard allocate, reallocate
    /// and free at once (with a slack of 8 bytes, so commits happen); after the joins
    /// every total is exact and the peak lies between what one thread alone had live
    /// and what all had live together.
    #[test]
    fn totals_exact_and_peak_bounded() {
        loom::model(|| {
            let c = Arc::new(Counters::new());
            let a = {
                let c = c.clone();
                thread::spawn(move || {
                    c.record_alloc(0, 8);
                    c.record_alloc(0, 8); // 16 live here: commits
                    c.record_free(0, 8);
                })
            };
            let b = {
                let c = c.clone();
                thread::spawn(move || {
                    c.record_alloc(1, 4);
                    c.record_realloc(1, 4, 12); // commits 12
                    c.record_free(1, 12);
                })
            };
            c.record_alloc(SHARDS, 2); // the shared shard
            c.record_failure();
            // The stored peak never exceeds what was live at once (a snapshot taken now
            // may: it sums shards read at different moments).
            let peak = c.peak.load(Relaxed);
            assert!(peak <= 30, "peak {peak} above the most ever live");
            a.join().unwrap();
            b.join().unwrap();
            let s = c.snapshot();
            assert_eq!((s.allocs, s.frees, s.reallocs, s.failures), (4, 2, 1, 1));
            assert_eq!(
                (s.bytes_allocated, s.bytes_freed, s.bytes_grown),
                (8 + 8 + 4 + 12 + 2, 8 + 4 + 12, 12 - 4)
            );
            assert_eq!((s.live_count(), s.live_bytes()), (2, 10));
            // Thread a alone had 16 live; all together at most 16 + 12 + 2.
            assert!((16..=30).contains(&s.peak_bytes), "peak {}", s.peak_bytes);
            // The fast path's room converged to the exact value, whatever the interleaving.
            assert_eq!(c.room_now(), c.room_exact());
        });
    }

    /// Peak updates race with each other: the larger one always wins.
    #[test]
    fn peak_keeps_the_maximum() {
        loom::model(|| {
            let c = Arc::new(Counters::new());
            let a = {
                let c = c.clone();
                thread::spawn(move || c.record_alloc(SHARDS, 20))
            };
            c.record_alloc(0, 9);
            a.join().unwrap();
            assert_eq!(c.snapshot().live_bytes(), 29);
            // The raw peak, not the snapshot's (which is never below what is live).
            let peak = c.peak.load(Relaxed);
            assert!((20..=29).contains(&peak), "peak {peak}: a raise was lost");
        });
    }
}
