//! What a device cache reports: its counters and a snapshot of its lists and thread
//! caches (no side effect, no CUDA call).

use super::Cache;
use crate::device::backend::Backend;
use crate::device::report::{DevicePoolStats, StreamCacheStats};
use crate::sync::{AtomicU64, Ordering};

/// Event counters of a cache (read-modify-writes happen only on slow paths).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Blocks allocated from the backend.
    pub(crate) misses: AtomicU64,
    /// Batches of blocks one stream took from another.
    pub(crate) steals: AtomicU64,
    /// Marks recorded to order a stream after another (steals and recorded uses).
    pub(crate) marks: AtomicU64,
    /// Allocations that failed.
    pub(crate) failures: AtomicU64,
    /// Blocks given back to the backend.
    pub(crate) released: AtomicU64,
    /// Out-of-memory recoveries attempted (release everything, retry).
    pub(crate) oom_recoveries: AtomicU64,
    /// Times the backend's idle reservations were trimmed (out-of-memory recoveries and
    /// `trim`).
    pub(crate) trims: AtomicU64,
    /// Bytes given up on (never reused, never freed) because a wait for the GPU failed.
    pub(crate) abandoned_bytes: AtomicU64,
}

impl Counters {
    /// Fills the counters' fields of `s`.
    fn fill(&self, s: &mut DevicePoolStats) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        s.misses = load(&self.misses);
        s.steals = load(&self.steals);
        s.events = load(&self.marks);
        s.failures = load(&self.failures);
        s.released = load(&self.released);
        s.oom_recoveries = load(&self.oom_recoveries);
        s.trims = load(&self.trims);
        s.abandoned_bytes = load(&self.abandoned_bytes);
    }
}

/// Free blocks by stream, the shared lists and thread caches merged.
#[derive(Default)]
struct PerStream(Vec<StreamCacheStats>);

impl PerStream {
    fn add(&mut self, stream: u64, bytes: u64, blocks: u64) {
        if blocks == 0 {
            return;
        }
        match self.0.iter_mut().find(|e| e.stream == stream) {
            Some(e) => {
                e.bytes += bytes;
                e.blocks += blocks;
            }
            None => self.0.push(StreamCacheStats {
                stream,
                bytes,
                blocks,
            }),
        }
    }
}

impl<B: Backend> Cache<B> {
    /// The cache's part of a pool's stats (its blocks, the thread caches, the counters;
    /// the device and driver fields are left for the pool to fill): no side effect, no
    /// CUDA call.
    pub(crate) fn snapshot(&self) -> DevicePoolStats {
        let mut s = DevicePoolStats::default();
        let mut per_stream = PerStream::default();
        {
            let sh = self.shared.lock();
            for l in &sh.streams {
                per_stream.add(l.id.get(), l.bytes as u64, l.blocks as u64);
            }
            (s.cached_bytes, s.cached_blocks) = (sh.bytes as u64, sh.blocks as u64);
            (s.pending_bytes, s.pending_blocks) = (sh.pending_bytes as u64, sh.pending_blocks as u64);
        }
        let seen = self.threads.visit(|t| {
            for slot in t.slots.iter().filter(|slot| slot.id.load(Ordering::Relaxed) != 0) {
                let id = slot.id.load(Ordering::Relaxed);
                let (b, n) = (
                    slot.bytes.load(Ordering::Relaxed),
                    slot.blocks.load(Ordering::Relaxed),
                );
                s.cached_bytes += b;
                s.cached_blocks += n;
                per_stream.add(id, b, n);
            }
        });
        (s.hits, s.thread_caches) = (seen.served, seen.threads as u64);
        per_stream.0.sort_unstable_by_key(|e| e.stream);
        s.per_stream = per_stream.0;
        s.held_bytes = self.held.held() as u64;
        s.peak_held_bytes = self.held.peak() as u64;
        let held_blocks = self.held_blocks.load(Ordering::Relaxed) as u64;
        s.live_bytes = s.held_bytes.saturating_sub(s.cached_bytes + s.pending_bytes);
        s.live_buffers = held_blocks.saturating_sub(s.cached_blocks + s.pending_blocks);
        self.counters.fill(&mut s);
        s
    }

    /// Blocks held from the backend (live, cached, pending and in transit).
    #[cfg(all(test, loom))]
    pub(crate) fn held_blocks(&self) -> usize {
        self.held_blocks.load(Ordering::Relaxed)
    }

    /// Misses of cached classes: regrets (a class given back lately) and the others.
    #[cfg_attr(not(any(test, feature = "sim")), allow(dead_code))]
    pub(crate) fn class_misses(&self) -> (u64, u64) {
        self.idle.misses()
    }

    /// Resets the peak of held bytes to the current value.
    pub(crate) fn reset_peak(&self) {
        self.held.reset_peak();
    }

    /// Counts a failure that happened before the cache was reached (a request that can
    /// never fit).
    pub(crate) fn count_failure(&self) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
    }
}
