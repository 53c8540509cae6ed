//! A simulated GPU for CPU tests and loom models: each stream is a counter of the
//! operations queued on it and of those completed; a mark is a position; a wait is
//! remembered by the waiting stream. Tests ask [`FakeStream::covers`] whether a stream
//! that received a block is ordered after the block's last use elsewhere. Built for tests and
//! with the `sim` feature (the simulated pool of `sim.rs`, which the `device_hit_sim`
//! benchmark runs on), never in a plain build.
//!
//! In parts: this file (streams, marks, the device), `pool_model.rs` (the driver pool's
//! reservations), `physical.rs` (the page heap's physical memory, checked).

mod physical;
mod pool_model;

use std::collections::BTreeMap;

pub use self::physical::DriverCosts;
pub(crate) use self::physical::FakePhys;
#[cfg(test)]
pub(crate) use self::physical::PhysOp;
use self::pool_model::PoolModel;
use super::backend::{nvtx_heap, Backend};
use super::config::PageTuning;
use super::order::StreamOrder;
use super::pages::{assert_unlocked, PageHeap};
use super::reserve::{PoolSide, Reservations};
use crate::cuda::StreamId;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, AtomicU64, Mutex, Ordering};
use crate::trace::{PoolReservation, Tag};

/// One simulated stream's queue.
#[derive(Debug)]
pub(crate) struct Lane {
    /// The stream's id (here rather than in [`FakeStream`], so that a simulated stream
    /// handle is one word like a real [`Stream`](crate::cuda::Stream), and its id one
    /// load behind it: the simulated pool's buffers then have the real ones' layout).
    id: StreamId,
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
    pub(crate) lane: Arc<Lane>,
}

impl FakeStream {
    pub(crate) fn new() -> Self {
        let s = Self {
            lane: Arc::new(Lane {
                id: StreamId::fresh(),
                queued: AtomicU64::new(0),
                completed: AtomicU64::new(0),
                clock: Mutex::new(BTreeMap::new()),
            }),
        };
        registry::register(s.id(), &s.lane);
        s
    }

    /// The stream's id.
    #[inline(always)]
    pub(crate) fn id(&self) -> StreamId {
        self.lane.id
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
        if self.id() == other.id() || other.completed() >= pos {
            return true;
        }
        lock(&self.lane.clock).get(&other.id()).is_some_and(|&p| p >= pos)
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

/// The most the simulated device holds, whatever limit it is given: 4 TiB, more than any
/// GPU, and small enough that the addresses it hands out (its driver pool's from 1 MiB,
/// its page heap's from 16 TiB, `FakePhys`) never wrap or meet, so that a huge request
/// fails as a device's does instead of handing out a block past the end of the address
/// space.
pub(crate) const DEVICE_BYTES: u64 = 1 << 42;

impl FakeBackend {
    /// A simulated device that holds at most `limit` bytes (and at most [`DEVICE_BYTES`]).
    pub(crate) fn new(limit: u64) -> Self {
        let limit = limit.min(DEVICE_BYTES);
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
        stream.id()
    }

    fn mark(&self, stream: &FakeStream) -> Result<FakeMark> {
        assert_unlocked("mark");
        if self.fail_marks.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument("fake: marks fail"));
        }
        self.marks.fetch_add(1, Ordering::SeqCst);
        // Recording is itself an operation queued on the stream, after all earlier ones
        // (the waits queued before it included: the clock is read under its lock).
        let clock = lock(&stream.lane.clock);
        let pos = stream.enqueue();
        let mut snapshot = clock.clone();
        snapshot.insert(stream.id(), pos);
        Ok(FakeMark {
            stream: stream.id(),
            pos,
            lane: stream.lane.clone(),
            clock: snapshot,
        })
    }

    fn wait(&self, stream: &FakeStream, mark: &FakeMark) -> Result<()> {
        assert_unlocked("wait");
        debug_assert_eq!(mark.clock.get(&mark.stream), Some(&mark.pos));
        let mut clock = lock(&stream.lane.clock);
        for (&s, &p) in &mark.clock {
            if s != stream.id() {
                let e = clock.entry(s).or_insert(0);
                *e = (*e).max(p);
            }
        }
        Ok(())
    }

    fn is_complete(&self, mark: &FakeMark) -> Result<bool> {
        assert_unlocked("is_complete");
        let done = mark.lane.completed.load(Ordering::SeqCst) >= mark.pos;
        if done {
            // What the mark's stream waited for before it completed too (a GPU stream
            // cannot pass a wait before the awaited work completes).
            registry::complete_through(&mark.clock);
        }
        Ok(done)
    }

    fn wait_host(&self, mark: &FakeMark) -> Result<()> {
        assert_unlocked("wait_host");
        mark.lane.completed.fetch_max(mark.pos, Ordering::SeqCst);
        registry::complete_through(&mark.clock);
        Ok(())
    }

    fn is_idle(&self, stream: &FakeStream) -> Result<bool> {
        assert_unlocked("is_idle");
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
        assert_unlocked("synchronize");
        self.syncs.fetch_add(1, Ordering::SeqCst);
        stream.complete_all();
        Ok(())
    }

    fn trace(&self) -> &Tag {
        &self.trace
    }
}

impl FakeBackend {
    /// Counts `b` more bytes held, or fails as the device does beyond its limit.
    fn charge(&self, b: u64) -> Result<()> {
        let mut held = self.held.load(Ordering::SeqCst);
        loop {
            if held.saturating_add(b) > self.limit {
                return Err(Error::OutOfMemory {
                    requested: b as usize,
                });
            }
            match self
                .held
                .compare_exchange(held, held + b, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(()),
                Err(now) => held = now,
            }
        }
    }
}

impl Backend for FakeBackend {
    fn alloc(&self, bytes: usize, stream: &FakeStream) -> Result<u64> {
        assert!(bytes > 0 && bytes % 256 == 0, "fake: bad request {bytes}");
        let b = bytes as u64;
        self.charge(b)?;
        let routed = PageHeap::alloc_routed(
            &self.pages,
            bytes,
            |h| h.alloc(self, bytes, stream),
            &ModelPool(self),
            || {
                self.reservations.pool_alloc(
                    bytes,
                    &ModelPool(self),
                    &self.growth,
                    &self.trace,
                    stream.id().get(),
                )
            },
        );
        let ptr = match routed {
            Ok(p) => p,
            Err(e) => {
                self.held.fetch_sub(b, Ordering::SeqCst);
                return Err(e);
            }
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
        match PageHeap::free_route(&self.pages, ptr, bytes) {
            // SAFETY: the caller's obligation 1; `free_route` says it came from the heap.
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
