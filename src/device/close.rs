//! A dropped pool gives its memory back while threads that cached its blocks live on.
//!
//! A thread's cache keeps the blocks it freed, each with the pool handle of the buffer
//! that freed it (so that a hit moves handles and touches no reference count). When the
//! program drops its last handle of a pool, a worker thread that used it may never touch
//! the pool again, and its bins would hold the pool, and the memory behind it, until the
//! thread exits. So the pool is *collected*: once no handle of it exists outside the
//! thread caches' bins, whoever holds the last outside handle takes every idle thread's
//! blocks, and the pool (its cache, driver pool and page heap) is dropped as if no thread
//! had cached anything.
//!
//! # The protocol
//!
//! - **Users are counted apart** (`Core::users`, changed by the public handles' clone and
//!   drop only, never on the hot path). When the count falls to 0 the pool *closes*:
//!   `closing` goes up, every registered thread's reclaim flag goes up (and stays up
//!   through its flushes while the pool is closed), then a process-wide barrier
//!   ([`heavy_barrier`]). A handle made again from a buffer reopens it.
//! - **Who collects.** The last handle outside the bins goes either by a drop or by a push
//!   into a bin. A push reads the reclaim flag after publishing (below) and, seeing it,
//!   drops a handle of its own (`after_push`). A drop of an internal handle
//!   ([`drop_handle`]) while the pool is closed runs under the registry's lock, after
//!   the drops that read `closing` before it was raised ended (`Core::dropping`), and
//!   tries [`collect`] before it gives up its reference; one that gives it up under the
//!   lock is never the last. So the drops are ordered, and the last of them sees every
//!   other gone.
//! - **Quiescence.** Each thread publishes its parked handles (blocks minus `bare` ones,
//!   per slot) with counts that change only monotonically or together with a monotonic
//!   one ([`ThreadStats`]). A collector reads every thread's counts, the pool's strong
//!   count, and the counts again, all under the registry's lock (no thread registers
//!   meanwhile). Equal readings mean no thread published anything in between, so at the
//!   moment of the strong count each thread's bins held at least its published handles
//!   (the invariant of [`ThreadStats`]: counts rise after a block enters a bin and fall
//!   before its handles are dropped); a strong count equal to the published handles plus
//!   the collector's own then means that no other handle existed at that moment: no user
//!   handle, no buffer, no operation in flight (every operation holds a handle outside
//!   the bins, and a push between its move into the bin and its publication makes the
//!   bins hold more than published). No handle can appear afterwards (handles are made
//!   only from handles), but from a `Weak` upgrade, which only `after_push` and a thread's
//!   exit make, both behind the claim below.
//! - **Claims.** The collector then claims each thread's cache (`FREE` to `CLAIMED`, a
//!   compare-and-swap), takes its blocks, and marks it `GONE` (`Release`). The owner goes
//!   through the same state for the two things it does without an outside handle: its
//!   exit (`FREE` to `EXITING`; if claimed, it waits for `GONE` before its cache is
//!   freed) and its own flush after a push (`FREE` to `BUSY` and back). The collector's
//!   `Acquire` readings synchronize with each thread's last publication and its last
//!   handle drop (the strong count is changed only by read-modify-writes), so it sees the
//!   bins as their owner left them.
//! - **The barrier.** A push publishes its count (`Release`) and then reads the reclaim
//!   flag; a close raises the flags and then reads the counts. Without a full fence on
//!   both sides each could miss the other's store (the store-buffer race), and the hot
//!   path cannot afford a fence. So the close pays for both: `membarrier(2)`'s
//!   private expedited command runs a full fence on every thread of the process that is
//!   running, and a thread that is not running passed one when it was switched out; after
//!   it, a push either published before its thread's fence (the collector reads it) or
//!   reads the flag after it (and collects itself). Where the command is refused, the
//!   global one, and then a `SeqCst` fence alone (logged once: a push racing the close
//!   may then leave its block cached until the thread's next use of the pool or its exit).
//!
//! What stays: each thread's empty cache, in its table until the thread exits or another
//! pool takes the slot (it holds the pool weakly: the `Arc`'s allocation, not the pool).
//! The pool itself, its cache, driver pool and page heap go at the collector's drop.

