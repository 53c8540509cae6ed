//! A device pool on a simulated GPU, for benchmarks and tests on machines without one:
//! the same cache, thread caches and hot path (`device::local`) as
//! [`DevicePool`](super::DevicePool), over the simulated streams and memory of
//! `device/fake/` instead of the driver. The `device_hit_sim` benchmark measures the hit
//! path with it.
//!
//! Hidden and outside the API's stability promise: scaffolding for measurements, not for
//! applications.

use super::cache::{Cache, Settings};
use super::config::PageTuning;
pub use super::fake::DriverCosts;
use super::fake::{FakeBackend, FakePhys, FakeStream};
use super::local::{self, Core, LocalCache, Owned, PoolHandle};
use super::order::StreamOrder;
use super::pages::page_threshold;
use crate::error::Result;
#[cfg(not(loom))]
use crate::slot_table::HotKey;
use crate::slot_table::{SlotBits, SlotEntry, SlotTable};
use crate::sync::global::{Arc, Weak};
use crate::sync::thread_local_const;
use core::marker::PhantomData;
use core::mem::ManuallyDrop;

/// A pool on a simulated GPU (unlimited memory; streams that never run ahead of the host
/// unless told to). A cheap, cloneable handle, like [`DevicePool`](super::DevicePool).
///
/// ```
/// use cudalloc::device::sim::{SimPool, SimStream};
/// let pool = SimPool::new(256 << 20);
/// let s = SimStream::new();
/// let a = pool.alloc(1 << 20, &s).unwrap();
/// let p = a.device_ptr();
/// drop(a);
/// assert_eq!(pool.alloc(1 << 20, &s).unwrap().device_ptr(), p, "a hit");
/// assert_eq!(pool.hits(), 1);
/// ```
#[repr(transparent)]
pub struct SimPool<M: Branch = Annotated> {
    r: SimRef<M>,
}

/// The internal handle of a [`SimPool`] (what buffers and bins hold), as `PoolRef` is
/// `DevicePool`'s.
pub(crate) struct SimRef<M: Branch> {
    core: ManuallyDrop<Arc<Core<FakeBackend>>>,
    marker: PhantomData<M>,
}

impl<M: Branch> Clone for SimRef<M> {
    #[inline(always)]
    fn clone(&self) -> Self {
        Self {
            core: ManuallyDrop::new(Arc::clone(&self.core)),
            marker: PhantomData,
        }
    }
}

impl<M: Branch> Drop for SimRef<M> {
    fn drop(&mut self) {
        super::close::drop_handle(self);
    }
}

impl<M: Branch> Clone for SimPool<M> {
    fn clone(&self) -> Self {
        self.r.core.add_user();
        Self { r: self.r.clone() }
    }
}

impl<M: Branch> Drop for SimPool<M> {
    fn drop(&mut self) {
        self.r.core.drop_user();
    }
}

/// Whether a simulated pool's hot path carries `DevicePool`'s NVTX branch: [`Annotated`]
/// (every [`SimPool`] but one, as every `DevicePool`) or [`Bare`] (compiled out). Sealed.
pub trait Branch: sealed::Sealed + Clone + Send + Sync + 'static {
    /// Whether the hot path describes blocks to an attached NVTX tool.
    const NVTX: bool;
}

/// The hot path of `DevicePool`: its observers' one branch per allocation and free
/// (`observe`) covers NVTX's state, an annotation with a tool attached.
#[derive(Clone, Copy, Debug)]
pub struct Annotated;

/// The hot path without the NVTX branch ([`SimPool::bare`]): what the annotations cost
/// without a tool is the difference between the two, in one process (issue 24).
#[derive(Clone, Copy, Debug)]
pub struct Bare;

impl Branch for Annotated {
    const NVTX: bool = true;
}

impl Branch for Bare {
    const NVTX: bool = false;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Annotated {}
    impl Sealed for super::Bare {}
}

thread_local_const! {
    static TABLE: SlotTable<LocalCache<SimRef<Annotated>>> = table(&HOT);
}

