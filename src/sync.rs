//! The one place that imports synchronization primitives: `std` normally, loom's
//! model-checked versions under `--cfg loom`. Every other module imports from here.
#![allow(unused_imports, dead_code)]

#[cfg(loom)]
pub(crate) use loom::{
    cell::UnsafeCell,
    sync::{
        atomic::{fence, AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    thread,
};

#[cfg(not(loom))]
pub(crate) use std::{
    sync::{
        atomic::{fence, AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard, Weak,
    },
    thread,
};

/// `std`'s `UnsafeCell` with loom's closure-based access API, so model code and real
/// code are the same text.
#[cfg(not(loom))]
#[derive(Debug, Default)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
#[allow(dead_code)]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Locks a mutex, recovering the data if another thread panicked while holding it: the
/// structures behind our locks keep their invariants between statements, and an
/// allocator must not turn one panic into a poisoned process.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(loom)]
    {
        m.lock().unwrap()
    }
    #[cfg(not(loom))]
    {
        global::lock(m)
    }
}

/// Locks a mutex if no thread holds it now (`None` if one does), recovering the data as
/// [`lock`] does.
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        // loom's mutex answers with `std`'s error type too.
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Declares a thread-local with a `const` initializer: `std`'s `thread_local!` normally
/// (const-initialized, no lazy-init check on access), loom's under `--cfg loom` (whose
/// thread-locals are per model thread and dropped when the model thread ends), so the code
/// that uses it (the pools' thread caches) is the same text in both and loom checks it.
/// Waits on `cv`, giving `guard`'s lock up meanwhile, and takes it again (poisoning
/// ignored, as [`lock`] ignores it).
pub(crate) fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    #[cfg(loom)]
    {
        cv.wait(guard).unwrap()
    }
    #[cfg(not(loom))]
    {
        cv.wait(guard).unwrap_or_else(|poison| poison.into_inner())
    }
}

macro_rules! thread_local_const {
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = $init:expr;) => {
        #[cfg(not(loom))]
        std::thread_local! { $(#[$attr])* $vis static $name: $t = const { $init }; }
        #[cfg(loom)]
        loom::thread_local! { $(#[$attr])* $vis static $name: $t = $init; }
    };
}
pub(crate) use thread_local_const;

/// Process-wide statics (driver state, global counters, the pools behind the zero-sized
/// handles) need `const` constructors, which loom's types lack; they are never part of
/// a loom model, so they always use `std`'s versions.
pub(crate) mod global {
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    /// Channels between the threads of a run (the staging pipeline's fill workers),
    /// never part of a loom model.
    pub(crate) use std::sync::mpsc;
    pub(crate) use std::sync::{Arc, Barrier, Mutex, MutexGuard, OnceLock, Weak};

    /// [`lock`](super::lock) for `std` mutexes in statics.
    pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

// The shim's rule (no source file but this one names `std::sync`, doc examples and
// `std::sync::mpsc` in tests excepted) is checked by `tools/check-sync-shim.sh`, which
// `.ci/run` runs: a check that reads the source tree cannot be a test, whose binary runs
// where the sources are not (the GPU machine). Clippy's `disallowed_types` cannot enforce
// it: it sees through re-exports, so it would flag the shim's own re-exports at every use.
