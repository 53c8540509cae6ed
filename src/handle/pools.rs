//! The process-wide pools behind the handles: one pinned pool per combination of the three
//! `cuMemHostAlloc` flags (8, sharing one cap) and one managed pool per attach mode, made
//! on first use; and the environment variables that configure them.

use crate::budget::Budget;
use crate::cuda::HostAllocFlags;
use crate::pool::{Pool, PoolConfig};
use crate::source::{ManagedAttach, ManagedSource, PinnedGrowth, PinnedPoolSource};
use crate::sync::global::OnceLock;
use crate::sync::Arc;
use crate::util::{env_var, parse_bytes, physical_memory};

/// Parses `CUDALLOC_PINNED_LIMIT`: a byte count (`8G`, `512MiB`, `0`: no pinned memory at
/// all), or `none`/`unlimited` for no cap. Any cap works, as with
/// [`PinnedAlloc::set_limit`](crate::PinnedAlloc::set_limit): under a cap smaller than a
/// chunk the pools carve small blocks from chunks just large enough for them.
fn parse_pinned_limit(s: &str) -> Option<Option<usize>> {
    match s.trim().to_ascii_lowercase().as_str() {
        "none" | "unlimited" => Some(None),
        _ => parse_bytes(s).map(Some),
    }
}

/// The default cap on pinned bytes held by the process-wide pinned pools together:
/// `CUDALLOC_PINNED_LIMIT` if set and valid, else a quarter of physical memory (or none
/// where that is unknown).
fn pinned_default_limit() -> Option<usize> {
    env_var(
        "CUDALLOC_PINNED_LIMIT",
        "a byte count (like 8G or 512MiB), or none",
        parse_pinned_limit,
    )
    .unwrap_or_else(|| physical_memory().map(|m| m / 4))
}

pub(crate) fn pinned_budget() -> &'static Arc<Budget> {
    static BUDGET: OnceLock<Arc<Budget>> = OnceLock::new();
    // The crate's bookkeeping: made once, kept for the process (`count::bookkeeping`).
    BUDGET.get_or_init(|| crate::count::bookkeeping(|| Arc::new(Budget::new(pinned_default_limit()))))
}

/// Sets the cap on pinned bytes held by the process-wide pinned pools together.
pub(crate) fn set_pinned_limit(bytes: Option<usize>) {
    pinned_budget().set_limit(bytes);
}

/// The cap on pinned bytes held by the process-wide pinned pools together.
pub(crate) fn pinned_limit() -> Option<usize> {
    pinned_budget().limit()
}

static PINNED: [OnceLock<Pool<PinnedPoolSource>>; 8] = [const { OnceLock::new() }; 8];
static MANAGED: [OnceLock<Pool<ManagedSource>>; 2] = [const { OnceLock::new() }; 2];

/// The process-wide pinned pool for `flags`, created on first use.
#[inline]
pub(crate) fn pinned_pool(flags: HostAllocFlags) -> &'static Pool<PinnedPoolSource> {
    // The crate's bookkeeping: made on first use, kept for the process.
    PINNED[(flags.bits() & 7) as usize].get_or_init(|| {
        crate::count::bookkeeping(|| {
            let source = PinnedPoolSource::new(flags, PinnedGrowth::from_env());
            Pool::with_budget(source, PoolConfig::default(), pinned_budget().clone())
                .traced_as(crate::trace::pinned_name(flags.bits()))
        })
    })
}

/// The process-wide pinned pool for `flags` if it was made.
#[inline]
pub(crate) fn made_pinned_pool(flags: HostAllocFlags) -> Option<&'static Pool<PinnedPoolSource>> {
    PINNED[(flags.bits() & 7) as usize].get()
}

/// The process-wide pinned pools created so far.
pub(crate) fn pinned_pools() -> impl Iterator<Item = &'static Pool<PinnedPoolSource>> {
    PINNED.iter().filter_map(OnceLock::get)
}

#[inline]
fn attach_index(attach: ManagedAttach) -> usize {
    match attach {
        ManagedAttach::Global => 0,
        ManagedAttach::Host => 1,
    }
}

/// The process-wide managed pool for `attach`, created on first use. No limit of its
/// own: every `ManagedSource` shares a cap of 90% of the device's memory.
#[inline]
pub(crate) fn managed_pool(attach: ManagedAttach) -> &'static Pool<ManagedSource> {
    // The crate's bookkeeping: made on first use, kept for the process.
    MANAGED[attach_index(attach)].get_or_init(|| {
        crate::count::bookkeeping(|| {
            Pool::new(ManagedSource::new(attach))
                .traced_as(["ManagedAlloc", "ManagedAlloc(host)"][attach_index(attach)])
        })
    })
}

/// The process-wide managed pool for `attach` if it was made.
#[inline]
pub(crate) fn made_managed_pool(attach: ManagedAttach) -> Option<&'static Pool<ManagedSource>> {
    MANAGED[attach_index(attach)].get()
}

/// The process-wide managed pools created so far.
pub(crate) fn managed_pools() -> impl Iterator<Item = &'static Pool<ManagedSource>> {
    MANAGED.iter().filter_map(OnceLock::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_limit_variable_takes_byte_counts_or_none() {
        assert_eq!(parse_pinned_limit("8G"), Some(Some(8 << 30)));
        assert_eq!(parse_pinned_limit("2MiB"), Some(Some(2 << 20)));
        // Caps below a chunk work, as `PinnedAlloc::set_limit` takes them (issue 21.6).
        assert_eq!(parse_pinned_limit("1M"), Some(Some(1 << 20)));
        assert_eq!(parse_pinned_limit("0"), Some(Some(0)));
        assert_eq!(parse_pinned_limit("none"), Some(None));
        assert_eq!(parse_pinned_limit("Unlimited"), Some(None));
        for bad in ["8bbbb", "lots", "", "-1"] {
            assert_eq!(parse_pinned_limit(bad), None, "{bad:?}");
        }
    }
}
