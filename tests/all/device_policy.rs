//! The device cache's idle allowance on the simulated GPU: a program that repeats keeps
//! its hits (after a warm-up, every allocation is a hit), a small program's reservation
//! stays within the uncached pool's.

use cudalloc::device::sim::{SimBuffer, SimPool, SimStream};

use crate::conformance::Rng;

/// A training-like step, repeated: the forward pass allocates one activation per layer
/// (and a workspace, freed at once), the backward pass allocates each layer's gradient
/// and frees its activation and the gradient of the layer above. Every step requests the
/// same sizes in the same order. Returns the blocks from the backend in each step.
fn training_loop(pool: &SimPool, sizes: &[usize], steps: usize) -> Vec<u64> {
    let s = SimStream::new();
    let n = sizes.len() / 3;
    let (act, work, grad) = (&sizes[..n], &sizes[n..2 * n], &sizes[2 * n..3 * n]);
    let mut per_step = Vec::with_capacity(steps);
    for _ in 0..steps {
        let before = pool.stats().misses;
        let mut acts: Vec<Option<SimBuffer>> = Vec::with_capacity(n);
        for i in 0..n {
            acts.push(Some(pool.alloc(act[i], &s).unwrap()));
            drop(pool.alloc(work[i], &s).unwrap());
        }
        let mut above: Option<SimBuffer> = None;
        for i in (0..n).rev() {
            let g = pool.alloc(grad[i], &s).unwrap();
            acts[i] = None;
            above = Some(g);
        }
        drop(above);
        per_step.push(pool.stats().misses - before);
    }
    per_step
}

/// `n` sizes from 1 KiB to `max`.
fn mixed_sizes(seed: u64, n: usize, max: usize) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| 1024 + rng.below(max - 1024)).collect()
}

#[test]
fn a_training_loop_is_all_hits_after_its_first_steps() {
    // 150 tensors of mixed sizes per step, below 1.9 MiB (cached by class on pages too)
    // and below 256 KiB. With the fixed 64 MiB floor every step after the first was all
    // hits; the learned allowance takes one more step.
    for (seed, max) in [(1, 1900 << 10), (2, 256 << 10)] {
        let sizes = mixed_sizes(seed, 150, max);
        let pools = [
            ("pages", SimPool::paged(256 << 20)),
            ("driver pool", SimPool::new(256 << 20)),
        ];
        for (name, pool) in pools {
            let misses = training_loop(&pool, &sizes, 1000);
            assert!(
                misses[2..].iter().all(|&m| m == 0),
                "{name}, sizes up to {max}: {:?}",
                &misses[..10]
            );
            let (regrets, cold) = pool.class_misses();
            assert_eq!(
                regrets + cold,
                misses.iter().sum::<u64>(),
                "{name}: every miss is of a class"
            );
        }
    }
}

/// A small program (as the host trace `traces/soak_host.csv`): 5000 allocations of sizes
/// from 64 B to 1 MiB, at most two live at once. Returns its peak reservation.
fn small_program(pool: &SimPool) -> u64 {
    let s = SimStream::new();
    let mut rng = Rng::new(7);
    let mut live: Vec<SimBuffer> = Vec::new();
    for _ in 0..5000 {
        if live.len() == 2 {
            live.remove(0);
        }
        live.push(pool.alloc(64 + rng.below(1 << 20), &s).unwrap());
    }
    drop(live);
    pool.peak_reserved()
}

#[test]
fn a_small_programs_reservation_stays_within_the_uncached_pools() {
    // With the fixed 64 MiB idle floor the cache kept up to 64 MiB of classes this
    // program had stopped using: 64 MiB reserved on the driver pool where the uncached
    // pool reserved one 32 MiB chunk.
    let pairs = [
        ("driver pool", SimPool::new(256 << 20), SimPool::uncached()),
        ("pages", SimPool::paged(256 << 20), SimPool::paged_uncached()),
    ];
    for (name, cached, uncached) in pairs {
        let (with, without) = (small_program(&cached), small_program(&uncached));
        assert!(
            with <= without,
            "{name}: {} MiB reserved, uncached {} MiB",
            with >> 20,
            without >> 20
        );
        assert!(cached.hits() > 0, "{name}: the cache still serves hits");
    }
}

