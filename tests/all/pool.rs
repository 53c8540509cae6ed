//! The caching pool: the conformance suite over `Pool` on every source, a property test
//! against a model (several threads, recorded uses, accounting after every step), limits
//! and trim, and on the GPU the reuse race that the pending list prevents.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::vec::Vec as AVec;
use cudalloc::cuda::{HostAllocFlags, Stream};
use cudalloc::pool::{Pool, PoolConfig, PoolStats};
use cudalloc::source::{HostSource, ManagedSource, MemorySource, PinnedSource, RegisteredSource};
use cudalloc::source::{PinnedGrowth, PinnedPoolSource};
use cudalloc::{copy, PinnedAlloc};
use proptest::prelude::*;

use crate::conformance::{suite, threads, Options};
use crate::model::{assert_drained, disjoint_ranges, retire, Block, Flag, Waiting};
use crate::support::assert_balanced;

/// A shape that exercises every path often: tiny thread caches, small chunks, a low
/// large-block threshold.
fn tight() -> PoolConfig {
    PoolConfig::default()
        .with_chunk_size(256 << 10)
        .with_large_threshold(8 << 10)
        .with_thread_cache_capacity(4)
        .with_thread_cache_bytes(64 << 10)
}

fn conformance_on<S: cudalloc::source::HostVisible + 'static>(
    source: S,
    config: PoolConfig,
    opts: Options,
    n_threads: usize,
) {
    let pool = Pool::with_config(source, config);
    suite(&pool, opts);
    threads(&pool, n_threads, opts);
    let s = quiescent(&pool);
    assert_eq!(s.live_blocks, 0, "{s:?}");
    assert_balanced(&s);
    trim_to_zero(&pool);
}

/// The pool's statistics once the threads of `threads` have finished exiting: its scope
/// may return before their locals (and so their caches) are destroyed, and a cache being
/// flushed shows its blocks as live for a moment.
fn quiescent<S: MemorySource + 'static>(pool: &Pool<S>) -> PoolStats {
    for _ in 0..200 {
        let s = pool.stats();
        if s.live_blocks == 0 && s.live_bytes + s.cached_bytes + s.pending_bytes == s.source_bytes {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    pool.stats()
}

/// Trims until the pool holds nothing, allowing exiting threads a moment to flush their
/// caches (see `quiescent`).
fn trim_to_zero<S: MemorySource + 'static>(pool: &Pool<S>) {
    for _ in 0..200 {
        pool.trim();
        if pool.stats().source_bytes == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let s = pool.stats();
    assert_eq!(
        (s.source_bytes, s.cached_bytes, s.live_bytes),
        (0, 0, 0),
        "after all frees and trim: {s:?}"
    );
}

#[test]
fn conformance_host_default() {
    conformance_on(HostSource, PoolConfig::default(), Options::default(), 4);
}

#[test]
fn conformance_host_tight() {
    conformance_on(HostSource, tight(), Options::default(), 4);
}

#[test]
fn conformance_host_without_thread_caches() {
    conformance_on(
        HostSource,
        PoolConfig::default().with_thread_cache_capacity(0),
        Options::default(),
        3,
    );
}

#[test]
fn conformance_through_a_reference() {
    let pool = Pool::new(HostSource);
    suite(&&pool, Options::default());
}

#[test]
fn conformance_on_cuda_sources() {
    gpu!();
    let opts = Options {
        random_ops: 1500,
        ..Options::default()
    };
    conformance_on(
        PinnedSource::new(HostAllocFlags::PORTABLE),
        PoolConfig::default(),
        opts,
        3,
    );
    conformance_on(PinnedSource::default(), tight(), opts, 3);
    conformance_on(RegisteredSource::new(false), PoolConfig::default(), opts, 3);
    conformance_on(
        PinnedPoolSource::new(HostAllocFlags::DEVICE_MAP, PinnedGrowth::Register),
        tight(),
        opts,
        3,
    );
    conformance_on(
        PinnedPoolSource::new(HostAllocFlags::DEFAULT, PinnedGrowth::Auto),
        PoolConfig::default(),
        opts,
        3,
    );
    conformance_on(ManagedSource::default(), PoolConfig::default(), opts, 3);
}

#[test]
fn stats_display_and_zero_after_trim() {
    let pool = Pool::new(HostSource);
    let mut v: AVec<u64, _> = AVec::new_in(&pool);
    v.extend(0..100_000);
    let big: AVec<u8, _> = AVec::with_capacity_in(5 << 20, &pool);
    let s = pool.stats();
    assert_eq!(s.live_blocks, 2);
    assert_balanced(&s);
    let text = s.to_string();
    for word in ["live", "cached", "pending", "source", "hits", "misses"] {
        assert!(text.contains(word), "{word} missing from\n{text}");
    }
    drop((v, big));
    pool.trim();
    let s = pool.stats();
    assert_eq!(
        (s.live_bytes, s.cached_bytes, s.pending_bytes, s.source_bytes),
        (0, 0, 0, 0),
        "{s:?}"
    );
}

#[test]
fn past_the_cap_allocation_fails_and_the_process_goes_on() {
    let pool = Pool::with_config(HostSource, PoolConfig::default().with_limit(8 << 20));
    let l = Layout::from_size_align(3 << 20, 64).unwrap();
    let a = pool.allocate(l).unwrap();
    let b = pool.allocate(l).unwrap();
    assert!(pool.allocate(l).is_err(), "9 MiB held would pass the 8 MiB cap");
    let mut v: AVec<u8, _> = AVec::new_in(&pool);
    assert!(v.try_reserve(16 << 20).is_err());
    assert!(pool.stats().failures >= 2);
    assert!(pool.stats().source_bytes <= 8 << 20);
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(a.cast(), l) };
    // Under the cap again after trimming (done by the failed path's retry or here).
    let c = pool.allocate(Layout::from_size_align(64, 8).unwrap()).unwrap();
    // SAFETY: allocated above.
    unsafe {
        pool.deallocate(b.cast(), l);
        pool.deallocate(c.cast(), Layout::from_size_align(64, 8).unwrap());
    }
    pool.set_limit(None);
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0);
}

