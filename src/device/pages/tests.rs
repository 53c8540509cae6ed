//! Groups (one handle for a span of chunks) and lost chunks, on the simulated physical
//! memory of `device/fake/`, which checks that a group is mapped whole, unmapped whole,
//! released only unmapped, and never mapped elsewhere.

use super::PageHeap;
use crate::device::backend::Backend;
use crate::device::config::PageTuning;
use crate::device::fake::{FakeBackend, FakePhys, FakeStream, PhysOp};
use crate::device::phys::Phys;
use crate::sync::lock;

const MIB: usize = 1 << 20;
const GRANULE: usize = 2 * MIB;
/// 4 MiB chunks, idle memory up to 1/32 (as `device::tests`).
const TUNING: PageTuning = PageTuning::new(4 * MIB, 32);
const CHUNK: usize = TUNING.chunk_bytes;

mod idle_queries;
mod unlocked;

type Heap = PageHeap<FakePhys, FakeBackend>;

/// A heap of `tuning` over fake physical memory of at most `limit` bytes, groups from
/// `group_min` chunks (`None`: the crate's rule), and a fake backend for its marks.
fn heap(limit: usize, tuning: PageTuning, group_min: Option<usize>) -> (Heap, FakeBackend, FakePhys) {
    let phys = FakePhys::new(GRANULE, limit);
    let mut h = PageHeap::new(phys.clone(), tuning);
    if let Some(k) = group_min {
        h = h.with_group_min(k);
    }
    (h, FakeBackend::new(u64::MAX), phys)
}

/// Frees `ptr` (of `h`) on `s`.
fn free(h: &Heap, b: &FakeBackend, ptr: u64, s: &FakeStream) {
    // SAFETY: the tests free each block of `h` once, after queuing its uses on `s`.
    unsafe { h.free(b, ptr, s) };
}

/// Trims `h` to nothing (every block freed) and checks that nothing is left and that no
/// operation broke the fake's rules.
fn trim_clean(h: &Heap, b: &FakeBackend, phys: &FakePhys) {
    h.trim_to(b, 0);
    assert_eq!(h.stats().reserved, 0);
    assert_eq!(phys.live(), (0, 0, 0, 0), "no handle, range or mapping left");
    assert_eq!(phys.violations(), 0);
}

/// Checks `h`'s driver calls so far: (handles created, groups created, maps, access calls).
#[track_caller]
fn assert_calls(h: &Heap, want: (u64, u64, u64, u64)) {
    let st = h.stats();
    assert_eq!(
        (st.creates, st.group_creates, st.maps, st.accesses),
        want,
        "{st:?}"
    );
}

#[test]
fn a_cold_large_block_is_one_create_one_map_and_one_access() {
    // The crate's rule: 64 MiB of new chunks wholly inside the block (16 of 4 MiB here).
    let (h, b, phys) = heap(usize::MAX, TUNING, None);
    let s = FakeStream::new();
    let a = h.alloc(&b, 64 * MIB, &s).unwrap();
    assert_calls(&h, (1, 1, 1, 1));
    assert_eq!(h.stats().reserved, 64 * MIB);
    assert_eq!(
        phys.mappings(),
        vec![(a, 64 * MIB)],
        "one mapping of the whole handle"
    );
    assert!(phys.use_block(a, 64 * MIB, &s));
    // A peer gets access to the group as to any span (one call).
    h.enable_peer(1).unwrap();
    assert_eq!(h.stats().accesses, 2);
    assert!(phys.peer_reaches(a, 64 * MIB, 1));
    // Below the rule's bytes (12 inner chunks), but the heap grows (no chunk idle): one
    // group too.
    let c = h.alloc(&b, 48 * MIB, &s).unwrap();
    assert_calls(&h, (2, 2, 2, 3));
    assert!(phys.use_block(c, 48 * MIB, &s));
    // Freed, its chunks serve smaller blocks with no driver call.
    free(&h, &b, a, &s);
    let d = h.alloc(&b, 8 * MIB, &s).unwrap();
    assert_eq!((d, h.stats().maps), (a, 2));
    assert!(phys.use_block(d, 8 * MIB, &s));
    // With chunks idle (a's last 56 MiB, a group's, so none moves alone) the heap does
    // not grow: a block that does not fit there and is below the rule's bytes maps one
    // handle per chunk, with one access call.
    let e = h.alloc(&b, 60 * MIB, &s).unwrap();
    assert_calls(&h, (17, 2, 17, 4));
    assert!(phys.use_block(e, 60 * MIB, &s));
    free(&h, &b, d, &s);
    free(&h, &b, c, &s);
    free(&h, &b, e, &s);
    assert_eq!(phys.violations(), 0);
    // Trim releases each group whole: one unmap, one release, its bytes.
    h.trim_to(&b, 0);
    let st = h.stats();
    assert_eq!((st.group_releases, st.releases, st.unmaps), (2, 17, 17), "{st:?}");
    trim_clean(&h, &b, &phys);
}

