//! Taking handles back from idle chunks, and the retired chunks: an idle chunk whose
//! frees completed is unmapped and its handle taken; one whose frees may be pending is
//! *retired* (carved out of its free run, its old mapping kept) while its handle is
//! mapped elsewhere, and [`poll`](PageHeap::poll) unmaps it once they complete. A group
//! (one handle over several chunks) is taken only whole: unmapped and its handle
//! released, once all its chunks are idle and their frees completed.
//!
//! All of it runs with the turn (`held.rs`): an idle chunk's units leave the free runs
//! (carved) before the lock is let go for its unmap, and come back after it.
//!
//! Invariants (under the heap's lock):
//! - a chunk is unmapped only once the work of every free that touched its units is
//!   known complete (asked with the lock let go; a trim waits on the host first), and never while a block holds
//!   one of its units;
//! - a retired chunk has no unit in a free run or a block (`used` is all of them), keeps
//!   its handle recorded until its old mapping goes, and holds the stamps of its frees;
//!   an allocation that maps its handle elsewhere is ordered after those stamps;
//! - a group is never retired and its handle never taken: it is unmapped as one mapping
//!   (all of its chunks idle, the frees of all its units complete) and released at once,
//!   so `stats.reserved` and the reservations drop by its bytes; one whose frees may be
//!   pending is skipped (a 1-chunk user cannot take a k-chunk handle).

use std::ops::ControlFlow;

use super::clocks::{touching, Stamps};
use super::held::{Held, Settled};
use super::{PageHeap, Reclaim, Reclaimed, State};
use crate::cuda::record_drop_error;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::trace::Code;

