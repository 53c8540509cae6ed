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
//! yourself ([`Stream::wait_for`]).
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
//! [`Stream::wait_for`]: crate::cuda::Stream::wait_for

use ::cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, HostSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop,
};

use crate::cuda::{PooledEvent, Stream};
use crate::device::{DeviceBuffer, DeviceCopy};
use crate::error::{Error, Result};
use crate::fence::Fence;
// cudarc's signatures name std's Arc (`DeviceSlice::stream`): the shim's `global` one.
use crate::sync::global::{Arc, OnceLock};
use crate::sync::{lock, Mutex};

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
        log::warn!(
            "cudalloc: could not order a cudarc stream after a buffer's stream ({e}); waiting on the host"
        );
        if let Err(e) = own.synchronize() {
            crate::cuda::record_drop_error("ordering a cudarc stream after a device buffer's stream", e);
            used_on
                .context()
                .record_err::<()>(Err(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)));
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

// ---- pinned host memory in cudarc's copies -------------------------------------------

/// The fields both pinned views show: where the memory is and how long.
fn debug_view<'f, 'b, T>(
    f: &'f mut core::fmt::Formatter<'b>,
    name: &str,
    data: &[T],
) -> core::fmt::DebugStruct<'f, 'b> {
    let mut d = f.debug_struct(name);
    d.field("ptr", &data.as_ptr()).field("len", &data.len());
    d
}

/// cudarc's `HostSlice` for a pinned view (`data` and `recorded` fields): as a copy
/// source, its slice with the copy's use recorded on the memory; as a destination,
/// whatever its `as_destination` says.
macro_rules! view_host_slice {
    ($view:ident) => {
        impl<T> HostSlice<T> for $view<'_, T> {
            fn len(&self) -> usize {
                self.data.len()
            }
            unsafe fn stream_synced_slice<'b>(&'b self, stream: &'b CudaStream) -> (&'b [T], SyncOnDrop<'b>) {
                (self.data, self.recorded.guard(self.data, stream))
            }
            unsafe fn stream_synced_mut_slice<'b>(
                &'b mut self,
                stream: &'b CudaStream,
            ) -> (&'b mut [T], SyncOnDrop<'b>) {
                self.as_destination(stream)
            }
        }
    };
}

/// The point in `stream` after a copy that cudarc queues once `stream_synced_slice` has
/// returned: fixed (an event recorded) only when the copy is known to be queued, at the
/// first of the view's drop and the memory's free ([`Fence::seal`]). Until then it
/// reports "not complete", so a poll of the live block between the two cannot take it
/// for done.
struct AfterCopy {
    stream: Stream,
    point: OnceLock<Point>,
}

enum Point {
    /// The event recorded after the copy.
    Recorded(PooledEvent),
    /// Recording failed and the stream was synchronized instead: the copy is done.
    Synchronized,
    /// Neither worked; reported as the fence's error (which a pool counts and treats as
    /// completion: the GPU is not running the copy).
    Failed(Error),
}

impl AfterCopy {
    fn seal(&self) -> &Point {
        self.point
            .get_or_init(|| match PooledEvent::record(&self.stream) {
                Ok(event) => Point::Recorded(event),
                Err(e) => {
                    log::warn!(
                        "cudalloc: recording a cudarc copy's use failed ({e}); synchronizing its stream"
                    );
                    match self.stream.synchronize() {
                        Ok(()) => Point::Synchronized,
                        Err(e) => Point::Failed(e),
                    }
                }
            })
    }
}

/// The pool's handle on an [`AfterCopy`] (shared with the view that seals it).
struct AfterCopyFence(Arc<AfterCopy>);

// SAFETY: 1. `is_complete` says true only for a sealed fence whose event (recorded on the
// copy's stream after the copy was queued: the view is dropped, or the memory freed, only
// once cudarc's call has returned) has completed, or whose stream was synchronized after
// the copy was queued; `wait` seals (it is only called for memory being freed, when every
// use was queued) and then blocks on the same. 2. A sealed point never changes, and an
// event handed to the fence is never recorded again.
unsafe impl Fence for AfterCopyFence {
    fn is_complete(&self) -> Result<bool> {
        match self.0.point.get() {
            None => Ok(false),
            Some(Point::Recorded(event)) => event.is_complete(),
            Some(Point::Synchronized) => Ok(true),
            Some(Point::Failed(e)) => Err(e.clone()),
        }
    }
    fn wait(&self) -> Result<()> {
        match self.0.seal() {
            Point::Recorded(event) => event.synchronize(),
            Point::Synchronized => Ok(()),
            Point::Failed(e) => Err(e.clone()),
        }
    }
    fn seal(&self) -> Result<()> {
        match self.0.seal() {
            Point::Failed(e) => Err(e.clone()),
            _ => Ok(()),
        }
    }
    // No stream id: a fence of the same stream recorded meanwhile (another thread's copy
    // of the same memory, through the copy helpers) may sit before this copy in the
    // stream, so neither may stand in for the other.
}

