//! Staging batches from an async runtime without blocking its workers.
//!
//! 64 tokio tasks stage batches through one `StagingRing` on 4 streams (4 buffers of 1 MiB
//! each): lease a buffer (`next_async().await`), fill it, copy it to the device, copy it
//! back into the task's pinned check buffer, await the copy's event
//! (`Event::completed().await`) and check every byte. The same work then runs on 64
//! blocking threads (`ring.next(timeout)`, `Event::synchronize`), and once more inside the
//! runtime with those blocking calls, to show what the futures avoid.
//!
//! How "no worker blocks on the GPU" is measured: a heartbeat task sleeps 1 ms in a loop on
//! the same runtime (4 workers) and records how late it wakes. With every worker free the
//! lateness stays at the timer's granularity; a worker parked in a blocking call shows up as
//! lateness of the order of the GPU waits.
//!
//! Last, the completion latency of a future (the end of GPU-side work to the task running
//! again) against `Stream::synchronize` (to the thread returning).
//!
//! `cargo run --release --example async_staging`. Without a GPU it says so and exits 0.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_api2::vec::Vec as AVec;
use cudalloc::cuda::Stream;
use cudalloc::device::DevicePool;
use cudalloc::staging::StagingRing;
use cudalloc::{copy, PinnedAlloc};

const TASKS: usize = 64;
const BATCHES: usize = 32;
const STREAMS: usize = 4;
const PER_STREAM: usize = 4;
const LEN: usize = 1 << 20;

type Ring = StagingRing<PinnedAlloc>;

fn pattern(task: usize, batch: usize, i: usize) -> u8 {
    (task.wrapping_mul(131) ^ batch.wrapping_mul(29) ^ i.wrapping_mul(7)) as u8
}

/// One batch's work, async: returns the number of wrong bytes read back.
async fn stage_async(
    ring: &Ring,
    pool: &DevicePool,
    check: &mut AVec<u8, PinnedAlloc>,
    task: usize,
    batch: usize,
) -> usize {
    let mut buf = ring.next_async().await.expect("a staging buffer");
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(task, batch, i);
    }
    let stream = buf.stream().clone();
    let mut dev = pool.alloc::<u8>(LEN, &stream).expect("device memory");
    // SAFETY: the lease is not written after this; the ring hands it out again only once
    // the copy has completed.
    unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.expect("H2D");
    drop(buf);
    // SAFETY: `check` is read only after the event below has completed.
    unsafe { copy::device_to_host_async(&dev, 0, check) }.expect("D2H");
    let done = stream.record_event().expect("an event");
    done.completed().await.expect("the copies");
    check
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(task, batch, i))
        .count()
}

/// The same batch, blocking the calling thread.
fn stage_blocking(
    ring: &Ring,
    pool: &DevicePool,
    check: &mut AVec<u8, PinnedAlloc>,
    task: usize,
    batch: usize,
) -> usize {
    let mut buf = ring.next(Duration::from_secs(60)).expect("a staging buffer");
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(task, batch, i);
    }
    let stream = buf.stream().clone();
    let mut dev = pool.alloc::<u8>(LEN, &stream).expect("device memory");
    // SAFETY: as in `stage_async`.
    unsafe { copy::host_to_device_async(&buf, &mut dev, 0) }.expect("H2D");
    drop(buf);
    // SAFETY: `check` is read only after the event below has completed.
    unsafe { copy::device_to_host_async(&dev, 0, check) }.expect("D2H");
    stream
        .record_event()
        .expect("an event")
        .synchronize()
        .expect("the copies");
    check
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(task, batch, i))
        .count()
}

fn check_buffer() -> AVec<u8, PinnedAlloc> {
    let mut v = AVec::with_capacity_in(LEN, PinnedAlloc);
    v.resize(LEN, 0);
    v
}

/// A heartbeat on the runtime: sleeps 1 ms in a loop until `stop`, returns its largest
/// lateness.
fn heartbeat(rt: &tokio::runtime::Runtime, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Duration> {
    rt.spawn(async move {
        let mut worst = Duration::ZERO;
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            tokio::time::sleep(Duration::from_millis(1)).await;
            worst = worst.max(t.elapsed().saturating_sub(Duration::from_millis(1)));
        }
        worst
    })
}

struct Run {
    wall: Duration,
    wrong: usize,
    heartbeat: Option<Duration>,
}

impl Run {
    fn print(&self, name: &str) {
        let gb = (TASKS * BATCHES * LEN) as f64 / 1e9;
        let beat = self
            .heartbeat
            .map_or("-".to_string(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3));
        println!(
            "| {name} | {:.1} | {:.2} | {beat} | {} |",
            self.wall.as_secs_f64() * 1e3,
            gb / self.wall.as_secs_f64(),
            self.wrong
        );
    }
}

