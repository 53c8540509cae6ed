//! The recorder: what the allocators' hooks call, the per-thread buffers they write, and
//! [`start`] / [`stop`], which turn the buffers into a [`Trace`].
//!
//! The hooks run inside allocators, perhaps the global one, so:
//! - off, a hook is one Relaxed load of [`STATE`] and a branch ([`on`]); everything else
//!   is behind a `#[cold]` call;
//! - on, a recording thread takes no global lock and one atomic read-modify-write per
//!   call: it writes a buffer of its own (a header found through a thread-local, its
//!   storage from `System`), and one `fetch_add` on [`SEQ`] both gives it its place in
//!   the global order and tells it whether [`stop`] (or the out-of-memory dump) halted
//!   the recorder; a plain store of the buffer's `writing` flag on each side of the write
//!   tells `stop` when the buffer may be read (see [`ThreadBuf::enter`]);
//! - a thread-local guard keeps the recorder from recording itself: what it allocates
//!   (a thread's first buffer, an allocator's name, the trace [`stop`] builds) goes to the
//!   allocator untraced, so a `Traced<System>` under `#[global_allocator]` cannot recurse.
//!
//! Locks: [`CONTROL`] (the configuration and the allocators of the session) is taken by
//! `start`, `stop` and by an allocator's first event of a session, never per event, and
//! never while the taking thread writes its buffer; a buffer's `busy` flag is taken by
//! `stop` and by a thread claiming the buffer of an exited one, never per event.

#[cfg(all(feature = "backtrace", not(loom)))]
mod sites;

mod env;

use core::cell::{Cell, UnsafeCell};
use core::fmt::{self, Write as _};
use std::alloc::System;
use std::borrow::Cow;
use std::time::Instant;

use allocator_api2::alloc::Layout;
use allocator_api2::boxed::Box as SysBox;
use allocator_api2::vec::Vec as SysVec;

use super::{Action, Event, Frame, Trace, TraceMemory, TracedAllocator};
use crate::error::{Error, Result};
use crate::sync::global::{lock, AtomicBool, AtomicU64, AtomicUsize, Mutex, OnceLock, Ordering};

/// How a recording is shaped: pass it to [`start`]. Start from
/// [`TraceConfig::default()`] and change what you need with the `with_*` methods.
///
/// ```
/// use cudalloc::trace::TraceConfig;
/// let config = TraceConfig::default().with_max_entries(10_000);
/// assert_eq!(config.max_entries, 10_000);
/// assert!(!config.sites);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceConfig {
    /// The most events a trace keeps (default 2^20): when more were recorded, [`stop`]
    /// keeps the `max_entries` newest (highest `seq`) and counts the rest in
    /// [`Trace::dropped`]. Each thread keeps its newest `max_entries` records (at least
    /// as many events) in a ring that grows as it fills, so no event that the trace
    /// keeps is lost, and each recording thread holds at most `max_entries` records (64
    /// bytes each, more with sites; a free whose block is reusable at once and that
    /// completion share one) until `stop`. At least 1.
    ///
    /// A ring is made with room for 2^16 records (4 MiB; `max_entries` if fewer), its
    /// pages faulted in before the first event is stored (the thread calling [`start`]'s
    /// at the start, about a millisecond); each growth (doubling, up to `max_entries`)
    /// faults its new memory in at once, in the event that makes it, so that the events
    /// in between cost what they cost in a full ring.
    pub max_entries: usize,
    /// Record the stack of every allocation (needs the `backtrace` feature; costly: a
    /// stack walk per allocation, and 256 bytes per event).
    pub sites: bool,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            max_entries: 1 << 20,
            sites: false,
        }
    }
}

impl TraceConfig {
    /// This configuration keeping at most `events` (at least 1).
    pub const fn with_max_entries(self, events: usize) -> Self {
        Self {
            max_entries: if events == 0 { 1 } else { events },
            ..self
        }
    }

    /// This configuration recording allocation sites, or not (`true` needs the
    /// `backtrace` feature: without it, [`start`] refuses).
    ///
    /// ```
    /// let c = cudalloc::trace::TraceConfig::default().with_sites(true);
    /// assert!(c.sites);
    /// ```
    pub const fn with_sites(self, sites: bool) -> Self {
        Self { sites, ..self }
    }
}

// ---- the state every hook reads -------------------------------------------------------

/// Bit 0: recording. Bit 1: `CUDALLOC_TRACE` not read yet (so the first hook looks).
/// Bits 2..: the session, counted up by every start (so that an allocator's index and a
/// thread's buffer of an earlier recording are told apart from this one's).
static STATE: AtomicU64 = AtomicU64::new(ENV_PENDING);
const ON: u64 = 1;
const ENV_PENDING: u64 = 2;
const SESSION_SHIFT: u32 = 2;

/// The global order of events in its low 63 bits (one `fetch_add` per recording call;
/// renumbered from 0 by `stop`), and [`HALT`]. Only read-modify-writes change it, so
/// that each one synchronizes with every earlier one (a release sequence): what a
/// writer stored before its `fetch_add` is visible to `collect` after its `fetch_or`.
static SEQ: Line<AtomicU64> = Line(AtomicU64::new(0));

/// A value on cache lines of its own: [`SEQ`], written by every event, beside [`STATE`],
/// read by every hook of every thread, would take that line from each reader's cache at
/// every event; a thread's buffer header beside another's, the same (128 bytes: the
/// pair of lines that x86's adjacent-line prefetch fetches together).
#[repr(align(128))]
struct Line<T>(T);

impl<T> core::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Set in [`SEQ`] while `collect` reads the buffers: a writer whose `fetch_add` sees it
/// writes nothing (and waits, if the recording goes on).
const HALT: u64 = 1 << 63;
/// Thread numbers of the session, from 0.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(0);
/// Each thread's ring holds this many events (the configuration's `max_entries`).
static CAPACITY: AtomicUsize = AtomicUsize::new(1);
/// Whether allocations capture their stack.
static SITES: AtomicBool = AtomicBool::new(false);
/// The clock's origin: `Instant` is not atomic, so sessions store their start as an
/// offset from this, fixed for the process.
static EPOCH: OnceLock<Instant> = OnceLock::new();
/// The session's start, in nanoseconds since `EPOCH` and in [`ticks`]: events store
/// ticks, which `build` turns into nanoseconds since the start by the rate between the
/// start and the collection.
static START_NS: AtomicU64 = AtomicU64::new(0);
static START_TICKS: AtomicU64 = AtomicU64::new(0);

