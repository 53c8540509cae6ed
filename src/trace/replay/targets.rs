//! The allocators a trace replays on: any allocator-api2 allocator ([`HostTarget`]), the
//! device pools ([`DevicePoolTarget`], and [`SimTarget`] on the simulated GPU), raw
//! driver calls, and the standard list of each kind ([`targets`]).

use core::ptr::NonNull;

use allocator_api2::alloc::{Allocator, Global, Layout};

use super::{Plan, ReplayReport, ReplayTarget};
use crate::cuda::async_memory::AsyncDeviceMemory;
use crate::cuda::memory::DeviceMemory;
use crate::cuda::{self, HostAllocFlags, Stream};
#[cfg(any(test, feature = "sim"))]
use crate::device::sim::{SimBuffer, SimPool, SimStream};
use crate::device::{Backing, DeviceBuffer, DevicePool, DevicePoolConfig, PageTuning};
use crate::pool::{Pool, PoolConfig};
use crate::source::{HostSource, PinnedSource};
use crate::trace::TraceMemory;
use crate::{Direct, ManagedAlloc, PinnedAlloc};

/// A block of a [`HostTarget`].
pub struct HostBlock {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a block is memory its allocator owns, with no thread affinity; `HostTarget`
// requires its allocator to be `Sync`, so it may be freed from any thread.
unsafe impl Send for HostBlock {}

/// Any allocator-api2 allocator as a replay target (streams are ignored).
///
/// ```
/// use cudalloc::pool::Pool;
/// use cudalloc::source::HostSource;
/// use cudalloc::trace::replay::{self, HostTarget};
/// use cudalloc::trace::{Action, Event, Trace};
/// let mut t = Trace::default();
/// t.events.push(Event::new(Action::Alloc, 0x10, 1000));
/// t.events.push(Event::new(Action::FreeRequested, 0x10, 1000));
/// let target = HostTarget::new("Pool<HostSource>", Pool::new(HostSource))
///     .with_peak_reserved(|p| p.stats().peak_source_bytes as u64);
/// let r = replay::replay(&t, target, &Default::default()).unwrap();
/// assert!(r.peak_held >= 1000);
/// assert!(r.peak_reserved.unwrap() >= 1000);
/// ```
pub struct HostTarget<A> {
    name: String,
    alloc: A,
    reserved: Option<fn(&A) -> u64>,
    note: Option<String>,
}

impl<A: Allocator + Sync> HostTarget<A> {
    /// `alloc`, named `name` in reports.
    pub fn new(name: impl Into<String>, alloc: A) -> Self {
        Self {
            name: name.into(),
            alloc,
            reserved: None,
            note: None,
        }
    }

    /// Reports the allocator's peak reservation as `f` says after the replay.
    pub fn with_peak_reserved(mut self, f: fn(&A) -> u64) -> Self {
        self.reserved = Some(f);
        self
    }

    /// Adds a note to the report.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}

impl<A: Allocator + Sync> ReplayTarget for HostTarget<A> {
    type Block = HostBlock;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn note(&self) -> Option<String> {
        self.note.clone()
    }

    #[inline]
    fn alloc(&self, size: usize, align: usize, _stream: usize) -> Result<(HostBlock, usize), String> {
        let layout = Layout::from_size_align(size, align).map_err(|e| e.to_string())?;
        match self.alloc.allocate(layout) {
            Ok(p) => Ok((
                HostBlock {
                    ptr: p.cast(),
                    layout,
                },
                p.len(),
            )),
            Err(_) => Err("allocation failed".into()),
        }
    }

    #[inline]
    unsafe fn free(&self, block: HostBlock, _stream: usize) {
        // SAFETY: the caller passes a block of this target's allocator, once (by value);
        // its layout is the one it was allocated with.
        unsafe { self.alloc.deallocate(block.ptr, block.layout) }
    }

