//! A thread cache's slow paths, called by the shared cache (`cache.rs`): making a stream's
//! slot (evicting the stream holding least when all are taken), refills, spills of half a
//! bin, evictions of stale classes, blocks taken for another stream or released, and the
//! flush of everything. They keep the invariant of [`ThreadCache`]'s counts by changing
//! bins only through `count` (bytes == sum over bins of len * size == sum of the published
//! slot bytes; bytes <= max_bytes), and they drop the handles of the blocks they take
//! (never the last of a stream: see the module docs of `thread_cache.rs`) only after the
//! removal is published (`count_taken`: the invariant of [`ThreadStats`]).

use super::*;

impl<B: StreamOrder, P> ThreadCache<B, P> {
    /// The slot of `stream`, making it if needed. Making one in a full table evicts the
    /// stream holding least; its contents come back for the shared cache.
    pub(crate) fn entry(&mut self, stream: &B::Stream) -> (usize, Option<Evicted<B>>) {
        let id = B::stream_id(stream);
        if let Some(i) = self.find::<true>(id) {
            return (i, None);
        }
        let (i, evicted) = match self.ids.iter().position(Option::is_none) {
            Some(i) => (i, None),
            None => {
                let i = (0..MAX_STREAMS).min_by_key(|&i| self.slot_bytes(i)).unwrap_or(0);
                let blocks = self.drain_where(i, |_| true);
                let large = self.evict_large(i);
                self.ids[i] = None;
                let old = self.streams[i].take();
                (
                    i,
                    old.map(|stream| Evicted {
                        stream,
                        blocks,
                        large,
                    }),
                )
            }
        };
        let made = (i + 1) * self.classes;
        if self.bins.len() < made {
            let classes = self.classes;
            let from = self.bins.len();
            self.bins.extend((from..made).map(|k| Bin {
                entries: Vec::new(),
                size: class_size(k % classes),
            }));
        }
        self.ids[i] = Some(id);
        self.streams[i] = Some(stream.clone());
        self.stats.slots[i].id.store(id.get(), Ordering::Relaxed);
        self.last = i;
        (i, evicted)
    }

    /// Takes the blocks of the bins of slot `i` (and drops their handles) for which
    /// `take(class)` says so.
    fn drain_where(&mut self, i: usize, mut take: impl FnMut(usize) -> bool) -> Vec<(usize, Vec<u64>)> {
        let mut out = Vec::new();
        for c in 0..self.classes {
            let Some(bin) = self.bin(i, c) else { break };
            if bin.entries.is_empty() || !take(c) {
                continue;
            }
            let n = bin.entries.len();
            out.push((c, self.take_first(i, c, n)));
        }
        out
    }

    /// The addresses of the `n` oldest blocks of `class` of slot `i` (at most its
    /// length), taken out: their removal published first, then their handles dropped.
    fn take_first(&mut self, i: usize, class: usize, n: usize) -> Vec<u64> {
        let Some(bin) = self.bin(i, class) else {
            return Vec::new();
        };
        let n = n.min(bin.entries.len());
        let (size, bare) = (
            bin.size,
            bin.entries[..n].iter().filter(|e| e.pool.is_none()).count(),
        );
        self.count_taken(i, n, bare, size);
        match self.bin(i, class) {
            Some(bin) => bin.entries.drain(..n).map(|e| e.ptr).collect(),
            None => Vec::new(),
        }
    }

    /// A handle of slot `i`'s stream.
    fn stream_of(&self, i: usize) -> Option<B::Stream> {
        self.streams[i].clone()
    }

    /// Takes one block of `class` of stream `stream` (slow path: its handles dropped).
    pub(crate) fn take_block(&mut self, stream: &B::Stream, class: usize) -> Option<u64> {
        let i = self.find::<true>(B::stream_id(stream))?;
        self.take(i, class)
    }

    /// Takes the newest block of `class` of slot `i` (its handles dropped once the
    /// removal is published). Inlined: `take_largest` tries it on every class.
    #[inline(always)]
    fn take(&mut self, i: usize, class: usize) -> Option<u64> {
        let bin = self.bin(i, class)?;
        let (ptr, handles) = bin.pop()?;
        let size = bin.size;
        self.count_taken(i, 1, usize::from(handles.is_none()), size);
        drop(handles);
        Some(ptr)
    }

    /// Keeps a block of `class` for slot `i` (with no handles; allocating the bin if
    /// needed); false when it does not fit.
    pub(crate) fn put_block(&mut self, i: usize, class: usize, ptr: u64) -> bool {
        self.reserve_bin(i, class);
        self.put(i, class, ptr, &mut None)
    }

