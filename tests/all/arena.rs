//! Bump arenas: the conformance suite; the same tests against `&bumpalo::Bump` and
//! `&Arena`; reset, rewind and limit semantics on host memory, watched through a source
//! that records its calls; and, on the GPU machine, pinned copies and the reuse race.

use core::alloc::Layout;
use core::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use allocator_api2::{boxed::Box, vec::Vec};
use cudalloc::arena::{Arena, ArenaConfig};
use cudalloc::cuda::{pointer_info, MemoryType, Stream};
use cudalloc::error::Result;
use cudalloc::source::{HostSource, HostVisible, MemorySource, PinnedSource};
use cudalloc::testing::DeviceMemory;

use crate::conformance::{suite, Options};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// A `Vec` in `a` holding `it`, allocated once when `it` knows its length.
fn collect_in<T, A: Allocator>(it: impl IntoIterator<Item = T>, a: A) -> Vec<T, A> {
    let it = it.into_iter();
    let mut v = Vec::with_capacity_in(it.size_hint().0, a);
    v.extend(it);
    v
}

// ----- a source that records its calls -----

#[derive(Default, Debug)]
struct Calls {
    allocated: std::vec::Vec<usize>,
    freed: std::vec::Vec<usize>,
}

/// Host memory whose every allocate and deallocate is recorded; refuses requests above
/// `max_request` (to simulate a source running short).
#[derive(Clone, Debug)]
struct Recorded {
    calls: Arc<Mutex<Calls>>,
    max_request: usize,
}

impl Recorded {
    fn new() -> Self {
        Self {
            calls: Arc::default(),
            max_request: usize::MAX,
        }
    }
    fn allocs(&self) -> usize {
        self.calls.lock().unwrap().allocated.len()
    }
    fn frees(&self) -> usize {
        self.calls.lock().unwrap().freed.len()
    }
    fn sizes(&self) -> std::vec::Vec<usize> {
        self.calls.lock().unwrap().allocated.clone()
    }
    fn live_bytes(&self) -> usize {
        let c = self.calls.lock().unwrap();
        c.allocated.iter().sum::<usize>() - c.freed.iter().sum::<usize>()
    }
}

// SAFETY: forwards to HostSource, which keeps every promise; refusing requests is allowed.
unsafe impl MemorySource for Recorded {
    fn align(&self) -> usize {
        HostSource.align()
    }
    fn kind(&self) -> MemoryType {
        MemoryType::Pageable
    }
    fn allocate(&self, size: usize) -> Result<NonNull<u8>> {
        assert!(size > 0, "a zero-size request reached the source");
        if size > self.max_request {
            return Err(cudalloc::Error::OutOfMemory { requested: size });
        }
        let p = HostSource.allocate(size)?;
        self.calls.lock().unwrap().allocated.push(size);
        Ok(p)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        self.calls.lock().unwrap().freed.push(size);
        // SAFETY: the caller's obligations are HostSource's.
        unsafe { HostSource.deallocate(ptr, size) }
    }
}

// SAFETY: HostSource memory.
unsafe impl HostVisible for Recorded {}

fn recorded(cfg: ArenaConfig) -> (Arena<Recorded>, Recorded) {
    let src = Recorded::new();
    (Arena::with_config(src.clone(), cfg), src)
}

fn small_chunks() -> ArenaConfig {
    ArenaConfig::host().with_first_chunk(4 * KIB)
}

// ----- conformance -----

#[test]
fn conformance_default_host_arena() {
    suite(&&Arena::host(), Options::default());
}

#[test]
fn conformance_small_capped_chunks() {
    // Nearly every request crosses a chunk: exercises the cold path and dedicated chunks.
    let arena = Arena::with_config(HostSource, small_chunks().with_max_chunk(16 * KIB));
    suite(&&arena, Options::default());
}

#[test]
fn conformance_under_a_limit() {
    let arena = Arena::with_config(HostSource, ArenaConfig::host().with_limit(256 * MIB));
    suite(&&arena, Options::default());
    assert!(arena.allocated_bytes() <= 256 * MIB);
}

