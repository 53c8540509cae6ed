//! The page heap's address space: regions of reserved virtual addresses cut into units,
//! the chunks of physical memory over them, and the free runs of units (the index of
//! `device/runs.rs`, each run with the stamps of the frees that touched it). Bookkeeping
//! only, apart from reserving and freeing regions: mapping is in `map.rs`, unmapping in
//! `reclaim.rs`.
//!
//! Invariants (under the heap's lock):
//! - regions are in increasing order of first unit, a chunk apart in the index space, so
//!   that no free run and no span of mapped chunks reaches from one region into the next;
//! - every unit of a region is in exactly one of: a live block, a free run, a retired
//!   chunk (or a chunk that stuck while retired: its unmap failed, and its units are
//!   never used again), a *lost* chunk (mapped without access: its access call and then
//!   its unmap failed; its units are never used again);
//! - free runs are maximal (two free runs never touch): a run is put back as it is only
//!   where its neighbours are a block or a retired chunk, else through [`give_back`];
//! - `chunks[c].used` is the number of units of chunk c in blocks (all of them while it
//!   is retired or lost), and `idle` holds exactly the chunks with a handle, none used,
//!   not stuck;
//! - a *group* is a span of chunks `g..g + k` (k >= 2, in one region) mapped with ONE
//!   handle of k chunks (`map.rs`): each of its chunks records `group == Some((g, k))`
//!   and the same handle, and is used and idle on its own like any chunk (a block placed
//!   there maps nothing). A group is unmapped only as a whole (one mapping), when all of
//!   its chunks are idle and the frees of all its units completed, and its handle is
//!   then released, never spare, never mapped elsewhere, never retired (`reclaim.rs`).
//!   A group whose unmap fails stays mapped whole (its chunks stuck, or lost).
//!
//! [`give_back`]: super::PageHeap::give_back

use super::clocks::{touching, Stamps};
use super::held::Held;
use super::{PageHeap, State};
use crate::cuda::record_drop_error;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::error::{Error, Result};

/// A maximal run of free units.
pub(super) struct Run {
    pub(super) len: usize,
    pub(super) stamps: Stamps,
}

/// One chunk of a region's units.
#[derive(Default)]
pub(super) struct Chunk {
    /// The handle mapped there.
    pub(super) handle: Option<u64>,
    /// Granules of the chunk in blocks.
    pub(super) used: usize,
    /// An unmap failed: the mapping stays, and the chunk is never unmapped again.
    pub(super) stuck: bool,
    /// Stuck without access (a span's access call failed, then this chunk's unmap): its
    /// units are out of the free runs for good (`used` is all of them).
    pub(super) lost: bool,
    /// The group this chunk is part of: (its first chunk, its chunks), all mapped with
    /// one handle (see the module docs).
    pub(super) group: Option<(usize, usize)>,
    /// Mapped, access not granted yet: the turn's holder is mapping it for a block, and
    /// no other block is placed there (`held.rs`).
    pub(super) granting: bool,
}

/// A reserved range of virtual addresses: units `first..first + units` of the
/// heap's index space.
pub(super) struct Region {
    pub(super) first: usize,
    pub(super) units: usize,
    pub(super) va: u64,
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    pub(super) fn chunk_bytes(&self) -> usize {
        self.chunk_units * self.unit
    }

    /// The address of unit `g` (in a region).
    pub(super) fn va_of(&self, st: &State<B>, g: usize) -> u64 {
        let i = st.regions.partition_point(|r| r.first <= g) - 1;
        let r = &st.regions[i];
        debug_assert!(g < r.first + r.units);
        r.va + ((g - r.first) * self.unit) as u64
    }

    /// The chunks a run of `len` units from `start` touches, with the units of each
    /// inside the run.
    pub(super) fn chunks_of(&self, start: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
        let cg = self.chunk_units;
        let end = start + len;
        (start / cg..end.div_ceil(cg)).map(move |c| (c, end.min((c + 1) * cg) - start.max(c * cg)))
    }

