//! Helpers shared by the integration tests.

// Each test binary that includes this file uses a part of it.
#![allow(dead_code)]

/// Whether GPU tests should run. Without a driver: prints `skipped: no CUDA driver` and
/// returns false, or panics when `REQUIRE_GPU=1` (the GPU machine's runs).
///
/// With a driver it also arranges, once per process, for the pools' cached memory to be
/// returned before the process exits (see [`release_cached_memory_at_exit`]).
pub fn gpu_available(test: &str) -> bool {
    if cudalloc::cuda::driver_available() {
        release_cached_memory_at_exit();
        return true;
    }
    if std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: REQUIRE_GPU=1 but no CUDA driver is available");
    }
    println!("{test}: skipped: no CUDA driver");
    false
}

/// Returns from the calling test unless a GPU is available (see [`gpu_available`]).
macro_rules! gpu {
    () => {
        if !$crate::support::gpu_available(module_path!()) {
            return;
        }
    };
}

/// For tests of the driver pool's and the page heap's own behaviour (their reservations,
/// release threshold, trim, reuse of pages): with an NVTX tool attached (under
/// compute-sanitizer) a `DevicePool` takes its blocks with `cuMemAlloc` instead, the only
/// memory the tool sees inside (`cuda::nvtx`), so the test says so and returns. Run it
/// without the tool, or under it with `CUDALLOC_NVTX=0`, to test the backings.
#[allow(unused_macros)] // used by both test binaries, which share this file; not by every test file
macro_rules! backings_in_use {
    () => {
        if cudalloc::cuda::nvtx::attached() {
            println!(
                "skipped: an NVTX tool is attached, DevicePool takes its blocks with cuMemAlloc \
                 (CUDALLOC_NVTX=0 tests the backings under the tool)"
            );
            return;
        }
    };
}

/// Returns from a test that compute-sanitizer cannot run as meant (an NVTX tool is
/// attached), saying why: `under_a_sanitizer!("…")`. Two kinds: a timing race between
/// streams (the sanitizer serializes the device and waits in calls that do not wait
/// otherwise, so the race never happens; its memory accesses are still checked by the
/// rest of the run), and a kernel that faults on purpose (the sanitizer reports the trap
/// as an error of the run). Only tests/gated.rs has such tests.
#[allow(unused_macros)]
macro_rules! under_a_sanitizer {
    ($why:literal) => {
        if cudalloc::cuda::nvtx::attached() || std::env::var_os("NVTX_INJECTION64_PATH").is_some() {
            println!(concat!("skipped: under compute-sanitizer, ", $why));
            return;
        }
    };
}

/// Registers (once) an exit hook that calls `cudalloc::release_cached_memory()` and trims
/// the process-wide device pools, so that compute-sanitizer's `--leak-check full` sees
/// the pools' cached blocks returned to the driver instead of reporting each of them as
/// leaked.
///
/// Why here and how: libtest offers no hook after the last test, and the library should
/// not free memory behind a program's back at exit. A test binary that used the GPU
/// registers the hook the first time a GPU test asks for the driver (every GPU test starts
/// with `gpu!()`): `atexit` runs it when `main` returns, after every test, and before the
/// driver's own teardown (libcuda's exit handlers were registered earlier, when the driver
/// was loaded, and exit handlers run in reverse order). Under `--test-threads=1` each test
/// runs on a thread that exits before the next starts, so the per-thread caches have
/// already gone back to the pools' shared lists, which `release_cached_memory` empties
/// (after waiting for the GPU uses recorded on pending blocks).
/// `CUDALLOC_TEST_KEEP_CACHE=1` turns the hook off (to see what the pools hold at exit).
pub fn release_cached_memory_at_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("CUDALLOC_TEST_KEEP_CACHE").is_some_and(|v| v == "1") {
            return;
        }
        extern "C" fn release() {
            // A panic must not cross the C boundary (it would abort); nothing in the
            // crate panics here, but a test's fence might.
            let _ = std::panic::catch_unwind(|| {
                let released = cudalloc::release_cached_memory();
                // The device pools' caches too (release_cached_memory covers the pinned
                // and managed pools only): their blocks are device allocations the leak
                // check would report.
                for device in 0..cudalloc::cuda::device_count() {
                    if let Ok(pool) = cudalloc::device::DevicePool::get(device) {
                        pool.trim();
                    }
                }
                if std::env::var_os("CUDALLOC_TEST_VERBOSE_EXIT").is_some() {
                    eprintln!("at exit: released {released} bytes of cached pinned and managed memory");
                }
            });
        }
        extern "C" {
            fn atexit(f: extern "C" fn()) -> core::ffi::c_int;
        }
        // SAFETY: `atexit` is the C library's (std links it); `release` is a plain
        // `extern "C" fn` with no arguments that does not unwind.
        let rc = unsafe { atexit(release) };
        if rc != 0 {
            eprintln!("could not register the exit hook that releases cached memory");
        }
    });
}

