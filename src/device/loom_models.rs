//! Loom models of the device cache's concurrent parts, running the real code of
//! `cache.rs`, `thread_cache.rs` and the page heap against the simulated GPU of `device/fake/`. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib loom`.
//!
//! Each model keeps to two or three threads and a handful of operations. Whenever a block
//! reaches a stream, the model checks that the stream is ordered after the block's last
//! use on another stream (a mark it waits for, or completion): the property a missing or
//! late event (CUB's record-after-publish) would break in some interleaving.

use super::cache::{Cache, Settings};
use super::close;
use super::config::PageTuning;
use super::fake::{FakeBackend, FakePhys, FakeStream};
use super::pages::PageHeap;
use super::thread_cache::ThreadCache;
use crate::sync::{thread, Arc, Ordering};

type Tc = ThreadCache<FakeBackend, ()>;

/// A cache whose idle allowance starts at its cap, as if learned: the models race the
/// lists and the marks, and a miss keeps the idle blocks they count.
fn cache(thread_cache_bytes: usize) -> Arc<Cache<FakeBackend>> {
    let mut settings = Settings::new(1 << 20, thread_cache_bytes, None);
    settings.idle_start = settings.idle_cap;
    Arc::new(Cache::new(FakeBackend::new(u64::MAX), settings))
}

/// A block used on S and freed there races with an allocation on T: T gets it only
/// ordered after the use, or gets another block. (The use is queued by the freeing
/// thread, so a mark recorded before the block was taken would miss it.)
#[test]
fn free_on_one_stream_races_a_take_on_another() {
    loom::model(|| {
        let c = cache(0);
        let (s, t) = (FakeStream::new(), FakeStream::new());
        let p = c.alloc_slow::<()>(None, 4096, &s).unwrap();
        let freer = {
            let (c, s) = (c.clone(), s.clone());
            thread::spawn(move || {
                let used_at = s.enqueue();
                c.free_slow::<()>(None, p, 4096, s, Vec::new());
                used_at
            })
        };
        let taker = {
            let (c, t) = (c.clone(), t.clone());
            thread::spawn(move || c.alloc_slow::<()>(None, 4096, &t).unwrap())
        };
        let used_at = freer.join().unwrap();
        let q = taker.join().unwrap();
        if q == p {
            assert!(t.covers(&s, used_at), "T got S's block unordered after S's use");
        }
        c.free_slow::<()>(None, q, 4096, t.clone(), Vec::new());
        let snap = c.snapshot();
        assert_eq!(snap.held_bytes, snap.cached_bytes, "{snap:?}");
        assert_eq!(c.held_blocks(), if q == p { 1 } else { 2 });
    });
}

/// Two streams race for the one block a third freed: at most one gets it, each ordered.
#[test]
fn two_takers_race_for_one_block() {
    loom::model(|| {
        let c = cache(0);
        let s = FakeStream::new();
        let p = c.alloc_slow::<()>(None, 4096, &s).unwrap();
        let used_at = s.enqueue();
        c.free_slow::<()>(None, p, 4096, s.clone(), Vec::new());
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let (c, s) = (c.clone(), s.clone());
                thread::spawn(move || {
                    let t = FakeStream::new();
                    let q = c.alloc_slow::<()>(None, 4096, &t).unwrap();
                    if q == p {
                        assert!(t.covers(&s, used_at));
                    }
                    (q, t)
                })
            })
            .collect();
        let got: Vec<(u64, FakeStream)> = takers.into_iter().map(|h| h.join().unwrap()).collect();
        assert_ne!(got[0].0, got[1].0, "one block handed to two streams");
        assert!(got.iter().any(|(q, _)| *q == p), "the free block was reused");
        for (q, t) in got {
            c.free_slow::<()>(None, q, 4096, t, Vec::new());
        }
    });
}

