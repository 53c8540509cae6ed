//! The page heap: large blocks of a device pool backed by physical memory through the
//! CUDA virtual memory management API (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`,
//! `cuMemSetAccess`), so that memory freed from a block of one size serves blocks of any
//! other size, and an allocation that fits in memory already mapped makes no driver call
//! (PyTorch's expandable segments). The default where the device supports it
//! ([`Backing::Auto`](super::Backing::Auto)); [`PageTuning`] tunes it.
//!
//! # The algorithm
//!
//! - **Address space**: the heap reserves large *regions* of virtual addresses (the
//!   device's memory each; another only when no free run fits) and cuts them into
//!   units of 64 KiB. Blocks are runs of units (a request rounds up to a unit, not to
//!   the 2 MiB allocation granule: only chunks are mapped); free units form
//!   maximal *free runs*, coalesced at every free. An allocation of n units takes the
//!   smallest free run of at least n (lowest address among equals), from its start; the
//!   rest of the run stays free.
//! - **Physical memory** comes in *chunks* (16 MiB by default: [`PageTuning`]), one handle
//!   each, mapped at chunk-aligned places of a region. A chunk is mapped while any
//!   unit of it is in a block; a wholly free chunk stays mapped (*idle*) so that the
//!   next block there costs nothing. An allocation maps the chunks of its run that are
//!   not mapped, with a handle from (in this order) the spare handles; while the idle
//!   chunks exceed an allowance (1/64 of the bytes in blocks by default), an idle chunk elsewhere
//!   (unmapped if its work completed, else mapped anew at once while its old mapping is
//!   *retired* until the work completes, the new user ordered after it: memory freed by a
//!   block of one size serves a block of another); or `cuMemCreate`. One
//!   `cuMemSetAccess` per span of chunks mapped together. So the heap reserves what its
//!   blocks touch plus at most the allowance of idle chunks.
//! - **Groups**: where the new chunks wholly inside a block would all be `cuMemCreate`d
//!   (no spare handle, idle chunks within the allowance) and make at least
//!   `GROUP_MIN_BYTES` (64 MiB), they are ONE handle, one map and one access call (on the
//!   H200 a cold 256 MiB block: 97 us instead of 919 us in 16 MiB chunks; a handle cannot
//!   be mapped in parts nor unmapped in parts). Where the heap *grows* (no chunk idle,
//!   the block's unmapped chunks run to its end), every new chunk the block touches,
//!   partial ones too, is one group from 2 chunks (`GROWTH_GROUP_MIN`): a single pass
//!   that only grows (a forward pass, a training step) maps once per block, not once per
//!   chunk, for the same reservation. Such a group also maps chunks *ahead* of its block,
//!   from the free run after it, as many as the idle allowance's share of the blocks
//!   holds (1/64 of them by default, not the allowance's floor, so a heap under 1 GiB maps
//!   nothing ahead), the group at most 4 chunks (`GROWTH_AHEAD_CHUNKS`): idle memory the
//!   heap tolerates anyway, mapped with one access call instead of one each later (the
//!   access call costs about the same per mapping whatever its size). Its chunks are used and idle one by one,
//!   but a group is unmapped and released only whole, when all of them are idle and
//!   their frees completed (`reclaim.rs`; the minimum, measured on the simulated pool, is
//!   in `GROUP_MIN_BYTES`'s docs).
//! - **Placement**: a block takes the smallest free run that fits and is mapped over
//!   the block's length, among the [`PLACE_TRIES`] smallest that fit; else the one of
//!   those with the fewest chunks to map (on the H200 this halved the moves of RMM's
//!   random workload: 3.8 s instead of 7.2-9.8 s, the same reservation).
//! - **Costs** (H200): `cuMemSetAccess` about 30 us per chunk in its range, `cuMemUnmap`
//!   34 us, `cuMemMap` 2.4 us, `cuMemCreate` 19 us; an allocation that fits in mapped
//!   memory makes none of them. The idle allowance and the chunk size trade memory for
//!   moves, and a move costs about the same whatever the chunk's size (25-30 us of
//!   access, 24 us of unmap), so larger chunks with a smaller allowance move fewer
//!   bytes for the same reservation. On RMM's random workload (10^5 allocations up to
//!   64 MiB, 4 streams, `benches/device.rs`, one H200, one process, blocks not cached by
//!   class; BENCHMARKS.md): 8 MiB chunks and 1/128 reserved 1.085x the peak request in
//!   2.6 s ([`PageTuning::TIGHT`]), 8 MiB 1/32 1.105x in 0.65 s, 16 MiB 1/128 1.103x in
//!   0.35-0.54 s ([`PageTuning::FAST`]), **16 MiB 1/64 1.115x in 0.26-0.47 s**
//!   ([`PageTuning::BALANCED`], the default), 16 MiB 1/32 1.122x in 0.37 s, 32 MiB 1/128
//!   1.128x in 0.33 s; `cuMemAllocAsync` 1.264x in 0.34-0.67 s in the same processes.
//! - **Not cached by class**: the pool's size-class cache keeps no block of this heap
//!   (it would round each block up to its class and hold memory only its class can
//!   use: with the cache in front, 8 MiB 1/128 reserved 1.144x instead of 1.085x); the
//!   thread caches keep the last few freed blocks for an allocation of the same size on
//!   the same stream until the thread's next allocation of a large block they do not
//!   serve, when they come back here.
//! - **Early blocks** (`early.rs`): until the heap begins, its blocks under one chunk go
//!   to the driver pool while that pool has room for them in what it reserved for the
//!   small blocks (at most 16 MiB and 8 blocks of them), so a program whose blocks stay
//!   small reserves the driver pool's step alone; the first block that is not early
//!   begins the heap for good.
//! - **Stream order**: a free makes no driver call. It numbers itself (under the heap's
//!   lock, so the frees of one stream are numbered in its order) and the freed run
//!   carries (stream, number) with the hull of the units freed; a run keeps the latest
//!   free of each stream not known to have completed, merged when runs coalesce and kept
//!   by the parts they touch when a run is split. The heap keeps a clock per stream
//!   that freed here: every free up to `done` completed, and the marks (events) recorded
//!   on it so far. An allocation on stream T that takes units a free of stream S touched
//!   (S not T) asks the clock: completed, else S's first mark after that free is queried
//!   (and its oldest), else (no mark pending) whether S is idle (`cuStreamQuery`); only
//!   if the work may still be pending does it record a mark on S (one, covering every
//!   free of S so far) and make T wait for it (`cuStreamWaitEvent`, no host wait). These
//!   questions are asked with the heap's lock let go (`held.rs`). A failed query counts
//!   as pending. On RMM's random workload (no kernels, so the streams are idle) this
//!   records no event at all, where the first version recorded one per free. An idle chunk is unmapped only once the frees touching it
//!   completed. A handle moved from a chunk whose work is pending passes that chunk's
//!   frees on to its new chunk.
//! - **Out of memory**: when `cuMemCreate` fails, every idle chunk whose work completed
//!   is taken before the error goes up to the cache, which releases its blocks, retries,
//!   and finally trims (below) after synchronizing. A failed allocation gives its run and
//!   its chunks back as they were.
//! - **Trim** (`trim_to(keep)`) synchronizes the streams of the frees so far (with the
//!   lock let go), then releases spare handles, then unmaps and releases idle chunks
//!   (from the highest address) until the heap reserves less than `keep`; trimming to 0
//!   also frees the regions left empty.
//! - **No lock across a driver call** (`held.rs`): one lock guards the heap's books, and
//!   one thread at a time (the one holding the *turn*) changes what is mapped, letting the
//!   lock go across each of its driver calls. Frees, blocks that fit in mapped memory and
//!   the stats go on meanwhile; a block that needs a mapping waits for the turn and is
//!   placed again, in what was freed meanwhile if that now holds it.
//!
//! The algorithm is generic over [`Phys`] (the physical operations) and the cache's
//! [`StreamOrder`] (its marks), so CPU tests drive it with `device/fake/`, whose fake
//! physical memory checks every mapping, unmapping and use against the simulated streams.
//!
//! # The parts
//! Each states its invariants in its own docs. Bottom up:
//! - `stats.rs`: [`PageStats`], with the driver's time by call ([`DriverNs`](stats::DriverNs));
//! - `clocks.rs`: the stream order of frees ([`Freed`](clocks::Freed) stamps, the
//!   [`Clocks`](clocks::Clocks) of the streams, the driver's questions and answers, forget), unit
//!   tested on its own;
//! - `device/runs.rs` (beside this directory, shared by nothing else): the free-run
//!   index, property-tested on its own;
//! - `space.rs`: regions, chunks and free runs (placing runs, coalescing at a free);
//! - `reclaim.rs`: unmapping idle chunks, retiring pending ones, polling the retired;
//! - `map.rs`: placement, mapping and access (peers too);
//! - `trim.rs`: trimming and the shutdown;
//! - `early.rs`: the blocks left to the driver pool before the heap begins;
//! - `held.rs`: the lock, let go across driver calls, and the turn to change mappings;
//! - this file: the heap, its state, `alloc` and `free`.

