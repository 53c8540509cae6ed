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
//! - **No lock across a driver call**: one lock guards the heap's books
//!   (`pages/state.rs`), and no driver call (create, map, set-access, unmap, release,
//!   reserve, an event's record, query or wait, a stream's query) is made while it is
//!   held. An operation decides under the lock (takes the block's units, marks the
//!   chunks it will map or unmap *busy*, or carves them out of the free runs), drops it
//!   for the driver calls (`pages/map.rs`, `pages/trim.rs`; the questions about streams
//!   in `pages/clocks.rs`), and retakes it to publish, or to roll back on an error (the
//!   handles to the spares, the units free again, the error returned). So a block that
//!   fits in mapped memory never waits for another thread's driver calls; one whose
//!   chunk another allocation is mapping waits for that mapping alone.
//!
//! The algorithm is generic over [`Phys`] (the physical operations) and the cache's
//! [`StreamOrder`] (its marks), so CPU tests drive it with `device/fake.rs`, whose fake
//! physical memory checks every mapping, unmapping and use against the simulated streams.

mod clocks;
mod map;
mod state;
mod trim;

use std::marker::PhantomData;

use super::config::PageTuning;
use super::order::StreamOrder;
use super::phys::Phys;
use super::reserve::Reservations;
use crate::cuda::{record_drop_error, StreamId};
use crate::error::{Error, Result};
use crate::sync::{lock, wait, Arc, AtomicBool, Condvar, Mutex, MutexGuard, Ordering};
use clocks::{note_free, retag, Ask, Freed, Stamps};
use state::{unlock, State};

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
    /// The books; never held across a driver call.
    state: Mutex<State<B>>,
    /// Signalled when busy chunks are published or a region was reserved (an allocation
    /// whose chunk another one maps waits for it here, without the lock).
    changed: Condvar,
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
            state: Mutex::new(State::new()),
            changed: Condvar::new(),
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

    /// Whether [`enable_peer`](Self::enable_peer) gave `peer` access.
    pub(crate) fn has_peer(&self, peer: usize) -> bool {
        lock(&self.state).granted.contains(&peer)
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

    /// A block of at least `bytes` (nonzero) usable by work queued on `stream` from now
    /// on. Locked to take the units, for each round of mapping, to ask about streams and
    /// to publish; never across a driver call.
    pub(crate) fn alloc(&self, b: &B, bytes: usize, stream: &B::Stream) -> Result<u64> {
        let g = self.unit;
        let n = bytes.div_ceil(g).max(1);
        let len = n.checked_mul(g).ok_or(Error::OutOfMemory { requested: bytes })?;
        // Each stream is asked about once at most in the operation.
        let mut asked = Vec::new();
        self.poll(b, POLL, false, &mut asked);
        let (mut st, start) = self.place_or_grow(lock(&self.state), n)?;
        let mut after = self.take_block(&mut st, start, n);
        drop(st);
        // Map the chunks that are not, and order `stream` after the last users of these
        // units and of the handles mapped.
        let ordered = self
            .map_block(b, start, n, &mut after, &mut asked)
            .and_then(|()| self.order_block(b, stream, &after, &asked));
        let mut st = lock(&self.state);
        match ordered {
            Ok(answers) => self.apply(&mut st, answers),
            Err(e) => {
                self.give_back(&mut st, start, n, retag(after, start, start + n));
                unlock(st);
                return Err(e);
            }
        }
        let va = self.va_of(&st, start);
        st.live.insert(va, (start, n));
        st.stats.block_bytes += len;
        st.stats.peak_block_bytes = st.stats.peak_block_bytes.max(st.stats.block_bytes);
        unlock(st);
        Ok(va)
    }

    /// Where a block of `n` units goes; when no free run fits, a region is reserved
    /// first, without the lock (one at a time: another that needs one waits for it).
    fn place_or_grow<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B>>,
        n: usize,
    ) -> Result<(MutexGuard<'a, State<B>>, usize)> {
        loop {
            if let Some(start) = self.place(&st, n) {
                return Ok((st, start));
            }
            if st.growing {
                st = wait(&self.changed, st);
                continue;
            }
            st.growing = true;
            drop(st);
            let grown = self.reserve_region(n);
            st = lock(&self.state);
            st.growing = false;
            self.changed.notify_all();
            let (va, units) = grown?;
            self.add_region(&mut st, va, units);
        }
    }

    /// Reserves a region for at least `n` units (no lock held): its address and units.
    fn reserve_region(&self, n: usize) -> Result<(u64, usize)> {
        let too_large = || Error::OutOfMemory {
            requested: n.saturating_mul(self.unit),
        };
        let units = (self.region_bytes / self.unit)
            .max(n)
            .checked_next_multiple_of(self.chunk_units)
            .ok_or_else(too_large)?;
        let bytes = units.checked_mul(self.unit).ok_or_else(too_large)?;
        Ok((self.phys.reserve(bytes)?, units))
    }

    /// Makes work queued on `stream` from now on run after the frees of other streams in
    /// `after` (operation `op`): the questions snapshot under the lock, the queries, marks
    /// and waits (no host wait) without it; the answers, to apply under the lock.
    fn order_block(
        &self,
        b: &B,
        stream: &B::Stream,
        after: &Stamps,
        asked: &[StreamId],
    ) -> Result<Vec<clocks::Answer<B>>> {
        let me = B::stream_id(stream);
        if !self.guard.load(Ordering::Relaxed) || after.iter().all(|s| s.stream == me) {
            return Ok(Vec::new());
        }
        let asks: Vec<Ask<B>> = {
            let st = lock(&self.state);
            after
                .iter()
                .filter(|s| s.stream != me)
                .filter_map(|f| Ask::of(&st.clocks, f, !asked.contains(&f.stream)))
                .collect()
        };
        asks.iter().map(|a| a.order(b, stream)).collect()
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
        // work completed, and records one only if it may not have (`order_block`).
        st.stats.block_bytes -= n * self.unit;
        st.seq += 1;
        let seq = st.seq;
        let id = note_free(&mut st.clocks, stream, seq);
        let freed = Freed {
            stream: id,
            seq,
            lo: start,
            hi: start + n,
        };
        self.give_back(&mut st, start, n, vec![freed]);
        self.forget_clocks(&mut st, MAX_CLOCKS);
        unlock(st);
        self.poll(b, POLL, false, &mut Vec::new());
    }
}

#[cfg(test)]
mod tests;
