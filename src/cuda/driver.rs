//! Driver presence, initialization, primary contexts and the error type.

use core::ffi::CStr;
use core::fmt;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};
use crate::sync::global::{AtomicU64, OnceLock, Ordering};

/// A failed CUDA driver call: the `CUresult` code, with its name and message available
/// from the driver.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CudaError {
    code: sys::CUresult,
}

impl CudaError {
    pub(crate) fn new(code: sys::CUresult) -> Self {
        Self { code }
    }

    /// The raw `CUresult` value (for example 2 for `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn code(&self) -> u32 {
        self.code as u32
    }

    /// Whether the driver reported that it ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }

    /// The driver's name for the code, such as `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn name(&self) -> &'static str {
        let mut p: *const core::ffi::c_char = core::ptr::null();
        // SAFETY: a CudaError only exists after a driver call, so libcuda is loaded;
        // cuGetErrorName writes a pointer to a static string or leaves `p` null.
        let rc = unsafe { sys::cuGetErrorName(self.code, &mut p) };
        static_str(rc, p).unwrap_or("CUDA_ERROR_UNKNOWN")
    }

    /// The driver's description of the code.
    pub fn message(&self) -> &'static str {
        let mut p: *const core::ffi::c_char = core::ptr::null();
        // SAFETY: as in `name`; cuGetErrorString writes a pointer to a static string.
        let rc = unsafe { sys::cuGetErrorString(self.code, &mut p) };
        static_str(rc, p).unwrap_or("unrecognized error code")
    }
}

fn static_str(rc: sys::CUresult, p: *const core::ffi::c_char) -> Option<&'static str> {
    if rc != sys::CUresult::CUDA_SUCCESS || p.is_null() {
        return None;
    }
    // SAFETY: the driver documents these strings as static and NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaError({} = {})", self.name(), self.code())
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name(), self.code(), self.message())
    }
}

impl std::error::Error for CudaError {}

/// Turns a `CUresult` into our result.
pub(crate) fn check(code: sys::CUresult) -> Result<(), CudaError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::new(code))
    }
}

impl From<result::DriverError> for CudaError {
    fn from(e: result::DriverError) -> Self {
        CudaError::new(e.0)
    }
}

/// A primary context pointer, shared across threads (CUDA contexts are thread-safe).
#[derive(Clone, Copy)]
struct Context(sys::CUcontext);
// SAFETY: a CUcontext is an opaque driver handle that the driver lets any thread use.
unsafe impl Send for Context {}
// SAFETY: as above; we never dereference it.
unsafe impl Sync for Context {}

struct Driver {
    devices: Box<[OnceLock<Result<Context, CudaError>>]>,
}

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

fn load() -> Option<Driver> {
    let no_driver = crate::util::env_var(
        "CUDALLOC_NO_DRIVER",
        "1, true, yes or on (or 0, false, no, off)",
        crate::util::parse_bool,
    );
    if no_driver == Some(true) {
        log::info!("cudalloc: CUDALLOC_NO_DRIVER is set; behaving as if no CUDA driver were present");
        return None;
    }
    // SAFETY: is_culib_present only tries to dlopen the candidate library names.
    if !unsafe { sys::is_culib_present() } {
        log::info!("cudalloc: libcuda not found; CUDA memory is unavailable");
        return None;
    }
    if let Err(e) = result::init() {
        log::warn!("cudalloc: cuInit failed: {}", CudaError::from(e));
        return None;
    }
    match result::device::get_count() {
        Ok(n) if n > 0 => Some(Driver {
            devices: (0..n).map(|_| OnceLock::new()).collect(),
        }),
        Ok(_) => {
            log::info!("cudalloc: the CUDA driver reports no device");
            None
        }
        Err(e) => {
            log::warn!("cudalloc: cuDeviceGetCount failed: {}", CudaError::from(e));
            None
        }
    }
}

#[inline]
fn state() -> Option<&'static Driver> {
    DRIVER.get_or_init(load).as_ref()
}

/// Whether a usable CUDA driver with at least one device is present. Checked once and
/// cached; never panics, also when libcuda is missing.
///
/// ```
/// if cudalloc::cuda::driver_available() {
///     println!("{} CUDA device(s)", cudalloc::cuda::device_count());
/// } else {
///     println!("no GPU here: PinnedAlloc falls back to pageable memory");
/// }
/// ```
#[inline]
pub fn driver_available() -> bool {
    state().is_some()
}

