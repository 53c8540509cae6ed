//! Cached memory given back at exit when the process runs under NVIDIA's
//! compute-sanitizer (issue 21, item 12): `--leak-check full` reports every block a pool
//! keeps for reuse as leaked unless the program releases it, and users run the sanitizer
//! on programs they did not write for it.
//!
//! **The sign.** Measured on the H200 machine (compute-sanitizer 2025.3.1, driver 580): the
//! program it starts sees `NV_SANITIZER_INJECTION_TRANSPORT_TYPE` (`uds`), with
//! `NV_SANITIZER_INJECTION_PORT_BASE` and the port range: the settings by which the
//! sanitizer's injected library reaches the tool, which the tool sets for each run; it did
//! not see `CUDA_INJECTION64_PATH`. So the sign is the transport variable, or
//! `CUDA_INJECTION64_PATH` naming `sanitizer` (any case) where a version injects through
//! the driver's variable (other tools inject through it too, Nsight Systems and Nsight
//! Compute with `libToolsInjection64.so`, hence the name check).
//! `CUDALLOC_RELEASE_AT_EXIT=1` (or `true`, `on`) forces the release on, `=0` (`false`,
//! `off`) forces it off, whatever the sign says.
//!
//! **The release.** The layers that own process-wide pools register a release function
//! ([`release_at_exit`]) when their first pool is made; under the sanitizer the first
//! registration also registers one `atexit` handler, which calls each function once. By
//! then `main` has returned and the main thread's caches have flushed into their pools;
//! the driver may already be torn down (a driver that fails answers with errors, which
//! the pools count in [`drop_errors`](super::drop_errors)); a panic in a release function
//! is caught and counted (in [`drop_errors`](super::drop_errors)), never unwinds
//! into C.

use crate::sync::global::{lock, AtomicU64, Mutex, OnceLock, Ordering};

/// The variable that forces the release at exit on (`1`, `true`, `on`) or off (`0`,
/// `false`, `off`).
pub(crate) const FORCE_VAR: &str = "CUDALLOC_RELEASE_AT_EXIT";
/// The variable through which the driver loads a tool's injection library.
pub(crate) const INJECTION_VAR: &str = "CUDA_INJECTION64_PATH";
/// The variable compute-sanitizer sets for its injected library's connection to the tool.
pub(crate) const TRANSPORT_VAR: &str = "NV_SANITIZER_INJECTION_TRANSPORT_TYPE";

/// Whether cached memory is released at exit, from the values of [`FORCE_VAR`],
/// [`INJECTION_VAR`] and [`TRANSPORT_VAR`] (`None`: unset). A forcing value that is
/// neither on nor off is ignored (the sign decides).
pub(crate) fn wants_release(force: Option<&str>, injection: Option<&str>, transport: Option<&str>) -> bool {
    match force.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("1" | "true" | "on" | "yes") => return true,
        Some("0" | "false" | "off" | "no") => return false,
        _ => {}
    }
    transport.is_some_and(|t| !t.is_empty())
        || injection.is_some_and(|p| p.to_ascii_lowercase().contains("sanitizer"))
}

/// [`wants_release`] over this process's environment, read once.
fn wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| {
        let force = std::env::var(FORCE_VAR).ok();
        let injection = std::env::var(INJECTION_VAR).ok();
        let transport = std::env::var(TRANSPORT_VAR).ok();
        let wanted = wants_release(force.as_deref(), injection.as_deref(), transport.as_deref());
        if wanted {
            log::info!("cudalloc: cached memory will be released at exit ({FORCE_VAR}, {INJECTION_VAR})");
        }
        wanted
    })
}

/// The release functions registered, each once.
static HOOKS: Mutex<Vec<fn()>> = Mutex::new(Vec::new());
/// Release functions that panicked at exit.
static FAILURES: AtomicU64 = AtomicU64::new(0);

/// Calls `release` at the process's exit if it runs under compute-sanitizer (or
/// [`FORCE_VAR`] says so); registering the same function again does nothing. Cheap after
/// the first call (the environment is read once); never fails: without `atexit` nothing
/// is released.
pub(crate) fn release_at_exit(release: fn()) {
    if !wanted() {
        return;
    }
    static ARMED: OnceLock<bool> = OnceLock::new();
    let armed = *ARMED.get_or_init(|| {
        // SAFETY: `atexit` is C's; `run_hooks` is an `extern "C"` function that never
        // unwinds (it catches every panic).
        unsafe { atexit(run_hooks) == 0 }
    });
    if !armed {
        log::warn!("cudalloc: atexit refused the handler: cached memory is not released at exit");
        return;
    }
    let mut hooks = lock(&HOOKS);
    if !hooks.iter().any(|&h| core::ptr::fn_addr_eq(h, release)) {
        hooks.push(release);
    }
}

/// Release functions that panicked at exit (each counted, also in
/// [`drop_errors`](super::drop_errors); none unwound).
#[cfg(all(test, not(loom)))]
fn exit_release_failures() -> u64 {
    FAILURES.load(Ordering::Relaxed)
}

extern "C" {
    fn atexit(f: extern "C" fn()) -> core::ffi::c_int;
}

/// The `atexit` handler: every registered release function once, each in `catch_unwind`.
extern "C" fn run_hooks() {
    let hooks = std::mem::take(&mut *lock(&HOOKS));
    run_each(&hooks);
}

/// Calls each of `hooks`, catching and counting panics.
fn run_each(hooks: &[fn()]) {
    for &h in hooks {
        if std::panic::catch_unwind(h).is_err() {
            FAILURES.fetch_add(1, Ordering::Relaxed);
            super::record_drop_error("releasing cached memory at exit", "a panic (caught)");
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_sanitizers_injection_library_is_the_sign() {
        let linux = "/usr/local/cuda-13.0/compute-sanitizer/libsanitizer-collection.so";
        let windows = r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0\compute-sanitizer\sanitizer-collection.dll";
        assert!(wants_release(None, Some(linux), None));
        assert!(wants_release(None, Some(windows), None));
        assert!(wants_release(None, Some("/opt/LIBSANITIZER-COLLECTION.SO"), None));
        // What the sanitizer sets on the H200 machine (2025.3.1): the transport.
        assert!(wants_release(None, None, Some("uds")));
        assert!(!wants_release(None, None, Some("")));
        // Not the sanitizer: no injection, or a profiler's.
        assert!(!wants_release(None, None, None));
        assert!(!wants_release(None, Some(""), None));
        assert!(!wants_release(
            None,
            Some("/opt/nvidia/nsight-systems/2025.1/target-linux-x64/libToolsInjection64.so"),
            None
        ));
    }

    #[test]
    fn the_variable_forces_it_on_or_off() {
        let sanitizer = Some("/cuda/compute-sanitizer/libsanitizer-collection.so");
        for on in ["1", "true", "ON", " yes "] {
            assert!(wants_release(Some(on), None, None), "{on}");
        }
        for off in ["0", "false", "Off", "no"] {
            assert!(!wants_release(Some(off), sanitizer, None), "{off}");
        }
        // Anything else: the sign decides.
        assert!(wants_release(Some("maybe"), sanitizer, None));
        assert!(!wants_release(Some(""), None, None));
    }

    #[test]
    fn a_release_that_panics_is_caught_and_counted() {
        fn fine() {}
        fn panics() {
            panic!("the driver is gone");
        }
        let before = exit_release_failures();
        run_each(&[panics, fine, panics]);
        assert_eq!(exit_release_failures(), before + 2);
    }
}
