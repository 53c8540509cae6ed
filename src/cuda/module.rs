//! Kernels from PTX text: loading a module (`cuModuleLoadData`), looking up its functions
//! (`cuModuleGetFunction`) and launching them on a [`Stream`] (`cuLaunchKernel`).
//!
//! No compiler is involved at build or run time: the PTX is generated ahead of time
//! (the repository's `kernels/build-ptx.sh` runs nvcc) and kept as text in the program
//! (`include_str!`); the driver JIT-compiles it for the GPU at hand when the module loads
//! (and caches the result on disk). A driver loads PTX up to the ISA version of its own
//! CUDA release: PTX 8.0 loads on every CUDA 12 and 13 driver, while PTX written by a newer
//! toolkit than the driver fails with [`Error::UnsupportedPtx`].

use crate::sync::global::Arc;
use core::ffi::c_void;
use std::ffi::CString;

use cudarc::driver::sys;

use super::driver::{bind, check, driver, record_drop_error, CudaError};
use super::stream::Stream;
use crate::error::{Error, Result};

/// The module handle, shared by the [`Module`] and every [`Kernel`] taken from it: the
/// module is unloaded when the last of them is dropped.
struct LoadedModule {
    raw: sys::CUmodule,
    device: usize,
}

// SAFETY: a CUmodule is an opaque driver handle, usable from any thread once its context
// is current (every use binds it first).
unsafe impl Send for LoadedModule {}
// SAFETY: as above; the handle is never mutated after loading.
unsafe impl Sync for LoadedModule {}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        if let Err(e) = bind(self.device) {
            return record_drop_error("binding a context for cuModuleUnload", e);
        }
        // SAFETY: `raw` was loaded by `Module::load_ptx` and is unloaded once, when the
        // last handle (module or kernel) goes.
        if let Err(e) = check(unsafe { sys::cuModuleUnload(self.raw) }) {
            record_drop_error("cuModuleUnload", e);
        }
    }
}

/// A module of device code loaded from PTX text into the primary context of one device.
/// Cloning is cheap; the module is unloaded when the module and every [`Kernel`] taken
/// from it have been dropped.
///
/// ```
/// use cudalloc::cuda::{Module, Stream};
///
/// const PTX: &str = r#"
/// .version 8.0
/// .target sm_75
/// .address_size 64
/// .visible .entry add_one(.param .u64 data, .param .u32 n)
/// {
///     .reg .pred %p;
///     .reg .b32 %r<6>;
///     .reg .b64 %rd<4>;
///     ld.param.u64 %rd1, [data];
///     ld.param.u32 %r1, [n];
///     mov.u32 %r2, %ctaid.x;
///     mov.u32 %r3, %ntid.x;
///     mov.u32 %r4, %tid.x;
///     mad.lo.s32 %r5, %r2, %r3, %r4;
///     setp.ge.u32 %p, %r5, %r1;
///     @%p bra DONE;
///     cvta.to.global.u64 %rd2, %rd1;
///     mul.wide.u32 %rd3, %r5, 4;
///     add.s64 %rd2, %rd2, %rd3;
///     ld.global.u32 %r1, [%rd2];
///     add.s32 %r1, %r1, 1;
///     st.global.u32 [%rd2], %r1;
/// DONE:
///     ret;
/// }
/// "#;
///
/// if let (Ok(stream), Ok(pool)) = (Stream::new(0), cudalloc::device::DevicePool::get(0)) {
///     let module = Module::load_ptx(0, PTX).unwrap();
///     let add_one = module.function("add_one").unwrap();
///     let buf = pool.from_host(&[1u32, 2, 3], &stream).unwrap();
///     let (mut data, mut n) = (buf.device_ptr(), buf.len() as u32);
///     // SAFETY: the arguments match `add_one(u64, u32)`; `data` is a live buffer of `n`
///     // u32s ordered on `stream` (the buffer's own stream).
///     unsafe {
///         add_one.launch((1, 1, 1), (32, 1, 1), 0, buf.stream(), &mut [
///             (&mut data as *mut u64).cast(),
///             (&mut n as *mut u32).cast(),
///         ])
///     }
///     .unwrap();
///     assert_eq!(buf.to_vec().unwrap(), [2, 3, 4]);
/// }
/// ```
#[derive(Clone)]
pub struct Module {
    inner: Arc<LoadedModule>,
}