fn run_tokio(rt: &tokio::runtime::Runtime, ring: &Ring, pool: &DevicePool, blocking_calls: bool) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let beat = heartbeat(rt, stop.clone());
    let wrong = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (ring, pool, wrong) = (ring.clone(), pool.clone(), wrong.clone());
            rt.spawn(async move {
                let mut check = check_buffer();
                for batch in 0..BATCHES {
                    let w = if blocking_calls {
                        stage_blocking(&ring, &pool, &mut check, task, batch)
                    } else {
                        stage_async(&ring, &pool, &mut check, task, batch).await
                    };
                    wrong.fetch_add(w, Ordering::Relaxed);
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
    let wall = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let worst = rt.block_on(beat).expect("the heartbeat");
    Run {
        wall,
        wrong: wrong.load(Ordering::Relaxed),
        heartbeat: Some(worst),
    }
}

fn run_threads(ring: &Ring, pool: &DevicePool) -> Run {
    let wrong = AtomicUsize::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for task in 0..TASKS {
            let wrong = &wrong;
            s.spawn(move || {
                let mut check = check_buffer();
                for batch in 0..BATCHES {
                    wrong.fetch_add(
                        stage_blocking(ring, pool, &mut check, task, batch),
                        Ordering::Relaxed,
                    );
                }
            });
        }
    });
    Run {
        wall: t0.elapsed(),
        wrong: wrong.load(Ordering::Relaxed),
        heartbeat: None,
    }
}

/// Median and 99th percentile in microseconds.
fn summary(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[(v.len() * 99 / 100).min(v.len() - 1)])
}

/// The end of GPU-side work (a host function queued on the stream that sleeps 200 us and
/// stamps the time) to the waiter running again, `reps` times, for a future awaited on the
/// runtime and for `Stream::synchronize`.
fn completion_latency(rt: &tokio::runtime::Runtime, s: &Stream, reps: usize) -> ((f64, f64), (f64, f64)) {
    let origin = Instant::now();
    let stamp = Arc::new(AtomicU64::new(0));
    let queue = |stamp: &Arc<AtomicU64>| {
        let st = stamp.clone();
        s.launch_host_fn(move || {
            std::thread::sleep(Duration::from_micros(200));
            st.store(origin.elapsed().as_nanos() as u64, Ordering::SeqCst);
        })
        .expect("a host function");
    };
    let since = |stamp: &AtomicU64| {
        (origin.elapsed().as_nanos() as u64).saturating_sub(stamp.load(Ordering::SeqCst)) as f64 / 1e3
    };
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

fn main() {
    if !cudalloc::cuda::driver_available() {
        println!("async_staging: no CUDA driver: nothing to stage (the futures need a GPU stream); exiting");
        return;
    }
    let streams: Vec<Stream> = (0..STREAMS).map(|_| Stream::new(0).expect("a stream")).collect();
    let ring = StagingRing::new(PinnedAlloc, &streams, PER_STREAM, LEN).expect("the staging ring");
    let pool = DevicePool::get(0).expect("the device pool");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .expect("a tokio runtime");
    println!(
        "{TASKS} tasks x {BATCHES} batches of {} KiB through one ring ({STREAMS} streams x {PER_STREAM} buffers), \
         H2D + D2H + check each; tokio with 4 workers",
        LEN >> 10
    );
    // Warm-up: the pools, the helper streams of the event futures.
    let _ = run_tokio(&rt, &ring, &pool, false);
    println!("| variant | wall ms | GB/s (H2D bytes) | heartbeat max lateness | wrong bytes |");
    println!("| --- | --- | --- | --- | --- |");
    let a = run_tokio(&rt, &ring, &pool, false);
    a.print("tokio tasks, futures (`next_async`, `completed().await`)");
    let b = run_threads(&ring, &pool);
    b.print("64 blocking threads (`next`, `synchronize`)");
    let c = run_tokio(&rt, &ring, &pool, true);
    c.print("tokio tasks making the blocking calls (workers blocked)");
    println!(
        "futures vs blocking threads: {:.2}x the throughput",
        b.wall.as_secs_f64() / a.wall.as_secs_f64()
    );
    let ((fm, f99), (sm, s99)) = completion_latency(&rt, &streams[0], 500);
    println!("completion latency, GPU work's end to the waiter running (500 reps): future on tokio median {fm:.1} us (p99 {f99:.1}), Stream::synchronize median {sm:.1} us (p99 {s99:.1})");
    let wrong = a.wrong + b.wrong + c.wrong;
    if wrong != 0 {
        eprintln!("async_staging: {wrong} wrong bytes");
        std::process::exit(1);
    }
}
