//! The cache's protocol, one case each: same-stream reuse, cross-stream hand-over after
//! a mark, recorded uses gated until they complete, out of memory, the limit, trim, reclaim
//! requests, eviction and spills. Invariant checked throughout: every hand-over of a block
//! to a stream is ordered after the block's earlier uses (`Tracker`), and held == live +
//! cached + pending (`assert_balanced`).

use super::*;

#[test]
fn settings_round_to_classes() {
    let s = Settings::new(1 << 30, 256 << 20, None);
    assert_eq!(s.max_cached_bytes, 1 << 30);
    assert_eq!(s.limit, usize::MAX);
    assert_eq!(class_size(s.thread_max_class.unwrap()), 256 << 20);
    let s = Settings::new(1000, 100, Some(64));
    assert_eq!(s.max_cached_bytes, 768, "the largest class not above 1000");
    assert_eq!(s.thread_max_class, None, "no class fits in 100 bytes");
    assert_eq!(Settings::new(0, 1 << 20, None).max_cached_bytes, 0);
    assert_eq!(Settings::new(0, 1 << 20, None).thread_max_class, None);
}

#[test]
fn same_stream_reuse_is_a_pop_with_no_mark_and_no_driver_call() {
    let c = cache(u64::MAX, 256 << 20);
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let s = FakeStream::new();
    let mut t = Tracker::default();
    for size in [1, 256, 257, 4096, 1 << 20, 128 << 20] {
        for _ in 0..100 {
            let p = alloc(&c, Some(&mut tc), size, &s).unwrap();
            assert_eq!(p % 256, 0);
            t.handed_out(p, size, &s);
            t.freed(p);
            free(&c, Some(&mut tc), p, size, &s, Vec::new());
        }
    }
    tc.debug_check();
    assert_eq!(t.violations, 0);
    // One block per class; each reused 99 times from the thread's bin.
    assert_eq!(
        c.backend.allocs.load(Ordering::SeqCst),
        5,
        "256 B and 1 B share a class"
    );
    assert_eq!(c.backend.marks.load(Ordering::SeqCst), 0);
    assert_eq!(c.backend.syncs.load(Ordering::SeqCst), 0);
    let snap = c.snapshot();
    assert_eq!(snap.hits, 595);
    assert_eq!(snap.per_stream.len(), 1);
    assert_eq!(snap.cached_blocks, 5);
    assert_balanced(&c, 0);
    c.retire_thread_cache(&mut tc);
    assert_eq!(c.snapshot().thread_caches, 0);
    assert_eq!(c.snapshot().cached_blocks, 5, "flushed to the shared lists");
    c.trim::<()>(None);
    assert_eq!(c.backend.held(), 0);
    assert_eq!(c.backend.live_blocks(), 0);
}

/// A block used on S, freed, then allocated on T: T must be ordered after the use.
fn cross_stream_case(own_thread_cache: bool, guard: bool) -> (usize, u64) {
    let c = cache(u64::MAX, 256 << 20);
    c.set_guard(guard);
    let (s, t) = (FakeStream::new(), FakeStream::new());
    let mut tr = Tracker::default();
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let mut other: Tc = c.new_thread_cache().unwrap();
    for round in 0..10 {
        let size = 1000 + round * 10_000;
        // Freed into this thread's bins of S, or (another thread's) into the shared list.
        let p = alloc(&c, Some(&mut tc), size, &s).unwrap();
        tr.handed_out(p, size, &s);
        tr.freed(p);
        if own_thread_cache {
            free(&c, Some(&mut tc), p, size, &s, Vec::new());
        } else {
            free(&c, Some(&mut other), p, size, &s, Vec::new());
            c.flush_thread(&mut other);
        }
        let q = alloc(&c, Some(&mut tc), size, &t).unwrap();
        assert_eq!(q, p, "T reuses S's block rather than allocating");
        tr.handed_out(q, size, &t);
        tr.freed(q);
        free(&c, Some(&mut tc), q, size, &t, Vec::new());
    }
    c.flush_thread(&mut tc);
    assert_balanced(&c, 0);
    (tr.violations, c.snapshot().events)
}