#[test]
fn the_small_sample_trace_reserves_no_more_than_the_driver_pool_alone() {
    use cudalloc::trace::replay::{self, SimTarget};
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/soak_host.csv");
    let trace = cudalloc::trace::format::read_any(&std::fs::read(path).unwrap(), false)
        .unwrap()
        .trace;
    let opts = Default::default();
    let reserved = |t: SimTarget| replay::replay(&trace, t, &opts).unwrap().peak_reserved.unwrap();
    let (paged, paged_uncached, driver) = (
        reserved(SimTarget::paged(true)),
        reserved(SimTarget::paged(false)),
        reserved(SimTarget::uncached()),
    );
    // Its blocks (up to 2 MiB) all stay under the heap's chunk (16 MiB): they are the
    // heap's early blocks, on the driver pool, so the heap never begins and the pool
    // reserves the driver pool's first step alone (before early blocks: 48 MiB, that
    // step and a chunk of the heap; with the 64 MiB idle floor: 112 MiB).
    assert_eq!(driver, 32 << 20);
    assert!(
        paged <= driver && paged_uncached <= driver,
        "{} MiB, uncached {} MiB, driver pool alone {} MiB",
        paged >> 20,
        paged_uncached >> 20,
        driver >> 20
    );
}

#[test]
fn the_heap_begins_at_its_first_block_of_a_chunk_and_its_early_blocks_go_back_to_the_driver_pool() {
    let pool = SimPool::paged(0);
    let s = SimStream::new();
    let mib = 1 << 20;
    // A small block: the driver pool reserves its first step (32 MiB).
    let small = pool.alloc(64 << 10, &s).unwrap();
    assert_eq!(pool.peak_reserved(), 32 << 20);
    // Blocks of the heap's size (from 2 MiB) under its chunk (16 MiB), up to 16 MiB in
    // all: on the driver pool, which has room for them.
    let early: Vec<SimBuffer> = (0..4).map(|_| pool.alloc(3 * mib, &s).unwrap()).collect();
    assert_eq!(
        pool.peak_reserved(),
        32 << 20,
        "the driver pool's first step alone"
    );
    // A block of a chunk begins the heap; later blocks of the heap's size are its own.
    let big = pool.alloc(16 * mib, &s).unwrap();
    let after = pool.peak_reserved();
    assert!(after >= (32 + 16) << 20, "{} MiB", after >> 20);
    let later = pool.alloc(3 * mib, &s).unwrap();
    assert!(pool.peak_reserved() > after, "a new chunk of the heap");
    // The early blocks go back to the driver pool (the simulated backend checks that each
    // block is freed where it came from, once, with its size), the others to the heap.
    drop(early);
    drop((big, later, small));
    pool.trim();
    assert_eq!(pool.stats().reserved_bytes, 0, "{:?}", pool.stats());
}

#[test]
fn without_small_blocks_the_driver_pool_reserves_nothing_for_the_heaps_blocks() {
    // The driver pool has no room (it reserved nothing): a 3 MiB block begins the heap,
    // which maps one chunk for it, rather than the driver pool's 32 MiB step.
    let pool = SimPool::paged(0);
    let s = SimStream::new();
    let a = pool.alloc(3 << 20, &s).unwrap();
    assert_eq!(pool.peak_reserved(), 16 << 20);
    drop(a);
}

/// Found by an audit (2026-12-07): on the simulated GPU a request near `isize::MAX`
/// aborted the process (the page heap grew its chunk table for the whole range without
/// a fallible reservation), and the driver-pool model handed out blocks that wrapped
/// past the end of the address space. Now every such request fails as a device's does,
/// and the pool goes on.
#[test]
fn huge_requests_on_the_simulated_gpu_fail_and_the_pool_goes_on() {
    let s = SimStream::new();
    for pool in [
        SimPool::new(1 << 20),
        SimPool::uncached(),
        SimPool::paged(1 << 20),
        SimPool::paged_uncached(),
    ] {
        for bytes in [isize::MAX as usize, usize::MAX - 4095, 1 << 50, 1 << 43] {
            assert!(pool.alloc(bytes, &s).is_err(), "{bytes} bytes");
        }
        let live: Vec<SimBuffer> = [1 << 20, 8 << 20, 64 << 20]
            .iter()
            .map(|&b| pool.alloc(b, &s).unwrap())
            .collect();
        let mut ends: Vec<(u64, u64)> = live
            .iter()
            .zip([1u64 << 20, 8 << 20, 64 << 20])
            .map(|(b, n)| (b.device_ptr(), b.device_ptr().checked_add(n).expect("no wrap")))
            .collect();
        ends.sort_unstable();
        assert!(
            ends.windows(2).all(|w| w[0].1 <= w[1].0),
            "distinct blocks: {ends:x?}"
        );
        drop(live);
        assert_eq!(pool.stats().live_buffers, 0);
    }
}
