//! The caching pool against the allocators it replaces, one A/B group per question:
//!
//! - `alloc_free_hit`: what does an allocate + free pair cost when the pool has the block
//!   cached (256 B .. 16 MiB, one thread)? Rows: `pool_host` (`Pool<HostSource>`),
//!   `system` (glibc malloc through `std::alloc::System`), and with a driver
//!   `pinned_alloc` (the process-wide pinned pool), `direct_pinned` (`Direct<PinnedSource>`:
//!   cuMemHostAlloc + cuMemFreeHost), `device_buffer` (a `DeviceBuffer<u8>` from the
//!   process-wide `DevicePool`, allocated and freed on one stream) and
//!   `cu_mem_alloc_async` (stream-ordered device memory from the default pool, release
//!   threshold raised). Target: pool <= 25 ns.
//! - `alloc_free_threads`: throughput of alloc + free pairs (64 B .. 4 KiB mixed) from
//!   1, 2, 4, 8, 16 threads at once. Target: 16 threads >= 12x one thread.
//! - `vec_growth`: pushing 10^3 .. 10^6 `u64`s one at a time (growth through `grow`).
//!   Target: `PinnedAlloc` within 1.2x of `Global`.
//! - `pinned_growth`: taking a chunk of pinned memory from the driver and giving it back,
//!   2 MiB .. 256 MiB: cuMemHostAlloc (`host_alloc`) against page-aligned memory +
//!   cuMemHostRegister (`register`). The faster becomes the pinned pools' default growth
//!   (`PinnedGrowth`; `CUDALLOC_PINNED_GROWTH` overrides).
//!
//! Rows that need a CUDA driver are skipped with a note when there is none.
//!
//! `cargo bench --bench pool -- --warm-up-time 1 --measurement-time 2`

mod common;

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Global, Layout, System};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput};
use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudalloc::pool::Pool;
use cudalloc::source::{HostSource, MemorySource, PinnedSource, RegisteredSource};
use cudalloc::testing::workload;
use cudalloc::testing::AsyncDeviceMemory;
use cudalloc::{Direct, PinnedAlloc};

use common::{per_call, size_label, wanted};

/// Whether the GPU rows can run; says why not once per group.
fn gpu(group: &str) -> bool {
    let ok = cudalloc::cuda::driver_available();
    if !ok {
        eprintln!("pool bench: {group}: GPU rows skipped: no CUDA driver");
    }
    ok
}

#[inline(always)]
fn pair<A: Allocator>(a: &A, layout: Layout) {
    let p = a.allocate(layout).expect("allocate");
    black_box(p);
    // SAFETY: allocated just above with `layout`.
    unsafe { a.deallocate(p.cast(), layout) };
}

fn alloc_free_hit(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_hit");
    g.sampling_mode(SamplingMode::Flat).sample_size(20);
    let sizes = [256, 4 << 10, 64 << 10, 1 << 20, 16 << 20];
    let pool = Pool::new(HostSource);
    let with_gpu = gpu("alloc_free_hit");
    let stream = if with_gpu {
        Stream::new(0).ok().map(Arc::new)
    } else {
        None
    };
    for size in sizes {
        let layout = Layout::from_size_align(size, 16).unwrap();
        let id = size_label(size);
        g.bench_function(BenchmarkId::new("pool_host", &id), |b| {
            b.iter(|| pair(&pool, layout))
        });
        g.bench_function(BenchmarkId::new("system", &id), |b| {
            b.iter(|| pair(&System, layout))
        });
        if with_gpu {
            g.bench_function(BenchmarkId::new("pinned_alloc", &id), |b| {
                b.iter(|| pair(&PinnedAlloc, layout))
            });
            let direct = Direct::new(PinnedSource::default());
            g.bench_function(BenchmarkId::new("direct_pinned", &id), |b| {
                b.iter(|| pair(&direct, layout))
            });
            if let (Some(stream), Ok(device)) = (&stream, DevicePool::get(0)) {
                g.bench_function(BenchmarkId::new("device_buffer", &id), |b| {
                    b.iter(|| drop(black_box(device.alloc::<u8>(size, stream).expect("DeviceBuffer"))))
                });
            }
            if let Some(stream) = &stream {
                g.bench_function(BenchmarkId::new("cu_mem_alloc_async", &id), |b| {
                    b.iter(|| {
                        drop(black_box(
                            AsyncDeviceMemory::new(size, stream).expect("cuMemAllocAsync"),
                        ))
                    })
                });
            }
        }
    }
    g.finish();
    if wanted("alloc_free_hit") {
        for size in sizes {
            let layout = Layout::from_size_align(size, 16).unwrap();
            let mut row = format!(
                "alloc_free_hit {}, per pair (median / fastest of 200 batches): pool_host {}, system {}",
                size_label(size),
                per_call(200, 10_000, || pair(&pool, layout)),
                per_call(200, 10_000, || pair(&System, layout)),
            );
            if with_gpu {
                row += &format!(
                    ", pinned_alloc {}",
                    per_call(200, 10_000, || pair(&PinnedAlloc, layout))
                );
            }
            println!("{row}");
        }
    }
    if let Some(stream) = stream {
        stream.synchronize().unwrap();
    }
}

