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

pub use crate::cuda::async_memory::warm_up as warm_up_stream_ordered;
pub use crate::cuda::async_memory::AsyncDeviceMemory;
pub use crate::cuda::memory::DeviceMemory;
pub use crate::source::managed::managed_bytes_held;
pub use raw_pinned::RawPinnedBuffer;

/// The page heap's counters of a pool on physical pages (driver calls made and the time
/// spent in them), for benchmarks; `None` for a pool on the driver pool.
pub fn page_heap_counters(pool: &crate::device::DevicePool) -> Option<String> {
    pool.page_counters()
}

/// Fresh host memory faulted in as registered pinned growth does before
/// `cuMemHostRegister` (its own mapping, pages faulted in by up to one thread per 8 MiB),
/// without the registration: for the cold-growth benchmark, which times the prefault
/// alone. Unmapped on drop.
///
/// ```
/// let mut pages = cudalloc::testing::PrefaultedPages::new(1 << 20).unwrap();
/// assert_eq!(pages.threads(), 1);
/// assert!(pages.as_mut_slice().iter().all(|&b| b == 0));
/// ```
pub struct PrefaultedPages {
    ptr: core::ptr::NonNull<u8>,
    len: usize,
    threads: usize,
}

impl PrefaultedPages {
    /// Maps `len` bytes (rounded up to the page; at least one page) and faults them in
    /// with up to [`prefault_threads`] threads.
    pub fn new(len: usize) -> crate::Result<Self> {
        let len =
            crate::util::align_up(len.max(1), crate::util::PAGE_SIZE).ok_or(crate::Error::TooLarge {
                requested: len,
                limit: usize::MAX - crate::util::PAGE_SIZE,
            })?;
        crate::util::check_physical_memory(len)?;
        let ptr = crate::source::prefault::map(len)?;
        // SAFETY: a fresh block of `len` bytes, ours alone.
        let threads = unsafe { crate::source::prefault::prefault(ptr, len, prefault_threads()) };
        Ok(Self { ptr, len, threads })
    }

    /// The threads that faulted the pages in.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The bytes (zero after `new`).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr+len` is mapped, initialized (zero) and ours while `self` lives.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PrefaultedPages {
    fn drop(&mut self) {
        // SAFETY: mapped by `new` with `len`; the slices borrowed from `self` are gone.
        unsafe { crate::source::prefault::unmap(self.ptr, self.len) }
    }
}

// SAFETY: the pages are plain memory owned by the value.
unsafe impl Send for PrefaultedPages {}

/// The most threads registered pinned growth faults a block's pages in with:
/// `CUDALLOC_PREFAULT_THREADS`, else the machine's available parallelism.
pub fn prefault_threads() -> usize {
    crate::source::prefault::max_threads()
}
