//! The A/B report's measurements: one function per section, each returning tables of
//! tidy rows (see `report.rs`). To add rows, add a contender to a section; to add a
//! section, write a function `fn(&Options, &Progress) -> Result<Vec<Table>, String>` and
//! list it in [`sections`].
//!
//! Absolute numbers hold for the machine that printed them; compare within one run.

// Shared by several examples and tests (`#[path]` includes): each uses part of it.
#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Global};
use cudalloc::cuda::{self, HostAllocFlags, Stream};
use cudalloc::device::DevicePool;
use cudalloc::source::{HostSource, MemorySource, PinnedSource, RegisteredSource};
use cudalloc::testing::{workload, AsyncDeviceMemory, DeviceMemory};
use cudalloc::{Arena, Counting, Direct, ManagedAlloc, PinnedAlloc};

use crate::report::{fmt_size, Report, Table, Unit};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// What to measure and how long.
#[derive(Clone, Debug)]
pub struct Options {
    /// Run only these sections (`None`: all).
    pub only: Option<Vec<String>>,
    /// Sizes for the size-swept sections (latency, device, bandwidth) instead of theirs.
    pub sizes: Option<Vec<usize>>,
    /// Short time budgets and small workloads: for tests and a first look.
    pub quick: bool,
    /// Batches of the pipeline summary.
    pub pipeline_batches: usize,
    /// A trace to replay against every allocator that fits its memory (`--trace FILE`):
    /// the `replay` section, which runs only with one.
    pub trace: Option<std::path::PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            only: None,
            sizes: None,
            quick: false,
            pipeline_batches: 32,
            trace: None,
        }
    }
}

impl Options {
    pub fn wants(&self, section: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.iter().any(|s| s == section))
    }

    fn sizes_or(&self, default: &[usize]) -> Vec<usize> {
        self.sizes.clone().unwrap_or_else(|| default.to_vec())
    }

    /// A time budget, shortened in quick mode.
    fn budget(&self, ms: u64) -> Duration {
        Duration::from_millis(if self.quick { (ms / 25).max(2) } else { ms })
    }
}

/// Progress lines on stderr (stdout carries the report).
pub struct Progress {
    start: Instant,
    enabled: bool,
}

impl Progress {
    pub fn new(enabled: bool) -> Self {
        Self {
            start: Instant::now(),
            enabled,
        }
    }

