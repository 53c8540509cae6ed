//! Stream-ordered device allocations (`cuMemAllocAsync`/`cuMemFreeAsync`) from each
//! device's default memory pool: the reference point the caching host pools are
//! measured against.
//!
//! The default pool's release threshold is 0: it returns memory to the system at every
//! synchronization and so caches nothing. The first allocation on a device sets it to
//! `u64::MAX`, once, so freed memory stays in the pool for reuse.

use cudarc::driver::{result, sys};

use super::driver::{bind, check, driver, record_drop_error, CudaError};
use super::stream::Stream;
use crate::error::{Error, Result};
use crate::sync::global::{AtomicU64, Ordering};

/// Devices (bit per ordinal below 64) whose default pool has had its threshold raised.
static THRESHOLD_SET: AtomicU64 = AtomicU64::new(0);

/// Runs `f` unless it already succeeded for `device` (a bit of `done` per ordinal below
/// 64; above, every time).
fn once_per_device(done: &AtomicU64, device: usize, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let bit = 1u64.checked_shl(device as u32).unwrap_or(0);
    if bit != 0 && done.load(Ordering::Relaxed) & bit != 0 {
        return Ok(());
    }
    f()?;
    done.fetch_or(bit, Ordering::Relaxed);
    Ok(())
}

fn keep_freed_memory(device: usize) -> Result<()> {
    once_per_device(&THRESHOLD_SET, device, || set_threshold(device))
}

fn set_threshold(device: usize) -> Result<()> {
    let dev = result::device::get(device as i32).map_err(CudaError::from)?;
    let mut pool: sys::CUmemoryPool = core::ptr::null_mut();
    // SAFETY: cuDeviceGetDefaultMemPool writes the pool handle of device `dev`.
    check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev) })?;
    let mut threshold = u64::MAX;
    // SAFETY: RELEASE_THRESHOLD takes a pointer to one cuuint64_t.
    check(unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    })?;
    Ok(())
}

/// Devices (bit per ordinal below 64) whose stream-ordered allocation was warmed up.
static WARMED: AtomicU64 = AtomicU64::new(0);

/// Pays, once per device and process, the driver's one-time set-up of stream-ordered
/// allocation: on the H200 the first `cuMemAllocAsync` (or `cuMemAllocFromPoolAsync`) of
/// a process took 8-11 ms, later ones 40-100 us, whatever the pool. Replays and
/// benchmarks call it before timing anything, so that the first allocator timed is not
/// charged for it.
///
/// ```
/// // Without a driver: an error, and nothing else happens.
/// let _ = cudalloc::testing::warm_up_stream_ordered(0);
/// ```
pub fn warm_up(device: usize) -> Result<()> {
    once_per_device(&WARMED, device, || {
        let stream = Stream::new(device)?;
        drop(AsyncDeviceMemory::new(256, &stream)?);
        stream.record_event()?.synchronize()?;
        stream.synchronize()
    })
}

/// Device memory allocated in stream order on a stream (`cuMemAllocAsync`) and freed on
/// the same stream when dropped (`cuMemFreeAsync`). It cannot be dereferenced on the host.
///
/// ```
/// use cudalloc::{cuda::Stream, testing::AsyncDeviceMemory};
/// if let Ok(stream) = Stream::new(0) {
///     let block = AsyncDeviceMemory::new(1 << 20, &stream).unwrap();
///     assert_eq!(block.len(), 1 << 20);
///     drop(block); // freed in stream order; the next allocation may reuse it at once
///     stream.synchronize().unwrap();
/// }
/// ```
#[derive(Debug)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub struct AsyncDeviceMemory<'s> {
    ptr: u64,
    len: usize,
    stream: &'s Stream,
}

#[cfg_attr(not(feature = "testing"), allow(dead_code))]
impl<'s> AsyncDeviceMemory<'s> {
    /// Allocates `len` bytes (at least one) on `stream`'s device, usable by work queued
    /// on `stream` after this call.
    pub fn new(len: usize, stream: &'s Stream) -> Result<Self> {
        driver()?;
        bind(stream.device())?;
        keep_freed_memory(stream.device())?;
        let mut ptr: u64 = 0;
        // SAFETY: cuMemAllocAsync writes the new address into `ptr`; the stream is live.
        check(unsafe { sys::cuMemAllocAsync(&mut ptr, len.max(1), stream.cu()) })?;
        if ptr == 0 {
            return Err(Error::OutOfMemory { requested: len });
        }
        Ok(Self { ptr, len, stream })
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
}

impl Drop for AsyncDeviceMemory<'_> {
    fn drop(&mut self) {
        if let Err(e) = bind(self.stream.device()) {
            return record_drop_error("binding a context for cuMemFreeAsync", e);
        }
        // SAFETY: `ptr` came from cuMemAllocAsync and is freed once, in the order of the
        // stream it was allocated on (which the borrow keeps alive).
        if let Err(e) = check(unsafe { sys::cuMemFreeAsync(self.ptr, self.stream.cu()) }) {
            record_drop_error("cuMemFreeAsync", e);
        }
    }
}