/// A forward pass over `h`: 20 layers of blocks kept (2.5 to 50 MiB, few of them whole
/// chunks) and a temporary freed per layer; every block used. The peak reservation, the
/// maps and the groups made.
fn forward_pass(h: &Heap, b: &FakeBackend, phys: &FakePhys) -> (usize, u64, u64) {
    let s = FakeStream::new();
    let mut kept = Vec::new();
    for _ in 0..20 {
        for kib in [2560, 12800, 51200, 10240, 2560, 5120] {
            let p = h.alloc(b, kib << 10, &s).unwrap();
            assert!(phys.use_block(p, kib << 10, &s));
            kept.push(p);
        }
        let tmp = h.alloc(b, 6 * MIB, &s).unwrap();
        assert!(phys.use_block(tmp, 6 * MIB, &s));
        free(h, b, tmp, &s);
    }
    let st = h.stats();
    for p in kept {
        free(h, b, p, &s);
    }
    s.complete_all();
    (st.peak_reserved, st.maps, st.group_creates)
}

#[test]
fn growth_maps_a_group_per_block_for_the_same_reservation() {
    // Nothing mapped ahead of the blocks (below): the groups alone.
    let (h, b, phys) = heap(usize::MAX, TUNING, None);
    let h = h.with_growth_ahead(0);
    let grouped = forward_pass(&h, &b, &phys);
    trim_clean(&h, &b, &phys);
    // The same pass with one handle per chunk (no groups).
    let (h1, b1, phys1) = heap(usize::MAX, TUNING, Some(usize::MAX));
    let single = forward_pass(&h1, &b1, &phys1);
    trim_clean(&h1, &b1, &phys1);
    assert_eq!(grouped.0, single.0, "the same peak reservation");
    assert_eq!(single.2, 0);
    assert!(grouped.2 > 0, "{grouped:?}");
    assert!(
        grouped.1 * 2 < single.1,
        "maps: {} with growth groups, {} without",
        grouped.1,
        single.1
    );
}

#[test]
fn growth_maps_ahead_within_the_idle_share_for_fewer_maps() {
    // The forward pass with chunks mapped ahead (the crate's rule) and without.
    let (h, b, phys) = heap(usize::MAX, TUNING, None);
    let ahead = forward_pass(&h, &b, &phys);
    trim_clean(&h, &b, &phys);
    let (h0, b0, phys0) = heap(usize::MAX, TUNING, None);
    let h0 = h0.with_growth_ahead(0);
    let none = forward_pass(&h0, &b0, &phys0);
    trim_clean(&h0, &b0, &phys0);
    assert!(
        ahead.1 * 4 < none.1 * 3,
        "maps: {} mapping ahead, {} without",
        ahead.1,
        none.1
    );
    // At most the chunks one group maps ahead (3) more at the peak.
    assert!(
        ahead.0 <= none.0 + 3 * CHUNK,
        "peak reserved: {} mapping ahead, {} without",
        ahead.0,
        none.0
    );
}