    pub fn step(&self, section: &str, what: impl std::fmt::Display) {
        if self.enabled {
            eprintln!(
                "[ab {:6.1}s] {section}: {what}",
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}

/// One section of the report.
pub struct Section {
    pub name: &'static str,
    /// Whether every row needs a GPU (sections with host rows run everywhere).
    pub needs_gpu: bool,
    pub run: fn(&Options, &Progress) -> Result<Vec<Table>, String>,
}

/// Every section, in report order.
pub fn sections() -> Vec<Section> {
    vec![
        Section {
            name: "latency",
            needs_gpu: false,
            run: latency,
        },
        Section {
            name: "growth",
            needs_gpu: false,
            run: vec_growth,
        },
        Section {
            name: "staging",
            needs_gpu: false,
            run: small_objects,
        },
        Section {
            name: "device",
            needs_gpu: true,
            run: device_latency,
        },
        Section {
            name: "bandwidth",
            needs_gpu: true,
            run: bandwidth,
        },
        Section {
            name: "cpu_bandwidth",
            needs_gpu: true,
            run: cpu_bandwidth,
        },
        Section {
            name: "cold",
            needs_gpu: false,
            run: cold_growth,
        },
        Section {
            name: "pipeline",
            needs_gpu: true,
            run: pipeline,
        },
        Section {
            name: "replay",
            needs_gpu: false,
            run: replay,
        },
    ]
}

/// Runs the sections `opts` asks for (the GPU ones only where a driver is present) and
/// gathers their tables.
pub fn collect(opts: &Options, progress: &Progress) -> Report {
    let gpu = cuda::driver_available();
    let mut report = Report {
        title: "cudalloc A/B report".into(),
        ..Default::default()
    };
    report
        .environment
        .push(("cudalloc".into(), env!("CARGO_PKG_VERSION").into()));
    report.environment.push((
        "GPU".into(),
        if gpu {
            let name = cuda::device_name(0).unwrap_or_else(|e| format!("unknown ({e})"));
            format!("{name}, {} device(s)", cuda::device_count())
        } else {
            "none".into()
        },
    ));
    report
        .environment
        .push(("budgets".into(), if opts.quick { "quick" } else { "full" }.into()));
    if !gpu {
        report.notes.push(
            "GPU rows missing: no CUDA driver on this machine (libcuda not found, cuInit failed, or no \
             device). Host rows only; run on a machine with an NVIDIA driver for the pinned and \
             managed rows (latency, growth, staging, cold) and the device, bandwidth, cpu_bandwidth \
             and pipeline tables."
                .into(),
        );
    }
    for s in sections() {
        if !opts.wants(s.name) || (s.needs_gpu && !gpu) || (s.name == "replay" && opts.trace.is_none()) {
            continue;
        }
        progress.step(s.name, "start");
        match (s.run)(opts, progress) {
            Ok(tables) => report.tables.extend(tables),
            Err(e) => report.notes.push(format!("section {} failed: {e}", s.name)),
        }
    }
    if cuda::drop_errors() > 0 {
        report.notes.push(format!(
            "warning: {} CUDA errors while freeing",
            cuda::drop_errors()
        ));
    }
    report
}

/// Median time of one call of `f`, timing batches of calls until `budget` is spent.
pub fn median_per_call(budget: Duration, mut f: impl FnMut()) -> Duration {
    // Calibrate the batch so that one batch takes about 1/50 of the budget.
    let start = Instant::now();
    f();
    let one = start.elapsed().max(Duration::from_nanos(1));
    let batch = ((budget.as_nanos() / 50) / one.as_nanos()).clamp(1, 1_000_000) as u32;
    let mut samples = Vec::new();
    let deadline = Instant::now() + budget;
    while samples.len() < 5 || (Instant::now() < deadline && samples.len() < 200) {
        let t = Instant::now();
        for _ in 0..batch {
            f();
        }
        samples.push(t.elapsed() / batch);
    }
    samples.sort();
    samples[samples.len() / 2]
}

fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// One allocator (or raw call) in a latency table: `run(size)` allocates `size` bytes,
/// touches them if it can, frees them, and says whether the allocation succeeded.
struct Contender<'a> {
    name: &'static str,
    run: Box<dyn FnMut(usize) -> bool + 'a>,
}

fn contender<'a, A: Allocator + 'a>(name: &'static str, a: A) -> Contender<'a> {
    Contender {
        name,
        run: Box::new(move |size| workload::alloc_free(&a, size)),
    }
}

/// The counting allocator users pick besides ours (a `GlobalAlloc` only).
static STATS_ALLOC: stats_alloc::StatsAlloc<std::alloc::System> = stats_alloc::StatsAlloc::system();

/// allocate + touch first and last byte + free through stats_alloc, as
/// `workload::alloc_free` does through an `Allocator`.
fn stats_alloc_pair(size: usize) -> bool {
    use std::alloc::GlobalAlloc;
    let Ok(layout) = std::alloc::Layout::from_size_align(size.max(1), 8) else {
        return false;
    };
    // SAFETY: the layout has nonzero size; the writes stay inside the block, which is
    // freed once with its layout.
    unsafe {
        let p = STATS_ALLOC.alloc(layout);
        if p.is_null() {
            return false;
        }
        p.write_volatile(1);
        p.add(layout.size() - 1).write_volatile(2);
        STATS_ALLOC.dealloc(black_box(p), layout);
    }
    true
}

/// stats_alloc's `StatsAlloc<System>` (a `GlobalAlloc` only) as an `Allocator`, for the
/// interleaved rows.
struct StatsAllocator;

// SAFETY: blocks come from `STATS_ALLOC` (System's) and go back to it with their layout;
// a null result becomes an error.
unsafe impl Allocator for StatsAllocator {
    fn allocate(
        &self,
        layout: std::alloc::Layout,
    ) -> Result<std::ptr::NonNull<[u8]>, allocator_api2::alloc::AllocError> {
        use std::alloc::GlobalAlloc;
        if layout.size() == 0 {
            return Err(allocator_api2::alloc::AllocError);
        }
        // SAFETY: nonzero size, checked above.
        let p = unsafe { STATS_ALLOC.alloc(layout) };
        std::ptr::NonNull::new(p)
            .map(|p| std::ptr::NonNull::slice_from_raw_parts(p, layout.size()))
            .ok_or(allocator_api2::alloc::AllocError)
    }

    unsafe fn deallocate(&self, ptr: std::ptr::NonNull<u8>, layout: std::alloc::Layout) {
        use std::alloc::GlobalAlloc;
        // SAFETY: the caller passes a block `allocate` returned, with its layout.
        unsafe { STATS_ALLOC.dealloc(ptr.as_ptr(), layout) }
    }
}

/// `x` against `base`, where both were measured and the base is not zero.
fn ratio(x: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => Some(x / b),
        _ => None,
    }
}

/// A size-swept table: a row per size and `series` (key, title) holding the measured
/// `value` (key, title, unit) and its ratio (titled `ratio_title`) against the series
/// measured first at that size; wide by size, charted by series.
fn by_size_table(
    id: &str,
    section: &str,
    title: &str,
    series: (&str, &str),
    value: (&str, &str, Unit),
    ratio_title: &str,
    log_y: bool,
) -> Table {
    Table::new(id, section, title)
        .col("size_bytes", "size", Unit::Bytes)
        .col(series.0, series.1, Unit::Label)
        .col(value.0, value.1, value.2)
        .col("ratio", ratio_title, Unit::Ratio)
        .wide("size_bytes", series.0, value.0, Some("ratio"))
        .chart("size_bytes", series.0, value.0, log_y)
}

/// The empty latency table of `section` (its id too): median time per allocator and size.
fn latency_table(section: &str, title: &str, ratio_title: &str) -> Table {
    let median = ("median_ns", "median", Unit::Nanos);
    by_size_table(
        section,
        section,
        title,
        ("allocator", "allocator"),
        median,
        ratio_title,
        true,
    )
}

/// Times every contender at every size into `table` (see [`latency_table`]); ratios
/// against the first contender.
fn time_sizes(
    mut table: Table,
    sizes: &[usize],
    contenders: &mut [Contender<'_>],
    budget: Duration,
    progress: &Progress,
) -> Table {
    let section = table.section.clone();
    for &size in sizes {
        let mut base = None;
        for c in contenders.iter_mut() {
            progress.step(&section, format_args!("{} {}", c.name, fmt_size(size)));
            let t = if (c.run)(size) {
                let t = ns(median_per_call(budget, || {
                    black_box((c.run)(size));
                }));
                Some(t)
            } else {
                None
            };
            let base = *base.get_or_insert(t);
            table.push(vec![size.into(), c.name.into(), t.into(), ratio(t, base).into()]);
        }
    }
    table
}

fn latency(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let gpu = cuda::driver_available();
    let sizes = opts.sizes_or(&[256, 64 * KIB, MIB, 16 * MIB]);
    let bump = bumpalo::Bump::new();
    let arena = Arena::<HostSource>::host();
    let mut contenders = vec![
        contender("Global", Global),
        contender("Counting<Global>", Counting::new(Global)),
        Contender {
            name: "stats_alloc::StatsAlloc<System>",
            run: Box::new(stats_alloc_pair),
        },
        contender("bumpalo::Bump", &bump),
        contender("Arena<HostSource>", &arena),
    ];
    if gpu {
        contenders.push(contender("PinnedAlloc", PinnedAlloc));
        contenders.push(contender("ManagedAlloc", ManagedAlloc));
        contenders.push(contender(
            "raw cuMemHostAlloc",
            Direct::new(PinnedSource::new(HostAllocFlags::DEFAULT)),
        ));
        contenders.push(contender(
            "raw cuMemHostRegister",
            Direct::new(RegisteredSource::new(false)),
        ));
    }
    let table = latency_table(
        "latency",
        "Allocation latency: allocate + touch first and last byte + free, median per pair",
        "vs Global",
    );
    let mut table = time_sizes(table, &sizes, &mut contenders, opts.budget(300), progress);
    table.note("Ratios are against Global in the same row. raw = one driver call per allocation, no pool.");
    drop(contenders);
    Ok(vec![table, counting_threads(&sizes, opts.budget(300), progress)])
}

/// Threads of the multi-threaded rows of the counting table (issue 22 item 1: one and 8).
const COUNTING_THREADS: [usize; 2] = [1, 8];

/// Median ns per pair of `a` and of `b` on each of `threads` threads at once (the median
/// of the threads' medians), timed in alternating batches over the same stretch of time
/// (`workload::alloc_free_ab`, static calls of both) for about `budget`.
fn ab_medians<A: Allocator + Sync, B: Allocator + Sync>(
    a: &A,
    b: &B,
    size: usize,
    threads: usize,
    budget: Duration,
) -> (Option<f64>, Option<f64>) {
    let batch = 4 * workload::INTERLEAVED_BATCH;
    let one = || {
        let deadline = Instant::now() + budget;
        let (mut sa, mut sb) = (Vec::new(), Vec::new());
        while sa.len() < 5 || (Instant::now() < deadline && sa.len() < 400) {
            let (ta, tb) = workload::alloc_free_ab(a, b, size, batch)?;
            sa.push(ns(ta) / batch as f64);
            sb.push(ns(tb) / batch as f64);
        }
        sa.sort_by(f64::total_cmp);
        sb.sort_by(f64::total_cmp);
        Some((sa[sa.len() / 2], sb[sb.len() / 2]))
    };
    let per_thread: Vec<(f64, f64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads).map(|_| scope.spawn(one)).collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect()
    });
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    (
        median(per_thread.iter().map(|p| p.0).collect()),
        median(per_thread.iter().map(|p| p.1).collect()),
    )
}

/// The counting allocators on 1 and 8 threads at once, each thread its own blocks:
/// `Global` and `Counting<Global>` timed interleaved (each with the other as the
/// untimed half), stats_alloc alone. Shared counters (a contended cache line) show on
/// 8 threads and not on one.
fn counting_threads(sizes: &[usize], budget: Duration, progress: &Progress) -> Table {
    let section = "latency";
    let counting = Counting::new(Global);
    let stats = StatsAllocator;
    let mut table = by_size_table(
        "latency_threads",
        section,
        "Counting allocators on 1 and 8 threads at once: allocate + touch first and last byte + free, median per pair",
        ("allocator", "allocator"),
        ("median_ns", "median", Unit::Nanos),
        "vs Global",
        true,
    );
    for threads in COUNTING_THREADS {
        let on = if threads == 1 {
            "1 thread".to_owned()
        } else {
            format!("{threads} threads")
        };
        for &size in sizes {
            progress.step(section, format_args!("counting {} x{threads}", fmt_size(size)));
            let (global, counted) = ab_medians(&Global, &counting, size, threads, budget);
            let (stats, _) = ab_medians(&stats, &stats, size, threads, budget / 2);
            for (name, t) in [
                ("Global", global),
                ("Counting<Global>", counted),
                ("stats_alloc::StatsAlloc<System>", stats),
            ] {
                let row = format!("{name}, {on}");
                table.push(vec![size.into(), row.into(), t.into(), ratio(t, global).into()]);
            }
        }
    }
    table.note(
        "Each thread allocates and frees its own blocks; ratios are against Global at the same size \
         and thread count. Global and Counting<Global> are timed in alternating batches of 256 \
         pairs over the same stretch of time, so their ratio compares them under the same \
         conditions; stats_alloc is timed alone.",
    );
    table
}

fn device_latency(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let sizes = opts.sizes_or(&[256, 64 * KIB, MIB, 16 * MIB]);
    let stream = Stream::new(0).map_err(|e| e.to_string())?;
    let pool = DevicePool::get(0).map_err(|e| e.to_string())?;
    let s = &stream;
    let mut contenders = vec![
        Contender {
            name: "raw cuMemAllocAsync",
            run: Box::new(move |size| AsyncDeviceMemory::new(size, s).is_ok()),
        },
        Contender {
            name: "DevicePool",
            run: Box::new(move |size| pool.alloc::<u8>(size, s).is_ok()),
        },
        Contender {
            name: "raw cuMemAlloc",
            run: Box::new(|size| DeviceMemory::new(size, 0).is_ok()),
        },
    ];
    let table = latency_table(
        "device",
        "Device allocation latency: allocate + free on one stream, median per pair (host time)",
        "vs raw cuMemAllocAsync",
    );
    let mut table = time_sizes(table, &sizes, &mut contenders, opts.budget(300), progress);
    stream.synchronize().map_err(|e| e.to_string())?;
    table.note(
        "raw cuMemAllocAsync: the device's default pool with its release threshold raised to the \
         maximum; DevicePool: the crate's process-wide pool of the device (its cache in front of \
         physical pages from 2 MiB, a driver pool below); raw cuMemAlloc: synchronous allocation \
         and free.",
    );
    Ok(vec![table])
}

/// Timed runs of one section, a row per allocator: its median time per run and the
/// ratio against a named row.
struct Timings<'p> {
    section: &'static str,
    budget: Duration,
    progress: &'p Progress,
    rows: Vec<(&'static str, Option<Duration>)>,
}

impl<'p> Timings<'p> {
    fn new(section: &'static str, budget: Duration, progress: &'p Progress) -> Self {
        Self {
            section,
            budget,
            progress,
            rows: Vec::new(),
        }
    }

