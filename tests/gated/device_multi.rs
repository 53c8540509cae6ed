//! Several GPUs: one cache per device, blocks never used on the wrong device, peer access
//! to pool memory and peer copies. Each test needs 2 GPUs: with fewer it prints `skipped:
//! needs 2 GPUs` and passes, unless `REQUIRE_GPUS=2`.

use cudalloc::cuda::{can_access_peer, copy_async, Stream};
use cudalloc::device::{Backing, DevicePool, DevicePoolConfig};
use cudalloc::Error;

use crate::gpu_support::{fill, finishes_within, gpus, mismatches, Gate, RUN_FOR};

const MIB: usize = 1 << 20;

macro_rules! two_gpus {
    () => {
        if !gpus(module_path!(), 2) {
            return;
        }
        let _one = crate::one_at_a_time();
    };
}

#[test]
fn each_device_has_its_own_cache() {
    two_gpus!();
    let (p0, p1) = (DevicePool::get(0).unwrap(), DevicePool::get(1).unwrap());
    assert_eq!((p0.device(), p1.device()), (0, 1));
    let (s0, s1) = (Stream::new(0).unwrap(), Stream::new(1).unwrap());
    // A stream of the other device is refused: a block never reaches the wrong device.
    assert!(matches!(
        p0.alloc::<u8>(4096, &s1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p1.alloc::<u8>(4096, &s0),
        Err(Error::InvalidArgument(_))
    ));
    let fresh = [
        DevicePool::new(0, DevicePoolConfig::default()).unwrap(),
        DevicePool::new(1, DevicePoolConfig::default()).unwrap(),
    ];
    let streams = [s0, s1];
    for round in 0..3u8 {
        for (pool, s) in fresh.iter().zip(&streams) {
            let b = pool.from_host(&vec![round; MIB], s).unwrap();
            assert_eq!(b.pool().device(), s.device());
            assert_eq!(mismatches(&b.to_vec().unwrap(), round), 0);
        }
    }
    for (d, pool) in fresh.iter().enumerate() {
        let st = pool.stats();
        println!("{st}");
        assert_eq!(st.device, d);
        assert_eq!((st.misses, st.hits), (1, 2), "device {d}: {st:?}");
        assert_eq!(st.cached_bytes, MIB as u64);
    }
    let report = cudalloc::device::report();
    println!("{report}");
    assert!(report.devices.len() >= 2);
}

#[test]
fn peer_copies_are_correct_both_ways() {
    two_gpus!();
    let (p0, p1) = (DevicePool::get(0).unwrap(), DevicePool::get(1).unwrap());
    let peer = can_access_peer(0, 1).unwrap() && can_access_peer(1, 0).unwrap();
    println!("peer access 0 <-> 1: {peer}");
    if peer {
        p0.enable_peer_access(1).unwrap();
        p1.enable_peer_access(0).unwrap();
        assert!(p0.peer_access(1).unwrap() && p1.peer_access(0).unwrap());
    }
    let (s0, s1) = (Stream::new(0).unwrap(), Stream::new(1).unwrap());
    for len in [1usize, 1000, MIB, 64 * MIB / 4] {
        let data: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
        let on1 = p1.from_host(&data, &s1).unwrap();
        let mut on0 = p0.alloc::<u32>(len, &s0).unwrap();
        on0.copy_from_device(&on1).unwrap();
        drop(on1); // device 1's stream waits for the copy before reusing the block
        assert!(on0.to_vec().unwrap() == data, "1 -> 0, {len} elements");
        let mut back = p1.alloc::<u32>(len, &s1).unwrap();
        back.copy_from_device(&on0).unwrap();
        assert!(back.to_vec().unwrap() == data, "0 -> 1, {len} elements");
    }
}

#[test]
fn a_peer_copy_behind_a_gate_still_reads_the_old_contents() {
    two_gpus!();
    let (p0, p1) = (DevicePool::get(0).unwrap(), DevicePool::get(1).unwrap());
    if can_access_peer(0, 1).unwrap() {
        p1.enable_peer_access(0).unwrap();
    }
    let (s0, s1) = (Stream::new(0).unwrap(), Stream::new(1).unwrap());
    let n = 64 * MIB;
    let src = p1.alloc::<u8>(n, &s1).unwrap();
    // SAFETY: src's block, on its own stream.
    unsafe { fill(src.device_ptr(), 0xAA, n, &s1) };
    let mut dst = p0.alloc::<u8>(n, &s0).unwrap();
    let gate = Gate::hold(&s0);
    dst.copy_from_device(&src).unwrap();
    let old = src.device_ptr();
    drop(src);
    let w = p1.alloc::<u8>(n, &s1).unwrap();
    assert_eq!(w.device_ptr(), old);
    // SAFETY: w's block, on its own stream (which waits for the peer copy first).
    unsafe { fill(w.device_ptr(), 0xBB, n, &s1) };
    let ran_ahead = finishes_within(&s1, RUN_FOR);
    gate.open();
    let bad = mismatches(&dst.to_vec().unwrap(), 0xAA);
    s1.synchronize().unwrap();
    println!("peer copy behind a gate: device 1's stream finished first: {ran_ahead}; {bad} of {n} bytes read wrong");
    assert!(!ran_ahead, "device 1's stream waited for the copy");
    assert_eq!(bad, 0);
}

#[test]
fn a_buffer_read_by_a_peer_is_declared_and_waited_for() {
    two_gpus!();
    let (p0, p1) = (DevicePool::get(0).unwrap(), DevicePool::get(1).unwrap());
    if can_access_peer(1, 0).unwrap() {
        p0.enable_peer_access(1).unwrap();
    }
    let (s0, s1) = (Stream::new(0).unwrap(), Stream::new(1).unwrap());
    let n = 16 * MIB;
    let mut x = p0.alloc::<u8>(n, &s0).unwrap();
    // SAFETY: x's block, on its own stream.
    unsafe { fill(x.device_ptr(), 0xAA, n, &s0) };
    s0.synchronize().unwrap(); // s1 reads x after this
    let z = p1.alloc::<u8>(n, &s1).unwrap();
    let gate = Gate::hold(&s1);
    // SAFETY: x (device 0) and z (device 1) are n bytes; x is declared used on s1 below,
    // so its block is reused only after this copy.
    unsafe { copy_async(z.device_ptr(), 1, x.device_ptr(), 0, n, &s1) }.unwrap();
    x.record_use(&s1);
    let old = x.device_ptr();
    drop(x);
    let w = p0.alloc::<u8>(n, &s0).unwrap();
    assert_ne!(w.device_ptr(), old, "x's block waits for device 1's read");
    // SAFETY: w's block, on its own stream.
    unsafe { fill(w.device_ptr(), 0xBB, n, &s0) };
    gate.open();
    s1.synchronize().unwrap();
    s0.synchronize().unwrap();
    assert_eq!(mismatches(&z.to_vec().unwrap(), 0xAA), 0);
}

#[test]
fn a_page_backed_pool_lets_a_peer_write_its_present_and_future_blocks() {
    two_gpus!();
    if !can_access_peer(1, 0).unwrap() {
        println!("skipped: device 1 cannot access device 0");
        return;
    }
    let config = DevicePoolConfig::default().with_backing(Backing::PhysicalPages);
    let pool = DevicePool::new(0, config).unwrap();
    assert!(!pool.peer_access(1).unwrap());
    let (s0, s1) = (Stream::new(0).unwrap(), Stream::new(1).unwrap());
    // A page block mapped before access is given, and one mapped after (new chunks).
    let before = pool.alloc::<u8>(8 * MIB, &s0).unwrap();
    s0.synchronize().unwrap(); // device 1 writes it after this
    pool.enable_peer_access(1).unwrap();
    assert!(pool.peer_access(1).unwrap());
    let after = pool.alloc::<u8>(64 * MIB, &s0).unwrap();
    let small = pool.alloc::<u8>(MIB, &s0).unwrap(); // on the driver pool
    assert!(pool.stats().reserved_bytes >= 72 * MIB as u64);
    s0.synchronize().unwrap();
    // Device 1 writes all three directly (a memset on its stream).
    for (b, v) in [(&before, 0xC1u8), (&after, 0xC2), (&small, 0xC3)] {
        // SAFETY: the block is device 0's, accessible from device 1 now; device 0's
        // stream has no work on it, and reads it only after s1 is synchronized.
        unsafe { fill(b.device_ptr(), v, b.len(), &s1) };
    }
    s1.synchronize().unwrap();
    for (b, v) in [(&before, 0xC1u8), (&after, 0xC2), (&small, 0xC3)] {
        assert_eq!(mismatches(&b.to_vec().unwrap(), v), 0, "{} bytes", b.len());
    }
    drop((before, after, small));
    pool.trim();
    assert_eq!(pool.stats().reserved_bytes, 0);
}
