//! Streams and events: driver handles that are destroyed in `Drop` without panicking.
//!
//! A [`Stream`] is a cheap, cloneable handle (an `Arc` inside): buffers, arenas and pools
//! keep a clone of the stream they are ordered on, so the handle outlives every use the
//! crate makes of it. Each stream carries a [`StreamId`] that is unique for the life of the
//! process: the crate keys recorded GPU uses by it, never by the raw `CUstream`, whose
//! value the driver may give to a new stream once the old one is destroyed.

use crate::sync::global::Arc;
use core::ffi::c_void;
use core::fmt;
use core::num::NonZeroU64;

use cudarc::driver::sys;

use super::driver::{bind, check, driver, record_drop_error};
use crate::error::{Error, Result};
use crate::sync::global::{AtomicU64, Ordering};

/// A process-unique identifier of a [`Stream`] handle (shared by its clones). Two streams
/// never have the same id, even when the driver reuses a destroyed stream's raw handle.
///
/// ```
/// use cudalloc::cuda::Stream;
/// if let (Ok(a), Ok(b)) = (Stream::new(0), Stream::new(0)) {
///     assert_ne!(a.id(), b.id());
///     assert_eq!(a.id(), a.clone().id());
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(NonZeroU64);

impl StreamId {
    /// A new identifier, never handed out before in this process.
    pub(crate) fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // u64 ids do not run out: 2^64 streams at one per nanosecond take 584 years.
        Self(NonZeroU64::new(n).unwrap_or(NonZeroU64::MIN))
    }

    /// The identifier as a number (nonzero).
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream#{}", self.0)
    }
}

/// Who destroys the raw stream.
enum Owner {
    /// This handle created it and destroys it when the last clone is dropped.
    Owned,
    /// Someone else owns it; the caller of [`Stream::from_raw`] keeps it alive.
    Borrowed,
    /// A cudarc stream, kept alive by this reference (see the `cudarc` feature).
    #[cfg(feature = "cudarc")]
    Cudarc(#[allow(dead_code)] Arc<cudarc::driver::CudaStream>),
}

struct StreamInner {
    raw: sys::CUstream,
    device: usize,
    id: StreamId,
    owner: Owner,
    /// The cudarc view of this stream, made on first use (see the `cudarc` feature).
    #[cfg(feature = "cudarc")]
    cudarc: crate::sync::global::OnceLock<Arc<cudarc::driver::CudaStream>>,
}

// SAFETY: CUDA streams are thread-safe driver handles; the driver serializes their use and
// the inner state is immutable after construction.
unsafe impl Send for StreamInner {}
// SAFETY: as above; every method takes `&self` and only passes the handle to the driver.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if !matches!(self.owner, Owner::Owned) {
            return;
        }
        if let Err(e) = bind(self.device) {
            return record_drop_error("binding a context for cuStreamDestroy", e);
        }
        // SAFETY: `raw` was created by this handle and is destroyed once, when the last
        // clone goes; work queued on it still completes.
        if let Err(e) = check(unsafe { sys::cuStreamDestroy_v2(self.raw) }) {
            record_drop_error("cuStreamDestroy", e);
        }
    }
}

/// A CUDA stream of one device: a cheap, cloneable handle (clones share one stream, which
/// is destroyed when the last clone is dropped, if this handle created it).
///
/// ```
/// use cudalloc::cuda::Stream;
/// match Stream::new(0) {
///     Ok(s) => s.synchronize().unwrap(),
///     Err(e) => println!("no stream without a GPU: {e}"),
/// }
/// ```
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owner = match self.inner.owner {
            Owner::Owned => "owned",
            Owner::Borrowed => "borrowed",
            #[cfg(feature = "cudarc")]
            Owner::Cudarc(_) => "cudarc",
        };
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("device", &self.inner.device)
            .field("raw", &self.inner.raw)
            .field("owner", &owner)
            .finish()
    }
}

/// Two handles are equal when they are clones of one stream (the same [`StreamId`]).
impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.inner.id == other.inner.id
    }
}
impl Eq for Stream {}

