//! The device API's handling of bad and extreme input (a review of 2026-12-06): requests
//! that overflow, exceed the device or hold zero-sized elements; copies with bad ranges;
//! device ordinals out of range; limits of 0, below a granule and above the device;
//! empty buffers in cudarc's copies; a checkpoint made stale by an earlier rewind.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudalloc::cuda::{self, Event, Stream};
use cudalloc::device::{DeviceArena, DevicePool, DevicePoolConfig};
use cudalloc::{copy, Error};

use crate::gpu_support::stream;

const MIB: usize = 1 << 20;

fn fresh_pool() -> DevicePool {
    DevicePool::new(0, DevicePoolConfig::default()).unwrap()
}

/// Found by review (2026-12-06): a checkpoint taken after a position that a later rewind
/// went behind was accepted once the arena had moved past it again, by when the arena
/// may have put a smaller chunk at the checkpoint's chunk index: its offset then lay past
/// that chunk's end, and the next allocation panicked (overflow checks) or handed out an
/// address past the chunk. Now refused, as the host `Arena` refuses a mark whose chunk
/// went. The sequence (MiB; chunks of 4, doubling):
///   alloc 4, 8, 16 -> [c0:4, c1:8, c2:16] at (2, 16)   ; early = (0, 4), late = (2, 16)
///   rewind(early); alloc 10 -> c2 swapped to index 1; alloc 7 -> c1 at index 2;
///   alloc 2 -> a new chunk at index 3; rewind(late) names (2, 16) in the 8 MiB c1.
#[test]
fn an_arena_checkpoint_behind_an_earlier_rewind_is_refused_once_its_chunk_moved() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = fresh_pool();
    let s = stream();
    let mut arena = DeviceArena::with_chunk_size(&pool, &s, 4 * MIB).unwrap();

    let c0 = arena.alloc::<u8>(4 * MIB).unwrap().device_ptr();
    let early = arena.checkpoint();
    let c1 = arena.alloc::<u8>(8 * MIB).unwrap().device_ptr();
    let c2 = arena.alloc::<u8>(16 * MIB).unwrap().device_ptr();
    let late = arena.checkpoint();
    assert_eq!(arena.stats().chunks, 3);

    arena.rewind(early).unwrap();
    let p10 = arena.alloc::<u8>(10 * MIB).unwrap().device_ptr();
    assert_eq!(p10, c2, "the 16 MiB spare was moved to index 1");
    let p7 = arena.alloc::<u8>(7 * MIB).unwrap().device_ptr();
    assert_eq!(p7, c1, "the 8 MiB spare is now at index 2");
    let c3 = arena.alloc::<u8>(2 * MIB).unwrap().device_ptr();
    assert_eq!(arena.stats().chunks, 4);
    let chunks = [(c0, 4 * MIB), (c1, 8 * MIB), (c2, 16 * MIB), (c3, 32 * MIB)];

    // `late` points at offset 16 MiB of chunk index 2, which now is the 8 MiB chunk.
    let rewound = arena.rewind(late);
    println!(
        "rewind(stale checkpoint) = {rewound:?}; stats {:?}",
        arena.stats()
    );
    let next = catch_unwind(AssertUnwindSafe(|| {
        arena.alloc::<u8>(1).map(|slice| slice.device_ptr())
    }));
    let ptr = match next {
        Err(_) => panic!(
            "DeviceArena::alloc panicked after rewind to a stale checkpoint was accepted \
             ({rewound:?}): offset past the end of the current chunk (arena.rs:235)"
        ),
        Ok(r) => r.unwrap(),
    };
    assert!(
        chunks
            .iter()
            .any(|&(base, len)| ptr >= base && ptr + 256 <= base + len as u64),
        "the arena handed out {ptr:#x}, outside all of its chunks {chunks:#x?}"
    );
    assert!(
        matches!(rewound, Err(Error::InvalidArgument(_))),
        "a checkpoint that an earlier rewind went back behind is stale and must be refused, got {rewound:?}"
    );
}

/// Found by review (2026-12-06): `cuda::device_name` (src/cuda/driver.rs:225) converts the ordinal
/// with `ordinal as i32` instead of the `ordinal_i32` check every other entry point uses
/// (driver.rs:199), and does not check it against `device_count()` as `bind` does: an
/// ordinal of 2^32 truncates to 0 and returns device 0's name instead of an error.
#[test]
fn device_name_of_an_ordinal_out_of_range_is_an_error() {
    gpu!();
    let _one = crate::one_at_a_time();
    assert!(cuda::device_name(99).is_err());
    assert!(cuda::device_name(usize::MAX).is_err(), "-1 as i32");
    #[cfg(target_pointer_width = "64")]
    {
        let wrapped = cuda::device_name(1usize << 32);
        assert!(
            wrapped.is_err(),
            "device_name(2^32) answered {wrapped:?}: the ordinal was truncated to device 0"
        );
    }
}

