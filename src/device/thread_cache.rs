//! Per-thread bins of free device blocks, keyed by (stream, size class): the hot path.
//!
//! A hit pops a block from the calling thread's bin for its stream and class: no lock, no
//! atomic read-modify-write, no CUDA call. Stream order makes it safe: a block in the bin
//! of stream S was freed on S after every use of it was queued there, so work queued on S
//! after the new allocation runs after those uses.
//!
//! A [`ThreadCache`] is an algorithm core: its owner thread has `&mut` to it (through the
//! thread-local table in `tls.rs`, or directly in CPU tests and loom models), and the
//! shared cache (`cache.rs`) takes its blocks when it overflows, when the thread exits,
//! and when [`ThreadStats::reclaim`] asks for them. It also keeps spare handles: every
//! buffer owns a clone of its stream and of its pool, and cloning those (`Arc`s) is an
//! atomic increment. A freed buffer's handles are kept here and given to the next buffer,
//! so a steady alloc/free cycle moves handles and never touches a reference count.

use super::backend::Backend;
use super::size_class::class_size;
use crate::cuda::StreamId;
use crate::sync::{Arc, AtomicBool, AtomicU64, Ordering};

/// Streams a thread keeps bins for; a further stream evicts the one holding least.
pub(crate) const MAX_STREAMS: usize = 8;
/// Spare handles kept per stream (and of the pool): enough for the buffers of a burst.
const SPARE_HANDLES: usize = 64;
/// The most blocks one bin keeps.
const MAX_BIN: usize = 64;

/// One stream slot's published counters.
#[derive(Debug, Default)]
pub(crate) struct SlotStats {
    /// The stream's id (0: the slot is unused).
    pub(crate) id: AtomicU64,
    /// Bytes of free blocks of that stream in the thread's bins.
    pub(crate) bytes: AtomicU64,
    /// Free blocks of that stream in the thread's bins.
    pub(crate) blocks: AtomicU64,
}

/// One thread's counters for one pool, written only by that thread (`Relaxed` stores,
/// never a read-modify-write) and read by `stats()`; and the flag other threads set to
/// ask for the thread's blocks back. Aligned to its own cache lines.
#[repr(align(128))]
#[derive(Debug, Default)]
pub(crate) struct ThreadStats {
    /// Set by `trim()` and the out-of-memory path of another thread: the owner moves its
    /// blocks to the shared cache at its next allocation or free.
    pub(crate) reclaim: AtomicBool,
    /// Allocations served from the bins.
    pub(crate) hits: AtomicU64,
    /// Per stream slot (the index of the stream in [`ThreadCache`]'s table).
    pub(crate) slots: [SlotStats; MAX_STREAMS],
}

/// A stream's bins in one thread's cache.
pub(crate) struct StreamBins<B: Backend> {
    pub(crate) id: StreamId,
    /// A live handle of the stream (to record a mark on it when another stream takes its
    /// blocks, and to free them to the driver in its order).
    pub(crate) stream: B::Stream,
    spares: Vec<B::Stream>,
    /// Free blocks per class, most recently freed last.
    bins: Box<[Vec<u64>]>,
    // bytes == sum over bins of len * class size
    bytes: usize,
    // blocks == sum over bins of len
    blocks: usize,
}

/// What a thread cache gives back to the shared cache: a stream's handle (and spare
/// handles, to be dropped outside any lock) and its blocks by class.
pub(crate) struct Evicted<B: Backend> {
    pub(crate) stream: B::Stream,
    pub(crate) spares: Vec<B::Stream>,
    pub(crate) blocks: Vec<(usize, Vec<u64>)>,
}

/// One thread's cache of free blocks for one pool. `P` is the pool handle buffers own
/// (spares of it are kept like stream handles).
pub(crate) struct ThreadCache<B: Backend, P> {
    streams: Vec<StreamBins<B>>,
    /// The index of the stream used last, tried first.
    last: usize,
    pool_spares: Vec<P>,
    /// The most blocks each class's bin keeps (the classes this cache holds).
    caps: Box<[u32]>,
    // bytes == sum over streams of their bytes; bytes <= max_bytes
    bytes: usize,
    max_bytes: usize,
    hits: u64,
    stats: Arc<ThreadStats>,
}

impl<B: Backend, P> ThreadCache<B, P> {
    /// An empty cache holding classes `0..caps.len()` (bin `c` at most `caps[c]` blocks)
    /// and at most `max_bytes` bytes.
    pub(crate) fn new(caps: Box<[u32]>, max_bytes: usize, stats: Arc<ThreadStats>) -> Self {
        Self {
            streams: Vec::new(),
            last: 0,
            pool_spares: Vec::new(),
            caps,
            bytes: 0,
            max_bytes,
            hits: 0,
            stats,
        }
    }

