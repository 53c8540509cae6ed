//! Device memory: the caching `DevicePool` against the driver's allocators, one A/B group
//! per question.
//!
//! - `device_hit`: an alloc + free pair when the block is cached, 256 B .. 128 MiB, one
//!   thread, one stream. Rows: `cache` (the process-wide `DevicePool`; the buffer passed
//!   whole through `black_box`), `cache_ptr` (the same, reading only the buffer's address,
//!   as a program does), `uncached_pool`
//!   (`DevicePool::uncached`: `cuMemAllocFromPoolAsync` + `cuMemFreeAsync`),
//!   `cu_mem_alloc_async` (`cuMemAllocAsync` + `cuMemFreeAsync`, default pool, release
//!   threshold raised) and `cu_mem_alloc` (`cuMemAlloc` + `cuMemFree`). Target (issue 23):
//!   `cache_ptr` <= 20 ns at every size; `cache` shows what moving the buffer through
//!   memory adds.
//! - `device_cross_stream`: a block freed on one stream and allocated on another, back and
//!   forth (every allocation a take after one event): `cache` vs `cu_mem_alloc_async`.
//! - `device_random`: RMM's `random_allocations` (10^5 allocations of uniform sizes up to
//!   64 MiB, at most 16000 MiB live, 73% allocations) spread over 4 streams: `cache` vs
//!   `cu_mem_alloc_async`, whole runs timed. Before timing, one run of each prints peak
//!   bytes held / peak bytes requested and peak bytes reserved / peak bytes requested (what
//!   the device gives up), with the times the cache trimmed its driver pool. Target: cache
//!   reserved / requested <= 1.15. `cache` is the default pool (large blocks on physical
//!   pages, `PageTuning::TIGHT`); the row `driver_pool` (and its memory line) is the
//!   cache on the driver pool (`Backing::DriverPool`); the memory line `pages_fast` the
//!   default with `PageTuning::FAST`, and `PAGE_TUNINGS="8:32,16:64"` adds memory lines
//!   of other tunings (chunk MiB : idle divisor).
//! - `device_threads`: 16 threads, each on its own stream, allocating and freeing blocks
//!   of 4..64 MiB at once (at most 8 live each): the default pool, the cache on the
//!   driver pool and `cuMemAllocAsync`, three runs each, median time and peak reserved /
//!   peak requested (printed), and each run's page heap counters.
//! - `device_page_miss`: what a miss of the cache costs on physical pages: an alloc +
//!   free pair of 32 MiB on an uncached pool, `pages` (the page heap takes the freed run,
//!   still mapped; the free records an event) vs `driver_pool`
//!   (`cuMemAllocFromPoolAsync` + `cuMemFreeAsync`). Before timing it prints the first
//!   allocation on fresh pools (the region's reservation, handle creation, mapping and
//!   access included). The `device_random` memory run prints the page heap's counters
//!   (driver calls and the nanoseconds spent in create, map, set-access, unmap, release).
//! - `device_scratch`: one batch of 16 scratch buffers (4 KiB .. 4 MiB) allocated and
//!   freed: `arena` (`DeviceArena` + reset), `cache`, `cu_mem_alloc_async`.
//! - `device_peer_copy` (2 GPUs; skipped with one): copy bandwidth device 1 -> 0 and
//!   0 -> 1 (`cuMemcpyPeerAsync`, peer access enabled on the pools) and on device 0
//!   (`cuMemcpyDtoDAsync`), 1 MiB .. 256 MiB.
//! - `device_hit_nvtx`: what the NVTX annotations cost the hit (256 B, 1 MiB) with no
//!   tool attached. On the simulated GPU, which runs `DevicePool`'s hot path: `sim_annotated`
//!   (the branch compiled in, as in every `DevicePool`) vs `sim_bare` (compiled out,
//!   `SimPool::bare`), criterion's estimates and then alternating batches in one stretch
//!   of time (the median difference per pair). On the GPU `cache` vs `cache_nvtx_off`
//!   (`with_nvtx(false)`: the same code without a tool, so their paired difference is
//!   the method's own resolution). Target (issue 24): at most 1 ns apart.
//! - `device_hit_sim` (no GPU needed): the hit of `device_hit` on a simulated GPU
//!   (`cudalloc::device::sim`: the same cache, thread caches and hot path as `DevicePool`,
//!   over simulated streams), 256 B .. 128 MiB, with a `malloc` alloc + free pair of 64 B
//!   as the reference in the same run; `sim_paged` the same on a simulated page heap
//!   shaped as the H200's default (blocks from 2 MiB up in the large slots, as
//!   `device_hit`'s 16 and 128 MiB rows), `sim_cache` all by class. The ratio
//!   `sim / malloc` compares hot-path changes across runs and machines.
//! - `device_threads_sim` (no GPU needed): `device_threads`' workload on the simulated
//!   default pool whose driver calls sleep the H100's measured costs
//!   (`DriverCosts::H100`): what waiting for another thread's driver calls costs.
//!
//! Without a CUDA driver the bench runs the simulated groups only and says why. `--quick` (criterion's flag) also
//! shrinks the workloads: three sizes, 10^4 random allocations. Filters pick groups (the
//! memory runs of `device_random` happen only when no filter excludes that group):
//!
//! `cargo bench --bench device -- --quick device_hit`

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use cudalloc::cuda::{copy_async, default_pool_reserved, device_count, Stream};
use cudalloc::device::sim::{DriverCosts, SimPool, SimStream};
use cudalloc::device::{Backing, PageTuning};
use cudalloc::device::{DeviceArena, DevicePool, DevicePoolConfig};
use cudalloc::testing::{AsyncDeviceMemory, DeviceMemory};

