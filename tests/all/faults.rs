//! Fault injection: a memory source that fails when told (its Nth call, the next few, or
//! every call with a chosen error), and fences that error, panic or stay pending. Every
//! allocator over them (`Pool`, `Arena`, `Direct`, `Counting` around them) must return
//! `AllocError` (or the crate's `Error` from `try_allocate` / `try_alloc_layout`), keep
//! its counters right, and keep working after the fault. Also the pool's trim-and-retry
//! path, a `Vec` whose growth fails midway, and backpressure: a pool at its limit waits
//! for pending blocks whose fences complete from another thread, and never holds more
//! than its limit.
//!
//! Fences here never hang a test: a pending one reports completion by itself after
//! `WATCHDOG` (a test that fails with fences pending still ends).

use core::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::vec::Vec as AVec;
use cudalloc::arena::{Arena, ArenaConfig};
use cudalloc::cuda::MemoryType;
use cudalloc::fence::Fence;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::{HostSource, HostVisible, MemorySource};
use cudalloc::{Counting, Direct, Error};

use crate::support::assert_balanced;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

// ---- a source that fails when told ---------------------------------------------------

/// What `Faulty` does on its calls.
#[derive(Default)]
struct Plan {
    /// Indices (from 0, over the source's life) of `allocate` calls that fail.
    fail_calls: Vec<usize>,
    /// Fail every call from now on with this error.
    fail_all: Option<Error>,
}

#[derive(Default)]
struct FaultState {
    calls: AtomicUsize,
    failed: AtomicUsize,
    plan: Mutex<Plan>,
    /// Bytes handed out and not returned; the most ever.
    held: AtomicUsize,
    peak: AtomicUsize,
}

/// Page-aligned host memory from [`HostSource`] whose `allocate` fails when told.
#[derive(Clone, Default)]
struct Faulty(Arc<FaultState>);

impl Faulty {
    /// Fails the `n`th `allocate` call from now on (0: the next one).
    fn fail_call_in(&self, n: usize) {
        let at = self.0.calls.load(Ordering::SeqCst) + n;
        self.0.plan.lock().unwrap().fail_calls.push(at);
    }
    /// Fails the next `n` calls.
    fn fail_next(&self, n: usize) {
        for i in 0..n {
            self.fail_call_in(i);
        }
    }
    /// Fails every call with `e` until healed.
    fn fail_every(&self, e: Error) {
        self.0.plan.lock().unwrap().fail_all = Some(e);
    }
    fn heal(&self) {
        *self.0.plan.lock().unwrap() = Plan::default();
    }
    fn calls(&self) -> usize {
        self.0.calls.load(Ordering::SeqCst)
    }
    fn failed(&self) -> usize {
        self.0.failed.load(Ordering::SeqCst)
    }
    fn held(&self) -> usize {
        self.0.held.load(Ordering::SeqCst)
    }
    fn peak(&self) -> usize {
        self.0.peak.load(Ordering::SeqCst)
    }
}

// SAFETY: successful calls forward to HostSource, which keeps every promise (exclusive
// blocks of `size` bytes at its alignment; deallocate never panics); refusing is allowed.
unsafe impl MemorySource for Faulty {
    fn align(&self) -> usize {
        HostSource.align()
    }
    fn kind(&self) -> MemoryType {
        MemoryType::Pageable
    }
    fn allocate(&self, size: usize) -> cudalloc::Result<NonNull<u8>> {
        let call = self.0.calls.fetch_add(1, Ordering::SeqCst);
        let refuse = {
            let plan = self.0.plan.lock().unwrap();
            plan.fail_all.clone().or_else(|| {
                plan.fail_calls
                    .contains(&call)
                    .then_some(Error::OutOfMemory { requested: size })
            })
        };
        if let Some(e) = refuse {
            self.0.failed.fetch_add(1, Ordering::SeqCst);
            return Err(e);
        }
        let p = HostSource.allocate(size)?;
        let now = self.0.held.fetch_add(size, Ordering::SeqCst) + size;
        self.0.peak.fetch_max(now, Ordering::SeqCst);
        Ok(p)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        self.0.held.fetch_sub(size, Ordering::SeqCst);
        // SAFETY: the caller's obligations are HostSource's (allocate used it).
        unsafe { HostSource.deallocate(ptr, size) }
    }
}

// SAFETY: HostSource memory.
unsafe impl HostVisible for Faulty {}

// ---- fences that misbehave -----------------------------------------------------------

