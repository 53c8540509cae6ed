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

mod event;

pub use event::{Action, Event, Frame, Trace, TraceMemory, TracedAllocator};

pub mod format;
pub mod replay;