#[test]
fn another_stream_takes_a_block_only_after_a_mark_it_waits_for() {
    for own in [true, false] {
        let (violations, marks) = cross_stream_case(own, true);
        assert_eq!(violations, 0, "own thread cache: {own}");
        assert_eq!(
            marks, 10,
            "one mark per take, none per free (own thread cache: {own})"
        );
    }
}

#[test]
fn without_the_mark_the_checker_sees_the_race() {
    // Negative control for the tracker itself: the same sequence with marks switched off.
    for own in [true, false] {
        let (violations, marks) = cross_stream_case(own, false);
        assert_eq!(violations, 10, "own thread cache: {own}");
        assert_eq!(marks, 0);
    }
}

#[test]
fn a_steal_takes_a_batch_for_one_mark() {
    let c = cache(u64::MAX, 256 << 20);
    let (s, t) = (FakeStream::new(), FakeStream::new());
    let mut other: Tc = c.new_thread_cache().unwrap();
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let blocks: Vec<u64> = (0..8)
        .map(|_| alloc(&c, Some(&mut other), 4096, &s).unwrap())
        .collect();
    for &p in &blocks {
        free(&c, Some(&mut other), p, 4096, &s, Vec::new());
    }
    c.flush_thread(&mut other);
    let mut got = Vec::new();
    for _ in 0..8 {
        got.push(alloc(&c, Some(&mut tc), 4096, &t).unwrap());
    }
    got.sort_unstable();
    let mut want = blocks.clone();
    want.sort_unstable();
    assert_eq!(got, want, "T reused all of S's blocks");
    let marks = c.backend.marks.load(Ordering::SeqCst);
    assert!(
        marks <= 2,
        "{marks} marks for 8 blocks: batches, not one per block"
    );
    assert_eq!(c.backend.allocs.load(Ordering::SeqCst), 8);
}

#[test]
fn recorded_uses_gate_reuse_until_they_complete() {
    let c = cache(u64::MAX, 256 << 20);
    let (s, u) = (FakeStream::new(), FakeStream::new());
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let mut tr = Tracker::default();
    let p = alloc(&c, Some(&mut tc), 1 << 20, &s).unwrap();
    tr.used_elsewhere(p, 1 << 20, &s, &u);
    free(&c, Some(&mut tc), p, 1 << 20, &s, vec![u.clone()]);
    let snap = c.snapshot();
    assert_eq!((snap.pending_blocks, snap.pending_bytes), (1, 1 << 20));
    assert_eq!(snap.events, 1, "one mark on the using stream, at the free");
    assert_balanced(&c, 0);
    // U has not finished: S gets a new block.
    let q = alloc(&c, Some(&mut tc), 1 << 20, &s).unwrap();
    assert_ne!(q, p);
    tr.handed_out(q, 1 << 20, &s);
    // U finishes; the next slow path moves the block to S's free list, and S reuses it.
    u.complete_all();
    tr.freed(q);
    free(&c, Some(&mut tc), q, 1 << 20, &s, Vec::new());
    let r1 = alloc(&c, Some(&mut tc), 1 << 20, &s).unwrap(); // q, from the thread's bin
    let r2 = alloc(&c, Some(&mut tc), 1 << 20, &s).unwrap(); // a miss: polls, finds p
    assert_eq!((r1, r2), (q, p));
    tr.handed_out(r1, 1 << 20, &s);
    tr.handed_out(r2, 1 << 20, &s);
    assert_eq!(tr.violations, 0);
    assert_eq!(c.snapshot().pending_blocks, 0);
    assert_eq!(c.backend.allocs.load(Ordering::SeqCst), 2);
}

#[test]
fn recorded_uses_switched_off_reuse_at_once() {
    let c = cache(u64::MAX, 0);
    c.set_guard(false);
    let (s, u) = (FakeStream::new(), FakeStream::new());
    let mut tr = Tracker::default();
    let p = alloc(&c, None, 4096, &s).unwrap();
    tr.used_elsewhere(p, 4096, &s, &u);
    free(&c, None, p, 4096, &s, vec![u.clone()]);
    let q = alloc(&c, None, 4096, &s).unwrap();
    assert_eq!(q, p);
    tr.handed_out(q, 4096, &s);
    assert_eq!(tr.violations, 1, "the negative control shows the race");
}

