//! Bytes held against one limit, with the most held at once ([`Tally`]): the cache's
//! blocks held from its backend, and a backend's reservations from the device
//! ([`Reservations`]: the driver pool's and the page heap's together, so that a pool's
//! limit holds for the pool as a whole; issue 21, item 3).

use crate::budget::Budget;
use crate::error::{Error, Result};
use crate::sync::{lock, AtomicUsize, Mutex, Ordering};
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

/// The driver pool's part of a [`Reservations`].
#[derive(Debug)]
struct PoolCharge {
    /// Bytes of the driver pool's reservation charged to the tally.
    charged: usize,
    /// The most the driver pool grew by in one allocation beyond the request rounded to
    /// the granule, so far (at least `POOL_FIRST_EXTRA`).
    extra: usize,
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
/// the growth (the request plus the most the driver added to one so far), and allocations from the driver
/// pool take a lock (only under a limit: it serializes their reading of the driver
/// pool's reservation; the page heap's charges need no lock). Should the driver pool still
/// grow past the limit, the block is freed at once, the driver pool trimmed, and the
/// request fails with [`Error::LimitExceeded`] (the cache then releases and retries); the
/// peak counts what the driver reserved meanwhile, so a breach shows in the stats.
pub(crate) struct Reservations {
    tally: Tally,
    pool: Mutex<PoolCharge>,
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
            }),
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

    /// Bytes charged now: the page heap's, and the driver pool's as last read.
    #[cfg(all(test, not(loom)))]
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
        let mut pc = lock(&self.pool);
        let (before, _) = pool.usage()?;
        growth.before(|| Some(before as u64));
        self.recharge(&mut pc, before);
        let room = self.head_room(&pc, bytes, before)?;
        let ptr = match pool.alloc(bytes) {
            Ok(p) => p,
            Err(e) => {
                self.tally.release(room);
                return Err(e);
            }
        };
        let after = pool.usage().map_or(before, |(r, _)| r);
        let grew = after.saturating_sub(before);
        if self.charge_growth(&mut pc, bytes, room, grew) {
            pc.charged = after;
            growth.after(tag, ptr, stream, || Some(after as u64));
            return Ok(ptr);
        }
        // The driver grew past the limit: count it, give the block and the growth back.
        let held = self.tally.held();
        self.tally.note_peak(held + (grew - room));
        self.tally.release(room);
        pool.undo(ptr, before);
        let now = pool.usage().map_or(before, |(r, _)| r);
        self.recharge(&mut pc, now);
        Err(Error::LimitExceeded {
            requested: bytes,
            held,
            limit: self.tally.limit(),
        })
    }

    /// Charges a growth of `grew` bytes of the driver pool at an allocation of `bytes` that
    /// took `room` bytes of head room (learning the most the driver adds to a request);
    /// false when the growth does not fit under the limit (nothing more is charged).
    fn charge_growth(&self, pc: &mut PoolCharge, bytes: usize, room: usize, grew: usize) -> bool {
        if grew > 0 {
            pc.extra = pc.extra.max(grew.saturating_sub(granules(bytes)));
        }
        if grew <= room {
            self.tally.release(room - grew);
            true
        } else {
            self.tally.reserve(grew - room).is_ok()
        }
    }

    /// Head room for a driver-pool allocation of `bytes` that may make the pool grow, the
    /// pool reserving `before` bytes: the request rounded to the granule plus the most the
    /// driver added to a request so far, but no more than the driver pool may still grow
    /// by (its maximum size is the limit). Taken even when the pool's idle bytes would hold
    /// the request: they may be fragmented, and the driver then grows the pool by a whole
    /// step (32 MiB on the H200) all the same; charged nothing, that growth passed the limit
    /// (the simulated stress test saw 96 MiB under 64 on the H200's 16 cores).
    fn head_room(&self, pc: &PoolCharge, bytes: usize, before: usize) -> Result<usize> {
        let need = granules(bytes);
        let cap = self.tally.limit().saturating_sub(before);
        let want = need.saturating_add(pc.extra).min(cap).max(need);
        self.tally.reserve(want)?;
        Ok(want)
    }

    /// Charges the driver pool's reservation as `reserved` bytes (read from the driver
    /// after a trim, or before an allocation: the driver also gives memory back by
    /// itself). A growth that does not fit is charged anyway (the limit was breached; the
    /// peak shows it).
    fn recharge(&self, pc: &mut PoolCharge, reserved: usize) {
        if reserved < pc.charged {
            self.tally.release(pc.charged - reserved);
        } else if reserved > pc.charged {
            let more = reserved - pc.charged;
            if self.tally.reserve(more).is_err() {
                self.tally.budget.charge(more);
                self.tally.note_peak(self.tally.held());
            }
        }
        pc.charged = reserved;
    }

    /// Reads the driver pool's reservation again (after a trim), with `reserved`, which is
    /// called only under a limit.
    pub(crate) fn pool_trimmed(&self, reserved: impl FnOnce() -> Option<usize>) {
        if !self.limited() {
            return;
        }
        let mut pc = lock(&self.pool);
        if let Some(r) = reserved() {
            self.recharge(&mut pc, r);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::global::AtomicU64;

    /// The recorder's tag of the tests' allocations (no recording runs in them).
    static TAG: Tag = Tag::new(String::new);

    /// A driver pool that grows by `step` bytes when its idle bytes do not fit a request.
    struct Steps {
        step: usize,
        reserved: AtomicUsize,
        used: AtomicUsize,
        next: AtomicU64,
    }

    impl PoolSide for Steps {
        fn usage(&self) -> Result<(usize, usize)> {
            Ok((
                self.reserved.load(Ordering::SeqCst),
                self.used.load(Ordering::SeqCst),
            ))
        }
        fn alloc(&self, bytes: usize) -> Result<u64> {
            let (r, u) = self.usage()?;
            if r - u < bytes {
                self.reserved.fetch_add(self.step.max(bytes), Ordering::SeqCst);
            }
            self.used.fetch_add(bytes, Ordering::SeqCst);
            Ok(self.next.fetch_add(bytes as u64, Ordering::SeqCst))
        }
        fn undo(&self, _: u64, keep: usize) {
            // Frees the newest block (the tests allocate one size) and trims to `keep`.
            let u = self.used.load(Ordering::SeqCst);
            self.used.store(u.saturating_sub(MIB), Ordering::SeqCst);
            let r = self.reserved.load(Ordering::SeqCst);
            let after = keep.max(self.used.load(Ordering::SeqCst));
            self.reserved.store(r.min(after.max(keep)), Ordering::SeqCst);
        }
    }

    const MIB: usize = 1 << 20;

    fn steps(step: usize) -> Steps {
        Steps {
            step,
            reserved: AtomicUsize::new(0),
            used: AtomicUsize::new(0),
            next: AtomicU64::new(1 << 20),
        }
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
}
