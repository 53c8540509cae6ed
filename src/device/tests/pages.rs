//! The page heap (`pages/`) on the simulated physical memory of `device/fake/`, alone.
//! Invariant: every map, unmap and use of a page is ordered after the uses before it
//! (`FakePhys::violations` stays 0), and a trim after every free leaves no handle, range
//! or mapping.

use super::*;

#[test]
fn page_blocks_reuse_memory_across_sizes_and_wait_for_other_streams() {
    let (h, b, phys) = heap(usize::MAX);
    let (s1, s2) = (FakeStream::new(), FakeStream::new());
    let a = h.alloc(&b, 64 * MIB, &s1).unwrap();
    assert!(phys.use_block(a, 64 * MIB, &s1));
    // SAFETY: a came from h; its use is on s1.
    unsafe { h.free(&b, a, &s1) };
    let st = h.stats();
    assert_eq!(
        (st.creates, st.maps),
        ((64 * MIB / CHUNK) as u64, (64 * MIB / CHUNK) as u64)
    );
    // The freed memory stays mapped: a 64 MiB block on another stream takes it, with no
    // driver call but a wait for s1's mark (s1 has not run).
    let c = h.alloc(&b, 64 * MIB, &s2).unwrap();
    assert_eq!(c, a);
    assert_eq!((h.stats().creates, h.stats().maps), (st.creates, st.maps));
    assert_eq!(h.stats().waits, 1);
    assert!(phys.use_block(c, 64 * MIB, &s2));
    assert_eq!(phys.violations(), 0);
    // SAFETY: as above, on s2.
    unsafe { h.free(&b, c, &s2) };
    // Blocks of other sizes take the same memory, mapping nothing: 48 MiB on s1 (waiting
    // for s2's mark), then 16 MiB on s2 (its own stream's mark, which came after s2
    // waited for s1's: no wait).
    let d = h.alloc(&b, 48 * MIB, &s1).unwrap();
    let e = h.alloc(&b, 16 * MIB, &s2).unwrap();
    assert_eq!((d, e), (a, a + 48 * MIB as u64));
    assert_eq!(
        (h.stats().creates, h.stats().maps, h.stats().waits),
        (st.creates, st.maps, 2)
    );
    assert!(phys.use_block(d, 48 * MIB, &s1));
    assert!(phys.use_block(e, 16 * MIB, &s2));
    assert_eq!(phys.violations(), 0);
    // SAFETY: as above.
    unsafe {
        h.free(&b, d, &s1);
        h.free(&b, e, &s2);
    }
    assert_eq!(h.stats().reserved, 64 * MIB);
    // Trim waits for the marks, unmaps and releases everything.
    trim_clean(&h, &b, &phys);
    assert_eq!(h.stats().reserved, 0);
}

#[test]
fn a_page_heap_gives_a_peer_access_to_present_and_future_blocks() {
    let (h, b, phys) = heap(usize::MAX);
    let s = FakeStream::new();
    // Live blocks in two spans of mapped chunks (a hole of idle memory between them
    // stays mapped), and one freed whose chunks stay idle.
    let a = h.alloc(&b, 16 * MIB, &s).unwrap();
    let gap = h.alloc(&b, 8 * MIB, &s).unwrap();
    let c = h.alloc(&b, 12 * MIB, &s).unwrap();
    // SAFETY: gap came from h; no use.
    unsafe { h.free(&b, gap, &s) };
    assert!(!phys.peer_reaches(a, 16 * MIB, 1));
    assert!(!h.has_peer(1));
    let before = h.stats().accesses;
    h.enable_peer(1).unwrap();
    assert!(h.has_peer(1) && !h.has_peer(2));
    // One access call for the one span of mapped chunks (the idle hole is mapped too).
    assert_eq!(h.stats().accesses, before + 1);
    for (ptr, bytes) in [(a, 16 * MIB), (gap, 8 * MIB), (c, 12 * MIB)] {
        assert!(phys.peer_reaches(ptr, bytes, 1), "{ptr:#x}");
        assert!(!phys.peer_reaches(ptr, bytes, 2));
    }
    // Enabling again changes nothing; a block mapped later includes the peer.
    h.enable_peer(1).unwrap();
    assert_eq!(h.stats().accesses, before + 1);
    let d = h.alloc(&b, 40 * MIB, &s).unwrap();
    assert!(phys.peer_reaches(d, 40 * MIB, 1));
    assert!(phys.use_block(d, 40 * MIB, &s), "the own device keeps its access");
    assert_eq!(phys.violations(), 0);
    // SAFETY: from h, their uses on s.
    unsafe {
        h.free(&b, a, &s);
        h.free(&b, c, &s);
        h.free(&b, d, &s);
    }
    s.complete_all();
    trim_clean(&h, &b, &phys);
}

