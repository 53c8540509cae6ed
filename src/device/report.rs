//! What device pools report: [`DevicePoolStats`] (one pool, printable for users),
//! [`DeviceMemorySummary`] (carried by out-of-memory errors) and [`DeviceReport`] (every
//! device of the machine and its process-wide pool).

use core::fmt;

/// Free blocks one stream has in a pool's cache (thread caches and shared lists).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct StreamCacheStats {
    /// The stream's id ([`StreamId::get`](crate::cuda::StreamId::get)).
    pub stream: u64,
    /// Bytes of its free blocks.
    pub bytes: u64,
    /// Its free blocks.
    pub blocks: u64,
}

/// A snapshot of a [`DevicePool`](super::DevicePool)'s state. `Display` prints it as a
/// short report for users.
///
/// Bytes are block bytes (requests rounded up to their size class): `live + cached +
/// pending == held`, what the pool holds from its driver pool, which in turn reserves
/// `reserved` from the device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DevicePoolStats {
    /// The device.
    pub device: usize,
    /// Whether the pool caches freed blocks.
    pub caching: bool,
    /// Bytes of buffers alive now.
    pub live_bytes: u64,
    /// Buffers (of nonzero size) alive now.
    pub live_buffers: u64,
    /// Bytes of free blocks in the cache (thread caches and shared lists).
    pub cached_bytes: u64,
    /// Free blocks in the cache.
    pub cached_blocks: u64,
    /// Bytes of freed blocks waiting for work recorded on other streams
    /// ([`record_use`](super::DeviceBuffer::record_use)) to complete.
    pub pending_bytes: u64,
    /// Blocks waiting so.
    pub pending_blocks: u64,
    /// Bytes held from the driver pool and the page heap: live, cached and pending.
    pub held_bytes: u64,
    /// The most bytes held at once.
    pub peak_held_bytes: u64,
    /// Bytes the driver pool reserves from the device now (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`;
    /// 0 if the driver could not say), plus, with
    /// [`Backing::PhysicalPages`](super::Backing::PhysicalPages), the bytes of the page
    /// heap's physical handles.
    pub reserved_bytes: u64,
    /// The most it reserved. With a [limit](super::DevicePoolConfig::limit), the peak of the
    /// driver pool's and the page heap's reservations together (which the limit holds to);
    /// without one, `..._RESERVED_MEM_HIGH` plus the page heap's peak (the sum of the two
    /// peaks, an upper bound of the peak of the sum).
    pub peak_reserved_bytes: u64,
    /// Bytes of the driver pool's allocations not yet freed (`..._USED_MEM_CURRENT`):
    /// held bytes, plus frees still queued; plus the page heap's bytes in blocks.
    pub used_bytes: u64,
    /// The most at once (`..._USED_MEM_HIGH`, plus the page heap's peak).
    pub peak_used_bytes: u64,
    /// The configured limit (`None`: none).
    pub limit: Option<usize>,
    /// Free memory of the device (`cuMemGetInfo`; 0 if the driver could not say).
    pub device_free_bytes: u64,
    /// Total memory of the device.
    pub device_total_bytes: u64,
    /// Cached free blocks by stream, by stream id.
    pub per_stream: Vec<StreamCacheStats>,
    /// Threads holding a cache for this pool.
    pub thread_caches: u64,
    /// Allocations served from a thread's bin without a lock.
    pub hits: u64,
    /// Blocks allocated from the driver pool.
    pub misses: u64,
    /// Times a stream took blocks another stream had freed (after an event).
    pub steals: u64,
    /// Events recorded to order one stream after another (steals and recorded uses).
    pub events: u64,
    /// Allocations that failed.
    pub failures: u64,
    /// Blocks given back to the driver pool or the page heap.
    pub released: u64,
    /// Times the pool ran out of memory and released its cache to retry.
    pub oom_recoveries: u64,
    /// Times the pool returned the driver pool's idle reservations to the device
    /// (`cuMemPoolTrimTo`): in [`DevicePool::trim`](super::DevicePool::trim) and in
    /// out-of-memory recoveries.
    pub trims: u64,
    /// Bytes given up on (never reused, never freed) because waiting for the GPU failed.
    /// Nonzero means the GPU reported an error.
    pub abandoned_bytes: u64,
}

