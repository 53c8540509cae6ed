//! The hot path of a device pool, and what a buffer owns: this thread's cache for the
//! pool (an entry of a thread-local [`SlotTable`]), the allocation hit and the free into
//! it, and [`Owned`], the block with its stream and pool handles that a buffer holds and
//! gives back on drop.
//!
//! Generic over the pool handle type ([`PoolHandle`]) so that the simulated pool of
//! `sim.rs` (CPU tests and the `device_hit_sim` benchmark) runs this very code on the
//! simulated GPU of `device/fake/`: [`DevicePool`](super::DevicePool) and the simulation
//! differ only in their backend and in the thread-local table each declares.

use core::mem::ManuallyDrop;
use core::ptr::NonNull;

use super::backend::Backend;
use super::cache::Cache;
use super::order::StreamOrder;
use super::size_class::{class_size, round_to_granule};
use super::thread_cache::ThreadCache;
use crate::cuda::{nvtx, StreamId};
use crate::observe;
use crate::slot_table::{SlotBits, SlotEntry, SlotTable};
use crate::sync::global::{AtomicBool, AtomicU64 as GlobalU64, AtomicUsize, Ordering as GlobalOrdering};
use crate::trace::{Code, Note};

/// The stream handle type of a pool handle's backend.
pub(crate) type StreamOf<P> = <<P as PoolHandle>::B as StreamOrder>::Stream;

/// A cheap, cloneable handle of a pool (an `Arc` inside), as buffers own one: the
/// internal handle, whose clones and drops do not count as users (`Core::users`). Its
/// drop tries the collection of a closed pool (`close.rs`).
pub(crate) trait PoolHandle: Clone + Send + Sync + 'static {
    /// What the pool allocates from.
    type B: Backend;
    /// A handle that does not keep the pool (a thread's table entry holds one).
    type Weak: Send + Sync;
    /// The pool's shared state.
    fn core(&self) -> &Core<Self::B>;
    /// A weak handle of the pool.
    fn downgrade(&self) -> Self::Weak;
    /// A handle of the pool of `w`, if it lives.
    fn upgrade(w: &Self::Weak) -> Option<Self>;
    /// The handles of the pool (the `Arc`'s strong count; `Relaxed`).
    fn strong_count(&self) -> usize;
    /// After a push into this thread's bin, the thread's reclaim flag was up:
    /// `close::after_push` (the handle types name it, so that this module, below
    /// `close.rs`, does not).
    fn after_push(entry: NonNull<LocalCache<Self>>);
    /// Gives up this handle's reference (the `Arc`'s drop): `close::drop_handle`, from
    /// the handle type's `Drop`, decides when.
    ///
    /// # Safety
    /// 1. Called once, by the handle's drop; the handle is not used afterwards.
    unsafe fn release_ref(&mut self);
    /// Runs `f` with this thread's table of caches of pools of this type; `None` while the
    /// thread's locals are being destroyed. Publishes the table for [`PoolHandle::hot_entry`].
    fn with_table<R>(f: impl FnOnce(&SlotTable<LocalCache<Self>>) -> R) -> Option<R>;
    /// The hot path's way to this thread's entry of pool `uid` in `slot`
    /// ([`SlotTable::entry_ptr`]): through the table's hot pointer where the handle type
    /// has one (`SlotTable::hot_entry_ptr`), so that the hit makes no call; `None` as well
    /// before a slow path of this thread published the table.
    #[inline(always)]
    fn hot_entry(slot: usize, uid: u64) -> Option<NonNull<LocalCache<Self>>> {
        Self::with_table(|t| t.entry_ptr(slot, uid)).flatten()
    }
    /// The slots of pools of this type in their tables.
    fn slots() -> &'static SlotBits;
    /// Whether the hot path describes blocks to an attached NVTX tool (its one branch,
    /// `nvtx::on()`, compiled in). Only the simulator's bare pool says no: it measures
    /// what that branch costs in the same process (issue 24).
    const NVTX: bool = true;
}

static NEXT_UID: GlobalU64 = GlobalU64::new(1);

