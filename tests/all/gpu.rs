//! Tests that need a GPU: real copies, driver-reported memory kinds, managed memory
//! changed on the device. Each starts with `gpu!()`.

use allocator_api2::vec::Vec;
use cudalloc::cuda::{
    memset_d8_async, pointer_info, HostAllocFlags, Location, ManagedAdvice, MemoryType, Stream,
};
use cudalloc::source::{advise, prefetch, MemorySource, RegisteredSource};
use cudalloc::testing::DeviceMemory;
use cudalloc::{ManagedAlloc, PinnedAlloc};

fn filled<A: allocator_api2::alloc::Allocator>(it: impl ExactSizeIterator<Item = u8>, a: A) -> Vec<u8, A> {
    let mut v = Vec::with_capacity_in(it.len(), a);
    v.extend(it);
    v
}

fn pattern(len: usize, seed: u8) -> impl ExactSizeIterator<Item = u8> {
    (0..len).map(move |i| (i as u8).wrapping_mul(167).wrapping_add(seed) ^ (i >> 13) as u8)
}

#[test]
fn pinned_vec_round_trip_through_device_is_bit_exact() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    for len in [1usize, 4097, 64 << 20] {
        let src: Vec<u8, _> = filled(pattern(len, 3), PinnedAlloc);
        let mut back: Vec<u8, _> = filled(core::iter::repeat_n(0u8, len), PinnedAlloc);
        let mut dev = DeviceMemory::new(len, 0).unwrap();
        // SAFETY: `src` and `back` are neither written nor read until the stream is
        // synchronized below.
        unsafe {
            dev.copy_from_host_async(0, &src, &stream).unwrap();
            dev.copy_to_host_async(0, &mut back, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        assert!(src[..] == back[..], "round trip of {len} bytes differs");
    }
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

#[test]
fn driver_reports_pinned_blocks_with_the_flags_asked_for() {
    gpu!();
    let mut report = std::vec::Vec::new();
    for bits in 0..8 {
        let flags = HostAllocFlags::from_bits(bits).unwrap();
        for len in [16usize, 100_000, 8 << 20] {
            let v: Vec<u8, _> = filled(core::iter::repeat_n(1u8, len), PinnedAlloc::with_flags(flags));
            let info = pointer_info(v.as_ptr()).unwrap();
            assert_eq!(
                info.memory_type,
                MemoryType::PinnedHost,
                "flags {flags:?}, {len} bytes"
            );
            let got = info
                .host_alloc_flags
                .expect("cuMemHostAlloc memory reports its flags");
            assert!(
                info.device_pointer.is_some(),
                "pinned memory is mapped under unified addressing"
            );
            // With unified addressing (every 64-bit system) the driver maps all pinned
            // memory and reports DEVICE_MAP whether or not it was asked for.
            println!(
                "asked {:#x}, {len} B: driver reports {:#x}",
                flags.bits(),
                got.bits()
            );
            if !got.contains(flags) {
                report.push(format!("asked {flags:?}, {len} B: driver reports {got:?}"));
            }
        }
    }
    assert!(
        report.is_empty(),
        "flags asked for are missing:\n{}",
        report.join("\n")
    );
    let pageable = std::vec![0u8; 64];
    assert_eq!(
        pointer_info(pageable.as_ptr()).unwrap().memory_type,
        MemoryType::Pageable
    );
}

#[test]
fn mapped_pinned_memory_is_written_by_the_device() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let flags = HostAllocFlags::DEVICE_MAP | HostAllocFlags::PORTABLE;
    let mut v: Vec<u8, _> = filled(core::iter::repeat_n(0u8, 1 << 20), PinnedAlloc::with_flags(flags));
    let dptr = pointer_info(v.as_ptr()).unwrap().device_pointer.expect("mapped");
    // SAFETY: the host does not touch `v` until the stream is synchronized.
    unsafe { memset_d8_async(dptr, 0x5A, v.len(), &stream) }.unwrap();
    stream.synchronize().unwrap();
    assert!(v.iter().all(|&b| b == 0x5A));
    v[0] = 1;
}

#[test]
fn registered_memory_is_reported_pinned() {
    gpu!();
    let src = RegisteredSource::new(false);
    let p = src.allocate(3 << 20).unwrap();
    let info = pointer_info(p.as_ptr()).unwrap();
    assert_eq!(info.memory_type, MemoryType::PinnedHost);
    // Registered portable: the driver reports it like portable (mapped) pinned memory.
    let flags = info
        .host_alloc_flags
        .expect("registered memory reports its flags");
    assert!(flags.contains(HostAllocFlags::PORTABLE), "{flags:?}");
    assert!(!flags.contains(HostAllocFlags::WRITE_COMBINED), "{flags:?}");
    // SAFETY: allocated above with this size and unused since.
    unsafe { src.deallocate(p, 3 << 20) };
    let after = pointer_info(p.as_ptr()).unwrap();
    assert_eq!(
        after.memory_type,
        MemoryType::Pageable,
        "unregistered before it is freed"
    );
}

#[test]
fn managed_vec_prefetched_changed_on_device_and_read_back() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let len = 32 << 20;
    let mut v: Vec<u8, _> = filled(core::iter::repeat_n(1u8, len), ManagedAlloc);
    let info = pointer_info(v.as_ptr()).unwrap();
    assert_eq!(info.memory_type, MemoryType::Managed);
    advise(&v, ManagedAdvice::PreferredLocation(Location::Device(0))).unwrap();
    advise(&v, ManagedAdvice::AccessedBy(Location::Host)).unwrap();
    prefetch(&v, Location::Device(0), &stream).unwrap();
    // SAFETY: the host does not touch `v` until the stream is synchronized.
    unsafe { memset_d8_async(v.as_ptr() as u64, 0xAB, len / 2, &stream) }.unwrap();
    prefetch(&v, Location::Host, &stream).unwrap();
    stream.synchronize().unwrap();
    assert!(
        v[..len / 2].iter().all(|&b| b == 0xAB),
        "device writes visible on the host"
    );
    assert!(v[len / 2..].iter().all(|&b| b == 1), "the rest untouched");
    v.push(9);
    assert_eq!(v[len], 9);
}

