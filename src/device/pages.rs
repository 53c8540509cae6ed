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
//! - **Physical memory** comes in *chunks* (8 MiB by default: [`PageTuning`]), one handle
//!   each, mapped at chunk-aligned places of a region. A chunk is mapped while any
//!   unit of it is in a block; a wholly free chunk stays mapped (*idle*) so that the
//!   next block there costs nothing. An allocation maps the chunks of its run that are
//!   not mapped, with a handle from (in this order) the spare handles; while the idle
//!   chunks exceed an allowance (1/128 of the bytes in blocks by default), an idle chunk elsewhere
//!   (unmapped if its work completed, else mapped anew at once while its old mapping is
//!   *retired* until the work completes, the new user ordered after it: memory freed by a
//!   block of one size serves a block of another); or `cuMemCreate`. One
//!   `cuMemSetAccess` per span of chunks mapped together. So the heap reserves what its
//!   blocks touch plus at most the allowance of idle chunks.
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
//! - **Stream order**: a free makes no driver call. It numbers itself (under the heap's
//!   lock, so the frees of one stream are numbered in its order) and the freed run
//!   carries (stream, number) with the hull of the units freed; a run keeps the latest
//!   free of each stream not known to have completed, merged when runs coalesce and kept
//!   by the parts they touch when a run is split. The heap keeps a [`Clock`] per stream
//!   that freed here: every free up to `done` completed, and the marks (events) recorded
//!   on it so far. An allocation on stream T that takes units a free of stream S touched
//!   (S not T) asks the clock: completed, else S's oldest marks are queried, else (no mark
//!   pending) whether S is idle (`cuStreamQuery`), at most once per stream and heap
//!   operation; only if the work may still be pending does it record a mark on S (one,
//!   covering every free of S so far) and make T wait for it (`cuStreamWaitEvent`, no
//!   host wait). A failed query counts as pending. On RMM's random workload (no kernels,
//!   so the streams are idle) this records no event at all, where the first version
//!   recorded one per free. An idle chunk is unmapped only once the frees touching it
//!   completed. A handle moved from a chunk whose work is pending passes that chunk's
//!   frees on to its new chunk.
//! - **Out of memory**: when `cuMemCreate` fails, every idle chunk whose work completed
//!   is taken before the error goes up to the cache, which releases its blocks, retries,
//!   and finally trims (below) after synchronizing. A failed allocation gives its run and
//!   its chunks back as they were.
//! - **Trim** (`trim_to(keep)`) releases spare handles, then unmaps and releases idle
//!   chunks (from the highest address, waiting on the host for their marks) until the
//!   heap reserves less than `keep`; trimming to 0 also frees the regions left empty.
//! - One lock guards the heap, driver calls included: only misses of the cache's large
//!   blocks come here, and in a steady state most of them map nothing.
//!
//! The algorithm is generic over [`Phys`] (the physical operations) and the cache's
//! [`StreamOrder`] (its marks), so CPU tests drive it with `device/fake.rs`, whose fake
//! physical memory checks every mapping, unmapping and use against the simulated streams.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::marker::PhantomData;

use super::config::PageTuning;
use super::order::StreamOrder;
use super::phys::Phys;
use super::reserve::Reservations;
use super::runs::Runs;
use crate::cuda::{record_drop_error, StreamId};
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};
use crate::trace::Code;

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

/// How [`PageHeap::reclaim`] may take an idle chunk's handle.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reclaim {
    /// After waiting on the host for the chunk's work.
    Wait,
    /// Where the work completed, else the first pending one, its old mapping retired.
    Retire,
}

/// Frees of units by one stream, as a free run remembers them: the sequence number of
/// the latest (under the heap's lock, so in the stream's order) and the hull of the units
/// the frees it stands for touched. No driver call is made at a free: a mark (an event)
/// is recorded on the stream only when another stream takes the units while the work may
/// be pending, and one mark then covers every free of the stream so far ([`Clock`]).
#[derive(Clone, Copy, Debug)]
struct Freed {
    stream: StreamId,
    seq: u64,
    lo: usize,
    hi: usize,
}

/// The frees a free run remembers: the latest of each stream not known to have completed.
type Stamps = Vec<Freed>;

/// What the heap knows of one stream's frees: which completed, and the marks recorded on
/// it that cover the others.
struct Clock<B: StreamOrder> {
    /// A live handle, to record marks on and to ask whether its work completed.
    stream: B::Stream,
    /// The latest free on the stream.
    freed: u64,
    /// Every free of the stream numbered up to this has completed.
    done: u64,
    /// Marks recorded on the stream, oldest first, each after every free up to its
    /// number.
    marks: VecDeque<(u64, B::Mark)>,
    /// The heap operation that last asked the driver about this stream (at most once an
    /// operation).
    asked: u64,
}