/// A pool's shared state: its cache, where this pool's thread caches are found, and
/// what its collection needs (`close.rs`).
pub(crate) struct Core<B: Backend> {
    pub(crate) cache: Cache<B>,
    /// The user handles (the public handle type's clones; 1 at the start). At 0 the pool
    /// is closed and collected once no internal handle is left outside the bins.
    pub(crate) users: AtomicUsize,
    /// Whether a collection took the threads' blocks (after which none is tried again).
    pub(crate) collected: AtomicBool,
    /// Internal handles being dropped without the registry's lock (`close::drop_handle`).
    pub(crate) dropping: AtomicUsize,
    /// Process-unique, to tell this pool's thread-cache entries from others'.
    pub(crate) uid: u64,
    /// The pool's slot in the thread-local tables (`None`: no thread caches).
    pub(crate) slot: Option<usize>,
    /// Where the slot goes back when the pool goes.
    slots: &'static SlotBits,
}

impl<B: Backend> Core<B> {
    /// The state of a new pool of handle type `P` around `cache`.
    pub(crate) fn new<P: PoolHandle<B = B>>(cache: Cache<B>) -> Self {
        let slots = P::slots();
        let slot = cache.settings.thread_max_class.and_then(|_| slots.acquire());
        Self {
            cache,
            users: AtomicUsize::new(1),
            collected: AtomicBool::new(false),
            dropping: AtomicUsize::new(0),
            uid: NEXT_UID.fetch_add(1, GlobalOrdering::Relaxed),
            slot,
            slots,
        }
    }
}

impl<B: Backend> Drop for Core<B> {
    fn drop(&mut self) {
        // No thread holds an entry of this pool any more: entries hold a pool handle.
        if let Some(slot) = self.slot {
            self.slots.release(slot);
        }
    }
}

/// One thread's cache for one pool, with a weak handle of the pool it flushes into (the
/// blocks in its bins hold strong ones; a collection takes them, `close.rs`).
pub(crate) struct LocalCache<P: PoolHandle> {
    uid: u64,
    pub(crate) cache: ThreadCache<P::B, P>,
    pub(crate) owner: P::Weak,
}

impl<P: PoolHandle> SlotEntry for LocalCache<P> {
    #[inline(always)]
    fn uid(&self) -> u64 {
        self.uid
    }
}

/// This thread's cache of the pool of `uid` in `slot`, as a pointer: its entry is boxed
/// and stays in the thread-local table until a slow path of this thread takes it out
/// (`with_thread_cache`) or the thread exits, so the hot path may use it for the length of
/// a call that reaches the table in no other way.
#[inline(always)]
fn local_cache<P: PoolHandle>(slot: usize, uid: u64) -> Option<NonNull<LocalCache<P>>> {
    P::hot_entry(slot, uid)
}

/// The allocation hit: a block of the class of `bytes` (nonzero) freed on `stream`, from
/// this thread's bin, owned with the handles of the buffer that freed it (recycled) or
/// clones. `None` on a miss.
#[inline(always)]
pub(crate) fn try_alloc_fast<P: PoolHandle>(
    pool: &P,
    bytes: usize,
    stream: &StreamOf<P>,
) -> Option<Owned<P>> {
    let core = pool.core();
    let slot = core.slot?;
    let Some(class) = core.cache.class_for(bytes) else {
        return try_alloc_large(pool, bytes, stream);
    };
    let id = P::B::stream_id(stream);
    let mut e = local_cache::<P>(slot, core.uid)?;
    // SAFETY: the entry is this thread's and stays in its table during this call (see
    // `local_cache`); this is the only reference to it, and `pop` does not reach the
    // table (it moves a block and its handles out of the cache, dropping nothing).
    let (ptr, handles) = unsafe { e.as_mut() }.cache.pop(id, class)?;
    Some(hit(pool, stream, bytes, (ptr, class), handles))
}

/// What a hit hands out: the block `(ptr, class)` owned with the handles it was freed
/// with (recycled) or clones; its allocation recorded (trace, NVTX).
#[inline(always)]
fn hit<P: PoolHandle>(
    pool: &P,
    stream: &StreamOf<P>,
    bytes: usize,
    (ptr, class): (u64, usize),
    handles: Option<(StreamOf<P>, P)>,
) -> Owned<P> {
    // One branch for the recorder and an NVTX tool together (`observe`).
    if observe::wanted(observed::<P>()) {
        observe_hit(pool, stream, bytes, (ptr, class));
    }
    let (stream, pool) = match handles {
        Some(h) => h,
        None => (stream.clone(), pool.clone()),
    };
    Owned::with_class(ptr, class, stream, pool)
}