impl Stream {
    /// Creates a non-blocking stream on device `device` (`cuStreamCreate` with
    /// `CU_STREAM_NON_BLOCKING`).
    pub fn new(device: usize) -> Result<Self> {
        driver()?;
        bind(device)?;
        let mut raw: sys::CUstream = core::ptr::null_mut();
        // SAFETY: cuStreamCreate writes a new handle into `raw`.
        check(unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) })?;
        Ok(Self::wrap(raw, device, Owner::Owned))
    }

    /// A handle over a stream someone else created and destroys (another CUDA library's
    /// `cudaStream_t`, say): the crate uses it like its own streams but never destroys it.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if let Ok(owner) = Stream::new(0) {
    ///     // SAFETY: `owner` belongs to device 0's primary context and outlives `borrowed`.
    ///     let borrowed = unsafe { Stream::from_raw(0, owner.as_raw()) }.unwrap();
    ///     assert_ne!(borrowed.id(), owner.id()); // a handle of its own
    ///     assert_eq!(borrowed.as_raw(), owner.as_raw());
    ///     borrowed.synchronize().unwrap();
    /// }
    /// ```
    ///
    /// # Safety
    /// 1. `raw` is a live stream (or null, the legacy default stream) of the primary
    ///    context of device `device`.
    /// 2. It stays alive until this handle, its clones, and everything the crate made with
    ///    them (buffers, arenas, recorded uses) are dropped or have completed.
    pub unsafe fn from_raw(device: usize, raw: *mut c_void) -> Result<Self> {
        driver()?;
        bind(device)?;
        Ok(Self::wrap(raw.cast(), device, Owner::Borrowed))
    }

    fn wrap(raw: sys::CUstream, device: usize, owner: Owner) -> Self {
        Self {
            inner: Arc::new(StreamInner {
                raw,
                device,
                id: StreamId::fresh(),
                owner,
                #[cfg(feature = "cudarc")]
                cudarc: crate::sync::global::OnceLock::new(),
            }),
        }
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// The process-unique identifier of this stream (shared by its clones).
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// Whether this handle destroys the stream when its last clone is dropped (false for
    /// [`Stream::from_raw`] and streams of other libraries).
    pub fn is_owned(&self) -> bool {
        matches!(self.inner.owner, Owner::Owned)
    }

    /// The raw `CUstream` as an untyped pointer, for other CUDA libraries (a
    /// `cudaStream_t` is the same handle). Do not destroy it.
    pub fn as_raw(&self) -> *mut c_void {
        self.inner.raw.cast()
    }

    /// The raw handle, for the crate's driver calls.
    pub(crate) fn cu(&self) -> sys::CUstream {
        self.inner.raw
    }

    /// Blocks until all work queued on the stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        bind(self.device())?;
        // SAFETY: `raw` is a live stream (owned, or kept alive by its owner: from_raw's
        // obligation 2).
        check(unsafe { sys::cuStreamSynchronize(self.cu()) })?;
        Ok(())
    }

    /// Whether all work queued on the stream has completed (`cuStreamQuery`). Never blocks.
    pub fn is_idle(&self) -> Result<bool> {
        bind(self.device())?;
        // SAFETY: `raw` is a live stream.
        match unsafe { sys::cuStreamQuery(self.cu()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(super::driver::CudaError::new(rc).into()),
        }
    }

    /// Records a new event at the current end of the stream.
    pub fn record_event(&self) -> Result<Event> {
        let event = Event::new(self.device())?;
        event.record(self)?;
        Ok(event)
    }

    /// Makes work queued on this stream from now on wait until `event` has completed
    /// (`cuStreamWaitEvent`): a GPU-side wait, the host does not block. The event may
    /// belong to another stream of the same or another device.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if let (Ok(a), Ok(b)) = (Stream::new(0), Stream::new(0)) {
    ///     let done_on_a = a.record_event().unwrap();
    ///     b.wait(&done_on_a).unwrap(); // b's later work runs after a's earlier work
    ///     b.synchronize().unwrap();
    /// }
    /// ```
    pub fn wait(&self, event: &Event) -> Result<()> {
        bind(self.device())?;
        // SAFETY: both handles are live (the event is owned by `event`, the stream by
        // self or its owner).
        check(unsafe { sys::cuStreamWaitEvent(self.cu(), event.raw, 0) })?;
        Ok(())
    }

    /// Queues `f` to run on a driver thread once all work queued before it has completed
    /// (`cuLaunchHostFunc`); later work on the stream waits for it. `f` must not call
    /// CUDA. A host function that sleeps is the simplest way to queue GPU-side delay
    /// without a kernel.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
    /// if let Ok(s) = Stream::new(0) {
    ///     let ran = Arc::new(AtomicBool::new(false));
    ///     let r = ran.clone();
    ///     s.launch_host_fn(move || r.store(true, Ordering::SeqCst)).unwrap();
    ///     s.synchronize().unwrap();
    ///     assert!(ran.load(Ordering::SeqCst));
    /// }
    /// ```
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, f: F) -> Result<()> {
        unsafe extern "C" fn trampoline<F: FnOnce()>(data: *mut c_void) {
            // SAFETY: `data` is the Box<F> leaked below, passed to us exactly once.
            let f = unsafe { Box::from_raw(data.cast::<F>()) };
            // A panic must not unwind into the driver's thread.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        }
        bind(self.device())?;
        let data = Box::into_raw(Box::new(f));
        // SAFETY: the driver calls `trampoline::<F>` once with `data`, which owns the box.
        let rc = unsafe { sys::cuLaunchHostFunc(self.cu(), Some(trampoline::<F>), data.cast()) };
        if let Err(e) = check(rc) {
            // SAFETY: the launch failed, so the driver will never call the trampoline;
            // we still own the box.
            drop(unsafe { Box::from_raw(data) });
            return Err(e.into());
        }
        Ok(())
    }
}