    /// Times `f` (median per call within the budget) as `name`'s row.
    fn time(&mut self, name: &'static str, f: impl FnMut()) {
        self.progress.step(self.section, name);
        self.rows.push((name, Some(median_per_call(self.budget, f))));
    }

    /// The section's table (its id too), ratios against `base_name`'s row.
    fn table(self, title: &str, base_name: &str, ratio_title: &str) -> Table {
        let mut table = Table::new(self.section, self.section, title)
            .col("allocator", "allocator", Unit::Label)
            .col("median_ns", "time", Unit::Nanos)
            .col("ratio", ratio_title, Unit::Ratio)
            .chart("allocator", "allocator", "median_ns", false);
        let base = self
            .rows
            .iter()
            .find(|(n, _)| *n == base_name)
            .and_then(|(_, t)| *t)
            .map(ns);
        for (name, t) in self.rows {
            let t = t.map(ns);
            table.push(vec![name.into(), t.into(), ratio(t, base).into()]);
        }
        table
    }
}

fn vec_growth(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let gpu = cuda::driver_available();
    let n = if opts.quick { 10_000 } else { 1_000_000 };
    let mut bump = bumpalo::Bump::new();
    let mut arena = Arena::<HostSource>::host();
    let mut rows = Timings::new("growth", opts.budget(500), progress);
    rows.time("Global", || {
        black_box(workload::vec_push(Global, n));
    });
    rows.time("bumpalo::Bump", || {
        black_box(workload::vec_push(&bump, n));
        bump.reset();
    });
    rows.time("Arena<HostSource>", || {
        black_box(workload::vec_push(&arena, n));
        arena.reset();
    });
    if gpu {
        rows.time("PinnedAlloc", || {
            black_box(workload::vec_push(PinnedAlloc, n));
        });
        rows.time("ManagedAlloc", || {
            black_box(workload::vec_push(ManagedAlloc, n));
        });
    }
    let title = format!("Vec growth: push {n} u64 one at a time, median per run");
    Ok(vec![rows.table(&title, "Global", "vs Global")])
}

fn small_objects(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let gpu = cuda::driver_available();
    let n = if opts.quick { 10_000 } else { 1_000_000 };
    let mut rows = Timings::new("staging", opts.budget(1500), progress);
    let mut bump = bumpalo::Bump::new();
    rows.time("bumpalo::Bump", || {
        black_box(workload::small_objects(&&bump, n));
        bump.reset();
    });
    let mut arena = Arena::<HostSource>::host();
    rows.time("Arena<HostSource>", || {
        black_box(workload::small_objects(&&arena, n));
        arena.reset();
    });
    if gpu {
        let mut pinned = Arena::pinned();
        rows.time("Arena<PinnedSource>", || {
            black_box(workload::small_objects(&&pinned, n));
            pinned.reset();
        });
    }
    rows.time("Global", || {
        black_box(workload::small_objects(&Global, n));
    });
    if gpu {
        rows.time("PinnedAlloc", || {
            black_box(workload::small_objects(&PinnedAlloc, n));
        });
    }
    let title = format!(
        "Per-batch staging: {n} objects of 8..256 B, then free all (arenas: reset), median per batch"
    );
    Ok(vec![rows.table(&title, "bumpalo::Bump", "vs bumpalo")])
}

/// A host buffer to copy from and to, of each kind the bandwidth table compares.
enum HostBuf {
    Raw(PinnedSource, core::ptr::NonNull<u8>, usize),
    Registered(RegisteredSource, core::ptr::NonNull<u8>, usize),
    Pinned(allocator_api2::vec::Vec<u8, PinnedAlloc>),
    Managed(allocator_api2::vec::Vec<u8, ManagedAlloc>),
    Pageable(Vec<u8>),
}

/// The memory kinds of the bandwidth table, the reference first.
const HOST_KINDS: [&str; 5] = [
    "raw cuMemHostAlloc",
    "raw cuMemHostRegister",
    "Vec<PinnedAlloc>",
    "Vec<ManagedAlloc>",
    "pageable Vec",
];

impl HostBuf {
    fn new(kind: usize, len: usize) -> cudalloc::Result<Self> {
        fn filled<A: Allocator>(a: A, len: usize) -> allocator_api2::vec::Vec<u8, A> {
            let mut v = allocator_api2::vec::Vec::with_capacity_in(len, a);
            v.resize(len, 7);
            v
        }
        Ok(match kind {
            0 => {
                let src = PinnedSource::default();
                let p = src.allocate(len)?;
                // SAFETY: `p` is a fresh block of `len` bytes.
                unsafe { p.as_ptr().write_bytes(7, len) };
                HostBuf::Raw(src, p, len)
            }
            1 => {
                let src = RegisteredSource::new(false);
                let p = src.allocate(len)?;
                // SAFETY: `p` is a fresh block of `len` bytes.
                unsafe { p.as_ptr().write_bytes(7, len) };
                HostBuf::Registered(src, p, len)
            }
            2 => HostBuf::Pinned(filled(PinnedAlloc, len)),
            3 => HostBuf::Managed(filled(ManagedAlloc, len)),
            _ => HostBuf::Pageable(vec![7; len]),
        })
    }

