//! The heap's lock and the mapper's turn: no lock is held across a driver call.
//!
//! Every operation locks the heap's state ([`Held`]) and lets the lock go across each
//! driver call ([`Held::unlocked`]). The operations that change what is mapped (map, set
//! access, unmap, create, release, reserve or free an address range) are made by one
//! thread at a time, the one holding the *turn* (`State::mapping`), with the lock let go
//! across each call ([`Held::driver`]). Meanwhile the other threads free blocks, take blocks that fit in memory already
//! mapped and read the stats; a thread whose block needs a mapping waits for the turn on
//! the heap's condition variable and then places its block again (frees made meanwhile
//! may now hold it; PyTorch's and RMM's pools serialize their growth the same way, on
//! their one lock). Threads that mapped at once instead (the lock-free attempt of
//! 2026-12-02, BENCHMARKS.md) reserved more (1.276 against 1.100 the peak request on
//! the H200's 16-thread run), since each grew the heap where waiting would have found
//! units freed, and were no faster.
//!
//! Invariants, which make the unlocked windows safe (the state read around a driver
//! call by the turn's holder cannot change under it):
//! - only the turn's holder changes a chunk's handle, the idle and spare handles' books,
//!   the retired chunks, the regions and the peers;
//! - a chunk whose handle is set but whose access is not yet granted is `granting`, and
//!   no block is placed there by another thread (placement counts it as unmapped, which
//!   needs the turn);
//! - units about to be unmapped (an idle chunk moved or released, a region freed) are
//!   out of the free runs before the lock is let go, and come back (unmapped) after.
//!
//! The stream order's driver calls (`cuEventQuery`, `cuStreamQuery`, `cuEventRecord`,
//! `cuStreamWaitEvent`) are made with the lock let go too, by any thread: the questions
//! are copied out under the lock and the answers kept after it (`clocks.rs`). A block's
//! taker asks after its block is its own (in `live`), and keeps a plain answer (what
//! completed) only if the lock is free at once ([`PageHeap::order_taker`]). The turn's
//! holder, reclaiming or polling, asks about the streams of the frees of the chunk at
//! hand only, each once per operation, and looks the chunk up again after
//! ([`PageHeap::settled`]), so that no lock is let go between finding an idle chunk's run
//! and carving it. A trim's host waits are made with the lock let go too (`trim.rs`), and
//! stream handles and marks that go are dropped after the lock (the last handle of a
//! stream, or a mark beyond the event pool's idle ones, is destroyed: a driver call).
//!
//! A panic inside a driver call (none is expected: the driver returns errors) gives the
//! turn up as the guard unwinds, so the heap's other threads do not wait for it forever.

use std::ops::{Deref, DerefMut};
use std::time::Instant;

use super::clocks::{answer, Answer, Ask, Freed, Stamps};
use super::stats::DriverNs;
use super::{PageHeap, State};
use crate::cuda::StreamId;
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::error::Result;
use crate::sync::Ordering;
use crate::sync::{lock, try_lock, wait, Condvar, Mutex, MutexGuard};

/// What an operation knows of the frees of units it is about to reuse
/// ([`PageHeap::settled`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Settled {
    /// All completed.
    Done,
    /// Some may be pending.
    Pending,
    /// The driver was asked, with the lock let go: look up again.
    Asked,
}

/// The heap's state, locked; it lets the lock go across a driver call
/// ([`driver`](Self::driver)).
pub(super) struct Held<'a, B: StreamOrder> {
    mutex: &'a Mutex<State<B>>,
    /// `None` only inside [`unlocked`](Self::unlocked), whose closure cannot reach
    /// `self`: every other access finds the guard.
    guard: Option<MutexGuard<'a, State<B>>>,
    /// The turn's condition variable.
    turn: &'a Condvar,
    /// Whether this thread took the turn through this guard and has not given it up: a
    /// guard dropped so (a panic in a driver call) gives it up, so that the heap's other
    /// threads are not left waiting for it.
    mine: bool,
    /// The streams this operation asked the driver about already ([`PageHeap::settled`]):
    /// each at most once per operation.
    asked: Vec<StreamId>,
}

#[cfg(all(test, not(loom)))]
std::thread_local! {
    /// The heap locks this thread holds through [`Held`] (tests only).
    static LOCKED: core::cell::Cell<usize> = const { core::cell::Cell::new(0) };
}

