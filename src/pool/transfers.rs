//! Consistent reads of counters that two owners keep: a block moving between a thread's
//! cache and the pool's shared lists changes the thread's published count and the pool's
//! "handed out" count one after the other, so `stats()` reading the two at different
//! moments could see the block in both places or in neither (`live = out - cached` then
//! wrapped to 2^64, or counted a flushed thread cache's blocks as live).
//!
//! Every such move runs between [`Transfers::begin`] and the drop of its guard; a reader
//! repeats its reads until no move began or was under way while it read (a seqlock with
//! any number of writers: two counters instead of one sequence). Moves are slow-path
//! (batches), so the two atomic additions cost nothing measurable; the hit paths do not
//! move blocks between owners and take no part.

use std::time::{Duration, Instant};

use crate::sync::{fence, AtomicU64, Ordering};

/// Counts of moves begun and ended. `ended <= begun`; equal when none is under way.
#[derive(Default)]
pub(crate) struct Transfers {
    begun: AtomicU64,
    ended: AtomicU64,
}

/// A move in progress; ends when dropped.
pub(crate) struct Transfer<'a>(&'a Transfers);

impl Transfers {
    /// Starts a move: call before changing either owner's counters.
    pub(crate) fn begin(&self) -> Transfer<'_> {
        self.begun.fetch_add(1, Ordering::Relaxed);
        // Orders the count before the move's counter writes: a reader that sees any of
        // them sees this count (with the reader's acquire fence).
        fence(Ordering::Release);
        Transfer(self)
    }

    /// Runs `read` until it ran while no move began or was under way, at most `tries`
    /// times (yielding between them) and then, while `patience` lasts, with a short sleep
    /// between tries (a thread's exit flushes its whole cache in one move, which can
    /// outlast many yields on a busy machine: a read right after `thread::scope`, whose
    /// threads run their thread-local destructors after it returns, met one in CI);
    /// returns its last result and whether that one is consistent.
    pub(crate) fn read<T>(&self, tries: usize, patience: Duration, mut read: impl FnMut() -> T) -> (T, bool) {
        let mut tries = tries.max(1);
        // Under loom a sleep lets no other model thread run: yields only.
        #[cfg(loom)]
        let patience = {
            let _ = patience;
            Duration::ZERO
        };
        let mut deadline = None;
        loop {
            let ended = self.ended.load(Ordering::Acquire);
            let value = read();
            fence(Ordering::Acquire);
            let begun = self.begun.load(Ordering::Relaxed);
            if begun == ended {
                return (value, true);
            }
            if tries > 1 {
                tries -= 1;
                crate::sync::thread::yield_now();
                continue;
            }
            let until = *deadline.get_or_insert_with(|| Instant::now() + patience);
            if Instant::now() >= until {
                return (value, false);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_read_during_a_move_is_not_consistent_and_one_after_it_is() {
        let t = Transfers::default();
        let guard = t.begin();
        let (v, consistent) = t.read(3, Duration::ZERO, || 7);
        assert_eq!((v, consistent), (7, false));
        drop(guard);
        assert_eq!(t.read(3, Duration::ZERO, || 8), (8, true));
    }

    /// A long move (a thread's exit flushing its cache) outlasts the yields; the read
    /// waits for it while its patience lasts.
    #[test]
    fn a_read_waits_out_a_move_longer_than_its_yields() {
        use crate::sync::global::{mpsc, Arc};
        let t = Arc::new(Transfers::default());
        let (started, began) = mpsc::channel();
        let mover = {
            let t = t.clone();
            std::thread::spawn(move || {
                let guard = t.begin();
                started.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(20));
                drop(guard);
            })
        };
        began.recv().unwrap();
        let (_, consistent) = t.read(64, Duration::from_secs(5), || ());
        assert!(consistent, "the read returned during the move");
        mover.join().unwrap();
    }
}
