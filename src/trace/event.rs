//! The data model of a trace: what happened, to which memory, on which thread and stream,
//! when. Every format reads into and writes from these types, the recorder produces them
//! and the replay consumes them.

use std::borrow::Cow;

/// The kind of memory an allocator of a trace hands out. A replay runs a trace only on
/// allocators of its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum TraceMemory {
    /// Host memory the host may touch (pageable, pinned, registered, managed): an
    /// allocator-api2 `Allocator`.
    Host,
    /// Device memory, stream-ordered: a device pool.
    Device,
}

/// What an event records.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// A block was handed out: `addr`, `size` (requested), `given` (usable bytes), `align`.
    Alloc,
    /// The owner freed a block (it may still wait for GPU uses before it can be reused).
    FreeRequested,
    /// A freed block became reusable: its recorded GPU uses completed.
    FreeCompleted,
    /// An allocation of `size` bytes failed; the error's message.
    Failure(Cow<'static, str>),
    /// Memory taken from the driver or the operating system (`cuMemHostAlloc`,
    /// `cuMemHostRegister`, `cuMemCreate`, driver-pool growth, a new arena chunk).
    SegmentAlloc,
    /// Memory given back to the driver or the operating system.
    SegmentFree,
    /// Physical pages mapped into a reserved range (`cuMemMap` + `cuMemSetAccess`).
    SegmentMap,
    /// Physical pages unmapped (`cuMemUnmap`).
    SegmentUnmap,
    /// An out-of-memory error (after the allocator released what it could).
    OutOfMemory,
    /// A trim gave `size` cached bytes back.
    Trim,
}

impl Action {
    /// The name PyTorch's snapshot uses for this action (`alloc`, `free_requested`,
    /// `free_completed`, `segment_alloc`, ...); failures are `oom` there too.
    pub fn torch_name(&self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::Failure(_) | Action::OutOfMemory => "oom",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Trim => "trim",
        }
    }
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// Position in the trace's global order (0, 1, 2, ...; a replay keeps this order).
    pub seq: u64,
    /// Nanoseconds since the recording started (monotonic clock).
    pub time_ns: u64,
    /// The recording thread (a small number, stable for the trace; not the OS id).
    pub thread: u32,
    /// What happened.
    pub action: Action,
    /// Which allocator (an index into [`Trace::allocators`]).
    pub allocator: u32,
    /// The block's (or segment's) address; 0 for a failure.
    pub addr: u64,
    /// Bytes requested (for a segment: its length).
    pub size: u64,
    /// Bytes handed out (at least `size`); equal to `size` where the allocator does not say.
    pub given: u64,
    /// The requested alignment (1 where the format does not say).
    pub align: u64,
    /// The stream for device memory (0: none, or the default stream).
    pub stream: u64,
    /// The allocation site's frames, innermost first, when recorded (`backtrace` feature).
    pub frames: Vec<Frame>,
}

impl Event {
    /// An event with the given action, address and size; every other field zero or empty
    /// (`given` = `size`, `align` = 1).
    ///
    /// ```
    /// use cudalloc::trace::{Action, Event};
    /// let e = Event::new(Action::Alloc, 0x1000, 256);
    /// assert_eq!((e.given, e.align, e.stream), (256, 1, 0));
    /// ```
    pub fn new(action: Action, addr: u64, size: u64) -> Self {
        Self {
            seq: 0,
            time_ns: 0,
            thread: 0,
            action,
            allocator: 0,
            addr,
            size,
            given: size,
            align: 1,
            stream: 0,
            frames: Vec::new(),
        }
    }
}

/// One stack frame of an allocation site.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Frame {
    /// The function's name (demangled), or `??`.
    pub name: String,
    /// The source file, or empty.
    pub filename: String,
    /// The line, or 0.
    pub line: u32,
}

impl Frame {
    /// A frame.
    ///
    /// ```
    /// let f = cudalloc::trace::Frame::new("main", "src/main.rs", 3);
    /// assert_eq!(f.line, 3);
    /// ```
    pub fn new(name: impl Into<String>, filename: impl Into<String>, line: u32) -> Self {
        Self {
            name: name.into(),
            filename: filename.into(),
            line,
        }
    }
}

/// An allocator that appears in a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TracedAllocator {
    /// Its name (`PinnedAlloc`, `Pool<HostSource>`, `DevicePool(0)`, `Traced<System>`, ...).
    pub name: String,
    /// The kind of memory it hands out.
    pub memory: TraceMemory,
    /// The device, for device memory.
    pub device: u32,
}

impl TracedAllocator {
    /// An allocator entry.
    ///
    /// ```
    /// use cudalloc::trace::{TraceMemory, TracedAllocator};
    /// let a = TracedAllocator::new("Global", TraceMemory::Host, 0);
    /// assert_eq!(a.name, "Global");
    /// ```
    pub fn new(name: impl Into<String>, memory: TraceMemory, device: u32) -> Self {
        Self {
            name: name.into(),
            memory,
            device,
        }
    }
}

/// A recorded (or read) trace: the allocators and the events, in global order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Trace {
    /// The allocators the events name, by index.
    pub allocators: Vec<TracedAllocator>,
    /// The events, ordered by `seq`.
    pub events: Vec<Event>,
    /// Events the bounded recorder dropped (the oldest first) because it was full.
    pub dropped: u64,
}