use common::{paired, per_call, size_label, wanted};

fn quick() -> bool {
    std::env::args().any(|a| a == "--quick")
}

fn device_hit(c: &mut Criterion, stream: &Stream) {
    let mut g = c.benchmark_group("device_hit");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let sizes: &[usize] = if quick() {
        &[256, 1 << 20, 128 << 20]
    } else {
        &[256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20]
    };
    let cached = DevicePool::get(0).expect("device pool");
    let uncached = DevicePool::uncached(0).expect("uncached pool");
    for &size in sizes {
        let id = size_label(size);
        g.bench_function(BenchmarkId::new("cache", &id), |b| {
            b.iter(|| {
                drop(black_box(
                    cached.alloc::<u8>(black_box(size), stream).expect("cache"),
                ))
            })
        });
        // What a program does with a buffer: reads its address (for a kernel or a copy)
        // and drops it. The row above also moves the whole 48-byte buffer through memory
        // (`black_box` of the buffer), as a program that keeps buffers in a collection
        // does. Until `DevicePool::alloc` had two ways out, that move read 16 bytes at a
        // time what had just been written 8 bytes at a time, which the CPU cannot forward
        // from its store buffer (about 10 ns on the H100).
        g.bench_function(BenchmarkId::new("cache_ptr", &id), |b| {
            b.iter(|| {
                let buf = cached.alloc::<u8>(black_box(size), stream).expect("cache");
                black_box(buf.device_ptr());
            })
        });
        g.bench_function(BenchmarkId::new("uncached_pool", &id), |b| {
            b.iter(|| {
                drop(black_box(
                    uncached.alloc::<u8>(size, stream).expect("uncached pool"),
                ))
            })
        });
        g.bench_function(BenchmarkId::new("cu_mem_alloc_async", &id), |b| {
            b.iter(|| {
                drop(black_box(
                    AsyncDeviceMemory::new(size, stream).expect("cuMemAllocAsync"),
                ))
            })
        });
        g.bench_function(BenchmarkId::new("cu_mem_alloc", &id), |b| {
            b.iter(|| drop(black_box(DeviceMemory::new(size, 0).expect("cuMemAlloc"))))
        });
    }
    g.finish();
    stream.synchronize().expect("synchronize");
    if wanted("device_hit") {
        let rows: Vec<String> = sizes
            .iter()
            .map(|&size| {
                let t = per_call(200, 10_000, || {
                    drop(black_box(
                        cached.alloc::<u8>(black_box(size), stream).expect("cache"),
                    ))
                });
                let ptr = per_call(200, 10_000, || {
                    let buf = cached.alloc::<u8>(black_box(size), stream).expect("cache");
                    black_box(buf.device_ptr());
                });
                format!("{} {t} (cache_ptr {ptr})", size_label(size))
            })
            .collect();
        println!(
            "device_hit cache, per pair (median / fastest of 200 batches): {}",
            rows.join(", ")
        );
        // The same pair against a `malloc` and `free` of 64 bytes in alternating batches.
        // Where the VM's speed moves both by one factor (the hit's time moves by 2x between
        // processes on one core and one layout: BENCHMARKS.md, 2026-12-07), the ratio is
        // what the hit costs whatever the moment, and a ratio that moves less than the
        // times shows that it was the machine.
        let rows: Vec<String> = sizes
            .iter()
            .map(|&size| {
                let p = paired(
                    200,
                    10_000,
                    || {
                        let buf = cached.alloc::<u8>(black_box(size), stream).expect("cache");
                        black_box(buf.device_ptr());
                    },
                    malloc_64,
                );
                format!("{} {} against {} ({:.2}x)", size_label(size), p.a, p.b, p.ratio)
            })
            .collect();
        println!(
            "device_hit cache_ptr against malloc 64B, alternating batches (median / fastest \
             of 200 each; the median of the rounds' ratios): {}",
            rows.join(", ")
        );
        println!("device_hit: {}", cached.stats());
    }
}