// ---- property test -----------------------------------------------------------------

type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs jobs one at a time, so each thread keeps its own cache.
struct Worker {
    jobs: Option<mpsc::Sender<Job>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn new() -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let handle = std::thread::spawn(move || {
            for job in rx {
                job();
            }
        });
        Self {
            jobs: Some(tx),
            handle: Some(handle),
        }
    }

    fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .as_ref()
            .unwrap()
            .send(Box::new(move || tx.send(f()).unwrap()))
            .unwrap();
        rx.recv().expect("worker job panicked")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        // Joining makes the thread's exit (and its cache flush) happen-before what follows.
        self.handle.take().unwrap().join().unwrap();
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        thread: usize,
        size: usize,
        align_log: u32,
    },
    Free {
        thread: usize,
        pick: usize,
    },
    Grow {
        thread: usize,
        pick: usize,
        extra: usize,
    },
    Shrink {
        thread: usize,
        pick: usize,
        keep_per_mille: usize,
    },
    RecordUse {
        pick: usize,
    },
    Complete {
        pick: usize,
    },
    Trim {
        thread: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![6 => 1usize..600, 3 => 600usize..40_000, 1 => 40_000usize..3_000_000];
    prop_oneof![
        4 => (0..3usize, size, 0..13u32).prop_map(|(thread, size, align_log)| Op::Alloc { thread, size, align_log }),
        3 => (0..3usize, any::<usize>()).prop_map(|(thread, pick)| Op::Free { thread, pick }),
        1 => (0..3usize, any::<usize>(), 1usize..100_000).prop_map(|(thread, pick, extra)| Op::Grow { thread, pick, extra }),
        1 => (0..3usize, any::<usize>(), 0usize..1000).prop_map(|(thread, pick, keep_per_mille)| Op::Shrink { thread, pick, keep_per_mille }),
        1 => any::<usize>().prop_map(|pick| Op::RecordUse { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Complete { pick }),
        1 => (0..3usize).prop_map(|thread| Op::Trim { thread }),
    ]
}

fn fill(addr: usize, len: usize, tag: u8) {
    for i in 0..len {
        // SAFETY: the model only passes live blocks of at least `len` bytes.
        unsafe { (addr as *mut u8).add(i).write(tag ^ (i as u8)) };
    }
}

fn check(addr: usize, len: usize, tag: u8) -> bool {
    // SAFETY: as in `fill`.
    (0..len).all(|i| unsafe { (addr as *const u8).add(i).read() } == tag ^ (i as u8))
}

type SharedPool = Arc<Pool<HostSource>>;

fn run_ops(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let pool: SharedPool = Arc::new(Pool::with_config(HostSource, tight()));
    let workers: Vec<Worker> = (0..3).map(|_| Worker::new()).collect();
    let mut live: Vec<Block> = Vec::new();
    let mut waiting: Vec<Waiting> = Vec::new();
    let mut next_tag = 1u8;
    for (step, op) in ops.into_iter().enumerate() {
        let p = pool.clone();
        match op {
            Op::Alloc {
                thread,
                size,
                align_log,
            } => {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let tag = next_tag;
                next_tag = next_tag.wrapping_add(1);
                let (addr, len) = workers[thread].run(move || {
                    let b = p.allocate(layout).expect("allocate");
                    fill(b.cast::<u8>().as_ptr() as usize, layout.size(), tag);
                    (b.cast::<u8>().as_ptr() as usize, b.len())
                });
                prop_assert!(
                    len >= size && addr % layout.align() == 0,
                    "step {step}: bad block for {layout:?}"
                );
                live.push(Block {
                    addr,
                    layout,
                    tag,
                    fences: Vec::new(),
                });
            }
            Op::Free { thread, pick } if !live.is_empty() => {
                let b = live.swap_remove(pick % live.len());
                prop_assert!(
                    check(b.addr, b.layout.size(), b.tag),
                    "step {step}: contents corrupted"
                );
                let (addr, layout) = (b.addr, b.layout);
                workers[thread].run(move || {
                    // SAFETY: allocated by this pool with `layout`, freed once.
                    unsafe { p.deallocate(core::ptr::NonNull::new(addr as *mut u8).unwrap(), layout) }
                });
                retire(&mut waiting, b.addr, b.layout.size(), b.fences);
            }
            Op::Grow { thread, pick, extra } if !live.is_empty() => {
                let i = pick % live.len();
                let new =
                    Layout::from_size_align(live[i].layout.size() + extra, live[i].layout.align()).unwrap();
                let (old_addr, old) = (live[i].addr, live[i].layout);
                prop_assert!(
                    check(old_addr, old.size(), live[i].tag),
                    "step {step}: contents corrupted"
                );
                let addr = workers[thread].run(move || {
                    let ptr = core::ptr::NonNull::new(old_addr as *mut u8).unwrap();
                    // SAFETY: live block of this pool with layout `old`; new is larger.
                    let b = unsafe { p.grow(ptr, old, new) }.expect("grow");
                    b.cast::<u8>().as_ptr() as usize
                });
                let b = &mut live[i];
                prop_assert!(check(addr, old.size(), b.tag), "step {step}: grow lost contents");
                b.resized(&mut waiting, addr, new);
                fill(addr, new.size(), b.tag);
            }
            Op::Shrink {
                thread,
                pick,
                keep_per_mille,
            } if !live.is_empty() => {
                let i = pick % live.len();
                let (old_addr, old) = (live[i].addr, live[i].layout);
                let new = Layout::from_size_align(old.size() * keep_per_mille / 1000, old.align()).unwrap();
                let addr = workers[thread].run(move || {
                    let ptr = core::ptr::NonNull::new(old_addr as *mut u8).unwrap();
                    // SAFETY: live block of this pool with layout `old`; new is smaller.
                    let b = unsafe { p.shrink(ptr, old, new) }.expect("shrink");
                    b.cast::<u8>().as_ptr() as usize
                });
                let b = &mut live[i];
                prop_assert!(
                    check(addr, new.size(), b.tag),
                    "step {step}: shrink lost contents"
                );
                b.resized(&mut waiting, addr, new);
            }
            Op::RecordUse { pick } if live.iter().any(|b| b.layout.size() > 0) => {
                let sized: Vec<usize> = (0..live.len()).filter(|&i| live[i].layout.size() > 0).collect();
                let b = &mut live[sized[pick % sized.len()]];
                let flag = Arc::new(AtomicBool::new(false));
                // An interior pointer.
                let at = b.addr + (pick % b.layout.size());
                pool.record_fence(at as *const u8, Flag(flag.clone())).unwrap();
                b.fences.push(flag);
            }
            Op::Complete { pick } => {
                let open: Vec<Arc<AtomicBool>> = live
                    .iter()
                    .flat_map(|b| b.fences.iter())
                    .chain(waiting.iter().flat_map(|w| w.fences.iter()))
                    .filter(|f| !f.load(Ordering::Relaxed))
                    .cloned()
                    .collect();
                if !open.is_empty() {
                    open[pick % open.len()].store(true, Ordering::Release);
                }
            }
            Op::Trim { thread } => {
                workers[thread].run(move || p.trim());
            }
            _ => {}
        }
        waiting.retain(|w| w.fences.iter().any(|f| !f.load(Ordering::Relaxed)));
        // After every step: accounting, live count, no overlap, no waiting block reused.
        // (stats() only reads: completed pending blocks are collected first.)
        pool.collect_pending();
        let s = pool.stats();
        prop_assert_eq!(
            s.live_bytes + s.cached_bytes + s.pending_bytes,
            s.source_bytes,
            "step {}: {:?}",
            step,
            s
        );
        let sized: Vec<&Block> = live.iter().filter(|b| b.layout.size() > 0).collect();
        prop_assert_eq!(s.live_blocks, sized.len(), "step {}: {:?}", step, s);
        prop_assert_eq!(s.pending_blocks, waiting.len(), "step {}: {:?}", step, s);
        let ranges = disjoint_ranges(step, sized.iter().map(|b| (b.addr, b.layout.size())))?;
        for w in &waiting {
            for &(a, e) in &ranges {
                prop_assert!(
                    e <= w.range.0 || a >= w.range.1,
                    "step {}: a block waiting for its fences was reused",
                    step
                );
            }
        }
    }
    for b in live.drain(..) {
        prop_assert!(check(b.addr, b.layout.size(), b.tag), "final contents corrupted");
        let p = pool.clone();
        workers[0].run(move || {
            // SAFETY: allocated by this pool with `b.layout`, freed once.
            unsafe { p.deallocate(core::ptr::NonNull::new(b.addr as *mut u8).unwrap(), b.layout) }
        });
        for f in b.fences {
            f.store(true, Ordering::Release);
        }
    }
    for w in &waiting {
        for f in &w.fences {
            f.store(true, Ordering::Release);
        }
    }
    drop(workers); // thread exit flushes their caches
    assert_drained(&pool)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_over_threads_match_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run_ops(ops)?;
    }
}

