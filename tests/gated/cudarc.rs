//! The pinned-memory hole in cudarc's copies, shown and closed (feature `cudarc`), and host
//! registrations that wait for their uses. Each copy is queued behind 20 ms of work on its
//! stream (a sleeping host function), so the host frees and hands out the memory while
//! the DMA has not yet touched it, as the design's race test on raw CUDA does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allocator_api2::vec::Vec;
use cudalloc::cuda::Stream;
use cudalloc::device::{DeviceBuffer, DevicePool};
use cudalloc::pool::Pool;
use cudalloc::source::PinnedSource;
use cudalloc::{copy, HostRegistration, PinnedView, PinnedViewMut};

use super::{gate_released_after, hold, one_at_a_time};

const ROUNDS: usize = 20;
/// A size class (below the pool's large threshold): a freed block goes to the thread's
/// cache and the next request of the class gets it back, the reuse a race needs.
const LEN: usize = 256 << 10;

/// Queues 20 ms of GPU-ordered delay on `stream`.
fn queue_delay(stream: &Stream) {
    stream
        .launch_host_fn(|| std::thread::sleep(Duration::from_millis(20)))
        .unwrap();
}

/// What a race round saw.
#[derive(Default, Debug)]
struct Rounds {
    /// Rounds in which the new owner got the freed block back.
    reused: usize,
    /// Bytes that were not what their owner wrote or meant to copy.
    corrupted: usize,
}

/// Host to device: per round, a pinned `Vec` (pattern `0x80 + round`) is copied by cudarc
/// behind 20 ms of work, dropped at once, and a new owner takes a block of the same size
/// and overwrites it with `0x11`. Counts the device bytes that are not the pattern.
fn htod_race(copy: impl Fn(&Arc<cudarc::driver::CudaStream>, &[u8], &mut DeviceBuffer<u8>)) -> Rounds {
    let stream = Stream::new(0).unwrap();
    let pool = Pool::new(PinnedSource::default());
    let mut dev = DevicePool::get(0).unwrap().alloc::<u8>(LEN, &stream).unwrap();
    let mut seen = Rounds::default();
    for round in 0..ROUNDS {
        let pattern = 0x80 + round as u8;
        let mut v: Vec<u8, _> = Vec::with_capacity_in(LEN, &pool);
        v.resize(LEN, pattern);
        let old = v.as_ptr();
        queue_delay(&stream);
        copy(stream.cudarc(), &v, &mut dev);
        drop(v);
        let mut next: Vec<u8, _> = Vec::with_capacity_in(LEN, &pool);
        next.resize(LEN, 0x11);
        seen.reused += usize::from(next.as_ptr() == old);
        let on_device = dev.to_vec().unwrap();
        seen.corrupted += on_device.iter().filter(|&&b| b != pattern).count();
    }
    stream.synchronize().unwrap();
    seen
}

/// Device to host: per round, cudarc copies a device buffer of `0xA5` into a pinned `Vec`
/// behind 20 ms of work, the `Vec` is dropped at once, and a new owner takes a block of
/// the same size and fills it with `0x11`. Counts the new owner's bytes that the copy
/// overwrote.
fn dtoh_race(copy: impl Fn(&Arc<cudarc::driver::CudaStream>, &DeviceBuffer<u8>, &mut [u8])) -> Rounds {
    let stream = Stream::new(0).unwrap();
    let pool = Pool::new(PinnedSource::default());
    let dev = DevicePool::get(0)
        .unwrap()
        .from_host(&vec![0xA5u8; LEN], &stream)
        .unwrap();
    let mut seen = Rounds::default();
    for _ in 0..ROUNDS {
        let mut v: Vec<u8, _> = Vec::with_capacity_in(LEN, &pool);
        v.resize(LEN, 0);
        let old = v.as_ptr();
        queue_delay(&stream);
        copy(stream.cudarc(), &dev, &mut v);
        drop(v);
        let mut next: Vec<u8, _> = Vec::with_capacity_in(LEN, &pool);
        next.resize(LEN, 0x11);
        seen.reused += usize::from(next.as_ptr() == old);
        stream.synchronize().unwrap();
        seen.corrupted += next.iter().filter(|&&b| b != 0x11).count();
    }
    seen
}

