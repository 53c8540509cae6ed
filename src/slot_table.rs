//! Thread-local tables of per-pool entries (the pools' thread caches), and the process-wide
//! bitmap that gives each live pool its slot in them. The host pools and the device pools
//! each declare a table of their own entry type (with `crate::sync::thread_local_const!`,
//! so loom models run this code) and a [`SlotBits`]; this module owns the unsafe part.
//!
//! A pool takes a slot when it is made and gives it back when it goes; while 64 pools of a
//! kind are alive, a further one gets no slot and works from its shared lists alone. An
//! entry carries its pool's process-unique id, so an entry left behind by a pool that
//! went away (in a thread that has not touched the slot since) is never taken for the
//! entry of the pool that reuses the slot.

use core::ptr::NonNull;

use crate::sync::global::{AtomicU64, Ordering};
use crate::sync::UnsafeCell;

/// Where the hot path finds this thread's table of one kind: a pointer in a `const`
/// thread-local without `Drop`, which (unlike the table's own thread-local, whose access
/// checks that its destructor is registered and may call to register it) is one load
/// with no call behind it, so the hit compiles to a leaf. Null until a slow path of the
/// thread publishes the table ([`SlotTable::publish`]) and again from the start of the
/// table's destruction. Not under loom, whose thread-locals the models check.
#[cfg(not(loom))]
pub(crate) type HotKey<E> = std::thread::LocalKey<core::cell::Cell<*const SlotTable<E>>>;

/// Slots per table: pools of one kind that get thread caches at once.
pub(crate) const SLOTS: usize = 64;

/// An entry of a [`SlotTable`]: one thread's state for one pool.
pub(crate) trait SlotEntry {
    /// The process-unique id of the entry's pool.
    fn uid(&self) -> u64;
}

/// One thread's entries, by slot. Lives in a thread-local, so only its thread reaches it
/// (it is not `Sync`: the cells are not).
pub(crate) struct SlotTable<E: 'static> {
    slots: [UnsafeCell<Option<Box<E>>>; SLOTS],
    /// The thread-local pointer the hot path reads, if the table has one.
    #[cfg(not(loom))]
    hot: Option<&'static HotKey<E>>,
}

impl<E: SlotEntry> SlotTable<E> {
    /// An empty table (a `const` initializer, so that the thread-local needs no lazy
    /// initialization check).
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Self {
        Self {
            slots: [const { UnsafeCell::new(None) }; SLOTS],
            hot: None,
        }
    }

    /// An empty table that [`publish`](Self::publish) makes reachable through `hot`
    /// ([`SlotTable::hot_entry_ptr`]).
    #[cfg(not(loom))]
    pub(crate) const fn with_hot(hot: &'static HotKey<E>) -> Self {
        Self {
            slots: [const { UnsafeCell::new(None) }; SLOTS],
            hot: Some(hot),
        }
    }

    /// Makes this table reachable through its hot pointer (nothing for a table without
    /// one, and under loom).
    ///
    /// # Safety
    /// 1. `self` is the table in a thread-local of the calling thread (so it stays at this
    ///    address until its destructor runs, which clears the pointer first).
    #[inline(always)]
    pub(crate) unsafe fn publish(&self) {
        #[cfg(not(loom))]
        if let Some(hot) = self.hot {
            // A `const` thread-local without `Drop` is never destroyed: `try_with` cannot
            // fail, and an error would only leave the pointer unset (the slow way).
            let _ = hot.try_with(|p| p.set(self));
        }
    }

    /// The entry of pool `uid` in `slot` of this thread's table behind `hot`, as
    /// [`entry_ptr`](Self::entry_ptr) gives it; `None` also while no table is published
    /// (the caller takes its slow path, which goes through the table's thread-local).
    #[cfg(not(loom))]
    #[inline(always)]
    pub(crate) fn hot_entry_ptr(hot: &'static HotKey<E>, slot: usize, uid: u64) -> Option<NonNull<E>> {
        let table = hot.try_with(|p| p.get()).ok()?;
        if table.is_null() {
            return None;
        }
        // SAFETY: `hot` is this thread's, and only `publish` sets it: to a table in a
        // thread-local of this thread (its obligation 1), which stays at that address
        // until its destructor, whose first act is to clear `hot`. So a non-null pointer
        // is a live table of this thread, reached here through a shared reference only
        // (its cells are borrowed within `entry_ptr` alone).
        unsafe { &*table }.entry_ptr(slot, uid)
    }