#[test]
fn a_page_heap_moves_a_pending_chunks_handle_and_orders_its_next_user() {
    // 32 MiB freed on s1 (s1 not run) leaves a hole too small for 40 MiB: the block goes
    // past the live one, and rather than make new memory while a hole as large idles,
    // the heap maps the hole's handles there and makes s2 wait for s1.
    let (h, b, phys) = heap(usize::MAX);
    let (s1, s2) = (FakeStream::new(), FakeStream::new());
    let a = h.alloc(&b, 32 * MIB, &s1).unwrap();
    let keep = h.alloc(&b, 32 * MIB, &s1).unwrap();
    assert!(phys.use_block(a, 32 * MIB, &s1));
    // SAFETY: a came from h; its use is on s1.
    unsafe { h.free(&b, a, &s1) };
    let c = h.alloc(&b, 40 * MIB, &s2).unwrap();
    assert!(c > keep);
    let st = h.stats();
    assert!(st.reserved < 64 * MIB + 40 * MIB, "moved, not made: {st:?}");
    assert!(st.waits >= 1);
    assert!(phys.use_block(c, 40 * MIB, &s2));
    assert_eq!(phys.violations(), 0, "s2 uses the moved handles after s1's work");
    // The old mappings go once s1's work completed; then the hole is free memory again.
    s1.complete_all();
    // SAFETY: c and keep came from h; their uses are on s2 and none.
    unsafe {
        h.free(&b, c, &s2);
        h.free(&b, keep, &s1);
    }
    s1.complete_all();
    s2.complete_all();
    trim_clean(&h, &b, &phys);
}

#[test]
fn the_fake_physical_memory_catches_an_unordered_reuse_and_an_early_unmap() {
    // Negative control of the checker the other tests rely on.
    use crate::device::phys::Phys;
    let phys = FakePhys::new(GRANULE, usize::MAX);
    let (s1, s2) = (FakeStream::new(), FakeStream::new());
    let hd = phys.create(GRANULE).unwrap();
    let (v1, v2) = (phys.reserve(GRANULE).unwrap(), phys.reserve(GRANULE).unwrap());
    // SAFETY: the fake only keeps books.
    unsafe {
        phys.map(v1, GRANULE, hd).unwrap();
        phys.set_access(v1, GRANULE, &[]).unwrap();
        phys.map(v2, GRANULE, hd).unwrap();
        phys.set_access(v2, GRANULE, &[]).unwrap();
    }
    phys.use_block(v1, GRANULE, &s1);
    assert_eq!(phys.violations(), 0);
    phys.use_block(v2, GRANULE, &s2);
    assert_eq!(phys.violations(), 1, "s2 uses the handle unordered after s1");
    // SAFETY: as above.
    unsafe { phys.unmap(v1, GRANULE).unwrap() };
    assert_eq!(phys.violations(), 2, "unmapped before s1's use completed");
}

#[test]
fn a_page_heap_out_of_memory_fails_cleanly_and_serves_once_memory_is_free() {
    let (h, b, phys) = heap(64 * MIB);
    let e = out_of_memory_scenario(h, b, phys);
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
}

#[test]
fn a_page_heap_under_a_pool_limit_moves_memory_and_never_holds_more() {
    // The same at a pool's limit of 64 MiB, with no shortage of physical memory: the
    // heap refuses with LimitExceeded (which the cache's recovery treats as out of
    // memory) rather than make a handle past the limit.
    let (h, b, phys) = heap(usize::MAX);
    let h = h.with_limit(Some(64 * MIB));
    let e = out_of_memory_scenario(h, b, phys);
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e:?}");
}

