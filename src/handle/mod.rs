//! The handles applications put in their collections: `PinnedAlloc`, `ManagedAlloc`
//! and their configurable forms `Pinned` and `Managed`.
//!
//! With a driver, every handle allocates from a process-wide caching [`Pool`](crate::pool::Pool): one per
//! combination of pinned flags (8, sharing one limit: a quarter of physical memory by
//! default, `CUDALLOC_PINNED_LIMIT` or [`PinnedAlloc::set_limit`]) and one per managed
//! attach mode, created on first use. A pool hit costs tens of nanoseconds where a
//! `cuMemHostAlloc` costs about 0.7 ms. For A/B comparisons the uncached allocator is
//! [`Direct`](crate::Direct) over the same source, e.g. `Direct::new(PinnedSource::new(flags))`: one
//! driver call per allocation and per free.
//!
//! Without a driver the default (non-strict) handles fall back to pageable host memory
//! from the system allocator, warn once in the log and count it
//! ([`fallback_allocations`]), so application code runs unchanged on a machine without a
//! GPU. Strict handles return `AllocError` instead. Whether a driver is present is decided
//! once per process, so every block is freed by the same path that allocated it.

use core::ptr::NonNull;
use std::alloc::{GlobalAlloc, System};

use allocator_api2::alloc::{AllocError, Allocator, Layout};

mod pools;
mod sanitizer_exit;

use crate::cuda::{driver_available, HostAllocFlags};
use crate::pool::{Pool, PoolStats};
use crate::source::{HostVisible, ManagedAttach};
use crate::util::{check_physical_memory, dangling_block};
use pools::{
    made_managed_pool, made_pinned_pool, managed_pool, managed_pools, pinned_limit, pinned_pool,
    pinned_pools, set_pinned_limit,
};

/// Number of allocations the default handles served from pageable host memory because
/// no CUDA driver was present.
///
/// ```
/// use allocator_api2::boxed::Box;
/// let before = cudalloc::fallback_allocations();
/// let b = Box::new_in(1u64, cudalloc::PinnedAlloc);
/// let fell_back = cudalloc::fallback_allocations() > before;
/// assert_eq!(fell_back, !cudalloc::cuda::driver_available());
/// # drop(b);
/// ```
pub fn fallback_allocations() -> u64 {
    crate::source::host::fallbacks()
}

#[cold]
#[inline(never)]
fn fallback_allocate<R: Route>(layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
    crate::source::host::warn_fallback(R::KIND);
    check_physical_memory(layout.size())?;
    // The fallback keeps the kind's cap (the pinned cap): code that stays under it without
    // a GPU stays under it with one.
    let budget = R::budget();
    if let Some(b) = budget {
        b.reserve(layout.size()).map_err(|_| AllocError)?;
    }
    // SAFETY: the layout has nonzero size.
    let p = unsafe { System.alloc(layout) };
    match NonNull::new(p) {
        Some(p) => {
            crate::source::host::count_fallback();
            Ok(NonNull::slice_from_raw_parts(p, layout.size()))
        }
        None => {
            if let Some(b) = budget {
                b.release(layout.size());
            }
            Err(AllocError)
        }
    }
}

/// Returns the cached memory of every process-wide pool (pinned and managed) to the
/// driver, first waiting for the GPU uses recorded on freed blocks; returns the bytes
/// released. Blocks parked in other threads' caches stay (they return when those threads
/// exit).
///
/// Under `compute-sanitizer` the crate calls it at exit by itself (the troubleshooting
/// guide says how it knows, and `CUDALLOC_RELEASE_AT_EXIT=1/0` forces it on or off), so
/// `--leak-check full` does not report the blocks the pools keep for reuse as leaked;
/// call it yourself to give cached memory back earlier.
///
/// ```
/// use allocator_api2::vec::Vec;
/// let v: Vec<u8, _> = Vec::with_capacity_in(1 << 20, cudalloc::PinnedAlloc);
/// drop(v);
/// cudalloc::release_cached_memory();
/// assert_eq!(cudalloc::PinnedAlloc::stats().cached_bytes, 0);
/// ```
pub fn release_cached_memory() -> usize {
    pinned_pools().map(Pool::release).sum::<usize>() + managed_pools().map(Pool::release).sum::<usize>()
}

