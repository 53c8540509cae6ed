//! A CUDA memory pool (`cuMemPoolCreate`) of one device, owned and destroyed in `Drop`,
//! with the stream-ordered allocations (`cuMemAllocFromPoolAsync`, `cuMemFreeAsync`) and
//! the attributes [`crate::device::DevicePool`] is built on. Crate-internal: the typed,
//! safe API is in [`crate::device`].

use cudarc::driver::sys;

use super::driver::{bind, check, driver, ordinal_i32, record_drop_error};
use super::stream::Stream;
use crate::error::{Error, Result};

/// An owned `CUmemoryPool` of device memory on one device.
#[derive(Debug)]
pub(crate) struct MemPool {
    raw: sys::CUmemoryPool,
    device: usize,
}

// SAFETY: memory pools are thread-safe driver handles; every method passes the handle to
// the driver, which serializes use.
unsafe impl Send for MemPool {}
// SAFETY: as above; no method mutates Rust-side state.
unsafe impl Sync for MemPool {}

/// The pool's memory counters, in bytes (`CU_MEMPOOL_ATTR_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MemPoolUsage {
    pub(crate) reserved: u64,
    pub(crate) reserved_high: u64,
    pub(crate) used: u64,
    pub(crate) used_high: u64,
}

impl MemPool {
    /// Creates a pool of device memory on `device` holding at most `max_size` bytes (0:
    /// the driver's default, the device's memory) and keeping up to `release_threshold`
    /// freed bytes across synchronizations.
    pub(crate) fn new(device: usize, max_size: usize, release_threshold: u64) -> Result<Self> {
        driver()?;
        bind(device)?;
        let ordinal = ordinal_i32(device)?;
        // SAFETY: an all-zero CUmemPoolProps is the documented "no options" value
        // (handle type none, no security attributes, reserved bytes zero).
        let mut props: sys::CUmemPoolProps = unsafe { core::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ordinal;
        props.maxSize = max_size;
        let mut raw: sys::CUmemoryPool = core::ptr::null_mut();
        // SAFETY: cuMemPoolCreate reads `props` and writes the new handle into `raw`.
        check(unsafe { sys::cuMemPoolCreate(&mut raw, &props) })?;
        let pool = Self { raw, device };
        pool.set_release_threshold(release_threshold)?;
        Ok(pool)
    }

    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// Sets how many freed bytes the pool keeps across synchronizations.
    pub(crate) fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        let mut value = bytes;
        // SAFETY: RELEASE_THRESHOLD takes a pointer to one cuuint64_t; the pool is live.
        check(unsafe {
            sys::cuMemPoolSetAttribute(
                self.raw,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
        })?;
        Ok(())
    }

    fn attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value = 0u64;
        // SAFETY: the memory attributes queried here are cuuint64_t values; the pool is live.
        check(unsafe { sys::cuMemPoolGetAttribute(self.raw, attr, (&mut value as *mut u64).cast()) })?;
        Ok(value)
    }