impl core::fmt::Debug for Module {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Module")
            .field("device", &self.inner.device)
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl Module {
    /// Loads PTX text into the primary context of device `device` (`cuModuleLoadData` on
    /// a NUL-terminated copy of `ptx`); the driver JIT-compiles it for that GPU.
    ///
    /// Errors: [`Error::InvalidArgument`] for text containing a NUL byte;
    /// [`Error::UnsupportedPtx`] when the PTX's `.version` is newer than the driver knows;
    /// [`Error::Cuda`] for the driver's other refusals (`CUDA_ERROR_INVALID_PTX` for a
    /// syntax error or a `.target` newer than the GPU, say); [`Error::NoDriver`].
    ///
    /// ```
    /// use cudalloc::{cuda::Module, Error};
    /// // PTX ISA 9.9: newer than any CUDA 12 or 13.0 driver knows.
    /// const TOO_NEW: &str = ".version 9.9\n.target sm_75\n.address_size 64\n";
    /// match Module::load_ptx(0, TOO_NEW) {
    ///     Err(Error::UnsupportedPtx { ptx_version, driver_version }) => {
    ///         assert_eq!(ptx_version, Some((9, 9)));
    ///         println!("this driver supports CUDA {}.{}", driver_version.0, driver_version.1);
    ///     }
    ///     Err(Error::NoDriver) => println!("no driver here"),
    ///     Ok(_) => println!("a driver of CUDA 13.9 or later knows PTX 9.9"),
    ///     Err(e) => panic!("unexpected: {e}"),
    /// }
    /// ```
    pub fn load_ptx(device: usize, ptx: &str) -> Result<Self> {
        let image =
            CString::new(ptx).map_err(|_| Error::InvalidArgument("the PTX text contains a NUL byte"))?;
        driver()?;
        bind(device)?;
        let mut raw: sys::CUmodule = core::ptr::null_mut();
        // SAFETY: `image` is NUL-terminated PTX text that lives across the call (the driver
        // copies what it needs); cuModuleLoadData writes the new handle into `raw`.
        let rc = unsafe { sys::cuModuleLoadData(&mut raw, image.as_ptr().cast::<c_void>()) };
        match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(Self {
                inner: Arc::new(LoadedModule { raw, device }),
            }),
            sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => Err(Error::UnsupportedPtx {
                ptx_version: ptx_version(ptx),
                driver_version: driver_version(),
            }),
            rc => {
                let e = CudaError::new(rc);
                log::debug!(
                    "cudalloc: cuModuleLoadData failed ({e}); the PTX declares {:?}",
                    ptx_directive(ptx, ".target").unwrap_or("no .target")
                );
                Err(e.into())
            }
        }
    }

    /// The function `name` of the module, ready to launch (`cuModuleGetFunction`). The
    /// name is the symbol in the PTX: declare kernels `extern "C"` so that C++ does not
    /// mangle it.
    ///
    /// Errors: [`Error::KernelNotFound`] when the module has no such function;
    /// [`Error::InvalidArgument`] for a name containing a NUL byte.
    pub fn function(&self, name: &str) -> Result<Kernel> {
        let symbol =
            CString::new(name).map_err(|_| Error::InvalidArgument("the kernel name contains a NUL byte"))?;
        bind(self.inner.device)?;
        let mut raw: sys::CUfunction = core::ptr::null_mut();
        // SAFETY: the module is loaded (kept by `inner`); `symbol` is NUL-terminated and
        // lives across the call; the driver writes the function handle into `raw`.
        let rc = unsafe { sys::cuModuleGetFunction(&mut raw, self.inner.raw, symbol.as_ptr()) };
        match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(Kernel {
                raw,
                name: name.into(),
                module: self.inner.clone(),
            }),
            sys::CUresult::CUDA_ERROR_NOT_FOUND => {
                log::debug!("cudalloc: the module has no function {name:?}");
                Err(Error::KernelNotFound)
            }
            rc => Err(CudaError::new(rc).into()),
        }
    }

    /// The device whose context the module is loaded in.
    pub fn device(&self) -> usize {
        self.inner.device
    }
}

/// A function of a loaded [`Module`]; it keeps the module loaded. Launch it with
/// [`Kernel::launch`] (see [`Module`] for an example).
#[derive(Clone)]
pub struct Kernel {
    raw: sys::CUfunction,
    name: Arc<str>,
    module: Arc<LoadedModule>,
}

// SAFETY: a CUfunction is an opaque driver handle, valid while its module is loaded (which
// `module` ensures) and usable from any thread.
unsafe impl Send for Kernel {}
// SAFETY: as above; launching only passes the handle to the driver.
unsafe impl Sync for Kernel {}

impl core::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.name)
            .field("device", &self.module.device)
            .finish()
    }
}

impl Kernel {
    /// The function's name in its module.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device whose context the kernel's module is loaded in.
    pub fn device(&self) -> usize {
        self.module.device
    }

