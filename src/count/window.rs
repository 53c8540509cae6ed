//! Windows: what was allocated and not freed between opening and closing one, on this
//! thread ([`Window`]) or on every thread through one allocator ([`ProcessWindow`]);
//! the leak-check helpers named for those two scopes; and the [`LeakReport`] a leak
//! check fails with.

use core::fmt;
use core::marker::PhantomData;

use super::counters::{Delta, Snapshot};
use super::sites::{self, LeakSite};
use super::thread::{current, ThreadState};
use super::Counting;
use crate::sync::global::Ordering;

/// Counts what every [`Counting`] allocator allocates and frees *on this thread* while
/// the window is open, so tests that run at once on other threads (as `cargo test`
/// runs them) do not disturb it.
///
/// A window balances what the thread allocated against what it freed, in blocks and in
/// bytes (the verdict is [`Delta::is_balanced`]): more blocks allocated than freed is a
/// leak, and so are more bytes, except those by which reallocations grew blocks. A
/// `Vec` that existed before the window and grew inside it is not a leak of the window
/// (its owner frees the growth with it); the bytes it holds show in
/// [`Delta::bytes_grown`] and [`Delta::net_bytes`]. A block allocated here and freed on
/// another thread counts as leaked here (use a [`ProcessWindow`] for work spread over
/// threads). While a window is open, a table keeps each block allocated in it until the
/// block is freed, so freeing or growing older blocks hides no leak: the report lists
/// the blocks kept, with their sizes (and, with the `backtrace` feature, where each
/// was allocated). The table takes a lock per allocation and free while windows are
/// open, and none otherwise.
///
/// Windows nest, and may close in any order. A window is tied to its thread (it is
/// `!Send`). Each of the 16 outermost windows open at once on a thread keeps its own
/// [`peak_bytes`](Window::peak_bytes); windows nested deeper report the peak since the
/// 16th opened.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{count::{Counting, Window}, PinnedAlloc};
///
/// let pinned = Counting::new(PinnedAlloc);
/// let w = Window::open();
/// let mut v: Vec<u32, _> = Vec::new_in(&pinned);
/// v.extend(0..1000);
/// drop(v);
/// w.assert_no_leaks();
///
/// let w = Window::open();
/// let kept: Vec<u32, _> = Vec::with_capacity_in(10, &pinned);
/// let report = w.check().unwrap_err();
/// assert_eq!((report.leaked_count(), report.leaked_bytes()), (1, 40));
/// # drop(kept);
/// ```
#[must_use = "a window checks nothing unless asked: call `assert_no_leaks` or `check`"]
pub struct Window {
    start: Snapshot,
    start_live: i64,
    /// This window's id on its thread (see `ThreadState::open_window`).
    id: u64,
    serial: u64,
    since: u64,
    _not_send: PhantomData<*const ()>,
}

impl Window {
    /// Opens a window on the calling thread. Allocates nothing.
    pub fn open() -> Window {
        let (start, (start_live, id), serial) =
            current(|t| (t.totals(), t.open_window(), t.serial())).unwrap_or_default();
        Window {
            start,
            start_live,
            id,
            serial,
            since: sites::now(),
            _not_send: PhantomData,
        }
    }

    /// What this thread did through `Counting` allocators since the window opened.
    ///
    /// ```
    /// use allocator_api2::boxed::Box;
    /// use cudalloc::count::{Counting, Window};
    /// let counting = Counting::new(std::alloc::System);
    /// let w = Window::open();
    /// let b = Box::new_in(7u64, &counting);
    /// assert_eq!(w.delta().net_bytes(), 8);
    /// drop(b);
    /// assert!(w.delta().is_balanced());
    /// # w.assert_no_leaks();
    /// ```
    pub fn delta(&self) -> Delta {
        current(|t| t.totals().delta(&self.start)).unwrap_or_default()
    }

