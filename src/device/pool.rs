//! [`DevicePool`]: a device's driver pool with the stream-ordered cache in front, its
//! configuration, and the allocation and free paths buffers take.

use core::fmt;

use super::backend::{is_out_of_memory, CudaBackend};
use super::buffer::DeviceBuffer;
use super::cache::{Cache, Settings};
use super::local::{self, Core, LocalCache, Owned, PoolHandle};
use super::report::{DeviceMemorySummary, DevicePoolStats, StreamCacheStats};
use super::DeviceCopy;
use crate::cuda::mem_pool::MemPool;
use crate::cuda::vmm::Vmm;
use crate::cuda::{device_count, mem_info, memset_d8_async, Stream};
use crate::error::{Error, Result};
use crate::slot_table::{SlotBits, SlotTable};
use crate::sync::global::OnceLock;
use crate::sync::{thread_local_const, Arc};

/// How a [`DevicePool`] behaves. Start from [`DevicePoolConfig::default()`] and change
/// what you need with the `with_*` methods (the fields are public to read).
///
/// ```
/// use cudalloc::device::{Backing, DevicePoolConfig};
/// let c = DevicePoolConfig::default();
/// assert_eq!(c.release_threshold, u64::MAX);
/// assert_eq!(c.limit, None);
/// assert!(c.cache);
/// assert_eq!(c.thread_cache_bytes, 256 << 20);
/// assert_eq!(c.max_cached_block, 1 << 30);
/// assert_eq!(c.backing, Backing::Auto); // physical pages where the device has them
/// let small = DevicePoolConfig::default()
///     .with_limit(64 << 20)           // hold at most 64 MiB from the device
///     .with_thread_cache_bytes(0);    // every free block in the shared lists
/// assert_eq!(small.limit, Some(64 << 20));
/// let uncached = DevicePoolConfig::default().with_cache(false);
/// assert!(!uncached.cache);
/// // Every block on the driver pool (`cuMemAllocFromPoolAsync`), as before 0.3.
/// let driver = DevicePoolConfig::default().with_backing(Backing::DriverPool);
/// if let Ok(pool) = cudalloc::device::DevicePool::new(0, driver) {
///     assert_eq!(pool.stats().reserved_bytes, 0);
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DevicePoolConfig {
    /// Freed bytes the driver pool keeps across synchronizations (default `u64::MAX`:
    /// all; the driver's default of 0 returns memory at every synchronization). Physical
    /// pages are kept until [`DevicePool::trim`] or an allocation's need.
    pub release_threshold: u64,
    /// The most bytes the pool holds from the device (`None`, the default: no limit
    /// beyond the device's memory), for the pool as a whole: what the driver pool and the
    /// page heap reserve together stays at most the limit
    /// ([`peak_reserved_bytes`](super::DevicePoolStats::peak_reserved_bytes) is then the
    /// peak of the two together), and so do the blocks held (counted at their class size).
    /// An allocation that would pass it frees cached memory and retries, then fails with
    /// [`Error::DeviceOutOfMemory`](crate::Error::DeviceOutOfMemory). Under a limit, an
    /// allocation from the driver pool that may make it grow first takes head room for
    /// the growth (the driver reserves in steps of 32 MiB and more), so that the limit
    /// holds; such allocations also take a lock of their own (misses only, not hits).
    pub limit: Option<usize>,
    /// Whether freed blocks are cached by (stream, size class) in front of the backing
    /// (default true). `false` with [`Backing::DriverPool`] gives the plain stream-ordered
    /// driver pool ([`DevicePool::uncached`]): every allocation is a
    /// `cuMemAllocFromPoolAsync`, every free a `cuMemFreeAsync`.
    pub cache: bool,
    /// The most bytes of free blocks one thread keeps for this pool, in bins served
    /// without a lock (default 256 MiB; 0: no thread caches, every free block goes to
    /// the shared lists). A block larger than this is cached in the shared lists only.
    pub thread_cache_bytes: usize,
    /// Requests above this many bytes are not cached: they are allocated from and freed
    /// to the driver pool directly (default 1 GiB).
    pub max_cached_block: usize,
    /// What memory blocks are made of (default [`Backing::Auto`]: physical pages where
    /// the device supports them).
    pub backing: Backing,
    /// How a [`Backing::PhysicalPages`] pool trades memory for driver calls (default
    /// [`PageTuning::TIGHT`]; unused on the driver pool).
    pub pages: PageTuning,
}