thread_local_const! {
    static BARE_TABLE: SlotTable<LocalCache<SimRef<Bare>>> = table(&BARE_HOT);
}

/// A table of `E` reached by the hot path through `HotKey` `_hot` (as `DevicePool`'s).
#[cfg(not(loom))]
const fn table<E: SlotEntry>(hot: &'static HotKey<E>) -> SlotTable<E> {
    SlotTable::with_hot(hot)
}

#[cfg(loom)]
fn table<E: SlotEntry>(_hot: &()) -> SlotTable<E> {
    SlotTable::new()
}

#[cfg(not(loom))]
std::thread_local! {
    /// Where the hot paths find `TABLE` and `BARE_TABLE` (`SlotTable::hot_entry_ptr`).
    static HOT: core::cell::Cell<*const SlotTable<LocalCache<SimRef<Annotated>>>> =
        const { core::cell::Cell::new(core::ptr::null()) };
    static BARE_HOT: core::cell::Cell<*const SlotTable<LocalCache<SimRef<Bare>>>> =
        const { core::cell::Cell::new(core::ptr::null()) };
}

#[cfg(loom)]
static HOT: () = ();
#[cfg(loom)]
static BARE_HOT: () = ();

static SLOTS: SlotBits = SlotBits::new();

/// The simulated device's allocation granule (the H200's).
const GRANULE: usize = 2 << 20;
/// Where the simulated page heap starts serving blocks.
const PAGE_MIN: usize = page_threshold(GRANULE);

impl<M: Branch> PoolHandle for SimRef<M> {
    type B = FakeBackend;
    type Weak = Weak<Core<FakeBackend>>;
    const NVTX: bool = M::NVTX;

    #[inline(always)]
    fn core(&self) -> &Core<FakeBackend> {
        &self.core
    }

    fn downgrade(&self) -> Self::Weak {
        Arc::downgrade(&self.core)
    }

    fn after_push(entry: core::ptr::NonNull<LocalCache<Self>>) {
        super::close::after_push(entry);
    }

    fn upgrade(w: &Self::Weak) -> Option<Self> {
        w.upgrade().map(|core| Self {
            core: ManuallyDrop::new(core),
            marker: PhantomData,
        })
    }

    unsafe fn release_ref(&mut self) {
        // SAFETY: obligation 1: the `Arc` is dropped once and not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.core) }
    }

    fn strong_count(&self) -> usize {
        Arc::strong_count(&self.core)
    }

    #[inline(always)]
    fn with_table<R>(f: impl FnOnce(&SlotTable<LocalCache<Self>>) -> R) -> Option<R> {
        // `Branch` is sealed with two implementors, `Annotated` (`NVTX` true) and `Bare`
        // (false): in each arm `Self` is the very type of that table's entries.
        if M::NVTX {
            TABLE
                .try_with(|t| {
                    // SAFETY: `t` is this thread's `TABLE` (obligation 1).
                    unsafe { t.publish() };
                    // SAFETY: `Self` is `SimRef<Annotated>` here (above): the cast
                    // changes no type.
                    f(unsafe { &*core::ptr::from_ref(t).cast() })
                })
                .ok()
        } else {
            BARE_TABLE
                .try_with(|t| {
                    // SAFETY: as above, for `BARE_TABLE`.
                    unsafe { t.publish() };
                    // SAFETY: `Self` is `SimRef<Bare>` here (above): the cast changes no
                    // type.
                    f(unsafe { &*core::ptr::from_ref(t).cast() })
                })
                .ok()
        }
    }

    #[cfg(not(loom))]
    #[inline(always)]
    fn hot_entry(slot: usize, uid: u64) -> Option<core::ptr::NonNull<LocalCache<Self>>> {
        // As in `with_table`: in each arm `Self` is the type of that table's entries, so
        // the casts change no type.
        if M::NVTX {
            SlotTable::hot_entry_ptr(&HOT, slot, uid).map(|e| e.cast())
        } else {
            SlotTable::hot_entry_ptr(&BARE_HOT, slot, uid).map(|e| e.cast())
        }
    }

    fn slots() -> &'static SlotBits {
        &SLOTS
    }
}