/// The configuration and the allocators of the session.
struct Control {
    allocators: Vec<TracedAllocator>,
}

static CONTROL: Mutex<Control> = Mutex::new(Control {
    allocators: Vec::new(),
});

/// Whether the hooks must look further: recording, or `CUDALLOC_TRACE` not read yet.
/// One Relaxed load; compiled to `false` under loom (the recorder is never part of a
/// model: its statics are `std`'s).
#[inline(always)]
pub(crate) fn on() -> bool {
    !cfg!(loom) && STATE.load(Ordering::Relaxed) & (ON | ENV_PENDING) != 0
}

/// Whether a recording is running now.
///
/// ```
/// assert!(!cudalloc::trace::is_recording() || std::env::var_os("CUDALLOC_TRACE").is_some());
/// ```
pub fn is_recording() -> bool {
    env::read_once();
    STATE.load(Ordering::Relaxed) & ON != 0
}

/// The running recording's session (`None`: none runs), `CUDALLOC_TRACE` read first:
/// what a hook that keeps state per recording compares (the driver pools' reservations,
/// `trace::growth`).
pub(crate) fn session() -> Option<u64> {
    env::read_once();
    let state = STATE.load(Ordering::Acquire);
    (state & ON != 0).then_some(session_of(state))
}

fn session_of(state: u64) -> u64 {
    state >> SESSION_SHIFT
}

/// Nanoseconds since the process's clock origin.
fn epoch_ns() -> u64 {
    let epoch = EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The event clock: the time-stamp counter on x86-64 (a few nanoseconds to read, where
/// `clock_gettime` took 40% of an event's time, measured), which every x86-64 CPU has and
/// which runs at a constant rate on those of the last fifteen years; elsewhere
/// nanoseconds of the monotonic clock.
#[inline(always)]
fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `rdtsc` exists on every x86-64 processor and has no side effects.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        epoch_ns()
    }
}

/// Turns an event's ticks into nanoseconds since the start, by the rate measured
/// between the start and now.
struct Clock {
    start_ticks: u64,
    ns_per_tick: f64,
}

impl Clock {
    fn now() -> Self {
        let (t0, n0) = (
            START_TICKS.load(Ordering::Relaxed),
            START_NS.load(Ordering::Relaxed),
        );
        let (t1, n1) = (ticks(), epoch_ns());
        let ns_per_tick = if t1 > t0 {
            n1.saturating_sub(n0) as f64 / (t1 - t0) as f64
        } else {
            1.0
        };
        Self {
            start_ticks: t0,
            ns_per_tick,
        }
    }

    fn ns(&self, ticks: u64) -> u64 {
        (ticks.saturating_sub(self.start_ticks) as f64 * self.ns_per_tick) as u64
    }
}

// ---- start and stop -------------------------------------------------------------------

/// Starts recording every allocator of the crate (and every [`Traced`](super::Traced)
/// allocator) on every thread. Errors: `InvalidArgument` if a recording is running
/// already (`CUDALLOC_TRACE` starts one for the whole process), or if `config.sites`
/// asks for allocation sites without the `backtrace` feature.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{pool::Pool, source::HostSource, trace};
///
/// # if trace::is_recording() { return; }
/// let pool = Pool::new(HostSource);
/// trace::start(trace::TraceConfig::default()).unwrap();
/// let v: Vec<u8, _> = Vec::with_capacity_in(100, &pool);
/// drop(v);
/// let t = trace::stop();
/// let mine = t.allocators.iter().position(|a| a.name == "Pool<HostSource>").unwrap() as u32;
/// let actions: Vec<_> = t.events.iter().filter(|e| e.allocator == mine).map(|e| e.action.torch_name()).collect();
/// assert_eq!(&actions[actions.len() - 3..], ["alloc", "free_requested", "free_completed"]);
/// ```
pub fn start(config: TraceConfig) -> Result<()> {
    env::read_once();
    if config.sites && !cfg!(all(feature = "backtrace", not(loom))) {
        return Err(Error::InvalidArgument(
            "allocation sites need cudalloc's `backtrace` feature",
        ));
    }
    let _inside = Inside::enter();
    let mut ctl = lock(&CONTROL);
    let state = STATE.load(Ordering::Relaxed);
    if state & ON != 0 {
        return Err(Error::InvalidArgument("a trace is already recording"));
    }
    ctl.allocators.clear();
    CAPACITY.store(config.max_entries.max(1), Ordering::Relaxed);
    SITES.store(config.sites, Ordering::Relaxed);
    NEXT_THREAD.store(0, Ordering::Relaxed);
    START_NS.store(epoch_ns(), Ordering::Relaxed);
    START_TICKS.store(ticks(), Ordering::Relaxed);
    let session = session_of(state) + 1;
    let on = (session << SESSION_SHIFT) | (state & ENV_PENDING) | ON;
    // Release: a hook that sees the new session (Acquire in `record`) sees the settings.
    STATE.store(on, Ordering::Release);
    crate::observe::raise(crate::observe::TRACE);
    drop(ctl);
    // The calling thread's ring, made and faulted in now rather than at its first event
    // (other threads' at theirs).
    if let Some(buf) = my_buffer() {
        if let Some((_writing, _)) = buf.enter(on, 0) {
            // SAFETY: between `enter` and the drop of `_writing` only this thread, the
            // buffer's owner, reaches the data (`collect` waits for the flag).
            let d = unsafe { &mut *buf.data.get() };
            if d.session != session {
                d.begin(session);
            }
        }
    }
    Ok(())
}

/// Stops the recording and returns its trace: the allocators that recorded, and the
/// events in global order (renumbered `seq` 0, 1, 2, ...), at most
/// [`TraceConfig::max_entries`] of them (the newest; [`Trace::dropped`] counts the
/// rest, and events a thread could not store for want of memory). Without a recording,
/// an empty trace.
///
/// ```
/// # if cudalloc::trace::is_recording() { return; }
/// let t = cudalloc::trace::stop(); // nothing was recording
/// assert!(t.events.is_empty() && t.allocators.is_empty());
/// ```
pub fn stop() -> Trace {
    env::read_once();
    collect(true)
}