    /// The bin capacities for a cache of `max_bytes` holding classes up to `max_class`:
    /// a bin holds at most an eighth of the budget (at least one block) and 64 blocks.
    pub(crate) fn caps_for(max_class: usize, max_bytes: usize) -> Box<[u32]> {
        (0..=max_class)
            .map(|c| (max_bytes / 8 / class_size(c)).clamp(1, MAX_BIN) as u32)
            .collect()
    }

    /// The counters this cache publishes.
    pub(crate) fn stats(&self) -> &Arc<ThreadStats> {
        &self.stats
    }

    /// Bytes of free blocks in the cache.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether another thread asked for this cache's blocks.
    #[inline(always)]
    pub(crate) fn reclaim_requested(&self) -> bool {
        self.stats.reclaim.load(Ordering::Relaxed)
    }

    /// Whether the cache holds blocks of `class` at all.
    #[inline(always)]
    pub(crate) fn holds_class(&self, class: usize) -> bool {
        class < self.caps.len()
    }

    /// The index of stream `id`'s bins.
    #[inline(always)]
    fn find(&mut self, id: StreamId) -> Option<usize> {
        if let Some(s) = self.streams.get(self.last) {
            if s.id == id {
                return Some(self.last);
            }
        }
        let i = self.streams.iter().position(|s| s.id == id)?;
        self.last = i;
        Some(i)
    }

    #[inline(always)]
    fn publish(&self, i: usize) {
        let (s, slot) = (&self.streams[i], &self.stats.slots[i]);
        slot.bytes.store(s.bytes as u64, Ordering::Relaxed);
        slot.blocks.store(s.blocks as u64, Ordering::Relaxed);
    }

    /// The allocation fast path: a free block of `class` freed on stream `id`, with a
    /// spare handle of that stream and of the pool when there are (`None`: the caller
    /// clones its own). `None` on a miss, or when another thread asked for the blocks.
    #[inline(always)]
    pub(crate) fn pop(&mut self, id: StreamId, class: usize) -> Option<(u64, Option<B::Stream>, Option<P>)> {
        if self.reclaim_requested() {
            return None;
        }
        let i = self.find(id)?;
        let ptr = self.take(i, class)?;
        self.hits += 1;
        self.stats.hits.store(self.hits, Ordering::Relaxed);
        let stream = self.streams[i].spares.pop();
        Some((ptr, stream, self.pool_spares.pop()))
    }

    /// Takes a free block of `class` from the bins of stream index `i`.
    #[inline(always)]
    fn take(&mut self, i: usize, class: usize) -> Option<u64> {
        let s = &mut self.streams[i];
        let ptr = s.bins.get_mut(class)?.pop()?;
        let size = class_size(class);
        s.bytes -= size;
        s.blocks -= 1;
        self.bytes -= size;
        self.publish(i);
        Some(ptr)
    }

    /// The free fast path: keeps a freed block of `class` of stream `id`, and the freed
    /// buffer's handles as spares. Gives the handles back when the block does not fit
    /// (unknown stream, full bin, over budget, reclaim asked): the caller takes the slow
    /// path.
    #[inline(always)]
    pub(crate) fn push(
        &mut self,
        id: StreamId,
        class: usize,
        ptr: u64,
        stream: B::Stream,
        pool: P,
    ) -> Result<(), (B::Stream, P)> {
        if self.reclaim_requested() {
            return Err((stream, pool));
        }
        let Some(i) = self.find(id) else {
            return Err((stream, pool));
        };
        if !self.put(i, class, ptr) {
            return Err((stream, pool));
        }
        self.keep_handles(i, stream, pool);
        Ok(())
    }

    /// Puts a block of `class` into the bins of stream index `i` if the bin and the
    /// budget have room.
    #[inline(always)]
    fn put(&mut self, i: usize, class: usize, ptr: u64) -> bool {
        let size = class_size(class);
        let Some(&cap) = self.caps.get(class) else {
            return false;
        };
        if self.bytes + size > self.max_bytes {
            return false;
        }
        let s = &mut self.streams[i];
        let bin = &mut s.bins[class];
        if bin.len() >= cap as usize {
            return false;
        }
        if bin.capacity() == 0 {
            bin.reserve_exact(cap as usize);
        }
        bin.push(ptr);
        s.bytes += size;
        s.blocks += 1;
        self.bytes += size;
        self.publish(i);
        true
    }