/// What may watch a pool of type `P`'s hot path: the recorder, and an NVTX tool unless
/// `P` compiles the annotations out (the simulator's bare pool).
#[inline(always)]
const fn observed<P: PoolHandle>() -> usize {
    observe::TRACE | if P::NVTX { observe::NVTX } else { 0 }
}

/// A hit seen by the recorder (the block's size given as the cache holds it) and by an
/// NVTX tool (a live region of exactly the request), whichever is on.
#[cold]
#[inline(never)]
fn observe_hit<P: PoolHandle>(pool: &P, stream: &StreamOf<P>, bytes: usize, (ptr, class): (u64, usize)) {
    pool.core().cache.backend.trace().event(|| Note {
        given: match class {
            LARGE => round_to_granule(bytes).unwrap_or(bytes),
            c => class_size(c),
        },
        ..alloc_note(ptr, bytes, P::B::stream_id(stream))
    });
    if P::NVTX && nvtx::on() {
        nvtx::region_register(ptr, bytes);
    }
}

/// The allocation hit of a large block (not cached by class): one of the same block size
/// freed on `stream`, from this thread's large slots. `None` on a miss.
#[inline(always)]
fn try_alloc_large<P: PoolHandle>(pool: &P, bytes: usize, stream: &StreamOf<P>) -> Option<Owned<P>> {
    let core = pool.core();
    let slot = core.slot?;
    let rounded = round_to_granule(bytes)?;
    if !core.cache.is_large(rounded) {
        return None;
    }
    let id = P::B::stream_id(stream);
    let mut e = local_cache::<P>(slot, core.uid)?;
    // SAFETY: as in `try_alloc_fast`: the entry stays in its table during this call, this
    // is the only reference to it, and `pop_large` drops nothing.
    let (ptr, handles) = unsafe { e.as_mut() }.cache.pop_large(id, rounded)?;
    Some(hit(pool, stream, bytes, (ptr, LARGE), handles))
}

/// The allocation slow path: a block for `bytes` (nonzero) on `stream`, through this
/// thread's cache (made if needed) and the shared cache.
#[cold]
#[inline(never)]
pub(crate) fn alloc_slow<P: PoolHandle>(
    pool: &P,
    bytes: usize,
    stream: &StreamOf<P>,
) -> crate::Result<Owned<P>> {
    let cache = &pool.core().cache;
    let ptr = with_thread_cache(pool, |tc| cache.alloc_slow(tc, bytes, stream))?;
    let class = match cache.class_for(bytes) {
        Some(c) => c,
        None if round_to_granule(bytes).is_some_and(|b| cache.is_large(b)) => LARGE,
        None => NOT_CACHED,
    };
    cache.backend.trace().event(|| Note {
        given: cache.block_bytes(bytes).unwrap_or(bytes),
        ..alloc_note(ptr, bytes, P::B::stream_id(stream))
    });
    if P::NVTX && nvtx::on() {
        nvtx::region_register(ptr, bytes);
    }
    Ok(Owned::with_class(ptr, class, stream.clone(), pool.clone()))
}

/// The alignment of every device block: classes and granules are multiples of 256 bytes,
/// and the driver's and the page heap's blocks start at such multiples.
pub(crate) const BLOCK_ALIGN: usize = 256;

/// An allocation's event (`given` set by the caller).
#[inline(always)]
fn alloc_note(ptr: u64, bytes: usize, stream: StreamId) -> Note<'static> {
    Note {
        action: Code::Alloc,
        addr: ptr as usize,
        size: bytes,
        given: bytes,
        align: BLOCK_ALIGN,
        stream: stream.get(),
        error: None,
    }
}

/// Records an allocation of `bytes` on `stream` that failed with `e`: a `Failure` with
/// its message, and for an out-of-memory error an `OutOfMemory` event, which writes the
/// `CUDALLOC_TRACE` file at once.
#[cold]
#[inline(never)]
pub(crate) fn record_failure<P: PoolHandle>(pool: &P, bytes: usize, stream: &StreamOf<P>, e: &crate::Error) {
    let trace = pool.core().cache.backend.trace();
    let stream = P::B::stream_id(stream).get();
    let note = Note {
        action: Code::Failure,
        addr: 0,
        size: bytes,
        given: 0,
        align: BLOCK_ALIGN,
        stream,
        error: Some(e),
    };
    trace.event(|| note);
    if e.is_out_of_memory() {
        trace.event(|| Note {
            action: Code::OutOfMemory,
            error: None,
            ..note
        });
    }
}