/// What a [`DevicePool`]'s blocks are made of.
///
/// ```
/// use cudalloc::device::{Backing, DevicePool, DevicePoolConfig};
/// assert_eq!(DevicePoolConfig::default().backing, Backing::Auto);
/// if let Ok(pool) = DevicePool::new(0, DevicePoolConfig::default()) {
///     // The pool says what it chose: pages where the device supports them.
///     assert_ne!(pool.config().backing, Backing::Auto);
/// }
/// let c = DevicePoolConfig::default().with_backing(Backing::DriverPool);
/// if let Ok(pool) = DevicePool::new(0, c) {
///     assert_eq!(pool.config().backing, Backing::DriverPool);
/// }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backing {
    /// [`PhysicalPages`](Self::PhysicalPages) where the device supports CUDA's virtual
    /// memory management (`CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`; the
    /// H200 does), else [`DriverPool`](Self::DriverPool). The default; a pool made with
    /// it reports the backing it chose in [`DevicePool::config`].
    #[default]
    Auto,
    /// Every block is an allocation of the pool's driver pool (`cuMemPoolCreate`,
    /// `cuMemAllocFromPoolAsync`), which carves its chunks in stream order. The driver
    /// keeps a chunk while any block lives in it, so a workload whose sizes vary makes its
    /// reservations drift above what it holds (RMM's random workload on the H200:
    /// `cuMemAllocAsync` 1.26x the peak request; the cache on the driver pool 1.47x).
    DriverPool,
    /// Blocks of 2 allocation granules and more (4 MiB on the H200) are runs of one large
    /// virtual range backed by chunks of physical memory (`cuMemCreate`, `cuMemMap`:
    /// CUDA's virtual memory management, as PyTorch's expandable segments use it): freed
    /// runs coalesce and stay mapped, so a block of any size that fits in freed memory
    /// takes it with no driver call, and a block that does not fit moves idle chunks
    /// rather than reserve more once they exceed an allowance. What is reserved stays near
    /// what is held, at the price of the moves (mapping, and above all `cuMemSetAccess`,
    /// about 25-30 us per chunk); [`PageTuning`] sets the trade-off (RMM's random
    /// workload on the H200: 1.144x the peak request in 1.4-1.7 s with the default tuning,
    /// 1.163x in 0.42 s with [`PageTuning::FAST`]). Smaller blocks stay on the driver
    /// pool. Needs a device with VMM support: [`DevicePool::new`] fails without it. A
    /// [`limit`](DevicePoolConfig::limit) holds for the pages and the driver pool together
    /// (idle chunks move rather than grow past it).
    PhysicalPages,
}

impl Default for DevicePoolConfig {
    fn default() -> Self {
        Self {
            release_threshold: u64::MAX,
            limit: None,
            cache: true,
            thread_cache_bytes: 256 << 20,
            max_cached_block: 1 << 30,
            backing: Backing::Auto,
            pages: PageTuning::TIGHT,
        }
    }
}