/// Grow or shrink by allocate, copy, free, through `a`.
///
/// # Safety
/// 1. `ptr` was allocated by `a` for `old` and is not used after this call except
///    through the returned block.
unsafe fn resize_by_copy<A: Allocator>(
    a: &A,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
) -> Result<NonNull<[u8]>, AllocError> {
    let block = a.allocate(new)?;
    // SAFETY: obligation 1; the new block is fresh, so distinct, and holds new.size() bytes.
    unsafe { crate::pool::move_block(a, ptr, old, new, block) };
    Ok(block)
}

/// Allocates through `h`'s pool when a driver is present; otherwise fails for a strict
/// handle or falls back to pageable memory. The one routing decision every handle shares.
///
/// The pool exists only where a driver is (it is made by the first allocation that finds
/// one), so its existence is the hot path's one check; the rest is cold.
#[inline]
fn route_allocate<R: Route>(h: R, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
    if layout.size() == 0 {
        // Every allocator answers a zero-size request with a dangling block, strict or
        // not, driver or not: it holds no memory of any kind.
        return Ok(dangling_block(layout));
    }
    match h.made_pool() {
        Some(pool) => pool.allocate(layout),
        None => route_allocate_cold(h, layout),
    }
}

/// The first allocation of a configuration (it makes the pool), or any without a driver.
#[cold]
#[inline(never)]
fn route_allocate_cold<R: Route>(h: R, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
    if driver_available() {
        sanitizer_exit::arm();
        h.pool().allocate(layout)
    } else if h.is_strict() {
        Err(AllocError)
    } else {
        crate::trace::fallback(R::KIND).allocated(layout, fallback_allocate::<R>(layout))
    }
}

/// # Safety
/// 1. `ptr` came from `route_allocate(h, layout)` with a handle of the same configuration.
#[inline]
unsafe fn route_deallocate<R: Route>(h: R, ptr: NonNull<u8>, layout: Layout) {
    if layout.size() == 0 {
        return;
    }
    match h.made_pool() {
        // SAFETY: obligation 1; the pool exists, so a driver does, so the block came from
        // this pool.
        Some(pool) => unsafe { pool.deallocate(ptr, layout) },
        // SAFETY: obligation 1; no pool was made, so there is no driver (with one, the
        // allocation would have made the pool) and the block came from the fallback.
        None => {
            crate::trace::fallback(R::KIND).free(ptr.as_ptr(), layout.size(), true);
            // SAFETY: as above.
            unsafe { fallback_deallocate::<R>(ptr, layout) }
        }
    }
}

/// # Safety
/// 1. `ptr` came from `handle`'s allocation for `old` (routed as `h`) and is not used
///    after this call except through the returned block.
#[inline]
unsafe fn route_resize<R: Route, A: Allocator>(
    h: R,
    handle: &A,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
    zeroed: bool,
) -> Result<NonNull<[u8]>, AllocError> {
    // A zero-size block was never the pool's (nor the fallback's): allocate afresh.
    let block = if old.size() == 0 {
        handle.allocate(new)?
    } else if new.size() == 0 {
        // SAFETY: obligation 1: the block is freed here and not used again.
        unsafe { handle.deallocate(ptr, old) };
        return Ok(dangling_block(new));
    } else if let Some(pool) = h.made_pool() {
        // SAFETY: obligation 1 (the block, not empty, came from the pool, which exists);
        // the pool picks grow or shrink by the sizes (in place when
        // it can, which a handle's own allocate + copy would miss).
        unsafe {
            if new.size() >= old.size() {
                pool.grow(ptr, old, new)?
            } else {
                pool.shrink(ptr, old, new)?
            }
        }
    } else {
        // SAFETY: obligation 1.
        unsafe { resize_by_copy(handle, ptr, old, new)? }
    };
    if zeroed {
        // SAFETY: the block holds block.len() >= new.size() >= old.size() bytes (a grow).
        unsafe { crate::pool::zero_tail(block, old.size()) };
    }
    Ok(block)
}

/// Adds the no-driver fallback count to a snapshot of pool statistics.
fn with_fallbacks(mut s: PoolStats) -> PoolStats {
    s.fallbacks = fallback_allocations();
    s
}

