//! The crate's device buffers and pinned memory in cudarc's copies and kernel launches
//! (feature `cudarc`).
//!
//! - [`DeviceBuffer<T>`] implements cudarc's `DeviceSlice`, `DevicePtr` and
//!   `DevicePtrMut`, so `CudaStream::memcpy_htod`/`memcpy_dtoh`/`memcpy_dtod` take it,
//!   and `PushKernelArg`, so `launch_builder(&f).arg(&buf)` (or `&mut buf`) does.
//! - Streams go both ways: [`Stream::cudarc`] is the crate stream as a cudarc stream,
//!   [`Stream::from_cudarc`] a cudarc stream as a crate stream (which is how
//!   [`DevicePool::alloc`](crate::device::DevicePool::alloc), the copy helpers and
//!   [`record_use`](crate::record_use) take one).
//!
//! ## Streams and ordering
//!
//! A buffer used on its own stream (`buf.stream().cudarc()`) costs nothing extra:
//! stream order covers it. On another stream, cudarc's call is ordered after the work
//! queued on the buffer's stream (an event, waited for on the GPU), and then blocks until
//! the copy has completed (`SyncOnDrop::Sync`): the buffer's stream knows nothing of the
//! other stream's work, and would otherwise free or overwrite the buffer under it.
//! Kernel arguments cannot be ordered that way (cudarc does not tell `PushKernelArg`
//! which stream the launch is on): launch on the buffer's stream, or order the streams
//! yourself ([`Stream::wait`]).
//!
//! ## Element types
//!
//! cudarc's copies need `T: cudarc::driver::DeviceRepr` as well as the crate's
//! [`DeviceCopy`]: the integers, floats and arrays of them have both. For a struct of
//! your own, derive zerocopy's traits and add `unsafe impl DeviceRepr for MyStruct {}`
//! yourself; the crate cannot do it for you (`impl<T: DeviceCopy> DeviceRepr for T` is
//! refused by the orphan rule: both the trait and the type parameter are foreign).
//!
//! ```
//! use cudalloc::{cuda::Stream, device::DevicePool};
//! if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
//!     let cs = stream.cudarc(); // &Arc<cudarc::driver::CudaStream>
//!     let mut buf = pool.alloc::<u32>(4, &stream).unwrap();
//!     cs.memcpy_htod(&[1u32, 2, 3, 4], &mut buf).unwrap(); // a plain array: pageable, blocking
//!     let back = cs.clone_dtoh(&buf).unwrap();
//!     assert_eq!(back, [1, 2, 3, 4]);
//! }
//! ```
//!
//! [`Stream::cudarc`]: crate::cuda::Stream::cudarc
//! [`Stream::from_cudarc`]: crate::cuda::Stream::from_cudarc
//! [`Stream::wait`]: crate::cuda::Stream::wait

use std::sync::Arc;

use ::cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use crate::cuda::Stream;
use crate::device::{DeviceBuffer, DeviceCopy};

/// What a buffer bound to `own` needs when cudarc uses it on `used_on`: nothing on the
/// same stream; on another, `used_on` waits for `own`'s earlier work, and the returned
/// guard blocks until `used_on` has done the use. Never panics: if the GPU-side wait
/// cannot be queued, the host waits for `own` instead; if that fails too, the error is
/// counted and parked in `used_on`'s context, where cudarc reports it on its next call.
fn ordered_use<'a>(own: &Stream, used_on: &'a CudaStream) -> SyncOnDrop<'a> {
    if crate::cuda::is_same(used_on, own) {
        return SyncOnDrop::Sync(None);
    }
    if let Err(e) = crate::cuda::order_after(used_on, own) {
        log::warn!("cudalloc: could not order a cudarc stream after a buffer's stream ({e}); waiting on the host");
        if let Err(e) = own.synchronize() {
            crate::cuda::record_drop_error("ordering a cudarc stream after a device buffer's stream", e);
            used_on.context().record_err::<()>(Err(::cudarc::driver::DriverError(
                sys::CUresult::CUDA_ERROR_UNKNOWN,
            )));
        }
    }
    SyncOnDrop::Sync(Some(used_on))
}

/// The buffer's length, and its stream as a cudarc stream.
impl<T: DeviceCopy> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        DeviceBuffer::len(self)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceBuffer::stream(self).cudarc()
    }
}

/// Reads of the buffer in cudarc's copies (see the [module docs](self) on streams).
impl<T: DeviceCopy> DevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let guard = ordered_use(DeviceBuffer::stream(self), stream);
        (DeviceBuffer::device_ptr(self), guard)
    }
}

/// Writes to the buffer in cudarc's copies (see the [module docs](self) on streams).
impl<T: DeviceCopy> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let guard = ordered_use(DeviceBuffer::stream(self), stream);
        (DeviceBuffer::device_ptr(self), guard)
    }
}

// SAFETY: the pushed argument is a pointer to the buffer's device address (a u64, what
// a kernel's `T*` parameter takes), which lives inside the buffer for 'b, so as long as
// the `LaunchArgs` ('a, shorter) that reads it at launch. This is cudarc's own impl for
// `&u64`, which it delegates to.
unsafe impl<'a, 'b: 'a, T: DeviceCopy> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
        self.arg(arg.device_ptr_ref())
    }
}

// SAFETY: as for `&DeviceBuffer<T>`; `&mut` only says the kernel may write.
unsafe impl<'a, 'b: 'a, T: DeviceCopy> PushKernelArg<&'b mut DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer<T>) -> &mut Self {
        self.arg(arg.device_ptr_ref())
    }
}
