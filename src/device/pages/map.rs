//! Placement and mapping: where a block goes among the free runs, and the handles mapped
//! under it (a spare one, one taken from an idle chunk by `reclaim.rs`, or a new one),
//! with one access call per span of chunks mapped together; and access for peers.
//!
//! Invariants (under the heap's lock):
//! - a chunk has a handle exactly while it is mapped, and every mapping has access for
//!   the device and every peer in `peers`: a span whose access call failed is unmapped
//!   again at once, its handles spare. (Not quite: a chunk whose unmap fails there stays
//!   mapped, stuck, without access, and its units go back to the free runs; a later
//!   block placed there would fault. Kept as it was, for now: issue 23.)
//! - an allocation that takes a handle whose old work may be pending is ordered after it:
//!   the stamps of that work join both the allocation's and the chunk's free runs.

use super::clocks::{retag, Stamps};
use super::stats::timed;
use super::{PageHeap, Reclaim, State, IDLE_FLOOR_CHUNKS, PLACE_TRIES, RECLAIM_TRIES};
use crate::cuda::record_drop_error;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::error::Result;
use crate::sync::lock;
use crate::trace::Code;

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Where a block of `n` units goes: the smallest free run that fits whose first `n`
    /// units are all mapped, among the [`PLACE_TRIES`] smallest that fit; else the one of
    /// those with the fewest chunks to map (the smallest among equals).
    pub(super) fn place(&self, st: &State<B>, n: usize) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None;
        for start in st.free.fitting(n).take(PLACE_TRIES) {
            let unmapped = self
                .chunks_of(start, n)
                .filter(|&(c, _)| st.chunks[c].handle.is_none())
                .count();
            if unmapped == 0 {
                return Some(start);
            }
            if best.is_none_or(|(u, _)| unmapped < u) {
                best = Some((unmapped, start));
            }
        }
        best.map(|(_, start)| start)
    }

    /// Maps every chunk of the run of `n` units from `start` that is not mapped,
    /// adding to `after` the marks of handles taken from chunks whose work is pending.
    pub(super) fn map_chunks(
        &self,
        st: &mut State<B>,
        b: &B,
        start: usize,
        n: usize,
        after: &mut Stamps,
    ) -> Result<()> {
        // The chunks the run touches: consecutive indices.
        let (mut i, end) = (start / self.chunk_units, (start + n).div_ceil(self.chunk_units));
        while i < end {
            if st.chunks[i].handle.is_some() {
                i += 1;
                continue;
            }
            // A span of unmapped chunks: a handle mapped at each, one access call.
            let from = i;
            let failed;
            (i, failed) = self.map_span(st, b, from, end, after);
            let granted = if from < i {
                self.grant_span(st, b, from, i)
            } else {
                Ok(())
            };
            // The first error is the one reported.
            if let Some(e) = failed {
                return Err(e);
            }
            granted?;
        }
        Ok(())
    }

    /// Maps a handle at each chunk from `from` on, up to `end` or the first chunk that is
    /// mapped: how far it got, and the error that stopped it before `end`, if one did.
    fn map_span(
        &self,
        st: &mut State<B>,
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
    fn map_one(&self, st: &mut State<B>, b: &B, c: usize, after: &mut Stamps) -> Result<()> {
        let cb = self.chunk_bytes();
        let (h, pending) = self.handle(st, b)?;
        let first = c * self.chunk_units;
        if !pending.is_empty() {
            // The handle's old work may touch any part of it: the free units of the chunk
            // pass its marks on too.
            let pending = retag(pending, first, first + self.chunk_units);
            self.stamp_free(st, first, first + self.chunk_units, &pending);
            st.clocks.merge(after, pending);
        }
        let va = self.va_of(st, first);
        // SAFETY: the chunk lies in a reserved region, and nothing is mapped there (no
        // handle is recorded for it); h is live, of a chunk's bytes, and mapped nowhere
        // (spare, unmapped from an idle chunk, or new) or only at a retired chunk whose
        // work the allocation is ordered after.
        if let Err(e) = timed(&mut st.stats.driver_ns.map, || unsafe {
            self.phys.map(va, cb, h)
        }) {
            st.spare.push(h);
            return Err(e);
        }
        st.chunks[c].handle = Some(h);
        st.stats.maps += 1;
        b.trace().segment(Code::SegmentMap, va as usize, cb);
        Ok(())
    }

    /// Sets access on chunks `from..to` (consecutive, just mapped) for the device and its
    /// peers; where that fails, unmaps them again (their handles spare; a chunk whose
    /// unmap fails stays mapped and stuck).
    fn grant_span(&self, st: &mut State<B>, b: &B, from: usize, to: usize) -> Result<()> {
        let cb = self.chunk_bytes();
        let va = self.va_of(st, from * self.chunk_units);
        st.stats.accesses += 1;
        // SAFETY: chunks from..to are consecutive and were all mapped by `map_span`.
        let access = timed(&mut st.stats.driver_ns.access, || unsafe {
            self.phys.set_access(va, (to - from) * cb, &st.peers)
        });
        let Err(e) = access else {
            return Ok(());
        };
        for c in from..to {
            let va = self.va_of(st, c * self.chunk_units);
            // SAFETY: mapped by `map_span`, and no work was queued on it.
            match unsafe { self.phys.unmap(va, cb) } {
                Ok(()) => {
                    b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                    if let Some(h) = st.chunks[c].handle.take() {
                        st.spare.push(h);
                    }
                }
                Err(e) => {
                    record_drop_error("cuMemUnmap", e);
                    st.chunks[c].stuck = true;
                }
            }
        }
        Err(e)
    }

    /// A handle for a chunk, with the marks its previous users' work must be ordered
    /// after: a spare one, one unmapped from an idle chunk whose work completed, a new
    /// one, or (when none can be made) one of an idle chunk whose work is pending, mapped
    /// anew while its old mapping is retired.
    fn handle(&self, st: &mut State<B>, b: &B) -> Result<(u64, Stamps)> {
        if let Some(h) = st.spare.pop() {
            return Ok((h, Vec::new()));
        }
        // Idle chunks stay mapped for the blocks that fit there, up to an allowance;
        // beyond it one is moved (its work completed, else pending) before new memory is
        // made. Moving costs an unmap and a map where making costs a map: an allowance of
        // none would move chunks back and forth (on the H200, 20 s for RMM's workload).
        let idle_bytes = st.idle.len() * self.chunk_bytes();
        if idle_bytes > (st.stats.block_bytes / self.idle_divisor).max(IDLE_FLOOR_CHUNKS * self.chunk_bytes())
        {
            if let Some(h) = self.reclaim(st, b, RECLAIM_TRIES, Reclaim::Retire) {
                return Ok(h);
            }
        }
        let chunk = self.chunk_bytes();
        if let Err(e) = self.reservations.take(chunk) {
            // At the pool's limit: only an idle chunk can serve (the cache's recovery runs
            // next).
            return self.reclaim(st, b, usize::MAX, Reclaim::Retire).ok_or(e);
        }
        match timed(&mut st.stats.driver_ns.create, || self.phys.create(chunk)) {
            Err(e) => {
                self.reservations.give(chunk);
                if e.is_out_of_memory() {
                    self.reclaim(st, b, usize::MAX, Reclaim::Retire).ok_or(e)
                } else {
                    Err(e)
                }
            }
            Ok(h) => {
                st.stats.creates += 1;
                st.stats.reserved += self.chunk_bytes();
                st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
                Ok((h, Vec::new()))
            }
        }
    }

    /// Lets device `peer` access every block, present and future: access is set on every
    /// mapped chunk (span by span) and every later mapping includes it. Under the heap's
    /// lock, so no mapping is made meanwhile without it. On an error the peer is not
    /// recorded (some chunks may have access already).
    pub(crate) fn enable_peer(&self, peer: usize) -> Result<()> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        if st.peers.contains(&peer) {
            return Ok(());
        }
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
            // SAFETY: every chunk with a handle is mapped (in blocks, idle, retired or
            // stuck), and chunks from..c are consecutive in one region.
            timed(&mut st.stats.driver_ns.access, || unsafe {
                self.phys.set_access(va, (c - from) * cb, &[peer])
            })?;
        }
        st.peers.push(peer);
        Ok(())
    }

    /// Whether [`enable_peer`](Self::enable_peer) gave `peer` access.
    pub(crate) fn has_peer(&self, peer: usize) -> bool {
        lock(&self.state).peers.contains(&peer)
    }
}