#[test]
fn conformance_after_reset_and_rewind() {
    let mut arena = Arena::with_config(HostSource, small_chunks());
    suite(
        &&arena,
        Options {
            random_ops: 500,
            ..Options::default()
        },
    );
    arena.reset();
    let mark = arena.checkpoint();
    suite(
        &&arena,
        Options {
            random_ops: 500,
            ..Options::default()
        },
    );
    arena.rewind(mark);
    suite(
        &&arena,
        Options {
            random_ops: 500,
            ..Options::default()
        },
    );
}

// ----- the same tests against &bumpalo::Bump and &Arena -----

/// What both bump allocators offer besides `Allocator`, under one name.
trait Bumper {
    /// Bytes left in the current chunk.
    fn remaining(&self) -> usize;
    /// Bytes held in chunks.
    fn held(&self) -> usize;
    /// Frees every block.
    fn reset_all(&mut self);
}

impl Bumper for bumpalo::Bump {
    fn remaining(&self) -> usize {
        self.chunk_capacity()
    }
    fn held(&self) -> usize {
        self.allocated_bytes()
    }
    fn reset_all(&mut self) {
        self.reset()
    }
}

impl<S: HostVisible> Bumper for Arena<S> {
    fn remaining(&self) -> usize {
        self.chunk_capacity()
    }
    fn held(&self) -> usize {
        self.allocated_bytes()
    }
    fn reset_all(&mut self) {
        self.reset()
    }
}

/// Runs `check` on a fresh bumpalo arena and on a fresh host `Arena`, each with a first
/// chunk of 1 MiB already taken (so both start with room in the current chunk).
macro_rules! on_both {
    ($check:ident) => {{
        let bump = bumpalo::Bump::with_capacity(MIB);
        $check(bump, "bumpalo");
        let arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(MIB));
        drop(Box::new_in(0u8, &arena));
        $check(arena, "arena");
    }};
}

/// The one `Vec<T, &A>` type family: these helpers take any allocator.
fn push_squares<A: Allocator>(v: &mut Vec<u64, A>, n: u64) {
    for i in 0..n {
        v.push(i * i);
    }
}

fn sum<A: Allocator>(v: &Vec<u64, A>) -> u64 {
    v.iter().sum()
}

fn collections<B>(b: B, who: &str)
where
    for<'a> &'a B: Allocator,
{
    let mut v: Vec<u64, &B> = Vec::new_in(&b);
    push_squares(&mut v, 1000);
    assert_eq!(sum(&v), (0..1000u64).map(|i| i * i).sum::<u64>(), "{who}");
    let boxed: Box<[u8; 4096], &B> = Box::new_in([9; 4096], &b);
    assert!(boxed.iter().all(|&x| x == 9), "{who}");
    let mut m = hashbrown::HashMap::new_in(&b);
    for i in 0..2000u32 {
        m.insert(i, i * 2);
    }
    m.retain(|k, _| k % 3 == 0);
    assert_eq!(m.len(), 667, "{who}");
    assert_eq!(m[&999], 1998, "{who}");
}

#[test]
fn same_vec_box_hashmap_code_on_both() {
    on_both!(collections);
}

fn free_last_reclaims<B: Bumper>(b: B, who: &str)
where
    for<'a> &'a B: Allocator,
{
    let a = &b;
    let before = b.remaining();
    let p = a.allocate(layout(64, 8)).unwrap();
    assert!(b.remaining() <= before - 64, "{who}");
    // SAFETY: allocated above with this layout.
    unsafe { a.deallocate(p.cast(), layout(64, 8)) };
    assert_eq!(
        b.remaining(),
        before,
        "{who}: freeing the most recent block reclaims it"
    );
    let q = a.allocate(layout(64, 8)).unwrap();
    assert_eq!(
        p.cast::<u8>(),
        q.cast::<u8>(),
        "{who}: the same memory comes back"
    );
}

#[test]
fn freeing_the_most_recent_block_reclaims_it_on_both() {
    on_both!(free_last_reclaims);
}