impl SimPool<Bare> {
    /// [`SimPool::annotated`] with the hot path's NVTX branch compiled out: for measuring
    /// that branch against the annotated pool in one process (the `device_hit_nvtx`
    /// benchmark). Nothing of its blocks reaches a tool.
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::bare(256 << 20);
    /// let s = SimStream::new();
    /// let p = pool.alloc(4096, &s).unwrap().device_ptr();
    /// assert_eq!(pool.alloc(4096, &s).unwrap().device_ptr(), p, "a hit");
    /// ```
    pub fn bare(thread_cache_bytes: usize) -> Self {
        let settings = Settings::new(1 << 30, thread_cache_bytes, None);
        Self::around(Cache::new(FakeBackend::new(u64::MAX).with_nvtx(), settings))
    }
}

impl<M: Branch> SimPool<M> {
    /// A pool around `cache`.
    fn around(cache: Cache<FakeBackend>) -> Self {
        Self {
            r: SimRef {
                core: ManuallyDrop::new(Arc::new(Core::new::<SimRef<M>>(cache))),
                marker: PhantomData,
            },
        }
    }
}

impl SimPool {
    /// A pool caching blocks up to 1 GiB, with thread caches of `thread_cache_bytes` (0:
    /// none), as `DevicePoolConfig::default()` with that setting.
    pub fn new(thread_cache_bytes: usize) -> Self {
        let settings = Settings::new(1 << 30, thread_cache_bytes, None);
        Self::around(Cache::new(FakeBackend::new(u64::MAX), settings))
    }

    /// [`SimPool::new`], its blocks described to an attached NVTX tool as a
    /// `DevicePool`'s are (heaps, and a live region per block handed out), for tests of
    /// the annotations with a fake tool.
    ///
    /// ```
    /// let pool = cudalloc::device::sim::SimPool::annotated(0);
    /// # drop(pool);
    /// ```
    pub fn annotated(thread_cache_bytes: usize) -> Self {
        let settings = Settings::new(1 << 30, thread_cache_bytes, None);
        Self::around(Cache::new(FakeBackend::new(u64::MAX).with_nvtx(), settings))
    }

    /// [`SimPool::new`] shaped as the default `DevicePool` on a GPU with CUDA's virtual
    /// memory management (2 MiB granules, as the H200's): blocks from one granule up on a
    /// simulated page heap, not cached by class but kept in the thread caches' large
    /// slots for reuse at the same size, so that the hit of a large block is measured
    /// too.
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::paged(256 << 20);
    /// let s = SimStream::new();
    /// let p = pool.alloc(16 << 20, &s).unwrap().device_ptr();
    /// assert_eq!(pool.alloc(16 << 20, &s).unwrap().device_ptr(), p, "a large-slot hit");
    /// assert_eq!(pool.hits(), 1);
    /// ```
    pub fn paged(thread_cache_bytes: usize) -> Self {
        Self::paged_costing(thread_cache_bytes, None)
    }

    /// [`SimPool::paged`] whose simulated driver takes `costs` for each physical-memory
    /// call (the page heap's growth and moves then take time as on a GPU; the
    /// `device_threads_sim` benchmark).
    ///
    /// ```
    /// use cudalloc::device::sim::{DriverCosts, SimPool, SimStream};
    /// let pool = SimPool::paged_with_costs(0, DriverCosts::H100);
    /// let t = std::time::Instant::now();
    /// drop(pool.alloc(16 << 20, &SimStream::new()).unwrap());
    /// assert!(t.elapsed() >= DriverCosts::H100.create + DriverCosts::H100.access);
    /// ```
    pub fn paged_with_costs(thread_cache_bytes: usize, costs: DriverCosts) -> Self {
        Self::paged_costing(thread_cache_bytes, Some(costs))
    }

    fn paged_costing(thread_cache_bytes: usize, costs: Option<DriverCosts>) -> Self {
        let mut settings = Settings::new((1 << 30).min(PAGE_MIN - 1), thread_cache_bytes, None);
        settings.max_large_bytes = 1 << 30;
        Self::on_pages(settings, costs)
    }