/// A pending fence reports completion by itself after this long, so no test can hang.
const WATCHDOG: Duration = Duration::from_secs(30);

const PENDING: u8 = 0;
const COMPLETE: u8 = 1;
const ERRORS: u8 = 2;
const PANICS: u8 = 3;

/// A fence whose answer the test sets: pending, complete, an error, or a panic (raised
/// with `resume_unwind`, which runs no panic hook: nothing printed).
#[derive(Clone)]
struct Scripted {
    state: Arc<AtomicU8>,
    polls: Arc<AtomicU64>,
    /// Whether `seal` fails (with a panic or an error, as `state` says at that time).
    seal_fails: bool,
    born: Instant,
}

impl Scripted {
    fn new(state: u8) -> Self {
        Self {
            state: Arc::new(AtomicU8::new(state)),
            polls: Arc::default(),
            seal_fails: false,
            born: Instant::now(),
        }
    }
    fn set(&self, state: u8) {
        self.state.store(state, Ordering::Release);
    }
    fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }
    fn answer(&self) -> cudalloc::Result<bool> {
        match self.state.load(Ordering::Acquire) {
            COMPLETE => Ok(true),
            ERRORS => Err(Error::InvalidArgument("fault injection: this fence fails")),
            PANICS => std::panic::resume_unwind(Box::new("fault injection: this fence panics")),
            _ => Ok(self.born.elapsed() > WATCHDOG),
        }
    }
}

// SAFETY: the simulated uses touch no memory, so any answer is true to them.
unsafe impl Fence for Scripted {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        self.answer()
    }
    fn seal(&self) -> cudalloc::Result<()> {
        if self.seal_fails {
            self.answer()?;
        }
        Ok(())
    }
}

// ---- checks --------------------------------------------------------------------------

/// The pool's counters against what the source and the test know.
#[track_caller]
fn assert_pool_counts(pool: &Pool<Faulty>, live_blocks: usize, failures: u64) {
    let s = pool.stats();
    assert_balanced(&s);
    assert_eq!(s.source_bytes, pool.source().held(), "source bytes: {s:?}");
    assert_eq!(s.live_blocks, live_blocks, "{s:?}");
    assert_eq!(s.failures, failures, "failures counted: {s:?}");
}

/// The bytes `fill` writes and `assert_filled` checks: the first and the last 4 KiB of a
/// block (enough to show a block moved, truncated or reused; the whole of a multi-MiB
/// block would make these tests slow under valgrind).
fn ends(len: usize) -> impl Iterator<Item = usize> {
    let head = len.min(4096);
    (0..head).chain(len.saturating_sub(4096).max(head)..len)
}

fn fill(p: NonNull<u8>, len: usize, seed: u8) {
    for i in ends(len) {
        // SAFETY: callers pass blocks of at least `len` bytes.
        unsafe {
            p.as_ptr()
                .add(i)
                .write((i as u8).wrapping_mul(13) ^ seed ^ (i >> 8) as u8)
        };
    }
}

#[track_caller]
fn assert_filled(p: NonNull<u8>, len: usize, seed: u8) {
    for i in ends(len) {
        // SAFETY: callers pass blocks of at least `len` bytes.
        let got = unsafe { p.as_ptr().add(i).read() };
        assert_eq!(
            got,
            (i as u8).wrapping_mul(13) ^ seed ^ (i >> 8) as u8,
            "byte {i} of {len}"
        );
    }
}

/// A sequence of requests through every path of a pool: small classes (new chunks),
/// aligned classes, large blocks, over-aligned large blocks, and growth.
const SCRIPT: [(usize, usize); 12] = [
    (64, 8),
    (100, 16),
    (5000, 64),
    (40 * KIB, 8),
    (300 * KIB, 4096),
    (700 * KIB, 8),
    (3 * MIB, 1 << 16),
    (64, 8),
    (9000, 4096),
    (200 * KIB, 8),
    (1500 * KIB, 8),
    (24, 8),
];

/// The tight pool shape: small chunks, a low large threshold, tiny thread caches, so the
/// script reaches the source often.
fn tight() -> PoolConfig {
    PoolConfig::default()
        .with_chunk_size(256 * KIB)
        .with_large_threshold(8 * KIB)
        .with_thread_cache_capacity(4)
        .with_thread_cache_bytes(64 * KIB)
}

/// What the script saw.
#[derive(Default)]
struct Tally {
    live: Vec<(NonNull<u8>, Layout, u8)>,
    failures: u64,
}

