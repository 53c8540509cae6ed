//! Memory sources: where raw memory comes from, one file per kind. A source hands out
//! whole blocks of at least one byte with a fixed natural alignment and takes them back;
//! it knows nothing of layouts, caching or statistics (the allocators above it do).

mod host;
pub(crate) mod managed;
mod pinned;
mod registered;

use core::ptr::NonNull;

pub use host::HostSource;
pub use managed::{advise, prefetch, ManagedAttach, ManagedSource};
pub use pinned::PinnedSource;
pub use registered::RegisteredSource;

use crate::error::Result;

/// The kinds of memory the crate can hand out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary pageable host memory.
    Pageable,
    /// Page-locked host memory from `cuMemHostAlloc`.
    Pinned,
    /// Host memory page-locked with `cuMemHostRegister`.
    Registered,
    /// Managed (unified) memory from `cuMemAllocManaged`.
    Managed,
}

/// Where raw memory comes from.
///
/// # Safety
/// Implementors promise:
/// 1. A successful `allocate(size)` returns a block of `size` bytes, aligned to
///    `self.align()`, that nothing else uses until it is passed to `deallocate`.
/// 2. `align()` is a power of two, at least 16, and never changes for one value.
/// 3. `deallocate` of a block never panics (errors are counted and logged).
pub unsafe trait MemorySource: Send + Sync {
    /// The alignment of every block this source returns.
    fn align(&self) -> usize;

    /// The kind of memory, for statistics and reports.
    fn kind(&self) -> MemoryKind;

    /// Allocates `size` bytes; `size` is never zero (callers handle zero-size requests).
    fn allocate(&self, size: usize) -> Result<NonNull<u8>>;

    /// Returns a block.
    ///
    /// # Safety
    /// 1. `ptr` was returned by `self.allocate(size)` with this same `size`.
    /// 2. The block is not used after this call, by the host or by the GPU.
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize);
}

/// A [`MemorySource`] whose memory the host can read and write through ordinary
/// pointers, so that allocators over it may implement `Allocator`. Device memory is not.
///
/// # Safety
/// 1. Every block from `allocate` is readable and writable by the host at its address.
pub unsafe trait HostVisible: MemorySource {}

// SAFETY: forwards every obligation to `S`.
unsafe impl<S: MemorySource + ?Sized> MemorySource for &S {
    fn align(&self) -> usize {
        (**self).align()
    }
    fn kind(&self) -> MemoryKind {
        (**self).kind()
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        (**self).allocate(size)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: the caller's obligations are S's.
        unsafe { (**self).deallocate(ptr, size) }
    }
}
// SAFETY: `&S` hands out S's blocks.
unsafe impl<S: HostVisible + ?Sized> HostVisible for &S {}

/// The host's page size (4 KiB on the platforms CUDA supports); pinned and registered
/// memory is handled in whole pages.
pub const PAGE_SIZE: usize = 4096;

/// Rounds `n` up to a multiple of `align` (a power of two); `None` on overflow.
#[inline]
pub(crate) const fn align_up(n: usize, align: usize) -> Option<usize> {
    match n.checked_add(align - 1) {
        Some(v) => Some(v & !(align - 1)),
        None => None,
    }
}

/// Physical memory of this machine in bytes, read once from `/proc/meminfo`
/// (`None` where it cannot be read).
pub(crate) fn physical_memory() -> Option<usize> {
    use crate::sync::global::OnceLock;
    static MEM: OnceLock<Option<usize>> = OnceLock::new();
    *MEM.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    })
}
