//! What the device cache needs from below: stream-ordered allocation from a driver pool,
//! and stream order itself ("mark a point on stream S", "make T wait for it", "has it
//! completed?", the `StreamOrder` part). [`CudaBackend`] implements it with a `cuMemPool`
//! and pooled events; the simulated GPU of `device/fake/` (tests and the `sim` feature)
//! simulates streams as counters so that the cache's algorithm runs in CPU tests and loom
//! models, and checks every cross-stream hand-over it makes.

use super::config::{Backing, DevicePoolConfig, PageTuning};
use super::order::StreamOrder;
use super::pages::PageHeap;
use super::report::DevicePoolStats;
use super::reserve::{PoolSide, Reservations};
use crate::cuda::mem_pool::MemPool;
use crate::cuda::memory::{plain_alloc, plain_free};
use crate::cuda::nvtx;
use crate::cuda::vmm::Vmm;
use crate::cuda::{mem_info, PooledEvent, Stream, StreamId};
use crate::error::{Error, Result};
use crate::sync::{Arc, AtomicUsize, Ordering};
use crate::trace::{Code, Note, PoolReservation, Tag};

/// Stream-ordered memory, as the cache uses it (stream order itself is its
/// [`StreamOrder`] part).
pub(crate) trait Backend: StreamOrder {
    /// Allocates `bytes` (nonzero, a multiple of 256) usable by work queued on `stream`
    /// from now on.
    fn alloc(&self, bytes: usize, stream: &Self::Stream) -> Result<u64>;
    /// Frees a block in the order of `stream`.
    ///
    /// # Safety
    /// 1. `ptr` came from [`Backend::alloc`] of this backend with `bytes`, is freed once,
    ///    and every use of it is ordered before this point of `stream`.
    unsafe fn free(&self, ptr: u64, bytes: usize, stream: &Self::Stream);
    /// Returns memory the backend reserved from the device but no allocation uses (and
    /// whose frees have completed) to the device, until it reserves less than `keep`
    /// bytes or has nothing more it can give back. Errors are counted, never raised.
    fn trim_to(&self, keep: usize);
    /// Bytes the backend has reserved from the device (`None` if it cannot say).
    fn reserved(&self) -> Option<usize>;
}

/// The backend of a [`DevicePool`](super::DevicePool): its own `cuMemPool` and the
/// per-device pool of reusable events, and with
/// [`Backing::PhysicalPages`](super::Backing::PhysicalPages) a page heap for large blocks.
#[derive(Debug)]
pub(crate) struct CudaBackend {
    pool: MemPool,
    /// The device's memory, in bytes.
    device_bytes: usize,
    /// Large blocks on physical pages (`None`: all on the driver pool).
    pages: Option<PageHeap<Vmm, CudaBackend>>,
    /// The driver pool's and the page heap's reservations, under the pool's limit.
    reservations: Arc<Reservations>,
    /// The pool's events, named `DevicePool(<ordinal>)`.
    trace: Tag,
    /// The driver pool's reservation as recorded (`SegmentAlloc` / `SegmentFree`).
    growth: PoolReservation,
    /// Whether its blocks are NVTX heaps (`DevicePoolConfig::nvtx`).
    nvtx: bool,
    /// Bytes of the blocks taken with `cuMemAlloc` because an NVTX tool is attached
    /// (`Some`): compute-sanitizer 2025.3.1 takes heaps over `cuMemAlloc` memory only
    /// (it refuses stream-ordered and mapped memory, `tools/nvtx-reference/`), so under
    /// it neither the driver pool nor the page heap serves the cache.
    visible: Option<Visible>,
}

/// The bytes a backend holds in `cuMemAlloc` blocks (with an NVTX tool attached), and
/// their peak.
#[derive(Debug, Default)]
struct Visible {
    bytes: AtomicUsize,
    peak: AtomicUsize,
}

impl Visible {
    fn add(&self, n: usize) {
        let now = self.bytes.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, n: usize) {
        self.bytes.fetch_sub(n, Ordering::Relaxed);
    }

    fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    fn reset_peak(&self) {
        self.peak.store(self.bytes(), Ordering::Relaxed);
    }
}

/// A block taken from the driver (`bytes` > 0) or given back (0): an NVTX heap, in which
/// the block's hand-outs are regions (`cuda::nvtx`). One branch without a tool.
#[inline(always)]
pub(crate) fn nvtx_heap(on: bool, ptr: u64, bytes: usize) {
    if on && nvtx::on() {
        match bytes {
            0 => nvtx::heap_unregister(ptr),
            b => nvtx::heap_register(ptr, b),
        }
    }
}

