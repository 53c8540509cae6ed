//! A simulated GPU for CPU tests and loom models: each stream is a counter of the
//! operations queued on it and of those completed; a mark is a position; a wait is
//! remembered by the waiting stream. Tests ask [`FakeStream::covers`] whether a stream
//! that received a block is ordered after the block's last use elsewhere. Built for tests and
//! with the `sim` feature (the simulated pool of `sim.rs`, which the `device_hit_sim`
//! benchmark runs on), never in a plain build.

use std::collections::BTreeMap;

use super::backend::{nvtx_heap, Backend};
use super::config::PageTuning;
use super::order::StreamOrder;
use super::pages::PageHeap;
use super::phys::Phys;
use super::reserve::{PoolSide, Reservations};
use crate::cuda::StreamId;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, Mutex, Ordering};
use crate::trace::{PoolReservation, Tag};

/// One simulated stream's queue.
#[derive(Debug, Default)]
pub(crate) struct Lane {
    /// Operations queued so far (positions 1..=queued).
    queued: AtomicU64,
    /// Operations completed so far.
    completed: AtomicU64,
    /// A vector clock: for each other stream, the latest position of it that work
    /// queued on this stream from now on runs after (through waits, transitively: a
    /// mark carries the clock of its stream, and a wait merges it).
    clock: Mutex<BTreeMap<StreamId, u64>>,
}

/// A simulated stream (clones share the queue).
#[derive(Clone, Debug)]
pub(crate) struct FakeStream {
    pub(crate) id: StreamId,
    pub(crate) lane: Arc<Lane>,
}

impl FakeStream {
    pub(crate) fn new() -> Self {
        let s = Self {
            id: StreamId::fresh(),
            lane: Arc::new(Lane::default()),
        };
        registry::register(s.id, &s.lane);
        s
    }

    /// Queues an operation (a kernel using a block); returns its position.
    pub(crate) fn enqueue(&self) -> u64 {
        self.lane.queued.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Operations completed so far.
    pub(crate) fn completed(&self) -> u64 {
        self.lane.completed.load(Ordering::SeqCst)
    }

    /// The GPU catches up: everything queued so far completes, and so does, on other
    /// streams, everything this stream waited for (its clock).
    pub(crate) fn complete_all(&self) {
        let clock = lock(&self.lane.clock).clone();
        let q = self.lane.queued.load(Ordering::SeqCst);
        self.lane.completed.fetch_max(q, Ordering::SeqCst);
        registry::complete_through(&clock);
    }

    /// Whether work queued on `self` from now on runs after position `pos` of
    /// `other`: the same stream, or `other` has completed it, or `self` waits
    /// (directly or through other streams' marks) for a mark of `other` at or after it.
    pub(crate) fn covers(&self, other: &FakeStream, pos: u64) -> bool {
        if self.id == other.id || other.completed() >= pos {
            return true;
        }
        lock(&self.lane.clock).get(&other.id).is_some_and(|&p| p >= pos)
    }
}

/// The simulated streams by id, so that the completion of a stream's work completes
/// what it waited for on others (outside loom, whose models never need it: their
/// checks ask `covers`, which reads the clocks).
mod registry {
    use std::collections::BTreeMap;

    use super::Lane;
    use crate::cuda::StreamId;

    #[cfg(not(loom))]
    use crate::sync::{lock, Arc, Mutex, Weak};

    #[cfg(not(loom))]
    static LANES: Mutex<BTreeMap<StreamId, Weak<Lane>>> = Mutex::new(BTreeMap::new());

    #[cfg(not(loom))]
    pub(super) fn register(id: StreamId, lane: &Arc<Lane>) {
        let mut m = lock(&LANES);
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(id, Arc::downgrade(lane));
    }