    /// An empty table (loom's cells have no `const` constructor).
    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        Self {
            slots: core::array::from_fn(|_| UnsafeCell::new(None)),
        }
    }

    /// The cell of `slot` (masked: slots come from [`SlotBits`], below [`SLOTS`], and the
    /// mask lets the compiler drop the bounds check from the hot path).
    #[inline(always)]
    fn cell(&self, slot: usize) -> &UnsafeCell<Option<Box<E>>> {
        &self.slots[slot & (SLOTS - 1)]
    }

    /// Runs `f` on the entry of pool `uid` in `slot`; `None` when the slot is empty or
    /// holds another pool's entry.
    ///
    /// # Safety
    /// 1. `f` does not reach this table while it runs: no call of `with`, `take` or `replace`
    ///    on it, and no drop of anything that could (an entry, or the last handle of a
    ///    pool whose drop flushes an entry).
    #[inline(always)]
    pub(crate) unsafe fn with<R>(&self, slot: usize, uid: u64, f: impl FnOnce(&mut E) -> R) -> Option<R> {
        self.cell(slot).with_mut(|p| {
            // SAFETY: the table is thread-local and not `Sync`, so only this thread reaches
            // the cell; no other borrow of it is live: `take` and `replace` hold theirs only
            // within their own bodies, and `f` does not reach the table (obligation 1).
            match unsafe { &mut *p } {
                Some(e) if e.uid() == uid => Some(f(e)),
                _ => None,
            }
        })
    }

    /// The entry of pool `uid` in `slot`, as a pointer (`None` when the slot is empty or
    /// holds another pool's entry). Entries are boxed, so the pointer stays valid while the
    /// entry stays in the table: until [`take`](Self::take) or [`replace`](Self::replace)
    /// moves it out, or the table is destroyed with its thread. Dereferencing it is the
    /// caller's business (and `unsafe`): no other reference to the entry may be live, and
    /// this table must not be reached while the reference is.
    #[inline(always)]
    pub(crate) fn entry_ptr(&self, slot: usize, uid: u64) -> Option<NonNull<E>> {
        self.cell(slot).with_mut(|p| {
            // SAFETY: as in `with`: one thread, no other borrow live; this borrow ends
            // here, and only a pointer to the boxed entry leaves.
            match unsafe { &mut *p } {
                Some(e) if e.uid() == uid => Some(NonNull::from(&mut **e)),
                _ => None,
            }
        })
    }

    /// Takes the entry of pool `uid` out of `slot` (for a slow path that may run long and
    /// reach the table meanwhile); give it back with [`replace`](Self::replace).
    pub(crate) fn take(&self, slot: usize, uid: u64) -> Option<Box<E>> {
        self.cell(slot).with_mut(|p| {
            // SAFETY: as in `with`: one thread, and no other borrow live (this one ends
            // before the function returns; the entry is moved out, nothing is dropped).
            let cell = unsafe { &mut *p };
            match cell {
                Some(e) if e.uid() == uid => cell.take(),
                _ => None,
            }
        })
    }

    /// Puts `entry` into `slot` (or empties it, with `None`); returns the entry it
    /// displaced, which the caller drops after this returns (dropping an entry flushes it
    /// into its pool).
    pub(crate) fn replace(&self, slot: usize, entry: Option<Box<E>>) -> Option<Box<E>> {
        // SAFETY: as in `take`: the old entry is moved out, not dropped, under the borrow.
        self.cell(slot)
            .with_mut(|p| core::mem::replace(unsafe { &mut *p }, entry))
    }
}

impl<E> Drop for SlotTable<E> {
    fn drop(&mut self) {
        // First: from here on the hot path takes the slow way, which finds the
        // thread-local destroyed.
        #[cfg(not(loom))]
        if let Some(hot) = self.hot {
            let _ = hot.try_with(|p| p.set(core::ptr::null()));
        }
        for slot in &self.slots {
            // SAFETY: the table is being destroyed on its own thread; no borrow of a cell
            // is live (borrows never outlive `with`, `take` and `replace`). The entry is
            // dropped after the borrow ends.
            let entry = slot.with_mut(|p| unsafe { (*p).take() });
            drop(entry);
        }
    }
}

/// The slots of one kind of pool: a bit per slot, set while a pool holds it.
pub(crate) struct SlotBits(AtomicU64);

const _: () = assert!(SLOTS == 64, "one bit per slot in SlotBits");

impl SlotBits {
    /// No slot taken.
    pub(crate) const fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Takes a free slot, if any.
    pub(crate) fn acquire(&self) -> Option<usize> {
        let mut bits = self.0.load(Ordering::Relaxed);
        loop {
            let free = (!bits).trailing_zeros() as usize;
            if free >= SLOTS {
                return None;
            }
            match self
                .0
                .compare_exchange_weak(bits, bits | 1 << free, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(free),
                Err(now) => bits = now,
            }
        }
    }

    /// Gives a slot back. Entries a thread still holds for it are told apart from the next
    /// holder's by their uid.
    pub(crate) fn release(&self, slot: usize) {
        self.0.fetch_and(!(1 << slot), Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Entry(u64);

    impl SlotEntry for Entry {
        fn uid(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn entries_are_found_by_slot_and_uid() {
        let t: SlotTable<Entry> = SlotTable::new();
        assert!(t.replace(3, Some(Box::new(Entry(7)))).is_none());
        // SAFETY: the closures do not reach the table.
        unsafe {
            assert_eq!(t.with(3, 7, |e| e.0), Some(7));
            assert_eq!(t.with(3, 8, |e| e.0), None, "another pool's entry");
            assert_eq!(t.with(4, 7, |e| e.0), None, "an empty slot");
        }
        assert!(t.take(3, 8).is_none());
        let e = t.take(3, 7).unwrap();
        assert!(t.take(3, 7).is_none());
        assert_eq!(t.replace(3, Some(e)).map(|e| e.0), None);
        assert_eq!(
            t.replace(3, Some(Box::new(Entry(9)))).map(|e| e.0),
            Some(7),
            "displaced"
        );
        assert_eq!(t.replace(3, None).map(|e| e.0), Some(9), "emptied");
    }

    #[test]
    fn slots_are_handed_out_once_until_released() {
        let bits = SlotBits::new();
        let all: Vec<usize> = (0..SLOTS).map(|_| bits.acquire().unwrap()).collect();
        assert_eq!(all, (0..SLOTS).collect::<Vec<_>>());
        assert_eq!(bits.acquire(), None);
        bits.release(17);
        assert_eq!(bits.acquire(), Some(17));
    }
}