#[test]
fn a_stream_that_cannot_be_marked_is_waited_for_on_the_host() {
    let c = cache(u64::MAX, 0);
    let (s, u) = (FakeStream::new(), FakeStream::new());
    let mut tr = Tracker::default();
    let p = alloc(&c, None, 4096, &s).unwrap();
    tr.used_elsewhere(p, 4096, &s, &u);
    c.backend.fail_marks.store(true, Ordering::SeqCst);
    free(&c, None, p, 4096, &s, vec![u.clone()]);
    assert_eq!(c.backend.syncs.load(Ordering::SeqCst), 1);
    assert_eq!(
        c.snapshot().pending_blocks,
        0,
        "an ordinary free after the host wait"
    );
    // A steal that cannot mark allocates anew instead.
    let t = FakeStream::new();
    let q = alloc(&c, None, 4096, &t).unwrap();
    assert_ne!(q, p);
    assert_eq!(c.snapshot().cached_blocks, 1, "p went back to S's list");
    c.backend.fail_marks.store(false, Ordering::SeqCst);
    let r = alloc(&c, None, 4096, &s).unwrap();
    assert_eq!(r, p);
    tr.handed_out(r, 4096, &s);
    assert_eq!(tr.violations, 0);
}

#[test]
fn blocks_above_the_cached_size_go_straight_to_the_backend() {
    let c = Cache::new(FakeBackend::new(u64::MAX), Settings::new(1 << 20, 1 << 20, None));
    let (s, u) = (FakeStream::new(), FakeStream::new());
    let p = c.alloc_slow::<()>(None, (1 << 20) + 1, &s).unwrap();
    assert_eq!(
        c.backend.held(),
        (1 << 20) + 256,
        "rounded to 256, not to a class"
    );
    c.free_slow::<()>(None, p, (1 << 20) + 1, s.clone(), vec![u.clone()]);
    assert_eq!(c.backend.held(), 0);
    assert_eq!(
        c.snapshot().events,
        1,
        "the home stream waited for the recorded use"
    );
    assert!(s.covers(&u, 1));
}

#[test]
fn uncached_settings_cache_nothing() {
    let c = Cache::new(FakeBackend::new(u64::MAX), Settings::new(0, 0, None));
    let s = FakeStream::new();
    for _ in 0..10 {
        let p = c.alloc_slow::<()>(None, 4096, &s).unwrap();
        c.free_slow::<()>(None, p, 4096, s.clone(), Vec::new());
    }
    assert_eq!(c.backend.allocs.load(Ordering::SeqCst), 10);
    assert_eq!(c.backend.held(), 0);
    assert!(c.new_thread_cache::<()>().is_none());
}

#[test]
fn out_of_memory_releases_the_cache_and_retries_then_fails_cleanly() {
    let c = cache(64 * MIB as u64, 256 << 20);
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let mut other: Tc = c.new_thread_cache().unwrap();
    let (s, t) = (FakeStream::new(), FakeStream::new());
    // 32 MiB cached: half in this thread, half in the shared lists.
    let a: Vec<u64> = (0..2)
        .map(|_| alloc(&c, Some(&mut tc), 8 * MIB, &s).unwrap())
        .collect();
    let b: Vec<u64> = (0..2)
        .map(|_| alloc(&c, Some(&mut other), 8 * MIB, &t).unwrap())
        .collect();
    for p in a {
        free(&c, Some(&mut tc), p, 8 * MIB, &s, Vec::new());
    }
    for p in b {
        free(&c, None, p, 8 * MIB, &t, Vec::new());
    }
    assert_eq!(c.backend.held(), 32 * MIB as u64);
    // 48 MiB fits only once the cache is released (the idle floor keeps it until then).
    let big = alloc(&c, Some(&mut tc), 48 * MIB, &s).unwrap();
    assert_eq!(c.backend.held(), 48 * MIB as u64);
    assert_eq!(c.snapshot().cached_bytes, 0);
    assert_eq!(c.snapshot().oom_recoveries, 1);
    // Now it cannot fit at all: an error, and the cache keeps working.
    let e = alloc(&c, Some(&mut tc), 32 * MIB, &s).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    assert_eq!(c.snapshot().failures, 1);
    free(&c, Some(&mut tc), big, 48 * MIB, &s, Vec::new());
    let p = alloc(&c, Some(&mut tc), 32 * MIB, &s).unwrap();
    free(&c, Some(&mut tc), p, 32 * MIB, &s, Vec::new());
    assert_balanced(&c, 0);
    c.retire_thread_cache(&mut tc);
    c.retire_thread_cache(&mut other);
}