    /// Completes each stream of `clock` up to its position there.
    #[cfg(not(loom))]
    pub(super) fn complete_through(clock: &BTreeMap<StreamId, u64>) {
        let lanes: Vec<(Arc<Lane>, u64)> = {
            let m = lock(&LANES);
            clock
                .iter()
                .filter_map(|(id, &p)| Some((m.get(id)?.upgrade()?, p)))
                .collect()
        };
        for (lane, p) in lanes {
            lane.completed.fetch_max(p, crate::sync::Ordering::SeqCst);
        }
    }

    #[cfg(loom)]
    pub(super) fn register(_: StreamId, _: &crate::sync::Arc<Lane>) {}

    #[cfg(loom)]
    pub(super) fn complete_through(_: &BTreeMap<StreamId, u64>) {}
}

/// A position recorded on a simulated stream, with that stream's clock then.
#[derive(Debug)]
pub(crate) struct FakeMark {
    stream: StreamId,
    pos: u64,
    lane: Arc<Lane>,
    clock: BTreeMap<StreamId, u64>,
}

/// The simulated driver pool's reservations, after what the H200's driver showed
/// (`cuMemAllocFromPoolAsync`, release threshold at its maximum): memory is reserved
/// in chunks of at least 32 MiB (a 1 MiB block reserved 32 MiB; 256 B + 1 MiB +
/// 128 MiB reserved 160 MiB), a larger block gets a chunk of its own rounded up to
/// 2 MiB, and a block is carved from the smallest free extent of any chunk that holds
/// it (freed extents merge with their neighbours). Trimming gives back chunks with no
/// block in them. Frees count as completed at once (the simulated streams run nothing
/// that the driver would wait for).
#[derive(Debug, Default)]
pub(crate) struct PoolModel {
    /// Per chunk (by id): its size and its free extents (offset -> length).
    chunks: BTreeMap<u64, (u64, BTreeMap<u64, u64>)>,
    next_chunk: u64,
    /// Per block: (chunk id, offset, length).
    blocks: BTreeMap<u64, (u64, u64, u64)>,
    reserved: u64,
    peak_reserved: u64,
    /// Bytes of live blocks.
    used: u64,
}

/// The smallest chunk the model reserves, and the granule of larger ones.
const CHUNK: u64 = 32 << 20;
const GRANULE: u64 = 2 << 20;

impl PoolModel {
    /// The free extent that a block of `len` bytes would take: (length, chunk, offset).
    fn fit(&self, len: u64) -> Option<(u64, u64, u64)> {
        self.chunks
            .iter()
            .flat_map(|(&id, (_, free))| free.iter().map(move |(&off, &l)| (l, id, off)))
            .filter(|&(l, _, _)| l >= len)
            .min()
    }

    /// Bytes a block of `len` would add to the reservation.
    fn growth(&self, len: u64) -> u64 {
        match self.fit(len) {
            Some(_) => 0,
            None => (len.div_ceil(GRANULE).max(1) * GRANULE).max(CHUNK),
        }
    }

    fn alloc(&mut self, ptr: u64, len: u64) {
        let fit = self
            .chunks
            .iter()
            .flat_map(|(&id, (_, free))| free.iter().map(move |(&off, &l)| (l, id, off)))
            .filter(|&(l, _, _)| l >= len)
            .min();
        let (id, off, l) = match fit {
            Some((l, id, off)) => (id, off, l),
            None => {
                let size = len.div_ceil(GRANULE).max(1) * GRANULE;
                let size = size.max(CHUNK);
                let id = self.next_chunk;
                self.next_chunk += 1;
                self.chunks.insert(id, (size, BTreeMap::from([(0, size)])));
                self.reserved += size;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                (id, 0, size)
            }
        };
        let free = &mut self.chunks.get_mut(&id).expect("the chunk fits").1;
        free.remove(&off);
        if l > len {
            free.insert(off + len, l - len);
        }
        self.blocks.insert(ptr, (id, off, len));
        self.used += len;
    }