/// What trying one idle chunk (or its group) came to ([`PageHeap::take_idle`]).
enum Tried {
    /// Unmapped: its handle (none if it had none), or `Released` for a group.
    Taken(Option<Reclaimed>),
    /// Its frees may be pending.
    Pending,
    /// Passed over; the search goes on below the given chunk.
    Passed(usize),
    /// The driver was asked whether its frees completed, the lock let go.
    Asked,
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Takes the handle of an idle chunk (trying at most `tries`, from the highest
    /// address), as `how` says, with the marks to order its next use after.
    pub(super) fn reclaim(
        &self,
        st: &mut Held<'_, B>,
        b: &B,
        tries: usize,
        how: Reclaim,
    ) -> Option<Reclaimed> {
        let pending = match self.take_idle(st, b, tries) {
            ControlFlow::Break(taken) => return taken,
            ControlFlow::Continue(pending) => pending,
        };
        let c = pending.filter(|_| how == Reclaim::Retire)?;
        // Looked up again: the lock may have been let go since (unmapping another chunk),
        // and a block may have taken the chunk meanwhile.
        if !st.idle.contains(&c) {
            return None;
        }
        let (rs, _, _) = st.free.at_or_before(c * self.chunk_units)?;
        let (h, stamps) = self.retire_pending(st, c, rs)?;
        Some(Reclaimed::Handle(h, stamps))
    }

    /// Unmaps the first idle chunk (of at most `tries`, from the highest address) whose
    /// frees completed and breaks with its
    /// handle (`None` if it had none), or with `Released` where that chunk is of a group
    /// (wholly idle: unmapped and released whole); else continues with the first chunk
    /// (not of a group) found pending. Where the frees of a chunk's units are not known
    /// complete, their streams are asked ([`settled`](Self::settled), the lock let go) and
    /// the chunk is looked up again: no lock is let go between finding a chunk's run and
    /// carving it.
    fn take_idle(
        &self,
        st: &mut Held<'_, B>,
        b: &B,
        tries: usize,
    ) -> ControlFlow<Option<Reclaimed>, Option<usize>> {
        let mut below = usize::MAX;
        let mut pending = None;
        let mut tried = 0;
        while tried < tries {
            let Some(&c) = st.idle.range(..below).next_back() else {
                break;
            };
            tried += 1;
            let outcome = match st.chunks[c].group {
                Some((g, k)) => match self.release_idle_group(st, b, g, k) {
                    Some(true) => Tried::Taken(Some(Reclaimed::Released)),
                    Some(false) => Tried::Passed(g),
                    None => Tried::Asked,
                },
                None => self.take_idle_chunk(st, b, c),
            };
            below = match outcome {
                Tried::Taken(r) => return ControlFlow::Break(r),
                Tried::Pending => {
                    pending = pending.or(Some(c));
                    c
                }
                Tried::Passed(below) => below,
                // The driver was asked (the lock let go): the same chunk is looked up
                // again; each stream is asked once per operation, so this ends.
                Tried::Asked => {
                    tried -= 1;
                    c + 1
                }
            };
        }
        ControlFlow::Continue(pending)
    }

    /// Tries idle chunk `c` (not of a group): unmaps it if the frees of its units
    /// completed.
    fn take_idle_chunk(&self, st: &mut Held<'_, B>, b: &B, c: usize) -> Tried {
        let first = c * self.chunk_units;
        let Some((rs, _, stamps)) = st.free.at_or_before(first) else {
            return Tried::Passed(c);
        };
        let frees = touching(stamps, first, first + self.chunk_units);
        match self.settled(st, b, &frees) {
            Settled::Done => {}
            Settled::Pending => return Tried::Pending,
            Settled::Asked => return Tried::Asked,
        }
        let Some(stamps) = self.carve(st, c, 1, rs) else {
            return Tried::Passed(c);
        };
        // SAFETY: the chunk was mapped by `map_chunks` with a chunk's bytes; no block holds
        // a unit of it (nor can: its units are carved out), and the marks of every free of
        // its units completed (a run keeps the latest mark of each stream until it
        // completes).
        let unmapped = unsafe { self.unmap_chunks(st, b, c, 1) };
        let h = if unmapped {
            st.chunks[c].handle.take()
        } else {
            None
        };
        self.give_back(st, first, self.chunk_units, stamps);
        match unmapped {
            true => Tried::Taken(h.map(|h| Reclaimed::Handle(h, Vec::new()))),
            false => Tried::Passed(c),
        }
    }

    /// Unmaps and releases group `g..g + k` if all of its chunks are idle and the frees of
    /// all its units completed: whether it did, or `None` where it asked the driver
    /// whether they completed (the lock let go: the caller looks again). A group that
    /// fails its unmap stays mapped, its chunks stuck.
    fn release_idle_group(&self, st: &mut Held<'_, B>, b: &B, g: usize, k: usize) -> Option<bool> {
        if !(g..g + k).all(|c| st.idle.contains(&c)) {
            return Some(false);
        }
        let (first, end) = (g * self.chunk_units, (g + k) * self.chunk_units);
        // All its units are free, so one maximal run holds them.
        let Some((rs, len, stamps)) = st.free.at_or_before(first) else {
            return Some(false);
        };
        debug_assert!(rs + len >= end, "page heap: an idle group's units in two runs");
        let frees = touching(stamps, first, end);
        match self.settled(st, b, &frees) {
            Settled::Done => {}
            Settled::Pending => return Some(false),
            Settled::Asked => return None,
        }
        let Some(h) = st.chunks[g].handle else {
            return Some(false);
        };
        let Some(stamps) = self.carve(st, g, k, rs) else {
            return Some(false);
        };
        // SAFETY: the group was mapped whole by `map_group` (k chunks' bytes, one handle);
        // no block holds a unit of it (nor can: its units are carved out) and the marks
        // of every free of its units completed.
        let unmapped = unsafe { self.unmap_chunks(st, b, g, k) };
        if unmapped {
            for c in g..g + k {
                st.chunks[c].handle = None;
                st.chunks[c].group = None;
            }
            // SAFETY: its only mapping just went (a group's handle is mapped nowhere
            // else), and it is forgotten here.
            unsafe { self.release_handle(st, h, k * self.chunk_bytes()) };
            st.stats.group_releases += 1;
        }
        self.give_back(st, first, end - first, stamps);
        Some(unmapped)
    }

    /// Releases `h`, of `bytes`, mapped nowhere: `stats.reserved` and the reservations
    /// drop by its bytes (a failed release is counted, and they do not).
    ///
    /// # Safety
    /// 1. `h` is live, of `bytes`, mapped nowhere, and forgotten by the caller.
    pub(super) unsafe fn release_handle(&self, st: &mut Held<'_, B>, h: u64, bytes: usize) {
        // SAFETY: obligation 1.
        match st.driver(|ns| &mut ns.release, || unsafe { self.phys.release(h) }) {
            Ok(()) => {
                st.stats.reserved -= bytes;
                self.reservations.give(bytes);
                st.stats.releases += 1;
            }
            Err(e) => record_drop_error("cuMemRelease", e),
        }
    }

    /// Carves idle chunk `c` out of its free run (from unit `rs`): its units stay mapped,
    /// out of use, until the run's marks complete ([`poll`](Self::poll)); its handle, with
    /// those marks, goes to a new mapping.
    fn retire_pending(&self, st: &mut State<B>, c: usize, rs: usize) -> Option<(u64, Stamps)> {
        let h = st.chunks[c].handle?;
        let mine = self.carve(st, c, 1, rs)?;
        st.retired.push((c, mine.clone()));
        Some((h, mine))
    }

    /// Unmaps retired chunks whose marks completed (querying at most `max` chunks), and
    /// frees their units.
    pub(super) fn poll(&self, st: &mut Held<'_, B>, b: &B, max: usize) {
        let mut i = 0;
        let mut seen = 0;
        while i < st.retired.len() && seen < max {
            let frees = st.retired[i].1.clone();
            match self.settled(st, b, &frees) {
                Settled::Done => {}
                Settled::Pending => {
                    (i, seen) = (i + 1, seen + 1);
                    continue;
                }
                // Looked at again: each stream is asked once per operation.
                Settled::Asked => continue,
            }
            seen += 1;
            let (c, _) = st.retired.swap_remove(i);
            // SAFETY: the chunk's old mapping (a chunk's bytes, by `map_chunks`; a group is
            // never retired); no block holds its units, and the marks of their last frees
            // completed.
            if unsafe { self.unmap_chunks(st, b, c, 1) } {
                // The handle lives on in its new mapping.
                st.chunks[c].handle = None;
                self.give_back(st, c * self.chunk_units, self.chunk_units, Vec::new());
            }
            // Else the mapping stays: the units are never used again.
        }
    }

    /// Unmaps the mapping of chunks `c..c + k` (their handle stays recorded for the
    /// caller): whether it did; a failed unmap is counted and leaves the chunks stuck.
    ///
    /// # Safety
    /// 1. Chunks `c..c + k` are one mapping (by `map_chunks`: one chunk, or a group).
    /// 2. No block holds a unit of it, nor can while the lock is let go (its units are
    ///    out of the free runs), and the work of every free of its units completed.
    unsafe fn unmap_chunks(&self, st: &mut Held<'_, B>, b: &B, c: usize, k: usize) -> bool {
        let va = self.va_of(st, c * self.chunk_units);
        let cb = k * self.chunk_bytes();
        // SAFETY: 1 and 2 are the caller's: the range is a whole mapping, and no work
        // can touch it any more.
        match st.driver(|ns| &mut ns.unmap, || unsafe { self.phys.unmap(va, cb) }) {
            Ok(()) => {
                st.stats.unmaps += 1;
                b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                true
            }
            Err(e) => {
                record_drop_error("cuMemUnmap", e);
                for ch in &mut st.chunks[c..c + k] {
                    ch.stuck = true;
                }
                false
            }
        }
    }
}