/// A `malloc` and `free` of 64 bytes: the host reference the hit rows are read against.
fn malloc_64() {
    drop(black_box(Box::new(black_box([0u64; 8]))));
}

fn device_hit_sim(c: &mut Criterion) {
    let sizes: &[usize] = if quick() {
        &[256, 1 << 20, 128 << 20]
    } else {
        &[256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20]
    };
    let pool = SimPool::new(256 << 20);
    let paged = SimPool::paged(256 << 20);
    let stream = SimStream::new();
    let hit = |size: usize| drop(black_box(pool.alloc(black_box(size), &stream).expect("sim")));
    let hit_paged = |size: usize| drop(black_box(paged.alloc(black_box(size), &stream).expect("sim")));
    let mut g = c.benchmark_group("device_hit_sim");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g.bench_function(BenchmarkId::new("malloc", "64B"), |b| b.iter(malloc_64));
    for &size in sizes {
        g.bench_function(BenchmarkId::new("sim_cache", size_label(size)), |b| {
            b.iter(|| hit(size))
        });
        g.bench_function(BenchmarkId::new("sim_paged", size_label(size)), |b| {
            b.iter(|| hit_paged(size))
        });
    }
    g.finish();
    if wanted("device_hit_sim") {
        // Criterion's means suffer on a loaded machine; the batches' median and minimum
        // less so.
        let base = per_call(200, 10_000, malloc_64);
        let rows: Vec<String> = sizes
            .iter()
            .map(|&size| {
                let t = per_call(200, 10_000, || hit(size));
                let p = per_call(200, 10_000, || hit_paged(size));
                format!(
                    "{} {t} ({:.2}x; sim_paged {p}, {:.2}x)",
                    size_label(size),
                    t.median / base.median,
                    p.median / base.median
                )
            })
            .collect();
        println!(
            "device_hit_sim, per call (median / fastest of 200 batches): malloc 64B {base}; sim_cache {}",
            rows.join(", ")
        );
    }
}

/// What the NVTX annotations cost the hit without a tool (issue 24): the simulated pool
/// with the hot path's branch compiled in (`SimPool::annotated`, as every `DevicePool`)
/// and out (`SimPool::bare`) in one process, and on the GPU a pool with annotations on
/// and one with them off (the same code without a tool: a control of the method).
fn device_hit_nvtx(c: &mut Criterion, stream: Option<&Stream>) {
    let mut g = c.benchmark_group("device_hit_nvtx");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let sizes = [256usize, 1 << 20];
    let sim_stream = SimStream::new();
    let (annotated, bare) = (SimPool::annotated(256 << 20), SimPool::bare(256 << 20));
    let bare2 = SimPool::bare(256 << 20);
    for size in sizes {
        let id = size_label(size);
        g.bench_function(BenchmarkId::new("sim_annotated", &id), |b| {
            b.iter(|| {
                drop(black_box(
                    annotated.alloc(black_box(size), &sim_stream).expect("sim"),
                ))
            })
        });
        g.bench_function(BenchmarkId::new("sim_bare", &id), |b| {
            b.iter(|| drop(black_box(bare.alloc(black_box(size), &sim_stream).expect("sim"))))
        });
    }
    let gpu = stream.map(|stream| {
        let on = DevicePool::new(0, DevicePoolConfig::default()).expect("device pool");
        let off = DevicePool::new(0, DevicePoolConfig::default().with_nvtx(false)).expect("device pool");
        (stream, on, off)
    });
    if let Some((stream, on, off)) = &gpu {
        for size in sizes {
            let id = size_label(size);
            for (name, pool) in [("cache", on), ("cache_nvtx_off", off)] {
                g.bench_function(BenchmarkId::new(name, &id), |b| {
                    b.iter(|| {
                        let buf = pool.alloc::<u8>(black_box(size), stream).expect("cache");
                        black_box(buf.device_ptr());
                    })
                });
            }
        }
        stream.synchronize().expect("synchronize");
    }
    g.finish();
    if wanted("device_hit_nvtx") {
        let mut rows = Vec::new();
        for size in sizes {
            let id = size_label(size);
            let t = paired(
                2000,
                10_000,
                || {
                    drop(black_box(
                        annotated.alloc(black_box(size), &sim_stream).expect("sim"),
                    ))
                },
                || drop(black_box(bare.alloc(black_box(size), &sim_stream).expect("sim"))),
            );
            rows.push(format!("sim_annotated vs sim_bare {id}: {t}"));
            // The control: the same code in two pools (the method's resolution).
            let t = paired(
                2000,
                10_000,
                || drop(black_box(bare.alloc(black_box(size), &sim_stream).expect("sim"))),
                || drop(black_box(bare2.alloc(black_box(size), &sim_stream).expect("sim"))),
            );
            rows.push(format!("sim_bare vs sim_bare (another pool) {id}: {t}"));
            if let Some((stream, on, off)) = &gpu {
                let hit = |pool: &DevicePool| {
                    let buf = pool.alloc::<u8>(black_box(size), stream).expect("cache");
                    black_box(buf.device_ptr());
                };
                let t = paired(2000, 10_000, || hit(on), || hit(off));
                rows.push(format!("cache vs cache_nvtx_off {id}: {t}"));
            }
        }
        if let Some((stream, ..)) = &gpu {
            stream.synchronize().expect("synchronize");
        }
        println!(
            "device_hit_nvtx, per pair (median / fastest of 2000 alternating batches of 10^4), \
             NVTX tool attached: {}:",
            cudalloc::cuda::nvtx::attached()
        );
        for r in rows {
            println!("  {r}");
        }
    }
}