mod clocks;
mod early;
mod held;
mod map;
mod reclaim;
mod space;
mod stats;
#[cfg(test)]
mod tests;
mod trim;

use std::collections::{BTreeSet, HashMap};
use std::marker::PhantomData;

use self::clocks::{retag, Clocks, Stamps};
#[cfg(any(test, feature = "sim"))]
pub(crate) use self::held::assert_unlocked;
use self::held::Held;
use self::space::{Chunk, Region};
pub(crate) use self::stats::PageStats;
use super::config::PageTuning;
use super::order::StreamOrder;
use super::phys::Phys;
use super::reserve::{PoolSide, Reservations};
use super::runs::Runs;
use crate::cuda::record_drop_error;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, Condvar, Mutex};

/// The most bytes of one step of the address index (blocks are multiples of it; less on
/// a device whose granule is smaller).
const UNIT: usize = 64 << 10;
/// Virtual bytes per region at least (the CUDA backend uses the device's memory).
const REGION_BYTES: usize = 1 << 36;
/// Idle chunks tried per handle needed before a new handle is created.
const RECLAIM_TRIES: usize = 8;
/// Free runs a placement considers.
const PLACE_TRIES: usize = 16;
/// Retired chunks polled per call.
const POLL: usize = 16;
/// Clocks of streams with nothing pending kept (so that a stream that frees again need
/// not clone its handle again); beyond it they go.
const MAX_CLOCKS: usize = 16;

