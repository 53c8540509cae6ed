//! The process-wide map from address ranges (chunks and large blocks) to the pool holding
//! them, so that [`record_use`](crate::record_use) and the copy helpers can find the
//! pool of any pointer, whichever pool (process-wide or local) it came from.
//!
//! One lock, taken when a pool takes memory from or returns it to its source (rare and
//! already costly) and by `record_use` (which also records a CUDA event). Pools are
//! registered by uid when created and removed when their handle is dropped; the map holds
//! an `Arc` to each registered pool's shared state. Not part of loom models (no-ops
//! there).

#[cfg(not(loom))]
pub(crate) use imp::*;

#[cfg(not(loom))]
mod imp {
    use std::collections::BTreeMap;

    use crate::error::Result;
    use crate::pool::Fence;
    use crate::sync::{lock, Arc, Mutex};

    /// A pool, type-erased, that can attach a fence to the block holding an address.
    pub(crate) trait UseRecorder: Send + Sync {
        fn record(&self, addr: usize, fence: Box<dyn Fence>) -> Result<()>;
    }

    struct Registry {
        /// start -> (end, pool uid)
        ranges: BTreeMap<usize, (usize, u64)>,
        owners: BTreeMap<u64, Arc<dyn UseRecorder>>,
    }

    static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
        ranges: BTreeMap::new(),
        owners: BTreeMap::new(),
    });

    pub(crate) fn add_owner(uid: u64, owner: Arc<dyn UseRecorder>) {
        lock(&REGISTRY).owners.insert(uid, owner);
    }

    /// Forgets a pool and every range it registered; returns its entry, which the caller
    /// drops after this returns (it may be the last reference to the pool).
    pub(crate) fn remove_owner(uid: u64) -> Option<Arc<dyn UseRecorder>> {
        let mut r = lock(&REGISTRY);
        r.ranges.retain(|_, (_, owner)| *owner != uid);
        r.owners.remove(&uid)
    }

    pub(crate) fn insert_range(start: usize, len: usize, uid: u64) {
        let mut r = lock(&REGISTRY);
        if r.owners.contains_key(&uid) {
            r.ranges.insert(start, (start + len, uid));
        }
    }

    pub(crate) fn remove_range(start: usize) {
        lock(&REGISTRY).ranges.remove(&start);
    }

    /// The pool holding `addr`, if any.
    pub(crate) fn find(addr: usize) -> Option<Arc<dyn UseRecorder>> {
        let r = lock(&REGISTRY);
        let (_, &(end, uid)) = r.ranges.range(..=addr).next_back()?;
        if addr >= end {
            return None;
        }
        r.owners.get(&uid).cloned()
    }
}

#[cfg(loom)]
pub(crate) fn insert_range(_start: usize, _len: usize, _uid: u64) {}

#[cfg(loom)]
pub(crate) fn remove_range(_start: usize) {}