fn device_cross_stream(c: &mut Criterion, stream: &Stream) {
    let mut g = c.benchmark_group("device_cross_stream");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let other = Stream::new(0).expect("stream");
    let pool = DevicePool::new(0, DevicePoolConfig::default()).expect("pool");
    let size = 1 << 20;
    g.bench_function(BenchmarkId::new("cache", "1MiB"), |b| {
        b.iter(|| {
            drop(black_box(pool.alloc::<u8>(size, stream).expect("cache")));
            drop(black_box(pool.alloc::<u8>(size, &other).expect("cache")));
        })
    });
    g.bench_function(BenchmarkId::new("cu_mem_alloc_async", "1MiB"), |b| {
        b.iter(|| {
            drop(black_box(
                AsyncDeviceMemory::new(size, stream).expect("cuMemAllocAsync"),
            ));
            drop(black_box(
                AsyncDeviceMemory::new(size, &other).expect("cuMemAllocAsync"),
            ));
        })
    });
    g.finish();
    stream.synchronize().expect("synchronize");
    other.synchronize().expect("synchronize");
    if wanted("device_cross_stream") {
        println!("device_cross_stream: {}", pool.stats());
    }
}

/// A small deterministic generator (xorshift), so every run sees the same workload.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// RMM's `random_allocation_free`: `2 * allocations` steps; while under `max_usage`, 73%
/// of them allocate (a uniform size up to `max_size`, on a random one of `streams`
/// streams), the rest free a random live block (on its stream). Returns the peak of the
/// bytes requested.
/// One memory run of the workload (allocations, max size, max usage) on `streams`,
/// allocating with `alloc`, then the streams synchronized: (peak bytes requested, time).
fn timed_run<T>(
    alloc: impl FnMut(usize, usize) -> T,
    (allocations, max_size, max_usage): (usize, usize, usize),
    streams: &[Stream],
) -> (usize, Duration) {
    let t0 = Instant::now();
    let peak = random_allocations(alloc, allocations, max_size, max_usage, streams.len());
    let elapsed = t0.elapsed();
    streams.iter().for_each(|s| s.synchronize().expect("synchronize"));
    (peak, elapsed)
}

fn random_allocations<T>(
    mut alloc: impl FnMut(usize, usize) -> T,
    allocations: usize,
    max_size: usize,
    max_usage: usize,
    streams: usize,
) -> usize {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut live: Vec<(T, usize)> = Vec::with_capacity(4096);
    let (mut requested, mut peak, mut count) = (0usize, 0usize, 0usize);
    for _ in 0..allocations * 2 {
        let size = 1 + rng.below(max_size as u64) as usize;
        let do_alloc =
            live.is_empty() || (rng.below(100) < 73 && count < allocations && requested + size < max_usage);
        if do_alloc {
            let s = rng.below(streams as u64) as usize;
            live.push((alloc(size, s), size));
            requested += size;
            peak = peak.max(requested);
            count += 1;
        } else {
            let i = rng.below(live.len() as u64) as usize;
            let (block, size) = live.swap_remove(i);
            drop(block);
            requested -= size;
        }
    }
    drop(live);
    peak
}

