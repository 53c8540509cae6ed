//! The pipeline with its fill on worker threads (`Pipeline::fill_threads`) never refills a
//! buffer the GPU still reads: copies held behind a gate, 0 corrupted bytes, and the
//! negative control that skips the ring's events and the drain before a refill.

use crate::staging::pipeline_behind_a_gate;

/// The pipeline of `staging::pipeline_behind_a_gate` with its fills on 2 worker threads.
fn threaded_pipeline_behind_a_gate(opener: bool) -> (usize, bool) {
    pipeline_behind_a_gate(opener, 2)
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
    assert_eq!(
        wrong,
        3 * 4 * crate::MIB,
        "the refills did not reach the held copies"
    );
}
