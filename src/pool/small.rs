//! The small blocks a pool's threads share: a free list per size class and the chunks the
//! blocks are carved from.
//!
//! Lock order: `chunks`, then class lists in class order. Only [`SmallShared::take_free_chunks`]
//! holds more than one lock (the chunk lock, then every list); nothing takes the chunk lock
//! while holding a list lock. No source or driver call runs under any of them.

use std::collections::HashMap;

use super::chunks::Chunks;
use super::size_class::{class_size, NUM_CLASSES};
use super::{Batch, BlockPtr};
use crate::sync::{lock, Mutex};

pub(crate) struct SmallShared {
    /// Free blocks per class, most recently freed last.
    lists: Box<[Mutex<Vec<BlockPtr>>]>,
    chunks: Mutex<Chunks>,
}

impl SmallShared {
    pub(crate) fn new(chunk_size: usize, max_class: usize) -> Self {
        Self {
            lists: (0..=max_class.min(NUM_CLASSES - 1))
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
            chunks: Mutex::new(Chunks::new(chunk_size, max_class)),
        }
    }

    /// Moves up to `want` free blocks of `class` from the shared list into `out`.
    pub(crate) fn take_listed(&self, class: usize, want: usize, out: &mut Batch) {
        let mut list = lock(&self.lists[class]);
        let n = want.min(list.len());
        let from = list.len() - n;
        for p in list.drain(from..) {
            out.push(p);
        }
    }

    /// Whether the block at `addr` (of `class`) is on the shared free list.
    pub(crate) fn is_listed(&self, class: usize, addr: usize) -> bool {
        self.lists
            .get(class)
            .is_some_and(|l| lock(l).iter().any(|p| p.addr() == addr))
    }

    /// Carves up to `want` new blocks of `class` from chunks with room; returns how many.
    pub(crate) fn carve(&self, class: usize, want: usize, out: &mut Batch) -> usize {
        lock(&self.chunks).carve(class, want, out)
    }

    /// Adds a chunk fresh from the source and carves up to `want` blocks of `class` from it.
    pub(crate) fn add_chunk_and_carve(
        &self,
        p: BlockPtr,
        size: usize,
        class: usize,
        want: usize,
        out: &mut Batch,
    ) -> usize {
        let mut chunks = lock(&self.chunks);
        chunks.add(p, size);
        chunks.carve(class, want, out)
    }

    /// Puts blocks of `class` on the shared list; returns how many.
    pub(crate) fn give(&self, class: usize, blocks: impl IntoIterator<Item = BlockPtr>) -> usize {
        let mut list = lock(&self.lists[class]);
        let before = list.len();
        list.extend(blocks);
        list.len() - before
    }

    /// The bytes of one run of `class` (what a chunk needs to carve any block of it).
    pub(crate) fn run_len(&self, class: usize) -> usize {
        lock(&self.chunks).run_len(class)
    }

    /// The carved block holding `addr`: its address and size.
    pub(crate) fn find_block(&self, addr: usize) -> Option<(usize, usize)> {
        lock(&self.chunks).find_block(addr)
    }

    /// Removes every chunk whose carved blocks are all in the shared lists (and those
    /// blocks), for the caller to return to the source.
    pub(crate) fn take_free_chunks(&self) -> Vec<(BlockPtr, usize)> {
        let mut chunks = lock(&self.chunks);
        // Lock order: chunks, then every class list in class order.
        let mut lists: Vec<_> = self.lists.iter().map(lock).collect();
        let mut free: HashMap<usize, usize> = HashMap::new();
        for list in &lists {
            for b in list.iter() {
                if let Some(base) = chunks.chunk_of(b.addr()) {
                    *free.entry(base).or_default() += 1;
                }
            }
        }
        let release: Vec<usize> = chunks
            .bases()
            .filter(|b| free.get(b).copied().unwrap_or(0) == chunks.carved_blocks(*b))
            .collect();
        if release.is_empty() {
            return Vec::new();
        }
        for list in &mut lists {
            list.retain(|b| {
                chunks
                    .chunk_of(b.addr())
                    .is_none_or(|base| release.binary_search(&base).is_err())
            });
        }
        drop(lists);
        release.into_iter().filter_map(|b| chunks.remove(b)).collect()
    }

    /// Free bytes and blocks in the shared lists.
    pub(crate) fn listed_totals(&self) -> (usize, usize) {
        let (mut bytes, mut blocks) = (0, 0);
        for (class, list) in self.lists.iter().enumerate() {
            let n = lock(list).len();
            bytes += n * class_size(class);
            blocks += n;
        }
        (bytes, blocks)
    }

    /// Bytes held in chunks but in no block (uncarved space, run tails).
    pub(crate) fn slack(&self) -> usize {
        lock(&self.chunks).slack()
    }

    /// Chunks and their bytes.
    pub(crate) fn chunk_totals(&self) -> (usize, usize) {
        lock(&self.chunks).totals()
    }

    /// Every chunk (a pool being dropped).
    pub(crate) fn drain(&self) -> Vec<(BlockPtr, usize)> {
        lock(&self.chunks).drain()
    }
}