/// 64 MiB of memory at most (the physical memory's or the heap's limit): a block that
/// needs more fails and changes nothing; freed memory serves, moved if need be. Returns
/// the failure's error.
fn out_of_memory_scenario(h: Heap, b: FakeBackend, phys: FakePhys) -> Error {
    let s = FakeStream::new();
    let s2 = FakeStream::new();
    let a = h.alloc(&b, 32 * MIB, &s).unwrap();
    let keep = h.alloc(&b, 32 * MIB, &s).unwrap();
    assert!(phys.use_block(a, 32 * MIB, &s));
    // SAFETY: a came from h; its use is on s.
    unsafe { h.free(&b, a, &s) };
    // 40 MiB: a's 32 MiB can be moved, 8 MiB more cannot be made.
    let e = h.alloc(&b, 40 * MIB, &s2).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    let st = h.stats();
    assert_eq!((st.reserved, st.block_bytes), (64 * MIB, 32 * MIB), "{st:?}");
    // 32 MiB fits in what was freed, ordered after s's work.
    let c = h.alloc(&b, 32 * MIB, &s2).unwrap();
    assert!(phys.use_block(c, 32 * MIB, &s2));
    assert_eq!(phys.violations(), 0);
    // SAFETY: as above, on s2; keep unused.
    unsafe {
        h.free(&b, c, &s2);
        h.free(&b, keep, &s);
    }
    // Everything free and its work done: 64 MiB in one block.
    s.complete_all();
    s2.complete_all();
    let d = h.alloc(&b, 64 * MIB, &s2).unwrap();
    assert_eq!(h.stats().reserved, 64 * MIB);
    assert!(phys.use_block(d, 64 * MIB, &s2));
    // SAFETY: as above.
    unsafe { h.free(&b, d, &s2) };
    trim_clean(&h, &b, &phys);
    e
}

#[test]
fn a_page_heap_trims_to_what_it_keeps_and_reuses_ranges() {
    let (h, b, phys) = heap(usize::MAX);
    let s = FakeStream::new();
    let blocks: Vec<u64> = (1..=4).map(|i| h.alloc(&b, i * 16 * MIB, &s).unwrap()).collect();
    let reserved = h.stats().reserved;
    assert_eq!(reserved, 160 * MIB);
    for (i, &p) in blocks.iter().enumerate() {
        assert!(phys.use_block(p, (i + 1) * 16 * MIB, &s));
        // SAFETY: each block once, its use on s.
        unsafe { h.free(&b, p, &s) };
    }
    // Keep 100 MiB: idle chunks go until less than that is reserved.
    h.trim_to(&b, 100 * MIB);
    let r = h.stats().reserved;
    assert!(r < 100 * MIB, "{r}");
    assert!(r >= 100 * MIB - CHUNK, "released no more than needed: {r}");
    // One region serves everything: a block reserves no address range.
    let reserves = h.stats().range_reserves;
    let p = h.alloc(&b, 32 * MIB, &s).unwrap();
    assert_eq!(h.stats().range_reserves, reserves);
    // SAFETY: unused block.
    unsafe { h.free(&b, p, &s) };
    drop(h);
    // The heap's owner shuts it down; a bare heap leaks: here it was dropped without, so
    // only check the books of what was released.
    assert_eq!(phys.violations(), 0);
}

#[test]
fn a_paged_fake_backend_gives_everything_back_at_drop() {
    let phys = FakePhys::new(GRANULE, usize::MAX);
    let b = FakeBackend::paged(u64::MAX, phys.clone(), 8 * GRANULE, HEAP_TUNING);
    let s = FakeStream::new();
    use crate::device::backend::Backend;
    let small = b.alloc(MIB, &s).unwrap();
    let big = b.alloc(40 * MIB, &s).unwrap();
    assert!(
        !phys.use_block(small, MIB, &s),
        "small blocks stay on the driver pool"
    );
    assert!(phys.use_block(big, 40 * MIB, &s));
    assert_eq!(b.reserved(), Some(32 * MIB + 40 * MIB));
    // SAFETY: each once, their uses on s.
    unsafe {
        b.free(small, MIB, &s);
        b.free(big, 40 * MIB, &s);
    }
    drop(b); // waits for the marks on the host, unmaps, releases
    assert_eq!(phys.live(), (0, 0, 0, 0));
    assert_eq!(phys.violations(), 0);
}