/// Runs the script on `a`: every request (and a grow of every third block) either
/// succeeds, or fails with `AllocError` and leaves the allocator as it was; `check` runs
/// after every step. Returns the live blocks.
fn run_script<A: Allocator>(a: &A, check: &dyn Fn(&Tally)) -> Tally {
    let mut t = Tally::default();
    for (i, &(size, align)) in SCRIPT.iter().enumerate() {
        let l = layout(size, align);
        match a.allocate(l) {
            Ok(b) => {
                assert!(b.len() >= size && b.cast::<u8>().as_ptr() as usize % align == 0);
                fill(b.cast(), size, i as u8);
                t.live.push((b.cast(), l, i as u8));
            }
            Err(_) => t.failures += 1,
        }
        check(&t);
        if i % 3 == 2 && !t.live.is_empty() {
            let (p, old, seed) = t.live.pop().unwrap();
            let new = layout(old.size() * 3 + 100, old.align());
            // SAFETY: `p` is live with `old`; new is larger.
            match unsafe { a.grow(p, old, new) } {
                Ok(g) => {
                    assert_filled(g.cast(), old.size(), seed);
                    fill(g.cast(), new.size(), seed);
                    t.live.push((g.cast(), new, seed));
                }
                Err(_) => {
                    // The block is untouched and still live with its old layout.
                    assert_filled(p, old.size(), seed);
                    t.failures += 1;
                    t.live.push((p, old, seed));
                }
            }
            check(&t);
        }
    }
    for &(p, l, seed) in &t.live {
        assert_filled(p, l.size(), seed);
    }
    t
}

fn free_all<A: Allocator>(a: &A, t: Tally) {
    for (p, l, seed) in t.live.into_iter().rev() {
        assert_filled(p, l.size(), seed);
        // SAFETY: allocated by `a` with `l` in the script, freed once.
        unsafe { a.deallocate(p, l) };
    }
}

// ---- the pool ------------------------------------------------------------------------

