//! The A/B report: the same generic workloads on every allocator, printed as tables with
//! ratios.
//!
//!     cargo run --release --example ab
//!
//! Rows that need a GPU (CUDA allocators, host<->device bandwidth) run only where a CUDA
//! driver is present; elsewhere the report says why they are missing. Absolute numbers
//! hold for the machine that printed them; compare ratios within one run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Global};
use cudalloc::cuda::{self, HostAllocFlags, Stream};
use cudalloc::testing::{workload, DeviceMemory};
use cudalloc::source::HostSource;
use cudalloc::source::{MemorySource, PinnedSource};
use cudalloc::{Arena, Counting, Direct, ManagedAlloc, PinnedAlloc};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Median time of one call of `f`, timing batches of calls until `budget` is spent.
fn median_per_call(budget: Duration, mut f: impl FnMut()) -> Duration {
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

fn fmt_time(d: Duration) -> String {
    let ns = d.as_secs_f64() * 1e9;
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} us", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

fn fmt_size(n: usize) -> String {
    match n {
        n if n >= GIB => format!("{} GiB", n / GIB),
        n if n >= MIB => format!("{} MiB", n / MIB),
        n if n >= KIB => format!("{} KiB", n / KIB),
        n => format!("{n} B"),
    }
}

struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }
    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
    fn print(&self) {
        let mut w: Vec<usize> = self.header.iter().map(|h| h.len()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.len());
            }
        }
        let line = |cells: &[String]| {
            let s: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(i, c)| format!("{c:>width$}", width = w[i]))
                .collect();
            println!("| {} |", s.join(" | "));
        };
        line(&self.header);
        println!(
            "|{}|",
            w.iter().map(|n| "-".repeat(n + 2)).collect::<Vec<_>>().join("|")
        );
        for r in &self.rows {
            line(r);
        }
        println!();
    }
}

/// One allocator in the latency table.
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

fn latency(gpu: bool) {
    let sizes = [256, 64 * KIB, MIB, 16 * MIB];
    let bump = bumpalo::Bump::new();
    let arena = Arena::<HostSource>::host();
    let mut contenders = vec![
        contender("Global", Global),
        contender("Counting<Global>", Counting::new(Global)),
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
    }
    println!("## Allocation latency: allocate + touch first and last byte + free, median per pair\n");
    let mut header = vec!["size"];
    header.extend(contenders.iter().map(|c| c.name));
    let mut table = Table::new(&header);
    for &size in &sizes {
        let mut cells = vec![fmt_size(size)];
        let mut base = None;
        for c in contenders.iter_mut() {
            if !(c.run)(size) {
                cells.push("failed".into());
                continue;
            }
            let t = median_per_call(Duration::from_millis(300), || {
                black_box((c.run)(size));
            });
            let base = *base.get_or_insert(t);
            cells.push(format!(
                "{} ({:.2}x)",
                fmt_time(t),
                t.as_secs_f64() / base.as_secs_f64()
            ));
        }
        table.row(cells);
    }
    table.print();
    println!("Ratios are against Global in the same row.\n");
}

fn vec_growth(gpu: bool) {
    println!("## Vec growth: push 10^6 u64 one at a time, median per run\n");
    let n = 1_000_000;
    let mut bump = bumpalo::Bump::new();
    let mut rows: Vec<(&str, Duration)> = Vec::new();
    let budget = Duration::from_millis(500);
    rows.push((
        "Global",
        median_per_call(budget, || {
            black_box(workload::vec_push(Global, n));
        }),
    ));
    rows.push((
        "bumpalo::Bump",
        median_per_call(budget, || {
            black_box(workload::vec_push(&bump, n));
            bump.reset();
        }),
    ));
    let mut arena = Arena::<HostSource>::host();
    rows.push((
        "Arena<HostSource>",
        median_per_call(budget, || {
            black_box(workload::vec_push(&arena, n));
            arena.reset();
        }),
    ));
    if gpu {
        rows.push((
            "PinnedAlloc",
            median_per_call(budget, || {
                black_box(workload::vec_push(PinnedAlloc, n));
            }),
        ));
        rows.push((
            "ManagedAlloc",
            median_per_call(budget, || {
                black_box(workload::vec_push(ManagedAlloc, n));
            }),
        ));
    }
    let base = rows[0].1;
    let mut table = Table::new(&["allocator", "time", "vs Global"]);
    for (name, t) in rows {
        table.row(vec![
            name.into(),
            fmt_time(t),
            format!("{:.2}x", t.as_secs_f64() / base.as_secs_f64()),
        ]);
    }
    table.print();
}

