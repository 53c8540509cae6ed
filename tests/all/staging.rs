//! The staging ring's argument checks (`cudalloc::staging`); its GPU tests hold streams
//! with gates and live in the gated binary (`tests/gated/staging.rs`).

use cudalloc::cuda::Stream;
use cudalloc::staging::StagingRing;
use cudalloc::{Error, PinnedAlloc};

#[test]
fn a_ring_refuses_empty_shapes() {
    // Checked before any driver call: runs without a GPU too.
    let err = StagingRing::new(PinnedAlloc, &[], 1, 4096).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    if !cudalloc::cuda::driver_available() {
        return;
    }
    let s = Stream::new(0).unwrap();
    for (n, len) in [(0, 4096), (1, 0)] {
        let err = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), n, len).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    }
}
