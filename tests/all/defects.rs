//! One regression test per defect of issue 12 (numbered as there). Each failed before its
//! fix. Defects 1 and 7 (the counting allocator) are tested in `counting.rs` and
//! `tests/counting_global.rs`; defect 9 on the GPU in `tests/gated.rs`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::vec::Vec;
use cudalloc::arena::{Arena, ArenaConfig};
use cudalloc::count::Counting;
use cudalloc::fence::Fence;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;
use cudalloc::PinnedAlloc;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

// ---- defect 2 -----------------------------------------------------------------------

/// While one thread asks for more than the limit in a loop, another's 8 MiB requests
/// under a 256 MiB limit must never fail (2,620 and 6,402 of 20,000 failed before: the
/// budget added the impossible request to the bytes held before comparing).
#[test]
fn defect_02_a_too_large_request_never_fails_valid_ones_on_other_threads() {
    const LIMIT: usize = 256 << 20;
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default()
            .with_limit(LIMIT)
            .with_thread_cache_capacity(0)
            .with_pending_wait(None),
    );
    let stop = AtomicBool::new(false);
    let refused = AtomicU64::new(0);
    let failures = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if pool.allocate(layout(LIMIT + 4096, 64)).is_err() {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let mut failures = 0;
        let mut rounds = 0;
        while rounds < 20_000 || refused.load(Ordering::Relaxed) < 2_000 {
            match pool.allocate(layout(8 << 20, 64)) {
                Ok(p) => {
                    // SAFETY: allocated just above with this layout.
                    unsafe { pool.deallocate(p.cast(), layout(8 << 20, 64)) };
                    // Back to the source, so that every round asks the budget again.
                    pool.trim();
                }
                Err(_) => failures += 1,
            }
            rounds += 1;
        }
        stop.store(true, Ordering::Relaxed);
        failures
    });
    assert!(refused.load(Ordering::Relaxed) > 0);
    assert_eq!(
        failures, 0,
        "valid requests failed while another thread asked for too much"
    );
    assert!(pool.stats().source_bytes <= LIMIT);
}

// ---- defect 3 -----------------------------------------------------------------------

/// Fills blocks of `size` with 0xFF and frees them, so that the next allocations of the
/// same class reuse dirty memory.
fn dirty<A: Allocator>(a: &A, size: usize, n: usize) {
    let l = layout(size, 8);
    let blocks: std::vec::Vec<_> = (0..n).map(|_| a.allocate(l).unwrap()).collect();
    for b in blocks {
        // SAFETY: the block holds b.len() bytes and is ours until freed below.
        unsafe {
            b.cast::<u8>().as_ptr().write_bytes(0xFF, b.len());
            a.deallocate(b.cast(), l);
        }
    }
}

/// `grow_zeroed` must zero every byte from the old size to the returned length.
fn grow_zeroed_zeroes_the_whole_tail<A: Allocator>(a: &A, from: usize, to: usize, what: &str) {
    dirty(a, to, 4);
    let old = layout(from, 8);
    let p = a.allocate(old).unwrap();
    // SAFETY: `p` was allocated with `old`; `to >= from`.
    let q = unsafe { a.grow_zeroed(p.cast(), old, layout(to, 8)) }.unwrap();
    // SAFETY: the returned block holds q.len() bytes.
    let bytes = unsafe { core::slice::from_raw_parts(q.cast::<u8>().as_ptr(), q.len()) };
    let dirty = bytes[from..].iter().filter(|&&b| b != 0).count();
    assert_eq!(
        dirty,
        0,
        "{what}: grow_zeroed {from} -> {to} (returned {}) left {dirty} old bytes",
        q.len()
    );
    // SAFETY: allocated above; freed with the returned length, which is allowed.
    unsafe { a.deallocate(q.cast(), layout(q.len(), 8)) };
}

#[test]
fn defect_03_grow_zeroed_zeroes_up_to_the_returned_length() {
    let pool = Pool::new(HostSource);
    // 100 -> 200 B into a reused 208 B block left 8 bytes; 8 -> 600,000 B left 2,112.
    grow_zeroed_zeroes_the_whole_tail(&pool, 100, 200, "Pool");
    grow_zeroed_zeroes_the_whole_tail(&pool, 8, 600_000, "Pool, into a large block");
    grow_zeroed_zeroes_the_whole_tail(&pool, 104, 110, "Pool, in place in the same class");
    let counting = Counting::new(&pool);
    grow_zeroed_zeroes_the_whole_tail(&&counting, 100, 200, "Counting<&Pool>");
    // The handles forward grow_zeroed to their pool (pinned with a driver, pageable
    // fallback without one).
    grow_zeroed_zeroes_the_whole_tail(&PinnedAlloc, 100, 200, "PinnedAlloc");
    grow_zeroed_zeroes_the_whole_tail(&PinnedAlloc, 8, 600_000, "PinnedAlloc, large");
}