/// A thread flushes its cache (as at exit) while another steals from the shared lists:
/// each block goes to one place, ordered.
#[test]
fn a_thread_cache_flush_races_a_steal() {
    loom::model(|| {
        let c = cache(1 << 20);
        let (s, t) = (FakeStream::new(), FakeStream::new());
        let mut owner: Tc = c.new_thread_cache().unwrap();
        let p = c.alloc_slow(Some(&mut owner), 4096, &s).unwrap();
        let used_at = s.enqueue();
        c.free_slow(Some(&mut owner), p, 4096, s.clone(), Vec::new());
        let exiting = {
            let c = c.clone();
            thread::spawn(move || {
                let mut owner = owner;
                c.retire_thread_cache(&mut owner);
            })
        };
        let stealer = {
            let (c, s, t) = (c.clone(), s.clone(), t.clone());
            thread::spawn(move || {
                let q = c.alloc_slow::<()>(None, 4096, &t).unwrap();
                if q == p {
                    assert!(t.covers(&s, used_at));
                }
                q
            })
        };
        exiting.join().unwrap();
        let q = stealer.join().unwrap();
        c.free_slow::<()>(None, q, 4096, t.clone(), Vec::new());
        let snap = c.snapshot();
        assert_eq!(snap.thread_caches, 0);
        assert_eq!(snap.held_bytes, snap.cached_bytes, "{snap:?}");
    });
}

/// A block freed with a recorded use on U is polled by an allocation (after U completed)
/// while another thread trims: it is reused once or freed once, never both, and never
/// before U's work.
#[test]
fn a_gated_block_polled_while_trimmed() {
    loom::model(|| {
        let c = cache(0);
        let (s, u) = (FakeStream::new(), FakeStream::new());
        let p = c.alloc_slow::<()>(None, 4096, &s).unwrap();
        let used_at = u.enqueue();
        c.free_slow::<()>(None, p, 4096, s.clone(), vec![u.clone()]);
        let user = {
            let (c, s, u) = (c.clone(), s.clone(), u.clone());
            thread::spawn(move || {
                let early = c.alloc_slow::<()>(None, 4096, &s).unwrap();
                if early == p {
                    assert!(s.covers(&u, used_at), "reused before the recorded use completed");
                }
                u.complete_all();
                let late = c.alloc_slow::<()>(None, 4096, &s).unwrap();
                if late == p {
                    assert!(s.covers(&u, used_at));
                }
                c.free_slow::<()>(None, early, 4096, s.clone(), Vec::new());
                c.free_slow::<()>(None, late, 4096, s, Vec::new());
            })
        };
        let trimmer = {
            let c = c.clone();
            thread::spawn(move || c.trim::<()>(None))
        };
        user.join().unwrap();
        trimmer.join().unwrap();
        c.trim::<()>(None);
        let snap = c.snapshot();
        assert_eq!((c.held_blocks(), snap.pending_blocks), (0, 0), "{snap:?}");
        assert_eq!(c.backend.live_blocks(), 0);
    });
}

/// A thread's cache, boxed as in its table, sent to the thread that owns it in the model.
struct Owned(*mut Tc);
// SAFETY: the model hands the box to one thread, which alone frees it; the collector
// reaches the cache only through the registry's pointer and the claim protocol.
unsafe impl Send for Owned {}

