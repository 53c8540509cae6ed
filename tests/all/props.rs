//! Model-based property tests: random programs of allocations, frees, grows and shrinks
//! (to other alignments, zeroed or not), recorded GPU uses (fake fences) and their
//! completion, trims, thread exits and concurrent bursts, run on 4 worker threads against
//! a model of the live and the pending blocks. After every step: contents intact, blocks
//! aligned and disjoint, no block whose fences are unfinished handed out again, and the
//! allocator's own counters (pool statistics, `Counting` snapshots) equal to the model's.
//!
//! Subjects: `Pool` in three shapes, `&Pool`, `Counting<&Pool>`, the handles (with
//! `Counting` around them), `Direct`, `Global` as the reference; and the arena, single
//! threaded (it is `!Sync`), against a model of checkpoints, rewinds, resets, its limit
//! and the blocks a recorded use protects.
//!
//! Over 10,000 cases in all (a couple of minutes on two cores in the debug profile);
//! `PROPTEST_CASES=n` runs `n` cases per test instead.

use core::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{Scope, ScopedJoinHandle};

use allocator_api2::alloc::{Allocator, Global, Layout};
use cudalloc::arena::{Arena, ArenaConfig, Checkpoint};
use cudalloc::fence::Fence;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;
use cudalloc::{Counting, Direct, ManagedAlloc, PinnedAlloc};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use crate::model::{assert_drained, disjoint_ranges, retire, Block, Flag, Waiting};

const THREADS: usize = 4;

/// `n`, or `PROPTEST_CASES` when set.
fn cases(n: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n)
}

fn config(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(n),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- fences ---------------------------------------------------------------------------

/// The flags of a case, all set when it ends however it ends: an allocator dropped with
/// a pending block waits for its fences.
#[derive(Default)]
struct OpenFences(Vec<Arc<AtomicBool>>);

impl OpenFences {
    fn new_flag(&mut self) -> Arc<AtomicBool> {
        let f = Arc::new(AtomicBool::new(false));
        self.0.push(f.clone());
        f
    }
}

impl Drop for OpenFences {
    fn drop(&mut self) {
        for f in &self.0 {
            f.store(true, Ordering::Release);
        }
    }
}

// ---- contents -------------------------------------------------------------------------

fn fill(addr: usize, len: usize, tag: u8) {
    for i in 0..len {
        // SAFETY: the model passes live blocks of at least `len` bytes.
        unsafe { (addr as *mut u8).add(i).write(tag ^ (i as u8) ^ (i >> 8) as u8) };
    }
}

fn intact(addr: usize, len: usize, tag: u8) -> bool {
    // SAFETY: as in `fill`.
    (0..len).all(|i| unsafe { (addr as *const u8).add(i).read() } == tag ^ (i as u8) ^ (i >> 8) as u8)
}

fn zero(addr: usize, from: usize, to: usize) -> bool {
    // SAFETY: the model passes blocks of at least `to` bytes.
    (from..to).all(|i| unsafe { (addr as *const u8).add(i).read() } == 0)
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

// ---- workers --------------------------------------------------------------------------

type Job<'env> = Box<dyn FnOnce() + Send + 'env>;

/// A thread that runs jobs one at a time, so each keeps its own thread caches; joined
/// when dropped (its exit flushes them).
struct Worker<'scope, 'env> {
    jobs: Option<mpsc::Sender<Job<'env>>>,
    handle: Option<ScopedJoinHandle<'scope, ()>>,
}

impl<'scope, 'env> Worker<'scope, 'env> {
    fn new(s: &'scope Scope<'scope, 'env>) -> Self {
        let (tx, rx) = mpsc::channel::<Job<'env>>();
        let handle = s.spawn(move || {
            for job in rx {
                job();
            }
        });
        Self {
            jobs: Some(tx),
            handle: Some(handle),
        }
    }

    /// Queues `f`; its result comes on the returned channel.
    fn submit<R: Send + 'env>(&self, f: impl FnOnce() -> R + Send + 'env) -> mpsc::Receiver<R> {
        let (tx, rx) = mpsc::channel();
        let job: Job<'env> = Box::new(move || {
            let _ = tx.send(f());
        });
        self.jobs.as_ref().unwrap().send(job).expect("worker gone");
        rx
    }

    fn run<R: Send + 'env>(&self, f: impl FnOnce() -> R + Send + 'env) -> R {
        self.submit(f).recv().expect("a worker's job panicked")
    }
}

impl Drop for Worker<'_, '_> {
    fn drop(&mut self) {
        drop(self.jobs.take());
        // An explicit join: the thread has exited (its thread-local caches flushed) when
        // it returns. A job's panic was reported already by `run`.
        let _ = self.handle.take().unwrap().join();
    }
}

// ---- the shared-allocator model -------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        thread: usize,
        size: usize,
        align_log: u32,
        zeroed: bool,
    },
    Free {
        thread: usize,
        pick: usize,
    },
    Grow {
        thread: usize,
        pick: usize,
        extra: usize,
        align_log: u32,
        zeroed: bool,
    },
    Shrink {
        thread: usize,
        pick: usize,
        keep_per_mille: usize,
        align_log: u32,
    },
    RecordUse {
        pick: usize,
        at: usize,
    },
    Complete {
        pick: usize,
    },
    Trim {
        thread: usize,
    },
    /// Every worker at once: a few allocations, frees and grows of its own; the blocks it
    /// keeps join the model.
    Burst {
        seed: u64,
    },
    /// A worker's thread exits (its caches go back) and a fresh one takes its place.
    Exit {
        thread: usize,
    },
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![12 => 0usize..600, 5 => 600usize..20_000, 1 => 20_000usize..700_000]
}

