//! Fresh host memory (its own mapping on Unix), its pages faulted in by several threads,
//! then page-locked with `cuMemHostRegister`; unregistered before it is freed.

use core::ptr::NonNull;

use super::{prefault, HostVisible, MemorySource};
use crate::cuda::raw;
use crate::cuda::MemoryType;
use crate::error::{Error, Result};
use crate::util::{align_up, PAGE_SIZE};

/// Page-aligned host memory registered with `cuMemHostRegister` (portable; optionally
/// mapped into the device address space). Registering memory that was just allocated
/// and touched measured about 10x cheaper than `cuMemHostAlloc` at 128 MiB.
///
/// Blocks are zeroed. Each is fresh memory (on Unix its own anonymous mapping, advised
/// for transparent huge pages from 2 MiB) whose pages are faulted in before it is
/// registered, by up to one thread per 8 MiB of the block, at most the machine's
/// available parallelism or `CUDALLOC_PREFAULT_THREADS` (as PyTorch's
/// `pinned_num_register_threads` does): one thread took about half a second for 1 GiB on
/// the H200 machine.
///
/// ```
/// use cudalloc::source::{MemorySource, RegisteredSource};
/// let src = RegisteredSource::new(false);
/// if let Ok(p) = src.allocate(1 << 20) {
///     unsafe { src.deallocate(p, 1 << 20) };
/// }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegisteredSource {
    device_map: bool,
}

impl RegisteredSource {
    /// A source that registers its blocks, mapped into the device address space if
    /// `device_map` is set.
    pub const fn new(device_map: bool) -> Self {
        Self { device_map }
    }
}

fn pages(size: usize) -> Result<usize> {
    align_up(size, PAGE_SIZE).ok_or(Error::TooLarge {
        requested: size,
        limit: usize::MAX - PAGE_SIZE,
    })
}

// SAFETY: blocks come from HostSource (exclusive, page-aligned) and are registered whole.
unsafe impl MemorySource for RegisteredSource {
    fn align(&self) -> usize {
        PAGE_SIZE
    }
    fn kind(&self) -> MemoryType {
        MemoryType::Registered
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        debug_assert!(size > 0);
        crate::cuda::driver_available()
            .then_some(())
            .ok_or(Error::NoDriver)?;
        let len = pages(size)?;
        crate::util::check_physical_memory(len)?;
        let p = prefault::map(len)?;
        // Fault every page in first, with threads for a large block: registering resident
        // pages is the cheap case, and the page faults are most of the cost.
        // SAFETY: p..p+len is the block just mapped, not yet handed out.
        unsafe { prefault::prefault(p, len, prefault::max_threads()) };
        // SAFETY: p..p+len is ours until deallocate, which unregisters before unmapping.
        if let Err(e) = unsafe { raw::host_register(p.as_ptr(), len, self.device_map) } {
            // SAFETY: p came from prefault::map(len) and was never handed out.
            unsafe { prefault::unmap(p, len) };
            return Err(e);
        }
        Ok(p)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        let len = pages(size).unwrap_or(size);
        // SAFETY: ptr was registered by `allocate` and is unused now.
        unsafe { raw::host_unregister(ptr.as_ptr()) };
        // SAFETY: ptr came from prefault::map(len) in `allocate`.
        unsafe { prefault::unmap(ptr, len) }
    }
    fn device_mapped(&self, ptr: NonNull<u8>, _size: usize) -> bool {
        // Mapped with unified addressing (registered with DEVICEMAP or not), at the host
        // address where the device can use host pointers for registered memory.
        super::mapped_at_host_address(ptr)
    }
}

// SAFETY: registered memory is ordinary host memory.
unsafe impl HostVisible for RegisteredSource {}
