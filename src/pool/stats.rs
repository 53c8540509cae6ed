//! What a pool reports: bytes and blocks by state, the source's share, hit counts.

use core::fmt;

/// A snapshot of a pool's counters, from [`Pool::stats`](super::Pool::stats) (or summed
/// over the process-wide pools by [`PinnedAlloc::stats`](crate::PinnedAlloc::stats) and
/// [`ManagedAlloc::stats`](crate::ManagedAlloc::stats)).
///
/// Block bytes count whole blocks (a 100-byte request takes a 112-byte block). When no
/// other thread uses the pool during the call, `live_bytes + cached_bytes +
/// pending_bytes == source_bytes` exactly; while threads allocate concurrently the sum
/// is approximate (each thread's counters are read one by one).
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{pool::Pool, source::HostSource};
/// let pool = Pool::new(HostSource);
/// let v: Vec<u8, _> = Vec::with_capacity_in(100, &pool);
/// let s = pool.stats();
/// assert_eq!(s.live_blocks, 1);
/// assert_eq!(s.live_bytes + s.cached_bytes + s.pending_bytes, s.source_bytes);
/// println!("{s}");
/// drop(v);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes of blocks handed out and not yet freed.
    pub live_bytes: usize,
    /// Blocks handed out and not yet freed.
    pub live_blocks: usize,
    /// The most bytes ever handed out at once (an upper bound: it also counts the blocks
    /// parked in thread caches at that moment, at most the thread-cache budget per
    /// thread; exact with thread caches off).
    pub peak_bytes: usize,
    /// Bytes held from the source and free for reuse: free blocks (in thread caches,
    /// shared lists and the large-block cache) and chunk space not yet carved.
    pub cached_bytes: usize,
    /// Free blocks cached (chunk space not yet carved counts no blocks).
    pub cached_blocks: usize,
    /// Bytes of freed blocks waiting for recorded GPU uses to finish.
    pub pending_bytes: usize,
    /// Freed blocks waiting for recorded GPU uses to finish.
    pub pending_blocks: usize,
    /// Bytes held from the source (chunks and large blocks).
    pub source_bytes: usize,
    /// Allocations held from the source (chunks and large blocks).
    pub source_blocks: usize,
    /// The most bytes ever held from the source at once.
    pub peak_source_bytes: usize,
    /// The cap on bytes held from the source (`None`: no limit). Pools that share a
    /// budget (the process-wide pinned pools) report the shared cap.
    pub limit: Option<usize>,
    /// Allocations served without calling the source.
    pub hits: u64,
    /// Allocations that had to call the source (for a new chunk or large block).
    pub misses: u64,
    /// Allocations served from pageable host memory because no CUDA driver was present
    /// (the default handles' fallback; always 0 for a [`Pool`](super::Pool)).
    pub fallbacks: u64,
    /// Allocations that failed (limit reached, source out of memory, absurd size).
    pub failures: u64,
    /// Times an allocation found the pool full and waited for pending blocks' GPU uses
    /// (backpressure, [`PoolConfig::pending_wait`](super::PoolConfig::pending_wait)).
    pub pending_waits: u64,
}

impl PoolStats {
    /// Fraction of allocations served without calling the source (1.0 with none).
    ///
    /// ```
    /// let mut s = cudalloc::pool::PoolStats::default();
    /// (s.hits, s.misses) = (3, 1);
    /// assert_eq!(s.hit_rate(), 0.75);
    /// ```
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            1.0
        } else {
            self.hits as f64 / total as f64
        }
    }

    /// The sum of two snapshots (peaks and limits are summed too: an upper bound; no
    /// limit on either side is no limit).
    ///
    /// ```
    /// use cudalloc::pool::PoolStats;
    /// let mut a = PoolStats::default();
    /// (a.live_bytes, a.hits) = (10, 1);
    /// let b = a.combine(&a);
    /// assert_eq!((b.live_bytes, b.hits), (20, 2));
    /// ```
    pub fn combine(&self, other: &PoolStats) -> PoolStats {
        PoolStats {
            live_bytes: self.live_bytes + other.live_bytes,
            live_blocks: self.live_blocks + other.live_blocks,
            peak_bytes: self.peak_bytes + other.peak_bytes,
            cached_bytes: self.cached_bytes + other.cached_bytes,
            cached_blocks: self.cached_blocks + other.cached_blocks,
            pending_bytes: self.pending_bytes + other.pending_bytes,
            pending_blocks: self.pending_blocks + other.pending_blocks,
            source_bytes: self.source_bytes + other.source_bytes,
            source_blocks: self.source_blocks + other.source_blocks,
            peak_source_bytes: self.peak_source_bytes + other.peak_source_bytes,
            limit: match (self.limit, other.limit) {
                (Some(a), Some(b)) => Some(a.saturating_add(b)),
                _ => None,
            },
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            fallbacks: self.fallbacks + other.fallbacks,
            failures: self.failures + other.failures,
            pending_waits: self.pending_waits + other.pending_waits,
        }
    }
}

/// Bytes in binary units, three significant digits.
pub(crate) struct Bytes(pub(crate) usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 == usize::MAX {
            return f.pad("none");
        }
        let mut v = self.0 as f64;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        let s = if unit == 0 {
            format!("{} B", self.0)
        } else {
            format!("{v:.1} {}", UNITS[unit])
        };
        f.pad(&s)
    }
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<8} {:>12} {:>10}", "", "bytes", "blocks")?;
        writeln!(
            f,
            "{:<8} {:>12} {:>10}",
            "live",
            Bytes(self.live_bytes),
            self.live_blocks
        )?;
        writeln!(f, "{:<8} {:>12} {:>10}", "peak", Bytes(self.peak_bytes), "")?;
        writeln!(
            f,
            "{:<8} {:>12} {:>10}",
            "cached",
            Bytes(self.cached_bytes),
            self.cached_blocks
        )?;
        writeln!(
            f,
            "{:<8} {:>12} {:>10}",
            "pending",
            Bytes(self.pending_bytes),
            self.pending_blocks
        )?;
        writeln!(
            f,
            "{:<8} {:>12} {:>10}",
            "source",
            Bytes(self.source_bytes),
            self.source_blocks
        )?;
        writeln!(
            f,
            "{:<8} {:>12} {:>10}",
            "peak src",
            Bytes(self.peak_source_bytes),
            ""
        )?;
        writeln!(
            f,
            "{:<8} {:>12}",
            "limit",
            Bytes(self.limit.unwrap_or(usize::MAX))
        )?;
        write!(
            f,
            "hits {} ({:.1}%), misses {}, fallbacks {}, failures {}, waits for the GPU {}",
            self.hits,
            100.0 * self.hit_rate(),
            self.misses,
            self.fallbacks,
            self.failures,
            self.pending_waits
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_a_small_table() {
        let s = PoolStats {
            live_bytes: 3 << 20,
            live_blocks: 2,
            hits: 9,
            misses: 1,
            limit: None,
            ..Default::default()
        };
        let text = s.to_string();
        assert!(text.contains("live"), "{text}");
        assert!(text.contains("3.0 MiB"), "{text}");
        assert!(text.contains("hits 9 (90.0%)"), "{text}");
        assert!(text.contains("none"), "{text}");
        assert_eq!(Bytes(100).to_string(), "100 B");
    }
}