/// The trace so far; with `stop`, ends the recording.
fn collect(stop: bool) -> Trace {
    let _inside = Inside::enter();
    let mut ctl = lock(&CONTROL);
    let state = STATE.load(Ordering::Relaxed);
    if state & ON == 0 {
        return Trace::default();
    }
    if stop {
        // Before `HALT`: a writer that sees `HALT` (or, later, sees it cleared) sees the
        // recording off, and drops its event.
        STATE.store(state & !ON, Ordering::SeqCst);
        crate::observe::lower(crate::observe::TRACE, on);
    }
    let session = session_of(state);
    // Acquire: every writer whose `fetch_add` came before this one in `SEQ`'s order
    // stored its `writing` flag before it, visibly now; every later one sees `HALT`.
    SEQ.fetch_or(HALT, Ordering::AcqRel);
    // From `System`: while `HALT` is set, an out-of-memory dump's writers wait, and one
    // may hold a lock of the global allocator.
    let mut taken: SysVec<Taken, System> = SysVec::new_in(System);
    let mut offered = 0u64;
    for buf in buffers() {
        // The owner finishes the one event it may be writing (Acquire: its stores are
        // visible once the flag reads false), and writes no other until `HALT` clears.
        while buf.writing.load(Ordering::Acquire) {
            core::hint::spin_loop();
        }
        // Against a thread claiming the buffer meanwhile (it reads the data).
        let _held = buf.hold();
        // SAFETY: the owner writes the data only between a `fetch_add` that saw no
        // `HALT` and its release of `writing`, which completed above; the flag keeps
        // claimers out.
        let d = unsafe { &mut *buf.data.get() };
        if d.session != session {
            continue;
        }
        offered += d.offered;
        let t = Taken {
            thread: d.thread,
            recs: if stop {
                core::mem::replace(&mut d.recs, SysVec::new_in(System))
            } else {
                d.recs.clone()
            },
            frames: if stop {
                core::mem::replace(&mut d.frames, SysVec::new_in(System))
            } else {
                d.frames.clone()
            },
            msgs: if stop {
                core::mem::replace(&mut d.msgs, SysVec::new_in(System))
            } else {
                d.msgs.clone()
            },
        };
        if stop {
            d.session = 0;
            d.offered = 0;
            d.head = 0;
            d.msg_head = 0;
        }
        taken.push(t);
    }
    // Release: a writer whose `fetch_add` sees `HALT` gone sees the state `stop` stored.
    SEQ.fetch_and(!HALT, Ordering::Release);
    let allocators = if stop {
        core::mem::take(&mut ctl.allocators)
    } else {
        ctl.allocators.clone()
    };
    // Under the lock: the next start moves the clock's origin.
    let clock = Clock::now();
    drop(ctl);
    build(allocators, taken, offered, &clock)
}

/// What `collect` moved out of one thread's buffer.
struct Taken {
    thread: u32,
    recs: SysVec<Rec, System>,
    frames: SysVec<Stack, System>,
    msgs: SysVec<Msg, System>,
}

/// The trace from the buffers' contents: sorted, trimmed to `max_entries`, renumbered.
fn build(
    allocators: Vec<TracedAllocator>,
    taken: SysVec<Taken, System>,
    offered: u64,
    clock: &Clock,
) -> Trace {
    let cap = CAPACITY.load(Ordering::Relaxed);
    // (seq, thread, taken index, record index, the record's `FreeCompleted`)
    let mut order: Vec<(u64, u32, usize, usize, bool)> = Vec::new();
    for (ti, t) in taken.iter().enumerate() {
        for (ri, r) in t.recs.iter().enumerate() {
            order.push((r.seq, t.thread, ti, ri, false));
            if r.completed {
                order.push((r.seq + 1, t.thread, ti, ri, true));
            }
        }
    }
    order.sort_unstable_by_key(|o| o.0);
    let kept_from = order.len().saturating_sub(cap);
    let order = &order[kept_from..];
    let mut events = Vec::with_capacity(order.len());
    for (i, &(seq, thread, ti, ri, second)) in order.iter().enumerate() {
        let t = &taken[ti];
        let r = &t.recs[ri];
        let action = match r.action {
            _ if second => Action::FreeCompleted,
            Code::Failure => Action::Failure(Cow::Owned(
                t.msgs
                    .iter()
                    .find(|m| m.seq == seq)
                    .map_or_else(|| "allocation failed".to_owned(), |m| m.text().to_owned()),
            )),
            code => code.action(),
        };
        let mut e = Event::new(action, r.addr, r.size);
        e.seq = i as u64;
        e.time_ns = clock.ns(r.ticks);
        e.thread = thread;
        e.allocator = r.allocator;
        e.given = r.given;
        e.align = r.align;
        e.stream = r.stream;
        if let Some(stack) = t.frames.get(ri).filter(|_| !second) {
            e.frames = resolve(stack);
        }
        events.push(e);
    }
    Trace {
        dropped: offered.saturating_sub(events.len() as u64),
        allocators,
        events,
    }
}

#[cfg(all(feature = "backtrace", not(loom)))]
fn resolve(stack: &Stack) -> Vec<Frame> {
    sites::resolve(&stack.ips[..stack.depth])
}

#[cfg(not(all(feature = "backtrace", not(loom))))]
fn resolve(_stack: &Stack) -> Vec<Frame> {
    Vec::new()
}

// ---- allocators -----------------------------------------------------------------------

/// An allocator's place in the session's [`Trace::allocators`], kept in the allocator
/// (a pool's shared state, a `Traced`): registered by its first event of a session (the
/// one time it takes [`CONTROL`]), read with one Acquire load afterwards.
pub(crate) struct Tag {
    /// `(session as u32) << 32 | index`; 0: not registered (sessions count from 1).
    id: AtomicU64,
    /// A name given by the allocator's owner (the handles name their pools
    /// `PinnedAlloc`, ...), in place of the allocator's own.
    name: OnceLock<&'static str>,
    /// A name fixed at construction (`Traced::named`), before every other.
    fixed: Option<&'static str>,
    /// The allocator's own name (`Pool<HostSource>`), made at registration.
    default_name: fn() -> String,
    /// A device allocator's own name, made from its device (`DevicePool(0)`), before
    /// `default_name`.
    device_name: Option<fn(u32) -> String>,
    memory: TraceMemory,
    device: u32,
}

impl core::fmt::Debug for Tag {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Tag").field("name", &self.name.get()).finish()
    }
}

