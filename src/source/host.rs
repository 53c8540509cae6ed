//! Pageable host memory from the system allocator: the reference source, the fallback
//! without a driver, and the source the CPU-only tests and loom models run on.

use core::ptr::NonNull;
use std::alloc::{GlobalAlloc, Layout, System};

use super::{HostVisible, MemorySource};
use crate::cuda::MemoryType;
use crate::error::{Error, Result};
use crate::util::PAGE_SIZE;

/// Page-aligned pageable host memory from [`System`].
///
/// ```
/// use cudalloc::source::{HostSource, MemorySource};
/// let block = HostSource.allocate(100).unwrap();
/// assert_eq!(block.as_ptr() as usize % HostSource.align(), 0);
/// unsafe { HostSource.deallocate(block, 100) };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostSource;

impl HostSource {
    fn layout(size: usize) -> Result<Layout> {
        Layout::from_size_align(size, PAGE_SIZE).map_err(|_| Error::TooLarge {
            requested: size,
            limit: isize::MAX as usize - PAGE_SIZE,
        })
    }
}

// SAFETY: System returns exclusive blocks of the layout's size and alignment (PAGE_SIZE).
unsafe impl MemorySource for HostSource {
    fn align(&self) -> usize {
        PAGE_SIZE
    }
    fn kind(&self) -> MemoryType {
        MemoryType::Pageable
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        debug_assert!(size > 0);
        crate::util::check_physical_memory(size)?;
        let layout = Self::layout(size)?;
        // SAFETY: layout has nonzero size (size > 0 is the trait's contract).
        NonNull::new(unsafe { System.alloc(layout) }).ok_or(Error::OutOfMemory { requested: size })
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: `ptr` came from `allocate(size)`, which used exactly this layout, and
        // that layout was valid then, so it is valid now.
        unsafe { System.dealloc(ptr.as_ptr(), Layout::from_size_align_unchecked(size, PAGE_SIZE)) }
    }
}

// SAFETY: system memory is ordinary host memory.
unsafe impl HostVisible for HostSource {}

static FALLBACKS: crate::sync::global::AtomicU64 = crate::sync::global::AtomicU64::new(0);
static WARNED: crate::sync::global::AtomicBool = crate::sync::global::AtomicBool::new(false);

/// Warns once per process that `kind` allocations fall back to pageable host memory
/// because no driver is present (at the first attempt, so that a fallback that fails is
/// explained too).
pub(crate) fn warn_fallback(kind: &str) {
    use crate::sync::global::Ordering;
    if !WARNED.swap(true, Ordering::Relaxed) {
        log::warn!("cudalloc: no CUDA driver; {kind} allocations fall back to pageable host memory");
    }
}

/// Counts an allocation of CUDA memory that pageable host memory served (only one that
/// succeeded: [`fallbacks`] counts blocks handed out).
pub(crate) fn count_fallback() {
    FALLBACKS.fetch_add(1, crate::sync::global::Ordering::Relaxed);
}

/// Allocations of CUDA memory served from pageable host memory for lack of a driver.
pub(crate) fn fallbacks() -> u64 {
    FALLBACKS.load(crate::sync::global::Ordering::Relaxed)
}
