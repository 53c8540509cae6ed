//! The trace recorder's cost, one A/B group per question:
//!
//! - `trace_hit_pair`: what does recording add to an allocate + free pair of 256 B?
//!   Rows: `pool_off` / `pool_on` (`Pool<HostSource>`, the block cached, recording off /
//!   on without sites: three events a pair, alloc, free requested, free completed),
//!   `system` / `traced_system_off` / `traced_system_on` (`std::alloc::System` bare and
//!   through `Traced`, off and on). Target: on adds at most 50 ns per event; off adds
//!   under 1 ns (`traced_system_off` against `system`; `pool_off` against the `pool`
//!   bench's `alloc_free_hit/pool_host/256B` of a build without the hooks).
//! - `trace_threads`: pairs per second through `Traced<System>` from 1, 2 and 4 threads
//!   at once, recording on (the global sequence's `fetch_add` is the one shared write).
//!
//! Each group also prints per-call times over timed batches (median / fastest), and the
//! difference per event.
//!
//! `cargo bench --bench trace -- --warm-up-time 1 --measurement-time 2`

mod common;

use std::hint::black_box;
use std::time::Instant;

use allocator_api2::alloc::{Allocator, Layout, System};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cudalloc::pool::Pool;
use cudalloc::source::HostSource;
use cudalloc::trace::{self, TraceConfig, Traced};

use common::{per_call, wanted};

const SIZE: usize = 256;

fn pair<A: Allocator>(a: &A, layout: Layout) {
    let p = a.allocate(layout).unwrap();
    // SAFETY: allocated just above with `layout`.
    unsafe { a.deallocate(black_box(p).cast(), layout) };
}

fn recording<R>(on: bool, f: impl FnOnce() -> R) -> R {
    if on {
        trace::start(TraceConfig::default()).expect("no recording runs (unset CUDALLOC_TRACE)");
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
            g.bench_function(BenchmarkId::new(format!("pool_{state}"), SIZE), |b| {
                b.iter(|| pair(&pool, layout))
            })
        });
        recording(on, || {
            g.bench_function(BenchmarkId::new(format!("traced_system_{state}"), SIZE), |b| {
                b.iter(|| pair(&traced, layout))
            })
        });
    }
    g.bench_function(BenchmarkId::new("system", SIZE), |b| b.iter(|| pair(&System, layout)));
    g.finish();

    if !wanted("trace_hit_pair") {
        return;
    }
    // Batches, alternating off and on, so that both see the same machine.
    let (batches, calls) = (31, 20_000);
    let time = |on: bool, f: &dyn Fn()| recording(on, || per_call(batches, calls, f));
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
}

fn threads(c: &mut Criterion) {
    let layout = Layout::from_size_align(SIZE, 8).unwrap();
    let traced = Traced::new(System);
    let mut g = c.benchmark_group("trace_threads");
    recording(true, || {
        for n in [1usize, 2, 4] {
            g.throughput(criterion::Throughput::Elements(n as u64));
            g.bench_function(BenchmarkId::new("traced_system_on", n), |b| {
                b.iter_custom(|iters| {
                    let t0 = Instant::now();
                    std::thread::scope(|s| {
                        for _ in 0..n {
                            s.spawn(|| {
                                for _ in 0..iters {
                                    pair(&traced, layout);
                                }
                            });
                        }
                    });
                    t0.elapsed()
                })
            });
        }
    });
    g.finish();
}

criterion_group!(benches, hit_pair, threads);
criterion_main!(benches);