    fn free(&mut self, ptr: u64) {
        let Some((id, mut off, mut len)) = self.blocks.remove(&ptr) else {
            return;
        };
        self.used -= len;
        let free = &mut self.chunks.get_mut(&id).expect("the block's chunk").1;
        if let Some((&o, &l)) = free.range(..off).next_back() {
            if o + l == off {
                free.remove(&o);
                off = o;
                len += l;
            }
        }
        if let Some(l) = free.remove(&(off + len)) {
            len += l;
        }
        free.insert(off, len);
    }

    fn trim_to(&mut self, keep: u64) {
        let mut empty: Vec<(u64, u64)> = self
            .chunks
            .iter()
            .filter(|(_, (size, free))| free.get(&0) == Some(size))
            .map(|(&id, &(size, _))| (size, id))
            .collect();
        empty.sort_unstable();
        while self.reserved >= keep.max(1) {
            let Some((size, id)) = empty.pop() else { break };
            self.chunks.remove(&id);
            self.reserved -= size;
        }
    }
}

/// A simulated device: addresses from a counter (never reused, so that the tests'
/// checker can follow each block), a byte limit on what is allocated, a check that
/// every block is freed once with its size, and a model of the driver pool's
/// reservations ([`PoolModel`]).
#[derive(Debug)]
pub(crate) struct FakeBackend {
    /// Large blocks on simulated physical pages.
    pub(crate) pages: Option<PageHeap<FakePhys, FakeBackend>>,
    /// The driver-pool model's and the page heap's reservations, under the pool's
    /// limit ([`FakeBackend::with_pool_limit`]).
    pub(crate) reservations: Arc<Reservations>,
    /// The most the driver-pool model and the page heap reserved together.
    peak_total: AtomicU64,
    next: AtomicU64,
    held: AtomicU64,
    limit: u64,
    live: Arc<Mutex<BTreeMap<u64, usize>>>,
    pool: Mutex<PoolModel>,
    /// Marks fail (a broken stream) while set.
    pub(crate) fail_marks: AtomicBool,
    pub(crate) marks: AtomicU64,
    pub(crate) allocs: AtomicU64,
    pub(crate) frees: AtomicU64,
    pub(crate) syncs: AtomicU64,
    /// Times the heap asked whether a stream is idle.
    pub(crate) idle_queries: AtomicU64,
    pub(crate) trims: AtomicU64,
    /// The simulated pool's events, named `SimPool(0)`.
    trace: Tag,
    /// The driver-pool model's reservation as recorded, as a `DevicePool`'s.
    growth: PoolReservation,
    /// Whether its blocks are NVTX heaps (off by default: the simulator's addresses are
    /// not memory a real tool could check; tests of the annotations with a fake tool
    /// turn it on).
    nvtx: bool,
}

fn sim_pool_name(device: u32) -> String {
    format!("SimPool({device})")
}

impl FakeBackend {
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            pages: None,
            reservations: Arc::new(Reservations::new(None)),
            peak_total: AtomicU64::new(0),
            next: AtomicU64::new(1 << 20),
            held: AtomicU64::new(0),
            limit,
            live: Arc::new(Mutex::new(BTreeMap::new())),
            pool: Mutex::new(PoolModel::default()),
            fail_marks: AtomicBool::new(false),
            marks: AtomicU64::new(0),
            allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            idle_queries: AtomicU64::new(0),
            trims: AtomicU64::new(0),
            trace: Tag::for_device(sim_pool_name, 0),
            growth: PoolReservation::new(),
            nvtx: false,
        }
    }

    /// This simulated device with its blocks described as NVTX heaps, as a `DevicePool`'s.
    pub(crate) fn with_nvtx(mut self) -> Self {
        self.nvtx = true;
        self
    }

    /// A simulated device whose blocks of `page_min` bytes and more live on the page
    /// heap over `phys`, tuned by `tuning`.
    pub(crate) fn paged(limit: u64, phys: FakePhys, page_min: usize, tuning: PageTuning) -> Self {
        let mut b = Self::new(limit);
        b.pages = Some(PageHeap::new(phys, tuning).with_min_block(page_min));
        b
    }

    /// This device holding its driver-pool model and its page heap together to at most
    /// `limit` bytes of reservations, as a `DevicePool`'s limit does.
    pub(crate) fn with_pool_limit(mut self, limit: Option<usize>) -> Self {
        let reservations = Arc::new(Reservations::new(limit));
        self.pages = self
            .pages
            .take()
            .map(|h| h.with_reservations(reservations.clone()));
        self.reservations = reservations;
        self
    }

    fn heap_reserved(&self) -> u64 {
        self.pages.as_ref().map_or(0, |h| h.reserved() as u64)
    }

    /// The most the simulated driver pool reserved.
    pub(crate) fn pool_peak(&self) -> u64 {
        lock(&self.pool).peak_reserved
    }

    /// Bytes allocated and not freed.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Blocks allocated and not freed.
    pub(crate) fn live_blocks(&self) -> usize {
        lock(&self.live).len()
    }

    /// The blocks allocated and not freed, readable after the backend is gone.
    pub(crate) fn live_map(&self) -> Arc<Mutex<BTreeMap<u64, usize>>> {
        self.live.clone()
    }

    /// Bytes the simulated driver pool and the page heap reserve now, and at most so
    /// far.
    pub(crate) fn reservation(&self) -> (u64, u64) {
        let m = lock(&self.pool);
        let now = m.reserved + self.heap_reserved();
        (now, self.peak_total.load(Ordering::SeqCst).max(now))
    }
}

