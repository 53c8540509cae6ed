//! The pieces of a threaded allocator model that `pool.rs` and `props.rs` share: a fence
//! completed by hand, the model's live and waiting blocks, and its side of a free.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use allocator_api2::alloc::Layout;
use cudalloc::fence::Fence;

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
