//! Thin wrappers over the driver's memory calls (`raw`), and the safe public types built
//! on them: flags, locations, advice, pointer queries and a plain device allocation.

use core::ffi::c_void;

use cudarc::driver::sys;

use super::driver::{bind, check, driver, record_drop_error, CudaError};
use super::stream::Stream;
use crate::error::{Error, Result};

/// Flags for `cuMemHostAlloc`: how pinned host memory is mapped.
///
/// ```
/// use cudalloc::cuda::HostAllocFlags;
/// let f = HostAllocFlags::PORTABLE | HostAllocFlags::DEVICE_MAP;
/// assert!(f.contains(HostAllocFlags::DEVICE_MAP));
/// assert_eq!(f.bits(), 3);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct HostAllocFlags(u32);

impl HostAllocFlags {
    /// Page-locked memory usable by the context that allocated it.
    pub const DEFAULT: Self = Self(0);
    /// Pinned for every CUDA context, not only the allocating one (`CU_MEMHOSTALLOC_PORTABLE`).
    pub const PORTABLE: Self = Self(sys::CU_MEMHOSTALLOC_PORTABLE);
    /// Mapped into the device address space: kernels can read it directly (zero-copy);
    /// see [`pointer_info`] for the device pointer (`CU_MEMHOSTALLOC_DEVICEMAP`).
    pub const DEVICE_MAP: Self = Self(sys::CU_MEMHOSTALLOC_DEVICEMAP);
    /// Write-combined: fast host writes and PCIe transfers, very slow host reads
    /// (`CU_MEMHOSTALLOC_WRITECOMBINED`).
    pub const WRITE_COMBINED: Self = Self(sys::CU_MEMHOSTALLOC_WRITECOMBINED);
    const ALL: u32 =
        sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_WRITECOMBINED;

    /// The raw flag bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw bits; `None` if a bit is not one of the three flags.
    pub const fn from_bits(bits: u32) -> Option<Self> {
        if bits & !Self::ALL == 0 {
            Some(Self(bits))
        } else {
            None
        }
    }

    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with the flags of `other` added (usable in `const` context).
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

impl core::ops::BitOr for HostAllocFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.union(rhs)
    }
}

/// Where managed memory should live, or who accesses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// The host (CPU) memory.
    Host,
    /// The memory of the CUDA device with this ordinal.
    Device(usize),
}

impl Location {
    /// The driver's form; a device ordinal past `i32::MAX` is an invalid argument (it
    /// would otherwise be cut to another device's).
    fn raw(self) -> Result<sys::CUmemLocation> {
        Ok(match self {
            Location::Host => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
            Location::Device(d) => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: crate::cuda::driver::ordinal_i32(d)?,
            },
        })
    }
}

/// Advice for `cuMemAdvise` on managed memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ManagedAdvice {
    /// Mostly read: the driver may keep read-only copies on every processor that reads it.
    ReadMostly,
    /// Undo [`ManagedAdvice::ReadMostly`].
    UnsetReadMostly,
    /// Prefer to keep the pages at this location.
    PreferredLocation(Location),
    /// Undo [`ManagedAdvice::PreferredLocation`].
    UnsetPreferredLocation,
    /// Keep the pages mapped for this processor, wherever they live.
    AccessedBy(Location),
    /// Undo [`ManagedAdvice::AccessedBy`] for this processor.
    UnsetAccessedBy(Location),
}

/// A kind of memory: what [`pointer_info`] finds at an address, and what a
/// [`MemorySource`](crate::source::MemorySource) hands out (its
/// [`kind`](crate::source::MemorySource::kind)).
///
/// ```
/// use cudalloc::{cuda::MemoryType, source::{HostSource, MemorySource}};
/// assert_eq!(HostSource.kind(), MemoryType::Pageable);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryType {
    /// Ordinary pageable host memory the driver does not know about.
    Pageable,
    /// Page-locked host memory from `cuMemHostAlloc`. [`pointer_info`] reports all
    /// page-locked host memory as this, registered memory too (the driver's pointer
    /// attributes do not tell the two apart).
    PinnedHost,
    /// Host memory page-locked with `cuMemHostRegister` (as its source reports it).
    Registered,
    /// Managed (unified) memory from `cuMemAllocManaged`.
    Managed,
    /// Device memory.
    Device,
}

