//! The bad-input matrix: one test per row, each row run by one generic helper against
//! every allocator of the crate, with `Global` and `&bumpalo::Bump` as references in the
//! rows where they agree (a row says which).
//!
//! Rows: zero size at every alignment up to 2^30; sizes that overflow when rounded; 1 PiB
//! and `isize::MAX`; grow and shrink to another alignment; `grow_zeroed` and
//! `allocate_zeroed` contents in blocks reused from a dirty cache; shrink to zero and
//! grow from zero.
//!
//! The CUDA allocators run every row for real with a driver. Without one, the default
//! handles (`PinnedAlloc`, `ManagedAlloc`, `Arena::pinned()`) fall back to pageable memory
//! and must still pass every row; the strict ones (and the plain CUDA sources) must fail
//! every nonzero request with `AllocError` and succeed at zero size.

use core::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global, Layout};
use cudalloc::arena::{Arena, ArenaConfig};
use cudalloc::cuda::{driver_available, HostAllocFlags};
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::{
    HostSource, HostVisible, ManagedAttach, ManagedSource, PinnedSource, RegisteredSource,
};
use cudalloc::{Counting, Direct, ManagedAlloc, PinnedAlloc};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Where an allocator comes from, for the rows that reference allocators skip.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// One of the crate's allocators (or `Counting` around one): every row applies.
    Crate,
    /// `allocator_api2::alloc::Global` (or `Counting<Global>`).
    Global,
    /// `&bumpalo::Bump`.
    Bumpalo,
}

/// An allocator under test: its name, what it must do, and what it can say about itself.
struct Who<'a> {
    name: String,
    kind: Kind,
    /// Nonzero requests succeed. False for strict CUDA allocators without a driver: every
    /// nonzero request must then fail with `AllocError`.
    works: bool,
    /// Bytes it holds from upstream, where it can tell (a fresh allocator holds none).
    held: Option<&'a dyn Fn() -> usize>,
    /// Blocks it counts as live, where it can tell.
    live: Option<&'a dyn Fn() -> usize>,
    /// Failed requests it has counted, where it counts them.
    failures: Option<&'a dyn Fn() -> u64>,
}

impl<'a> Who<'a> {
    fn new(name: impl Into<String>, works: bool) -> Self {
        Self {
            name: name.into(),
            kind: Kind::Crate,
            works,
            held: None,
            live: None,
            failures: None,
        }
    }
    fn reference(name: &str, kind: Kind) -> Self {
        Self {
            kind,
            ..Self::new(name, true)
        }
    }
    fn held(self, f: &'a dyn Fn() -> usize) -> Self {
        Self {
            held: Some(f),
            ..self
        }
    }
    fn live(self, f: &'a dyn Fn() -> usize) -> Self {
        Self {
            live: Some(f),
            ..self
        }
    }
    fn failures(self, f: &'a dyn Fn() -> u64) -> Self {
        Self {
            failures: Some(f),
            ..self
        }
    }
    fn is_reference(&self) -> bool {
        self.kind != Kind::Crate
    }
    fn live_now(&self) -> Option<usize> {
        self.live.map(|f| f())
    }
    fn failures_now(&self) -> Option<u64> {
        self.failures.map(|f| f())
    }
}

/// One row of the matrix, generic over the allocator.
trait Row {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>);
}

/// Runs `row` on `a`, then checks that the row left no block live.
fn run_row<R: Row, A: Allocator>(row: &R, a: &A, who: &Who<'_>) {
    let live_before = who.live_now();
    row.run(a, who);
    if let (Some(before), Some(after)) = (live_before, who.live_now()) {
        assert_eq!(after, before, "{}: the row left blocks live", who.name);
    }
}