/// Runs `f` with this thread's cache for `pool` (made if needed; `None` if the pool has
/// none or the thread's locals are gone). The cache is out of the thread-local table
/// meanwhile, so `f` may take long, call CUDA and drop handles. The crate's bookkeeping
/// (`count::bookkeeping`): the thread's cache made here lives as long as the thread, and
/// the pool's lists grow here, so a leak check's window does not count them.
pub(crate) fn with_thread_cache<P: PoolHandle, R>(
    pool: &P,
    f: impl FnOnce(Option<&mut ThreadCache<P::B, P>>) -> R,
) -> R {
    crate::count::bookkeeping(|| {
        let core = pool.core();
        let Some(slot) = core.slot else {
            return f(None);
        };
        let uid = core.uid;
        let mut entry = P::with_table(|t| t.take(slot, uid)).flatten().or_else(|| {
            let cache = core.cache.new_thread_cache()?;
            let mut e = Box::new(LocalCache {
                uid,
                cache,
                owner: pool.downgrade(),
            });
            // Boxed: the cache stays at this address until the entry is dropped.
            let at: *mut ThreadCache<P::B, P> = &mut e.cache;
            e.cache
                .stats()
                .cache
                .store(at.cast(), crate::sync::Ordering::Release);
            Some(e)
        });
        let r = f(entry.as_deref_mut().map(|e| &mut e.cache));
        if let Some(e) = entry {
            // Dropped after the table is released: dropping an entry flushes it into a pool.
            let mut e = Some(e);
            let displaced = P::with_table(|t| t.replace(slot, e.take()));
            drop(displaced);
            drop(e); // the thread's locals are being destroyed: flushed now
        }
        r
    })
}

/// The class of a block that no thread cache holds (too large to cache, or empty).
const NOT_CACHED: usize = usize::MAX;
/// The class of a large block: not cached by class, kept in the thread caches' large
/// slots for reuse at the same size.
const LARGE: usize = usize::MAX - 1;

/// A block a buffer owns: its address and size class, the handles of its stream and its
/// pool (taken by [`release`](Self::release), which hands them to the pool's cache with
/// the block, so a steady allocate/free cycle never touches a reference count), and the
/// other streams that use it. Five words: the uses are boxed, since few buffers have any.
pub(crate) struct Owned<P: PoolHandle> {
    ptr: u64,
    /// The class the block serves in its pool ([`NOT_CACHED`]: none), so that the free
    /// need not compute it again.
    class: usize,
    stream: ManuallyDrop<StreamOf<P>>,
    pool: ManuallyDrop<P>,
    /// Other streams whose work uses the block (`record_use`). Boxed: one word in every
    /// buffer rather than a `Vec`'s three, since few buffers record uses. In a
    /// `ManuallyDrop` like the handles, so that `Owned` has no drop glue and a buffer's
    /// drop is its `release` alone, small enough to inline at every drop site.
    #[allow(clippy::box_collection)]
    uses: ManuallyDrop<Option<Box<Vec<StreamOf<P>>>>>,
}

impl<P: PoolHandle> Owned<P> {
    /// Owns an empty buffer (no block) with its handles.
    pub(crate) fn empty(stream: StreamOf<P>, pool: P) -> Self {
        Self::with_class(0, NOT_CACHED, stream, pool)
    }

    #[inline(always)]
    fn with_class(ptr: u64, class: usize, stream: StreamOf<P>, pool: P) -> Self {
        Self {
            ptr,
            class,
            stream: ManuallyDrop::new(stream),
            pool: ManuallyDrop::new(pool),
            uses: ManuallyDrop::new(None),
        }
    }

