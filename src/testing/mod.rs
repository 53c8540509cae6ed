//! Scaffolding for the crate's benchmarks, examples and tests: generic workloads and the
//! raw CUDA reference points (plain `cuMemAlloc` and `cuMemAllocAsync` device memory,
//! `cuMemHostAlloc` host buffers) that the crate's own types are measured against.
//!
//! Behind the `testing` feature (the crate's own benches, examples and tests get it through
//! its dev-dependency on itself) and outside the API's stability promise: these types
//! exist to make A/B comparisons honest, not for applications, which use
//! [`DevicePool`](crate::device::DevicePool), [`PinnedAlloc`](crate::PinnedAlloc) and
//! [`copy`](crate::copy) instead.

mod raw_pinned;
pub mod workload;

pub use crate::cuda::async_memory::AsyncDeviceMemory;
pub use crate::cuda::memory::DeviceMemory;
pub use crate::source::managed::managed_bytes_held;
pub use raw_pinned::RawPinnedBuffer;

/// The page heap's counters of a pool on physical pages (driver calls made and the time
/// spent in them), for benchmarks; `None` for a pool on the driver pool.
pub fn page_heap_counters(pool: &crate::device::DevicePool) -> Option<String> {
    pool.page_counters()
}
