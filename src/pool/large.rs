//! Large blocks (above the pool's threshold, or aligned beyond a page), as extents of
//! **segments**: each segment is one allocation from the source, tiled by extents that
//! are live (handed out) or free. No power-of-two rounding anywhere: a fresh segment has
//! the request's page-rounded size, or twice that when the request comes from a growing
//! block (room to grow in place).
//!
//! - A request takes the smallest free extent that fits (best fit) and splits off the
//!   rest when it is at least `min_split` bytes (the pool's large threshold; a smaller
//!   rest stays with the block), so reuse wastes less than a large threshold per block.
//! - A growing block ([`Large::take_for_growth`]) takes the largest free extent instead,
//!   where it has the most room to keep growing; [`Large::grow_in_place`] extends a live
//!   block into the free extent after it: a `Vec` of pinned memory doubling from 1 MiB
//!   to 1 GiB copies nothing once its segment has room, as glibc's `realloc` at the top
//!   of the heap copies nothing.
//! - A freed extent merges with its free neighbours in the same segment (never across
//!   segments, even when the source placed two at adjacent addresses), and a segment
//!   goes back to the source ([`Large::take_free`]) only when it is one free extent.
//!
//! Every operation that changes the size of an extent at some address (a split, a merge,
//! an in-place growth) reports it, and the pool then moves its large epoch: thread
//! caches trust their record of a large block's size only within one epoch.
//!
//! [`Large`] is an algorithm core (`&mut self`); [`LargeShared`] keeps it behind one
//! lock together with the epoch, and moves the epoch itself whenever an operation reshapes
//! an extent, so no caller has to remember to.

use std::collections::{BTreeMap, BTreeSet};

use super::BlockPtr;
use crate::sync::{lock, AtomicU64, Mutex, Ordering};
use crate::util::align_up;

struct Extent {
    /// The extent's first byte (with the segment's provenance).
    ptr: BlockPtr,
    size: usize,
    free: bool,
    /// Base address of the segment holding it.
    segment: usize,
}

/// A block taken from the registry: the extent (base, size) and the pointer handed out
/// (the base aligned up to the request's alignment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) base: BlockPtr,
    pub(crate) size: usize,
    pub(crate) user: BlockPtr,
    /// Whether an extent at some address changed size (the pool moves its epoch).
    pub(crate) reshaped: bool,
}

/// The large blocks of one pool.
pub(crate) struct Large {
    /// Every extent of every segment, by base address.
    extents: BTreeMap<usize, Extent>,
    /// Every segment: base address -> (pointer, size).
    segments: BTreeMap<usize, (BlockPtr, usize)>,
    /// The free extents, by (size, base): the first entry from `(need, 0)` is the
    /// smallest that is large enough.
    free: BTreeSet<(usize, usize)>,
    /// A free rest smaller than this stays with the block taken from its extent.
    min_split: usize,
    // free_bytes == sum of the sizes in `free`
    free_bytes: usize,
    // held_bytes == sum of the segment sizes
    held_bytes: usize,
}

impl Large {
    /// An empty registry splitting extents only for rests of at least `min_split` bytes.
    pub(crate) fn new(min_split: usize) -> Self {
        Self {
            extents: BTreeMap::new(),
            segments: BTreeMap::new(),
            free: BTreeSet::new(),
            min_split: min_split.max(1),
            free_bytes: 0,
            held_bytes: 0,
        }
    }

    /// Where a block of `need` bytes aligned to `align` would start in the extent at
    /// `base` of `size` bytes, if it fits there.
    fn fit(base: usize, size: usize, need: usize, align: usize) -> Option<usize> {
        let user = align_up(base, align)?;
        (user - base)
            .checked_add(need)
            .filter(|&n| n <= size)
            .map(|_| user)
    }

    /// Takes the smallest free extent that can hold `need` bytes aligned to `align`.
    pub(crate) fn take(&mut self, need: usize, align: usize) -> Option<Taken> {
        let &(_, base) = self
            .free
            .range((need, 0)..)
            .find(|&&(size, base)| Self::fit(base, size, need, align).is_some())?;
        Some(self.carve(base, need, align))
    }

    /// Takes the largest free extent if it can hold `need` bytes aligned to `align`,
    /// else the smallest that can: for a block that is growing.
    pub(crate) fn take_for_growth(&mut self, need: usize, align: usize) -> Option<Taken> {
        let &(size, base) = self.free.last()?;
        if Self::fit(base, size, need, align).is_some() {
            Some(self.carve(base, need, align))
        } else {
            self.take(need, align)
        }
    }