/// What the views share: the fences of the copies queued with the view, sealed when it is
/// dropped.
#[derive(Default)]
struct Recorded(Mutex<Vec<Arc<AfterCopy>>>);

impl Recorded {
    /// Records a use of `data` by a copy cudarc is about to queue on `stream`. Returns
    /// whether the copy may stay asynchronous: false when `stream` is no stream the crate
    /// knows (there would be no handle to record on later) or the record failed; the
    /// caller then has cudarc synchronize the stream after the copy.
    fn record<T>(&self, data: &[T], stream: &CudaStream) -> bool {
        let Some(stream) = crate::cuda::known(stream) else {
            return false;
        };
        let fence = Arc::new(AfterCopy {
            stream,
            point: OnceLock::new(),
        });
        match crate::fence::record_fence(data.as_ptr().cast(), AfterCopyFence(fence.clone())) {
            Ok(true) => {
                lock(&self.0).push(fence);
                true
            }
            Ok(false) => false,
            Err(e) => {
                log::warn!(
                    "cudalloc: could not record a cudarc copy's use ({e}); the copy will wait for its stream"
                );
                false
            }
        }
    }

    /// The guard cudarc drops after queuing the copy.
    fn guard<'a, T>(&self, data: &[T], stream: &'a CudaStream) -> SyncOnDrop<'a> {
        if data.is_empty() || self.record(data, stream) {
            SyncOnDrop::Sync(None)
        } else {
            SyncOnDrop::Sync(Some(stream))
        }
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        // Every copy this view was handed to has been queued: the borrow of the view
        // outlived cudarc's call.
        for fence in core::mem::take(&mut *lock(&self.0)) {
            if let Point::Failed(e) = fence.seal() {
                crate::cuda::record_drop_error("recording a cudarc copy's use of pinned memory", e);
            }
        }
    }
}

/// Checks that `data` is memory of the crate's allocators (a `Vec<T, PinnedAlloc>`, a
/// `Pool`, an `Arena`) or of a [`HostRegistration`](crate::HostRegistration).
fn check_owned<T>(data: &[T]) -> Result<()> {
    if core::mem::size_of_val(data) == 0 || crate::fence::registry::find(data.as_ptr() as usize).is_some() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(
            "a PinnedView needs memory of the crate's allocators (a Vec<T, PinnedAlloc>, a Pool, an Arena) or of a HostRegistration",
        ))
    }
}

/// Pinned memory of the crate as a cudarc copy source (`HostSlice`), without cudarc's
/// hole: the copy stays asynchronous *and* the memory is kept from reuse until it has
/// completed, so the `Vec` may be dropped as soon as cudarc's call returns.
///
/// cudarc treats every plain `&[T]` as pageable memory and never waits. The driver,
/// though, copies pinned memory truly asynchronously: `cs.memcpy_htod(&v[..], &mut dst)`
/// with `v: Vec<T, PinnedAlloc>` returns before the copy has read `v`, and if `v` is
/// dropped, the pinned pool may hand its block to a new owner whose data the device then
/// receives. Through a `PinnedView` the copy's use is recorded on the block (an event
/// recorded after the copy, on its stream) and a freed block waits for it.
///
/// The copy stays asynchronous when its stream is one the crate knows: a crate
/// [`Stream`]'s [view](Stream::cudarc), or a cudarc stream with a live
/// [`Stream::from_cudarc`] handle. On any other stream cudarc's call waits for the copy
/// (still correct; it only blocks).
///
/// What stays the caller's business, as with any asynchronous copy: the device reads the
/// memory when the stream gets to the copy, so what the host writes to `v` before then
/// may be what the device sees.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{cuda::Stream, device::DevicePool, PinnedAlloc, PinnedView};
/// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
///     let mut staging: Vec<f32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
///     staging.extend((0..1024).map(|i| i as f32));
///     let mut dev = pool.alloc::<f32>(1024, &stream).unwrap();
///     stream.cudarc().memcpy_htod(&PinnedView::new(&staging).unwrap(), &mut dev).unwrap();
///     drop(staging); // at once: the block waits for the copy before its next owner
///     assert_eq!(dev.to_vec().unwrap()[1023], 1023.0);
/// }
/// ```
///
/// As a copy *destination* use [`PinnedViewMut`]: a `PinnedView` refuses to be one (it
/// hands cudarc an empty slice, and parks `CUDA_ERROR_INVALID_VALUE` in the stream's
/// context, which cudarc reports on its next call).
pub struct PinnedView<'a, T> {
    data: &'a [T],
    recorded: Recorded,
}