use super::local::{Core, LocalCache, PoolHandle};
use super::order::StreamOrder;
use super::thread_cache::{Evicted, ThreadCache, ThreadStats};
use crate::sync::{fence, Ordering};

/// The owner's cache is touched only by the owner's operations.
pub(crate) const FREE: u8 = 0;
/// The owner flushes its cache outside an operation (after a push saw its flag).
pub(crate) const BUSY: u8 = 1;
/// The owner exits: its cache is flushed and freed by it.
pub(crate) const EXITING: u8 = 2;
/// A collector takes the cache's blocks.
pub(crate) const CLAIMED: u8 = 3;
/// Taken: the cache is empty for good, and out of the registry.
pub(crate) const GONE: u8 = 4;

impl<P: PoolHandle> Drop for LocalCache<P> {
    fn drop(&mut self) {
        // A handle first: with one the pool outlives the flush (blocks without handles do
        // not hold it). Without one the pool was collected (and this cache, then free,
        // claimed) and dropped.
        let Some(pool) = P::upgrade(&self.owner) else {
            return; // claimed (`GONE`) by the collector, which held the pool meanwhile
        };
        if exiting(self.cache.stats()) {
            pool.core().cache.retire_thread_cache(&mut self.cache);
        } // else a collection took the blocks and retired the cache
        drop(pool); // tries the collection if the pool is closed
    }
}

impl<B: super::backend::Backend> Core<B> {
    /// A user handle more (the public handle's clone).
    pub(crate) fn add_user(&self) {
        if self.users.fetch_add(1, Ordering::SeqCst) == 0 {
            reopen(self);
        }
    }

    /// A user handle less (the public handle's drop): the last one closes the pool (its
    /// internal handle, dropped next, tries the collection).
    pub(crate) fn drop_user(&self) {
        if self.users.fetch_sub(1, Ordering::SeqCst) == 1 {
            close(self);
        }
    }
}

/// The drop of the last user handle: `closing` goes up (so that the threads' reclaim
/// flags stay up through their flushes: every push then looks for the collection), every
/// thread is asked for its blocks, and the barrier orders that request against every push
/// in flight (module docs). The caller's internal handle then tries the collection as it
/// drops. Under the registry's lock and only while no user handle exists, so that a
/// handle made again from a buffer meanwhile ([`reopen`]) leaves the pool open.
pub(crate) fn close<B: super::backend::Backend>(core: &Core<B>) {
    let cache = &core.cache;
    cache.threads().locked(|live| {
        if core.users.load(Ordering::SeqCst) == 0 {
            cache.closing.store(true, Ordering::SeqCst);
            for t in live {
                t.reclaim.store(true, Ordering::SeqCst);
            }
        }
    });
    heavy_barrier();
}

/// A user handle made from a buffer of a closed pool (its users went from 0 to 1): the
/// pool is open again (the flags the close raised go down at each thread's flush).
pub(crate) fn reopen<B: super::backend::Backend>(core: &Core<B>) {
    let cache = &core.cache;
    cache.threads().locked(|_| {
        if core.users.load(Ordering::SeqCst) > 0 {
            cache.closing.store(false, Ordering::SeqCst);
        }
    });
}