// ---- GPU ---------------------------------------------------------------------------

const RACE_BYTES: usize = 256 << 20;
const A: u8 = 0xA5;
const B: u8 = 0x5A;

/// On a stream: 20 ms of host-function delay, then the async copy of a pooled 256 MiB
/// buffer of `A`s to the device. The buffer is dropped at once and the same size
/// allocated and filled with `B`s; after synchronizing, the device must hold only `A`s.
/// Returns the corrupted bytes over 20 rounds.
fn reuse_race(pending_list: bool) -> usize {
    let stream = Stream::new(0).unwrap();
    let pool = Pool::new(PinnedSource::default());
    #[cfg(feature = "test-hooks")]
    pool.set_pending_list_enabled(pending_list);
    #[cfg(not(feature = "test-hooks"))]
    assert!(
        pending_list,
        "switching the pending list off needs the test-hooks feature"
    );
    let mut dev = cudalloc::device::DevicePool::get(0)
        .unwrap()
        .alloc::<u8>(RACE_BYTES, &stream)
        .unwrap();
    let mut back = vec![0u8; RACE_BYTES];
    let mut corrupted = 0;
    let mut reused = 0;
    for _ in 0..20 {
        let mut a: AVec<u8, _> = AVec::with_capacity_in(RACE_BYTES, &pool);
        a.resize(RACE_BYTES, A);
        stream
            .launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(20)))
            .unwrap();
        // SAFETY: `a` is not written after this call (it is dropped: the pool keeps the
        // block from reuse until the copy completes, unless the test switched that off).
        unsafe { copy::host_to_device_async(&a, &mut dev, 0) }.unwrap();
        let a_ptr = a.as_ptr();
        drop(a);
        let mut b: AVec<u8, _> = AVec::with_capacity_in(RACE_BYTES, &pool);
        reused += usize::from(b.as_ptr() == a_ptr);
        b.resize(RACE_BYTES, B);
        stream.synchronize().unwrap();
        dev.copy_to_host(&mut back).unwrap();
        corrupted += back.iter().filter(|&&x| x != A).count();
        drop(b);
    }
    println!("reuse race (pending list {pending_list}): {corrupted} corrupted bytes, block reused at once in {reused}/20 rounds");
    drop(dev);
    pool.trim();
    corrupted
}