/// What an event says, besides who and when.
#[derive(Clone, Copy)]
pub(crate) struct Note<'a> {
    pub(crate) action: Code,
    pub(crate) addr: usize,
    pub(crate) size: usize,
    pub(crate) given: usize,
    pub(crate) align: usize,
    pub(crate) stream: u64,
    /// A failure's reason.
    pub(crate) error: Option<&'a dyn fmt::Display>,
}

impl<'a> Note<'a> {
    /// An event of `action` on `size` bytes at `addr` (given = size, align 1, no stream).
    pub(crate) fn new(action: Code, addr: usize, size: usize) -> Self {
        Self {
            action,
            addr,
            size,
            given: size,
            align: 1,
            stream: 0,
            error: None,
        }
    }
}

impl Default for Tag {
    fn default() -> Self {
        Self::new(|| "?".to_owned())
    }
}

impl Tag {
    /// A host allocator's tag, named by `default_name` unless its owner renames it.
    pub(crate) const fn new(default_name: fn() -> String) -> Self {
        Self::with_memory(default_name, TraceMemory::Host, 0)
    }

    /// A tag for memory of `memory` kind on `device`.
    pub(crate) const fn with_memory(default_name: fn() -> String, memory: TraceMemory, device: u32) -> Self {
        Self {
            id: AtomicU64::new(0),
            name: OnceLock::new(),
            fixed: None,
            default_name,
            device_name: None,
            memory,
            device,
        }
    }

    /// A device allocator's tag on device `device`, named `name(device)` unless its
    /// owner renames it.
    pub(crate) const fn for_device(name: fn(u32) -> String, device: u32) -> Self {
        fn unnamed() -> String {
            "?".to_owned()
        }
        let mut t = Self::with_memory(unnamed, TraceMemory::Device, device);
        t.device_name = Some(name);
        t
    }

    /// A host allocator's tag named `name`.
    pub(crate) const fn named(name: &'static str, default_name: fn() -> String) -> Self {
        let mut t = Self::new(default_name);
        t.fixed = Some(name);
        t
    }

    fn describe(&self) -> TracedAllocator {
        let name = match self.fixed.or_else(|| self.name.get().copied()) {
            Some(n) => n.to_owned(),
            None => match self.device_name {
                Some(f) => f(self.device),
                None => (self.default_name)(),
            },
        };
        TracedAllocator::new(name, self.memory, self.device)
    }

    /// Names the allocator in traces (first name wins).
    pub(crate) fn set_name(&self, name: &'static str) {
        let _ = self.name.set(name);
    }

