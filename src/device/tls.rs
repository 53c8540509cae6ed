//! The thread-local table of device thread caches: one entry per pool slot (64 slots: a
//! pool created while 64 others with thread caches are alive works from the shared lists
//! alone). An entry holds a handle of its pool, so a pool lives while any thread holds a
//! cache for it; the entry gives its blocks back to the pool when its thread exits or
//! the pool is trimmed from that thread.

use super::backend::CudaBackend;
use super::pool::DevicePool;
use super::thread_cache::ThreadCache;
use crate::sync::global::{AtomicU64, Ordering};
use crate::sync::UnsafeCell;

/// Pools that get thread caches at once.
pub(crate) const SLOTS: usize = 64;

/// One thread's cache for one pool, with the pool it flushes into.
pub(crate) struct Entry {
    pub(crate) uid: u64,
    pub(crate) cache: ThreadCache<CudaBackend, DevicePool>,
    pub(crate) owner: DevicePool,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.owner.cache().retire_thread_cache(&mut self.cache);
    }
}

struct Table {
    slots: [UnsafeCell<Option<Box<Entry>>>; SLOTS],
}

impl Drop for Table {
    fn drop(&mut self) {
        for slot in &self.slots {
            // SAFETY: the table is being destroyed on its own thread; no borrow of a slot
            // is live (borrows never outlive `with`, `take` and `put`).
            let entry = slot.with_mut(|p| unsafe { (*p).take() });
            drop(entry);
        }
    }
}

thread_local! {
    static TABLE: Table = const {
        Table { slots: [const { UnsafeCell::new(None) }; SLOTS] }
    };
}

/// Runs `f` on this thread's entry for pool `uid` in `slot`, if there is one. `None`
/// when the slot is empty or holds another pool's entry, or while the thread's locals
/// are being destroyed.
///
/// `f` must not reach the table again (it runs with `&mut` to the entry): callers pass
/// closures that push or pop a block and move handles, and drop nothing that could be
/// the last handle of a pool (the entry holds its own).
#[inline(always)]
pub(crate) fn with<R>(slot: usize, uid: u64, f: impl FnOnce(&mut Entry) -> R) -> Option<R> {
    TABLE
        .try_with(|t| {
            t.slots[slot].with_mut(|p| {
                // SAFETY: the table is thread-local, so only this thread reaches the slot,
                // and no other borrow of it is live: borrows are confined to this function,
                // `take` and `put`, whose closures do not re-enter the table.
                match unsafe { &mut *p } {
                    Some(e) if e.uid == uid => Some(f(e)),
                    _ => None,
                }
            })
        })
        .ok()
        .flatten()
}

/// Takes this thread's entry for pool `uid` out of `slot` (for a slow path that may run
/// long); give it back with [`put`].
pub(crate) fn take(slot: usize, uid: u64) -> Option<Box<Entry>> {
    TABLE
        .try_with(|t| {
            t.slots[slot].with_mut(|p| {
                // SAFETY: as in `with`: thread-local, no other borrow live.
                let cell = unsafe { &mut *p };
                match cell {
                    Some(e) if e.uid == uid => cell.take(),
                    _ => None,
                }
            })
        })
        .ok()
        .flatten()
}

/// Puts `entry` into `slot`; returns what the caller must drop after this returns (the
/// entry displaced, or `entry` itself while the thread's locals are being destroyed).
/// Dropping an entry flushes it into its pool.
pub(crate) fn put(slot: usize, entry: Box<Entry>) -> Option<Box<Entry>> {
    let mut entry = Some(entry);
    let swapped = TABLE.try_with(|t| {
        // SAFETY: as in `with`: thread-local, no other borrow live.
        t.slots[slot].with_mut(|p| core::mem::replace(unsafe { &mut *p }, entry.take()))
    });
    match swapped {
        Ok(displaced) => displaced,
        Err(_) => entry,
    }
}

static SLOT_BITS: AtomicU64 = AtomicU64::new(0);
const _: () = assert!(SLOTS == 64, "one bit per slot in SLOT_BITS");

/// Takes a free slot, if any.
pub(crate) fn acquire_slot() -> Option<usize> {
    let mut bits = SLOT_BITS.load(Ordering::Relaxed);
    loop {
        let free = (!bits).trailing_zeros() as usize;
        if free >= SLOTS {
            return None;
        }
        match SLOT_BITS.compare_exchange_weak(bits, bits | 1 << free, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(free),
            Err(now) => bits = now,
        }
    }
}

/// Gives a slot back. Only a pool that no thread holds an entry for does (entries hold
/// their pool), so no stale entry of it remains in any thread.
pub(crate) fn release_slot(slot: usize) {
    SLOT_BITS.fetch_and(!(1 << slot), Ordering::Relaxed);
}
