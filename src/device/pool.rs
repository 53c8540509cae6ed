//! [`DevicePool`]: a device's driver pool with the stream-ordered cache in front, and the
//! allocation and free paths buffers take (its configuration is in `config.rs`).

use core::fmt;
use core::mem::ManuallyDrop;
use core::ops::Deref;

use super::backend::CudaBackend;
use super::cache::{Cache, Settings};
use super::close;
use super::config::{Backing, DevicePoolConfig};
use super::local::{self, Core, LocalCache, PoolHandle};
use super::pages::page_threshold;
use super::report::{DeviceEntry, DeviceMemorySummary, DevicePoolStats, DeviceReport};
use crate::cuda::{device_count, device_name, mem_info};
use crate::error::{Error, Result};
use crate::slot_table::{SlotBits, SlotTable};
use crate::sync::global::{Arc, OnceLock, Weak};
use crate::sync::thread_local_const;

pub(crate) struct Inner {
    core: Core<CudaBackend>,
    device: usize,
    config: DevicePoolConfig,
}

thread_local_const! {
    /// This thread's caches of device pools, by the pools' slots.
    static TABLE: SlotTable<LocalCache<PoolRef>> = table();
}

#[cfg(not(loom))]
std::thread_local! {
    /// Where the hot path finds `TABLE` (`SlotTable::hot_entry_ptr`).
    static HOT: core::cell::Cell<*const SlotTable<LocalCache<PoolRef>>> =
        const { core::cell::Cell::new(core::ptr::null()) };
}

#[cfg(not(loom))]
const fn table() -> SlotTable<LocalCache<PoolRef>> {
    SlotTable::with_hot(&HOT)
}

#[cfg(loom)]
fn table() -> SlotTable<LocalCache<PoolRef>> {
    SlotTable::new()
}

/// The slots of device pools in their thread-local tables.
static SLOTS: SlotBits = SlotBits::new();

/// The internal handle of a device pool: what buffers and the thread caches' bins hold.
/// Its clones and drops do not count as the pool's users ([`DevicePool`]'s do); its drop
/// tries the collection of a pool with no user left (`close.rs`).
pub(crate) struct PoolRef(ManuallyDrop<Arc<Inner>>);

impl Clone for PoolRef {
    #[inline(always)]
    fn clone(&self) -> Self {
        Self(ManuallyDrop::new(Arc::clone(&self.0)))
    }
}

impl Deref for PoolRef {
    type Target = Inner;

    #[inline(always)]
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl Drop for PoolRef {
    fn drop(&mut self) {
        close::drop_handle(self);
    }
}

impl PoolHandle for PoolRef {
    type B = CudaBackend;
    type Weak = Weak<Inner>;

    #[inline(always)]
    fn core(&self) -> &Core<CudaBackend> {
        &self.0.core
    }

    fn downgrade(&self) -> Weak<Inner> {
        Arc::downgrade(&self.0)
    }

    fn after_push(entry: core::ptr::NonNull<LocalCache<Self>>) {
        close::after_push(entry);
    }

    fn upgrade(w: &Weak<Inner>) -> Option<Self> {
        w.upgrade().map(|a| Self(ManuallyDrop::new(a)))
    }

    unsafe fn release_ref(&mut self) {
        // SAFETY: obligation 1: the `Arc` is dropped once and not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.0) }
    }

    fn strong_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    #[inline(always)]
    fn with_table<R>(f: impl FnOnce(&SlotTable<LocalCache<Self>>) -> R) -> Option<R> {
        TABLE
            .try_with(|t| {
                // SAFETY: `t` is this thread's `TABLE` (obligation 1).
                unsafe { t.publish() };
                f(t)
            })
            .ok()
    }

    #[cfg(not(loom))]
    #[inline(always)]
    fn hot_entry(slot: usize, uid: u64) -> Option<core::ptr::NonNull<LocalCache<Self>>> {
        SlotTable::hot_entry_ptr(&HOT, slot, uid)
    }

    fn slots() -> &'static SlotBits {
        &SLOTS
    }
}

/// A pool of device memory on one device: a stream-ordered cache of blocks by (stream,
/// size class) in front of a driver pool of its own (`cuMemPoolCreate`) and, by default
/// where the device has virtual memory management, a page heap for blocks of a granule
/// and more ([`Backing`](super::Backing)). A cheap,
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
///
/// Dropping the last handle gives the pool's memory back once no buffer of it is left,
/// even while threads that cached its blocks live on (a collection takes their blocks).
#[repr(transparent)]
pub struct DevicePool {
    /// The internal handle; `DevicePool` adds the count of users (`Core::users`).
    inner: PoolRef,
}