    /// Records any event (the device pools' hook: streams, maps and unmaps).
    #[inline(always)]
    pub(crate) fn event<'a>(&self, note: impl FnOnce() -> Note<'a>) {
        if on() {
            self.event_cold(&note());
        }
    }

    #[cold]
    #[inline(never)]
    fn event_cold(&self, note: &Note<'_>) {
        self.record(note);
        // An out-of-memory event writes the `CUDALLOC_TRACE` file at once.
        if note.action == Code::OutOfMemory {
            env::on_out_of_memory();
        }
    }

    /// An allocation that returned `block` for `layout` (nothing for a zero size).
    #[inline(always)]
    pub(crate) fn alloc(&self, addr: *const u8, layout: Layout, given: usize) {
        if on() {
            self.alloc_cold(addr, layout, given);
        }
    }

    /// An allocation of `layout` that failed with `error`.
    #[inline(always)]
    pub(crate) fn failure(&self, layout: Layout, error: &impl Failure) {
        if on() {
            self.failure_cold(layout, error, error.out_of_memory());
        }
    }

    /// The result of an allocation of `layout`, recorded (an [`alloc`](Self::alloc) or a
    /// [`failure`](Self::failure)) and passed on. By value: a hook that borrows the result
    /// keeps it out of registers, which cost the pool's hit pair 6 ns (measured).
    #[inline(always)]
    pub(crate) fn allocated<E: Failure>(
        &self,
        layout: Layout,
        result: core::result::Result<core::ptr::NonNull<[u8]>, E>,
    ) -> core::result::Result<core::ptr::NonNull<[u8]>, E> {
        match result {
            Ok(block) => {
                self.alloc(block.cast::<u8>().as_ptr(), layout, block.len());
                Ok(block)
            }
            Err(e) => {
                self.failure(layout, &e);
                Err(e)
            }
        }
    }

    /// The owner freed the block at `addr` (`size` bytes); with `completed`, it is
    /// reusable at once (no GPU use to wait for), which a second event records.
    #[inline(always)]
    pub(crate) fn free(&self, addr: *const u8, size: usize, completed: bool) {
        if on() {
            self.free_cold(addr as usize, size, completed);
        }
    }

    /// A device buffer of `size` bytes at `addr` on stream `stream` was dropped; with
    /// `completed`, the block is reusable at once (by later work on the same stream),
    /// which a second event records.
    #[inline(always)]
    pub(crate) fn device_free(&self, addr: u64, size: usize, stream: u64, completed: bool) {
        if on() {
            self.device_free_cold(addr, size, stream, completed);
        }
    }

    #[cold]
    #[inline(never)]
    fn device_free_cold(&self, addr: u64, size: usize, stream: u64, completed: bool) {
        if addr == 0 || size == 0 {
            return; // an empty buffer
        }
        let mut n = Note::new(Code::FreeRequested, addr as usize, size);
        n.stream = stream;
        self.record_then(&n, completed);
    }

    /// A freed block became reusable (its recorded GPU uses completed).
    #[inline(always)]
    pub(crate) fn free_completed(&self, addr: usize, size: usize) {
        if on() {
            self.record(&Note::new(Code::FreeCompleted, addr, size));
        }
    }

    /// Memory taken from or given back to the source (`SegmentAlloc`, `SegmentFree`,
    /// `SegmentMap`, `SegmentUnmap`), or a trim of `size` bytes (`Trim`).
    #[inline(always)]
    pub(crate) fn segment(&self, action: Code, addr: usize, size: usize) {
        if on() {
            self.record(&Note::new(action, addr, size));
        }
    }

    /// A block moved or resized in place: the old block freed, then the new one
    /// allocated (for an in-place resize, at the same address). Call it where the old
    /// block is no longer the caller's and the new one not yet handed out.
    #[inline(always)]
    pub(crate) fn resized(&self, old: (*const u8, Layout), new: (*const u8, Layout, usize)) {
        if on() {
            self.free_cold(old.0 as usize, old.1.size(), true);
            self.alloc_cold(new.0, new.1, new.2);
        }
    }

    #[cold]
    #[inline(never)]
    fn alloc_cold(&self, addr: *const u8, layout: Layout, given: usize) {
        if layout.size() == 0 {
            return;
        }
        let mut n = Note::new(Code::Alloc, addr as usize, layout.size());
        n.given = given;
        n.align = layout.align();
        self.record(&n);
    }

    #[cold]
    #[inline(never)]
    fn failure_cold(&self, layout: Layout, error: &dyn fmt::Display, out_of_memory: bool) {
        let mut n = Note::new(Code::Failure, 0, layout.size());
        n.align = layout.align();
        n.given = 0;
        n.error = Some(error);
        self.record(&n);
        if out_of_memory {
            env::on_out_of_memory();
        }
    }

    #[cold]
    #[inline(never)]
    fn free_cold(&self, addr: usize, size: usize, completed: bool) {
        if size == 0 {
            return;
        }
        self.record_then(&Note::new(Code::FreeRequested, addr, size), completed);
    }

    /// The index of this allocator in the session's `state` (registering it), or `None`
    /// when the recording stopped meanwhile.
    fn index(&self, state: u64) -> Option<u32> {
        let session = session_of(state) as u32 as u64;
        let id = self.id.load(Ordering::Acquire);
        if id >> 32 == session && id != 0 {
            return Some(id as u32);
        }
        self.register(state)
    }

    #[cold]
    #[inline(never)]
    fn register(&self, state: u64) -> Option<u32> {
        let session = session_of(state) as u32 as u64;
        // Outside the lock: describing may allocate (a name).
        let entry = self.describe();
        let mut ctl = lock(&CONTROL);
        if STATE.load(Ordering::Relaxed) != state {
            return None;
        }
        let id = self.id.load(Ordering::Relaxed);
        if id >> 32 == session && id != 0 {
            return Some(id as u32);
        }
        let index = u32::try_from(ctl.allocators.len()).ok()?;
        ctl.allocators.try_reserve(1).ok()?;
        ctl.allocators.push(entry);
        self.id
            .store((session << 32) | u64::from(index), Ordering::Release);
        Some(index)
    }

    /// Writes one event into this thread's buffer.
    #[inline(always)]
    fn record(&self, note: &Note<'_>) {
        self.record_then(note, false);
    }

    /// Writes the event of `note` into this thread's buffer and, with `completed` (a
    /// free whose block is reusable at once), its `FreeCompleted` right after it, at the
    /// same time: the two under one entry into the recorder, one read-modify-write (one
    /// step of the global order) and one record in the ring ([`Rec::completed`]): a pool
    /// hit pair's three events cost two of each.
    #[cold]
    #[inline(never)]
    fn record_then(&self, note: &Note<'_>, completed: bool) {
        let Some(_inside) = Inside::enter() else {
            return;
        };
        let state = STATE.load(Ordering::Acquire);
        if state & ENV_PENDING != 0 {
            env::read_once();
            return self.record_inside(note, completed, STATE.load(Ordering::Acquire));
        }
        self.record_inside(note, completed, state);
    }

    #[inline(always)]
    fn record_inside(&self, note: &Note<'_>, completed: bool, state: u64) {
        if state & ON == 0 {
            return;
        }
        let Some(allocator) = self.index(state) else {
            return;
        };
        let stack = capture(note.action);
        let Some(buf) = my_buffer() else {
            return;
        };
        let Some((_writing, seq)) = buf.enter(state, 1 + u64::from(completed)) else {
            return;
        };
        // SAFETY: between `enter` and the drop of `_writing` only this thread, the
        // buffer's owner, reaches the data (`collect` waits for the flag).
        let d = unsafe { &mut *buf.data.get() };
        let session = session_of(state);
        if d.session != session {
            d.begin(session);
        }
        let rec = Rec {
            seq,
            ticks: ticks(),
            addr: note.addr as u64,
            size: note.size as u64,
            given: note.given as u64,
            align: note.align as u64,
            stream: note.stream,
            allocator,
            action: note.action,
            completed,
        };
        d.push(rec, stack.as_ref(), note.error);
    }
}

/// An allocation error as the recorder sees it: its message, and whether it means the
/// memory ran out (which writes the `CUDALLOC_TRACE` file at once).
pub(crate) trait Failure: fmt::Display {
    fn out_of_memory(&self) -> bool;
}

impl Failure for Error {
    fn out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } | Error::LimitExceeded { .. } | Error::DeviceOutOfMemory { .. } => true,
            Error::Cuda(c) => c.is_out_of_memory(),
            _ => false,
        }
    }
}

impl<T: Failure + ?Sized> Failure for &T {
    fn out_of_memory(&self) -> bool {
        (**self).out_of_memory()
    }
}

/// What `Allocator` and `GlobalAlloc` failures say: nothing but that memory ran out.
impl Failure for allocator_api2::alloc::AllocError {
    fn out_of_memory(&self) -> bool {
        true
    }
}

/// `Kind<S>`, `S` without its module path: `pool_name::<HostSource>` gives
/// `Pool<HostSource>`.
pub(crate) fn pool_name<S>() -> String {
    format!("Pool<{}>", short_type_name::<S>())
}

/// `Arena<S>`.
pub(crate) fn arena_name<S>() -> String {
    format!("Arena<{}>", short_type_name::<S>())
}

/// The name of the process-wide pinned pool of `cuMemHostAlloc` flags `bits`.
pub(crate) fn pinned_name(bits: u32) -> &'static str {
    const NAMES: [&str; 8] = [
        "PinnedAlloc",
        "PinnedAlloc(PORTABLE)",
        "PinnedAlloc(DEVICE_MAP)",
        "PinnedAlloc(PORTABLE|DEVICE_MAP)",
        "PinnedAlloc(WRITE_COMBINED)",
        "PinnedAlloc(PORTABLE|WRITE_COMBINED)",
        "PinnedAlloc(DEVICE_MAP|WRITE_COMBINED)",
        "PinnedAlloc(PORTABLE|DEVICE_MAP|WRITE_COMBINED)",
    ];
    NAMES[(bits & 7) as usize]
}

fn pinned_fallback_name() -> String {
    "PinnedAlloc(fallback)".to_owned()
}

