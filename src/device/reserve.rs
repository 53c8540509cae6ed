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
        self.limited_alloc(bytes, pool, growth, tag, stream)
    }

    /// [`pool_alloc`](Self::pool_alloc) under a limit: head room taken first, the growth
    /// charged from the readings around the allocation, no lock across a driver call.
    fn limited_alloc(
        &self,
        bytes: usize,
        pool: &impl PoolSide,
        growth: &PoolReservation,
        tag: &Tag,
        stream: u64,
    ) -> Result<u64> {
        let ticket = self.ticket();
        let before = Reading {
            ticket,
            bytes: pool.reserved()?,
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
        let after = match pool.reserved() {
            Ok(now) => {
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
        self.pool_trimmed(|| pool.reserved().ok());
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
        pc.begun += 1;
        Ok(Flight {
            room,
            // None other in flight: its room is all the room taken (a room is at least a
            // granule: the backends never ask for 0 bytes).
            alone: (pc.taken == room).then_some(pc.begun),
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

#[cfg(test)]
pub(crate) mod growing;

#[cfg(all(test, not(loom)))]
mod tests;
