//! The `cudarc` feature: streams both ways, device buffers in cudarc's copies and launches,
//! and the example's pipeline. GPU tests skip without a driver. Tests that hold a stream
//! with a gate live in `tests/gated/cudarc.rs` (a serialized binary).
#![cfg(feature = "cudarc")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// Queues a host function that sleeps `ms` on `stream` (GPU-ordered delay, no kernel),
/// and returns the flag it sets when done.
fn delay(stream: &Stream, ms: u64) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            d.store(true, Ordering::Release);
        })
        .unwrap();
    done
}

#[test]
fn both_crates_retain_the_same_primary_context() {
    gpu!();
    let s = Stream::new(0).unwrap();
    s.synchronize().unwrap(); // binds the crate's context on this thread
    let ours = cudarc::driver::result::ctx::get_current()
        .unwrap()
        .expect("a current context");
    let theirs = CudaContext::new(0).unwrap();
    assert_eq!(
        theirs.cu_ctx(),
        ours,
        "CudaContext::new(0) is the crate's primary context"
    );
    assert!(theirs.is_primary());
    assert_eq!(s.cudarc().context().cu_ctx(), ours);
    assert_eq!(
        **s.cudarc().context(),
        *theirs,
        "cudarc compares contexts by handle"
    );
}

#[test]
fn a_crate_stream_and_its_cudarc_view_are_one_stream() {
    gpu!();
    let s = Stream::new(0).unwrap();
    let view = s.cudarc();
    assert_eq!(view.cu_stream().cast(), s.as_raw());
    assert!(s.is_owned());
    // Work queued through the crate is ordered before work queued through the view.
    let done = delay(&s, 30);
    let event = view.record_event(None).unwrap();
    event.synchronize().unwrap();
    assert!(
        done.load(Ordering::Acquire),
        "an event recorded through the view completed before the crate's earlier host function"
    );
    // The view maps back to the same crate stream (one StreamId).
    let back = Stream::from_cudarc(view).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.id(), s.id());
}

#[test]
fn a_cudarc_view_keeps_its_stream_alive() {
    gpu!();
    let view = Stream::new(0).unwrap().cudarc().clone();
    // The crate handle is gone; the stream must still be usable through the view.
    view.synchronize().unwrap();
    let event = view.record_event(None).unwrap();
    event.synchronize().unwrap();
    assert!(view.context().check_err().is_ok());
}

#[test]
fn a_cudarc_stream_is_one_crate_stream_while_a_handle_lives() {
    gpu!();
    let ctx = CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let a = Stream::from_cudarc(&theirs).unwrap();
    let b: Stream = (&theirs).try_into().unwrap();
    assert_eq!(a, b, "the same cudarc stream converts to the same crate stream");
    assert!(!a.is_owned());
    assert!(
        Arc::ptr_eq(a.cudarc(), &theirs),
        "its view is the cudarc stream itself"
    );
    let id = a.id();
    drop((a, b));
    let c = Stream::from_cudarc(&theirs).unwrap();
    assert_ne!(c.id(), id, "with no handle left, a new one gets a new identity");
    // Ordering: crate work first, cudarc work after, on one stream.
    let done = delay(&c, 30);
    theirs.synchronize().unwrap();
    assert!(done.load(Ordering::Acquire));
    // A different stream of the same context is a different crate stream.
    let other = Stream::from_cudarc(&ctx.new_stream().unwrap()).unwrap();
    assert_ne!(other, c);
}

#[test]
fn streams_that_cannot_be_crate_streams_are_refused() {
    gpu!();
    let ctx = CudaContext::new(0).unwrap();
    let per_thread = ctx.per_thread_stream();
    assert!(matches!(
        Stream::from_cudarc(&per_thread),
        Err(cudalloc::Error::InvalidArgument(_))
    ));
    // SAFETY: the call fails before anything uses the handle.
    let raw = unsafe { Stream::from_raw(0, per_thread.cu_stream().cast()) };
    assert!(matches!(raw, Err(cudalloc::Error::InvalidArgument(_))));
    let private = CudaContext::new_non_primary(0, 0).unwrap();
    let stream = private.new_stream().unwrap();
    assert!(matches!(
        Stream::from_cudarc(&stream),
        Err(cudalloc::Error::InvalidArgument(_))
    ));
}

