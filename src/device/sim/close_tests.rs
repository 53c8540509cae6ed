//! A dropped pool's memory goes back while threads that cached its blocks live on
//! (`device/close.rs`), on the simulated GPU: the blocks the simulated backend still
//! holds are its live map; a block freed twice panics there.

use super::*;
use crate::sync::global::{mpsc, Arc, Barrier, Mutex};
use crate::sync::lock;
use std::collections::BTreeMap;

/// A thread that stays alive between jobs, as a worker of a thread pool does.
struct Worker {
    jobs: Option<mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn new() -> Self {
        let (tx, rx) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let thread = std::thread::spawn(move || {
            for job in rx {
                job();
            }
        });
        Self {
            jobs: Some(tx),
            thread: Some(thread),
        }
    }

    /// Runs `f` on the worker and waits for it.
    fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = mpsc::channel();
        let job = Box::new(move || tx.send(f()).unwrap());
        self.jobs.as_ref().unwrap().send(job).unwrap();
        rx.recv().unwrap()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        self.thread.take().unwrap().join().unwrap();
    }
}

type Live = Arc<Mutex<BTreeMap<u64, usize>>>;

fn live_of<M: Branch>(pool: &SimPool<M>) -> Live {
    pool.r.core.cache.backend.live_map()
}

fn blocks(live: &Live) -> usize {
    lock(live).len()
}

#[test]
fn an_idle_worker_gives_back_the_blocks_of_a_dropped_pool() {
    let pool = SimPool::new(256 << 20);
    let live = live_of(&pool);
    let w = Worker::new();
    let p = pool.clone();
    w.run(move || {
        let s = SimStream::new();
        drop(p.alloc(1 << 20, &s).unwrap()); // cached in the worker's bin
    });
    assert_eq!(blocks(&live), 1, "the block is cached in the worker's bin");
    drop(pool); // the last handle: no buffer is live
    assert_eq!(
        blocks(&live),
        0,
        "the pool's memory went back while the worker lived"
    );
    drop(w);
}

#[test]
fn large_blocks_in_an_idle_workers_slots_go_back_too() {
    let pool = SimPool::paged(256 << 20);
    let live = live_of(&pool);
    let w = Worker::new();
    let p = pool.clone();
    w.run(move || {
        let s = SimStream::new();
        drop(p.alloc(16 << 20, &s).unwrap()); // a large slot
        drop(p.alloc(4096, &s).unwrap()); // a bin
    });
    assert_eq!(blocks(&live), 2);
    drop(pool);
    assert_eq!(blocks(&live), 0);
    drop(w);
}

/// The collection never takes what a live buffer uses: the buffer keeps the pool (its
/// block and the worker's cached one stay), and its free, on the worker, is what gives
/// everything back (the push into the worker's bin sees the close).
#[test]
fn a_buffer_that_outlives_the_last_handle_gives_the_memory_back_at_its_free() {
    let pool = SimPool::new(256 << 20);
    let live = live_of(&pool);
    let w = Worker::new();
    let p = pool.clone();
    w.run(move || drop(p.alloc(4096, &SimStream::new()).unwrap()));
    let s = SimStream::new();
    let buf = pool.alloc(1 << 20, &s).unwrap();
    let at = buf.device_ptr();
    drop(pool);
    assert_eq!(blocks(&live), 2, "the buffer's block and the worker's cached one");
    assert_eq!(
        lock(&live).get(&at),
        Some(&(1 << 20)),
        "the buffer's block is not freed"
    );
    // The buffer's pool still serves it (a handle made from a buffer is a user again).
    let other = buf.pool().alloc(8192, &s).unwrap();
    assert_ne!(other.device_ptr(), 0);
    drop(other); // cached in this thread's bin: the buffer is still out
    assert_eq!(blocks(&live), 3);
    w.run(move || drop(buf)); // freed into the worker's bin, which then collects
    assert_eq!(blocks(&live), 0, "everything went back at the last buffer's free");
    drop(w);
}