#[cfg(feature = "cudarc")]
impl Stream {
    /// A handle over a cudarc stream, keeping it alive: the crate's copies, buffers and
    /// recorded uses run on it in its order. Its context must be the primary context of its
    /// device (what `CudaContext::new` gives), which the crate shares.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if cudalloc::cuda::driver_available() {
    ///     let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ///     let theirs = ctx.new_stream().unwrap();
    ///     let ours = Stream::from_cudarc(&theirs).unwrap();
    ///     assert_eq!(ours.as_raw(), theirs.cu_stream().cast());
    /// }
    /// ```
    pub fn from_cudarc(stream: &Arc<cudarc::driver::CudaStream>) -> Result<Self> {
        driver()?;
        let ctx = stream.context();
        if !ctx.is_primary() {
            return Err(Error::InvalidArgument(
                "the cudarc stream's context is not its device's primary context",
            ));
        }
        let device = ctx.ordinal();
        bind(device)?;
        let this = Self::wrap(stream.cu_stream(), device, Owner::Cudarc(stream.clone()));
        // The cudarc view is the stream itself.
        let _ = this.inner.cudarc.set(stream.clone());
        Ok(this)
    }

    /// This stream as a cudarc stream, for cudarc's copies and kernel launches
    /// (`CudaStream::memcpy_htod`, `launch_builder`): the same driver stream, borrowed
    /// (`CudaContext::wrap_borrowed_stream`), made on first call and kept with the handle.
    /// The context is the device's primary context, the one `CudaContext::new` retains.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if let Ok(s) = Stream::new(0) {
    ///     let theirs = s.cudarc().unwrap();
    ///     assert_eq!(theirs.cu_stream().cast(), s.as_raw());
    /// }
    /// ```
    pub fn cudarc(&self) -> Result<&Arc<cudarc::driver::CudaStream>> {
        if let Some(s) = self.inner.cudarc.get() {
            return Ok(s);
        }
        driver()?;
        let ctx = cudarc::driver::CudaContext::new(self.device()).map_err(super::driver::CudaError::from)?;
        // SAFETY: the stream belongs to the device's primary context, which `ctx` is (both
        // crates retain the primary context); it stays alive as long as `self.inner`,
        // which holds the cudarc handle; ordering across the two APIs is the stream's own
        // order, the same for both.
        let wrapped = unsafe { ctx.wrap_borrowed_stream(self.cu()) };
        Ok(self.inner.cudarc.get_or_init(|| wrapped))
    }
}

