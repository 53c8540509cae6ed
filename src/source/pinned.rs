//! Pinned (page-locked) host memory from `cuMemHostAlloc`, with its flags.

use core::ptr::NonNull;

use super::{HostVisible, MemoryKind, MemorySource};
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedSource {
    flags: HostAllocFlags,
}

impl PinnedSource {
    /// A source allocating with `flags`.
    pub const fn new(flags: HostAllocFlags) -> Self {
        Self { flags }
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
    fn kind(&self) -> MemoryKind {
        MemoryKind::Pinned
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        debug_assert!(size > 0, "zero-size requests never reach CUDA");
        if let Some(phys) = super::physical_memory() {
            if size > phys {
                return Err(Error::TooLarge {
                    requested: size,
                    limit: phys,
                });
            }
        }
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
    unsafe fn deallocate(&self, ptr: NonNull<u8>, _size: usize) {
        // SAFETY: `ptr` came from `allocate`, i.e. from host_alloc, and is unused now.
        unsafe { raw::host_free(ptr.as_ptr()) }
    }
}

// SAFETY: page-locked host memory is ordinary host memory to the CPU.
unsafe impl HostVisible for PinnedSource {}
