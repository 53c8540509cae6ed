//! A cap on bytes held from a source, which several allocators may share: the process-wide
//! pinned pools share one, every managed source shares one (90% of device memory), and
//! each `Pool` has one unless it is given a shared one.

use crate::error::{Error, Result};
use crate::sync::{AtomicUsize, Ordering};

/// Bytes held against a limit. `reserve` succeeds only if the bytes fit *and* takes them
/// in one atomic step, so a request that cannot fit never makes others fail.
pub(crate) struct Budget {
    /// `usize::MAX`: no limit.
    limit: AtomicUsize,
    // held == sum of the bytes reserved and not released; held <= limit when reserved
    // (a lowered limit may leave held above it until memory is released).
    held: AtomicUsize,
}

impl Budget {
    pub(crate) fn new(limit: Option<usize>) -> Self {
        Self {
            limit: AtomicUsize::new(limit.unwrap_or(usize::MAX)),
            held: AtomicUsize::new(0),
        }
    }

    pub(crate) fn limit(&self) -> Option<usize> {
        match self.limit.load(Ordering::Relaxed) {
            usize::MAX => None,
            n => Some(n),
        }
    }

    pub(crate) fn set_limit(&self, limit: Option<usize>) {
        self.limit.store(limit.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if `held + n <= limit`; otherwise changes nothing and says why.
    /// (Adding first and undoing on failure, as an earlier version did, let a request too
    /// large to ever fit make concurrent valid requests fail: they saw its bytes held.)
    pub(crate) fn reserve(&self, n: usize) -> Result<()> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut held = self.held.load(Ordering::Relaxed);
        loop {
            match held.checked_add(n) {
                Some(after) if after <= limit => {}
                _ => {
                    return Err(Error::LimitExceeded {
                        requested: n,
                        held,
                        limit,
                    })
                }
            }
            match self
                .held
                .compare_exchange_weak(held, held + n, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => held = now,
            }
        }
    }

    /// Counts `n` more bytes as held even past the limit (memory that was taken anyway,
    /// such as a driver pool's growth that the driver decided on).
    pub(crate) fn charge(&self, n: usize) {
        self.held.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn release(&self, n: usize) {
        let before = self.held.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(before >= n, "budget released {n} bytes with {before} held");
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn reserve_takes_only_what_fits() {
        let b = Budget::new(Some(100));
        assert!(b.reserve(60).is_ok());
        assert!(matches!(
            b.reserve(41),
            Err(Error::LimitExceeded {
                requested: 41,
                held: 60,
                limit: 100
            })
        ));
        assert_eq!(b.held(), 60, "a refused request leaves nothing held");
        assert!(b.reserve(40).is_ok());
        b.release(100);
        assert!(b.reserve(usize::MAX).is_err());
        assert_eq!(Budget::new(None).limit(), None);
    }

    /// Issue 12, defect 2: while one thread asks for more than the limit in a loop, a
    /// request that fits must never fail. With add-then-check it failed thousands of times.
    #[test]
    fn an_impossible_request_never_fails_a_possible_one() {
        use crate::sync::global::{Arc, AtomicBool, AtomicU64};
        let b = Arc::new(Budget::new(Some(256 << 20)));
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicU64::new(0));
        let hog = std::thread::spawn({
            let (b, stop, refused) = (b.clone(), stop.clone(), refused.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    if b.reserve((256 << 20) + 4096).is_err() {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        let mut failures = 0;
        let mut rounds = 0u64;
        // Overlap the two threads for a while (at least 20,000 refusals on the other side).
        while rounds < 200_000 || refused.load(Ordering::Relaxed) < 20_000 {
            match b.reserve(8 << 20) {
                Ok(()) => b.release(8 << 20),
                Err(_) => failures += 1,
            }
            rounds += 1;
            if rounds > 50_000_000 {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        hog.join().unwrap();
        assert!(refused.load(Ordering::Relaxed) > 0);
        assert_eq!(
            failures, 0,
            "valid requests failed while another thread asked for too much"
        );
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use crate::sync::{thread, Arc};

    /// Every interleaving: a request that fits succeeds while another that never fits runs.
    #[test]
    fn loom_budget_impossible_request_never_fails_a_possible_one() {
        loom::model(|| {
            let b = Arc::new(Budget::new(Some(100)));
            let hog = {
                let b = b.clone();
                thread::spawn(move || assert!(b.reserve(101).is_err()))
            };
            assert!(b.reserve(100).is_ok());
            hog.join().unwrap();
            assert_eq!(b.held(), 100);
        });
    }
}