    /// The most net bytes this thread had allocated at once since the window opened.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::count::{Counting, Window};
    /// let counting = Counting::new(std::alloc::System);
    /// let w = Window::open();
    /// drop(Vec::<u8, _>::with_capacity_in(4096, &counting));
    /// assert_eq!(w.peak_bytes(), 4096);
    /// # w.assert_no_leaks();
    /// ```
    pub fn peak_bytes(&self) -> u64 {
        current(|t| t.peak(self.id).saturating_sub(self.start_live).max(0) as u64).unwrap_or(0)
    }

    /// Closes the window: `Ok` with what happened if nothing leaked, else the report.
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{count::{Counting, Window}, PinnedAlloc};
    /// let pinned = Counting::new(PinnedAlloc);
    /// let w = Window::open();
    /// let mut v: Vec<u8, _> = Vec::new_in(&pinned);
    /// v.resize(100, 1);
    /// drop(v);
    /// let d = w.check().expect("nothing leaked");
    /// assert_eq!((d.allocs, d.frees), (1, 1));
    /// ```
    pub fn check(self) -> Result<Delta, LeakReport> {
        // Everything is read before the report allocates, and the window is closed
        // before the report is built, so the report never counts itself.
        let delta = self.delta();
        let (serial, since) = (self.serial, self.since);
        drop(self);
        let sites = sites::collect(|s| s.thread == serial && s.seq >= since);
        LeakReport::new(LeakScope::Thread, delta, sites)
    }

    /// Closes the window and panics with the [`LeakReport`] if anything leaked.
    #[track_caller]
    pub fn assert_no_leaks(self) {
        if let Err(report) = self.check() {
            panic!("{report}");
        }
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let id = self.id;
        let _ = current(|t: &ThreadState| t.close_window(id));
    }
}

impl fmt::Debug for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window").field("delta", &self.delta()).finish()
    }
}

/// Runs `f` in a [`Window`] (this thread, every `Counting` allocator) and panics with
/// the leak report if it leaked; see [`Window`] for what counts. For work spread over
/// threads, see [`Counting::assert_no_leaks_across_threads`].
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{count::{assert_no_leaks_on_this_thread, Counting}, ManagedAlloc};
/// let managed = Counting::new(ManagedAlloc);
/// assert_no_leaks_on_this_thread(|| {
///     let v: Vec<f32, _> = Vec::with_capacity_in(256, &managed);
///     assert!(v.capacity() >= 256);
/// });
/// ```
#[track_caller]
pub fn assert_no_leaks_on_this_thread(f: impl FnOnce()) {
    if let Err(report) = check_leaks_on_this_thread(f) {
        panic!("{report}");
    }
}

/// Runs `f` in a [`Window`] (this thread, every `Counting` allocator): `Ok` with what
/// happened, or the leak report.
///
/// ```
/// use allocator_api2::boxed::Box;
/// use cudalloc::count::{check_leaks_on_this_thread, Counting};
/// let counting = Counting::new(std::alloc::System);
/// let mut kept = None;
/// let report = check_leaks_on_this_thread(|| kept = Some(Box::new_in(1u32, &counting))).unwrap_err();
/// assert_eq!(report.leaked_bytes(), 4);
/// ```
pub fn check_leaks_on_this_thread(f: impl FnOnce()) -> Result<Delta, LeakReport> {
    let w = Window::open();
    f();
    w.check()
}