/// # Safety
/// 1. `ptr` came from `fallback_allocate::<R>(layout)`.
unsafe fn fallback_deallocate<R: Route>(ptr: NonNull<u8>, layout: Layout) {
    if layout.size() != 0 {
        // SAFETY: obligation 1: System allocated it with this layout.
        unsafe { System.dealloc(ptr.as_ptr(), layout) }
        if let Some(b) = R::budget() {
            b.release(layout.size());
        }
    }
}

/// Pinned (page-locked) host memory with the default flags: the zero-sized handle for
/// `Vec`, `Box` and `HashMap`. Copies between pinned memory and the GPU run at full PCIe
/// speed (about 55 GB/s on the H200 machine against 7-17 GB/s for pageable memory).
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::PinnedAlloc;
/// let mut staging: Vec<f32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
/// staging.extend_from_slice(&[1.0, 2.0, 3.0]);
/// assert_eq!(staging.len(), 3);
/// ```
///
/// Without a driver it falls back to pageable memory; [`PinnedAlloc::strict`] does not.
///
/// ## In cudarc's copies
///
/// Do not hand a `Vec<T, PinnedAlloc>` to cudarc as a plain `&[T]` / `&mut [T]`. cudarc
/// takes every plain slice for pageable memory and never waits, but the driver copies
/// pinned memory truly asynchronously: `memcpy_htod(&v[..], ..)` returns before the copy
/// has read `v` (the device gets what the host writes afterwards), and if `v` is dropped
/// the pool may hand its block to a new owner while the DMA still reads it, or, for
/// `memcpy_dtoh`, still writes it: corrupted data, reachable from safe code. With the
/// `cudarc` feature, wrap it: `PinnedView` keeps the copy asynchronous and the block from
/// reuse until the copy is done, and `PinnedViewMut` makes a copy into it complete before
/// cudarc returns (`PinnedViewMut::new_async`, unsafe, keeps it asynchronous).
#[cfg_attr(
    feature = "cudarc",
    doc = r#"
```
use allocator_api2::vec::Vec;
use cudalloc::{cuda::Stream, device::DevicePool, PinnedAlloc, PinnedView, PinnedViewMut};
if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
    let cs = stream.cudarc();
    let mut v: Vec<u32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    v.extend(0..256);
    let mut dev = pool.alloc::<u32>(256, &stream).unwrap();
    cs.memcpy_htod(&PinnedView::new(&v).unwrap(), &mut dev).unwrap(); // not &v[..]
    drop(v); // safe at once
    let mut back: Vec<u32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    back.resize(256, 0);
    cs.memcpy_dtoh(&dev, &mut PinnedViewMut::new(&mut back).unwrap()).unwrap();
    assert_eq!(back[255], 255);
}
```
"#
)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PinnedAlloc;

impl PinnedAlloc {
    /// A handle allocating with `flags` (portable, mapped, write-combined).
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{cuda::HostAllocFlags, PinnedAlloc};
    /// let zero_copy = PinnedAlloc::with_flags(HostAllocFlags::DEVICE_MAP | HostAllocFlags::PORTABLE);
    /// let v: Vec<u8, _> = Vec::with_capacity_in(1024, zero_copy);
    /// assert!(v.capacity() >= 1024);
    /// ```
    pub const fn with_flags(flags: HostAllocFlags) -> Pinned {
        Pinned { flags, strict: false }
    }

    /// A handle that returns `AllocError` when there is no driver instead of falling back.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// let v: Result<Vec<u8, _>, _> = {
    ///     let mut v = Vec::new_in(cudalloc::PinnedAlloc::strict());
    ///     v.try_reserve(16).map(|_| v)
    /// };
    /// assert_eq!(v.is_ok(), cudalloc::cuda::driver_available());
    /// ```
    pub const fn strict() -> Pinned {
        Pinned {
            flags: HostAllocFlags::DEFAULT,
            strict: true,
        }
    }

    /// Statistics of the process-wide pinned pools, all flag combinations together (the
    /// limit is their shared one), with the process's no-driver fallbacks
    /// ([`fallback_allocations`], pinned and managed).
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::PinnedAlloc;
    /// let v: Vec<u8, _> = Vec::with_capacity_in(4096, PinnedAlloc);
    /// let s = PinnedAlloc::stats();
    /// if cudalloc::cuda::driver_available() {
    ///     assert!(s.live_bytes >= 4096);
    /// } else {
    ///     assert!(s.fallbacks >= 1);
    /// }
    /// println!("{s}");
    /// # drop(v);
    /// ```
    pub fn stats() -> PoolStats {
        let mut s = pinned_pools().fold(PoolStats::default(), |acc, p| acc.combine(&p.stats()));
        s.limit = pinned_limit();
        with_fallbacks(s)
    }