fn device_pool_name(device: u32) -> String {
    format!("DevicePool({device})")
}

/// The driver pool as [`Reservations::pool_alloc`] uses it, for one allocation on `stream`.
struct DriverPool<'a> {
    pool: &'a MemPool,
    stream: &'a Stream,
}

impl PoolSide for DriverPool<'_> {
    fn usage(&self) -> Result<(usize, usize)> {
        let (reserved, used) = self.pool.reserved_and_used()?;
        let bytes = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        Ok((bytes(reserved), bytes(used)))
    }

    fn reserved(&self) -> Result<usize> {
        Ok(usize::try_from(self.pool.reserved()?).unwrap_or(usize::MAX))
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        self.pool.alloc_async(bytes, self.stream)
    }

    fn undo(&self, ptr: u64, keep: usize) {
        // SAFETY: `ptr` was just allocated on `stream` from this pool and never handed out.
        unsafe { self.pool.free_async(ptr, self.stream) };
        if let Err(e) = self.stream.synchronize() {
            crate::cuda::record_drop_error("cuStreamSynchronize", e);
        }
        if let Err(e) = self.pool.trim_to(keep) {
            crate::cuda::record_drop_error("cuMemPoolTrimTo", e);
        }
    }
}

impl CudaBackend {
    /// The backend of a new pool on `device` as `config` asks: a driver pool of its own
    /// (its maxSize of 0 is the driver's default, the device's memory: a limit of 0 bytes
    /// is enforced by the cache, which then refuses every allocation), and with
    /// [`Backing::PhysicalPages`] (or [`Backing::Auto`] where the device supports it) a
    /// page heap.
    pub(crate) fn open(device: usize, config: &DevicePoolConfig) -> Result<Self> {
        config.pages.check()?;
        let (_, device_bytes) = mem_info(device)?;
        // A limit of the device's memory or more caps nothing: the driver's default, not a
        // maxSize past the device (`with_limit(usize::MAX)`), which the driver may refuse.
        let max_size = config.limit.filter(|&l| l < device_bytes).unwrap_or(0);
        let pool = MemPool::new(device, max_size, config.release_threshold)?;
        let vmm = match config.backing {
            Backing::DriverPool => None,
            Backing::PhysicalPages => Some(Vmm::new(device)?),
            Backing::Auto => Vmm::new(device).ok(),
        };
        Ok(Self::new(pool, device_bytes, vmm, config.pages, config.limit))
    }

    fn new(
        pool: MemPool,
        device_bytes: usize,
        pages: Option<Vmm>,
        tuning: PageTuning,
        limit: Option<usize>,
    ) -> Self {
        let reservations = Arc::new(Reservations::new(limit));
        let device = u32::try_from(pool.device()).unwrap_or(u32::MAX);
        Self {
            trace: Tag::for_device(device_pool_name, device),
            growth: PoolReservation::new(),
            pool,
            device_bytes,
            pages: pages.map(|p| {
                PageHeap::new(p, tuning)
                    .with_region_bytes(device_bytes)
                    .with_reservations(reservations.clone())
            }),
            reservations,
            nvtx: true,
            visible: None,
        }
    }

    /// This backend with its blocks described to NVTX tools (`cuda::nvtx`) or not. With
    /// a tool attached, its blocks are then taken with `cuMemAlloc`, the memory the tool
    /// can see inside.
    pub(crate) fn with_nvtx(mut self, nvtx: bool) -> Self {
        self.nvtx = nvtx;
        self.visible = (nvtx && nvtx::attached()).then(Visible::default);
        if self.visible.is_some() {
            log::info!(
                "cudalloc: NVTX tool attached: DevicePool({}) takes its blocks with cuMemAlloc \
                 (the tool sees no heap in stream-ordered or mapped memory)",
                self.pool.device()
            );
        }
        self
    }

    /// A block for the cache while an NVTX tool is attached: `cuMemAlloc`, under the
    /// pool's limit.
    fn alloc_visible(&self, visible: &Visible, bytes: usize, stream: &Stream) -> Result<u64> {
        self.reservations.take(bytes)?;
        match plain_alloc(self.pool.device(), bytes) {
            Ok(ptr) => {
                visible.add(bytes);
                // Each block is memory taken from the driver.
                self.trace.event(|| Note {
                    stream: stream.id().get(),
                    ..Note::new(Code::SegmentAlloc, ptr as usize, bytes)
                });
                Ok(ptr)
            }
            Err(e) => {
                self.reservations.give(bytes);
                Err(e)
            }
        }
    }

