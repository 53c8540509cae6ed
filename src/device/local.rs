//! The hot path of a device pool, and what a buffer owns: this thread's cache for the
//! pool (an entry of a thread-local [`SlotTable`]), the allocation hit and the free into
//! it, and [`Owned`], the block with its stream and pool handles that a buffer holds and
//! gives back on drop.
//!
//! Generic over the pool handle type ([`PoolHandle`]) so that the simulated pool of
//! `sim.rs` (CPU tests and the `device_hit_sim` benchmark) runs this very code on the
//! simulated GPU of `backend::fake`: [`DevicePool`](super::DevicePool) and the simulation
//! differ only in their backend and in the thread-local table each declares.

use core::mem::ManuallyDrop;

use super::backend::Backend;
use super::cache::Cache;
use super::thread_cache::ThreadCache;
use crate::slot_table::{SlotBits, SlotEntry, SlotTable};
use crate::sync::global::{AtomicU64 as GlobalU64, Ordering as GlobalOrdering};

/// The stream handle type of a pool handle's backend.
pub(crate) type StreamOf<P> = <<P as PoolHandle>::B as Backend>::Stream;

/// A cheap, cloneable handle of a pool (an `Arc` inside), as buffers own one.
pub(crate) trait PoolHandle: Clone + Send + Sync + 'static {
    /// What the pool allocates from.
    type B: Backend;
    /// The pool's shared state.
    fn core(&self) -> &Core<Self::B>;
    /// Runs `f` with this thread's table of caches of pools of this type; `None` while the
    /// thread's locals are being destroyed.
    fn with_table<R>(f: impl FnOnce(&SlotTable<LocalCache<Self>>) -> R) -> Option<R>;
    /// The slots of pools of this type in their tables.
    fn slots() -> &'static SlotBits;
}

static NEXT_UID: GlobalU64 = GlobalU64::new(1);

