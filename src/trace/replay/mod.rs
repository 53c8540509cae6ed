//! Replay: a trace's allocations and frees run again against an allocator, timed, with
//! the memory it held and reserved.
//!
//! The scheme is RMM's (`REPLAY_BENCH`), with streams kept: one replay thread per
//! recorded thread runs that thread's events in their recorded order, and a global
//! sequence makes every event wait for the one before it in the trace, so the allocator
//! sees the recorded interleaving, on the recorded threads. Recorded addresses map to the
//! replayed blocks; device traces get one real stream per recorded stream (RMM replays
//! every stream on the default one).
//!
//! ```
//! use cudalloc::trace::replay::{self, HostTarget, ReplayOptions};
//! use cudalloc::trace::{Action, Event, Trace};
//!
//! let mut t = Trace::default();
//! t.events.push(Event::new(Action::Alloc, 0x1000, 100));
//! t.events.push(Event::new(Action::Alloc, 0x2000, 200));
//! t.events.push(Event::new(Action::FreeRequested, 0x1000, 100));
//! let target = HostTarget::new("Global", allocator_api2::alloc::Global);
//! let r = replay::replay(&t, target, &ReplayOptions::default()).unwrap();
//! assert_eq!((r.allocations, r.frees, r.failures), (2, 1, 0));
//! assert_eq!(r.peak_requested, 300);
//! assert_eq!((r.never_freed_blocks, r.never_freed_bytes), (1, 200));
//! ```
//!
//! What is replayed: allocations ([`Action::Alloc`], with their size and alignment) and
//! frees requested ([`Action::FreeRequested`]). Recorded failures are counted
//! ([`ReplayReport::recorded_failures`]) but not retried; frees completed, segment,
//! out-of-memory and trim events describe what the recorded allocator did, not what the
//! program asked for, and are ignored.

mod targets;
mod workload;

#[cfg(any(test, feature = "sim"))]
pub use targets::SimTarget;
pub use targets::{targets, DevicePoolTarget, HostTarget, Target};
pub use workload::{random_workload, RandomWorkload};

use std::collections::HashMap;
use std::time::Instant;

use super::format::{Location, TraceError};
use super::{Action, Trace};
use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

/// How to read a trace for replay.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// Skip bad events (a free of an unknown pointer, a double free, a size beyond
    /// memory) and count them, instead of failing on the first.
    pub lenient: bool,
    /// Replay only the events of this allocator of the trace (`None`: all of them, as one
    /// allocator's).
    pub allocator: Option<u32>,
    /// The largest block a trace may ask for; larger is bad input ("beyond memory").
    pub max_block_bytes: u64,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            lenient: false,
            allocator: None,
            max_block_bytes: 1 << 47,
        }
    }
}

impl ReplayOptions {
    /// These options, lenient or not.
    ///
    /// ```
    /// assert!(cudalloc::trace::replay::ReplayOptions::default().with_lenient(true).lenient);
    /// ```
    pub fn with_lenient(mut self, lenient: bool) -> Self {
        self.lenient = lenient;
        self
    }

    /// These options, for one allocator of the trace.
    pub fn with_allocator(mut self, allocator: Option<u32>) -> Self {
        self.allocator = allocator;
        self
    }

    /// These options, with a bound on the size of one block.
    pub fn with_max_block_bytes(mut self, bytes: u64) -> Self {
        self.max_block_bytes = bytes;
        self
    }
}

/// One replayed operation.
#[derive(Clone, Copy, Debug)]
struct Op {
    free: bool,
    slot: u32,
    size: u64,
    align: u64,
    stream: u32,
}

/// A trace checked and prepared for replay: its operations per thread, recorded
/// addresses turned into block slots. Build it once, replay it on many targets.
///
/// ```
/// use cudalloc::trace::replay::{Plan, ReplayOptions};
/// use cudalloc::trace::{Action, Event, Trace};
/// let mut t = Trace::default();
/// t.events.push(Event::new(Action::FreeRequested, 0x1000, 8));
/// let e = Plan::new(&t, &ReplayOptions::default()).unwrap_err();
/// assert_eq!(e.to_string(), "event 0: free of 0x1000, which the trace never allocated");
/// let lenient = Plan::new(&t, &ReplayOptions::default().with_lenient(true)).unwrap();
/// assert_eq!(lenient.skipped().len(), 1);
/// ```
#[derive(Debug)]
pub struct Plan {
    ops: Vec<Op>,
    /// Indices into `ops`, per replay thread, in order.
    per_thread: Vec<Vec<u32>>,
    slots: usize,
    streams: usize,
    /// Slots the trace never frees: (slot, size).
    never_freed: Vec<(u32, u64)>,
    skipped: Vec<TraceError>,
    recorded_failures: u64,
    ignored: u64,
}