/// A dropped pool's collection claims a thread's cache while the thread exits
/// (`close.rs`): the owner flushes it or the collector takes it, never both, and an owner
/// whose cache is being taken waits for the claim to end before it frees the cache.
#[test]
fn a_claim_races_the_owners_exit() {
    loom::model(|| {
        let c = cache(1 << 20);
        let s = FakeStream::new();
        let mut owner: Box<Tc> = Box::new(c.new_thread_cache().unwrap());
        let p = c.alloc_slow(Some(&mut owner), 4096, &s).unwrap();
        c.free_slow(Some(&mut owner), p, 4096, s.clone(), Vec::new());
        let stats = owner.stats().clone();
        let at: *mut Tc = &mut *owner;
        stats.cache.store(at.cast(), Ordering::Release);
        let boxed = Owned(Box::into_raw(owner));
        let exiting = {
            let c = c.clone();
            thread::spawn(move || {
                let boxed = boxed;
                // SAFETY: the box made above, freed here once.
                let mut owner = unsafe { Box::from_raw(boxed.0) };
                let flushed = close::exiting(owner.stats());
                flushed.then(|| c.retire_thread_cache(&mut owner));
                assert_eq!(owner.bytes(), 0, "the cache is empty when its owner frees it");
                flushed
            })
        };
        let collector = {
            let (c, stats) = (c.clone(), stats.clone());
            thread::spawn(move || {
                // SAFETY: the model's owner runs no operation on its cache but its exit;
                // the cache is a `Tc`.
                let got = unsafe { close::claim_cache::<FakeBackend, ()>(&stats) };
                let claimed = got.is_some();
                if let Some(evicted) = got {
                    c.give_evicted(evicted);
                }
                claimed
            })
        };
        let flushed = exiting.join().unwrap();
        let claimed = collector.join().unwrap();
        assert!(flushed != claimed, "flushed {flushed}, claimed {claimed}");
        let snap = c.snapshot();
        assert_eq!(
            (snap.cached_blocks, snap.held_bytes),
            (1, 4096),
            "the block went back once: {snap:?}"
        );
        c.trim::<()>(None);
        assert_eq!(c.backend.live_blocks(), 0);
    });
}

/// The end of a page heap model: frees each block on its stream, trims everything and
/// checks the simulated memory (no rule broken, no handle, range or mapping left).
///
/// # Safety
/// 1. Each block is live, freed here once, and its use was queued on the stream given
///    with it.
unsafe fn free_trim_and_check(
    heap: &(PageHeap<FakePhys, FakeBackend>, FakeBackend),
    phys: &FakePhys,
    blocks: &[(u64, &FakeStream)],
) {
    for &(b, s) in blocks {
        // SAFETY: obligation 1.
        unsafe { heap.0.free(&heap.1, b, s) };
    }
    heap.0.trim_to(&heap.1, 0);
    assert_eq!(phys.violations(), 0);
    assert_eq!(phys.live(), (0, 0, 0, 0), "no handle, range or mapping left");
}

/// The page heap lets its lock go across driver calls (`pages/held.rs`): a thread
/// growing the heap (a region, a handle, a map, an access call, each with the lock let
/// go) races an allocation on another stream that may land in the rest of the chunk being
/// mapped, and a free. Every block is mapped with access when used (a block placed in a
/// chunk still waiting for its access call would break that), and ordered after the last
/// use of the memory under it; nothing is left and no rule of the simulated memory is
/// broken at the end.
#[test]
fn a_mapping_races_a_fit_in_its_chunk_and_a_free() {
    const MIB: usize = 1 << 20;
    loom::model(|| {
        let phys = FakePhys::new(2 * MIB, usize::MAX);
        let heap = Arc::new((
            PageHeap::new(phys.clone(), PageTuning::new(4 * MIB, 32)),
            FakeBackend::new(u64::MAX),
        ));
        let (s, t) = (FakeStream::new(), FakeStream::new());
        let x = heap.0.alloc(&heap.1, 4 * MIB, &s).unwrap();
        assert!(phys.use_block(x, 4 * MIB, &s));
        let mapper = {
            let (heap, phys, t) = (heap.clone(), phys.clone(), t.clone());
            thread::spawn(move || {
                // A chunk and a half: the rest of its second chunk stays free.
                let y = heap.0.alloc(&heap.1, 6 * MIB, &t).unwrap();
                assert!(phys.use_block(y, 6 * MIB, &t));
                y
            })
        };
        let z = heap.0.alloc(&heap.1, 2 * MIB, &s).unwrap();
        assert!(phys.use_block(z, 2 * MIB, &s));
        // SAFETY: x is freed once, after its use was queued on s.
        unsafe { heap.0.free(&heap.1, x, &s) };
        let y = mapper.join().unwrap();
        // SAFETY: each block is freed once, after its use was queued on its stream.
        unsafe { free_trim_and_check(&heap, &phys, &[(y, &t), (z, &s)]) };
    });
}

