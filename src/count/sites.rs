//! Allocation sites: each block allocated while a window was open, kept until the block
//! is freed, so a leak report can list the blocks a window kept (their number, sizes
//! and, with the `backtrace` feature, where each was allocated). This module owns
//! [`LeakSite`], the table of live sites and the thread's flag that keeps the crate's
//! own allocations (building a report) out of the counts. It knows nothing of windows
//! or of `Counting`: they call it (window -> sites -> thread). Under loom every call
//! compiles to nothing.

/// A block allocated in a window and still live: its address, size and, with the
/// `backtrace` feature, where it was allocated.
///
/// ```
/// use allocator_api2::boxed::Box;
/// use cudalloc::count::{Counting, Window};
/// let counting = Counting::new(std::alloc::System);
/// let w = Window::open();
/// let kept = Box::new_in(1u64, &counting);
/// let report = w.check().unwrap_err();
/// for site in &report.sites {
///     println!("{} bytes at {:#x}:\n{}", site.size, site.address, site.backtrace);
/// }
/// assert_eq!((report.sites.len(), report.sites[0].size), (1, 8));
/// # drop(kept);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeakSite {
    /// The block's address.
    pub address: usize,
    /// Its size in bytes (after any reallocation).
    pub size: usize,
    /// The stack where the block was allocated, the allocator's own frames trimmed
    /// (empty without the `backtrace` feature). A block keeps the site of its first
    /// allocation when it is reallocated.
    pub backtrace: String,
}

/// What a window selects sites by.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SiteKey {
    /// Serial of the thread that allocated the block.
    pub(crate) thread: u64,
    /// The id of the `Counting` allocator it came from.
    pub(crate) instance: usize,
    /// Its place in allocation order (see [`now`]).
    pub(crate) seq: u64,
}

/// Whether sites carry the stack they were allocated from.
pub(crate) const BACKTRACES: bool = cfg!(all(feature = "backtrace", not(loom)));

#[cfg(not(loom))]
mod table;

#[cfg(not(loom))]
pub(crate) use table::{
    any, bookkeeping, collect, detach, forget, is_bookkeeping, is_internal, now, record, uncounted,
    uncounted_thread, Detached, ENABLED,
};

#[cfg(loom)]
pub(crate) use off::{
    any, bookkeeping, collect, detach, forget, is_bookkeeping, is_internal, now, record, uncounted,
    uncounted_thread, Detached, ENABLED,
};

/// Stand-ins for the table under loom (its lock and thread-locals are std's).
#[cfg(loom)]
mod off {
    use super::{LeakSite, SiteKey};

    pub(crate) const ENABLED: bool = false;

    pub(crate) fn now() -> u64 {
        0
    }

    #[inline(always)]
    pub(crate) fn is_internal() -> bool {
        false
    }

    #[inline(always)]
    pub(crate) fn record(_thread: u64, _instance: usize, _addr: usize, _size: usize) {}

    pub(crate) fn uncounted<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    pub(crate) fn uncounted_thread() {}

    #[inline(always)]
    pub(crate) fn is_bookkeeping() -> bool {
        false
    }

    pub(crate) fn bookkeeping<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    #[inline(always)]
    pub(crate) fn forget(_instance: impl FnOnce() -> usize, _addr: usize) {}

    pub(crate) struct Detached;

    #[inline(always)]
    pub(crate) fn detach(_instance: impl FnOnce() -> usize, _addr: usize) -> Detached {
        Detached
    }

    impl Detached {
        #[inline(always)]
        pub(crate) fn none() -> Self {
            Detached
        }

        #[inline(always)]
        pub(crate) fn reattach(self, _addr: usize, _size: usize) {}
    }

    pub(crate) fn any(_keep: impl Fn(&SiteKey) -> bool) -> bool {
        false
    }

    pub(crate) fn collect(_keep: impl Fn(&SiteKey) -> bool) -> Vec<LeakSite> {
        Vec::new()
    }
}
