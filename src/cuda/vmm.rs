//! The CUDA virtual memory management API on one device: physical memory in handles
//! (`cuMemCreate`, `cuMemRelease`, granule from `cuMemGetAllocationGranularity`), virtual
//! ranges (`cuMemAddressReserve`, `cuMemAddressFree`), mappings (`cuMemMap`,
//! `cuMemUnmap`) and access (`cuMemSetAccess`). Crate-internal: the page heap of a device
//! pool (`device::pages`) is built on it (through `device::phys`, which implements its
//! `Phys` trait with these methods: this layer never names the device layer); every call
//! binds the device's primary context first.

use cudarc::driver::sys;

use super::driver::{bind, check, driver, ordinal_i32};
use crate::error::{Error, Result};

/// Physical memory of device `device`, pinned (not pageable), accessible from the device.
#[derive(Debug)]
pub(crate) struct Vmm {
    device: usize,
    ordinal: i32,
    granule: usize,
}

impl Vmm {
    /// The VMM operations of `device`; errors when the device has no VMM support or the
    /// granule cannot be queried.
    pub(crate) fn new(device: usize) -> Result<Self> {
        driver()?;
        bind(device)?;
        let ordinal = ordinal_i32(device)?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: cuDeviceGet writes the handle of a valid ordinal (an error otherwise).
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut supported: core::ffi::c_int = 0;
        // SAFETY: cuDeviceGetAttribute writes one int for a valid device.
        check(unsafe {
            sys::cuDeviceGetAttribute(
                &mut supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                dev,
            )
        })?;
        if supported == 0 {
            return Err(Error::InvalidArgument(
                "the device does not support virtual memory management (Backing::PhysicalPages)",
            ));
        }
        let mut v = Self {
            device,
            ordinal,
            granule: 0,
        };
        let prop = v.prop();
        let mut granule = 0usize;
        // SAFETY: the driver reads `prop` and writes one size.
        check(unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granule,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if granule == 0 || !granule.is_power_of_two() {
            return Err(Error::InvalidArgument("the device reports no usable VMM granule"));
        }
        v.granule = granule;
        Ok(v)
    }

    /// The properties of every handle: pinned device memory of this device, no export.
    fn prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: an all-zero CUmemAllocationProp is a valid value (no handle types, no
        // Win32 metadata, no allocation flags); the fields that matter are set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { core::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.ordinal;
        prop
    }
}

/// The physical operations in the driver's terms.
impl Vmm {
    /// The allocation granule in bytes (a power of two).
    pub(crate) fn granule(&self) -> usize {
        self.granule
    }

    /// Creates a handle of `bytes` (a multiple of the granule) of physical memory.
    pub(crate) fn create(&self, bytes: usize) -> Result<u64> {
        bind(self.device)?;
        let prop = self.prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the driver reads `prop` and writes the new handle; `bytes` is a multiple
        // of the granule (the page heap's sizes are).
        check(unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) })?;
        Ok(handle)
    }

    /// Releases a handle that no range maps.
    ///
    /// # Safety
    /// 1. `handle` came from [`Vmm::create`], is released once, and is not mapped.
    pub(crate) unsafe fn release(&self, handle: u64) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: a live handle, released once.
        check(unsafe { sys::cuMemRelease(handle) })?;
        Ok(())
    }

    /// Reserves a virtual range of `bytes` (a multiple of the granule).
    pub(crate) fn reserve(&self, bytes: usize) -> Result<u64> {
        bind(self.device)?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: the driver writes the range's start; aligned to the granule, no fixed
        // address, no flags.
        check(unsafe { sys::cuMemAddressReserve(&mut va, bytes, self.granule, 0, 0) })?;
        if va == 0 {
            return Err(Error::OutOfMemory { requested: bytes });
        }
        Ok(va)
    }

    /// Frees a virtual range.
    ///
    /// # Safety
    /// 1. `va`, `bytes` came from [`Vmm::reserve`], are freed once, and nothing in the
    ///    range is mapped.
    pub(crate) unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: a reserved range with nothing mapped, freed once.
        check(unsafe { sys::cuMemAddressFree(va, bytes) })?;
        Ok(())
    }

    /// Maps the whole of `handle` (of `bytes`) at `va`.
    ///
    /// # Safety
    /// 1. `[va, va + bytes)` lies in a reserved range and nothing is mapped in it; `handle`
    ///    is live and of `bytes`.
    pub(crate) unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: an unmapped part of a reserved range, a live handle of
        // `bytes`, mapped whole (offset 0, the only offset the driver accepts).
        check(unsafe { sys::cuMemMap(va, bytes, 0, handle, 0) })?;
        Ok(())
    }

    /// Unmaps the mapping at `va` of `bytes` (one handle's).
    ///
    /// # Safety
    /// 1. One [`Vmm::map`] made exactly this mapping, and no work queued on the device
    ///    that has not completed uses it.
    pub(crate) unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: exactly one earlier mapping, which no pending work uses.
        check(unsafe { sys::cuMemUnmap(va, bytes) })?;
        Ok(())
    }

    /// Lets the device, and the devices `peers`, read and write `[va, va + bytes)`
    /// (access of devices not named is left as it is).
    ///
    /// # Safety
    /// 1. The range is wholly mapped.
    pub(crate) unsafe fn set_access(&self, va: u64, bytes: usize, peers: &[usize]) -> Result<()> {
        bind(self.device)?;
        let read_write = |id| sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut desc = vec![read_write(self.ordinal)];
        for &p in peers {
            desc.push(read_write(ordinal_i32(p)?));
        }
        // SAFETY: obligation 1: the range is wholly mapped; the descriptors are read
        // during the call.
        check(unsafe { sys::cuMemSetAccess(va, bytes, desc.as_ptr(), desc.len()) })?;
        Ok(())
    }
}