/// Bytes as a short human figure (`1.5 GiB`).
pub(crate) struct Bytes(pub(crate) u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut unit = 0;
        while v >= 1024.0 && unit < UNITS.len() - 1 {
            v /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{v:.1} {}", UNITS[unit])
        }
    }
}

/// Prints the report:
///
/// ```text
/// device 0: 139.8 GiB total, 120.3 GiB free
///   pool: live 10.0 GiB in 1234 buffers, cached 1.5 GiB in 77 blocks, pending 0 B
///   held 11.5 GiB (peak 14.0 GiB), reserved 12.0 GiB (peak 14.2 GiB), no limit
///   cached by stream: stream#3 1.0 GiB in 50 blocks; stream#7 512.0 MiB in 27 blocks
///   allocations: 123456 hits, 1234 from the driver, 12 cross-stream takes (12 events), 0 failed
///   released: 1200 blocks to the driver pool or pages, 30 trims of its idle reservations
/// ```
impl fmt::Display for DevicePoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_memory(f)?;
        self.fmt_activity(f)
    }
}

impl DevicePoolStats {
    /// The report's lines on memory: the device, the pool's bytes, its limit.
    fn fmt_memory(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "device {}: {} total, {} free",
            self.device,
            Bytes(self.device_total_bytes),
            Bytes(self.device_free_bytes)
        )?;
        writeln!(
            f,
            "  pool{}: live {} in {} buffers, cached {} in {} blocks, pending {}",
            if self.caching { "" } else { " (uncached)" },
            Bytes(self.live_bytes),
            self.live_buffers,
            Bytes(self.cached_bytes),
            self.cached_blocks,
            Bytes(self.pending_bytes)
        )?;
        write!(
            f,
            "  held {} (peak {}), reserved {} (peak {}), ",
            Bytes(self.held_bytes),
            Bytes(self.peak_held_bytes),
            Bytes(self.reserved_bytes),
            Bytes(self.peak_reserved_bytes)
        )?;
        match self.limit {
            None => writeln!(f, "no limit")?,
            Some(l) => writeln!(f, "limit {}", Bytes(l as u64))?,
        }
        Ok(())
    }

    /// The report's lines on what the pool did: cached bytes by stream, allocations,
    /// releases.
    fn fmt_activity(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.per_stream.is_empty() {
            write!(f, "  cached by stream:")?;
            for (i, s) in self.per_stream.iter().enumerate() {
                let sep = if i == 0 { " " } else { "; " };
                write!(
                    f,
                    "{sep}stream#{} {} in {} blocks",
                    s.stream,
                    Bytes(s.bytes),
                    s.blocks
                )?;
            }
            writeln!(f)?;
        }
        write!(
            f,
            "  allocations: {} hits, {} from the driver, {} cross-stream takes ({} events), {} failed",
            self.hits, self.misses, self.steals, self.events, self.failures
        )?;
        if self.oom_recoveries > 0 {
            write!(f, ", {} out-of-memory recoveries", self.oom_recoveries)?;
        }
        if self.abandoned_bytes > 0 {
            write!(f, ", {} abandoned after GPU errors", Bytes(self.abandoned_bytes))?;
        }
        if self.released > 0 {
            write!(
                f,
                "\n  released: {} blocks to the driver pool or pages, {} trims of its idle reservations",
                self.released, self.trims
            )?;
        }
        Ok(())
    }
}