/// How a pool on [`Backing::PhysicalPages`] trades memory for driver calls: the size of
/// its chunks of physical memory, and how much idle memory (chunks mapped with no block in
/// them) it keeps before it moves a chunk to where a block needs it rather than create
/// more. Smaller chunks and a smaller allowance keep the reservation nearer to what the
/// blocks hold and pay more moves (each about 50-60 us of driver calls per chunk on the
/// H200, whatever its size: `cuMemUnmap`, `cuMemMap`, `cuMemSetAccess`).
///
/// Measured on RMM's random workload (`benches/device.rs`, 10^5 allocations up to 64 MiB,
/// 4 streams, one H200, BENCHMARKS.md): [`TIGHT`](Self::TIGHT) (the default) reserved
/// 1.144x the peak request in 1.4-1.7 s, [`FAST`](Self::FAST) 1.163x in 0.42 s; in the same
/// process the cache on the driver pool reserved 1.472x in 0.52 s and `cuMemAllocAsync`
/// 1.260x in 0.33 s.
///
/// ```
/// use cudalloc::device::{Backing, DevicePoolConfig, PageTuning};
/// let c = DevicePoolConfig::default()
///     .with_backing(Backing::PhysicalPages)
///     .with_pages(PageTuning::FAST);
/// assert_eq!(c.pages.chunk_bytes, 16 << 20);
/// let custom = PageTuning::new(4 << 20, 32); // 4 MiB chunks, idle up to 1/32
/// assert_eq!(custom.idle_divisor, 32);
/// // Checked when a pool is made: a chunk of 0 bytes or an allowance of 1/0 is refused.
/// assert!(PageTuning::new(0, 8).check().is_err());
/// assert!(PageTuning::new(4 << 20, 0).check().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PageTuning {
    /// Bytes of one chunk of physical memory (one `cuMemCreate` handle), rounded up to a
    /// power-of-two number of the device's allocation granules (2 MiB on the H200).
    pub chunk_bytes: usize,
    /// Idle chunks are kept mapped up to 1/`idle_divisor` of the bytes in blocks (and at
    /// least 4 chunks); beyond that a block that needs memory moves an idle chunk.
    pub idle_divisor: u32,
}

impl PageTuning {
    /// 8 MiB chunks, idle memory up to 1/128: reserves within 15% of the peak request on
    /// RMM's random workload (the default).
    pub const TIGHT: Self = Self::new(8 << 20, 128);
    /// 16 MiB chunks, idle memory up to 1/128: a few percent more reserved in a third of
    /// the time (on RMM's workload 1.3x `cuMemAllocAsync`'s time).
    pub const FAST: Self = Self::new(16 << 20, 128);
    /// The most bytes a chunk may have.
    pub const MAX_CHUNK_BYTES: usize = 1 << 30;

    /// Chunks of `chunk_bytes`, idle memory up to 1/`idle_divisor` of the bytes in blocks.
    pub const fn new(chunk_bytes: usize, idle_divisor: u32) -> Self {
        Self {
            chunk_bytes,
            idle_divisor,
        }
    }

    /// Refuses a chunk of 0 bytes or more than [`MAX_CHUNK_BYTES`](Self::MAX_CHUNK_BYTES),
    /// and an `idle_divisor` of 0 ([`DevicePool::new`] checks this).
    pub fn check(&self) -> Result<()> {
        if self.chunk_bytes == 0 || self.chunk_bytes > Self::MAX_CHUNK_BYTES {
            return Err(Error::InvalidArgument(
                "PageTuning::chunk_bytes must be in 1..=1 GiB",
            ));
        }
        if self.idle_divisor == 0 {
            return Err(Error::InvalidArgument("PageTuning::idle_divisor must not be 0"));
        }
        Ok(())
    }

    /// Granules per chunk on a device of `granule` bytes (a power of two).
    pub(crate) fn chunk_granules(&self, granule: usize) -> usize {
        self.chunk_bytes.div_ceil(granule).max(1).next_power_of_two()
    }
}

impl Default for PageTuning {
    fn default() -> Self {
        Self::TIGHT
    }
}

impl DevicePoolConfig {
    /// This configuration with the driver pool keeping `bytes` of freed memory across
    /// synchronizations.
    ///
    /// ```
    /// let c = cudalloc::device::DevicePoolConfig::default().with_release_threshold(0);
    /// assert_eq!(c.release_threshold, 0);
    /// ```
    pub const fn with_release_threshold(self, bytes: u64) -> Self {
        Self {
            release_threshold: bytes,
            ..self
        }
    }

    /// This configuration holding at most `bytes` from the device.
    ///
    /// ```
    /// let c = cudalloc::device::DevicePoolConfig::default().with_limit(1 << 30);
    /// assert_eq!(c.limit, Some(1 << 30));
    /// ```
    pub const fn with_limit(self, bytes: usize) -> Self {
        Self {
            limit: Some(bytes),
            ..self
        }
    }