    /// Queues the kernel on `stream` with `grid` blocks of `block` threads (x, y, z) and
    /// `shared_mem_bytes` of dynamic shared memory (`cuLaunchKernel`), and returns at
    /// once. `args` holds one pointer per kernel parameter, in order, each to a value of
    /// that parameter's type (a device pointer is passed as a `u64` address); the driver
    /// copies the values during this call.
    ///
    /// Errors, before anything is queued: [`Error::InvalidArgument`] for a zero grid or
    /// block dimension or a stream of another device; the driver's refusals
    /// (`CUDA_ERROR_INVALID_VALUE` for too many threads per block, say) as
    /// [`Error::Cuda`]. A fault inside the kernel surfaces later, from the next
    /// synchronizing call on the stream.
    ///
    /// # Safety
    /// 1. `args` has exactly as many entries as the kernel has parameters, and entry `i`
    ///    points to a live, initialized value of the type of parameter `i` (the driver
    ///    reads as many bytes as the parameter's size).
    /// 2. Every address the kernel dereferences (device pointers among the arguments,
    ///    and what they point to) is memory the kernel may access on this device, at
    ///    least as large as the kernel's accesses, and stays allocated until the kernel
    ///    has completed.
    /// 3. Nothing reads or writes that memory in a way that conflicts with the kernel
    ///    while it runs: other GPU work is ordered with it (on `stream`, or by events),
    ///    and the host does not touch host memory the kernel uses (mapped or managed)
    ///    before the stream has passed the kernel.
    /// 4. This kernel (or its module, or another kernel of the module) is kept until the
    ///    launch has completed: dropping the last handle unloads the module.
    pub unsafe fn launch(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem_bytes: u32,
        stream: &Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if [grid.0, grid.1, grid.2, block.0, block.1, block.2].contains(&0) {
            return Err(Error::InvalidArgument(
                "grid and block dimensions must be at least 1",
            ));
        }
        if stream.device() != self.module.device {
            return Err(Error::InvalidArgument(
                "the stream and the kernel's module belong to different devices",
            ));
        }
        bind(stream.device())?;
        let params = if args.is_empty() {
            core::ptr::null_mut()
        } else {
            args.as_mut_ptr()
        };
        // SAFETY: the function is valid while `self.module` keeps its module loaded
        // (obligation 4 keeps it loaded until the kernel has run); obligation 1 makes
        // `params` a correct parameter array, read during this call only; obligations 2
        // and 3 make the kernel's memory accesses valid and race-free; `extra` is null.
        check(unsafe {
            sys::cuLaunchKernel(
                self.raw,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_mem_bytes,
                stream.cu(),
                params,
                core::ptr::null_mut(),
            )
        })?;
        Ok(())
    }
}

/// The CUDA version the driver supports, as (major, minor) (`cuDriverGetVersion`; 12080
/// is 12.8); (0, 0) when it cannot be read.
fn driver_version() -> (u16, u16) {
    let mut v: core::ffi::c_int = 0;
    // SAFETY: called after the driver check; writes one int.
    let rc = unsafe { sys::cuDriverGetVersion(&mut v) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return (0, 0);
    }
    split_driver_version(v)
}

/// `cuDriverGetVersion`'s number as (major, minor): 12080 is CUDA 12.8.
fn split_driver_version(v: core::ffi::c_int) -> (u16, u16) {
    if v <= 0 {
        return (0, 0);
    }
    let major = u16::try_from(v / 1000).unwrap_or(u16::MAX);
    (major, (v % 1000 / 10) as u16)
}

/// The first token after `directive` at the start of a line of `ptx`.
fn ptx_directive<'a>(ptx: &'a str, directive: &str) -> Option<&'a str> {
    ptx.lines()
        .map(str::trim_start)
        .find_map(|l| l.strip_prefix(directive))
        .filter(|rest| rest.starts_with(char::is_whitespace))
        .and_then(|rest| rest.split_whitespace().next())
}

/// The PTX ISA version the text declares (`.version 8.0` is `(8, 0)`).
pub(crate) fn ptx_version(ptx: &str) -> Option<(u16, u16)> {
    let (major, minor) = ptx_directive(ptx, ".version")?.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_declared_ptx_version() {
        assert_eq!(ptx_version("//\n.version 8.0\n.target sm_75\n"), Some((8, 0)));
        assert_eq!(ptx_version("  .version 9.1 // comment\n"), Some((9, 1)));
        assert_eq!(ptx_version(".versionx 8.0\n"), None);
        assert_eq!(ptx_version(".target sm_75\n"), None);
        assert_eq!(
            ptx_directive(".version 8.0\n.target sm_90a\n", ".target"),
            Some("sm_90a")
        );
    }

    #[test]
    fn driver_version_splits_major_and_minor() {
        assert_eq!(split_driver_version(12080), (12, 8));
        assert_eq!(split_driver_version(13000), (13, 0));
        assert_eq!(split_driver_version(12040), (12, 4));
        assert_eq!(split_driver_version(0), (0, 0));
    }
}
