//! Asynchronous copies between host slices and parts of a [`DeviceBuffer`] that keep the
//! crate's host memory safe: after queuing the copy they record its use of the host memory
//! ([`crate::record_use`]), so freeing it early (dropping a `Vec<T, PinnedAlloc>` while the
//! copy is in flight, resetting an arena) cannot hand the memory to a new owner before the
//! DMA is done with it. `DeviceBuffer`'s own `copy_*_async` methods copy whole buffers;
//! these take an offset, for one buffer filled or read in pieces.
//!
//! What stays the caller's obligation, and why these functions are `unsafe`: the copy
//! reads (or writes) the host memory at some later time, while safe code could write (or
//! read) the slice as soon as the borrow ends. The allocators protect memory from *reuse*
//! after it is freed; they cannot protect it from its current owner.

use crate::cuda::Stream;
use crate::device::{DeviceBuffer, DeviceCopy};
use crate::error::{Error, Result};

/// Called after a copy was queued: records its use of the host memory. If that fails
/// (no event could be had), waits for the stream instead, which is just as safe.
pub(crate) fn protect(host: *const u8, stream: &Stream) -> Result<()> {
    match crate::record_use(host, stream) {
        Ok(_) => Ok(()),
        Err(e) => {
            log::warn!(
                "cudalloc: could not record a copy's use of {host:p} ({e}); synchronizing the stream instead"
            );
            stream.synchronize()
        }
    }
}

/// The device address of elements `offset..offset + len` of `buf`, if they are in it.
fn range<T: DeviceCopy>(buf: &DeviceBuffer<T>, offset: usize, len: usize) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= buf.len() => Ok(buf.device_ptr() + (offset * size_of::<T>()) as u64),
        _ => Err(Error::InvalidArgument("copy range exceeds the device buffer")),
    }
}

/// Queues a copy of `src` into `dst`'s elements from `dst_offset` on, on `dst`'s stream,
/// and returns at once. If `src` is memory of the crate's allocators (a
/// `Vec<T, PinnedAlloc>`, a `Pool`, an `Arena`, a host registration), the copy's use of it
/// is recorded: it may be freed right after this call and will not be reused before the
/// copy completes.
///
/// # Safety
/// 1. `src` is not written (by the host or by other GPU work) until the copy has completed
///    on `dst`'s stream (synchronize it, or wait on an event recorded after the copy).
/// 2. If `src` is not memory of the crate's allocators (pageable memory, a
///    [`Direct`](crate::Direct) block, memory from elsewhere), it also stays allocated
///    until the copy has completed.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{copy, cuda::Stream, device::DevicePool, PinnedAlloc};
/// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
///     let mut dev = pool.alloc_zeroed::<u32>(2048, &stream).unwrap();
///     let mut half: Vec<u32, _> = Vec::new_in(PinnedAlloc);
///     half.extend(0..1024);
///     // SAFETY: `half` is not written after this; it is pooled memory, so dropping it
///     // early is fine.
///     unsafe { copy::host_to_device_async(&half, &mut dev, 1024) }.unwrap();
///     drop(half);
///     let mut back = vec![0u32; 1024];
///     // SAFETY: `back` is not touched before the stream is synchronized.
///     unsafe { copy::device_to_host_async(&dev, 1024, &mut back) }.unwrap();
///     stream.synchronize().unwrap();
///     assert_eq!(back[1023], 1023);
/// }
/// ```
pub unsafe fn host_to_device_async<T: DeviceCopy>(
    src: &[T],
    dst: &mut DeviceBuffer<T>,
    dst_offset: usize,
) -> Result<()> {
    let ptr = range(dst, dst_offset, src.len())?;
    // SAFETY: `ptr..` holds `src.len()` elements of `dst` (checked), which the `&mut`
    // lets us write on its stream; obligations 1 and 2 keep `src` valid and unwritten.
    unsafe { crate::device::copy_from_host_async(ptr, src.len(), src, dst.stream()) }
}

/// Queues a copy of `dst.len()` elements of `src` from `src_offset` on into `dst`, on
/// `src`'s stream, and returns at once. If `dst` is memory of the crate's allocators, the
/// copy's use of it is recorded: freed early, it is not reused before the copy completes
/// (the DMA would overwrite its new owner's data).
///
/// # Safety
/// 1. `dst` is neither read nor written until the copy has completed on `src`'s stream.
/// 2. If `dst` is not memory of the crate's allocators, it also stays allocated until the
///    copy has completed.
///
/// See [`host_to_device_async`] for an example.
pub unsafe fn device_to_host_async<T: DeviceCopy>(
    src: &DeviceBuffer<T>,
    src_offset: usize,
    dst: &mut [T],
) -> Result<()> {
    let ptr = range(src, src_offset, dst.len())?;
    // SAFETY: `ptr..` holds `dst.len()` elements of `src` (checked), read on its stream;
    // obligations 1 and 2 keep `dst` valid and untouched until the copy has written it.
    unsafe { crate::device::copy_to_host_async(ptr, dst.len(), dst, src.stream()) }
}
