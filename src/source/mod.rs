//! Memory sources: where raw memory comes from, one file per kind. A source hands out
//! whole blocks of at least one byte with a fixed natural alignment and takes them back;
//! it knows nothing of layouts, caching or statistics (the allocators above it do).

pub(crate) mod host;
pub(crate) mod managed;
mod pinned;
mod pinned_pool;
pub(crate) mod prefault;
mod registered;

use core::ptr::NonNull;

pub use host::HostSource;
pub use managed::{advise, prefetch, ManagedAttach, ManagedSource};
pub use pinned::PinnedSource;
pub use pinned_pool::{PinnedGrowth, PinnedPoolSource};
pub use registered::RegisteredSource;

use crate::cuda::MemoryType;
use crate::error::Result;

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

    /// The kind of memory, for statistics and reports ([`MemoryType`]; a source says
    /// whether its page-locked memory is `PinnedHost` or `Registered`, which
    /// [`pointer_info`] does not tell apart).
    ///
    /// [`pointer_info`]: crate::cuda::pointer_info
    fn kind(&self) -> MemoryType;

    /// Allocates `size` bytes; `size` is never zero (callers handle zero-size requests).
    fn allocate(&self, size: usize) -> Result<NonNull<u8>>;

    /// Returns a block.
    ///
    /// # Safety
    /// 1. `ptr` was returned by `self.allocate(size)` with this same `size`.
    /// 2. The block is not used after this call, by the host or by the GPU.
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize);

    /// Whether the GPU reaches the block `ptr..ptr + size` (from [`allocate`]) at its host
    /// address, as it reaches pinned and managed memory under unified addressing. Pools and
    /// arenas over the source then describe their blocks in it to an attached NVTX tool
    /// (compute-sanitizer: [`cuda::nvtx`](crate::cuda::nvtx)), so that a kernel's access
    /// outside a live block is reported. Asked only with a tool attached, once per block
    /// taken from the source. The default, `false`, leaves the block unannotated (as
    /// pageable memory is); a wrong `true` can only make the tool report accesses inside
    /// the source's memory that are not inside a block.
    ///
    /// [`allocate`]: MemorySource::allocate
    ///
    /// ```
    /// use cudalloc::source::{HostSource, MemorySource};
    /// let p = HostSource.allocate(4096).unwrap();
    /// assert!(!HostSource.device_mapped(p, 4096), "no GPU reaches pageable memory");
    /// unsafe { HostSource.deallocate(p, 4096) };
    /// ```
    fn device_mapped(&self, ptr: NonNull<u8>, size: usize) -> bool {
        let _ = (ptr, size);
        false
    }
}

/// Whether the driver maps `ptr`, pinned or managed host memory, into the device address
/// space at the same address (so a kernel's access there is one the sanitizer checks).
/// False without a driver, for pageable memory, and for a mapping at another address.
pub(crate) fn mapped_at_host_address(ptr: NonNull<u8>) -> bool {
    crate::cuda::pointer_info(ptr.as_ptr()).is_ok_and(|i| {
        matches!(i.memory_type, MemoryType::PinnedHost | MemoryType::Managed)
            && i.device_pointer == Some(ptr.as_ptr() as u64)
    })
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
    fn kind(&self) -> MemoryType {
        (**self).kind()
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        (**self).allocate(size)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: the caller's obligations are S's.
        unsafe { (**self).deallocate(ptr, size) }
    }
    fn device_mapped(&self, ptr: NonNull<u8>, size: usize) -> bool {
        (**self).device_mapped(ptr, size)
    }
}
// SAFETY: `&S` hands out S's blocks.
unsafe impl<S: HostVisible + ?Sized> HostVisible for &S {}

pub use crate::util::PAGE_SIZE;