    fn peak_reserved(&self) -> Option<u64> {
        self.reserved.map(|f| f(&self.alloc))
    }
}

/// A [`DevicePool`] as a replay target: one real stream per recorded stream.
///
/// ```
/// use cudalloc::device::DevicePoolConfig;
/// use cudalloc::trace::replay::DevicePoolTarget;
/// if let Ok(t) = DevicePoolTarget::new("DevicePool", 0, DevicePoolConfig::default()) {
///     let r = cudalloc::trace::replay::replay(&Default::default(), t, &Default::default()).unwrap();
///     assert_eq!(r.allocations, 0);
/// }
/// ```
pub struct DevicePoolTarget {
    name: String,
    pool: DevicePool,
    device: usize,
    streams: Vec<Stream>,
}

impl DevicePoolTarget {
    /// A fresh pool on `device` with `config`.
    pub fn new(name: impl Into<String>, device: usize, config: DevicePoolConfig) -> crate::Result<Self> {
        Ok(Self {
            name: name.into(),
            pool: DevicePool::new(device, config)?,
            device,
            streams: Vec::new(),
        })
    }

    /// The plain driver pool ([`DevicePool::uncached`]).
    pub fn uncached(name: impl Into<String>, device: usize) -> crate::Result<Self> {
        Ok(Self {
            name: name.into(),
            pool: DevicePool::uncached(device)?,
            device,
            streams: Vec::new(),
        })
    }
}

impl ReplayTarget for DevicePoolTarget {
    type Block = DeviceBuffer<u8>;

    fn name(&self) -> String {
        self.name.clone()
    }

    /// With the `testing` feature (the crate's own examples and benches), a pool on
    /// physical pages says what its page heap did in the run: the driver calls it made
    /// and the time they took.
    #[cfg(feature = "testing")]
    fn note(&self) -> Option<String> {
        self.pool.page_counters().map(|c| format!("page heap: {c}"))
    }

    fn prepare(&mut self, streams: usize) -> Result<(), String> {
        self.streams = make_streams(self.device, streams)?;
        Ok(())
    }

    #[inline]
    fn alloc(&self, size: usize, _align: usize, stream: usize) -> Result<(DeviceBuffer<u8>, usize), String> {
        let b = self
            .pool
            .alloc::<u8>(size, &self.streams[stream])
            .map_err(|e| e.to_string())?;
        Ok((b, size))
    }

    #[inline]
    unsafe fn free(&self, block: DeviceBuffer<u8>, _stream: usize) {
        drop(block); // on its stream, into the pool's cache
    }

    fn settle(&self) {
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }

