//! What counting costs: an allocation-heavy workload (build and drop a `BTreeMap` of
//! 10^5 `String`s) under the system allocator, `Counting<System>` and stats_alloc's
//! `StatsAlloc<System>`, in one run.
//!
//! How it measures: the workload allocates through the *global* allocator (std's
//! `BTreeMap` and `String` take no allocator parameter, and `StatsAlloc` is only a
//! `GlobalAlloc`), so this binary installs one `#[global_allocator]`, `Switch`, that
//! forwards every call to System, `Counting<System>` or `StatsAlloc<System>` by a
//! static mode set at the start of each benchmark. All three rows pay the same switch
//! (one relaxed load and a predictable branch), so the ratios compare the counting
//! itself; all memory comes from System whatever the mode, so a block allocated under
//! one mode (criterion's own bookkeeping) may be freed under another, which only skews
//! counters nobody reads here. Each iteration allocates and frees everything it uses.
//!
//! A second question, in groups `pair_1_thread` and `pair_8_threads`: what counting adds
//! to one allocation pair (allocate, touch the first and last byte, free; as `ab`'s
//! latency table), at 256 B, 64 KiB, 1 MiB and 16 MiB, on one thread and on 8 at once,
//! against `Global` and stats_alloc, and (row `Counting<Global>, window open`) what it
//! costs while a leak-check `Window` is open on the thread. Rows on 8 threads time one
//! pair on each thread. The `Global` and `Counting<Global>` rows are timed interleaved
//! (`workload::alloc_free_interleaved`: batches of 256 pairs alternating between the two,
//! each row timing its own), so that their ratio compares the allocators under the same
//! conditions rather than two stretches of a machine's time.
//!
//! Run: `cargo bench --bench counting -- --warm-up-time 1 --measurement-time 3`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{AllocError, Allocator, Global};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cudalloc::count::{Counting, Window};
use cudalloc::testing::workload::{alloc_free, alloc_free_interleaved};
use stats_alloc::StatsAlloc;

const SYSTEM: u8 = 0;
const COUNTING: u8 = 1;
const STATS: u8 = 2;

static MODE: AtomicU8 = AtomicU8::new(SYSTEM);
static COUNTED: Counting<System> = Counting::new(System);
static STATS_ALLOC: StatsAlloc<System> = StatsAlloc::system();

/// The global allocator: System, Counting<System> or StatsAlloc<System>, per `MODE`.
struct Switch;

// SAFETY: every call goes to one of three allocators that all hand out System's blocks
// and free them with System, so a block may be freed under any mode.
unsafe impl GlobalAlloc for Switch {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        unsafe {
            match MODE.load(Relaxed) {
                COUNTING => COUNTED.alloc(layout),
                STATS => STATS_ALLOC.alloc(layout),
                _ => System.alloc(layout),
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        unsafe {
            match MODE.load(Relaxed) {
                COUNTING => COUNTED.alloc_zeroed(layout),
                STATS => STATS_ALLOC.alloc_zeroed(layout),
                _ => System.alloc_zeroed(layout),
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded; every mode frees with System.
        unsafe {
            match MODE.load(Relaxed) {
                COUNTING => COUNTED.dealloc(ptr, layout),
                STATS => STATS_ALLOC.dealloc(ptr, layout),
                _ => System.dealloc(ptr, layout),
            }
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded; every mode reallocates with System.
        unsafe {
            match MODE.load(Relaxed) {
                COUNTING => COUNTED.realloc(ptr, layout, new_size),
                STATS => STATS_ALLOC.realloc(ptr, layout, new_size),
                _ => System.realloc(ptr, layout, new_size),
            }
        }
    }
}

#[global_allocator]
static GLOBAL: Switch = Switch;

const ENTRIES: u64 = 100_000;

/// Builds and drops a map of `ENTRIES` strings, inserted in scrambled order.
fn btree_of_strings() -> usize {
    let mut map = BTreeMap::new();
    for i in 0..ENTRIES {
        let key = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % 1_000_000_007;
        map.insert(format!("key-{key:010}"), i);
    }
    let len = map.len();
    drop(black_box(map));
    len
}

/// The same workload split over `threads` threads, each building its own map: shared
/// counters (stats_alloc's atomics) contend here, per-thread ones (ours) do not.
fn btree_of_strings_threads(threads: u64) -> usize {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut map = BTreeMap::new();
                    for i in (t..ENTRIES).step_by(threads as usize) {
                        let key = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % 1_000_000_007;
                        map.insert(format!("key-{key:010}"), i);
                    }
                    let len = map.len();
                    drop(black_box(map));
                    len
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

fn overhead_threads(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(8)) as u64;
    let mut group = c.benchmark_group(format!("btreemap_1e5_strings_{threads}_threads"));
    group.throughput(Throughput::Elements(ENTRIES));
    for (name, mode) in [
        ("System", SYSTEM),
        ("Counting<System>", COUNTING),
        ("StatsAlloc<System>", STATS),
    ] {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            MODE.store(mode, Relaxed);
            b.iter(|| btree_of_strings_threads(threads));
            MODE.store(SYSTEM, Relaxed);
        });
    }
    group.finish();
}

fn overhead(c: &mut Criterion) {
    // Grow the heap first, so the first row does not pay for page faults the others skip.
    for _ in 0..3 {
        black_box(btree_of_strings());
    }
    let mut group = c.benchmark_group("btreemap_1e5_strings");
    group.throughput(Throughput::Elements(ENTRIES));
    for (name, mode) in [
        ("System", SYSTEM),
        ("Counting<System>", COUNTING),
        ("StatsAlloc<System>", STATS),
    ] {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            MODE.store(mode, Relaxed);
            let before = COUNTED.snapshot().allocs;
            b.iter(btree_of_strings);
            MODE.store(SYSTEM, Relaxed);
            // Proof that the counting row counted: its allocations went through `COUNTED`.
            if mode == COUNTING {
                assert!(
                    COUNTED.snapshot().allocs - before >= ENTRIES,
                    "Counting<System> counted nothing"
                );
            }
        });
    }
    group.finish();
}