#[test]
fn managed_request_beyond_device_memory_is_refused_before_cuda() {
    gpu!();
    let (_free, total) = cudalloc::cuda::mem_info(0).unwrap();
    let mut v: Vec<u8, _> = Vec::new_in(ManagedAlloc);
    assert!(
        v.try_reserve_exact(total).is_err(),
        "more managed memory than the device holds"
    );
    let err = cudalloc::source::ManagedSource::default()
        .allocate(total)
        .unwrap_err();
    assert!(
        matches!(
            err,
            cudalloc::Error::TooLarge { .. } | cudalloc::Error::LimitExceeded { .. }
        ),
        "{err}"
    );
    v.push(1);
}

#[test]
fn errors_carry_the_driver_code_name_and_message() {
    gpu!();
    let err = DeviceMemory::new(1 << 50, 0).unwrap_err();
    let cudalloc::Error::Cuda(e) = err else {
        panic!("expected a CUDA error, got {err}")
    };
    assert!(e.is_out_of_memory());
    assert_eq!(e.name(), "CUDA_ERROR_OUT_OF_MEMORY");
    assert!(!e.message().is_empty());
    assert!(format!("{err}").contains("CUDA_ERROR_OUT_OF_MEMORY"));
}

#[test]
fn fallback_when_driver_hidden() {
    gpu!();
    // Re-run the no-driver test in a child process that hides the driver: on the GPU
    // machine that is the only way to exercise the fallback and the strict errors.
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "allocators::without_driver_defaults_fall_back_and_strict_handles_fail",
            "--nocapture",
        ])
        .env("CUDALLOC_NO_DRIVER", "1")
        .env_remove("REQUIRE_GPU")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "the child ran the test:\n{stdout}");
}
