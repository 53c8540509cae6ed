//! Per-thread state shared by every `Counting` allocator: the thread's slot (which shard
//! of each allocator's counters it writes), its serial, its own running totals for
//! windows, the window depth, and the gate the hot path reads first (the slot while
//! nothing but the shard is needed). All of it is `Cell`s in a `const`-initialized
//! thread-local without `Drop`, so reading it never allocates and works until the
//! thread is gone. A leaf: it knows the counters' shapes and nothing else of `count`.

use core::cell::Cell;

use super::counters::{Snapshot, SHARDS};
use crate::sync::global::{AtomicU64, Ordering};

/// `slot` before the thread's first counted operation.
const UNASSIGNED: u32 = u32::MAX;
/// `slot` of a thread without a private shard (any value `>= SHARDS` works).
const SHARED: u32 = SHARDS as u32;
/// `gate` of a thread whose operations take the full path (any value `>= SHARDS` works).
const SLOW: u32 = u32::MAX;
const _: () = assert!(SHARDS <= 64, "slots are the bits of one u64");
/// Open windows per thread whose peaks are kept apart; windows nested deeper share the
/// peak of the innermost one kept.
pub(crate) const PEAK_LEVELS: usize = 16;

/// Bit `i` is set while some thread holds slot `i`.
static SLOTS_IN_USE: AtomicU64 = AtomicU64::new(0);
/// Source of thread serials (never reused, unlike slots).
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

pub(crate) struct ThreadState {
    /// What the hot path reads first, one load for three conditions: the thread's slot
    /// while it holds a private shard, has no window open and is not in site code
    /// (capturing a stack or building a report), so that an operation needs nothing but
    /// its shard; `SLOW` otherwise. Kept by [`ThreadState::refresh_gate`] whenever one
    /// of the three changes.
    gate: Cell<u32>,
    /// Set while the thread is in site code (`sites` says so through [`set_site_busy`]).
    site_busy: Cell<bool>,
    /// Shard index; `UNASSIGNED`, or `>= SHARDS` for the shared shard.
    slot: Cell<u32>,
    /// Unique id of this thread among all that ever counted (0: not yet assigned).
    serial: Cell<u64>,
    /// Open windows on this thread.
    depth: Cell<u32>,
    /// What every `Counting` allocator did on this thread while a window was open on it
    /// (wrapping): a window's delta is what changed here while it was open.
    totals: Cell<Snapshot>,
    /// Net bytes this thread allocated minus freed while windows were open, and the
    /// highest it reached since the latest window kept in `windows` opened.
    live: Cell<i64>,
    peak: Cell<i64>,
    /// The open windows with a peak of their own, in opening order: `windows[..kept]`
    /// hold each one's id and the peak of the time between the previous one's opening
    /// and its own (`peak` holds the time since the last one's). A window's peak is the
    /// most of its own entry's successors and `peak`; windows may close in any order.
    windows: [Cell<(u64, i64)>; PEAK_LEVELS],
    kept: Cell<usize>,
    /// Source of window ids on this thread (0: a window with no peak of its own).
    next_window: Cell<u64>,
}

thread_local! {
    static THREAD: ThreadState = const { ThreadState::new() };
    static SLOT: SlotGuard = const { SlotGuard(Cell::new(UNASSIGNED)) };
}

/// The slot of this thread's private shard if the operation at hand may take the fast
/// path (see `ThreadState::gate`); any value `>= SHARDS` if it must take the full one.
#[inline(always)]
pub(crate) fn fast_slot() -> usize {
    THREAD.try_with(|t| t.gate.get()).unwrap_or(SLOW) as usize
}

/// Marks this thread as in site code (`busy`) or out of it: while it is, every operation
/// takes the full path, which asks the site table what to count and record. (Unused
/// under loom, where the site table compiles to nothing.)
#[cfg_attr(loom, allow(dead_code))]
pub(crate) fn set_site_busy(busy: bool) {
    let _ = THREAD.try_with(|t| {
        t.site_busy.set(busy);
        t.refresh_gate();
    });
}

