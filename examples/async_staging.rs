//! Staging batches from an async runtime without blocking its workers.
//!
//! 64 tokio tasks stage batches through one `StagingRing` on 4 streams (4 buffers of 1 MiB
//! per stream, 16 in all): lease a buffer (`next_async().await`), fill it, copy it to the device, copy it
//! back into the task's pinned check buffer, await the copy's event
//! (`Event::completed().await`) and check every byte. The same work then runs on blocking
//! threads (`ring.next(timeout)`, `Event::synchronize`): as many threads as the runtime has
//! workers (the same CPU parallelism, so that the comparison isolates the waits) and one
//! thread per task; and once more on the runtime's workers with those blocking calls (the
//! negative control).
//!
//! How "the workers stay free" is measured: tokio adds up, per worker, the time it spends
//! running tasks (`RuntimeMetrics::worker_total_busy_duration`, a stable metric). A worker
//! blocked in a GPU wait inside a poll counts as busy; a worker whose task awaits a future
//! runs another task or parks. Each task times its own code (the fill, the issue of the
//! copies, the check: "own work") and, apart, its two waits (for a buffer, for the copies).
//! Busy minus own work is the time the workers spent inside polls *not* running the tasks'
//! code, i.e. blocked (plus the runtime's own bookkeeping and the making of the futures,
//! which queue their wake-up on the driver). With the futures it stays small while the
//! tasks' waits add up to seconds; with the blocking calls on the workers it is about the
//! tasks' waits. The busy time is read once the runtime has been dropped, when every worker
//! has published its last interval. `worker parks` (`worker_park_count`) is a second sign:
//! a worker that finds every task waiting on a future parks.
//!
//! Last, the completion latency of a future (the end of GPU-side work to the task running
//! again) against `Stream::synchronize` (to the thread returning).
//!
//! `cargo run --release --example async_staging [-- --workers N]` (N defaults to the
//! machine's available parallelism). Without a GPU it says so and exits 0;
//! `cargo test --example async_staging` checks the measurement on the CPU, a thread standing
//! in for the GPU.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_api2::vec::Vec as AVec;
use cudalloc::cuda::{Event, Stream};
use cudalloc::device::DevicePool;
use cudalloc::staging::{Staged, StagingRing};
use cudalloc::{copy, PinnedAlloc};

const TASKS: usize = 64;
const BATCHES: usize = 32;
const STREAMS: usize = 4;
const PER_STREAM: usize = 4;
const LEN: usize = 1 << 20;

type Ring = StagingRing<PinnedAlloc>;

/// What the tasks of one variant measured in themselves, summed over the tasks.
#[derive(Default)]
struct Tally {
    own_ns: AtomicU64,
    wait_ns: AtomicU64,
    wrong: AtomicUsize,
}

