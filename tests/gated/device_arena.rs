//! Device arenas: bump allocation, stream-ordered resets (free on the arena's stream,
//! events for recorded uses on others), checkpoints, slices as copy targets.

use cudalloc::cuda::copy_async;
use cudalloc::device::{DeviceArena, DevicePool, DevicePoolConfig};
use cudalloc::Error;

use crate::gpu_support::{fill, late_write, mismatches, stream, Gate};

const N: usize = 16 << 20;

fn pool() -> DevicePool {
    DevicePool::new(0, DevicePoolConfig::default()).unwrap()
}

#[test]
fn slices_are_aligned_distinct_and_round_trip() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = pool();
    let s = stream();
    let arena = DeviceArena::with_chunk_size(&pool, &s, 1 << 20).unwrap();
    let mut a = arena.alloc::<u8>(3).unwrap();
    let mut b = arena.alloc::<u64>(1000).unwrap();
    let c = arena.alloc_zeroed::<f32>(300_000).unwrap(); // larger than a chunk
    let empty = arena.alloc::<u32>(0).unwrap();
    assert_eq!(empty.device_ptr(), 0);
    for p in [a.device_ptr(), b.device_ptr(), c.device_ptr()] {
        assert_eq!(p % 256, 0);
    }
    assert!(a.device_ptr() + 256 <= b.device_ptr(), "a and b do not overlap");
    a.copy_from_host(&[1, 2, 3]).unwrap();
    let data: Vec<u64> = (0..1000).map(|i| i * i).collect();
    b.copy_from_host(&data).unwrap();
    assert_eq!(a.to_vec().unwrap(), [1, 2, 3]);
    assert_eq!(b.to_vec().unwrap(), data);
    assert!(c.to_vec().unwrap().iter().all(|&x| x == 0.0));
    assert!(matches!(a.copy_from_host(&[1]), Err(Error::InvalidArgument(_))));
    assert_eq!((a.stream(), a.pool().device()), (&s, 0));
    let st = arena.stats();
    println!("{st:?}");
    assert_eq!(st.chunks, 2);
    assert!(st.capacity_bytes >= (1 << 20) + 1_200_000);
}

#[test]
fn a_same_stream_reset_waits_for_nothing_and_reuses_the_memory() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = pool();
    let s = stream();
    let mut arena = DeviceArena::new(&pool, &s).unwrap();
    let mut first = Vec::new();
    for batch in 0..5u8 {
        let mut ptrs = Vec::new();
        for k in 0..4usize {
            let mut x = arena.alloc::<u8>(100_000 * (k + 1)).unwrap();
            x.copy_from_host(&vec![batch ^ k as u8; 100_000 * (k + 1)])
                .unwrap();
            assert_eq!(mismatches(&x.to_vec().unwrap(), batch ^ k as u8), 0);
            ptrs.push(x.device_ptr());
        }
        if batch == 0 {
            first = ptrs;
        } else {
            assert_eq!(ptrs, first, "every batch reuses the same memory");
        }
        arena.reset();
    }
    let st = arena.stats();
    assert_eq!((st.chunks, st.foreign_waits, st.used_bytes), (1, 0, 0), "{st:?}");
    assert_eq!(pool.stats().events, 0, "no event at all");
    assert_eq!(pool.stats().misses, 1, "one chunk from the driver pool, once");
}

/// A slice read on T behind a gate, the arena reset, the memory reused on the arena's
/// stream and overwritten (device operations on both streams, ordered by nothing but the
/// arena's events): returns the bytes T read wrong and whether the arena's stream finished
/// its write before T's read could run.
fn foreign_use_race(guard: bool) -> (usize, bool) {
    let pool = pool();
    let (s, t) = (stream(), stream());
    let mut arena = DeviceArena::new(&pool, &s).unwrap();
    #[cfg(feature = "test-hooks")]
    arena.set_event_guard(guard);
    #[cfg(not(feature = "test-hooks"))]
    assert!(guard, "the negative control needs the test-hooks feature");
    let z = pool.alloc::<u8>(N, &t).unwrap();
    let gate;
    let old = {
        let a = arena.alloc::<u8>(N).unwrap();
        // SAFETY: the slice's memory, on the arena's stream.
        unsafe { fill(a.device_ptr(), 0xAA, N, &s) };
        s.synchronize().unwrap(); // T reads it after this
        gate = Gate::hold(&t);
        // SAFETY: both are N-byte ranges of device 0; the arena is told of the use on `t`
        // below, so its memory is reused only after this copy (with the guard on).
        unsafe { copy_async(z.device_ptr(), 0, a.device_ptr(), 0, N, &t) }.unwrap();
        a.record_use(&t);
        a.device_ptr()
    };
    assert_eq!(arena.stats().foreign_streams, 1);
    arena.reset();
    let b = arena.alloc::<u8>(N).unwrap();
    assert_eq!(b.device_ptr(), old);
    // SAFETY: the slice's memory, on the arena's stream (after the reset's waits).
    let ran_ahead = unsafe { late_write(b.device_ptr(), N, &s, &gate, &t) };
    let bad = mismatches(&z.to_vec().unwrap(), 0xAA);
    println!(
        "arena reset after a use on another stream (event {}): the arena's stream finished \
         before T's read: {ran_ahead}; {bad} of {N} bytes read wrong; {:?}",
        if guard { "on" } else { "off" },
        arena.stats()
    );
    (bad, ran_ahead)
}

