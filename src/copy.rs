//! Asynchronous copies between host slices and device memory that keep pooled host
//! blocks safe: after queuing the copy they record its use of the host block
//! ([`crate::record_use`]), so freeing the block early (dropping a `Vec<T, PinnedAlloc>`
//! while the copy is in flight) cannot hand the memory to a new owner before the DMA is
//! done with it.
//!
//! What stays the caller's obligation, and why these functions are `unsafe`: the copy
//! reads (or writes) the host memory at some later time, while safe code could write (or
//! read) the slice as soon as the borrow ends. The pool protects a block from *reuse*
//! after it is freed; it cannot protect it from its current owner.

use crate::cuda::{raw, DeviceMemory, Stream};
use crate::error::{Error, Result};

/// The device address `offset` bytes into `mem`, checking that `len` bytes fit there.
fn device_range(mem: &DeviceMemory, offset: usize, len: usize) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= mem.len() => Ok(mem.device_ptr() + offset as u64),
        _ => Err(Error::InvalidArgument("copy range exceeds the device allocation")),
    }
}

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

/// Queues a copy of `src` into `dst` at byte offset `dst_offset`, on `stream`, and returns
/// at once. If `src` lies in a pooled block (a `Vec<T, PinnedAlloc>`, a `Pool`), the
/// copy's use of it is recorded: the block may be freed right after this call and will
/// not be reused before the copy completes.
///
/// # Safety
/// 1. `src` is not written (by the host or by other GPU work) until the copy has completed
///    on `stream` (synchronize the stream, or wait on an event recorded after the copy).
/// 2. If `src` is not in a block of one of the crate's pools (pageable memory, a
///    [`Direct`](crate::Direct) block, memory from elsewhere), it also stays allocated
///    until the copy has completed.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{copy, cuda::Stream, testing::DeviceMemory, PinnedAlloc};
/// if let Ok(stream) = Stream::new(0) {
///     let mut src: Vec<u32, _> = Vec::new_in(PinnedAlloc);
///     src.extend(0..1024);
///     let mut dev = DeviceMemory::new(4096, 0).unwrap();
///     // SAFETY: `src` is not written before the stream is synchronized; it is pooled,
///     // so dropping it early is fine.
///     unsafe { copy::host_to_device_async(&src, &mut dev, 0, &stream) }.unwrap();
///     drop(src);
///     let mut back = vec![0u32; 1024];
///     stream.synchronize().unwrap();
///     // SAFETY: `back` is not touched before the synchronize below.
///     unsafe { copy::device_to_host_async(&dev, 0, &mut back, &stream) }.unwrap();
///     stream.synchronize().unwrap();
///     assert_eq!(back[1023], 1023);
/// }
/// ```
pub unsafe fn host_to_device_async<T: Copy>(
    src: &[T],
    dst: &mut DeviceMemory,
    dst_offset: usize,
    stream: &Stream,
) -> Result<()> {
    let len = core::mem::size_of_val(src);
    let dst = device_range(dst, dst_offset, len)?;
    if len == 0 {
        return Ok(());
    }
    let host = src.as_ptr().cast::<u8>();
    // SAFETY: `dst..dst+len` lies in `dst`'s allocation, which the `&mut` lets us write
    // (its owner must order later reads on the stream, as for any async copy); the host
    // range is `src`'s memory, which obligations 1 and 2 keep valid and unwritten until
    // the copy completes, except that a pooled block may be freed early: `protect`
    // records the use before this function returns.
    unsafe { raw::copy_htod_async(dst, host, len, stream) }?;
    protect(host, stream)
}

/// Queues a copy of `dst.len()` elements from `src` at byte offset `src_offset` into
/// `dst`, on `stream`, and returns at once. If `dst` lies in a pooled block, the copy's
/// use of it is recorded: freed early, the block is not reused before the copy completes
/// (the DMA would overwrite its new owner's data).
///
/// # Safety
/// 1. `dst` is neither read nor written until the copy has completed on `stream`.
/// 2. If `dst` is not in a block of one of the crate's pools, it also stays allocated
///    until the copy has completed.
/// 3. The bytes copied are valid values of `T` (true of every bit pattern for integers
///    and floats).
///
/// See [`host_to_device_async`] for an example.
pub unsafe fn device_to_host_async<T: Copy>(
    src: &DeviceMemory,
    src_offset: usize,
    dst: &mut [T],
    stream: &Stream,
) -> Result<()> {
    let len = core::mem::size_of_val(dst);
    let src = device_range(src, src_offset, len)?;
    if len == 0 {
        return Ok(());
    }
    let host = dst.as_mut_ptr().cast::<u8>();
    // SAFETY: `src..src+len` lies in the device allocation; the host range is `dst`'s
    // memory, writable through the `&mut`, which obligations 1 and 2 keep valid and
    // untouched until the copy completes (a pooled block freed early is protected by
    // `protect` below); obligation 3 makes the bytes written valid `T`s.
    unsafe { raw::copy_dtoh_async(host, src, len, stream) }?;
    protect(host, stream)
}