// ---- defect 4 -----------------------------------------------------------------------

/// After `reset()`, an arena with a limit must serve what a fresh arena with the same
/// limit serves (the kept chunk counted against the limit and was not used for a request
/// larger than it).
#[test]
fn defect_04_an_arena_with_a_limit_serves_after_reset_what_a_fresh_one_serves() {
    let config = ArenaConfig::host()
        .with_first_chunk(256 << 10)
        .with_limit(1 << 20);
    let fresh = Arena::with_config(HostSource, config);
    let big = layout(900 << 10, 8);
    assert!((&fresh).allocate(big).is_ok(), "a fresh arena serves it");
    let mut arena = Arena::with_config(HostSource, config);
    drop(Vec::<u8, _>::with_capacity_in(1000, &arena));
    arena.reset();
    assert!((&arena).allocate(big).is_ok(), "after reset it must too");
    assert!(arena.allocated_bytes() <= 1 << 20);
}

// ---- defect 5 -----------------------------------------------------------------------

// Defect 5 (a fence that panics) lives in `tests/faults.rs`: it counts an error in the
// process-wide `cuda::drop_errors()`, which GPU tests of this binary assert is zero.

// ---- defect 6 -----------------------------------------------------------------------

/// A logger that keeps warnings, for the child processes below.
struct Capture(Mutex<std::vec::Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            self.0.lock().unwrap().push(r.args().to_string());
        }
    }
    fn flush(&self) {}
}

static CAPTURE: Capture = Capture(Mutex::new(std::vec::Vec::new()));

/// Runs test `name` of this binary in a child process with `env` set, returning its
/// standard output.
fn child(name: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("CUDALLOC_TEST_CHILD", "1")
        .env_remove("CUDALLOC_PINNED_LIMIT")
        .env_remove("CUDALLOC_NO_DRIVER")
        .env_remove("CUDALLOC_PINNED_GROWTH")
        .env_remove("REQUIRE_GPU");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child {name} {env:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "the child ran {name}:\n{stdout}");
    stdout
}

/// In a child: prints what the crate made of its environment, and the warnings it logged.
#[test]
fn defect_06_child_reports_the_environment() {
    if std::env::var_os("CUDALLOC_TEST_CHILD").is_none() {
        return;
    }
    log::set_logger(&CAPTURE).unwrap();
    log::set_max_level(log::LevelFilter::Warn);
    let limit = PinnedAlloc::limit();
    let driver = cudalloc::cuda::driver_available();
    let growth = cudalloc::source::PinnedGrowth::from_env();
    println!("REPORT limit={limit:?} driver={driver} growth={growth:?}");
    for w in CAPTURE.0.lock().unwrap().iter() {
        println!("WARNING {w}");
    }
}

fn report(env: &[(&str, &str)]) -> (String, usize) {
    let out = child("defects::defect_06_child_reports_the_environment", env);
    // The harness prints "test NAME ... " before the test's own output, on that line.
    let line = out
        .lines()
        .find_map(|l| l.find("REPORT ").map(|i| l[i..].to_string()))
        .expect("the child reports");
    let warnings = out.lines().filter(|l| l.starts_with("WARNING ")).count();
    (line, warnings)
}