    #[inline(always)]
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// A reference to the address, for APIs that read a kernel argument at launch.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn ptr_ref(&self) -> &u64 {
        &self.ptr
    }

    #[inline(always)]
    pub(crate) fn stream(&self) -> &StreamOf<P> {
        &self.stream
    }

    #[inline(always)]
    pub(crate) fn pool(&self) -> &P {
        &self.pool
    }

    /// The streams recorded as using the block.
    pub(crate) fn uses(&self) -> &[StreamOf<P>] {
        self.uses.as_deref().map_or(&[], Vec::as_slice)
    }

    /// Records that work queued on `stream` uses the block (nothing for an empty buffer
    /// or the block's own stream; once per stream).
    pub(crate) fn record_use(&mut self, stream: &StreamOf<P>) {
        let id = P::B::stream_id(stream);
        if self.ptr == 0
            || id == P::B::stream_id(&self.stream)
            || self.uses().iter().any(|u| P::B::stream_id(u) == id)
        {
            return;
        }
        self.uses.get_or_insert_with(Box::default).push(stream.clone());
    }

    /// Gives the block of `bytes` (what the buffer asked for) back to its pool, with the
    /// handles: into this thread's bin for its stream and class when there is room and no
    /// other stream used it, else through the slow path.
    ///
    /// # Safety
    /// 1. Called once, from the owner's drop: nothing of `self` is used afterwards (the
    ///    handles are moved out of their `ManuallyDrop`s).
    #[inline(always)]
    pub(crate) unsafe fn release(&mut self, bytes: usize) {
        // SAFETY: obligation 1: the handles and the uses are taken once and never touched
        // again.
        let (stream, pool, uses) = unsafe {
            (
                ManuallyDrop::take(&mut self.stream),
                ManuallyDrop::take(&mut self.pool),
                ManuallyDrop::take(&mut self.uses),
            )
        };
        release_parts((self.ptr, self.class), bytes, stream, pool, uses);
    }
}

/// [`Owned::release`] with the buffer's fields passed by value, out of line: a buffer's
/// drop is then a call small enough for the compiler to inline at every drop site, so a
/// buffer moved out of a `Result` (`?`, `expect`) is never copied through memory for an
/// out-of-line drop to read. (That copy read each 16 bytes that two 8-byte stores had
/// just written, which the CPU cannot forward from its store buffer: about 10 ns a pair.)
#[inline(never)]
#[allow(clippy::box_collection)]
fn release_parts<P: PoolHandle>(
    (ptr, class): (u64, usize),
    bytes: usize,
    stream: StreamOf<P>,
    pool: P,
    uses: Option<Box<Vec<StreamOf<P>>>>,
) {
    // Seen before the block goes anywhere (another thread may take it at once). Every
    // call on this path is a tail call, so that the common case keeps its values in
    // registers and saves none (the observed free, the stream search, the slow path and
    // a close's reclaim each continue in a function of their own).
    if observe::wanted(observed::<P>()) {
        return release_observed((ptr, class), bytes, stream, pool, uses);
    }
    let core = pool.core();
    // One test for the common case: a class below `LARGE` is a block cached by class
    // (an empty buffer's class is `NOT_CACHED`, above it).
    if let (Some(slot), None, true) = (core.slot, &uses, class < LARGE) {
        if let Some(mut e) = local_cache::<P>(slot, core.uid) {
            let id = P::B::stream_id(&stream);
            // SAFETY: as in `try_alloc_fast`: the entry stays in the table during this
            // statement, no other reference to it is live, and `push` does not reach
            // the table (it moves the block and the handles into the cache, or gives the
            // handles back).
            let pushed = unsafe { e.as_mut() }
                .cache
                .push::<false>(id, class, ptr, stream, pool);
            return match pushed {
                // Read after the push is published (`close.rs`).
                // SAFETY: as above; the push's borrow ended.
                Ok(()) if unsafe { e.as_ref() }.cache.reclaim_requested() => P::after_push(e),
                Ok(()) => {}
                Err((stream, pool)) => release_searched(pool, ptr, bytes, stream, class),
            };
        }
    }
    release_uncached(pool, ptr, bytes, stream, uses, class);
}

/// [`release_parts`] for a free an NVTX tool or the recorder sees.
#[cold]
#[inline(never)]
#[allow(clippy::box_collection)]
fn release_observed<P: PoolHandle>(
    (ptr, class): (u64, usize),
    bytes: usize,
    stream: StreamOf<P>,
    pool: P,
    uses: Option<Box<Vec<StreamOf<P>>>>,
) {
    let core = pool.core();
    observe_free::<P>(core, ptr, bytes, &stream, uses.is_none());
    if let (None, true) = (&uses, class < LARGE) {
        return release_searched(pool, ptr, bytes, stream, class);
    }
    release_uncached(pool, ptr, bytes, stream, uses, class);
}