#[test]
fn reuse_race_never_corrupts_with_the_pending_list() {
    gpu!();
    assert_eq!(
        reuse_race(true),
        0,
        "a pooled block was reused while a copy still read it"
    );
}

#[cfg(feature = "test-hooks")]
#[test]
fn reuse_race_corrupts_without_the_pending_list() {
    gpu!();
    // The control: the same test with the pending list off must see corruption, or the
    // test above could not fail.
    assert!(
        reuse_race(false) > 0,
        "the race did not show: the test above proves nothing"
    );
}

#[test]
fn pinned_cap_and_stats_on_the_gpu() {
    gpu!();
    let pool = Pool::with_config(
        PinnedSource::default(),
        PoolConfig::default().with_limit(64 << 20),
    );
    let l = Layout::from_size_align(40 << 20, 4096).unwrap();
    let a = pool.allocate(l).unwrap();
    assert!(pool.allocate(l).is_err(), "80 MiB would pass the 64 MiB cap");
    let small: AVec<u8, _> = AVec::with_capacity_in(1000, &pool);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.cast(), l) };
    drop(small);
    pool.trim();
    let s = pool.stats();
    assert_eq!((s.live_bytes, s.source_bytes), (0, 0), "{s:?}");
    // The process-wide pinned pools refuse past their shared cap without a driver call.
    let mut v: AVec<u8, _> = AVec::new_in(PinnedAlloc);
    assert!(v
        .try_reserve(PinnedAlloc::limit().unwrap_or(usize::MAX / 2).saturating_add(1))
        .is_err());
    let s = PinnedAlloc::stats();
    println!("process-wide pinned pools:\n{s}");
    assert!(s.failures >= 1);
}

