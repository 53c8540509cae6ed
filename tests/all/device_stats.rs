//! Device pool statistics, the printable report, trim, limits and the out-of-memory path
//! (provoked cheaply with a pool limit; the real GPU is never exhausted).

use cudalloc::device::{DevicePool, DevicePoolConfig};
use cudalloc::Error;

use crate::device::stream;

const MIB: usize = 1 << 20;

#[test]
fn stats_count_live_cached_and_per_stream_bytes_and_trim_empties_the_cache() {
    gpu!();
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let (s, t) = (stream(), stream());
    let live = pool.alloc::<u8>(3 * MIB, &s).unwrap();
    let a: Vec<_> = (0..3).map(|_| pool.alloc::<u8>(MIB, &s).unwrap()).collect();
    let b: Vec<_> = (0..2).map(|_| pool.alloc::<u32>(1000, &t).unwrap()).collect();
    drop((a, b));
    let st = pool.stats();
    println!("{st}");
    assert_eq!((st.live_buffers, st.live_bytes), (1, 3 * MIB as u64), "{st:?}");
    assert_eq!(
        (st.cached_blocks, st.cached_bytes),
        (5, 3 * MIB as u64 + 2 * 4096),
        "{st:?}"
    );
    assert_eq!(st.held_bytes, st.live_bytes + st.cached_bytes + st.pending_bytes);
    assert!(st.reserved_bytes >= st.held_bytes, "{st:?}");
    assert!(st.device_total_bytes > 0 && st.device_free_bytes <= st.device_total_bytes);
    let mut per: Vec<(u64, u64)> = st.per_stream.iter().map(|p| (p.stream, p.bytes)).collect();
    per.sort_unstable();
    let mut want = vec![(s.id().get(), 3 * MIB as u64), (t.id().get(), 8192)];
    want.sort_unstable();
    assert_eq!(per, want);
    let text = st.to_string();
    assert!(
        text.contains("device 0") && text.contains("cached 3.0 MiB in 5 blocks"),
        "{text}"
    );
    let mut again = pool.stats();
    again.device_free_bytes = st.device_free_bytes; // other tests use the device meanwhile
    assert_eq!(again, st, "stats() has no side effect");
    pool.trim();
    let st = pool.stats();
    assert_eq!((st.cached_bytes, st.held_bytes), (0, 3 * MIB as u64), "{st:?}");
    assert!(st.per_stream.is_empty());
    drop(live);
    pool.trim();
    let st = pool.stats();
    assert_eq!((st.held_bytes, st.reserved_bytes), (0, 0), "{st:?}");
}

#[test]
fn the_report_covers_every_device() {
    gpu!();
    let _touch = DevicePool::get(0).unwrap();
    let r = cudalloc::device::report();
    println!("{r}");
    assert_eq!(r.devices.len(), cudalloc::cuda::device_count());
    assert!(r.devices[0].pool.is_some());
    assert!(r.devices[0].total_bytes > 0);
    assert!(r.to_string().contains("device 0"));
}