#[test]
fn a_buffer_freed_through_the_slow_path_after_the_last_handle_gives_the_memory_back() {
    // No thread caches: every free goes through the slow path, and the buffer's handle is
    // dropped there.
    let pool = SimPool::new(0);
    let live = live_of(&pool);
    let buf = pool.alloc(1 << 20, &SimStream::new()).unwrap();
    drop(pool);
    assert_eq!(blocks(&live), 1);
    drop(buf);
    assert_eq!(blocks(&live), 0);
}

#[test]
fn a_handle_made_again_from_a_buffer_keeps_the_pool_until_it_drops() {
    let pool = SimPool::new(256 << 20);
    let live = live_of(&pool);
    let w = Worker::new();
    let s = SimStream::new();
    let buf = pool.alloc(4096, &s).unwrap();
    drop(pool);
    let again = buf.pool().clone();
    drop(buf); // cached: `again` is a user handle
    assert_eq!(blocks(&live), 1);
    let p = again.clone();
    let hit = w.run(move || {
        let s = SimStream::new();
        let first = p.alloc(4096, &s).unwrap().device_ptr();
        p.alloc(4096, &s).unwrap().device_ptr() == first
    });
    assert!(hit, "the pool made again works, its thread caches too");
    let ptr = again.alloc(4096, &s).unwrap().device_ptr();
    assert_eq!(again.alloc(4096, &s).unwrap().device_ptr(), ptr, "a hit");
    assert_eq!(blocks(&live), 2);
    drop(again);
    assert_eq!(blocks(&live), 0);
    drop(w);
}

/// Threads that exit while the last handle drops: each block goes back once (a second
/// free panics in the simulated backend), and none stays.
#[test]
fn threads_exiting_while_the_last_handle_drops_give_every_block_back_once() {
    for round in 0..200 {
        let pool = SimPool::new(64 << 20);
        let live = live_of(&pool);
        let start = Arc::new(Barrier::new(5));
        let threads: Vec<_> = (0..4)
            .map(|k| {
                let (p, start) = (pool.clone(), start.clone());
                std::thread::spawn(move || {
                    let s = SimStream::new();
                    for i in 0..8 {
                        drop(p.alloc(4096 << ((i + k) % 6), &s).unwrap());
                    }
                    drop(p);
                    start.wait();
                    // exits now, racing the last handle's drop
                })
            })
            .collect();
        start.wait();
        drop(pool);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(blocks(&live), 0, "round {round}");
    }
}

/// Live workers that free their last buffers while the last handle drops: whoever comes
/// last collects, and every block goes back once while the workers live on.
#[test]
fn workers_freeing_while_the_last_handle_drops_give_every_block_back() {
    let workers: Vec<Worker> = (0..4).map(|_| Worker::new()).collect();
    for round in 0..200 {
        let pool = SimPool::new(64 << 20);
        let live = live_of(&pool);
        let start = Arc::new(Barrier::new(5));
        let (done_tx, done_rx) = mpsc::channel();
        for (k, w) in workers.iter().enumerate() {
            let (p, start, done) = (pool.clone(), start.clone(), done_tx.clone());
            let jobs = w.jobs.as_ref().unwrap();
            jobs.send(Box::new(move || {
                let s = SimStream::new();
                let bufs: Vec<_> = (0..6)
                    .map(|i| p.alloc(4096 << ((i + k) % 4), &s).unwrap())
                    .collect();
                drop(p);
                start.wait();
                drop(bufs); // into the bins, racing the last handle's drop
                done.send(()).unwrap();
            }))
            .unwrap();
        }
        start.wait();
        drop(pool);
        for _ in 0..4 {
            done_rx.recv().unwrap();
        }
        assert_eq!(
            blocks(&live),
            0,
            "round {round}: the workers live, the memory is back"
        );
    }
}