/// Runs `f` on this thread's state; `None` only where the platform has already torn
/// thread-locals down (a `const` one without `Drop` stays usable on mainstream targets).
#[inline(always)]
pub(crate) fn current<R>(f: impl FnOnce(&ThreadState) -> R) -> Option<R> {
    THREAD.try_with(f).ok()
}

impl ThreadState {
    const fn new() -> Self {
        Self {
            gate: Cell::new(SLOW),
            site_busy: Cell::new(false),
            slot: Cell::new(UNASSIGNED),
            serial: Cell::new(0),
            depth: Cell::new(0),
            totals: Cell::new(Snapshot {
                allocs: 0,
                frees: 0,
                reallocs: 0,
                failures: 0,
                bytes_allocated: 0,
                bytes_freed: 0,
                bytes_grown: 0,
                peak_bytes: 0,
            }),
            live: Cell::new(0),
            peak: Cell::new(0),
            windows: [const { Cell::new((0, 0)) }; PEAK_LEVELS],
            kept: Cell::new(0),
            next_window: Cell::new(1),
        }
    }

    /// The shard this thread writes (`>= SHARDS`: the shared one).
    #[inline(always)]
    pub(crate) fn slot(&self) -> usize {
        let slot = self.slot.get();
        if slot != UNASSIGNED {
            slot as usize
        } else {
            self.assign()
        }
    }

    #[cold]
    #[inline(never)]
    fn assign(&self) -> usize {
        // Until the guard below is in place, this thread (including any allocation made
        // while registering the guard's destructor) uses the shared shard.
        self.slot.set(SHARED);
        self.serial.set(NEXT_SERIAL.fetch_add(1, Ordering::Relaxed));
        if let Some(slot) = claim_slot() {
            if SLOT.try_with(|g| g.0.set(slot)).is_ok() {
                self.slot.set(slot);
                self.refresh_gate();
            } else {
                release_slot(slot);
            }
        }
        self.slot.get() as usize
    }

    /// Recomputes `gate` from the slot, the window depth and the site flag.
    fn refresh_gate(&self) {
        let slot = self.slot.get();
        let fast = (slot as usize) < SHARDS && self.depth.get() == 0 && !self.site_busy.get();
        self.gate.set(if fast { slot } else { SLOW });
    }

    /// This thread's serial (assigning one if needed).
    pub(crate) fn serial(&self) -> u64 {
        self.slot();
        self.serial.get()
    }

    #[inline(always)]
    pub(crate) fn window_open(&self) -> bool {
        self.depth.get() != 0
    }

    #[inline(always)]
    pub(crate) fn on_alloc(&self, size: u64) {
        let mut t = self.totals.get();
        t.allocs = t.allocs.wrapping_add(1);
        t.bytes_allocated = t.bytes_allocated.wrapping_add(size);
        self.totals.set(t);
        self.grow_live(size as i64);
    }

    #[inline(always)]
    pub(crate) fn on_free(&self, size: u64) {
        let mut t = self.totals.get();
        t.frees = t.frees.wrapping_add(1);
        t.bytes_freed = t.bytes_freed.wrapping_add(size);
        self.totals.set(t);
        self.live.set(self.live.get().wrapping_sub(size as i64));
    }

    #[inline(always)]
    pub(crate) fn on_realloc(&self, old: u64, new: u64) {
        let mut t = self.totals.get();
        t.reallocs = t.reallocs.wrapping_add(1);
        t.bytes_allocated = t.bytes_allocated.wrapping_add(new);
        t.bytes_freed = t.bytes_freed.wrapping_add(old);
        if new > old {
            t.bytes_grown = t.bytes_grown.wrapping_add(new - old);
        }
        self.totals.set(t);
        self.grow_live(new.wrapping_sub(old) as i64);
    }

    #[cold]
    pub(crate) fn on_failure(&self) {
        let mut t = self.totals.get();
        t.failures = t.failures.wrapping_add(1);
        self.totals.set(t);
    }