impl<'a, T> PinnedView<'a, T> {
    /// A view of `data`, which must be memory of the crate's allocators (a
    /// `Vec<T, PinnedAlloc>`, a [`Pool`](crate::Pool), an [`Arena`](crate::Arena)) or of a
    /// [`HostRegistration`](crate::HostRegistration); anything else is refused with
    /// [`Error::InvalidArgument`] (the view could not keep it from reuse). An empty slice
    /// is always accepted.
    pub fn new(data: &'a [T]) -> Result<Self> {
        check_owned(data)?;
        Ok(Self {
            data,
            recorded: Recorded::default(),
        })
    }
}

impl<T> core::fmt::Debug for PinnedView<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        debug_view(f, "PinnedView", self.data).finish()
    }
}

impl<T> PinnedView<'_, T> {
    /// The view as a copy destination, which it refuses (see the type's docs).
    fn as_destination<'b>(&'b mut self, stream: &'b CudaStream) -> (&'b mut [T], SyncOnDrop<'b>) {
        log::error!(
            "cudalloc: a PinnedView (read-only) was given to cudarc as a copy destination; use PinnedViewMut"
        );
        stream
            .context()
            .record_err::<()>(Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE)));
        (&mut [], SyncOnDrop::Sync(None))
    }
}

view_host_slice!(PinnedView);

/// Pinned memory of the crate as a cudarc copy destination (and source): see
/// [`PinnedView`] for the hole it closes.
///
/// Made with [`new`](Self::new), a copy into it completes before cudarc's call returns
/// (cudarc synchronizes the stream after queuing it): the data may be read at once, and
/// nothing is left for the pool to guard. Made with [`new_async`](Self::new_async), the
/// copy stays asynchronous and its use is recorded on the memory like a `PinnedView`'s;
/// that constructor is `unsafe` because nothing stops safe code from reading the slice
/// while the device still writes it.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{cuda::Stream, device::DevicePool, PinnedAlloc, PinnedViewMut};
/// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
///     let dev = pool.from_host(&[1u32, 2, 3], &stream).unwrap();
///     let mut back: Vec<u32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
///     back.resize(3, 0);
///     stream.cudarc().memcpy_dtoh(&dev, &mut PinnedViewMut::new(&mut back).unwrap()).unwrap();
///     assert_eq!(back[..], [1, 2, 3]); // complete when memcpy_dtoh returned
/// }
/// ```
pub struct PinnedViewMut<'a, T> {
    data: &'a mut [T],
    /// Whether copies into it stay asynchronous (`new_async`).
    asynchronous: bool,
    recorded: Recorded,
}

impl<'a, T> PinnedViewMut<'a, T> {
    /// A view of `data` (memory of the crate's allocators or of a
    /// [`HostRegistration`](crate::HostRegistration), as for [`PinnedView::new`]) whose
    /// copies *into* it complete before cudarc's call returns. As a copy source it is
    /// asynchronous, like a [`PinnedView`].
    pub fn new(data: &'a mut [T]) -> Result<Self> {
        check_owned(data)?;
        Ok(Self {
            data,
            asynchronous: false,
            recorded: Recorded::default(),
        })
    }

    /// Like [`new`](Self::new), but copies into it stay asynchronous: cudarc's call
    /// returns once the copy is queued, and the use is recorded on the memory, so that
    /// freeing it early is safe.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{cuda::Stream, device::DevicePool, PinnedAlloc, PinnedViewMut};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
    ///     let dev = pool.from_host(&[5u8; 64], &stream).unwrap();
    ///     let mut back: Vec<u8, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    ///     back.resize(64, 0);
    ///     // SAFETY: `back` is not touched until the stream has been synchronized.
    ///     let mut view = unsafe { PinnedViewMut::new_async(&mut back) }.unwrap();
    ///     stream.cudarc().memcpy_dtoh(&dev, &mut view).unwrap();
    ///     drop(view);
    ///     stream.synchronize().unwrap();
    ///     assert!(back.iter().all(|&b| b == 5));
    /// }
    /// ```
    ///
    /// # Safety
    /// 1. `data` is neither read nor written (by the host or other GPU work) until every
    ///    copy into it has completed on its stream (synchronize the stream, or wait for an
    ///    event recorded after the copy); dropping its memory early is allowed.
    pub unsafe fn new_async(data: &'a mut [T]) -> Result<Self> {
        let mut view = Self::new(data)?;
        view.asynchronous = true;
        Ok(view)
    }
}

impl<T> core::fmt::Debug for PinnedViewMut<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        debug_view(f, "PinnedViewMut", self.data)
            .field("asynchronous", &self.asynchronous)
            .finish()
    }
}

impl<T> PinnedViewMut<'_, T> {
    /// The view as a copy destination: the copy completes before cudarc's call returns,
    /// or, made with `new_async`, its use is recorded on the memory.
    fn as_destination<'b>(&'b mut self, stream: &'b CudaStream) -> (&'b mut [T], SyncOnDrop<'b>) {
        let guard = if self.asynchronous {
            self.recorded.guard(self.data, stream)
        } else {
            SyncOnDrop::Sync(Some(stream))
        };
        (self.data, guard)
    }
}

view_host_slice!(PinnedViewMut);