    fn peak_reserved(&self) -> Option<u64> {
        Some(self.pool.stats().peak_reserved_bytes)
    }
}

impl Drop for DevicePoolTarget {
    /// Gives the pool's memory back before the next target runs. Dropping the pool alone
    /// does not: this thread's cache (the blocks the trace never freed go there after the
    /// timed run) holds a handle of the pool, which keeps the pool and everything it
    /// reserves alive while the thread lives. On a trace whose peak is a third of the
    /// device (a 41 GB public snapshot on the 141 GB H200), the fourth target then ran
    /// out of memory and the last three could not make a stream.
    fn drop(&mut self) {
        self.settle();
        self.pool.trim();
    }
}

/// The streams of a device target, after the driver's one-time set-up of stream-ordered
/// allocation was paid (once per process), so no target is charged for it.
fn make_streams(device: usize, n: usize) -> Result<Vec<Stream>, String> {
    crate::cuda::async_memory::warm_up(device).map_err(|e| format!("warming up the driver: {e}"))?;
    (0..n)
        .map(|_| Stream::new(device).map_err(|e| format!("creating a stream: {e}")))
        .collect()
}

/// The device pool's cache on the simulated GPU ([`crate::device::sim`]): for machines
/// without one. Times are the cache's and the simulated driver's, not a GPU's. Only with
/// the `sim` feature (the crate's own tests, benches and examples have it).
///
/// ```
/// use cudalloc::trace::replay::{self, SimTarget};
/// use cudalloc::trace::{Action, Event, Trace};
/// let mut t = Trace::default();
/// t.events.push(Event::new(Action::Alloc, 0x10, 1 << 20));
/// let r = replay::replay(&t, SimTarget::new(256 << 20), &Default::default()).unwrap();
/// assert!(r.note.unwrap().contains("simulated"));
/// ```
#[cfg(any(test, feature = "sim"))]
pub struct SimTarget {
    name: String,
    pool: SimPool,
    streams: Vec<SimStream>,
    /// Whether the report gives the simulated reservation (the paged shapes).
    reserved: bool,
}

#[cfg(any(test, feature = "sim"))]
impl SimTarget {
    /// The simulated pool shaped as the default `DevicePool` on a GPU with physical
    /// pages ([`SimPool::paged`]), with its cache (`cache`) or without
    /// ([`SimPool::paged_uncached`]); its peak reservation is the simulated driver
    /// pool's and page heap's.
    ///
    /// ```
    /// use cudalloc::trace::replay::{self, SimTarget};
    /// use cudalloc::trace::{Action, Event, Trace};
    /// let mut t = Trace::default();
    /// t.events.push(Event::new(Action::Alloc, 0x10, 16 << 20));
    /// let r = replay::replay(&t, SimTarget::paged(false), &Default::default()).unwrap();
    /// assert!(r.peak_reserved.unwrap() >= 16 << 20);
    /// ```
    pub fn paged(cache: bool) -> Self {
        let (name, pool) = if cache {
            let bytes = DevicePoolConfig::default().thread_cache_bytes;
            ("DevicePool (simulated GPU, pages)", SimPool::paged(bytes))
        } else {
            (
                "DevicePool (simulated GPU, pages, no cache)",
                SimPool::paged_uncached(),
            )
        };
        Self {
            name: name.into(),
            pool,
            streams: Vec::new(),
            reserved: true,
        }
    }

    /// The simulated pool without its cache, on the simulated driver pool alone
    /// ([`SimPool::uncached`]: `DevicePool::uncached` in effect), with its reservation.
    ///
    /// ```
    /// use cudalloc::trace::replay::{self, SimTarget};
    /// use cudalloc::trace::{Action, Event, Trace};
    /// let mut t = Trace::default();
    /// t.events.push(Event::new(Action::Alloc, 0x10, 1 << 20));
    /// let r = replay::replay(&t, SimTarget::uncached(), &Default::default()).unwrap();
    /// assert_eq!(r.peak_reserved, Some(32 << 20));
    /// ```
    pub fn uncached() -> Self {
        Self {
            name: "DevicePool::uncached (simulated GPU, driver pool)".into(),
            pool: SimPool::uncached(),
            streams: Vec::new(),
            reserved: true,
        }
    }

    /// A simulated pool with thread caches of `thread_cache_bytes` (0: none).
    pub fn new(thread_cache_bytes: usize) -> Self {
        Self {
            name: if thread_cache_bytes == 0 {
                "DevicePool (simulated GPU, no thread cache)".into()
            } else {
                "DevicePool (simulated GPU)".into()
            },
            pool: SimPool::new(thread_cache_bytes),
            streams: Vec::new(),
            reserved: false,
        }
    }
}

#[cfg(any(test, feature = "sim"))]
impl ReplayTarget for SimTarget {
    type Block = SimBuffer;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn note(&self) -> Option<String> {
        Some("simulated GPU (no CUDA driver): the cache's own work, no driver or GPU time".into())
    }

    fn prepare(&mut self, streams: usize) -> Result<(), String> {
        self.streams = (0..streams).map(|_| SimStream::new()).collect();
        Ok(())
    }

    #[inline]
    fn alloc(&self, size: usize, _align: usize, stream: usize) -> Result<(SimBuffer, usize), String> {
        let b = self
            .pool
            .alloc(size, &self.streams[stream])
            .map_err(|e| e.to_string())?;
        Ok((b, size))
    }