    /// Registers a segment fresh from the source and takes a block of `need` bytes
    /// aligned to `align` from its start; the rest (if any) is free.
    ///
    /// Returns `None` (registering nothing) if the block does not fit in the segment.
    pub(crate) fn insert_segment(
        &mut self,
        ptr: BlockPtr,
        size: usize,
        need: usize,
        align: usize,
    ) -> Option<Taken> {
        let base = ptr.addr();
        Self::fit(base, size, need, align)?;
        self.segments.insert(base, (ptr, size));
        self.held_bytes += size;
        self.insert_free(Extent {
            ptr,
            size,
            free: true,
            segment: base,
        });
        let mut taken = self.carve(base, need, align);
        // A fresh segment changes no extent that was ever handed out.
        taken.reshaped = false;
        Some(taken)
    }

    fn insert_free(&mut self, e: Extent) {
        debug_assert!(e.free);
        self.free.insert((e.size, e.ptr.addr()));
        self.free_bytes += e.size;
        self.extents.insert(e.ptr.addr(), e);
    }

    /// Removes the free extent at `base` from the free set (it stays in `extents`).
    fn unfree(&mut self, base: usize) -> &mut Extent {
        let e = self.extents.get_mut(&base).expect("free extents are registered");
        debug_assert!(e.free);
        self.free.remove(&(e.size, base));
        self.free_bytes -= e.size;
        e.free = false;
        e
    }

    /// Hands out the free extent at `base` for `need` bytes aligned to `align`
    /// (checked to fit), splitting off the rest when it is at least `min_split`.
    fn carve(&mut self, base: usize, need: usize, align: usize) -> Taken {
        let min_split = self.min_split;
        let e = self.unfree(base);
        let user = Self::fit(base, e.size, need, align).expect("checked by the caller");
        let end = user + need;
        let rest = e.size - (end - base);
        let (ptr, segment) = (e.ptr, e.segment);
        let reshaped = rest >= min_split;
        if reshaped {
            e.size -= rest;
            self.insert_free(Extent {
                ptr: ptr.add(end - base),
                size: rest,
                free: true,
                segment,
            });
        }
        let size = self.extents[&base].size;
        Taken {
            base: ptr,
            size,
            user: ptr.add(user - base),
            reshaped,
        }
    }

    /// Extends the live block holding `addr` so that at least `need` bytes from `addr`
    /// are usable, taking the start of the free extent right after it in the same
    /// segment. Returns the usable bytes from `addr` and the bytes the block grew by, or
    /// `None` if it cannot grow in place (the block stays as it was).
    pub(crate) fn grow_in_place(&mut self, addr: usize, need: usize) -> Option<(usize, usize)> {
        let (base, size, free) = self.find(addr)?;
        if free {
            return None;
        }
        let want_end = addr.checked_add(need)?;
        let end = base + size;
        if want_end <= end {
            return Some((end - addr, 0));
        }
        let segment = self.extents[&base].segment;
        let next = self.extents.get(&end)?;
        if !next.free || next.segment != segment || end + next.size < want_end {
            return None;
        }
        let next_size = next.size;
        let next_ptr = next.ptr;
        self.unfree(end);
        self.extents.remove(&end);
        let extra = want_end - end;
        let rest = next_size - extra;
        let grown = if rest >= self.min_split {
            self.insert_free(Extent {
                ptr: next_ptr.add(extra),
                size: rest,
                free: true,
                segment,
            });
            extra
        } else {
            next_size
        };
        self.extents.get_mut(&base).expect("found above").size += grown;
        Some((end + grown - addr, grown))
    }

    /// The extent holding `addr`: its base and size, and whether it is free.
    pub(crate) fn find(&self, addr: usize) -> Option<(usize, usize, bool)> {
        let (&base, e) = self.extents.range(..=addr).next_back()?;
        (addr < base + e.size).then_some((base, e.size, e.free))
    }