/// Number of CUDA devices (0 without a driver).
///
/// ```
/// assert_eq!(cudalloc::cuda::device_count() > 0, cudalloc::cuda::driver_available());
/// ```
pub fn device_count() -> usize {
    state().map_or(0, |d| d.devices.len())
}

/// Checks for a driver; the gate in front of every CUDA call of the crate.
#[inline]
pub(crate) fn driver() -> Result<()> {
    if driver_available() {
        Ok(())
    } else {
        Err(Error::NoDriver)
    }
}

/// Makes the primary context of device `ordinal` current on the calling thread, retaining
/// it the first time. Call before every driver call that needs a context.
pub(crate) fn bind(ordinal: usize) -> Result<()> {
    let d = state().ok_or(Error::NoDriver)?;
    let slot = d
        .devices
        .get(ordinal)
        .ok_or(Error::InvalidArgument("no CUDA device with that ordinal"))?;
    let ctx = (*slot.get_or_init(|| {
        let dev = result::device::get(ordinal as i32)?;
        // SAFETY: `dev` came from cuDeviceGet. The retained primary context is kept for
        // the life of the process (it is never released), so it stays valid.
        Ok(Context(unsafe { result::primary_ctx::retain(dev) }?))
    }))?;
    let current = result::ctx::get_current().map_err(CudaError::from)?;
    if current != Some(ctx.0) {
        // SAFETY: `ctx` is a retained primary context that is never released.
        unsafe { result::ctx::set_current(ctx.0) }.map_err(CudaError::from)?;
    }
    Ok(())
}

/// Device `ordinal` as the driver's `int` (`CUdevice`, a `CUmemLocation`'s id): an
/// ordinal past `i32::MAX` is an invalid argument.
pub(crate) fn ordinal_i32(ordinal: usize) -> Result<i32> {
    i32::try_from(ordinal).map_err(|_| Error::InvalidArgument("device ordinal out of range"))
}

/// Free and total memory of device `ordinal`, in bytes, as `cuMemGetInfo` reports them.
///
/// ```
/// match cudalloc::cuda::mem_info(0) {
///     Ok((free, total)) => assert!(free <= total),
///     Err(e) => println!("no device memory to report: {e}"),
/// }
/// ```
pub fn mem_info(ordinal: usize) -> Result<(usize, usize)> {
    bind(ordinal)?;
    Ok(result::mem_get_info().map_err(CudaError::from)?)
}

/// The name of device `ordinal`, such as `NVIDIA H200`.
///
/// ```
/// if let Ok(name) = cudalloc::cuda::device_name(0) {
///     println!("device 0: {name}");
/// }
/// ```
pub fn device_name(ordinal: usize) -> Result<String> {
    driver()?;
    let dev = result::device::get(ordinal_i32(ordinal)?).map_err(CudaError::from)?;
    Ok(result::device::get_name(dev).map_err(CudaError::from)?)
}

static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Records a CUDA error that happened where it cannot be returned (in `Drop`, in
/// `deallocate`): counted, logged, never a panic.
pub(crate) fn record_drop_error(what: &str, e: impl fmt::Display) {
    DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
    let message = format!("{what} failed: {e}");
    log::error!("cudalloc: {message}");
    *crate::sync::global::lock(&LAST_DROP_ERROR) = Some(message);
}

static LAST_DROP_ERROR: crate::sync::global::Mutex<Option<String>> = crate::sync::global::Mutex::new(None);

/// The most recent error counted by [`drop_errors`], in words (what failed, and the
/// driver's message), for a program that finds the count nonzero and has no logger.
///
/// ```
/// if cudalloc::cuda::drop_errors() > 0 {
///     eprintln!("last: {:?}", cudalloc::cuda::last_drop_error());
/// }
/// ```
pub fn last_drop_error() -> Option<String> {
    crate::sync::global::lock(&LAST_DROP_ERROR).clone()
}

/// Number of CUDA errors the crate met while freeing memory, destroying handles or
/// waiting for recorded GPU uses before reusing memory (an arena's reset), where they
/// could not be returned to a caller. Nonzero means something leaked or was misused.
///
/// ```
/// let before = cudalloc::cuda::drop_errors();
/// drop(allocator_api2::vec::Vec::<u8, _>::with_capacity_in(64, cudalloc::PinnedAlloc));
/// assert_eq!(cudalloc::cuda::drop_errors(), before);
/// ```
pub fn drop_errors() -> u64 {
    DROP_ERRORS.load(Ordering::Relaxed)
}