/// Idle chunks tolerated at least before one is moved rather than new memory made (the
/// tuning's `idle_divisor` sets the allowance above this floor).
const IDLE_FLOOR_CHUNKS: usize = 4;

/// The fewest bytes of unmapped chunks wholly inside a block mapped as one group (one
/// handle, one map, one access call) where they would all be new handles (`map.rs`); 2
/// chunks at least. On the simulated pool groups of fewer bytes, or of every chunk a
/// block touches, raised RMM's random workload's reservation (blocks up to 64 MiB:
/// 1.108x the peak request without groups, 1.114-1.127x with them), as a partly used
/// group cannot be moved a chunk at a time; from 64 MiB of inner chunks it is unchanged
/// (no group forms there), and cold growth in large blocks maps a quarter as often (the
/// pipeline trace: 41 creates, maps and accesses instead of 164 creates and maps).
const GROUP_MIN_BYTES: usize = 64 << 20;

/// The fewest new chunks mapped as one group where the heap grows: no chunk is idle (it
/// holds no mapped memory to spare) and a block's unmapped chunks run to its end. There
/// the group takes every new chunk the block touches, its partial first and last ones
/// too (an unmapped chunk holds no other block, so the rest of it is free, and the heap
/// maps it for this block in any case): the reservation is the same, the driver calls
/// fewer. Replaying the sample traces through `SimPool::paged` (BENCHMARKS.md, issue 23):
/// the cs336 forward pass 613 -> 404 maps, ftcourse 263 -> 135, RMM's random workload
/// (4 streams) 1489 -> 1110 maps at 1.107x instead of 1.108x; the 10^5-allocation RMM
/// trace 1990 -> 1099 maps at 1.288x instead of 1.280x (one 16 MiB chunk on its 2 GB
/// peak, as a partly used group cannot move a chunk at a time).
const GROWTH_GROUP_MIN: usize = 2;

