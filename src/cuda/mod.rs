//! The only module that calls `cudarc`. It owns lazy driver initialization, the cached
//! "is a driver here?" answer, binding a device's primary context to the calling thread,
//! streams, events, copies, pointer queries and kernels loaded from PTX. The rest of the
//! crate sees our own types.
//!
//! cudarc panics when libcuda is missing; every entry point here first goes through
//! one check ([`driver_available`]: once per process, without panicking); without a
//! driver they return [`Error::NoDriver`](crate::Error::NoDriver).
//! Set `CUDALLOC_NO_DRIVER=1` to make the crate behave as if no driver were present
//! (useful to test fallback paths on a GPU machine).

pub(crate) mod async_memory;
mod completion;
mod driver;
mod event_pool;
pub(crate) mod exit;
pub(crate) mod mem_pool;
pub(crate) mod memory;
mod module;
pub mod nvtx;
mod peer;
mod stream;
pub(crate) mod vmm;

pub(crate) use driver::record_drop_error;
pub use driver::{
    device_count, device_name, driver_available, drop_errors, last_drop_error, mem_info, CudaError,
};
pub(crate) use event_pool::PooledEvent;
#[cfg(feature = "testing")]
pub use mem_pool::default_pool_reserved;
pub(crate) use memory::raw;

pub use completion::{pending_completions, EventCompleted, StreamIdle};
pub use memory::{
    memset_d8_async, pointer_info, HostAllocFlags, Location, ManagedAdvice, MemoryType, PointerInfo,
};
pub use module::{Kernel, Module};
pub use peer::{can_access_peer, copy_async};
#[cfg(feature = "cudarc")]
pub(crate) use stream::{is_same, known, order_after};
pub use stream::{Event, Stream, StreamId};