impl StreamOrder for FakeBackend {
    type Stream = FakeStream;
    type Mark = FakeMark;

    fn stream_id(stream: &FakeStream) -> StreamId {
        stream.id
    }

    fn mark(&self, stream: &FakeStream) -> Result<FakeMark> {
        if self.fail_marks.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument("fake: marks fail"));
        }
        self.marks.fetch_add(1, Ordering::SeqCst);
        // Recording is itself an operation queued on the stream, after all earlier ones
        // (the waits queued before it included: the clock is read under its lock).
        let clock = lock(&stream.lane.clock);
        let pos = stream.enqueue();
        let mut snapshot = clock.clone();
        snapshot.insert(stream.id, pos);
        Ok(FakeMark {
            stream: stream.id,
            pos,
            lane: stream.lane.clone(),
            clock: snapshot,
        })
    }

    fn wait(&self, stream: &FakeStream, mark: &FakeMark) -> Result<()> {
        debug_assert_eq!(mark.clock.get(&mark.stream), Some(&mark.pos));
        let mut clock = lock(&stream.lane.clock);
        for (&s, &p) in &mark.clock {
            if s != stream.id {
                let e = clock.entry(s).or_insert(0);
                *e = (*e).max(p);
            }
        }
        Ok(())
    }

    fn is_complete(&self, mark: &FakeMark) -> Result<bool> {
        let done = mark.lane.completed.load(Ordering::SeqCst) >= mark.pos;
        if done {
            // What the mark's stream waited for before it completed too (a GPU stream
            // cannot pass a wait before the awaited work completes).
            registry::complete_through(&mark.clock);
        }
        Ok(done)
    }

    fn wait_host(&self, mark: &FakeMark) -> Result<()> {
        mark.lane.completed.fetch_max(mark.pos, Ordering::SeqCst);
        registry::complete_through(&mark.clock);
        Ok(())
    }

    fn is_idle(&self, stream: &FakeStream) -> Result<bool> {
        self.idle_queries.fetch_add(1, Ordering::SeqCst);
        // As `complete_all` reads them: the waits first, then the work queued.
        let clock = lock(&stream.lane.clock).clone();
        let idle = stream.completed() >= stream.lane.queued.load(Ordering::SeqCst);
        if idle {
            // What the stream waited for completed before it did.
            registry::complete_through(&clock);
        }
        Ok(idle)
    }

    fn synchronize(&self, stream: &FakeStream) -> Result<()> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        stream.complete_all();
        Ok(())
    }

    fn trace(&self) -> &Tag {
        &self.trace
    }
}