/// Counts what one [`Counting`] allocator allocates and frees on *every* thread while
/// the window is open: for code that spreads its work over threads. Leaks are judged
/// as in a [`Window`] ([`Delta::is_balanced`]). Close it after
/// joining the threads; anything else that uses the same allocator meanwhile (another
/// test running at once) is counted too, so give each such test its own allocator.
/// The crate's own bookkeeping (a pool's cache for a thread, made at the thread's first
/// use of the pool) is left out of the delta, as in a [`Window`]; see [`crate::count`].
///
/// The end of a `thread::scope` comes before its threads have quite exited; with
/// `Counting` as the global allocator they may still free a few blocks of std's thread
/// bookkeeping. So before reporting a leak, `check` waits up to 100 ms for the counts
/// to balance and the blocks allocated in the window to be freed. (`JoinHandle::join`
/// waits for the exit itself.)
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::count::{Counting, ProcessWindow};
/// use cudalloc::PinnedAlloc;
///
/// let pinned = Counting::new(PinnedAlloc);
/// let w = ProcessWindow::open(&pinned);
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| drop(Vec::<u8, _>::with_capacity_in(1000, &pinned)));
///     }
/// });
/// assert_eq!(w.delta().allocs, 4);
/// w.assert_no_leaks();
/// ```
#[must_use = "a window checks nothing unless asked: call `assert_no_leaks` or `check`"]
pub struct ProcessWindow<'a, A> {
    counting: &'a Counting<A>,
    start: Snapshot,
    /// [`Counting::aside`] at opening.
    aside: (u64, u64),
    since: u64,
}

impl<'a, A> ProcessWindow<'a, A> {
    /// Opens a window on `counting`. Allocates nothing.
    pub fn open(counting: &'a Counting<A>) -> Self {
        counting.process_windows.fetch_add(1, Ordering::Relaxed);
        counting.counters.block_fast_path();
        Self {
            counting,
            // The snapshot first: a bookkeeping allocation counted before it and set
            // aside after `aside` is read would be taken off twice (see `delta`).
            start: counting.snapshot(),
            aside: counting.aside(),
            since: sites::now(),
        }
    }

    /// What happened through the allocator, on all threads, since the window opened
    /// (the crate's own bookkeeping's allocations left out; see [`crate::count`]).
    pub fn delta(&self) -> Delta {
        let mut delta = self.counting.snapshot().delta(&self.start);
        let (count, bytes) = self.counting.aside();
        // Saturating: an allocation racing the window's opening may be set aside inside
        // it while its count fell before; the error leans towards fewer allocations,
        // and the window's sites still name every block of the user's it kept.
        delta.allocs = delta.allocs.saturating_sub(count.wrapping_sub(self.aside.0));
        delta.bytes_allocated = (delta.bytes_allocated).saturating_sub(bytes.wrapping_sub(self.aside.1));
        delta
    }

    /// Closes the window: `Ok` with what happened if nothing leaked, else the report.
    ///
    /// ```
    /// use allocator_api2::boxed::Box;
    /// use cudalloc::{count::{Counting, LeakScope, ProcessWindow}, ManagedAlloc};
    /// let managed = Counting::new(ManagedAlloc);
    /// let w = ProcessWindow::open(&managed);
    /// let kept = std::thread::scope(|s| s.spawn(|| Box::new_in(1u32, &managed)).join().unwrap());
    /// let report = w.check().unwrap_err();
    /// assert_eq!((report.scope, report.leaked_count()), (LeakScope::Process, 1));
    /// # drop(kept);
    /// ```
    pub fn check(self) -> Result<Delta, LeakReport> {
        // Threads joined by the end of a `thread::scope` may still be on their way out,
        // freeing their own bookkeeping (with `Counting` as the global allocator): give
        // them a moment before calling anything a leak, by the verdict itself (counts
        // that balance can still hide a block allocated here and not yet freed, where the
        // window also freed older blocks). Reading allocates nothing.
        let (instance, since) = (self.counting.id(), self.since);
        let ours = |s: &sites::SiteKey| s.instance == instance && s.seq >= since;
        let mut delta = self.delta();
        for _ in 0..SETTLE_ROUNDS {
            if delta.is_balanced() && !sites::any(ours) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
            delta = self.delta();
        }
        drop(self);
        let sites = sites::collect(ours);
        LeakReport::new(LeakScope::Process, delta, sites)
    }

