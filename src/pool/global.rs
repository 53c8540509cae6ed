//! The process-wide pools behind [`PinnedAlloc`](crate::PinnedAlloc) (one per
//! combination of the three `cuMemHostAlloc` flags, sharing one limit) and
//! [`ManagedAlloc`](crate::ManagedAlloc) (one per attach mode), created on first use;
//! how pinned pools grow; and [`record_use`] for any pooled pointer.

use core::ptr::NonNull;

use super::shared::Budget;
use super::{Pool, PoolConfig};
use crate::cuda::{HostAllocFlags, Stream};
use crate::error::Result;
use crate::source::{
    physical_memory, HostVisible, ManagedAttach, ManagedSource, MemoryKind, MemorySource, PinnedSource,
    RegisteredSource,
};
use crate::sync::global::OnceLock;
use crate::sync::Arc;

/// How a pinned pool takes memory from the driver.
///
/// ```
/// use cudalloc::pool::PinnedGrowth;
/// assert_eq!(PinnedGrowth::default(), PinnedGrowth::Auto);
/// assert_eq!(PinnedGrowth::parse("register"), Some(PinnedGrowth::Register));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PinnedGrowth {
    /// Whichever was faster on the H200 machine for the size (the default): register
    /// blocks below [`REGISTER_BELOW`] (64 MiB), `cuMemHostAlloc` the rest. Measured
    /// there (allocate + free, `bench pool/pinned_growth`, 2026-11-29): register 0.37 ms
    /// vs 1.28 ms at 2 MiB, 0.98 vs 4.18 ms at 8 MiB, 21.3 vs 22.6 ms at 32 MiB, but
    /// 88.9 vs 64.8 ms at 128 MiB and 176 vs 154 ms at 256 MiB.
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

    /// The choice for the process-wide pinned pools: `CUDALLOC_PINNED_GROWTH`
    /// (`auto`, `hostalloc` or `register`) if set and valid, else the default.
    pub fn from_env() -> Self {
        match std::env::var("CUDALLOC_PINNED_GROWTH") {
            Ok(v) => Self::parse(&v).unwrap_or_else(|| {
                log::warn!("cudalloc: CUDALLOC_PINNED_GROWTH={v:?} is neither hostalloc nor register; using the default");
                Self::default()
            }),
            Err(_) => Self::default(),
        }
    }
}

/// Blocks below this size are registered by [`PinnedGrowth::Auto`]; larger ones come from
/// `cuMemHostAlloc`.
pub const REGISTER_BELOW: usize = 64 << 20;

/// Pinned memory with the given flags, from `cuMemHostAlloc` or by registering host
/// memory, as [`PinnedGrowth`] says: the source of the process-wide pinned pools.
///
/// ```
/// use cudalloc::{cuda::HostAllocFlags, pool::{PinnedGrowth, PinnedPoolSource, Pool}};
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
    /// pure function of the size, so `deallocate` takes the path `allocate` took.
    fn registers(&self, size: usize) -> bool {
        match self.growth {
            PinnedGrowth::Auto => size < REGISTER_BELOW,
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
    fn kind(&self) -> MemoryKind {
        match self.growth {
            PinnedGrowth::Register => MemoryKind::Registered,
            PinnedGrowth::HostAlloc | PinnedGrowth::Auto => MemoryKind::Pinned,
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
}

// SAFETY: both inner sources return host-visible memory.
unsafe impl HostVisible for PinnedPoolSource {}

/// Parses a byte count: digits with an optional unit `K`, `M`, `G`, `T` (powers of
/// 1024, optionally followed by `i`/`B`: `8G`, `512MiB`, `1048576`).
pub(crate) fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: usize = s[..digits].parse().ok()?;
    let unit = s[digits..].trim().to_ascii_uppercase();
    let unit = unit.trim_end_matches('B').trim_end_matches('I');
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return None,
    };
    n.checked_mul(1usize << shift)
}

/// The default cap on pinned bytes held by the process-wide pinned pools together:
/// `CUDALLOC_PINNED_LIMIT` (bytes, or with a unit: `8G`, `512M`) if set and valid, else a
/// quarter of physical memory (or no cap where that is unknown).
///
/// ```
/// let limit = cudalloc::pool::pinned_default_limit();
/// assert!(limit > 0);
/// ```
pub fn pinned_default_limit() -> usize {
    if let Ok(v) = std::env::var("CUDALLOC_PINNED_LIMIT") {
        match parse_bytes(&v) {
            Some(n) => return n,
            None => log::warn!(
                "cudalloc: CUDALLOC_PINNED_LIMIT={v:?} is not a byte count (like 8G); using the default"
            ),
        }
    }
    physical_memory().map_or(usize::MAX, |m| m / 4)
}

fn pinned_budget() -> &'static Arc<Budget> {
    static BUDGET: OnceLock<Arc<Budget>> = OnceLock::new();
    BUDGET.get_or_init(|| Arc::new(Budget::new(pinned_default_limit())))
}