fn device_random(c: &mut Criterion) {
    let (allocations, max_size, max_usage) = if quick() {
        (10_000, 64 << 20, 16_000 << 20)
    } else {
        (100_000, 64 << 20, 16_000 << 20)
    };
    let streams: Vec<Stream> = (0..4).map(|_| Stream::new(0).expect("stream")).collect();
    // The driver's one-time set-up of stream-ordered allocation (8-11 ms on the H200) is
    // paid here, not by the first pool the memory runs time.
    cudalloc::testing::warm_up_stream_ordered(0).expect("warm-up");
    let sync = || streams.iter().for_each(|s| s.synchronize().expect("synchronize"));
    let work = (allocations, max_size, max_usage);
    // Memory: one run each on a fresh pool / a freshly reset default pool.
    if wanted("device_random") {
        let paged = DevicePoolConfig::default().with_backing(Backing::PhysicalPages);
        let mut configs = vec![
            ("cache".to_string(), DevicePoolConfig::default()),
            ("pages_fast".to_string(), paged.with_pages(PageTuning::FAST)),
            (
                "driver_pool".to_string(),
                DevicePoolConfig::default().with_backing(Backing::DriverPool),
            ),
        ];
        // More page tunings to compare: `PAGE_TUNINGS="8:32,16:64,16:128:nocache"` (chunk
        // MiB : idle divisor, and `nocache` for a pool without the size-class cache, `small`
        // for one caching only blocks below the page heap's threshold).
        for t in std::env::var("PAGE_TUNINGS").unwrap_or_default().split(',') {
            let mut f = t.split(':');
            if let (Some(mib), Some(div)) = (f.next(), f.next()) {
                let (mib, div) = (mib.parse::<usize>().expect("MiB"), div.parse().expect("divisor"));
                let how = f.next().unwrap_or("");
                let mut config = paged.with_pages(PageTuning::new(mib << 20, div));
                match how {
                    "nocache" => config = config.with_cache(false),
                    // Only the blocks below the page heap's threshold cached.
                    "small" => config = config.with_max_cached_block((4 << 20) - 1),
                    _ => {}
                }
                configs.push((format!("pages_{mib}mib_1/{div}_{how}"), config));
            }
        }
        for (name, config) in configs {
            let name = name.as_str();
            let pool = DevicePool::new(0, config).expect("pool");
            let (peak, elapsed) = timed_run(
                |size, s| pool.alloc::<u8>(size, &streams[s]).expect(name),
                work,
                &streams,
            );
            let st = pool.stats();
            println!(
                "device_random {name}: {allocations} allocations in {:.1} ms; peak requested {:.0} MiB, \
                 peak held {:.0} MiB (held / requested = {:.3}), peak reserved {:.0} MiB \
                 (reserved / requested = {:.3}, target <= 1.15); {} driver-pool trims\n{st}",
                elapsed.as_secs_f64() * 1e3,
                peak as f64 / 1048576.0,
                st.peak_held_bytes as f64 / 1048576.0,
                st.peak_held_bytes as f64 / peak as f64,
                st.peak_reserved_bytes as f64 / 1048576.0,
                st.peak_reserved_bytes as f64 / peak as f64,
                st.trims,
            );
            if let Some(c) = cudalloc::testing::page_heap_counters(&pool) {
                println!("device_random {name}: page heap {c}");
            }
            // This thread's cache holds a handle of the pool: give its memory back now.
            pool.trim();
        }
    }
    if wanted("device_random") {
        sync();
        let _ = default_pool_reserved(0, true);
        let (peak, elapsed) = timed_run(
            |size, s| AsyncDeviceMemory::new(size, &streams[s]).expect("cuMemAllocAsync"),
            work,
            &streams,
        );
        if let Ok((_, high)) = default_pool_reserved(0, false) {
            println!(
                "device_random cu_mem_alloc_async: {allocations} allocations in {:.1} ms; peak requested \
                 {:.0} MiB, peak reserved {:.0} MiB (reserved / requested = {:.3})",
                elapsed.as_secs_f64() * 1e3,
                peak as f64 / 1048576.0,
                high as f64 / 1048576.0,
                high as f64 / peak as f64
            );
        }
    }
    let mut g = c.benchmark_group("device_random");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(if quick() { 1 } else { 5 }));
    g.throughput(Throughput::Elements(allocations as u64));
    let pool = DevicePool::get(0).expect("pool");
    let id = format!("{allocations}x{}MiB", max_size >> 20);
    // A row: `iters` runs of the workload, allocating with `$alloc`.
    macro_rules! random_row {
        ($name:expr, $alloc:expr) => {
            g.bench_function(BenchmarkId::new($name, &id), |b| {
                b.iter_custom(|iters| {
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        random_allocations($alloc, allocations, max_size, max_usage, streams.len());
                    }
                    t0.elapsed()
                })
            })
        };
    }
    random_row!("cache", |size, s| pool
        .alloc::<u8>(size, &streams[s])
        .expect("cache"));
    random_row!("cu_mem_alloc_async", |size, s| {
        AsyncDeviceMemory::new(size, &streams[s]).expect("cuMemAllocAsync")
    });
    let driver = DevicePool::new(0, DevicePoolConfig::default().with_backing(Backing::DriverPool))
        .expect("pool on the driver pool");
    random_row!("driver_pool", |size, s| driver
        .alloc::<u8>(size, &streams[s])
        .expect("driver pool"));
    g.finish();
    sync();
    // The process-wide pool keeps what the runs cached; give it back for later groups.
    pool.trim();
    driver.trim();
}