    /// This configuration with the cache on or off (off: the plain driver pool).
    ///
    /// ```
    /// let c = cudalloc::device::DevicePoolConfig::default().with_cache(false);
    /// assert!(!c.cache);
    /// ```
    pub const fn with_cache(self, cache: bool) -> Self {
        Self { cache, ..self }
    }

    /// This configuration with thread caches of at most `bytes` per thread (0: none).
    ///
    /// ```
    /// let c = cudalloc::device::DevicePoolConfig::default().with_thread_cache_bytes(0);
    /// assert_eq!(c.thread_cache_bytes, 0);
    /// ```
    pub const fn with_thread_cache_bytes(self, bytes: usize) -> Self {
        Self {
            thread_cache_bytes: bytes,
            ..self
        }
    }

    /// This configuration caching requests of at most `bytes` (larger ones go to and from
    /// the driver pool directly).
    ///
    /// ```
    /// let c = cudalloc::device::DevicePoolConfig::default().with_max_cached_block(4 << 20);
    /// assert_eq!(c.max_cached_block, 4 << 20);
    /// ```
    pub const fn with_max_cached_block(self, bytes: usize) -> Self {
        Self {
            max_cached_block: bytes,
            ..self
        }
    }

    /// This configuration with blocks made of `backing`.
    ///
    /// ```
    /// use cudalloc::device::{Backing, DevicePoolConfig};
    /// let c = DevicePoolConfig::default().with_backing(Backing::PhysicalPages);
    /// assert_eq!(c.backing, Backing::PhysicalPages);
    /// ```
    pub const fn with_backing(self, backing: Backing) -> Self {
        Self { backing, ..self }
    }

    /// This configuration with page-backed blocks tuned by `pages` (used with
    /// [`Backing::PhysicalPages`] only).
    ///
    /// ```
    /// use cudalloc::device::{DevicePoolConfig, PageTuning};
    /// let c = DevicePoolConfig::default().with_pages(PageTuning::FAST);
    /// assert_eq!(c.pages, PageTuning::FAST);
    /// ```
    pub const fn with_pages(self, pages: PageTuning) -> Self {
        Self { pages, ..self }
    }
}

pub(crate) struct Inner {
    core: Core<CudaBackend>,
    device: usize,
    config: DevicePoolConfig,
}

thread_local_const! {
    /// This thread's caches of device pools, by the pools' slots.
    static TABLE: SlotTable<LocalCache<DevicePool>> = SlotTable::new();
}

/// The slots of device pools in their thread-local tables.
static SLOTS: SlotBits = SlotBits::new();

impl PoolHandle for DevicePool {
    type B = CudaBackend;

    #[inline(always)]
    fn core(&self) -> &Core<CudaBackend> {
        &self.inner.core
    }

    #[inline(always)]
    fn with_table<R>(f: impl FnOnce(&SlotTable<LocalCache<Self>>) -> R) -> Option<R> {
        TABLE.try_with(f).ok()
    }

    fn slots() -> &'static SlotBits {
        &SLOTS
    }
}

/// A pool of device memory on one device: a stream-ordered cache of blocks by (stream,
/// size class) in front of the device's own driver pool (`cuMemPoolCreate`). A cheap,
/// cloneable handle; [`DevicePool::get`] gives the process-wide pool of a device.
///
/// Allocating a buffer on a stream that freed a block of its size class reuses that block
/// at once, from a bin of the calling thread: no lock and no CUDA call (tens of
/// nanoseconds; `cuMemAllocAsync` costs about a microsecond). A block freed on another
/// stream is taken only after that stream's work (one event per batch, waited for on the
/// GPU). See the [module docs](super) for the whole protocol.
///
/// ```
/// use cudalloc::{cuda::Stream, device::{DevicePool, DevicePoolConfig}};
/// if let Ok(stream) = Stream::new(0) {
///     let pool = DevicePool::new(0, DevicePoolConfig::default().with_limit(64 << 20)).unwrap();
///     let a = pool.alloc_zeroed::<u32>(1 << 20, &stream).unwrap();
///     assert_eq!(a.len(), 1 << 20);
///     assert!(pool.alloc::<u8>(128 << 20, &stream).is_err(), "past the 64 MiB limit");
///     drop(a); // cached for the next allocation of its class on `stream`
///     assert_eq!(pool.stats().cached_bytes, 4 << 20);
///     pool.trim();
///     assert_eq!(pool.stats().cached_bytes, 0);
/// }
/// ```
#[derive(Clone)]
pub struct DevicePool {
    inner: Arc<Inner>,
}

