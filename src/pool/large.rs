//! Large blocks (above the pool's threshold, or aligned beyond a page): taken from the
//! source one by one at their page-rounded size and cached whole, by exact size. A
//! request takes the smallest cached block that fits, and only one at most twice the
//! request (plus its alignment): a bigger block is left for a bigger request and a fresh
//! one is allocated instead, so reuse wastes at most half of a block, where power-of-two
//! rounding may waste half of every block.
//!
//! The registry is an algorithm core (`&mut self`); the pool keeps it behind one lock.

use std::collections::{BTreeMap, BTreeSet};

use super::BlockPtr;
use crate::source::align_up;

/// How much larger than the request a reused block may be: `size <= REUSE_FACTOR * need
/// + align`.
pub(crate) const REUSE_FACTOR: usize = 2;

struct LargeBlock {
    base: BlockPtr,
    size: usize,
    free: bool,
}

/// The large blocks of one pool.
#[derive(Default)]
pub(crate) struct Large {
    /// Every large block held, by base address.
    blocks: BTreeMap<usize, LargeBlock>,
    /// The free ones, by (size, base): the first entry from `(need, 0)` is the smallest
    /// that is large enough.
    free: BTreeSet<(usize, usize)>,
    // free_bytes == sum of the sizes in `free`
    free_bytes: usize,
    // held_bytes == sum of the sizes in `blocks`
    held_bytes: usize,
}

impl Large {
    /// Takes the smallest free block that can hold `need` bytes aligned to `align`, within
    /// the reuse bound; returns (base, block size, aligned pointer).
    pub(crate) fn take(&mut self, need: usize, align: usize) -> Option<(BlockPtr, usize, BlockPtr)> {
        let bound = need.saturating_mul(REUSE_FACTOR).saturating_add(align);
        let &(size, base) = self
            .free
            .range((need, 0)..)
            .take_while(|&&(size, _)| size <= bound)
            .find(|&&(size, base)| align_up(base, align).is_some_and(|user| user - base + need <= size))?;
        self.free.remove(&(size, base));
        self.free_bytes -= size;
        let block = self.blocks.get_mut(&base).expect("free blocks are registered");
        block.free = false;
        let user = align_up(base, align).expect("checked above") - base;
        Some((block.base, size, block.base.add(user)))
    }

    /// Registers a block fresh from the source, handed out at once.
    pub(crate) fn insert_live(&mut self, base: BlockPtr, size: usize) {
        self.blocks.insert(
            base.addr(),
            LargeBlock {
                base,
                size,
                free: false,
            },
        );
        self.held_bytes += size;
    }

    /// The block holding `addr`: its base and size, and whether it is free.
    pub(crate) fn find(&self, addr: usize) -> Option<(usize, usize, bool)> {
        let (&base, b) = self.blocks.range(..=addr).next_back()?;
        (addr < base + b.size).then_some((base, b.size, b.free))
    }

    /// Marks the live block holding `addr` free; returns its base and size, or `None` if
    /// `addr` is in no live block (a double free or a foreign pointer).
    pub(crate) fn give_back(&mut self, addr: usize) -> Option<(usize, usize)> {
        let (base, size, free) = self.find(addr)?;
        if free {
            return None;
        }
        self.blocks.get_mut(&base).expect("found above").free = true;
        self.free.insert((size, base));
        self.free_bytes += size;
        Some((base, size))
    }

    /// Removes every free block from the registry, for the caller to return to the source.
    pub(crate) fn take_free(&mut self) -> Vec<(BlockPtr, usize)> {
        let free = core::mem::take(&mut self.free);
        self.free_bytes = 0;
        free.into_iter()
            .map(|(size, base)| {
                let b = self.blocks.remove(&base).expect("free blocks are registered");
                self.held_bytes -= size;
                (b.base, size)
            })
            .collect()
    }

    /// Removes every block, free or not (for a pool being dropped).
    pub(crate) fn drain(&mut self) -> Vec<(BlockPtr, usize)> {
        self.free.clear();
        self.free_bytes = 0;
        self.held_bytes = 0;
        core::mem::take(&mut self.blocks)
            .into_values()
            .map(|b| (b.base, b.size))
            .collect()
    }

    /// Free bytes and blocks.
    pub(crate) fn free_totals(&self) -> (usize, usize) {
        (self.free_bytes, self.free.len())
    }

    /// Held bytes and blocks.
    #[cfg(test)]
    pub(crate) fn held_totals(&self) -> (usize, usize) {
        (self.held_bytes, self.blocks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::ptr::NonNull;

    fn at(addr: usize) -> BlockPtr {
        BlockPtr::new(NonNull::new(core::ptr::without_provenance_mut(addr)).unwrap())
    }

    #[test]
    fn takes_the_smallest_fit_within_the_bound() {
        let mut l = Large::default();
        for (base, size) in [(0x10_0000, 8 << 20), (0x100_0000, 3 << 20), (0x200_0000, 5 << 20)] {
            l.insert_live(at(base), size);
            assert!(l.give_back(base + 100).is_some());
        }
        assert_eq!(l.free_totals(), (16 << 20, 3));
        let (base, size, user) = l.take(3 << 20, 4096).unwrap();
        assert_eq!(
            (base.addr(), size, user.addr()),
            (0x100_0000, 3 << 20, 0x100_0000)
        );
        // 1 MiB: the 5 and 8 MiB blocks are more than twice as large.
        assert!(l.take(1 << 20, 4096).is_none());
        let (base, size, _) = l.take(4 << 20, 4096).unwrap();
        assert_eq!((base.addr(), size), (0x200_0000, 5 << 20));
        assert!(l.give_back(0x200_0000).is_some());
        assert!(l.give_back(0x200_0000).is_none(), "double free is refused");
        assert_eq!(l.find(0x200_0000 + (5 << 20)), None);
        let freed = l.take_free();
        assert_eq!(freed.len(), 2);
        assert_eq!(l.held_totals(), (3 << 20, 1));
    }
}