    fn bytes(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Pageable(v) => v,
            HostBuf::Pinned(v) => v,
            HostBuf::Managed(v) => v,
            // SAFETY: the block is ours, `len` bytes, initialized in `new`.
            HostBuf::Raw(_, p, len) | HostBuf::Registered(_, p, len) => unsafe {
                core::slice::from_raw_parts_mut(p.as_ptr(), *len)
            },
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        match self {
            // SAFETY: allocated by this source with `len` in `new`; no copy is in flight
            // (every timed copy is synchronized).
            HostBuf::Raw(src, p, len) => unsafe { src.deallocate(*p, *len) },
            // SAFETY: as above.
            HostBuf::Registered(src, p, len) => unsafe { src.deallocate(*p, *len) },
            _ => {}
        }
    }
}

/// GB/s of copies of `buf` to (or from) `dev`, median of the synchronized repetitions.
fn copy_gbps(
    buf: &mut HostBuf,
    dev: &mut DeviceMemory,
    stream: &Stream,
    to_device: bool,
    quick: bool,
) -> cudalloc::Result<f64> {
    let len = buf.bytes().len();
    let reps = match (quick, len >= 256 * MIB) {
        (true, _) => 3,
        (false, true) => 5,
        (false, false) => 20,
    };
    let mut samples = Vec::new();
    for i in 0..reps + 1 {
        let t = Instant::now();
        // SAFETY: the buffer is not touched until the stream is synchronized below.
        unsafe {
            if to_device {
                dev.copy_from_host_async(0, buf.bytes(), stream)?;
            } else {
                dev.copy_to_host_async(0, buf.bytes(), stream)?;
            }
        }
        stream.synchronize()?;
        if i > 0 {
            samples.push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

fn bandwidth(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let sizes = opts.sizes_or(&[MIB, 16 * MIB, 256 * MIB, GIB]);
    let stream = Stream::new(0).map_err(|e| e.to_string())?;
    let mut tables = Vec::new();
    for (to_device, id, dir) in [(true, "bandwidth_h2d", "H2D"), (false, "bandwidth_d2h", "D2H")] {
        let mut table = by_size_table(
            id,
            "bandwidth",
            &format!("{dir} bandwidth, GB/s (cuMemcpyAsync, synchronized, median)"),
            ("memory", "host memory"),
            ("gbps", "GB/s", Unit::GBps),
            "vs raw cuMemHostAlloc",
            false,
        );
        for &size in &sizes {
            let mut dev = DeviceMemory::new(size, 0).map_err(|e| e.to_string())?;
            let mut base = None;
            for (kind, name) in HOST_KINDS.iter().enumerate() {
                progress.step("bandwidth", format_args!("{dir} {name} {}", fmt_size(size)));
                let g = HostBuf::new(kind, size)
                    .and_then(|mut buf| copy_gbps(&mut buf, &mut dev, &stream, to_device, opts.quick))
                    .ok();
                let b = *base.get_or_insert(g);
                table.push(vec![size.into(), (*name).into(), g.into(), ratio(g, b).into()]);
            }
        }
        table.note("Ratios are against raw cuMemHostAlloc memory at the same size.");
        tables.push(table);
    }
    Ok(tables)
}

/// Threads for the several-thread rows: the available parallelism, at most 8.
fn cpu_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().min(8))
}

/// GB/s of the CPU writing (`fill`) or reading (summing u64 words) all of `buf` with
/// `threads` threads on equal parts, median of `reps` timed passes after one untimed.
pub fn cpu_gbps(buf: &mut [u8], threads: usize, write: bool, reps: usize) -> f64 {
    let len = buf.len();
    let part = len.div_ceil(threads.max(1)).max(1);
    let mut samples = Vec::new();
    for rep in 0..reps + 1 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for chunk in buf.chunks_mut(part) {
                s.spawn(move || {
                    if write {
                        chunk.fill(rep as u8);
                    } else {
                        let sum = chunk
                            .chunks_exact(8)
                            .map(|w| u64::from_ne_bytes(w.try_into().unwrap()))
                            .fold(0u64, u64::wrapping_add);
                        black_box(sum);
                    }
                });
            }
        });
        if rep > 0 {
            samples.push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// CPU write and read bandwidth over default and write-combined `cuMemHostAlloc` memory,
/// `PinnedAlloc`'s (registered) and pageable memory (issue 22.5: the claim that write-combined memory makes CPU writes 2-3x faster
/// and reads more than 10x slower), one thread and several.
fn cpu_bandwidth(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let size = opts
        .sizes
        .as_ref()
        .and_then(|s| s.iter().max().copied())
        .unwrap_or(if opts.quick { 4 * MIB } else { 64 * MIB });
    let reps = if opts.quick { 1 } else { 5 };
    let many = cpu_threads();
    let mut table = Table::new(
        "cpu_bandwidth",
        "cpu_bandwidth",
        &format!(
            "CPU bandwidth over host memory of {}, GB/s (median of {reps} passes)",
            fmt_size(size)
        ),
    )
    .col("access", "access", Unit::Label)
    .col("memory", "host memory", Unit::Label)
    .col("gbps", "GB/s", Unit::GBps)
    .col("ratio", "vs cuMemHostAlloc default", Unit::Ratio)
    .wide("access", "memory", "gbps", Some("ratio"))
    .chart("access", "memory", "gbps", true);
    let kinds: [(&str, Option<HostAllocFlags>); 4] = [
        ("cuMemHostAlloc default", Some(HostAllocFlags::DEFAULT)),
        (
            "cuMemHostAlloc WRITE_COMBINED",
            Some(HostAllocFlags::WRITE_COMBINED),
        ),
        ("Vec<PinnedAlloc>", None),
        ("pageable Vec", None),
    ];
    let accesses = [
        ("write, 1 thread".to_string(), true, 1),
        (format!("write, {many} threads"), true, many),
        ("read, 1 thread".to_string(), false, 1),
        (format!("read, {many} threads"), false, many),
    ];
    for (access, write, threads) in &accesses {
        let mut base = None;
        for (name, flags) in kinds {
            progress.step("cpu_bandwidth", format_args!("{access} {name}"));
            let g = match flags {
                Some(flags) => {
                    let src = PinnedSource::new(flags);
                    src.allocate(size).ok().map(|p| {
                        // SAFETY: `p` is a fresh block of `size` bytes, ours until freed
                        // below; no GPU work uses it.
                        let buf = unsafe { core::slice::from_raw_parts_mut(p.as_ptr(), size) };
                        buf.fill(7);
                        let g = cpu_gbps(buf, *threads, *write, reps);
                        // SAFETY: allocated above with `size`; no longer used.
                        unsafe { src.deallocate(p, size) };
                        g
                    })
                }
                None if name == "Vec<PinnedAlloc>" => {
                    let mut v: allocator_api2::vec::Vec<u8, PinnedAlloc> =
                        allocator_api2::vec::Vec::new_in(PinnedAlloc);
                    v.try_reserve_exact(size).ok().map(|()| {
                        v.resize(size, 7);
                        cpu_gbps(&mut v, *threads, *write, reps)
                    })
                }
                None => Some(cpu_gbps(&mut vec![7u8; size], *threads, *write, reps)),
            };
            let b = *base.get_or_insert(g);
            table.push(vec![
                access.as_str().into(),
                name.into(),
                g.into(),
                ratio(g, b).into(),
            ]);
        }
    }
    table.note(
        "Writes: slice::fill (memset); reads: a sum of u64 words; each thread on its own equal \
         part. Write-combined memory is uncached for the CPU: the seeds' claim is writes 2-3x \
         faster and reads more than 10x slower than default pinned memory. The H2D figures \
         are in the bandwidth tables.",
    );
    Ok(vec![table])
}

/// One first-allocation run of the cold table: its row name, the environment to set and
/// to remove in the child, and what the child allocates (see [`cold_child`]).
struct ColdRun {
    name: &'static str,
    set: &'static [(&'static str, &'static str)],
    remove: &'static [&'static str],
    kind: &'static str,
}

/// The runs of the cold table, the default first (the ratios' base).
const COLD_RUNS: [ColdRun; 6] = [
    ColdRun {
        name: "PinnedAlloc (default)",
        set: &[],
        remove: &["CUDALLOC_PINNED_GROWTH", "CUDALLOC_PREFAULT_THREADS"],
        kind: "pinned",
    },
    ColdRun {
        name: "PinnedAlloc, register",
        set: &[("CUDALLOC_PINNED_GROWTH", "register")],
        remove: &["CUDALLOC_PREFAULT_THREADS"],
        kind: "pinned",
    },
    ColdRun {
        name: "PinnedAlloc, register, 1 prefault thread",
        set: &[
            ("CUDALLOC_PINNED_GROWTH", "register"),
            ("CUDALLOC_PREFAULT_THREADS", "1"),
        ],
        remove: &[],
        kind: "pinned",
    },
    ColdRun {
        name: "PinnedAlloc, hostalloc",
        set: &[("CUDALLOC_PINNED_GROWTH", "hostalloc")],
        remove: &["CUDALLOC_PREFAULT_THREADS"],
        kind: "pinned",
    },
    ColdRun {
        name: "pageable Vec<u8>",
        set: &[],
        remove: &[],
        kind: "pageable",
    },
    ColdRun {
        name: "the threaded prefault alone (no register)",
        set: &[],
        remove: &["CUDALLOC_PREFAULT_THREADS"],
        kind: "prefault",
    },
];

/// The flag `ab` takes to run one cold allocation in its own process (see [`cold_child`]).
pub const COLD_CHILD_FLAG: &str = "--cold-child";

/// In a fresh process (`ab --cold-child KIND SIZE`): the first allocation of `size` bytes
/// of `kind` (`pinned`: `Vec::<u8, PinnedAlloc>::try_reserve_exact`, after a 1-byte pinned
/// allocation has brought up the driver, the context and the pool, as the PyTorch script
/// does with `torch.empty(1, pin_memory=True)`; `pageable`: a `Vec<u8>`; `prefault`: a
/// `Vec<u8>`'s capacity zeroed as registered growth does, timed as the allocation), then
/// filling it; prints `cold-result FIRST_NS FILL_NS`.
pub fn cold_child(kind: &str, size: usize) -> Result<(), String> {
    use allocator_api2::vec::Vec as AVec;
    fn run<A: Allocator>(a: A, size: usize) -> Result<(f64, f64), String> {
        let t = Instant::now();
        let mut v: AVec<u8, A> = AVec::new_in(a);
        v.try_reserve_exact(size).map_err(|e| format!("{e:?}"))?;
        let first = ns(t.elapsed());
        let t = Instant::now();
        v.resize(size, 1);
        let fill = ns(t.elapsed());
        black_box(&v);
        Ok((first, fill))
    }
    let (first, fill) = match kind {
        "pinned" => {
            if !cuda::driver_available() {
                return Err("no CUDA driver".into());
            }
            let mut warm: AVec<u8, PinnedAlloc> = AVec::new_in(PinnedAlloc);
            warm.try_reserve_exact(1).map_err(|e| format!("{e:?}"))?;
            warm.push(1);
            black_box(&warm);
            run(PinnedAlloc, size)?
        }
        "pageable" => run(Global, size)?,
        "prefault" => {
            // What registered growth does before cuMemHostRegister.
            let t = Instant::now();
            let mut pages = cudalloc::testing::PrefaultedPages::new(size).map_err(|e| e.to_string())?;
            let first = ns(t.elapsed());
            let t = Instant::now();
            pages.as_mut_slice().fill(1);
            black_box(pages.as_mut_slice());
            (first, ns(t.elapsed()))
        }
        other => return Err(format!("unknown kind {other:?}")),
    };
    println!("cold-result {first} {fill}");
    Ok(())
}

/// Runs [`cold_child`] in a fresh process of this executable; `(first_ns, fill_ns)`.
fn cold_run(kind: &str, size: usize, set: &[(&str, &str)], remove: &[&str]) -> Result<(f64, f64), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args([COLD_CHILD_FLAG, kind, &size.to_string()]);
    for (k, v) in set {
        cmd.env(k, v);
    }
    for k in remove {
        cmd.env_remove(k);
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("cold-result "));
    let parsed = line.and_then(|l| {
        let mut it = l.split_whitespace().map(|x| x.parse::<f64>().ok());
        Some((it.next()??, it.next()??))
    });
    parsed.ok_or_else(|| {
        format!(
            "the child failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

/// Issue 22.6: the first pinned allocation of 64 MiB, 256 MiB and 1 GiB in a fresh
/// process (cold: each figure is its own process), by growth mode, and filling it;
/// `tools/torch_pinned_cold.py` measures PyTorch's caching host allocator the same way.
fn cold_growth(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let gpu = cuda::driver_available();
    let sizes = opts.sizes_or(if opts.quick {
        &[16 * MIB]
    } else {
        &[64 * MIB, 256 * MIB, GIB]
    });
    let reps = if opts.quick { 1 } else { 3 };
    let mut table = Table::new(
        "cold",
        "cold",
        &format!("Cold pinned growth: the first allocation in a fresh process, median of {reps} processes"),
    )
    .col("size_bytes", "size", Unit::Bytes)
    .col("allocator", "allocator", Unit::Label)
    .col("first_ms", "first allocation", Unit::Millis)
    .col("fill_ms", "then filling it", Unit::Millis)
    .col("ratio", "first vs default", Unit::Ratio)
    .chart("size_bytes", "allocator", "first_ms", true);
    let mut failures = Vec::new();
    for &size in &sizes {
        let mut base = None;
        for ColdRun {
            name,
            set,
            remove,
            kind,
        } in COLD_RUNS
        {
            if kind == "pinned" && !gpu {
                continue;
            }
            progress.step("cold", format_args!("{name} {}", fmt_size(size)));
            let mut runs = Vec::new();
            for _ in 0..reps {
                match cold_run(kind, size, set, remove) {
                    Ok(r) => runs.push(r),
                    Err(e) => failures.push(format!("{name} {}: {e}", fmt_size(size))),
                }
            }
            let median = |f: fn(&(f64, f64)) -> f64| {
                let mut xs: Vec<f64> = runs.iter().map(f).collect();
                xs.sort_by(f64::total_cmp);
                xs.get(xs.len() / 2).map(|x| x / 1e6)
            };
            let (first, fill) = (median(|r| r.0), median(|r| r.1));
            if name == COLD_RUNS[0].name {
                base = first;
            }
            table.push(vec![
                size.into(),
                name.into(),
                first.into(),
                fill.into(),
                ratio(first, base).into(),
            ]);
        }
    }
    table.note(format!(
        "Each figure is a fresh process (`ab {COLD_CHILD_FLAG} KIND SIZE`): a 1-byte pinned \
         allocation first brings up the driver, the context and the pool; then the timed \
         `Vec::<u8, PinnedAlloc>::try_reserve_exact(size)` (a fresh segment from the source), \
         then `resize(size, 1)`. Default (`PinnedGrowth::Auto`): registered growth with two or \
         more CPUs, pages faulted in by up to {} threads (one per 8 MiB; on one CPU \
         `cuMemHostAlloc` from 64 MiB); `1 prefault thread` is the growth before issue 22.6. \
         PyTorch's figures: `python3 tools/torch_pinned_cold.py`.",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    ));
    for f in failures {
        table.note(format!("failed: {f}"));
    }
    Ok(vec![table])
}

fn pipeline(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let cfg = crate::pipeline::Config::summary(opts.pipeline_batches);
    let results = crate::pipeline::run(&cfg, &|what: &str| progress.step("pipeline", what))
        .map_err(|e| e.to_string())?;
    Ok(results.tables())
}

/// Issue 20.5: the replay of `--trace FILE` against every allocator that fits its memory,
/// as `examples/replay.rs` prints it (one table, charted by total time per allocator).
fn replay(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let path = opts.trace.clone().ok_or("no --trace FILE")?;
    let args = crate::replay_report::ReplayArgs {
        trace: path,
        ..Default::default()
    };
    let replayed = crate::replay_report::replay_file(&args, &|what: &str| progress.step("replay", what))?;
    let mut tables = replayed.tables;
    let table = tables.first_mut().ok_or("the replay made no table")?;
    table.title = format!("{}: time and memory per allocator", replayed.title);
    // The replay's own report lines go with its table, before the table's notes.
    let mut notes: Vec<String> = replayed
        .environment
        .iter()
        .filter(|(k, _)| k == "trace")
        .map(|(_, v)| format!("Trace: {v}."))
        .collect();
    notes.extend(replayed.notes);
    notes.append(&mut table.notes);
    table.notes = notes;
    Ok(tables)
}

/// The table of `id` in a report, for tests.
#[allow(dead_code)]
pub fn find<'r>(report: &'r Report, id: &str) -> Option<&'r Table> {
    report.tables.iter().find(|t| t.id == id)
}