/// `threads` threads each run `iters` rounds of 8 alloc + free pairs (64 B .. 4 KiB,
/// freed in reverse) at once; returns the wall time from their common start.
fn run_threads<A: Allocator + Sync>(a: &A, threads: usize, iters: u64) -> Duration {
    const SIZES: [usize; 8] = [64, 96, 128, 256, 512, 1024, 2048, 4096];
    let start = Barrier::new(threads + 1);
    let (start, a) = (&start, a);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    // Warm this thread's cache before the clock starts.
                    for size in SIZES {
                        pair(a, Layout::from_size_align(size, 8).unwrap());
                    }
                    start.wait();
                    let mut held = [core::ptr::NonNull::<[u8]>::from(&mut [][..]); 8];
                    for _ in 0..iters {
                        for (i, size) in SIZES.iter().enumerate() {
                            held[i] = a
                                .allocate(Layout::from_size_align(*size, 8).unwrap())
                                .expect("allocate");
                        }
                        black_box(&mut held);
                        for (i, size) in SIZES.iter().enumerate().rev() {
                            // SAFETY: allocated just above with this layout.
                            unsafe {
                                a.deallocate(held[i].cast(), Layout::from_size_align(*size, 8).unwrap())
                            };
                        }
                    }
                    Instant::now()
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        let end = handles.into_iter().map(|h| h.join().unwrap()).max().unwrap();
        end - t0
    })
}

fn alloc_free_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_threads");
    g.sample_size(20);
    let pool = Arc::new(Pool::new(HostSource));
    let with_gpu = gpu("alloc_free_threads");
    for threads in [1, 2, 4, 8, 16] {
        g.throughput(Throughput::Elements(8 * threads as u64));
        g.bench_function(BenchmarkId::new("pool_host", threads), |b| {
            b.iter_custom(|iters| run_threads(&*pool, threads, iters))
        });
        g.bench_function(BenchmarkId::new("system", threads), |b| {
            b.iter_custom(|iters| run_threads(&System, threads, iters))
        });
        if with_gpu {
            g.bench_function(BenchmarkId::new("pinned_alloc", threads), |b| {
                b.iter_custom(|iters| run_threads(&PinnedAlloc, threads, iters))
            });
        }
    }
    g.finish();
}

fn vec_growth(c: &mut Criterion) {
    let mut g = c.benchmark_group("vec_growth");
    g.sample_size(20);
    let pool = Pool::new(HostSource);
    let with_gpu = gpu("vec_growth");
    for n in [1_000, 10_000, 100_000, 1_000_000] {
        g.throughput(Throughput::Bytes(8 * n as u64));
        g.bench_function(BenchmarkId::new("global", n), |b| {
            b.iter(|| workload::vec_push(Global, black_box(n)))
        });
        g.bench_function(BenchmarkId::new("pool_host", n), |b| {
            b.iter(|| workload::vec_push(&pool, black_box(n)))
        });
        if with_gpu {
            g.bench_function(BenchmarkId::new("pinned_alloc", n), |b| {
                b.iter(|| workload::vec_push(PinnedAlloc, black_box(n)))
            });
        }
    }
    g.finish();
}

/// One chunk from the source and back: what growing a pool by `size` costs.
fn take_and_give_back<S: MemorySource>(source: &S, size: usize) {
    let p = source.allocate(size).expect("pinned chunk");
    black_box(p);
    // SAFETY: allocated just above with `size`.
    unsafe { source.deallocate(p, size) };
}

fn pinned_growth(c: &mut Criterion) {
    if !gpu("pinned_growth") {
        return;
    }
    let mut g = c.benchmark_group("pinned_growth");
    g.sampling_mode(SamplingMode::Flat).sample_size(10);
    for size in [2 << 20, 8 << 20, 32 << 20, 128 << 20, 256 << 20] {
        g.throughput(Throughput::Bytes(size as u64));
        let id = size_label(size);
        g.bench_function(BenchmarkId::new("host_alloc", &id), |b| {
            b.iter(|| take_and_give_back(&PinnedSource::default(), size))
        });
        g.bench_function(BenchmarkId::new("register", &id), |b| {
            b.iter(|| take_and_give_back(&RegisteredSource::new(false), size))
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    alloc_free_hit,
    alloc_free_threads,
    vec_growth,
    pinned_growth
);
criterion_main!(benches);