impl Tally {
    fn own(&self, since: Instant) {
        self.own_ns.fetch_add(nanos(since.elapsed()), Ordering::Relaxed);
    }
    fn waited(&self, since: Instant) {
        self.wait_ns.fetch_add(nanos(since.elapsed()), Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn pattern(task: usize, batch: usize, i: usize) -> u8 {
    (task.wrapping_mul(131) ^ batch.wrapping_mul(29) ^ i.wrapping_mul(7)) as u8
}

/// Fills the lease, queues its copy to the device and back into `check`, and records the
/// event the caller waits for.
fn fill_and_issue(
    mut buf: Staged<PinnedAlloc>,
    pool: &DevicePool,
    check: &mut AVec<u8, PinnedAlloc>,
    task: usize,
    batch: usize,
) -> Event {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(task, batch, i);
    }
    let stream = buf.stream().clone();
    let mut dev = pool.alloc::<u8>(LEN, &stream).expect("device memory");
    // SAFETY: the lease is not written after this (it is dropped below); the ring hands it
    // out again only once the copy has completed.
    unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.expect("H2D");
    drop(buf);
    // SAFETY: the caller reads `check` only after the returned event has completed.
    unsafe { copy::device_to_host_async(&dev, 0, check) }.expect("D2H");
    stream.record_event().expect("an event")
}

fn count_wrong(check: &[u8], task: usize, batch: usize) -> usize {
    check
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(task, batch, i))
        .count()
}

/// One batch, async: the waits are awaits.
async fn stage_async(
    ring: &Ring,
    pool: &DevicePool,
    check: &mut AVec<u8, PinnedAlloc>,
    task: usize,
    batch: usize,
    tally: &Tally,
) {
    let t = Instant::now();
    let buf = ring.next_async().await.expect("a staging buffer");
    tally.waited(t);
    let t = Instant::now();
    let done = fill_and_issue(buf, pool, check, task, batch);
    tally.own(t);
    let t = Instant::now();
    done.completed().await.expect("the copies");
    tally.waited(t);
    let t = Instant::now();
    tally
        .wrong
        .fetch_add(count_wrong(check, task, batch), Ordering::Relaxed);
    tally.own(t);
}

/// The same batch, blocking the calling thread in its waits.
fn stage_blocking(
    ring: &Ring,
    pool: &DevicePool,
    check: &mut AVec<u8, PinnedAlloc>,
    task: usize,
    batch: usize,
    tally: &Tally,
) {
    let t = Instant::now();
    let buf = ring.next(Duration::from_secs(60)).expect("a staging buffer");
    tally.waited(t);
    let t = Instant::now();
    let done = fill_and_issue(buf, pool, check, task, batch);
    tally.own(t);
    let t = Instant::now();
    done.synchronize().expect("the copies");
    tally.waited(t);
    let t = Instant::now();
    tally
        .wrong
        .fetch_add(count_wrong(check, task, batch), Ordering::Relaxed);
    tally.own(t);
}

fn check_buffer() -> AVec<u8, PinnedAlloc> {
    let mut v = AVec::with_capacity_in(LEN, PinnedAlloc);
    v.resize(LEN, 0);
    v
}

/// One variant's figures.
#[derive(Debug, Clone)]
struct Run {
    /// Threads that ran the tasks' code: the runtime's workers, or the blocking threads.
    threads: usize,
    wall: Duration,
    /// The tasks' own code (fill, issue, check), summed over the tasks.
    own: Duration,
    /// The tasks' waits (for a buffer, for the copies), summed over the tasks.
    waits: Duration,
    /// On a runtime: its workers' busy time and parks, summed over the workers.
    runtime: Option<(Duration, u64)>,
    wrong: usize,
}

impl Run {
    fn from_tally(threads: usize, wall: Duration, runtime: Option<(Duration, u64)>, tally: &Tally) -> Run {
        Run {
            threads,
            wall,
            own: Duration::from_nanos(tally.own_ns.load(Ordering::Relaxed)),
            waits: Duration::from_nanos(tally.wait_ns.load(Ordering::Relaxed)),
            runtime,
            wrong: tally.wrong.load(Ordering::Relaxed),
        }
    }

    /// Time the workers spent inside polls not running the tasks' own code: blocked.
    fn blocked(&self) -> Option<Duration> {
        self.runtime.map(|(busy, _)| busy.saturating_sub(self.own))
    }

