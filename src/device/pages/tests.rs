//! The page heap holds no lock across a driver call: with one driver call blocked on the
//! simulated physical memory (`FakePhys::block_next`), other threads allocate and free
//! blocks that fit in mapped memory, and finish. (The heap's other tests are in
//! `device/tests.rs`.)

use std::time::Duration;

use super::PageHeap;
use crate::device::config::PageTuning;
use crate::device::fake::{wait_until, FakeBackend, FakePhys, FakeStream};
use crate::sync::{AtomicBool, Ordering};

const MIB: usize = 1 << 20;
const GRANULE: usize = 2 * MIB;
/// 4 MiB chunks, idle memory up to 1/32 (the heap tests' geometry).
const TUNING: PageTuning = PageTuning::new(4 * MIB, 32);
/// How long the other thread may take at most: it makes no driver call that blocks, so
/// anything near this is a lock held across the blocked call.
const LIMIT: Duration = Duration::from_secs(10);

type Heap = PageHeap<FakePhys, FakeBackend>;

fn heap() -> (Heap, FakeBackend, FakePhys) {
    let phys = FakePhys::new(GRANULE, usize::MAX);
    (
        PageHeap::new(phys.clone(), TUNING),
        FakeBackend::new(u64::MAX),
        phys,
    )
}

/// Runs `blocked` on a thread whose next `op` driver call blocks, and meanwhile, on
/// another thread and stream, allocates and frees 8 MiB blocks (which fit in the mapped
/// free memory the caller left): those must finish while the call is blocked. The gate
/// is opened in any case, so that a failure is a clear message, not a hang.
fn others_finish_while_blocked(
    h: &Heap,
    b: &FakeBackend,
    phys: &FakePhys,
    op: &'static str,
    blocked: impl FnOnce() + Send,
) {
    phys.block_next(op);
    let done = AtomicBool::new(false);
    let (entered, finished) = std::thread::scope(|s| {
        let stuck = s.spawn(blocked);
        let entered = phys.wait_blocked(LIMIT);
        let other = s.spawn(|| {
            let stream = FakeStream::new();
            for _ in 0..8 {
                let p = h.alloc(b, 8 * MIB, &stream).expect("fits in mapped memory");
                assert!(phys.use_block(p, 8 * MIB, &stream));
                // SAFETY: p came from h; its use is on `stream`.
                unsafe { h.free(b, p, &stream) };
            }
            done.store(true, Ordering::SeqCst);
        });
        let finished = wait_until(LIMIT, || done.load(Ordering::SeqCst));
        phys.open_gate();
        other.join().expect("the other thread");
        stuck.join().expect("the blocked thread");
        (entered, finished)
    });
    assert!(entered, "no {op} call was made to block");
    assert!(
        finished,
        "allocations that fit in mapped memory waited for another thread's {op}: \
         the heap held its lock across the driver call"
    );
    assert_eq!(phys.violations(), 0);
}

/// Leaves 16 MiB of mapped free memory at the start of the heap, a live 4 MiB block
/// after it (returned), so that a larger block goes past it and maps.
fn mapped_hole(h: &Heap, b: &FakeBackend, s: &FakeStream) -> u64 {
    let a = h.alloc(b, 16 * MIB, s).unwrap();
    let keep = h.alloc(b, 4 * MIB, s).unwrap();
    assert!(a < keep);
    // SAFETY: a came from h; no use.
    unsafe { h.free(b, a, s) };
    keep
}

/// Frees `keep`, trims to nothing and checks that nothing is left.
fn finish(h: &Heap, b: &FakeBackend, phys: &FakePhys, keep: u64, s: &FakeStream) {
    // SAFETY: keep came from h; no use.
    unsafe { h.free(b, keep, s) };
    s.complete_all();
    h.trim_to(b, 0);
    assert_eq!(phys.live(), (0, 0, 0, 0), "no handle, range or mapping left");
    assert_eq!(phys.violations(), 0);
}

#[test]
fn allocations_in_mapped_memory_finish_while_another_threads_map_is_blocked() {
    let (h, b, phys) = heap();
    let s = FakeStream::new();
    let keep = mapped_hole(&h, &b, &s);
    let maps = h.stats().maps;
    others_finish_while_blocked(&h, &b, &phys, "map", || {
        let p = h.alloc(&b, 200 * MIB, &s).expect("the blocked allocation");
        // SAFETY: p came from h; no use.
        unsafe { h.free(&b, p, &s) };
    });
    assert_eq!(h.stats().maps, maps + (200 * MIB / (4 * MIB)) as u64);
    finish(&h, &b, &phys, keep, &s);
}

#[test]
fn allocations_in_mapped_memory_finish_while_a_creating_allocation_is_blocked() {
    let (h, b, phys) = heap();
    let s = FakeStream::new();
    let keep = mapped_hole(&h, &b, &s);
    others_finish_while_blocked(&h, &b, &phys, "create", || {
        let p = h.alloc(&b, 64 * MIB, &s).expect("the blocked allocation");
        // SAFETY: p came from h; no use.
        unsafe { h.free(&b, p, &s) };
    });
    finish(&h, &b, &phys, keep, &s);
}

#[test]
fn allocations_in_mapped_memory_finish_while_a_trims_unmap_is_blocked() {
    let (h, b, phys) = heap();
    let s = FakeStream::new();
    let keep = mapped_hole(&h, &b, &s);
    // 32 MiB more mapped past the live block, idle: the trim unmaps from there.
    let c = h.alloc(&b, 32 * MIB, &s).unwrap();
    // SAFETY: c came from h; no use.
    unsafe { h.free(&b, c, &s) };
    s.complete_all();
    let reserved = h.stats().reserved;
    others_finish_while_blocked(&h, &b, &phys, "unmap", || h.trim_to(&b, 40 * MIB));
    assert!(h.stats().reserved < 40 * MIB && h.stats().reserved < reserved);
    finish(&h, &b, &phys, keep, &s);
}

#[test]
fn an_allocation_whose_chunk_another_maps_waits_for_that_map_and_is_ordered() {
    // Two allocations share a chunk: the second finds it being mapped by the first
    // (blocked), waits for the publication without the lock, and its block is usable.
    let (h, b, phys) = heap();
    let s = FakeStream::new();
    phys.block_next("map");
    std::thread::scope(|sc| {
        let first = sc.spawn(|| h.alloc(&b, 2 * MIB, &s).expect("first"));
        assert!(phys.wait_blocked(LIMIT), "the first allocation maps");
        let second = sc.spawn(|| h.alloc(&b, 2 * MIB, &s).expect("second"));
        let waiting = !wait_until(Duration::from_millis(50), || second.is_finished());
        phys.open_gate();
        let (p, q) = (first.join().unwrap(), second.join().unwrap());
        assert!(
            waiting,
            "the second block's chunk is not mapped until the first's map is done"
        );
        assert_ne!(p, q);
        for x in [p, q] {
            assert!(phys.use_block(x, 2 * MIB, &s));
            // SAFETY: from h; use on s.
            unsafe { h.free(&b, x, &s) };
        }
    });
    assert_eq!(h.stats().maps, 1, "one chunk, mapped once");
    assert_eq!(phys.violations(), 0);
    s.complete_all();
    h.trim_to(&b, 0);
    assert_eq!(phys.live(), (0, 0, 0, 0));
}