    /// Resets the highs of reserved and used bytes to their current values.
    pub(crate) fn reset_highs(&self) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        bind(self.device)?;
        for attr in [
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        ] {
            let mut zero = 0u64;
            // SAFETY: the high attributes take a pointer to one cuuint64_t; 0 resets them.
            check(unsafe { sys::cuMemPoolSetAttribute(self.raw, attr, (&mut zero as *mut u64).cast()) })?;
        }
        Ok(())
    }

    /// Reserved and used bytes, now and at their highs.
    pub(crate) fn usage(&self) -> Result<MemPoolUsage> {
        use sys::CUmemPool_attribute as A;
        bind(self.device)?;
        Ok(MemPoolUsage {
            reserved: self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used: self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// Bytes reserved from the device now and bytes of its live blocks (two attribute
    /// queries: [`usage`](Self::usage) without the highs).
    pub(crate) fn reserved_and_used(&self) -> Result<(u64, u64)> {
        use sys::CUmemPool_attribute as A;
        bind(self.device)?;
        Ok((
            self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        ))
    }

    /// Bytes reserved from the device now (one attribute query; the device cache's trims
    /// read it to say what they gave back).
    pub(crate) fn reserved(&self) -> Result<u64> {
        bind(self.device)?;
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Releases reserved memory beyond `keep` bytes that no allocation uses.
    pub(crate) fn trim_to(&self, keep: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: the pool is live.
        check(unsafe { sys::cuMemPoolTrimTo(self.raw, keep) })?;
        Ok(())
    }

    /// Lets device `peer` read and write every allocation of the pool (`access`), or takes
    /// that away (`cuMemPoolSetAccess`).
    pub(crate) fn set_access(&self, peer: usize, access: bool) -> Result<()> {
        bind(self.device)?;
        let flags = if access {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE
        };
        let desc = sys::CUmemAccessDesc {
            location: location(peer)?,
            flags,
        };
        // SAFETY: one access descriptor, read by the driver during the call; the pool is
        // live.
        check(unsafe { sys::cuMemPoolSetAccess(self.raw, &desc, 1) })?;
        Ok(())
    }

    /// Whether device `peer` may read and write the pool's allocations.
    pub(crate) fn access(&self, peer: usize) -> Result<bool> {
        bind(self.device)?;
        let mut loc = location(peer)?;
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: the driver reads the location and writes one flags value; the pool is
        // live.
        check(unsafe { sys::cuMemPoolGetAccess(&mut flags, self.raw, &mut loc) })?;
        Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    }

    /// Allocates `bytes` (nonzero) in stream order on `stream`.
    pub(crate) fn alloc_async(&self, bytes: usize, stream: &Stream) -> Result<u64> {
        debug_assert!(bytes > 0);
        bind(self.device)?;
        let mut ptr: u64 = 0;
        // SAFETY: cuMemAllocFromPoolAsync writes the new address into `ptr`; the pool and
        // the stream are live.
        check(unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, self.raw, stream.cu()) })?;
        if ptr == 0 {
            return Err(Error::OutOfMemory { requested: bytes });
        }
        Ok(ptr)
    }

    /// Frees `ptr` in stream order on `stream`; errors are counted, never raised.
    ///
    /// # Safety
    /// 1. `ptr` came from [`MemPool::alloc_async`] of this pool and is not used by work
    ///    queued after this call on any stream.
    pub(crate) unsafe fn free_async(&self, ptr: u64, stream: &Stream) {
        if let Err(e) = bind(self.device) {
            return record_drop_error("binding a context for cuMemFreeAsync", e);
        }
        // SAFETY: obligation 1; the stream is live.
        if let Err(e) = check(unsafe { sys::cuMemFreeAsync(ptr, stream.cu()) }) {
            record_drop_error("cuMemFreeAsync", e);
        }
    }
}

/// The location of device `ordinal`.
fn location(ordinal: usize) -> Result<sys::CUmemLocation> {
    Ok(sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal_i32(ordinal)?,
    })
}

/// Reserved bytes of device `device`'s default memory pool (the one `cuMemAllocAsync`
/// uses), now and at its high (reset to the current value with `reset_high`): what the
/// `cuMemAllocAsync` reference of the benchmarks reserves.
#[cfg(feature = "testing")]
pub fn default_pool_reserved(device: usize, reset_high: bool) -> Result<(u64, u64)> {
    use sys::CUmemPool_attribute as A;
    driver()?;
    bind(device)?;
    let dev = ordinal_i32(device)?;
    let mut pool: sys::CUmemoryPool = core::ptr::null_mut();
    // SAFETY: cuDeviceGetDefaultMemPool writes the pool handle of a valid device.
    check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev) })?;
    if reset_high {
        let mut zero = 0u64;
        // SAFETY: RESERVED_MEM_HIGH takes a pointer to one cuuint64_t; 0 is the only value
        // it accepts (it resets the high to the current value).
        check(unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        })?;
    }
    let get = |attr| -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: the reserved-memory attributes are cuuint64_t values.
        check(unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) })?;
        Ok(v)
    };
    Ok((
        get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
    ))
}

impl Drop for MemPool {
    fn drop(&mut self) {
        if let Err(e) = bind(self.device) {
            return record_drop_error("binding a context for cuMemPoolDestroy", e);
        }
        // SAFETY: the handle came from cuMemPoolCreate and is destroyed once. Allocations
        // whose stream-ordered frees have not completed yet are released by the driver
        // when they complete (documented behaviour of cuMemPoolDestroy).
        if let Err(e) = check(unsafe { sys::cuMemPoolDestroy(self.raw) }) {
            record_drop_error("cuMemPoolDestroy", e);
        }
    }
}