/// For every N: the Nth source call fails (then, in turn, the Nth and the next; the Nth
/// and every later one). The pool answers each request or fails it cleanly, its counters
/// match the source's and the test's after every step, and healed it serves the whole
/// script and returns every byte.
#[test]
fn pool_source_failing_at_every_call_in_turn() {
    // What fails, given the source and N.
    type FaultPlan = (&'static str, fn(&Faulty, usize));
    let plans: [FaultPlan; 3] = [
        ("the Nth call", |f, n| f.fail_call_in(n)),
        ("the Nth and the next", |f, n| {
            f.fail_call_in(n);
            f.fail_call_in(n + 1);
        }),
        ("the Nth and all after", |f, n| {
            f.fail_call_in(n);
            f.fail_call_in(n + 1);
            f.fail_call_in(n + 2);
            f.fail_call_in(n + 3);
        }),
    ];
    for (what, plan) in plans {
        for config in [tight(), PoolConfig::default()] {
            let mut n = 0;
            loop {
                let source = Faulty::default();
                let pool = Pool::with_config(source.clone(), config);
                plan(&source, n);
                let check = |t: &Tally| assert_pool_counts(&pool, t.live.len(), t.failures);
                let t = run_script(&pool, &check);
                let reached = source.calls() > n;
                assert_eq!(source.failed() > 0, reached, "{what}, N = {n}");
                // Healed: the whole script works, next to the blocks still live.
                source.heal();
                let failures = t.failures;
                let again = run_script(&pool, &|u| {
                    assert_eq!(u.failures, 0, "{what}, N = {n}: failed after healing");
                    assert_pool_counts(&pool, t.live.len() + u.live.len(), failures);
                });
                free_all(&pool, again);
                free_all(&pool, t);
                pool.trim();
                let s = pool.stats();
                assert_eq!((s.live_blocks, s.source_bytes, source.held()), (0, 0, 0), "{s:?}");
                if !reached {
                    break; // the script never got to call N: every N is covered
                }
                n += 1;
            }
            assert!(n >= 5, "{what}: the script made only {n} source calls");
        }
    }
}

/// The source fails once: the pool trims its cache (returning the free chunk or segment
/// it holds) and retries, and the request succeeds. Twice in a row: the request fails
/// with the source's error, counted once.
#[test]
fn pool_trims_and_retries_once_when_the_source_fails() {
    // A large request finds a cached chunk of small blocks in the way.
    let source = Faulty::default();
    let pool = Pool::with_config(
        source.clone(),
        PoolConfig::default().with_thread_cache_capacity(0),
    );
    let small = layout(64, 8);
    let b = pool.allocate(small).unwrap();
    // SAFETY: allocated above with `small`.
    unsafe { pool.deallocate(b.cast(), small) };
    assert_eq!(pool.stats().cached_bytes, 2 * MIB, "the free chunk stays cached");
    source.fail_next(1);
    let big = layout(3 * MIB, 8);
    let calls = source.calls();
    let b = pool.try_allocate(big).expect("trim and retry succeeds");
    assert_eq!(source.calls() - calls, 2, "one failed call, one retry");
    let s = pool.stats();
    assert_eq!(s.failures, 0, "a request that succeeded is no failure: {s:?}");
    assert_eq!(
        s.source_bytes,
        3 * MIB,
        "the trim returned the cached chunk: {s:?}"
    );
    assert_eq!(source.held(), 3 * MIB);
    // SAFETY: allocated above with `big`.
    unsafe { pool.deallocate(b.cast(), big) };

    // A small request finds the cached large segment in the way.
    source.fail_next(1);
    let b = pool.try_allocate(small).expect("trim and retry succeeds");
    assert_eq!(pool.stats().source_bytes, 2 * MIB, "the segment was trimmed");
    // SAFETY: allocated above with `small`.
    unsafe { pool.deallocate(b.cast(), small) };

    // Twice in a row: the source's error, counted once; then the pool works again.
    for l in [small, big, layout(9000, 4096)] {
        pool.trim();
        source.fail_next(2);
        let e = pool.try_allocate(l).expect_err("both attempts fail");
        assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    }
    assert_eq!(pool.stats().failures, 3);
    let b = pool.try_allocate(big).unwrap();
    // SAFETY: allocated above with `big`.
    unsafe { pool.deallocate(b.cast(), big) };
    pool.trim();
    assert_eq!((pool.stats().source_bytes, source.held()), (0, 0));
}

/// Every error a source can return reaches `try_allocate` / `try_alloc_layout` as it is,
/// and `Allocator` callers get `AllocError`, for the pool, the arena, `Direct` and
/// `Counting` around them; healed, each works again.
#[test]
fn every_source_error_reaches_the_caller_unchanged() {
    let errors = [
        Error::OutOfMemory { requested: 12345 },
        Error::NoDriver,
        Error::InvalidArgument("fault injection"),
        Error::TooLarge {
            requested: 1,
            limit: 2,
        },
        Error::LimitExceeded {
            requested: 3,
            held: 4,
            limit: 5,
        },
    ];
    for e in errors {
        for l in [
            layout(64, 8),
            layout(700 * KIB, 8),
            layout(100, 1 << 16),
            layout(5 * MIB, 8),
        ] {
            let source = Faulty::default();
            source.fail_every(e.clone());
            let pool = Pool::with_config(source.clone(), tight());
            assert_eq!(pool.try_allocate(l).unwrap_err(), e.clone(), "pool, {l:?}");
            assert!(pool.allocate(l).is_err());
            let counting = Counting::new(&pool);
            assert!(counting.allocate(l).is_err());
            assert_eq!(counting.snapshot().failures, 1);
            assert_eq!(pool.stats().failures, 3);
            assert_pool_counts(&pool, 0, 3);

            let arena = Arena::with_config(source.clone(), ArenaConfig::host().with_first_chunk(4 * KIB));
            assert_eq!(arena.try_alloc_layout(l).unwrap_err(), e.clone(), "arena, {l:?}");
            assert!((&arena).allocate(l).is_err());
            assert_eq!(arena.allocated_bytes(), 0);

            let direct = Direct::new(source.clone());
            assert_eq!(direct.try_allocate(l).unwrap_err(), e, "Direct, {l:?}");
            let counting = Counting::new(direct);
            assert!(counting.allocate(l).is_err());
            assert_eq!(counting.snapshot().failures, 1);

            source.heal();
            let b = pool.allocate(l).unwrap();
            // SAFETY: allocated above with `l`.
            unsafe { pool.deallocate(b.cast(), l) };
            assert!(arena.try_alloc_layout(l).is_ok());
            let b = counting.allocate(l).unwrap();
            // SAFETY: allocated above with `l`.
            unsafe { counting.deallocate(b.cast(), l) };
            assert_eq!(counting.snapshot().live_count(), 0);
            drop(arena);
            pool.trim();
            assert_eq!(source.held(), 0, "everything returned");
        }
    }
}

/// The arena, `Direct` and `Counting` around them through the same script, the source
/// failing at each call in turn: failures are clean and counted, held bytes match the
/// source's, and the allocators work after healing.
#[test]
fn arena_direct_and_counting_with_a_source_failing_at_every_call_in_turn() {
    for n in 0..12 {
        // Arena: a chunk that fails is asked for again at just the request's size, so
        // failing one call is absorbed; failing two is not.
        for fails in [1, 2] {
            let source = Faulty::default();
            let arena = Arena::with_config(source.clone(), ArenaConfig::host().with_first_chunk(64 * KIB));
            let counting = Counting::new(&arena);
            for k in 0..fails {
                source.fail_call_in(n + k);
            }
            let check = |t: &Tally| {
                assert_eq!(arena.allocated_bytes(), source.held());
                let s = counting.snapshot();
                assert_eq!((s.live_count() as usize, s.failures), (t.live.len(), t.failures));
            };
            let t = run_script(&counting, &check);
            if fails == 1 {
                assert!(
                    t.failures <= 1,
                    "N = {n}: one failed call fails at most one request"
                );
            }
            source.heal();
            let again = run_script(&counting, &|u| assert_eq!(u.failures, 0));
            free_all(&counting, again);
            free_all(&counting, t);
            assert_eq!(counting.snapshot().live_count(), 0);
            drop(arena);
            assert_eq!(source.held(), 0, "a dropped arena returns every chunk");
        }
        // Direct: one source call per block, so exactly the failed calls fail.
        let source = Faulty::default();
        let counting = Counting::new(Direct::new(source.clone()));
        source.fail_call_in(n);
        let t = run_script(&counting, &|t| {
            let s = counting.snapshot();
            assert_eq!((s.live_count() as usize, s.failures), (t.live.len(), t.failures));
        });
        assert_eq!(t.failures as usize, source.failed(), "N = {n}");
        free_all(&counting, t);
        assert_eq!((counting.snapshot().live_count(), source.held()), (0, 0));
    }
}

/// A `Vec` whose growth fails midway (the source dies while it doubles) keeps its
/// contents and its allocation, the allocator's counters stay right, and once the source
/// is back the `Vec` grows on.
#[test]
fn vec_growth_failing_midway_keeps_the_vec_and_the_allocator() {
    fn grow_through_a_fault<A: Allocator>(a: A, source: &Faulty, what: &str) {
        let mut v: AVec<u64, A> = AVec::new_in(a);
        let mut pushed = 0u64;
        let mut failed = false;
        while pushed < 2_000_000 {
            if pushed == 300_000 {
                source.fail_every(Error::OutOfMemory { requested: 0 });
            }
            if v.len() == v.capacity() {
                let want = v.capacity().max(64);
                if v.try_reserve(want).is_err() {
                    failed = true;
                    assert_eq!(v.len() as u64, pushed);
                    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * 7), "{what}");
                    source.heal();
                    continue;
                }
            }
            v.push(pushed * 7);
            pushed += 1;
        }
        assert!(failed, "{what}: the growth never met the fault");
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * 7), "{what}");
    }
    for config in [tight(), PoolConfig::default()] {
        let source = Faulty::default();
        let pool = Pool::with_config(source.clone(), config);
        grow_through_a_fault(&pool, &source, "Pool");
        pool.trim(); // or the next Vec grows in the cached segments without a source call
        let counting = Counting::new(&pool);
        grow_through_a_fault(&counting, &source, "Counting<&Pool>");
        let s = counting.snapshot();
        assert_eq!(s.live_count(), 0);
        assert!(s.failures >= 1);
        pool.trim();
        assert_pool_counts(&pool, 0, pool.stats().failures);
        assert_eq!(source.held(), 0);
    }
    let source = Faulty::default();
    let arena = Arena::with_config(source.clone(), ArenaConfig::host());
    grow_through_a_fault(&arena, &source, "Arena");
    drop(arena);
    let direct = Counting::new(Direct::new(source.clone()));
    grow_through_a_fault(&direct, &source, "Counting<Direct>");
    assert_eq!(direct.snapshot().live_count(), 0);
    assert_eq!(source.held(), 0);
}