/// A pool's shared state: its cache, and where this pool's thread caches are found.
pub(crate) struct Core<B: Backend> {
    pub(crate) cache: Cache<B>,
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

/// One thread's cache for one pool, with a handle of the pool it flushes into (so a pool
/// lives while any thread holds a cache for it).
pub(crate) struct LocalCache<P: PoolHandle> {
    uid: u64,
    pub(crate) cache: ThreadCache<P::B, P>,
    owner: P,
}

impl<P: PoolHandle> SlotEntry for LocalCache<P> {
    #[inline(always)]
    fn uid(&self) -> u64 {
        self.uid
    }
}

impl<P: PoolHandle> Drop for LocalCache<P> {
    fn drop(&mut self) {
        self.owner.core().cache.retire_thread_cache(&mut self.cache);
    }
}

/// The allocation hit: a block of the class of `bytes` (nonzero) freed on `stream`, from
/// this thread's bin, with the handles a buffer owns (the last freed buffer's, recycled,
/// or clones). `None` on a miss.
#[inline(always)]
pub(crate) fn try_alloc_fast<P: PoolHandle>(
    pool: &P,
    bytes: usize,
    stream: &StreamOf<P>,
) -> Option<(u64, StreamOf<P>, P)> {
    let core = pool.core();
    let slot = core.slot?;
    let class = core.cache.class_for(bytes)?;
    let id = P::B::stream_id(stream);
    let (ptr, s, p) = P::with_table(|t| {
        // SAFETY: `pop` only moves blocks and handles within the thread's cache; it drops
        // nothing and does not reach the table.
        unsafe { t.with(slot, core.uid, |e| e.cache.pop(id, class)) }
    })???;
    Some((
        ptr,
        s.unwrap_or_else(|| stream.clone()),
        p.unwrap_or_else(|| pool.clone()),
    ))
}

/// The allocation slow path: a block for `bytes` (nonzero) on `stream`, through this
/// thread's cache (made if needed) and the shared cache.
#[cold]
#[inline(never)]
pub(crate) fn alloc_slow<P: PoolHandle>(pool: &P, bytes: usize, stream: &StreamOf<P>) -> crate::Result<u64> {
    with_thread_cache(pool, |tc| pool.core().cache.alloc_slow(tc, bytes, stream))
}

/// Runs `f` with this thread's cache for `pool` (made if needed; `None` if the pool has
/// none or the thread's locals are gone). The cache is out of the thread-local table
/// meanwhile, so `f` may take long, call CUDA and drop handles.
pub(crate) fn with_thread_cache<P: PoolHandle, R>(
    pool: &P,
    f: impl FnOnce(Option<&mut ThreadCache<P::B, P>>) -> R,
) -> R {
    let core = pool.core();
    let Some(slot) = core.slot else {
        return f(None);
    };
    let uid = core.uid;
    let mut entry = P::with_table(|t| t.take(slot, uid)).flatten().or_else(|| {
        let cache = core.cache.new_thread_cache()?;
        Some(Box::new(LocalCache {
            uid,
            cache,
            owner: pool.clone(),
        }))
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
}

/// A block a buffer owns: its address, the handles of its stream and its pool (taken by
/// [`release`](Self::release), which hands them to the pool's cache with the block, so a
/// steady allocate/free cycle never touches a reference count), and the other streams
/// that use it.
pub(crate) struct Owned<P: PoolHandle> {
    ptr: u64,
    stream: ManuallyDrop<StreamOf<P>>,
    pool: ManuallyDrop<P>,
    /// Other streams whose work uses the block (`record_use`).
    uses: Vec<StreamOf<P>>,
}

impl<P: PoolHandle> Owned<P> {
    /// Owns `ptr` (0 for an empty buffer) with its handles.
    #[inline(always)]
    pub(crate) fn new(ptr: u64, stream: StreamOf<P>, pool: P) -> Self {
        Self {
            ptr,
            stream: ManuallyDrop::new(stream),
            pool: ManuallyDrop::new(pool),
            uses: Vec::new(),
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
        &self.uses
    }

    /// Records that work queued on `stream` uses the block (nothing for an empty buffer
    /// or the block's own stream; once per stream).
    pub(crate) fn record_use(&mut self, stream: &StreamOf<P>) {
        let id = P::B::stream_id(stream);
        if self.ptr == 0
            || id == P::B::stream_id(&self.stream)
            || self.uses.iter().any(|u| P::B::stream_id(u) == id)
        {
            return;
        }
        self.uses.push(stream.clone());
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
        // SAFETY: obligation 1: the handles are taken once and never touched again.
        let (stream, pool) = unsafe {
            (
                ManuallyDrop::take(&mut self.stream),
                ManuallyDrop::take(&mut self.pool),
            )
        };
        if self.ptr == 0 {
            return;
        }
        let uses = core::mem::take(&mut self.uses);
        if uses.is_empty() {
            let core = pool.core();
            if let (Some(slot), Some(class)) = (core.slot, core.cache.class_for(bytes)) {
                let (uid, id) = (core.uid, P::B::stream_id(&stream));
                let mut handles = Some((stream, pool));
                let kept = P::with_table(|t| {
                    // SAFETY: `push` only moves the block and the handles into the
                    // thread's cache (or back out); it drops nothing and does not reach
                    // the table.
                    unsafe {
                        t.with(slot, uid, |e| {
                            let (s, p) = handles.take()?;
                            match e.cache.push(id, class, self.ptr, s, p) {
                                Ok(()) => Some(()),
                                Err(back) => {
                                    handles = Some(back);
                                    None
                                }
                            }
                        })
                    }
                });
                if let Some(Some(Some(()))) = kept {
                    return;
                }
                if let Some((stream, pool)) = handles {
                    release_slow(pool, self.ptr, bytes, stream, uses);
                }
                return;
            }
        }
        release_slow(pool, self.ptr, bytes, stream, uses);
    }
}

#[cold]
#[inline(never)]
fn release_slow<P: PoolHandle>(pool: P, ptr: u64, bytes: usize, stream: StreamOf<P>, uses: Vec<StreamOf<P>>) {
    with_thread_cache(&pool, |tc| {
        pool.core()
            .cache
            .free_slow::<P>(tc, ptr, bytes, stream, None, uses)
    });
}
