//! How many idle bytes a device cache keeps at a miss when 1/32 of the live bytes is less: an
//! allowance learned from the misses, not a fixed floor. It grows only when the cache
//! missed a class it had given back lately (a block a larger allowance would have kept:
//! a *regret*), shrinks at misses of classes it had not given back, and never exceeds
//! twice the most bytes of cached classes the program had live (nor the cap, 64 MiB by
//! default): a small program's cache holds little, a repeating one learns to keep what it
//! re-requests.

use crate::device::size_class::{class_of, class_size};
use crate::sync::{lock, AtomicUsize, Mutex, Ordering};

/// A miss of a class not given back lately takes 1/2^DECAY_SHIFT of its class size off
/// the allowance: the allowance grows while more than about 1 miss in 1 + 2^DECAY_SHIFT
/// is a regret.
const DECAY_SHIFT: u32 = 2;

/// The allowance is at most this many times the most class bytes a miss saw live: a
/// repeating program re-requests at the start of a step its live blocks of the step's
/// peak and the blocks it freed on the way there (workspaces, gradients). Measured on a
/// training-like loop (`tests/all/device_policy.rs`): 1x missed 9 blocks a step where
/// the fixed 64 MiB floor missed 3; 2x misses as few; 3x let RMM's random trace keep
/// 64 MiB idle again (1.53x reserved on the simulated GPU instead of 1.47x).
const WORKING_SET_MULTIPLE: usize = 2;

/// The learned idle allowance of a cache. See the [module docs](self).
pub(super) struct IdleAllowance {
    /// The allowance, read with no lock at every miss that may release (`learner.allow`
    /// mirrored by every update under the lock).
    allow: AtomicUsize,
    // class_held == bytes of class blocks held from the backend (live, idle, pending)
    class_held: AtomicUsize,
    // peak_live >= every class_held - idle a miss has seen: the program's working set of
    // cached classes
    peak_live: AtomicUsize,
    learner: Mutex<Learner>,
}

/// The allowance's state under its lock.
struct Learner {
    // allow <= min(cap, WORKING_SET_MULTIPLE * peak_live as of its last growth)
    allow: usize,
    /// The most the allowance may reach (`Settings::idle_cap`); also how recent (in bytes
    /// given back since) a release must be for a miss of its class to be a regret.
    cap: usize,
    /// Bytes the release policy gave back so far: the clock of the ghosts.
    clock: u64,
    /// Per cached class: the clock after the latest release of a block of that class and
    /// how many such blocks were given back and not yet missed (the class's ghosts).
    ghosts: Vec<(u64, u32)>,
    /// Misses that were regrets, and misses that were not (for tests and tuning).
    regrets: u64,
    cold: u64,
}

impl IdleAllowance {
    /// An allowance starting at `start`, at most `cap`, for the classes serving requests
    /// up to `max_cached_bytes`.
    pub(super) fn new(start: usize, cap: usize, max_cached_bytes: usize) -> Self {
        let classes = if max_cached_bytes == 0 {
            0
        } else {
            class_of(max_cached_bytes) + 1
        };
        let start = start.min(cap);
        Self {
            allow: AtomicUsize::new(start),
            class_held: AtomicUsize::new(0),
            // A starting allowance stands for a working set seen before.
            peak_live: AtomicUsize::new(start),
            learner: Mutex::new(Learner {
                allow: start,
                cap,
                clock: 0,
                ghosts: vec![(0, 0); classes],
                regrets: 0,
                cold: 0,
            }),
        }
    }

    /// The idle bytes a miss tolerates where 1/32 of the live bytes is less.
    #[inline]
    pub(super) fn allowance(&self) -> usize {
        self.allow.load(Ordering::Relaxed)
    }

