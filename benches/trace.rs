//! The trace recorder's cost, one A/B group per question:
//!
//! - `trace_hit_pair`: what does recording add to an allocate + free pair of 256 B?
//!   Rows: `pool_off` / `pool_on` (`Pool<HostSource>`, the block cached, recording off /
//!   on without sites: three events a pair, alloc, free requested, free completed),
//!   `system` / `traced_system_off` / `traced_system_on` (`std::alloc::System` bare and
//!   through `Traced`, off and on). Target: on adds at most 50 ns per event; off adds
//!   under 1 ns (`traced_system_off` against `system`; `pool_off` against the `pool`
//!   bench's `alloc_free_hit/pool_host/256B` of a build without the hooks).
//!
//! - `trace_parts`: what the parts of a recorded event cost on this machine, alone and
//!   together (printed only, no criterion rows): the time-stamp counter, a thread-local,
//!   an uncontended `fetch_add`, a spin flag's take and release (the per-event flag the
//!   recorder had before issue 20's change), a 64-byte record stored into a 4 MiB ring,
//!   and the ring store followed by one or two locked instructions (which wait for the
//!   stores before them: what a record costs where a store's line is far away). Run it
//!   where `trace_hit_pair`'s figure is out of line with this machine's.
//!
//! Each group also prints per-call times over timed batches (median / fastest), and the
//! difference per event.
//!
//! `cargo bench --bench trace -- --warm-up-time 1 --measurement-time 2`

mod common;

use std::hint::black_box;

use allocator_api2::alloc::{Allocator, Layout, System};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cudalloc::pool::Pool;
use cudalloc::source::HostSource;
use cudalloc::trace::{self, TraceConfig, Traced};

use common::{per_call, size_label, wanted};

const SIZE: usize = 256;

fn pair<A: Allocator>(a: &A, layout: Layout) {
    let p = a.allocate(layout).unwrap();
    // SAFETY: allocated just above with `layout`.
    unsafe { a.deallocate(black_box(p).cast(), layout) };
}

fn recording<R>(on: bool, f: impl FnOnce() -> R) -> R {
    recording_with(on, TraceConfig::default(), f)
}

fn recording_with<R>(on: bool, config: TraceConfig, f: impl FnOnce() -> R) -> R {
    if on {
        trace::start(config).expect("no recording runs (unset CUDALLOC_TRACE)");
    }
    let r = f();
    if on {
        let t = trace::stop();
        black_box(t.events.len());
    }
    r
}

fn hit_pair(c: &mut Criterion) {
    let layout = Layout::from_size_align(SIZE, 8).unwrap();
    let pool = Pool::new(HostSource);
    let traced = Traced::new(System);
    pair(&pool, layout);
    let mut g = c.benchmark_group("trace_hit_pair");
    for on in [false, true] {
        let state = if on { "on" } else { "off" };
        recording(on, || {
            g.bench_function(BenchmarkId::new(format!("pool_{state}"), size_label(SIZE)), |b| {
                b.iter(|| pair(&pool, layout))
            })
        });
        recording(on, || {
            g.bench_function(
                BenchmarkId::new(format!("traced_system_{state}"), size_label(SIZE)),
                |b| b.iter(|| pair(&traced, layout)),
            )
        });
    }
    g.bench_function(BenchmarkId::new("system", size_label(SIZE)), |b| {
        b.iter(|| pair(&System, layout))
    });
    g.finish();

    if !wanted("trace_hit_pair") {
        return;
    }
    // Steady state: a ring of 2^16 events, full after the untimed first batch, so
    // that the batches time recording, not the first touch of the ring's memory.
    let (batches, calls) = (31, 30_000);
    let steady = TraceConfig::default().with_max_entries(1 << 16);
    let time = |on: bool, f: &dyn Fn()| recording_with(on, steady, || per_call(batches, calls, f));
    let pool_off = time(false, &|| pair(&pool, layout));
    let pool_on = time(true, &|| pair(&pool, layout));
    let sys = time(false, &|| pair(&System, layout));
    let traced_off = time(false, &|| pair(&traced, layout));
    let traced_on = time(true, &|| pair(&traced, layout));
    println!("trace_hit_pair per call (median / fastest), 256 B:");
    println!("  pool_off           {pool_off}");
    println!(
        "  pool_on            {pool_on}   (+{:.1} ns per event, 3 events a pair)",
        (pool_on.median - pool_off.median) / 3.0
    );
    println!("  system             {sys}");
    println!(
        "  traced_system_off  {traced_off}   (+{:.2} ns a pair)",
        traced_off.median - sys.median
    );
    println!(
        "  traced_system_on   {traced_on}   (+{:.1} ns per event, 3 events a pair)",
        (traced_on.median - sys.median) / 3.0
    );
    // Filling: the first events of a recording write the ring's fresh memory. `start`
    // makes and faults in the calling thread's first 2^16 records (4 MiB); a ring of a
    // default recording grows past them to 2^20 (64 MiB), each growth faulted in at once.
    // Timed as the steady state is, in batches (of 1000 pairs: 47 pages of ring each,
    // so every batch writes fresh memory), median and fastest over 5 recordings; and the
    // mean, which counts the batches where a ring grows (and faults its growth in).
    let fill = |config: TraceConfig, events: usize| {
        let (batch, mut times) = (1000, Vec::new());
        for _ in 0..5 {
            recording_with(true, config, || {
                for _ in 0..events / 3 / batch {
                    let t0 = std::time::Instant::now();
                    for _ in 0..batch {
                        pair(&traced, layout);
                    }
                    times.push(t0.elapsed().as_secs_f64() * 1e9 / batch as f64);
                }
            });
        }
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        times.sort_by(f64::total_cmp);
        (times[times.len() / 2], times[0], mean)
    };
    let steady_add = (traced_on.median - sys.median) / 3.0;
    for (what, config, events) in [
        ("first 2^16 events, a ring of 2^16", steady, 1 << 16),
        (
            "first 2^20 events, a ring of 2^20",
            TraceConfig::default(),
            1 << 20,
        ),
    ] {
        let (median, fastest, mean) = fill(config, events);
        println!(
            "  traced_system_on, the ring filling ({what}): {median:.1} / {fastest:.1} ns, \
             mean {mean:.1} ns   (+{:.1} ns per event; steady +{steady_add:.1})",
            (median - sys.median) / 3.0,
        );
    }
    // What a start costs the calling thread (its ring made and faulted in) with the stop
    // of an empty recording, median of 21 (the allocator may hand the same ring memory,
    // faulted in already, to every start after the first: `strace -T -e madvise` shows
    // the first's prefault).
    for (what, config) in [("2^16", steady), ("default", TraceConfig::default())] {
        let mut t: Vec<f64> = (0..21)
            .map(|_| {
                let t0 = std::time::Instant::now();
                trace::start(config).expect("no recording runs");
                let dt = t0.elapsed().as_secs_f64() * 1e6;
                black_box(trace::stop());
                dt
            })
            .collect();
        t.sort_by(f64::total_cmp);
        println!("  trace::start, max_entries {what}: {:.0} us", t[10]);
    }
}

