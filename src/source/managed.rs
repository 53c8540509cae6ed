//! Managed (unified) memory from `cuMemAllocManaged`, with prefetch and advice.
//!
//! Oversubscribing managed memory can hang the GPU, so this source never lets the bytes
//! it holds exceed a limit: 90% of the device's total memory by default, and each request
//! must also fit in the memory the device reports free at that moment.

use core::ptr::NonNull;

use super::{HostVisible, MemorySource};
use crate::budget::Budget;
use crate::cuda::MemoryType;
use crate::cuda::{mem_info, raw, Location, ManagedAdvice, Stream};
use crate::error::{Error, Result};
use crate::sync::global::OnceLock;

/// Which processors may access a new managed block before it is attached to a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ManagedAttach {
    /// Any stream on any device (`CU_MEM_ATTACH_GLOBAL`).
    #[default]
    Global,
    /// The host only, until attached to a stream (`CU_MEM_ATTACH_HOST`).
    Host,
}

/// Managed memory from `cuMemAllocManaged` on device 0.
///
/// ```
/// use cudalloc::source::{ManagedAttach, ManagedSource, MemorySource};
/// let src = ManagedSource::new(ManagedAttach::Global);
/// if let Ok(p) = src.allocate(1024) {
///     unsafe { p.as_ptr().write(7) }; // the host can use it directly
///     unsafe { src.deallocate(p, 1024) };
/// }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagedSource {
    attach: ManagedAttach,
}

impl ManagedSource {
    /// A source allocating with `attach`.
    pub const fn new(attach: ManagedAttach) -> Self {
        Self { attach }
    }
}

/// The cap every `ManagedSource` of the process shares: 90% of device 0's memory, set on
/// first use.
fn budget() -> Result<&'static Budget> {
    static BUDGET: OnceLock<Budget> = OnceLock::new();
    if let Some(b) = BUDGET.get() {
        return Ok(b);
    }
    let (_, total) = mem_info(0)?;
    Ok(BUDGET.get_or_init(|| Budget::new(Some(total / 10 * 9))))
}

/// Managed bytes currently allocated through the crate (all handles and pools).
#[cfg(feature = "testing")]
pub fn managed_bytes_held() -> usize {
    budget().map_or(0, Budget::held)
}

/// Reserves `size` managed bytes: refused if they do not fit in the memory the device
/// reports free now, or would take the process past its managed cap.
fn reserve(size: usize) -> Result<&'static Budget> {
    let budget = budget()?;
    let (free, _) = mem_info(0)?;
    if size > free {
        return Err(Error::TooLarge {
            requested: size,
            limit: free,
        });
    }
    budget.reserve(size)?;
    Ok(budget)
}

/// Managed blocks are 256-byte aligned at least (the driver's guarantee for every
/// allocation it makes).
const MANAGED_ALIGN: usize = 256;

// SAFETY: cuMemAllocManaged returns an exclusive block of `size` bytes, checked for the
// alignment we promise.
unsafe impl MemorySource for ManagedSource {
    fn align(&self) -> usize {
        MANAGED_ALIGN
    }
    fn kind(&self) -> MemoryType {
        MemoryType::Managed
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        debug_assert!(size > 0, "zero-size requests never reach CUDA");
        let budget = reserve(size)?;
        let p = match raw::managed_alloc(size, self.attach == ManagedAttach::Global) {
            Ok(p) => p,
            Err(e) => {
                budget.release(size);
                return Err(e);
            }
        };
        if p as usize % MANAGED_ALIGN != 0 {
            // SAFETY: p came from managed_alloc and was never handed out.
            unsafe { raw::mem_free(p as u64) };
            budget.release(size);
            return Err(Error::InvalidArgument(
                "cuMemAllocManaged returned a misaligned block",
            ));
        }
        NonNull::new(p).ok_or(Error::OutOfMemory { requested: size })
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: ptr came from managed_alloc in `allocate` and is unused now.
        unsafe { raw::mem_free(ptr.as_ptr() as u64) };
        // A block exists only after a successful reserve, which made the budget.
        if let Ok(b) = budget() {
            b.release(size);
        }
    }
    fn device_mapped(&self, ptr: NonNull<u8>, _size: usize) -> bool {
        super::mapped_at_host_address(ptr)
    }
}

// SAFETY: managed memory is addressable by the host at the same address.
unsafe impl HostVisible for ManagedSource {}

/// Queues a migration of the pages behind `data` to `location` on `stream`
/// (`cuMemPrefetchAsync`). `data` must live in managed memory (a `Vec<T, ManagedAlloc>`,
/// say); the driver rejects other memory with an error. Contents are unchanged.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{cuda::{Location, Stream}, source::prefetch, ManagedAlloc};
/// if let Ok(stream) = Stream::new(0) {
///     let mut v: Vec<u32, _> = Vec::new_in(ManagedAlloc);
///     v.extend(0..1024);
///     prefetch(&v, Location::Device(0), &stream).unwrap();
///     stream.synchronize().unwrap();
/// }
/// ```
pub fn prefetch<T>(data: &[T], location: Location, stream: &Stream) -> Result<()> {
    let len = core::mem::size_of_val(data);
    if len == 0 {
        return Ok(());
    }
    raw::prefetch(data.as_ptr().cast(), len, location, stream)
}

/// Gives the driver `advice` about the managed pages behind `data` (`cuMemAdvise`).
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{cuda::ManagedAdvice, source::advise, ManagedAlloc};
/// let mut v: Vec<u32, _> = Vec::new_in(ManagedAlloc);
///     v.extend(0..1024);
/// if cudalloc::cuda::driver_available() {
///     advise(&v, ManagedAdvice::ReadMostly).unwrap();
/// }
/// ```
pub fn advise<T>(data: &[T], advice: ManagedAdvice) -> Result<()> {
    let len = core::mem::size_of_val(data);
    if len == 0 {
        return Ok(());
    }
    raw::advise(data.as_ptr().cast(), len, advice)
}