    /// A pool of `settings` over a simulated page heap shaped as the H200's (2 MiB
    /// granules, blocks from [`PAGE_MIN`] up on the heap), its driver taking `costs`.
    fn on_pages(settings: Settings, costs: Option<DriverCosts>) -> Self {
        let phys = FakePhys::new(GRANULE, usize::MAX);
        let phys = match costs {
            Some(c) => phys.with_costs(c),
            None => phys,
        };
        let backend = FakeBackend::paged(u64::MAX, phys, PAGE_MIN, PageTuning::default());
        Self::around(Cache::new(backend, settings))
    }

    /// [`SimPool::paged`] without the cache: every block from the simulated backend
    /// (the page heap from one granule up, the simulated driver pool below), as
    /// `DevicePoolConfig::default().with_cache(false)` on a GPU with physical pages.
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::paged_uncached();
    /// drop(pool.alloc(16 << 20, &SimStream::new()).unwrap());
    /// assert_eq!(pool.hits(), 0, "nothing is cached");
    /// ```
    pub fn paged_uncached() -> Self {
        Self::on_pages(Settings::new(0, 0, None), None)
    }

    /// The pool without its cache, on the simulated driver pool alone: every block from
    /// the backend, as [`DevicePool::uncached`](super::DevicePool::uncached) (the driver
    /// pool in effect, whose reservation the issue's targets compare against).
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::uncached();
    /// drop(pool.alloc(1 << 20, &SimStream::new()).unwrap());
    /// assert_eq!(pool.peak_reserved(), 32 << 20, "the driver pool's first chunk");
    /// ```
    pub fn uncached() -> Self {
        let settings = Settings::new(0, 0, None);
        Self::around(Cache::new(FakeBackend::new(u64::MAX), settings))
    }
}

impl<M: Branch> SimPool<M> {
    /// Misses of cached classes so far: those of a class the cache had given back lately
    /// (its idle allowance grew), and the others.
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::new(0);
    /// drop(pool.alloc(4096, &SimStream::new()).unwrap());
    /// assert_eq!(pool.class_misses(), (0, 1));
    /// ```
    pub fn class_misses(&self) -> (u64, u64) {
        self.r.core.cache.class_misses()
    }

    /// The most memory the simulated driver pool and page heap reserved together so far
    /// (the simulated counterpart of `DevicePoolStats::peak_reserved_bytes`).
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::paged(0);
    /// drop(pool.alloc(16 << 20, &SimStream::new()).unwrap());
    /// assert!(pool.peak_reserved() >= 16 << 20);
    /// ```
    pub fn peak_reserved(&self) -> u64 {
        self.r.core.cache.backend.reservation().1
    }

    /// The pool's statistics, as [`DevicePool::stats`](super::DevicePool::stats) gives
    /// them (without the device's own figures).
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::new(0);
    /// drop(pool.alloc(4096, &SimStream::new()).unwrap());
    /// assert_eq!(pool.stats().misses, 1);
    /// ```
    pub fn stats(&self) -> super::DevicePoolStats {
        self.r.core.cache.snapshot()
    }

    /// A block of `bytes` on `stream`: the path of [`DevicePool::alloc`] (a hit from this
    /// thread's bin, else the slow path).
    ///
    /// [`DevicePool::alloc`]: super::DevicePool::alloc
    #[inline]
    pub fn alloc(&self, bytes: usize, stream: &SimStream) -> Result<SimBuffer<M>> {
        if bytes != 0 {
            if let Some(block) = local::try_alloc_fast(&self.r, bytes, &stream.stream) {
                return Ok(SimBuffer { block, bytes });
            }
        }
        self.alloc_slow(bytes, stream)
    }

    #[cold]
    #[inline(never)]
    fn alloc_slow(&self, bytes: usize, stream: &SimStream) -> Result<SimBuffer<M>> {
        let block = match bytes {
            0 => Owned::empty(stream.stream.clone(), self.r.clone()),
            b => local::alloc_slow(&self.r, b, &stream.stream)
                .inspect_err(|e| local::record_failure(&self.r, b, &stream.stream, e))?,
        };
        Ok(SimBuffer { block, bytes })
    }