#[test]
fn out_of_memory_releases_the_cache_then_names_the_device_the_size_and_the_state() {
    gpu!();
    let pool = DevicePool::new(0, DevicePoolConfig::default().with_limit(64 * MIB)).unwrap();
    let (s, t) = (stream(), stream());
    // 32 MiB cached on two streams.
    let blocks: Vec<_> = (0..4)
        .map(|i| {
            pool.alloc::<u8>(8 * MIB, if i % 2 == 0 { &s } else { &t })
                .unwrap()
        })
        .collect();
    drop(blocks);
    assert_eq!(pool.stats().cached_bytes, 32 * MIB as u64);
    // 48 MiB fits only once the cache is given back.
    let big = pool.alloc::<u8>(48 * MIB, &s).unwrap();
    let st = pool.stats();
    println!("after making room: {st}");
    assert!(st.held_bytes <= 64 * MIB as u64, "{st:?}");
    // The limit holds for what the device gives up too (on pages: the heap's handles).
    assert!(st.peak_reserved_bytes <= 64 * MIB as u64, "{st:?}");
    assert!(st.released >= 2, "{st:?}");
    // Now it cannot fit at all.
    let e = pool.alloc::<u8>(40 * MIB, &t).unwrap_err();
    println!("{e}");
    match &e {
        Error::DeviceOutOfMemory {
            device,
            requested,
            memory,
        } => {
            assert_eq!((*device, *requested), (0, 40 * MIB));
            assert_eq!(memory.live_bytes, 48 * MIB as u64);
            assert_eq!(memory.limit_bytes, Some(64 * MIB as u64));
        }
        other => panic!("expected DeviceOutOfMemory, got {other:?}"),
    }
    assert!(e.to_string().contains("device 0"), "{e}");
    assert!(pool.stats().oom_recoveries >= 1);
    assert!(pool.stats().peak_reserved_bytes <= 64 * MIB as u64);
    // The pool goes on.
    drop(big);
    let again = pool.from_host(&vec![7u8; 40 * MIB], &t).unwrap();
    assert!(again.to_vec().unwrap().iter().all(|&b| b == 7));
}

#[test]
fn blocks_above_the_cached_size_are_not_cached() {
    gpu!();
    let pool = DevicePool::new(0, DevicePoolConfig::default().with_max_cached_block(4 * MIB)).unwrap();
    let s = stream();
    // The larger one first: a large allocation gives the thread's large slots back.
    drop(pool.alloc::<u8>(4 * MIB + 1, &s).unwrap());
    drop(pool.alloc::<u8>(4 * MIB, &s).unwrap());
    let st = pool.stats();
    assert_eq!((st.cached_blocks, st.cached_bytes), (1, 4 * MIB as u64), "{st:?}");
    assert_eq!(st.released, 1, "the larger block went straight back: {st:?}");
}

#[test]
fn a_thread_gives_its_cache_back_when_it_exits() {
    gpu!();
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let s = stream();
    // `join` waits for the thread's locals to be destroyed (a scope may not).
    let (p, st) = (pool.clone(), s.clone());
    // 1 MiB: a block cached by size class (below the page heap's blocks, which are not).
    std::thread::spawn(move || {
        drop(p.alloc::<u8>(MIB, &st).unwrap());
        assert_eq!(p.stats().thread_caches, 1);
    })
    .join()
    .unwrap();
    let st = pool.stats();
    assert_eq!((st.thread_caches, st.cached_bytes), (0, MIB as u64), "{st:?}");
    // This thread takes it from the shared list: same stream, no event.
    let b = pool.alloc::<u8>(MIB, &s).unwrap();
    let st = pool.stats();
    assert_eq!((st.misses, st.events), (1, 0), "{st:?}");
    drop(b);
    // A large block the exiting thread kept for its size goes back to what it came from:
    // on physical pages the heap, whose freed memory this thread's next block takes
    // without reserving more.
    let (p, st) = (pool.clone(), s.clone());
    std::thread::spawn(move || {
        drop(p.alloc::<u8>(24 * MIB, &st).unwrap());
        assert!(p.stats().cached_bytes >= 24 * MIB as u64);
    })
    .join()
    .unwrap();
    let st = pool.stats();
    let reserved = st.reserved_bytes;
    let c = pool.alloc::<u8>(20 * MIB, &s).unwrap();
    // (Under an NVTX tool the pool takes its blocks with cuMemAlloc, not from pages.)
    if pool.config().backing == cudalloc::device::Backing::PhysicalPages && !cudalloc::cuda::nvtx::attached()
    {
        assert!(
            st.cached_bytes <= MIB as u64,
            "the large block left the cache: {st:?}"
        );
        assert_eq!(pool.stats().reserved_bytes, reserved, "reused, not reserved anew");
    }
    drop(c);
}