    /// The table row: the workers' busy time as a share of `threads x wall`.
    fn row(&self, name: &str, bytes: usize) -> String {
        let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        let (busy, parks, blocked) = match (self.runtime, self.blocked()) {
            (Some((busy, parks)), Some(blocked)) => {
                let share = busy.as_secs_f64() / (self.threads as f64 * self.wall.as_secs_f64());
                (
                    format!("{} ({:.0}%)", ms(busy), share * 100.0),
                    parks.to_string(),
                    ms(blocked),
                )
            }
            _ => ("-".into(), "-".into(), "-".into()),
        };
        format!(
            "| {name} | {} | {} | {:.2} | {busy} | {} | {blocked} | {} | {parks} | {} |",
            self.threads,
            ms(self.wall),
            bytes as f64 / 1e9 / self.wall.as_secs_f64(),
            ms(self.own),
            ms(self.waits),
            self.wrong
        )
    }
}

const HEADER: &str = "| variant | threads | wall ms | GB/s (H2D bytes) | workers busy ms (of threads x wall) | tasks' own work ms | blocked in polls ms (busy - own work) | tasks' waits ms | worker parks | wrong bytes |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |";

/// Runs `work` on a fresh runtime of `workers` workers: its result, its wall time, and the
/// workers' busy time and parks summed. A worker publishes its busy time when it parks,
/// every 61 polls and when it shuts down, so the sums are read after the runtime is dropped
/// (its drop waits for the workers to exit): they then hold every busy interval of `work`.
fn on_runtime<T>(
    workers: usize,
    build: impl FnOnce(&mut tokio::runtime::Builder) -> &mut tokio::runtime::Builder,
    work: impl FnOnce(&tokio::runtime::Runtime) -> T,
) -> (T, Duration, (Duration, u64)) {
    let rt = build(tokio::runtime::Builder::new_multi_thread().worker_threads(workers))
        .build()
        .expect("a tokio runtime");
    let metrics = rt.metrics();
    let t0 = Instant::now();
    let out = work(&rt);
    let wall = t0.elapsed();
    drop(rt);
    let busy = (0..workers).map(|w| metrics.worker_total_busy_duration(w)).sum();
    let parks = (0..workers).map(|w| metrics.worker_park_count(w)).sum();
    (out, wall, (busy, parks))
}

fn run_tokio(workers: usize, ring: &Ring, pool: &DevicePool, blocking_calls: bool) -> Run {
    let tally = Arc::new(Tally::default());
    let ((), wall, runtime) = on_runtime(
        workers,
        |b| b,
        |rt| {
            let tasks: Vec<_> = (0..TASKS)
                .map(|task| {
                    let (ring, pool, tally) = (ring.clone(), pool.clone(), tally.clone());
                    rt.spawn(async move {
                        let mut check = check_buffer();
                        for batch in 0..BATCHES {
                            if blocking_calls {
                                stage_blocking(&ring, &pool, &mut check, task, batch, &tally);
                            } else {
                                stage_async(&ring, &pool, &mut check, task, batch, &tally).await;
                            }
                            tokio::task::yield_now().await;
                        }
                    })
                })
                .collect();
            rt.block_on(async {
                for t in tasks {
                    t.await.expect("a staging task");
                }
            });
        },
    );
    Run::from_tally(workers, wall, Some(runtime), &tally)
}

/// The same 64 tasks' batches on `threads` blocking threads, thread `k` taking tasks
/// `k, k + threads, ...` in turn.
fn run_threads(threads: usize, ring: &Ring, pool: &DevicePool) -> Run {
    let tally = Tally::default();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for k in 0..threads {
            let tally = &tally;
            s.spawn(move || {
                let mut check = check_buffer();
                for task in (k..TASKS).step_by(threads) {
                    for batch in 0..BATCHES {
                        stage_blocking(ring, pool, &mut check, task, batch, tally);
                    }
                }
            });
        }
    });
    Run::from_tally(threads, t0.elapsed(), None, &tally)
}

/// Median and 99th percentile in microseconds.
fn summary(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[(v.len() * 99 / 100).min(v.len() - 1)])
}

/// The end of GPU-side work (a host function queued on the stream that sleeps 200 us and
/// stamps the time) to the waiter running again, `reps` times, for a future awaited on a
/// runtime and for `Stream::synchronize`.
fn completion_latency(s: &Stream, reps: usize) -> ((f64, f64), (f64, f64)) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .build()
        .expect("a tokio runtime");
    let origin = Instant::now();
    let stamp = Arc::new(AtomicU64::new(0));
    let queue = |stamp: &Arc<AtomicU64>| {
        let st = stamp.clone();
        s.launch_host_fn(move || {
            std::thread::sleep(Duration::from_micros(200));
            st.store(nanos(origin.elapsed()), Ordering::SeqCst);
        })
        .expect("a host function");
    };
    let since =
        |stamp: &AtomicU64| nanos(origin.elapsed()).saturating_sub(stamp.load(Ordering::SeqCst)) as f64 / 1e3;
    let mut fut = Vec::with_capacity(reps);
    let mut sync = Vec::with_capacity(reps);
    for _ in 0..reps {
        queue(&stamp);
        let idle = s.idle();
        fut.push(rt.block_on(async {
            idle.await.expect("the stream");
            since(&stamp)
        }));
        queue(&stamp);
        s.synchronize().expect("the stream");
        sync.push(since(&stamp));
    }
    (summary(fut), summary(sync))
}