/// Pool shapes: the default, one that crosses every threshold often, and one without
/// thread caches.
fn pool_configs() -> [(&'static str, PoolConfig); 3] {
    [
        ("default", PoolConfig::default()),
        (
            "tight",
            PoolConfig::default()
                .with_chunk_size(256 * KIB)
                .with_large_threshold(8 * KIB)
                .with_thread_cache_capacity(4)
                .with_thread_cache_bytes(64 * KIB),
        ),
        (
            "no thread caches",
            PoolConfig::default().with_thread_cache_capacity(0),
        ),
    ]
}

/// `row` on a pool over `source`, by value, by reference and inside `Counting`; after
/// each, everything it allocated was freed, and trimming returns every byte to the source.
fn pool_rows<R: Row, S: HostVisible + Clone + 'static>(row: &R, what: &str, source: S, works: bool) {
    for (shape, config) in pool_configs() {
        let pool = Pool::with_config(source.clone(), config);
        let held = || pool.stats().source_bytes;
        let live = || pool.stats().live_blocks;
        let failures = || pool.stats().failures;
        let name = format!("Pool<{what}> ({shape})");
        let who = Who::new(&name, works).held(&held).live(&live).failures(&failures);
        run_row(row, &pool, &who);
        let who = Who::new(format!("&{name}"), works)
            .live(&live)
            .failures(&failures);
        run_row(row, &&pool, &who);
        let counting = Counting::new(&pool);
        let c_live = || counting.snapshot().live_count() as usize;
        let c_failures = || counting.snapshot().failures;
        let who = Who::new(format!("Counting<&{name}>"), works)
            .live(&c_live)
            .failures(&c_failures);
        run_row(row, &counting, &who);
        pool.trim();
        let s = pool.stats();
        assert_eq!(
            (s.live_blocks, s.source_bytes),
            (0, 0),
            "{name}: after every row's frees and a trim: {s:?}"
        );
        assert_eq!(
            s.live_bytes + s.cached_bytes + s.pending_bytes,
            s.source_bytes,
            "{name}: {s:?}"
        );
    }
}

/// `row` on arenas over `source`: the default shape, small chunks, and under a limit.
fn arena_rows<R: Row, S: HostVisible + Clone>(row: &R, what: &str, source: S, works: bool) {
    let configs = [
        ("default", ArenaConfig::for_kind(source.kind())),
        ("4 KiB chunks", ArenaConfig::host().with_first_chunk(4 * KIB)),
        ("limit 256 MiB", ArenaConfig::host().with_limit(256 * MIB)),
    ];
    for (shape, config) in configs {
        let arena = Arena::with_config(source.clone(), config);
        arena_row(row, &format!("&Arena<{what}> ({shape})"), &arena, works);
    }
}

fn arena_row<R: Row, S: HostVisible>(row: &R, name: &str, arena: &Arena<S>, works: bool) {
    let held = || arena.allocated_bytes();
    run_row(row, &arena, &Who::new(name, works).held(&held));
    counting_row(row, &format!("Counting<{name}>"), arena, works);
}

/// `row` on `inner` inside `Counting` (named `name`), checked against its counts.
fn counting_row<R: Row, A: Allocator>(row: &R, name: &str, inner: A, works: bool) {
    let counting = Counting::new(inner);
    let live = || counting.snapshot().live_count() as usize;
    let failures = || counting.snapshot().failures;
    let who = Who::new(name, works).live(&live).failures(&failures);
    run_row(row, &counting, &who);
}

/// `row` on `Direct` over `source`, bare and inside `Counting`.
fn direct_rows<R: Row, S: HostVisible + Clone>(row: &R, what: &str, source: S, works: bool) {
    run_row(
        row,
        &Direct::new(source.clone()),
        &Who::new(format!("Direct<{what}>"), works),
    );
    counting_row(
        row,
        &format!("Counting<Direct<{what}>>"),
        Direct::new(source),
        works,
    );
}

/// A process-wide handle, bare and inside `Counting` (the handles' pools are shared with
/// the other tests of this binary, so only `Counting` can count their blocks exactly).
fn handle_rows<R: Row, A: Allocator>(row: &R, name: &str, handle: A, works: bool) {
    run_row(row, &handle, &Who::new(name, works));
    counting_row(row, &format!("Counting<{name}>"), handle, works);
}

