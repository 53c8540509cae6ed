//! The crate's error type. Allocator-trait methods must return `AllocError`, which
//! carries nothing; the sources and pools underneath return this richer type so callers
//! of the lower layers (and logs) learn *why*.

use core::fmt;

use crate::cuda::CudaError;

/// Why an allocation or a CUDA operation failed.
///
/// Small (32 bytes), so that a `Result` of it costs little on allocation paths: the one
/// variant with a report ([`Error::DeviceOutOfMemory`]) keeps it in a `Box`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// No CUDA driver (libcuda) could be loaded, `cuInit` failed, or there is no device.
    NoDriver,
    /// A CUDA driver call failed.
    Cuda(CudaError),
    /// The request is larger than this source or pool may hand out.
    TooLarge {
        /// Bytes asked for (after rounding).
        requested: usize,
        /// The limit it exceeded.
        limit: usize,
    },
    /// The request would take the bytes held past a configured limit.
    LimitExceeded {
        /// Bytes asked for.
        requested: usize,
        /// Bytes held already.
        held: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The upstream source (the operating system or the driver) had no memory.
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
    },
    /// A device pool found no memory for a request even after releasing its cache (or
    /// the request would take it past its limit): the device, the block size asked for,
    /// and the pool's state then.
    DeviceOutOfMemory {
        /// The device.
        device: usize,
        /// Bytes asked for (the block size the request rounds up to).
        requested: usize,
        /// What the pool held (boxed: it would make every `Result` of the crate larger).
        memory: Box<crate::device::DeviceMemorySummary>,
    },
    /// An argument was invalid (a zero-size block where one is not allowed, an alignment
    /// this source cannot provide, a range outside the block, ...).
    InvalidArgument(&'static str),
    /// The driver does not know the PTX ISA version a module declares
    /// (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`): the PTX came from a newer CUDA toolkit than
    /// the driver's release.
    UnsupportedPtx {
        /// The `.version` the PTX declares, as (major, minor), if it declares one.
        ptx_version: Option<(u16, u16)>,
        /// The CUDA version the driver supports, as (major, minor); (0, 0) if unknown.
        driver_version: (u16, u16),
    },
    /// A module has no kernel of the requested name (`CUDA_ERROR_NOT_FOUND`).
    KernelNotFound,
    /// A wait with a deadline ran out before what it waited for was ready (a staging
    /// ring's [`next`](crate::staging::StagingRing::next) whose buffers the GPU still
    /// used, say).
    TimedOut(&'static str),
}

impl Error {
    /// Whether the error says that memory ran out (a source, a driver, or a limit), rather
    /// than that something is broken: what a pool's recovery (release, trim, retry) can
    /// help with.
    pub(crate) fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } | Error::DeviceOutOfMemory { .. } | Error::LimitExceeded { .. } => true,
            Error::Cuda(c) => c.is_out_of_memory(),
            _ => false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver => f.write_str(
                "no CUDA driver: libcuda could not be loaded, cuInit failed, or no device is present",
            ),
            Error::Cuda(e) => write!(f, "CUDA driver call failed: {e}"),
            Error::TooLarge { requested, limit } => {
                write!(
                    f,
                    "request of {requested} bytes exceeds the limit of {limit} bytes"
                )
            }
            Error::LimitExceeded {
                requested,
                held,
                limit,
            } => write!(
                f,
                "request of {requested} bytes with {held} bytes held exceeds the limit of {limit} bytes"
            ),
            Error::OutOfMemory { requested } => write!(f, "out of memory allocating {requested} bytes"),
            Error::DeviceOutOfMemory {
                device,
                requested,
                memory,
            } => write!(
                f,
                "device {device} out of memory allocating {requested} bytes after releasing its cache ({memory})"
            ),
            Error::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
            Error::UnsupportedPtx {
                ptx_version,
                driver_version: (major, minor),
            } => {
                match ptx_version {
                    Some((x, y)) => write!(f, "the PTX declares ISA version {x}.{y}, which ")?,
                    None => f.write_str("the PTX declares an ISA version that ")?,
                }
                if (*major, *minor) == (0, 0) {
                    f.write_str("this driver does not know")?;
                } else {
                    write!(f, "this driver (CUDA {major}.{minor}) does not know")?;
                }
                f.write_str(
                    ": it was generated by a newer CUDA toolkit; lower its `.version` (PTX 8.0 \
                     loads on every CUDA 12 and 13 driver) or update the driver",
                )
            }
            Error::TimedOut(what) => write!(f, "timed out: {what}"),
            Error::KernelNotFound => f.write_str(
                "the module has no kernel of that name (declare kernels extern \"C\" so that \
                 C++ does not mangle their names)",
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Cuda(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CudaError> for Error {
    fn from(e: CudaError) -> Self {
        Error::Cuda(e)
    }
}

impl From<Error> for allocator_api2::alloc::AllocError {
    fn from(_: Error) -> Self {
        allocator_api2::alloc::AllocError
    }
}

// Every `Result<_, Error>` on an allocation path carries this much.
const _: () = assert!(size_of::<Error>() <= 32, "Error stays small");

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = core::result::Result<T, E>;
