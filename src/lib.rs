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
//! ## Guides
//!
//! - [Choosing an allocator](guide::choosing): which of [`PinnedAlloc`], [`ManagedAlloc`],
//!   [`Arena`], [`Pool`], [`Direct`], [`DevicePool`](device::DevicePool) and [`Counting`]
//!   fits which job, with measured costs, and the pitfalls (the pinned cap, managed memory
//!   without prefetch, write-combined reads, no driver, compute-sanitizer).
//! - [Troubleshooting](guide::troubleshooting): each error, the message the crate prints,
//!   and what to do.
//! - [Guarantees](guide::guarantees): what every allocator promises (alignment, zero
//!   size, bad input, zeroed memory, threads, reuse after GPU use, limits, no driver,
//!   source failures) and the test that holds it to each promise.
//! - [Traces](guide::traces): recording a program's allocations, looking at them, and
//!   replaying them against every allocator.
//! - [Staging and async](guide::staging): GPU completion as futures
//!   ([`Stream::idle`](cuda::Stream::idle), [`Event::completed`](cuda::Event::completed)) and
//!   staging rings ([`staging::StagingRing`]): blocking, non-blocking and async.
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
//!
//! ## Working with cudarc
//!
//! With the `cudarc` feature (off by default) the crate's memory and streams go straight
//! into the copies and kernel launches of [cudarc](https://docs.rs/cudarc) 0.19:
//!
//! - **Streams, both ways.** `Stream::cudarc()` is a crate [`Stream`](cuda::Stream) as
//!   cudarc's `&Arc<CudaStream>`: the same driver stream, in the device's primary context,
//!   which both crates retain. `Stream::from_cudarc(&s)` (or `Stream::try_from(&s)`) turns
//!   a cudarc stream into a crate stream, which is how [`DevicePool::alloc`],
//!   [`record_use`] and the [`copy`] helpers take one; while a handle of it lives, the
//!   same cudarc stream converts to the same crate stream.
//! - **Device buffers.** [`DeviceBuffer<T>`](device::DeviceBuffer) implements cudarc's
//!   `DeviceSlice`, `DevicePtr`, `DevicePtrMut` and `PushKernelArg`:
//!   `cs.memcpy_htod(&src, &mut buf)`, `cs.launch_builder(&f).arg(&buf)`. On the buffer's
//!   own stream that costs nothing; on another stream cudarc's call is ordered after the
//!   buffer's stream and waits for the use. cudarc's copies also need `T: DeviceRepr`
//!   (the integers and floats have it; implement it for your own plain structs).
//! - **Pinned memory: not as a plain slice.** cudarc takes every `&[T]` for pageable
//!   memory and never waits, while the driver copies pinned memory truly asynchronously:
//!   `cs.memcpy_htod(&v[..], ..)` with `v: Vec<T, PinnedAlloc>` returns before the copy has
//!   read `v`, the device receives what the host writes afterwards, and a `v` dropped at
//!   once goes back to the pool, which may hand it to a new owner while the DMA still
//!   reads (or, for `memcpy_dtoh`, writes) it. Wrap it instead: `PinnedView::new(&v)?` as
//!   a source keeps the copy asynchronous and the block from reuse until the copy is
//!   done; `PinnedViewMut::new(&mut v)?` as a destination makes the copy complete before
//!   cudarc returns (`new_async`, `unsafe`, keeps it asynchronous). The copy stays
//!   asynchronous on a crate stream's view or a cudarc stream with a live
//!   `Stream::from_cudarc` handle; on other streams the call waits for it.
//! - **Memory you already have** (a `Vec` from another crate, an mmap'd file):
//!   [`HostRegistration::new(&mut buf)`](HostRegistration) pins it for as long as the
//!   guard lives, for the copy helpers and the views alike.
//! - **Kernels without NVRTC.** `ctx.load_module(Ptx::from_src(include_str!("k.ptx")))`
//!   loads PTX text kept in your repository; the feature enables cudarc's `nvrtc` feature
//!   only for that function, and libnvrtc is never loaded. Write PTX with a `.version` the
//!   oldest driver you support knows (8.0 loads on every CUDA 12 and 13 driver).
//!   `examples/cudarc.rs` and `kernels/` show the whole path. (Without cudarc, the
//!   crate's own [`cuda::Module`] loads PTX and launches kernels on crate streams.)
//!
//! [`DevicePool::alloc`]: device::DevicePool::alloc
#![cfg_attr(
    feature = "cudarc",
    doc = r#"
```
use allocator_api2::vec::Vec;
use cudalloc::{cuda::Stream, device::DevicePool, PinnedAlloc, PinnedView, PinnedViewMut};

if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
    let cs = stream.cudarc(); // &Arc<cudarc::driver::CudaStream>
    let mut x: Vec<f32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    x.extend((0..1024).map(|i| i as f32));
    let mut dev = pool.alloc::<f32>(x.len(), &stream).unwrap(); // DeviceBuffer<f32>
    cs.memcpy_htod(&PinnedView::new(&x).unwrap(), &mut dev).unwrap(); // asynchronous
    drop(x); // at once: the pool keeps the block until the copy is done
    // ... cs.launch_builder(&kernel).arg(&mut dev).arg(&n).launch(cfg) ...
    let mut out: Vec<f32, PinnedAlloc> = Vec::new_in(PinnedAlloc);
    out.resize(1024, 0.0);
    cs.memcpy_dtoh(&dev, &mut PinnedViewMut::new(&mut out).unwrap()).unwrap();
    assert_eq!(out[1023], 1023.0);
}
```
"#
)]
#![deny(missing_docs)]

pub mod arena;
mod budget;
mod class_geometry;
pub mod copy;
pub mod count;
pub mod cuda;
pub mod device;
mod direct;
pub mod error;
pub mod fence;
pub mod guide;
mod handle;
#[cfg(feature = "cudarc")]
pub mod interop;
mod observe;
pub mod pool;
mod registration;
mod slot_table;
pub mod source;
pub mod staging;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;
mod thread_registry;
pub mod trace;
mod util;

pub use arena::{Arena, ArenaConfig, ArenaStats, Checkpoint};
pub use count::{Counting, LeakReport, ProcessWindow, Snapshot, Window};
pub use direct::Direct;
pub use error::{Error, Result};
pub use fence::{record_fence, record_use};
pub use handle::{
    fallback_allocations, release_cached_memory, Managed, ManagedAlloc, Pinned, PinnedAlloc, PinnedAllocate,
};
#[cfg(feature = "cudarc")]
pub use interop::cudarc::{PinnedView, PinnedViewMut};
pub use pool::{Pool, PoolConfig, PoolStats};
pub use registration::HostRegistration;
pub use source::{advise, prefetch};
