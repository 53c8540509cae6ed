//! The pipeline with its fill on worker threads (`Pipeline::fill_threads`) never refills a
//! buffer the GPU still reads: copies held behind a gate, 0 corrupted bytes, and the
//! negative control that skips the ring's events and the drain before a refill.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudalloc::staging::StagingRing;
use cudalloc::{copy, Error, PinnedAlloc};

use crate::gpu_support::Gate;
use crate::MIB;

/// Four batches through a threaded pipeline (2 fill threads) of one buffer with 4 batches
/// in flight, its stream held by a gate from the start: the copy of batch 0 is queued
/// behind the gate when batch 1 wants the buffer. The gate opens in `fill(3)` (after its
/// write) and, if `opener` is set, from a thread after 100 ms. Returns the bytes that
/// arrived wrong and whether `fill(1)` ran after the thread had opened the gate.
fn threaded_pipeline_behind_a_gate(opener: bool) -> (usize, bool) {
    let len = 4 * MIB;
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, len).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let pattern = |b: usize| (b as u8).wrapping_mul(37).wrapping_add(1);
    // Allocated before the gate: nothing below allocates while the stream is held.
    let mut values: Vec<_> = (0..4)
        .map(|_| {
            let dev = pool.alloc::<u8>(len, &s).unwrap();
            let mut back: allocator_api2::vec::Vec<u8, PinnedAlloc> =
                allocator_api2::vec::Vec::new_in(PinnedAlloc);
            back.resize(len, 0);
            (dev, back)
        })
        .collect();
    s.synchronize().unwrap();
    let opened = AtomicUsize::new(0);
    let fill1_after_open = AtomicBool::new(false);
    let mut wrong = 0;
    let gate = Gate::hold(&s);
    std::thread::scope(|scope| {
        if opener {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                opened.store(1, Ordering::SeqCst);
                gate.open();
            });
        }
        ring.pipeline()
            .in_flight(4)
            .fill_threads(2)
            .run(
                4,
                |b, buf| {
                    if b == 1 {
                        fill1_after_open.store(opened.load(Ordering::SeqCst) == 1, Ordering::SeqCst);
                    }
                    buf.fill(pattern(b));
                    if b == 3 {
                        gate.open();
                    }
                    Ok::<_, Error>(())
                },
                |_, buf| {
                    let (mut dev, mut back) = values.pop().expect("a value per batch");
                    // SAFETY: the pipeline and the ring keep `buf` from the next fill until
                    // the copy has completed (the property under test).
                    unsafe { copy::host_to_device_async(buf, &mut dev, 0) }?;
                    // SAFETY: `back` is read by the drain only, after the batch completed.
                    unsafe { copy::device_to_host_async(&dev, 0, &mut back) }?;
                    Ok((dev, back))
                },
                |b, (_dev, back)| {
                    wrong += back.iter().filter(|&&x| x != pattern(b)).count();
                    Ok(())
                },
            )
            .unwrap();
    });
    (wrong, fill1_after_open.load(Ordering::SeqCst))
}

#[test]
fn a_threaded_pipeline_refills_a_buffer_only_once_the_gpu_is_done_with_it() {
    gpu!();
    let _one = crate::one_at_a_time();
    let (wrong, fill1_after_open) = threaded_pipeline_behind_a_gate(true);
    assert!(
        fill1_after_open,
        "batch 1 refilled the buffer while batch 0's copy was held"
    );
    assert_eq!(wrong, 0, "bytes arrived wrong");
}

/// The negative control: without the ring's events and the drain before a refill, the
/// workers refill the buffer behind the held copies, and batches 0-2 arrive with batch
/// 3's bytes.
#[cfg(feature = "test-hooks")]
#[test]
fn without_the_rings_events_a_threaded_pipeline_refills_buffers_the_gpu_still_reads() {
    gpu!();
    let _one = crate::one_at_a_time();
    if crate::support::in_a_child_process(
        "staging_threaded::without_the_rings_events_a_threaded_pipeline_refills_buffers_the_gpu_still_reads",
    ) {
        return;
    }
    cudalloc::staging::hooks::skip_release_events(true);
    let (wrong, _) = threaded_pipeline_behind_a_gate(false);
    cudalloc::staging::hooks::skip_release_events(false);
    assert_eq!(wrong, 3 * 4 * MIB, "the refills did not reach the held copies");
}