fn managed_fallback_name() -> String {
    "ManagedAlloc(fallback)".to_owned()
}

/// The tag of the handles' no-driver fallback of `kind` (`"pinned"`, `"managed"`).
pub(crate) fn fallback(kind: &str) -> &'static Tag {
    static PINNED: Tag = Tag::new(pinned_fallback_name);
    static MANAGED: Tag = Tag::new(managed_fallback_name);
    if kind == "managed" {
        &MANAGED
    } else {
        &PINNED
    }
}

/// The tag of every `Direct` over memory of `kind` (a `Direct` is `Copy` and has no
/// room for one of its own): `Direct(pageable)`, `Direct(pinned)`, `Direct(registered)`,
/// `Direct(managed)`, `Direct(device)`.
pub(crate) fn direct(kind: crate::cuda::MemoryType) -> &'static Tag {
    use crate::cuda::MemoryType;
    fn unnamed() -> String {
        "Direct".to_owned()
    }
    static TAGS: [Tag; 5] = [
        Tag::named("Direct(pageable)", unnamed),
        Tag::named("Direct(pinned)", unnamed),
        Tag::named("Direct(registered)", unnamed),
        Tag::named("Direct(managed)", unnamed),
        Tag::named("Direct(device)", unnamed),
    ];
    match kind {
        MemoryType::Pageable => &TAGS[0],
        MemoryType::PinnedHost => &TAGS[1],
        MemoryType::Registered => &TAGS[2],
        MemoryType::Managed => &TAGS[3],
        MemoryType::Device => &TAGS[4],
    }
}

/// A type's name without module paths: `Pool<cudalloc::source::host::HostSource>` gives
/// `Pool<HostSource>`.
pub(crate) fn short_type_name<T: ?Sized>() -> String {
    short_name(core::any::type_name::<T>())
}

fn short_name(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut word = String::new();
    for c in full.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
        } else {
            out.push_str(word.rsplit("::").next().unwrap_or(""));
            word.clear();
            out.push(c);
        }
    }
    out.push_str(word.rsplit("::").next().unwrap_or(""));
    out
}

// ---- events as stored -----------------------------------------------------------------

/// An action as a buffer stores it (a failure's message is stored apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Code {
    Alloc,
    FreeRequested,
    FreeCompleted,
    Failure,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    OutOfMemory,
    Trim,
}

impl Code {
    fn action(self) -> Action {
        match self {
            Code::Alloc => Action::Alloc,
            Code::FreeRequested => Action::FreeRequested,
            Code::FreeCompleted => Action::FreeCompleted,
            Code::Failure => Action::Failure(Cow::Borrowed("allocation failed")),
            Code::SegmentAlloc => Action::SegmentAlloc,
            Code::SegmentFree => Action::SegmentFree,
            Code::SegmentMap => Action::SegmentMap,
            Code::SegmentUnmap => Action::SegmentUnmap,
            Code::OutOfMemory => Action::OutOfMemory,
            Code::Trim => Action::Trim,
        }
    }
}

/// One event in a buffer (64 bytes; not aligned to a cache line: `System` grows an
/// over-aligned block by a copy, not in place, which tripled the cost of filling a ring).
#[derive(Clone, Copy)]
struct Rec {
    seq: u64,
    /// When, in [`ticks`].
    ticks: u64,
    addr: u64,
    size: u64,
    given: u64,
    align: u64,
    stream: u64,
    allocator: u32,
    action: Code,
    /// A free followed at once by its `FreeCompleted` (`seq + 1`, the same fields),
    /// which `build` makes of this record: one record written for the two events.
    completed: bool,
}

/// Return addresses of an allocation site, innermost first.
#[cfg_attr(not(all(feature = "backtrace", not(loom))), allow(dead_code))]
#[derive(Clone, Copy)]
struct Stack {
    ips: [usize; FRAMES],
    depth: usize,
}

/// Frames kept per site: the allocator's own (about ten) and enough of the caller's.
const FRAMES: usize = 32;

#[cfg(all(feature = "backtrace", not(loom)))]
fn capture(action: Code) -> Option<Stack> {
    if action != Code::Alloc || !SITES.load(Ordering::Relaxed) {
        return None;
    }
    let mut s = Stack {
        ips: [0; FRAMES],
        depth: 0,
    };
    s.depth = sites::capture(&mut s.ips);
    Some(s)
}

#[cfg(not(all(feature = "backtrace", not(loom))))]
fn capture(_action: Code) -> Option<Stack> {
    None
}

/// A failure's message, formatted into a fixed array (no allocation in the hook).
#[derive(Clone, Copy)]
struct Msg {
    seq: u64,
    len: u8,
    text: [u8; MSG_BYTES],
}

const MSG_BYTES: usize = 200;
/// Failure messages a thread keeps (older ones become "allocation failed").
const MSGS: usize = 64;

impl Msg {
    fn text(&self) -> &str {
        let bytes = &self.text[..usize::from(self.len)];
        // Cut at a character boundary: the formatter stops mid-character when full.
        match core::str::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => core::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or(""),
        }
    }
}

impl fmt::Write for Msg {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let at = usize::from(self.len);
        let n = s.len().min(MSG_BYTES - at);
        self.text[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n as u8;
        Ok(())
    }
}

// ---- per-thread buffers ---------------------------------------------------------------

/// A thread's buffer: a header that lives as long as the process (in a list that only
/// grows; a header is reused by a later thread once its thread exited and its events
/// were collected), its storage from `System`. Aligned as [`Line`]: one thread's stores
/// to its header leave the others' alone.
#[repr(align(128))]
struct ThreadBuf {
    /// The next header in the list (fixed once pushed).
    next: *const ThreadBuf,
    /// Set by the owner (plain stores, no read-modify-write) while it writes `data`.
    writing: AtomicBool,
    /// Held while `collect` reads the buffer or a thread claims it (never per event).
    busy: AtomicBool,
    /// Set while a live thread writes this buffer.
    owned: AtomicBool,
    data: UnsafeCell<BufData>,
}

// SAFETY: `data` is written by its owner between `enter` and the release of `writing`,
// read and written by `collect` only once `HALT` is set and `writing` reads false, and by
// a claiming thread only under `busy` while no thread owns it (see `ThreadBuf::enter`);
// `next` is immutable after the header is published.
unsafe impl Sync for ThreadBuf {}