/// Threads of `device_threads`, allocations each, blocks live at most per thread.
const THREADS: usize = 16;

/// One run of `device_threads`: `threads` threads, each on its own stream, allocating
/// blocks of 4..64 MiB (keeping at most 8 live, freeing a random one when full or at
/// random) with `alloc` (size, thread); the wall time of the whole and the peak of the
/// bytes requested by all threads together.
fn threads_run<T>(
    alloc: impl Fn(usize, usize) -> T + Sync,
    per_thread: usize,
    threads: usize,
) -> (Duration, usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (live, peak) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let barrier = std::sync::Barrier::new(threads + 1);
    let t0 = std::thread::scope(|s| {
        for t in 0..threads {
            let (alloc, live, peak, barrier) = (&alloc, &live, &peak, &barrier);
            s.spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1));
                let mut mine: Vec<(T, usize)> = Vec::with_capacity(8);
                barrier.wait();
                for _ in 0..per_thread {
                    if mine.len() == 8 || (!mine.is_empty() && rng.below(3) == 0) {
                        let i = rng.below(mine.len() as u64) as usize;
                        let (b, size) = mine.swap_remove(i);
                        drop(b);
                        live.fetch_sub(size, Ordering::Relaxed);
                    }
                    let size = (4 << 20) + rng.below(60 << 20) as usize;
                    mine.push((alloc(size, t), size));
                    let now = live.fetch_add(size, Ordering::Relaxed) + size;
                    peak.fetch_max(now, Ordering::Relaxed);
                }
                for (b, size) in mine.drain(..) {
                    drop(b);
                    live.fetch_sub(size, Ordering::Relaxed);
                }
            });
        }
        barrier.wait();
        Instant::now()
    });
    (t0.elapsed(), peak.load(Ordering::Relaxed))
}

/// 16 threads allocating and freeing large blocks of changing sizes at once, each on its
/// own stream: the default pool (a fresh one per run), the cache on the driver pool and
/// `cuMemAllocAsync`, alternating, three runs each; the median time and the peak
/// reserved / peak requested of each. Printed, not a criterion group (each run is a
/// whole workload). `cargo bench --bench device -- device_threads`
fn device_threads() {
    if !wanted("device_threads") {
        return;
    }
    let per_thread = if quick() { 500 } else { 4000 };
    let streams: Vec<Stream> = (0..THREADS).map(|_| Stream::new(0).expect("stream")).collect();
    let mut times: [Vec<f64>; 3] = Default::default();
    let mut ratios = [0.0f64; 3];
    for _ in 0..3 {
        for (i, config) in [
            Some(DevicePoolConfig::default()),
            Some(DevicePoolConfig::default().with_backing(Backing::DriverPool)),
            None,
        ]
        .into_iter()
        .enumerate()
        {
            let (elapsed, peak, reserved) = match config {
                Some(config) => {
                    let pool = DevicePool::new(0, config).expect("pool");
                    let (elapsed, peak) = threads_run(
                        |size, t| pool.alloc::<u8>(size, &streams[t]).expect("pool"),
                        per_thread,
                        THREADS,
                    );
                    streams.iter().for_each(|s| s.synchronize().expect("synchronize"));
                    let reserved = pool.stats().peak_reserved_bytes;
                    if let Some(c) = cudalloc::testing::page_heap_counters(&pool) {
                        // Where a run's time goes: the driver calls' counts and nanoseconds.
                        println!("device_threads run {}: page heap {c}", times[i].len());
                    }
                    pool.trim();
                    (elapsed, peak, reserved as f64)
                }
                None => {
                    let _ = default_pool_reserved(0, true);
                    let (elapsed, peak) = threads_run(
                        |size, t| AsyncDeviceMemory::new(size, &streams[t]).expect("cuMemAllocAsync"),
                        per_thread,
                        THREADS,
                    );
                    streams.iter().for_each(|s| s.synchronize().expect("synchronize"));
                    let high = default_pool_reserved(0, false).map_or(0, |(_, h)| h);
                    (elapsed, peak, high as f64)
                }
            };
            times[i].push(elapsed.as_secs_f64() * 1e3);
            ratios[i] = reserved / peak as f64;
        }
    }
    for (i, name) in ["default pool", "driver pool", "cu_mem_alloc_async"]
        .iter()
        .enumerate()
    {
        times[i].sort_by(f64::total_cmp);
        println!(
            "device_threads {name}: {THREADS} threads x {per_thread} allocations of 4..64 MiB: \
             median {:.1} ms (runs {:.1?}); peak reserved / peak requested {:.3}",
            times[i][1], times[i], ratios[i]
        );
    }
}