/// The answer of [`pointer_info`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PointerInfo {
    /// The kind of memory.
    pub memory_type: MemoryType,
    /// The flags of pinned memory as `cuMemHostGetFlags` reports them (`None` for
    /// managed, device and pageable memory). With unified addressing (every 64-bit
    /// system) the driver maps all pinned memory and reports `DEVICE_MAP` whether or not
    /// it was asked for; registered memory reports the flags it was registered with.
    pub host_alloc_flags: Option<HostAllocFlags>,
    /// The device address of mapped host memory (`DEVICE_MAP`, registered memory on
    /// systems with unified addressing) or of managed and device memory.
    pub device_pointer: Option<u64>,
}

/// Asks the driver what kind of memory `ptr` points into (`cuPointerGetAttribute`,
/// `cuMemHostGetFlags`). Any address may be asked about; pageable memory is reported as
/// [`MemoryType::Pageable`].
///
/// ```
/// use cudalloc::cuda::{pointer_info, MemoryType};
/// let x = 5u64;
/// match pointer_info(&x as *const u64 as *const u8) {
///     Ok(info) => assert_eq!(info.memory_type, MemoryType::Pageable),
///     Err(e) => println!("no driver to ask: {e}"),
/// }
/// ```
pub fn pointer_info(ptr: *const u8) -> Result<PointerInfo> {
    driver()?;
    bind(0)?;
    let addr = ptr as u64;
    let mut mem_type: u32 = 0;
    // SAFETY: cuPointerGetAttribute writes one unsigned int for MEMORY_TYPE into
    // `mem_type`; any address value may be queried.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut mem_type as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    if rc == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(PointerInfo {
            memory_type: MemoryType::Pageable,
            host_alloc_flags: None,
            device_pointer: None,
        });
    }
    check(rc)?;
    let mut managed: u32 = 0;
    // SAFETY: IS_MANAGED writes one bool-sized (unsigned int) value.
    check(unsafe {
        sys::cuPointerGetAttribute(
            (&mut managed as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            addr,
        )
    })?;
    let mut dptr: u64 = 0;
    // SAFETY: DEVICE_POINTER writes one CUdeviceptr; it fails for host memory that is
    // not mapped, which we report as `None`.
    let has_dptr = unsafe {
        sys::cuPointerGetAttribute(
            (&mut dptr as *mut u64).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
            addr,
        )
    } == sys::CUresult::CUDA_SUCCESS;
    let memory_type = if managed != 0 {
        MemoryType::Managed
    } else if mem_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
        MemoryType::PinnedHost
    } else {
        MemoryType::Device
    };
    let host_alloc_flags = if memory_type == MemoryType::PinnedHost {
        let mut flags: u32 = 0;
        // SAFETY: cuMemHostGetFlags writes one unsigned int; it fails for memory that
        // was registered rather than allocated by cuMemHostAlloc.
        let rc = unsafe { sys::cuMemHostGetFlags(&mut flags, ptr as *mut c_void) };
        // The driver reports extra internal bits; keep the three documented flags.
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(HostAllocFlags(flags & HostAllocFlags::ALL))
    } else {
        None
    };
    Ok(PointerInfo {
        memory_type,
        host_alloc_flags,
        device_pointer: has_dptr.then_some(dptr),
    })
}

/// The driver calls the memory sources make. Each checks for a driver and binds the
/// primary context of device 0 (or the given device) first.
pub(crate) mod raw {
    use super::*;

