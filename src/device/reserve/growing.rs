//! A driver pool for the tests and loom models of [`Reservations`]: it grows by `step`
//! bytes when its idle bytes do not fit a request, and checks at every change that the
//! watched [`Reservations`] cover what it reserves (and, used by one thread, that no call
//! comes while the limit's lock is held).

use super::{PoolSide, Reservations};
use crate::error::Result;
use crate::sync::{lock, Mutex};

/// Reserved and used bytes, and the next address.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) reserved: usize,
    pub(crate) used: usize,
    next: u64,
    last: usize,
}

#[derive(Debug)]
pub(crate) struct Growing<'a> {
    step: usize,
    pub(crate) state: Mutex<State>,
    watched: Option<&'a Reservations>,
    /// One thread uses it: the limit's lock is then free at every call.
    sole: bool,
}

impl<'a> Growing<'a> {
    /// A pool growing by `step`; with `watched`, every call checks that `watched`
    /// covers the reservation and, if `sole` (one thread uses the pool), that its
    /// lock is free.
    pub(crate) fn new(step: usize, watched: Option<&'a Reservations>, sole: bool) -> Self {
        Self {
            step,
            state: Mutex::new(State {
                next: 1 << 20,
                ..State::default()
            }),
            watched,
            sole,
        }
    }

    /// Checks, with the pool's state locked (it cannot change meanwhile), that the
    /// watched reservations cover what the pool reserves and that no driver call is
    /// made under their lock.
    fn check(&self, s: &State) {
        if let Some(r) = self.watched {
            assert!(
                !self.sole || r.pool.try_lock().is_ok(),
                "a driver pool call under the limit's lock"
            );
            assert!(
                s.reserved <= r.tally.held(),
                "the driver pool reserves {} bytes, the reservations hold {}",
                s.reserved,
                r.tally.held()
            );
        }
    }

    /// Frees `bytes` of live blocks.
    pub(crate) fn free(&self, bytes: usize) {
        let mut s = lock(&self.state);
        s.used -= bytes;
    }

    /// Gives idle steps back down to `keep` bytes.
    pub(crate) fn trim_to(&self, keep: usize) {
        let mut s = lock(&self.state);
        let need = s.used.max(keep).div_ceil(self.step) * self.step;
        s.reserved = s.reserved.min(need);
        self.check(&s);
    }
}

impl PoolSide for Growing<'_> {
    fn usage(&self) -> Result<(usize, usize)> {
        let s = lock(&self.state);
        self.check(&s);
        Ok((s.reserved, s.used))
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let mut s = lock(&self.state);
        while s.reserved - s.used < bytes {
            s.reserved += self.step;
        }
        s.used += bytes;
        let p = s.next;
        s.next += bytes as u64;
        s.last = bytes;
        self.check(&s);
        Ok(p)
    }

    fn undo(&self, _: u64, keep: usize) {
        // Frees the newest block (the tests that undo allocate one at a time).
        let last = lock(&self.state).last;
        self.free(last);
        self.trim_to(keep);
    }
}
