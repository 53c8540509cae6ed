//! # cudalloc
//!
//! Ordinary Rust collections in CUDA memory, made cheap, safe and measurable.
//!
//! ## Quick start
//!
//! ```
//! use allocator_api2::{boxed::Box, vec::Vec};
//! use cudalloc::{ManagedAlloc, PinnedAlloc};
//!
//! // Page-locked host memory: host<->device copies at full PCIe speed.
//! let mut staging: Vec<f32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
//! staging.extend_from_slice(&[1.0, 2.0, 3.0]);
//!
//! // Managed memory: one pointer for the host and every GPU.
//! let table = Box::new_in([0u64; 512], ManagedAlloc);
//!
//! // hashbrown takes the same allocators.
//! let mut map = hashbrown::HashMap::new_in(PinnedAlloc);
//! map.insert("frame", 42);
//!
//! assert_eq!(staging[2], 3.0);
//! assert_eq!(table.len(), 512);
//! assert_eq!(map["frame"], 42);
//! ```
//!
//! Without a CUDA driver the code above still runs: [`PinnedAlloc`] and [`ManagedAlloc`]
//! fall back to pageable host memory (counted by [`fallback_allocations`]); the strict
//! handles ([`PinnedAlloc::strict`]) return `AllocError` instead.
//!
//! ## Layers
//!
//! - handles: [`PinnedAlloc`], [`ManagedAlloc`], [`Pinned`], [`Managed`], [`Direct`];
//! - device memory ([`device`]): [`device::DevicePool`] hands out typed, stream-ordered
//!   [`device::DeviceBuffer`]s (device memory is not behind `Allocator`: the host cannot
//!   touch it);
//! - sources ([`source`]): where raw memory comes from, one type per memory kind;
//! - [`cuda`]: the only module that calls the driver (through cudarc).
//!
//! The allocator trait is allocator-api2 0.2's, the one `bumpalo` 3.20 and `hashbrown`
//! 0.17 implement, so one generic workload runs on every allocator.

#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod arena;
mod budget;
pub mod copy;
pub mod count;
pub mod cuda;
pub mod device;
mod direct;
pub mod error;
pub mod fence;
mod handle;
#[cfg(feature = "cudarc")]
pub mod interop;
pub mod pool;
mod registration;
pub mod source;
mod sync;
mod util;
pub mod workload;

pub use arena::{Arena, ArenaConfig, ArenaStats, Checkpoint};
pub use count::{Counting, LeakReport, ProcessWindow, Snapshot, Window};
pub use direct::Direct;
pub use error::{Error, Result};
pub use fence::{record_fence, record_use};
#[cfg(feature = "cudarc")]
pub use interop::cudarc::{PinnedView, PinnedViewMut};
pub use handle::{fallback_allocations, release_cached_memory, Managed, ManagedAlloc, Pinned, PinnedAlloc};
pub use pool::{Pool, PoolConfig, PoolStats};
pub use registration::HostRegistration;