/// Every value is used as documented, or rejected with one clear warning.
#[test]
fn defect_06_environment_variables_are_used_as_documented_or_rejected_loudly() {
    let (default, w) = report(&[]);
    assert_eq!(w, 0, "{default}");
    // `8bbbb` was read as 8 bytes. (`0` and `1` are caps like any other since issue 21
    // item 6: `PinnedAlloc::set_limit` takes them, and so does the variable.)
    for bad in ["8bbbb", "lots", "1.5G"] {
        let (r, w) = report(&[("CUDALLOC_PINNED_LIMIT", bad)]);
        assert_eq!(
            r, default,
            "CUDALLOC_PINNED_LIMIT={bad} must be rejected: the default stays"
        );
        assert_eq!(w, 1, "one warning for CUDALLOC_PINNED_LIMIT={bad}");
    }
    let (r, w) = report(&[("CUDALLOC_PINNED_LIMIT", "1")]);
    assert!(r.contains("limit=Some(1)"), "{r}");
    assert_eq!(w, 0);
    let (r, w) = report(&[("CUDALLOC_PINNED_LIMIT", "8G")]);
    assert!(r.contains(&format!("limit=Some({})", 8usize << 30)), "{r}");
    assert_eq!(w, 0);
    let (r, _) = report(&[("CUDALLOC_PINNED_LIMIT", "none")]);
    assert!(r.contains("limit=None"), "{r}");
    // `false`, `no`, `0` and empty turned the driver off.
    for off in ["false", "no", "0", ""] {
        let (r, w) = report(&[("CUDALLOC_NO_DRIVER", off)]);
        assert_eq!(w, 0, "CUDALLOC_NO_DRIVER={off:?} is valid");
        let driver = cudalloc::cuda::driver_available();
        assert!(
            r.contains(&format!("driver={driver}")),
            "CUDALLOC_NO_DRIVER={off:?} must not hide the driver: {r}"
        );
    }
    let (r, _) = report(&[("CUDALLOC_NO_DRIVER", "1")]);
    assert!(r.contains("driver=false"), "{r}");
    let (_, w) = report(&[("CUDALLOC_NO_DRIVER", "maybe")]);
    assert_eq!(w, 1, "an invalid switch is rejected with one warning");
    // The warning for a bad CUDALLOC_PINNED_GROWTH omitted `auto`.
    let out = child(
        "defects::defect_06_child_reports_the_environment",
        &[("CUDALLOC_PINNED_GROWTH", "mmap")],
    );
    let warning = out
        .lines()
        .find(|l| l.starts_with("WARNING "))
        .expect("a warning");
    for name in ["auto", "hostalloc", "register"] {
        assert!(warning.contains(name), "the warning lists {name}: {warning}");
    }
}

/// Non-UTF-8 values were treated as unset, silently.
#[cfg(unix)]
#[test]
fn defect_06_a_non_utf8_value_is_rejected_loudly() {
    use std::os::unix::ffi::OsStrExt;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "defects::defect_06_child_reports_the_environment",
        "--nocapture",
    ])
    .env("CUDALLOC_TEST_CHILD", "1")
    .env_remove("REQUIRE_GPU")
    .env("CUDALLOC_PINNED_LIMIT", std::ffi::OsStr::from_bytes(b"8G\xff"));
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("WARNING ")).count(),
        1,
        "{stdout}"
    );
}

// ---- defect 8 -----------------------------------------------------------------------

/// Strict handles refused zero-size requests without a driver, while every other
/// allocator returns a dangling pointer.
#[test]
fn defect_08_strict_handles_serve_zero_size_requests_without_a_driver() {
    for align in [1, 8, 4096, 1 << 20] {
        let l = layout(0, align);
        for (name, r) in [
            ("PinnedAlloc::strict", PinnedAlloc::strict().allocate(l)),
            (
                "ManagedAlloc::strict",
                cudalloc::ManagedAlloc::strict().allocate(l),
            ),
            ("PinnedAlloc", PinnedAlloc.allocate(l)),
        ] {
            let p = r.unwrap_or_else(|_| panic!("{name}: zero-size request at align {align}"));
            assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0, "{name}");
            // SAFETY: a zero-size block of this layout; freeing it is a no-op.
            unsafe { PinnedAlloc::strict().deallocate(p.cast(), l) };
        }
    }
}

// ---- backpressure (issue 11, item 2), host-only ----------------------------------------

/// A fence completed by another thread after `delay`.
struct Later(Arc<AtomicBool>);

// SAFETY: the flag is set only once the simulated copy is over.
unsafe impl Fence for Later {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        Ok(self.0.load(Ordering::Acquire))
    }
}