// ---- fences --------------------------------------------------------------------------

/// One pooled block of `l`, its use recorded with `fence`, freed: pending.
fn pending_block(pool: &Pool<Faulty>, l: Layout, fence: &Scripted) -> usize {
    let b = pool.allocate(l).unwrap();
    let addr = b.cast::<u8>().as_ptr() as usize;
    assert!(pool.record_fence(addr as *const u8, fence.clone()).unwrap());
    // SAFETY: allocated above with `l`; the fence stands for a use that touches nothing.
    unsafe { pool.deallocate(b.cast(), l) };
    addr
}

/// A fence that reports an error is not completion (the rule stated on `Fence`): the error
/// is counted in `cuda::drop_errors()`, the block stays pending (neither reused nor
/// lost), and comes back once the fence answers. Likewise for a fence whose seal fails.
/// An arena whose fence fails its wait gives its memory up (counted) and works on.
#[test]
fn a_fence_that_errors_is_counted_and_its_memory_stays_pending() {
    if crate::support::in_a_child_process_with_a_driver(
        "faults::a_fence_that_errors_is_counted_and_its_memory_stays_pending",
    ) {
        return;
    }
    for l in [layout(64, 8), layout(700 * KIB, 8)] {
        let pool = Pool::new(Faulty::default());
        let fence = Scripted::new(PENDING);
        pending_block(&pool, l, &fence);
        assert_eq!(pool.collect_pending(), 0);
        assert_eq!(pool.stats().pending_blocks, 1);
        let errors = cudalloc::cuda::drop_errors();
        fence.set(ERRORS);
        assert_eq!(pool.collect_pending(), 0, "an error is not completion");
        assert!(cudalloc::cuda::drop_errors() > errors, "and it is counted");
        let s = pool.stats();
        assert_eq!((s.pending_blocks, s.live_blocks), (1, 0), "{s:?}");
        assert_balanced(&s);
        fence.set(COMPLETE);
        assert_eq!(
            pool.collect_pending(),
            1,
            "the block comes back once the fence answers"
        );

        // A fence whose seal (at the free) fails: counted, and still polled for reuse.
        let mut fence = Scripted::new(ERRORS);
        fence.seal_fails = true;
        let errors = cudalloc::cuda::drop_errors();
        pending_block(&pool, l, &fence);
        assert!(cudalloc::cuda::drop_errors() > errors);
        pool.collect_pending();
        assert_eq!(pool.stats().pending_blocks, 1);
        fence.set(COMPLETE);
        pool.collect_pending();
        assert_eq!(pool.stats().pending_blocks, 0);
        pool.trim();
        assert_eq!((pool.stats().source_bytes, pool.source().held()), (0, 0));
    }

    // An arena: reset waits, the wait fails, the memory is given up; the arena works on.
    let source = Faulty::default();
    let mut arena = Arena::with_config(source.clone(), ArenaConfig::host());
    let p = arena.try_alloc_layout(layout(100, 8)).unwrap();
    let fence = Scripted::new(ERRORS);
    assert!(cudalloc::record_fence(p.as_ptr(), fence.clone()).unwrap());
    let errors = cudalloc::cuda::drop_errors();
    arena.reset();
    assert!(cudalloc::cuda::drop_errors() > errors);
    let s = arena.stats();
    assert_eq!(
        (s.gpu_wait_errors, s.abandoned_bytes, s.held_bytes),
        (1, 64 * KIB, 0),
        "{s:?}"
    );
    assert!(
        arena.try_alloc_layout(layout(100, 8)).is_ok(),
        "the arena works on"
    );
    fence.set(COMPLETE);
    arena.reset();
    let s = arena.stats();
    assert_eq!((s.gpu_wait_errors, s.pending_uses, s.chunks), (1, 0, 1), "{s:?}");
    drop(arena);
    assert_eq!(source.held(), 64 * KIB, "only the abandoned chunk is kept");
}