/// `Counting<Global>` for the pair groups; `Global` is the `Switch` above in mode System.
static COUNTED_GLOBAL: Counting<Global> = Counting::new(Global);

/// stats_alloc's `StatsAlloc<System>` (a `GlobalAlloc` only) as an allocator-api2
/// `Allocator`, for the pair groups.
struct ViaGlobalAlloc(&'static StatsAlloc<System>);

// SAFETY: blocks come from `StatsAlloc<System>` (System's) and go back to it with their
// layout; a null result becomes an error.
unsafe impl Allocator for ViaGlobalAlloc {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: `alloc_free` asks for nonzero sizes.
        let p = unsafe { self.0.alloc(layout) };
        NonNull::new(p)
            .map(|p| NonNull::slice_from_raw_parts(p, layout.size()))
            .ok_or(AllocError)
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller passes a block `allocate` returned, with its layout.
        unsafe { self.0.dealloc(ptr.as_ptr(), layout) }
    }
}

const PAIR_SIZES: [usize; 4] = [256, 64 << 10, 1 << 20, 16 << 20];

/// `iters` pairs of `size` on each of `threads` threads at once (with a window open on
/// each if `window`; interleaved in batches with untimed pairs on `other`, if given:
/// `alloc_free_interleaved`); the time of the slowest thread.
fn pairs_on_threads<A: Allocator + Sync>(
    a: &A,
    other: Option<&(dyn Allocator + Sync)>,
    size: usize,
    iters: u64,
    threads: usize,
    window: bool,
) -> Duration {
    let start = Barrier::new(threads);
    let run = || {
        let w = window.then(Window::open);
        start.wait();
        let elapsed = match other {
            Some(other) => alloc_free_interleaved(a, &other, size, iters).unwrap_or_default(),
            None => {
                let t = Instant::now();
                for _ in 0..iters {
                    black_box(alloc_free(a, black_box(size)));
                }
                t.elapsed()
            }
        };
        if let Some(w) = w {
            w.assert_no_leaks();
        }
        elapsed
    };
    if threads == 1 {
        return run();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(run)).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap_or_default()
    })
}

fn pair_group(c: &mut Criterion, threads: usize) {
    let name = if threads == 1 {
        "pair_1_thread".to_owned()
    } else {
        format!("pair_{threads}_threads")
    };
    let mut group = c.benchmark_group(name);
    let stats = ViaGlobalAlloc(&STATS_ALLOC);
    for size in PAIR_SIZES {
        let rows: [(&str, &dyn Fn(u64) -> Duration); 4] = [
            ("Global", &|n| {
                pairs_on_threads(&Global, Some(&COUNTED_GLOBAL), size, n, threads, false)
            }),
            ("Counting<Global>", &|n| {
                pairs_on_threads(&COUNTED_GLOBAL, Some(&Global), size, n, threads, false)
            }),
            ("stats_alloc::StatsAlloc<System>", &|n| {
                pairs_on_threads(&stats, None, size, n, threads, false)
            }),
            ("Counting<Global>, window open", &|n| {
                pairs_on_threads(&COUNTED_GLOBAL, None, size, n, threads, true)
            }),
        ];
        for (row, run) in rows {
            group.bench_function(BenchmarkId::new(row, size), |b| b.iter_custom(run));
        }
    }
    group.finish();
}

fn pair(c: &mut Criterion) {
    pair_group(c, 1);
    pair_group(c, 8);
}

criterion_group!(benches, overhead, overhead_threads, pair);
criterion_main!(benches);