/// A staging loop that outruns its (simulated) GPU: a pool capped at 64 MiB, 50 rounds of
/// 16 MiB staged and freed while their "copies" run. The fake GPU completes the oldest copy
/// only once the pool is full of pending blocks (so the loop must wait, deterministically):
/// no `AllocError`, bytes held never above the cap; the loop waits instead.
#[test]
fn backpressure_a_full_pool_waits_for_pending_uses_instead_of_failing() {
    const CAP: usize = 64 << 20;
    const ROUND: usize = 16 << 20;
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default()
            .with_limit(CAP)
            .with_pending_wait(Some(Duration::from_secs(10))),
    );
    let host_done = AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel::<Arc<AtomicBool>>();
    let peak = std::thread::scope(|s| {
        s.spawn(|| {
            // The "stream": completes the oldest copy once the pool is full of pending
            // blocks (or the host has stopped), then the next, in order.
            for done in rx {
                let t = std::time::Instant::now();
                while pool.stats().pending_blocks < CAP / ROUND
                    && !host_done.load(Ordering::Acquire)
                    && t.elapsed() < Duration::from_secs(5)
                {
                    std::thread::sleep(Duration::from_micros(200));
                }
                std::thread::sleep(Duration::from_millis(1));
                done.store(true, Ordering::Release);
            }
        });
        let mut peak = 0;
        for round in 0..50u8 {
            let mut v: Vec<u8, _> = Vec::new_in(&pool);
            v.try_reserve_exact(ROUND)
                .unwrap_or_else(|_| panic!("round {round}: AllocError at the cap"));
            v.resize(ROUND, round);
            let done = Arc::new(AtomicBool::new(false));
            assert!(pool.record_fence(v.as_ptr(), Later(done.clone())).unwrap());
            tx.send(done).unwrap();
            drop(v); // freed while its "copy" runs: pending
            peak = peak.max(pool.stats().source_bytes);
        }
        host_done.store(true, Ordering::Release);
        drop(tx);
        peak
    });
    let s = pool.stats();
    assert!(peak <= CAP, "held {peak} bytes, above the {CAP}-byte cap");
    assert!(
        s.pending_waits > 0,
        "the loop outran the fake GPU and had to wait: {s:?}"
    );
    assert_eq!(s.failures, 0, "{s:?}");
}

/// Without backpressure (`pending_wait: None`) the same pool fails at once.
#[test]
fn backpressure_off_fails_at_once() {
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default().with_limit(32 << 20).with_pending_wait(None),
    );
    let never = Arc::new(AtomicBool::new(false));
    let mut held = std::vec::Vec::new();
    for _ in 0..2 {
        let v: Vec<u8, _> = Vec::with_capacity_in(16 << 20, &pool);
        assert!(pool.record_fence(v.as_ptr(), Later(never.clone())).unwrap());
        held.push(v);
    }
    drop(held);
    let t = std::time::Instant::now();
    let mut v: Vec<u8, _> = Vec::new_in(&pool);
    assert!(v.try_reserve_exact(16 << 20).is_err());
    assert!(t.elapsed() < Duration::from_secs(5));
    never.store(true, Ordering::Release);
}

/// Found by an audit (2026-12-07): without a driver, a request the pageable fallback
/// could not serve (here 1 PiB) counted in `fallback_allocations()` and the handles'
/// `stats().fallbacks` as an allocation served. In a child process without the driver
/// (`CUDALLOC_NO_DRIVER=1`), so that no other test's allocations move the counter and
/// the GPU machine runs it too.
#[test]
fn failed_fallback_allocations_are_not_counted_as_served() {
    if std::env::var_os("CUDALLOC_TEST_CHILD").is_none() {
        child(
            "defects::failed_fallback_allocations_are_not_counted_as_served",
            &[("CUDALLOC_NO_DRIVER", "1")],
        );
        return;
    }
    assert!(!cudalloc::cuda::driver_available());
    let before = cudalloc::fallback_allocations();
    let huge = Layout::from_size_align(1 << 50, 8).unwrap();
    assert!(cudalloc::PinnedAlloc.allocate(huge).is_err());
    assert!(cudalloc::ManagedAlloc.allocate(huge).is_err());
    assert_eq!(
        cudalloc::fallback_allocations(),
        before,
        "failures counted as served"
    );
    let small = Layout::from_size_align(64, 8).unwrap();
    let p = cudalloc::PinnedAlloc.allocate(small).unwrap();
    let served = cudalloc::fallback_allocations();
    assert!(served > before, "a block served from pageable memory is counted");
    assert_eq!(cudalloc::PinnedAlloc::stats().fallbacks, served);
    // SAFETY: allocated above with this layout, not used afterwards.
    unsafe { cudalloc::PinnedAlloc.deallocate(p.cast(), small) };
}
