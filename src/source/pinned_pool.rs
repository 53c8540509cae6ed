//! Pinned memory from `cuMemHostAlloc` or by registering host memory, chosen by size: the
//! source of the process-wide pinned pools behind [`PinnedAlloc`](crate::PinnedAlloc).

use core::ptr::NonNull;

use super::{HostVisible, MemorySource, PinnedSource, RegisteredSource};
use crate::cuda::HostAllocFlags;
use crate::cuda::MemoryType;
use crate::error::Result;

/// How a pinned pool takes memory from the driver.
///
/// ```
/// use cudalloc::source::PinnedGrowth;
/// assert_eq!(PinnedGrowth::default(), PinnedGrowth::Auto);
/// assert_eq!(PinnedGrowth::parse("register"), Some(PinnedGrowth::Register));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PinnedGrowth {
    /// The default: register every block when its pages can be faulted in by more than
    /// one thread (the machine has two or more CPUs available, see [`RegisteredSource`]);
    /// on one CPU, register blocks below 64 MiB and `cuMemHostAlloc` the rest, the faster
    /// of the two on one thread. Measured on the H200 machine with one thread touching
    /// the pages (allocate + free, `bench pool/pinned_growth`, 2026-11-29): register
    /// 0.37 ms vs 1.28 ms at 2 MiB, 0.98 vs 4.18 ms at 8 MiB, 21.3 vs 22.6 ms at 32 MiB,
    /// but 88.9 vs 64.8 ms at 128 MiB and 176 vs 154 ms at 256 MiB; the first
    /// allocation of 1 GiB took 531-570 ms either way, against 133 ms for PyTorch's
    /// registering with 8 threads (`ab --only cold` measures both).
    #[default]
    Auto,
    /// `cuMemHostAlloc` ([`PinnedSource`]) for every block.
    HostAlloc,
    /// Page-aligned memory from the system allocator, touched, then `cuMemHostRegister`
    /// ([`RegisteredSource`]). Not possible with `WRITE_COMBINED` (which only
    /// `cuMemHostAlloc` provides); such pools use `HostAlloc`.
    Register,
}

impl PinnedGrowth {
    /// `"auto"`, `"hostalloc"` or `"register"` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "hostalloc" | "host_alloc" | "cumemhostalloc" => Some(Self::HostAlloc),
            "register" | "registered" | "cumemhostregister" => Some(Self::Register),
            _ => None,
        }
    }

    /// The choice for the process-wide pinned pools: `CUDALLOC_PINNED_GROWTH` (`auto`,
    /// `hostalloc` or `register`) if set and valid, else the default (an invalid value is
    /// ignored with one warning that lists the valid ones).
    pub fn from_env() -> Self {
        crate::util::env_var(
            "CUDALLOC_PINNED_GROWTH",
            "auto, hostalloc or register",
            Self::parse,
        )
        .unwrap_or_default()
    }
}

/// On a machine with one CPU, blocks below this size are registered by
/// [`PinnedGrowth::Auto`] and larger ones come from `cuMemHostAlloc` (the faster of the
/// two at each size with one thread touching the pages, on the H200 machine).
const REGISTER_BELOW: usize = 64 << 20;

/// Pinned memory with the given flags, from `cuMemHostAlloc` or by registering host
/// memory, as [`PinnedGrowth`] says: the source of the process-wide pinned pools.
///
/// ```
/// use cudalloc::{cuda::HostAllocFlags, pool::Pool, source::{PinnedGrowth, PinnedPoolSource}};
/// let pool = Pool::new(PinnedPoolSource::new(HostAllocFlags::PORTABLE, PinnedGrowth::Register));
/// # drop(pool);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedPoolSource {
    flags: HostAllocFlags,
    growth: PinnedGrowth,
}

impl PinnedPoolSource {
    /// A source for `flags` growing by `growth` (`HostAlloc` if the flags need it).
    pub const fn new(flags: HostAllocFlags, growth: PinnedGrowth) -> Self {
        let growth = if flags.contains(HostAllocFlags::WRITE_COMBINED) {
            PinnedGrowth::HostAlloc
        } else {
            growth
        };
        Self { flags, growth }
    }

    /// The flags.
    pub const fn flags(&self) -> HostAllocFlags {
        self.flags
    }

    /// How it takes memory.
    pub const fn growth(&self) -> PinnedGrowth {
        self.growth
    }

    fn registered(&self) -> RegisteredSource {
        RegisteredSource::new(self.flags.contains(HostAllocFlags::DEVICE_MAP))
    }

    /// Whether a block of `size` bytes is registered rather than `cuMemHostAlloc`ed: a
    /// pure function of the size (the prefault's thread cap is read once per process),
    /// so `deallocate` takes the path `allocate` took.
    fn registers(&self, size: usize) -> bool {
        match self.growth {
            PinnedGrowth::Auto => size < REGISTER_BELOW || super::prefault::max_threads() > 1,
            PinnedGrowth::HostAlloc => false,
            PinnedGrowth::Register => true,
        }
    }
}

// SAFETY: forwards each block to PinnedSource or RegisteredSource, chosen by `registers`,
// a pure function of the block size, so a block is freed by the source that allocated it;
// `align` is the smaller of the two sources' alignments (both are fixed).
unsafe impl MemorySource for PinnedPoolSource {
    fn align(&self) -> usize {
        PinnedSource::new(self.flags)
            .align()
            .min(self.registered().align())
    }
    fn kind(&self) -> MemoryType {
        match self.growth {
            PinnedGrowth::Register => MemoryType::Registered,
            PinnedGrowth::HostAlloc | PinnedGrowth::Auto => MemoryType::PinnedHost,
        }
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        if self.registers(size) {
            self.registered().allocate(size)
        } else {
            PinnedSource::new(self.flags).allocate(size)
        }
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: the caller's obligations; `registers(size)` picks the source that
        // allocated the block, as in `allocate`.
        unsafe {
            if self.registers(size) {
                self.registered().deallocate(ptr, size)
            } else {
                PinnedSource::new(self.flags).deallocate(ptr, size)
            }
        }
    }
    fn device_mapped(&self, ptr: NonNull<u8>, size: usize) -> bool {
        if self.registers(size) {
            self.registered().device_mapped(ptr, size)
        } else {
            PinnedSource::new(self.flags).device_mapped(ptr, size)
        }
    }
}

// SAFETY: both inner sources return host-visible memory.
unsafe impl HostVisible for PinnedPoolSource {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_combined_pools_always_use_host_alloc() {
        let s = PinnedPoolSource::new(HostAllocFlags::WRITE_COMBINED, PinnedGrowth::Register);
        assert_eq!(s.growth(), PinnedGrowth::HostAlloc);
        let s = PinnedPoolSource::new(HostAllocFlags::DEVICE_MAP, PinnedGrowth::Register);
        assert_eq!(s.kind(), MemoryType::Registered);
    }

    #[test]
    fn growth_parses_its_three_names() {
        assert_eq!(PinnedGrowth::parse("AUTO"), Some(PinnedGrowth::Auto));
        assert_eq!(PinnedGrowth::parse("hostalloc"), Some(PinnedGrowth::HostAlloc));
        assert_eq!(PinnedGrowth::parse(" register "), Some(PinnedGrowth::Register));
        assert_eq!(PinnedGrowth::parse("mmap"), None);
    }
}