    /// `cuMemHostAlloc`. `size` must be nonzero (the driver returns null for 0).
    pub(crate) fn host_alloc(size: usize, flags: HostAllocFlags) -> Result<*mut u8> {
        debug_assert!(size > 0, "zero-size requests never reach CUDA");
        driver()?;
        bind(0)?;
        let mut p: *mut c_void = core::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes the new pointer into `p`; flags are valid bits.
        check(unsafe { sys::cuMemHostAlloc(&mut p, size, flags.bits()) })?;
        if p.is_null() {
            return Err(Error::OutOfMemory { requested: size });
        }
        Ok(p.cast())
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// 1. `p` came from [`host_alloc`] and is not used after this call.
    pub(crate) unsafe fn host_free(p: *mut u8) {
        if let Err(e) = bind(0) {
            return record_drop_error("binding a context for cuMemFreeHost", e);
        }
        // SAFETY: obligation 1 of this function.
        if let Err(e) = check(unsafe { sys::cuMemFreeHost(p.cast()) }) {
            record_drop_error("cuMemFreeHost", e);
        }
    }

    /// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE` (and `DEVICEMAP` if asked).
    ///
    /// # Safety
    /// 1. `p..p+size` is host memory owned by the caller, valid until [`host_unregister`].
    pub(crate) unsafe fn host_register(p: *mut u8, size: usize, device_map: bool) -> Result<()> {
        driver()?;
        bind(0)?;
        let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        if device_map {
            flags |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        }
        // SAFETY: obligation 1 of this function.
        check(unsafe { sys::cuMemHostRegister_v2(p.cast(), size, flags) })?;
        Ok(())
    }

    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// 1. `p` was registered by [`host_register`] and not yet unregistered.
    pub(crate) unsafe fn host_unregister(p: *mut u8) {
        // SAFETY: obligation 1 of this function.
        if let Err(e) = unsafe { try_host_unregister(p) } {
            record_drop_error("cuMemHostUnregister", e);
        }
    }

    /// `cuMemHostUnregister`, returning its error.
    ///
    /// # Safety
    /// 1. `p` was registered by [`host_register`] and not yet unregistered.
    pub(crate) unsafe fn try_host_unregister(p: *mut u8) -> Result<()> {
        bind(0)?;
        // SAFETY: obligation 1 of this function.
        check(unsafe { sys::cuMemHostUnregister(p.cast()) })?;
        Ok(())
    }

    /// `cuMemAllocManaged`. `size` must be nonzero.
    pub(crate) fn managed_alloc(size: usize, attach_global: bool) -> Result<*mut u8> {
        debug_assert!(size > 0, "zero-size requests never reach CUDA");
        driver()?;
        bind(0)?;
        let flags = if attach_global {
            sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL
        } else {
            sys::CUmemAttach_flags::CU_MEM_ATTACH_HOST
        };
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: cuMemAllocManaged writes the new address into `p`.
        check(unsafe { sys::cuMemAllocManaged(&mut p, size, flags as u32) })?;
        if p == 0 {
            return Err(Error::OutOfMemory { requested: size });
        }
        Ok(p as *mut u8)
    }

    /// `cuMemFree` of managed or device memory.
    ///
    /// # Safety
    /// 1. `p` came from [`managed_alloc`] or `cuMemAlloc` and is not used after this call.
    pub(crate) unsafe fn mem_free(p: u64) {
        if let Err(e) = bind(0) {
            return record_drop_error("binding a context for cuMemFree", e);
        }
        // SAFETY: obligation 1 of this function.
        if let Err(e) = check(unsafe { sys::cuMemFree_v2(p) }) {
            record_drop_error("cuMemFree", e);
        }
    }

    /// `cuMemPrefetchAsync` of a managed range to `location`, ordered on `stream`.
    pub(crate) fn prefetch(p: *const u8, len: usize, location: Location, stream: &Stream) -> Result<()> {
        driver()?;
        bind(stream.device())?;
        let location = location.raw()?;
        // SAFETY: the driver validates that the range is managed memory and returns an
        // error otherwise; prefetching moves pages without changing their contents.
        check(unsafe { sys::cuMemPrefetchAsync_v2(p as u64, len, location, 0, stream.cu()) })?;
        Ok(())
    }

    /// `cuMemAdvise` on a managed range.
    pub(crate) fn advise(p: *const u8, len: usize, advice: ManagedAdvice) -> Result<()> {
        use sys::CUmem_advise as A;
        driver()?;
        bind(0)?;
        let (a, loc) = match advice {
            ManagedAdvice::ReadMostly => (A::CU_MEM_ADVISE_SET_READ_MOSTLY, Location::Device(0)),
            ManagedAdvice::UnsetReadMostly => (A::CU_MEM_ADVISE_UNSET_READ_MOSTLY, Location::Device(0)),
            ManagedAdvice::PreferredLocation(l) => (A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, l),
            ManagedAdvice::UnsetPreferredLocation => {
                (A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, Location::Device(0))
            }
            ManagedAdvice::AccessedBy(l) => (A::CU_MEM_ADVISE_SET_ACCESSED_BY, l),
            ManagedAdvice::UnsetAccessedBy(l) => (A::CU_MEM_ADVISE_UNSET_ACCESSED_BY, l),
        };
        let loc = loc.raw()?;
        // SAFETY: advice changes page placement hints only; the driver validates the range.
        check(unsafe { sys::cuMemAdvise_v2(p as u64, len, a, loc) })?;
        Ok(())
    }

    /// `cuMemcpyHtoDAsync`.
    ///
    /// # Safety
    /// 1. `src..src+len` stays valid and unwritten until the copy completes on `stream`.
    /// 2. `dst..dst+len` is device memory the caller may write.
    pub(crate) unsafe fn copy_htod_async(
        dst: u64,
        src: *const u8,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        bind(stream.device())?;
        // SAFETY: obligations 1 and 2.
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream.cu()) })?;
        Ok(())
    }

    /// `cuMemcpyDtoHAsync`.
    ///
    /// # Safety
    /// 1. `dst..dst+len` stays valid and is not accessed until the copy completes on `stream`.
    /// 2. `src..src+len` is device memory.
    pub(crate) unsafe fn copy_dtoh_async(dst: *mut u8, src: u64, len: usize, stream: &Stream) -> Result<()> {
        bind(stream.device())?;
        // SAFETY: obligations 1 and 2.
        check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream.cu()) })?;
        Ok(())
    }
}

