//! Bytes held against one limit, with the most held at once ([`Tally`]): the cache's
//! blocks held from its backend, and a backend's reservations from the device
//! ([`Reservations`]: the driver pool's and the page heap's together, so that a pool's
//! limit holds for the pool as a whole; issue 21, item 3).

use crate::budget::Budget;
use crate::error::{Error, Result};
use crate::sync::{lock, AtomicU64, AtomicUsize, Mutex, Ordering};
use crate::trace::{PoolReservation, Tag};

/// The granule of the driver pool's reservations: a request that may make it grow is
/// charged at least its size rounded up to this before the driver is asked.
const POOL_GRANULE: usize = 2 << 20;
/// How much more than a request (rounded to the granule) the driver pool is first
/// assumed to grow by when it grows: its smallest reservation measured on the H200 is
/// 32 MiB (a 1 MiB block reserved 32 MiB; `fake/`'s `PoolModel` follows it).
/// Learned upward from what the driver does, never downward.
const POOL_FIRST_EXTRA: usize = 30 << 20;

/// `bytes` rounded up to the driver pool's granule.
fn granules(bytes: usize) -> usize {
    bytes.div_ceil(POOL_GRANULE).saturating_mul(POOL_GRANULE)
}

/// Bytes held against a limit ([`Budget`]) and the most held at once.
pub(crate) struct Tally {
    budget: Budget,
    peak: AtomicUsize,
}

impl Tally {
    pub(crate) fn new(limit: Option<usize>) -> Self {
        Self {
            budget: Budget::new(limit),
            peak: AtomicUsize::new(0),
        }
    }

    /// The limit (`usize::MAX`: none).
    #[inline]
    pub(crate) fn limit(&self) -> usize {
        self.budget.limit().unwrap_or(usize::MAX)
    }

    /// Takes `n` bytes if they fit under the limit (the error names the request, what is
    /// held and the limit); otherwise changes nothing.
    #[inline]
    pub(crate) fn reserve(&self, n: usize) -> Result<()> {
        self.budget.reserve(n)?;
        self.note_peak(self.budget.held());
        Ok(())
    }

    /// Gives back `n` bytes taken by [`reserve`](Self::reserve).
    #[inline]
    pub(crate) fn release(&self, n: usize) {
        self.budget.release(n);
    }

    pub(crate) fn held(&self) -> usize {
        self.budget.held()
    }

    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Counts `n` bytes as held at some moment (the peak only).
    fn note_peak(&self, n: usize) {
        self.peak.fetch_max(n, Ordering::Relaxed);
    }

    /// Resets the peak to what is held now.
    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.held(), Ordering::Relaxed);
    }
}

/// The driver pool's part of a [`Reservations`]: what its readings of the driver pool
/// have charged, and the head room of the allocations in flight.
///
/// Nothing here is held across a driver call. Readings of the driver pool's reservation
/// are taken without the lock and applied under it in the order of their tickets (a
/// reading older than one applied is dropped). Between a reading and its application the
/// driver pool may have grown by the allocations in flight: their growth is covered by
/// their head room, which stays taken (in `room`) until a reading shows the growth or the
/// allocation lands. So the tally always covers the driver pool's reservation: `charged +
/// room` is at least what the driver reserves, unless the driver grew past the limit (a
/// breach, which the allocation that sees it gives back).
#[derive(Debug)]
struct PoolCharge {
    /// Bytes of the driver pool's reservation charged to the tally, as last read.
    charged: usize,
    /// The most the driver pool grew by in one allocation beyond the request rounded to
    /// the granule, so far (at least `POOL_FIRST_EXTRA`), learned from allocations that
    /// ran alone (another's growth would be taken for theirs).
    extra: usize,
    /// Head room of the allocations in flight not yet charged as growth (held in the
    /// tally; at most `taken`).
    room: usize,
    /// Head room the allocations in flight took.
    taken: usize,
    /// Allocations in flight.
    flying: usize,
    /// Allocations begun so far (an allocation ran alone when none began after it and
    /// none was in flight when it began).
    begun: u64,
    /// The newest reading applied.
    applied: u64,
}

/// The driver pool's reservation as read once, with the ticket taken before the read.
#[derive(Clone, Copy, Debug)]
struct Reading {
    ticket: u64,
    bytes: usize,
}