    /// Closes the window and panics with the [`LeakReport`] if anything leaked.
    #[track_caller]
    pub fn assert_no_leaks(self) {
        if let Err(report) = self.check() {
            panic!("{report}");
        }
    }
}

impl<A> Drop for ProcessWindow<'_, A> {
    fn drop(&mut self) {
        self.counting.counters.unblock_fast_path();
        self.counting.process_windows.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<A> fmt::Debug for ProcessWindow<'_, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessWindow")
            .field("delta", &self.delta())
            .finish()
    }
}

/// Leak checks across threads, on one allocator.
impl<A> Counting<A> {
    /// Opens a [`ProcessWindow`] on this allocator: what it does on every thread.
    ///
    /// ```
    /// use allocator_api2::boxed::Box;
    /// use cudalloc::count::Counting;
    /// let c = Counting::new(std::alloc::System);
    /// let w = c.process_window();
    /// let b = std::thread::scope(|s| s.spawn(|| Box::new_in(1u8, &c)).join().unwrap());
    /// drop(b);
    /// w.assert_no_leaks();
    /// ```
    pub fn process_window(&self) -> ProcessWindow<'_, A> {
        ProcessWindow::open(self)
    }

    /// Runs `f` in a [`ProcessWindow`] on this allocator (every thread, this allocator
    /// only) and panics with the leak report if it leaked. Threads that `f` spawns must
    /// be joined before it returns. For this thread and every allocator, see
    /// [`assert_no_leaks_on_this_thread`].
    ///
    /// ```
    /// use allocator_api2::vec::Vec;
    /// use cudalloc::{count::Counting, PinnedAlloc};
    /// let pinned = Counting::new(PinnedAlloc);
    /// pinned.assert_no_leaks_across_threads(|| {
    ///     std::thread::scope(|s| {
    ///         s.spawn(|| drop(Vec::<u64, _>::with_capacity_in(8, &pinned)));
    ///     });
    /// });
    /// ```
    #[track_caller]
    pub fn assert_no_leaks_across_threads(&self, f: impl FnOnce()) {
        if let Err(report) = self.check_leaks_across_threads(f) {
            panic!("{report}");
        }
    }

    /// Runs `f` in a [`ProcessWindow`] on this allocator: `Ok` with what happened on
    /// every thread, or the leak report. Threads that `f` spawns must be joined before
    /// it returns.
    ///
    /// ```
    /// use allocator_api2::boxed::Box;
    /// use cudalloc::count::{Counting, LeakScope};
    /// let counting = Counting::new(std::alloc::System);
    /// let kept = counting
    ///     .check_leaks_across_threads(|| {
    ///         std::thread::scope(|s| {
    ///             s.spawn(|| drop(Box::new_in([0u8; 8], &counting)));
    ///         });
    ///     })
    ///     .expect("nothing leaked");
    /// assert_eq!((kept.allocs, kept.frees), (1, 1));
    /// let mut b = None;
    /// let report = counting.check_leaks_across_threads(|| b = Some(Box::new_in(1u32, &counting)));
    /// assert_eq!(report.unwrap_err().scope, LeakScope::Process);
    /// ```
    pub fn check_leaks_across_threads(&self, f: impl FnOnce()) -> Result<Delta, LeakReport> {
        let w = self.process_window();
        f();
        w.check()
    }
}

/// How often, 2 ms apart, a process-wide window rereads unbalanced counts.
const SETTLE_ROUNDS: u32 = 50;

/// Which kind of window a [`LeakReport`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeakScope {
    /// A [`Window`]: one thread, every `Counting` allocator.
    Thread,
    /// A [`ProcessWindow`]: every thread, one allocator.
    Process,
}

