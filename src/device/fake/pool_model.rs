//! The simulated driver pool's reservations (`cuMemAllocFromPoolAsync` as the H200's
//! driver showed it), for the simulated device of `fake/mod.rs`.
//!
//! Invariant: `reserved` is the sum of the chunks' sizes, `used` the sum of the live
//! blocks' lengths, and each chunk's free extents (coalesced at every free) and blocks
//! tile it without overlap.

use std::collections::BTreeMap;

/// The simulated driver pool's reservations, after what the H200's driver showed
/// (`cuMemAllocFromPoolAsync`, release threshold at its maximum): memory is reserved
/// in chunks of at least 32 MiB (a 1 MiB block reserved 32 MiB; 256 B + 1 MiB +
/// 128 MiB reserved 160 MiB), a larger block gets a chunk of its own rounded up to
/// 2 MiB, and a block is carved from the smallest free extent of any chunk that holds
/// it (freed extents merge with their neighbours). Trimming gives back chunks with no
/// block in them. Frees count as completed at once (the simulated streams run nothing
/// that the driver would wait for).
#[derive(Debug, Default)]
pub(crate) struct PoolModel {
    /// Per chunk (by id): its size and its free extents (offset -> length).
    chunks: BTreeMap<u64, (u64, BTreeMap<u64, u64>)>,
    next_chunk: u64,
    /// Per block: (chunk id, offset, length).
    blocks: BTreeMap<u64, (u64, u64, u64)>,
    pub(super) reserved: u64,
    pub(super) peak_reserved: u64,
    /// Bytes of live blocks.
    pub(super) used: u64,
}

/// The smallest chunk the model reserves, and the granule of larger ones.
const CHUNK: u64 = 32 << 20;
const GRANULE: u64 = 2 << 20;

impl PoolModel {
    /// The free extent that a block of `len` bytes would take: (length, chunk, offset).
    fn fit(&self, len: u64) -> Option<(u64, u64, u64)> {
        self.chunks
            .iter()
            .flat_map(|(&id, (_, free))| free.iter().map(move |(&off, &l)| (l, id, off)))
            .filter(|&(l, _, _)| l >= len)
            .min()
    }

    /// Bytes a block of `len` would add to the reservation.
    pub(super) fn growth(&self, len: u64) -> u64 {
        match self.fit(len) {
            Some(_) => 0,
            None => (len.div_ceil(GRANULE).max(1) * GRANULE).max(CHUNK),
        }
    }

    pub(super) fn alloc(&mut self, ptr: u64, len: u64) {
        let fit = self
            .chunks
            .iter()
            .flat_map(|(&id, (_, free))| free.iter().map(move |(&off, &l)| (l, id, off)))
            .filter(|&(l, _, _)| l >= len)
            .min();
        let (id, off, l) = match fit {
            Some((l, id, off)) => (id, off, l),
            None => {
                let size = len.div_ceil(GRANULE).max(1) * GRANULE;
                let size = size.max(CHUNK);
                let id = self.next_chunk;
                self.next_chunk += 1;
                self.chunks.insert(id, (size, BTreeMap::from([(0, size)])));
                self.reserved += size;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                (id, 0, size)
            }
        };
        let free = &mut self.chunks.get_mut(&id).expect("the chunk fits").1;
        free.remove(&off);
        if l > len {
            free.insert(off + len, l - len);
        }
        self.blocks.insert(ptr, (id, off, len));
        self.used += len;
    }

    pub(super) fn free(&mut self, ptr: u64) {
        let Some((id, mut off, mut len)) = self.blocks.remove(&ptr) else {
            return;
        };
        self.used -= len;
        let free = &mut self.chunks.get_mut(&id).expect("the block's chunk").1;
        if let Some((&o, &l)) = free.range(..off).next_back() {
            if o + l == off {
                free.remove(&o);
                off = o;
                len += l;
            }
        }
        if let Some(l) = free.remove(&(off + len)) {
            len += l;
        }
        free.insert(off, len);
    }

    pub(super) fn trim_to(&mut self, keep: u64) {
        let mut empty: Vec<(u64, u64)> = self
            .chunks
            .iter()
            .filter(|(_, (size, free))| free.get(&0) == Some(size))
            .map(|(&id, &(size, _))| (size, id))
            .collect();
        empty.sort_unstable();
        while self.reserved >= keep.max(1) {
            let Some((size, id)) = empty.pop() else { break };
            self.chunks.remove(&id);
            self.reserved -= size;
        }
    }
}