/// Runs `row` against every allocator of the crate and the references.
fn every_allocator<R: Row>(row: &R) {
    let driver = driver_available();
    let mapped = HostAllocFlags::PORTABLE | HostAllocFlags::DEVICE_MAP;

    // The handles: the defaults work everywhere (pinned or pageable), strict ones only
    // with a driver.
    handle_rows(row, "PinnedAlloc", PinnedAlloc, true);
    handle_rows(row, "PinnedAlloc::strict()", PinnedAlloc::strict(), driver);
    handle_rows(
        row,
        "PinnedAlloc::with_flags(PORTABLE|DEVICE_MAP)",
        PinnedAlloc::with_flags(mapped),
        true,
    );
    handle_rows(
        row,
        "PinnedAlloc::with_flags(WRITE_COMBINED).strict()",
        PinnedAlloc::with_flags(HostAllocFlags::WRITE_COMBINED).strict(),
        driver,
    );
    handle_rows(row, "ManagedAlloc", ManagedAlloc, true);
    handle_rows(row, "ManagedAlloc::strict()", ManagedAlloc::strict(), driver);
    handle_rows(
        row,
        "ManagedAlloc::with_attach(Host)",
        ManagedAlloc::with_attach(ManagedAttach::Host),
        true,
    );

    // Pools, arenas and Direct over pageable memory.
    pool_rows(row, "HostSource", HostSource, true);
    direct_rows(row, "HostSource", HostSource, true);
    arena_rows(row, "HostSource", HostSource, true);
    arena_row(row, "&Arena::host()", &Arena::host(), true);
    arena_row(row, "&Arena::pinned()", &Arena::pinned(), true);
    arena_row(row, "&Arena::pinned_strict()", &Arena::pinned_strict(), driver);

    // The CUDA sources: real with a driver; without one every nonzero request fails.
    pool_rows(row, "PinnedSource", PinnedSource::default(), driver);
    pool_rows(row, "ManagedSource", ManagedSource::default(), driver);
    direct_rows(row, "PinnedSource", PinnedSource::new(mapped), driver);
    direct_rows(row, "ManagedSource", ManagedSource::default(), driver);
    direct_rows(row, "RegisteredSource", RegisteredSource::new(false), driver);
    arena_rows(row, "PinnedSource", PinnedSource::default(), driver);

    // References.
    run_row(row, &Global, &Who::reference("Global", Kind::Global));
    let counting = Counting::new(Global);
    let live = || counting.snapshot().live_count() as usize;
    let who = Who::reference("Counting<Global>", Kind::Global).live(&live);
    run_row(row, &counting, &who);
    let bump = bumpalo::Bump::new();
    run_row(row, &&bump, &Who::reference("&bumpalo::Bump", Kind::Bumpalo));
}

// ---- helpers ------------------------------------------------------------------------

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// The pattern's 8 bytes at word `k`: no byte is zero, and every word differs (a copy
/// shifted, truncated or taken from the wrong place shows). Written and checked a word at
/// a time: these checks run over megabytes, also under valgrind.
fn word(k: usize, seed: u8) -> u64 {
    ((k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(seed).wrapping_mul(0x0101_0101_0101_0101))
        | 0x0101_0101_0101_0101
}

fn fill(p: NonNull<u8>, len: usize, seed: u8) {
    let words = len / 8;
    for k in 0..words {
        // SAFETY: callers pass blocks of at least `len` bytes; 8 * k + 8 <= len.
        unsafe { p.as_ptr().add(8 * k).cast::<u64>().write_unaligned(word(k, seed)) };
    }
    let tail = word(words, seed).to_le_bytes();
    for (j, &b) in tail.iter().enumerate().take(len % 8) {
        // SAFETY: 8 * words + j < len.
        unsafe { p.as_ptr().add(8 * words + j).write(b) };
    }
}

fn assert_pattern(p: NonNull<u8>, len: usize, seed: u8, what: &str) {
    // SAFETY: callers pass blocks of at least `len` bytes, initialized by `fill`.
    let bytes = unsafe { core::slice::from_raw_parts(p.as_ptr(), len) };
    for (k, chunk) in bytes.chunks(8).enumerate() {
        let want = word(k, seed).to_le_bytes();
        if chunk != &want[..chunk.len()] {
            let j = chunk.iter().zip(want).position(|(a, b)| *a != b).unwrap();
            panic!(
                "{what}: byte {} of {len} lost ({:#x}, not {:#x})",
                8 * k + j,
                chunk[j],
                want[j]
            );
        }
    }
}

fn assert_zero(p: NonNull<u8>, from: usize, to: usize, what: &str) {
    // SAFETY: callers pass blocks of at least `to` bytes (bytes the allocator zeroed).
    let bytes = unsafe { core::slice::from_raw_parts(p.as_ptr().add(from), to - from) };
    // SAFETY: every bit pattern is a valid u64.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    if head.iter().chain(tail).any(|&b| b != 0) || words.iter().any(|&w| w != 0) {
        let i = bytes.iter().position(|&b| b != 0).unwrap();
        panic!(
            "{what}: byte {} (zeroed range {from}..{to}) is {:#x}",
            from + i,
            bytes[i]
        );
    }
}