    /// A class block of `bytes` came from the backend (`true`) or went back to it.
    #[inline]
    pub(super) fn held(&self, bytes: usize, from_backend: bool) {
        if from_backend {
            self.class_held.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.class_held.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// A miss of `need` bytes (0 when not of a class) saw `idle` bytes idle: the class
    /// blocks held less those are live.
    #[inline]
    pub(super) fn saw_idle(&self, idle: usize, need: usize) {
        let live = self.class_held.load(Ordering::Relaxed).saturating_sub(idle) + need;
        if live > self.peak_live.load(Ordering::Relaxed) {
            self.peak_live.fetch_max(live, Ordering::Relaxed);
        }
    }

    /// The most class bytes a miss saw live (a test's view).
    #[cfg(all(test, not(loom)))]
    fn saw_live(&self, live: usize) {
        self.peak_live.fetch_max(live, Ordering::Relaxed);
    }

    /// The release policy gave back blocks of these classes.
    pub(super) fn released(&self, classes: impl IntoIterator<Item = usize>) {
        let mut l = lock(&self.learner);
        for c in classes {
            l.clock += class_size(c) as u64;
            let clock = l.clock;
            if let Some(g) = l.ghosts.get_mut(c) {
                *g = (clock, g.1.saturating_add(1));
            }
        }
    }

    /// A block of `class` comes from the backend: a regret if the policy gave one back
    /// within the last `cap` bytes it gave back (the allowance grows by its size, up to
    /// twice the program's peak of live class bytes and the cap), else the allowance
    /// shrinks by a quarter of its size.
    pub(super) fn missed(&self, class: usize) {
        let peak = self.peak_live.load(Ordering::Relaxed);
        let mut l = lock(&self.learner);
        let (clock, cap) = (l.clock, l.cap);
        let size = class_size(class);
        let regret = match l.ghosts.get_mut(class) {
            Some((at, n)) if *n > 0 && clock - *at <= cap as u64 => {
                *n -= 1;
                true
            }
            _ => false,
        };
        l.allow = if regret {
            l.regrets += 1;
            let most = peak.saturating_mul(WORKING_SET_MULTIPLE).max(l.allow);
            l.allow.saturating_add(size).min(cap).min(most)
        } else {
            l.cold += 1;
            l.allow.saturating_sub(size >> DECAY_SHIFT)
        };
        self.allow.store(l.allow, Ordering::Relaxed);
    }

    /// Misses that were regrets, and misses that were not.
    #[cfg_attr(not(any(test, feature = "sim")), allow(dead_code))]
    pub(super) fn misses(&self) -> (u64, u64) {
        let l = lock(&self.learner);
        (l.regrets, l.cold)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_class_missed_after_its_release_grows_the_allowance() {
        let a = IdleAllowance::new(0, 64 * MIB, 1 << 30);
        let c = class_of(MIB);
        a.saw_live(16 * MIB);
        a.missed(c);
        assert_eq!((a.allowance(), a.misses()), (0, (0, 1)), "a first miss is cold");
        a.released([c, c]);
        a.missed(c);
        a.missed(c);
        assert_eq!(a.allowance(), 2 * MIB);
        assert_eq!(a.misses(), (2, 1));
        a.missed(c);
        assert_eq!(a.allowance(), 2 * MIB - MIB / 4, "no ghost left: cold");
    }

    #[test]
    fn the_allowance_stays_below_twice_the_peak_live_bytes_and_the_cap() {
        let a = IdleAllowance::new(0, 6 * MIB, 1 << 30);
        let c = class_of(MIB);
        a.saw_live(MIB);
        for _ in 0..4 {
            a.released([c]);
            a.missed(c);
        }
        assert_eq!(a.allowance(), 2 * MIB, "twice the peak of live bytes");
        a.saw_live(100 * MIB);
        for _ in 0..8 {
            a.released([c]);
            a.missed(c);
        }
        assert_eq!(a.allowance(), 6 * MIB, "the cap");
    }

    #[test]
    fn an_old_release_is_no_regret() {
        let a = IdleAllowance::new(0, 4 * MIB, 1 << 30);
        let (c, big) = (class_of(MIB), class_of(MIB + MIB / 2));
        a.saw_live(64 * MIB);
        a.released([c]);
        a.released([big, big, big]);
        a.missed(c);
        assert_eq!(a.misses(), (0, 1), "4.5 MiB released since: older than the cap");
        a.missed(big);
        assert_eq!(a.misses(), (1, 1));
    }
}