    /// Marks the live block holding `addr` free and merges it with free neighbours in
    /// its segment; returns the block's base and size (before merging) and whether a
    /// merge changed an extent, or `None` if `addr` is in no live block (a double free or
    /// a foreign pointer).
    pub(crate) fn give_back(&mut self, addr: usize) -> Option<(usize, usize, bool)> {
        let (base, size, free) = self.find(addr)?;
        if free {
            return None;
        }
        let mut e = self.extents.remove(&base).expect("found above");
        e.free = true;
        let mut merged = false;
        // The next extent, if free and in the same segment.
        let end = base + size;
        if self
            .extents
            .get(&end)
            .is_some_and(|n| n.free && n.segment == e.segment)
        {
            let n_size = self.unfree(end).size;
            self.extents.remove(&end);
            e.size += n_size;
            merged = true;
        }
        // The previous extent, if free and in the same segment.
        if let Some((&p_base, p)) = self.extents.range(..base).next_back() {
            if p.free && p.segment == e.segment && p_base + p.size == base {
                let p = self.unfree(p_base);
                let (p_size, p_ptr) = (p.size, p.ptr);
                self.extents.remove(&p_base);
                e = Extent {
                    ptr: p_ptr,
                    size: p_size + e.size,
                    free: true,
                    segment: e.segment,
                };
                merged = true;
            }
        }
        self.insert_free(e);
        Some((base, size, merged))
    }

    /// Removes every segment that is one free extent, for the caller to return to the
    /// source. Segments with a live block stay (their free extents stay cached).
    pub(crate) fn take_free(&mut self) -> Vec<(BlockPtr, usize)> {
        let whole: Vec<usize> = self
            .segments
            .iter()
            .filter(|(base, (_, size))| self.extents.get(base).is_some_and(|e| e.free && e.size == *size))
            .map(|(&base, _)| base)
            .collect();
        whole
            .into_iter()
            .map(|base| {
                self.unfree(base);
                self.extents.remove(&base);
                let (ptr, size) = self.segments.remove(&base).expect("listed above");
                self.held_bytes -= size;
                (ptr, size)
            })
            .collect()
    }

    /// Removes every segment, free or not (for a pool being dropped).
    pub(crate) fn drain(&mut self) -> Vec<(BlockPtr, usize)> {
        self.extents.clear();
        self.free.clear();
        self.free_bytes = 0;
        self.held_bytes = 0;
        core::mem::take(&mut self.segments).into_values().collect()
    }

    /// Free bytes and extents.
    pub(crate) fn free_totals(&self) -> (usize, usize) {
        (self.free_bytes, self.free.len())
    }

    /// Held bytes and segments.
    pub(crate) fn held_totals(&self) -> (usize, usize) {
        (self.held_bytes, self.segments.len())
    }

    /// Checks that the extents tile every segment and the totals add up.
    #[cfg(test)]
    pub(crate) fn check(&self) {
        let mut held = 0;
        for (&base, &(_, size)) in &self.segments {
            let mut at = base;
            for (&b, e) in self.extents.range(base..base + size) {
                assert_eq!(b, at, "extents tile the segment at {base:#x}");
                assert_eq!(e.segment, base);
                assert!(e.size > 0);
                at += e.size;
            }
            assert_eq!(at, base + size, "extents cover the segment at {base:#x}");
            held += size;
        }
        assert_eq!(held, self.held_bytes);
        let free: Vec<_> = self.extents.values().filter(|e| e.free).collect();
        assert_eq!(free.len(), self.free.len());
        assert_eq!(free.iter().map(|e| e.size).sum::<usize>(), self.free_bytes);
        for e in free {
            assert!(self.free.contains(&(e.size, e.ptr.addr())));
        }
    }
}

/// A large block handed out: the pointer, its usable bytes, the extent's base and size,
/// and the epoch it was handed out in.
pub(crate) struct LargeTaken {
    pub(crate) ptr: BlockPtr,
    pub(crate) usable: usize,
    pub(crate) base: usize,
    /// The extent's size (what the statistics count).
    pub(crate) size: usize,
    pub(crate) epoch: u64,
}

/// The large extents of a pool behind their lock, with the large epoch.
pub(crate) struct LargeShared {
    large: Mutex<Large>,
    /// Moves (under the lock) whenever an extent at some address changes size or a
    /// segment goes back to the source; thread caches trust their record of a large
    /// block's size only within one epoch. Read Relaxed: the move happens-before any later
    /// handout of a reused address through the lock, and the handout before its free.
    epoch: AtomicU64,
}

impl LargeShared {
    pub(crate) fn new(min_split: usize) -> Self {
        Self {
            large: Mutex::new(Large::new(min_split)),
            epoch: AtomicU64::new(0),
        }
    }