impl Plan {
    /// Checks `trace` and prepares it. Bad events are errors naming the event (or, with
    /// [`ReplayOptions::lenient`], skipped and listed in [`Plan::skipped`]).
    pub fn new(trace: &Trace, opts: &ReplayOptions) -> Result<Self, TraceError> {
        let mut plan = Plan {
            ops: Vec::with_capacity(trace.events.len()),
            per_thread: Vec::new(),
            slots: 0,
            streams: 0,
            never_freed: Vec::new(),
            skipped: Vec::new(),
            recorded_failures: 0,
            ignored: 0,
        };
        // (allocator, address) -> (slot, size, event) of the live block there.
        let mut live: HashMap<(u32, u64), (u32, u64, usize)> = HashMap::new();
        // (allocator, address) -> the event that last freed a block there.
        let mut freed: HashMap<(u32, u64), usize> = HashMap::new();
        let mut threads: HashMap<u32, usize> = HashMap::new();
        let mut streams: HashMap<u64, u32> = HashMap::new();
        let mut sizes: Vec<u64> = Vec::new();
        for (i, e) in trace.events.iter().enumerate() {
            if opts.allocator.is_some_and(|a| a != e.allocator) {
                continue;
            }
            let key = (e.allocator, e.addr);
            let op = match e.action {
                Action::Alloc => {
                    let align = e.align.max(1);
                    let bad = if e.size > opts.max_block_bytes {
                        Some(format!(
                            "allocation of {} bytes, beyond memory (at most {} bytes a block)",
                            e.size, opts.max_block_bytes
                        ))
                    } else if !align.is_power_of_two() || align > 1 << 30 {
                        Some(format!("alignment {align} is not a power of two up to 1 GiB"))
                    } else if let Some(&(_, _, at)) = live.get(&key) {
                        Some(format!(
                            "allocation at {:#x}, which event {at} allocated and the trace has not freed",
                            e.addr
                        ))
                    } else {
                        None
                    };
                    if let Some(msg) = bad {
                        plan.reject(TraceError::new(Location::Event(i as u64), msg), opts.lenient)?;
                        continue;
                    }
                    let slot = plan.slots as u32;
                    plan.slots += 1;
                    sizes.push(e.size);
                    live.insert(key, (slot, e.size, i));
                    freed.remove(&key);
                    Op {
                        free: false,
                        slot,
                        size: e.size,
                        align,
                        stream: 0,
                    }
                }
                Action::FreeRequested => match live.remove(&key) {
                    Some((slot, size, _)) => {
                        freed.insert(key, i);
                        Op {
                            free: true,
                            slot,
                            size,
                            align: 1,
                            stream: 0,
                        }
                    }
                    None => {
                        let msg = match freed.get(&key) {
                            Some(at) => format!("double free of {:#x} (event {at} freed it)", e.addr),
                            None => format!("free of {:#x}, which the trace never allocated", e.addr),
                        };
                        plan.reject(TraceError::new(Location::Event(i as u64), msg), opts.lenient)?;
                        continue;
                    }
                },
                Action::Failure(_) => {
                    plan.recorded_failures += 1;
                    continue;
                }
                _ => {
                    plan.ignored += 1;
                    continue;
                }
            };
            let next = streams.len() as u32;
            let stream = *streams.entry(e.stream).or_insert(next);
            let next = threads.len();
            let t = *threads.entry(e.thread).or_insert(next);
            if t == plan.per_thread.len() {
                plan.per_thread.push(Vec::new());
            }
            plan.per_thread[t].push(plan.ops.len() as u32);
            plan.ops.push(Op { stream, ..op });
        }
        plan.streams = streams.len();
        plan.never_freed = live.values().map(|&(slot, size, _)| (slot, size)).collect();
        plan.never_freed.sort_unstable();
        Ok(plan)
    }

    fn reject(&mut self, e: TraceError, lenient: bool) -> Result<(), TraceError> {
        if lenient {
            self.skipped.push(e);
            Ok(())
        } else {
            Err(e)
        }
    }

