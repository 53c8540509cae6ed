//! How a [`DevicePool`](super::DevicePool) is configured: [`DevicePoolConfig`], the
//! [`Backing`] of its blocks and the [`PageTuning`] of its page heap.

use crate::error::{Error, Result};

/// How a [`DevicePool`](super::DevicePool) behaves. Start from [`DevicePoolConfig::default()`] and change
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
    /// pages are kept until [`DevicePool::trim`](super::DevicePool::trim) or an allocation's need.
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
    /// driver pool ([`DevicePool::uncached`](super::DevicePool::uncached)): every allocation is a
    /// `cuMemAllocFromPoolAsync`, every free a `cuMemFreeAsync`.
    pub cache: bool,
    /// The most bytes of free blocks one thread keeps for this pool, in bins served
    /// without a lock (default 256 MiB; 0: no thread caches, every free block goes to
    /// the shared lists). A block larger than this is cached in the shared lists only.
    pub thread_cache_bytes: usize,
    /// Requests above this many bytes are not cached: they are allocated from and freed
    /// to the backing directly (default 1 GiB). On [`Backing::PhysicalPages`] the page
    /// heap's blocks (one allocation granule and more, 2 MiB on the H200) are not cached
    /// by size class whatever this says (freed memory there serves blocks of any size at
    /// once); up to this size the last few a thread freed wait in its cache for an
    /// allocation of the same size on the same stream, until its next large allocation
    /// they do not serve.
    pub max_cached_block: usize,
    /// What memory blocks are made of (default [`Backing::Auto`]: physical pages where
    /// the device supports them).
    pub backing: Backing,
    /// How a [`Backing::PhysicalPages`] pool trades memory for driver calls (default
    /// [`PageTuning::BALANCED`]; unused on the driver pool).
    pub pages: PageTuning,
    /// Whether the pool describes its memory to an attached NVTX tool (default true),
    /// so that compute-sanitizer's memcheck reports accesses past a buffer's requested
    /// length and into freed or cached blocks ([`cuda::nvtx`](crate::cuda::nvtx)).
    /// Without a tool this costs nothing on a hit either way (the recorder's branch covers
    /// it); `CUDALLOC_NVTX=0` turns annotations off for every pool. With a tool attached (and
    /// this true) the pool takes its blocks with `cuMemAlloc` instead of its driver pool
    /// or page heap: compute-sanitizer 2025.3.1 sees inside no other device memory.
    pub nvtx: bool,
}

/// What a [`DevicePool`](super::DevicePool)'s blocks are made of.
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
    /// it reports the backing it chose in [`DevicePool::config`](super::DevicePool::config).
    #[default]
    Auto,
    /// Every block is an allocation of the pool's driver pool (`cuMemPoolCreate`,
    /// `cuMemAllocFromPoolAsync`), which carves its chunks in stream order. The driver
    /// keeps a chunk while any block lives in it, so a workload whose sizes vary makes its
    /// reservations drift above what it holds (RMM's random workload on the H200:
    /// `cuMemAllocAsync` 1.26x the peak request; the cache on the driver pool 1.47x).
    DriverPool,
    /// Blocks of one allocation granule and more (2 MiB on the H200) are runs of one large
    /// virtual range backed by chunks of physical memory (`cuMemCreate`, `cuMemMap`:
    /// CUDA's virtual memory management, as PyTorch's expandable segments use it): freed
    /// runs coalesce and stay mapped, so a block of any size that fits in freed memory
    /// takes it with no driver call, and a block that does not fit moves idle chunks
    /// rather than reserve more once they exceed an allowance. What is reserved stays near
    /// what is held, at the price of the moves (mapping, and above all `cuMemSetAccess`,
    /// about 25-30 us per chunk); [`PageTuning`] sets the trade-off (RMM's random
    /// workload on the H200: 1.115x the peak request with the default tuning, in less
    /// time than `cuMemAllocAsync`, which reserves 1.264x). Smaller blocks stay on the
    /// driver pool, cached by size class. Needs a device with VMM support: [`DevicePool::new`](super::DevicePool::new) fails without it. A
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
            pages: PageTuning::BALANCED,
            nvtx: true,
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
/// 4 streams, BENCHMARKS.md): on one H100 (2026-12-06) [`BALANCED`](Self::BALANCED) (the
/// default) reserved 1.119x the peak request in 0.25-0.29 s and [`FAST`](Self::FAST)
/// 1.122x in 0.26-0.27 s, where `cuMemAllocAsync` in the same processes reserved 1.264x
/// in 0.40-0.42 s; on one H200, before a growing heap mapped chunks ahead, BALANCED
/// 1.115x, FAST 1.103x and [`TIGHT`](Self::TIGHT) 1.085x in 2.6 s. A few chunks either
/// way at the peak follow the order in which frees complete, so the allowances' order on
/// one workload is not a rule.
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
    /// 16 MiB chunks, idle memory up to 1/64 (the default): on RMM's random workload
    /// 1.115-1.119x the peak request in less time than `cuMemAllocAsync` (which reserves
    /// 1.264x).
    pub const BALANCED: Self = Self::new(16 << 20, 64);
    /// 8 MiB chunks, idle memory up to 1/128: the least memory (1.085x on RMM's
    /// workload) for many more moves (about 8x `cuMemAllocAsync`'s time there).
    pub const TIGHT: Self = Self::new(8 << 20, 128);
    /// 16 MiB chunks, idle memory up to 1/128: 1.103-1.122x on RMM's workload (the
    /// default's 1.115-1.119x), in about the default's time.
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
    /// and an `idle_divisor` of 0 ([`DevicePool::new`](super::DevicePool::new) checks this).
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
        Self::BALANCED
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
    /// the backing directly: the driver pool, or the page heap on physical pages).
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

    /// This configuration with NVTX annotations on or off (see
    /// [`nvtx`](DevicePoolConfig::nvtx)): off, the pool's memory looks to
    /// compute-sanitizer as one allocation per block it holds, cached or not.
    ///
    /// ```
    /// use cudalloc::device::DevicePoolConfig;
    /// assert!(DevicePoolConfig::default().nvtx);
    /// assert!(!DevicePoolConfig::default().with_nvtx(false).nvtx);
    /// ```
    pub const fn with_nvtx(self, nvtx: bool) -> Self {
        Self { nvtx, ..self }
    }
}
