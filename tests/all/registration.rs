//! `HostRegistration`: pinning memory the caller already has. GPU tests skip without a
//! driver; the test that a registration waits for its recorded uses holds a stream with a
//! gate and lives in `tests/gated.rs`.

use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;

#[test]
fn host_registrations_pin_existing_memory_for_the_copy_helpers() {
    gpu!();
    use cudalloc::cuda::{pointer_info, MemoryType};
    use cudalloc::HostRegistration;
    let stream = Stream::new(0).unwrap();
    // An unaligned range of an ordinary Vec.
    let mut backing = vec![0u32; 10_000];
    let mut pinned = HostRegistration::new(&mut backing[3..9_001]).unwrap();
    assert_eq!(pinned.len(), 8_998);
    assert_eq!(
        pointer_info(pinned.as_ptr().cast()).unwrap().memory_type,
        MemoryType::PinnedHost
    );
    for (i, x) in pinned.iter_mut().enumerate() {
        *x = i as u32;
    }
    assert!(cudalloc::record_use(pinned.as_ptr().cast(), &stream).unwrap());
    assert!(pinned.pending_uses() >= 1);
    let pool = DevicePool::get(0).unwrap();
    let mut dev = pool.alloc::<u32>(pinned.len(), &stream).unwrap();
    // SAFETY: `pinned` is not written until the to_vec below synchronizes the stream.
    unsafe { dev.copy_from_host_async(&pinned) }.unwrap();
    assert_eq!(dev.to_vec().unwrap(), pinned.to_vec());
    pinned.unregister().unwrap();
    assert_eq!(
        pointer_info(backing[3..].as_ptr().cast()).unwrap().memory_type,
        MemoryType::Pageable,
        "unregistered"
    );
    backing[0] = 1;
    // Empty buffers register nothing.
    let mut none: [u64; 0] = [];
    let empty = HostRegistration::new(&mut none[..]).unwrap();
    assert!(empty.is_empty() && empty.pending_uses() == 0);
}

#[test]
fn host_registrations_refuse_memory_that_is_already_pinned() {
    gpu!();
    use cudalloc::HostRegistration;
    let _bound = Stream::new(0).unwrap(); // a current context for the raw calls below
                                          // The crate's own pinned memory.
    let mut v: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::new_in(cudalloc::PinnedAlloc);
    v.resize(4096, 0);
    assert!(matches!(
        HostRegistration::new(&mut v[..]),
        Err(cudalloc::Error::InvalidArgument(_))
    ));
    // Memory another library registered: the driver refuses (712).
    let mut other = vec![0u8; 1 << 16];
    let p = other.as_mut_ptr();
    // SAFETY: `other` outlives the registration, undone below.
    unsafe { cudarc::driver::sys::cuMemHostRegister_v2(p.cast(), other.len(), 0) }
        .result()
        .unwrap();
    match HostRegistration::new(&mut other[1000..2000]) {
        Err(cudalloc::Error::Cuda(e)) => assert_eq!(e.code(), 712, "{e}"),
        other => panic!("registering registered memory: {other:?}"),
    }
    // SAFETY: registered above.
    unsafe { cudarc::driver::sys::cuMemHostUnregister(p.cast()) }
        .result()
        .unwrap();
    // Two registrations that share a page but no byte: what the driver does is reported,
    // and whatever it is, it is a clean result.
    let mut shared = vec![0u8; 8192];
    let (a, b) = shared.split_at_mut(3000);
    let first = HostRegistration::new(a).unwrap();
    match HostRegistration::new(b) {
        Ok(second) => {
            println!("two registrations sharing a page: both accepted");
            second.unregister().unwrap();
        }
        Err(cudalloc::Error::Cuda(e)) if e.code() == 712 => {
            println!("two registrations sharing a page: the second refused ({e})")
        }
        Err(e) => panic!("unexpected error for a registration sharing a page: {e}"),
    }
    first.unregister().unwrap();
}

#[test]
fn host_registration_without_a_driver_is_no_driver() {
    if cudalloc::cuda::driver_available() {
        println!("skipped: a driver is present (the no-driver path is tested without one)");
        return;
    }
    let mut v = [0u8; 64];
    assert!(matches!(
        cudalloc::HostRegistration::new(&mut v[..]),
        Err(cudalloc::Error::NoDriver)
    ));
}

/// Issue 22.6: registered growth faults a block's pages in with several threads before
/// `cuMemHostRegister`; the block must come back zeroed, writable and registered to its
/// last byte, at sizes that are not multiples of the page or of a thread's share, and
/// the process-wide pools' first large allocation must be pinned whole.
#[test]
fn registered_blocks_are_zeroed_by_the_threaded_prefault_and_pinned_whole() {
    gpu!();
    use allocator_api2::vec::Vec as AVec;
    use cudalloc::cuda::{pointer_info, MemoryType};
    use cudalloc::source::{MemorySource, RegisteredSource};
    use cudalloc::PinnedAlloc;
    let src = RegisteredSource::new(false);
    for len in [100, (2 << 20) + 1, (24 << 20) + 2048 + 7, (65 << 20) - 1] {
        let p = src.allocate(len).unwrap();
        // SAFETY: a fresh block of at least `len` bytes, ours until deallocated below.
        let bytes = unsafe { core::slice::from_raw_parts_mut(p.as_ptr(), len) };
        assert_eq!(
            bytes.iter().position(|&b| b != 0),
            None,
            "{len} bytes: not zeroed"
        );
        for at in [0, len / 2, len - 1] {
            assert_eq!(
                pointer_info(bytes[at..].as_ptr().cast()).unwrap().memory_type,
                MemoryType::PinnedHost,
                "{len} bytes: byte {at} registered"
            );
        }
        bytes.fill(9);
        assert!(bytes.iter().all(|&b| b == 9), "{len} bytes: writable");
        // SAFETY: allocated above with `len`; no copy used it.
        unsafe { src.deallocate(p, len) };
    }
    // The default pool's first large block (a fresh segment), copied to the GPU and back.
    let stream = Stream::new(0).unwrap();
    let len = (64 << 20) + 4096 * 3 + 5;
    let mut v: AVec<u8, PinnedAlloc> = AVec::with_capacity_in(len, PinnedAlloc);
    v.extend((0..len).map(|i| (i % 251) as u8));
    assert_eq!(
        pointer_info(v[len - 1..].as_ptr().cast()).unwrap().memory_type,
        MemoryType::PinnedHost,
        "the last byte of a 64 MiB PinnedAlloc block is pinned"
    );
    let pool = DevicePool::get(0).unwrap();
    let mut dev = pool.alloc::<u8>(len, &stream).unwrap();
    // SAFETY: `v` is not written until the to_vec below synchronizes the stream.
    unsafe { dev.copy_from_host_async(&v) }.unwrap();
    assert!(dev.to_vec().unwrap() == v[..], "the copy round trip");
}