/// Counts a lock taken (+1) or let go (-1) by this thread (tests only).
#[inline(always)]
fn note(_delta: isize) {
    #[cfg(all(test, not(loom)))]
    LOCKED.with(|l| l.set(l.get().wrapping_add_signed(_delta)));
}

/// In tests, fails the simulated driver call `call` if this thread holds a page heap's
/// lock (the simulated physical memory and stream order call it: no lock is held across
/// a driver call).
#[cfg(any(test, feature = "sim"))]
#[inline(always)]
pub(crate) fn assert_unlocked(_call: impl core::fmt::Debug) {
    #[cfg(all(test, not(loom)))]
    assert!(
        LOCKED.with(|l| l.get() == 0),
        "fake: {_call:?} called under a page heap's lock"
    );
}

impl<'a, B: StreamOrder> Held<'a, B> {
    pub(super) fn new(mutex: &'a Mutex<State<B>>, turn: &'a Condvar) -> Self {
        Self::locked(mutex, lock(mutex), turn)
    }

    /// The state locked, if its lock is free now.
    pub(super) fn try_new(mutex: &'a Mutex<State<B>>, turn: &'a Condvar) -> Option<Self> {
        Some(Self::locked(mutex, try_lock(mutex)?, turn))
    }

    fn locked(mutex: &'a Mutex<State<B>>, guard: MutexGuard<'a, State<B>>, turn: &'a Condvar) -> Self {
        note(1);
        Self {
            mutex,
            guard: Some(guard),
            turn,
            mine: false,
            asked: Vec::new(),
        }
    }

    fn guard(&self) -> &MutexGuard<'a, State<B>> {
        match &self.guard {
            Some(g) => g,
            // Unreachable: `unlocked` puts the guard back before it returns, and its
            // closure cannot reach `self`.
            None => unreachable!("page heap: the state read while unlocked"),
        }
    }

    /// Runs `f` with the lock let go, then takes it again.
    pub(super) fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.guard = None;
        note(-1);
        let r = f();
        self.guard = Some(lock(self.mutex));
        note(1);
        r
    }

    /// Makes the driver call `f` with the lock let go (only the turn's holder does), and
    /// adds its time to the slot of [`DriverNs`] that `slot` picks.
    pub(super) fn driver<R>(&mut self, slot: fn(&mut DriverNs) -> &mut u64, f: impl FnOnce() -> R) -> R {
        debug_assert!(self.mine, "page heap: a physical-memory call without the turn");
        let (r, ns) = self.unlocked(|| {
            let t = Instant::now();
            let r = f();
            (r, t.elapsed().as_nanos() as u64)
        });
        *slot(&mut self.stats.driver_ns) += ns;
        r
    }

    /// Waits on the turn's condition variable, the lock let go meanwhile.
    fn wait(&mut self) {
        if let Some(mut g) = self.guard.take() {
            g.stats.turn_waits += 1;
            self.guard = Some(wait(self.turn, g));
        }
    }

    /// Takes the turn if no thread holds it: whether it did.
    pub(super) fn try_turn(&mut self) -> bool {
        let took = !std::mem::replace(&mut self.mapping, true);
        self.mine |= took;
        took
    }

    /// Takes the turn, waiting while another thread holds it.
    pub(super) fn take_turn(&mut self) {
        while !self.try_turn() {
            self.wait();
        }
    }

    /// Waits until no thread holds the turn (its mapping is done), without taking it.
    pub(super) fn await_turn(&mut self) {
        if self.mapping {
            self.wait();
        }
    }

    /// Gives the turn up and wakes the threads waiting for it (they place their blocks
    /// again).
    pub(super) fn end_turn(&mut self) {
        debug_assert!(self.mine, "page heap: a turn given up that was not taken");
        self.mapping = false;
        self.mine = false;
        self.turn.notify_all();
    }
}

impl<B: StreamOrder> Drop for Held<'_, B> {
    fn drop(&mut self) {
        if self.mine {
            // Only on a panic with the turn (every path gives it up otherwise).
            if self.guard.is_none() {
                self.guard = Some(lock(self.mutex));
                note(1);
            }
            self.end_turn();
        }
        if self.guard.is_some() {
            note(-1);
        }
    }
}