fn free_earlier_reclaims_nothing<B: Bumper>(b: B, who: &str)
where
    for<'a> &'a B: Allocator,
{
    let a = &b;
    let first = a.allocate(layout(64, 8)).unwrap();
    let _second = a.allocate(layout(64, 8)).unwrap();
    let before = b.remaining();
    // SAFETY: allocated above with this layout.
    unsafe { a.deallocate(first.cast(), layout(64, 8)) };
    assert_eq!(
        b.remaining(),
        before,
        "{who}: an earlier block waits for the reset"
    );
}

#[test]
fn freeing_an_earlier_block_reclaims_nothing_on_both() {
    on_both!(free_earlier_reclaims_nothing);
}

fn grow_last_in_place<B: Bumper>(b: B, who: &str)
where
    for<'a> &'a B: Allocator,
{
    let mut v: Vec<u8, &B> = Vec::with_capacity_in(1000, &b);
    v.extend((0..1000).map(|i| i as u8));
    let before = b.remaining();
    v.reserve_exact(1000);
    let used = before - b.remaining();
    assert!(
        used <= 1000 + 16,
        "{who}: growing the most recent block took {used} bytes, not the 1000 added"
    );
    assert!(
        v.iter().enumerate().all(|(i, &x)| x == i as u8),
        "{who}: contents survive the grow"
    );
}

#[test]
fn growing_the_most_recent_block_takes_only_the_difference_on_both() {
    on_both!(grow_last_in_place);
}

fn shrink_last_reclaims_tail<B: Bumper>(b: B, who: &str)
where
    for<'a> &'a B: Allocator,
{
    let mut v: Vec<u8, &B> = Vec::with_capacity_in(1000, &b);
    v.extend((0..10).map(|i| i as u8));
    let before = b.remaining();
    v.shrink_to_fit();
    assert!(
        b.remaining() >= before + 990 - 16,
        "{who}: shrinking the most recent block gives back its tail"
    );
    assert_eq!(v[..], (0..10).collect::<std::vec::Vec<u8>>()[..], "{who}");
}

#[test]
fn shrinking_the_most_recent_block_reclaims_its_tail_on_both() {
    on_both!(shrink_last_reclaims_tail);
}

fn reset_reuses_memory<B: Bumper>(mut b: B, who: &str)
where
    for<'a> &'a B: Allocator,
{
    let mut held = std::vec::Vec::new();
    for _round in 0..5 {
        {
            let a = &b;
            let blocks: std::vec::Vec<_> = (0..20_000)
                .map(|i| a.allocate(layout(8 + i % 200, 8)).unwrap())
                .collect();
            assert_eq!(blocks.len(), 20_000);
        }
        b.reset_all();
        held.push(b.held());
    }
    assert_eq!(
        held[3], held[4],
        "{who}: a steady workload stops taking chunks after a reset ({held:?})"
    );
}

#[test]
fn reset_reuses_memory_on_both() {
    on_both!(reset_reuses_memory);
}

// ----- reset -----

#[test]
fn reset_keeps_the_largest_chunk_and_frees_the_rest() {
    let (mut arena, src) = recorded(ArenaConfig::host());
    let a = &arena;
    drop(Box::new_in(1u8, a)); // 64 KiB chunk
    let big: Vec<u8, _> = Vec::with_capacity_in(MIB, a); // dedicated 1 MiB chunk
    let later: Vec<u8, _> = Vec::with_capacity_in(100 * KIB, a); // regular chunk: 256 KiB
    assert_eq!(
        src.sizes(),
        [64 * KIB, MIB, 256 * KIB],
        "every new chunk doubles the next regular one"
    );
    let big_ptr = big.as_ptr() as usize;
    drop((big, later));
    arena.reset();
    assert_eq!((arena.chunk_count(), src.frees()), (1, 2));
    assert_eq!(arena.allocated_bytes(), MIB, "the largest chunk is kept");
    assert_eq!((arena.used_bytes(), arena.chunk_capacity()), (0, MIB));
    let again: Vec<u8, _> = Vec::with_capacity_in(MIB, &arena);
    assert_eq!(
        again.as_ptr() as usize,
        big_ptr,
        "the kept chunk serves the next batch"
    );
    assert_eq!(src.allocs(), 3, "no new chunk after the reset");
    drop(again);
    drop(arena);
    assert_eq!(src.live_bytes(), 0, "drop returns every chunk");
}