fn op() -> impl Strategy<Value = Op> {
    let t = 0..THREADS;
    prop_oneof![
        8 => (t.clone(), size(), 0..13u32, any::<bool>())
            .prop_map(|(thread, size, align_log, zeroed)| Op::Alloc { thread, size, align_log, zeroed }),
        6 => (t.clone(), any::<usize>()).prop_map(|(thread, pick)| Op::Free { thread, pick }),
        2 => (t.clone(), any::<usize>(), 1usize..60_000, 0..13u32, any::<bool>())
            .prop_map(|(thread, pick, extra, align_log, zeroed)| Op::Grow { thread, pick, extra, align_log, zeroed }),
        2 => (t.clone(), any::<usize>(), 0usize..1000, 0..13u32)
            .prop_map(|(thread, pick, keep_per_mille, align_log)| Op::Shrink { thread, pick, keep_per_mille, align_log }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(pick, at)| Op::RecordUse { pick, at }),
        2 => any::<usize>().prop_map(|pick| Op::Complete { pick }),
        1 => t.clone().prop_map(|thread| Op::Trim { thread }),
        1 => any::<u64>().prop_map(|seed| Op::Burst { seed }),
        1 => t.prop_map(|thread| Op::Exit { thread }),
    ]
}

fn ops(max: usize) -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 1..max)
}

/// What the model knows, for the subject's own checks.
struct View {
    /// Live blocks of nonzero size, and their bytes (as asked).
    live_blocks: usize,
    live_bytes: usize,
    /// Freed blocks with unfinished recorded uses.
    waiting: usize,
}

/// The allocator under test, and what it can check against the model.
struct Subject<'a, A> {
    a: &'a A,
    /// Returns cached memory (a pool's trim), on the calling (worker) thread.
    trim: &'a (dyn Fn() + Sync),
    /// The allocator's counters against the model, at quiet points (every worker idle).
    check: &'a dyn Fn(&View) -> Result<(), TestCaseError>,
    /// After every block was freed, every fence completed and every worker exited.
    check_end: &'a dyn Fn() -> Result<(), TestCaseError>,
}

/// A block handed between threads by address.
#[derive(Clone, Copy)]
struct Raw {
    addr: usize,
    len: usize,
}

impl Raw {
    fn of(b: NonNull<[u8]>) -> Raw {
        Raw {
            addr: b.cast::<u8>().as_ptr() as usize,
            len: b.len(),
        }
    }
}

fn ptr(addr: usize) -> NonNull<u8> {
    NonNull::new(addr as *mut u8).expect("the model holds no null block")
}

fn alloc_on<A: Allocator>(a: &A, l: Layout, zeroed: bool) -> Raw {
    let b = if zeroed {
        a.allocate_zeroed(l)
    } else {
        a.allocate(l)
    };
    let b = b.unwrap_or_else(|_| panic!("allocate {l:?}"));
    Raw::of(b)
}

/// One burst on one worker: allocations (checked against `taken`, the waiting and live
/// blocks of the model), frees and grows of its own; returns the blocks it keeps.
fn burst<A: Allocator>(a: &A, seed: u64, taken: &[(usize, usize)]) -> Result<Vec<(Raw, Layout, u8)>, String> {
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut mine: Vec<(Raw, Layout, u8)> = Vec::new();
    for _ in 0..12 {
        let r = next();
        if r % 3 != 0 || mine.is_empty() {
            let size = 1 + (next() % if r % 7 == 0 { 30_000 } else { 700 }) as usize;
            let l = Layout::from_size_align(size, 1 << (next() % 8)).unwrap();
            let b = alloc_on(a, l, false);
            if taken.iter().any(|&w| overlaps(w, (b.addr, b.addr + size))) {
                return Err(format!("burst: a waiting or live block was handed out for {l:?}"));
            }
            let tag = next() as u8;
            fill(b.addr, size, tag);
            mine.push((b, l, tag));
        } else {
            let (b, l, tag) = mine.swap_remove((next() as usize) % mine.len());
            if !intact(b.addr, l.size(), tag) {
                return Err("burst: contents corrupted".into());
            }
            if r % 2 == 0 {
                // SAFETY: allocated by this worker with `l`, freed once.
                unsafe { a.deallocate(ptr(b.addr), l) };
            } else {
                let new = Layout::from_size_align(l.size() * 2 + 8, l.align()).unwrap();
                // SAFETY: live with `l`; new is larger.
                let g = unsafe { a.grow(ptr(b.addr), l, new) }.map_err(|_| "burst: grow failed")?;
                let g = Raw::of(g);
                if !intact(g.addr, l.size(), tag) {
                    return Err("burst: grow lost contents".into());
                }
                if taken.iter().any(|&w| overlaps(w, (g.addr, g.addr + new.size()))) {
                    return Err(format!("burst: a grow to {new:?} took a waiting or live block"));
                }
                fill(g.addr, new.size(), tag);
                mine.push((g, new, tag));
            }
        }
    }
    Ok(mine)
}

