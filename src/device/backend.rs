//! What the device cache needs from below: stream-ordered allocation from a driver pool,
//! and stream order itself ("mark a point on stream S", "make T wait for it", "has it
//! completed?", the `StreamOrder` part). [`CudaBackend`] implements it with a `cuMemPool`
//! and pooled events; the simulated GPU of `device/fake.rs` (tests and the `sim` feature)
//! simulates streams as counters so that the cache's algorithm runs in CPU tests and loom
//! models, and checks every cross-stream hand-over it makes.

use super::config::PageTuning;
use super::order::StreamOrder;
use super::pages::PageHeap;
use super::reserve::{PoolSide, Reservations};
use crate::cuda::mem_pool::MemPool;
use crate::cuda::nvtx;
use crate::cuda::vmm::Vmm;
use crate::cuda::{mem_info, PooledEvent, Stream, StreamId};
use crate::error::{Error, Result};
use crate::sync::Arc;
use crate::trace::Tag;

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
    pub(crate) pool: MemPool,
    /// The device's memory, in bytes.
    pub(crate) device_bytes: usize,
    /// Large blocks on physical pages (`None`: all on the driver pool).
    pub(crate) pages: Option<PageHeap<Vmm, CudaBackend>>,
    /// The driver pool's and the page heap's reservations, under the pool's limit.
    pub(crate) reservations: Arc<Reservations>,
    /// The pool's events, named `DevicePool(<ordinal>)`.
    trace: Tag,
    /// Whether its blocks are NVTX heaps (`DevicePoolConfig::nvtx`).
    nvtx: bool,
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
        let u = self.pool.usage()?;
        let bytes = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        Ok((bytes(u.reserved), bytes(u.used)))
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
    pub(crate) fn new(
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
            pool,
            device_bytes,
            pages: pages.map(|p| {
                PageHeap::new(p, tuning)
                    .with_region_bytes(device_bytes)
                    .with_reservations(reservations.clone())
            }),
            reservations,
            nvtx: true,
        }
    }

    /// This backend with its blocks described to NVTX tools (`cuda::nvtx`) or not.
    pub(crate) fn with_nvtx(mut self, nvtx: bool) -> Self {
        self.nvtx = nvtx;
        self
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
        match PageHeap::serving(&self.pages, bytes) {
            Some(h) => h.alloc(self, bytes, stream),
            None => self.reservations.pool_alloc(
                bytes,
                &DriverPool {
                    pool: &self.pool,
                    stream,
                },
            ),
        }
        .inspect(|&ptr| nvtx_heap(self.nvtx, ptr, bytes))
    }

    unsafe fn free(&self, ptr: u64, bytes: usize, stream: &Stream) {
        nvtx_heap(self.nvtx, ptr, 0);
        if let Some(h) = PageHeap::serving(&self.pages, bytes) {
            // SAFETY: obligation 1; a block of this size came from the page heap.
            return unsafe { h.free(self, ptr, stream) };
        }
        // SAFETY: obligation 1 of this function is MemPool::free_async's obligation 1.
        unsafe { self.pool.free_async(ptr, stream) }
    }

    fn trim_to(&self, keep: usize) {
        let keep_pool = self.pages.as_ref().map_or(keep, |h| {
            let pool = usize::try_from(self.pool.reserved().unwrap_or(0)).unwrap_or(usize::MAX);
            h.trim_beside_pool(self, keep, pool)
        });
        if let Err(e) = self.pool.trim_to(keep_pool) {
            crate::cuda::record_drop_error("cuMemPoolTrimTo", e);
        }
        self.reservations
            .pool_trimmed(|| usize::try_from(self.pool.reserved().ok()?).ok());
    }

    fn reserved(&self) -> Option<usize> {
        let pool = usize::try_from(self.pool.reserved().ok()?).ok()?;
        Some(pool + self.pages.as_ref().map_or(0, PageHeap::reserved))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(h) = &self.pages {
            h.shutdown(self);
        }
    }
}
