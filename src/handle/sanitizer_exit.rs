//! The host pools' part of the release at exit under compute-sanitizer (see
//! `cuda/exit.rs`): [`release_cached_memory`](super::release_cached_memory), registered
//! when a handle first makes a process-wide pool.

/// Registers the release of the process-wide pinned and managed pools at exit (only under
/// compute-sanitizer or `CUDALLOC_RELEASE_AT_EXIT=1`; once; cheap after the first call).
pub(super) fn arm() {
    crate::cuda::exit::release_at_exit(release);
}

fn release() {
    super::release_cached_memory();
}
