//! The `debug-checks` feature: every block a pool hands out is remembered until it is
//! freed, so a double free or a block freed to a pool that does not own it stops the
//! program with a clear panic instead of handing one block to two owners later (a small
//! block freed twice sits twice in a free list) or silently adopting foreign memory.
//! Costs a lock and a hash-set operation per allocation and free: for debugging only.

use std::collections::HashSet;

use crate::sync::{lock, Mutex};

#[derive(Default)]
pub(crate) struct LiveBlocks {
    live: Mutex<HashSet<usize>>,
}

impl LiveBlocks {
    /// A block at `addr` was handed out. The set's growth is the crate's bookkeeping
    /// (`count::bookkeeping`): it lives as long as the pool, not the user's window.
    pub(crate) fn on_alloc(&self, addr: usize) {
        if !crate::count::bookkeeping(|| lock(&self.live).insert(addr)) {
            panic!("cudalloc debug-checks: the pool handed out block {addr:#x} while it was live (internal error)");
        }
    }

    /// Whether the block at `addr` is live.
    pub(crate) fn is_live(&self, addr: usize) -> bool {
        lock(&self.live).contains(&addr)
    }

    /// The block at `addr` is being freed; `owns` says whether the pool holds that memory.
    pub(crate) fn on_free(&self, addr: usize, owns: impl FnOnce() -> bool) {
        if lock(&self.live).remove(&addr) {
            return;
        }
        if owns() {
            panic!("cudalloc debug-checks: double free of block {addr:#x} (it is not live)");
        }
        panic!("cudalloc debug-checks: block {addr:#x} freed to a pool that does not own it");
    }
}