#[test]
fn the_limit_is_a_limit_on_held_bytes() {
    let c = Cache::new(
        FakeBackend::new(u64::MAX),
        Settings::new(1 << 30, 0, Some(16 * MIB)),
    );
    let s = FakeStream::new();
    let a = c.alloc_slow::<()>(None, 10 * MIB, &s).unwrap();
    let e = c.alloc_slow::<()>(None, 10 * MIB, &s).unwrap_err();
    assert!(
        matches!(e, Error::LimitExceeded { limit, .. } if limit == 16 * MIB),
        "{e}"
    );
    c.free_slow::<()>(None, a, 10 * MIB, s.clone(), Vec::new());
    // The cached 10 MiB block is released to make room for a 12 MiB one.
    let b = c.alloc_slow::<()>(None, 12 * MIB, &s).unwrap();
    assert_eq!(c.backend.held(), class_size(class_of(12 * MIB)) as u64);
    c.free_slow::<()>(None, b, 12 * MIB, s.clone(), Vec::new());
}

#[test]
fn out_of_memory_waits_for_gated_blocks() {
    let c = cache(16 * MIB as u64, 0);
    let (s, u) = (FakeStream::new(), FakeStream::new());
    let p = c.alloc_slow::<()>(None, 8 * MIB, &s).unwrap();
    u.enqueue();
    c.free_slow::<()>(None, p, 8 * MIB, s.clone(), vec![u.clone()]);
    assert_eq!(c.snapshot().pending_blocks, 1);
    // 12 MiB fits only once the gated block is released, after its use completed.
    let q = c.alloc_slow::<()>(None, 12 * MIB, &s).unwrap();
    assert_eq!(c.snapshot().pending_blocks, 0);
    assert!(
        s.covers(&u, 1),
        "the host waited for the use before the block went back"
    );
    c.free_slow::<()>(None, q, 12 * MIB, s, Vec::new());
}

#[test]
fn trim_gives_everything_back_and_drops_stream_handles() {
    let c = cache(u64::MAX, 256 << 20);
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let streams: Vec<FakeStream> = (0..3).map(|_| FakeStream::new()).collect();
    let u = FakeStream::new();
    let mut live = Vec::new();
    for (i, s) in streams.iter().enumerate() {
        for k in 0..4 {
            let size = (k + 1) * 4096 * (i + 1);
            let p = alloc(&c, Some(&mut tc), size, s).unwrap();
            live.push((p, size, s.clone()));
        }
    }
    let keep = live.pop().unwrap();
    for (n, (p, size, s)) in live.into_iter().enumerate() {
        let uses = if n == 0 { vec![u.clone()] } else { Vec::new() };
        free(&c, Some(&mut tc), p, size, &s, uses);
    }
    let before = c.snapshot();
    assert_eq!(before.per_stream.len(), 3, "{before:?}");
    assert_eq!(before.pending_blocks, 1);
    let reserved = c.backend.reserved().unwrap();
    let released = c.trim(Some(&mut tc));
    assert_eq!(
        released,
        reserved - c.backend.reserved().unwrap(),
        "trim returns the bytes released"
    );
    let after = c.snapshot();
    assert_eq!((after.cached_bytes, after.pending_bytes), (0, 0), "{after:?}");
    assert!(after.per_stream.is_empty());
    assert_eq!(c.backend.held(), class_size(class_of(keep.1)) as u64);
    // Only the handle of the stream with nothing cached... all of them: keep's block is live.
    for s in &streams {
        assert_eq!(
            Arc::strong_count(&s.lane),
            1 + usize::from(s.id() == keep.2.id()),
            "stream handles dropped"
        );
    }
    free(&c, Some(&mut tc), keep.0, keep.1, &keep.2, Vec::new());
    c.retire_thread_cache(&mut tc);
    let reserved = c.backend.reserved().unwrap();
    assert!(reserved > 0, "the simulated driver pool keeps what it was given");
    assert_eq!(c.trim::<()>(None), reserved, "trim returns the bytes released");
    assert_eq!(c.backend.live_blocks(), 0);
    assert_eq!(c.backend.reserved(), Some(0));
}