#[test]
fn crate_apis_take_a_cudarc_stream_through_from_cudarc() {
    gpu!();
    let ctx = CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let stream = Stream::from_cudarc(&theirs).unwrap();
    // DevicePool allocation.
    let pool = DevicePool::get(0).unwrap();
    let mut buf = pool.alloc::<u32>(1024, &stream).unwrap();
    buf.copy_from_host(&(0..1024).collect::<Vec<u32>>()).unwrap();
    assert!(Arc::ptr_eq(buf.stream().cudarc(), &theirs));
    // record_use on a pooled block.
    let mut v: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::new_in(cudalloc::PinnedAlloc);
    v.resize(4096, 7);
    assert!(cudalloc::record_use(v.as_ptr(), &stream).unwrap());
    drop(v);
    // The copy helpers.
    let mut dev = DevicePool::get(0).unwrap().alloc::<u8>(4096, &stream).unwrap();
    let src = vec![1u8; 4096];
    // SAFETY: `src` is neither written nor freed before the stream is synchronized.
    unsafe { cudalloc::copy::host_to_device_async(&src, &mut dev, 0) }.unwrap();
    theirs.synchronize().unwrap();
}

#[test]
fn device_buffers_take_part_in_cudarc_copies_on_their_stream() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let cs = stream.cudarc();
    let pool = DevicePool::get(0).unwrap();
    let input: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let mut a = pool.alloc::<f32>(input.len(), &stream).unwrap();
    cs.memcpy_htod(&input, &mut a).unwrap();
    let mut b = pool.alloc::<f32>(input.len(), &stream).unwrap();
    cs.memcpy_dtod(&a, &mut b).unwrap();
    assert_eq!(cs.clone_dtoh(&b).unwrap(), input);
    assert_eq!(b.to_vec().unwrap(), input, "the crate sees what cudarc wrote");
    assert_eq!(cudarc::driver::DeviceSlice::len(&b), input.len());
    let empty = pool.alloc::<f32>(0, &stream).unwrap();
    assert!(cs.clone_dtoh(&empty).unwrap().is_empty());
}

#[test]
fn device_buffers_used_on_another_stream_are_ordered_both_ways() {
    gpu!();
    let home = Stream::new(0).unwrap();
    let other = Stream::new(0).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let n = 1 << 20;
    let mut buf = pool.alloc_zeroed::<u32>(n, &home).unwrap();
    home.synchronize().unwrap();
    // Entry: a write queued on the buffer's stream behind 30 ms is seen by a cudarc read
    // on another stream.
    let ones = vec![1u32; n];
    let done = delay(&home, 30);
    // SAFETY: `ones` outlives the synchronize below and is not written.
    unsafe { buf.copy_from_host_async(&ones) }.unwrap();
    let seen = other.cudarc().clone_dtoh(&buf).unwrap();
    assert!(
        done.load(Ordering::Acquire),
        "the read ran before the buffer's stream got to it"
    );
    assert!(
        seen.iter().all(|&x| x == 1),
        "a cudarc read on another stream saw stale data"
    );
    // Exit: a cudarc write on another stream behind 30 ms has completed when the call
    // returns, so the buffer's own stream reads the new data without any other ordering.
    // The source is pinned and passed as a plain slice, so cudarc's copy itself returns
    // at once (pageable memory would make the driver wait for the stream).
    let mut twos: allocator_api2::vec::Vec<u32, _> = allocator_api2::vec::Vec::new_in(cudalloc::PinnedAlloc);
    twos.resize(n, 2);
    let done = delay(&other, 30);
    other.cudarc().memcpy_htod(&twos[..], &mut buf).unwrap();
    assert!(
        done.load(Ordering::Acquire),
        "the cudarc call returned before the other stream's use"
    );
    assert!(buf.to_vec().unwrap().iter().all(|&x| x == 2));
    home.synchronize().unwrap();
}