/// overflowing, huge, zero-sized and zero-length requests get
/// errors or empty buffers, never a panic, and take nothing.
#[test]
fn extreme_sizes_are_errors_or_empty_buffers_and_hold_nothing() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = fresh_pool();
    let s = stream();
    let live = pool.stats().live_bytes;

    // len * size_of::<T>() overflows.
    for r in [
        pool.alloc::<u64>(usize::MAX / 4, &s).map(|b| b.len()),
        pool.alloc::<u64>(usize::MAX / 8 + 1, &s).map(|b| b.len()),
        pool.alloc_zeroed::<u64>(usize::MAX / 4, &s).map(|b| b.len()),
        pool.alloc::<[u8; 4096]>(usize::MAX / 2048, &s).map(|b| b.len()),
    ] {
        assert!(matches!(r, Err(Error::TooLarge { .. })), "{r:?}");
    }
    // More than the device holds, without overflow.
    for bytes in [usize::MAX, usize::MAX - 255, 1 << 50] {
        let r = pool.alloc::<u8>(bytes, &s);
        assert!(matches!(r, Err(Error::TooLarge { .. })), "{bytes}: {r:?}");
    }
    // Zero-sized elements and zero lengths.
    let unit = pool.alloc::<()>(usize::MAX, &s).unwrap();
    assert_eq!(
        (unit.len(), unit.byte_len(), unit.device_ptr()),
        (usize::MAX, 0, 0)
    );
    let units = pool.alloc_zeroed::<()>(10, &s).unwrap();
    assert_eq!(units.to_vec().unwrap().len(), 10);
    let mut empty = pool.alloc::<u32>(0, &s).unwrap();
    assert_eq!(empty.device_ptr(), 0);
    empty.copy_from_host(&[]).unwrap();
    assert!(empty.to_vec().unwrap().is_empty());
    assert!(matches!(
        empty.copy_from_host(&[1]),
        Err(Error::InvalidArgument(_))
    ));
    let empty_zeroed = pool.alloc_zeroed::<u64>(0, &s).unwrap();
    assert!(empty_zeroed.to_vec().unwrap().is_empty());
    drop((unit, units, empty, empty_zeroed));
    s.synchronize().unwrap();
    assert_eq!(
        pool.stats().live_bytes,
        live,
        "failed and empty requests hold nothing"
    );

    // Arena: overflow and huge requests are errors, zero-sized ones empty slices.
    let arena = DeviceArena::new(&pool, &s).unwrap();
    assert!(matches!(
        arena.alloc::<u64>(usize::MAX / 4),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        arena.alloc::<u8>(usize::MAX),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        arena.alloc::<u8>(usize::MAX - 255),
        Err(Error::TooLarge { .. })
    ));
    assert!(arena.alloc::<u8>(1 << 50).is_err());
    assert_eq!(arena.alloc::<()>(usize::MAX).unwrap().device_ptr(), 0);
    assert_eq!(arena.stats().chunks, 0, "failed requests took no chunk");
    let tiny = DeviceArena::with_chunk_size(&pool, &s, 0).unwrap();
    assert_ne!(tiny.alloc::<u8>(1).unwrap().device_ptr(), 0);
    let big = DeviceArena::with_chunk_size(&pool, &s, usize::MAX).unwrap();
    drop(big);
}

/// typed copies with bad ranges are refused.
#[test]
fn copies_with_bad_ranges_are_refused() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = fresh_pool();
    let s = stream();
    let mut dev = pool.alloc_zeroed::<u32>(16, &s).unwrap();
    let src = [7u32; 8];
    let mut dst = [0u32; 8];
    // SAFETY: every call here is refused before anything is queued, or is synchronized
    // below before `src`/`dst` are touched.
    unsafe {
        for off in [9, 16, 17, usize::MAX, usize::MAX - 7] {
            assert!(
                matches!(
                    copy::host_to_device_async(&src, &mut dev, off),
                    Err(Error::InvalidArgument(_))
                ),
                "{off}"
            );
            assert!(
                matches!(
                    copy::device_to_host_async(&dev, off, &mut dst),
                    Err(Error::InvalidArgument(_))
                ),
                "{off}"
            );
        }
        // An empty copy at the very end is fine, one past it is not.
        copy::host_to_device_async(&[], &mut dev, 16).unwrap();
        assert!(copy::host_to_device_async(&[], &mut dev, 17).is_err());
        assert!(copy::device_to_host_async(&dev, usize::MAX, &mut []).is_err());
        copy::host_to_device_async(&src, &mut dev, 8).unwrap();
        copy::device_to_host_async(&dev, 8, &mut dst).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(dst, src);
    // Whole-buffer copies need equal lengths.
    assert!(dev.copy_from_host(&[1; 15]).is_err());
    assert!(dev.copy_to_host(&mut [0; 17]).is_err());
    let other = pool.alloc::<u32>(15, &s).unwrap();
    assert!(matches!(
        dev.copy_from_device(&other),
        Err(Error::InvalidArgument(_))
    ));
    let mut e1 = pool.alloc::<u32>(0, &s).unwrap();
    let e2 = pool.alloc::<u32>(0, &s).unwrap();
    e1.copy_from_device(&e2).unwrap();
    // Zero-sized element types.
    let mut units = pool.alloc::<()>(4, &s).unwrap();
    // SAFETY: nothing is queued for zero bytes.
    unsafe { copy::host_to_device_async(&[(); 2], &mut units, 2) }.unwrap();
    // SAFETY: as above.
    assert!(unsafe { copy::host_to_device_async(&[(); 2], &mut units, 3) }.is_err());
    assert_eq!(dev.to_vec().unwrap()[8..], src);
}

