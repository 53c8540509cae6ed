//! The threads of one pool: each thread's cache publishes its counters in a block of its
//! own (written by that thread only, read by the pool's statistics and reclaim requests),
//! registered here while the thread lives; what a thread served is kept in the totals
//! when it exits. One registry for the host pools and the device pools (the other half of
//! the per-thread machinery, the thread-local table, is in `slot_table.rs`); the thread
//! caches themselves and their counters stay apart, keyed differently.

use crate::sync::{lock, Arc, Mutex};

/// What one thread publishes for its pool.
pub(crate) trait ThreadCounters: Default + Send + Sync {
    /// The allocations the thread's cache served so far.
    fn served(&self) -> u64;
}

/// The registered threads of one pool.
pub(crate) struct ThreadRegistry<T> {
    inner: Mutex<Registered<T>>,
}

struct Registered<T> {
    live: Vec<Arc<T>>,
    // retired == sum of served() of the counters retired so far
    retired: u64,
}

/// What [`ThreadRegistry::visit`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Visited {
    /// Allocations served by every thread of the pool, exited ones included.
    pub(crate) served: u64,
    /// Threads registered now.
    pub(crate) threads: usize,
}

impl<T: ThreadCounters> ThreadRegistry<T> {
    pub(crate) fn new() -> Self {
        Self {
            inner: Mutex::new(Registered {
                live: Vec::new(),
                retired: 0,
            }),
        }
    }

    /// Counters for a new thread, registered until [`retire`](Self::retire).
    pub(crate) fn register(&self) -> Arc<T> {
        let counters = Arc::new(T::default());
        lock(&self.inner).live.push(counters.clone());
        counters
    }

    /// Stops reading a thread's counters (it exits), keeping what it served in the totals.
    /// Its counters must not change afterwards.
    pub(crate) fn retire(&self, counters: &Arc<T>) {
        let mut r = lock(&self.inner);
        let before = r.live.len();
        r.live.retain(|c| !Arc::ptr_eq(c, counters));
        if r.live.len() < before {
            r.retired += counters.served();
        }
    }

    /// Runs `f` with every registered thread's counters under the registry's lock (no
    /// thread registers or retires meanwhile; `f` takes no other lock of the pool).
    pub(crate) fn locked<R>(&self, f: impl FnOnce(&[Arc<T>]) -> R) -> R {
        f(&lock(&self.inner).live)
    }

    /// Runs `f` with every registered thread's counters under the registry's lock (no
    /// thread registers or retires meanwhile; `f` takes no other lock of the pool), then
    /// retires those for which `stay` says no, keeping what they served in the totals.
    pub(crate) fn sweep<R>(&self, f: impl FnOnce(&[Arc<T>]) -> R, mut stay: impl FnMut(&T) -> bool) -> R {
        let mut r = lock(&self.inner);
        let out = f(&r.live);
        let mut gone = 0;
        r.live.retain(|c| {
            let keep = stay(c);
            if !keep {
                gone += c.served();
            }
            keep
        });
        r.retired += gone;
        out
    }

    /// Calls `f` with every registered thread's counters (under the registry's lock: `f`
    /// takes no other lock of the pool).
    pub(crate) fn visit(&self, mut f: impl FnMut(&T)) -> Visited {
        let r = lock(&self.inner);
        let mut served = r.retired;
        for c in &r.live {
            served += c.served();
            f(c);
        }
        Visited {
            served,
            threads: r.live.len(),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Counts(AtomicU64);

    impl ThreadCounters for Counts {
        fn served(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }

    #[test]
    fn retired_threads_stay_in_the_totals_once() {
        let r: ThreadRegistry<Counts> = ThreadRegistry::new();
        let (a, b) = (r.register(), r.register());
        a.0.store(3, Ordering::Relaxed);
        b.0.store(4, Ordering::Relaxed);
        let mut seen = 0;
        assert_eq!(
            r.visit(|_| seen += 1),
            Visited {
                served: 7,
                threads: 2
            }
        );
        assert_eq!(seen, 2);
        r.retire(&a);
        r.retire(&a); // a second retire of the same thread counts nothing
        assert_eq!(
            r.visit(|_| {}),
            Visited {
                served: 7,
                threads: 1
            }
        );
        r.retire(&b);
        assert_eq!(
            r.visit(|_| panic!("no thread left")),
            Visited {
                served: 7,
                threads: 0
            }
        );
    }
}