    /// Returns the cached memory of the process-wide pinned pools to the driver (see
    /// [`Pool::trim`](crate::pool::Pool::trim)); returns the bytes released.
    pub fn trim() -> usize {
        pinned_pools().map(|p| p.trim()).sum()
    }

    /// The cap on pinned bytes the process-wide pinned pools hold together (`None`: no
    /// cap). Pinned memory is a scarce system resource: page-locked memory cannot be
    /// swapped, and pinning too much slows the whole machine.
    pub fn limit() -> Option<usize> {
        pinned_limit()
    }

    /// Sets the cap on pinned bytes the process-wide pinned pools hold together (`None`:
    /// no cap). It is process-wide, like the pools: every `PinnedAlloc` and `Pinned` handle
    /// shares it. The default is `CUDALLOC_PINNED_LIMIT` (a byte count,
    /// like `8G`, or `none`), else a quarter of physical memory. An allocation past it
    /// trims the caches, retries, waits for blocks still used by the GPU (up to 10 s), and
    /// then fails with `AllocError`.
    ///
    /// ```
    /// use cudalloc::PinnedAlloc;
    /// let before = PinnedAlloc::limit();
    /// PinnedAlloc::set_limit(Some(1 << 30));
    /// assert_eq!(PinnedAlloc::limit(), Some(1 << 30));
    /// PinnedAlloc::set_limit(before);
    /// ```
    pub fn set_limit(bytes: Option<usize>) {
        set_pinned_limit(bytes)
    }
}

/// A pinned-memory handle with chosen flags and fallback behaviour; made by
/// [`PinnedAlloc::with_flags`] and [`PinnedAlloc::strict`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pinned {
    flags: HostAllocFlags,
    strict: bool,
}

impl Pinned {
    /// This handle, made strict: no fallback without a driver.
    pub const fn strict(self) -> Self {
        Self { strict: true, ..self }
    }

    /// The `cuMemHostAlloc` flags.
    pub const fn flags(&self) -> HostAllocFlags {
        self.flags
    }

    /// Whether the handle refuses to fall back to pageable memory.
    pub const fn is_strict(&self) -> bool {
        self.strict
    }

    /// Statistics of the one process-wide pool for this handle's flags (zero if it was
    /// never used), with the no-driver fallbacks. [`PinnedAlloc::stats`] sums every
    /// pinned pool.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{cuda::HostAllocFlags, PinnedAlloc};
    /// let portable = PinnedAlloc::with_flags(HostAllocFlags::PORTABLE);
    /// let v: Vec<u8, _> = Vec::with_capacity_in(100, portable);
    /// if cudalloc::cuda::driver_available() {
    ///     assert_eq!(portable.pool_stats().live_blocks, 1);
    /// }
    /// # drop(v);
    /// ```
    pub fn pool_stats(&self) -> PoolStats {
        let s = pinned_pools()
            .find(|p| p.source().flags() == self.flags)
            .map_or_else(
                || PoolStats {
                    limit: pinned_limit(),
                    ..PoolStats::default()
                },
                |p| p.stats(),
            );
        with_fallbacks(s)
    }
}

const PINNED_DEFAULT: Pinned = Pinned {
    flags: HostAllocFlags::DEFAULT,
    strict: false,
};

/// Managed (unified) memory: the zero-sized handle. The host and every device address it
/// at the same pointer; pages migrate on demand or by [`crate::source::prefetch`].
///
/// ```
/// use allocator_api2::boxed::Box;
/// use cudalloc::ManagedAlloc;
/// let b = Box::new_in([0u32; 256], ManagedAlloc);
/// assert_eq!(b.len(), 256);
/// ```
///
/// The crate never holds more managed memory than 90% of the device's memory: managed
/// memory beyond what the device can hold can hang the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ManagedAlloc;

impl ManagedAlloc {
    /// A handle attaching new blocks as `attach` says.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{source::ManagedAttach, ManagedAlloc};
    /// let v: Vec<u8, _> = Vec::with_capacity_in(64, ManagedAlloc::with_attach(ManagedAttach::Host));
    /// # drop(v);
    /// ```
    pub const fn with_attach(attach: ManagedAttach) -> Managed {
        Managed {
            attach,
            strict: false,
        }
    }

