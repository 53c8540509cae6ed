//! A soak: many threads allocate, copy and free for a long time, and the run fails on any
//! corrupted byte, any leaked block, or memory held that keeps growing after warm-up.
//!
//! ```text
//! cargo run --release --example soak -- --seconds 600 --threads 16      # the GPU machine
//! cargo run --release --example soak -- --seconds 30 --host-only        # CI
//! ```
//!
//! With a GPU, each thread loops over round trips through pinned, device and managed
//! memory: a pinned `Vec` is filled, copied to a `DeviceBuffer` asynchronously on one of 8
//! streams (behind a short host-function delay, so the copy is still queued), and dropped
//! at once; a new pinned block of the same size is taken and scribbled over (the pool
//! must not hand out the block the copy still reads); the device buffer is copied back
//! into a managed `Vec` and compared. Sizes run from 4 KiB to `--device-max-mib` (8 MiB by
//! default; blocks of 2 MiB and more are the page heap's, which a larger maximum makes
//! map, move and unmap chunks while other threads allocate: `--device-max-mib 64`;
//! `--device-chunk-mib 2` gives the soak a pool of its own whose heap keeps no idle chunk
//! beyond its floor, so that blocks take the handles of other blocks' chunks, moved while
//! their work may be pending). One iteration in four runs the host workload instead.
//!
//! The host workload (all of it with `--host-only` or without a driver): a `Pool` over
//! host memory (with a limit, so backpressure engages) and per-thread arenas; "copies"
//! are done by 8 fake streams, threads that read the source block after a random delay
//! and then complete its fence, so a block the pool handed out again too early shows as
//! corrupted data.
//!
//! The host pool and the pinned and managed allocators are wrapped in `Counting`, and the
//! device pool's live buffers are checked: 0 live blocks at the end. Bytes held (pinned,
//! managed, device, host pool) are sampled every second and printed every 30 s; the
//! largest after warm-up (the first third) must stay within `--max-drift-pct` (default
//! 25%, plus 32 MiB) of the largest during it. Exit status 1 on any failure.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use allocator_api2::vec::Vec as AVec;
use cudalloc::arena::{Arena, ArenaConfig};
use cudalloc::cuda::{driver_available, Stream};
use cudalloc::fence::Fence;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;
use cudalloc::{Counting, ManagedAlloc, PinnedAlloc};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

static PINNED: Counting<PinnedAlloc> = Counting::new(PinnedAlloc);
static MANAGED: Counting<ManagedAlloc> = Counting::new(ManagedAlloc);

// ---- options ----------------------------------------------------------------------------

struct Options {
    seconds: u64,
    threads: usize,
    streams: usize,
    host_only: bool,
    max_drift_pct: u64,
    report_every: u64,
    /// The largest block of a GPU round trip.
    device_max: usize,
    /// Chunks of the soak's own device pool (`None`: the process-wide pool).
    device_chunk: Option<usize>,
    /// The negative control (needs the `test-hooks` feature): the host pool reuses freed
    /// blocks at once, even while a copy still reads them; the soak must then fail.
    no_pending_list: bool,
}

fn options() -> Options {
    let mut o = Options {
        seconds: 60,
        threads: 16,
        streams: 8,
        host_only: false,
        max_drift_pct: 25,
        report_every: 30,
        device_max: 8 * MIB,
        device_chunk: None,
        no_pending_list: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage(&format!("{name} takes a number")))
        };
        match a.as_str() {
            "--seconds" => o.seconds = value("--seconds").max(1),
            "--threads" => o.threads = value("--threads").max(1) as usize,
            "--streams" => o.streams = value("--streams").max(1) as usize,
            "--max-drift-pct" => o.max_drift_pct = value("--max-drift-pct"),
            "--report-every" => o.report_every = value("--report-every").max(1),
            "--device-max-mib" => o.device_max = (value("--device-max-mib").clamp(1, 1024) as usize) * MIB,
            "--device-chunk-mib" => {
                o.device_chunk = Some((value("--device-chunk-mib").clamp(1, 1024) as usize) * MIB)
            }
            "--host-only" => o.host_only = true,
            "--no-pending-list" if cfg!(feature = "test-hooks") => o.no_pending_list = true,
            "--bench" => {} // cargo bench passes it; nothing to do
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    // Short runs report more often, so that warm-up and the rest have samples.
    o.report_every = o.report_every.min((o.seconds / 6).max(1));
    o
}