/// Runs `ops` against `subject` on `THREADS` workers and checks it against the model.
fn run_model<A: Allocator + Sync>(subject: &Subject<'_, A>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut fences = OpenFences::default();
    let a = subject.a;
    let trim = subject.trim;
    let result = std::thread::scope(|s| -> Result<(), TestCaseError> {
        let mut workers: Vec<Worker<'_, '_>> = (0..THREADS).map(|_| Worker::new(s)).collect();
        let mut live: Vec<Block> = Vec::new();
        let mut waiting: Vec<Waiting> = Vec::new();
        let mut next_tag = 1u8;
        let mut tag = || {
            next_tag = next_tag.wrapping_add(1);
            next_tag
        };
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Alloc {
                    thread,
                    size,
                    align_log,
                    zeroed,
                } => {
                    let l = Layout::from_size_align(size, 1 << align_log).unwrap();
                    let b = workers[thread].run(move || alloc_on(a, l, zeroed));
                    prop_assert!(
                        b.len >= size && b.addr % l.align() == 0,
                        "step {}: bad block for {:?}",
                        step,
                        l
                    );
                    if zeroed {
                        prop_assert!(zero(b.addr, 0, b.len), "step {}: allocate_zeroed not zero", step);
                    }
                    let t = tag();
                    fill(b.addr, size, t);
                    live.push(Block {
                        addr: b.addr,
                        layout: l,
                        tag: t,
                        fences: Vec::new(),
                    });
                }
                Op::Free { thread, pick } if !live.is_empty() => {
                    let b = live.swap_remove(pick % live.len());
                    prop_assert!(
                        intact(b.addr, b.layout.size(), b.tag),
                        "step {}: contents corrupted",
                        step
                    );
                    let (addr, l) = (b.addr, b.layout);
                    // SAFETY: allocated by `a` with `l`, freed once.
                    workers[thread].run(move || unsafe { a.deallocate(ptr(addr), l) });
                    retire(&mut waiting, b.addr, b.layout.size(), b.fences);
                }
                Op::Grow {
                    thread,
                    pick,
                    extra,
                    align_log,
                    zeroed,
                } if !live.is_empty() => {
                    let i = pick % live.len();
                    let (old_addr, old) = (live[i].addr, live[i].layout);
                    prop_assert!(
                        intact(old_addr, old.size(), live[i].tag),
                        "step {}: corrupted",
                        step
                    );
                    let new = Layout::from_size_align(old.size() + extra, 1 << align_log).unwrap();
                    let g = workers[thread].run(move || {
                        // SAFETY: live block of `a` with `old`; new is larger.
                        let g = unsafe {
                            if zeroed {
                                a.grow_zeroed(ptr(old_addr), old, new)
                            } else {
                                a.grow(ptr(old_addr), old, new)
                            }
                        }
                        .expect("grow");
                        Raw::of(g)
                    });
                    let b = &mut live[i];
                    check_resized(step, "grow", &g, new, old.size(), b.tag, zeroed)?;
                    b.resized(&mut waiting, g.addr, new);
                    fill(g.addr, new.size(), b.tag);
                }
                Op::Shrink {
                    thread,
                    pick,
                    keep_per_mille,
                    align_log,
                } if !live.is_empty() => {
                    let i = pick % live.len();
                    let (old_addr, old) = (live[i].addr, live[i].layout);
                    let new =
                        Layout::from_size_align(old.size() * keep_per_mille / 1000, 1 << align_log).unwrap();
                    let g = workers[thread].run(move || {
                        // SAFETY: live block of `a` with `old`; new is not larger.
                        let g = unsafe { a.shrink(ptr(old_addr), old, new) }.expect("shrink");
                        Raw::of(g)
                    });
                    let b = &mut live[i];
                    check_resized(step, "shrink", &g, new, new.size(), b.tag, false)?;
                    b.resized(&mut waiting, g.addr, new);
                }
                Op::RecordUse { pick, at } if live.iter().any(|b| b.layout.size() > 0) => {
                    let sized: Vec<usize> = (0..live.len()).filter(|&i| live[i].layout.size() > 0).collect();
                    let b = &mut live[sized[pick % sized.len()]];
                    let flag = fences.new_flag();
                    // An interior pointer, found through the range registry.
                    let interior = b.addr + at % b.layout.size();
                    let recorded = cudalloc::record_fence(interior as *const u8, Flag(flag.clone()));
                    prop_assert!(recorded.is_ok(), "step {}: record_fence: {:?}", step, recorded);
                    if recorded == Ok(true) {
                        b.fences.push(flag);
                    }
                }
                Op::Complete { pick } => {
                    let open: Vec<&Arc<AtomicBool>> =
                        fences.0.iter().filter(|f| !f.load(Ordering::Relaxed)).collect();
                    if !open.is_empty() {
                        open[pick % open.len()].store(true, Ordering::Release);
                    }
                }
                Op::Trim { thread } => workers[thread].run(trim),
                Op::Burst { seed } => {
                    // No block a worker gets may overlap a waiting or a live one.
                    let ranges: Vec<(usize, usize)> = waiting
                        .iter()
                        .map(|w| w.range)
                        .chain(live.iter().map(|b| (b.addr, b.addr + b.layout.size())))
                        .filter(|r| r.1 > r.0)
                        .collect();
                    let pending: Vec<_> = workers
                        .iter()
                        .enumerate()
                        .map(|(t, w)| {
                            let ranges = ranges.clone();
                            w.submit(move || burst(a, seed.wrapping_add(t as u64), &ranges))
                        })
                        .collect();
                    for rx in pending {
                        let kept = rx.recv().expect("a burst panicked");
                        let kept = kept.map_err(|e| TestCaseError::fail(format!("step {step}: {e}")))?;
                        for (b, l, t) in kept {
                            live.push(Block {
                                addr: b.addr,
                                layout: l,
                                tag: t,
                                fences: Vec::new(),
                            });
                        }
                    }
                }
                Op::Exit { thread } => {
                    workers[thread] = Worker::new(s); // the old one is joined as it drops
                }
                _ => {}
            }
            waiting.retain(|w| w.fences.iter().any(|f| !f.load(Ordering::Relaxed)));
            // After every step: no overlap among live blocks, none over a waiting block,
            // the contents of all, and the subject's counters.
            let ranges = disjoint_ranges(step, live.iter().map(|b| (b.addr, b.layout.size())))?;
            for w in &waiting {
                prop_assert!(
                    !ranges.iter().any(|&r| overlaps(r, w.range)),
                    "step {}: a block waiting for its fences was handed out again",
                    step
                );
            }
            for b in &live {
                prop_assert!(
                    intact(b.addr, b.layout.size(), b.tag),
                    "step {}: contents corrupted",
                    step
                );
            }
            let view = View {
                live_blocks: ranges.len(),
                live_bytes: ranges.iter().map(|r| r.1 - r.0).sum(),
                waiting: waiting.len(),
            };
            (subject.check)(&view).map_err(|e| TestCaseError::fail(format!("step {step}: {e}")))?;
        }
        // Free what is left from a worker, complete every fence, let the workers exit.
        for b in live.drain(..) {
            prop_assert!(intact(b.addr, b.layout.size(), b.tag), "final contents corrupted");
            let (addr, l) = (b.addr, b.layout);
            // SAFETY: allocated by `a` with `l`, freed once.
            workers[0].run(move || unsafe { a.deallocate(ptr(addr), l) });
        }
        Ok(())
    });
    drop(fences); // every flag set
    result?;
    (subject.check_end)()
}