/// `device_threads` on the simulated GPU (no GPU needed): the default pool's shape over
/// a simulated page heap whose driver calls take the H100's measured costs
/// (`DriverCosts::H100`, slept), 16 threads, three runs; the median time and the peak
/// reserved / peak requested. It shows what the heap's lock costs when other threads
/// wait for its driver calls (`pages/held.rs`). `cargo bench --bench device --
/// device_threads_sim`
fn device_threads_sim() {
    if !wanted("device_threads_sim") {
        return;
    }
    let per_thread = if quick() { 200 } else { 1000 };
    let streams: Vec<SimStream> = (0..THREADS).map(|_| SimStream::new()).collect();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let pool = SimPool::paged_with_costs(64 << 20, DriverCosts::H100);
        let (elapsed, peak) = threads_run(
            |size, t| pool.alloc(size, &streams[t]).expect("sim"),
            per_thread,
            THREADS,
        );
        runs.push((
            elapsed.as_secs_f64() * 1e3,
            pool.peak_reserved() as f64 / peak as f64,
        ));
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!(
        "device_threads_sim: {THREADS} threads x {per_thread} allocations of 4..64 MiB, simulated \
         driver at the H100's costs: median {:.1} ms (runs {:.1?} ms, reserved/requested {:.3?})",
        runs[1].0,
        runs.iter().map(|r| r.0).collect::<Vec<_>>(),
        runs.iter().map(|r| r.1).collect::<Vec<_>>(),
    );
}

/// What a miss costs on physical pages (see the module docs).
fn device_page_miss(c: &mut Criterion, stream: &Stream) {
    const SIZE: usize = 32 << 20;
    if !wanted("device_page_miss") {
        return;
    }
    let config = DevicePoolConfig::default().with_cache(false);
    // The first allocation of fresh pools: cuMemCreate, cuMemAddressReserve, cuMemMap,
    // cuMemSetAccess.
    let (mut first, n) = (Duration::ZERO, 20);
    for _ in 0..n {
        let pool = DevicePool::new(0, config.with_backing(Backing::PhysicalPages)).expect("pages");
        let t0 = Instant::now();
        let b = pool.alloc::<u8>(SIZE, stream).expect("pages");
        first += t0.elapsed();
        drop(b);
        stream.synchronize().expect("synchronize");
    }
    println!(
        "device_page_miss: first 32 MiB allocation of a fresh pool on pages: {:.1} us",
        first.as_secs_f64() * 1e6 / n as f64
    );
    let mut g = c.benchmark_group("device_page_miss");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(if quick() { 1 } else { 3 }));
    for (name, backing) in [
        ("pages", Backing::PhysicalPages),
        ("driver_pool", Backing::DriverPool),
    ] {
        let pool = DevicePool::new(0, config.with_backing(backing)).expect("pool");
        g.bench_function(BenchmarkId::new(name, "32MiB"), |b| {
            b.iter(|| drop(black_box(pool.alloc::<u8>(SIZE, stream).expect("alloc"))))
        });
        stream.synchronize().expect("synchronize");
        println!("device_page_miss {name}: {}", pool.stats());
    }
    g.finish();
}

/// Scratch request sizes: 4 KiB to 4 MiB by fours, cycled to sixteen requests.
const SCRATCH: [usize; 16] = {
    const STEPS: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
    let mut sizes = [0; 16];
    let mut i = 0;
    while i < sizes.len() {
        sizes[i] = STEPS[i % STEPS.len()];
        i += 1;
    }
    sizes
};