    /// A handle that returns `AllocError` when there is no driver instead of falling back.
    pub const fn strict() -> Managed {
        Managed {
            attach: ManagedAttach::Global,
            strict: true,
        }
    }

    /// Statistics of the process-wide managed pools (both attach modes together), with
    /// the process's no-driver fallbacks.
    ///
    /// ```
    /// let s = cudalloc::ManagedAlloc::stats();
    /// assert_eq!(s.live_bytes + s.cached_bytes + s.pending_bytes >= s.live_bytes, true);
    /// ```
    pub fn stats() -> PoolStats {
        let mut s = managed_pools().fold(PoolStats::default(), |acc, p| acc.combine(&p.stats()));
        s.limit = None;
        with_fallbacks(s)
    }

    /// Returns the cached memory of the process-wide managed pools to the driver; returns
    /// the bytes released.
    pub fn trim() -> usize {
        managed_pools().map(|p| p.trim()).sum()
    }
}

/// A managed-memory handle with chosen attachment and fallback behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Managed {
    attach: ManagedAttach,
    strict: bool,
}

impl Managed {
    /// This handle, made strict: no fallback without a driver.
    pub const fn strict(self) -> Self {
        Self { strict: true, ..self }
    }

    /// Whether the handle refuses to fall back to pageable memory.
    pub const fn is_strict(&self) -> bool {
        self.strict
    }

    /// How new blocks are attached.
    pub const fn attach(&self) -> ManagedAttach {
        self.attach
    }

    /// Statistics of the one process-wide pool for this handle's attach mode, with the
    /// no-driver fallbacks. [`ManagedAlloc::stats`] sums both managed pools.
    pub fn pool_stats(&self) -> PoolStats {
        let s = managed_pools()
            .find(|p| p.source() == &crate::source::ManagedSource::new(self.attach))
            .map_or_else(PoolStats::default, |p| p.stats());
        with_fallbacks(s)
    }
}

impl PinnedAlloc {
    /// Allocates a block for `layout` from the process-wide pinned pool, waiting without
    /// a thread where the pool is at the pinned cap with freed blocks the GPU still uses
    /// (see [`Pool::allocate_async`](crate::pool::Pool::allocate_async); the `Allocator`
    /// path waits up to 10 s on the thread instead). Without a driver the block comes from
    /// the fallback at once, as [`Allocator::allocate`] does. Free it with
    /// `Allocator::deallocate(&PinnedAlloc, ..)`.
    ///
    /// ```
    /// use allocator_api2::alloc::{Allocator, Layout};
    /// use cudalloc::PinnedAlloc;
    /// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     use std::task::{Context, Poll, Wake, Waker};
    /// #     struct T(std::thread::Thread);
    /// #     impl Wake for T { fn wake(self: std::sync::Arc<Self>) { self.0.unpark() } }
    /// #     let waker = Waker::from(std::sync::Arc::new(T(std::thread::current())));
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop {
    /// #         if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) { return v; }
    /// #         std::thread::park();
    /// #     }
    /// # }
    /// let layout = Layout::from_size_align(1 << 20, 64).unwrap();
    /// // In async code: `PinnedAlloc::allocate_async(layout).await?`
    /// let block = block_on(PinnedAlloc::allocate_async(layout)).unwrap();
    /// assert!(block.len() >= 1 << 20);
    /// // SAFETY: allocated above with `layout` from the default pinned handle.
    /// unsafe { PinnedAlloc.deallocate(block.cast(), layout) };
    /// ```
    pub fn allocate_async(layout: Layout) -> PinnedAllocate {
        if layout.size() != 0 && driver_available() {
            sanitizer_exit::arm();
            return PinnedAllocate(AllocateRoute::Pool(PINNED_DEFAULT.pool().allocate_async(layout)));
        }
        let out = route_allocate(PINNED_DEFAULT, layout).map_err(|AllocError| crate::Error::OutOfMemory {
            requested: layout.size(),
        });
        PinnedAllocate(AllocateRoute::Ready(Some(out)))
    }
}

/// The future of [`PinnedAlloc::allocate_async`].
#[must_use = "a future does nothing unless awaited or polled"]
#[derive(Debug)]
pub struct PinnedAllocate(AllocateRoute);

#[derive(Debug)]
enum AllocateRoute {
    Pool(crate::pool::AllocateAsync<'static, crate::source::PinnedPoolSource>),
    Ready(Option<crate::Result<NonNull<[u8]>>>),
}

impl core::future::Future for PinnedAllocate {
    type Output = crate::Result<NonNull<[u8]>>;
    fn poll(
        self: core::pin::Pin<&mut Self>,
        cx: &mut core::task::Context<'_>,
    ) -> core::task::Poll<Self::Output> {
        match &mut self.get_mut().0 {
            AllocateRoute::Pool(f) => core::pin::Pin::new(f).poll(cx),
            AllocateRoute::Ready(out) => core::task::Poll::Ready(
                out.take()
                    .unwrap_or(Err(crate::Error::InvalidArgument("polled after it completed"))),
            ),
        }
    }
}

const MANAGED_DEFAULT: Managed = Managed {
    attach: ManagedAttach::Global,
    strict: false,
};

/// What a configured handle routes to: its process-wide pool, whether it is strict, and
/// the memory kind named in the no-driver warning.
trait Route: Copy {
    type Source: HostVisible + 'static;
    const KIND: &'static str;
    /// The pool, made on first use (only where a driver is).
    fn pool(self) -> &'static Pool<Self::Source>;
    /// The pool if it was made.
    fn made_pool(self) -> Option<&'static Pool<Self::Source>>;
    fn is_strict(self) -> bool;
    /// The cap the kind's memory counts against, which the no-driver fallback keeps too.
    fn budget() -> Option<&'static crate::budget::Budget>;
}

impl Route for Pinned {
    type Source = crate::source::PinnedPoolSource;
    const KIND: &'static str = "pinned";
    #[inline]
    fn pool(self) -> &'static Pool<Self::Source> {
        pinned_pool(self.flags)
    }
    #[inline]
    fn made_pool(self) -> Option<&'static Pool<Self::Source>> {
        made_pinned_pool(self.flags)
    }
    #[inline]
    fn is_strict(self) -> bool {
        self.strict
    }
    fn budget() -> Option<&'static crate::budget::Budget> {
        Some(pools::pinned_budget())
    }
}