/// Checks the block `g` a grow or shrink (`what`) returned for `new`: fitted and aligned,
/// its first `kept` bytes still `tag`, and (for a zeroed grow) the rest zero.
fn check_resized(
    step: usize,
    what: &str,
    g: &Raw,
    new: Layout,
    kept: usize,
    tag: u8,
    zeroed: bool,
) -> Result<(), TestCaseError> {
    prop_assert!(
        g.len >= new.size() && g.addr % new.align() == 0,
        "step {}: bad {}",
        step,
        what
    );
    prop_assert!(intact(g.addr, kept, tag), "step {}: {} lost contents", step, what);
    if zeroed {
        prop_assert!(
            zero(g.addr, kept, g.len),
            "step {}: {}_zeroed left bytes",
            step,
            what
        );
    }
    Ok(())
}

// ---- subjects -------------------------------------------------------------------------

fn no_trim() {}

fn no_check(_: &View) -> Result<(), TestCaseError> {
    Ok(())
}

fn nothing_at_end() -> Result<(), TestCaseError> {
    Ok(())
}

/// A pool's statistics against the model: exact at a quiet point (pending blocks whose
/// fences completed are collected first: `stats()` only reads).
fn pool_check(pool: &Pool<HostSource>, v: &View) -> Result<(), TestCaseError> {
    pool.collect_pending();
    let s = pool.stats();
    prop_assert_eq!(
        s.live_bytes + s.cached_bytes + s.pending_bytes,
        s.source_bytes,
        "{:?}",
        s
    );
    prop_assert_eq!(s.live_blocks, v.live_blocks, "{:?}", s);
    prop_assert_eq!(s.pending_blocks, v.waiting, "{:?}", s);
    prop_assert!(s.live_bytes >= v.live_bytes, "{:?}", s);
    Ok(())
}

fn counting_check<A>(c: &Counting<A>, v: &View) -> Result<(), TestCaseError> {
    let s = c.snapshot();
    prop_assert_eq!(s.live_count() as usize, v.live_blocks, "{}", s);
    prop_assert_eq!(s.live_bytes() as usize, v.live_bytes, "{}", s);
    prop_assert_eq!(s.failures, 0, "{}", s);
    Ok(())
}

fn tight() -> PoolConfig {
    PoolConfig::default()
        .with_chunk_size(256 << 10)
        .with_large_threshold(8 << 10)
        .with_thread_cache_capacity(4)
        .with_thread_cache_bytes(64 << 10)
}

fn pool_case(config: PoolConfig, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let pool = Pool::with_config(HostSource, config);
    let trim = || {
        pool.trim();
    };
    let check = |v: &View| pool_check(&pool, v);
    let end = || assert_drained(&pool);
    run_model(
        &Subject {
            a: &pool,
            trim: &trim,
            check: &check,
            check_end: &end,
        },
        ops,
    )
}

proptest! {
    #![proptest_config(config(3000))]

    /// The pool shaped to cross every threshold often: small chunks, a low large
    /// threshold, tiny thread caches.
    #[test]
    fn pool_tight_matches_the_model_over_4_threads(ops in ops(40)) {
        pool_case(tight(), ops)?;
    }
}

