//! The physical side of the page heap: the [`Phys`] operations it is built on, and their
//! implementation by the driver's virtual memory management API (`cuda::vmm`, which never
//! names this layer). The simulated GPU implements them too (`FakePhys`).

use crate::cuda::vmm::Vmm;
use crate::error::Result;

/// The physical operations of the virtual memory management API, on one device.
pub(crate) trait Phys: Send + Sync + 'static {
    /// The allocation granule in bytes (a power of two).
    fn granule(&self) -> usize;
    /// Creates a handle of `bytes` (a multiple of the granule) of physical memory.
    fn create(&self, bytes: usize) -> Result<u64>;
    /// Releases a handle that no range maps.
    ///
    /// # Safety
    /// 1. `handle` came from [`Phys::create`], is released once, and is not mapped.
    unsafe fn release(&self, handle: u64) -> Result<()>;
    /// Reserves a virtual range of `bytes` (a multiple of the granule).
    fn reserve(&self, bytes: usize) -> Result<u64>;
    /// Frees a virtual range.
    ///
    /// # Safety
    /// 1. `va`, `bytes` came from [`Phys::reserve`], are freed once, and nothing in the
    ///    range is mapped.
    unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()>;
    /// Maps the whole of `handle` (of `bytes`) at `va`.
    ///
    /// # Safety
    /// 1. `[va, va + bytes)` lies in a reserved range and nothing is mapped in it; `handle`
    ///    is live and of `bytes`.
    unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()>;
    /// Unmaps the mapping at `va` of `bytes` (one handle's).
    ///
    /// # Safety
    /// 1. One [`Phys::map`] made exactly this mapping, and no work queued on the device
    ///    that has not completed uses it.
    unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()>;
    /// Lets the device, and the devices `peers`, read and write `[va, va + bytes)`
    /// (access of devices not named is left as it is).
    ///
    /// # Safety
    /// 1. The range is wholly mapped.
    unsafe fn set_access(&self, va: u64, bytes: usize, peers: &[usize]) -> Result<()>;
}

impl Phys for Vmm {
    fn granule(&self) -> usize {
        Vmm::granule(self)
    }

    fn create(&self, bytes: usize) -> Result<u64> {
        Vmm::create(self, bytes)
    }

    unsafe fn release(&self, handle: u64) -> Result<()> {
        // SAFETY: obligation 1 is Vmm::release's obligation 1.
        unsafe { Vmm::release(self, handle) }
    }

    fn reserve(&self, bytes: usize) -> Result<u64> {
        Vmm::reserve(self, bytes)
    }

    unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()> {
        // SAFETY: obligation 1 is Vmm::free_range's obligation 1.
        unsafe { Vmm::free_range(self, va, bytes) }
    }

    unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()> {
        // SAFETY: obligation 1 is Vmm::map's obligation 1.
        unsafe { Vmm::map(self, va, bytes, handle) }
    }

    unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()> {
        // SAFETY: obligation 1 is Vmm::unmap's obligation 1.
        unsafe { Vmm::unmap(self, va, bytes) }
    }

    unsafe fn set_access(&self, va: u64, bytes: usize, peers: &[usize]) -> Result<()> {
        // SAFETY: obligation 1 is Vmm::set_access's obligation 1.
        unsafe { Vmm::set_access(self, va, bytes, peers) }
    }
}