/// The free of a block cached by class (no uses on other streams) that the stream's
/// last slot did not take: into this thread's bin for its stream found by a search, else
/// through the slow path.
#[cold]
#[inline(never)]
fn release_searched<P: PoolHandle>(pool: P, ptr: u64, bytes: usize, stream: StreamOf<P>, class: usize) {
    let core = pool.core();
    let Some(mut e) = core.slot.and_then(|slot| local_cache::<P>(slot, core.uid)) else {
        return release_slow(pool, ptr, bytes, stream, None);
    };
    let id = P::B::stream_id(&stream);
    // SAFETY: as in `release_parts`; `push` does not reach the table either.
    match unsafe { e.as_mut() }
        .cache
        .push::<true>(id, class, ptr, stream, pool)
    {
        // SAFETY: as above; the push's borrow ended.
        Ok(()) if unsafe { e.as_ref() }.cache.reclaim_requested() => P::after_push(e),
        Ok(()) => {}
        Err((stream, pool)) => release_slow(pool, ptr, bytes, stream, None),
    }
}

/// The free of a block not cached by class: a large block into this thread's large
/// slots, anything else (an empty buffer, a block with uses on other streams, one too
/// large to cache) through the slow path.
#[cold]
#[inline(never)]
#[allow(clippy::box_collection)]
fn release_uncached<P: PoolHandle>(
    pool: P,
    ptr: u64,
    bytes: usize,
    stream: StreamOf<P>,
    uses: Option<Box<Vec<StreamOf<P>>>>,
    class: usize,
) {
    if let (Some(slot), None, LARGE) = (pool.core().slot, &uses, class) {
        return release_large(pool, ptr, bytes, stream, slot);
    }
    release_slow(pool, ptr, bytes, stream, uses);
}
/// The free of a large block: into this thread's large slots with its handles, else
/// through the slow path.
#[inline(always)]
fn release_large<P: PoolHandle>(pool: P, ptr: u64, bytes: usize, stream: StreamOf<P>, slot: usize) {
    let core = pool.core();
    let (Some(rounded), Some(mut e)) = (round_to_granule(bytes), local_cache::<P>(slot, core.uid)) else {
        return release_slow(pool, ptr, bytes, stream, None);
    };
    let id = P::B::stream_id(&stream);
    // SAFETY: as in `Owned::release`: the entry stays in its table during this statement,
    // no other reference to it is live, and `push_large` drops nothing.
    let pushed = unsafe { e.as_mut() }
        .cache
        .push_large(id, rounded, ptr, Some((stream, pool)));
    match pushed {
        // Read after the push is published (`close.rs`).
        // SAFETY: as above; the push's borrow ended.
        Ok(()) if unsafe { e.as_ref() }.cache.reclaim_requested() => P::after_push(e),
        Ok(()) => {}
        Err(Some((stream, pool))) => release_slow(pool, ptr, bytes, stream, None),
        Err(None) => {}
    }
}

/// The free of a buffer seen by an NVTX tool (freed or cached, the block is no longer a
/// live region) and by the recorder, whichever is on (off the hot path). A block without
/// uses on other streams is reusable at once by later work on its stream, so its free
/// completes with the request (`completed`); one with uses completes when the cache finds
/// them complete (`Cache::free_slow`).
#[cold]
#[inline(never)]
fn observe_free<P: PoolHandle>(
    core: &Core<P::B>,
    ptr: u64,
    bytes: usize,
    stream: &StreamOf<P>,
    completed: bool,
) {
    if P::NVTX && nvtx::on() {
        nvtx::region_unregister(ptr);
    }
    if crate::trace::on() {
        let id = P::B::stream_id(stream).get();
        core.cache.backend.trace().device_free(ptr, bytes, id, completed);
    }
}

/// Everything but the free into this thread's bin: an empty buffer's handles dropped, a
/// block with recorded uses, a block too large to cache, a full bin.
#[cold]
#[inline(never)]
#[allow(clippy::box_collection)]
fn release_slow<P: PoolHandle>(
    pool: P,
    ptr: u64,
    bytes: usize,
    stream: StreamOf<P>,
    uses: Option<Box<Vec<StreamOf<P>>>>,
) {
    if ptr == 0 {
        return; // an empty buffer: no block, only its handles to drop
    }
    let uses = uses.map_or_else(Vec::new, |b| *b);
    with_thread_cache(&pool, |tc| {
        pool.core().cache.free_slow::<P>(tc, ptr, bytes, stream, uses)
    });
}