proptest! {
    #![proptest_config(config(1200))]

    #[test]
    fn pool_default_matches_the_model_over_4_threads(ops in ops(40)) {
        pool_case(PoolConfig::default(), ops)?;
    }

    #[test]
    fn pool_without_thread_caches_matches_the_model_over_4_threads(ops in ops(40)) {
        pool_case(tight().with_thread_cache_capacity(0), ops)?;
    }

    /// `Counting` around `&Pool`: both the pool's statistics and the snapshots match.
    #[test]
    fn counting_around_a_pool_matches_the_model_over_4_threads(ops in ops(40)) {
        let pool = Pool::with_config(HostSource, tight());
        let counting = Counting::new(&pool);
        let trim = || { pool.trim(); };
        let check = |v: &View| {
            pool_check(&pool, v)?;
            counting_check(&counting, v)
        };
        let end = || {
            let s = counting.snapshot();
            prop_assert_eq!((s.live_count(), s.live_bytes()), (0, 0), "{}", s);
            assert_drained(&pool)
        };
        run_model(&Subject { a: &counting, trim: &trim, check: &check, check_end: &end }, ops)?;
    }
}

proptest! {
    #![proptest_config(config(600))]

    /// The process-wide handles (pinned pools with a driver, the pageable fallback
    /// without), counted exactly by `Counting` (the pools are shared with other tests).
    #[test]
    fn pinned_handle_matches_the_model_over_4_threads(ops in ops(30)) {
        let counting = Counting::new(PinnedAlloc);
        let check = |v: &View| counting_check(&counting, v);
        let end = || {
            prop_assert_eq!(counting.snapshot().live_count(), 0);
            Ok(())
        };
        run_model(&Subject { a: &counting, trim: &no_trim, check: &check, check_end: &end }, ops)?;
    }

    #[test]
    fn managed_handle_matches_the_model_over_4_threads(ops in ops(30)) {
        let counting = Counting::new(ManagedAlloc);
        let check = |v: &View| counting_check(&counting, v);
        run_model(&Subject { a: &counting, trim: &no_trim, check: &check, check_end: &nothing_at_end }, ops)?;
    }

    #[test]
    fn direct_matches_the_model_over_4_threads(ops in ops(30)) {
        let direct = Direct::new(HostSource);
        run_model(&Subject { a: &direct, trim: &no_trim, check: &no_check, check_end: &nothing_at_end }, ops)?;
    }

    /// The reference: `Global` passes the same model (which shows the model asks nothing
    /// an ordinary allocator does not do).
    #[test]
    fn global_matches_the_model_over_4_threads(ops in ops(30)) {
        run_model(&Subject { a: &Global, trim: &no_trim, check: &no_check, check_end: &nothing_at_end }, ops)?;
    }
}

// ---- the arena model -----------------------------------------------------------------

#[derive(Clone, Debug)]
enum ArenaOp {
    Alloc {
        size: usize,
        align_log: u32,
        zeroed: bool,
    },
    Free {
        pick: usize,
    },
    /// Frees the most recent block (the one the arena can reclaim).
    FreeLast,
    Grow {
        pick: usize,
        extra: usize,
        align_log: u32,
        zeroed: bool,
    },
    Shrink {
        pick: usize,
        keep_per_mille: usize,
        align_log: u32,
    },
    RecordUse {
        pick: usize,
        polls: u32,
    },
    Checkpoint,
    Rewind {
        pick: usize,
    },
    Reset,
}

fn arena_op() -> impl Strategy<Value = ArenaOp> {
    let size = prop_oneof![10 => 0usize..400, 4 => 400usize..20_000, 1 => 20_000usize..300_000];
    prop_oneof![
        10 => (size, 0..14u32, any::<bool>()).prop_map(|(size, align_log, zeroed)| ArenaOp::Alloc { size, align_log, zeroed }),
        2 => any::<usize>().prop_map(|pick| ArenaOp::Free { pick }),
        2 => Just(ArenaOp::FreeLast),
        3 => (any::<usize>(), 1usize..40_000, 0..14u32, any::<bool>())
            .prop_map(|(pick, extra, align_log, zeroed)| ArenaOp::Grow { pick, extra, align_log, zeroed }),
        2 => (any::<usize>(), 0usize..1000, 0..14u32)
            .prop_map(|(pick, keep_per_mille, align_log)| ArenaOp::Shrink { pick, keep_per_mille, align_log }),
        1 => (any::<usize>(), 0..4u32).prop_map(|(pick, polls)| ArenaOp::RecordUse { pick, polls }),
        2 => Just(ArenaOp::Checkpoint),
        1 => any::<usize>().prop_map(|pick| ArenaOp::Rewind { pick }),
        1 => Just(ArenaOp::Reset),
    ]
}

/// A fence that completes after a number of polls (a wait never blocks for long) and
/// says whether it did.
struct Countdown {
    left: AtomicU32,
    done: Arc<AtomicBool>,
}

// SAFETY: the simulated use touches no memory; once complete it stays complete.
unsafe impl Fence for Countdown {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        let left = self.left.load(Ordering::Relaxed);
        if left == 0 {
            self.done.store(true, Ordering::Release);
            return Ok(true);
        }
        self.left.store(left - 1, Ordering::Relaxed);
        Ok(false)
    }
}

struct ArenaBlock {
    addr: usize,
    layout: Layout,
    tag: u8,
    /// When it was last placed (allocated, or moved by a grow or shrink): a rewind to a
    /// checkpoint taken before that frees it.
    seq: u64,
    /// When it was first allocated (grows keep it).
    born: u64,
    /// The uses recorded while it existed: until they have completed (the arena waits for
    /// them in a reset or a rewind, or to free spare chunks under its limit), its bytes
    /// may not be reclaimed by a free or a grow.
    protected_by: Vec<Arc<AtomicBool>>,
}