#[test]
fn chunks_mapped_ahead_are_idle_and_serve_the_next_block_with_no_map() {
    let (h, b, phys) = heap(usize::MAX, TUNING, None);
    let s = FakeStream::new();
    // A heap under 32 chunks of blocks (1/32 of them under one chunk) maps nothing ahead.
    let small = h.alloc(&b, 2 * MIB, &s).unwrap();
    assert_eq!(h.stats().reserved, CHUNK, "nothing ahead of a small heap");
    free(&h, &b, small, &s);
    s.complete_all();
    trim_clean(&h, &b, &phys);
    // 64 chunks of blocks: the share is 2 chunks, so a block growing the heap by one
    // chunk maps the next one with it, as one group.
    let big = h.alloc(&b, 64 * CHUNK, &s).unwrap();
    let before = h.stats();
    let a = h.alloc(&b, 2 * MIB, &s).unwrap();
    let st = h.stats();
    assert_eq!(st.reserved - before.reserved, 2 * CHUNK, "{st:?}");
    assert_eq!((st.maps - before.maps, st.accesses - before.accesses), (1, 1));
    assert_eq!(st.group_creates - before.group_creates, 1);
    // The next block takes the rest of a's chunk and the chunk ahead: no driver call.
    let c = h.alloc(&b, CHUNK, &s).unwrap();
    assert_eq!(c, a + 2 * MIB as u64);
    let after = h.stats();
    assert_eq!(
        (after.maps, after.accesses, after.reserved),
        (st.maps, st.accesses, st.reserved)
    );
    assert!(phys.use_block(a, 2 * MIB, &s) && phys.use_block(c, CHUNK, &s));
    assert!(phys.use_block(big, 64 * CHUNK, &s));
    // 256 chunks of blocks more: the group stops at 4 chunks (`huge` ends 2 MiB into a
    // chunk of its own group; `d` takes that and grows the heap).
    let huge = h.alloc(&b, 256 * CHUNK, &s).unwrap();
    let before = h.stats();
    let d = h.alloc(&b, CHUNK, &s).unwrap();
    assert_eq!(
        h.stats().reserved - before.reserved,
        4 * CHUNK,
        "capped at 4 chunks"
    );
    assert!(phys.use_block(d, CHUNK, &s));
    for p in [a, c, big, huge, d] {
        free(&h, &b, p, &s);
    }
    s.complete_all();
    trim_clean(&h, &b, &phys);
}

#[test]
fn a_limit_that_refuses_the_chunks_ahead_maps_the_blocks_group_alone() {
    // 96 chunks of blocks (a share of 3 chunks) and room for 2 chunks more: a block that
    // grows the heap by 2 chunks cannot have the third ahead of it, and is still one
    // group of its own 2 (one handle, one map), not one handle per chunk.
    let (h, b, phys) = heap(98 * CHUNK, TUNING, None);
    let s = FakeStream::new();
    let big = h.alloc(&b, 96 * CHUNK, &s).unwrap();
    let before = h.stats();
    let a = h.alloc(&b, 2 * CHUNK, &s).expect("the block alone fits");
    let st = h.stats();
    assert_eq!(st.reserved, 98 * CHUNK);
    assert_eq!(
        (
            st.group_creates - before.group_creates,
            st.creates - before.creates,
            st.maps - before.maps
        ),
        (1, 1, 1),
        "{st:?}"
    );
    assert!(phys.use_block(a, 2 * CHUNK, &s) && phys.use_block(big, 96 * CHUNK, &s));
    free(&h, &b, a, &s);
    free(&h, &b, big, &s);
    s.complete_all();
    trim_clean(&h, &b, &phys);
}

#[test]
fn growth_maps_no_chunk_ahead_over_a_stuck_group() {
    // Chunk 0 (a), a group of chunks 1-2 (g), then 64 chunks of blocks (big): a share of
    // 2 chunks ahead. g's group fails its unmap: it stays mapped and stuck, its units
    // free. Chunk 0 is unmapped. A block in chunk 0 grows the heap, and the chunk ahead of
    // it is the stuck group's first: mapping it again would map over a live mapping.
    let (h, b, phys) = heap(usize::MAX, TUNING, None);
    let s = FakeStream::new();
    let a = h.alloc(&b, CHUNK, &s).unwrap();
    let g = h.alloc(&b, 2 * CHUNK, &s).unwrap();
    let big = h.alloc(&b, 64 * CHUNK, &s).unwrap();
    assert_eq!((g, big), (a + CHUNK as u64, a + 3 * CHUNK as u64));
    free(&h, &b, g, &s);
    s.complete_all();
    phys.fail_next(PhysOp::Unmap, 1);
    h.trim_to(&b, 0);
    assert!(
        phys.mappings().contains(&(g, 2 * CHUNK)),
        "the group stays mapped"
    );
    free(&h, &b, a, &s);
    s.complete_all();
    h.trim_to(&b, 0);
    let stuck = phys.mappings();
    assert!(!stuck.iter().any(|&(va, _)| va == a), "chunk 0 unmapped");
    let before = h.stats();
    let c = h.alloc(&b, 2 * MIB, &s).expect("the block's own chunk maps");
    assert_eq!(c, a, "placed at the lowest free address");
    let st = h.stats();
    assert_eq!(st.reserved - before.reserved, CHUNK, "nothing ahead: {st:?}");
    assert_eq!(phys.violations(), 0, "no map over a mapping");
    assert!(phys.use_block(c, 2 * MIB, &s) && phys.use_block(big, 64 * CHUNK, &s));
    let mut now = phys.mappings();
    now.retain(|&(va, _)| va != c);
    assert_eq!(now, stuck, "the stuck group is mapped as it was");
    free(&h, &b, c, &s);
    free(&h, &b, big, &s);
    s.complete_all();
    h.trim_to(&b, 0);
    assert_eq!(phys.violations(), 0);
}