    #[inline(always)]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Moves the epoch; call with the lock held.
    fn bump(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The epoch a block just taken (under the lock) is handed out in.
    fn handed_out(&self, t: Taken) -> LargeTaken {
        let epoch = if t.reshaped { self.bump() } else { self.epoch() };
        LargeTaken {
            ptr: t.user,
            usable: t.size - (t.user.addr() - t.base.addr()),
            base: t.base.addr(),
            size: t.size,
            epoch,
        }
    }

    /// A cached extent for `need` bytes aligned to `align`: the smallest that fits, or the
    /// largest for a `growing` block.
    pub(crate) fn take(&self, need: usize, align: usize, growing: bool) -> Option<LargeTaken> {
        let mut large = lock(&self.large);
        let t = if growing {
            large.take_for_growth(need, align)
        } else {
            large.take(need, align)
        }?;
        Some(self.handed_out(t))
    }

    /// Registers a fresh segment and takes a block from its start (`None`: it does not
    /// fit, nothing registered).
    pub(crate) fn insert_segment(
        &self,
        base: BlockPtr,
        total: usize,
        need: usize,
        align: usize,
    ) -> Option<LargeTaken> {
        let mut large = lock(&self.large);
        let t = large.insert_segment(base, total, need, align)?;
        Some(self.handed_out(t))
    }

    /// Grows the live block holding `addr` in place to `need` usable bytes from `addr`;
    /// returns the usable bytes and the bytes it grew by.
    pub(crate) fn grow_in_place(&self, addr: usize, need: usize) -> Option<(usize, usize)> {
        let mut large = lock(&self.large);
        let (usable, grown) = large.grow_in_place(addr, need)?;
        if grown > 0 {
            self.bump();
        }
        Some((usable, grown))
    }

    /// Frees the live block holding `addr`; returns its base and size (`None`: no live
    /// block there).
    pub(crate) fn give_back(&self, addr: usize) -> Option<(usize, usize)> {
        let mut large = lock(&self.large);
        let (base, size, merged) = large.give_back(addr)?;
        if merged {
            self.bump();
        }
        Some((base, size))
    }

    /// The extent holding `addr`: base, size, free.
    pub(crate) fn find(&self, addr: usize) -> Option<(usize, usize, bool)> {
        lock(&self.large).find(addr)
    }

    /// Removes the wholly free segments, for the caller to return to the source.
    pub(crate) fn take_free(&self) -> Vec<(BlockPtr, usize)> {
        let mut large = lock(&self.large);
        self.bump();
        large.take_free()
    }

    /// Every segment (a pool being dropped).
    pub(crate) fn drain(&self) -> Vec<(BlockPtr, usize)> {
        lock(&self.large).drain()
    }

    /// Free bytes and extents.
    pub(crate) fn free_totals(&self) -> (usize, usize) {
        lock(&self.large).free_totals()
    }

    /// Held bytes and segments.
    pub(crate) fn held_totals(&self) -> (usize, usize) {
        lock(&self.large).held_totals()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::ptr::NonNull;

    const MIB: usize = 1 << 20;

    fn at(addr: usize) -> BlockPtr {
        BlockPtr::new(NonNull::new(core::ptr::without_provenance_mut(addr)).unwrap())
    }

    /// A registry holding segments (base, size), all free.
    fn with_free_segments(segments: &[(usize, usize)]) -> Large {
        let mut l = Large::new(512 << 10);
        for &(base, size) in segments {
            let t = l.insert_segment(at(base), size, size, 4096).unwrap();
            assert_eq!((t.base.addr(), t.size, t.user.addr()), (base, size, base));
            assert!(l.give_back(base).is_some());
        }
        l.check();
        l
    }

    #[test]
    fn takes_the_smallest_fit_and_splits_off_the_rest() {
        let mut l = with_free_segments(&[
            (0x1000_0000, 8 * MIB),
            (0x2000_0000, 3 * MIB),
            (0x3000_0000, 5 * MIB),
        ]);
        assert_eq!(l.free_totals(), (16 * MIB, 3));
        let t = l.take(3 * MIB, 4096).unwrap();
        assert_eq!((t.base.addr(), t.size, t.reshaped), (0x2000_0000, 3 * MIB, false));
        // 1 MiB from the 5 MiB segment (the smallest that fits): split, 4 MiB stays free.
        let t = l.take(MIB, 4096).unwrap();
        assert_eq!((t.base.addr(), t.size, t.reshaped), (0x3000_0000, MIB, true));
        assert_eq!(
            l.find(0x3000_0000 + MIB),
            Some((0x3000_0000 + MIB, 4 * MIB, true))
        );
        l.check();
        // A rest below min_split stays with the block.
        let t = l.take(4 * MIB - (256 << 10), 4096).unwrap();
        assert_eq!((t.base.addr(), t.size), (0x3000_0000 + MIB, 4 * MIB));
        l.check();
        assert!(l.give_back(0x2000_0000 + 100).is_some());
        assert!(l.give_back(0x2000_0000).is_none(), "double free is refused");
        assert_eq!(l.find(0x4000_0000), None);
        // Only the segments that are wholly free go back.
        let freed = l.take_free();
        let mut bases: Vec<_> = freed.iter().map(|(p, s)| (p.addr(), *s)).collect();
        bases.sort();
        assert_eq!(bases, [(0x1000_0000, 8 * MIB), (0x2000_0000, 3 * MIB)]);
        assert_eq!(l.held_totals(), (5 * MIB, 1));
        l.check();
    }

    #[test]
    fn freed_extents_merge_within_a_segment_but_not_across() {
        // Two segments at adjacent addresses.
        let mut l = with_free_segments(&[(0x1000_0000, 4 * MIB), (0x1000_0000 + 4 * MIB, 4 * MIB)]);
        let a = l.take(MIB, 4096).unwrap();
        let b = l.take(MIB, 4096).unwrap();
        let c = l.take(MIB, 4096).unwrap();
        assert_eq!(a.base.addr(), 0x1000_0000);
        assert_eq!(b.base.addr(), 0x1000_0000 + MIB);
        assert_eq!(c.base.addr(), 0x1000_0000 + 2 * MIB);
        // Free the middle, then its neighbours: one free extent again.
        assert_eq!(l.give_back(b.base.addr()), Some((b.base.addr(), MIB, false)));
        assert_eq!(l.give_back(a.base.addr()), Some((a.base.addr(), MIB, true)));
        assert_eq!(l.give_back(c.base.addr()), Some((c.base.addr(), MIB, true)));
        l.check();
        assert_eq!(l.find(0x1000_0000), Some((0x1000_0000, 4 * MIB, true)));
        assert_eq!(l.free_totals(), (8 * MIB, 2), "the two segments stay two extents");
        assert_eq!(l.take_free().len(), 2);
        assert_eq!(l.held_totals(), (0, 0));
    }

    #[test]
    fn grows_in_place_into_the_free_extent_after_it() {
        let mut l = with_free_segments(&[(0x1000_0000, 16 * MIB), (0x2000_0000, 32 * MIB)]);
        // A growing block goes to the largest free extent.
        let t = l.take_for_growth(MIB, 4096).unwrap();
        assert_eq!(t.base.addr(), 0x2000_0000);
        let base = t.base.addr();
        assert_eq!(l.grow_in_place(base, MIB), Some((MIB, 0)), "already large enough");
        assert_eq!(l.grow_in_place(base, 2 * MIB), Some((2 * MIB, MIB)));
        assert_eq!(
            l.grow_in_place(base + 4096, 8 * MIB),
            Some((8 * MIB, 6 * MIB + 4096))
        );
        l.check();
        // A live neighbour stops it.
        let n = l.take(MIB, 4096).unwrap();
        assert_eq!(n.base.addr(), 0x1000_0000, "best fit: the 16 MiB segment");
        let m = l.take(20 * MIB, 4096).unwrap();
        assert_eq!(m.base.addr(), base + 8 * MIB + 4096);
        assert_eq!(l.grow_in_place(base, 16 * MIB), None);
        assert_eq!(l.find(base), Some((base, 8 * MIB + 4096, false)), "unchanged");
        // Not past its segment; nor from a free or foreign address.
        assert_eq!(l.grow_in_place(n.base.addr(), 17 * MIB), None);
        assert_eq!(l.grow_in_place(0x3000_0000, MIB), None);
        for p in [base, n.base.addr(), m.base.addr()] {
            assert!(l.give_back(p).is_some());
        }
        assert_eq!(l.grow_in_place(base, 2 * MIB), None, "a free block does not grow");
        l.check();
        assert_eq!(l.take_free().len(), 2);
    }

    #[test]
    fn aligned_blocks_start_inside_their_extent() {
        let mut l = with_free_segments(&[(0x1000_1000, 8 * MIB)]);
        let t = l.take(MIB, MIB).unwrap();
        assert_eq!(t.user.addr(), 0x1010_0000);
        assert_eq!(t.base.addr(), 0x1000_1000);
        assert_eq!(t.size, 0x1010_0000 - 0x1000_1000 + MIB);
        assert!(l.take(8 * MIB, 4096).is_none());
        let mut l2 = Large::new(4096);
        assert!(
            l2.insert_segment(at(0x1000_1000), MIB, MIB, MIB).is_none(),
            "does not fit"
        );
        assert_eq!(l2.held_totals(), (0, 0));
        l.check();
    }
}