impl Backend for FakeBackend {
    fn alloc(&self, bytes: usize, stream: &FakeStream) -> Result<u64> {
        assert!(bytes > 0 && bytes % 256 == 0, "fake: bad request {bytes}");
        let b = bytes as u64;
        let mut held = self.held.load(Ordering::SeqCst);
        loop {
            if held + b > self.limit {
                return Err(Error::OutOfMemory { requested: bytes });
            }
            match self
                .held
                .compare_exchange(held, held + b, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break,
                Err(now) => held = now,
            }
        }
        if PageHeap::serving(&self.pages, bytes).is_none() {
            self.growth.before(|| Some(lock(&self.pool).reserved));
        }
        let ptr = match PageHeap::serving(&self.pages, bytes) {
            Some(h) => match h.alloc(self, bytes, stream) {
                Ok(p) => p,
                Err(e) => {
                    self.held.fetch_sub(b, Ordering::SeqCst);
                    return Err(e);
                }
            },
            None => match self
                .reservations
                .pool_alloc(bytes, &ModelPool(self))
                .inspect(|&p| {
                    self.growth.after(&self.trace, p, stream.id.get(), || {
                        Some(lock(&self.pool).reserved)
                    })
                }) {
                Ok(p) => p,
                Err(e) => {
                    self.held.fetch_sub(b, Ordering::SeqCst);
                    return Err(e);
                }
            },
        };
        assert!(
            lock(&self.live).insert(ptr, bytes).is_none(),
            "fake: block {ptr:#x} handed out twice"
        );
        let total = lock(&self.pool).reserved + self.heap_reserved();
        self.peak_total.fetch_max(total, Ordering::SeqCst);
        self.allocs.fetch_add(1, Ordering::SeqCst);
        nvtx_heap(self.nvtx, ptr, bytes);
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: u64, bytes: usize, stream: &FakeStream) {
        nvtx_heap(self.nvtx, ptr, 0);
        let size = lock(&self.live).remove(&ptr);
        assert_eq!(
            size,
            Some(bytes),
            "fake: block {ptr:#x} freed twice or with a wrong size"
        );
        match PageHeap::serving(&self.pages, bytes) {
            // SAFETY: the caller's obligation 1; blocks of this size come from the heap.
            Some(h) => unsafe { h.free(self, ptr, stream) },
            None => lock(&self.pool).free(ptr),
        }
        self.held.fetch_sub(bytes as u64, Ordering::SeqCst);
        self.frees.fetch_add(1, Ordering::SeqCst);
    }

    fn trim_to(&self, keep: usize) {
        self.trims.fetch_add(1, Ordering::SeqCst);
        self.growth.before(|| Some(lock(&self.pool).reserved));
        let keep_pool = self.pages.as_ref().map_or(keep, |h| {
            let pool = lock(&self.pool).reserved as usize;
            h.trim_beside_pool(self, keep, pool)
        });
        lock(&self.pool).trim_to(keep_pool as u64);
        self.reservations
            .pool_trimmed(|| Some(lock(&self.pool).reserved as usize));
        self.growth
            .after(&self.trace, 0, 0, || Some(lock(&self.pool).reserved));
    }

    fn reserved(&self) -> Option<usize> {
        Some((lock(&self.pool).reserved + self.heap_reserved()) as usize)
    }
}

/// The driver-pool model as the reservations use it.
struct ModelPool<'a>(&'a FakeBackend);