/// The most chunks a growth's group spans from its first new chunk when it maps chunks
/// ahead of its block (`map.rs`, `growth_end`): as many as the idle allowance's share of
/// the blocks holds, up to this. Replaying the sample traces through `SimPool::paged`
/// (BENCHMARKS.md, 2026-12-06, sixth session): the cs336 forward pass 404 -> 225 maps at
/// the same peak reservation (9840 MiB), the full step 1050 -> 960 maps at 39936 MiB
/// instead of 39968, ftcourse 135 -> 120 at the same 4608 MiB, RMM's random workload at
/// 16 GB (4 streams) 17984 MiB instead of 18176, the smaller traces unchanged (their
/// share is under one chunk); 8 raised the forward pass's reservation to 9872 MiB.
const GROWTH_AHEAD_CHUNKS: usize = 4;

/// What [`PageHeap::reclaim`] got from an idle chunk.
enum Reclaimed {
    /// A chunk's handle, unmapped (or mapped at a chunk now retired), with the marks to
    /// order its next use after.
    Handle(u64, clocks::Stamps),
    /// A group, unmapped and released whole (its handle is never mapped elsewhere): the
    /// heap reserves less, and may create.
    Released,
}

/// How [`PageHeap::reclaim`] may take an idle chunk's handle.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reclaim {
    /// Only where the work completed (a trim, which waited on the host first).
    Done,
    /// Where the work completed, else the first pending one, its old mapping retired.
    Retire,
}

/// The heap's state, under its lock. The parts' invariants are on their files; across
/// them: `stats.block_bytes` is the bytes of `live` (units times unit), and
/// `stats.reserved` the bytes of the live handles (mapped or spare; a handle mapped anew
/// while its old mapping is retired counts once).
struct State<B: StreamOrder> {
    regions: Vec<Region>,
    /// The first unit index of the next region (regions are a chunk apart in the index
    /// space, so that no free run reaches from one into the next).
    next_index: usize,
    /// By chunk index (unit index / units per chunk).
    chunks: Vec<Chunk>,
    /// Free runs by first unit, and by (length, first unit) for the best fit, each with
    /// the frees that touched it.
    free: Runs<Stamps>,
    /// Mapped chunks with no unit in a block (and not stuck).
    idle: BTreeSet<usize>,
    /// Handles mapped nowhere.
    spare: Vec<u64>,
    /// Chunks whose handle was mapped elsewhere while their last frees' marks were
    /// pending: the old mapping stays (their units out of the free runs) until the marks
    /// complete.
    retired: Vec<(usize, Stamps)>,
    /// Live blocks by address: (first unit, units).
    live: HashMap<u64, (usize, usize)>,
    /// Other devices that may access every mapping (`enable_peer`).
    peers: Vec<usize>,
    /// A thread holds the turn to change mappings (`held.rs`).
    mapping: bool,
    /// The streams that freed here with work that may be pending, the numbering of
    /// frees and of heap operations.
    clocks: Clocks<B>,
    stats: PageStats,
}

/// Blocks of at least this many granules go to the page heap (when there is one): one
/// granule (2 MiB on the H200). Smaller blocks stay on the driver pool, which packs them
/// into its chunks, and are cached by size class. The threshold is low because the
/// driver pool fragments under blocks of mixed sizes and the class cache holds memory
/// only its class can use (`page_thresholds_compared` in `device::tests` measures it on
/// the simulated pool: RMM's random workload reserves 1.108x the peak request from 1
/// granule, 1.115x from 2, 1.145x from 4, 1.181x from 8).
pub(crate) const PAGE_MIN_GRANULES: usize = 1;