#[test]
fn a_plain_pinned_slice_in_cudarc_corrupts_the_next_owner_negative_control() {
    gpu!();
    let _one = one_at_a_time();
    let htod = htod_race(|cs, v, dev| cs.memcpy_htod(v, dev).unwrap());
    println!("plain &[u8], host to device: {htod:?} over {ROUNDS} rounds of {LEN} bytes");
    assert!(
        htod.reused > 0,
        "the pool never handed the freed block out again: {htod:?}"
    );
    assert!(
        htod.corrupted > 0,
        "the negative control shows no corruption, so the fixed test proves nothing: {htod:?}"
    );
    let dtoh = dtoh_race(|cs, dev, v| cs.memcpy_dtoh(dev, v).unwrap());
    println!("plain &mut [u8], device to host: {dtoh:?}");
    assert!(dtoh.reused > 0 && dtoh.corrupted > 0, "{dtoh:?}");
}

#[test]
fn pinned_views_keep_the_block_from_its_next_owner_until_the_copy_is_done() {
    gpu!();
    let _one = one_at_a_time();
    let htod = htod_race(|cs, v, dev| {
        cs.memcpy_htod(&PinnedView::new(v).unwrap(), dev).unwrap();
    });
    println!("PinnedView, host to device: {htod:?}");
    assert_eq!(htod.corrupted, 0, "{htod:?}");
    assert_eq!(
        htod.reused, 0,
        "a block with a copy in flight was handed out: {htod:?}"
    );
    let dtoh = dtoh_race(|cs, dev, v| {
        // SAFETY: the race helper does not touch `v` before dropping it.
        let mut view = unsafe { PinnedViewMut::new_async(v) }.unwrap();
        cs.memcpy_dtoh(dev, &mut view).unwrap();
    });
    println!("PinnedViewMut::new_async, device to host: {dtoh:?}");
    assert_eq!(dtoh.corrupted, 0, "{dtoh:?}");
    assert_eq!(dtoh.reused, 0, "{dtoh:?}");
}

#[test]
fn a_forgotten_view_is_sealed_when_its_block_is_freed() {
    gpu!();
    let _one = one_at_a_time();
    let htod = htod_race(|cs, v, dev| {
        let view = PinnedView::new(v).unwrap();
        cs.memcpy_htod(&view, dev).unwrap();
        std::mem::forget(view); // safe code may: the pool seals the use at the free
    });
    assert_eq!(htod.corrupted, 0, "{htod:?}");
    assert_eq!(htod.reused, 0, "{htod:?}");
}

#[test]
fn pinned_views_stay_asynchronous_on_crate_streams_and_wait_on_others() {
    gpu!();
    let _one = one_at_a_time();
    let pool = Pool::new(PinnedSource::default());
    let mut v: Vec<u32, _> = Vec::with_capacity_in(1024, &pool);
    v.resize(1024, 3);
    let ours = Stream::new(0).unwrap();
    let mut dev = DevicePool::get(0).unwrap().alloc::<u32>(1024, &ours).unwrap();
    // On a crate stream: the call returns with the copy still queued, and the block
    // freed meanwhile is pending.
    let checked = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&checked, Duration::ZERO);
    hold(&ours, &release, None);
    ours.cudarc()
        .memcpy_htod(&PinnedView::new(&v).unwrap(), &mut dev)
        .unwrap();
    let returned_while_gated = !release.load(Ordering::Acquire);
    drop(v);
    let pending = pool.stats().pending_blocks;
    checked.store(true, Ordering::Release);
    timer.join().unwrap();
    assert!(
        returned_while_gated,
        "memcpy_htod through a PinnedView waited for its stream"
    );
    assert_eq!(pending, 1, "the freed block waits for the copy");
    assert_eq!(dev.to_vec().unwrap(), vec![3u32; 1024]);
    // On a cudarc stream the crate has no handle of: correct, by waiting.
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    {
        let handle = Stream::from_cudarc(&theirs).unwrap();
        let d = done.clone();
        handle
            .launch_host_fn(move || {
                std::thread::sleep(Duration::from_millis(30));
                d.store(true, Ordering::Release);
            })
            .unwrap();
    } // no crate handle of `theirs` is left
      // The first copy has completed (`to_vec` waited for `ours`): collecting pending
      // blocks now takes v's, so that what is pending below is w's alone.
    pool.collect_pending();
    assert_eq!(pool.stats().pending_blocks, 0);
    let mut w: Vec<u32, _> = Vec::with_capacity_in(1024, &pool);
    w.resize(1024, 4);
    theirs
        .memcpy_htod(&PinnedView::new(&w).unwrap(), &mut dev)
        .unwrap();
    assert!(
        done.load(Ordering::Acquire),
        "a copy on a stream the crate does not know returned before it ran"
    );
    drop(w);
    assert_eq!(pool.stats().pending_blocks, 0, "nothing left to guard");
    ours.synchronize().unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![4u32; 1024]);
}