/// One rule for a failed query (of a mark, or of a stream's work): the work counts as
/// pending, so the memory it may touch is never handed out or unmapped on that answer.
fn completed<B: StreamOrder>(clocks: &HashMap<StreamId, Clock<B>>, f: &Freed) -> bool {
    // A stream without a clock has no free pending: clocks go only once all completed.
    clocks.get(&f.stream).is_none_or(|c| f.seq <= c.done)
}

/// Adds `from` to `into`, keeping the latest free of each stream (with the hull of both
/// ranges: waiting for the later free waits for the earlier) and dropping those known
/// complete.
fn merge<B: StreamOrder>(clocks: &HashMap<StreamId, Clock<B>>, into: &mut Stamps, from: Stamps) {
    into.retain(|s| !completed(clocks, s));
    for s in from {
        if completed(clocks, &s) {
            continue;
        }
        match into.iter_mut().find(|t| t.stream == s.stream) {
            Some(t) => {
                let (lo, hi) = (t.lo.min(s.lo), t.hi.max(s.hi));
                t.seq = t.seq.max(s.seq);
                (t.lo, t.hi) = (lo, hi);
            }
            None => into.push(s),
        }
    }
}

/// The stamps of `stamps` whose frees touched units `lo..hi`.
fn touching(stamps: &Stamps, lo: usize, hi: usize) -> Stamps {
    stamps
        .iter()
        .filter(|s| s.lo < hi && s.hi > lo)
        .copied()
        .collect()
}

/// `stamps` taken to stand for frees of units `lo..hi` (where their work may now touch).
fn retag(mut stamps: Stamps, lo: usize, hi: usize) -> Stamps {
    for s in &mut stamps {
        (s.lo, s.hi) = (lo, hi);
    }
    stamps
}

/// A maximal run of free units.
struct Run {
    len: usize,
    stamps: Stamps,
}

/// One chunk of a region's units.
#[derive(Default)]
struct Chunk {
    /// The handle mapped there.
    handle: Option<u64>,
    /// Granules of the chunk in blocks.
    used: usize,
    /// An unmap failed: the mapping stays, and the chunk is never unmapped again.
    stuck: bool,
}

/// A reserved range of virtual addresses: units `first..first + units` of the
/// heap's index space.
struct Region {
    first: usize,
    units: usize,
    va: u64,
}

/// What the heap has done and holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageStats {
    /// Bytes of live handles (mapped or spare), now and at most.
    pub(crate) reserved: usize,
    pub(crate) peak_reserved: usize,
    /// Bytes in live blocks, now and at most.
    pub(crate) block_bytes: usize,
    pub(crate) peak_block_bytes: usize,
    pub(crate) creates: u64,
    pub(crate) releases: u64,
    pub(crate) maps: u64,
    pub(crate) unmaps: u64,
    pub(crate) range_reserves: u64,
    pub(crate) waits: u64,
    /// Marks recorded (for another stream taking units whose frees may be pending).
    pub(crate) marks: u64,
    /// `cuMemSetAccess` calls.
    pub(crate) accesses: u64,
    /// Nanoseconds in the driver's create, map, set-access, unmap and release calls (by
    /// the slots [`CREATE`], [`MAP`], [`ACCESS`], [`UNMAP`], [`RELEASE`]).
    pub(crate) driver_ns: [u64; 5],
}

/// The slots of [`PageStats::driver_ns`]: `cuMemCreate`.
const CREATE: usize = 0;
/// `cuMemMap`.
const MAP: usize = 1;
/// `cuMemSetAccess`.
const ACCESS: usize = 2;
/// `cuMemUnmap`.
const UNMAP: usize = 3;
/// `cuMemRelease`.
const RELEASE: usize = 4;