/// The state of a device pool when it ran out of memory, carried by
/// [`Error::DeviceOutOfMemory`](crate::Error::DeviceOutOfMemory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct DeviceMemorySummary {
    /// Bytes of live buffers.
    pub live_bytes: u64,
    /// Bytes of free blocks still cached (in other threads' caches: the pool released its
    /// own and the shared ones before failing).
    pub cached_bytes: u64,
    /// Bytes of freed blocks waiting for recorded uses.
    pub pending_bytes: u64,
    /// Bytes the pool held from its driver pool and page heap.
    pub held_bytes: u64,
    /// Bytes the pool reserved from the device (its driver pool and its page heap).
    pub reserved_bytes: u64,
    /// The pool's limit (`None`: none).
    pub limit_bytes: Option<u64>,
    /// Free memory of the device.
    pub device_free_bytes: u64,
}

impl fmt::Display for DeviceMemorySummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "live {}, cached {}, pending {}, held {}, reserved {}, ",
            Bytes(self.live_bytes),
            Bytes(self.cached_bytes),
            Bytes(self.pending_bytes),
            Bytes(self.held_bytes),
            Bytes(self.reserved_bytes)
        )?;
        match self.limit_bytes {
            None => write!(f, "no limit")?,
            Some(l) => write!(f, "limit {}", Bytes(l))?,
        }
        write!(f, ", device free {}", Bytes(self.device_free_bytes))
    }
}

/// Every device of the machine: its name and memory, and the state of its process-wide
/// pool ([`DevicePool::get`](super::DevicePool::get)) if one was created. `Display`
/// prints it for users.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceReport {
    /// One entry per device, by ordinal.
    pub devices: Vec<DeviceEntry>,
}

/// One device in a [`DeviceReport`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceEntry {
    /// The ordinal.
    pub device: usize,
    /// The name (`NVIDIA H200`; empty if the driver could not say).
    pub name: String,
    /// Free memory (`cuMemGetInfo`).
    pub free_bytes: u64,
    /// Total memory.
    pub total_bytes: u64,
    /// The process-wide pool's state, if it exists.
    pub pool: Option<DevicePoolStats>,
}

impl fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.devices.is_empty() {
            return write!(f, "no CUDA device");
        }
        for (i, d) in self.devices.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            match &d.pool {
                Some(p) => {
                    write!(f, "[{}] ", d.name)?;
                    write!(f, "{p}")?;
                }
                None => write!(
                    f,
                    "device {} [{}]: {} total, {} free, no pool",
                    d.device,
                    d.name,
                    Bytes(d.total_bytes),
                    Bytes(d.free_bytes)
                )?,
            }
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_pool_report_prints_every_line() {
        let s = DevicePoolStats {
            device: 0,
            caching: true,
            live_bytes: 10 << 30,
            live_buffers: 1234,
            cached_bytes: 3 << 29,
            cached_blocks: 77,
            held_bytes: 23 << 29,
            peak_held_bytes: 14 << 30,
            reserved_bytes: 12 << 30,
            peak_reserved_bytes: 14 << 30,
            device_total_bytes: 140 << 30,
            device_free_bytes: 120 << 30,
            per_stream: vec![
                StreamCacheStats {
                    stream: 3,
                    bytes: 1 << 30,
                    blocks: 50,
                },
                StreamCacheStats {
                    stream: 7,
                    bytes: 512 << 20,
                    blocks: 27,
                },
            ],
            hits: 123456,
            misses: 1234,
            steals: 12,
            events: 12,
            released: 1200,
            trims: 30,
            oom_recoveries: 1,
            ..DevicePoolStats::default()
        };
        let want = "device 0: 140.0 GiB total, 120.0 GiB free\n\
                    \x20 pool: live 10.0 GiB in 1234 buffers, cached 1.5 GiB in 77 blocks, pending 0 B\n\
                    \x20 held 11.5 GiB (peak 14.0 GiB), reserved 12.0 GiB (peak 14.0 GiB), no limit\n\
                    \x20 cached by stream: stream#3 1.0 GiB in 50 blocks; stream#7 512.0 MiB in 27 blocks\n\
                    \x20 allocations: 123456 hits, 1234 from the driver, 12 cross-stream takes (12 events), \
                    0 failed, 1 out-of-memory recoveries\n\
                    \x20 released: 1200 blocks to the driver pool or pages, 30 trims of its idle reservations";
        assert_eq!(s.to_string(), want);
    }
}