/// Sets `len` bytes at device address `dst` to `value`, ordered on `stream`
/// (`cuMemsetD8Async`). Works on device memory, managed memory and mapped host memory.
///
/// # Safety
/// 1. `dst..dst+len` is memory the device may write, and nothing reads or writes it on
///    the host until the stream has passed this point.
pub unsafe fn memset_d8_async(dst: u64, value: u8, len: usize, stream: &Stream) -> Result<()> {
    driver()?;
    bind(stream.device())?;
    // SAFETY: obligation 1 of this function.
    check(unsafe { sys::cuMemsetD8Async(dst, value, len, stream.cu()) })?;
    Ok(())
}

/// A plain device allocation (`cuMemAlloc`/`cuMemFree`) of `len` bytes: the destination
/// of host-to-device copies in tests, benchmarks and examples. It cannot be dereferenced
/// on the host.
///
/// ```
/// use cudalloc::{cuda::Stream, testing::DeviceMemory};
/// if cudalloc::cuda::driver_available() {
///     let stream = Stream::new(0).unwrap();
///     let mut dev = DeviceMemory::new(4, 0).unwrap();
///     dev.copy_from_host(&[1, 2, 3, 4], &stream).unwrap();
///     let mut back = [0u8; 4];
///     dev.copy_to_host(&mut back, &stream).unwrap();
///     assert_eq!(back, [1, 2, 3, 4]);
/// }
/// ```
///
/// Device memory cannot be read on the host: there is no way to index or deref it.
///
/// ```compile_fail
/// let dev = cudalloc::testing::DeviceMemory::new(4, 0).unwrap();
/// let first: u8 = dev[0];
/// ```
#[derive(Debug)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub struct DeviceMemory {
    ptr: u64,
    len: usize,
    device: usize,
}

