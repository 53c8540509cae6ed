//! The pieces of a threaded allocator model that `pool.rs` and `props.rs` share: a fence
//! completed by hand, the model's live and waiting blocks, and its side of a free.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use allocator_api2::alloc::Layout;
use cudalloc::fence::Fence;
use cudalloc::pool::Pool;
use cudalloc::source::HostSource;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// A fence the model completes by hand.
pub struct Flag(pub Arc<AtomicBool>);

// SAFETY: the models set the flag only once they no longer use the block (they never
// touch a freed block).
unsafe impl Fence for Flag {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        Ok(self.0.load(Ordering::Acquire))
    }
}

/// A live block of the model.
pub struct Block {
    pub addr: usize,
    pub layout: Layout,
    pub tag: u8,
    /// Flags of the uses recorded on it (open or not).
    pub fences: Vec<Arc<AtomicBool>>,
}

impl Block {
    /// The model's side of a grow or shrink to `layout` at `addr`: a block that moved
    /// leaves its old place waiting for its fences.
    pub fn resized(&mut self, waiting: &mut Vec<Waiting>, addr: usize, layout: Layout) {
        if addr != self.addr {
            let fences = core::mem::take(&mut self.fences);
            retire(waiting, self.addr, self.layout.size(), fences);
        }
        self.addr = addr;
        self.layout = layout;
    }
}

/// A freed block that must not be handed out again before its flags are all set.
pub struct Waiting {
    pub range: (usize, usize),
    pub fences: Vec<Arc<AtomicBool>>,
}

/// The model's side of a free: a block with unset flags must not be reused until set.
pub fn retire(waiting: &mut Vec<Waiting>, addr: usize, len: usize, fences: Vec<Arc<AtomicBool>>) {
    if len > 0 && fences.iter().any(|f| !f.load(Ordering::Relaxed)) {
        waiting.push(Waiting {
            range: (addr, addr + len),
            fences,
        });
    }
}

/// The ranges of the blocks of nonzero size among `blocks` (address, size), sorted and
/// checked disjoint after step `step`.
pub fn disjoint_ranges(
    step: usize,
    blocks: impl Iterator<Item = (usize, usize)>,
) -> Result<Vec<(usize, usize)>, TestCaseError> {
    let mut ranges: Vec<(usize, usize)> = blocks.filter(|b| b.1 > 0).map(|(a, n)| (a, a + n)).collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        prop_assert!(w[0].1 <= w[1].0, "step {}: live blocks overlap: {:x?}", step, w);
    }
    Ok(ranges)
}

/// At the end of a case: after a trim the pool holds nothing.
pub fn assert_drained(pool: &Pool<HostSource>) -> Result<(), TestCaseError> {
    pool.trim();
    let s = pool.stats();
    prop_assert_eq!(
        (s.live_bytes, s.cached_bytes, s.pending_bytes, s.source_bytes),
        (0, 0, 0, 0),
        "{:?}",
        s
    );
    Ok(())
}
