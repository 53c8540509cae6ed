//! The process-wide map from address ranges to the allocator owning them (pool chunks and
//! segments, arena chunks, host registrations), so that [`record_use`](super::record_use)
//! and the copy helpers can find the owner of any pointer, whichever allocator it came
//! from.
//!
//! One lock, taken when an allocator takes memory from or returns it to its source (rare
//! and already costly) and by `record_use` (which also records a CUDA event). Owners are
//! registered by a process-unique id and hold an entry (an `Arc` to their shared state)
//! until they remove it. Not part of loom models (no-ops there).

use super::SharedFence;
use crate::error::Result;

/// An allocator's shared state, type-erased, that can attach a fence to the memory
/// holding an address.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) trait UseRecorder: Send + Sync {
    /// Attaches `fence` to the memory holding `addr`. `Ok(false)` when the owner no longer
    /// holds `addr` (a range being removed); `Err` when `addr` is in the owner's memory but
    /// in no live block.
    fn record(&self, addr: usize, fence: SharedFence) -> Result<bool>;
}

#[cfg(not(loom))]
pub(crate) use imp::*;

#[cfg(not(loom))]
mod imp {
    use std::collections::BTreeMap;

    use super::UseRecorder;
    use crate::sync::{lock, Arc, Mutex};

    struct Registry {
        /// start -> (end, owner id)
        ranges: BTreeMap<usize, (usize, u64)>,
        owners: BTreeMap<u64, Arc<dyn UseRecorder>>,
    }

    static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
        ranges: BTreeMap::new(),
        owners: BTreeMap::new(),
    });

    /// Registers an owner under `id` (from [`new_owner_id`]).
    pub(crate) fn add_owner<T: UseRecorder + 'static>(id: u64, owner: T) {
        let owner: Arc<dyn UseRecorder> = Arc::new(owner);
        lock(&REGISTRY).owners.insert(id, owner);
    }

    /// Forgets an owner and every range it registered; returns its entry, which the caller
    /// drops after this returns (it may be the last reference to the owner's state).
    pub(crate) fn remove_owner(id: u64) -> Option<Arc<dyn UseRecorder>> {
        let mut r = lock(&REGISTRY);
        r.ranges.retain(|_, (_, owner)| *owner != id);
        r.owners.remove(&id)
    }

    /// Registers `start..start + len` as owned by `id` (a registered owner).
    pub(crate) fn insert_range(start: usize, len: usize, id: u64) {
        let mut r = lock(&REGISTRY);
        if r.owners.contains_key(&id) {
            r.ranges.insert(start, (start + len, id));
        }
    }

    pub(crate) fn remove_range(start: usize) {
        lock(&REGISTRY).ranges.remove(&start);
    }

    /// The id of the owner of `addr`, if any.
    pub(crate) fn find_owner_id(addr: usize) -> Option<u64> {
        let r = lock(&REGISTRY);
        let (_, &(end, id)) = r.ranges.range(..=addr).next_back()?;
        (addr < end).then_some(id)
    }

    /// Whether any registered range meets `start..start + len` (`len` > 0). Ranges are
    /// disjoint, so only the last one starting below the end can reach into it.
    pub(crate) fn overlaps(start: usize, len: usize) -> bool {
        let r = lock(&REGISTRY);
        r.ranges
            .range(..start.saturating_add(len))
            .next_back()
            .is_some_and(|(_, &(end, _))| end > start)
    }

    /// The owner of `addr`, if any.
    pub(crate) fn find(addr: usize) -> Option<Arc<dyn UseRecorder>> {
        let r = lock(&REGISTRY);
        let (_, &(end, id)) = r.ranges.range(..=addr).next_back()?;
        if addr >= end {
            return None;
        }
        r.owners.get(&id).cloned()
    }
}

/// A process-unique owner id (never reused), for pools, arenas and registrations alike.
pub(crate) fn new_owner_id() -> u64 {
    use crate::sync::global::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Under loom the registry holds nothing: it is process-wide state outside the models.
#[cfg(loom)]
mod imp_loom {
    use super::UseRecorder;
    pub(crate) struct NoOwner;
    impl NoOwner {
        pub(crate) fn record(&self, _addr: usize, _fence: super::SharedFence) -> crate::error::Result<bool> {
            Ok(false)
        }
    }
    pub(crate) fn add_owner<T: UseRecorder + 'static>(_id: u64, _owner: T) {}
    pub(crate) fn remove_owner(_id: u64) -> Option<NoOwner> {
        None
    }
    pub(crate) fn insert_range(_start: usize, _len: usize, _id: u64) {}
    pub(crate) fn remove_range(_start: usize) {}
    pub(crate) fn find_owner_id(_addr: usize) -> Option<u64> {
        None
    }
    pub(crate) fn overlaps(_start: usize, _len: usize) -> bool {
        false
    }
    pub(crate) fn find(_addr: usize) -> Option<NoOwner> {
        None
    }
}
#[cfg(loom)]
pub(crate) use imp_loom::*;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Nobody;

    impl UseRecorder for Nobody {
        fn record(&self, _addr: usize, _fence: SharedFence) -> Result<bool> {
            Ok(false)
        }
    }

    #[test]
    fn overlaps_sees_a_range_inside_outside_or_across_the_query() {
        // Addresses no allocation of this process uses (above the 47-bit user space).
        let base = 0xffff_0000_0000_0000usize;
        let id = new_owner_id();
        add_owner(id, Nobody);
        insert_range(base + 0x1000, 0x100, id); // [0x1000, 0x1100)
        assert!(overlaps(base, 0x10000), "a registered range inside the query");
        assert!(overlaps(base + 0x1010, 0x10), "the query inside a range");
        assert!(overlaps(base + 0x10ff, 0x100), "the query across the end");
        assert!(overlaps(base + 0xf00, 0x101), "the query across the start");
        assert!(!overlaps(base, 0x1000), "adjacent below");
        assert!(!overlaps(base + 0x1100, 0x1000), "adjacent above");
        assert_eq!(find_owner_id(base + 0x1000), Some(id));
        assert!(remove_owner(id).is_some());
        assert!(!overlaps(base, 0x10000), "removed with its owner");
    }
}
