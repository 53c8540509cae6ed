//! Chunks: the large blocks (2 MiB by default) the pool takes from its source and carves
//! into small blocks. A chunk is cut, front to back, into page-aligned runs; a run holds
//! blocks of one size class, carved lazily from its start as the class needs them.
//!
//! Keeping one class per run is what lets `record_use` map any interior pointer to its
//! block (find the chunk, then the run, then divide by the class size) without a header
//! in the block: the pool writes nothing into the memory it manages, so a freed managed
//! block is not migrated back to the host and a pinned block is not touched while a copy
//! may still read it.
//!
//! The registry is an algorithm core (`&mut self`); the pool keeps it behind one lock,
//! taken only on the slow path (carving, trimming, looking up a block for `record_use`).

use std::collections::BTreeMap;

use super::size_class::{class_size, run_bytes, NUM_CLASSES};
use super::{Batch, BlockPtr};
use crate::util::{align_up, PAGE_SIZE};

/// Chunks with room that carving tries before asking the source for a new chunk.
const MAX_CARVING: usize = 8;

struct Run {
    /// Offset of the run in its chunk (page-aligned in memory).
    start: usize,
    class: usize,
    /// Blocks the run can hold.
    capacity: usize,
    /// Blocks carved so far: the first `carved` blocks of the run exist.
    carved: usize,
}

struct Chunk {
    base: BlockPtr,
    size: usize,
    /// Offset of the first byte that belongs to no run.
    cursor: usize,
    /// Sorted by `start` (runs are cut front to back).
    runs: Vec<Run>,
    // carved_bytes == sum over runs of carved * class size
    carved_blocks: usize,
    carved_bytes: usize,
}

/// The chunk registry and carving state of one pool.
pub(crate) struct Chunks {
    map: BTreeMap<usize, Chunk>,
    /// Bases of chunks that may have room for another run, newest last.
    carving: Vec<usize>,
    /// Per class: the run blocks are being carved from, as (chunk base, run index).
    open: Vec<Option<(usize, usize)>>,
    /// Run size per class, capped for the pool's chunk size.
    run_bytes: Vec<usize>,
    // slack == sum over chunks of (size - carved_bytes): bytes held in chunks that are in
    // no block (uncarved space, run tails, alignment padding). Counted as cached.
    slack: usize,
    // chunk_bytes == sum over chunks of size
    chunk_bytes: usize,
}

impl Chunks {
    /// A registry for chunks of `chunk_size` bytes serving classes up to `max_class`.
    pub(crate) fn new(chunk_size: usize, max_class: usize) -> Self {
        let cap = (chunk_size / 4).max(PAGE_SIZE);
        let run_bytes = (0..NUM_CLASSES)
            .map(|c| {
                let run = run_bytes(c);
                if c > max_class || run <= cap {
                    return run;
                }
                let size = class_size(c);
                let blocks = (cap / size).max(1);
                align_up(blocks * size, PAGE_SIZE).unwrap_or(usize::MAX)
            })
            .collect();
        Self {
            map: BTreeMap::new(),
            carving: Vec::new(),
            open: vec![None; NUM_CLASSES],
            run_bytes,
            slack: 0,
            chunk_bytes: 0,
        }
    }

    /// Bytes of chunks not in any carved block.
    pub(crate) fn slack(&self) -> usize {
        self.slack
    }

    /// Chunks held and their bytes.
    pub(crate) fn totals(&self) -> (usize, usize) {
        (self.map.len(), self.chunk_bytes)
    }

    /// Adds a chunk fresh from the source.
    pub(crate) fn add(&mut self, base: BlockPtr, size: usize) {
        let chunk = Chunk {
            base,
            size,
            cursor: 0,
            runs: Vec::new(),
            carved_blocks: 0,
            carved_bytes: 0,
        };
        self.map.insert(base.addr(), chunk);
        self.slack += size;
        self.chunk_bytes += size;
        self.carving.push(base.addr());
        if self.carving.len() > MAX_CARVING {
            self.carving.remove(0);
        }
    }

    /// Carves up to `want` blocks of `class` into `out`, from the class's open run and
    /// then from new runs in chunks with room. Returns how many it carved (0: every chunk
    /// is full; the caller adds a chunk and calls again).
    pub(crate) fn carve(&mut self, class: usize, want: usize, out: &mut Batch) -> usize {
        let size = class_size(class);
        let mut got = 0;
        while got < want {
            let Some((base, run_index)) = self.open[class] else {
                if !self.open_run(class) {
                    break;
                }
                continue;
            };
            let chunk = self
                .map
                .get_mut(&base)
                .expect("an open run's chunk is registered");
            let run = &mut chunk.runs[run_index];
            let n = (run.capacity - run.carved).min(want - got);
            for i in run.carved..run.carved + n {
                out.push(chunk.base.add(run.start + i * size));
            }
            run.carved += n;
            if run.carved == run.capacity {
                self.open[class] = None;
            }
            chunk.carved_blocks += n;
            chunk.carved_bytes += n * size;
            self.slack -= n * size;
            got += n;
        }
        got
    }