impl PoolSide for ModelPool<'_> {
    fn usage(&self) -> Result<(usize, usize)> {
        let m = lock(&self.0.pool);
        Ok((m.reserved as usize, m.used as usize))
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let b = bytes as u64;
        let mut m = lock(&self.0.pool);
        // The driver pool's maximum size is the pool's limit.
        let limit = self.0.reservations.limit() as u64;
        if m.reserved.saturating_add(m.growth(b)) > limit {
            return Err(Error::OutOfMemory { requested: bytes });
        }
        let ptr = self.0.next.fetch_add(b, Ordering::SeqCst);
        m.alloc(ptr, b);
        // The peak of the two together, at the moment the model grew.
        let total = m.reserved + self.0.heap_reserved();
        self.0.peak_total.fetch_max(total, Ordering::SeqCst);
        Ok(ptr)
    }

    fn undo(&self, ptr: u64, keep: usize) {
        let mut m = lock(&self.0.pool);
        m.free(ptr);
        m.trim_to(keep as u64);
    }
}

impl Drop for FakeBackend {
    fn drop(&mut self) {
        if let Some(h) = &self.pages {
            h.shutdown(self);
        }
        self.growth.destroyed(&self.trace);
    }
}

/// Simulated physical memory for the page heap, checking every operation: handles
/// are power-of-two multiples of the granule, mapped whole into reserved ranges at
/// unmapped places, released only when unmapped, ranges freed only when empty; a
/// block's use ([`FakePhys::use_block`]) needs access set and a stream ordered after
/// every earlier use of each handle under it (on any range); an unmapping needs every
/// use of that mapping completed. Breaches are counted in `violations` (and printed),
/// never panics: tests assert there are none. Clones share the state.
#[derive(Clone, Debug)]
pub(crate) struct FakePhys {
    pub(crate) state: Arc<Mutex<PhysState>>,
}

/// A mapping: bytes, handle, the devices with access (bit d: device d; the fake's own
/// device is 0), uses through it, its id (one per `map`).
pub(crate) type Mapping = (usize, u64, u64, Vec<(FakeStream, u64)>, u64);

/// The simulated physical memory's books.
#[derive(Debug, Default)]
pub(crate) struct PhysState {
    pub(crate) granule: usize,
    /// Bytes of handles that may exist at once (out of memory beyond).
    pub(crate) limit: usize,
    next_handle: u64,
    next_va: u64,
    /// Live handles: bytes, mappings.
    pub(crate) handles: BTreeMap<u64, (usize, u32)>,
    pub(crate) handle_bytes: usize,
    /// Reserved ranges: start -> bytes.
    pub(crate) ranges: BTreeMap<u64, usize>,
    /// Mappings by start.
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    /// Uses of each handle, through any mapping (by id), not known to have completed.
    uses: BTreeMap<u64, Vec<(u64, FakeStream, u64)>>,
    next_mapping: u64,
    pub(crate) violations: Vec<String>,
    /// Per handle, what happened to it (for the violations' messages).
    history: BTreeMap<u64, Vec<String>>,
    pub(crate) creates: u64,
    pub(crate) maps: u64,
}

impl PhysState {
    fn violation(&mut self, what: String) {
        eprintln!("fake phys: {what}");
        self.violations.push(what);
    }
}

