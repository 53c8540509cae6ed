//! Device pool conformance: alignment, zero size, huge requests, distinct blocks, and
//! random allocate/free from many threads on many streams with contents checked through
//! copies; for the cached pool and the plain driver pool alike.

use std::sync::{Arc, Mutex};

use cudalloc::cuda::{mem_info, Stream};
use cudalloc::device::{DeviceBuffer, DevicePool, DevicePoolConfig};
use cudalloc::Error;

use crate::device::stream;

const MIB: usize = 1 << 20;

fn pools() -> Vec<(&'static str, DevicePool)> {
    vec![
        ("cached", DevicePool::new(0, DevicePoolConfig::default()).unwrap()),
        (
            "shared lists only",
            DevicePool::new(0, DevicePoolConfig::default().with_thread_cache_bytes(0)).unwrap(),
        ),
        ("uncached", DevicePool::uncached(0).unwrap()),
    ]
}

#[test]
fn blocks_are_aligned_to_256_bytes() {
    gpu!();
    let s = stream();
    let sizes = [
        1,
        2,
        3,
        7,
        255,
        256,
        257,
        1000,
        4095,
        4096,
        4097,
        65_535,
        MIB + 1,
        3 * MIB,
    ];
    for (name, pool) in pools() {
        for round in 0..2 {
            // Round 2 is served from the cache.
            let held: Vec<DeviceBuffer<u8>> =
                sizes.iter().map(|&n| pool.alloc::<u8>(n, &s).unwrap()).collect();
            for b in &held {
                assert_eq!(
                    b.device_ptr() % 256,
                    0,
                    "{name} round {round}: {} bytes at {:#x}",
                    b.len(),
                    b.device_ptr()
                );
            }
        }
        let wide = pool.alloc::<[u64; 7]>(333, &s).unwrap();
        assert_eq!(wide.device_ptr() % 256, 0, "{name}");
        assert_eq!(wide.byte_len(), 333 * 56);
    }
}

#[test]
fn zero_sized_buffers_take_nothing() {
    gpu!();
    let s = stream();
    for (name, pool) in pools() {
        let before = pool.stats();
        let mut e = pool.alloc::<u32>(0, &s).unwrap();
        let z = pool.alloc_zeroed::<f64>(0, &s).unwrap();
        let unit = pool.alloc::<()>(1000, &s).unwrap();
        assert_eq!(
            (e.device_ptr(), z.device_ptr(), unit.device_ptr()),
            (0, 0, 0),
            "{name}"
        );
        assert_eq!(unit.len(), 1000);
        e.copy_from_host(&[]).unwrap();
        assert!(e.to_vec().unwrap().is_empty());
        let mut other = pool.alloc::<u32>(0, &stream()).unwrap();
        other.copy_from_device(&e).unwrap();
        e.record_use(&stream());
        drop((e, z, unit, other));
        let after = pool.stats();
        assert_eq!(
            (after.held_bytes, after.misses, after.hits),
            (before.held_bytes, before.misses, before.hits),
            "{name}"
        );
    }
}

#[test]
fn huge_requests_fail_cleanly_and_the_pool_works_afterwards() {
    gpu!();
    let s = stream();
    let (free, total) = mem_info(0).unwrap();
    for (name, pool) in pools() {
        assert!(
            matches!(pool.alloc::<u8>(total + 1, &s), Err(Error::TooLarge { .. })),
            "{name}"
        );
        assert!(
            matches!(pool.alloc::<u32>(usize::MAX / 2, &s), Err(Error::TooLarge { .. })),
            "{name}"
        );
        // More than is free (the context alone takes more than 1 MiB) but not more than
        // the device: refused before the driver is asked for it, which could fill the
        // device for everyone while it tries.
        let e = pool.alloc::<u8>(total - MIB, &s).unwrap_err();
        println!("{name}: {} bytes with {free} free: {e}", total - MIB);
        assert!(
            matches!(e, Error::DeviceOutOfMemory { device: 0, .. }),
            "{name}: {e:?}"
        );
        let data: Vec<u32> = (0..MIB as u32).collect();
        let b = pool.from_host(&data, &s).unwrap();
        assert_eq!(
            b.to_vec().unwrap(),
            data,
            "{name}: the pool works after the failures"
        );
        let st = pool.stats();
        assert!(st.failures >= 3, "{name}: {st:?}");
        assert_eq!(st.live_buffers, 1, "{name}: {st:?}");
    }
}

#[test]
fn live_blocks_are_distinct() {
    gpu!();
    let (s, t) = (stream(), stream());
    for (name, pool) in pools() {
        let mut held: Vec<DeviceBuffer<u8>> = Vec::new();
        for round in 0..3 {
            for i in 0..600usize {
                let size = 1 + (i * 7919 + round * 104_729) % (96 << 10);
                let st = if i % 2 == 0 { &s } else { &t };
                held.push(pool.alloc::<u8>(size, st).unwrap());
            }
            // Free a third, so later rounds reuse blocks across both streams.
            let mut i = 0;
            held.retain(|_| {
                i += 1;
                i % 3 != 0
            });
        }
        let mut ranges: Vec<(u64, u64)> = held
            .iter()
            .map(|b| (b.device_ptr(), b.device_ptr() + b.byte_len() as u64))
            .collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "{name}: {:#x?} overlaps {:#x?}", w[0], w[1]);
        }
        println!("{name}: {} live blocks distinct; {}", ranges.len(), pool.stats());
    }
}

