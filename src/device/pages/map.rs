//! Placement and mapping: where a block goes among the free runs, and the handles mapped
//! under it (a spare one, one taken from an idle chunk by `reclaim.rs`, or a new one),
//! with one access call per span of chunks mapped together; and access for peers.
//! Where the unmapped chunks wholly inside a block, at least `group_min` of them (64 MiB:
//! `GROUP_MIN_BYTES`), would be filled with new handles only (no spare one, idle chunks
//! within the allowance), they are mapped as one *group*: one handle of their bytes, one
//! map, one access call (on the H200 a 256 MiB span costs 97 us instead of 919 us in
//! 16 MiB handles). A failed create of a group's handle falls back to one handle per
//! chunk (out-of-memory behaviour unchanged). Where the heap grows, the group also maps
//! chunks ahead of the block within the idle allowance's share (`growth_end`); a failed
//! create there retries without them.
//!
//! Invariants (under the heap's lock; mapping is done by the turn's holder with the lock
//! let go across each driver call, `held.rs`):
//! - a chunk has a handle exactly while it is mapped, and every mapping a block may use
//!   has access for the device and every peer in `peers` (a chunk mapped and not yet
//!   granted access is `granting`, and only the block being mapped is placed there): a span whose access call
//!   failed is unmapped again at once (its chunks' handles spare, a group's released); a
//!   chunk (or group) whose unmap fails there stays mapped without access and is *lost*:
//!   its units leave the free runs for good (`space.rs`), so no block is placed there.
//! - an allocation that takes a handle whose old work may be pending is ordered after it:
//!   the stamps of that work join both the allocation's and the chunk's free runs; a
//!   group's handle is always new (nothing to order after).