    /// Cuts a new run for `class` from the first chunk with room; false if none has.
    fn open_run(&mut self, class: usize) -> bool {
        let len = self.run_bytes[class];
        let size = class_size(class);
        let mut i = self.carving.len();
        while i > 0 {
            i -= 1;
            let base = self.carving[i];
            let chunk = self.map.get_mut(&base).expect("carving chunks are registered");
            // Run starts are page-aligned in memory, whatever the source's alignment.
            let start = align_up(base + chunk.cursor, PAGE_SIZE).map(|a| a - base);
            match start {
                Some(start) if start.checked_add(len).is_some_and(|end| end <= chunk.size) => {
                    chunk.runs.push(Run {
                        start,
                        class,
                        capacity: len / size,
                        carved: 0,
                    });
                    chunk.cursor = start + len;
                    self.open[class] = Some((base, chunk.runs.len() - 1));
                    if chunk.size - chunk.cursor < PAGE_SIZE {
                        self.carving.remove(i);
                    }
                    return true;
                }
                _ => {
                    // A chunk too full for this run may still fit smaller ones; drop it
                    // only when not even the smallest run fits.
                    if chunk.size - chunk.cursor.min(chunk.size) < run_bytes(0) {
                        self.carving.remove(i);
                    }
                }
            }
        }
        false
    }

    /// The bytes of one run of `class`.
    pub(crate) fn run_len(&self, class: usize) -> usize {
        self.run_bytes[class]
    }

    /// The chunk holding `addr`, as its base.
    pub(crate) fn chunk_of(&self, addr: usize) -> Option<usize> {
        let (&base, chunk) = self.map.range(..=addr).next_back()?;
        (addr < base + chunk.size).then_some(base)
    }

    /// The carved block holding `addr`: its address and class.
    pub(crate) fn find_block(&self, addr: usize) -> Option<(usize, usize)> {
        let base = self.chunk_of(addr)?;
        let chunk = &self.map[&base];
        let off = addr - base;
        let i = chunk.runs.partition_point(|r| r.start <= off).checked_sub(1)?;
        let run = &chunk.runs[i];
        let size = class_size(run.class);
        let index = (off - run.start) / size;
        (index < run.carved).then(|| (base + run.start + index * size, run.class))
    }

    /// Carved blocks of the chunk at `base`.
    pub(crate) fn carved_blocks(&self, base: usize) -> usize {
        self.map.get(&base).map_or(0, |c| c.carved_blocks)
    }

    /// Bases of every chunk.
    pub(crate) fn bases(&self) -> impl Iterator<Item = usize> + '_ {
        self.map.keys().copied()
    }

    /// Removes the chunk at `base` from the registry (all its carved blocks must have
    /// been removed from the free lists by the caller); returns its pointer and size for
    /// the caller to give back to the source.
    pub(crate) fn remove(&mut self, base: usize) -> Option<(BlockPtr, usize)> {
        let chunk = self.map.remove(&base)?;
        self.carving.retain(|&b| b != base);
        for open in &mut self.open {
            if matches!(open, Some((b, _)) if *b == base) {
                *open = None;
            }
        }
        self.slack -= chunk.size - chunk.carved_bytes;
        self.chunk_bytes -= chunk.size;
        Some((chunk.base, chunk.size))
    }

    /// Every chunk, removed (for a pool being dropped).
    pub(crate) fn drain(&mut self) -> Vec<(BlockPtr, usize)> {
        let bases: Vec<usize> = self.bases().collect();
        bases.into_iter().filter_map(|b| self.remove(b)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::ptr::NonNull;

    fn fake_chunk(storage: &mut [u8]) -> BlockPtr {
        BlockPtr::new(NonNull::new(storage.as_mut_ptr()).unwrap())
    }

    #[test]
    fn carving_fills_runs_and_lookup_finds_interior_pointers() {
        // Page-aligned backing store, never dereferenced through the blocks.
        let layout = std::alloc::Layout::from_size_align(1 << 20, PAGE_SIZE).unwrap();
        // SAFETY: nonzero size.
        let mem = unsafe { std::alloc::alloc(layout) };
        // SAFETY: `mem` is a live allocation of 1 MiB.
        let storage = unsafe { core::slice::from_raw_parts_mut(mem, 1 << 20) };
        let base = fake_chunk(storage);
        let mut chunks = Chunks::new(1 << 20, NUM_CLASSES - 1);
        let mut batch = Batch::new();
        assert_eq!(chunks.carve(3, 4, &mut batch), 0, "no chunk yet");
        chunks.add(base, 1 << 20);
        assert_eq!(chunks.slack(), 1 << 20);
        assert_eq!(chunks.carve(3, 4, &mut batch), 4);
        let blocks: Vec<usize> = batch.drain().map(|b| b.addr()).collect();
        assert_eq!(blocks[1] - blocks[0], class_size(3));
        assert_eq!(chunks.slack(), (1 << 20) - 4 * class_size(3));
        assert_eq!(chunks.find_block(blocks[2] + 5), Some((blocks[2], 3)));
        assert_eq!(
            chunks.find_block(blocks[3] + class_size(3)),
            None,
            "not carved yet"
        );
        // A class of another size goes to a new page-aligned run.
        assert_eq!(chunks.carve(40, 2, &mut batch), 2);
        let other: Vec<usize> = batch.drain().map(|b| b.addr()).collect();
        assert_eq!(other[0] % PAGE_SIZE, 0);
        assert_eq!(chunks.find_block(other[1] + 1), Some((other[1], 40)));
        assert_eq!(chunks.carved_blocks(base.addr()), 6);
        let (p, size) = chunks.remove(base.addr()).unwrap();
        assert_eq!((p.addr(), size), (base.addr(), 1 << 20));
        assert_eq!(chunks.slack(), 0);
        // SAFETY: allocated above with `layout`.
        unsafe { std::alloc::dealloc(mem, layout) };
    }
}