struct BufData {
    /// The session whose events `recs` holds (0: none).
    session: u64,
    thread: u32,
    /// Events of the session offered to this buffer (stored, overwritten or lost).
    offered: u64,
    /// The session's `CAPACITY`, read once by `begin`.
    cap: usize,
    /// A ring of at most `CAPACITY` events: pushed until full, then overwritten at `head`.
    recs: SysVec<Rec, System>,
    head: usize,
    /// With sites: `frames[i]` is the site of `recs[i]` (a non-allocation has an empty
    /// stack), or shorter when a stack could not be stored.
    frames: SysVec<Stack, System>,
    /// The newest failure messages, a ring of `MSGS` (the oldest at `msg_head` once full).
    msgs: SysVec<Msg, System>,
    msg_head: usize,
}

/// Records of a thread's ring made and faulted in before its first event is stored
/// (4 MiB; fewer if `max_entries` asks for fewer): the page faults of fresh memory, one
/// per 64 events, took the cost of an event while a ring first filled from 40 ns to
/// 55 ns on the H200 machine.
const PREFAULT_RECORDS: usize = 1 << 16;

/// A ring record of zeros: what the prefault writes where it cannot ask the kernel.
const NO_REC: Rec = Rec {
    seq: 0,
    ticks: 0,
    addr: 0,
    size: 0,
    given: 0,
    align: 0,
    stream: 0,
    allocator: 0,
    action: Code::Alloc,
    completed: false,
};

impl BufData {
    fn begin(&mut self, session: u64) {
        self.session = session;
        self.thread = NEXT_THREAD.fetch_add(1, Ordering::Relaxed) as u32;
        self.offered = 0;
        self.cap = CAPACITY.load(Ordering::Relaxed).max(1);
        self.head = 0;
        self.recs.clear();
        self.frames.clear();
        self.msgs.clear();
        self.msg_head = 0;
        // Without the memory the ring grows at its first event (or drops it).
        let _ = self.grow_to(self.cap.min(PREFAULT_RECORDS));
    }

    /// Makes room in the ring for `records` records in all, its fresh memory faulted in
    /// at once (one call into the kernel where it can: cheaper than the fault per page
    /// that the events' stores would take, and outside the events). False when the
    /// memory cannot be had.
    #[cold]
    #[inline(never)]
    fn grow_to(&mut self, records: usize) -> bool {
        let len = self.recs.len();
        if self.recs.capacity() >= records {
            return true;
        }
        if self.recs.try_reserve_exact(records - len).is_err() {
            return false;
        }
        prefault(self.recs.spare_capacity_mut());
        true
    }

    #[inline(always)]
    fn push(&mut self, rec: Rec, stack: Option<&Stack>, error: Option<&dyn fmt::Display>) {
        self.offered += 1 + u64::from(rec.completed);
        let cap = self.cap;
        let len = self.recs.len();
        let i = if len >= cap {
            // Full: overwrite the oldest, at `head`. No `%`: a division per event is tens
            // of cycles of latency on many server CPUs.
            let i = self.head;
            if let Some(slot) = self.recs.get_mut(i) {
                *slot = rec;
            }
            self.head = if i + 1 >= cap { 0 } else { i + 1 };
            i
        } else {
            // With no memory for the event it goes unrecorded (counted as dropped): no
            // abort in an allocator.
            if len == self.recs.capacity() && !self.grow_to(len + len.max(1024).min(cap - len)) {
                return;
            }
            self.recs.push(rec);
            len
        };
        if SITES.load(Ordering::Relaxed) {
            let s = stack.copied().unwrap_or(Stack {
                ips: [0; FRAMES],
                depth: 0,
            });
            if i < self.frames.len() {
                self.frames[i] = s;
            } else if i == self.frames.len() && self.frames.try_reserve(1).is_ok() {
                self.frames.push(s);
            }
        }
        if let Some(error) = error {
            let mut m = Msg {
                seq: rec.seq,
                len: 0,
                text: [0; MSG_BYTES],
            };
            let _ = write!(m, "{error}");
            if self.msgs.len() < MSGS {
                if self.msgs.try_reserve(1).is_ok() {
                    self.msgs.push(m);
                }
            } else {
                self.msgs[self.msg_head] = m;
                self.msg_head = (self.msg_head + 1) % MSGS;
            }
        }
    }
}

/// Faults in the pages of `spare`, ring memory no record uses yet: with
/// `MADV_POPULATE_WRITE` (Linux 5.14 and later) for the pages wholly inside it, else by
/// writing a record of zeros every page.
fn prefault(spare: &mut [core::mem::MaybeUninit<Rec>]) {
    const PAGE: usize = crate::util::PAGE_SIZE;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let start = spare.as_mut_ptr() as usize;
        let end = start + core::mem::size_of_val(spare);
        let (first, last) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
        if last > first {
            // SAFETY: `first..last` is whole pages inside `spare`, memory this thread owns
            // and nothing reads; populating maps them writable and changes no byte.
            let done = unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_POPULATE_WRITE,
                )
            } == 0;
            if done {
                return;
            }
        }
    }
    for slot in spare.iter_mut().step_by(PAGE / core::mem::size_of::<Rec>()) {
        slot.write(NO_REC);
    }
}

impl ThreadBuf {
    /// Starts writing one call's `events` events into the buffer, for the recording of
    /// `state`: the first event's place in the global order, and the guard whose drop
    /// ends the write; `None` if `stop` ended the recording (the events go unrecorded).
    ///
    /// The protocol, with one read-modify-write per call: the owner stores `writing`
    /// (a plain store), then takes its `fetch_add` on [`SEQ`] (a release: it carries
    /// the store); `collect` sets [`HALT`] with its own read-modify-write (an acquire),
    /// then waits for each buffer's `writing` to read false. Read-modify-writes of `SEQ`
    /// are totally ordered: a writer before `collect`'s sees no `HALT` and its `writing`
    /// store is visible to `collect`, which waits for the event; a writer after it sees
    /// `HALT` and leaves the data alone. A halt of `stop` changes `STATE` first: the
    /// writer drops the event; the out-of-memory dump's does not: the writer waits for
    /// the dump to read the buffers, then takes a new place.
    #[inline(always)]
    fn enter(&self, state: u64, events: u64) -> Option<(Writing<'_>, u64)> {
        loop {
            self.writing.store(true, Ordering::Relaxed);
            let seq = SEQ.fetch_add(events, Ordering::AcqRel);
            if seq & HALT == 0 && STATE.load(Ordering::Relaxed) == state {
                return Some((Writing(self), seq));
            }
            self.writing.store(false, Ordering::Release);
            self.wait_halted(state)?;
        }
    }