    /// Allocates the bin of `class` of slot `i` at its capacity, if not yet.
    fn reserve_bin(&mut self, i: usize, class: usize) {
        let Some(&cap) = self.caps.get(class) else {
            return;
        };
        if let Some(bin) = self.bin(i, class) {
            if bin.entries.capacity() == 0 {
                bin.entries.reserve_exact(cap as usize);
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

    /// The number of blocks in the bin of `class` of slot `i`, and its capacity.
    fn fill(&self, i: usize, class: usize) -> Option<(usize, usize)> {
        let cap = *self.caps.get(class)? as usize;
        let n = self.bins.get(i * self.classes + class)?.entries.len();
        Some((n, cap))
    }

    /// Whether a block of `class` for slot `i` would fit now.
    pub(crate) fn has_room(&self, i: usize, class: usize) -> bool {
        self.fill(i, class)
            .is_some_and(|(n, cap)| n < cap && self.bytes + class_size(class) <= self.max_bytes)
    }

    /// Whether the bin of `class` of slot `i` holds as many blocks as it may.
    pub(crate) fn bin_is_full(&self, i: usize, class: usize) -> bool {
        self.fill(i, class).is_none_or(|(n, cap)| n >= cap)
    }

    /// Takes the older half (at least one) of the bin of `class` of slot `i`.
    pub(crate) fn take_half(&mut self, i: usize, class: usize) -> Vec<u64> {
        let Some(bin) = self.bin(i, class) else {
            return Vec::new();
        };
        let n = bin.entries.len().div_ceil(2);
        self.take_first(i, class, n)
    }

    /// Takes every block except those of `class` of slot `keep`: makes room for the
    /// working set when stale classes fill the budget.
    pub(crate) fn take_all_but(&mut self, keep: usize, class: usize) -> Vec<Evicted<B>> {
        let mut out = Vec::new();
        for i in 0..MAX_STREAMS {
            if self.ids[i].is_none() {
                continue;
            }
            let blocks = self.drain_where(i, |c| i != keep || c != class);
            let large = self.evict_large(i);
            if let (false, Some(stream)) = (blocks.is_empty() && large.is_empty(), self.stream_of(i)) {
                out.push(Evicted {
                    stream,
                    blocks,
                    large,
                });
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
        let i = (0..MAX_STREAMS).find(|&i| {
            self.ids[i].is_some_and(|id| id != not) && self.fill(i, class).is_some_and(|(k, _)| k > 0)
        })?;
        let stream = self.stream_of(i)?;
        let bin = self.bin(i, class)?;
        let k = n.clamp(1, bin.entries.len());
        Some((stream, self.take_first(i, class, k)))
    }

    /// Takes the largest blocks until at least `excess` bytes are taken (or the cache
    /// is empty): (a handle of the block's stream, class, block) each.
    pub(crate) fn take_largest(&mut self, mut excess: usize) -> Vec<(B::Stream, usize, u64)> {
        let mut out = Vec::new();
        let mut class = self.classes;
        // Slots with a stream (and so with bins): the loop below runs on every miss
        // that releases, so it visits only them and clones a stream only for a block.
        let slots: Vec<(usize, B::Stream)> = (0..MAX_STREAMS)
            .filter(|&i| self.slot_bytes(i) > 0)
            .filter_map(|i| Some((i, self.stream_of(i)?)))
            .collect();
        while excess > 0 && self.bytes > 0 && class > 0 {
            class -= 1;
            for (i, stream) in &slots {
                while excess > 0 {
                    let Some(ptr) = self.take(*i, class) else {
                        break;
                    };
                    out.push((stream.clone(), class, ptr));
                    excess = excess.saturating_sub(class_size(class));
                }
            }
        }
        out
    }

    /// Takes everything: every stream's blocks and handles, leaving the cache empty
    /// (the thread exits, or another thread asked for its blocks; the caller clears the
    /// reclaim flag, `Cache::flush_thread`).
    pub(crate) fn take_all(&mut self) -> Vec<Evicted<B>> {
        let mut out = Vec::new();
        for i in 0..MAX_STREAMS {
            let blocks = self.drain_where(i, |_| true);
            let large = self.evict_large(i);
            self.ids[i] = None;
            self.stats.slots[i].id.store(0, Ordering::Relaxed);
            if let Some(stream) = self.streams[i].take() {
                out.push(Evicted {
                    stream,
                    blocks,
                    large,
                });
            }
        }
        self.last = 0;
        out
    }

    /// Checks the byte counts against the bins (debug builds).
    #[cfg(test)]
    pub(crate) fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let mut total = 0;
            for i in 0..MAX_STREAMS {
                let bins = self.bins.iter().skip(i * self.classes).take(self.classes);
                let (bytes, blocks) = bins.fold((0, 0), |(b, n), bin| {
                    (b + bin.entries.len() * bin.size, n + bin.entries.len())
                });
                let (bytes, blocks) = self
                    .large
                    .iter()
                    .filter(|l| l.slot == i)
                    .fold((bytes, blocks), |(b, n), l| (b + l.bytes, n + 1));
                assert!(
                    self.ids[i].is_some() || blocks == 0,
                    "slot {i} is free but holds blocks"
                );
                let slot = &self.stats.slots[i];
                debug_assert_eq!(
                    (bytes as u64, blocks as u64),
                    (
                        slot.bytes.load(Ordering::Relaxed),
                        slot.blocks.load(Ordering::Relaxed)
                    ),
                    "slot {i} counts"
                );
                total += bytes;
            }
            debug_assert!(
                total == self.bytes && total <= self.max_bytes,
                "thread cache holds {total} bytes, counts {} (budget {})",
                self.bytes,
                self.max_bytes
            );
            let bare = self
                .bins
                .iter()
                .flat_map(|b| &b.entries)
                .filter(|e| e.pool.is_none())
                .count()
                + self.large.iter().filter(|l| l.pool.is_none()).count();
            debug_assert_eq!(
                (bare as u64, bare as u64),
                (self.bare, self.stats.bare.load(Ordering::Relaxed)),
                "blocks without handles"
            );
        }
    }
}