#[test]
fn a_growth_group_shared_with_the_next_block_goes_once_both_are_freed() {
    let (h, b, phys) = heap(usize::MAX, TUNING, None);
    let s = FakeStream::new();
    // 6 MiB from the start: chunks 0 and 1 (the second partly), one group; the next
    // 2 MiB fits in the rest of chunk 1 and maps nothing.
    let a = h.alloc(&b, 6 * MIB, &s).unwrap();
    let c = h.alloc(&b, 2 * MIB, &s).unwrap();
    assert_eq!(c, a + 6 * MIB as u64);
    let st = h.stats();
    assert_eq!((st.creates, st.group_creates, st.maps), (1, 1, 1), "{st:?}");
    assert_eq!(phys.mappings(), vec![(a, 2 * CHUNK)]);
    assert!(phys.use_block(a, 6 * MIB, &s) && phys.use_block(c, 2 * MIB, &s));
    // a freed: chunk 0 idle, chunk 1 still c's: the group stays whole.
    free(&h, &b, a, &s);
    s.complete_all();
    h.trim_to(&b, 0);
    assert_eq!(h.stats().reserved, 2 * CHUNK, "a group goes only whole");
    assert_eq!(phys.mappings(), vec![(a, 2 * CHUNK)]);
    assert!(phys.use_block(c, 2 * MIB, &s));
    free(&h, &b, c, &s);
    s.complete_all();
    trim_clean(&h, &b, &phys);
    assert_eq!(h.stats().group_releases, 1);
}

#[test]
fn a_group_goes_only_whole_when_idle_and_done_and_is_never_mapped_elsewhere() {
    let (h, b, phys) = heap(usize::MAX, TUNING, Some(2));
    let (s1, s2) = (FakeStream::new(), FakeStream::new());
    // A group of 8 chunks, a block after it (so that its hole is bounded); a 4 MiB
    // block stays in the group's first chunk.
    let a = h.alloc(&b, 32 * MIB, &s1).unwrap();
    let keep = h.alloc(&b, 4 * MIB, &s1).unwrap();
    assert!(phys.use_block(a, 32 * MIB, &s1));
    free(&h, &b, a, &s1);
    let small = h.alloc(&b, 4 * MIB, &s1).unwrap();
    assert_eq!(small, a);
    assert!(phys.use_block(small, 4 * MIB, &s1));
    // 28 MiB idle, over the allowance: a block that does not fit there would move an
    // idle chunk, but no chunk of a group moves alone: new memory is made instead.
    let c = h.alloc(&b, 40 * MIB, &s2).unwrap();
    let st = h.stats();
    assert_eq!((st.unmaps, st.group_releases, st.creates), (0, 0, 12), "{st:?}");
    assert!(
        phys.mappings().contains(&(a, 32 * MIB)),
        "the group stays mapped whole"
    );
    assert!(phys.use_block(c, 40 * MIB, &s2));
    // All of the group idle, but its frees pending on s1 (not run): skipped, never
    // retired (its handle would have to be mapped at one chunk).
    free(&h, &b, small, &s1);
    free(&h, &b, c, &s2);
    let d = h.alloc(&b, 72 * MIB, &s2).unwrap();
    let st = h.stats();
    assert_eq!((st.unmaps, st.group_releases, st.creates), (0, 0, 20), "{st:?}");
    assert!(lock(&h.state).retired.is_empty(), "a group is never retired");
    assert!(phys.mappings().contains(&(a, 32 * MIB)));
    assert!(phys.use_block(d, 72 * MIB, &s2));
    free(&h, &b, d, &s2);
    // Once s1's work completed, the next block that would move an idle chunk releases
    // the group instead (one unmap of all of it) and creates: the heap reserves less.
    s1.complete_all();
    s2.complete_all();
    assert_eq!(h.stats().reserved, (4 + 32 + 72) * MIB);
    let e = h.alloc(&b, 80 * MIB, &s2).unwrap();
    let st = h.stats();
    assert_eq!((st.group_releases, st.unmaps), (1, 1), "{st:?}");
    assert!(!phys.mappings().contains(&(a, 32 * MIB)), "unmapped whole");
    assert_eq!(st.reserved, (4 + 80) * MIB, "{st:?}");
    assert!(phys.use_block(e, 80 * MIB, &s2));
    free(&h, &b, e, &s2);
    free(&h, &b, keep, &s1);
    s2.complete_all();
    assert_eq!(phys.violations(), 0);
    trim_clean(&h, &b, &phys);
}