fn assert_block(block: NonNull<[u8]>, l: Layout, what: &str) {
    assert!(block.len() >= l.size(), "{what}: {} bytes for {l:?}", block.len());
    assert_eq!(
        block.cast::<u8>().as_ptr() as usize % l.align(),
        0,
        "{what}: misaligned for {l:?}"
    );
}

/// For an allocator that must work: a block for `l`, checked. For one that must not:
/// asserts `AllocError` and returns `None`.
fn alloc_or_refuse<A: Allocator>(a: &A, who: &Who<'_>, l: Layout) -> Option<NonNull<[u8]>> {
    checked_or_refused(a, who, l, a.allocate(l), "allocate")
}

/// `alloc_or_refuse` for `allocate_zeroed`.
fn alloc_zeroed_or_refuse<A: Allocator>(a: &A, who: &Who<'_>, l: Layout) -> Option<NonNull<[u8]>> {
    checked_or_refused(a, who, l, a.allocate_zeroed(l), "allocate_zeroed")
}

/// The checks of `alloc_or_refuse` on the result `r` of `call` (`allocate` or
/// `allocate_zeroed`) with `l`.
fn checked_or_refused<A: Allocator>(
    a: &A,
    who: &Who<'_>,
    l: Layout,
    r: Result<NonNull<[u8]>, AllocError>,
    call: &str,
) -> Option<NonNull<[u8]>> {
    match r {
        Ok(b) if who.works => {
            assert_block(b, l, &who.name);
            Some(b)
        }
        Ok(b) => {
            // SAFETY: just allocated with `l`.
            unsafe { a.deallocate(b.cast(), l) };
            panic!("{}: {l:?} must fail without a driver", who.name)
        }
        Err(_) if who.works => panic!("{}: {call} {l:?} failed", who.name),
        Err(_) => None,
    }
}

/// A block of 64 bytes that the row keeps while it tries bad requests, to show they
/// disturb nothing; and the proof that the allocator still works after them.
struct Witness {
    block: Option<NonNull<[u8]>>,
}

const WITNESS: Layout = match Layout::from_size_align(64, 8) {
    Ok(l) => l,
    Err(_) => panic!(),
};

impl Witness {
    fn new<A: Allocator>(a: &A, who: &Who<'_>) -> Self {
        let block = alloc_or_refuse(a, who, WITNESS);
        if let Some(b) = block {
            fill(b.cast(), WITNESS.size(), 0x5c);
        }
        Self { block }
    }

    /// Checks the witness, frees it, and shows that a fresh request works.
    fn finish<A: Allocator>(self, a: &A, who: &Who<'_>, after: &str) {
        if let Some(b) = self.block {
            assert_pattern(
                b.cast(),
                WITNESS.size(),
                0x5c,
                &format!("{}: witness after {after}", who.name),
            );
            // SAFETY: allocated by `a` with WITNESS in `new`.
            unsafe { a.deallocate(b.cast(), WITNESS) };
        }
        let l = layout(1000, 16);
        if let Some(b) = alloc_or_refuse(a, who, l) {
            fill(b.cast(), l.size(), 3);
            assert_pattern(
                b.cast(),
                l.size(),
                3,
                &format!("{}: usable after {after}", who.name),
            );
            // SAFETY: just allocated with `l`.
            unsafe { a.deallocate(b.cast(), l) };
        }
    }
}

