//! The page heap's books, all behind its one lock: the regions of virtual addresses, the
//! chunks of physical memory in them, the free runs with the frees that touched them,
//! the idle chunks, spare handles and retired mappings. Every method here is pure
//! bookkeeping: no driver call is made with the books locked. A chunk that an operation
//! maps or unmaps without the lock is `busy` meanwhile, and no other operation touches
//! its handle.

use std::collections::{BTreeSet, HashMap};

use super::clocks::{completed, merge, touching, Clocks, Stamps};
use super::{PageHeap, PageStats, PLACE_TRIES};
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::device::runs::Runs;
use crate::sync::{Arc, MutexGuard};

/// A maximal run of free units.
pub(super) struct Run {
    pub(super) len: usize,
    pub(super) stamps: Stamps,
}

/// One chunk of a region's units.
#[derive(Default)]
pub(super) struct Chunk {
    /// The handle mapped there (while `busy` with no handle: being mapped; with one:
    /// being unmapped).
    pub(super) handle: Option<u64>,
    /// Units of the chunk in blocks (all of them while carved out of the free runs:
    /// retired, or being unmapped).
    pub(super) used: usize,
    /// An unmap failed: the mapping stays, and the chunk is never unmapped again.
    pub(super) stuck: bool,
    /// An operation maps or unmaps it with the lock dropped.
    pub(super) busy: bool,
}

/// A reserved range of virtual addresses: units `first..first + units` of the
/// heap's index space.
pub(super) struct Region {
    pub(super) first: usize,
    pub(super) units: usize,
    pub(super) va: u64,
}

pub(super) struct State<B: StreamOrder> {
    pub(super) regions: Vec<Region>,
    /// The first unit index of the next region (regions are a chunk apart in the index
    /// space, so that no free run reaches from one into the next).
    pub(super) next_index: usize,
    /// A region is being reserved (one at a time; others that need one wait for it).
    pub(super) growing: bool,
    /// By chunk index (unit index / units per chunk).
    pub(super) chunks: Vec<Chunk>,
    /// Free runs by first unit, and by (length, first unit) for the best fit, each with
    /// the frees that touched it.
    pub(super) free: Runs<Stamps>,
    /// Mapped chunks with no unit in a block (and neither stuck nor busy).
    pub(super) idle: BTreeSet<usize>,
    /// Handles mapped nowhere.
    pub(super) spare: Vec<u64>,
    /// Chunks whose handle was mapped elsewhere while their last frees' marks were
    /// pending: the old mapping stays (their units out of the free runs) until the marks
    /// complete.
    pub(super) retired: Vec<(usize, Stamps)>,
    /// Live blocks by address: (first unit, units).
    pub(super) live: HashMap<u64, (usize, usize)>,
    /// Other devices every new mapping gives access to.
    pub(super) peers: Vec<usize>,
    /// The peers `enable_peer` gave access to every mapping.
    pub(super) granted: Vec<usize>,
    /// `enable_peer` calls setting access: no chunk is unmapped meanwhile.
    pub(super) granting: usize,
    /// The latest free's sequence number.
    pub(super) seq: u64,
    pub(super) clocks: Clocks<B>,
    /// Handles of streams whose clocks went, and marks that went, dropped after the lock
    /// (the last handle of an owned stream destroys it, a mark may destroy its event).
    pub(super) dead: Vec<B::Stream>,
    pub(super) dead_marks: Vec<Arc<B::Mark>>,
    pub(super) stats: PageStats,
}

impl<B: StreamOrder> State<B> {
    pub(super) fn new() -> Self {
        Self {
            regions: Vec::new(),
            next_index: 0,
            growing: false,
            chunks: Vec::new(),
            free: Runs::default(),
            idle: BTreeSet::new(),
            spare: Vec::new(),
            retired: Vec::new(),
            live: HashMap::new(),
            peers: Vec::new(),
            granted: Vec::new(),
            granting: 0,
            seq: 0,
            clocks: Clocks::default(),
            dead: Vec::new(),
            dead_marks: Vec::new(),
            stats: PageStats::default(),
        }
    }

    /// Whether handle `h` is still mapped at a retired chunk.
    pub(super) fn retired_holds(&self, h: u64) -> bool {
        self.retired
            .iter()
            .any(|&(c, _)| self.chunks[c].handle == Some(h))
    }
}