#[test]
fn a_reclaim_request_moves_another_threads_blocks_to_the_shared_lists() {
    let c = cache(64 * MIB as u64, 256 << 20);
    let mut mine: Tc = c.new_thread_cache().unwrap();
    let mut theirs: Tc = c.new_thread_cache().unwrap();
    let s = FakeStream::new();
    let p = alloc(&c, Some(&mut theirs), 40 * MIB, &s).unwrap();
    free(&c, Some(&mut theirs), p, 40 * MIB, &s, Vec::new());
    // 40 MiB parked in their cache; 40 more cannot fit: the first attempt fails, and
    // asks them.
    assert!(alloc(&c, Some(&mut mine), 40 * MIB, &s).is_err());
    assert!(theirs.reclaim_requested());
    assert!(
        theirs.pop(s.id(), class_of(40 * MIB)).is_none(),
        "the fast path refuses"
    );
    // Their next operation flushes; then it fits.
    let q = alloc(&c, Some(&mut theirs), 4096, &s).unwrap();
    assert!(!theirs.reclaim_requested());
    let r = alloc(&c, Some(&mut mine), 40 * MIB, &s).unwrap();
    assert_eq!(r, p, "the flushed block, same stream");
    free(&c, Some(&mut mine), r, 40 * MIB, &s, Vec::new());
    free(&c, Some(&mut theirs), q, 4096, &s, Vec::new());
    c.retire_thread_cache(&mut mine);
    c.retire_thread_cache(&mut theirs);
    assert_balanced(&c, 0);
}

#[test]
fn a_ninth_stream_evicts_the_emptiest() {
    let c = cache(u64::MAX, 256 << 20);
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let streams: Vec<FakeStream> = (0..9).map(|_| FakeStream::new()).collect();
    // Allocate everything first (no block to reuse), then free stream by stream.
    let blocks: Vec<Vec<u64>> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = if i == 3 { 1 } else { 2 };
            (0..n)
                .map(|_| alloc(&c, Some(&mut tc), 4096, s).unwrap())
                .collect()
        })
        .collect();
    for (s, bs) in streams.iter().zip(blocks) {
        for p in bs {
            free(&c, Some(&mut tc), p, 4096, s, Vec::new());
        }
    }
    tc.debug_check();
    let snap = c.snapshot();
    // Stream 3 held least when stream 8 came: its block is in the shared lists now.
    assert_eq!(snap.cached_blocks, 17);
    assert_eq!(snap.per_stream.len(), 9);
    let p = alloc(&c, Some(&mut tc), 4096, &streams[3]).unwrap();
    assert_eq!(
        c.backend.marks.load(Ordering::SeqCst),
        0,
        "same stream, from the shared list"
    );
    free(&c, Some(&mut tc), p, 4096, &streams[3], Vec::new());
    c.retire_thread_cache(&mut tc);
    assert_balanced(&c, 0);
}

#[test]
fn a_full_bin_and_a_full_budget_spill_to_the_shared_lists() {
    let c = cache(u64::MAX, 8 * MIB);
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let s = FakeStream::new();
    // 1 MiB blocks: the bin keeps at most one (an eighth of 8 MiB).
    let blocks: Vec<u64> = (0..4)
        .map(|_| alloc(&c, Some(&mut tc), MIB, &s).unwrap())
        .collect();
    for p in blocks {
        free(&c, Some(&mut tc), p, MIB, &s, Vec::new());
    }
    tc.debug_check();
    assert_eq!(tc.bytes(), MIB);
    assert_eq!(c.snapshot().cached_blocks, 4);
    // Fill the budget with other classes, then free another class: the stale ones go.
    let sizes = [600 << 10, 700 << 10, 800 << 10, 900 << 10, 2 * MIB, 3 * MIB];
    let held: Vec<(u64, usize)> = sizes
        .iter()
        .map(|&z| (alloc(&c, Some(&mut tc), z, &s).unwrap(), z))
        .collect();
    for (p, z) in held {
        free(&c, Some(&mut tc), p, z, &s, Vec::new());
    }
    tc.debug_check();
    assert!(tc.bytes() <= 8 * MIB);
    assert!(tc.bytes() >= 3 * MIB, "the last class freed stays in the thread");
    c.retire_thread_cache(&mut tc);
    assert_balanced(&c, 0);
}