/// A CUDA event: a marker in a stream whose completion can be queried without blocking.
/// [`Event::new`] makes one without timing (`CU_EVENT_DISABLE_TIMING`), the cheap kind;
/// [`Event::timed`] one that can measure elapsed time.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    device: usize,
    timed: bool,
}

// SAFETY: CUDA events are thread-safe driver handles.
unsafe impl Send for Event {}
// SAFETY: as above; methods only pass the handle to the driver.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event on device `device` (not yet recorded: it counts as complete).
    pub fn new(device: usize) -> Result<Self> {
        Self::create(device, false)
    }

    /// Creates an event that records a timestamp, for [`Event::elapsed_since`].
    ///
    /// ```
    /// use cudalloc::cuda::{Event, Stream};
    /// if let Ok(s) = Stream::new(0) {
    ///     let (start, end) = (Event::timed(0).unwrap(), Event::timed(0).unwrap());
    ///     start.record(&s).unwrap();
    ///     s.launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(5))).unwrap();
    ///     end.record(&s).unwrap();
    ///     end.synchronize().unwrap();
    ///     assert!(end.elapsed_since(&start).unwrap().as_secs_f64() >= 0.004);
    /// }
    /// ```
    pub fn timed(device: usize) -> Result<Self> {
        Self::create(device, true)
    }

    fn create(device: usize, timed: bool) -> Result<Self> {
        driver()?;
        bind(device)?;
        let flags = if timed {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let mut raw: sys::CUevent = core::ptr::null_mut();
        // SAFETY: cuEventCreate writes a new handle into `raw`.
        check(unsafe { sys::cuEventCreate(&mut raw, flags as u32) })?;
        Ok(Self { raw, device, timed })
    }

    /// Records the event at the current end of `stream` (re-recording moves it).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device {
            return Err(Error::InvalidArgument(
                "the event and the stream belong to different devices",
            ));
        }
        bind(self.device)?;
        // SAFETY: both handles are live and owned by their wrappers (or their owners).
        check(unsafe { sys::cuEventRecord(self.raw, stream.cu()) })?;
        Ok(())
    }

    /// Whether all work captured by the last `record` has completed. Never blocks.
    /// An error (a failed kernel, say) is returned as `Err`.
    pub fn is_complete(&self) -> Result<bool> {
        bind(self.device)?;
        // SAFETY: `raw` is a live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(super::driver::CudaError::new(rc).into()),
        }
    }

    /// Blocks until the work captured by the last `record` has completed.
    pub fn synchronize(&self) -> Result<()> {
        bind(self.device)?;
        // SAFETY: `raw` is a live event.
        check(unsafe { sys::cuEventSynchronize(self.raw) })?;
        Ok(())
    }

    /// GPU time from `start` to this event, both [`Event::timed`] and completed
    /// (`cuEventElapsedTime`; resolution about half a microsecond).
    pub fn elapsed_since(&self, start: &Event) -> Result<std::time::Duration> {
        if !self.timed || !start.timed {
            return Err(Error::InvalidArgument(
                "elapsed time needs two events made by Event::timed",
            ));
        }
        bind(self.device)?;
        let mut ms = 0f32;
        // SAFETY: both events are live timed events; the driver writes one float.
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw) })?;
        Ok(std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }

    /// The device this event belongs to.
    pub fn device(&self) -> usize {
        self.device
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Err(e) = bind(self.device) {
            return record_drop_error("binding a context for cuEventDestroy", e);
        }
        // SAFETY: `raw` is owned by self and destroyed once.
        if let Err(e) = check(unsafe { sys::cuEventDestroy_v2(self.raw) }) {
            record_drop_error("cuEventDestroy", e);
        }
    }
}
