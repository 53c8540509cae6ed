//! Before the heap begins: the first blocks it would serve that are smaller than one of
//! its chunks go to the driver pool beside it when that pool has room for them in what it
//! reserved already (for the pool's small blocks: its first step is 32 MiB on the H200).
//! A program whose blocks all stay small (under a chunk) then reserves what the driver
//! pool alone would, not that and a chunk of the heap besides (`traces/soak_host.csv`:
//! 32 MiB instead of 48 MiB for a peak request of 2 MiB), and one with no small blocks
//! makes the driver pool reserve nothing for them. The heap begins, for good, at the
//! first block that is not such an *early* block: one of a chunk or more, one the driver
//! pool has no room for, or one that would take the early blocks past [`EARLY_BYTES`] or
//! [`EARLY_BLOCKS`]. Early blocks are freed to the driver pool, wherever the heap stands
//! then. (Two threads may both see the same room; the limits bound what that costs.)
//!
//! Invariants (under the lock): `bytes` is the sum of the early blocks' sizes, counting
//! those being allocated (`pending` of them); `blocks.len() + pending <= EARLY_BLOCKS`
//! and `bytes <= EARLY_BYTES`; once `begun` is set no block is claimed again. `live`
//! mirrors `blocks.len()` (stored under the lock) so that a free of a heap-sized block
//! looks no further while no early block lives. No lock is held across a driver call:
//! a claim takes its room under the lock, the caller allocates, and [`Early::placed`]
//! records the block (or gives the room back).

use crate::sync::{lock, AtomicBool, AtomicUsize, Mutex, Ordering};

/// The most bytes in early blocks at once: half the driver pool's first step, so that
/// the early blocks and the small ones beside them rarely make it grow.
pub(crate) const EARLY_BYTES: usize = 16 << 20;
/// The most early blocks at once.
pub(crate) const EARLY_BLOCKS: usize = 8;

/// The heap's early blocks (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Early {
    /// Set once the heap has begun: every later block it serves is its own.
    begun: AtomicBool,
    /// Early blocks live now.
    live: AtomicUsize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// (address, bytes) of each live early block.
    blocks: Vec<(u64, usize)>,
    /// Claimed and being allocated.
    pending: usize,
    bytes: usize,
}

impl Early {
    /// Whether a block of `bytes`, which the heap would serve, goes to the driver pool
    /// instead (its room taken: the caller allocates it there and calls
    /// [`placed`](Self::placed)); false once the heap has begun, and when this block
    /// begins it: `bytes` of a `chunk` or more, past the early limits, or more than the
    /// driver pool's `room` (bytes it reserved that no block uses; asked only here, with
    /// no lock held, as it may be a driver call).
    pub(crate) fn claim(&self, bytes: usize, chunk: usize, room: impl FnOnce() -> usize) -> bool {
        if self.begun.load(Ordering::Relaxed) {
            return false;
        }
        let fits = bytes < chunk && bytes <= room();
        let mut st = lock(&self.state);
        let fits = fits && st.bytes + bytes <= EARLY_BYTES && st.blocks.len() + st.pending < EARLY_BLOCKS;
        if !fits || self.begun.load(Ordering::Relaxed) {
            self.begun.store(true, Ordering::Relaxed);
            return false;
        }
        st.pending += 1;
        st.bytes += bytes;
        true
    }

    /// Records the outcome of allocating a claimed early block of `bytes` from the
    /// driver pool: the block, or its room given back.
    pub(crate) fn placed(&self, outcome: &crate::Result<u64>, bytes: usize) {
        let mut st = lock(&self.state);
        st.pending -= 1;
        match outcome {
            Ok(ptr) => {
                st.blocks.push((*ptr, bytes));
                self.live.store(st.blocks.len(), Ordering::Release);
            }
            Err(_) => st.bytes -= bytes,
        }
    }

    /// Whether `ptr` (a block of `bytes` the heap would serve, being freed) is an early
    /// block, to be freed to the driver pool; it is forgotten here.
    #[inline]
    pub(crate) fn release(&self, ptr: u64, bytes: usize) -> bool {
        // A block's allocation happens before its free, so a live early block's count
        // is seen here.
        if self.live.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut st = lock(&self.state);
        let Some(i) = st.blocks.iter().position(|&(p, _)| p == ptr) else {
            return false;
        };
        debug_assert_eq!(
            st.blocks[i].1, bytes,
            "early block {ptr:#x} freed with another size"
        );
        st.blocks.swap_remove(i);
        st.bytes -= bytes;
        self.live.store(st.blocks.len(), Ordering::Release);
        true
    }

    /// Whether the heap has begun.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn begun(&self) -> bool {
        self.begun.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const CHUNK: usize = 16 << 20;

    #[test]
    fn small_blocks_stay_early_until_a_chunk_sized_one_begins_the_heap() {
        let e = Early::default();
        assert!(e.claim(2 << 20, CHUNK, || 32 << 20));
        e.placed(&Ok(0x1000), 2 << 20);
        assert!(
            !e.claim(CHUNK, CHUNK, || 32 << 20),
            "a chunk-sized block is the heap's"
        );
        assert!(e.begun());
        assert!(!e.claim(2 << 20, CHUNK, || 32 << 20), "begun for good");
        assert!(e.release(0x1000, 2 << 20), "still freed to the driver pool");
        assert!(!e.release(0x1000, 2 << 20), "once");
        assert!(!e.release(0x2000, 2 << 20), "not an early block");
    }

    #[test]
    fn the_early_limits_begin_the_heap() {
        let e = Early::default();
        for i in 0..EARLY_BLOCKS as u64 {
            assert!(e.claim(1 << 20, CHUNK, || 32 << 20), "block {i}");
            e.placed(&Ok(0x1000 * (i + 1)), 1 << 20);
        }
        assert!(
            !e.claim(1 << 20, CHUNK, || 32 << 20),
            "a ninth block begins the heap"
        );
        let e = Early::default();
        assert!(e.claim(15 << 20, CHUNK, || 32 << 20));
        assert!(!e.claim(2 << 20, CHUNK, || 32 << 20), "past EARLY_BYTES");
        assert!(e.begun());
    }

    #[test]
    fn a_block_the_driver_pool_has_no_room_for_begins_the_heap() {
        let e = Early::default();
        assert!(
            !e.claim(2 << 20, CHUNK, || 0),
            "nothing reserved there: the heap's"
        );
        assert!(e.begun());
        let e = Early::default();
        assert!(e.claim(2 << 20, CHUNK, || 2 << 20), "room for exactly it");
        assert!(!e.claim(3 << 20, CHUNK, || 2 << 20));
    }

    #[test]
    fn a_failed_early_allocation_gives_its_room_back() {
        let e = Early::default();
        assert!(e.claim(15 << 20, CHUNK, || 32 << 20));
        e.placed(&Err(crate::Error::OutOfMemory { requested: 15 << 20 }), 15 << 20);
        assert!(e.claim(15 << 20, CHUNK, || 32 << 20), "the room came back");
        e.placed(&Ok(0x1000), 15 << 20);
        assert!(!e.release(0x2000, 15 << 20));
        assert!(e.release(0x1000, 15 << 20));
        assert!(!e.begun());
    }
}