/// How an allocation from the driver pool ended.
#[derive(Clone, Copy, Debug)]
enum After {
    /// The driver refused it.
    Failed,
    /// It was made, but the driver pool's reservation could not be read after it.
    Unread,
    /// It was made; the reading after it, and by how much the driver pool grew beyond the
    /// request rounded to the granule.
    Read(Reading, usize),
}

/// An allocation from the driver pool in flight under a limit.
#[derive(Debug)]
struct Flight {
    /// The head room it took.
    room: usize,
    /// `begun` after it began, if it began alone.
    alone: Option<u64>,
}

/// A driver pool as [`Reservations::pool_alloc`] uses it.
pub(crate) trait PoolSide {
    /// Bytes the driver pool reserves from the device now, and bytes of its live blocks.
    fn usage(&self) -> Result<(usize, usize)>;
    /// Bytes the driver pool reserves from the device now (the first half of
    /// [`usage`](Self::usage), where the driver can read it alone).
    fn reserved(&self) -> Result<usize> {
        self.usage().map(|(r, _)| r)
    }
    /// Allocates from the driver pool.
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Frees `ptr` (just allocated by [`alloc`](Self::alloc), never used), waits for the
    /// free and gives the driver pool's idle reservation back down to `keep` bytes.
    fn undo(&self, ptr: u64, keep: usize);
}

/// A backend's reservations from the device under one limit: the page heap's handles,
/// charged when they are made and released, and the driver pool's reservation, read from
/// the driver around each allocation from it. The driver decides by how much its pool
/// grows, so under a limit an allocation that may make it grow first takes head room for
/// the growth (the request plus the most the driver added to one so far); no lock is held
/// across the driver's calls (see `PoolCharge`). Should the driver pool still grow past
/// the limit, the allocation that sees it frees its block at once, trims the driver pool
/// and fails with [`Error::LimitExceeded`] (the cache then releases and retries); the
/// peak counts what the driver reserved meanwhile, so a breach shows in the stats.
pub(crate) struct Reservations {
    tally: Tally,
    pool: Mutex<PoolCharge>,
    /// The next reading's ticket.
    tickets: AtomicU64,
}

impl core::fmt::Debug for Reservations {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Reservations")
            .field("held", &self.tally.held())
            .field("peak", &self.tally.peak())
            .field("limit", &self.tally.limit())
            .finish()
    }
}

impl Reservations {
    /// Reservations held to at most `limit` bytes (`None`: no limit; the driver pool's
    /// reservation is then not read, and only the page heap's is counted).
    pub(crate) fn new(limit: Option<usize>) -> Self {
        Self {
            tally: Tally::new(limit),
            pool: Mutex::new(PoolCharge {
                charged: 0,
                extra: POOL_FIRST_EXTRA,
                room: 0,
                taken: 0,
                flying: 0,
                begun: 0,
                applied: 0,
            }),
            tickets: AtomicU64::new(1),
        }
    }

    /// Whether there is a limit.
    #[inline]
    pub(crate) fn limited(&self) -> bool {
        self.tally.limit() != usize::MAX
    }

    /// The limit (`usize::MAX`: none).
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn limit(&self) -> usize {
        self.tally.limit()
    }