#[test]
fn pinned_growth_sources_report_their_kind() {
    let s = PinnedPoolSource::new(HostAllocFlags::PORTABLE, PinnedGrowth::Register);
    assert_eq!(s.kind(), cudalloc::cuda::MemoryType::Registered);
    let s = PinnedPoolSource::new(HostAllocFlags::PORTABLE, PinnedGrowth::HostAlloc);
    assert_eq!(s.kind(), cudalloc::cuda::MemoryType::PinnedHost);
    let s = PinnedPoolSource::new(HostAllocFlags::PORTABLE, PinnedGrowth::Auto);
    assert_eq!(s.kind(), cudalloc::cuda::MemoryType::PinnedHost);
}

#[test]
fn auto_growth_pins_every_size_and_frees_it_by_the_path_it_took() {
    gpu!();
    use cudalloc::cuda::{pointer_info, MemoryType};
    use cudalloc::source::MemorySource;
    let s = PinnedPoolSource::new(HostAllocFlags::DEFAULT, PinnedGrowth::Auto);
    for size in [
        2 << 20,
        64 << 20, // from here Auto uses cuMemHostAlloc on a machine with one CPU
        (64 << 20) + 4096,
    ] {
        let p = s.allocate(size).unwrap();
        let info = pointer_info(p.as_ptr()).unwrap();
        assert_eq!(info.memory_type, MemoryType::PinnedHost, "{size} bytes");
        // SAFETY: allocated just above with `size`, unused. Freed by the path that
        // allocated it, or the driver reports an error (counted in drop_errors).
        unsafe { s.deallocate(p, size) };
    }
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}
