//! Helpers of the GPU tests that hold streams with gates (shared by the `all` and
//! `gated` test binaries through `#[path]`): a stream, a [`Gate`], a fill, a count of
//! wrong bytes, and the check for a second GPU.
#![allow(dead_code)] // each binary uses its own subset

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;

pub fn stream() -> Stream {
    Stream::new(0).unwrap()
}

/// A host function queued on a stream that holds the stream until the gate is opened:
/// work queued on the stream behind it waits, and so does work on other streams ordered
/// after it by events. A race test queues the late access behind a gate, queues the
/// conflicting access on another stream, lets that stream run (or sees that it cannot),
/// and only then opens the gate: the outcome does not depend on timing.
///
/// Never hangs the GPU: dropping the gate (a failing test included) opens it, and the
/// host function gives up waiting after 10 s.
pub struct Gate {
    open: Arc<(Mutex<bool>, Condvar)>,
}

impl Gate {
    /// Queues a closed gate on `stream`.
    pub fn hold(stream: &Stream) -> Gate {
        let open = Arc::new((Mutex::new(false), Condvar::new()));
        let held = open.clone();
        stream
            .launch_host_fn(move || {
                let (lock, cv) = &*held;
                let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                let _ = cv.wait_timeout_while(guard, Duration::from_secs(10), |open| !*open);
            })
            .unwrap();
        Gate { open }
    }

    /// Opens the gate: the stream goes on.
    pub fn open(&self) {
        let (lock, cv) = &*self.open;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}

/// Whether all work queued on `stream` completes within `timeout` (polled, never a
/// blocking synchronize: the stream may be held behind a closed [`Gate`]).
pub fn finishes_within(stream: &Stream, timeout: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        if stream.is_idle().unwrap() {
            return true;
        }
        if t0.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// How long a race test lets the conflicting stream run before it opens the gate: ample
/// for a 64 MiB memset (tens of microseconds on the H200) on a loaded machine.
pub const RUN_FOR: Duration = Duration::from_millis(500);

/// Queues a fill of the `len` bytes at `ptr` with `value` on `stream` (`cuMemsetD8Async`:
/// a device operation, ordered only by streams and events, unlike a copy from pageable
/// host memory, which the driver may serialize with other streams).
///
/// # Safety
/// 1. `ptr..ptr + len` is device memory of the stream's device that stays allocated until
///    the fill has run (a block the caller owns, or one whose reuse the test studies).
pub unsafe fn fill(ptr: u64, value: u8, len: usize, stream: &Stream) {
    // SAFETY: obligation 1; the host never touches device memory.
    unsafe { cudalloc::cuda::memset_d8_async(ptr, value, len, stream) }.unwrap();
}

/// The late write of a race test: queues a fill of `ptr..ptr + len` with `0xBB` on `on`,
/// says whether it finished within [`RUN_FOR`] (it must wait for the work held behind
/// `gate`), then opens the gate and waits for `other` and `on`.
///
/// # Safety
/// As for [`fill`] on `on`.
pub unsafe fn late_write(ptr: u64, len: usize, on: &Stream, gate: &Gate, other: &Stream) -> bool {
    // SAFETY: the caller's obligation, as for `fill`.
    unsafe { fill(ptr, 0xBB, len, on) };
    let ran_ahead = finishes_within(on, RUN_FOR);
    gate.open();
    other.synchronize().unwrap();
    on.synchronize().unwrap();
    ran_ahead
}

/// The first half of a race: S allocates `len` bytes of `pool`, writes 0xAA into them
/// behind a closed gate and frees them. Returns S, a second stream T, the gate and the
/// freed block's address.
pub fn written_and_freed_behind_a_gate(pool: &DevicePool, len: usize) -> (Stream, Stream, Gate, u64) {
    let (s, t) = (stream(), stream());
    let x = pool.alloc::<u8>(len, &s).unwrap();
    let gate = Gate::hold(&s);
    // SAFETY: x's block, written on its own stream; the pool frees it in S's order.
    unsafe { fill(x.device_ptr(), 0xAA, len, &s) };
    let old = x.device_ptr();
    drop(x);
    (s, t, gate, old)
}

/// How many bytes of `data` differ from `expected`.
pub fn mismatches(data: &[u8], expected: u8) -> usize {
    data.iter().filter(|&&b| b != expected).count()
}

/// Whether a test that needs `n` GPUs can run: with fewer, prints `skipped: needs n GPUs`
/// and returns false, or panics when `REQUIRE_GPUS` asks for at least `n`.
pub fn gpus(test: &str, n: usize) -> bool {
    let have = cudalloc::cuda::device_count();
    if have >= n {
        return true;
    }
    let required = std::env::var("REQUIRE_GPUS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    if required >= n {
        panic!("{test}: REQUIRE_GPUS={required} but {have} GPU(s) are available");
    }
    println!("{test}: skipped: needs {n} GPUs");
    false
}