#[test]
fn reset_of_an_empty_arena_is_a_no_op() {
    let (mut arena, src) = recorded(ArenaConfig::host());
    arena.reset();
    arena.reset();
    assert_eq!((arena.chunk_count(), arena.used_bytes(), src.allocs()), (0, 0, 0));
    drop(Box::new_in(3u16, &arena));
    arena.reset();
    assert_eq!(arena.chunk_count(), 1);
}

#[test]
fn chunks_grow_geometrically_up_to_max_chunk() {
    let (arena, src) = recorded(small_chunks().with_max_chunk(32 * KIB));
    for _ in 0..200 {
        core::mem::forget(Box::new_in([0u8; 1000], &arena));
    }
    let sizes = src.sizes();
    assert_eq!(sizes[..4], [4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB]);
    assert!(sizes[4..].iter().all(|&s| s == 32 * KIB), "{sizes:?}");
    assert_eq!(arena.allocated_bytes(), sizes.iter().sum::<usize>());
}

// ----- rewind -----

#[test]
fn rewind_frees_what_came_after_the_mark_and_keeps_what_came_before() {
    let (mut arena, src) = recorded(small_chunks());
    let before = Box::into_raw(Box::new_in([7u64; 16], &arena));
    let mark = arena.checkpoint();
    let used = arena.used_bytes();
    {
        let a = &arena;
        let v: Vec<u64, _> = collect_in(0..10_000, a); // a chunk of its own
        let more = Box::new_in([1u8; 3000], a); // and a regular chunk
        assert_eq!((arena.chunk_count(), v.len(), more.len()), (3, 10_000, 3000));
    }
    let chunks = arena.chunk_count();
    arena.rewind(mark);
    assert_eq!(arena.used_bytes(), used);
    assert_eq!(arena.chunk_count(), chunks, "emptied chunks are kept as spares");
    // SAFETY: allocated before the mark, so the rewind left it alone.
    assert_eq!(unsafe { *before }, [7; 16]);
    let allocs = src.allocs();
    for _ in 0..10 {
        let mark = arena.checkpoint();
        {
            let v: Vec<u64, _> = collect_in(0..10_000, &arena);
            assert_eq!(v.iter().sum::<u64>(), 49_995_000);
        }
        arena.rewind(mark);
    }
    assert_eq!(
        src.allocs(),
        allocs,
        "spares serve repeated scopes without new chunks"
    );
}

#[test]
fn nested_checkpoints() {
    let mut arena = Arena::with_config(HostSource, small_chunks());
    let outer = arena.checkpoint();
    core::mem::forget(Box::new_in([1u8; 100], &arena));
    let inner = arena.checkpoint();
    let at_inner = arena.used_bytes();
    core::mem::forget(Box::new_in([2u8; 5000], &arena));
    arena.rewind(inner);
    assert_eq!(arena.used_bytes(), at_inner);
    let again = arena.checkpoint();
    assert_eq!(again, inner, "rewinding to a mark puts the arena exactly there");
    core::mem::forget(Box::new_in([3u8; 5000], &arena));
    arena.rewind(inner); // the same mark again
    arena.rewind(outer);
    assert_eq!(arena.used_bytes(), 0);
}

