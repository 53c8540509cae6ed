//! Streams and events: owned driver handles that are destroyed in `Drop` without panicking.

use core::ffi::c_void;

use cudarc::driver::sys;

use super::driver::{bind, check, driver, record_drop_error};
use crate::error::Result;

/// A CUDA stream of one device (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`).
///
/// ```
/// use cudalloc::cuda::Stream;
/// match Stream::new(0) {
///     Ok(s) => s.synchronize().unwrap(),
///     Err(e) => println!("no stream without a GPU: {e}"),
/// }
/// ```
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
    device: usize,
}

// SAFETY: CUDA streams are thread-safe driver handles; the driver serializes use.
unsafe impl Send for Stream {}
// SAFETY: as above; every method takes `&self` and only passes the handle to the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream on device `device`.
    pub fn new(device: usize) -> Result<Self> {
        driver()?;
        bind(device)?;
        let mut raw: sys::CUstream = core::ptr::null_mut();
        // SAFETY: cuStreamCreate writes a new handle into `raw`.
        check(unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) })?;
        Ok(Self { raw, device })
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The raw `CUstream`, for use with other CUDA libraries (cudarc, cuBLAS, ...).
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Blocks until all work queued on the stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        bind(self.device)?;
        // SAFETY: `raw` is a live stream owned by self.
        check(unsafe { sys::cuStreamSynchronize(self.raw) })?;
        Ok(())
    }

    /// Records a new event at the current end of the stream.
    pub fn record_event(&self) -> Result<Event> {
        let event = Event::new(self.device)?;
        event.record(self)?;
        Ok(event)
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
        bind(self.device)?;
        let data = Box::into_raw(Box::new(f));
        // SAFETY: the driver calls `trampoline::<F>` once with `data`, which owns the box.
        let rc = unsafe { sys::cuLaunchHostFunc(self.raw, Some(trampoline::<F>), data.cast()) };
        if let Err(e) = check(rc) {
            // SAFETY: the launch failed, so the driver will never call the trampoline;
            // we still own the box.
            drop(unsafe { Box::from_raw(data) });
            return Err(e.into());
        }
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Err(e) = bind(self.device) {
            return record_drop_error("binding a context for cuStreamDestroy", e);
        }
        // SAFETY: `raw` is owned by self and destroyed once; queued work still completes.
        if let Err(e) = check(unsafe { sys::cuStreamDestroy_v2(self.raw) }) {
            record_drop_error("cuStreamDestroy", e);
        }
    }
}

/// A CUDA event without timing (`CU_EVENT_DISABLE_TIMING`): a marker in a stream whose
/// completion can be queried without blocking.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    device: usize,
}

// SAFETY: CUDA events are thread-safe driver handles.
unsafe impl Send for Event {}
// SAFETY: as above; methods only pass the handle to the driver.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event on device `device` (not yet recorded: it counts as complete).
    pub fn new(device: usize) -> Result<Self> {
        driver()?;
        bind(device)?;
        let mut raw: sys::CUevent = core::ptr::null_mut();
        // SAFETY: cuEventCreate writes a new handle into `raw`.
        check(unsafe { sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) })?;
        Ok(Self { raw, device })
    }

    /// Records the event at the current end of `stream` (re-recording moves it).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        bind(self.device)?;
        // SAFETY: both handles are live and owned by their wrappers.
        check(unsafe { sys::cuEventRecord(self.raw, stream.raw()) })?;
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
