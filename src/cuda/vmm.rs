//! The CUDA virtual memory management API on one device: physical memory in handles
//! (`cuMemCreate`, `cuMemRelease`, granule from `cuMemGetAllocationGranularity`), virtual
//! ranges (`cuMemAddressReserve`, `cuMemAddressFree`), mappings (`cuMemMap`,
//! `cuMemUnmap`) and access (`cuMemSetAccess`). Crate-internal: the page heap of a device
//! pool (`device::pages`) is built on it; every call binds the device's primary context
//! first.

use cudarc::driver::sys;

use super::driver::{bind, check, driver, ordinal_i32};
use crate::device::pages::Phys;
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

impl Phys for Vmm {
    fn granule(&self) -> usize {
        self.granule
    }

    fn create(&self, bytes: usize) -> Result<u64> {
        bind(self.device)?;
        let prop = self.prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the driver reads `prop` and writes the new handle; `bytes` is a multiple
        // of the granule (the page heap's sizes are).
        check(unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) })?;
        Ok(handle)
    }

    unsafe fn release(&self, handle: u64) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: a live handle, released once.
        check(unsafe { sys::cuMemRelease(handle) })?;
        Ok(())
    }

    fn reserve(&self, bytes: usize) -> Result<u64> {
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

    unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: a reserved range with nothing mapped, freed once.
        check(unsafe { sys::cuMemAddressFree(va, bytes) })?;
        Ok(())
    }

    unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: an unmapped part of a reserved range, a live handle of
        // `bytes`, mapped whole (offset 0, the only offset the driver accepts).
        check(unsafe { sys::cuMemMap(va, bytes, 0, handle, 0) })?;
        Ok(())
    }

    unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: obligation 1: exactly one earlier mapping, which no pending work uses.
        check(unsafe { sys::cuMemUnmap(va, bytes) })?;
        Ok(())
    }

    unsafe fn set_access(&self, va: u64, bytes: usize, peers: &[usize]) -> Result<()> {
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
