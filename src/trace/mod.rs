//! Allocation traces: record what a program's allocators do, look at it, replay it
//! against every allocator.
//!
//! A [`Trace`] is a list of [`Event`]s (allocations, frees requested and completed,
//! failures, memory taken from and given back to the driver) in one global order, with
//! the allocators they name. The recorder, the file formats and the replay all speak
//! these types.
//!
//! ```
//! use cudalloc::trace::{Action, Event, Trace, TraceMemory, TracedAllocator};
//!
//! let mut t = Trace::default();
//! t.allocators.push(TracedAllocator::new("Global", TraceMemory::Host, 0));
//! t.events.push(Event::new(Action::Alloc, 0x1000, 64));
//! t.events.push(Event::new(Action::FreeRequested, 0x1000, 64));
//! assert_eq!(t.events.len(), 2);
//! ```
//!
//! # Recording
//!
//! [`start`] turns the recorder on for every allocator of the crate (`Pool`, `Arena`,
//! `Direct`, the pools behind `PinnedAlloc` and `ManagedAlloc`, `DevicePool`,
//! `DeviceArena`) and every [`Traced`]
//! allocator, on every thread; [`stop`] returns the [`Trace`]. Setting
//! `CUDALLOC_TRACE=FILE` records the whole process instead, and writes the trace to
//! FILE at exit and at the first out-of-memory error: PyTorch's memory snapshot for a
//! `.pickle` or `.pkl` FILE, the SVG timeline for `.svg`, RMM's CSV log otherwise.
//!
//! ```
//! use allocator_api2::{boxed::Box, vec::Vec};
//! use cudalloc::trace::{self, Action, TraceConfig, Traced};
//!
//! # if trace::is_recording() { return; }
//! let system = Traced::named(std::alloc::System, "system");
//! trace::start(TraceConfig::default()).unwrap();
//! let b = Box::new_in([0u64; 4], &system);
//! drop(b);
//! let t = trace::stop();
//! let mine = t.allocators.iter().position(|a| a.name == "system").unwrap() as u32;
//! let e: Vec<_> = t.events.iter().filter(|e| e.allocator == mine).collect();
//! assert_eq!((e[0].action.clone(), e[0].size, e[0].align), (Action::Alloc, 32, 8));
//! assert_eq!(e[1].action, Action::FreeRequested);
//! assert_eq!(e[2].action, Action::FreeCompleted);
//! ```
//!
//! Off (the default), a hook costs one Relaxed load and a branch. On, a recording
//! thread takes no global lock: it writes a buffer of its own and takes its place in the
//! global order with one atomic `fetch_add`. See [`TraceConfig`] for the bound on the
//! events kept.
//!
//! What each allocator records:
//!
//! | allocator | events |
//! | --- | --- |
//! | `Pool<S>` (`Pool<HostSource>`) | `Alloc` (`given`: the block's bytes); `FreeRequested` at `deallocate`; `FreeCompleted` at once, or, for a block with recorded GPU uses, when the pool finds them complete (`size`: the block's bytes then); `Failure` with the error's message; `SegmentAlloc` / `SegmentFree` for each chunk or large segment taken from or given back to the source; `Trim` (`size`: bytes released) for every trim, the ones a failing allocation makes included |
//! | `PinnedAlloc`, `ManagedAlloc` | their process-wide pools' events, named `PinnedAlloc`, `PinnedAlloc(PORTABLE)`, ..., `ManagedAlloc`, `ManagedAlloc(host)`; without a driver, `PinnedAlloc(fallback)` / `ManagedAlloc(fallback)` |
//! | `Arena<S>` | `Alloc`; `FreeRequested` and `FreeCompleted` at `deallocate` (the memory itself returns at `reset`); `Failure`; `SegmentAlloc` / `SegmentFree` per chunk |
//! | `Direct<S>` | `Alloc`, `FreeRequested` + `FreeCompleted`, `Failure` (each block is its own source call: no segment events), named `Direct(pageable)`, `Direct(pinned)`, ... |
//! | [`Traced<A>`] | `Alloc`, `FreeRequested` + `FreeCompleted`, `Failure` (`memory allocation failed`) |
//! | `DevicePool` (`DevicePool(<ordinal>)`) | `Alloc` (`stream`: the stream's id; `given`: the class or granule size; `align` 256); `FreeRequested` at the buffer's drop; `FreeCompleted` at once when no other stream used the block (later work on its stream may reuse it, in stream order), else when the cache finds the recorded uses complete; `Failure` with the error's message, then `OutOfMemory` for `DeviceOutOfMemory`; `SegmentAlloc` / `SegmentFree` for the driver pool's growth and shrinking (below); `SegmentMap` / `SegmentUnmap` for each chunk the page heap maps or unmaps; `Trim` (`size`: bytes the driver pool and the page heap gave back), after the trim's `SegmentFree`s and `SegmentUnmap`s; with an NVTX tool attached (every block a `cuMemAlloc`), `SegmentAlloc` / `SegmentFree` per block |
//! | `DeviceArena` (`DeviceArena(<ordinal>)`) | `Alloc` per slice; `FreeRequested` + `FreeCompleted` for each slice at the `reset`, `rewind` or drop that makes it reusable; `SegmentAlloc` / `SegmentFree` per chunk (each chunk is also a `DevicePool` buffer); `Failure` |
//!
//! The driver pool (`cuMemPool`: every block of [`Backing::DriverPool`], the small ones
//! of the default [`Backing::Auto`]) grows by chunks of the driver's choosing and says
//! only how many bytes it reserves (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`). While a
//! recording runs, the pool reads that figure after each allocation that reached the
//! driver pool (a hit never does) and after each trim, and records the change: a growth
//! is a `SegmentAlloc` of the bytes it grew by, at the address and on the stream of the
//! allocation after which it was seen (the driver does not say where its chunk starts),
//! recorded before that allocation's `Alloc`; a decrease, at a trim or by the driver
//! itself (seen at the next reading), gives back the newest recorded growths first, a
//! `SegmentFree` with each one's address, size and stream (a decrease that ends inside a
//! growth frees it and records its remainder again, so that segments pair by address);
//! what the pool reserved before the recording is given back last, a `SegmentFree` at
//! address 0 on stream 0. When the pool is dropped, its growths still reserved are
//! freed. The `SegmentAlloc`s less the `SegmentFree`s add up to the driver pool's
//! reservation at its last reading less its reservation when the recording first read
//! it. Off, the hooks are the recorder's one load and branch, and nothing is read.
//!
//! [`Backing::DriverPool`]: crate::device::Backing::DriverPool
//! [`Backing::Auto`]: crate::device::Backing::Auto
//!
//! A grow or shrink in place is the old block's free and the new block's allocation
//! at the same address; a move by copy is the new block's allocation, then the old
//! one's free (`Traced` records the old block's free first either way: it cannot tell
//! a move from a resize in place). Zero-size blocks are not recorded.

mod event;
mod growth;
mod record;
mod traced;

pub use event::{Action, Event, Frame, Trace, TraceMemory, TracedAllocator};
pub use record::{is_recording, start, stop, TraceConfig};
pub use traced::Traced;

#[allow(unused_imports)]
pub(crate) use growth::PoolReservation;
#[allow(unused_imports)]
pub(crate) use record::{arena_name, direct, fallback, on, pinned_name, pool_name, Code, Note, Tag};

pub mod format;
pub mod replay;
