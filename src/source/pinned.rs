//! Pinned (page-locked) host memory from `cuMemHostAlloc`, with its flags.

use core::ptr::NonNull;

use super::{HostSource, HostVisible, MemorySource};
use crate::cuda::MemoryType;
use crate::cuda::{raw, HostAllocFlags};
use crate::error::{Error, Result};

/// Page-locked host memory from `cuMemHostAlloc` with the given flags. Each `allocate`
/// is one driver call (about 0.7 ms on the H200 machine, whatever the size): use the
/// caching handles ([`crate::PinnedAlloc`]) for many small blocks.
///
/// ```
/// use cudalloc::source::{MemorySource, PinnedSource};
/// use cudalloc::cuda::HostAllocFlags;
/// let src = PinnedSource::new(HostAllocFlags::PORTABLE);
/// match src.allocate(4096) {
///     Ok(p) => unsafe { src.deallocate(p, 4096) },
///     Err(e) => println!("no pinned memory here: {e}"),
/// }
/// ```
///
/// Without a driver it fails with `Error::NoDriver`, unless made by
/// [`PinnedSource::with_fallback`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedSource {
    flags: HostAllocFlags,
    fallback: bool,
}

impl PinnedSource {
    /// A source allocating with `flags`.
    pub const fn new(flags: HostAllocFlags) -> Self {
        Self {
            flags,
            fallback: false,
        }
    }

    /// A source of pinned memory with default flags that, without a driver, hands out
    /// pageable host memory instead (logged once and counted by
    /// [`fallback_allocations`](crate::fallback_allocations)), as the default handles do.
    /// Whether a driver is present is decided once per process, so every block goes back
    /// the way it came.
    ///
    /// ```
    /// use cudalloc::source::{MemorySource, PinnedSource};
    /// let src = PinnedSource::with_fallback();
    /// let p = src.allocate(4096).unwrap(); // pinned, or pageable without a GPU
    /// unsafe { src.deallocate(p, 4096) };
    /// ```
    pub const fn with_fallback() -> Self {
        Self {
            flags: HostAllocFlags::DEFAULT,
            fallback: true,
        }
    }

    /// Whether it falls back to pageable memory without a driver.
    pub const fn falls_back(&self) -> bool {
        self.fallback
    }

    /// The flags this source allocates with.
    pub const fn flags(&self) -> HostAllocFlags {
        self.flags
    }
}

/// Alignment of `cuMemHostAlloc` blocks we rely on. The driver returns whole pages, but
/// documents only "suitably aligned"; 256 bytes is what every CUDA allocation offers.
const PINNED_ALIGN: usize = 256;

// SAFETY: cuMemHostAlloc returns an exclusive block of `size` bytes; we check the
// alignment we promise and refuse a block that lacks it.
unsafe impl MemorySource for PinnedSource {
    fn align(&self) -> usize {
        PINNED_ALIGN
    }
    fn kind(&self) -> MemoryType {
        MemoryType::PinnedHost
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        debug_assert!(size > 0, "zero-size requests never reach CUDA");
        if self.fallback && !crate::cuda::driver_available() {
            super::host::warn_fallback("pinned");
            let block = HostSource.allocate(size)?;
            super::host::count_fallback();
            return Ok(block);
        }
        crate::util::check_physical_memory(size)?;
        let p = raw::host_alloc(size, self.flags)?;
        if p as usize % PINNED_ALIGN != 0 {
            // SAFETY: p came from host_alloc and was never handed out.
            unsafe { raw::host_free(p) };
            return Err(Error::InvalidArgument(
                "cuMemHostAlloc returned a misaligned block",
            ));
        }
        NonNull::new(p).ok_or(Error::OutOfMemory { requested: size })
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        if self.fallback && !crate::cuda::driver_available() {
            // SAFETY: without a driver (decided once per process) `allocate` used
            // HostSource with this size.
            return unsafe { HostSource.deallocate(ptr, size) };
        }
        // SAFETY: `ptr` came from `allocate`, i.e. from host_alloc, and is unused now.
        unsafe { raw::host_free(ptr.as_ptr()) }
    }
    fn device_mapped(&self, ptr: NonNull<u8>, _size: usize) -> bool {
        // The pageable fallback (no driver) is asked too, and answers false.
        super::mapped_at_host_address(ptr)
    }
}

// SAFETY: page-locked host memory is ordinary host memory to the CPU (and the fallback
// is ordinary host memory).
unsafe impl HostVisible for PinnedSource {}