/// For tests that make `cudalloc::cuda::drop_errors()` grow on purpose (fences that fail):
/// with a driver, runs the test `name` (its path in this binary, `module::test`) alone in a
/// child process and returns true, so that GPU tests of this process that assert no drop
/// errors are not disturbed; in that child, or without a driver (where no test asserts
/// that), returns false: the caller runs the test body.
pub fn in_a_child_process_with_a_driver(name: &str) -> bool {
    cudalloc::cuda::driver_available() && in_a_child_process(name)
}

/// For tests that change process-wide settings (the pinned cap): runs the test `name`
/// (its path in this binary, `module::test`) alone in a child process and returns true;
/// in that child returns false, and the caller runs the test body.
pub fn in_a_child_process(name: &str) -> bool {
    const CHILD: &str = "CUDALLOC_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("run the test in a child process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a child process: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

/// For tests of input that once allocated without bound: runs the `#[ignore]`d test `name`
/// (its path in this binary, `module::test`) alone in a child process whose address space
/// is capped at `cap_mib` MiB, so that a regression aborts the child, not the machine;
/// fails with the child's output unless it passed. The child is a process of its own,
/// so the parent passes under any number of test threads.
pub fn in_a_capped_child(name: &str, cap_mib: u64) {
    let exe = std::env::current_exe().expect("the test binary's path");
    // Where the hard limit is already lower, the lower one holds (and `ulimit` fails).
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {} 2>/dev/null; exec \"$0\" \"$@\"",
            cap_mib * 1024
        ))
        .arg(exe)
        .args([name, "--exact", "--ignored", "--test-threads=1"])
        .output()
        .expect("run the test in a capped child process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a child capped at {cap_mib} MiB: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a thread with a stack of `bytes` (a test thread's is what the harness
/// chose): a stack overflow there aborts the test binary.
pub fn on_a_stack_of<T: Send>(bytes: usize, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(bytes)
            .spawn_scoped(s, f)
            .expect("spawn a thread")
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A pool's byte counters balance: live + cached + pending == what it holds from its source.
#[track_caller]
pub fn assert_balanced(s: &cudalloc::pool::PoolStats) {
    assert_eq!(
        s.live_bytes + s.cached_bytes + s.pending_bytes,
        s.source_bytes,
        "live + cached + pending == source: {s:?}"
    );
}

/// A waker that counts its wake-ups and unparks the thread that made it (the futures
/// tests of both test binaries).
pub(crate) struct CountingWaker {
    pub(crate) wakes: std::sync::atomic::AtomicUsize,
    thread: std::thread::Thread,
}

impl std::task::Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wakes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// A counting waker for the calling thread, and the waker itself.
pub(crate) fn counting() -> (std::sync::Arc<CountingWaker>, std::task::Waker) {
    let c = std::sync::Arc::new(CountingWaker {
        wakes: std::sync::atomic::AtomicUsize::new(0),
        thread: std::thread::current(),
    });
    (c.clone(), std::task::Waker::from(c))
}

/// Polls `f` once with `waker`.
pub(crate) fn poll<F: std::future::Future + Unpin>(
    f: &mut F,
    waker: &std::task::Waker,
) -> std::task::Poll<F::Output> {
    std::pin::Pin::new(f).poll(&mut std::task::Context::from_waker(waker))
}