fn device_scratch(c: &mut Criterion, stream: &Stream) {
    let mut g = c.benchmark_group("device_scratch");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(SCRATCH.len() as u64));
    let pool = DevicePool::get(0).expect("pool");
    let mut arena = DeviceArena::new(&pool, stream).expect("arena");
    g.bench_function("arena", |b| {
        b.iter(|| {
            for &size in &SCRATCH {
                black_box(arena.alloc::<u8>(size).expect("arena").device_ptr());
            }
            arena.reset();
        })
    });
    let mut held = Vec::with_capacity(SCRATCH.len());
    g.bench_function("cache", |b| {
        b.iter(|| {
            for &size in &SCRATCH {
                held.push(pool.alloc::<u8>(size, stream).expect("cache"));
            }
            black_box(&held);
            held.clear();
        })
    });
    let mut held = Vec::with_capacity(SCRATCH.len());
    g.bench_function("cu_mem_alloc_async", |b| {
        b.iter(|| {
            for &size in &SCRATCH {
                held.push(AsyncDeviceMemory::new(size, stream).expect("cuMemAllocAsync"));
            }
            black_box(&held);
            held.clear();
        })
    });
    g.finish();
    stream.synchronize().expect("synchronize");
}

fn device_peer_copy(c: &mut Criterion) {
    if !wanted("device_peer_copy") {
        return;
    }
    if device_count() < 2 {
        eprintln!(
            "device bench: device_peer_copy skipped: needs 2 GPUs ({} here)",
            device_count()
        );
        return;
    }
    let (p0, p1) = (
        DevicePool::get(0).expect("pool 0"),
        DevicePool::get(1).expect("pool 1"),
    );
    for (pool, peer) in [(&p0, 1), (&p1, 0)] {
        if let Err(e) = pool.enable_peer_access(peer) {
            eprintln!(
                "device bench: no peer access of device {peer} to device {}: {e}",
                pool.device()
            );
        }
    }
    let (s0, s1) = (
        Stream::new(0).expect("stream 0"),
        Stream::new(1).expect("stream 1"),
    );
    let mut g = c.benchmark_group("device_peer_copy");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let sizes: &[usize] = if quick() {
        &[64 << 20]
    } else {
        &[1 << 20, 16 << 20, 64 << 20, 256 << 20]
    };
    for &size in sizes {
        g.throughput(Throughput::Bytes(size as u64));
        let id = size_label(size);
        let a0 = p0.alloc_zeroed::<u8>(size, &s0).expect("alloc 0");
        let b0 = p0.alloc_zeroed::<u8>(size, &s0).expect("alloc 0");
        let a1 = p1.alloc_zeroed::<u8>(size, &s1).expect("alloc 1");
        s0.synchronize().expect("synchronize");
        s1.synchronize().expect("synchronize");
        // Each row queues `iters` copies on one stream and waits for them.
        let mut row = |name: &str, dst: (u64, usize), src: (u64, usize), s: &Stream| {
            g.bench_function(BenchmarkId::new(name, &id), |b| {
                b.iter_custom(|iters| {
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        // SAFETY: the buffers are `size` bytes on the devices named, alive
                        // for the whole group and used by nothing but these copies, all on
                        // `s` (and the zeroing above, synchronized).
                        unsafe { copy_async(dst.0, dst.1, src.0, src.1, size, s) }.expect("copy");
                    }
                    s.synchronize().expect("synchronize");
                    t0.elapsed()
                })
            });
        };
        row("peer_1_to_0", (a0.device_ptr(), 0), (a1.device_ptr(), 1), &s0);
        row("peer_0_to_1", (a1.device_ptr(), 1), (a0.device_ptr(), 0), &s1);
        row("local_0", (b0.device_ptr(), 0), (a0.device_ptr(), 0), &s0);
    }
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    device_hit_sim(&mut c);
    device_threads_sim();
    if !cudalloc::cuda::driver_available() {
        device_hit_nvtx(&mut c, None);
        eprintln!(
            "device bench: no CUDA driver: only device_hit_sim, device_threads_sim and device_hit_nvtx's \
             simulated rows ran"
        );
        c.final_summary();
        return;
    }
    let stream = Stream::new(0).expect("stream");
    device_hit(&mut c, &stream);
    device_hit_nvtx(&mut c, Some(&stream));
    device_cross_stream(&mut c, &stream);
    device_random(&mut c);
    device_page_miss(&mut c, &stream);
    device_threads();
    device_scratch(&mut c, &stream);
    device_peer_copy(&mut c);
    c.final_summary();
}