impl FakePhys {
    pub(crate) fn new(granule: usize, limit: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(PhysState {
                granule,
                limit,
                next_handle: 1,
                next_va: 1 << 44,
                ..PhysState::default()
            })),
        }
    }

    /// Work on `stream` uses the block at `[va, va + bytes)` (if it is on pages): checks
    /// access and that `stream` is ordered after every earlier use of its handles
    /// through other mappings (earlier blocks; uses of the same block on several
    /// streams are the cache's business), then records the use. Returns whether the
    /// block is on pages.
    pub(crate) fn use_block(&self, va: u64, bytes: usize, stream: &FakeStream) -> bool {
        self.record(va, bytes, stream, true)
    }

    /// Work on `stream` uses the live block at `[va, va + bytes)` besides its own
    /// stream's (what `record_use` declares): recorded, not checked (ordering such a use
    /// after the block's allocation is the program's business).
    pub(crate) fn use_block_elsewhere(&self, va: u64, bytes: usize, stream: &FakeStream) -> bool {
        self.record(va, bytes, stream, false)
    }

    fn record(&self, va: u64, bytes: usize, stream: &FakeStream, check: bool) -> bool {
        let mut st = lock(&self.state);
        let st = &mut *st;
        // Mappings overlapping the block (the first may start before it).
        let end = va + bytes as u64;
        let found: Vec<u64> = st
            .mappings
            .range(..end)
            .rev()
            .take_while(|(&v, m)| v + m.0 as u64 > va)
            .map(|(&v, _)| v)
            .collect();
        if found.is_empty() {
            return false;
        }
        let pos = stream.enqueue();
        let mut problems = Vec::new();
        let mut covered = 0usize;
        for v in found {
            let m = st.mappings.get_mut(&v).expect("found");
            covered += (v + m.0 as u64).min(end).saturating_sub(v.max(va)) as usize;
            if m.2 & 1 == 0 {
                problems.push(format!("use of {v:#x} without access"));
            }
            m.3.push((stream.clone(), pos));
            let (h, id) = (m.1, m.4);
            let uses = st.uses.entry(h).or_default();
            uses.retain(|(_, s, p)| s.completed() < *p);
            for (_, s, p) in uses.iter().filter(|u| check && u.0 != id) {
                if !stream.covers(s, *p) {
                    let h_ = st
                        .history
                        .get(&h)
                        .map(|v| v[v.len().saturating_sub(12)..].to_vec());
                    problems.push(format!(
                        "handle {h} used on {} at {pos} unordered after its use on {} at {p} \
                         ({} completed); history {h_:?}",
                        stream.id,
                        s.id,
                        s.completed()
                    ));
                }
            }
            uses.push((id, stream.clone(), pos));
            st.history
                .entry(h)
                .or_default()
                .push(format!("use of map {id} on {} at {pos}", stream.id));
        }
        if covered < bytes {
            problems.push(format!("block {va:#x} of {bytes} bytes only {covered} mapped"));
        }
        for p in problems {
            st.violation(p);
        }
        true
    }

    /// Whether device `peer` may access the whole of `[va, va + bytes)`.
    pub(crate) fn peer_reaches(&self, va: u64, bytes: usize, peer: usize) -> bool {
        let st = lock(&self.state);
        let end = va + bytes as u64;
        let mut covered = 0u64;
        for (&v, m) in st
            .mappings
            .range(..end)
            .rev()
            .take_while(|(&v, m)| v + m.0 as u64 > va)
        {
            if m.2 & (1 << peer) == 0 {
                return false;
            }
            covered += (v + m.0 as u64).min(end) - v.max(va);
        }
        covered == bytes as u64
    }

    /// Breaches so far.
    pub(crate) fn violations(&self) -> usize {
        lock(&self.state).violations.len()
    }

    /// (live handles, their bytes, reserved ranges, mappings).
    pub(crate) fn live(&self) -> (usize, usize, usize, usize) {
        let st = lock(&self.state);
        (
            st.handles.len(),
            st.handle_bytes,
            st.ranges.len(),
            st.mappings.len(),
        )
    }
}

impl Phys for FakePhys {
    fn granule(&self) -> usize {
        lock(&self.state).granule
    }

    fn create(&self, bytes: usize) -> Result<u64> {
        let mut st = lock(&self.state);
        let g = st.granule;
        if bytes == 0 || bytes % g != 0 || !(bytes / g).is_power_of_two() {
            st.violation(format!("create of {bytes} bytes"));
        }
        if st.handle_bytes + bytes > st.limit {
            return Err(Error::OutOfMemory { requested: bytes });
        }
        let h = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(h, (bytes, 0));
        st.handle_bytes += bytes;
        st.creates += 1;
        Ok(h)
    }