/// A record as the recorder stores it: 64 bytes.
#[derive(Clone, Copy, Default)]
struct Record([u64; 8]);

fn parts(_c: &mut Criterion) {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    if !wanted("trace_parts") {
        return;
    }
    static SEQ: AtomicU64 = AtomicU64::new(0);
    static FLAG: AtomicBool = AtomicBool::new(false);
    std::thread_local! {
        static LOCAL: Cell<u64> = const { Cell::new(0) };
    }
    let take_flag = || {
        while FLAG
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {}
        FLAG.store(false, Ordering::Release);
    };
    // 2^16 records, as `trace_hit_pair`'s steady rows.
    let ring = std::cell::RefCell::new(vec![Record::default(); 1 << 16]);
    let head = Cell::new(0usize);
    let store = || {
        let mut r = ring.borrow_mut();
        let i = head.get();
        r[i] = Record([i as u64; 8]);
        head.set(if i + 1 == r.len() { 0 } else { i + 1 });
    };
    let (batches, calls) = (31, 30_000);
    let time = |f: &dyn Fn()| per_call(batches, calls, f);
    let nothing = time(&|| {
        black_box(0);
    });
    #[cfg(target_arch = "x86_64")]
    let rdtsc = time(&|| {
        // SAFETY: `rdtsc` exists on every x86-64 processor and has no side effects.
        black_box(unsafe { core::arch::x86_64::_rdtsc() });
    });
    let local = time(&|| LOCAL.with(|l| l.set(black_box(l.get() + 1))));
    let fetch_add = time(&|| {
        black_box(SEQ.fetch_add(1, Ordering::AcqRel));
    });
    let flag = time(&take_flag);
    let ring_store = time(&store);
    let store_add = time(&|| {
        store();
        black_box(SEQ.fetch_add(1, Ordering::AcqRel));
    });
    let store_flag_add = time(&|| {
        take_flag();
        store();
        black_box(SEQ.fetch_add(1, Ordering::AcqRel));
    });
    black_box(ring.borrow()[0].0[0]);
    println!("trace_parts per call (median / fastest):");
    println!("  loop alone                        {nothing}");
    #[cfg(target_arch = "x86_64")]
    println!("  rdtsc                             {rdtsc}");
    println!("  thread-local get + set            {local}");
    println!("  fetch_add (uncontended)           {fetch_add}");
    println!("  spin flag take + release          {flag}");
    println!("  64 B store into a 4 MiB ring      {ring_store}");
    println!("  ring store + fetch_add            {store_add}   (one recording call now)");
    println!("  flag + ring store + fetch_add     {store_flag_add}   (one recording call before)");
}

criterion_group!(benches, hit_pair, parts);
criterion_main!(benches);