/// ordinals out of range are errors everywhere.
#[test]
fn device_ordinals_out_of_range_are_errors_everywhere() {
    gpu!();
    let _one = crate::one_at_a_time();
    let n = cuda::device_count();
    for d in [n, 99, 1 << 31, usize::MAX] {
        assert!(
            matches!(DevicePool::get(d), Err(Error::InvalidArgument(_))),
            "{d}"
        );
        assert!(DevicePool::new(d, DevicePoolConfig::default()).is_err(), "{d}");
        assert!(DevicePool::uncached(d).is_err(), "{d}");
        assert!(Stream::new(d).is_err(), "{d}");
        assert!(Event::new(d).is_err(), "{d}");
        assert!(cuda::mem_info(d).is_err(), "{d}");
        assert!(cuda::can_access_peer(0, d).is_err(), "{d}");
        assert!(cuda::can_access_peer(d, 0).is_err(), "{d}");
        let pool = DevicePool::get(0).unwrap();
        assert!(pool.enable_peer_access(d).is_err(), "{d}");
        // Either an error or "no access"; never a panic and never "yes".
        assert!(!pool.peer_access(d).unwrap_or(false), "{d}");
    }
}

/// Limits of 0, below one granule, and above the device's memory. A limit of 0 or 100
/// bytes refuses every nonzero request with an error (never a panic); a limit of
/// `usize::MAX` or 1 TiB (more than any device) caps nothing: the pool is made and
/// serves (the driver pool's own cap is then the driver's default).
#[test]
fn limits_of_zero_below_a_granule_and_above_the_device_work() {
    gpu!();
    let _one = crate::one_at_a_time();
    let s = stream();
    for limit in [0, 1, 100, 255] {
        let made = DevicePool::new(0, DevicePoolConfig::default().with_limit(limit));
        println!("limit {limit}: {made:?}");
        let Ok(pool) = made else { continue };
        let r = pool.alloc::<u8>(1, &s);
        assert!(
            r.is_err(),
            "limit {limit}: a 1-byte block (256 B class) fit: {r:?}"
        );
        assert!(pool.alloc::<u8>(0, &s).is_ok());
        assert_eq!(pool.stats().live_bytes, 0);
    }
    for limit in [usize::MAX, 1 << 40] {
        let made = DevicePool::new(0, DevicePoolConfig::default().with_limit(limit));
        let pool = made.unwrap_or_else(|e| panic!("limit {limit}: {e}"));
        let b = pool.alloc::<u8>(MIB, &s).unwrap();
        assert_eq!(b.len(), MIB);
    }
}

/// (Needs 2 GPUs.) a stream of another device is refused for
/// every size, also on a pool whose thread cache is warm.
#[test]
fn a_stream_of_another_device_is_refused_for_every_size() {
    gpu!();
    let _one = crate::one_at_a_time();
    if cuda::device_count() < 2 {
        println!("skipped: needs 2 devices");
        return;
    }
    let pool = fresh_pool();
    let (s0, s1) = (Stream::new(0).unwrap(), Stream::new(1).unwrap());
    drop(pool.alloc::<u8>(4096, &s0).unwrap()); // warm bin for (s0, 4 KiB)
    for len in [0, 1, 4096, 64 * MIB] {
        let r = pool.alloc::<u8>(len, &s1);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{len}: {r:?}");
    }
    assert!(DeviceArena::new(&pool, &s1).is_err());
    let e = Event::new(0).unwrap();
    assert!(matches!(e.record(&s1), Err(Error::InvalidArgument(_))));
}

/// an empty `DeviceBuffer` has `device_ptr() == 0`; cudarc's
/// copies pass it to `cuMemcpy*Async` with 0 bytes. If the driver refuses a null device
/// pointer even for 0 bytes, empty buffers cannot be used with cudarc's copies.
#[cfg(feature = "cudarc")]
#[test]
fn empty_buffers_work_in_cudarcs_copies() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = fresh_pool();
    let s = stream();
    let cs = s.cudarc();
    let mut empty = pool.alloc::<u32>(0, &s).unwrap();
    cs.memcpy_htod(&[] as &[u32], &mut empty).unwrap();
    assert!(cs.clone_dtoh(&empty).unwrap().is_empty());
    let mut empty2 = pool.alloc::<u32>(0, &s).unwrap();
    cs.memcpy_dtod(&empty, &mut empty2).unwrap();
    s.synchronize().unwrap();
}