impl Clone for DevicePool {
    fn clone(&self) -> Self {
        self.inner.core.add_user();
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // The last user closes the pool; `inner`, dropped next, tries its collection.
        self.inner.core.drop_user();
    }
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
        let backend = CudaBackend::open(device, &config)?;
        let config = DevicePoolConfig {
            backing: backend.backing(),
            ..config
        };
        // Under compute-sanitizer, the process-wide pools' cached memory goes back at exit.
        crate::cuda::exit::release_at_exit(release_process_pools);
        let settings = if config.cache {
            // The page heap's blocks are not cached by size class: freed, they serve
            // blocks of any size at once (a class cache holds memory only its class can
            // use, and rounds each block up to its class).
            let page_min = backend.page_granule().map(page_threshold);
            let max_cached = page_min.map_or(config.max_cached_block, |m| config.max_cached_block.min(m - 1));
            let mut settings = Settings::new(max_cached, config.thread_cache_bytes, config.limit);
            if page_min.is_some() {
                // Freed page-heap blocks up to the cached size wait in the thread caches'
                // large slots for an allocation of the same size until the thread's next
                // large miss.
                settings.max_large_bytes = config.max_cached_block;
            }
            settings
        } else {
            Settings::new(0, 0, config.limit)
        };
        Ok(Self {
            inner: PoolRef(ManuallyDrop::new(Arc::new(Inner {
                core: Core::new::<PoolRef>(Cache::new(backend.with_nvtx(config.nvtx), settings)),
                device,
                config,
            }))),
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
        // The crate's bookkeeping (`count::bookkeeping`): made on first use, kept for the
        // process, so a leak check's window does not count it.
        let pool = crate::count::bookkeeping(|| Self::new(device, DevicePoolConfig::default()))?;
        // Two threads may race to create it: one wins, the other's pool is dropped.
        Ok(slot.get_or_init(|| pool).clone())
    }

    /// The internal handle buffers hold.
    #[inline(always)]
    pub(crate) fn handle(&self) -> &PoolRef {
        &self.inner
    }

    /// The user handle a buffer's internal handle `r` stands for (`DeviceBuffer::pool`):
    /// cloning it makes a user handle.
    #[inline(always)]
    pub(crate) fn from_ref(r: &PoolRef) -> &DevicePool {
        // SAFETY: `DevicePool` is `repr(transparent)` over its one field, a `PoolRef`:
        // the same layout. The reference is never dropped as a `DevicePool` (only an
        // owned one counts a user), and lives as long as `r`.
        unsafe { &*core::ptr::from_ref(r).cast::<DevicePool>() }
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

    /// The device's memory, in bytes (the most one request may ask for).
    pub(super) fn device_bytes(&self) -> usize {
        self.cache().backend.device_bytes()
    }

    /// Turns an out-of-memory error into one naming the device, the size and the pool's
    /// state.
    #[cold]
    pub(super) fn out_of_memory(&self, e: Error, bytes: usize) -> Error {
        if !e.is_out_of_memory() {
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
        let mut s = self.cache().snapshot();
        s.device = self.inner.device;
        s.caching = self.inner.config.cache;
        s.limit = self.inner.config.limit;
        self.cache().backend.fill_usage(&mut s);
        s
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
    /// Returns the bytes released: how much less the pool reserves from the device
    /// afterwards (the driver pool and the page heap together), as [`Pool::trim`] returns
    /// the bytes it gave back to its source.
    ///
    /// [`Pool::trim`]: crate::pool::Pool::trim
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::uncached(0), Stream::new(0)) {
    ///     drop(pool.alloc::<u8>(16 << 20, &stream).unwrap());
    ///     stream.synchronize().unwrap();
    ///     let reserved = pool.stats().reserved_bytes; // the driver pool keeps the block
    ///     assert!(reserved >= 16 << 20);
    ///     assert_eq!(pool.trim() as u64, reserved);
    ///     assert_eq!(pool.stats().reserved_bytes, 0);
    /// }
    /// ```
    pub fn trim(&self) -> usize {
        local::with_thread_cache(self.handle(), |tc| self.cache().trim(tc))
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
        self.cache().backend.reset_peaks();
    }

    /// The page heap's counters, on physical pages (benchmarks print them).
    #[cfg(feature = "testing")]
    pub(crate) fn page_counters(&self) -> Option<String> {
        self.cache().backend.page_counters()
    }

    /// Sets how many freed bytes the driver pool keeps across synchronizations.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.cache().backend.set_release_threshold(bytes)
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
        self.cache().backend.enable_peer(peer)
    }

    /// Whether device `peer` may access this pool's memory (always true for the pool's
    /// own device).
    pub fn peer_access(&self, peer: usize) -> Result<bool> {
        if peer == self.inner.device {
            return Ok(true);
        }
        self.cache().backend.peer_access(peer)
    }

    /// Test switch: with `false`, a stream takes blocks freed on another stream without
    /// waiting for that stream's work, and blocks freed with recorded uses are reused at
    /// once (the races the events prevent), so a negative-control test can show them.
    #[cfg(feature = "test-hooks")]
    pub fn set_event_guard(&self, on: bool) {
        self.cache().set_guard(on);
        self.cache().backend.set_guard(on);
    }
}

fn process_pools() -> &'static [OnceLock<DevicePool>] {
    static POOLS: OnceLock<Box<[OnceLock<DevicePool>]>> = OnceLock::new();
    POOLS.get_or_init(|| crate::count::bookkeeping(|| (0..device_count()).map(|_| OnceLock::new()).collect()))
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

/// A report on every device: memory, and the process-wide pools' state. Empty without a
/// driver. No side effect (it creates no pool).
///
/// ```
/// let report = cudalloc::device::report();
/// assert_eq!(report.devices.len(), cudalloc::cuda::device_count());
/// println!("{report}");
/// ```
pub fn report() -> DeviceReport {
    let pools = if device_count() == 0 {
        Vec::new()
    } else {
        existing_process_pools()
    };
    DeviceReport {
        devices: (0..device_count())
            .map(|d| {
                let (free, total) = mem_info(d).unwrap_or((0, 0));
                DeviceEntry {
                    device: d,
                    name: device_name(d).unwrap_or_default(),
                    free_bytes: free as u64,
                    total_bytes: total as u64,
                    pool: pools.get(d).and_then(|p| p.as_ref()).map(|p| p.stats()),
                }
            })
            .collect(),
    }
}
