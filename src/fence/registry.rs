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

    /// start -> (end, owner id): ranges of one nesting depth, disjoint.
    type Level = BTreeMap<usize, (usize, u64)>;

    /// Ranges nest: an allocator whose source is another allocator of the crate (an
    /// arena or a pool over a pool's blocks) registers its chunks inside the lower
    /// allocator's ranges. `levels[0]` holds the ranges inside no other, `levels[d + 1]`
    /// the ranges inside one of `levels[d]`; each level's ranges are disjoint, so a
    /// lookup is one search per level (one or two levels in practice), and the innermost
    /// owner of an address (the deepest level holding it) answers for it.
    struct Registry {
        levels: Vec<Level>,
        owners: BTreeMap<u64, Arc<dyn UseRecorder>>,
    }

    static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
        levels: Vec::new(),
        owners: BTreeMap::new(),
    });

    /// The range of `level` holding `addr`: (start, end, owner id).
    fn holding(level: &Level, addr: usize) -> Option<(usize, usize, u64)> {
        let (&start, &(end, id)) = level.range(..=addr).next_back()?;
        (addr < end).then_some((start, end, id))
    }

    /// Whether a range of `level` meets `start..end` (`start < end`).
    fn meets(level: &Level, start: usize, end: usize) -> bool {
        level
            .range(..end)
            .next_back()
            .is_some_and(|(_, &(e, _))| e > start)
    }

    impl Registry {
        /// The innermost range holding `addr`.
        fn innermost(&self, addr: usize) -> Option<(usize, usize, u64)> {
            self.levels.iter().rev().find_map(|l| holding(l, addr))
        }

        fn drop_empty_levels(&mut self) {
            while self.levels.last().is_some_and(|l| l.is_empty()) {
                self.levels.pop();
            }
        }
    }

    /// Registers an owner under `id` (from [`new_owner_id`](super::new_owner_id)).
    pub(crate) fn add_owner<T: UseRecorder + 'static>(id: u64, owner: T) {
        let owner: Arc<dyn UseRecorder> = Arc::new(owner);
        lock(&REGISTRY).owners.insert(id, owner);
    }

    /// Forgets an owner and every range it registered; returns its entry, which the caller
    /// drops after this returns (it may be the last reference to the owner's state).
    pub(crate) fn remove_owner(id: u64) -> Option<Arc<dyn UseRecorder>> {
        let mut r = lock(&REGISTRY);
        for level in &mut r.levels {
            level.retain(|_, (_, owner)| *owner != id);
        }
        r.drop_empty_levels();
        r.owners.remove(&id)
    }

    /// Registers `start..start + len` as owned by `id` (a registered owner), inside the
    /// ranges that hold it (nesting). False, and nothing registered, for a range that
    /// crosses the edge of a registered range or holds one: memory the crate's allocators
    /// already own cannot be handed out twice, so such a range is a broken source's.
    #[must_use]
    pub(crate) fn insert_range(start: usize, len: usize, id: u64) -> bool {
        let Some(end) = start.checked_add(len).filter(|_| len > 0) else {
            return false;
        };
        let mut r = lock(&REGISTRY);
        if !r.owners.contains_key(&id) {
            return true;
        }
        // Depth: the number of levels whose ranges hold the whole new range.
        let depth = r
            .levels
            .iter()
            .take_while(|l| holding(l, start).is_some_and(|(_, e, _)| end <= e))
            .count();
        if r.levels[depth..].iter().any(|l| meets(l, start, end)) {
            return false;
        }
        if depth == r.levels.len() {
            r.levels.push(Level::new());
        }
        r.levels[depth].insert(start, (end, id));
        true
    }

    /// Forgets the range starting at `start` that `id` registered (a range of another
    /// owner starting at the same address, inside or around it, stays).
    pub(crate) fn remove_range(start: usize, id: u64) {
        let mut r = lock(&REGISTRY);
        for level in r.levels.iter_mut().rev() {
            if level.get(&start).is_some_and(|&(_, owner)| owner == id) {
                level.remove(&start);
                break;
            }
        }
        r.drop_empty_levels();
    }

    /// The id of the innermost owner of `addr`, if any.
    #[cfg(test)]
    pub(crate) fn find_owner_id(addr: usize) -> Option<u64> {
        lock(&REGISTRY).innermost(addr).map(|(_, _, id)| id)
    }

    /// Whether `id` registered a range holding `addr` (at any depth).
    pub(crate) fn holds(id: u64, addr: usize) -> bool {
        let r = lock(&REGISTRY);
        r.levels
            .iter()
            .any(|l| holding(l, addr).is_some_and(|(_, _, owner)| owner == id))
    }

    /// Whether any registered range meets `start..start + len` (`len` > 0).
    pub(crate) fn overlaps(start: usize, len: usize) -> bool {
        let end = start.saturating_add(len);
        lock(&REGISTRY).levels.iter().any(|l| meets(l, start, end))
    }

    /// The innermost owner of `addr`, if any.
    pub(crate) fn find(addr: usize) -> Option<Arc<dyn UseRecorder>> {
        let r = lock(&REGISTRY);
        let (_, _, id) = r.innermost(addr)?;
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
    pub(crate) fn insert_range(_start: usize, _len: usize, _id: u64) -> bool {
        true
    }
    pub(crate) fn remove_range(_start: usize, _id: u64) {}
    pub(crate) fn holds(_id: u64, _addr: usize) -> bool {
        false
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
        assert!(insert_range(base + 0x1000, 0x100, id)); // [0x1000, 0x1100)
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

    #[test]
    fn nested_ranges_answer_innermost_and_each_owner_stays_registered() {
        let base = 0xffff_1000_0000_0000usize;
        let (lower, upper) = (new_owner_id(), new_owner_id());
        add_owner(lower, Nobody);
        add_owner(upper, Nobody);
        assert!(insert_range(base, 0x10000, lower), "a segment of the lower pool");
        // The upper allocator's chunk is a block of that segment, at its start.
        assert!(insert_range(base, 0x1000, upper));
        assert!(insert_range(base + 0x4000, 0x1000, upper));
        assert_eq!(find_owner_id(base + 0x10), Some(upper), "innermost answers");
        assert_eq!(find_owner_id(base + 0x2000), Some(lower), "outside the chunks");
        assert!(holds(lower, base + 0x10) && holds(upper, base + 0x10));
        assert!(!holds(upper, base + 0x2000));
        // Crossing a chunk's edge, or holding registered ranges: refused.
        assert!(!insert_range(base + 0x800, 0x1000, upper));
        assert!(!insert_range(base + 0x1000, 0x20000, upper));
        assert!(!insert_range(base, 0, upper), "empty");
        // The chunk at the segment's start goes: the segment stays.
        remove_range(base, upper);
        assert_eq!(find_owner_id(base + 0x10), Some(lower));
        assert_eq!(find_owner_id(base + 0x4000), Some(upper));
        assert!(remove_owner(upper).is_some());
        assert_eq!(find_owner_id(base + 0x4000), Some(lower));
        assert!(remove_owner(lower).is_some());
        assert_eq!(find_owner_id(base + 0x10), None);
    }
}