use super::clocks::{retag, Stamps};
use super::held::Held;
use super::{
    PageHeap, Reclaim, Reclaimed, State, GROWTH_GROUP_MIN, IDLE_FLOOR_CHUNKS, PLACE_TRIES, RECLAIM_TRIES,
};
use crate::cuda::record_drop_error;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::error::Result;
use crate::sync::lock;
use crate::trace::Code;

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Where a block of `n` units goes, and how many of its chunks are not ready (not
    /// mapped, or mapped and not yet granted access): the smallest free run that fits
    /// whose first `n` units are all ready, among the [`PLACE_TRIES`] smallest that fit;
    /// else the one of those with the fewest chunks not ready (the smallest among equals).
    pub(super) fn place(&self, st: &State<B>, n: usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for start in st.free.fitting(n).take(PLACE_TRIES) {
            let unready = self
                .chunks_of(start, n)
                .filter(|&(c, _)| st.chunks[c].handle.is_none() || st.chunks[c].granting)
                .count();
            if unready == 0 {
                return Some((start, 0));
            }
            if best.is_none_or(|(u, _)| unready < u) {
                best = Some((unready, start));
            }
        }
        best.map(|(unready, start)| (start, unready))
    }

    /// Maps every chunk of the run of `n` units from `start` that is not mapped,
    /// adding to `after` the marks of handles taken from chunks whose work is pending.
    pub(super) fn map_chunks(
        &self,
        st: &mut Held<'_, B>,
        b: &B,
        start: usize,
        n: usize,
        after: &mut Stamps,
    ) -> Result<()> {
        // The chunks the run touches: consecutive indices.
        let (mut i, end) = (start / self.chunk_units, (start + n).div_ceil(self.chunk_units));
        // The chunks wholly inside the run: only those may form a group, so that a group
        // is idle as a whole once its block is freed (a chunk shared with a neighbour
        // stays movable on its own).
        let (inner_lo, inner_hi) = (start.div_ceil(self.chunk_units), (start + n) / self.chunk_units);
        // Cleared by a failed create of a group's handle: the rest maps chunk by chunk.
        let mut grouping = true;
        // Cleared by a failed create of a growth group with chunks ahead of the block.
        let mut ahead = true;
        while i < end {
            if st.chunks[i].handle.is_some() {
                i += 1;
                continue;
            }
            let mut to = (i..end).find(|&c| st.chunks[c].handle.is_some()).unwrap_or(end);
            let (glo, ghi, min) = self.group_span(st, (i, to), (end, start + n), (inner_lo, inner_hi), ahead);
            if grouping && ghi > glo && self.group_fits(st, ghi - glo, min) {
                if glo > i {
                    // The partial chunk before the group, on its own.
                    to = glo;
                } else if self.map_group(st, b, i, ghi)? {
                    // Chunks mapped ahead of the block hold no unit of a block: idle.
                    st.idle.extend(end..ghi);
                    i = ghi;
                    continue;
                } else if ghi > end {
                    // No handle for the chunks ahead (a limit, out of memory): the
                    // block's own chunks alone.
                    ahead = false;
                    continue;
                } else {
                    grouping = false;
                }
            }
            i = self.map_each(st, b, i, to, after)?;
        }
        Ok(())
    }

    /// The chunks `glo..ghi` that may be mapped as one group from chunk `i` (unmapped up
    /// to `to`), and the fewest that make one. Growth (no chunk idle: the heap has no
    /// mapped memory to spare; the unmapped chunks run to the block's end chunk `end`)
    /// groups every new chunk to the end, its partial ones too: an unmapped chunk holds no
    /// other block, so the rest of it is free, and the heap would map it for this block
    /// anyway; with `ahead`, also the chunks [`growth_end`](Self::growth_end) adds after
    /// the block (whose last unit is before `block_end`). Elsewhere only the chunks wholly
    /// inside the block (`inner`).
    fn group_span(
        &self,
        st: &State<B>,
        (i, to): (usize, usize),
        (end, block_end): (usize, usize),
        (inner_lo, inner_hi): (usize, usize),
        ahead: bool,
    ) -> (usize, usize, usize) {
        let growth = to == end && st.idle.is_empty() && self.group_min != usize::MAX;
        if !growth {
            return (i.max(inner_lo), to.min(inner_hi), self.group_min);
        }
        let ghi = if ahead {
            self.growth_end(st, i, end, block_end)
        } else {
            end
        };
        (i, ghi, GROWTH_GROUP_MIN)
    }

    /// Where a growth's group from chunk `i` ends: the block's end chunk `end`, or
    /// further into the free run after the block (from unit `block_end`) by the chunks
    /// the idle allowance's share of the blocks holds (`block_bytes / idle_divisor`, not
    /// its floor: a small heap maps nothing ahead), the group at most `growth_ahead`
    /// chunks from `i`. The chunks ahead are idle memory the heap tolerates anyway,
    /// mapped with the block's in one call instead of one each later.
    fn growth_end(&self, st: &State<B>, i: usize, end: usize, block_end: usize) -> usize {
        let share = self.idle_share(st) / self.chunk_bytes();
        let want = i + share.min(self.growth_ahead);
        if want <= end {
            return end;
        }
        // The chunks wholly inside the free run after the block, up to the first one
        // mapped (a stuck chunk: mapped, free, and never idle).
        let run_end = block_end + st.free.len_at(block_end).unwrap_or(0);
        let stop = want.min(run_end / self.chunk_units).max(end);
        (end..stop)
            .find(|&c| st.chunks[c].handle.is_some())
            .unwrap_or(stop)
    }

    /// Maps unmapped chunks `from..to` one handle each, with one access call for those
    /// mapped: how far it got (to `to`, or the first chunk that is mapped).
    fn map_each(
        &self,
        st: &mut Held<'_, B>,
        b: &B,
        from: usize,
        to: usize,
        after: &mut Stamps,
    ) -> Result<usize> {
        let (i, failed) = self.map_span(st, b, from, to, after);
        let granted = if from < i {
            self.grant_span(st, b, from, i)
        } else {
            Ok(())
        };
        // The first error is the one reported.
        if let Some(e) = failed {
            return Err(e);
        }
        granted.map(|()| i)
    }

    /// Whether a span of `k` unmapped chunks would be filled with new handles only and
    /// is long enough for a group (`min` chunks): no spare handle, idle chunks within the
    /// allowance.
    fn group_fits(&self, st: &State<B>, k: usize, min: usize) -> bool {
        k >= min && st.spare.is_empty() && !self.idle_over_allowance(st)
    }

    /// Whether the idle chunks exceed the allowance (a handle is then moved from one
    /// rather than made).
    fn idle_over_allowance(&self, st: &State<B>) -> bool {
        let idle_bytes = st.idle.len() * self.chunk_bytes();
        idle_bytes > self.idle_share(st).max(IDLE_FLOOR_CHUNKS * self.chunk_bytes())
    }

    /// The idle bytes the heap tolerates for its blocks: `1/idle_divisor` of them (the
    /// allowance without its floor; what a growth may map ahead).
    fn idle_share(&self, st: &State<B>) -> usize {
        st.stats.block_bytes / self.idle_divisor
    }

    /// Maps unmapped chunks `from..to` as one group: one new handle of their bytes, one
    /// map, one access call. `Ok(false)` (nothing changed) if the handle could not be
    /// charged or created; an error if the map or the access call failed (the group
    /// unmapped again and released, or lost where its unmap failed too).
    fn map_group(&self, st: &mut Held<'_, B>, b: &B, from: usize, to: usize) -> Result<bool> {
        let (k, bytes) = (to - from, (to - from) * self.chunk_bytes());
        let Ok(h) = self.create_handle(st, bytes) else {
            return Ok(false);
        };
        st.stats.group_creates += 1;
        let va = self.va_of(st, from * self.chunk_units);
        // SAFETY: chunks from..to are consecutive in one region (a run's chunks) and none
        // is mapped; h is new, of their bytes.
        if let Err(e) = st.driver(|ns| &mut ns.map, || unsafe { self.phys.map(va, bytes, h) }) {
            // SAFETY: h was never mapped, and is forgotten here.
            unsafe { self.release_handle(st, h, bytes) };
            return Err(e);
        }
        for ch in &mut st.chunks[from..to] {
            ch.handle = Some(h);
            ch.group = Some((from, k));
            ch.granting = true;
        }
        st.stats.maps += 1;
        b.trace().segment(Code::SegmentMap, va as usize, bytes);
        st.stats.accesses += 1;
        let peers = st.peers.clone();
        let access = st.driver(
            |ns| &mut ns.access,
            // SAFETY: the group was just mapped whole.
            || unsafe { self.phys.set_access(va, bytes, &peers) },
        );
        let Err(e) = access else {
            self.granted(st, from, to);
            return Ok(true);
        };
        st.stats.access_failures += 1;
        // SAFETY: mapped just above as one mapping of h, with no work queued on it.
        unsafe { self.undo_group(st, b, (from, to), h, va) };
        Err(e)
    }

    /// Unmaps group `from..to` (at `va`, handle `h`) whose access call failed and releases
    /// its handle; where the unmap fails too, its chunks are lost (never used again).
    ///
    /// # Safety
    /// 1. The group is one mapping of `h` at `va`, and no work was queued on it.
    unsafe fn undo_group(&self, st: &mut Held<'_, B>, b: &B, (from, to): (usize, usize), h: u64, va: u64) {
        let bytes = (to - from) * self.chunk_bytes();
        // SAFETY: obligation 1.
        match st.driver(|ns| &mut ns.unmap, || unsafe { self.phys.unmap(va, bytes) }) {
            Ok(()) => {
                st.stats.unmaps += 1;
                b.trace().segment(Code::SegmentUnmap, va as usize, bytes);
                for ch in &mut st.chunks[from..to] {
                    ch.handle = None;
                    ch.group = None;
                    ch.granting = false;
                }
                // SAFETY: just unmapped, its only mapping; forgotten here.
                unsafe { self.release_handle(st, h, bytes) };
                st.stats.group_releases += 1;
            }
            Err(e) => {
                record_drop_error("cuMemUnmap", e);
                self.lose_chunks(st, from, to);
            }
        }
    }

    /// Maps a handle at each chunk from `from` on, up to `end` or the first chunk that is
    /// mapped: how far it got, and the error that stopped it before `end`, if one did.
    fn map_span(
        &self,
        st: &mut Held<'_, B>,
        b: &B,
        from: usize,
        end: usize,
        after: &mut Stamps,
    ) -> (usize, Option<crate::error::Error>) {
        let mut i = from;
        while i < end && st.chunks[i].handle.is_none() {
            if let Err(e) = self.map_one(st, b, i, after) {
                return (i, Some(e));
            }
            i += 1;
        }
        (i, None)
    }

    /// Maps a handle at chunk `c` (not mapped), without access yet.
    fn map_one(&self, st: &mut Held<'_, B>, b: &B, c: usize, after: &mut Stamps) -> Result<()> {
        let cb = self.chunk_bytes();
        let (h, pending) = self.handle(st, b)?;
        let first = c * self.chunk_units;
        if !pending.is_empty() {
            // The handle's old work may touch any part of it: the free units of the chunk
            // pass its marks on too.
            let pending = retag(pending, first, first + self.chunk_units);
            self.stamp_free(st, first, first + self.chunk_units, &pending);
            let s: &mut State<B> = st;
            s.clocks.merge(after, pending);
        }
        let va = self.va_of(st, first);
        // SAFETY: the chunk lies in a reserved region, and nothing is mapped there (no
        // handle is recorded for it); h is live, of a chunk's bytes, and mapped nowhere
        // (spare, unmapped from an idle chunk, or new) or only at a retired chunk whose
        // work the allocation is ordered after.
        if let Err(e) = st.driver(|ns| &mut ns.map, || unsafe { self.phys.map(va, cb, h) }) {
            st.spare.push(h);
            return Err(e);
        }
        st.chunks[c].handle = Some(h);
        st.chunks[c].granting = true;
        st.stats.maps += 1;
        b.trace().segment(Code::SegmentMap, va as usize, cb);
        Ok(())
    }

    /// Sets access on chunks `from..to` (consecutive, just mapped) for the device and its
    /// peers; where that fails, unmaps them again (their handles spare; a chunk whose
    /// unmap fails stays mapped without access, lost: its units out of the free runs).
    fn grant_span(&self, st: &mut Held<'_, B>, b: &B, from: usize, to: usize) -> Result<()> {
        let cb = self.chunk_bytes();
        let va = self.va_of(st, from * self.chunk_units);
        st.stats.accesses += 1;
        let peers = st.peers.clone();
        let access = st.driver(
            |ns| &mut ns.access,
            // SAFETY: chunks from..to are consecutive and were all mapped by `map_span`.
            || unsafe { self.phys.set_access(va, (to - from) * cb, &peers) },
        );
        let Err(e) = access else {
            self.granted(st, from, to);
            return Ok(());
        };
        st.stats.access_failures += 1;
        for c in from..to {
            let va = self.va_of(st, c * self.chunk_units);
            // SAFETY: mapped by `map_span`, and no work was queued on it.
            match st.driver(|ns| &mut ns.unmap, || unsafe { self.phys.unmap(va, cb) }) {
                Ok(()) => {
                    b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                    st.chunks[c].granting = false;
                    if let Some(h) = st.chunks[c].handle.take() {
                        st.spare.push(h);
                    }
                }
                Err(e) => {
                    record_drop_error("cuMemUnmap", e);
                    self.lose_chunks(st, c, c + 1);
                }
            }
        }
        Err(e)
    }

    /// A handle for a chunk, with the marks its previous users' work must be ordered
    /// after: a spare one, one unmapped from an idle chunk whose work completed, a new
    /// one, or (when none can be made) one of an idle chunk whose work is pending, mapped
    /// anew while its old mapping is retired.
    ///
    /// Where it would take a handle from an idle chunk of a group, it releases the group
    /// instead (its handle is never mapped elsewhere) and goes on: to create (the heap
    /// reserved no more for it), and out of memory, to retry the create.
    fn handle(&self, st: &mut Held<'_, B>, b: &B) -> Result<(u64, Stamps)> {
        if let Some(h) = st.spare.pop() {
            return Ok((h, Vec::new()));
        }
        // Idle chunks stay mapped for the blocks that fit there, up to an allowance;
        // beyond it one is moved (its work completed, else pending) before new memory is
        // made. Moving costs an unmap and a map where making costs a map: an allowance of
        // none would move chunks back and forth (on the H200, 20 s for RMM's workload).
        if self.idle_over_allowance(st) {
            if let Some(Reclaimed::Handle(h, pending)) = self.reclaim(st, b, RECLAIM_TRIES, Reclaim::Retire) {
                return Ok((h, pending));
            }
        }
        let chunk = self.chunk_bytes();
        loop {
            // At the pool's limit (an error of the reservation) only an idle chunk can
            // serve, or the memory of an idle group (the cache's recovery runs next).
            match self.create_handle(st, chunk) {
                Ok(h) => return Ok((h, Vec::new())),
                Err(e) if e.is_out_of_memory() => match self.reclaim(st, b, usize::MAX, Reclaim::Retire) {
                    Some(Reclaimed::Handle(h, pending)) => return Ok((h, pending)),
                    // Memory given back: the create may succeed now.
                    Some(Reclaimed::Released) => continue,
                    None => return Err(e),
                },
                Err(e) => return Err(e),
            }
        }
    }

    /// A new handle of `bytes`, charged to the pool's reservations first (given back if
    /// the create fails) and counted in the stats: the one place handles are made (see
    /// `release_handle` for the other end).
    fn create_handle(&self, st: &mut Held<'_, B>, bytes: usize) -> Result<u64> {
        self.reservations.take(bytes)?;
        let h = st
            .driver(|ns| &mut ns.create, || self.phys.create(bytes))
            .inspect_err(|_| self.reservations.give(bytes))?;
        st.stats.creates += 1;
        st.stats.reserved += bytes;
        st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
        Ok(h)
    }

    /// Lets device `peer` access every block, present and future: access is set on every
    /// mapped chunk (span by span) and every later mapping includes it. With the turn, so
    /// no mapping is made meanwhile without it. On an error the peer is not recorded
    /// (some chunks may have access already).
    pub(crate) fn enable_peer(&self, peer: usize) -> Result<()> {
        let mut st = self.held();
        st.take_turn();
        let granted = if st.peers.contains(&peer) {
            Ok(())
        } else {
            self.grant_peer(&mut st, peer)
        };
        st.end_turn();
        granted
    }

    /// With the turn: sets access for `peer` on every mapped chunk, then records it.
    fn grant_peer(&self, st: &mut Held<'_, B>, peer: usize) -> Result<()> {
        let cb = self.chunk_bytes();
        let mut c = 0;
        while c < st.chunks.len() {
            if st.chunks[c].handle.is_none() {
                c += 1;
                continue;
            }
            // A span of mapped chunks (never across regions: a chunk of the index space
            // between regions is never mapped).
            let from = c;
            while c < st.chunks.len() && st.chunks[c].handle.is_some() {
                c += 1;
            }
            let va = self.va_of(st, from * self.chunk_units);
            st.stats.accesses += 1;
            st.driver(
                |ns| &mut ns.access,
                // SAFETY: every chunk with a handle is mapped (in blocks, idle, retired
                // or stuck), and chunks from..c are consecutive in one region; only the
                // turn's holder maps or unmaps, so they stay so while the lock is let go.
                || unsafe { self.phys.set_access(va, (c - from) * cb, &[peer]) },
            )?;
        }
        st.peers.push(peer);
        Ok(())
    }

    /// Marks chunks `from..to`, just granted access, ready for any block.
    fn granted(&self, st: &mut State<B>, from: usize, to: usize) {
        for ch in &mut st.chunks[from..to] {
            ch.granting = false;
        }
    }

    /// Whether [`enable_peer`](Self::enable_peer) gave `peer` access.
    pub(crate) fn has_peer(&self, peer: usize) -> bool {
        lock(&self.state).peers.contains(&peer)
    }
}
