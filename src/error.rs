//! The crate's error type. Allocator-trait methods must return `AllocError`, which
//! carries nothing; the sources and pools underneath return this richer type so callers
//! of the lower layers (and logs) learn *why*.

use core::fmt;

use crate::cuda::CudaError;

/// Why an allocation or a CUDA operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
        /// What the pool held.
        memory: crate::device::DeviceMemorySummary,
    },
    /// An argument was invalid (a zero-size block where one is not allowed, an alignment
    /// this source cannot provide, a range outside the block, ...).
    InvalidArgument(&'static str),
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

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = core::result::Result<T, E>;