/// A checkpoint stays a position of the arena when the blocks of its chunk are freed
/// one by one (newest first, so the frees reclaim them) and the arena then moves to
/// another chunk: rewinding to it frees what came after it and keeps what came before
/// (found by an audit: the refill recycled the emptied chunk, and the rewind panicked).
#[test]
fn a_mark_whose_chunk_was_emptied_by_frees_still_rewinds() {
    let mut arena = Arena::with_config(HostSource, ArenaConfig::host().with_first_chunk(64 * KIB));
    let first = (&arena).allocate(layout(100, 8)).unwrap();
    // SAFETY: a live block of 100 bytes.
    unsafe { first.cast::<u8>().as_ptr().write_bytes(0xA5, 100) };
    let big = layout(200 * KIB, 8); // a chunk of its own
    let b = (&arena).allocate(big).unwrap();
    let mark = arena.checkpoint(); // names `b`'s chunk
                                   // SAFETY: the newest block, freed with its layout: its chunk is empty again.
    unsafe { (&arena).deallocate(b.cast(), big) };
    let after = (&arena).allocate(layout(400 * KIB, 8)).unwrap(); // does not fit that chunk
                                                                  // SAFETY: a live block of 400 KiB.
    unsafe { after.cast::<u8>().as_ptr().write_bytes(1, 400 * KIB) };
    let used_after = arena.used_bytes();
    arena.rewind(mark);
    assert!(
        arena.used_bytes() < used_after,
        "the block after the mark is freed"
    );
    // SAFETY: allocated before the mark: the rewind left it alone.
    let kept = unsafe { core::slice::from_raw_parts(first.cast::<u8>().as_ptr(), 100) };
    assert!(kept.iter().all(|&x| x == 0xA5));
    // The same through `scope`, which rewinds to a mark of its own.
    let c = (&arena).allocate(big).unwrap();
    arena.scope(|a| {
        // SAFETY: the newest block, freed with its layout.
        unsafe { a.deallocate(c.cast(), big) };
        let v: Vec<u8, _> = collect_in(core::iter::repeat_n(7u8, 400 * KIB), a);
        assert_eq!(v.len(), 400 * KIB);
    });
    assert_eq!(*Box::new_in(5u32, &arena), 5, "usable afterwards");
}

#[test]
fn scope_frees_on_return() {
    let mut arena = Arena::host();
    let outer = arena.scope(|a| {
        let v: Vec<u8, _> = collect_in(0..=255u8, a);
        v.len()
    });
    assert_eq!((outer, arena.used_bytes()), (256, 0));
}

#[test]
#[should_panic(expected = "not a position")]
fn rewind_to_a_later_mark_after_an_earlier_one_panics() {
    let mut arena = Arena::host();
    let early = arena.checkpoint();
    core::mem::forget(Box::new_in(1u64, &arena));
    let late = arena.checkpoint();
    arena.rewind(early);
    arena.rewind(late);
}

#[test]
#[should_panic(expected = "not a position")]
fn rewind_to_another_arenas_mark_panics() {
    let mut arena = Arena::host();
    let other = Arena::host();
    core::mem::forget(Box::new_in(1u64, &arena));
    core::mem::forget(Box::new_in(1u64, &other));
    arena.rewind(other.checkpoint());
}

#[test]
#[should_panic(expected = "not a position")]
fn rewind_to_a_mark_whose_chunk_a_reset_freed_panics() {
    let mut arena = Arena::with_config(HostSource, small_chunks());
    core::mem::forget(Box::new_in(1u64, &arena));
    let mark = arena.checkpoint(); // in the 4 KiB chunk
    core::mem::forget(Box::new_in([0u8; 8000], &arena));
    arena.reset(); // keeps the 8 KiB chunk, frees the 4 KiB one
    arena.rewind(mark);
}

// ----- limits and failures -----

#[test]
fn limit_reached_gives_alloc_error_and_the_arena_stays_usable() {
    let (mut arena, src) = recorded(ArenaConfig::host().with_limit(MIB));
    let mut too_big: Vec<u8, _> = Vec::new_in(&arena);
    assert!(
        too_big.try_reserve_exact(2 * MIB).is_err(),
        "a request past the limit fails"
    );
    drop(too_big);
    assert_eq!(*Box::new_in(5u32, &arena), 5, "usable after a failure");
    for round in 0..3 {
        let a = &arena;
        let mut blocks = 0usize;
        while a.allocate(layout(4 * KIB, 8)).is_ok() {
            blocks += 1;
            assert!(blocks <= 256, "round {round}: more blocks than the limit holds");
        }
        assert!(
            blocks >= 200,
            "round {round}: only {blocks} blocks of 4 KiB fit in 1 MiB"
        );
        assert!(arena.allocated_bytes() <= MIB);
        assert!(a.allocate(layout(16, 8)).is_ok() || arena.chunk_capacity() < 16);
        arena.reset();
        assert!(arena.allocated_bytes() <= MIB);
    }
    drop(arena);
    assert_eq!(src.live_bytes(), 0);
}