fn usage(why: &str) -> ! {
    if !why.is_empty() {
        eprintln!("soak: {why}");
    }
    eprintln!(
        "usage: soak [--seconds N (60)] [--threads T (16)] [--streams S (8)] [--host-only] \
         [--max-drift-pct P (25)] [--report-every SECS (30)] [--device-max-mib M (8)] \
         [--device-chunk-mib C (the process-wide pool)] \
         [--no-pending-list (negative control; needs --features test-hooks)]"
    );
    std::process::exit(2)
}

// ---- shared tallies ---------------------------------------------------------------------

/// What went wrong and what was done, over all threads.
#[derive(Default)]
struct Tally {
    corrupted_bytes: AtomicU64,
    errors: AtomicU64,
    gpu_round_trips: AtomicU64,
    host_round_trips: AtomicU64,
    arena_batches: AtomicU64,
    bytes_checked: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Tally {
    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_error.lock().unwrap();
        if first.is_none() {
            eprintln!("soak: error: {what}");
            *first = Some(what);
        }
    }
    fn corrupted(&self, n: u64, what: &str) {
        if n > 0 {
            self.corrupted_bytes.fetch_add(n, Ordering::Relaxed);
            self.error(format!("{n} corrupted bytes in {what}"));
        }
    }
}

// ---- data -------------------------------------------------------------------------------

/// xorshift64*: a small deterministic generator per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A size spread evenly over the powers of two from `min` to `max`.
    fn size(&mut self, min: usize, max: usize) -> usize {
        let (lo, hi) = (min.ilog2(), max.ilog2());
        let base = 1usize << (lo + self.below((hi - lo + 1) as u64) as u32);
        (base + self.below(base as u64) as usize).clamp(min, max)
    }
}

fn pattern(i: usize, seed: u64) -> u8 {
    (i as u64)
        .wrapping_mul(0x9E37)
        .wrapping_add(seed)
        .wrapping_add((i >> 12) as u64) as u8
}

fn fill(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(i, seed);
    }
}

fn mismatches(buf: &[u8], seed: u64) -> u64 {
    buf.iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(i, seed))
        .count() as u64
}

// ---- fake streams (the host workload's "GPU") --------------------------------------------

/// A fence completed by a fake stream once its copy has read the source.
struct Flag(Arc<AtomicBool>);

// SAFETY: the fake stream sets the flag only after its last read of the block.
unsafe impl Fence for Flag {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        Ok(self.0.load(Ordering::Acquire))
    }
}

/// A copy for a fake stream: after `delay`, read `len` bytes at `src` into a new buffer,
/// complete the fence, and send the buffer back.
struct FakeCopy {
    src: usize,
    len: usize,
    delay: Duration,
    done: Arc<AtomicBool>,
    reply: mpsc::Sender<Vec<u8>>,
}