/// A fence that panics is not completion and is not lost: its block stays pending (the
/// pool neither reuses nor leaks it), `collect_pending` and `stats()` say so, and once the
/// fence answers the block comes back. A pool dropped while a fence still panics gives up
/// that memory (it stays with the source) rather than free it under the GPU, and does not
/// panic itself.
#[test]
fn a_fence_that_panics_keeps_its_block_pending_and_is_not_lost() {
    if crate::support::in_a_child_process_with_a_driver(
        "faults::a_fence_that_panics_keeps_its_block_pending_and_is_not_lost",
    ) {
        return;
    }
    for l in [layout(64, 8), layout(700 * KIB, 8)] {
        let source = Faulty::default();
        let pool = Pool::with_config(source.clone(), PoolConfig::default().with_pending_wait(None));
        let fence = Scripted::new(PANICS);
        let errors = cudalloc::cuda::drop_errors();
        let addr = pending_block(&pool, l, &fence);
        for _ in 0..3 {
            assert_eq!(pool.collect_pending(), 0, "a panic is not completion");
        }
        assert!(fence.polls() >= 3, "the fence was polled each time");
        assert!(cudalloc::cuda::drop_errors() > errors, "the panics are counted");
        let s = pool.stats();
        assert_eq!(
            (s.pending_blocks, s.pending_bytes >= l.size()),
            (1, true),
            "{s:?}"
        );
        assert_balanced(&s);
        // The block is not handed out meanwhile, on any path that drains the list.
        let mut held = Vec::new();
        for _ in 0..40 {
            let b = pool.allocate(l).unwrap();
            assert_ne!(
                b.cast::<u8>().as_ptr() as usize,
                addr,
                "a block with a panicking fence was reused"
            );
            held.push(b);
        }
        pool.trim();
        assert_eq!(pool.stats().pending_blocks, 1);
        for b in held {
            // SAFETY: allocated above with `l`.
            unsafe { pool.deallocate(b.cast(), l) };
        }
        // The fence answers: the block comes back.
        fence.set(COMPLETE);
        assert_eq!(pool.collect_pending(), 1);
        let s = pool.stats();
        assert_eq!((s.pending_blocks, s.live_blocks), (0, 0), "{s:?}");
        assert_balanced(&s);
        pool.trim();
        assert_eq!((pool.stats().source_bytes, source.held()), (0, 0));

        // Dropped while the fence still panics: no panic, no hang, the memory given up.
        let pool = Pool::new(source.clone());
        let fence = Scripted::new(PANICS);
        pending_block(&pool, l, &fence);
        let pending_memory = pool.stats().source_bytes;
        drop(pool);
        assert_eq!(
            source.held(),
            pending_memory,
            "the chunk or segment a GPU may still use is kept"
        );
    }

    // An arena whose fence panics: reset gives its memory up (counted), the arena works
    // on; once the fence answers, reset reuses memory again.
    let source = Faulty::default();
    let mut arena = Arena::with_config(source.clone(), ArenaConfig::host());
    let p = arena.try_alloc_layout(layout(100, 8)).unwrap();
    let fence = Scripted::new(PANICS);
    assert!(cudalloc::record_fence(p.as_ptr(), fence.clone()).unwrap());
    arena.reset();
    let s = arena.stats();
    assert_eq!(
        (s.gpu_wait_errors, s.abandoned_bytes, s.held_bytes),
        (1, 64 * KIB, 0),
        "{s:?}"
    );
    assert!(
        arena.try_alloc_layout(layout(100, 8)).is_ok(),
        "the arena works on"
    );
    fence.set(COMPLETE);
    arena.reset();
    let s = arena.stats();
    assert_eq!((s.gpu_wait_errors, s.pending_uses, s.chunks), (1, 0, 1), "{s:?}");
    drop(arena);
    assert_eq!(source.held(), 64 * KIB, "only the abandoned chunk is kept");
}