#[test]
fn limit_below_the_first_chunk_clips_it() {
    let arena = Arena::with_config(HostSource, ArenaConfig::host().with_limit(1000));
    let a = &arena;
    assert!(a.allocate(layout(600, 8)).is_ok());
    assert!(
        a.allocate(layout(600, 8)).is_err(),
        "1200 bytes do not fit a 1000-byte limit"
    );
    assert!(
        a.allocate(layout(300, 8)).is_ok(),
        "what still fits is handed out"
    );
    assert_eq!(arena.allocated_bytes(), 1000);
}

#[test]
fn spares_go_back_to_the_source_under_limit_pressure() {
    let (mut arena, src) = recorded(ArenaConfig::host().with_limit(MIB));
    drop(Box::new_in(0u8, &arena));
    let mark = arena.checkpoint();
    drop(Vec::<u8, _>::with_capacity_in(600 * KIB, &arena)); // a chunk of its own
    arena.rewind(mark); // ... now a spare
    assert_eq!(arena.chunk_count(), 2);
    let v: Vec<u8, _> = Vec::with_capacity_in(900 * KIB, &arena);
    // The spare went back to make room, and so did the first chunk, which the dropped
    // Box left empty.
    assert_eq!(
        src.frees(),
        2,
        "the spare and the empty chunk were freed to make room"
    );
    assert!(arena.allocated_bytes() <= MIB);
    drop(v);
}

#[test]
fn huge_requests_fail_cleanly() {
    let arena = Arena::host();
    let a = &arena;
    assert!(a.allocate(layout(1 << 50, 8)).is_err());
    assert!(a.allocate(layout(isize::MAX as usize - 4095, 4096)).is_err());
    assert!(
        a.allocate(layout(isize::MAX as usize / 2, 1 << 30)).is_err(),
        "size + alignment slack"
    );
    assert!(a.allocate(layout(64, 8)).is_ok());
}

#[test]
fn a_short_source_gets_asked_for_just_enough() {
    let src = Recorded {
        max_request: 256 * KIB,
        ..Recorded::new()
    };
    let arena = Arena::with_config(src.clone(), ArenaConfig::host().with_first_chunk(MIB));
    let a = &arena;
    assert!(
        a.allocate(layout(100, 8)).is_ok(),
        "the 1 MiB chunk is refused; 100 bytes are not"
    );
    assert_eq!(src.sizes(), [100]);
    assert!(a.allocate(layout(300 * KIB, 8)).is_err());
    assert!(a.allocate(layout(200 * KIB, 8)).is_ok());
}

#[test]
fn zero_size_requests_never_reach_the_source() {
    let (arena, src) = recorded(ArenaConfig::host());
    let a = &arena;
    for align in [1, 8, 4096, MIB, 1 << 30] {
        let p = a.allocate(layout(0, align)).unwrap();
        assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0);
        // SAFETY: allocated above.
        unsafe { a.deallocate(p.cast(), layout(0, align)) };
    }
    let v: Vec<(), _> = collect_in(core::iter::repeat_n((), 1000), a);
    assert_eq!(v.len(), 1000);
    assert_eq!(src.allocs(), 0);
}

#[test]
fn alignments_beyond_the_source_alignment() {
    let arena = Arena::with_config(HostSource, small_chunks());
    let a = &arena;
    for shift in [13, 16, 20, 24] {
        let l = layout(100, 1 << shift);
        let p = a.allocate(l).unwrap();
        assert_eq!(p.cast::<u8>().as_ptr() as usize % l.align(), 0, "align 2^{shift}");
        // SAFETY: the block has 100 writable bytes.
        unsafe { p.cast::<u8>().as_ptr().write_bytes(0xEE, 100) };
    }
}

// ----- threads, statistics -----

#[test]
fn an_arena_moves_between_threads() {
    fn send<T: Send>(_: &T) {}
    let mut arena = Arena::host();
    send(&arena);
    send(&Arena::pinned());
    drop(Box::new_in(1u8, &arena));
    arena = std::thread::spawn(move || {
        drop(collect_in(0..1000, &arena));
        arena.reset();
        arena
    })
    .join()
    .unwrap();
    assert_eq!(arena.chunk_count(), 1);
}