/// Whether a request for `l` succeeds (the block is freed at once). `black_box`: the
/// compiler may otherwise remove an allocation whose block is never used, and take it to
/// have succeeded (it does so for `Global` at opt-level 1).
fn succeeds<A: Allocator>(a: &A, l: Layout, zeroed: bool) -> bool {
    let r = std::hint::black_box(if zeroed {
        a.allocate_zeroed(l)
    } else {
        a.allocate(l)
    });
    match r {
        // SAFETY: just allocated with `l`.
        Ok(b) => unsafe {
            a.deallocate(b.cast(), l);
            true
        },
        Err(_) => false,
    }
}

/// Asserts that requests for each of `layouts` fail with `AllocError` (allocate,
/// allocate_zeroed, and growing a live block to it, which must keep the block), that each
/// failure is counted where the allocator counts them, and that the allocator works after.
fn must_refuse<A: Allocator>(a: &A, who: &Who<'_>, layouts: &[Layout], what: &str) {
    let witness = Witness::new(a, who);
    let failures_before = who.failures_now();
    let mut refused = 0u64;
    for &l in layouts {
        let ctx = format!("{}: {what} {l:?}", who.name);
        assert!(!succeeds(a, l, false), "{ctx}: allocate must fail");
        assert!(!succeeds(a, l, true), "{ctx}: allocate_zeroed must fail");
        refused += 2;
        let small = layout(100, l.align().min(4096));
        if let Some(b) = alloc_or_refuse(a, who, small) {
            fill(b.cast(), small.size(), 9);
            // SAFETY: `b` is live with `small`; l.size() >= small.size().
            let grown = unsafe { a.grow(b.cast(), small, l) };
            assert!(grown.is_err(), "{ctx}: grow must fail");
            // SAFETY: as above (a failed grow leaves the block live).
            let grown = unsafe { a.grow_zeroed(b.cast(), small, l) };
            assert!(grown.is_err(), "{ctx}: grow_zeroed must fail");
            refused += 2;
            assert_pattern(
                b.cast(),
                small.size(),
                9,
                &format!("{ctx}: block after failed grows"),
            );
            // SAFETY: a failed grow leaves the block live with its old layout.
            unsafe { a.deallocate(b.cast(), small) };
        }
    }
    if let (Some(before), Some(after)) = (failures_before, who.failures_now()) {
        assert!(
            after >= before + refused,
            "{}: {refused} failed requests, {} counted",
            who.name,
            after - before
        );
    }
    witness.finish(a, who, what);
}

// ---- row 1: zero size ---------------------------------------------------------------

struct ZeroSize;

impl Row for ZeroSize {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>) {
        let held_before = who.held.map(|f| f());
        let mut blocks = Vec::new();
        for shift in 0..=30 {
            let l = layout(0, 1 << shift);
            for zeroed in [false, true] {
                let b = if zeroed {
                    a.allocate_zeroed(l)
                } else {
                    a.allocate(l)
                };
                let b = b.unwrap_or_else(|_| {
                    panic!("{}: zero-size {l:?} (zeroed: {zeroed}) must succeed", who.name)
                });
                assert_eq!(
                    b.cast::<u8>().as_ptr() as usize % l.align(),
                    0,
                    "{}: zero-size block misaligned for {l:?}",
                    who.name
                );
                blocks.push((b, l));
            }
        }
        // Holding zero-size blocks takes nothing from upstream.
        if let (Some(f), Some(before)) = (who.held, held_before) {
            assert_eq!(f(), before, "{}: zero-size blocks took memory", who.name);
        }
        // Freeing them has no effect: a block allocated before keeps its contents, and
        // the allocator works after.
        let witness = Witness::new(a, who);
        for (b, l) in blocks {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { a.deallocate(b.cast(), l) };
        }
        witness.finish(a, who, "freeing zero-size blocks");
        if who.works || who.held.is_some() {
            // A fresh allocator that only saw zero-size requests and one small block,
            // freed: nothing counted live.
            if let Some(live) = who.live_now() {
                assert_eq!(live, 0, "{}", who.name);
            }
        }
    }
}

#[test]
fn zero_size_at_every_alignment_up_to_2_pow_30() {
    every_allocator(&ZeroSize);
}