// ---- backpressure --------------------------------------------------------------------

const BLOCK: usize = MIB;

/// A pool over `source` holding at most 4 MiB, full of 4 pending 1 MiB blocks whose
/// fences are returned.
fn full_pool(source: &Faulty, wait: Option<Duration>) -> (Pool<Faulty>, Vec<Scripted>) {
    let pool = Pool::with_config(
        source.clone(),
        PoolConfig::default()
            .with_limit(4 * BLOCK)
            .with_pending_wait(wait),
    );
    let l = layout(BLOCK, 8);
    let fences: Vec<Scripted> = (0..4).map(|_| Scripted::new(PENDING)).collect();
    let blocks: Vec<_> = fences.iter().map(|_| pool.allocate(l).unwrap()).collect();
    for (b, f) in blocks.iter().zip(&fences) {
        assert!(pool.record_fence(b.cast::<u8>().as_ptr(), f.clone()).unwrap());
    }
    for b in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { pool.deallocate(b.cast(), l) };
    }
    let s = pool.stats();
    assert_eq!((s.pending_blocks, s.source_bytes), (4, 4 * BLOCK), "{s:?}");
    (pool, fences)
}

/// A pool at its limit whose pending blocks' fences complete from another thread after a
/// delay: the allocation waits and succeeds, and the pool never holds more than its limit.
#[test]
fn a_full_pool_waits_for_pending_blocks_and_never_passes_its_limit() {
    let source = Faulty::default();
    let (pool, fences) = full_pool(&source, Some(Duration::from_secs(20)));
    let completer = {
        let fences = fences.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            for f in fences {
                f.set(COMPLETE);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let l = layout(BLOCK, 8);
    let b = pool
        .try_allocate(l)
        .expect("waits for a pending block, then succeeds");
    let completed = fences
        .iter()
        .filter(|f| f.state.load(Ordering::Acquire) == COMPLETE)
        .count();
    assert!(
        completed >= 1,
        "the allocation returned before any fence completed"
    );
    let s = pool.stats();
    assert!(s.pending_waits >= 1, "{s:?}");
    assert_eq!(s.failures, 0, "{s:?}");
    assert!(
        source.peak() <= 4 * BLOCK,
        "held {} bytes past the 4 MiB limit",
        source.peak()
    );
    completer.join().unwrap();
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(b.cast(), l) };
    pool.collect_pending();
    pool.trim();
    assert_eq!((pool.stats().source_bytes, source.held()), (0, 0));
}

/// With `pending_wait(None)` a full pool fails at once (it does not wait for the
/// fences); with a short wait it fails after it; either way it works again once the
/// fences complete.
#[test]
fn a_full_pool_without_pending_wait_fails_at_once() {
    for wait in [None, Some(Duration::from_millis(30))] {
        let source = Faulty::default();
        let (pool, fences) = full_pool(&source, wait);
        let l = layout(BLOCK, 8);
        let e = pool
            .try_allocate(l)
            .expect_err("full, and the fences never complete");
        assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
        let s = pool.stats();
        assert_eq!(s.pending_waits > 0, wait.is_some(), "{s:?}");
        assert_eq!((s.failures, s.pending_blocks), (1, 4), "{s:?}");
        assert!(
            fences.iter().all(|f| f.born.elapsed() < WATCHDOG),
            "did not wait for the watchdog"
        );
        assert!(source.peak() <= 4 * BLOCK);
        for f in &fences {
            f.set(COMPLETE);
        }
        let b = pool.try_allocate(l).expect("the fences completed");
        // SAFETY: allocated above with `l`.
        unsafe { pool.deallocate(b.cast(), l) };
        pool.trim();
        assert_eq!(source.held(), 0);
    }
}

/// A request larger than the limit can never be met: it fails at once, without waiting
/// for the pending blocks (which could not make room for it) and without trimming.
#[test]
fn a_request_larger_than_the_limit_fails_without_waiting() {
    let source = Faulty::default();
    let (pool, fences) = full_pool(&source, Some(Duration::from_secs(20)));
    let e = pool
        .try_allocate(layout(5 * BLOCK, 8))
        .expect_err("larger than the 4 MiB limit");
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
    let s = pool.stats();
    assert_eq!(
        (s.pending_waits, s.failures, s.pending_blocks),
        (0, 1, 4),
        "{s:?}"
    );
    assert!(fences.iter().all(|f| f.state.load(Ordering::Acquire) == PENDING));
    for f in &fences {
        f.set(COMPLETE);
    }
    pool.collect_pending();
    pool.trim();
    assert_eq!(source.held(), 0);
}

/// A staging loop that outruns a fake GPU (a thread completing fences in order after a
/// delay each): every allocation succeeds, at the GPU's pace, and the pool never holds
/// more than its limit. `Counting` around the pool sees every block freed.
#[test]
fn a_staging_loop_that_outruns_the_gpu_runs_at_its_pace() {
    let source = Faulty::default();
    let pool = Pool::with_config(source.clone(), PoolConfig::default().with_limit(6 * BLOCK));
    let counting = Counting::new(&pool);
    let (tx, rx) = std::sync::mpsc::channel::<Scripted>();
    let gpu = std::thread::spawn(move || {
        for f in rx {
            std::thread::sleep(Duration::from_millis(2));
            f.set(COMPLETE);
        }
    });
    for round in 0..40u8 {
        let mut staging: AVec<u8, _> = AVec::with_capacity_in(BLOCK, &counting);
        staging.resize(BLOCK, round);
        let fence = Scripted::new(PENDING);
        assert!(cudalloc::record_fence(staging.as_ptr(), fence.clone()).unwrap());
        tx.send(fence).unwrap();
        drop(staging); // freed while the fake copy runs: pending until it completes
    }
    drop(tx);
    gpu.join().unwrap();
    assert!(
        source.peak() <= 6 * BLOCK,
        "held {} bytes past the 6 MiB limit",
        source.peak()
    );
    let s = pool.stats();
    assert_eq!(s.failures, 0, "{s:?}");
    let c = counting.snapshot();
    assert_eq!((c.live_count(), c.failures, c.allocs), (0, 0, 40));
    pool.collect_pending();
    pool.trim();
    assert_eq!(source.held(), 0);
}