#[test]
fn a_reset_after_a_foreign_use_waits_for_it() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (bad, ran_ahead) = foreign_use_race(true);
    assert!(!ran_ahead, "the arena's stream waited for T's read");
    assert_eq!(bad, 0);
}

#[cfg(feature = "test-hooks")]
#[test]
fn without_the_event_a_reset_after_a_foreign_use_corrupts() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (bad, ran_ahead) = foreign_use_race(false);
    assert!(ran_ahead, "nothing held the arena's stream");
    assert_eq!(bad, N, "negative control: every byte read wrong");
}

#[test]
fn dropping_an_arena_orders_its_free_after_foreign_uses() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = pool();
    let (s, t) = (stream(), stream());
    let z = pool.alloc::<u8>(N, &t).unwrap();
    let arena = DeviceArena::with_chunk_size(&pool, &s, N).unwrap();
    let gate;
    let old = {
        let a = arena.alloc::<u8>(N).unwrap();
        // SAFETY: the slice's memory, on the arena's stream.
        unsafe { fill(a.device_ptr(), 0xAA, N, &s) };
        s.synchronize().unwrap();
        gate = Gate::hold(&t);
        // SAFETY: as above; the arena's drop orders the chunk's free after this copy.
        unsafe { copy_async(z.device_ptr(), 0, a.device_ptr(), 0, N, &t) }.unwrap();
        a.record_use(&t);
        a.device_ptr()
    };
    drop(arena);
    // The chunk went back to the pool on S: the next allocation of its size on S gets it.
    let w = pool.alloc::<u8>(N, &s).unwrap();
    assert_eq!(w.device_ptr(), old);
    // SAFETY: w's block, on its own stream (ordered after T's read by the arena's drop).
    let ran_ahead = unsafe { late_write(w.device_ptr(), N, &s, &gate, &t) };
    assert!(!ran_ahead, "S waited for T's read");
    assert_eq!(mismatches(&z.to_vec().unwrap(), 0xAA), 0);
}

#[test]
fn checkpoints_rewind_nested_scratch() {
    gpu!();
    let _one = crate::one_at_a_time();
    let pool = pool();
    let s = stream();
    let mut arena = DeviceArena::with_chunk_size(&pool, &s, 1 << 20).unwrap();
    let keep = arena.alloc::<u32>(1000).unwrap().device_ptr();
    let outer = arena.checkpoint();
    let used = arena.stats().used_bytes;
    let (tmp, big) = {
        let tmp = arena.alloc::<u32>(10_000).unwrap().device_ptr();
        let inner = arena.checkpoint();
        let big = arena.alloc::<u8>(3 << 20).unwrap().device_ptr(); // a chunk of its own
        arena.rewind(inner).unwrap();
        assert_eq!(
            arena.alloc::<u8>(3 << 20).unwrap().device_ptr(),
            big,
            "the chunk is reused"
        );
        (tmp, big)
    };
    assert!(keep < tmp);
    arena.rewind(outer).unwrap();
    assert_eq!(arena.stats().used_bytes, used);
    assert_eq!(arena.alloc::<u32>(10_000).unwrap().device_ptr(), tmp);
    // Invalid checkpoints change nothing.
    let late = arena.checkpoint();
    arena.rewind(outer).unwrap();
    assert!(
        matches!(arena.rewind(late), Err(Error::InvalidArgument(_))),
        "past the position"
    );
    let other = DeviceArena::new(&pool, &s).unwrap();
    assert!(arena.rewind(other.checkpoint()).is_err(), "another arena's");
    arena.reset();
    assert!(arena.rewind(outer).is_err(), "from before the reset");
    assert_eq!(arena.alloc::<u8>(3 << 20).unwrap().device_ptr(), big);
    assert_eq!(arena.stats().foreign_waits, 0);
}

#[test]
fn an_arena_refuses_a_stream_of_another_device() {
    if !crate::gpu_support::gpus(module_path!(), 2) {
        return;
    }
    let pool = DevicePool::get(0).unwrap();
    let other = cudalloc::cuda::Stream::new(1).unwrap();
    assert!(matches!(
        DeviceArena::new(&pool, &other),
        Err(Error::InvalidArgument(_))
    ));
}