impl<B: StreamOrder> Deref for Held<'_, B> {
    type Target = State<B>;

    fn deref(&self) -> &State<B> {
        self.guard()
    }
}

impl<B: StreamOrder> DerefMut for Held<'_, B> {
    fn deref_mut(&mut self) -> &mut State<B> {
        match &mut self.guard {
            Some(g) => g,
            None => unreachable!("page heap: the state written while unlocked"),
        }
    }
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// The heap's state, locked.
    pub(super) fn held(&self) -> Held<'_, B> {
        Held::new(&self.state, &self.turn)
    }

    /// Whether the work of every free of `frees` completed, as far as this operation
    /// knows: [`Settled::Asked`] where it did not know of a stream it had not asked about
    /// yet, and asked the driver now with the lock let go (that stream's marks, else
    /// whether it is idle; each stream at most once per operation), so that the caller
    /// looks up again what it read under the lock. Only the streams of the frees at hand
    /// are asked, where asking every stream with frees pending, once per operation, made
    /// up to 16 queries per mapping on 16 threads for the one or two the chunk needs.
    pub(super) fn settled(&self, st: &mut Held<'_, B>, b: &B, frees: &[Freed]) -> Settled {
        let (mut asks, mut pending) = (Vec::new(), false);
        for f in frees {
            if st.clocks.completed(f) {
                continue;
            }
            if st.asked.contains(&f.stream) {
                pending = true;
                continue;
            }
            st.asked.push(f.stream);
            // The latest free of this stream among `frees`.
            let need = frees.iter().filter(|g| g.stream == f.stream).map(|g| g.seq).max();
            asks.extend(need.and_then(|need| st.clocks.ask(f.stream, need)));
        }
        if asks.is_empty() {
            return if pending { Settled::Pending } else { Settled::Done };
        }
        let answers: Vec<_> = st.unlocked(|| asks.into_iter().map(|a| answer(b, a, None).0).collect());
        st.clocks.answered(answers);
        Settled::Asked
    }

    /// The questions that order a taker on `stream` after the frees of `after` by other
    /// streams not known complete (none while the guard is off: negative controls), and
    /// a vector for their answers.
    pub(super) fn taker_asks(
        &self,
        st: &mut Held<'_, B>,
        stream: &B::Stream,
        after: &Stamps,
    ) -> (Vec<Ask<B>>, Vec<Answer<B>>) {
        let (me, on) = (B::stream_id(stream), self.guard.load(Ordering::Relaxed));
        let asks = st.clocks.asks(after.iter().filter(|s| on && s.stream != me));
        (asks, st.clocks.answers())
    }

    /// Makes work queued on `stream` from now on run after the frees that `asks` ask
    /// about, with no lock held, then keeps what the driver answered: under the heap's
    /// lock where a mark was recorded, a wait made or the ordering failed (`undo` runs
    /// then, under the lock), else only if the lock is free at once. A taker that finds it
    /// taken drops the answers (a later taker of those frees asks again): on the H100, 16
    /// threads that each took the lock again after asking ran `device_threads` 8-12%
    /// slower than with the questions asked under the lock, and these threads as fast.
    pub(super) fn order_taker(
        &self,
        b: &B,
        stream: &B::Stream,
        (mut asks, mut answers): (Vec<Ask<B>>, Vec<Answer<B>>),
        undo: impl FnOnce(&mut Held<'_, B>),
    ) -> Result<()> {
        let mut ordered = Ok(());
        for a in asks.drain(..) {
            let (got, r) = answer(b, a, Some(stream));
            answers.push(got);
            ordered = ordered.and(r);
        }
        let plain = ordered.is_ok() && answers.iter().all(Answer::plain);
        let held = if plain {
            Held::try_new(&self.state, &self.turn)
        } else {
            Some(self.held())
        };
        let Some(mut st) = held else {
            return ordered;
        };
        for a in &answers {
            st.stats.marks += a.marks;
            st.stats.waits += a.waits;
        }
        st.clocks.answered(answers.drain(..));
        st.clocks.recycle(asks, answers);
        if ordered.is_err() {
            undo(&mut st);
        }
        let dead = st.clocks.take_dead();
        drop(st);
        drop(dead);
        ordered
    }
}