#[test]
fn statistics() {
    let arena = Arena::with_config(HostSource, small_chunks());
    let b = Box::new_in([0u8; 1000], &arena);
    let s = arena.stats();
    assert_eq!(
        (s.held_bytes, s.used_bytes, s.chunks, s.pending_uses),
        (4 * KIB, 1000, 1, 0)
    );
    assert_eq!((s.gpu_wait_errors, s.abandoned_bytes), (0, 0));
    assert_eq!(arena.chunk_capacity(), 4 * KIB - 1000);
    drop(b);
    assert_eq!(arena.used_bytes(), 0);
    assert!(format!("{arena:?}").contains("Arena"));
}

#[test]
fn pinned_arena_without_a_driver_falls_back_and_the_strict_one_fails_cleanly() {
    if cudalloc::cuda::driver_available() {
        return; // covered by pinned_arena_conformance on the GPU machine
    }
    let strict = Arena::pinned_strict();
    let mut v: Vec<u8, _> = Vec::new_in(&strict);
    assert!(v.try_reserve(1).is_err());
    assert!(
        Vec::<(), _>::with_capacity_in(10, &strict).capacity() > 0,
        "zero-size types need no driver"
    );
    assert_eq!(strict.allocated_bytes(), 0);
    let before = cudalloc::fallback_allocations();
    let arena = Arena::pinned();
    let mut v: Vec<u8, _> = Vec::new_in(&arena);
    v.extend_from_slice(&[1, 2, 3]);
    assert_eq!(&v[..], &[1, 2, 3]);
    assert!(cudalloc::fallback_allocations() > before, "counted as a fallback");
}

// ----- on the GPU machine -----

#[test]
fn pinned_arena_conformance() {
    gpu!();
    suite(
        &&Arena::pinned(),
        Options {
            random_ops: 1000,
            ..Options::default()
        },
    );
}

#[test]
fn pinned_arena_block_copied_to_the_device_is_bit_exact() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let arena = Arena::pinned();
    for len in [1usize, 4097, 3 * MIB + 5, 64 * MIB] {
        let src: Vec<u8, _> = collect_in(
            (0..len).map(|i| (i as u8).wrapping_mul(167) ^ (i >> 11) as u8),
            &arena,
        );
        assert_eq!(
            pointer_info(src.as_ptr()).unwrap().memory_type,
            MemoryType::PinnedHost
        );
        let mut dev = DeviceMemory::new(len, 0).unwrap();
        dev.copy_from_host(&src, &stream).unwrap();
        let mut back = std::vec![0u8; len];
        dev.copy_to_host(&mut back, &stream).unwrap();
        assert!(src[..] == back[..], "{len} bytes differ after the round trip");
    }
    assert_eq!(arena.stats().gpu_wait_errors, 0);
}

const RACE_BYTES: usize = 64 * MIB;
const PATTERN_A: u8 = 0xA5;
const PATTERN_B: u8 = 0x5A;

#[derive(Clone, Copy, Debug)]
enum Reuse {
    Reset,
    Rewind,
}

