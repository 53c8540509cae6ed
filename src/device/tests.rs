//! CPU tests of the cache's algorithm (`cache.rs`, `thread_cache.rs`) on the simulated
//! GPU of `device/fake/`: every hand-over of a block to a stream is checked against the
//! block's earlier uses on other streams. This file holds what the parts share (the cache
//! of the tests, the `Tracker` of uses, the workload generator, the page heap's fixture);
//! the tests are in `tests/`, one file per part of the algorithm.

mod cache;
mod marks;
mod paged;
mod pages;
mod threads;

use std::collections::HashMap;

use super::backend::Backend;
use super::cache::{Cache, Settings};
use super::fake::{FakeBackend, FakeStream};
use super::order::StreamOrder;
use super::size_class::{class_of, class_size, round_to_granule};
use super::thread_cache::ThreadCache;
use crate::error::Error;
use crate::sync::{lock, Arc, Mutex, Ordering};

const MIB: usize = 1 << 20;

type Tc = ThreadCache<FakeBackend, ()>;

/// A cache whose idle allowance starts at its cap (64 MiB), as if learned: the tests of
/// the lists' mechanics keep their idle blocks across misses (the allowance's own tests
/// are in `cache/idle.rs` and `tests/all/device_policy.rs`).
fn cache(limit: u64, thread_cache_bytes: usize) -> Cache<FakeBackend> {
    let mut settings = Settings::new(1 << 30, thread_cache_bytes, None);
    settings.idle_start = settings.idle_cap;
    Cache::new(FakeBackend::new(limit), settings)
}

/// The uses of each live or cached block since it was last handed out, and the check
/// that a stream receiving a block is ordered after all of them.
#[derive(Default)]
struct Tracker {
    uses: HashMap<u64, Vec<(FakeStream, u64)>>,
    live: HashMap<u64, usize>,
    violations: usize,
    history: HashMap<u64, Vec<String>>,
}

impl Tracker {
    /// A block was handed to `stream`: check it, then record one use on `stream`.
    fn handed_out(&mut self, ptr: u64, bytes: usize, stream: &FakeStream) {
        assert!(
            self.live.insert(ptr, bytes).is_none(),
            "block {ptr:#x} handed out twice"
        );
        for (s, pos) in self.uses.remove(&ptr).unwrap_or_default() {
            if !stream.covers(&s, pos) {
                let h = &self.history[&ptr];
                eprintln!(
                    "unordered: block {ptr:#x} ({bytes} bytes) to {} after a use on {} at {pos} \
                     ({} completed); its last events: {:?}",
                    stream.id(),
                    s.id(),
                    s.completed(),
                    &h[h.len().saturating_sub(8)..]
                );
                self.violations += 1;
            }
        }
        let pos = stream.enqueue();
        self.history
            .entry(ptr)
            .or_default()
            .push(format!("out to {} at {pos}", stream.id()));
        self.uses.insert(ptr, vec![(stream.clone(), pos)]);
    }

    /// Another stream uses the live block (what `record_use` declares).
    fn used_on(&mut self, ptr: u64, stream: &FakeStream) {
        let pos = stream.enqueue();
        self.history
            .entry(ptr)
            .or_default()
            .push(format!("used on {} at {pos}", stream.id()));
        self.uses.entry(ptr).or_default().push((stream.clone(), pos));
    }

    /// The life of a block used on another stream than its own: handed to `stream`,
    /// used on `user`, then freed.
    fn used_elsewhere(&mut self, ptr: u64, bytes: usize, stream: &FakeStream, user: &FakeStream) {
        self.handed_out(ptr, bytes, stream);
        self.used_on(ptr, user);
        self.freed(ptr);
    }

    fn freed(&mut self, ptr: u64) {
        assert!(
            self.live.remove(&ptr).is_some(),
            "block {ptr:#x} freed but not live"
        );
        self.history.entry(ptr).or_default().push("freed".into());
    }
}

/// The full allocation path of a pool (fast, then slow), as `DevicePool` takes it.
fn alloc(
    c: &Cache<FakeBackend>,
    mut tc: Option<&mut Tc>,
    bytes: usize,
    s: &FakeStream,
) -> Result<u64, Error> {
    if let (Some(t), Some(class)) = (tc.as_deref_mut(), c.class_for(bytes)) {
        if let Some((p, _)) = t.pop(s.id(), class) {
            return Ok(p);
        }
    }
    let rounded = round_to_granule(bytes).unwrap_or(bytes);
    if let (Some(t), None, true) = (tc.as_deref_mut(), c.class_for(bytes), c.is_large(rounded)) {
        if let Some((p, _)) = t.pop_large(s.id(), rounded) {
            return Ok(p);
        }
    }
    c.alloc_slow(tc, bytes, s)
}

/// The full free path of a pool (fast, then slow).
fn free(
    c: &Cache<FakeBackend>,
    mut tc: Option<&mut Tc>,
    ptr: u64,
    bytes: usize,
    s: &FakeStream,
    uses: Vec<FakeStream>,
) {
    if uses.is_empty() {
        if let (Some(t), Some(class)) = (tc.as_deref_mut(), c.class_for(bytes)) {
            match t.push::<true>(s.id(), class, ptr, s.clone(), ()) {
                Ok(()) => return,
                Err((stream, ())) => return c.free_slow(tc, ptr, bytes, stream, uses),
            }
        }
        let rounded = round_to_granule(bytes).unwrap_or(bytes);
        if let (Some(t), None, true) = (tc.as_deref_mut(), c.class_for(bytes), c.is_large(rounded)) {
            if t.push_large(s.id(), rounded, ptr, Some((s.clone(), ()))).is_ok() {
                return;
            }
        }
    }
    c.free_slow(tc, ptr, bytes, s.clone(), uses)
}

