//! Taking handles back from idle chunks, and the retired chunks: an idle chunk whose
//! frees completed is unmapped and its handle taken; one whose frees may be pending is
//! *retired* (carved out of its free run, its old mapping kept) while its handle is
//! mapped elsewhere, and [`poll`](PageHeap::poll) unmaps it once they complete.
//!
//! Invariants (under the heap's lock):
//! - a chunk is unmapped only once the work of every free that touched its units is
//!   known complete (settled, or waited for on the host), and never while a block holds
//!   one of its units;
//! - a retired chunk has no unit in a free run or a block (`used` is all of them), keeps
//!   its handle recorded until its old mapping goes, and holds the stamps of its frees;
//!   an allocation that maps its handle elsewhere is ordered after those stamps.

use std::ops::ControlFlow;

use super::clocks::{touching, Freed, Stamps};
use super::stats::timed;
use super::{PageHeap, Reclaim, State};
use crate::cuda::record_drop_error;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::trace::Code;

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Takes the handle of an idle chunk (trying at most `tries`, from the highest
    /// address), as `how` says, with the marks to order its next use after.
    pub(super) fn reclaim(
        &self,
        st: &mut State<B>,
        b: &B,
        tries: usize,
        how: Reclaim,
    ) -> Option<(u64, Stamps)> {
        let pending = match self.take_idle(st, b, tries, how) {
            ControlFlow::Break(taken) => return taken.map(|h| (h, Vec::new())),
            ControlFlow::Continue(pending) => pending,
        };
        let (c, rs) = pending.filter(|_| how == Reclaim::Retire)?;
        self.retire_pending(st, c, rs)
    }

    /// Unmaps the first idle chunk (of at most `tries`, from the highest address) whose
    /// frees completed (`how`: settled, or waited for on the host) and breaks with its
    /// handle (`None` if it had none); else continues with the first chunk found pending
    /// and the first unit of its free run.
    fn take_idle(
        &self,
        st: &mut State<B>,
        b: &B,
        tries: usize,
        how: Reclaim,
    ) -> ControlFlow<Option<u64>, Option<(usize, usize)>> {
        let mut below = usize::MAX;
        let mut pending = None;
        for _ in 0..tries {
            let Some(&c) = st.idle.range(..below).next_back() else {
                break;
            };
            below = c;
            let first = c * self.chunk_units;
            let Some((rs, _, stamps)) = st.free.at_or_before(first) else {
                continue;
            };
            let frees = touching(stamps, first, first + self.chunk_units);
            if !self.frees_done(st, b, &frees, how == Reclaim::Wait) {
                pending = pending.or(Some((c, rs)));
                continue;
            }
            st.idle.remove(&c);
            // SAFETY: the chunk was mapped by `map_chunks` with a chunk's bytes; no block
            // holds a unit of it, and the marks of every free of its units completed (a
            // run keeps the latest mark of each stream until it completes).
            if unsafe { self.unmap_chunk(st, b, c) } {
                return ControlFlow::Break(st.chunks[c].handle.take());
            }
        }
        ControlFlow::Continue(pending)
    }

    /// Carves idle chunk `c` out of its free run (from unit `rs`): its units stay mapped,
    /// out of use, until the run's marks complete ([`poll`](Self::poll)); its handle, with
    /// those marks, goes to a new mapping.
    fn retire_pending(&self, st: &mut State<B>, c: usize, rs: usize) -> Option<(u64, Stamps)> {
        let h = st.chunks[c].handle?;
        let run = self.take_run(st, rs)?;
        let (first, end) = (c * self.chunk_units, (c + 1) * self.chunk_units);
        if rs < first {
            self.put_run(st, rs, first - rs, touching(&run.stamps, rs, first));
        }
        if rs + run.len > end {
            self.put_run(
                st,
                end,
                rs + run.len - end,
                touching(&run.stamps, end, rs + run.len),
            );
        }
        st.idle.remove(&c);
        st.chunks[c].used = self.chunk_units;
        let mine = touching(&run.stamps, first, end);
        st.retired.push((c, mine.clone()));
        Some((h, mine))
    }

    /// Unmaps retired chunks whose marks completed (querying at most `max` chunks; with
    /// `wait`, after waiting on the host), and frees their units.
    pub(super) fn poll(&self, st: &mut State<B>, b: &B, max: usize, wait: bool) {
        let mut i = 0;
        let mut seen = 0;
        while i < st.retired.len() && seen < max {
            seen += 1;
            let frees = st.retired[i].1.clone();
            if !self.frees_done(st, b, &frees, wait) {
                i += 1;
                continue;
            }
            let (c, _) = st.retired.swap_remove(i);
            // SAFETY: the chunk's old mapping (a chunk's bytes, by `map_chunks`); no block
            // holds its units, and the marks of their last frees completed.
            if unsafe { self.unmap_chunk(st, b, c) } {
                // The handle lives on in its new mapping.
                st.chunks[c].handle = None;
                self.give_back(st, c * self.chunk_units, self.chunk_units, Vec::new());
            }
            // Else the mapping stays: the units are never used again.
        }
    }

    /// Whether the work of every free of `frees` is known complete: settled (asking the
    /// driver at most once per stream and operation), or with `wait`, waited for on the
    /// host. Stops at the first that is not.
    fn frees_done(&self, st: &mut State<B>, b: &B, frees: &[Freed], wait: bool) -> bool {
        frees.iter().all(|s| {
            if wait {
                st.clocks.wait_done(b, s)
            } else {
                st.clocks.settle(b, s)
            }
        })
    }

    /// Unmaps chunk `c` (its handle stays recorded for the caller): whether it did; a
    /// failed unmap is counted and leaves the chunk stuck.
    ///
    /// # Safety
    /// 1. Chunk `c` is mapped with a chunk's bytes (by `map_chunks`).
    /// 2. No block holds a unit of it, and the work of every free of its units completed.
    unsafe fn unmap_chunk(&self, st: &mut State<B>, b: &B, c: usize) -> bool {
        let va = self.va_of(st, c * self.chunk_units);
        let cb = self.chunk_bytes();
        // SAFETY: 1 and 2 are the caller's: the range is a whole mapping, and no work
        // can touch it any more.
        match timed(&mut st.stats.driver_ns.unmap, || unsafe {
            self.phys.unmap(va, cb)
        }) {
            Ok(()) => {
                st.stats.unmaps += 1;
                b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                true
            }
            Err(e) => {
                record_drop_error("cuMemUnmap", e);
                st.chunks[c].stuck = true;
                false
            }
        }
    }
}