// ---- row 2: sizes that overflow when rounded ---------------------------------------

/// The largest sizes a `Layout` accepts at each alignment, and sizes just under them:
/// rounding any of them up to a page, adding the alignment for over-allocation, or
/// doubling for growth room overflows `isize`.
fn overflowing_layouts() -> Vec<Layout> {
    let mut out = Vec::new();
    for shift in [0, 1, 3, 4, 6, 12, 13, 16, 20, 30] {
        let align = 1usize << shift;
        let max = isize::MAX as usize - (align - 1);
        for size in [
            max,
            max - 1,
            max - 10,
            max - align,
            max - 4095,
            max - 4097,
            isize::MAX as usize / 2 + 1,
        ] {
            if let Ok(l) = Layout::from_size_align(size, align) {
                out.push(l);
            }
        }
    }
    out
}

struct OverflowWhenRounded;

impl Row for OverflowWhenRounded {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>) {
        let mut layouts = overflowing_layouts();
        if who.is_reference() {
            // The references pass these to the C library, whose answer to alignments
            // beyond a few MiB is its own business (valgrind's replacement aborts the
            // process on a 1 GiB alignment); the crate never hands them to it.
            layouts.retain(|l| l.align() <= 1 << 16);
        }
        must_refuse(a, who, &layouts, "size that overflows when rounded");
    }
}

#[test]
fn sizes_that_overflow_when_rounded_fail_cleanly() {
    // `Layout` itself refuses a size that overflows when rounded to its own alignment
    // (isize::MAX - 10 at 4096), so no allocator ever sees one; what reaches them is the
    // largest sizes it accepts, which overflow inside the allocator instead.
    assert!(Layout::from_size_align(isize::MAX as usize - 10, 4096).is_err());
    assert!(Layout::from_size_align(isize::MAX as usize - 4095, 4096).is_ok());
    // Global and bumpalo agree: these sizes exceed any address space.
    every_allocator(&OverflowWhenRounded);
}

// ---- row 3: 1 PiB and isize::MAX ----------------------------------------------------

struct Huge;

impl Row for Huge {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>) {
        if who.is_reference() {
            // With unlimited overcommit (the GPU machine) malloc hands out 1 PiB of
            // address space; the crate refuses requests above physical memory.
            return;
        }
        let layouts = [
            layout(1 << 50, 1),
            layout(1 << 50, 8),
            layout(1 << 50, 4096),
            layout(1 << 50, 1 << 20),
            layout(isize::MAX as usize, 1),
            layout(isize::MAX as usize - 4095, 4096),
        ];
        must_refuse(a, who, &layouts, "huge request");
    }
}

#[test]
fn one_pib_and_isize_max_fail_and_the_allocator_goes_on() {
    every_allocator(&Huge);
}

// ---- row 4: grow and shrink to another alignment ------------------------------------

const ALIGNS: [usize; 6] = [1, 16, 64, 4096, 1 << 16, 1 << 20];
const ALIGNS_LARGE: [usize; 4] = [8, 4096, 1 << 16, 1 << 20];

struct ChangedAlignment;

