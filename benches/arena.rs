//! Bump arenas against bumpalo and `Global`, one A/B group per question:
//!
//! - `small_objects_then_reset`: 10^6 objects of 8..=256 bytes, kept live, freed, then a
//!   reset (the shared `workload::small_objects`): `Arena` over host and pinned memory
//!   against `bumpalo::Bump`. Target: the arena within 1.1x of bumpalo.
//! - `bump_then_reset`: the same sizes, bumped and written with nothing else in the
//!   loop, to compare the allocation fast paths alone.
//! - `vec_growth`: pushing `u64`s one at a time into a `Vec` (growth by doubling) in an
//!   arena, in bumpalo and in `Global`.
//!
//! The pinned rows need a CUDA driver; without one they are skipped with a note.
//!
//! `cargo bench --bench arena -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use allocator_api2::alloc::{Allocator, Global, Layout};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cudalloc::arena::Arena;
use cudalloc::source::HostVisible;
use cudalloc::testing::workload;

const OBJECTS: usize = 1_000_000;

/// Whether the pinned rows can run; says why not, once.
fn pinned_available() -> bool {
    static NOTED: std::sync::Once = std::sync::Once::new();
    let ok = cudalloc::cuda::driver_available();
    if !ok {
        NOTED.call_once(|| eprintln!("arena bench: pinned rows skipped: no CUDA driver"));
    }
    ok
}

/// Allocates `n` blocks of 8..=256 bytes (the sizes of `workload::small_objects`) and
/// writes the first word of each; frees nothing.
fn bump_n<A: Allocator>(a: &A, n: usize) -> usize {
    let mut bytes = 0;
    for size in workload::object_sizes(n) {
        let Ok(layout) = Layout::from_size_align(size, 8) else {
            continue;
        };
        let Ok(p) = a.allocate(layout) else { break };
        // SAFETY: the block has `size` >= 8 bytes, 8-aligned.
        unsafe { p.cast::<u64>().as_ptr().write(size as u64) };
        bytes += size;
    }
    bytes
}

/// A workload over any allocator, for one group of rows.
trait Workload {
    const GROUP: &'static str;
    fn run<A: Allocator>(a: &A, n: usize) -> usize;
}

/// The shared workload: objects kept live, then freed in allocation order.
struct SmallObjects;
impl Workload for SmallObjects {
    const GROUP: &'static str = "small_objects_then_reset";
    fn run<A: Allocator>(a: &A, n: usize) -> usize {
        workload::small_objects(a, n)
    }
}

/// Bumps only: the allocation fast paths compared without other work in the loop.
struct BumpOnly;
impl Workload for BumpOnly {
    const GROUP: &'static str = "bump_then_reset";
    fn run<A: Allocator>(a: &A, n: usize) -> usize {
        bump_n(a, n)
    }
}

fn arena_row<W: Workload, S: HostVisible>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mut arena: Arena<S>,
) {
    g.bench_function(BenchmarkId::new(name, OBJECTS), |b| {
        b.iter(|| {
            let n = W::run(&&arena, black_box(OBJECTS));
            arena.reset();
            n
        })
    });
}

fn objects_group<W: Workload>(c: &mut Criterion) {
    let mut g = c.benchmark_group(W::GROUP);
    g.throughput(Throughput::Elements(OBJECTS as u64));
    let mut bump = bumpalo::Bump::new();
    g.bench_function(BenchmarkId::new("bumpalo", OBJECTS), |b| {
        b.iter(|| {
            let n = W::run(&&bump, black_box(OBJECTS));
            bump.reset();
            n
        })
    });
    drop(bump);
    arena_row::<W, _>(&mut g, "arena_host", Arena::host());
    if pinned_available() {
        arena_row::<W, _>(&mut g, "arena_pinned", Arena::pinned());
    }
    g.finish();
}

fn small_objects(c: &mut Criterion) {
    objects_group::<SmallObjects>(c);
}

fn bump_only(c: &mut Criterion) {
    objects_group::<BumpOnly>(c);
}

fn vec_growth(c: &mut Criterion) {
    let mut g = c.benchmark_group("vec_growth");
    let pinned = pinned_available();
    for n in [1_000usize, 100_000, 1_000_000] {
        g.throughput(Throughput::Bytes((n * 8) as u64));
        g.bench_with_input(BenchmarkId::new("global", n), &n, |b, &n| {
            b.iter(|| workload::vec_push(Global, n))
        });
        let mut bump = bumpalo::Bump::new();
        g.bench_with_input(BenchmarkId::new("bumpalo", n), &n, |b, &n| {
            b.iter(|| {
                let sum = workload::vec_push(&bump, n);
                bump.reset();
                sum
            })
        });
        let mut host = Arena::host();
        g.bench_with_input(BenchmarkId::new("arena_host", n), &n, |b, &n| {
            b.iter(|| {
                let sum = workload::vec_push(&host, n);
                host.reset();
                sum
            })
        });
        if pinned {
            let mut arena = Arena::pinned();
            g.bench_with_input(BenchmarkId::new("arena_pinned", n), &n, |b, &n| {
                b.iter(|| {
                    let sum = workload::vec_push(&arena, n);
                    arena.reset();
                    sum
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, small_objects, bump_only, vec_growth);
criterion_main!(benches);