    /// Keeps a freed buffer's handles as spares (drops them when there are enough: the
    /// stream's own handle in the table keeps it alive, so this drop never destroys it).
    #[inline(always)]
    fn keep_handles(&mut self, i: usize, stream: B::Stream, pool: P) {
        let spares = &mut self.streams[i].spares;
        if spares.len() < SPARE_HANDLES {
            spares.push(stream);
        }
        if self.pool_spares.len() < SPARE_HANDLES {
            self.pool_spares.push(pool);
        }
    }

    // ---- slow paths (called by the shared cache) --------------------------------------

    /// The index of `stream`'s bins, making them if needed. Making them in a full table
    /// evicts the stream holding least; its contents come back for the shared cache.
    pub(crate) fn entry(&mut self, stream: &B::Stream) -> (usize, Option<Evicted<B>>) {
        let id = B::stream_id(stream);
        if let Some(i) = self.find(id) {
            return (i, None);
        }
        let fresh = |bins: Box<[Vec<u64>]>| StreamBins {
            id,
            stream: stream.clone(),
            spares: Vec::new(),
            bins,
            bytes: 0,
            blocks: 0,
        };
        let (i, evicted) = if self.streams.len() < MAX_STREAMS {
            let bins = (0..self.caps.len()).map(|_| Vec::new()).collect();
            self.streams.push(fresh(bins));
            (self.streams.len() - 1, None)
        } else {
            let (i, _) = self
                .streams
                .iter()
                .enumerate()
                .min_by_key(|(_, s)| s.bytes)
                .expect("a full table has entries");
            let mut ev = self.drain(i);
            let bins = core::mem::take(&mut self.streams[i].bins);
            let old = core::mem::replace(&mut self.streams[i], fresh(bins));
            ev.stream = old.stream;
            ev.spares = old.spares;
            (i, Some(ev))
        };
        self.stats.slots[i].id.store(id.get(), Ordering::Relaxed);
        self.publish(i);
        self.last = i;
        (i, evicted)
    }

    /// Takes every block of stream index `i` (its handles stay; the returned `stream` is
    /// a clone, and `spares` is empty).
    fn drain(&mut self, i: usize) -> Evicted<B> {
        let s = &mut self.streams[i];
        let blocks: Vec<(usize, Vec<u64>)> = s
            .bins
            .iter_mut()
            .enumerate()
            .filter(|(_, b)| !b.is_empty())
            .map(|(c, b)| (c, core::mem::take(b)))
            .collect();
        self.bytes -= s.bytes;
        s.bytes = 0;
        s.blocks = 0;
        let ev = Evicted {
            stream: s.stream.clone(),
            spares: Vec::new(),
            blocks,
        };
        self.publish(i);
        ev
    }

    /// Takes one block of `class` of stream `stream` (slow path: no handles).
    pub(crate) fn take_block(&mut self, stream: &B::Stream, class: usize) -> Option<u64> {
        let i = self.find(B::stream_id(stream))?;
        self.take(i, class)
    }

    /// Keeps a block of `class` for stream index `i`; false when it does not fit.
    pub(crate) fn put_block(&mut self, i: usize, class: usize, ptr: u64) -> bool {
        self.put(i, class, ptr)
    }

    /// Keeps handles of a freed buffer as spares for stream index `i`.
    pub(crate) fn put_handles(&mut self, i: usize, stream: B::Stream, pool: Option<P>) {
        let spares = &mut self.streams[i].spares;
        if spares.len() < SPARE_HANDLES {
            spares.push(stream);
        }
        if let Some(p) = pool {
            if self.pool_spares.len() < SPARE_HANDLES {
                self.pool_spares.push(p);
            }
        }
    }

    /// How many blocks of `class` a refill brings: half the bin (at least one), as far
    /// as the bin and the budget have room.
    pub(crate) fn refill_count(&self, class: usize) -> usize {
        let Some(&cap) = self.caps.get(class) else {
            return 0;
        };
        let by_bytes = self.max_bytes.saturating_sub(self.bytes) / class_size(class);
        (cap as usize).div_ceil(2).min(by_bytes)
    }

    /// Whether a block of `class` for stream index `i` would fit now.
    pub(crate) fn has_room(&self, i: usize, class: usize) -> bool {
        match self.caps.get(class) {
            Some(&cap) => {
                self.streams[i].bins[class].len() < cap as usize
                    && self.bytes + class_size(class) <= self.max_bytes
            }
            None => false,
        }
    }

    /// Whether the bin of `class` of stream index `i` holds as many blocks as it may.
    pub(crate) fn bin_is_full(&self, i: usize, class: usize) -> bool {
        match self.caps.get(class) {
            Some(&cap) => self.streams[i].bins[class].len() >= cap as usize,
            None => true,
        }
    }

