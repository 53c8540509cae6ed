//! The one place that imports synchronization primitives: `std` normally, loom's
//! model-checked versions under `--cfg loom`. Every other module imports from here.
#![allow(unused_imports, dead_code)]

#[cfg(loom)]
pub(crate) use loom::{
    cell::UnsafeCell,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread,
};

#[cfg(not(loom))]
pub(crate) use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, Weak,
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

/// Declares a thread-local with a `const` initializer: `std`'s `thread_local!` normally
/// (const-initialized, no lazy-init check on access), loom's under `--cfg loom` (whose
/// thread-locals are per model thread and dropped when the model thread ends), so the code
/// that uses it (the pools' thread caches) is the same text in both and loom checks it.
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
    pub(crate) use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

    /// [`lock`](super::lock) for `std` mutexes in statics.
    pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

/// The shim's rule, checked: no source file but this one names `std::sync` (doc examples,
/// which are user code, and `std::sync::mpsc` channels in tests excepted). Clippy's
/// `disallowed_types` cannot enforce it: it sees through re-exports, so it would flag the
/// shim's own re-exports at every use.
#[cfg(all(test, not(loom)))]
mod tests {
    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn only_the_shim_imports_std_sync() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut offenders = Vec::new();
        for f in files.iter().filter(|f| !f.ends_with("sync.rs")) {
            let text = std::fs::read_to_string(f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.trim_start();
                if code.starts_with("//") || !code.contains("std::sync") || code.contains("std::sync::mpsc") {
                    continue;
                }
                offenders.push(format!("{}:{}: {}", f.display(), i + 1, code));
            }
        }
        assert!(files.len() > 20, "found the sources");
        assert!(
            offenders.is_empty(),
            "std::sync outside src/sync.rs:\n{}",
            offenders.join("\n")
        );
    }
}