/// `--workers N`, else the available parallelism.
fn workers_arg() -> usize {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--workers") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse().ok())
            .filter(|&n| n > 0)
            .expect("--workers N, N > 0"),
        None => std::thread::available_parallelism().map_or(4, |n| n.get()),
    }
}

fn main() {
    let workers = workers_arg();
    if !cudalloc::cuda::driver_available() {
        println!("async_staging: no CUDA driver: nothing to stage (the futures need a GPU stream); exiting");
        return;
    }
    let streams: Vec<Stream> = (0..STREAMS).map(|_| Stream::new(0).expect("a stream")).collect();
    let ring = StagingRing::new(PinnedAlloc, &streams, PER_STREAM, LEN).expect("the staging ring");
    let pool = DevicePool::get(0).expect("the device pool");
    println!(
        "{TASKS} tasks x {BATCHES} batches of {} KiB through one ring ({STREAMS} streams x {PER_STREAM} buffers), \
         H2D + D2H + check each; tokio with {workers} workers",
        LEN >> 10
    );
    // Warm-up: the pools, the helper streams of the event futures.
    let _ = run_tokio(workers, &ring, &pool, false);
    let bytes = TASKS * BATCHES * LEN;
    println!("{HEADER}");
    let futures = run_tokio(workers, &ring, &pool, false);
    println!(
        "{}",
        futures.row("tokio tasks, futures (`next_async`, `completed().await`)", bytes)
    );
    let same = run_threads(workers, &ring, &pool);
    println!(
        "{}",
        same.row(
            "blocking threads, as many as the workers (`next`, `synchronize`)",
            bytes
        )
    );
    let per_task = run_threads(TASKS, &ring, &pool);
    println!("{}", per_task.row("blocking threads, one per task", bytes));
    let blocked = run_tokio(workers, &ring, &pool, true);
    println!(
        "{}",
        blocked.row("tokio tasks making the blocking calls (workers blocked)", bytes)
    );
    println!(
        "futures vs blocking threads: {:.2}x the throughput on {workers} threads each, {:.2}x against {TASKS} threads",
        same.wall.as_secs_f64() / futures.wall.as_secs_f64(),
        per_task.wall.as_secs_f64() / futures.wall.as_secs_f64(),
    );
    let ((fm, f99), (sm, s99)) = completion_latency(&streams[0], 500);
    println!("completion latency, GPU work's end to the waiter running (500 reps): future on tokio median {fm:.1} us (p99 {f99:.1}), Stream::synchronize median {sm:.1} us (p99 {s99:.1})");
    let wrong = futures.wrong + same.wrong + per_task.wrong + blocked.wrong;
    if wrong != 0 {
        eprintln!("async_staging: {wrong} wrong bytes");
        std::process::exit(1);
    }
}