    /// Takes the older half (at least one) of the bin of `class` of stream index `i`.
    pub(crate) fn take_half(&mut self, i: usize, class: usize) -> Vec<u64> {
        let s = &mut self.streams[i];
        let bin = &mut s.bins[class];
        let n = bin.len().div_ceil(2);
        let taken: Vec<u64> = bin.drain(..n).collect();
        let bytes = n * class_size(class);
        s.bytes -= bytes;
        s.blocks -= n;
        self.bytes -= bytes;
        self.publish(i);
        taken
    }

    /// Takes every block except those of `class` of stream index `keep`: makes room
    /// for the working set when stale classes fill the budget.
    pub(crate) fn take_all_but(&mut self, keep: usize, class: usize) -> Vec<Evicted<B>> {
        let mut out = Vec::new();
        for i in 0..self.streams.len() {
            let kept = (i == keep).then(|| core::mem::take(&mut self.streams[i].bins[class]));
            let ev = self.drain(i);
            if let Some(bin) = kept {
                let s = &mut self.streams[i];
                let bytes = bin.len() * class_size(class);
                s.blocks += bin.len();
                s.bytes += bytes;
                self.bytes += bytes;
                s.bins[class] = bin;
                self.publish(i);
            }
            if !ev.blocks.is_empty() {
                out.push(ev);
            }
        }
        out
    }

    /// Takes up to `n` blocks of `class` from the bins of a stream other than `not`,
    /// with a handle of that stream (to record a mark on it before another stream uses
    /// them).
    pub(crate) fn take_from_other_stream(
        &mut self,
        not: StreamId,
        class: usize,
        n: usize,
    ) -> Option<(B::Stream, Vec<u64>)> {
        if !self.holds_class(class) {
            return None;
        }
        let i = self
            .streams
            .iter()
            .position(|s| s.id != not && !s.bins[class].is_empty())?;
        let s = &mut self.streams[i];
        let bin = &mut s.bins[class];
        let k = n.clamp(1, bin.len());
        let taken: Vec<u64> = bin.drain(..k).collect();
        let bytes = k * class_size(class);
        s.bytes -= bytes;
        s.blocks -= k;
        self.bytes -= bytes;
        let stream = s.stream.clone();
        self.publish(i);
        Some((stream, taken))
    }

    /// Takes the largest blocks until at least `excess` bytes are taken (or the cache
    /// is empty): (a handle of the block's stream, class, block) each.
    pub(crate) fn take_largest(&mut self, mut excess: usize) -> Vec<(B::Stream, usize, u64)> {
        let mut out = Vec::new();
        let mut class = self.caps.len();
        while excess > 0 && self.bytes > 0 && class > 0 {
            class -= 1;
            for i in 0..self.streams.len() {
                while excess > 0 {
                    let Some(ptr) = self.take(i, class) else { break };
                    out.push((self.streams[i].stream.clone(), class, ptr));
                    excess = excess.saturating_sub(class_size(class));
                }
            }
        }
        out
    }

    /// Takes everything: every stream's blocks and handles, leaving the cache empty
    /// (the thread exits, or another thread asked for its blocks). Clears the reclaim
    /// flag.
    pub(crate) fn take_all(&mut self) -> (Vec<Evicted<B>>, Vec<P>) {
        let mut out = Vec::with_capacity(self.streams.len());
        for (i, mut s) in self.streams.drain(..).enumerate() {
            let slot = &self.stats.slots[i];
            slot.id.store(0, Ordering::Relaxed);
            slot.bytes.store(0, Ordering::Relaxed);
            slot.blocks.store(0, Ordering::Relaxed);
            let blocks = s
                .bins
                .iter_mut()
                .enumerate()
                .filter(|(_, b)| !b.is_empty())
                .map(|(c, b)| (c, core::mem::take(b)))
                .collect();
            out.push(Evicted {
                stream: s.stream,
                spares: s.spares,
                blocks,
            });
        }
        self.bytes = 0;
        self.last = 0;
        self.stats.reclaim.store(false, Ordering::Relaxed);
        (out, core::mem::take(&mut self.pool_spares))
    }

    /// Checks the byte counts against the bins (debug builds).
    #[cfg(test)]
    pub(crate) fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let mut total = 0;
            for s in &self.streams {
                let bytes: usize = s
                    .bins
                    .iter()
                    .enumerate()
                    .map(|(c, b)| b.len() * class_size(c))
                    .sum();
                let blocks: usize = s.bins.iter().map(Vec::len).sum();
                debug_assert_eq!((bytes, blocks), (s.bytes, s.blocks), "stream {} counts", s.id);
                total += bytes;
            }
            debug_assert!(
                total == self.bytes && total <= self.max_bytes,
                "thread cache holds {total} bytes, counts {} (budget {})",
                self.bytes,
                self.max_bytes
            );
        }
    }
}