    /// Bytes charged now: the page heap's, the driver pool's as last read and the head
    /// room of allocations in flight.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.tally.held()
    }

    /// The most bytes charged at once (with a limit: the driver pool's and the page
    /// heap's reservations together).
    pub(crate) fn peak(&self) -> usize {
        self.tally.peak()
    }

    pub(crate) fn reset_peak(&self) {
        self.tally.reset_peak();
    }

    /// Takes `n` bytes for the page heap (before it makes a handle).
    pub(crate) fn take(&self, n: usize) -> Result<()> {
        self.tally.reserve(n)
    }

    /// Gives back `n` bytes the page heap took (after it released a handle, or failed to
    /// make one).
    pub(crate) fn give(&self, n: usize) {
        self.tally.release(n);
    }

    /// Allocates `bytes` from the driver pool `pool` for work on stream `stream` (its id),
    /// keeping the driver pool's and the page heap's reservations together under the
    /// limit, and telling `growth` (a recording's view of the pool, events on `tag`) what
    /// the driver pool reserves before and after: under a limit the readings the limit
    /// takes anyway, else (only while a recording runs) readings of their own. Both
    /// backends allocate from their driver pool through here, so the trace's growth and
    /// the limit's charge come from one reading.
    pub(crate) fn pool_alloc(
        &self,
        bytes: usize,
        pool: &impl PoolSide,
        growth: &PoolReservation,
        tag: &Tag,
        stream: u64,
    ) -> Result<u64> {
        let reserved = || pool.reserved().ok().map(|r| r as u64);
        if !self.limited() {
            growth.before(reserved);
            let ptr = pool.alloc(bytes)?;
            growth.after(tag, ptr, stream, reserved);
            return Ok(ptr);
        }
        let ticket = self.ticket();
        let before = Reading {
            ticket,
            bytes: pool.usage()?.0,
        };
        growth.before(|| Some(before.bytes as u64));
        let flight = self.take_off(bytes, before)?;
        let ptr = match pool.alloc(bytes) {
            Ok(p) => p,
            Err(e) => {
                self.land(flight, After::Failed);
                return Err(e);
            }
        };
        let ticket = self.ticket();
        let after = match pool.usage() {
            Ok((now, _)) => {
                let extra = now.saturating_sub(before.bytes.saturating_add(granules(bytes)));
                After::Read(Reading { ticket, bytes: now }, extra)
            }
            Err(_) => After::Unread,
        };
        let held = self.tally.held();
        if self.land(flight, after) {
            if let After::Read(a, _) = after {
                growth.after(tag, ptr, stream, || Some(a.bytes as u64));
            }
            return Ok(ptr);
        }
        // The driver grew past the limit: give the block and the growth back.
        pool.undo(ptr, before.bytes);
        self.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
        Err(Error::LimitExceeded {
            requested: bytes,
            held,
            limit: self.tally.limit(),
        })
    }

    /// The ticket of a reading of the driver pool's reservation, taken before the driver
    /// is asked.
    fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::SeqCst)
    }

    /// Begins an allocation of `bytes` from the driver pool, which read `before`: takes
    /// head room for its growth (the request rounded to the granule plus the most the
    /// driver added to a request so far, but no more than the driver pool may still grow
    /// by: its maximum size is the limit). The room is taken even when the pool's idle
    /// bytes would hold the request: they may be fragmented, and the driver then grows the
    /// pool by a whole step (32 MiB on the H200) all the same; charged nothing, that growth
    /// passed the limit (the simulated stress test saw 96 MiB under 64 on the H200's 16
    /// cores).
    fn take_off(&self, bytes: usize, before: Reading) -> Result<Flight> {
        let mut pc = lock(&self.pool);
        self.apply(&mut pc, before);
        let need = granules(bytes);
        let cap = self.tally.limit().saturating_sub(pc.charged);
        let room = need.saturating_add(pc.extra).min(cap).max(need);
        self.tally.reserve(room)?;
        pc.room += room;
        pc.taken += room;
        pc.flying += 1;
        pc.begun += 1;
        Ok(Flight {
            room,
            alone: (pc.flying == 1).then_some(pc.begun),
        })
    }

    /// Ends an allocation in flight: applies the driver pool's reservation read after it,
    /// learns `extra` (by how much the driver grew the pool beyond the request rounded to
    /// its granule) if it ran alone, and gives back what is left of its room. False if the
    /// tally is then past the limit (the driver grew past it).
    fn land(&self, flight: Flight, after: After) -> bool {
        let mut pc = lock(&self.pool);
        match after {
            After::Read(a, extra) => {
                // Alone: no allocation began after it, none was in flight when it began.
                if flight.alone == Some(pc.begun) {
                    pc.extra = pc.extra.max(extra);
                }
                self.apply(&mut pc, a);
            }
            // Unread, the growth may be as large as the room: the room is charged as
            // reserved until a newer reading says what the driver did.
            After::Unread => {
                let keep = flight.room.min(pc.room);
                pc.room -= keep;
                pc.charged += keep;
            }
            After::Failed => {}
        }
        pc.taken -= flight.room;
        pc.flying -= 1;
        if pc.room > pc.taken {
            self.tally.release(pc.room - pc.taken);
            pc.room = pc.taken;
        }
        self.tally.held() <= self.tally.limit()
    }

    /// Applies reading `r` of the driver pool's reservation, unless a newer one was
    /// applied. A growth is charged out of the room of the allocations in flight first
    /// (theirs), then to the tally, past the limit if need be (the driver grew anyway; the
    /// peak shows it). A fall gives back to the room what the room lent to earlier
    /// readings (the fall may be this reading missing a growth in flight, which the room
    /// must cover again), the rest to the tally.
    fn apply(&self, pc: &mut PoolCharge, r: Reading) {
        if r.ticket < pc.applied {
            return;
        }
        pc.applied = r.ticket;
        if r.bytes > pc.charged {
            let grew = r.bytes - pc.charged;
            let covered = grew.min(pc.room);
            pc.room -= covered;
            let rest = grew - covered;
            if rest > 0 && self.tally.reserve(rest).is_err() {
                self.tally.budget.charge(rest);
                self.tally.note_peak(self.tally.held());
            }
        } else {
            let fell = pc.charged - r.bytes;
            let back = fell.min(pc.taken - pc.room);
            pc.room += back;
            self.tally.release(fell - back);
        }
        pc.charged = r.bytes;
    }

    /// Reads the driver pool's reservation again (after a trim) with `reserved` (a driver
    /// call, made without the lock), which is called only under a limit.
    pub(crate) fn pool_trimmed(&self, reserved: impl FnOnce() -> Option<usize>) {
        if !self.limited() {
            return;
        }
        let ticket = self.ticket();
        if let Some(bytes) = reserved() {
            self.apply(&mut lock(&self.pool), Reading { ticket, bytes });
        }
    }
}