    /// The backing it has: [`Backing::PhysicalPages`] with a page heap, else
    /// [`Backing::DriverPool`].
    pub(crate) fn backing(&self) -> Backing {
        match self.pages {
            Some(_) => Backing::PhysicalPages,
            None => Backing::DriverPool,
        }
    }

    /// Turns the page heap's ordering of takers after other streams' frees off (negative
    /// controls only) or on.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_guard(&self, on: bool) {
        if let Some(h) = &self.pages {
            h.set_guard(on);
        }
    }

    /// The allocation granule of the page heap's device (`None`: no page heap).
    pub(crate) fn page_granule(&self) -> Option<usize> {
        self.pages.as_ref().map(PageHeap::granule)
    }

    /// The device's memory, in bytes.
    pub(crate) fn device_bytes(&self) -> usize {
        self.device_bytes
    }

    /// Fills the device side of `s`: what the driver pool and the page heap reserve and
    /// use, now and at their peaks, and the device's free and total memory (driver
    /// numbers it cannot get read as 0).
    pub(crate) fn fill_usage(&self, s: &mut DevicePoolStats) {
        let mut usage = self.pool.usage().unwrap_or_default();
        if let Some(h) = &self.pages {
            let p = h.stats();
            usage.reserved += p.reserved as u64;
            usage.reserved_high += p.peak_reserved as u64;
            usage.used += p.block_bytes as u64;
            usage.used_high += p.peak_block_bytes as u64;
        }
        if let Some(v) = &self.visible {
            // Every cuMemAlloc block is the cache's: reserved and used alike.
            usage.reserved += v.bytes() as u64;
            usage.reserved_high += v.peak() as u64;
            usage.used += v.bytes() as u64;
            usage.used_high += v.peak() as u64;
        }
        s.reserved_bytes = usage.reserved;
        // Under a limit the pool reads the sum at every change (`reserve.rs`): the peak of
        // the sum. Without one, the two peaks added.
        s.peak_reserved_bytes = if self.reservations.limited() {
            self.reservations.peak() as u64
        } else {
            usage.reserved_high
        };
        s.used_bytes = usage.used;
        s.peak_used_bytes = usage.used_high;
        let (free, total) = mem_info(self.pool.device()).unwrap_or((0, self.device_bytes));
        s.device_free_bytes = free as u64;
        s.device_total_bytes = total as u64;
    }

    /// Resets the peaks of the page heap, of the reservations and the driver pool's
    /// highs to their current values.
    pub(crate) fn reset_peaks(&self) {
        if let Some(h) = &self.pages {
            h.reset_peak();
        }
        self.reservations.reset_peak();
        if let Some(v) = &self.visible {
            v.reset_peak();
        }
        if let Err(e) = self.pool.reset_highs() {
            log::warn!("cudalloc: could not reset the driver pool's highs: {e}");
        }
    }

    /// Lets device `peer` access every block, present and future (the driver pool's, and
    /// the page heap's mapped chunks).
    pub(crate) fn enable_peer(&self, peer: usize) -> Result<()> {
        self.pool.set_access(peer, true)?;
        match &self.pages {
            Some(h) => h.enable_peer(peer),
            None => Ok(()),
        }
    }

    /// Whether device `peer` may access every block.
    pub(crate) fn peer_access(&self, peer: usize) -> Result<bool> {
        Ok(self.pool.access(peer)? && self.pages.as_ref().is_none_or(|h| h.has_peer(peer)))
    }

    /// Sets how many freed bytes the driver pool keeps across synchronizations.
    pub(crate) fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.pool.set_release_threshold(bytes)
    }

    /// The page heap's counters, on physical pages (benchmarks print them).
    #[cfg(feature = "testing")]
    pub(crate) fn page_counters(&self) -> Option<String> {
        self.pages.as_ref().map(|h| format!("{:?}", h.stats()))
    }

    /// Refuses, before any driver allocation, what cannot fit: for requests of an eighth
    /// of the device and more, more than is free on it plus what this pool holds unused
    /// (in the driver pool and on pages). A driver asked for more than is free may fill
    /// the device while it tries (the page heap would map chunk after chunk), failing
    /// other threads' and processes' allocations.
    fn check_fits(&self, bytes: usize) -> Result<()> {
        if bytes >= self.device_bytes / 8 {
            let (free, _) = mem_info(self.pool.device())?;
            let u = self.pool.usage()?;
            let pages_idle = self.pages.as_ref().map_or(0, PageHeap::unused);
            let idle = usize::try_from(u.reserved.saturating_sub(u.used))
                .unwrap_or(usize::MAX)
                .saturating_add(pages_idle);
            if bytes > free.saturating_add(idle) {
                return Err(Error::OutOfMemory { requested: bytes });
            }
        }
        Ok(())
    }
}