#[test]
fn trim_releases_idle_groups_whole_and_no_more_than_needed() {
    let (h, b, phys) = heap(usize::MAX, TUNING, Some(2));
    let s = FakeStream::new();
    let a = h.alloc(&b, 32 * MIB, &s).unwrap();
    let c = h.alloc(&b, 32 * MIB, &s).unwrap();
    assert_eq!(h.stats().group_creates, 2);
    assert!(phys.use_block(a, 32 * MIB, &s));
    assert!(phys.use_block(c, 32 * MIB, &s));
    free(&h, &b, a, &s);
    free(&h, &b, c, &s);
    // Keep 40 MiB: the highest group goes (waiting for its frees on the host), whole.
    h.trim_to(&b, 40 * MIB);
    let st = h.stats();
    assert_eq!(
        (st.reserved, st.group_releases, st.unmaps),
        (32 * MIB, 1, 1),
        "{st:?}"
    );
    assert_eq!(phys.mappings(), vec![(a, 32 * MIB)]);
    assert_eq!(phys.violations(), 0);
    trim_clean(&h, &b, &phys);
    assert_eq!(h.stats().group_releases, 2);
}

#[test]
fn out_of_memory_recovery_releases_an_idle_group_and_the_retry_succeeds() {
    // 100 MiB of physical memory; idle memory up to the bytes in blocks (divisor 1), so
    // that nothing is moved before the create fails.
    let tuning = PageTuning::new(4 * MIB, 1);
    let (h, b, phys) = heap(100 * MIB, tuning, Some(2));
    let s = FakeStream::new();
    let a = h.alloc(&b, 48 * MIB, &s).unwrap();
    let keep = h.alloc(&b, 48 * MIB, &s).unwrap();
    assert_eq!(h.stats().group_creates, 2);
    assert!(phys.use_block(a, 48 * MIB, &s));
    free(&h, &b, a, &s);
    s.complete_all();
    // 52 MiB does not fit in a's hole: past `keep`, where the group's create (52 MiB)
    // fails, chunks are made one by one until memory runs out, and then the idle group
    // is released and the create retried.
    let c = h.alloc(&b, 52 * MIB, &s).unwrap();
    let st = h.stats();
    assert_eq!((st.group_creates, st.group_releases), (2, 1), "{st:?}");
    assert_eq!(st.reserved, 100 * MIB);
    assert!(phys.use_block(c, 52 * MIB, &s));
    free(&h, &b, c, &s);
    free(&h, &b, keep, &s);
    s.complete_all();
    assert_eq!(phys.violations(), 0);
    trim_clean(&h, &b, &phys);
}

#[test]
fn a_chunk_stuck_without_access_is_never_used_again() {
    // Per chunk: the access call over chunks 0-1 fails, then chunk 0's unmap: it stays
    // mapped without access. Before the fix its units went back to the free runs and the
    // next block was placed there (mapped, so no driver call) and used it without access.
    let (h, b, phys) = heap(usize::MAX, TUNING, Some(usize::MAX));
    let s = FakeStream::new();
    phys.fail_next(PhysOp::SetAccess, 1);
    phys.fail_next(PhysOp::Unmap, 1);
    assert!(h.alloc(&b, 6 * MIB, &s).is_err());
    assert_eq!(h.stats().access_failures, 1);
    let lost = phys.mappings();
    assert_eq!(lost.len(), 1, "chunk 0 stays mapped");
    let y = h.alloc(&b, 4 * MIB, &s).unwrap();
    assert_ne!(y, lost[0].0, "placed where memory has access");
    assert!(phys.use_block(y, 4 * MIB, &s));
    assert_eq!(phys.violations(), 0, "no use without access");
    free(&h, &b, y, &s);
    // Trimming leaves the lost chunk mapped (and its region reserved).
    h.trim_to(&b, 0);
    assert_eq!(phys.mappings(), lost);
    assert_eq!(phys.violations(), 0);
}

