//! What the page heap has done and holds: counters of its driver calls and the time they
//! took, by name. Plain data, read under the heap's lock ([`PageHeap::stats`]).
//!
//! Invariant: `block_bytes <= peak_block_bytes` and `reserved <= peak_reserved` (a peak
//! is raised wherever its value grows, and `reset_peak` sets it back to the value).
//!
//! [`PageHeap::stats`]: super::PageHeap::stats

/// What the heap has done and holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageStats {
    /// Bytes of live handles (mapped or spare), now and at most.
    pub(crate) reserved: usize,
    pub(crate) peak_reserved: usize,
    /// Bytes in live blocks, now and at most.
    pub(crate) block_bytes: usize,
    pub(crate) peak_block_bytes: usize,
    /// Handles created and released (a group's handle counts once).
    pub(crate) creates: u64,
    pub(crate) releases: u64,
    /// Of those, the handles of groups (one handle for a span of chunks).
    pub(crate) group_creates: u64,
    pub(crate) group_releases: u64,
    /// Mappings made and unmapped (a group is one mapping).
    pub(crate) maps: u64,
    pub(crate) unmaps: u64,
    pub(crate) range_reserves: u64,
    pub(crate) waits: u64,
    /// Marks recorded (for another stream taking units whose frees may be pending).
    pub(crate) marks: u64,
    /// `cuMemSetAccess` calls.
    pub(crate) accesses: u64,
    /// Of those, the ones that failed on a span just mapped (the span was unmapped again).
    pub(crate) access_failures: u64,
    /// Times a thread waited for another's turn (its mapping) to end.
    pub(crate) turn_waits: u64,
    /// Nanoseconds in the driver's physical-memory calls, by call.
    pub(crate) driver_ns: DriverNs,
}

/// Nanoseconds spent in each of the driver calls the heap times (all but the calls on
/// address ranges), added by `Held::driver`, which makes them with the heap's lock let go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DriverNs {
    /// `cuMemCreate`.
    pub(crate) create: u64,
    /// `cuMemMap`.
    pub(crate) map: u64,
    /// `cuMemSetAccess`.
    pub(crate) access: u64,
    /// `cuMemUnmap`.
    pub(crate) unmap: u64,
    /// `cuMemRelease`.
    pub(crate) release: u64,
}