/// The race recipe: a copy of an arena block queued behind 20 ms of work on the stream,
/// `record_use`, then the memory reused at once (reset or rewind, and a new block of
/// the same size filled with pattern B). Returns the rounds whose device copy holds
/// anything but pattern A.
fn race(rounds: usize, wait: bool, reuse: Reuse) -> usize {
    let stream = Stream::new(0).unwrap();
    let cfg = ArenaConfig::pinned().with_first_chunk(RACE_BYTES);
    let mut arena = Arena::with_config(PinnedSource::default(), cfg);
    #[cfg(feature = "test-hooks")]
    arena.set_skip_gpu_wait(!wait);
    #[cfg(not(feature = "test-hooks"))]
    assert!(wait, "skipping the wait needs the test-hooks feature");
    let mut dev = DeviceMemory::new(RACE_BYTES, 0).unwrap();
    let mut back = std::vec![0u8; RACE_BYTES];
    let mut corrupted = 0;
    for round in 0..rounds {
        let mark = arena.checkpoint();
        let a_addr = {
            let mut a: Vec<u8, _> = Vec::with_capacity_in(RACE_BYTES, &arena);
            a.resize(RACE_BYTES, PATTERN_A);
            stream
                .launch_host_fn(|| std::thread::sleep(Duration::from_millis(20)))
                .unwrap();
            // SAFETY: `a`'s memory is kept from reuse by record_use, unless the test
            // switch turns the wait off: then host writes race the DMA read on purpose,
            // which corrupts the copied bytes, never Rust-visible memory.
            unsafe { dev.copy_from_host_async(0, &a, &stream) }.unwrap();
            assert!(arena.record_use(a.as_ptr(), &stream).unwrap());
            a.as_ptr() as usize
        };
        let t = Instant::now();
        match reuse {
            Reuse::Reset => arena.reset(),
            Reuse::Rewind => arena.rewind(mark),
        }
        let waited = t.elapsed();
        let mut b: Vec<u8, _> = Vec::with_capacity_in(RACE_BYTES, &arena);
        b.resize(RACE_BYTES, PATTERN_B);
        assert_eq!(
            b.as_ptr() as usize,
            a_addr,
            "the test needs block B in block A's memory"
        );
        stream.synchronize().unwrap();
        dev.copy_to_host(&mut back, &stream).unwrap();
        let bad = back.iter().filter(|&&x| x != PATTERN_A).count();
        println!(
            "{reuse:?}, wait {wait}, round {round}: {:?} waited, {bad} of {RACE_BYTES} bytes corrupted",
            waited
        );
        corrupted += usize::from(bad > 0);
    }
    assert_eq!(arena.stats().gpu_wait_errors, 0);
    corrupted
}

#[test]
fn reset_after_an_async_copy_waits_for_it() {
    gpu!();
    assert_eq!(
        race(8, true, Reuse::Reset),
        0,
        "reset reused memory a queued copy still had to read"
    );
}

#[cfg(feature = "test-hooks")]
#[test]
fn reset_without_the_wait_corrupts_the_copy() {
    gpu!();
    // The negative control: if this fails, the race test above proves nothing.
    let corrupted = race(8, false, Reuse::Reset);
    assert!(
        corrupted > 0,
        "no corruption seen without the wait: the race recipe does not race"
    );
}

#[test]
fn rewind_after_an_async_copy_waits_for_it() {
    gpu!();
    assert_eq!(
        race(4, true, Reuse::Rewind),
        0,
        "rewind reused memory a queued copy still had to read"
    );
}

#[cfg(feature = "test-hooks")]
#[test]
fn rewind_without_the_wait_corrupts_the_copy() {
    gpu!();
    assert!(
        race(4, false, Reuse::Rewind) > 0,
        "no corruption seen without the wait"
    );
}

#[test]
fn freeing_a_block_the_gpu_reads_does_not_hand_it_out_again() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let arena = Arena::with_config(
        PinnedSource::default(),
        ArenaConfig::pinned().with_first_chunk(2 * RACE_BYTES),
    );
    let mut dev = DeviceMemory::new(RACE_BYTES, 0).unwrap();
    let a_addr = {
        let mut a: Vec<u8, _> = Vec::with_capacity_in(RACE_BYTES, &arena);
        a.resize(RACE_BYTES, PATTERN_A);
        stream
            .launch_host_fn(|| std::thread::sleep(Duration::from_millis(20)))
            .unwrap();
        // SAFETY: record_use keeps `a`'s memory from being handed out again.
        unsafe { dev.copy_from_host_async(0, &a, &stream) }.unwrap();
        assert!(arena.record_use(a.as_ptr(), &stream).unwrap());
        a.as_ptr() as usize
    }; // `a` is the most recent block: freeing it would normally reclaim it
    let mut b: Vec<u8, _> = Vec::with_capacity_in(RACE_BYTES, &arena);
    b.resize(RACE_BYTES, PATTERN_B);
    assert_ne!(b.as_ptr() as usize, a_addr);
    stream.synchronize().unwrap();
    let mut back = std::vec![0u8; RACE_BYTES];
    dev.copy_to_host(&mut back, &stream).unwrap();
    assert!(back.iter().all(|&x| x == PATTERN_A));
}