/// Runs a driver call, adding its time to `ns`.
fn timed<R>(ns: &mut u64, f: impl FnOnce() -> R) -> R {
    let t = std::time::Instant::now();
    let r = f();
    *ns += t.elapsed().as_nanos() as u64;
    r
}

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
    /// The latest free's sequence number.
    seq: u64,
    /// The streams that freed here with work that may be pending.
    clocks: HashMap<StreamId, Clock<B>>,
    /// Heap operations so far (a stream is asked about at most once in one).
    op: u64,
    /// Handles of streams whose clocks went, dropped after the lock (the last handle of
    /// an owned stream destroys it: a driver call).
    dead: Vec<B::Stream>,
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
    /// Virtual bytes of a region at least.
    region_bytes: usize,
    /// The smallest block the heap serves; smaller ones stay on the driver pool.
    min_block: usize,
    /// The pool's reservations: every handle is charged there before it is made, so that
    /// the pool's limit holds for the heap and the driver pool together.
    reservations: Arc<Reservations>,
    state: Mutex<State<B>>,
    /// Whether takers are ordered after other streams' frees (off only in negative
    /// controls, `test-hooks`).
    guard: AtomicBool,
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
                seq: 0,
                clocks: HashMap::new(),
                op: 0,
                dead: Vec::new(),
                stats: PageStats::default(),
            }),
            guard: AtomicBool::new(true),
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

    /// `heap`, if there is one and it serves blocks of `bytes` (a backend's routing: the
    /// same size routes an allocation and its free).
    #[inline]
    pub(crate) fn serving(heap: &Option<Self>, bytes: usize) -> Option<&Self> {
        heap.as_ref().filter(|h| bytes >= h.min_block)
    }

    /// Trims this heap and says what the driver pool beside it (reserving `pool_reserved`
    /// bytes) may keep, so that the two together keep less than `keep`.
    pub(crate) fn trim_beside_pool(&self, b: &B, keep: usize, pool_reserved: usize) -> usize {
        self.trim_to(b, keep.saturating_sub(pool_reserved));
        keep.saturating_sub(self.reserved())
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
        self.guard.store(on, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> PageStats {
        lock(&self.state).stats
    }

    /// Lets device `peer` access every block, present and future: access is set on every
    /// mapped chunk (span by span) and every later mapping includes it. Under the heap's
    /// lock, so no mapping is made meanwhile without it. On an error the peer is not
    /// recorded (some chunks may have access already).
    pub(crate) fn enable_peer(&self, peer: usize) -> Result<()> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        if st.peers.contains(&peer) {
            return Ok(());
        }
        let cb = self.chunk_bytes();
        let mut c = 0;
        while c < st.chunks.len() {
            if st.chunks[c].handle.is_none() {
                c += 1;
                continue;
            }
            // A span of mapped chunks (never across regions: a chunk of the index space
            // between regions is never mapped).
            let from = c;
            while c < st.chunks.len() && st.chunks[c].handle.is_some() {
                c += 1;
            }
            let va = self.va_of(st, from * self.chunk_units);
            st.stats.accesses += 1;
            // SAFETY: every chunk with a handle is mapped (in blocks, idle, retired or
            // stuck), and chunks from..c are consecutive in one region.
            timed(&mut st.stats.driver_ns[ACCESS], || unsafe {
                self.phys.set_access(va, (c - from) * cb, &[peer])
            })?;
        }
        st.peers.push(peer);
        Ok(())
    }

    /// Whether [`enable_peer`](Self::enable_peer) gave `peer` access.
    pub(crate) fn has_peer(&self, peer: usize) -> bool {
        lock(&self.state).peers.contains(&peer)
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

    fn chunk_bytes(&self) -> usize {
        self.chunk_units * self.unit
    }

    /// The address of unit `g` (in a region).
    fn va_of(&self, st: &State<B>, g: usize) -> u64 {
        let i = st.regions.partition_point(|r| r.first <= g) - 1;
        let r = &st.regions[i];
        debug_assert!(g < r.first + r.units);
        r.va + ((g - r.first) * self.unit) as u64
    }

    /// The chunks a run of `len` units from `start` touches, with the units of each
    /// inside the run.
    fn chunks_of(&self, start: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
        let cg = self.chunk_units;
        let end = start + len;
        (start / cg..end.div_ceil(cg)).map(move |c| (c, end.min((c + 1) * cg) - start.max(c * cg)))
    }

    /// A block of at least `bytes` (nonzero) usable by work queued on `stream` from now on.
    pub(crate) fn alloc(&self, b: &B, bytes: usize, stream: &B::Stream) -> Result<u64> {
        let g = self.unit;
        let n = bytes.div_ceil(g).max(1);
        let len = n.checked_mul(g).ok_or(Error::OutOfMemory { requested: bytes })?;
        let mut st = lock(&self.state);
        st.op += 1;
        self.poll(&mut st, b, POLL, false);
        let start = match self.place(&st, n) {
            Some(start) => start,
            None => self.add_region(&mut st, n)?,
        };
        let Some(run) = self.take_run(&mut st, start) else {
            log::error!("cudalloc: page heap index lost a free run (internal bug); the allocation fails");
            return Err(Error::OutOfMemory { requested: bytes });
        };
        if run.len > n {
            // The rest of a maximal run: its neighbours are this block and a block.
            let rest = touching(&run.stamps, start + n, start + run.len);
            self.put_run(&mut st, start + n, run.len - n, rest);
        }
        for (c, k) in self.chunks_of(start, n) {
            st.chunks[c].used += k;
            st.idle.remove(&c);
        }
        // Map the chunks that are not, and order `stream` after the last users of these
        // units and of the handles mapped.
        let mut after = touching(&run.stamps, start, start + n);
        let ordered = self.map_chunks(&mut st, b, start, n, &mut after).and_then(|()| {
            let me = B::stream_id(stream);
            for s in after.iter().filter(|s| s.stream != me) {
                self.order_after(&mut st, b, stream, s)?;
            }
            Ok(())
        });
        if let Err(e) = ordered {
            self.give_back(&mut st, start, n, retag(after, start, start + n));
            return Err(e);
        }
        let va = self.va_of(&st, start);
        st.live.insert(va, (start, n));
        st.stats.block_bytes += len;
        st.stats.peak_block_bytes = st.stats.peak_block_bytes.max(st.stats.block_bytes);
        Ok(va)
    }

    /// Where a block of `n` units goes: the smallest free run that fits whose first `n`
    /// units are all mapped, among the [`PLACE_TRIES`] smallest that fit; else the one of
    /// those with the fewest chunks to map (the smallest among equals).
    fn place(&self, st: &State<B>, n: usize) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None;
        for start in st.free.fitting(n).take(PLACE_TRIES) {
            let unmapped = self
                .chunks_of(start, n)
                .filter(|&(c, _)| st.chunks[c].handle.is_none())
                .count();
            if unmapped == 0 {
                return Some(start);
            }
            if best.is_none_or(|(u, _)| unmapped < u) {
                best = Some((unmapped, start));
            }
        }
        best.map(|(_, start)| start)
    }

    /// Maps every chunk of the run of `n` units from `start` that is not mapped,
    /// adding to `after` the marks of handles taken from chunks whose work is pending.
    fn map_chunks(&self, st: &mut State<B>, b: &B, start: usize, n: usize, after: &mut Stamps) -> Result<()> {
        let cb = self.chunk_bytes();
        // The chunks the run touches: consecutive indices.
        let (mut i, end) = (start / self.chunk_units, (start + n).div_ceil(self.chunk_units));
        while i < end {
            if st.chunks[i].handle.is_some() {
                i += 1;
                continue;
            }
            // A span of unmapped chunks: a handle mapped at each, one access call.
            let from = i;
            let mut failed = None;
            while i < end && st.chunks[i].handle.is_none() {
                let c = i;
                let (h, pending) = match self.handle(st, b) {
                    Ok(x) => x,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                };
                let first = c * self.chunk_units;
                if !pending.is_empty() {
                    // The handle's old work may touch any part of it: the free units
                    // of the chunk pass its marks on too.
                    let pending = retag(pending, first, first + self.chunk_units);
                    self.stamp_free(st, first, first + self.chunk_units, &pending);
                    merge(&st.clocks, after, pending);
                }
                let va = self.va_of(st, first);
                // SAFETY: the chunk lies in a reserved region, and nothing is mapped there
                // (no handle is recorded for it); h is live, of a chunk's bytes, and mapped
                // nowhere (spare, unmapped from an idle chunk, or new) or only at a retired
                // chunk whose work the allocation is ordered after.
                if let Err(e) = timed(&mut st.stats.driver_ns[MAP], || unsafe {
                    self.phys.map(va, cb, h)
                }) {
                    st.spare.push(h);
                    failed = Some(e);
                    break;
                }
                st.chunks[c].handle = Some(h);
                st.stats.maps += 1;
                b.trace().segment(Code::SegmentMap, va as usize, cb);
                i += 1;
            }
            if from < i {
                let va = self.va_of(st, from * self.chunk_units);
                st.stats.accesses += 1;
                // SAFETY: chunks from..i are consecutive and were all mapped above.
                let access = timed(&mut st.stats.driver_ns[ACCESS], || unsafe {
                    self.phys.set_access(va, (i - from) * cb, &st.peers)
                });
                if let Err(e) = access {
                    failed = failed.or(Some(e));
                    for c in from..i {
                        let va = self.va_of(st, c * self.chunk_units);
                        // SAFETY: mapped above, and no work was queued on it.
                        match unsafe { self.phys.unmap(va, cb) } {
                            Ok(()) => {
                                b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                                if let Some(h) = st.chunks[c].handle.take() {
                                    st.spare.push(h);
                                }
                            }
                            Err(e) => {
                                record_drop_error("cuMemUnmap", e);
                                st.chunks[c].stuck = true;
                            }
                        }
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Adds `stamps` to the free runs overlapping units `lo..hi`.
    fn stamp_free(&self, st: &mut State<B>, lo: usize, hi: usize, stamps: &Stamps) {
        for s in st.free.overlapping(lo, hi) {
            if let Some(run) = st.free.payload_mut(s) {
                merge(&st.clocks, run, stamps.clone());
            }
        }
    }

    /// A handle for a chunk, with the marks its previous users' work must be ordered
    /// after: a spare one, one unmapped from an idle chunk whose work completed, a new
    /// one, or (when none can be made) one of an idle chunk whose work is pending, mapped
    /// anew while its old mapping is retired.
    fn handle(&self, st: &mut State<B>, b: &B) -> Result<(u64, Stamps)> {
        if let Some(h) = st.spare.pop() {
            return Ok((h, Vec::new()));
        }
        // Idle chunks stay mapped for the blocks that fit there, up to an allowance;
        // beyond it one is moved (its work completed, else pending) before new memory is
        // made. Moving costs an unmap and a map where making costs a map: an allowance of
        // none would move chunks back and forth (on the H200, 20 s for RMM's workload).
        let idle_bytes = st.idle.len() * self.chunk_bytes();
        if idle_bytes > (st.stats.block_bytes / self.idle_divisor).max(IDLE_FLOOR_CHUNKS * self.chunk_bytes())
        {
            if let Some(h) = self.reclaim(st, b, RECLAIM_TRIES, Reclaim::Retire) {
                return Ok(h);
            }
        }
        let chunk = self.chunk_bytes();
        if let Err(e) = self.reservations.take(chunk) {
            // At the pool's limit: only an idle chunk can serve (the cache's recovery runs
            // next).
            return self.reclaim(st, b, usize::MAX, Reclaim::Retire).ok_or(e);
        }
        match timed(&mut st.stats.driver_ns[CREATE], || self.phys.create(chunk)) {
            Err(e) => {
                self.reservations.give(chunk);
                if e.is_out_of_memory() {
                    self.reclaim(st, b, usize::MAX, Reclaim::Retire).ok_or(e)
                } else {
                    Err(e)
                }
            }
            Ok(h) => {
                st.stats.creates += 1;
                st.stats.reserved += self.chunk_bytes();
                st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
                Ok((h, Vec::new()))
            }
        }
    }

    /// Takes the handle of an idle chunk (trying at most `tries`, from the highest
    /// address), as `how` says, with the marks to order its next use after.
    fn reclaim(&self, st: &mut State<B>, b: &B, tries: usize, how: Reclaim) -> Option<(u64, Stamps)> {
        let mut below = usize::MAX;
        let mut pending = None;
        for _ in 0..tries {
            let Some(&c) = st.idle.range(..below).next_back() else {
                break;
            };
            below = c;
            let first = c * self.chunk_units;
            let Some((rs, _, stamps)) = st.free.at_or_before(first) else {
                continue;
            };
            let last = first + self.chunk_units;
            let frees = touching(stamps, first, last);
            let done = frees.iter().all(|s| match how {
                Reclaim::Wait => self.wait_done(st, b, s),
                Reclaim::Retire => self.settle(st, b, s),
            });
            if !done {
                pending = pending.or(Some((c, rs)));
                continue;
            }
            st.idle.remove(&c);
            let va = self.va_of(st, first);
            let cb = self.chunk_bytes();
            // SAFETY: the chunk was mapped by `map_chunks` with a chunk's bytes; no block
            // holds a unit of it, and the marks of every free of its units
            // completed (a run keeps the latest mark of each stream until it completes).
            match timed(&mut st.stats.driver_ns[UNMAP], || unsafe {
                self.phys.unmap(va, cb)
            }) {
                Ok(()) => {
                    st.stats.unmaps += 1;
                    b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                    return st.chunks[c].handle.take().map(|h| (h, Vec::new()));
                }
                Err(e) => {
                    record_drop_error("cuMemUnmap", e);
                    st.chunks[c].stuck = true;
                }
            }
        }
        let (c, rs) = pending.filter(|_| how == Reclaim::Retire)?;
        let h = st.chunks[c].handle?;
        // Carve the chunk out of its run: its units stay mapped, out of use, until the
        // run's marks complete (`poll`).
        let run = self.take_run(st, rs)?;
        let (first, end) = (c * self.chunk_units, (c + 1) * self.chunk_units);
        if rs < first {
            self.put_run(st, rs, first - rs, touching(&run.stamps, rs, first));
        }
        if rs + run.len > end {
            self.put_run(
                st,
                end,
                rs + run.len - end,
                touching(&run.stamps, end, rs + run.len),
            );
        }
        st.idle.remove(&c);
        st.chunks[c].used = self.chunk_units;
        let mine = touching(&run.stamps, first, end);
        st.retired.push((c, mine.clone()));
        Some((h, mine))
    }

    /// Unmaps retired chunks whose marks completed (querying at most `max` chunks; with
    /// `wait`, after waiting on the host), and frees their units.
    fn poll(&self, st: &mut State<B>, b: &B, max: usize, wait: bool) {
        let mut i = 0;
        let mut seen = 0;
        while i < st.retired.len() && seen < max {
            seen += 1;
            let frees = st.retired[i].1.clone();
            let done = frees.iter().all(|s| {
                if wait {
                    self.wait_done(st, b, s)
                } else {
                    self.settle(st, b, s)
                }
            });
            if !done {
                i += 1;
                continue;
            }
            let (c, _) = st.retired.swap_remove(i);
            let first = c * self.chunk_units;
            let va = self.va_of(st, first);
            let cb = self.chunk_bytes();
            // SAFETY: the chunk's old mapping (a chunk's bytes, by `map_chunks`); no block
            // holds its units, and the marks of their last frees completed.
            match timed(&mut st.stats.driver_ns[UNMAP], || unsafe {
                self.phys.unmap(va, cb)
            }) {
                Ok(()) => {
                    st.stats.unmaps += 1;
                    b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                    // The handle lives on in its new mapping.
                    st.chunks[c].handle = None;
                    self.give_back(st, first, self.chunk_units, Vec::new());
                }
                Err(e) => {
                    // The mapping stays: the units are never used again.
                    record_drop_error("cuMemUnmap", e);
                    st.chunks[c].stuck = true;
                }
            }
        }
    }

    /// Reserves a region for at least `n` units; returns its first unit (a free run
    /// of the whole region).
    fn add_region(&self, st: &mut State<B>, n: usize) -> Result<usize> {
        let cu = self.chunk_units;
        let too_large = || Error::OutOfMemory {
            requested: n.saturating_mul(self.unit),
        };
        let units = (self.region_bytes / self.unit)
            .max(n)
            .checked_next_multiple_of(cu)
            .ok_or_else(too_large)?;
        let bytes = units.checked_mul(self.unit).ok_or_else(too_large)?;
        let va = self.phys.reserve(bytes)?;
        st.stats.range_reserves += 1;
        let first = st.next_index;
        st.next_index = first + units + cu;
        st.regions.push(Region { first, units, va });
        st.chunks.resize_with(st.next_index / cu, Chunk::default);
        self.put_run(st, first, units, Vec::new());
        Ok(first)
    }

    /// Removes the free run starting at `start`.
    /// `None` only if the index lost the run (an internal bug: debug builds stop here;
    /// release builds fail the operation at hand instead of panicking on an allocation
    /// path).
    fn take_run(&self, st: &mut State<B>, start: usize) -> Option<Run> {
        let run = st.free.remove(start).map(|(len, stamps)| Run { len, stamps });
        debug_assert!(
            run.is_some(),
            "page heap: unit {start} starts no free run of the index"
        );
        run
    }

    /// Inserts a free run as it is (its neighbours are not free).
    fn put_run(&self, st: &mut State<B>, start: usize, len: usize, stamps: Stamps) {
        st.free.insert(start, len, stamps);
    }

    /// Frees units `start..start + n` (of a block or a failed allocation) with
    /// `stamps`: coalesced with the free runs around them, their chunks idle if wholly free.
    fn give_back(&self, st: &mut State<B>, start: usize, n: usize, mut stamps: Stamps) {
        for (c, k) in self.chunks_of(start, n) {
            let ch = &mut st.chunks[c];
            ch.used -= k;
            if ch.used == 0 && ch.handle.is_some() && !ch.stuck {
                st.idle.insert(c);
            }
        }
        let (mut start, mut len) = (start, n);
        if let Some((s, l)) = st.free.ending_at(start) {
            if let Some(run) = self.take_run(st, s) {
                merge(&st.clocks, &mut stamps, run.stamps);
                (start, len) = (s, len + l);
            }
        }
        if st.free.len_at(start + len).is_some() {
            if let Some(run) = self.take_run(st, start + len) {
                len += run.len;
                merge(&st.clocks, &mut stamps, run.stamps);
            }
        }
        merge(&st.clocks, &mut stamps, Vec::new());
        self.put_run(st, start, len, stamps);
    }

    /// Frees the block at `ptr` in the order of `stream`.
    ///
    /// # Safety
    /// 1. `ptr` came from [`PageHeap::alloc`] of this heap, is freed once, and every use of
    ///    it is ordered before this point of `stream`.
    pub(crate) unsafe fn free(&self, b: &B, ptr: u64, stream: &B::Stream) {
        let mut st = lock(&self.state);
        let Some((start, n)) = st.live.remove(&ptr) else {
            drop(st);
            return record_drop_error(
                "freeing a page block",
                Error::InvalidArgument("not a live block of the page heap"),
            );
        };
        // Numbered under the lock: the frees of one stream are numbered in its order. No
        // mark is recorded: another stream that takes these units first asks whether the
        // work completed, and records one only if it may not have (`order_after`).
        st.op += 1;
        st.stats.block_bytes -= n * self.unit;
        st.seq += 1;
        let seq = st.seq;
        let id = B::stream_id(stream);
        st.clocks
            .entry(id)
            .or_insert_with(|| Clock {
                stream: stream.clone(),
                freed: seq,
                // A stream without a clock has no free pending (see `completed`).
                done: seq - 1,
                marks: VecDeque::new(),
                asked: 0,
            })
            .freed = seq;
        let freed = Freed {
            stream: id,
            seq,
            lo: start,
            hi: start + n,
        };
        self.give_back(&mut st, start, n, vec![freed]);
        self.poll(&mut st, b, POLL, false);
        self.forget_clocks(&mut st, MAX_CLOCKS);
        let dead = core::mem::take(&mut st.dead);
        drop(st);
        drop(dead);
    }

    /// Whether the frees `f` stands for are known to have completed, asking the driver
    /// (the stream's oldest marks; without a pending mark, whether the stream is idle) at
    /// most once per stream and heap operation. A failed query counts as pending.
    fn settle(&self, st: &mut State<B>, b: &B, f: &Freed) -> bool {
        if completed(&st.clocks, f) {
            return true;
        }
        let op = st.op;
        let Some(c) = st.clocks.get_mut(&f.stream) else {
            return true;
        };
        if c.asked == op {
            return false;
        }
        c.asked = op;
        // Marks of one stream complete in order.
        while let Some((seq, m)) = c.marks.front() {
            if !matches!(b.is_complete(m), Ok(true)) {
                break;
            }
            c.done = c.done.max(*seq);
            c.marks.pop_front();
        }
        // A pending mark means pending work: only without one is the stream asked.
        if f.seq > c.done && c.marks.is_empty() && matches!(b.is_idle(&c.stream), Ok(true)) {
            c.done = c.freed;
        }
        f.seq <= c.done
    }

    /// Makes work queued on `stream` from now on run after the work of the frees `f`
    /// stands for: nothing if it completed, else a wait (no host wait) for the first mark
    /// recorded after them, recorded now if there is none (it covers every free of its
    /// stream so far).
    fn order_after(&self, st: &mut State<B>, b: &B, stream: &B::Stream, f: &Freed) -> Result<()> {
        if !self.guard.load(Ordering::Relaxed) || self.settle(st, b, f) {
            return Ok(());
        }
        let Some(c) = st.clocks.get_mut(&f.stream) else {
            return Ok(());
        };
        let i = match c.marks.iter().position(|&(seq, _)| seq >= f.seq) {
            Some(i) => i,
            None => {
                c.marks.push_back((c.freed, b.mark(&c.stream)?));
                st.stats.marks += 1;
                c.marks.len() - 1
            }
        };
        b.wait(stream, &c.marks[i].1)?;
        st.stats.waits += 1;
        Ok(())
    }

    /// Waits on the host until the work of the frees `f` stands for completed (the first
    /// mark after them, else the whole stream); whether it did (a failed wait is counted
    /// and the work stays pending).
    fn wait_done(&self, st: &mut State<B>, b: &B, f: &Freed) -> bool {
        if self.settle(st, b, f) {
            return true;
        }
        let Some(c) = st.clocks.get_mut(&f.stream) else {
            return true;
        };
        let waited = match c.marks.iter().position(|&(seq, _)| seq >= f.seq) {
            Some(i) => b.wait_host(&c.marks[i].1).map(|()| c.marks[i].0),
            None => b.synchronize(&c.stream).map(|()| c.freed),
        };
        match waited {
            Ok(seq) => {
                c.done = c.done.max(seq);
                while c.marks.front().is_some_and(|&(s, _)| s <= c.done) {
                    c.marks.pop_front();
                }
                true
            }
            Err(e) => {
                record_drop_error("waiting for a page block's frees", e);
                false
            }
        }
    }

    /// Forgets the clocks of streams whose frees all completed while there are more than
    /// `keep` clocks (their handles go to `dead`, dropped after the lock).
    fn forget_clocks(&self, st: &mut State<B>, keep: usize) {
        if st.clocks.len() <= keep {
            return;
        }
        let gone: Vec<StreamId> = st
            .clocks
            .iter()
            .filter(|(_, c)| c.done >= c.freed && c.marks.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(c) = st.clocks.remove(&id) {
                st.dead.push(c.stream);
            }
        }
    }

    /// Releases spare handles, then idle chunks from the highest address (waiting on the
    /// host for their marks), until the heap reserves less than `keep` bytes (0: all it
    /// can, and the regions left empty are freed).
    pub(crate) fn trim_to(&self, b: &B, keep: usize) {
        let mut st = lock(&self.state);
        st.op += 1;
        let all = keep == 0;
        let keep = keep.max(1);
        self.poll(&mut st, b, usize::MAX, true);
        while st.stats.reserved >= keep {
            let h = match st.spare.pop() {
                Some(h) => h,
                None => match self.reclaim(&mut st, b, usize::MAX, Reclaim::Wait) {
                    Some((h, _)) => h,
                    None => break,
                },
            };
            if st.retired.iter().any(|&(c, _)| st.chunks[c].handle == Some(h)) {
                // Still mapped at a chunk whose work could not be waited for: kept.
                st.spare.push(h);
                break;
            }
            // SAFETY: the handle is mapped nowhere (spare, or just unmapped) and
            // forgotten here.
            match timed(&mut st.stats.driver_ns[RELEASE], || unsafe {
                self.phys.release(h)
            }) {
                Ok(()) => {
                    st.stats.reserved -= self.chunk_bytes();
                    self.reservations.give(self.chunk_bytes());
                    st.stats.releases += 1;
                }
                Err(e) => record_drop_error("cuMemRelease", e),
            }
        }
        if all {
            self.free_empty_regions(&mut st);
        }
        self.forget_clocks(&mut st, if all { 0 } else { MAX_CLOCKS });
        let dead = core::mem::take(&mut st.dead);
        drop(st);
        drop(dead);
    }

    /// Frees the regions with no block and no mapping.
    fn free_empty_regions(&self, st: &mut State<B>) {
        let cu = self.chunk_units;
        let mut i = 0;
        while i < st.regions.len() {
            let r = &st.regions[i];
            let (first, units, va) = (r.first, r.units, r.va);
            let empty = st.free.len_at(first) == Some(units)
                && (first / cu..(first + units) / cu).all(|c| st.chunks[c].handle.is_none());
            if !empty {
                i += 1;
                continue;
            }
            // SAFETY: the range came from reserve, nothing is mapped in it, and it is
            // forgotten here.
            if let Err(e) = unsafe { self.phys.free_range(va, units * self.unit) } {
                record_drop_error("cuMemAddressFree", e);
            }
            let _ = self.take_run(st, first);
            st.regions.remove(i);
        }
    }

    /// Gives everything back, at the backend's drop: trims to 0, then releases the
    /// handles of chunks still mapped (blocks still live, or stuck; the driver frees them
    /// once unmapped).
    pub(crate) fn shutdown(&self, b: &B) {
        self.trim_to(b, 0);
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.dead.extend(st.clocks.drain().map(|(_, c)| c.stream));
        // A handle may be mapped at two chunks (its own and a retired one): released once.
        let mut handles: std::collections::BTreeSet<u64> = st.spare.drain(..).collect();
        handles.extend(st.chunks.iter_mut().filter_map(|c| c.handle.take()));
        for h in handles {
            // SAFETY: the pool is being dropped: nothing allocates from it again; a
            // handle released while mapped is freed by the driver at its unmap.
            if let Err(e) = unsafe { self.phys.release(h) } {
                record_drop_error("cuMemRelease", e);
            }
        }
    }
}
