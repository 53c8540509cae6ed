//! Typed device buffers from stream-ordered device pools.

use cudalloc::cuda::Stream;
use cudalloc::device::{Backing, DeviceBuffer, DevicePool, DevicePoolConfig};
use cudalloc::Error;

const MIB: usize = 1 << 20;

pub use crate::gpu_support::stream;

#[test]
fn without_a_driver_device_pools_say_so() {
    if cudalloc::cuda::driver_available() {
        assert!(DevicePool::get(0).is_ok());
        assert!(matches!(
            DevicePool::get(cudalloc::cuda::device_count()),
            Err(Error::InvalidArgument(_))
        ));
    } else {
        assert!(matches!(DevicePool::get(0), Err(Error::NoDriver)));
        assert!(matches!(
            DevicePool::new(0, DevicePoolConfig::default()),
            Err(Error::NoDriver)
        ));
    }
}

#[test]
fn buffers_round_trip_bit_exact() {
    gpu!();
    let pool = DevicePool::get(0).unwrap();
    let s = stream();
    let one = pool.from_host(&[0xDEAD_BEEF_u32], &s).unwrap();
    assert_eq!(one.to_vec().unwrap(), [0xDEAD_BEEF]);
    let odd: Vec<u8> = (0..4097u32).map(|i| (i * 7 + 3) as u8).collect();
    let b = pool.from_host(&odd, &s).unwrap();
    assert_eq!((b.len(), b.byte_len()), (4097, 4097));
    assert_eq!(b.to_vec().unwrap(), odd);
    let big: Vec<u64> = (0..(64 * MIB / 8) as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let b = pool.from_host(&big, &s).unwrap();
    assert_eq!(b.byte_len(), 64 * MIB);
    assert!(b.to_vec().unwrap() == big, "64 MiB round trip");
    let pairs: Vec<[f32; 2]> = (0..1000).map(|i| [i as f32, -(i as f32)]).collect();
    assert_eq!(pool.from_host(&pairs, &s).unwrap().to_vec().unwrap(), pairs);
}

#[test]
fn zeroed_buffers_read_zero_even_over_reused_memory() {
    gpu!();
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let s = stream();
    drop(pool.from_host(&vec![0xFFu8; 8 * MIB], &s).unwrap());
    let z = pool.alloc_zeroed::<u8>(8 * MIB, &s).unwrap();
    assert!(z.to_vec().unwrap().iter().all(|&b| b == 0));
}

#[test]
fn freed_memory_is_reused_in_stream_order_without_new_reservations() {
    gpu!();
    backings_in_use!();
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let s = stream();
    let a = pool.alloc::<u8>(16 * MIB, &s).unwrap();
    let reserved = pool.stats().reserved_bytes;
    assert!(reserved >= 16 * MIB as u64);
    drop(a);
    // No synchronization: the next allocation on the same stream reuses the freed block
    // from this thread's cache, without a driver call.
    for _ in 0..100 {
        let b = pool.alloc::<u8>(16 * MIB, &s).unwrap();
        drop(b);
    }
    s.synchronize().unwrap();
    let st = pool.stats();
    println!("{st}");
    assert_eq!(st.reserved_bytes, reserved, "{st:?}");
    assert_eq!((st.misses, st.hits), (1, 100), "{st:?}");
    assert_eq!((st.live_buffers, st.live_bytes), (0, 0), "{st:?}");
    assert_eq!(
        (st.cached_blocks, st.cached_bytes),
        (1, 16 * MIB as u64),
        "{st:?}"
    );
    assert_eq!(st.held_bytes, 16 * MIB as u64);
    assert_eq!(st.events, 0, "same-stream reuse records no event");
    // trim gives it back to the device, and says how much.
    assert_eq!(pool.trim() as u64, reserved, "trim returns the bytes released");
    let st = pool.stats();
    assert_eq!(
        (st.reserved_bytes, st.held_bytes, st.cached_bytes),
        (0, 0, 0),
        "{st:?}"
    );
    assert!(st.per_stream.is_empty(), "trim drops the stream handles: {st:?}");
}

#[test]
fn release_threshold_zero_returns_memory_at_synchronization() {
    gpu!();
    backings_in_use!();
    let pool = DevicePool::new(
        0,
        DevicePoolConfig::default()
            .with_release_threshold(0)
            .with_cache(false)
            .with_backing(Backing::DriverPool),
    )
    .unwrap();
    let s = stream();
    drop(pool.alloc::<u8>(32 * MIB, &s).unwrap());
    s.synchronize().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    pool.set_release_threshold(u64::MAX).unwrap();
    drop(pool.alloc::<u8>(32 * MIB, &s).unwrap());
    s.synchronize().unwrap();
    assert!(pool.stats().reserved_bytes >= 32 * MIB as u64);
}

#[test]
fn bad_requests_fail_cleanly_and_the_pool_goes_on() {
    gpu!();
    let pool = DevicePool::new(0, DevicePoolConfig::default().with_limit(64 * MIB)).unwrap();
    let s = stream();
    // Past the pool's limit; past the device and past the address space (refused before
    // any driver allocation, which could fill the device for everyone while it tries).
    let e = pool.alloc::<u8>(128 * MIB, &s).unwrap_err();
    println!("past the limit: {e}");
    assert!(
        matches!(&e, Error::DeviceOutOfMemory { device: 0, requested, memory } if *requested == 128 * MIB && memory.limit_bytes == Some(64 * MIB as u64)),
        "{e:?}"
    );
    assert!(e.to_string().contains("device 0"), "{e}");
    let (_, total) = cudalloc::cuda::mem_info(0).unwrap();
    assert!(matches!(
        pool.alloc::<u8>(total + 1, &s),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        pool.alloc::<u64>(usize::MAX / 4, &s),
        Err(Error::TooLarge { .. })
    ));
    assert_eq!(pool.stats().failures, 3);
    // Lengths must match; nothing is copied.
    let mut b = pool.alloc_zeroed::<u32>(4, &s).unwrap();
    assert!(matches!(
        b.copy_from_host(&[1, 2, 3]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.copy_to_host(&mut [0; 5]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(b.to_vec().unwrap(), [0; 4]);
    // Empty buffers take nothing from the device.
    let before = pool.stats();
    let e: DeviceBuffer<f64> = pool.alloc(0, &s).unwrap();
    assert!(e.is_empty() && e.device_ptr() == 0);
    assert!(e.to_vec().unwrap().is_empty());
    let after = pool.stats();
    assert_eq!(
        (after.hits, after.misses, after.live_buffers),
        (before.hits, before.misses, before.live_buffers)
    );
    // A stream of another device is refused (when there is one to try).
    if cudalloc::cuda::device_count() > 1 {
        let other = Stream::new(1).unwrap();
        assert!(matches!(
            pool.alloc::<u8>(16, &other),
            Err(Error::InvalidArgument(_))
        ));
    }
    // Still usable up to its limit once its blocks are freed: the limit counts the whole
    // pool (issue 21 item 3), and a small live block keeps a driver-pool chunk (32 MiB on
    // the H200) that a 48 MiB block on pages would have to fit beside.
    drop((b, e));
    let ok = pool.alloc::<u8>(48 * MIB, &s).unwrap();
    assert_eq!(ok.len(), 48 * MIB);
}

#[test]
fn threads_with_their_own_streams_share_a_pool() {
    gpu!();
    // A pool of its own: the process-wide pool and the global drop-error counter are
    // shared with tests running at the same time (fault-injection tests count errors).
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    std::thread::scope(|sc| {
        let threads: Vec<_> = (0..8u32)
            .map(|t| {
                let pool = pool.clone();
                sc.spawn(move || {
                    let s = stream();
                    for round in 0..50u32 {
                        let data: Vec<u32> = (0..(1000 + t * 100 + round))
                            .map(|i| i ^ (t << 24) ^ round)
                            .collect();
                        let buf = pool.from_host(&data, &s).unwrap();
                        assert_eq!(buf.to_vec().unwrap(), data);
                    }
                })
            })
            .collect();
        // An explicit join waits for the thread's exit, its thread-local destructors
        // (which flush its cache into the pool) included; the scope's own join does not.
        for h in threads {
            h.join().unwrap();
        }
    });
    let st = pool.stats();
    println!("{st}");
    // Each thread's sizes cross at most one class boundary: at most two allocations per
    // thread are not hits from its own bin.
    assert!(st.hits >= 8 * 48, "{st:?}");
    assert_eq!((st.failures, st.abandoned_bytes), (0, 0), "{st:?}");
    assert_eq!((st.live_buffers, st.live_bytes), (0, 0), "{st:?}");
    assert_eq!(st.held_bytes, st.cached_bytes + st.pending_bytes, "{st:?}");
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

/// Issue 21, item 3: a pool's limit holds for the pool as a whole (the driver pool for
/// small blocks and the page heap for large ones together). 8 threads, each on its own
/// stream, allocate 1-16 MiB blocks (those under 4 MiB on the driver pool, the rest on
/// pages) and hold at most 3 each, 1500 times each, under a 64 MiB limit. Before the fix
/// each backing was capped alone, and the peak reached 96-128 MiB on the H200.
#[test]
fn a_pool_limit_holds_for_both_backings_together() {
    gpu!();
    const LIMIT: usize = 64 * MIB;
    let pool = DevicePool::new(0, DevicePoolConfig::default().with_limit(LIMIT)).unwrap();
    let limited = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (pool, limited) = (pool.clone(), &limited);
                sc.spawn(move || {
                    let s = stream();
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t << 32);
                    let mut held: Vec<DeviceBuffer<u8>> = Vec::new();
                    for _ in 0..1500 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if held.len() == 3 || (!held.is_empty() && x % 2 == 0) {
                            held.swap_remove((x >> 8) as usize % held.len());
                            continue;
                        }
                        let size = MIB + (x >> 16) as usize % (15 * MIB);
                        match pool.alloc_zeroed::<u8>(size, &s) {
                            Ok(b) => held.push(b),
                            Err(Error::DeviceOutOfMemory { .. } | Error::LimitExceeded { .. }) => {
                                limited.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(e) => panic!("thread {t}: {size} bytes: {e}"),
                        }
                    }
                    drop(held);
                    s.synchronize().unwrap();
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
    });
    let st = pool.stats();
    println!(
        "{st}\nbacking {:?}; {} allocations refused at the limit",
        pool.config().backing,
        limited.into_inner()
    );
    assert!(
        st.peak_reserved_bytes <= LIMIT as u64,
        "peak reserved {} MiB past the 64 MiB limit: {st:?}",
        st.peak_reserved_bytes >> 20
    );
    assert!(st.peak_held_bytes <= LIMIT as u64, "{st:?}");
    assert_eq!(st.abandoned_bytes, 0, "{st:?}");
    assert_eq!((st.live_buffers, st.live_bytes), (0, 0), "{st:?}");
}

/// Issue 21, item 12: leaves cached memory in the process-wide pinned and device pools
/// (no release call) for the library's own release at exit. The proof is a run under the
/// sanitizer with the test harness's exit hook off, which must report no leak:
/// `CUDALLOC_TEST_KEEP_CACHE=1 REQUIRE_GPU=1 compute-sanitizer --leak-check full
/// .gpu/test-all --exact device::cached_memory_left_for_the_release_at_exit`, and with
/// `CUDALLOC_RELEASE_AT_EXIT=0` added, the negative control, must report the cached blocks.
#[test]
fn cached_memory_left_for_the_release_at_exit() {
    gpu!();
    let s = stream();
    let pool = DevicePool::get(0).unwrap();
    let v: allocator_api2::vec::Vec<u8, _> =
        allocator_api2::vec::Vec::with_capacity_in(4 * MIB, cudalloc::PinnedAlloc);
    drop(v);
    drop(pool.alloc_zeroed::<u8>(8 * MIB, &s).unwrap());
    s.synchronize().unwrap();
    let st = pool.stats();
    assert!(st.cached_bytes + st.pending_bytes > 0, "{st:?}");
}

/// Issue 23, item 1: a pool dropped while a worker thread that cached its blocks lives on
/// gives its device memory back at once, not at the worker's exit. The worker allocates
/// 8 GiB in 512 MiB blocks (on the page heap, which keeps freed chunks mapped) and a small
/// block that stays in its bin with a handle of the pool; the last handle's drop on this
/// thread then collects the pool, and the device's free memory rises by the pool's
/// reservation while the worker still lives. (Other tests of this process allocate
/// meanwhile: the bound leaves them 2 GiB.)
#[test]
fn a_dropped_pool_gives_its_device_memory_back_while_its_worker_lives() {
    gpu!();
    backings_in_use!();
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let (used_tx, used_rx) = std::sync::mpsc::channel();
    let (exit_tx, exit_rx) = std::sync::mpsc::channel::<()>();
    let worker = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let s = stream();
            let big: Vec<_> = (0..16)
                .map(|_| pool.alloc::<u8>(512 * MIB, &s).unwrap())
                .collect();
            drop(big);
            drop(pool.alloc::<u8>(4096, &s).unwrap()); // into this thread's bin
            drop(pool.alloc::<u8>(4096, &s).unwrap()); // a hit: the bin holds a handle
            s.synchronize().unwrap();
            drop(pool);
            used_tx.send(()).unwrap();
            exit_rx.recv().ok(); // lives on, as a worker of a thread pool does
        })
    };
    used_rx.recv().unwrap();
    let st = pool.stats();
    assert!(
        st.reserved_bytes >= 8 << 30,
        "the pool reserves the worker's 8 GiB: {st:?}"
    );
    assert_eq!(st.live_buffers, 0, "{st:?}");
    let (before, _) = cudalloc::cuda::mem_info(0).unwrap();
    drop(pool);
    let (after, _) = cudalloc::cuda::mem_info(0).unwrap();
    exit_tx.send(()).unwrap();
    worker.join().unwrap();
    assert!(
        after >= before + (6 << 30),
        "device free memory {} MiB before the drop, {} MiB after, while the worker lived",
        before >> 20,
        after >> 20
    );
}