    unsafe fn release(&self, handle: u64) -> Result<()> {
        let mut st = lock(&self.state);
        match st.handles.remove(&handle) {
            Some((bytes, maps)) => {
                st.handle_bytes -= bytes;
                st.uses.remove(&handle);
                if maps != 0 {
                    st.violation(format!("release of handle {handle} mapped {maps} times"));
                }
            }
            None => st.violation(format!("release of unknown handle {handle}")),
        }
        Ok(())
    }

    fn reserve(&self, bytes: usize) -> Result<u64> {
        let mut st = lock(&self.state);
        if bytes == 0 || bytes % st.granule != 0 {
            st.violation(format!("reserve of {bytes} bytes"));
        }
        let va = st.next_va;
        // A gap after each range, so that a mapping past its end is caught.
        st.next_va += bytes as u64 + st.granule as u64;
        st.ranges.insert(va, bytes);
        Ok(va)
    }

    unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()> {
        let mut st = lock(&self.state);
        if st.ranges.remove(&va) != Some(bytes) {
            st.violation(format!("free of unknown range {va:#x} ({bytes} bytes)"));
        }
        if st.mappings.range(va..va + bytes as u64).next().is_some() {
            st.violation(format!("free of range {va:#x} with mappings"));
        }
        Ok(())
    }

    unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()> {
        let mut st = lock(&self.state);
        let inside = st
            .ranges
            .range(..=va)
            .next_back()
            .is_some_and(|(&r, &l)| va + bytes as u64 <= r + l as u64);
        if !inside {
            st.violation(format!("map at {va:#x} outside a reserved range"));
        }
        let overlap = st
            .mappings
            .range(..va + bytes as u64)
            .next_back()
            .is_some_and(|(&m, &(l, ..))| m + l as u64 > va);
        if overlap {
            st.violation(format!("map at {va:#x} over a mapping"));
        }
        match st.handles.get_mut(&handle) {
            Some((b, maps)) if *b == bytes => *maps += 1,
            _ => st.violation(format!("map of handle {handle} unknown or not of {bytes} bytes")),
        }
        st.next_mapping += 1;
        let id = st.next_mapping;
        st.mappings.insert(va, (bytes, handle, 0, Vec::new(), id));
        st.history
            .entry(handle)
            .or_default()
            .push(format!("map {id} at {va:#x}"));
        st.maps += 1;
        Ok(())
    }

    unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()> {
        let mut st = lock(&self.state);
        match st.mappings.remove(&va) {
            Some((l, h, _, uses, _)) if l == bytes => {
                if let Some((_, maps)) = st.handles.get_mut(&h) {
                    *maps -= 1;
                }
                for (s, p) in uses {
                    if s.completed() < p {
                        st.violation(format!(
                            "unmap of {va:#x} (handle {h}) before its use on {} at {p} completed",
                            s.id
                        ));
                    }
                }
            }
            _ => st.violation(format!("unmap of unknown mapping {va:#x} ({bytes} bytes)")),
        }
        Ok(())
    }

    unsafe fn set_access(&self, va: u64, bytes: usize, peers: &[usize]) -> Result<()> {
        let mask = peers.iter().fold(1u64, |m, &p| m | 1 << p);
        let mut st = lock(&self.state);
        let mut at = va;
        let end = va + bytes as u64;
        let keys: Vec<u64> = st.mappings.range(va..end).map(|(&k, _)| k).collect();
        for k in keys {
            let m = st.mappings.get_mut(&k).expect("listed");
            if k != at {
                break;
            }
            m.2 |= mask;
            at += m.0 as u64;
        }
        if at != end {
            st.violation(format!("access to {va:#x} ({bytes} bytes) not wholly mapped"));
        }
        Ok(())
    }
}