    #[inline]
    unsafe fn free(&self, block: SimBuffer, _stream: usize) {
        drop(block);
    }

    fn peak_reserved(&self) -> Option<u64> {
        self.reserved.then(|| self.pool.peak_reserved())
    }
}

/// Raw `cuMemAllocAsync` on the device's default memory pool, one call per allocation.
struct RawAsync {
    streams: Vec<&'static Stream>,
    device: usize,
}

impl ReplayTarget for RawAsync {
    type Block = AsyncDeviceMemory<'static>;

    fn name(&self) -> String {
        "raw cuMemAllocAsync".into()
    }

    fn prepare(&mut self, streams: usize) -> Result<(), String> {
        // A raw allocation borrows its stream; the streams (a few per replay) are leaked
        // so that the blocks may outlive this function's borrows.
        self.streams = make_streams(self.device, streams)?
            .into_iter()
            .map(|s| &*Box::leak(Box::new(s)))
            .collect();
        Ok(())
    }

    fn alloc(&self, size: usize, _align: usize, stream: usize) -> Result<(Self::Block, usize), String> {
        let m = AsyncDeviceMemory::new(size, self.streams[stream]).map_err(|e| e.to_string())?;
        Ok((m, size))
    }

    unsafe fn free(&self, block: Self::Block, _stream: usize) {
        drop(block);
    }

    fn settle(&self) {
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }
}

/// Raw `cuMemAlloc`, synchronous, one call per allocation.
struct RawAlloc {
    device: usize,
}

impl ReplayTarget for RawAlloc {
    type Block = DeviceMemory;

    fn name(&self) -> String {
        "raw cuMemAlloc".into()
    }

    fn alloc(&self, size: usize, _align: usize, _stream: usize) -> Result<(DeviceMemory, usize), String> {
        let m = DeviceMemory::new(size, self.device).map_err(|e| e.to_string())?;
        Ok((m, size))
    }

    unsafe fn free(&self, block: DeviceMemory, _stream: usize) {
        drop(block);
    }
}

type RunFn = dyn Fn(&Plan, Option<u64>) -> Result<ReplayReport, String>;

/// One allocator of the standard lists: made fresh for each replay (so its peaks are the
/// replay's own), optionally under a limit ([`Target::fit`]).
pub struct Target {
    /// The name in reports.
    pub name: String,
    /// Whether [`Target::fit`] can bisect on its limit.
    pub limitable: bool,
    run: Box<RunFn>,
}

impl Target {
    fn new(
        name: &str,
        limitable: bool,
        run: impl Fn(&Plan, Option<u64>) -> Result<ReplayReport, String> + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            limitable,
            run: Box::new(run),
        }
    }

    /// A target from any closure that makes a [`ReplayTarget`] (under a limit, when
    /// `limitable` and one is given) and replays the plan on it.
    ///
    /// ```
    /// use cudalloc::trace::replay::{HostTarget, Plan, Target};
    /// let t = Target::from_fn("Global", false, |plan: &Plan, _limit| {
    ///     plan.replay(HostTarget::new("Global", allocator_api2::alloc::Global))
    /// });
    /// assert_eq!(t.name, "Global");
    /// ```
    pub fn from_fn(
        name: &str,
        limitable: bool,
        run: impl Fn(&Plan, Option<u64>) -> Result<ReplayReport, String> + 'static,
    ) -> Self {
        Self::new(name, limitable, run)
    }

    /// Replays `plan` on a fresh instance.
    pub fn run(&self, plan: &Plan) -> Result<ReplayReport, String> {
        (self.run)(plan, None)
    }

    /// Replays `plan` on a fresh instance limited to `bytes` (unlimited where the target
    /// has no limit).
    pub fn run_limited(&self, plan: &Plan, bytes: u64) -> Result<ReplayReport, String> {
        (self.run)(plan, Some(bytes))
    }