    /// The bad events skipped (lenient plans only).
    pub fn skipped(&self) -> &[TraceError] {
        &self.skipped
    }

    /// The operations replayed (allocations and frees).
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether nothing is replayed.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The replay threads (one per recorded thread with allocations or frees).
    pub fn threads(&self) -> usize {
        self.per_thread.len()
    }

    /// The distinct streams of the replayed events.
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// The peak of the bytes the trace asks for at once (what a replay reports as
    /// [`ReplayReport::peak_requested`] when no allocation fails).
    ///
    /// Saturates at `u64::MAX` (a trace whose live blocks pass 16 EiB), as the replay's does.
    pub fn peak_requested(&self) -> u64 {
        let (mut now, mut peak) = (0u64, 0u64);
        for op in &self.ops {
            if op.free {
                now = now.saturating_sub(op.size);
            } else {
                now = now.saturating_add(op.size);
                peak = peak.max(now);
            }
        }
        peak
    }

    /// Replays the plan on `target`.
    pub fn replay<T: ReplayTarget>(&self, mut target: T) -> Result<ReplayReport, String> {
        target.prepare(self.streams.max(1))?;
        let slots: Vec<Mutex<Option<T::Block>>> = (0..self.slots).map(|_| Mutex::new(None)).collect();
        let given: Vec<AtomicU64> = (0..self.slots).map(|_| AtomicU64::new(0)).collect();
        let shared = Shared {
            next: AtomicUsize::new(0),
            requested: AtomicU64::new(0),
            peak_requested: AtomicU64::new(0),
            held: AtomicU64::new(0),
            peak_held: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            first_failure: Mutex::new(None),
            aborted: AtomicBool::new(false),
        };
        let t0 = Instant::now();
        // Always on threads of their own, even for one: a target that panics ends the
        // replay with an error, whatever the number of threads.
        let times: Vec<Times> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .per_thread
                .iter()
                .map(|ops| {
                    let (target, slots, given, shared) = (&target, &slots, &given, &shared);
                    s.spawn(move || self.run_thread(target, ops, slots, given, shared))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        if shared.aborted.load(Ordering::Relaxed) {
            return Err(format!(
                "{}: the allocator panicked during the replay",
                target.name()
            ));
        }
        target.settle();
        let total_ns = t0.elapsed().as_nanos() as u64;
        let peak_reserved = target.peak_reserved();
        // Blocks the trace never frees: reported, then freed outside the timed run.
        let (mut never_freed_blocks, mut never_freed_bytes) = (0, 0u64);
        for &(slot, size) in &self.never_freed {
            if let Some(b) = crate::sync::lock(&slots[slot as usize]).take() {
                never_freed_blocks += 1;
                never_freed_bytes = never_freed_bytes.saturating_add(size);
                // SAFETY: `b` came from this target's `alloc` and is freed once (taken).
                unsafe { target.free(b, 0) };
            }
        }
        let mut allocs: Vec<u64> = Vec::new();
        let mut frees: Vec<u64> = Vec::new();
        for t in times {
            allocs.extend(t.allocs);
            frees.extend(t.frees);
        }
        let (alloc_median_ns, alloc_p99_ns) = percentiles(&mut allocs);
        let (free_median_ns, free_p99_ns) = percentiles(&mut frees);
        let first_failure = crate::sync::lock(&shared.first_failure).take();
        Ok(ReplayReport {
            allocator: target.name(),
            note: target.note(),
            threads: self.per_thread.len(),
            streams: self.streams,
            allocations: allocs.len() as u64,
            frees: frees.len() as u64,
            failures: shared.failures.load(Ordering::Relaxed),
            first_failure,
            skipped: self.skipped.len() as u64,
            recorded_failures: self.recorded_failures,
            ignored: self.ignored,
            total_ns,
            alloc_median_ns,
            alloc_p99_ns,
            free_median_ns,
            free_p99_ns,
            peak_requested: shared.peak_requested.load(Ordering::Relaxed),
            peak_held: shared.peak_held.load(Ordering::Relaxed),
            peak_reserved,
            never_freed_blocks,
            never_freed_bytes,
        })
    }

    fn run_thread<T: ReplayTarget>(
        &self,
        target: &T,
        ops: &[u32],
        slots: &[Mutex<Option<T::Block>>],
        given: &[AtomicU64],
        sh: &Shared,
    ) -> Times {
        /// Tells the other replay threads to stop waiting when this one unwinds (a
        /// target that panicked), instead of waiting for its turn forever.
        struct AbortOnUnwind<'a>(&'a AtomicBool);
        impl Drop for AbortOnUnwind<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
        }
        let _guard = AbortOnUnwind(&sh.aborted);
        let mut times = Times::default();
        for &i in ops {
            let op = self.ops[i as usize];
            let mut spins = 0u32;
            while sh.next.load(Ordering::Acquire) != i as usize {
                if sh.aborted.load(Ordering::Relaxed) {
                    return times;
                }
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            let slot = op.slot as usize;
            if op.free {
                let block = crate::sync::lock(&slots[slot]).take();
                if let Some(b) = block {
                    let t = Instant::now();
                    // SAFETY: `b` came from this target's `alloc` and is freed once (taken
                    // out of its slot).
                    unsafe { target.free(b, op.stream as usize) };
                    times.frees.push(t.elapsed().as_nanos() as u64);
                    saturating_sub(&sh.requested, op.size);
                    saturating_sub(&sh.held, given[slot].swap(0, Ordering::Relaxed));
                }
            } else {
                let t = Instant::now();
                let r = target.alloc(op.size as usize, op.align as usize, op.stream as usize);
                let ns = t.elapsed().as_nanos() as u64;
                match r {
                    Ok((b, g)) => {
                        times.allocs.push(ns);
                        *crate::sync::lock(&slots[slot]) = Some(b);
                        given[slot].store(g as u64, Ordering::Relaxed);
                        let req = saturating_add(&sh.requested, op.size);
                        sh.peak_requested.fetch_max(req, Ordering::Relaxed);
                        let held = saturating_add(&sh.held, g as u64);
                        sh.peak_held.fetch_max(held, Ordering::Relaxed);
                    }
                    Err(e) => {
                        sh.failures.fetch_add(1, Ordering::Relaxed);
                        let mut first = crate::sync::lock(&sh.first_failure);
                        if first.is_none() {
                            *first = Some(format!("{} bytes: {e}", op.size));
                        }
                    }
                }
            }
            sh.next.store(i as usize + 1, Ordering::Release);
        }
        // Stay until the whole replay is done: a thread that exited now would flush its
        // thread caches into the allocator at a moment the other threads' timing decides,
        // and a replay near a limit would fail or not from one run to the next.
        while sh.next.load(Ordering::Acquire) < self.ops.len() && !sh.aborted.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        times
    }
}

struct Shared {
    /// The index (into `Plan::ops`) of the operation whose turn it is.
    next: AtomicUsize,
    requested: AtomicU64,
    peak_requested: AtomicU64,
    held: AtomicU64,
    peak_held: AtomicU64,
    failures: AtomicU64,
    first_failure: Mutex<Option<String>>,
    /// A replay thread panicked: the others stop.
    aborted: AtomicBool,
}

/// Adds `n` to `a`, saturating at `u64::MAX` (the bytes live at once may pass 16 EiB in a
/// trace, never in memory); returns the new value. The replay's threads take turns, so
/// the update never retries in practice.
fn saturating_add(a: &AtomicU64, n: u64) -> u64 {
    let old = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
    // Infallible: the closure always returns `Some`.
    old.unwrap_or_else(|v| v).saturating_add(n)
}

/// Takes `n` from `a`, saturating at 0 (after a saturated add, the total is below the
/// true one).
fn saturating_sub(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

#[derive(Default)]
struct Times {
    allocs: Vec<u64>,
    frees: Vec<u64>,
}

fn percentiles(v: &mut [u64]) -> (u64, u64) {
    if v.is_empty() {
        return (0, 0);
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// An allocator a trace replays on. [`HostTarget`] adapts any allocator-api2 allocator;
/// [`DevicePoolTarget`] and `SimTarget` (with the `sim` feature) the device pools.
///
/// ```
/// use cudalloc::trace::replay::ReplayTarget;
/// struct Counter;
/// impl ReplayTarget for Counter {
///     type Block = usize;
///     fn name(&self) -> String { "counter".into() }
///     fn alloc(&self, size: usize, _align: usize, _stream: usize) -> Result<(usize, usize), String> {
///         Ok((size, size))
///     }
///     unsafe fn free(&self, _block: usize, _stream: usize) {}
/// }
/// let t = cudalloc::trace::Trace::default();
/// let r = cudalloc::trace::replay::replay(&t, Counter, &Default::default()).unwrap();
/// assert_eq!(r.allocations, 0);
/// ```
pub trait ReplayTarget: Sync {
    /// What a replay keeps for each live block.
    type Block: Send;

    /// The name in reports.
    fn name(&self) -> String;

    /// A note for the report (a simulated device, say).
    fn note(&self) -> Option<String> {
        None
    }

    /// Called once before the replay with the number of streams the trace uses.
    fn prepare(&mut self, streams: usize) -> Result<(), String> {
        let _ = streams;
        Ok(())
    }

    /// Allocates `size` bytes aligned to `align` on stream `stream` (`0..streams`):
    /// the block and the bytes it holds.
    fn alloc(&self, size: usize, align: usize, stream: usize) -> Result<(Self::Block, usize), String>;

    /// Frees a block on stream `stream`.
    ///
    /// # Safety
    ///
    /// 1. `block` came from this target's [`alloc`](Self::alloc) (not another instance's).
    unsafe fn free(&self, block: Self::Block, stream: usize);

    /// Called once the last operation ran (a device target synchronizes its streams).
    fn settle(&self) {}

    /// The most memory the allocator reserved from its source during the replay, where
    /// it says.
    fn peak_reserved(&self) -> Option<u64> {
        None
    }
}

/// What one replay measured.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The allocator.
    pub allocator: String,
    /// A note (a simulated device, a process-wide pool whose reservation is not its own).
    pub note: Option<String>,
    /// Replay threads (one per recorded thread).
    pub threads: usize,
    /// Streams (one per recorded stream).
    pub streams: usize,
    /// Allocations that succeeded.
    pub allocations: u64,
    /// Frees replayed.
    pub frees: u64,
    /// Allocations that failed (the replay went on; their frees are skipped).
    pub failures: u64,
    /// The first failure's error.
    pub first_failure: Option<String>,
    /// Bad events skipped (lenient replays).
    pub skipped: u64,
    /// Failures the trace recorded (not replayed).
    pub recorded_failures: u64,
    /// Events that describe the recorded allocator (frees completed, segments, trims),
    /// not replayed.
    pub ignored: u64,
    /// Wall time of the whole replay, nanoseconds (with its sequencing between threads).
    pub total_ns: u64,
    /// Median time of one allocation, nanoseconds.
    pub alloc_median_ns: u64,
    /// 99th percentile of one allocation's time, nanoseconds.
    pub alloc_p99_ns: u64,
    /// Median time of one free, nanoseconds.
    pub free_median_ns: u64,
    /// 99th percentile of one free's time, nanoseconds.
    pub free_p99_ns: u64,
    /// The most bytes requested at once.
    pub peak_requested: u64,
    /// The most bytes the allocator handed out at once (blocks' usable lengths).
    pub peak_held: u64,
    /// The most bytes the allocator reserved from its source, where it says.
    pub peak_reserved: Option<u64>,
    /// Blocks the trace never frees (not charged to the allocator: freed after the run).
    pub never_freed_blocks: u64,
    /// Their bytes.
    pub never_freed_bytes: u64,
}

impl ReplayReport {
    /// Peak reserved / peak requested, where the allocator says what it reserved.
    ///
    /// ```
    /// # use cudalloc::trace::{replay::{self, HostTarget}, Trace};
    /// let r = replay::replay(&Trace::default(), HostTarget::new("Global", allocator_api2::alloc::Global), &Default::default()).unwrap();
    /// assert_eq!(r.reserved_ratio(), None);
    /// ```
    pub fn reserved_ratio(&self) -> Option<f64> {
        let r = self.peak_reserved?;
        (self.peak_requested > 0).then(|| r as f64 / self.peak_requested as f64)
    }
}

/// Replays `trace` on `target`: [`Plan::new`] then [`Plan::replay`]. A bad trace is a
/// [`TraceError`] naming the event; a target that cannot start is a message.
pub fn replay<T: ReplayTarget>(
    trace: &Trace,
    target: T,
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let plan = Plan::new(trace, opts).map_err(ReplayError::Trace)?;
    plan.replay(target).map_err(ReplayError::Target)
}

/// Why a replay did not run.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayError {
    /// The trace has bad events.
    Trace(TraceError),
    /// The target could not start (no device, streams not created).
    Target(String),
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::Trace(e) => write!(f, "bad trace: {e}"),
            ReplayError::Target(e) => write!(f, "replay target: {e}"),
        }
    }
}

impl std::error::Error for ReplayError {}