#[test]
fn pinned_view_mut_new_completes_the_copy_before_returning() {
    gpu!();
    let _one = one_at_a_time();
    let stream = Stream::new(0).unwrap();
    let dev = DevicePool::get(0)
        .unwrap()
        .from_host(&[9u16; 4096], &stream)
        .unwrap();
    let mut back: Vec<u16, _> = Vec::with_capacity_in(4096, cudalloc::PinnedAlloc);
    back.resize(4096, 0);
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(30));
            d.store(true, Ordering::Release);
        })
        .unwrap();
    stream
        .cudarc()
        .memcpy_dtoh(&dev, &mut PinnedViewMut::new(&mut back).unwrap())
        .unwrap();
    assert!(
        done.load(Ordering::Acquire),
        "memcpy_dtoh returned before the copy ran"
    );
    assert!(back.iter().all(|&x| x == 9));
}

#[test]
fn a_host_registration_waits_for_its_uses_before_unregistering() {
    gpu!();
    let _one = one_at_a_time();
    let stream = Stream::new(0).unwrap();
    let mut frame = vec![6u8; 1 << 20];
    let mut dev = cudalloc::device::DevicePool::get(0)
        .unwrap()
        .alloc::<u8>(1 << 20, &stream)
        .unwrap();
    let dropping = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&dropping, Duration::from_millis(50));
    let registration = HostRegistration::new(&mut frame[..]).unwrap();
    hold(&stream, &release, None);
    // SAFETY: the registration's drop waits for the copy before the buffer is usable.
    unsafe { copy::host_to_device_async(&registration, &mut dev, 0) }.unwrap();
    assert_eq!(registration.pending_uses(), 1, "the copy helper recorded its use");
    let gate_was_closed = !release.load(Ordering::Acquire);
    dropping.store(true, Ordering::Release);
    drop(registration);
    assert!(
        release.load(Ordering::Acquire),
        "the registration was released before the copy it had to wait for could run"
    );
    timer.join().unwrap();
    assert!(
        gate_was_closed,
        "queuing took 10 s: the gate opened before the drop"
    );
    frame[0] = 1; // the caller's again
                  // Through cudarc: a PinnedView records its use on the registration.
    let mut buf = DevicePool::get(0).unwrap().alloc::<u8>(1 << 20, &stream).unwrap();
    let registration = HostRegistration::new(&mut frame[..]).unwrap();
    queue_delay(&stream);
    stream
        .cudarc()
        .memcpy_htod(&PinnedView::new(&registration).unwrap(), &mut buf)
        .unwrap();
    assert_eq!(registration.pending_uses(), 1);
    registration.unregister().unwrap();
    let on_device = buf.to_vec().unwrap();
    assert_eq!(on_device[0], 1);
    assert!(on_device[1..].iter().all(|&b| b == 6));
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

#[test]
fn making_a_stream_never_waits_for_work_on_the_device() {
    gpu!();
    under_a_sanitizer!("which serializes the device (the race cannot happen)");
    let _one = one_at_a_time();
    // cudarc synchronizes a context when its count of streams goes from 0 to 1; the crate
    // keeps its context in multi-stream mode, so a stream made while no other crate stream
    // lives does not wait for a gated (destroyed) stream's work.
    let checked = Arc::new(AtomicBool::new(false));
    let (release, timer) = gate_released_after(&checked, Duration::ZERO);
    {
        let a = Stream::new(0).unwrap();
        hold(&a, &release, None);
        assert!(a.cudarc().context().is_managing_stream_synchronization());
    } // the last crate stream is gone, its work still gated
    let b = Stream::new(0).unwrap();
    let gate_was_closed = !release.load(Ordering::Acquire);
    checked.store(true, Ordering::Release);
    timer.join().unwrap();
    assert!(gate_was_closed, "Stream::new waited for the device");
    b.synchronize().unwrap();
}