/// The smallest block a page heap on a device of `granule` bytes serves.
pub(crate) const fn page_threshold(granule: usize) -> usize {
    granule * PAGE_MIN_GRANULES
}

/// Large blocks on physical pages. See the [module docs](self).
pub(crate) struct PageHeap<P: Phys, B: StreamOrder> {
    phys: P,
    granule: usize,
    /// The bytes of one step of the address index: blocks are runs of units.
    unit: usize,
    /// Units per chunk (a power of two).
    chunk_units: usize,
    /// Idle chunks are tolerated up to 1/idle_divisor of the bytes in blocks.
    idle_divisor: usize,
    /// Spans of at least this many new chunks wholly inside a block are mapped as one
    /// group (`usize::MAX`: never).
    group_min: usize,
    /// The most chunks a growth's group spans when it maps chunks ahead of its block
    /// ([`GROWTH_AHEAD_CHUNKS`]; 0: none ahead).
    growth_ahead: usize,
    /// Virtual bytes of a region at least.
    region_bytes: usize,
    /// The smallest block the heap serves; smaller ones stay on the driver pool.
    min_block: usize,
    /// The pool's reservations: every handle is charged there before it is made, so that
    /// the pool's limit holds for the heap and the driver pool together.
    reservations: Arc<Reservations>,
    state: Mutex<State<B>>,
    /// Signalled when the turn to change mappings is given up (`held.rs`).
    turn: Condvar,
    /// Whether takers are ordered after other streams' frees (off only in negative
    /// controls, `test-hooks`).
    guard: AtomicBool,
    /// The blocks left to the driver pool before the heap begins (`early.rs`).
    early: early::Early,
    _backend: PhantomData<fn() -> B>,
}