fn assert_balanced(c: &Cache<FakeBackend>, live_bytes: u64) {
    let s = c.snapshot();
    assert_eq!(
        s.held_bytes,
        live_bytes + s.cached_bytes + s.pending_bytes,
        "held == live + cached + pending: {s:?}"
    );
    assert_eq!(s.held_bytes, c.backend.held(), "the backend agrees: {s:?}");
}

/// A small deterministic generator (xorshift), so that the workloads are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// RMM's `random_allocations` (73% allocations while under `max_usage`, frees of random
/// live blocks otherwise, uniform sizes up to `max_size`), on `streams` streams. Returns
/// (peak bytes requested, peak bytes held, violations).
fn random_workload(
    c: &Cache<FakeBackend>,
    tc: &mut Tc,
    allocations: usize,
    max_size: u64,
    max_usage: u64,
    streams: usize,
) -> (u64, u64, usize) {
    let streams: Vec<FakeStream> = (0..streams).map(|_| FakeStream::new()).collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut tr = Tracker::default();
    let mut live: Vec<(u64, usize, usize)> = Vec::new();
    let (mut requested, mut peak_requested, mut count) = (0u64, 0u64, 0usize);
    for _ in 0..allocations * 2 {
        let size = 1 + rng.below(max_size) as usize;
        let do_alloc = live.is_empty()
            || (rng.below(100) < 73 && count < allocations && requested + size as u64 <= max_usage);
        if do_alloc {
            let si = rng.below(streams.len() as u64) as usize;
            let p = alloc(c, Some(&mut *tc), size, &streams[si]).unwrap();
            tr.handed_out(p, size, &streams[si]);
            if let Some(h) = &c.backend.pages {
                h.phys().use_block(p, size, &streams[si]);
            }
            live.push((p, size, si));
            requested += size as u64;
            peak_requested = peak_requested.max(requested);
            count += 1;
        } else {
            let i = rng.below(live.len() as u64) as usize;
            let (p, size, si) = live.swap_remove(i);
            tr.freed(p);
            free(c, Some(&mut *tc), p, size, &streams[si], Vec::new());
            requested -= size as u64;
        }
        // The GPU keeps up now and then.
        if rng.below(64) == 0 {
            streams.iter().for_each(FakeStream::complete_all);
        }
    }
    for (p, size, si) in live {
        tr.freed(p);
        free(c, Some(&mut *tc), p, size, &streams[si], Vec::new());
    }
    (peak_requested, c.snapshot().peak_held_bytes, tr.violations)
}

/// RMM's random workload (scaled down 16x in usage: 1000 MiB instead of 16000; sizes up
/// to 64 MiB, 4 streams) on a cache over the simulated driver pool: (peak bytes requested,
/// peak bytes held, peak bytes the simulated driver pool reserved).
fn random_reservations() -> (u64, u64, u64) {
    let c = Cache::new(
        FakeBackend::new(u64::MAX),
        Settings::new(1 << 30, 256 << 20, None),
    );
    let mut tc: Tc = c.new_thread_cache().unwrap();
    let (peak_requested, peak_held, violations) =
        random_workload(&c, &mut tc, 20_000, 64 << 20, 16_000 << 20, 4);
    assert_eq!(violations, 0);
    let (_, peak_reserved) = c.backend.reservation();
    let s = c.snapshot();
    println!(
        "random workload: peak requested {} MiB, held / requested {:.3}, reserved / requested \
         {:.3}; {} hits, {} misses, {} steals, {} released, {} trims",
        peak_requested >> 20,
        peak_held as f64 / peak_requested as f64,
        peak_reserved as f64 / peak_requested as f64,
        s.hits,
        s.misses,
        s.steals,
        s.released,
        s.trims
    );
    c.retire_thread_cache(&mut tc);
    assert_balanced(&c, 0);
    c.trim::<()>(None);
    assert_eq!(c.backend.live_blocks(), 0);
    assert_eq!(c.backend.reservation().0, 0, "trim gives every reservation back");
    (peak_requested, peak_held, peak_reserved)
}

// The page heap (`pages/`) on the simulated physical memory of `device/fake/`.

use super::config::PageTuning;
use super::fake::FakePhys;
use super::pages::PageHeap;

const GRANULE: usize = 2 * MIB;

type Heap = PageHeap<FakePhys, FakeBackend>;

/// A page heap over fake physical memory of at most `limit` bytes, one handle per chunk
/// (no groups: `pages/tests.rs` tests those), and a fake backend for its marks.
fn heap(limit: usize) -> (Heap, FakeBackend, FakePhys) {
    let phys = FakePhys::new(GRANULE, limit);
    (
        PageHeap::new(phys.clone(), HEAP_TUNING).with_group_min(usize::MAX),
        FakeBackend::new(u64::MAX),
        phys,
    )
}

/// Trims `h` to nothing (after every block was freed) and checks that no handle, range or
/// mapping is left and that no operation broke the fake's rules.
fn trim_clean(h: &Heap, b: &FakeBackend, phys: &FakePhys) {
    h.trim_to(b, 0);
    assert_eq!(phys.live(), (0, 0, 0, 0), "no handle, range or mapping left");
    assert_eq!(phys.violations(), 0);
}

/// A chunk of the page heap (one handle), in bytes.
/// The heap tests' geometry: 4 MiB chunks, idle memory up to 1/32.
const HEAP_TUNING: PageTuning = PageTuning::new(4 * MIB, 32);
const CHUNK: usize = HEAP_TUNING.chunk_bytes;