    /// The smallest limit (within 1% or 64 KiB) under which `plan` replays with no failed
    /// allocation, by bisection between the plan's peak request and a limit that works
    /// (doubled from it until one does, at most 2^10 times the peak). `None` for a target
    /// without a limit, or when no limit up to that bound works.
    ///
    /// ```
    /// use cudalloc::trace::replay::{random_workload, targets, Plan, RandomWorkload};
    /// use cudalloc::trace::TraceMemory;
    /// let trace = random_workload(&RandomWorkload { allocations: 200, ..RandomWorkload::small() });
    /// let plan = Plan::new(&trace, &Default::default()).unwrap();
    /// let pool = targets(TraceMemory::Host).into_iter().find(|t| t.limitable).unwrap();
    /// let fit = pool.fit(&plan).unwrap().unwrap();
    /// assert!(fit >= plan.peak_requested());
    /// ```
    pub fn fit(&self, plan: &Plan) -> Option<Result<u64, String>> {
        if !self.limitable {
            return None;
        }
        let fits = |limit: u64| self.run_limited(plan, limit).map(|r| r.failures == 0);
        let mut lo = plan.peak_requested().max(1);
        let mut hi = lo;
        let mut doublings = 0;
        loop {
            match fits(hi) {
                Err(e) => return Some(Err(e)),
                Ok(true) => break,
                Ok(false) if doublings < 10 => {
                    lo = hi;
                    hi = hi.saturating_mul(2);
                    doublings += 1;
                }
                Ok(false) => {
                    return Some(Err(format!(
                        "no limit up to {hi} bytes replays the trace without a failure"
                    )))
                }
            }
        }
        if hi == lo && doublings == 0 {
            return Some(Ok(hi));
        }
        // Invariant: `hi` works, `lo` does not (or is the peak request).
        while hi - lo > (lo / 100).max(64 << 10) {
            let mid = lo + (hi - lo) / 2;
            match fits(mid) {
                Err(e) => return Some(Err(e)),
                Ok(true) => hi = mid,
                Ok(false) => lo = mid,
            }
        }
        Some(Ok(hi))
    }
}

fn host<A: Allocator + Sync>(t: HostTarget<A>, plan: &Plan) -> Result<ReplayReport, String> {
    plan.replay(t)
}

/// The standard allocators for a kind of memory, each made fresh for every replay.
///
/// Host: `Global`, `PinnedAlloc`, `ManagedAlloc` (the process-wide pools: their
/// reservation is not the replay's own, so not reported; without a driver they fall
/// back to pageable memory), `Pool<HostSource>` with and without thread caches (limitable),
/// `Direct<HostSource>`, and with a driver raw `cuMemHostAlloc` (`Direct<PinnedSource>`).
///
/// Device, with a driver: `DevicePool` on each [`Backing`] (`Auto`, `DriverPool`,
/// `PhysicalPages` with each [`PageTuning`] preset, and without the cache), all
/// limitable, the uncached driver pool, raw `cuMemAllocAsync` and raw `cuMemAlloc`;
/// without one, the device pool's
/// cache on the simulated GPU (`SimTarget`, with the `sim` feature; none without it), with
/// and without thread caches.
///
/// ```
/// use cudalloc::trace::{replay::targets, TraceMemory};
/// let names: Vec<String> = targets(TraceMemory::Host).into_iter().map(|t| t.name).collect();
/// assert!(names.iter().any(|n| n == "Global"));
/// ```
pub fn targets(memory: TraceMemory) -> Vec<Target> {
    let gpu = cuda::driver_available();
    let mut v = Vec::new();
    match memory {
        TraceMemory::Host => {
            v.push(Target::new("Global", false, |p, _| {
                host(HostTarget::new("Global", Global), p)
            }));
            let shared = "process-wide pool: its reservation is not the replay's own";
            v.push(Target::new("PinnedAlloc", false, move |p, _| {
                host(HostTarget::new("PinnedAlloc", PinnedAlloc).with_note(shared), p)
            }));
            v.push(Target::new("ManagedAlloc", false, move |p, _| {
                host(HostTarget::new("ManagedAlloc", ManagedAlloc).with_note(shared), p)
            }));
            let pool = |name: &'static str, config: PoolConfig| {
                Target::new(name, true, move |p, limit| {
                    let c = match limit {
                        Some(l) => config.with_limit(l as usize),
                        None => config,
                    };
                    host(
                        HostTarget::new(name, Pool::with_config(HostSource, c))
                            .with_peak_reserved(|p| p.stats().peak_source_bytes as u64),
                        p,
                    )
                })
            };
            v.push(pool("Pool<HostSource>", PoolConfig::default()));
            v.push(pool(
                "Pool<HostSource>, no thread cache",
                PoolConfig::default().with_thread_cache_capacity(0),
            ));
            v.push(Target::new("Direct<HostSource>", false, |p, _| {
                host(HostTarget::new("Direct<HostSource>", Direct::new(HostSource)), p)
            }));
            if gpu {
                v.push(Target::new("raw cuMemHostAlloc", false, |p, _| {
                    host(
                        HostTarget::new(
                            "raw cuMemHostAlloc",
                            Direct::new(PinnedSource::new(HostAllocFlags::DEFAULT)),
                        ),
                        p,
                    )
                }));
            }
        }
        TraceMemory::Device if gpu => {
            let pool = |name: &'static str, config: DevicePoolConfig| {
                Target::new(name, true, move |p, limit| {
                    let c = match limit {
                        Some(l) => config.with_limit(l as usize),
                        None => config,
                    };
                    p.replay(DevicePoolTarget::new(name, 0, c).map_err(|e| e.to_string())?)
                })
            };
            let d = DevicePoolConfig::default();
            let pages = d.with_backing(Backing::PhysicalPages);
            v.push(pool("DevicePool (Auto)", d));
            v.push(pool(
                "DevicePool (DriverPool)",
                d.with_backing(Backing::DriverPool),
            ));
            v.push(pool(
                "DevicePool (PhysicalPages, TIGHT)",
                pages.with_pages(PageTuning::TIGHT),
            ));
            v.push(pool(
                "DevicePool (PhysicalPages, FAST)",
                pages.with_pages(PageTuning::FAST),
            ));
            // The default's page heap without the size-class cache in front: what the
            // cache costs or saves on the trace.
            v.push(pool(
                "DevicePool (PhysicalPages, no cache)",
                pages.with_cache(false),
            ));
            v.push(Target::new("DevicePool::uncached", false, |p, _| {
                p.replay(DevicePoolTarget::uncached("DevicePool::uncached", 0).map_err(|e| e.to_string())?)
            }));
            v.push(Target::new("raw cuMemAllocAsync", false, |p, _| {
                p.replay(RawAsync {
                    streams: Vec::new(),
                    device: 0,
                })
            }));
            v.push(Target::new("raw cuMemAlloc", false, |p, _| {
                p.replay(RawAlloc { device: 0 })
            }));
        }
        #[cfg(any(test, feature = "sim"))]
        TraceMemory::Device => {
            v.push(Target::new("DevicePool (simulated GPU)", false, |p, _| {
                p.replay(SimTarget::new(DevicePoolConfig::default().thread_cache_bytes))
            }));
            v.push(Target::new(
                "DevicePool (simulated GPU, no thread cache)",
                false,
                |p, _| p.replay(SimTarget::new(0)),
            ));
            v.push(Target::new("DevicePool (simulated GPU, pages)", false, |p, _| {
                p.replay(SimTarget::paged(true))
            }));
            v.push(Target::new(
                "DevicePool (simulated GPU, pages, no cache)",
                false,
                |p, _| p.replay(SimTarget::paged(false)),
            ));
            v.push(Target::new(
                "DevicePool::uncached (simulated GPU, driver pool)",
                false,
                |p, _| p.replay(SimTarget::uncached()),
            ));
        }
        #[cfg(not(any(test, feature = "sim")))]
        TraceMemory::Device => {}
    }
    v
}