/// The drop of an internal handle `h` (from its type's `Drop`). While the pool is open,
/// or once it was collected, it gives up its reference at once (counted in
/// `Core::dropping` meanwhile while open). While it is closed it does so under the
/// registry's lock, after every unlocked drop in flight ended, so that of the handles
/// that drop, the last one sees the others gone: it tries the collection ([`collect`]),
/// and gives up its reference after the lock only if it may be the pool's last (one
/// given up under the lock never is).
pub(crate) fn drop_handle<P: PoolHandle>(h: &mut P) {
    let core: *const Core<P::B> = h.core();
    // SAFETY: `h` holds the pool until `release_ref` below.
    let c = unsafe { &*core };
    c.dropping.fetch_add(1, Ordering::SeqCst);
    if c.collected.load(Ordering::Acquire) {
        c.dropping.fetch_sub(1, Ordering::SeqCst);
        // SAFETY: the drop's one release of `h` (obligation 1 of `release_ref`).
        return unsafe { h.release_ref() };
    }
    if !c.cache.closing.load(Ordering::SeqCst) {
        // SAFETY: the drop's one release of `h`.
        unsafe { h.release_ref() };
        // SAFETY: the pool lives on: it was open when `closing` was read, so a user
        // handle lives, or the one that drops closes the pool and waits for this count
        // to fall to 0 before it gives up its own reference (below, under the lock).
        unsafe { &*core }.dropping.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    c.dropping.fetch_sub(1, Ordering::SeqCst);
    let collected = c.cache.threads().sweep(
        |live| {
            // Drops that read `closing` before the close raised it end first (their
            // count went up before they read it; the close's store came before this).
            while c.dropping.load(Ordering::SeqCst) != 0 {
                core::hint::spin_loop();
            }
            let taken = match c.collected.load(Ordering::Relaxed) {
                false => collect(h, live),
                true => None,
            };
            if taken.is_none() && h.strong_count() > 1 {
                // SAFETY: the drop's one release of `h`. Another handle holds the pool,
                // and none can go meanwhile: the unlocked drops ended, the locked ones
                // wait for the lock, and without a collection none drops unlocked. So
                // the pool, and the lock held, stay.
                unsafe { h.release_ref() };
                return Err(());
            }
            Ok(taken)
        },
        |t| t.state.load(Ordering::Relaxed) != GONE,
    );
    if let Ok(taken) = collected {
        // This handle (maybe the last) holds the pool while the blocks go back.
        c.cache.give_evicted(taken.unwrap_or_default());
        // SAFETY: the drop's one release of `h`; after the lock, as it may free the pool.
        unsafe { h.release_ref() };
    }
}

/// Collects the pool of `own` (the caller's handle, its drop under the registry's lock,
/// with the registered threads `live`) if no other handle exists outside the thread
/// caches' bins: claims every thread's cache (but those of threads exiting, which hold
/// a handle and give their blocks back on their own) and returns their blocks, for the
/// shared lists and the backend. See the module docs.
fn collect<P: PoolHandle>(own: &P, live: &[crate::sync::Arc<ThreadStats>]) -> Option<Vec<Evicted<P::B>>> {
    let first: Vec<_> = live.iter().map(|t| t.reading()).collect();
    let strong = own.strong_count() as u64;
    // The strong count only changes by read-modify-writes, so this synchronizes with
    // every drop before the value read.
    fence(Ordering::Acquire);
    let again: Vec<_> = live.iter().map(|t| t.reading()).collect();
    let parked: u64 = first.iter().map(ThreadStats::parked).sum();
    if first != again || strong != parked + 1 {
        return None;
    }
    own.core().collected.store(true, Ordering::Release);
    // SAFETY: the pool is quiescent (obligation 1); its registry's caches are all
    // `ThreadCache<P::B, P>` (obligation 2).
    let taken = live.iter().filter_map(|t| unsafe { claim_cache::<P::B, P>(t) });
    Some(taken.flatten().collect())
}

/// Takes the blocks of the thread cache `t` publishes for, if it is `FREE` (the owner
/// neither exits nor flushes), leaving it `GONE`.
///
/// # Safety
/// 1. The owner of the cache runs no operation on it and will not (the pool is
///    quiescent), but its own flush and its exit, which go through `t.state`; and what it
///    wrote to the cache happened before this call (`collect`'s `Acquire` readings).
/// 2. `t.cache`, if set, points to a `ThreadCache<B, P>` (the registry's caches are all
///    of its pool's types).
pub(crate) unsafe fn claim_cache<B: StreamOrder, P>(t: &ThreadStats) -> Option<Vec<Evicted<B>>> {
    let ptr = t.cache.load(Ordering::Acquire).cast::<ThreadCache<B, P>>();
    if ptr.is_null()
        || t.state
            .compare_exchange(FREE, CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return None;
    }
    // SAFETY: `ptr` is the owner's cache (obligation 2), boxed in its thread's table and
    // freed only by the owner's exit, which waits while the state is `CLAIMED`; the owner
    // touches it no other way (obligation 1) and its flush is excluded by the state just
    // taken. So this is the only reference to the cache.
    let tc = unsafe { &mut *ptr };
    let evicted = tc.take_all();
    t.state.store(GONE, Ordering::Release);
    Some(evicted)
}

/// After a push into this thread's bin, the reclaim flag was up (a trim, another thread
/// out of memory, or the pool's close): the thread flushes its cache, unless a collector
/// claimed it, and tries the collection if the pool is closed (as its handle drops).
#[cold]
#[inline(never)]
pub(crate) fn after_push<P: PoolHandle>(entry: core::ptr::NonNull<LocalCache<P>>) {
    // SAFETY: the entry is this thread's, in its table for this call (the caller's
    // pointer, as on the hot path); the borrow ends at the upgrade.
    let Some(pool) = P::upgrade(unsafe { &entry.as_ref().owner }) else {
        return; // collected and dropped: the cache was claimed, and is empty
    };
    super::local::with_thread_cache(&pool, |tc| {
        let Some(tc) = tc else { return };
        let state = &tc.stats().state;
        if state
            .compare_exchange(FREE, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            pool.core().cache.flush_thread(tc);
            tc.stats().state.store(FREE, Ordering::Release);
        }
    });
    drop(pool); // the internal handle's drop tries the collection if the pool is closed
}

/// The exit of a thread's cache (its table entry's drop): claims it against collectors
/// (`EXITING`), or waits until a collector that claimed it is done. True when the owner
/// still has to flush it.
pub(crate) fn exiting(t: &ThreadStats) -> bool {
    loop {
        match t
            .state
            .compare_exchange(FREE, EXITING, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(GONE) => return false,
            // A collector is taking the blocks: a short wait.
            Err(_) => crate::sync::thread::yield_now(),
        }
    }
}

/// A full memory fence on every thread of the process (module docs).
pub(crate) fn heavy_barrier() {
    fence(Ordering::SeqCst);
    #[cfg(all(target_os = "linux", not(loom)))]
    membarrier::run();
}

#[cfg(all(target_os = "linux", not(loom)))]
mod membarrier {
    use crate::sync::global::OnceLock;

    const GLOBAL: libc::c_int = 1;
    const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    fn call(cmd: libc::c_int) -> bool {
        // SAFETY: `membarrier(cmd, flags = 0, cpu_id = 0)` reads and writes no memory of
        // ours; an unknown or refused command returns -1.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) == 0 }
    }

    pub(super) fn run() {
        static REGISTERED: OnceLock<bool> = OnceLock::new();
        if *REGISTERED.get_or_init(|| call(REGISTER_PRIVATE_EXPEDITED)) && call(PRIVATE_EXPEDITED) {
            return;
        }
        if call(GLOBAL) {
            return;
        }
        static WARNED: OnceLock<()> = OnceLock::new();
        WARNED.get_or_init(|| {
            log::warn!(
                "cudalloc: membarrier(2) refused; a block freed while its pool's last handle drops may stay cached until its thread's next use of the pool or exit"
            );
        });
    }
}