    /// With the turn: reserves a region for at least `n` units; returns its first unit
    /// (a free run of the whole region).
    pub(super) fn add_region(&self, st: &mut Held<'_, B>, n: usize) -> Result<usize> {
        let cu = self.chunk_units;
        let too_large = || Error::OutOfMemory {
            requested: n.saturating_mul(self.unit),
        };
        let units = (self.region_bytes / self.unit)
            .max(n)
            .checked_next_multiple_of(cu)
            .ok_or_else(too_large)?;
        let bytes = units.checked_mul(self.unit).ok_or_else(too_large)?;
        // The region's bookkeeping first (a chunk entry for every chunk of the range): a
        // request the heap cannot even describe fails here, before any driver call, with
        // nothing changed, instead of aborting in an infallible `Vec` growth.
        let first = st.next_index;
        let next = first
            .checked_add(units)
            .and_then(|n| n.checked_add(cu))
            .ok_or_else(too_large)?;
        let chunks = next / cu;
        let more = chunks.saturating_sub(st.chunks.len());
        st.chunks.try_reserve(more).map_err(|_| too_large())?;
        st.regions.try_reserve(1).map_err(|_| too_large())?;
        let va = st.unlocked(|| self.phys.reserve(bytes))?;
        // With the turn (the caller's): no other thread added a region meanwhile.
        debug_assert_eq!(st.next_index, first, "page heap: a region added without the turn");
        st.stats.range_reserves += 1;
        st.next_index = next;
        st.regions.push(Region { first, units, va });
        st.chunks.resize_with(chunks, Chunk::default);
        self.put_run(st, first, units, Vec::new());
        Ok(first)
    }

    /// Frees the regions with no block and no mapping (with the turn: each region's run
    /// leaves the free runs before the lock is let go for the driver call).
    pub(super) fn free_empty_regions(&self, st: &mut Held<'_, B>) {
        let cu = self.chunk_units;
        let mut i = 0;
        while i < st.regions.len() {
            let r = &st.regions[i];
            let (first, units, va) = (r.first, r.units, r.va);
            let empty = st.free.len_at(first) == Some(units)
                && (first / cu..(first + units) / cu).all(|c| st.chunks[c].handle.is_none());
            if !empty {
                i += 1;
                continue;
            }
            let _ = self.take_run(st, first);
            // SAFETY: the range came from reserve, nothing is mapped in it (and nothing
            // is placed there: its run is gone), and it is forgotten here.
            if let Err(e) = st.unlocked(|| unsafe { self.phys.free_range(va, units * self.unit) }) {
                record_drop_error("cuMemAddressFree", e);
            }
            st.regions.remove(i);
        }
    }

    /// Removes the free run starting at `start`.
    /// `None` only if the index lost the run (an internal bug: debug builds stop here;
    /// release builds fail the operation at hand instead of panicking on an allocation
    /// path).
    pub(super) fn take_run(&self, st: &mut State<B>, start: usize) -> Option<Run> {
        let run = st.free.remove(start).map(|(len, stamps)| Run { len, stamps });
        debug_assert!(
            run.is_some(),
            "page heap: unit {start} starts no free run of the index"
        );
        run
    }

    /// Inserts a free run as it is (its neighbours are not free).
    pub(super) fn put_run(&self, st: &mut State<B>, start: usize, len: usize, stamps: Stamps) {
        st.free.insert(start, len, stamps);
    }

    /// Adds `stamps` to the free runs overlapping units `lo..hi`.
    pub(super) fn stamp_free(&self, st: &mut State<B>, lo: usize, hi: usize, stamps: &Stamps) {
        for s in st.free.overlapping(lo, hi) {
            if let Some(run) = st.free.payload_mut(s) {
                st.clocks.merge(run, stamps.clone());
            }
        }
    }

    /// Takes units `start..start + n` for a block from the free run starting at `start`
    /// (the rest of the run stays free) and marks them used in their chunks: the stamps of
    /// the frees that touched them (`None` if the index lost the run: an internal bug).
    pub(super) fn take_units(&self, st: &mut State<B>, start: usize, n: usize) -> Option<Stamps> {
        let run = self.take_run(st, start)?;
        if run.len > n {
            // The rest of a maximal run: its neighbours are this block and a block.
            let rest = touching(&run.stamps, start + n, start + run.len);
            self.put_run(st, start + n, run.len - n, rest);
        }
        for (c, k) in self.chunks_of(start, n) {
            st.chunks[c].used += k;
            st.idle.remove(&c);
        }
        Some(touching(&run.stamps, start, start + n))
    }