impl Row for ChangedAlignment {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>) {
        let mut seed = 0u8;
        for size in [40, 3000, 600 * KIB] {
            // Large blocks at fewer alignments: each one moves and checks megabytes.
            let aligns: &[usize] = if size > 4096 { &ALIGNS_LARGE } else { &ALIGNS };
            for &from in aligns {
                for &to in aligns {
                    seed = seed.wrapping_add(1);
                    let ctx = format!("{}: {size} B, align {from} -> {to}", who.name);
                    let old = layout(size, from);
                    let Some(b) = alloc_or_refuse(a, who, old) else {
                        continue;
                    };
                    fill(b.cast(), size, seed);
                    // Grow to another alignment: contents kept, new alignment honoured.
                    let grown = layout(size * 2 + 5, to);
                    // SAFETY: `b` is live with `old`; grown is larger.
                    let g = unsafe { a.grow(b.cast(), old, grown) }
                        .unwrap_or_else(|_| panic!("{ctx}: grow failed"));
                    assert_block(g, grown, &ctx);
                    assert_pattern(g.cast(), size, seed, &format!("{ctx}: grow"));
                    fill(g.cast(), grown.size(), seed);
                    // Shrink to a third alignment (the old one back).
                    let shrunk = layout(size / 2 + 1, from);
                    // SAFETY: `g` is live with `grown`; shrunk is smaller.
                    let s = unsafe { a.shrink(g.cast(), grown, shrunk) }
                        .unwrap_or_else(|_| panic!("{ctx}: shrink failed"));
                    assert_block(s, shrunk, &ctx);
                    assert_pattern(s.cast(), shrunk.size(), seed, &format!("{ctx}: shrink"));
                    // Shrink again, to the other alignment.
                    let smaller = layout(size / 4 + 1, to);
                    // SAFETY: `s` is live with `shrunk`; smaller is not larger.
                    let t = unsafe { a.shrink(s.cast(), shrunk, smaller) }
                        .unwrap_or_else(|_| panic!("{ctx}: second shrink failed"));
                    assert_block(t, smaller, &ctx);
                    assert_pattern(t.cast(), smaller.size(), seed, &format!("{ctx}: second shrink"));
                    // SAFETY: `t` is live with `smaller`.
                    unsafe { a.deallocate(t.cast(), smaller) };
                }
            }
        }
    }
}

#[test]
fn grow_and_shrink_to_another_alignment_keep_contents() {
    every_allocator(&ChangedAlignment);
}

// ---- row 5: grow_zeroed and allocate_zeroed contents --------------------------------

/// Size changes through every path of the pool: within a class (100 -> 110 stays in the
/// 112 B class), across classes (100 -> 200 into a reused 208 B block: issue 12, defect
/// 3), from small to large (8 -> 600,000), large in place and large moved.
const ZEROED: [(usize, usize, usize); 9] = [
    (100, 110, 8),
    (100, 200, 8),
    (8, 600_000, 8),
    (1000, 5000, 16),
    (3000, 9000, 64),
    (600 * KIB, 700 * KIB, 8),
    (600 * KIB, 3 * MIB, 4096),
    (5000, 70_000, 1 << 16),
    (0, 300, 8),
];

/// Fills blocks of every size the row asks for with 0xFF over their whole length and frees
/// them, so that caches hold dirty blocks (and free extents hold dirty bytes).
fn dirty<A: Allocator>(a: &A, who: &Who<'_>) {
    let mut layouts: Vec<Layout> = ZEROED
        .iter()
        .flat_map(|&(old, new, align)| [old, new, new + new / 2].map(|size| (size, align)))
        .chain([(3 * MIB, 8)])
        .filter(|&(size, _)| size > 0)
        .map(|(size, align)| layout(size, align))
        .collect();
    layouts.sort_by_key(|l| (l.size(), l.align()));
    layouts.dedup();
    let mut blocks = Vec::new();
    for l in layouts {
        for _ in 0..2 {
            if let Some(b) = alloc_or_refuse(a, who, l) {
                // SAFETY: the block has b.len() bytes.
                unsafe { b.cast::<u8>().as_ptr().write_bytes(0xFF, b.len()) };
                blocks.push((b, l));
            }
        }
    }
    // Newest first: a bump allocator reclaims in that order.
    for (b, l) in blocks.into_iter().rev() {
        // SAFETY: allocated above with `l`.
        unsafe { a.deallocate(b.cast(), l) };
    }
}

struct Zeroed;