fn small_objects(gpu: bool) {
    println!(
        "## Per-batch staging: 10^6 objects of 8..256 B, then free all (arenas: reset), median per batch\n"
    );
    let n = 1_000_000;
    let budget = Duration::from_millis(1500);
    let mut rows: Vec<(&str, Duration)> = Vec::new();
    let mut bump = bumpalo::Bump::new();
    rows.push((
        "bumpalo::Bump",
        median_per_call(budget, || {
            black_box(workload::small_objects(&&bump, n));
            bump.reset();
        }),
    ));
    let mut arena = Arena::<HostSource>::host();
    rows.push((
        "Arena<HostSource>",
        median_per_call(budget, || {
            black_box(workload::small_objects(&&arena, n));
            arena.reset();
        }),
    ));
    if gpu {
        let mut pinned = Arena::pinned();
        rows.push((
            "Arena<PinnedSource>",
            median_per_call(budget, || {
                black_box(workload::small_objects(&&pinned, n));
                pinned.reset();
            }),
        ));
    }
    rows.push((
        "Global",
        median_per_call(budget, || {
            black_box(workload::small_objects(&Global, n));
        }),
    ));
    if gpu {
        rows.push((
            "PinnedAlloc",
            median_per_call(budget, || {
                black_box(workload::small_objects(&PinnedAlloc, n));
            }),
        ));
    }
    let base = rows[0].1;
    let mut table = Table::new(&["allocator", "time", "vs bumpalo"]);
    for (name, t) in rows {
        table.row(vec![
            name.into(),
            fmt_time(t),
            format!("{:.2}x", t.as_secs_f64() / base.as_secs_f64()),
        ]);
    }
    table.print();
}

/// A host buffer to copy from and to.
enum HostBuf {
    Pageable(Vec<u8>),
    Pinned(allocator_api2::vec::Vec<u8, PinnedAlloc>),
    Managed(allocator_api2::vec::Vec<u8, ManagedAlloc>),
    Raw(core::ptr::NonNull<u8>, usize),
}

impl HostBuf {
    fn new(kind: usize, len: usize) -> cudalloc::Result<Self> {
        fn filled<A: Allocator>(a: A, len: usize) -> allocator_api2::vec::Vec<u8, A> {
            let mut v = allocator_api2::vec::Vec::with_capacity_in(len, a);
            v.resize(len, 7);
            v
        }
        Ok(match kind {
            0 => HostBuf::Pageable(vec![7; len]),
            1 => HostBuf::Pinned(filled(PinnedAlloc, len)),
            2 => HostBuf::Managed(filled(ManagedAlloc, len)),
            _ => {
                let p = PinnedSource::default().allocate(len)?;
                // SAFETY: `p` is a fresh block of `len` bytes.
                unsafe { p.as_ptr().write_bytes(7, len) };
                HostBuf::Raw(p, len)
            }
        })
    }
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Pageable(v) => v,
            HostBuf::Pinned(v) => v,
            HostBuf::Managed(v) => v,
            // SAFETY: the block is ours, `len` bytes, initialized in `new`.
            HostBuf::Raw(p, len) => unsafe { core::slice::from_raw_parts_mut(p.as_ptr(), *len) },
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let HostBuf::Raw(p, len) = *self {
            // SAFETY: allocated by PinnedSource::allocate(len) in `new`; no copy is in
            // flight (every timed copy is synchronized).
            unsafe { PinnedSource::default().deallocate(p, len) };
        }
    }
}

/// GB/s of `reps` copies of `buf` to (or from) `dev`, median of the synchronized reps.
fn bandwidth(
    buf: &mut HostBuf,
    dev: &mut DeviceMemory,
    stream: &Stream,
    to_device: bool,
) -> cudalloc::Result<f64> {
    let len = buf.bytes().len();
    let reps = if len >= 256 * MIB { 5 } else { 20 };
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

fn transfers() -> cudalloc::Result<()> {
    let stream = Stream::new(0)?;
    let names = [
        "pageable Vec",
        "Vec<PinnedAlloc>",
        "Vec<ManagedAlloc>",
        "raw cuMemHostAlloc",
    ];
    for to_device in [true, false] {
        println!(
            "## {} bandwidth, GB/s (cuMemcpyAsync, median)\n",
            if to_device { "H2D" } else { "D2H" }
        );
        let mut header = vec!["size"];
        header.extend(names);
        header.extend(["pinned / raw", "pinned / pageable"]);
        let mut table = Table::new(&header);
        for size in [MIB, 16 * MIB, 256 * MIB, GIB] {
            let mut dev = DeviceMemory::new(size, 0)?;
            let mut gbps = [0.0; 4];
            for (kind, g) in gbps.iter_mut().enumerate() {
                let mut buf = HostBuf::new(kind, size)?;
                *g = bandwidth(&mut buf, &mut dev, &stream, to_device)?;
            }
            let mut cells = vec![fmt_size(size)];
            cells.extend(gbps.iter().map(|g| format!("{g:.1}")));
            cells.push(format!("{:.1}%", 100.0 * gbps[1] / gbps[3]));
            cells.push(format!("{:.2}x", gbps[1] / gbps[0]));
            table.row(cells);
        }
        table.print();
    }
    Ok(())
}

fn main() {
    let gpu = cuda::driver_available();
    println!("# cudalloc A/B report\n");
    if gpu {
        let name = cuda::device_name(0).unwrap_or_else(|e| format!("unknown ({e})"));
        println!("GPU: {name}, {} device(s)\n", cuda::device_count());
    } else {
        println!(
            "GPU rows missing: no CUDA driver on this machine (libcuda not found, cuInit failed, or no device). \
             Host rows only; run on a machine with an NVIDIA driver for the pinned, managed and bandwidth rows.\n"
        );
    }
    latency(gpu);
    vec_growth(gpu);
    small_objects(gpu);
    if gpu {
        if let Err(e) = transfers() {
            println!("bandwidth rows failed: {e}");
        }
    }
    if cuda::drop_errors() > 0 {
        println!("warning: {} CUDA errors while freeing", cuda::drop_errors());
    }
}