#[test]
fn a_kernel_launched_through_cudarc_takes_device_buffers() {
    gpu!();
    let stream = Stream::new(0).unwrap();
    let cs = stream.cudarc();
    let module = cs
        .context()
        .load_module(Ptx::from_src(include_str!("../../kernels/saxpy.ptx")))
        .unwrap();
    let saxpy = module.load_function("saxpy").unwrap();
    let pool = DevicePool::get(0).unwrap();
    let n: u32 = 100_000;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let dx = pool.from_host(&x, &stream).unwrap();
    let mut dy = pool.from_host(&vec![1.0f32; n as usize], &stream).unwrap();
    let a = 2.0f32;
    let mut launch = cs.launch_builder(&saxpy);
    launch.arg(&a).arg(&dx).arg(&mut dy).arg(&n);
    // SAFETY: saxpy(float a, const float* x, float* y, unsigned n): the arguments match
    // in type and order, and both buffers hold n floats on the launch's stream.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    let y = dy.to_vec().unwrap();
    assert!(y.iter().enumerate().all(|(i, &v)| v == 2.0 * i as f32 + 1.0));
}

#[test]
fn pinned_views_take_only_memory_the_crate_can_guard() {
    // Runs without a GPU: the check is a lookup in the crate's range registry.
    use cudalloc::{PinnedView, PinnedViewMut};
    let pool = cudalloc::Pool::new(cudalloc::source::HostSource);
    let mut pooled: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::with_capacity_in(256, &pool);
    pooled.resize(256, 1);
    assert!(PinnedView::new(&pooled[10..]).is_ok());
    assert!(PinnedViewMut::new(&mut pooled[..]).is_ok());
    let plain = vec![0u8; 256];
    assert!(matches!(
        PinnedView::new(&plain),
        Err(cudalloc::Error::InvalidArgument(_))
    ));
    assert!(
        PinnedView::<u8>::new(&[]).is_ok(),
        "an empty slice needs no guarding"
    );
    let arena = cudalloc::Arena::new(cudalloc::source::HostSource);
    let mut in_arena: allocator_api2::vec::Vec<u32, _> = allocator_api2::vec::Vec::new_in(&arena);
    in_arena.push(1);
    assert!(PinnedView::new(&in_arena).is_ok());
}

#[test]
fn a_read_only_view_as_a_copy_destination_is_an_error_not_a_panic() {
    gpu!();
    // A context of this test's own: the error is parked in it (cudarc's way for errors
    // that a trait method cannot return), and must not reach other tests' streams.
    let ctx = CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let stream = Stream::from_cudarc(&theirs).unwrap();
    let dev = DevicePool::get(0)
        .unwrap()
        .from_host(&[1u8; 64], &stream)
        .unwrap();
    let mut v: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::new_in(cudalloc::PinnedAlloc);
    v.resize(64, 0);
    let _ = theirs.memcpy_dtoh(&dev, &mut cudalloc::PinnedView::new(&v).unwrap());
    assert!(
        theirs.synchronize().is_err(),
        "cudarc's next call reports the misuse"
    );
    assert!(
        v.iter().all(|&b| b == 0),
        "nothing was written through a read-only view"
    );
    assert!(theirs.synchronize().is_ok(), "and only once");
}

#[test]
fn the_example_runs_and_checks_its_results() {
    gpu!();
    let summary = example::saxpy_on_the_gpu(100_003, 2.0).unwrap();
    assert!(summary.contains("100003 elements checked"), "{summary}");
    assert!(example::saxpy_on_the_gpu(0, 2.0).is_err());
}

/// The example program itself, its `main` unused here.
#[allow(dead_code)]
#[path = "../../examples/cudarc.rs"]
mod example;