/// Unlocks `st`, then drops the stream handles and marks that went under it.
pub(super) fn unlock<B: StreamOrder>(mut st: MutexGuard<'_, State<B>>) {
    let dead = core::mem::take(&mut st.dead);
    let marks = core::mem::take(&mut st.dead_marks);
    drop(st);
    drop(dead);
    drop(marks);
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

    /// Where a block of `n` units goes: the smallest free run that fits whose first `n`
    /// units are all mapped, among the [`PLACE_TRIES`] smallest that fit; else the one of
    /// those with the fewest chunks to map (the smallest among equals). A chunk being
    /// mapped counts as unmapped.
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

    /// Takes units `start..start + n` (the start of a free run) for a block; the frees
    /// that touched them.
    pub(super) fn take_block(&self, st: &mut State<B>, start: usize, n: usize) -> Stamps {
        let run = self.take_run(st, start);
        if run.len > n {
            // The rest of a maximal run: its neighbours are this block and a block.
            let rest = touching(&run.stamps, start + n, start + run.len);
            self.put_run(st, start + n, run.len - n, rest);
        }
        for (c, k) in self.chunks_of(start, n) {
            st.chunks[c].used += k;
            st.idle.remove(&c);
        }
        touching(&run.stamps, start, start + n)
    }

    /// Adds the region of `units` at `va`; returns its first unit (a free run of the
    /// whole region).
    pub(super) fn add_region(&self, st: &mut State<B>, va: u64, units: usize) -> usize {
        let cu = self.chunk_units;
        st.stats.range_reserves += 1;
        let first = st.next_index;
        st.next_index = first + units + cu;
        st.regions.push(Region { first, units, va });
        st.chunks.resize_with(st.next_index / cu, Chunk::default);
        self.put_run(st, first, units, Vec::new());
        first
    }

    /// Removes the free run starting at `start`.
    pub(super) fn take_run(&self, st: &mut State<B>, start: usize) -> Run {
        let (len, stamps) = st.free.remove(start).expect("a free run from the index");
        Run { len, stamps }
    }

    /// Inserts a free run as it is (its neighbours are not free).
    pub(super) fn put_run(&self, st: &mut State<B>, start: usize, len: usize, stamps: Stamps) {
        st.free.insert(start, len, stamps);
    }

    /// Adds `stamps` to the free runs overlapping units `lo..hi`.
    pub(super) fn stamp_free(&self, st: &mut State<B>, lo: usize, hi: usize, stamps: &Stamps) {
        for s in st.free.overlapping(lo, hi) {
            if let Some(run) = st.free.payload_mut(s) {
                merge(&st.clocks, run, stamps.clone());
            }
        }
    }

    /// Frees units `start..start + n` (of a block, a failed allocation or a carved chunk)
    /// with `stamps`: coalesced with the free runs around them, their chunks idle if
    /// wholly free.
    pub(super) fn give_back(&self, st: &mut State<B>, start: usize, n: usize, mut stamps: Stamps) {
        for (c, k) in self.chunks_of(start, n) {
            let ch = &mut st.chunks[c];
            ch.used -= k;
            if ch.used == 0 && ch.handle.is_some() && !ch.stuck && !ch.busy {
                st.idle.insert(c);
            }
        }
        let (mut start, mut len) = (start, n);
        if let Some((s, l)) = st.free.ending_at(start) {
            let run = self.take_run(st, s);
            merge(&st.clocks, &mut stamps, run.stamps);
            (start, len) = (s, len + l);
        }
        if st.free.len_at(start + len).is_some() {
            let run = self.take_run(st, start + len);
            len += run.len;
            merge(&st.clocks, &mut stamps, run.stamps);
        }
        merge(&st.clocks, &mut stamps, Vec::new());
        self.put_run(st, start, len, stamps);
    }

    /// Takes idle chunk `c` out of its free run (all its units counted used, out of the
    /// idle set); the frees that touched it.
    pub(super) fn carve(&self, st: &mut State<B>, c: usize) -> Stamps {
        let (first, end) = (c * self.chunk_units, (c + 1) * self.chunk_units);
        st.idle.remove(&c);
        st.chunks[c].used = self.chunk_units;
        let Some((rs, _, _)) = st.free.at_or_before(first) else {
            return Vec::new();
        };
        let run = self.take_run(st, rs);
        if rs < first {
            self.put_run(st, rs, first - rs, touching(&run.stamps, rs, first));
        }
        if rs + run.len > end {
            let rest = touching(&run.stamps, end, rs + run.len);
            self.put_run(st, end, rs + run.len - end, rest);
        }
        touching(&run.stamps, first, end)
    }

    /// The frees touching idle chunk `c` that are not known to have completed.
    pub(super) fn pending_at(&self, st: &State<B>, c: usize) -> Stamps {
        let first = c * self.chunk_units;
        let Some((_, _, stamps)) = st.free.at_or_before(first) else {
            return Vec::new();
        };
        let mut frees = touching(stamps, first, first + self.chunk_units);
        frees.retain(|s| !completed(&st.clocks, s));
        frees
    }

    /// Whether the idle chunks exceed the allowance (1/idle_divisor of the bytes in
    /// blocks, at least [`IDLE_FLOOR_CHUNKS`](super::IDLE_FLOOR_CHUNKS)).
    pub(super) fn idle_over_allowance(&self, st: &State<B>) -> bool {
        let cb = self.chunk_bytes();
        let allowance = (st.stats.block_bytes / self.idle_divisor).max(super::IDLE_FLOOR_CHUNKS * cb);
        st.idle.len() * cb > allowance
    }

    /// Forgets the clocks of streams whose frees all completed while there are more than
    /// `keep` clocks (their handles go to `dead`, dropped after the lock).
    pub(super) fn forget_clocks(&self, st: &mut State<B>, keep: usize) {
        if st.clocks.len() <= keep {
            return;
        }
        let gone: Vec<_> = st
            .clocks
            .iter()
            .filter(|(_, c)| c.done >= c.freed && c.marks.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(c) = st.clocks.remove(&id) {
                st.dead.push(c.stream);
            }
        }
    }
}