    /// Waits while `collect` reads the buffers of the recording `state`; `None` once
    /// that recording ended.
    #[cold]
    #[inline(never)]
    fn wait_halted(&self, state: u64) -> Option<()> {
        while SEQ.load(Ordering::Relaxed) & HALT != 0 && STATE.load(Ordering::Relaxed) == state {
            core::hint::spin_loop();
        }
        (STATE.load(Ordering::Relaxed) == state).then_some(())
    }

    /// Holds the flag (spinning: the other holder writes one event, or moves storage).
    fn hold(&self) -> Held<'_> {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            core::hint::spin_loop();
        }
        Held(self)
    }
}

struct Held<'a>(&'a ThreadBuf);

/// The owner is writing its buffer (see [`ThreadBuf::enter`]).
struct Writing<'a>(&'a ThreadBuf);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        // Release: `collect`, reading false, sees the event's stores.
        self.0.writing.store(false, Ordering::Release);
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// The head of the list of headers (a `*const ThreadBuf`, exposed).
static BUFFERS: AtomicUsize = AtomicUsize::new(0);

fn buffers() -> impl Iterator<Item = &'static ThreadBuf> {
    let head = BUFFERS.load(Ordering::Acquire);
    let mut p: *const ThreadBuf = core::ptr::with_exposed_provenance(head);
    core::iter::from_fn(move || {
        // SAFETY: headers are never freed; `next` was written before the header was
        // published (Release in `publish`, Acquire above).
        let buf = unsafe { p.as_ref()? };
        p = buf.next;
        Some(buf)
    })
}

std::thread_local! {
    /// The recorder is running on this thread: what it allocates is not recorded.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// This thread's buffer (null: none yet).
    static MINE: Cell<*const ThreadBuf> = const { Cell::new(core::ptr::null()) };
    /// Gives this thread's buffer up when the thread exits.
    static OWNER: Owner = const { Owner(Cell::new(core::ptr::null())) };
}

/// The reentrancy guard: set while this thread is inside the recorder.
pub(crate) struct Inside(());

impl Inside {
    /// Enters the recorder; `None` if this thread is inside already (or its
    /// thread-locals are gone).
    pub(crate) fn enter() -> Option<Inside> {
        INSIDE
            .try_with(|i| (!i.replace(true)).then(|| Inside(())))
            .ok()
            .flatten()
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|i| i.set(false));
    }
}

struct Owner(Cell<*const ThreadBuf>);

impl Drop for Owner {
    fn drop(&mut self) {
        let p = self.0.replace(core::ptr::null());
        let _ = MINE.try_with(|m| m.set(core::ptr::null()));
        // SAFETY: headers are never freed.
        if let Some(buf) = unsafe { p.as_ref() } {
            buf.owned.store(false, Ordering::Release);
        }
    }
}

/// This thread's buffer, claiming or making one on its first event.
fn my_buffer() -> Option<&'static ThreadBuf> {
    let p = MINE.try_with(Cell::get).ok()?;
    // SAFETY: headers are never freed.
    if let Some(buf) = unsafe { p.as_ref() } {
        return Some(buf);
    }
    claim_buffer()
}

#[cold]
#[inline(never)]
fn claim_buffer() -> Option<&'static ThreadBuf> {
    let session = session_of(STATE.load(Ordering::Relaxed));
    let found = buffers().find(|b| {
        if b.owned
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let _held = b.hold();
        // SAFETY: the flag is held.
        let d = unsafe { &*b.data.get() };
        // A header still holding this session's events of an exited thread waits for
        // `stop`: reusing it would merge two threads.
        if d.session == session && d.offered != 0 {
            b.owned.store(false, Ordering::Release);
            return false;
        }
        true
    });
    let buf = match found {
        Some(b) => b,
        None => publish()?,
    };
    // Registering the destructor may allocate: this thread is inside the recorder, so
    // that allocation is not recorded.
    if OWNER.try_with(|o| o.0.set(buf)).is_err() {
        buf.owned.store(false, Ordering::Release);
        return None;
    }
    MINE.try_with(|m| m.set(buf)).ok()?;
    Some(buf)
}

/// A new header, owned by the calling thread, pushed onto the list.
fn publish() -> Option<&'static ThreadBuf> {
    let header = SysBox::try_new_in(
        ThreadBuf {
            next: core::ptr::null(),
            writing: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            owned: AtomicBool::new(true),
            data: UnsafeCell::new(BufData {
                session: 0,
                thread: 0,
                offered: 0,
                cap: 1,
                recs: SysVec::new_in(System),
                head: 0,
                frames: SysVec::new_in(System),
                msgs: SysVec::new_in(System),
                msg_head: 0,
            }),
        },
        System,
    )
    .ok()?;
    let p = SysBox::into_raw(header);
    let mut head = BUFFERS.load(Ordering::Relaxed);
    loop {
        // SAFETY: `p` is ours until published.
        unsafe { (*p).next = core::ptr::with_exposed_provenance(head) };
        match BUFFERS.compare_exchange_weak(head, p.expose_provenance(), Ordering::Release, Ordering::Relaxed)
        {
            Ok(_) => break,
            Err(now) => head = now,
        }
    }
    // SAFETY: published headers are never freed.
    Some(unsafe { &*p })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn short_names_drop_module_paths() {
        assert_eq!(
            short_name("cudalloc::pool::Pool<cudalloc::source::host::HostSource>"),
            "Pool<HostSource>"
        );
        assert_eq!(short_name("&bumpalo::Bump"), "&Bump");
        assert_eq!(short_name("std::alloc::System"), "System");
        assert_eq!(short_name("(a::B, [c::D; 3])"), "(B, [D; 3])");
    }

    #[test]
    fn failure_messages_are_cut_at_a_character() {
        let mut m = Msg {
            seq: 0,
            len: 0,
            text: [0; MSG_BYTES],
        };
        let long = "é".repeat(150);
        let _ = write!(m, "{long}");
        assert_eq!(usize::from(m.len), MSG_BYTES);
        assert_eq!(m.text().chars().count(), MSG_BYTES / 2);
    }
}