impl StreamOrder for CudaBackend {
    type Stream = Stream;
    type Mark = PooledEvent;

    #[inline(always)]
    fn stream_id(stream: &Stream) -> StreamId {
        stream.id()
    }

    fn mark(&self, stream: &Stream) -> Result<PooledEvent> {
        PooledEvent::record(stream)
    }

    fn wait(&self, stream: &Stream, mark: &PooledEvent) -> Result<()> {
        stream.wait(mark.event())
    }

    fn is_complete(&self, mark: &PooledEvent) -> Result<bool> {
        mark.is_complete()
    }

    fn wait_host(&self, mark: &PooledEvent) -> Result<()> {
        mark.synchronize()
    }

    fn is_idle(&self, stream: &Stream) -> Result<bool> {
        stream.is_idle()
    }

    fn synchronize(&self, stream: &Stream) -> Result<()> {
        stream.synchronize()
    }

    #[inline(always)]
    fn trace(&self) -> &Tag {
        &self.trace
    }
}

impl Backend for CudaBackend {
    fn alloc(&self, bytes: usize, stream: &Stream) -> Result<u64> {
        self.check_fits(bytes)?;
        if let Some(v) = &self.visible {
            return self
                .alloc_visible(v, bytes, stream)
                .inspect(|&ptr| nvtx_heap(self.nvtx, ptr, bytes));
        }
        let driver = DriverPool {
            pool: &self.pool,
            stream,
        };
        PageHeap::alloc_routed(
            &self.pages,
            bytes,
            |h| h.alloc(self, bytes, stream),
            &driver,
            || {
                self.reservations
                    .pool_alloc(bytes, &driver, &self.growth, &self.trace, stream.id().get())
            },
        )
        .inspect(|&ptr| nvtx_heap(self.nvtx, ptr, bytes))
    }

    unsafe fn free(&self, ptr: u64, bytes: usize, stream: &Stream) {
        nvtx_heap(self.nvtx, ptr, 0);
        if let Some(v) = &self.visible {
            // cuMemFree is not stream ordered: the work queued on `stream` is waited for.
            if let Err(e) = stream.synchronize() {
                crate::cuda::record_drop_error("cuStreamSynchronize", e);
            }
            // SAFETY: obligation 1; with a tool attached every block came from
            // alloc_visible.
            unsafe { plain_free(self.pool.device(), ptr) };
            self.trace.event(|| Note {
                stream: stream.id().get(),
                ..Note::new(Code::SegmentFree, ptr as usize, bytes)
            });
            v.sub(bytes);
            self.reservations.give(bytes);
            return;
        }
        if let Some(h) = PageHeap::free_route(&self.pages, ptr, bytes) {
            // SAFETY: obligation 1; `free_route` says the block came from the page heap.
            return unsafe { h.free(self, ptr, stream) };
        }
        // SAFETY: obligation 1 of this function is MemPool::free_async's obligation 1.
        unsafe { self.pool.free_async(ptr, stream) }
    }

    fn trim_to(&self, keep: usize) {
        // A recording's first look at the pool may be its trim: what it gives back of
        // what it reserved before the recording is recorded too.
        self.growth.before(|| self.pool.reserved().ok());
        let keep_pool = self.pages.as_ref().map_or(keep, |h| {
            let pool = usize::try_from(self.pool.reserved().unwrap_or(0)).unwrap_or(usize::MAX);
            h.trim_beside_pool(self, keep, pool)
        });
        if let Err(e) = self.pool.trim_to(keep_pool) {
            crate::cuda::record_drop_error("cuMemPoolTrimTo", e);
        }
        self.reservations
            .pool_trimmed(|| usize::try_from(self.pool.reserved().ok()?).ok());
        self.growth.after(&self.trace, 0, 0, || self.pool.reserved().ok());
    }

    fn reserved(&self) -> Option<usize> {
        let pool = usize::try_from(self.pool.reserved().ok()?).ok()?;
        let visible = self.visible.as_ref().map_or(0, Visible::bytes);
        Some(pool + visible + self.pages.as_ref().map_or(0, PageHeap::reserved))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(h) = &self.pages {
            h.shutdown(self);
        }
        // The driver pool goes with the backend (`MemPool`'s drop destroys it).
        self.growth.destroyed(&self.trace);
    }
}