/// Fake streams: threads that run their copies in order, each after a random delay.
struct FakeStreams {
    queues: Vec<mpsc::Sender<FakeCopy>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl FakeStreams {
    fn new(n: usize) -> Self {
        let (queues, threads) = (0..n)
            .map(|_| {
                let (tx, rx) = mpsc::channel::<FakeCopy>();
                let t = std::thread::spawn(move || {
                    for c in rx {
                        std::thread::sleep(c.delay);
                        // SAFETY: the block at `src` was filled before the copy was queued
                        // (the channel orders it), its use is recorded with `done`, and
                        // its allocator keeps it from reuse (and from the source) until
                        // `done` is set below, after this last read.
                        let copy = unsafe { std::slice::from_raw_parts(c.src as *const u8, c.len) }.to_vec();
                        c.done.store(true, Ordering::Release);
                        let _ = c.reply.send(copy);
                    }
                });
                (tx, t)
            })
            .unzip();
        Self { queues, threads }
    }

    /// Queues a copy of `src` on stream `k`, its use recorded with a fence; returns the
    /// channel its copy comes back on, and the fence's flag.
    fn copy(
        &self,
        k: usize,
        src: &[u8],
        delay: Duration,
    ) -> Result<(mpsc::Receiver<Vec<u8>>, Arc<AtomicBool>), String> {
        let done = Arc::new(AtomicBool::new(false));
        match cudalloc::record_fence(src.as_ptr(), Flag(done.clone())) {
            Ok(true) => {}
            Ok(false) => return Err("record_fence: the block belongs to no allocator of the crate".into()),
            Err(e) => return Err(format!("record_fence: {e}")),
        }
        let (reply, rx) = mpsc::channel();
        self.queues[k % self.queues.len()]
            .send(FakeCopy {
                src: src.as_ptr() as usize,
                len: src.len(),
                delay,
                done: done.clone(),
                reply,
            })
            .map_err(|_| "a fake stream is gone")?;
        Ok((rx, done))
    }

    fn join(self) {
        drop(self.queues);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn wait_copy(rx: &mpsc::Receiver<Vec<u8>>) -> Result<Vec<u8>, String> {
    rx.recv_timeout(Duration::from_secs(60))
        .map_err(|e| format!("a fake copy did not come back: {e}"))
}

// ---- the host workload ------------------------------------------------------------------

type HostPool = Pool<HostSource>;

/// One round trip through the host pool: fill, "copy" on a fake stream, free at once,
/// take and scribble over a block of the same size, then check the copy.
fn host_round_trip(
    pool: &Counting<&HostPool>,
    fake: &FakeStreams,
    rng: &mut Rng,
    tally: &Tally,
) -> Result<(), String> {
    let n = rng.size(256, 2 * MIB);
    let seed = rng.next();
    let mut src: AVec<u8, _> = AVec::new_in(pool);
    src.try_reserve_exact(n)
        .map_err(|e| format!("host pool: {n} bytes: {e}"))?;
    src.resize(n, 0);
    fill(&mut src, seed);
    let delay = Duration::from_micros(rng.below(3000));
    let (rx, _) = fake.copy(rng.next() as usize, &src, delay)?;
    drop(src); // freed while the copy is queued: the pool must keep it pending
    let mut other: AVec<u8, _> = AVec::new_in(pool);
    other
        .try_reserve_exact(n)
        .map_err(|e| format!("host pool: {n} bytes: {e}"))?;
    other.resize(n, 0xEE);
    let copy = wait_copy(&rx)?;
    tally.corrupted(mismatches(&copy, seed), "a host pool round trip");
    tally.bytes_checked.fetch_add(n as u64, Ordering::Relaxed);
    tally.host_round_trips.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// One batch in a thread's arena: a few vectors, one "copied" on a fake stream, then a
/// reset, which must wait for that copy before the memory is reused.
fn arena_batch(
    arena: &mut Arena<HostSource>,
    fake: &FakeStreams,
    rng: &mut Rng,
    tally: &Tally,
) -> Result<(), String> {
    let seed = rng.next();
    let n = rng.size(64, 256 * KIB);
    let (rx, done) = {
        let counting = Counting::new(&*arena);
        let mut keep = Vec::new();
        for k in 0..1 + rng.below(6) {
            let mut v: AVec<u8, _> = AVec::new_in(&counting);
            v.try_reserve_exact(n).map_err(|e| format!("arena: {e}"))?;
            v.resize(n, 0);
            fill(&mut v, seed.wrapping_add(k));
            keep.push(v);
        }
        let staged = &keep[0];
        let copied = fake.copy(
            rng.next() as usize,
            staged,
            Duration::from_micros(rng.below(2000)),
        )?;
        for (k, v) in keep.iter().enumerate() {
            tally.corrupted(mismatches(v, seed.wrapping_add(k as u64)), "an arena block");
        }
        drop(keep);
        let s = counting.snapshot();
        if s.live_count() != 0 {
            return Err(format!("arena batch: {} blocks not freed", s.live_count()));
        }
        copied
    };
    arena.reset(); // waits for the copy's fence
    if !done.load(Ordering::Acquire) {
        return Err("Arena::reset returned before the recorded use completed".into());
    }
    let copy = wait_copy(&rx)?;
    tally.corrupted(mismatches(&copy, seed), "an arena round trip");
    tally.arena_batches.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

// ---- the GPU workload -------------------------------------------------------------------

/// The soak's only use of device memory, kept in one place (the device module may change
/// around these calls): a buffer of `src.len()` bytes from the soak's device pool (the
/// process-wide pool of device 0, or one of its own: [`device_io::use_chunks`]), filled
/// from `src` asynchronously on `stream`.
mod device_io {
    use std::sync::OnceLock;

    use cudalloc::cuda::Stream;
    use cudalloc::device::{Backing, DeviceBuffer, DevicePool, DevicePoolConfig, PageTuning};

    pub type Buffer = DeviceBuffer<u8>;

    static POOL: OnceLock<DevicePool> = OnceLock::new();

    /// Makes the soak's pool one of its own whose page heap maps chunks of `bytes` and
    /// keeps no idle chunk beyond its floor of four: a block that needs memory then takes
    /// an idle chunk's handle (moved while its work may be pending) far more often than
    /// the default tuning does. Call before the first allocation.
    /// The pool's backing: physical pages where the device has them, else the driver
    /// pool (and no chunks at all).
    pub fn use_chunks(bytes: usize) -> cudalloc::Result<Backing> {
        let config = DevicePoolConfig::default().with_pages(PageTuning::new(bytes, u32::MAX));
        let pool = DevicePool::new(0, config)?;
        let backing = pool.config().backing;
        let _ = POOL.set(pool);
        Ok(backing)
    }

    /// The soak's device pool.
    fn pool() -> cudalloc::Result<DevicePool> {
        match POOL.get() {
            Some(p) => Ok(p.clone()),
            None => DevicePool::get(0),
        }
    }

    /// # Safety
    /// 1. `src` is not written until the copy has completed on `stream`; if it is not in
    ///    a block of the crate's pools it also stays allocated until then.
    pub unsafe fn upload(src: &[u8], stream: &Stream) -> cudalloc::Result<Buffer> {
        let mut buf = pool()?.alloc::<u8>(src.len(), stream)?;
        // SAFETY: obligation 1.
        unsafe { buf.copy_from_host_async(src) }?;
        Ok(buf)
    }

    /// # Safety
    /// 1. `dst` is neither read nor written until the copy has completed on the buffer's
    ///    stream; if it is not in a block of the crate's pools it stays allocated until then.
    pub unsafe fn download(buf: &Buffer, dst: &mut [u8]) -> cudalloc::Result<()> {
        // SAFETY: obligation 1.
        unsafe { buf.copy_to_host_async(dst) }
    }

    /// Bytes the soak's device pool reserves from the device, and its live buffers.
    pub fn held() -> cudalloc::Result<(u64, u64)> {
        let s = pool()?.stats();
        Ok((s.reserved_bytes, s.live_buffers))
    }

    /// What the soak's device pool did: its stats, and its page heap's driver calls and
    /// waits (the cross-stream hand-overs and mappings the soak exercised).
    pub fn report() -> cudalloc::Result<String> {
        let pool = pool()?;
        let pages = cudalloc::testing::page_heap_counters(&pool)
            .map_or_else(|| "no page heap".to_string(), |c| format!("page heap {c}"));
        Ok(format!("{}\n  {pages}", pool.stats()))
    }

    /// Returns the soak's device pool's free memory to the device.
    pub fn trim() -> cudalloc::Result<()> {
        pool()?.trim();
        Ok(())
    }
}

/// One round trip: pinned -> device -> managed, the pinned source freed while its copy is
/// queued and its size taken again and scribbled over at once.
fn gpu_round_trip(stream: &Stream, max: usize, rng: &mut Rng, tally: &Tally) -> Result<(), String> {
    let n = rng.size(4 * KIB, max);
    let seed = rng.next();
    let mut src: AVec<u8, _> = AVec::new_in(&PINNED);
    src.try_reserve_exact(n)
        .map_err(|e| format!("pinned: {n} bytes: {e}"))?;
    src.resize(n, 0);
    fill(&mut src, seed);
    if rng.below(4) == 0 {
        // Queue a little work ahead of the copy, so it is still in flight when the pinned
        // block is freed and its size asked for again.
        let pause = Duration::from_micros(rng.below(500));
        stream
            .launch_host_fn(move || std::thread::sleep(pause))
            .map_err(|e| format!("launch_host_fn: {e}"))?;
    }
    // SAFETY: `src` is pooled pinned memory: dropping it right after is allowed (the pool
    // keeps the block until the copy completes), and nothing writes it before that.
    let buf = unsafe { device_io::upload(&src, stream) }.map_err(|e| format!("upload: {e}"))?;
    drop(src);
    let mut other: AVec<u8, _> = AVec::new_in(&PINNED);
    other
        .try_reserve_exact(n)
        .map_err(|e| format!("pinned: {n} bytes: {e}"))?;
    other.resize(n, 0xEE);
    let mut dst: AVec<u8, _> = AVec::new_in(&MANAGED);
    dst.try_reserve_exact(n)
        .map_err(|e| format!("managed: {n} bytes: {e}"))?;
    dst.resize(n, 0);
    // SAFETY: `dst` is not touched until the stream is synchronized below.
    unsafe { device_io::download(&buf, &mut dst) }.map_err(|e| format!("download: {e}"))?;
    drop(buf); // freed in stream order, after the copy back
    stream.synchronize().map_err(|e| format!("synchronize: {e}"))?;
    tally.corrupted(mismatches(&dst, seed), "a pinned -> device -> managed round trip");
    tally.bytes_checked.fetch_add(n as u64, Ordering::Relaxed);
    tally.gpu_round_trips.fetch_add(1, Ordering::Relaxed);
    drop((other, dst));
    Ok(())
}

// ---- sampling ---------------------------------------------------------------------------

/// Bytes held at one moment.
#[derive(Clone, Copy, Default)]
struct Sample {
    at: Duration,
    pinned: usize,
    managed: usize,
    device: u64,
    host_pool: usize,
}

fn sample(start: Instant, host: &HostPool, gpu: bool) -> Sample {
    let mut s = Sample {
        at: start.elapsed(),
        host_pool: host.stats().source_bytes,
        ..Sample::default()
    };
    if gpu {
        s.pinned = PinnedAlloc::stats().source_bytes;
        s.managed = ManagedAlloc::stats().source_bytes;
        s.device = device_io::held().map(|h| h.0).unwrap_or(0);
    }
    s
}

fn mib(n: u64) -> f64 {
    n as f64 / MIB as f64
}

/// The largest value after warm-up minus the largest during it, for each metric; fails
/// when one grows past the tolerance.
/// A metric: its name, how to read it from a sample, whether this run measures it.
type Metric = (&'static str, fn(&Sample) -> u64, bool);

fn drift(samples: &[Sample], warm: Duration, pct: u64, gpu: bool) -> Result<String, String> {
    let metrics: [Metric; 4] = [
        ("pinned", |s| s.pinned as u64, gpu),
        ("managed", |s| s.managed as u64, gpu),
        ("device", |s| s.device, gpu),
        ("host pool", |s| s.host_pool as u64, true),
    ];
    let (early, late): (Vec<&Sample>, Vec<&Sample>) = samples.iter().partition(|s| s.at <= warm);
    if early.is_empty() || late.is_empty() {
        return Err("too few samples to judge drift (run longer)".into());
    }
    let mut report = Vec::new();
    let mut failed = Vec::new();
    for (name, get, on) in metrics {
        if !on {
            continue;
        }
        let warm_max = early.iter().map(|s| get(s)).max().unwrap_or(0);
        let late_max = late.iter().map(|s| get(s)).max().unwrap_or(0);
        let d = late_max as i64 - warm_max as i64;
        let tolerance = warm_max / 100 * pct + 32 * MIB as u64;
        report.push(format!(
            "{name}: warm-up max {:.1} MiB, after {:.1} MiB, drift {:+.1} MiB",
            mib(warm_max),
            mib(late_max),
            d as f64 / MIB as f64
        ));
        if d > tolerance as i64 {
            failed.push(format!(
                "{name} grew {:.1} MiB after warm-up",
                d as f64 / MIB as f64
            ));
        }
    }
    if failed.is_empty() {
        Ok(report.join("; "))
    } else {
        Err(format!("{} ({})", failed.join(", "), report.join("; ")))
    }
}

// ---- main -------------------------------------------------------------------------------

fn main() {
    let o = options();
    let gpu = !o.host_only && driver_available();
    println!(
        "soak: {} s, {} threads, {} streams, {}",
        o.seconds,
        o.threads,
        o.streams,
        if gpu {
            format!(
                "pinned + managed + device memory (blocks up to {} MiB), and the host workload",
                o.device_max / MIB
            )
        } else if o.host_only {
            "host only (--host-only)".to_string()
        } else {
            "host only (no CUDA driver)".to_string()
        }
    );
    let streams: Vec<Stream> = if gpu {
        match (0..o.streams).map(|_| Stream::new(0)).collect() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("soak: FAIL: cannot create streams: {e}");
                std::process::exit(1);
            }
        }
    } else {
        Vec::new()
    };
    if let (true, Some(chunk)) = (gpu, o.device_chunk) {
        let backing = match device_io::use_chunks(chunk) {
            Ok(b) => b,
            Err(e) => {
                eprintln!(
                    "soak: FAIL: cannot make a device pool of {} MiB chunks: {e}",
                    chunk / MIB
                );
                std::process::exit(1);
            }
        };
        println!(
            "soak: device pool of its own on {backing:?}: chunks of {} MiB rounded up to a \
             power-of-two number of granules (physical pages only), no idle allowance beyond \
             the floor",
            chunk / MIB
        );
    }
    // A limit, so that backpressure engages: above what the live blocks and the thread
    // caches can hold, so that a failure means a bug, not a full pool.
    let host_pool = Pool::with_config(
        HostSource,
        PoolConfig::default()
            .with_limit(256 * MIB)
            .with_thread_cache_bytes(4 * MIB),
    );
    #[cfg(feature = "test-hooks")]
    if o.no_pending_list {
        println!("soak: NEGATIVE CONTROL: the host pool's pending list is off; this run must fail");
        host_pool.set_pending_list_enabled(false);
    }
    let host = Counting::new(&host_pool);
    let fake = FakeStreams::new(o.streams);
    let tally = Tally::default();
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let duration = Duration::from_secs(o.seconds);
    let warm = duration / 3;
    let mut samples: Vec<Sample> = Vec::new();

    let device_max = o.device_max;
    std::thread::scope(|s| {
        for t in 0..o.threads {
            let (host, fake, tally, stop, streams) = (&host, &fake, &tally, &stop, &streams);
            s.spawn(move || {
                let mut rng = Rng(0x5eed_0000 + t as u64 * 7919);
                let mut arena = Arena::with_config(HostSource, ArenaConfig::host());
                let (mut i, mut host_turns) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let r = if gpu && i % 4 != 3 {
                        gpu_round_trip(&streams[t % streams.len()], device_max, &mut rng, tally)
                    } else {
                        // Host turns alternate between the pool and the arena.
                        host_turns += 1;
                        if host_turns % 2 == 0 {
                            host_round_trip(host, fake, &mut rng, tally)
                        } else {
                            arena_batch(&mut arena, fake, &mut rng, tally)
                        }
                    };
                    if let Err(e) = r {
                        tally.error(format!("thread {t}: {e}"));
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    i += 1;
                }
            });
        }
        // The sampler: every second; a line every `report_every` seconds.
        let mut next_report = Duration::from_secs(o.report_every);
        while start.elapsed() < duration {
            std::thread::sleep(Duration::from_secs(1).min(duration.saturating_sub(start.elapsed())));
            let x = sample(start, &host_pool, gpu);
            samples.push(x);
            if x.at >= next_report {
                next_report += Duration::from_secs(o.report_every);
                let mut line = format!(
                    "[{:>4} s] round trips: {} GPU, {} host, {} arena batches; held: host pool {:.1} MiB",
                    x.at.as_secs(),
                    tally.gpu_round_trips.load(Ordering::Relaxed),
                    tally.host_round_trips.load(Ordering::Relaxed),
                    tally.arena_batches.load(Ordering::Relaxed),
                    mib(x.host_pool as u64)
                );
                if gpu {
                    line += &format!(
                        ", pinned {:.1} MiB, managed {:.1} MiB, device {:.1} MiB",
                        mib(x.pinned as u64),
                        mib(x.managed as u64),
                        mib(x.device)
                    );
                }
                println!("{line}");
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    fake.join();
    let elapsed = start.elapsed();

    // ---- verdict ----
    let mut failures: Vec<String> = Vec::new();
    let corrupted = tally.corrupted_bytes.load(Ordering::Relaxed);
    let errors = tally.errors.load(Ordering::Relaxed);
    if corrupted > 0 {
        failures.push(format!("{corrupted} corrupted bytes"));
    }
    if errors > 0 {
        let first = tally.first_error.lock().unwrap().clone().unwrap_or_default();
        failures.push(format!("{errors} errors (first: {first})"));
    }
    let leaks = [
        ("host pool", host.snapshot()),
        ("pinned", PINNED.snapshot()),
        ("managed", MANAGED.snapshot()),
    ];
    for (name, snap) in leaks {
        if snap.live_count() != 0 {
            failures.push(format!(
                "{name}: {} blocks ({} bytes) not freed",
                snap.live_count(),
                snap.live_bytes()
            ));
        }
    }
    host_pool.collect_pending();
    let hs = host_pool.stats();
    if hs.live_blocks != 0 || hs.pending_blocks != 0 {
        failures.push(format!(
            "host pool: {} live and {} pending blocks at the end",
            hs.live_blocks, hs.pending_blocks
        ));
    }
    if gpu {
        for s in &streams {
            if let Err(e) = s.synchronize() {
                failures.push(format!("synchronize: {e}"));
            }
        }
        match device_io::held() {
            Ok((_, 0)) => {}
            Ok((_, live)) => failures.push(format!("device: {live} buffers not freed")),
            Err(e) => failures.push(format!("device pool stats: {e}")),
        }
    }
    let drift_report = match drift(&samples, warm, o.max_drift_pct, gpu) {
        Ok(r) => r,
        Err(e) => {
            failures.push(format!("memory held grew after warm-up: {e}"));
            e
        }
    };
    let gb = tally.bytes_checked.load(Ordering::Relaxed) as f64 / 1e9;
    println!(
        "soak: {:.0} s: {} GPU round trips, {} host round trips, {} arena batches, {gb:.2} GB checked, \
         {corrupted} corrupted bytes, {errors} errors",
        elapsed.as_secs_f64(),
        tally.gpu_round_trips.load(Ordering::Relaxed),
        tally.host_round_trips.load(Ordering::Relaxed),
        tally.arena_batches.load(Ordering::Relaxed),
    );
    println!(
        "leaks (Counting, live blocks): host pool {}, pinned {}, managed {}",
        host.snapshot().live_count(),
        PINNED.snapshot().live_count(),
        MANAGED.snapshot().live_count()
    );
    println!("drift after warm-up ({} s): {drift_report}", warm.as_secs());
    println!("cudalloc::cuda::drop_errors(): {}", cudalloc::cuda::drop_errors());

    // Return everything before exit (and show what the pools held).
    println!("host pool:\n{hs}");
    if gpu {
        println!("pinned pools:\n{}", PinnedAlloc::stats());
        println!("managed pools:\n{}", ManagedAlloc::stats());
        match device_io::report() {
            Ok(r) => println!("device pool:\n{r}"),
            Err(e) => failures.push(format!("device pool stats: {e}")),
        }
        drop(streams);
        if let Err(e) = device_io::trim() {
            failures.push(format!("device pool trim: {e}"));
        }
    }
    let released = cudalloc::release_cached_memory();
    host_pool.release();
    println!(
        "released {:.1} MiB of cached pinned and managed memory",
        mib(released as u64)
    );
    if failures.is_empty() {
        println!("soak: PASS");
    } else {
        for f in &failures {
            println!("soak: FAIL: {f}");
        }
        std::process::exit(1);
    }
}
