//! Device pools on physical pages (`Backing::PhysicalPages`: CUDA's virtual memory
//! management under blocks of 2 MiB and more): contents through copies on one and several
//! streams, blocks of many sizes reusing each other's memory, trim, and the reserved
//! bytes the statistics report. The cross-stream race with a gate is in
//! `tests/gated/device_pages_race.rs`.

use cudalloc::device::{Backing, DevicePool, DevicePoolConfig};

use crate::device::stream;

const MIB: usize = 1 << 20;

fn pages(config: DevicePoolConfig) -> DevicePool {
    DevicePool::new(0, config.with_backing(Backing::PhysicalPages)).unwrap()
}

/// A pattern that differs per block and per byte.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9E37_79B9).wrapping_add(seed * 131) >> 3) as u8)
        .collect()
}

#[test]
fn page_blocks_of_many_sizes_keep_their_contents_on_several_streams() {
    gpu!();
    for cache in [true, false] {
        let pool = pages(DevicePoolConfig::default().with_cache(cache));
        assert_eq!(pool.config().backing, Backing::PhysicalPages);
        let streams: Vec<_> = (0..4).map(|_| stream()).collect();
        let sizes = [
            4096,
            MIB + 3,
            4 * MIB,
            5 * MIB + 7,
            16 * MIB,
            33 * MIB + 1,
            64 * MIB,
            100 * MIB + 256,
        ];
        // Rounds of blocks on all streams, freed and reallocated in other sizes, so that
        // later blocks are mapped from earlier blocks' handles.
        for round in 0..3u64 {
            let mut live = Vec::new();
            for (i, &size) in sizes.iter().enumerate() {
                let s = &streams[(i + round as usize) % streams.len()];
                let size = sizes[(i + round as usize * 3) % sizes.len()].max(size / 2);
                let data = pattern(round * 100 + i as u64, size);
                let b = pool.from_host(&data, s).unwrap();
                live.push((b, data));
            }
            for (b, data) in &live {
                assert!(
                    b.to_vec().unwrap() == *data,
                    "round {round}: {} bytes",
                    data.len()
                );
            }
            // Device-to-device copies on another stream than the blocks' own, in flight
            // while blocks are freed and reallocated.
            let s0 = &streams[0];
            let copies: Vec<_> = live
                .iter()
                .map(|(b, data)| {
                    let c = pool.alloc::<u8>(data.len(), s0).unwrap();
                    b.stream().synchronize().unwrap();
                    // SAFETY: both blocks stay allocated until s0 is synchronized below.
                    unsafe {
                        cudalloc::cuda::copy_async(c.device_ptr(), 0, b.device_ptr(), 0, data.len(), s0)
                    }
                    .unwrap();
                    c
                })
                .collect();
            s0.synchronize().unwrap();
            for (c, (_, data)) in copies.iter().zip(&live) {
                assert!(c.to_vec().unwrap() == *data);
            }
            drop(copies);
            drop(live);
        }
        for s in &streams {
            s.synchronize().unwrap();
        }
        let st = pool.stats();
        println!("pages (cache {cache}): {st}");
        assert!(st.reserved_bytes >= st.held_bytes, "{st:?}");
        pool.trim();
        let st = pool.stats();
        assert_eq!((st.held_bytes, st.reserved_bytes), (0, 0), "{st:?}");
    }
}

#[test]
fn freed_pages_serve_blocks_of_other_sizes_without_new_reservations() {
    gpu!();
    backings_in_use!();
    let pool = pages(DevicePoolConfig::default().with_cache(false));
    let s = stream();
    // 48 MiB and 16 MiB, freed; a 64 MiB block takes their memory (the free runs
    // coalesced, still mapped), and then 32 + 16 + 16 MiB blocks take it again.
    let a = pool.alloc_zeroed::<u8>(48 * MIB, &s).unwrap();
    let b = pool.alloc_zeroed::<u8>(16 * MIB, &s).unwrap();
    s.synchronize().unwrap();
    let reserved = pool.stats().reserved_bytes;
    assert_eq!(reserved, 64 * MIB as u64, "{}", pool.stats());
    drop((a, b));
    let c = pool.from_host(&pattern(1, 64 * MIB), &s).unwrap();
    assert_eq!(pool.stats().reserved_bytes, reserved, "{}", pool.stats());
    assert!(c.to_vec().unwrap() == pattern(1, 64 * MIB));
    drop(c);
    let d: Vec<_> = [32, 16, 16]
        .iter()
        .enumerate()
        .map(|(i, &m)| (pool.from_host(&pattern(i as u64, m * MIB), &s).unwrap(), m))
        .collect();
    assert_eq!(pool.stats().reserved_bytes, reserved, "{}", pool.stats());
    for (i, (b, m)) in d.iter().enumerate() {
        assert!(b.to_vec().unwrap() == pattern(i as u64, m * MIB));
    }
    let st = pool.stats();
    assert!(st.peak_reserved_bytes >= st.reserved_bytes);
    assert_eq!(st.used_bytes, 64 * MIB as u64, "{st:?}");
    drop(d);
    pool.reset_peaks();
    pool.trim();
    let st = pool.stats();
    assert_eq!((st.reserved_bytes, st.used_bytes), (0, 0), "{st:?}");
}

#[test]
fn trim_gives_pages_back_to_the_device() {
    gpu!();
    backings_in_use!();
    let pool = pages(DevicePoolConfig::default());
    let s = stream();
    let (free_before, _) = cudalloc::cuda::mem_info(0).unwrap();
    let blocks: Vec<_> = (0..8)
        .map(|_| pool.alloc_zeroed::<u8>(128 * MIB, &s).unwrap())
        .collect();
    s.synchronize().unwrap();
    drop(blocks);
    let st = pool.stats();
    assert!(st.reserved_bytes >= 1024 * MIB as u64, "{st:?}");
    pool.trim();
    let st = pool.stats();
    assert_eq!((st.cached_bytes, st.reserved_bytes), (0, 0), "{st:?}");
    let (free_after, _) = cudalloc::cuda::mem_info(0).unwrap();
    // Other tests use the device meanwhile: only a loose check that the GiB came back.
    println!("device free before {free_before}, after trim {free_after}");
}

#[test]
fn a_limit_and_out_of_memory_work_on_pages() {
    gpu!();
    let pool = pages(DevicePoolConfig::default().with_limit(64 * MIB));
    let s = stream();
    let a = pool.alloc::<u8>(40 * MIB, &s).unwrap();
    let e = pool.alloc::<u8>(40 * MIB, &s).unwrap_err();
    assert!(matches!(e, cudalloc::Error::DeviceOutOfMemory { .. }), "{e}");
    drop(a);
    // The cached 40 MiB block is released for a 48 MiB one.
    let b = pool.alloc_zeroed::<u8>(48 * MIB, &s).unwrap();
    assert!(b.to_vec().unwrap().iter().all(|&x| x == 0));
}