/// Whether some of these uses have not completed.
fn open(uses: &[Arc<AtomicBool>]) -> bool {
    uses.iter().any(|d| !d.load(Ordering::Acquire))
}

/// Memory freed (or left by a moved block) while uses recorded on it were unfinished.
struct Guarded {
    range: (usize, usize),
    uses: Vec<Arc<AtomicBool>>,
}

/// The bytes an arena request needs from a chunk (a larger alignment than the source's
/// pages needs slack).
fn arena_need(l: Layout) -> usize {
    if l.align() <= 4096 {
        l.size()
    } else {
        l.size() + l.align() - 1
    }
}

fn run_arena_model(config: ArenaConfig, ops: Vec<ArenaOp>) -> Result<(), TestCaseError> {
    run_arena_model_with(config, ops, false)
}

/// The arena model; `skip_wait` (a negative control, with the `test-hooks` feature) makes
/// reset and rewind skip the wait for recorded uses.
fn run_arena_model_with(
    config: ArenaConfig,
    ops: Vec<ArenaOp>,
    skip_wait: bool,
) -> Result<(), TestCaseError> {
    let mut arena = Arena::with_config(HostSource, config);
    #[cfg(feature = "test-hooks")]
    arena.set_skip_gpu_wait(skip_wait);
    #[cfg(not(feature = "test-hooks"))]
    assert!(!skip_wait, "skipping the wait needs the test-hooks feature");
    let limit = config.limit;
    let mut live: Vec<ArenaBlock> = Vec::new();
    // Freed or moved protected blocks: no new block may overlap them until the arena has
    // waited for the recorded uses (in a reset, a rewind, or freeing spare chunks to make
    // room under its limit).
    let mut guarded: Vec<Guarded> = Vec::new();
    let mut uses: Vec<Arc<AtomicBool>> = Vec::new();
    // Checkpoints, when they were taken, and whether a block older than them was freed
    // or shrunk since (the arena may then have reclaimed memory above the mark; the
    // model does not rewind to such a mark, `rewind_after_freeing_the_block_before_the_mark`
    // covers it).
    let mut marks: Vec<Mark> = Vec::new();
    let mut seq = 0u64;
    // The arena holds no block (fresh, reset, or rewound to an empty mark): any request
    // within the limit must succeed (issue 12, defect 4).
    let mut empty = true;
    let mut tag = 0u8;
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            ArenaOp::Alloc {
                size,
                align_log,
                zeroed,
            } => {
                let l = Layout::from_size_align(size, 1 << align_log).unwrap();
                let held = arena.allocated_bytes();
                let r = if zeroed {
                    (&arena).allocate_zeroed(l)
                } else {
                    (&arena).allocate(l)
                };
                match r {
                    Ok(b) => {
                        let addr = b.cast::<u8>().as_ptr() as usize;
                        prop_assert!(
                            b.len() >= size && addr % l.align() == 0,
                            "step {}: bad block",
                            step
                        );
                        if zeroed {
                            prop_assert!(zero(addr, 0, b.len()), "step {}: allocate_zeroed not zero", step);
                        }
                        prop_assert!(
                            !guarded
                                .iter()
                                .any(|g| open(&g.uses) && overlaps(g.range, (addr, addr + size))),
                            "step {}: memory a recorded use protects was handed out again",
                            step
                        );
                        tag = tag.wrapping_add(1);
                        fill(addr, size, tag);
                        seq += 1;
                        live.push(ArenaBlock {
                            addr,
                            layout: l,
                            tag,
                            seq,
                            born: seq,
                            protected_by: Vec::new(),
                        });
                        if size > 0 {
                            empty = false;
                        }
                    }
                    Err(_) => {
                        let Some(limit) = limit else {
                            return Err(TestCaseError::fail(format!(
                                "step {step}: {l:?} failed with no limit"
                            )));
                        };
                        let need = arena_need(l);
                        prop_assert!(
                            need > limit.saturating_sub(held),
                            "step {}: {:?} failed with {} of {} bytes held",
                            step,
                            l,
                            held,
                            limit
                        );
                        prop_assert!(
                            !(empty && need <= limit),
                            "step {}: an empty arena refused {:?} within its limit of {}",
                            step,
                            l,
                            limit
                        );
                    }
                }
            }
            ArenaOp::Free { pick } if !live.is_empty() => {
                let b = live.swap_remove(pick % live.len());
                disturb(&mut marks, b.born);
                free_arena_block(&arena, b, &mut guarded, step)?;
            }
            ArenaOp::FreeLast if !live.is_empty() => {
                let i = (0..live.len()).max_by_key(|&i| live[i].seq).unwrap();
                let b = live.swap_remove(i);
                disturb(&mut marks, b.born);
                free_arena_block(&arena, b, &mut guarded, step)?;
            }
            ArenaOp::Grow {
                pick,
                extra,
                align_log,
                zeroed,
            } if !live.is_empty() => {
                let i = pick % live.len();
                let b = &live[i];
                let (old_addr, old) = (b.addr, b.layout);
                let new = Layout::from_size_align(old.size() + extra, 1 << align_log).unwrap();
                // SAFETY: live block of the arena with `old`; new is larger.
                let r = unsafe {
                    if zeroed {
                        (&arena).grow_zeroed(ptr(old_addr), old, new)
                    } else {
                        (&arena).grow(ptr(old_addr), old, new)
                    }
                };
                let Ok(g) = r else {
                    prop_assert!(limit.is_some(), "step {}: grow failed with no limit", step);
                    prop_assert!(
                        intact(old_addr, old.size(), b.tag),
                        "step {}: failed grow lost contents",
                        step
                    );
                    continue;
                };
                let addr = g.cast::<u8>().as_ptr() as usize;
                let raw = Raw { addr, len: g.len() };
                check_resized(step, "grow", &raw, new, old.size(), b.tag, zeroed)?;
                if open(&b.protected_by) {
                    // The old bytes may still be read by the GPU: the grown block may not
                    // have reclaimed them (an in-place grow moves a block down over free
                    // space, overlapping its old place).
                    prop_assert!(
                        !overlaps((addr, addr + new.size()), (old_addr, old_addr + old.size())),
                        "step {}: a protected block was grown over itself",
                        step
                    );
                    guard(&mut guarded, old_addr, old.size(), &b.protected_by);
                }
                prop_assert!(
                    !guarded
                        .iter()
                        .any(|g| open(&g.uses) && overlaps(g.range, (addr, addr + new.size()))),
                    "step {}: a grow took memory a recorded use protects",
                    step
                );
                let b = &mut live[i];
                seq += 1;
                b.seq = seq;
                b.addr = addr;
                b.layout = new;
                b.protected_by.clear();
                fill(addr, new.size(), b.tag);
                if new.size() > 0 {
                    empty = false;
                }
            }
            ArenaOp::Shrink {
                pick,
                keep_per_mille,
                align_log,
            } if !live.is_empty() => {
                let i = pick % live.len();
                let b = &live[i];
                let (old_addr, old) = (b.addr, b.layout);
                let new =
                    Layout::from_size_align(old.size() * keep_per_mille / 1000, 1 << align_log).unwrap();
                // SAFETY: live block with `old`; new is not larger.
                let Ok(g) = (unsafe { (&arena).shrink(ptr(old_addr), old, new) }) else {
                    prop_assert!(limit.is_some(), "step {}: shrink failed with no limit", step);
                    continue;
                };
                let addr = g.cast::<u8>().as_ptr() as usize;
                let raw = Raw { addr, len: g.len() };
                check_resized(step, "shrink", &raw, new, new.size(), b.tag, false)?;
                let within = addr >= old_addr && addr + new.size() <= old_addr + old.size();
                disturb(&mut marks, b.born);
                let b = &mut live[i];
                if !within {
                    guard(&mut guarded, old_addr, old.size(), &b.protected_by);
                    seq += 1;
                    b.seq = seq;
                    b.protected_by.clear();
                }
                b.addr = addr;
                b.layout = new;
            }
            ArenaOp::RecordUse { pick, polls } if live.iter().any(|b| b.layout.size() > 0) => {
                let sized: Vec<usize> = (0..live.len()).filter(|&i| live[i].layout.size() > 0).collect();
                let b = &live[sized[pick % sized.len()]];
                let done = Arc::new(AtomicBool::new(false));
                let fence = Countdown {
                    left: AtomicU32::new(polls),
                    done: done.clone(),
                };
                let recorded = cudalloc::record_fence(b.addr as *const u8, fence);
                prop_assert_eq!(recorded, Ok(true), "step {}: the arena owns its blocks", step);
                // Every block that exists now is protected until the use completes.
                for b in &mut live {
                    b.protected_by.push(done.clone());
                }
                uses.push(done);
            }
            ArenaOp::Checkpoint => {
                marks.push(Mark {
                    at: arena.checkpoint(),
                    seq,
                    disturbed: false,
                    empty,
                });
            }
            ArenaOp::Rewind { pick } if marks.iter().any(|m| !m.disturbed) => {
                let usable: Vec<usize> = (0..marks.len()).filter(|&i| !marks[i].disturbed).collect();
                let i = usable[pick % usable.len()];
                let Mark {
                    at: mark,
                    seq: at,
                    empty: was_empty,
                    ..
                } = marks[i];
                marks.truncate(i + 1);
                // Blocks placed after the mark are freed by the rewind; the others stay.
                live.retain(|b| b.seq <= at);
                arena.rewind(mark);
                prop_assert!(
                    uses.iter().all(|d| d.load(Ordering::Acquire)),
                    "step {}: rewind did not wait",
                    step
                );
                uses.clear();
                guarded.clear();
                for b in &mut live {
                    b.protected_by.clear();
                }
                // Empty again if it was empty at the mark (blocks freed since, but not
                // reclaimed, still take room otherwise).
                empty = was_empty;
            }
            ArenaOp::Reset => {
                live.clear();
                marks.clear();
                arena.reset();
                prop_assert!(
                    uses.iter().all(|d| d.load(Ordering::Acquire)),
                    "step {}: reset did not wait",
                    step
                );
                uses.clear();
                guarded.clear();
                prop_assert_eq!(arena.used_bytes(), 0);
                prop_assert!(arena.chunk_count() <= 1, "step {}: reset keeps one chunk", step);
                empty = true;
            }
            _ => {}
        }
        guarded.retain(|g| open(&g.uses));
        // After every step: blocks disjoint and intact, within the limit.
        disjoint_ranges(step, live.iter().map(|b| (b.addr, b.layout.size())))?;
        for b in &live {
            prop_assert!(
                intact(b.addr, b.layout.size(), b.tag),
                "step {}: contents corrupted",
                step
            );
        }
        if let Some(limit) = limit {
            prop_assert!(arena.allocated_bytes() <= limit, "step {}: past the limit", step);
        }
        let s = arena.stats();
        prop_assert_eq!((s.gpu_wait_errors, s.abandoned_bytes), (0, 0), "step {}", step);
    }
    drop(live);
    arena.reset();
    prop_assert_eq!(arena.used_bytes(), 0);
    Ok(())
}