/// A pattern unique to (thread, op, element).
fn pattern(thread: usize, op: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ ((thread as u32) << 24) ^ (op as u32))
        .collect()
}

/// A buffer with the contents it should hold.
type Checked = (DeviceBuffer<u32>, Vec<u32>);

/// 16 threads allocate, fill (through a copy), check (through a copy back) and free on
/// `n_streams` shared streams; a fifth of the buffers are freed by another thread.
fn random_workload(name: &str, pool: &DevicePool, n_streams: usize) {
    let streams: Arc<Vec<Stream>> = Arc::new((0..n_streams).map(|_| stream()).collect());
    let mailbox: Arc<Mutex<Vec<Checked>>> = Arc::new(Mutex::new(Vec::new()));
    let start = std::time::Instant::now();
    std::thread::scope(|sc| {
        let threads: Vec<_> = (0..16usize)
            .map(|t| {
                let (pool, streams, mailbox) = (pool.clone(), streams.clone(), mailbox.clone());
                sc.spawn(move || {
                    let mut rng = 0x9E37_79B9u64 ^ (t as u64) << 32;
                    let mut next = move |n: usize| {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        (rng % n as u64) as usize
                    };
                    let mut mine: Vec<Checked> = Vec::new();
                    for op in 0..120 {
                        if mine.len() < 8 && next(3) != 0 {
                            let s = &streams[next(streams.len())];
                            let len = 1 + next(64 << 10);
                            let data = pattern(t, op, len);
                            let mut b = pool.alloc::<u32>(len, s).unwrap();
                            b.copy_from_host(&data).unwrap();
                            if next(5) == 0 {
                                mailbox.lock().unwrap().push((b, data));
                            } else {
                                mine.push((b, data));
                            }
                        } else {
                            let item = if next(2) == 0 {
                                mailbox.lock().unwrap().pop()
                            } else if mine.is_empty() {
                                None
                            } else {
                                Some(mine.swap_remove(next(mine.len())))
                            };
                            if let Some((b, data)) = item {
                                assert!(
                                    b.to_vec().unwrap() == data,
                                    "{name}: thread {t} op {op}: contents changed"
                                );
                            }
                        }
                    }
                    for (b, data) in mine {
                        assert!(
                            b.to_vec().unwrap() == data,
                            "{name}: thread {t}: contents changed"
                        );
                    }
                })
            })
            .collect();
        // An explicit join waits for the thread's exit, its thread-local destructors
        // (which flush its cache into the pool) included; the scope's own join does not,
        // and the live count below would race with those flushes.
        for h in threads {
            h.join().unwrap();
        }
    });
    for (b, data) in mailbox.lock().unwrap().drain(..) {
        assert!(b.to_vec().unwrap() == data, "{name}: contents changed");
    }
    let st = pool.stats();
    println!(
        "{name}, {n_streams} streams, 16 threads: {:.0} ms; {} hits, {} driver allocations, {} cross-stream takes",
        start.elapsed().as_secs_f64() * 1e3,
        st.hits,
        st.misses,
        st.steals
    );
    assert_eq!(st.live_buffers, 0, "{name}: {st:?}");
}

#[test]
fn random_allocations_on_many_streams_and_threads_keep_their_contents() {
    gpu!();
    let errors = cudalloc::cuda::drop_errors();
    for n_streams in [1, 2, 4, 8] {
        for (name, pool) in pools() {
            random_workload(name, &pool, n_streams);
        }
    }
    assert_eq!(cudalloc::cuda::drop_errors(), errors);
}

/// A buffer dropped by a thread-local's destructor goes back to its pool, whether the
/// thread's table of caches is still there then (the free's hot path, through the table's
/// pointer) or already destroyed (the slow path, with no thread cache): on the simulated
/// GPU, where the hot path is the real pool's code.
#[test]
fn buffers_dropped_by_thread_local_destructors_go_back_to_the_pool() {
    use std::cell::RefCell;

    use cudalloc::device::sim::{SimBuffer, SimPool, SimStream};

    struct Holder(Option<SimBuffer>);
    thread_local! {
        // Registered before the table (first used first): destroyed after it.
        static BEFORE: RefCell<Holder> = const { RefCell::new(Holder(None)) };
        // Registered after the table: destroyed before it.
        static AFTER: RefCell<Holder> = const { RefCell::new(Holder(None)) };
    }
    let pool = SimPool::new(1 << 20);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let s = SimStream::new();
            BEFORE.with(|_| {});
            // The thread's first allocation makes its cache (and registers the table).
            drop(pool.alloc(4096, &s).unwrap());
            let hits = pool.hits();
            let (a, b) = (pool.alloc(4096, &s).unwrap(), pool.alloc(4096, &s).unwrap());
            assert!(pool.hits() > hits, "the thread's cache served a block");
            BEFORE.with(|h| h.borrow_mut().0 = Some(a));
            AFTER.with(|h| h.borrow_mut().0 = Some(b));
        })
        .join()
        .unwrap();
    });
    let st = pool.stats();
    assert_eq!((st.live_buffers, st.live_bytes), (0, 0), "{st:?}");
    assert_eq!(st.held_bytes, st.cached_bytes + st.pending_bytes, "{st:?}");
    // Both blocks are back where a new allocation finds them.
    let s = SimStream::new();
    let again: Vec<SimBuffer> = (0..3).map(|_| pool.alloc(4096, &s).unwrap()).collect();
    assert_eq!(pool.stats().live_buffers, 3);
    drop(again);
}