/// A move of a pending chunk (`pages/reclaim.rs`) races a free and a fit: S's five
/// one-chunk blocks are freed with their uses pending (idle chunks over the floor of four)
/// beside a live block of S; T's six-chunk block fits in no mapped run, so it is mapped past
/// the live block and takes an idle chunk's handle, mapped there at once while the old
/// mapping is retired, with the lock let go across every driver call. Meanwhile S frees its
/// live block and takes a one-chunk block (which fits in an idle chunk, unless the mover
/// carved it). Where S frees first, T's block fits in the freed run and takes it across
/// streams instead: both orders are explored. T's use must be ordered after S's uses of the
/// memory it got, no block may land in a carved or retired chunk, and nothing is left at
/// the end.
#[test]
fn a_move_of_a_pending_chunk_races_a_free_and_a_fit() {
    const CHUNK: usize = 2 << 20;
    loom::model(|| {
        let phys = FakePhys::new(CHUNK, usize::MAX);
        let heap = Arc::new((
            PageHeap::new(phys.clone(), PageTuning::new(CHUNK, u32::MAX)),
            FakeBackend::new(u64::MAX),
        ));
        let (s, t) = (FakeStream::new(), FakeStream::new());
        let blocks: Vec<u64> = (0..6)
            .map(|_| heap.0.alloc(&heap.1, CHUNK, &s).unwrap())
            .collect();
        for &b in &blocks {
            assert!(phys.use_block(b, CHUNK, &s));
        }
        for &b in &blocks[..5] {
            // SAFETY: each block is freed once, after its use was queued on s.
            unsafe { heap.0.free(&heap.1, b, &s) };
        }
        let mover = {
            let (heap, phys, t) = (heap.clone(), phys.clone(), t.clone());
            thread::spawn(move || {
                let y = heap.0.alloc(&heap.1, 6 * CHUNK, &t).unwrap();
                assert!(
                    phys.use_block(y, 6 * CHUNK, &t),
                    "T ordered after the moved chunk's uses"
                );
                y
            })
        };
        // SAFETY: the live block is freed once, after its use was queued on s.
        unsafe { heap.0.free(&heap.1, blocks[5], &s) };
        let z = heap.0.alloc(&heap.1, CHUNK, &s).unwrap();
        assert!(phys.use_block(z, CHUNK, &s));
        let y = mover.join().unwrap();
        // SAFETY: each block is freed once, after its use was queued on its stream.
        unsafe { free_trim_and_check(&heap, &phys, &[(y, &t), (z, &s)]) };
    });
}

/// Two allocations from the driver pool under a limit race a reading after a trim; no
/// lock is held across the driver's calls. At every call the pool checks that the limit's
/// tally covers what it reserves: a reading taken before a growth but applied after a
/// newer one that charged the growth must not give the growth's room away. Each growth
/// fills its room exactly (32 MiB for a 1 MiB block), so any room given away shows.
#[test]
fn allocations_under_a_limit_race_a_stale_reading() {
    use super::reserve::growing::Growing;
    use super::reserve::{PoolSide, Reservations};
    use crate::trace::{PoolReservation, Tag};
    const MIB: usize = 1 << 20;
    static TAG: Tag = Tag::new(String::new);
    loom::model(|| {
        let r: &'static Reservations = Box::leak(Box::new(Reservations::new(Some(128 * MIB))));
        let pool: &'static Growing<'static> = Box::leak(Box::new(Growing::new(32 * MIB, Some(r), false)));
        let alloc = move || {
            let growth = PoolReservation::new();
            r.pool_alloc(MIB, pool, &growth, &TAG, 0).unwrap();
        };
        let a = thread::spawn(alloc);
        let b = thread::spawn(alloc);
        r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
        a.join().unwrap();
        b.join().unwrap();
        r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
        let reserved = pool.usage().unwrap().0;
        assert_eq!(r.held(), reserved, "the tally is the driver pool's reservation");
        assert!(r.peak() <= 128 * MIB);
    });
}