/// A block born at `born` was freed or shrunk: marks taken after its birth may now lie
/// below memory the arena reclaimed.
fn disturb(marks: &mut [Mark], born: u64) {
    for m in marks.iter_mut().filter(|m| m.seq >= born) {
        m.disturbed = true;
    }
}

#[derive(Clone, Copy)]
struct Mark {
    at: Checkpoint,
    /// The model's sequence number then: blocks placed later are freed by a rewind.
    seq: u64,
    disturbed: bool,
    /// The arena held no block then.
    empty: bool,
}

/// A block the model frees: contents checked; a protected one joins the guarded ranges.
fn free_arena_block(
    arena: &Arena<HostSource>,
    b: ArenaBlock,
    guarded: &mut Vec<Guarded>,
    step: usize,
) -> Result<(), TestCaseError> {
    prop_assert!(
        intact(b.addr, b.layout.size(), b.tag),
        "step {}: contents corrupted",
        step
    );
    // SAFETY: a live block of the arena with `b.layout`, freed once.
    unsafe { Allocator::deallocate(&arena, ptr(b.addr), b.layout) };
    guard(guarded, b.addr, b.layout.size(), &b.protected_by);
    Ok(())
}

/// Memory a recorded use protects (a zero-size block protects nothing).
fn guard(guarded: &mut Vec<Guarded>, addr: usize, len: usize, uses: &[Arc<AtomicBool>]) {
    if len > 0 && open(uses) {
        guarded.push(Guarded {
            range: (addr, addr + len),
            uses: uses.to_vec(),
        });
    }
}

