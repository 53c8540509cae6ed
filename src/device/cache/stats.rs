//! What a device cache reports: its counters and a snapshot of its lists and thread
//! caches (no side effect, no CUDA call).

use super::Cache;
use crate::device::backend::Backend;
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

/// What [`Cache::snapshot`] reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) held_bytes: u64,
    pub(crate) held_blocks: u64,
    pub(crate) peak_held_bytes: u64,
    pub(crate) cached_bytes: u64,
    pub(crate) cached_blocks: u64,
    pub(crate) pending_bytes: u64,
    pub(crate) pending_blocks: u64,
    /// (stream id, cached bytes, cached blocks), the shared lists and thread caches merged.
    pub(crate) per_stream: Vec<(u64, u64, u64)>,
    pub(crate) thread_caches: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) steals: u64,
    pub(crate) marks: u64,
    pub(crate) failures: u64,
    pub(crate) released: u64,
    pub(crate) oom_recoveries: u64,
    pub(crate) trims: u64,
    pub(crate) abandoned_bytes: u64,
}

impl<B: Backend> Cache<B> {
    /// A snapshot of the counters: no side effect, no CUDA call.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut per_stream: Vec<(u64, u64, u64)> = Vec::new();
        let mut add = |id: u64, bytes: u64, blocks: u64| {
            if blocks == 0 {
                return;
            }
            match per_stream.iter_mut().find(|e| e.0 == id) {
                Some(e) => {
                    e.1 += bytes;
                    e.2 += blocks;
                }
                None => per_stream.push((id, bytes, blocks)),
            }
        };
        let (mut cached_bytes, mut cached_blocks, pending_bytes, pending_blocks) = {
            let sh = self.shared.lock();
            for s in &sh.streams {
                add(s.id.get(), s.bytes as u64, s.blocks as u64);
            }
            (
                sh.bytes as u64,
                sh.blocks as u64,
                sh.pending_bytes as u64,
                sh.pending_blocks as u64,
            )
        };
        let seen = self.threads.visit(|t| {
            for slot in &t.slots {
                let id = slot.id.load(Ordering::Relaxed);
                if id != 0 {
                    let (b, n) = (
                        slot.bytes.load(Ordering::Relaxed),
                        slot.blocks.load(Ordering::Relaxed),
                    );
                    cached_bytes += b;
                    cached_blocks += n;
                    add(id, b, n);
                }
            }
        });
        let (hits, thread_caches) = (seen.served, seen.threads as u64);
        per_stream.sort_unstable();
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            held_bytes: self.held.held() as u64,
            held_blocks: self.held_blocks.load(Ordering::Relaxed) as u64,
            peak_held_bytes: self.held.peak() as u64,
            cached_bytes,
            cached_blocks,
            pending_bytes,
            pending_blocks,
            per_stream,
            thread_caches,
            hits,
            misses: load(&c.misses),
            steals: load(&c.steals),
            marks: load(&c.marks),
            failures: load(&c.failures),
            released: load(&c.released),
            oom_recoveries: load(&c.oom_recoveries),
            trims: load(&c.trims),
            abandoned_bytes: load(&c.abandoned_bytes),
        }
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