#[test]
fn a_group_whose_access_fails_is_released_or_lost_and_never_used() {
    let (h, b, phys) = heap(usize::MAX, TUNING, Some(2));
    let s = FakeStream::new();
    // The access call fails and the unmap succeeds: released at once.
    phys.fail_next(PhysOp::SetAccess, 1);
    assert!(h.alloc(&b, 16 * MIB, &s).is_err());
    let st = h.stats();
    assert_eq!(
        (
            st.group_creates,
            st.group_releases,
            st.access_failures,
            st.reserved
        ),
        (1, 1, 1, 0),
        "{st:?}"
    );
    assert_eq!(phys.live().0, 0, "no handle left");
    // The access call and the unmap fail: the group stays mapped, lost.
    phys.fail_next(PhysOp::SetAccess, 1);
    phys.fail_next(PhysOp::Unmap, 1);
    assert!(h.alloc(&b, 16 * MIB, &s).is_err());
    let lost = phys.mappings();
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0].1, 16 * MIB, "the whole group");
    let y = h.alloc(&b, 16 * MIB, &s).unwrap();
    assert!(y >= lost[0].0 + 16 * MIB as u64, "placed past the lost group");
    assert!(phys.use_block(y, 16 * MIB, &s));
    assert_eq!(phys.violations(), 0);
    free(&h, &b, y, &s);
    h.trim_to(&b, 0);
    assert_eq!(phys.mappings(), lost);
    assert_eq!(phys.violations(), 0);
}

#[test]
fn a_failed_group_create_falls_back_to_one_handle_per_chunk() {
    let (h, b, phys) = heap(usize::MAX, TUNING, Some(2));
    let s = FakeStream::new();
    phys.fail_next(PhysOp::Create, 1);
    let a = h.alloc(&b, 16 * MIB, &s).unwrap();
    let st = h.stats();
    assert_eq!(
        (st.group_creates, st.creates, st.maps, st.accesses),
        (0, 4, 4, 1),
        "{st:?}"
    );
    assert!(phys.use_block(a, 16 * MIB, &s));
    free(&h, &b, a, &s);
    trim_clean(&h, &b, &phys);
}

#[test]
fn a_paged_backend_releases_each_group_handle_once_at_drop() {
    let phys = FakePhys::new(GRANULE, usize::MAX);
    let b = FakeBackend::paged(u64::MAX, phys.clone(), GRANULE, TUNING);
    let s = FakeStream::new();
    let a = b.alloc(256 * MIB, &s).unwrap();
    assert!(phys.use_block(a, 256 * MIB, &s));
    assert_eq!(b.pages.as_ref().unwrap().stats().group_creates, 1);
    // SAFETY: allocated above, its use on s.
    unsafe { b.free(a, 256 * MIB, &s) };
    drop(b); // waits for the marks on the host, unmaps, releases
    assert_eq!(phys.live(), (0, 0, 0, 0));
    assert_eq!(phys.violations(), 0, "released once, unmapped whole");
}

#[test]
fn the_fake_physical_memory_catches_a_group_unmapped_or_mapped_in_part() {
    // Negative control of the checks the tests above rely on.
    let phys = FakePhys::new(GRANULE, usize::MAX);
    let h = phys.create(4 * CHUNK).unwrap();
    let v = phys.reserve(8 * CHUNK).unwrap();
    // SAFETY: the fake only keeps books.
    unsafe {
        phys.map(v, 4 * CHUNK, h).unwrap();
        phys.set_access(v, 4 * CHUNK, &[]).unwrap();
    }
    assert_eq!(phys.violations(), 0);
    // SAFETY: as above.
    unsafe { phys.set_access(v + CHUNK as u64, CHUNK, &[]).unwrap() };
    assert_eq!(phys.violations(), 1, "access over part of a mapping");
    // SAFETY: as above.
    unsafe { phys.map(v + (4 * CHUNK) as u64, CHUNK, h).unwrap() };
    assert_eq!(phys.violations(), 2, "a group's handle mapped as one chunk");
    // SAFETY: as above.
    unsafe { phys.unmap(v, CHUNK).unwrap() };
    assert_eq!(phys.violations(), 3, "a group unmapped in part");
}