impl fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePool")
            .field("device", &self.inner.device)
            .field("uid", &self.inner.core.uid)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl DevicePool {
    /// A new pool on device `device`, with a driver pool of its own.
    pub fn new(device: usize, config: DevicePoolConfig) -> Result<Self> {
        config.pages.check()?;
        // The driver pool's maxSize of 0 is its default (the device's memory); a limit of
        // 0 bytes is enforced by the cache, which then refuses every allocation.
        let pool = MemPool::new(device, config.limit.unwrap_or(0), config.release_threshold)?;
        let (_, device_bytes) = mem_info(device)?;
        let pages = match config.backing {
            Backing::DriverPool => None,
            Backing::PhysicalPages => Some(Vmm::new(device)?),
            Backing::Auto => Vmm::new(device).ok(),
        };
        let config = DevicePoolConfig {
            backing: if pages.is_some() {
                Backing::PhysicalPages
            } else {
                Backing::DriverPool
            },
            ..config
        };
        // Under compute-sanitizer, the process-wide pools' cached memory goes back at exit.
        crate::cuda::exit::release_at_exit(release_process_pools);
        let settings = if config.cache {
            Settings::new(config.max_cached_block, config.thread_cache_bytes, config.limit)
        } else {
            Settings::new(0, 0, config.limit)
        };
        Ok(Self {
            inner: Arc::new(Inner {
                core: Core::new::<DevicePool>(Cache::new(
                    CudaBackend::new(pool, device_bytes, pages, config.pages, config.limit),
                    settings,
                )),
                device,
                config,
            }),
        })
    }

    /// A pool without the cache on [`Backing::DriverPool`]: every allocation goes to the
    /// driver pool (`cuMemAllocFromPoolAsync`) and every free back to it
    /// (`cuMemFreeAsync`). The reference the cache is measured against.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::uncached(0), Stream::new(0)) {
    ///     assert!(!pool.config().cache);
    ///     drop(pool.alloc::<u8>(4096, &stream).unwrap());
    ///     assert_eq!(pool.stats().cached_bytes, 0);
    /// }
    /// ```
    pub fn uncached(device: usize) -> Result<Self> {
        let config = DevicePoolConfig::default()
            .with_cache(false)
            .with_backing(Backing::DriverPool);
        Self::new(device, config)
    }

    /// The process-wide pool of device `device` (default configuration), created on
    /// first use; one per device, each with its own cache.
    ///
    /// ```
    /// match cudalloc::device::DevicePool::get(0) {
    ///     Ok(pool) => assert_eq!(pool.device(), 0),
    ///     Err(e) => println!("no device pool: {e}"),
    /// }
    /// ```
    pub fn get(device: usize) -> Result<Self> {
        let pools = process_pools();
        if pools.is_empty() {
            return Err(Error::NoDriver);
        }
        let slot = pools
            .get(device)
            .ok_or(Error::InvalidArgument("no CUDA device with that ordinal"))?;
        if let Some(pool) = slot.get() {
            return Ok(pool.clone());
        }
        let pool = Self::new(device, DevicePoolConfig::default())?;
        // Two threads may race to create it: one wins, the other's pool is dropped.
        Ok(slot.get_or_init(|| pool).clone())
    }

    /// The device.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// The configuration the pool was made with.
    pub fn config(&self) -> DevicePoolConfig {
        self.inner.config
    }

    pub(crate) fn cache(&self) -> &Cache<CudaBackend> {
        &self.inner.core.cache
    }

    /// A buffer of `len` elements on `stream` (which must belong to the pool's device),
    /// usable by work queued on `stream` from now on. Its contents are unspecified: fill
    /// it before reading (or use [`alloc_zeroed`](Self::alloc_zeroed)). A buffer of zero
    /// bytes takes no memory (its [`device_ptr`](DeviceBuffer::device_ptr) is 0).
    ///
    /// Errors: `InvalidArgument` for a stream of another device; `TooLarge` for more than
    /// the device holds; [`Error::DeviceOutOfMemory`] (naming the device, the size and the
    /// pool's state) when the memory is not there even after the cache was released.
    // Always inlined: the hit is a few dozen instructions, and a call with its register
    // saves costs a tenth of it.
    #[inline(always)]
    pub fn alloc<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        match len.checked_mul(size_of::<T>()) {
            // No device check on the hit: a bin of this pool's thread cache only holds
            // blocks freed on streams of its device (stream ids are never reused), so a
            // stream of another device misses and the slow path refuses it.
            Some(bytes) if bytes != 0 => match self.try_alloc_fast(len, bytes, stream) {
                Some(buf) => Ok(buf),
                None => self.alloc_slow(len, bytes, stream),
            },
            bytes => self.alloc_unusual(len, bytes, stream),
        }
    }

    /// The hit: a block of the request's class freed on `stream`, from this thread's bin.
    #[inline(always)]
    fn try_alloc_fast<T: DeviceCopy>(
        &self,
        len: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Option<DeviceBuffer<T>> {
        let block = local::try_alloc_fast(self, bytes, stream)?;
        Some(DeviceBuffer::from_parts(block, len))
    }

    #[cold]
    #[inline(never)]
    fn alloc_slow<T: DeviceCopy>(
        &self,
        len: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<DeviceBuffer<T>> {
        if stream.device() != self.inner.device {
            return Err(Error::InvalidArgument("the stream belongs to another device"));
        }
        let device_bytes = self.cache().backend.device_bytes;
        if bytes > device_bytes {
            self.cache().count_failure();
            return Err(Error::TooLarge {
                requested: bytes,
                limit: device_bytes,
            });
        }
        let block = local::alloc_slow(self, bytes, stream).map_err(|e| self.out_of_memory(e, bytes))?;
        Ok(DeviceBuffer::from_parts(block, len))
    }

    /// Zero bytes, a size that overflows, or a stream of another device.
    #[cold]
    #[inline(never)]
    fn alloc_unusual<T: DeviceCopy>(
        &self,
        len: usize,
        bytes: Option<usize>,
        stream: &Stream,
    ) -> Result<DeviceBuffer<T>> {
        if stream.device() != self.inner.device {
            return Err(Error::InvalidArgument("the stream belongs to another device"));
        }
        match bytes {
            Some(0) => Ok(DeviceBuffer::from_parts(
                Owned::empty(stream.clone(), self.clone()),
                len,
            )),
            Some(bytes) => self.alloc_slow(len, bytes, stream),
            None => {
                self.cache().count_failure();
                Err(Error::TooLarge {
                    requested: usize::MAX,
                    limit: self.cache().backend.device_bytes,
                })
            }
        }
    }

    /// Turns an out-of-memory error into one naming the device, the size and the pool's
    /// state.
    #[cold]
    fn out_of_memory(&self, e: Error, bytes: usize) -> Error {
        if !is_out_of_memory(&e) {
            return e;
        }
        let requested = self.cache().block_bytes(bytes).unwrap_or(bytes);
        let e = Error::DeviceOutOfMemory {
            device: self.inner.device,
            requested,
            memory: Box::new(self.summary()),
        };
        log::warn!("cudalloc: {e}");
        e
    }

    /// A buffer of `len` zeroed elements on `stream` (zeroed in stream order).
    pub fn alloc_zeroed<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let buf = self.alloc::<T>(len, stream)?;
        if buf.device_ptr() != 0 {
            // SAFETY: the range is the buffer's own block, queued on its stream after the
            // allocation.
            unsafe { memset_d8_async(buf.device_ptr(), 0, buf.byte_len(), stream) }?;
        }
        Ok(buf)
    }

    /// A buffer holding a copy of `src`, on `stream`; returns when the copy is done.
    pub fn from_host<T: DeviceCopy>(&self, src: &[T], stream: &Stream) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc::<T>(src.len(), stream)?;
        buf.copy_from_host(src)?;
        Ok(buf)
    }

    /// The pool's state (see [`DevicePoolStats`]; `Display` prints a report for users).
    /// No side effect: reads counters, the driver pool's attributes and `cuMemGetInfo`
    /// (driver numbers it cannot get read as 0).
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
    ///     let _buf = pool.alloc::<f32>(1 << 20, &stream).unwrap();
    ///     let s = pool.stats();
    ///     assert!(s.live_bytes >= 4 << 20);
    ///     println!("{s}"); // device 0: ... live ..., cached ..., reserved ..., free ...
    /// }
    /// ```
    pub fn stats(&self) -> DevicePoolStats {
        let snap = self.cache().snapshot();
        let backend = &self.cache().backend;
        let mut usage = backend.pool.usage().unwrap_or_default();
        if let Some(h) = &backend.pages {
            let p = h.stats();
            usage.reserved += p.reserved as u64;
            usage.reserved_high += p.peak_reserved as u64;
            usage.used += p.block_bytes as u64;
            usage.used_high += p.peak_block_bytes as u64;
        }
        let (free, total) = mem_info(self.inner.device).unwrap_or((0, backend.device_bytes));
        let live_bytes = snap
            .held_bytes
            .saturating_sub(snap.cached_bytes + snap.pending_bytes);
        let live_buffers = snap
            .held_blocks
            .saturating_sub(snap.cached_blocks + snap.pending_blocks);
        DevicePoolStats {
            device: self.inner.device,
            caching: self.inner.config.cache,
            live_bytes,
            live_buffers,
            cached_bytes: snap.cached_bytes,
            cached_blocks: snap.cached_blocks,
            pending_bytes: snap.pending_bytes,
            pending_blocks: snap.pending_blocks,
            held_bytes: snap.held_bytes,
            peak_held_bytes: snap.peak_held_bytes,
            reserved_bytes: usage.reserved,
            // Under a limit the pool reads the sum at every change (`reserve.rs`): the
            // peak of the sum. Without one, the two peaks added.
            peak_reserved_bytes: if backend.reservations.limited() {
                backend.reservations.peak() as u64
            } else {
                usage.reserved_high
            },
            used_bytes: usage.used,
            peak_used_bytes: usage.used_high,
            limit: self.inner.config.limit,
            device_free_bytes: free as u64,
            device_total_bytes: total as u64,
            per_stream: snap
                .per_stream
                .iter()
                .map(|&(stream, bytes, blocks)| StreamCacheStats {
                    stream,
                    bytes,
                    blocks,
                })
                .collect(),
            thread_caches: snap.thread_caches,
            hits: snap.hits,
            misses: snap.misses,
            steals: snap.steals,
            events: snap.marks,
            failures: snap.failures,
            released: snap.released,
            oom_recoveries: snap.oom_recoveries,
            trims: snap.trims,
            abandoned_bytes: snap.abandoned_bytes,
        }
    }

    fn summary(&self) -> DeviceMemorySummary {
        let s = self.stats();
        DeviceMemorySummary {
            live_bytes: s.live_bytes,
            cached_bytes: s.cached_bytes,
            pending_bytes: s.pending_bytes,
            held_bytes: s.held_bytes,
            reserved_bytes: s.reserved_bytes,
            limit_bytes: s.limit.map(|l| l as u64),
            device_free_bytes: s.device_free_bytes,
        }
    }

    /// Gives the memory the pool holds but no buffer uses back to the device: this
    /// thread's cached blocks and the shared ones (blocks freed with uses recorded on
    /// other streams after waiting for those uses), each freed in its stream's order; then
    /// waits for those frees and trims the driver pool. Drops the pool's handles of streams
    /// with nothing cached. Other threads' cached blocks go back to the shared lists at
    /// their next allocation or free on this pool (or when they exit); trim again then.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::uncached(0), Stream::new(0)) {
    ///     drop(pool.alloc::<u8>(16 << 20, &stream).unwrap());
    ///     stream.synchronize().unwrap();
    ///     assert!(pool.stats().reserved_bytes >= 16 << 20); // the driver pool keeps it
    ///     pool.trim();
    ///     assert_eq!(pool.stats().reserved_bytes, 0);
    /// }
    /// ```
    pub fn trim(&self) {
        local::with_thread_cache(self, |tc| self.cache().trim(tc));
    }

    /// Resets the peaks that [`stats`](Self::stats) reports (held bytes, and the driver
    /// pool's reserved and used highs) to their current values, to measure one phase of
    /// a program.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::uncached(0), Stream::new(0)) {
    ///     drop(pool.alloc::<u8>(32 << 20, &stream).unwrap());
    ///     pool.reset_peaks();
    ///     assert_eq!(pool.stats().peak_held_bytes, 0);
    /// }
    /// ```
    pub fn reset_peaks(&self) {
        self.cache().reset_peak();
        if let Some(h) = &self.cache().backend.pages {
            h.reset_peak();
        }
        self.cache().backend.reservations.reset_peak();
        if let Err(e) = self.cache().backend.pool.reset_highs() {
            log::warn!("cudalloc: could not reset the driver pool's highs: {e}");
        }
    }

    /// The page heap's counters, on physical pages (benchmarks print them).
    pub(crate) fn page_counters(&self) -> Option<String> {
        self.cache()
            .backend
            .pages
            .as_ref()
            .map(|h| format!("{:?}", h.stats()))
    }

    /// Sets how many freed bytes the driver pool keeps across synchronizations.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.cache().backend.pool.set_release_threshold(bytes)
    }

    /// Lets kernels and copies on device `peer` read and write this pool's memory (every
    /// block, present and future: `cuMemPoolSetAccess` on the driver pool, and on
    /// [`Backing::PhysicalPages`] `cuMemSetAccess` on every mapped chunk, which later
    /// mappings repeat). Errors with `InvalidArgument` when the devices have no peer path
    /// (`cuDeviceCanAccessPeer`). On the pool's own device it does nothing.
    ///
    /// ```
    /// use cudalloc::device::DevicePool;
    /// if cudalloc::cuda::device_count() >= 2 {
    ///     let pool = DevicePool::get(0).unwrap();
    ///     if cudalloc::cuda::can_access_peer(1, 0).unwrap() {
    ///         pool.enable_peer_access(1).unwrap();
    ///         assert!(pool.peer_access(1).unwrap());
    ///     }
    /// }
    /// ```
    pub fn enable_peer_access(&self, peer: usize) -> Result<()> {
        if peer == self.inner.device {
            return Ok(());
        }
        if !crate::cuda::can_access_peer(peer, self.inner.device)? {
            return Err(Error::InvalidArgument(
                "the devices have no peer path: the peer cannot access this device's memory",
            ));
        }
        let backend = &self.cache().backend;
        backend.pool.set_access(peer, true)?;
        match &backend.pages {
            Some(h) => h.enable_peer(peer),
            None => Ok(()),
        }
    }

    /// Whether device `peer` may access this pool's memory (always true for the pool's
    /// own device).
    pub fn peer_access(&self, peer: usize) -> Result<bool> {
        if peer == self.inner.device {
            return Ok(true);
        }
        let backend = &self.cache().backend;
        Ok(backend.pool.access(peer)? && backend.pages.as_ref().is_none_or(|h| h.has_peer(peer)))
    }

    /// Test switch: with `false`, a stream takes blocks freed on another stream without
    /// waiting for that stream's work, and blocks freed with recorded uses are reused at
    /// once (the races the events prevent), so a negative-control test can show them.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn set_event_guard(&self, on: bool) {
        self.cache().set_guard(on);
    }
}

fn process_pools() -> &'static [OnceLock<DevicePool>] {
    static POOLS: OnceLock<Box<[OnceLock<DevicePool>]>> = OnceLock::new();
    POOLS.get_or_init(|| (0..device_count()).map(|_| OnceLock::new()).collect())
}

/// Trims every process-wide pool (at exit under compute-sanitizer: `cuda/exit.rs`).
fn release_process_pools() {
    for pool in existing_process_pools().into_iter().flatten() {
        pool.trim();
    }
}

/// The process-wide pools created so far, by device (for [`report`](super::report)).
pub(crate) fn existing_process_pools() -> Vec<Option<DevicePool>> {
    process_pools().iter().map(|p| p.get().cloned()).collect()
}