/// The measurement on the CPU: a thread stands in for the GPU.
#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_row_shares_busy_time_over_threads_and_wall_and_subtracts_own_work() {
        let run = Run {
            threads: 4,
            wall: 1250 * MS,
            own: 1000 * MS,
            waits: 7000 * MS,
            runtime: Some((4000 * MS, 12)),
            wrong: 0,
        };
        assert_eq!(run.blocked(), Some(3000 * MS));
        assert_eq!(
            run.row("r", 2_500_000_000),
            "| r | 4 | 1250.0 | 2.00 | 4000.0 (80%) | 1000.0 | 3000.0 | 7000.0 | 12 | 0 |"
        );
        // Own work timed a little over the busy time (the two clocks): blocked is 0.
        let noisy = Run {
            own: 4100 * MS,
            ..run.clone()
        };
        assert_eq!(noisy.blocked(), Some(Duration::ZERO));
        // Off a runtime there is no busy time to share.
        let threads = Run { runtime: None, ..run };
        assert_eq!(
            threads.row("t", 2_500_000_000),
            "| t | 4 | 1250.0 | 2.00 | - | 1000.0 | - | 7000.0 | - | 0 |"
        );
        assert_eq!(
            HEADER.lines().next().unwrap().matches('|').count(),
            threads.row("t", 1).matches('|').count()
        );
    }

    /// The negative control's shape: tasks wait in a blocking call inside their polls
    /// (`sleep` stands in for `Event::synchronize`); each signals the end of its work
    /// half-way through, so the run ends while a worker is still inside a poll. Each wait
    /// lies within a worker's busy interval, so the summed busy time is at least the summed
    /// waits, once every worker has published its last interval. Fails if the busy time is
    /// read before the runtime is dropped (the last interval is missing), or from one worker
    /// only.
    #[test]
    fn a_wait_inside_a_poll_counts_as_blocked() {
        const N: usize = 8;
        let tally = Arc::new(Tally::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let ((), wall, runtime) = on_runtime(
            2,
            |b| b,
            |rt| {
                for _ in 0..N {
                    let (tally, tx) = (tally.clone(), tx.clone());
                    rt.spawn(async move {
                        let t = Instant::now();
                        std::thread::sleep(10 * MS);
                        tx.send(()).unwrap();
                        std::thread::sleep(10 * MS);
                        tally.waited(t);
                    });
                }
                rx.iter().take(N).for_each(drop);
            },
        );
        let run = Run::from_tally(2, wall, Some(runtime), &tally);
        eprintln!("{HEADER}\n{}", run.row("blocking inside polls", 0));
        assert!(run.waits >= 2 * N as u32 * 10 * MS, "{run:?}");
        assert!(run.blocked().unwrap() >= run.waits, "{run:?}");
    }

    /// The futures' shape: tasks await a completion that another thread signals (standing
    /// in for the driver's host function), which it does only once the one worker has
    /// parked with every task waiting (the park callback sees it). Fails if awaiting held
    /// the worker: it then never starts the other tasks, and the stand-in completes each
    /// task as it comes after a 10 s deadline, with no such park seen.
    #[test]
    fn tasks_awaiting_a_completion_leave_the_worker_free() {
        const N: usize = 8;
        let waiting = Arc::new(AtomicUsize::new(0));
        let parked_with_all_waiting = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<Arc<Completion>>();
        let tally = Arc::new(Tally::default());
        let ((), wall, runtime) = on_runtime(
            1,
            |b| {
                let (waiting, parked) = (waiting.clone(), parked_with_all_waiting.clone());
                b.on_thread_park(move || {
                    if waiting.load(Ordering::SeqCst) == N {
                        parked.store(true, Ordering::SeqCst);
                    }
                })
            },
            |rt| {
                let gpu = std::thread::spawn({
                    let parked = parked_with_all_waiting.clone();
                    move || {
                        let deadline = Instant::now() + 10_000 * MS;
                        while !parked.load(Ordering::SeqCst) && Instant::now() < deadline {
                            std::thread::sleep(MS);
                        }
                        rx.iter().take(N).for_each(|c| c.complete());
                    }
                });
                let tasks: Vec<_> = (0..N)
                    .map(|_| {
                        let (tx, waiting, tally) = (tx.clone(), waiting.clone(), tally.clone());
                        rt.spawn(async move {
                            let done = Arc::new(Completion::default());
                            tx.send(done.clone()).unwrap();
                            let t = Instant::now();
                            waiting.fetch_add(1, Ordering::SeqCst);
                            std::future::poll_fn(|cx| done.poll(cx)).await;
                            waiting.fetch_sub(1, Ordering::SeqCst);
                            tally.waited(t);
                        })
                    })
                    .collect();
                rt.block_on(async {
                    for t in tasks {
                        t.await.unwrap();
                    }
                });
                gpu.join().unwrap();
            },
        );
        let run = Run::from_tally(1, wall, Some(runtime), &tally);
        eprintln!("{HEADER}\n{}", run.row("awaiting a completion", 0));
        assert!(parked_with_all_waiting.load(Ordering::SeqCst), "{run:?}");
    }

    /// A one-shot completion: set once by the stand-in GPU thread, which wakes the waiter.
    #[derive(Default)]
    struct Completion {
        done: AtomicBool,
        waker: std::sync::Mutex<Option<std::task::Waker>>,
    }

    impl Completion {
        fn complete(&self) {
            self.done.store(true, Ordering::SeqCst);
            if let Some(w) = self.waker.lock().unwrap().take() {
                w.wake();
            }
        }
        fn poll(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            if self.done.load(Ordering::SeqCst) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        }
    }
}