#[cfg_attr(not(feature = "testing"), allow(dead_code))]
impl DeviceMemory {
    /// Allocates `len` bytes (at least one) on device `device`.
    pub fn new(len: usize, device: usize) -> Result<Self> {
        let ptr = plain_alloc(device, len.max(1))?;
        Ok(Self { ptr, len, device })
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation has zero length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check_len(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::InvalidArgument("copy range exceeds the device allocation")),
        }
    }

    /// Queues a copy of `src` to this allocation at `offset`, on `stream`, and returns at
    /// once.
    ///
    /// # Safety
    /// 1. `src` stays valid and is not written until the copy has completed on `stream`
    ///    (synchronize the stream, or wait on an event recorded after the copy).
    ///    Memory of the crate's allocators may be dropped early: the copy's use of it is
    ///    recorded, so it is not reused before the copy completes.
    pub unsafe fn copy_from_host_async(&mut self, offset: usize, src: &[u8], stream: &Stream) -> Result<()> {
        self.check_len(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked above; obligation 1 passes to the caller.
        unsafe { raw::copy_htod_async(self.ptr + offset as u64, src.as_ptr(), src.len(), stream) }?;
        crate::copy::protect(src.as_ptr(), stream)
    }

    /// Queues a copy of this allocation at `offset` into `dst`, on `stream`, and returns
    /// at once.
    ///
    /// # Safety
    /// 1. `dst` stays valid and is neither read nor written until the copy has completed
    ///    on `stream`. Memory of the crate's allocators may be dropped early: the copy's
    ///    use of it is recorded.
    pub unsafe fn copy_to_host_async(&self, offset: usize, dst: &mut [u8], stream: &Stream) -> Result<()> {
        self.check_len(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked above; obligation 1 passes to the caller.
        unsafe { raw::copy_dtoh_async(dst.as_mut_ptr(), self.ptr + offset as u64, dst.len(), stream) }?;
        crate::copy::protect(dst.as_ptr(), stream)
    }

    /// Copies `src` to the start of this allocation and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[u8], stream: &Stream) -> Result<()> {
        // SAFETY: we synchronize before returning, so `src` outlives the copy.
        unsafe { self.copy_from_host_async(0, src, stream) }?;
        stream.synchronize()
    }

    /// Copies the start of this allocation into `dst` and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [u8], stream: &Stream) -> Result<()> {
        // SAFETY: we synchronize before returning, so `dst` is not touched meanwhile.
        unsafe { self.copy_to_host_async(0, dst, stream) }?;
        stream.synchronize()
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from plain_alloc on this device and is freed once, here.
        unsafe { plain_free(self.device, self.ptr) }
    }
}

/// `bytes` (nonzero) of plain device memory on `device` (`cuMemAlloc`: not stream
/// ordered, usable by every stream at once).
pub(crate) fn plain_alloc(device: usize, bytes: usize) -> Result<u64> {
    driver()?;
    bind(device)?;
    let mut ptr: u64 = 0;
    // SAFETY: cuMemAlloc writes the new address into `ptr`.
    check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) })?;
    Ok(ptr)
}

/// Frees memory [`plain_alloc`] gave (`cuMemFree`, which waits for the device's work
/// using it); an error is recorded, not returned (it runs in drops).
///
/// # Safety
/// 1. `ptr` came from [`plain_alloc`] on `device` and is not used or freed again.
pub(crate) unsafe fn plain_free(device: usize, ptr: u64) {
    if let Err(e) = bind(device) {
        return record_drop_error("binding a context for cuMemFree", e);
    }
    // SAFETY: obligation 1.
    if let Err(e) = check(unsafe { sys::cuMemFree_v2(ptr) }) {
        record_drop_error("cuMemFree", e);
    }
}

impl From<CudaError> for allocator_api2::alloc::AllocError {
    fn from(_: CudaError) -> Self {
        allocator_api2::alloc::AllocError
    }
}