    /// Frees units `start..start + n` (of a block or a failed allocation) with
    /// `stamps`: coalesced with the free runs around them, their chunks idle if wholly
    /// free. The units of lost chunks stay out (never used again).
    pub(super) fn give_back(&self, st: &mut State<B>, start: usize, n: usize, stamps: Stamps) {
        let cu = self.chunk_units;
        let end = start + n;
        let mut at = start;
        while at < end {
            // The next piece: up to the next lost chunk, or past it.
            let c = at / cu;
            let piece_end = end.min((c + 1) * cu);
            if st.chunks[c].lost {
                at = piece_end;
                continue;
            }
            let mut to = piece_end;
            while to < end && !st.chunks[to / cu].lost {
                to = end.min((to / cu + 1) * cu);
            }
            let part = if (at, to) == (start, end) {
                stamps.clone()
            } else {
                touching(&stamps, at, to)
            };
            self.give_back_run(st, at, to - at, part);
            at = to;
        }
    }

    /// [`give_back`](Self::give_back) of units in no lost chunk.
    fn give_back_run(&self, st: &mut State<B>, start: usize, n: usize, mut stamps: Stamps) {
        for (c, k) in self.chunks_of(start, n) {
            let ch = &mut st.chunks[c];
            ch.used -= k;
            if ch.used == 0 && ch.handle.is_some() && !ch.stuck {
                st.idle.insert(c);
            }
        }
        let (mut start, mut len) = (start, n);
        if let Some((s, l)) = st.free.ending_at(start) {
            if let Some(run) = self.take_run(st, s) {
                st.clocks.merge(&mut stamps, run.stamps);
                (start, len) = (s, len + l);
            }
        }
        if st.free.len_at(start + len).is_some() {
            if let Some(run) = self.take_run(st, start + len) {
                len += run.len;
                st.clocks.merge(&mut stamps, run.stamps);
            }
        }
        st.clocks.merge(&mut stamps, Vec::new());
        self.put_run(st, start, len, stamps);
    }
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Takes the units of chunks `c..c + k` (idle, so wholly free) out of the free run
    /// starting at `rs` that holds them, counted used, so that no block is placed there
    /// while their mapping changes; the rest of the run stays free. The stamps of the
    /// frees that touched them (`None` if the index lost the run: an internal bug).
    pub(super) fn carve(&self, st: &mut State<B>, c: usize, k: usize, rs: usize) -> Option<Stamps> {
        let run = self.take_run(st, rs)?;
        let (first, end) = (c * self.chunk_units, (c + k) * self.chunk_units);
        debug_assert!(
            rs <= first && end <= rs + run.len,
            "page heap: carving units not free"
        );
        if rs < first {
            self.put_run(st, rs, first - rs, touching(&run.stamps, rs, first));
        }
        if rs + run.len > end {
            let rest = touching(&run.stamps, end, rs + run.len);
            self.put_run(st, end, rs + run.len - end, rest);
        }
        for ch in c..c + k {
            st.idle.remove(&ch);
            st.chunks[ch].used = self.chunk_units;
        }
        Some(touching(&run.stamps, first, end))
    }

    /// Marks chunks `from..to` lost (mapped without access, never unmapped again) and
    /// takes their free units out of the free runs for good; the units of the
    /// allocation at hand in them stay out when it gives its run back.
    pub(super) fn lose_chunks(&self, st: &mut State<B>, from: usize, to: usize) {
        let (first, end) = (from * self.chunk_units, to * self.chunk_units);
        for c in from..to {
            let ch = &mut st.chunks[c];
            ch.stuck = true;
            ch.lost = true;
            ch.granting = false;
            ch.used = self.chunk_units;
            st.idle.remove(&c);
        }
        for rs in st.free.overlapping(first, end) {
            let Some(run) = self.take_run(st, rs) else {
                continue;
            };
            if rs < first {
                self.put_run(st, rs, first - rs, touching(&run.stamps, rs, first));
            }
            if rs + run.len > end {
                let stamps = touching(&run.stamps, end, rs + run.len);
                self.put_run(st, end, rs + run.len - end, stamps);
            }
        }
    }
}
