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
    /// This handle created it and destroys it when the last clone is dropped. (With the
    /// `cudarc` feature the crate's streams are cudarc's, see [`Owner::Cudarc`].)
    #[cfg_attr(feature = "cudarc", allow(dead_code))]
    Owned,
    /// Someone else owns it; the caller of [`Stream::from_raw`] keeps it alive.
    Borrowed,
    /// The cudarc view (`StreamInner::view`) owns it or keeps it alive: the stream lives
    /// while this handle or any clone of the view does. `created`: the crate made it
    /// ([`Stream::new`]) rather than wrapped it ([`Stream::from_cudarc`]).
    #[cfg(feature = "cudarc")]
    Cudarc { created: bool },
}

struct StreamInner {
    raw: sys::CUstream,
    device: usize,
    id: StreamId,
    owner: Owner,
    /// The same stream as cudarc sees it, made when the handle is (see the `cudarc`
    /// feature): `Stream::cudarc` cannot fail, so cudarc's `DeviceSlice::stream` can
    /// return it.
    #[cfg(feature = "cudarc")]
    view: Arc<cudarc::driver::CudaStream>,
}

// SAFETY: CUDA streams are thread-safe driver handles; the driver serializes their use and
// the inner state is immutable after construction.
unsafe impl Send for StreamInner {}
// SAFETY: as above; every method takes `&self` and only passes the handle to the driver.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        #[cfg(feature = "cudarc")]
        cudarc_side::forget(self);
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
            Owner::Cudarc { created: true } => "owned (shared with its cudarc view)",
            #[cfg(feature = "cudarc")]
            Owner::Cudarc { created: false } => "cudarc",
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
    ///
    /// With the `cudarc` feature the stream is made by cudarc (`CudaContext::new_stream`
    /// on the device's primary context) and shared with its cudarc view
    /// ([`Stream::cudarc`]): it is destroyed when the last handle *and* the last clone of
    /// the view are dropped, so a view kept by cudarc code never outlives its stream.
    /// cudarc then orders its own slices across the crate's streams (its multi-stream
    /// mode, which the crate keeps on, so that making a stream never synchronizes the
    /// device's context as cudarc's first `new_stream` of a context does).
    pub fn new(device: usize) -> Result<Self> {
        driver()?;
        bind(device)?;
        Self::create(device)
    }

    #[cfg(not(feature = "cudarc"))]
    fn create(device: usize) -> Result<Self> {
        let mut raw: sys::CUstream = core::ptr::null_mut();
        // SAFETY: cuStreamCreate writes a new handle into `raw`.
        check(unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) })?;
        Self::wrap(raw, device, Owner::Owned)
    }

    #[cfg(feature = "cudarc")]
    fn create(device: usize) -> Result<Self> {
        cudarc_side::create(device)
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
    ///    them (buffers, arenas, recorded uses; with the `cudarc` feature, clones of its
    ///    cudarc view) are dropped or have completed.
    ///
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`) is refused: it names a
    /// different stream on every thread, while the crate may record on or free into a
    /// stream from any thread.
    pub unsafe fn from_raw(device: usize, raw: *mut c_void) -> Result<Self> {
        driver()?;
        if raw == PER_THREAD.cast() {
            return Err(Error::InvalidArgument(PER_THREAD_REFUSED));
        }
        bind(device)?;
        Self::wrap(raw.cast(), device, Owner::Borrowed)
    }

    /// A handle over `raw` (created here or borrowed); with the `cudarc` feature, with
    /// its cudarc view.
    fn wrap(raw: sys::CUstream, device: usize, owner: Owner) -> Result<Self> {
        let inner = StreamInner {
            raw,
            device,
            id: StreamId::fresh(),
            owner,
            #[cfg(feature = "cudarc")]
            // SAFETY: `raw` is a stream of the primary context of `device` (it was created
            // there, or from_raw's obligation 1 says so) that outlives the view (obligation
            // 2 of from_raw names the view's clones).
            view: unsafe { cudarc_side::borrowed_view(device, raw) }?,
        };
        Ok(Self::publish(inner))
    }

    /// The handle over `inner`, made known to the cudarc side (feature `cudarc`).
    fn publish(inner: StreamInner) -> Self {
        let this = Self {
            inner: Arc::new(inner),
        };
        #[cfg(feature = "cudarc")]
        cudarc_side::remember(&this);
        this
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// The process-unique identifier of this stream (shared by its clones).
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// Whether the stream is destroyed when its last handle is dropped (true for
    /// [`Stream::new`]; false for [`Stream::from_raw`] and streams of other libraries).
    /// With the `cudarc` feature, clones of its cudarc view keep it alive as well.
    pub fn is_owned(&self) -> bool {
        match self.inner.owner {
            Owner::Owned => true,
            Owner::Borrowed => false,
            #[cfg(feature = "cudarc")]
            Owner::Cudarc { created } => created,
        }
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

    /// Makes work queued on this stream from now on wait for the work queued on `other`
    /// so far: an event recorded on `other` and waited for on the GPU, so neither stream
    /// nor the host blocks. If that wait cannot be queued, waits for `other` on the host
    /// instead (as safe, only slower); fails only if that fails too. `other` may be a
    /// stream of another device.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if let (Ok(producer), Ok(consumer)) = (Stream::new(0), Stream::new(0)) {
    ///     consumer.wait_for(&producer).unwrap(); // consumer's later work runs after producer's work so far
    ///     consumer.synchronize().unwrap();
    /// }
    /// ```
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        self.wait_queued(other).or_else(|e| {
            log::warn!(
                "cudalloc: could not order stream {} after stream {} on the GPU ({e}); waiting on the host",
                self.id(),
                other.id()
            );
            other.synchronize()
        })
    }

    /// The GPU-side wait of [`wait_for`](Self::wait_for) alone: fails if it cannot be
    /// queued.
    pub(crate) fn wait_queued(&self, other: &Stream) -> Result<()> {
        let event = super::PooledEvent::record(other)?;
        self.wait(event.event())
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

impl Stream {
    /// Queues `f` to run on a driver thread once all work queued before it has completed
    /// or the context has failed (`cuStreamAddCallback`: unlike `cuLaunchHostFunc`'s host
    /// function, which the driver skips after an error, the callback is called with the
    /// error as `status`, so a future waiting on it always resolves). Later work on the
    /// stream waits for it. `f` must not call CUDA (nor drop a [`Stream`] or an
    /// [`Event`]: that calls the driver).
    pub(crate) fn add_callback<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce(core::result::Result<(), super::driver::CudaError>) + Send + 'static,
    {
        unsafe extern "C" fn trampoline<F>(_stream: sys::CUstream, status: sys::CUresult, data: *mut c_void)
        where
            F: FnOnce(core::result::Result<(), super::driver::CudaError>),
        {
            // SAFETY: `data` is the Box<F> leaked below, passed to us exactly once.
            let f = unsafe { Box::from_raw(data.cast::<F>()) };
            let status = match status {
                sys::CUresult::CUDA_SUCCESS => Ok(()),
                rc => Err(super::driver::CudaError::new(rc)),
            };
            // A panic must not unwind into the driver's thread.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || f(status)));
        }
        bind(self.device())?;
        let data = Box::into_raw(Box::new(f));
        // SAFETY: the driver calls `trampoline::<F>` once with `data`, which owns the box;
        // flags must be 0.
        let rc = unsafe { sys::cuStreamAddCallback(self.cu(), Some(trampoline::<F>), data.cast(), 0) };
        if let Err(e) = check(rc) {
            // SAFETY: the launch failed, so the driver will never call the trampoline;
            // we still own the box.
            drop(unsafe { Box::from_raw(data) });
            return Err(e.into());
        }
        Ok(())
    }
}

/// `CU_STREAM_PER_THREAD`: a handle that means "the calling thread's default stream".
const PER_THREAD: sys::CUstream = 0x2 as sys::CUstream;
const PER_THREAD_REFUSED: &str =
    "the per-thread default stream names a different stream on each thread; pass a stream of its own";

#[cfg(feature = "cudarc")]
#[path = "stream_cudarc.rs"]
mod cudarc_side;

#[cfg(feature = "cudarc")]
pub(crate) use cudarc_side::{is_same, known, order_after};

#[cfg(feature = "cudarc")]
impl Stream {
    /// A handle over a cudarc stream, keeping it alive: the crate's copies, buffers and
    /// recorded uses run on it in its order. Its context must be the primary context of
    /// its device (what `CudaContext::new` gives), which the crate shares.
    ///
    /// One cudarc stream is one crate stream: while a handle made from `stream` (or the
    /// crate stream whose [view](Stream::cudarc) `stream` is) lives, this returns a clone
    /// of it, with the same [`StreamId`] (the crate keys per-stream state by it). So
    /// converting where a crate function wants a [`Stream`] is cheap (a lock and a map
    /// lookup) and keeps the identity, though holding the handle is cheaper still.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if cudalloc::cuda::driver_available() {
    ///     let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ///     let theirs = ctx.new_stream().unwrap();
    ///     let ours = Stream::from_cudarc(&theirs).unwrap();
    ///     assert_eq!(ours.as_raw(), theirs.cu_stream().cast());
    ///     assert_eq!(Stream::from_cudarc(&theirs).unwrap(), ours); // the same stream
    ///     let pooled: cudalloc::device::DevicePool = cudalloc::device::DevicePool::get(0).unwrap();
    ///     let buf = pooled.alloc::<f32>(256, &ours).unwrap(); // crate APIs take it as a Stream
    ///     assert_eq!(buf.len(), 256);
    /// }
    /// ```
    pub fn from_cudarc(stream: &Arc<cudarc::driver::CudaStream>) -> Result<Self> {
        cudarc_side::from_cudarc(stream)
    }

    /// This stream as a cudarc stream, for cudarc's copies and kernel launches
    /// (`CudaStream::memcpy_htod`, `launch_builder`): the same driver stream, in the
    /// device's primary context (the one `CudaContext::new` retains), made with the handle.
    /// The crate's streams are cudarc-owned: cloning the view and keeping it past this
    /// handle is fine (it keeps the stream alive); for a [`Stream::from_raw`] handle it is
    /// that function's obligation 2.
    ///
    /// ```
    /// use cudalloc::cuda::Stream;
    /// if let Ok(s) = Stream::new(0) {
    ///     let theirs = s.cudarc();
    ///     assert_eq!(theirs.cu_stream().cast(), s.as_raw());
    ///     assert_eq!(Stream::from_cudarc(theirs).unwrap(), s);
    /// }
    /// ```
    pub fn cudarc(&self) -> &Arc<cudarc::driver::CudaStream> {
        &self.inner.view
    }
}

/// [`Stream::from_cudarc`].
#[cfg(feature = "cudarc")]
impl TryFrom<&Arc<cudarc::driver::CudaStream>> for Stream {
    type Error = Error;
    fn try_from(stream: &Arc<cudarc::driver::CudaStream>) -> Result<Self> {
        Self::from_cudarc(stream)
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