fn arena_config() -> impl Strategy<Value = ArenaConfig> {
    prop_oneof![
        Just(ArenaConfig::host()),
        (12..18u32).prop_map(|s| ArenaConfig::host()
            .with_first_chunk(1 << s)
            .with_max_chunk(1 << (s + 2))),
        (16..22u32).prop_map(|s| ArenaConfig::host().with_first_chunk(4096).with_limit(1 << s)),
    ]
}

proptest! {
    #![proptest_config(config(2500))]

    /// The arena against its model: checkpoints, rewinds and resets free exactly what
    /// they say, protected memory is not reclaimed before the recorded uses are waited
    /// for, the limit holds, and an empty arena accepts any request within its limit.
    #[test]
    fn arena_matches_the_model(config in arena_config(), ops in proptest::collection::vec(arena_op(), 1..60)) {
        run_arena_model(config, ops)?;
    }
}

// ---- negative controls: the models can fail -------------------------------------------

/// Runs `cases` cases of `strategy` through `test` and returns whether one failed
/// (no shrinking: only the verdict matters).
#[cfg(feature = "test-hooks")]
fn finds_a_failure<S: Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> bool {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: 0,
        ..ProptestConfig::default()
    });
    runner.run(&strategy, test).is_err()
}

/// A pool whose pending list is switched off hands out blocks whose recorded uses are
/// unfinished: the model (its overlap check alone, the pool's counters unchecked) must
/// catch it, or the tests above could not fail.
#[cfg(feature = "test-hooks")]
#[test]
fn the_model_catches_a_pool_that_reuses_blocks_before_their_fences() {
    let caught = finds_a_failure(2000, ops(40), |ops| {
        let pool = Pool::with_config(HostSource, tight());
        pool.set_pending_list_enabled(false);
        let trim = || {
            pool.trim();
        };
        run_model(
            &Subject {
                a: &pool,
                trim: &trim,
                check: &no_check,
                check_end: &nothing_at_end,
            },
            ops,
        )
    });
    assert!(
        caught,
        "the model never noticed a block reused before its fences completed"
    );
}

/// An arena whose reset and rewind skip the wait for recorded uses must fail the arena
/// model.
#[cfg(feature = "test-hooks")]
#[test]
fn the_arena_model_catches_an_arena_that_does_not_wait() {
    let caught = finds_a_failure(2000, proptest::collection::vec(arena_op(), 1..60), |ops| {
        run_arena_model_with(ArenaConfig::host(), ops, true)
    });
    assert!(caught, "the arena model never noticed a reset that did not wait");
}

/// Found by the arena model: a checkpoint taken while the arena's newest block is live,
/// then that block freed (the arena reclaims it, so its bump pointer moves above the
/// mark), then a rewind to the mark: the rewind panicked ("not a position of this
/// arena's current blocks"), though nothing allocated after the mark was live. The
/// rewind now leaves the pointer where it is.
#[test]
fn rewind_after_freeing_the_block_before_the_mark() {
    let mut arena = Arena::host();
    let v: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::with_capacity_in(100, &arena);
    let mark = arena.checkpoint();
    drop(v);
    arena.rewind(mark);
    assert_eq!(arena.used_bytes(), 0);
}