/// A driver pool for the tests and loom models of [`Reservations`]: it grows by `step`
/// bytes when its idle bytes do not fit a request, and checks at every change that the
/// watched [`Reservations`] cover what it reserves (and, used by one thread, that no call
/// comes while the limit's lock is held).
#[cfg(test)]
pub(crate) mod growing {
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
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::growing::Growing;
    use super::*;
    use crate::sync::global::AtomicBool;
    use std::thread;

    /// The recorder's tag of the tests' allocations (no recording runs in them).
    static TAG: Tag = Tag::new(String::new);

    const MIB: usize = 1 << 20;

    fn steps(step: usize) -> Growing<'static> {
        Growing::new(step, None, false)
    }

    #[test]
    fn the_page_heap_and_the_driver_pool_share_one_limit() {
        let r = Reservations::new(Some(64 * MIB));
        let pool = steps(2 * MIB);
        r.take(20 * MIB).unwrap();
        assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
        assert_eq!(
            r.held(),
            22 * MIB,
            "the driver pool's growth is charged, the room given back"
        );
        assert!(
            r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok(),
            "idle driver memory needs no room"
        );
        assert_eq!(r.held(), 22 * MIB);
        r.take(40 * MIB).unwrap();
        // 2 MiB of room are left; a growth may take 4 + 30 MiB.
        assert!(matches!(
            r.pool_alloc(4 * MIB, &pool, &PoolReservation::new(), &TAG, 0),
            Err(Error::LimitExceeded { .. })
        ));
        assert_eq!(
            pool.usage().unwrap(),
            (2 * MIB, 2 * MIB),
            "the driver was not asked"
        );
        assert!(
            r.take(4 * MIB).is_err(),
            "the page heap sees the driver pool's part"
        );
        r.give(40 * MIB);
        assert!(r.take(44 * MIB).is_err());
        assert!(r.take(42 * MIB).is_ok());
        assert_eq!(r.peak(), 64 * MIB);
    }

    #[test]
    fn a_growth_past_the_limit_is_given_back_and_shows_in_the_peak() {
        // The driver grows by 48 MiB where 32 MiB of room were taken.
        let r = Reservations::new(Some(64 * MIB));
        let pool = steps(48 * MIB);
        r.take(20 * MIB).unwrap();
        assert!(matches!(
            r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0),
            Err(Error::LimitExceeded { .. })
        ));
        assert_eq!(
            pool.usage().unwrap(),
            (0, 0),
            "the block and the growth went back"
        );
        assert_eq!(r.held(), 20 * MIB);
        assert_eq!(r.peak(), 68 * MIB, "the breach is counted");
        // Learned: the next allocation asks for 48 MiB of room first, and fails cleanly.
        assert!(r
            .pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0)
            .is_err());
        assert_eq!(pool.usage().unwrap(), (0, 0));
        r.give(20 * MIB);
        assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
        assert_eq!(r.held(), 48 * MIB);
    }

    #[test]
    fn the_room_is_capped_by_what_the_driver_pool_may_still_grow_by() {
        // Under a 16 MiB limit the driver pool (its maximum size is the limit) grows by at
        // most 16 MiB: the room asked for is no more.
        let r = Reservations::new(Some(16 * MIB));
        let pool = steps(16 * MIB);
        assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
        assert_eq!(r.held(), 16 * MIB);
    }

    #[test]
    fn without_a_limit_the_driver_pool_is_not_read() {
        let r = Reservations::new(None);
        let pool = steps(32 * MIB);
        assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
        assert_eq!(r.held(), 0);
        r.take(8 * MIB).unwrap();
        assert_eq!((r.held(), r.peak()), (8 * MIB, 8 * MIB));
    }

    #[test]
    fn the_driver_pool_is_asked_without_the_limits_lock() {
        let r = Reservations::new(Some(64 * MIB));
        let pool = Growing::new(16 * MIB, Some(&r), true);
        for _ in 0..20 {
            r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0)
                .unwrap();
        }
        assert_eq!(r.held(), 32 * MIB);
        pool.free(20 * MIB);
        pool.trim_to(0);
        r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
        assert_eq!(r.held(), 0, "the trim gave the idle steps back");
    }

    /// Threads allocate and free under a limit at once: at every driver call the
    /// reservations cover what the driver pool reserves (checked by the pool, with its
    /// state locked), no allocation breaches the limit (each growth fits its room), and
    /// once all have landed the tally holds exactly the driver pool's reservation.
    #[test]
    fn threads_under_a_limit_keep_the_driver_pool_covered() {
        let r = Reservations::new(Some(256 * MIB));
        let pool = Growing::new(32 * MIB, Some(&r), false);
        let refused = AtomicBool::new(false);
        let made: usize = thread::scope(|s| {
            let workers: Vec<_> = (0..8)
                .map(|t| {
                    let (r, pool, refused) = (&r, &pool, &refused);
                    s.spawn(move || {
                        let mut made = 0;
                        for i in 0..300 {
                            let bytes = (1 + (t + i) % 8) * MIB;
                            let got = r.pool_alloc(bytes, pool, &PoolReservation::new(), &TAG, 0);
                            match got {
                                Ok(_) => {
                                    made += 1;
                                    pool.free(bytes);
                                }
                                Err(Error::LimitExceeded { .. }) => refused.store(true, Ordering::Relaxed),
                                Err(e) => panic!("{e}"),
                            }
                            if i % 37 == t {
                                pool.trim_to(0);
                                r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
                            }
                        }
                        made
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert!(made > 8 * 150, "{made} of 2400 allocations made");
        assert!(r.peak() <= 256 * MIB, "breached: peak {}", r.peak());
        r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
        assert_eq!(r.held(), lock(&pool.state).reserved, "refused some: {refused:?}");
    }

    /// The order the loom model reaches only past its preemption bound, played out by
    /// hand: A's growth is charged out of its room by a reading taken after it (but
    /// ticketed earlier); then a reading ticketed later but taken before the growth says
    /// the pool is smaller. The room that reading gives back must stay with A, or the tally
    /// no longer covers the driver pool while A is in flight.
    #[test]
    fn a_reading_from_before_a_growth_in_flight_keeps_its_room() {
        let r = Reservations::new(Some(128 * MIB));
        let read = |bytes| Reading {
            ticket: r.ticket(),
            bytes,
        };
        let a = r.take_off(MIB, read(0)).unwrap();
        assert_eq!(r.held(), 32 * MIB, "A's room: its request and 30 MiB");
        let after_growth = r.ticket();
        let before_growth = read(0);
        // A's allocation grows the driver pool by 32 MiB.
        r.apply(
            &mut lock(&r.pool),
            Reading {
                ticket: after_growth,
                bytes: 32 * MIB,
            },
        );
        r.apply(&mut lock(&r.pool), before_growth);
        assert_eq!(r.held(), 32 * MIB, "A's growth is still covered");
        assert!(r.land(a, After::Read(read(32 * MIB), 0)));
        assert_eq!(r.held(), 32 * MIB, "charged as read after A, no room left");
    }
}