impl Row for Zeroed {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>) {
        for round in 0..2 {
            dirty(a, who);
            for (i, (old_size, new_size, align)) in ZEROED.into_iter().enumerate() {
                let ctx = format!(
                    "{}: round {round}, {old_size} -> {new_size} B (align {align})",
                    who.name
                );
                let seed = (round * 16 + i) as u8;
                let old = layout(old_size, align);
                let new = layout(new_size, align);
                // allocate_zeroed: every byte of the returned length is zero.
                let Some(z) = alloc_zeroed_or_refuse(a, who, new) else {
                    continue;
                };
                assert_zero(z.cast(), 0, z.len(), &format!("{ctx}: allocate_zeroed"));
                // SAFETY: allocated with `new`.
                unsafe { a.deallocate(z.cast(), new) };
                let Some(b) = alloc_or_refuse(a, who, old) else {
                    continue;
                };
                fill(b.cast(), old_size, seed);
                // SAFETY: `b` is live with `old`; new is not smaller.
                let g = unsafe { a.grow_zeroed(b.cast(), old, new) }
                    .unwrap_or_else(|_| panic!("{ctx}: grow_zeroed failed"));
                assert_block(g, new, &ctx);
                assert_pattern(g.cast(), old_size, seed, &format!("{ctx}: old contents"));
                assert_zero(g.cast(), old_size, g.len(), &format!("{ctx}: grow_zeroed"));
                // Dirty the whole block before freeing it: the next round reuses it.
                // SAFETY: the block has g.len() bytes.
                unsafe { g.cast::<u8>().as_ptr().write_bytes(0xEE, g.len()) };
                // SAFETY: `g` is live with `new`.
                unsafe { a.deallocate(g.cast(), new) };
            }
        }
    }
}

#[test]
fn grow_zeroed_and_allocate_zeroed_zero_up_to_the_returned_length_in_reused_blocks() {
    // Global and bumpalo agree (their blocks are exactly as long as asked).
    every_allocator(&Zeroed);
}

// ---- row 6: shrink to zero and grow from zero ---------------------------------------

struct ToAndFromZero;

impl Row for ToAndFromZero {
    fn run<A: Allocator>(&self, a: &A, who: &Who<'_>) {
        for &align in &[1, 8, 64, 4096, 1 << 16] {
            for size in [24, 5000, 700 * KIB] {
                let ctx = format!("{}: {size} B, align {align}", who.name);
                let l = layout(size, align);
                // Shrink to zero, at the same alignment and at another one: the result
                // is a valid zero-size block, freed without effect.
                for zero_align in [align, 8, 4096] {
                    let Some(b) = alloc_or_refuse(a, who, l) else {
                        continue;
                    };
                    fill(b.cast(), size, 1);
                    let zero = layout(0, zero_align);
                    // SAFETY: `b` is live with `l`; zero is smaller.
                    let z = unsafe { a.shrink(b.cast(), l, zero) }
                        .unwrap_or_else(|_| panic!("{ctx}: shrink to zero (align {zero_align}) failed"));
                    assert_eq!(
                        z.cast::<u8>().as_ptr() as usize % zero_align,
                        0,
                        "{ctx}: shrunk to zero, misaligned"
                    );
                    // SAFETY: the zero-size block the shrink returned, with its layout.
                    unsafe { a.deallocate(z.cast(), zero) };
                }
                // Grow from a zero-size block (plain and zeroed) to a real one.
                for zeroed in [false, true] {
                    let zero = layout(0, align);
                    let z = a
                        .allocate(zero)
                        .unwrap_or_else(|_| panic!("{ctx}: zero-size allocation failed"));
                    // SAFETY: `z` is a live zero-size block of `a`; l is larger.
                    let grown = unsafe {
                        if zeroed {
                            a.grow_zeroed(z.cast(), zero, l)
                        } else {
                            a.grow(z.cast(), zero, l)
                        }
                    };
                    match grown {
                        Ok(g) if who.works => {
                            assert_block(g, l, &ctx);
                            if zeroed {
                                assert_zero(g.cast(), 0, g.len(), &format!("{ctx}: grow_zeroed from zero"));
                            }
                            fill(g.cast(), size, 2);
                            assert_pattern(g.cast(), size, 2, &ctx);
                            // SAFETY: `g` is live with `l`.
                            unsafe { a.deallocate(g.cast(), l) };
                        }
                        Ok(_) => panic!("{ctx}: growing from zero must fail without a driver"),
                        Err(_) if who.works => panic!("{ctx}: grow from zero (zeroed: {zeroed}) failed"),
                        // A failed grow leaves the zero-size block, which needs no free
                        // but may have one.
                        // SAFETY: `z` is still live with `zero`.
                        Err(_) => unsafe { a.deallocate(z.cast(), zero) },
                    }
                }
            }
        }
    }
}

#[test]
fn shrink_to_zero_and_grow_from_zero() {
    every_allocator(&ToAndFromZero);
}