    #[inline(always)]
    fn grow_live(&self, delta: i64) {
        let live = self.live.get().wrapping_add(delta);
        self.live.set(live);
        if live > self.peak.get() {
            self.peak.set(live);
        }
    }

    /// This thread's running totals.
    pub(crate) fn totals(&self) -> Snapshot {
        self.totals.get()
    }

    /// Opens a window: returns the live level at opening and the window's id.
    pub(crate) fn open_window(&self) -> (i64, u64) {
        self.serial();
        self.depth.set(self.depth.get() + 1);
        self.refresh_gate();
        let live = self.live.get();
        let kept = self.kept.get();
        let Some(entry) = self.windows.get(kept) else {
            return (live, 0);
        };
        let id = self.next_window.get();
        self.next_window.set(id + 1);
        entry.set((id, self.peak.replace(live)));
        self.kept.set(kept + 1);
        (live, id)
    }

    /// Where window `id` is in `windows`, if it has a peak of its own.
    fn find_window(&self, id: u64) -> Option<usize> {
        if id == 0 {
            return None;
        }
        self.windows[..self.kept.get()]
            .iter()
            .position(|w| w.get().0 == id)
    }

    /// The highest net bytes since window `id` opened (for a window nested too deep for
    /// a peak of its own: since the innermost window that has one opened).
    pub(crate) fn peak(&self, id: u64) -> i64 {
        let later = match self.find_window(id) {
            Some(i) => &self.windows[i + 1..self.kept.get()],
            None => &[],
        };
        later.iter().fold(self.peak.get(), |peak, w| peak.max(w.get().1))
    }

    /// Closes window `id`, opened with [`ThreadState::open_window`].
    pub(crate) fn close_window(&self, id: u64) {
        debug_assert!(self.depth.get() > 0, "closing a window that is not open");
        self.depth.set(self.depth.get().saturating_sub(1));
        self.refresh_gate();
        let Some(i) = self.find_window(id) else {
            return;
        };
        let kept = self.kept.get();
        let before = self.windows[i].get().1;
        // The time before this window opened, until the next one opened, belongs to the
        // windows opened earlier (and not to those opened later): merge it into the next
        // entry, or into `peak` when this window is the latest.
        match self.windows.get(i + 1).filter(|_| i + 1 < kept) {
            Some(next) => {
                let (next_id, next_peak) = next.get();
                next.set((next_id, next_peak.max(before)));
            }
            None => self.peak.set(self.peak.get().max(before)),
        }
        for j in i..kept - 1 {
            self.windows[j].set(self.windows[j + 1].get());
        }
        self.kept.set(kept - 1);
    }
}

/// Holds the thread's slot; its destructor (run at thread exit) gives the slot back.
struct SlotGuard(Cell<u32>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slot = self.0.replace(UNASSIGNED);
        if slot != UNASSIGNED {
            // Stop writing the shard before anyone else may claim it: whatever this
            // thread allocates or frees from now on goes to the shared shard.
            let _ = THREAD.try_with(|t| {
                t.slot.set(SHARED);
                t.refresh_gate();
            });
            release_slot(slot);
        }
    }
}

fn claim_slot() -> Option<u32> {
    let all = if SHARDS == 64 {
        u64::MAX
    } else {
        (1u64 << SHARDS) - 1
    };
    let mut used = SLOTS_IN_USE.load(Ordering::Relaxed);
    loop {
        let free = !used & all;
        if free == 0 {
            return None;
        }
        let slot = free.trailing_zeros();
        // Acquire: the previous owner's writes to the shard happen before ours.
        match SLOTS_IN_USE.compare_exchange_weak(used, used | 1 << slot, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => return Some(slot),
            Err(now) => used = now,
        }
    }
}

fn release_slot(slot: u32) {
    // Release: our writes to the shard happen before the next owner's.
    SLOTS_IN_USE.fetch_and(!(1u64 << slot), Ordering::Release);
}
