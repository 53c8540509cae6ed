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
}

impl Default for Options {
    fn default() -> Self {
        Self {
            only: None,
            sizes: None,
            quick: false,
            pipeline_batches: 32,
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
            name: "pipeline",
            needs_gpu: true,
            run: pipeline,
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
             device). Host rows only; run on a machine with an NVIDIA driver for the pinned, managed, \
             device, bandwidth and pipeline rows."
                .into(),
        );
    }
    for s in sections() {
        if !opts.wants(s.name) || (s.needs_gpu && !gpu) {
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
    Ok(vec![table])
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
         physical pages from 4 MiB, a driver pool below); raw cuMemAlloc: synchronous allocation \
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

fn pipeline(opts: &Options, progress: &Progress) -> Result<Vec<Table>, String> {
    let cfg = crate::pipeline::Config::summary(opts.pipeline_batches);
    let results = crate::pipeline::run(&cfg, &|what: &str| progress.step("pipeline", what))
        .map_err(|e| e.to_string())?;
    Ok(results.tables())
}

/// The table of `id` in a report, for tests.
#[allow(dead_code)]
pub fn find<'r>(report: &'r Report, id: &str) -> Option<&'r Table> {
    report.tables.iter().find(|t| t.id == id)
}