/// Sets the cap on pinned bytes held by the process-wide pinned pools together.
pub(crate) fn set_pinned_limit(bytes: usize) {
    pinned_budget().set_limit(bytes);
}

/// The cap on pinned bytes held by the process-wide pinned pools together.
pub(crate) fn pinned_limit() -> usize {
    pinned_budget().limit()
}

static PINNED: [OnceLock<Pool<PinnedPoolSource>>; 8] = [const { OnceLock::new() }; 8];
static MANAGED: [OnceLock<Pool<ManagedSource>>; 2] = [const { OnceLock::new() }; 2];

/// The process-wide pinned pool for `flags`, created on first use.
#[inline]
pub(crate) fn pinned_pool(flags: HostAllocFlags) -> &'static Pool<PinnedPoolSource> {
    PINNED[(flags.bits() & 7) as usize].get_or_init(|| {
        let source = PinnedPoolSource::new(flags, PinnedGrowth::from_env());
        Pool::with_budget(source, PoolConfig::default(), pinned_budget().clone())
    })
}

/// The process-wide pinned pools created so far.
pub(crate) fn pinned_pools() -> impl Iterator<Item = &'static Pool<PinnedPoolSource>> {
    PINNED.iter().filter_map(OnceLock::get)
}

fn attach_index(attach: ManagedAttach) -> usize {
    match attach {
        ManagedAttach::Global => 0,
        ManagedAttach::Host => 1,
    }
}

/// The process-wide managed pool for `attach`, created on first use. No limit of its
/// own: `ManagedSource` refuses to hold more than 90% of the device's memory.
#[inline]
pub(crate) fn managed_pool(attach: ManagedAttach) -> &'static Pool<ManagedSource> {
    MANAGED[attach_index(attach)].get_or_init(|| Pool::new(ManagedSource::new(attach)))
}

/// The process-wide managed pools created so far.
pub(crate) fn managed_pools() -> impl Iterator<Item = &'static Pool<ManagedSource>> {
    MANAGED.iter().filter_map(OnceLock::get)
}

/// Records that work queued on `stream` uses the memory at `ptr`, if it lies in a block
/// of any of the crate's pools (the process-wide ones behind [`PinnedAlloc`] and
/// [`ManagedAlloc`], or a [`Pool`]): if that block is freed before the work completes,
/// it is not handed out again until then. Returns whether a pool held `ptr` (memory from
/// elsewhere needs no record: nothing reuses it behind the caller's back).
///
/// The copy helpers in [`crate::copy`] call it themselves; call it after queuing other
/// work (a kernel, a cudarc copy) that reads or writes a pooled block.
///
/// [`PinnedAlloc`]: crate::PinnedAlloc
/// [`ManagedAlloc`]: crate::ManagedAlloc
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{cuda::Stream, PinnedAlloc};
/// if let Ok(stream) = Stream::new(0) {
///     let mut v: Vec<u8, _> = Vec::new_in(PinnedAlloc);
///     v.extend(0..=255);
///     // ... queue work reading `v` on `stream` through another API, then:
///     assert!(cudalloc::record_use(v.as_ptr(), &stream).unwrap());
///     drop(v); // the block is reused only after the work completes
/// }
/// ```
pub fn record_use(ptr: *const u8, stream: &Stream) -> Result<bool> {
    #[cfg(not(loom))]
    {
        let Some(owner) = super::registry::find(ptr as usize) else {
            return Ok(false);
        };
        let event = crate::cuda::PooledEvent::record(stream)?;
        owner.record(ptr as usize, Box::new(event))?;
        Ok(true)
    }
    #[cfg(loom)]
    {
        let _ = (ptr, stream);
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_units() {
        assert_eq!(parse_bytes("1048576"), Some(1 << 20));
        assert_eq!(parse_bytes("8G"), Some(8 << 30));
        assert_eq!(parse_bytes("8g"), Some(8 << 30));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("4 KB"), Some(4096));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("3X"), None);
        assert_eq!(parse_bytes("99999999999T"), None);
    }

    #[test]
    fn write_combined_pools_always_use_host_alloc() {
        let s = PinnedPoolSource::new(HostAllocFlags::WRITE_COMBINED, PinnedGrowth::Register);
        assert_eq!(s.growth(), PinnedGrowth::HostAlloc);
        let s = PinnedPoolSource::new(HostAllocFlags::DEVICE_MAP, PinnedGrowth::Register);
        assert_eq!(s.kind(), MemoryKind::Registered);
    }
}
