//! Giving memory back to the driver: trimming to a number of bytes (spare handles first,
//! then idle chunks from the highest address, after waiting on the host, with the lock
//! let go, for the frees numbered so far), and the shutdown at the backend's drop.
//!
//! Invariants: a handle is released only when it is mapped nowhere (spare, or just
//! unmapped, and not still mapped at a retired chunk); every handle a trim releases
//! leaves `stats.reserved` and the pool's reservations together, a group's with all its
//! bytes (the shutdown releases the rest without counting: the pool is going, and a
//! group's handle, recorded at each of its chunks, once).

use super::held::Held;
use super::{PageHeap, Reclaim, Reclaimed, MAX_CLOCKS};
use crate::cuda::record_drop_error;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Trims this heap and says what the driver pool beside it (reserving `pool_reserved`
    /// bytes) may keep, so that the two together keep less than `keep`.
    pub(crate) fn trim_beside_pool(&self, b: &B, keep: usize, pool_reserved: usize) -> usize {
        self.trim_to(b, keep.saturating_sub(pool_reserved));
        keep.saturating_sub(self.reserved())
    }

    /// Releases spare handles, then idle chunks from the highest address (whose frees
    /// completed: the streams of the frees numbered before the trim are synchronized
    /// first; a group when all of its chunks are idle, whole), until the
    /// heap reserves less than `keep` bytes (0: all it can, and the regions left empty
    /// are freed).
    pub(crate) fn trim_to(&self, b: &B, keep: usize) {
        let mut st = self.held();
        st.take_turn();
        let all = keep == 0;
        let keep = keep.max(1);
        self.wait_for_frees(&mut st, b);
        self.poll(&mut st, b, usize::MAX);
        while st.stats.reserved >= keep {
            let h = match st.spare.pop() {
                Some(h) => h,
                None => match self.reclaim(&mut st, b, usize::MAX, Reclaim::Done) {
                    Some(Reclaimed::Handle(h, _)) => h,
                    // A group, unmapped and released whole.
                    Some(Reclaimed::Released) => continue,
                    None => break,
                },
            };
            if st.retired.iter().any(|&(c, _)| st.chunks[c].handle == Some(h)) {
                // Still mapped at a chunk whose work could not be waited for: kept.
                st.spare.push(h);
                break;
            }
            // SAFETY: the handle (a chunk's) is mapped nowhere (spare, or just unmapped)
            // and forgotten here.
            unsafe { self.release_handle(&mut st, h, self.chunk_bytes()) };
        }
        if all {
            self.free_empty_regions(&mut st);
        }
        st.end_turn();
        st.clocks.forget(if all { 0 } else { MAX_CLOCKS });
        let dead = st.clocks.take_dead();
        drop(st);
        drop(dead);
    }

    /// With the turn: waits on the host, with the lock let go, for the work of every free
    /// numbered so far whose work may be pending (synchronizing its stream), so that what
    /// a trim unmaps is settled; a failed wait is counted and that work stays pending.
    fn wait_for_frees(&self, st: &mut Held<'_, B>, b: &B) {
        let pending = st.clocks.pending();
        if pending.is_empty() {
            return;
        }
        // The stream handles are dropped with the lock let go (the last handle of a
        // stream destroys it: a driver call).
        let waited: Vec<_> = st.unlocked(|| {
            pending
                .into_iter()
                .map(|(s, seq)| (B::stream_id(&s), seq, b.synchronize(&s)))
                .collect()
        });
        for (id, seq, r) in waited {
            match r {
                Ok(()) => st.clocks.completed_to(id, seq),
                Err(e) => record_drop_error("waiting for a page block's frees", e),
            }
        }
    }

    /// Gives everything back, at the backend's drop: trims to 0, then releases the
    /// handles of chunks still mapped (blocks still live, or stuck; the driver frees them
    /// once unmapped).
    pub(crate) fn shutdown(&self, b: &B) {
        self.trim_to(b, 0);
        let mut st = self.held();
        st.take_turn();
        st.clocks.forget_all();
        // A handle may be mapped at two chunks (its own and a retired one): released once.
        let mut handles: std::collections::BTreeSet<u64> = st.spare.drain(..).collect();
        handles.extend(st.chunks.iter_mut().filter_map(|c| c.handle.take()));
        for h in handles {
            // SAFETY: the pool is being dropped: nothing allocates from it again; a
            // handle released while mapped is freed by the driver at its unmap.
            if let Err(e) = st.unlocked(|| unsafe { self.phys.release(h) }) {
                record_drop_error("cuMemRelease", e);
            }
        }
        st.end_turn();
        let dead = st.clocks.take_dead();
        drop(st);
        drop(dead);
    }
}