/// Why a leak check failed: which blocks leaked, and with the `backtrace` feature where.
///
/// A window keeps a table of the blocks allocated while it is open, until each is
/// freed ([`LeakReport::sites`]); its first line counts the blocks it kept and their
/// bytes ("2 blocks, 20 bytes not freed"), whatever older blocks it freed or grew
/// meanwhile. Where the table has nothing and the counts still fail the verdict
/// ([`Delta::is_balanced`]: a block allocated in a thread window and freed on another
/// thread, say), it says what the counts say. Growth of blocks by reallocation is shown
/// apart ("reallocations grew blocks by N B"): it fails no check by itself.
///
/// ```
/// use allocator_api2::boxed::Box;
/// use cudalloc::count::{Counting, LeakScope, Window};
/// let counting = Counting::new(std::alloc::System);
/// let w = Window::open();
/// let b = Box::new_in([0u8; 100], &counting);
/// let report = w.check().unwrap_err();
/// assert_eq!(report.scope, LeakScope::Thread);
/// assert!(report.to_string().contains("1 block, 100 bytes not freed"));
/// # drop(b);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeakReport {
    /// The kind of window.
    pub scope: LeakScope,
    /// What happened in the window.
    pub delta: Delta,
    /// Blocks allocated in the window and still live, oldest first (with the
    /// `backtrace` feature, each with the stack it was allocated from).
    pub sites: Vec<LeakSite>,
}

impl LeakReport {
    fn new(scope: LeakScope, delta: Delta, sites: Vec<LeakSite>) -> Result<Delta, LeakReport> {
        if delta.is_balanced() && sites.is_empty() {
            Ok(delta)
        } else {
            Err(LeakReport { scope, delta, sites })
        }
    }

    /// Blocks allocated in the window and not freed: those of [`LeakReport::sites`];
    /// where the table has none, the net count ([`Delta::leaked_count`]).
    pub fn leaked_count(&self) -> u64 {
        if self.sites.is_empty() {
            self.delta.leaked_count()
        } else {
            self.sites.len() as u64
        }
    }

    /// Their bytes: the sizes of [`LeakReport::sites`]; where the table has none, the
    /// net bytes ([`Delta::leaked_bytes`]).
    pub fn leaked_bytes(&self) -> u64 {
        if self.sites.is_empty() {
            self.delta.leaked_bytes()
        } else {
            self.sites.iter().map(|s| s.size as u64).sum()
        }
    }
}

/// At most this many allocation sites are printed.
const SITES_SHOWN: usize = 16;

/// "1 block", "2 blocks".
fn blocks(n: u64) -> String {
    format!("{n} block{}", if n == 1 { "" } else { "s" })
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scope = match self.scope {
            LeakScope::Thread => "thread window",
            LeakScope::Process => "process-wide window",
        };
        let (count, bytes) = (self.leaked_count(), self.leaked_bytes());
        if count > 0 {
            writeln!(
                f,
                "memory leaked in a {scope}: {}, {bytes} bytes not freed",
                blocks(count)
            )?;
        } else {
            writeln!(
                f,
                "memory leaked in a {scope}: {bytes} bytes not freed, in no more blocks than \
                 at opening (blocks allocated in the window outlive it in place of older ones \
                 it freed)"
            )?;
        }
        write!(f, "  window: {}", self.delta)?;
        if !self.sites.is_empty() {
            write!(
                f,
                "\n  allocated in the window and still live: {}",
                blocks(self.sites.len() as u64)
            )?;
        }
        for (i, site) in self.sites.iter().take(SITES_SHOWN).enumerate() {
            write!(f, "\n  #{i}: {} bytes at {:#x}", site.size, site.address)?;
            if !site.backtrace.is_empty() {
                write!(f, ", allocated at:")?;
            }
            for line in site.backtrace.lines() {
                write!(f, "\n    {line}")?;
            }
        }
        if self.sites.len() > SITES_SHOWN {
            write!(f, "\n  ... and {} more", self.sites.len() - SITES_SHOWN)?;
        }
        if !sites::BACKTRACES {
            write!(
                f,
                "\n  (enable cudalloc's `backtrace` feature to see allocation sites)"
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for LeakReport {}