impl<P: Phys, B: StreamOrder> core::fmt::Debug for PageHeap<P, B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PageHeap")
            .field("granule", &self.granule)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// A heap over `phys`, tuned by `tuning` (checked: [`PageTuning::check`]).
    pub(crate) fn new(phys: P, tuning: PageTuning) -> Self {
        let granule = phys.granule();
        debug_assert!(granule.is_power_of_two());
        let unit = granule.min(UNIT);
        Self {
            phys,
            granule,
            unit,
            chunk_units: tuning.chunk_granules(granule) * (granule / unit),
            idle_divisor: tuning.idle_divisor.max(1) as usize,
            group_min: 2.max(GROUP_MIN_BYTES / (tuning.chunk_granules(granule) * granule)),
            growth_ahead: GROWTH_AHEAD_CHUNKS,
            region_bytes: REGION_BYTES,
            min_block: page_threshold(granule),
            reservations: Arc::new(Reservations::new(None)),
            state: Mutex::new(State {
                regions: Vec::new(),
                next_index: 0,
                chunks: Vec::new(),
                free: Runs::default(),
                idle: BTreeSet::new(),
                spare: Vec::new(),
                retired: Vec::new(),
                live: HashMap::new(),
                peers: Vec::new(),
                mapping: false,
                clocks: Clocks::default(),
                stats: PageStats::default(),
            }),
            turn: Condvar::new(),
            guard: AtomicBool::new(true),
            early: early::Early::default(),
            _backend: PhantomData,
        }
    }

    /// This heap serving blocks of `bytes` and more (simulated devices test thresholds).
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn with_min_block(self, bytes: usize) -> Self {
        Self {
            min_block: bytes,
            ..self
        }
    }

    /// This heap mapping spans of at least `chunks` (2 or more) new chunks wholly inside
    /// a block as one group (`usize::MAX`: never, one handle per chunk as before groups).
    #[cfg(test)]
    pub(crate) fn with_group_min(self, chunks: usize) -> Self {
        Self {
            group_min: chunks,
            ..self
        }
    }

    /// This heap mapping ahead of a growing block at most `chunks` chunks from its first
    /// new one (0: nothing ahead, as before 2026-12-06).
    #[cfg(test)]
    pub(crate) fn with_growth_ahead(self, chunks: usize) -> Self {
        Self {
            growth_ahead: chunks,
            ..self
        }
    }

    /// This heap charging its handles to `reservations` (shared with the driver pool
    /// beside it, under the pool's limit).
    pub(crate) fn with_reservations(self, reservations: Arc<Reservations>) -> Self {
        Self { reservations, ..self }
    }

    /// This heap holding at most `limit` bytes of handles, alone (`None`: no cap).
    #[cfg(test)]
    pub(crate) fn with_limit(self, limit: Option<usize>) -> Self {
        self.with_reservations(Arc::new(Reservations::new(limit)))
    }

    /// This heap reserving virtual regions of at least `bytes` (the device's memory).
    pub(crate) fn with_region_bytes(self, bytes: usize) -> Self {
        Self {
            region_bytes: bytes,
            ..self
        }
    }

    /// `heap`, if there is one and it serves blocks of `bytes`.
    #[inline]
    fn serving(heap: &Option<Self>, bytes: usize) -> Option<&Self> {
        heap.as_ref().filter(|h| bytes >= h.min_block)
    }

    /// A backend's allocation of `bytes`: `on_heap` where `heap` serves the block, else
    /// from `driver` (the driver pool beside it) with `on_driver`, which also takes the
    /// heap's early blocks before it begins (`early.rs`) while `driver` has room for them.
    #[inline]
    pub(crate) fn alloc_routed(
        heap: &Option<Self>,
        bytes: usize,
        on_heap: impl FnOnce(&Self) -> Result<u64>,
        driver: &impl PoolSide,
        on_driver: impl FnOnce() -> Result<u64>,
    ) -> Result<u64> {
        let Some(h) = Self::serving(heap, bytes) else {
            return on_driver();
        };
        let room = || {
            driver
                .usage()
                .map_or(0, |(reserved, used)| reserved.saturating_sub(used))
        };
        if !h.early.claim(bytes, h.chunk_units * h.unit, room) {
            return on_heap(h);
        }
        let r = on_driver();
        h.early.placed(&r, bytes);
        r
    }

    /// Where a backend frees the block `ptr` of `bytes` that [`alloc_routed`] placed:
    /// `Some(heap)`, or the driver pool (`None`).
    ///
    /// [`alloc_routed`]: Self::alloc_routed
    #[inline]
    pub(crate) fn free_route(heap: &Option<Self>, ptr: u64, bytes: usize) -> Option<&Self> {
        Self::serving(heap, bytes).filter(|h| !h.early.release(ptr, bytes))
    }

    #[cfg(test)]
    pub(crate) fn phys(&self) -> &P {
        &self.phys
    }

    /// The device's allocation granule.
    pub(crate) fn granule(&self) -> usize {
        self.granule
    }

    /// Turns the ordering of takers after other streams' frees off (negative controls
    /// only) or on.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_guard(&self, on: bool) {
        self.guard.store(on, crate::sync::Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> PageStats {
        lock(&self.state).stats
    }

    pub(crate) fn reserved(&self) -> usize {
        lock(&self.state).stats.reserved
    }

    /// Bytes of handles no block uses (idle chunks, spare handles, the unused parts of
    /// chunks): what an allocation may take without new physical memory, at most.
    pub(crate) fn unused(&self) -> usize {
        let st = lock(&self.state);
        st.stats.reserved.saturating_sub(st.stats.block_bytes)
    }

    pub(crate) fn reset_peak(&self) {
        let mut st = lock(&self.state);
        st.stats.peak_reserved = st.stats.reserved;
        st.stats.peak_block_bytes = st.stats.block_bytes;
    }

    /// A block of at least `bytes` (nonzero) usable by work queued on `stream` from now on.
    pub(crate) fn alloc(&self, b: &B, bytes: usize, stream: &B::Stream) -> Result<u64> {
        let g = self.unit;
        let n = bytes.div_ceil(g).max(1);
        let len = n.checked_mul(g).ok_or(Error::OutOfMemory { requested: bytes })?;
        let mut st = self.held();
        // A block that fits in mapped memory is taken at once; one that needs a mapping
        // takes the turn, or waits for it and is placed again (`held.rs`).
        let (start, after) = loop {
            self.poll_in_turn(&mut st, b);
            if let Some((start, 0)) = self.place(&st, n) {
                break (start, self.take_placed(&mut st, start, n)?);
            }
            if st.try_turn() {
                let placed = self.alloc_mapped(&mut st, b, n);
                st.end_turn();
                break placed?;
            }
            st.await_turn();
        };
        // The block is the caller's from here (in `live`, counted); its stream is ordered
        // after the last users of its units and of the handles mapped with no lock held.
        let va = self.va_of(&st, start);
        st.live.insert(va, (start, n));
        st.stats.block_bytes += len;
        st.stats.peak_block_bytes = st.stats.peak_block_bytes.max(st.stats.block_bytes);
        let (asks, answers) = self.taker_asks(&mut st, stream, &after);
        let questions = if asks.is_empty() {
            st.clocks.recycle(asks, answers);
            None
        } else {
            Some((asks, answers))
        };
        let dead = st.clocks.take_dead();
        drop(st);
        drop(dead);
        let Some(questions) = questions else {
            return Ok(va);
        };
        // Where the ordering failed the block goes back (a peak of blocks it raised stays).
        let undo = |st: &mut Held<'_, B>| {
            st.live.remove(&va);
            st.stats.block_bytes -= len;
            self.give_back(st, start, n, retag(after, start, start + n));
        };
        self.order_taker(b, stream, questions, undo).map(|()| va)
    }

    /// With the turn: places a block of `n` units (in a new region if no free run holds
    /// it), takes its units and maps its chunks that are not; the block's first unit and
    /// the stamps to order its stream after. On an error nothing is taken.
    fn alloc_mapped(&self, st: &mut Held<'_, B>, b: &B, n: usize) -> Result<(usize, Stamps)> {
        let start = match self.place(st, n) {
            Some((start, _)) => start,
            None => self.add_region(st, n)?,
        };
        let mut after = self.take_placed(st, start, n)?;
        if let Err(e) = self.map_chunks(st, b, start, n, &mut after) {
            self.give_back(st, start, n, retag(after, start, start + n));
            return Err(e);
        }
        Ok((start, after))
    }

    /// [`take_units`](Self::take_units) of a run just placed; an error where the index
    /// lost the run (an internal bug).
    fn take_placed(&self, st: &mut State<B>, start: usize, n: usize) -> Result<Stamps> {
        self.take_units(st, start, n).ok_or_else(|| {
            log::error!("cudalloc: page heap index lost a free run (internal bug); the allocation fails");
            Error::OutOfMemory {
                requested: n * self.unit,
            }
        })
    }

    /// Unmaps the retired chunks whose work completed, if there are any and no thread
    /// holds the turn (which polls them itself).
    fn poll_in_turn(&self, st: &mut Held<'_, B>, b: &B) {
        if !st.retired.is_empty() && st.try_turn() {
            self.poll(st, b, POLL);
            st.end_turn();
        }
    }

    /// Frees the block at `ptr` in the order of `stream`.
    ///
    /// # Safety
    /// 1. `ptr` came from [`PageHeap::alloc`] of this heap, is freed once, and every use of
    ///    it is ordered before this point of `stream`.
    pub(crate) unsafe fn free(&self, b: &B, ptr: u64, stream: &B::Stream) {
        let mut st = self.held();
        let Some((start, n)) = st.live.remove(&ptr) else {
            drop(st);
            return record_drop_error(
                "freeing a page block",
                Error::InvalidArgument("not a live block of the page heap"),
            );
        };
        // Numbered under the lock: the frees of one stream are numbered in its order. No
        // mark is recorded: another stream that takes these units first asks whether the
        // work completed, and records one only if it may not have (`order_taker`).
        st.stats.block_bytes -= n * self.unit;
        let freed = st.clocks.number_free(stream, start, start + n);
        self.give_back(&mut st, start, n, vec![freed]);
        self.poll_in_turn(&mut st, b);
        st.clocks.forget(MAX_CLOCKS);
        let dead = st.clocks.take_dead();
        drop(st);
        drop(dead);
    }
}