impl Route for Managed {
    type Source = crate::source::ManagedSource;
    const KIND: &'static str = "managed";
    #[inline]
    fn pool(self) -> &'static Pool<Self::Source> {
        managed_pool(self.attach)
    }
    #[inline]
    fn made_pool(self) -> Option<&'static Pool<Self::Source>> {
        made_managed_pool(self.attach)
    }
    #[inline]
    fn is_strict(self) -> bool {
        self.strict
    }
    fn budget() -> Option<&'static crate::budget::Budget> {
        // Managed memory is capped by what the device holds: without a driver there is
        // no device, and the fallback is plain host memory.
        None
    }
}

macro_rules! forward_allocator {
    ($handle:ty, $to:expr) => {
        // SAFETY: routes to the configured handle's process-wide pool (blocks exclusive,
        // host-visible, of the requested layout) or, without a driver, to the fallback;
        // every copy of the handle frees blocks by the same path (chosen by the
        // per-process driver check) and through the same pool (a pure function of the
        // configuration).
        unsafe impl Allocator for $handle {
            #[inline]
            fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
                route_allocate(($to)(self), layout)
            }
            #[inline]
            unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: the caller passes a block this handle allocated, so routed the
                // same way.
                unsafe { route_deallocate(($to)(self), ptr, layout) }
            }
            forward_allocator!(@resize $to; grow(false), grow_zeroed(true), shrink(false));
        }
    };
    // The resizing methods: each routes by the sizes (zeroing the grown tail if asked).
    (@resize $to:expr; $($method:ident($zeroed:literal)),*) => {$(
        #[inline]
        unsafe fn $method(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
            // SAFETY: the caller passes a block this handle allocated with `old`.
            unsafe { route_resize(($to)(self), self, ptr, old, new, $zeroed) }
        }
    )*};
}

forward_allocator!(PinnedAlloc, |_: &PinnedAlloc| PINNED_DEFAULT);
forward_allocator!(Pinned, |h: &Pinned| *h);
forward_allocator!(ManagedAlloc, |_: &ManagedAlloc| MANAGED_DEFAULT);
forward_allocator!(Managed, |h: &Managed| *h);