    /// This pool, named `name` in traces (`SimPool(0)` otherwise; the first name given
    /// wins).
    ///
    /// ```
    /// let pool = cudalloc::device::sim::SimPool::new(0).traced_as("scratch");
    /// # drop(pool);
    /// ```
    pub fn traced_as(self, name: &'static str) -> Self {
        self.r.core.cache.backend.trace().set_name(name);
        self
    }

    /// Gives every cached block back to the simulated device, as
    /// [`DevicePool::trim`](super::DevicePool::trim) does.
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let pool = SimPool::new(0);
    /// drop(pool.alloc(4096, &SimStream::new()).unwrap());
    /// pool.trim();
    /// ```
    pub fn trim(&self) {
        local::with_thread_cache(&self.r, |tc| self.r.core.cache.trim(tc));
    }

    /// Allocations served from a thread's bin.
    pub fn hits(&self) -> u64 {
        self.r.core.cache.snapshot().hits
    }
}

/// A simulated stream.
#[derive(Clone)]
pub struct SimStream {
    stream: FakeStream,
}

impl SimStream {
    /// A new stream.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        Self {
            stream: FakeStream::new(),
        }
    }
}

/// A block from a [`SimPool`], given back on drop as a `DeviceBuffer` is.
pub struct SimBuffer<M: Branch = Annotated> {
    block: Owned<SimRef<M>>,
    bytes: usize,
}

impl<M: Branch> SimBuffer<M> {
    /// The simulated address.
    pub fn device_ptr(&self) -> u64 {
        self.block.ptr()
    }

    /// The pool it came from, as [`DeviceBuffer::pool`](super::DeviceBuffer::pool).
    ///
    /// ```
    /// use cudalloc::device::sim::{SimPool, SimStream};
    /// let buf = SimPool::new(0).alloc(4096, &SimStream::new()).unwrap();
    /// let pool = buf.pool().clone(); // a handle again, though the first one is gone
    /// drop(buf);
    /// assert_eq!(pool.stats().cached_blocks, 1);
    /// ```
    pub fn pool(&self) -> &SimPool<M> {
        // SAFETY: `SimPool` is `repr(transparent)` over a `SimRef`: the same layout. The
        // reference is never dropped as a `SimPool` and lives as long as the block's.
        unsafe { &*core::ptr::from_ref(self.block.pool()).cast::<SimPool<M>>() }
    }
}

impl<M: Branch> Drop for SimBuffer<M> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: called once, here; the block is not used afterwards.
        unsafe { self.block.release(self.bytes) }
    }
}

#[cfg(all(test, not(loom)))]
mod close_tests;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_steady_cycle_is_all_hits_on_the_hot_path() {
        let pool = SimPool::new(256 << 20);
        let s = SimStream::new();
        for size in [256, 4096, 1 << 20, 128 << 20] {
            let first = pool.alloc(size, &s).unwrap().device_ptr();
            let hits = pool.hits();
            for _ in 0..1000 {
                assert_eq!(pool.alloc(size, &s).unwrap().device_ptr(), first);
            }
            assert_eq!(pool.hits() - hits, 1000, "size {size}");
        }
        let snap = pool.r.core.cache.snapshot();
        assert_eq!((snap.misses, snap.events), (4, 0), "{snap:?}");
    }

    #[test]
    fn a_steady_cycle_of_large_blocks_is_all_hits_on_pages() {
        let pool = SimPool::paged(256 << 20);
        let s = SimStream::new();
        for size in [256, 1 << 20, 2 << 20, 16 << 20, 128 << 20] {
            let first = pool.alloc(size, &s).unwrap().device_ptr();
            let hits = pool.hits();
            for _ in 0..1000 {
                assert_eq!(pool.alloc(size, &s).unwrap().device_ptr(), first);
            }
            assert_eq!(pool.hits() - hits, 1000, "size {size}");
        }
        assert!(
            pool.r.core.cache.is_large(16 << 20),
            "16 MiB is a large block here"
        );
    }
}
