//! The trace recorder: what a recorded program's trace holds, from one thread and many,
//! its bound, its start and stop, and the events of the crate's allocators (a pool's
//! pending frees, failures, segments, trims; arenas; the handles).
//!
//! The recorder is process-wide and other tests of this binary allocate meanwhile, so
//! these tests run one at a time (`SERIAL`) and look only at their own allocators' events:
//! `Traced` wrappers with names of their own, pools over sources of their own type.

use core::ptr::NonNull;
use std::alloc::System;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec as AVec;
use cudalloc::arena::Arena;
use cudalloc::cuda::MemoryType;
use cudalloc::fence::Fence;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::{HostSource, HostVisible, MemorySource};
use cudalloc::trace::{self, Action, Event, Trace, TraceConfig, Traced};

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the recorder for one test (none runs when `CUDALLOC_TRACE` records the
/// whole process: `None`).
fn serial() -> Option<MutexGuard<'static, ()>> {
    let g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if trace::is_recording() {
        eprintln!("skipped: a recording runs already (CUDALLOC_TRACE?)");
        return None;
    }
    Some(g)
}

/// The events of the allocator named `name` (exactly one must be).
fn events_of<'t>(t: &'t Trace, name: &str) -> Vec<&'t Event> {
    let ids: Vec<usize> = (0..t.allocators.len())
        .filter(|&i| t.allocators[i].name == name)
        .collect();
    assert!(ids.len() <= 1, "{name} registered {} times", ids.len());
    match ids.first() {
        Some(&id) => t.events.iter().filter(|e| e.allocator as usize == id).collect(),
        None => Vec::new(),
    }
}

fn actions(events: &[&Event]) -> Vec<&'static str> {
    events.iter().map(|e| e.action.torch_name()).collect()
}

/// A host source of a type of its own, so that its pool's name is this test's alone.
struct Src<const N: usize>;

// SAFETY: forwards to HostSource, which keeps every promise.
unsafe impl<const N: usize> MemorySource for Src<N> {
    fn align(&self) -> usize {
        HostSource.align()
    }
    fn kind(&self) -> MemoryType {
        HostSource.kind()
    }
    fn allocate(&self, size: usize) -> cudalloc::Result<NonNull<u8>> {
        HostSource.allocate(size)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: the caller's obligations are HostSource's.
        unsafe { HostSource.deallocate(ptr, size) }
    }
}

// SAFETY: HostSource's memory is host memory.
unsafe impl<const N: usize> HostVisible for Src<N> {}

struct Flag(Arc<AtomicBool>);

// SAFETY: the test sets the flag only once it no longer uses the block.
unsafe impl Fence for Flag {
    fn is_complete(&self) -> cudalloc::Result<bool> {
        Ok(self.0.load(Ordering::Acquire))
    }
}

#[test]
fn a_recorded_program_has_its_allocations_in_order() {
    let Some(_g) = serial() else { return };
    let a = Traced::named(System, "trace_record::in_order");
    trace::start(TraceConfig::default()).unwrap();
    let l1 = Layout::from_size_align(24, 8).unwrap();
    let l2 = Layout::from_size_align(1000, 64).unwrap();
    let p1 = a.allocate(l1).unwrap();
    let p2 = a.allocate(l2).unwrap();
    // SAFETY: allocated above with these layouts.
    unsafe {
        a.deallocate(p1.cast(), l1);
        a.deallocate(p2.cast(), l2);
    }
    let t = trace::stop();
    let e = events_of(&t, "trace_record::in_order");
    assert_eq!(
        actions(&e),
        [
            "alloc",
            "alloc",
            "free_requested",
            "free_completed",
            "free_requested",
            "free_completed"
        ]
    );
    let addr = |p: NonNull<[u8]>| p.cast::<u8>().as_ptr() as u64;
    assert_eq!((e[0].addr, e[0].size, e[0].align), (addr(p1), 24, 8));
    assert_eq!((e[1].addr, e[1].size, e[1].align), (addr(p2), 1000, 64));
    assert_eq!((e[2].addr, e[2].size), (addr(p1), 24));
    assert_eq!((e[4].addr, e[4].size), (addr(p2), 1000));
    assert!(e
        .windows(2)
        .all(|w| w[0].seq < w[1].seq && w[0].time_ns <= w[1].time_ns));
    assert!(e.iter().all(|x| x.thread == e[0].thread));
    assert!(
        t.events.windows(2).all(|w| w[0].seq + 1 == w[1].seq),
        "seq renumbered 0, 1, 2, ..."
    );
    let me = &t.allocators[e[0].allocator as usize];
    assert_eq!(me.memory, trace::TraceMemory::Host);
}

#[test]
fn threads_record_without_loss_each_in_its_order() {
    let Some(_g) = serial() else { return };
    const THREADS: usize = 4;
    const OPS: usize = 500;
    let a = Traced::named(System, "trace_record::threads");
    trace::start(TraceConfig::default()).unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let a = &a;
            s.spawn(move || {
                for i in 0..OPS {
                    // The size says which thread and which step.
                    let l = Layout::from_size_align(8 * (1 + t * OPS + i), 8).unwrap();
                    let p = a.allocate(l).unwrap();
                    // SAFETY: allocated just above with `l`.
                    unsafe { a.deallocate(p.cast(), l) };
                }
            });
        }
    });
    let t = trace::stop();
    let e = events_of(&t, "trace_record::threads");
    let allocs: Vec<&&Event> = e.iter().filter(|e| e.action == Action::Alloc).collect();
    assert_eq!(allocs.len(), THREADS * OPS, "dropped {}", t.dropped);
    let mut seqs: Vec<u64> = e.iter().map(|e| e.seq).collect();
    seqs.dedup();
    assert_eq!(seqs.len(), e.len(), "every seq distinct");
    let mut threads: Vec<u32> = allocs.iter().map(|e| e.thread).collect();
    threads.sort_unstable();
    threads.dedup();
    assert_eq!(threads.len(), THREADS, "a thread number per thread");
    for th in threads {
        let sizes: Vec<u64> = allocs.iter().filter(|e| e.thread == th).map(|e| e.size).collect();
        let first = sizes[0] / 8 - 1;
        assert_eq!(first % OPS as u64, 0, "a thread's first step");
        let want: Vec<u64> = (0..OPS as u64).map(|i| 8 * (1 + first + i)).collect();
        assert_eq!(sizes, want, "thread {th}'s events in its order");
    }
}

#[test]
fn the_ring_keeps_the_newest_events_and_counts_the_dropped() {
    let Some(_g) = serial() else { return };
    let a = Traced::named(System, "trace_record::ring");
    trace::start(TraceConfig::default().with_max_entries(100)).unwrap();
    for i in 1..=1000usize {
        let l = Layout::from_size_align(i, 1).unwrap();
        let p = a.allocate(l).unwrap();
        // SAFETY: allocated just above with `l`.
        unsafe { a.deallocate(p.cast(), l) };
    }
    let t = trace::stop();
    assert_eq!(t.events.len(), 100);
    assert!(t.dropped >= 3000 - 100, "dropped {}", t.dropped);
    let sizes: Vec<u64> = events_of(&t, "trace_record::ring")
        .iter()
        .filter(|e| e.action == Action::Alloc)
        .map(|e| e.size)
        .collect();
    assert!(!sizes.is_empty());
    assert_eq!(*sizes.last().unwrap(), 1000, "the newest kept");
    let first = sizes[0];
    assert_eq!(sizes, (first..=1000).collect::<Vec<_>>(), "the oldest dropped");
}

#[test]
fn stopping_ends_the_recording_and_starting_twice_is_refused() {
    let Some(_g) = serial() else { return };
    let a = Traced::named(System, "trace_record::stop");
    let before = Box::new_in(1u8, &a); // off: not recorded
    trace::start(TraceConfig::default()).unwrap();
    assert!(trace::is_recording());
    let err = trace::start(TraceConfig::default()).unwrap_err();
    assert!(err.to_string().contains("already recording"), "{err}");
    let during = Box::new_in(2u16, &a);
    let t = trace::stop();
    assert!(!trace::is_recording());
    drop((before, during)); // off again: not recorded
    let e = events_of(&t, "trace_record::stop");
    assert_eq!(actions(&e), ["alloc"]);
    assert_eq!(e[0].size, 2);
    assert_eq!(
        trace::stop(),
        Trace::default(),
        "nothing recording: an empty trace"
    );
    // A new recording starts empty.
    trace::start(TraceConfig::default()).unwrap();
    let t = trace::stop();
    assert!(events_of(&t, "trace_record::stop").is_empty());
}

#[test]
fn off_records_nothing() {
    let Some(_g) = serial() else { return };
    let a = Traced::named(System, "trace_record::off");
    let pool = Pool::new(Src::<1>);
    drop(Box::new_in(1u64, &a));
    drop(Box::new_in(1u64, &pool));
    pool.trim();
    trace::start(TraceConfig::default()).unwrap();
    let t = trace::stop();
    assert!(events_of(&t, "trace_record::off").is_empty());
    assert!(events_of(&t, "Pool<Src<1>>").is_empty());
}

#[test]
fn a_pool_records_free_requested_then_completed_when_the_gpu_use_ends() {
    let Some(_g) = serial() else { return };
    let pool = Pool::new(Src::<2>);
    let layout = Layout::from_size_align(64, 8).unwrap();
    trace::start(TraceConfig::default()).unwrap();
    let used = pool.allocate(layout).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    assert!(pool
        .record_fence(used.cast::<u8>().as_ptr(), Flag(done.clone()))
        .unwrap());
    // SAFETY: allocated above; not used again.
    unsafe { pool.deallocate(used.cast(), layout) };
    let unused = pool.allocate(layout).unwrap();
    // SAFETY: allocated just above; not used again.
    unsafe { pool.deallocate(unused.cast(), layout) };
    done.store(true, Ordering::Release);
    assert_eq!(pool.collect_pending(), 1);
    let t = trace::stop();
    let e: Vec<&Event> = events_of(&t, "Pool<Src<2>>")
        .into_iter()
        .filter(|e| {
            matches!(
                e.action,
                Action::Alloc | Action::FreeRequested | Action::FreeCompleted
            )
        })
        .collect();
    let u = used.cast::<u8>().as_ptr() as u64;
    let n = unused.cast::<u8>().as_ptr() as u64;
    assert_ne!(u, n, "the pending block is not reused");
    let got: Vec<(&str, u64)> = e.iter().map(|e| (e.action.torch_name(), e.addr)).collect();
    assert_eq!(
        got,
        [
            ("alloc", u),
            ("free_requested", u),
            ("alloc", n),
            ("free_requested", n),
            ("free_completed", n), // no uses: at once
            ("free_completed", u), // when its use completed
        ]
    );
    assert_eq!((e[0].size, e[0].given, e[0].align), (64, 64, 8));
}

#[test]
fn a_pool_records_failures_with_their_error_segments_and_trims() {
    let Some(_g) = serial() else { return };
    let pool = Pool::with_config(
        Src::<3>,
        PoolConfig::default().with_limit(4 << 20).with_pending_wait(None),
    );
    trace::start(TraceConfig::default()).unwrap();
    let big = Layout::from_size_align(8 << 20, 8).unwrap();
    assert!(pool.allocate(big).is_err());
    let v: AVec<u8, _> = AVec::with_capacity_in(1 << 20, &pool);
    drop(v);
    let released = pool.trim();
    let t = trace::stop();
    let e = events_of(&t, "Pool<Src<3>>");
    let fail = e
        .iter()
        .find(|e| matches!(e.action, Action::Failure(_)))
        .expect("a failure");
    let Action::Failure(msg) = &fail.action else {
        unreachable!()
    };
    assert!(msg.contains("exceeds the limit"), "{msg}");
    assert_eq!((fail.size, fail.addr), (8 << 20, 0));
    let names = actions(&e);
    let pos = |what: &str| names.iter().position(|n| *n == what);
    let seg = pos("segment_alloc").expect("a segment taken");
    assert!(seg < pos("alloc").unwrap(), "{names:?}");
    assert!(
        pos("segment_free").unwrap() > pos("free_completed").unwrap(),
        "{names:?}"
    );
    let trim = e.iter().find(|e| e.action == Action::Trim).expect("the trim");
    assert_eq!(trim.size as usize, released);
    let seg_bytes: u64 = e
        .iter()
        .filter(|e| e.action == Action::SegmentFree)
        .map(|e| e.size)
        .sum();
    assert_eq!(seg_bytes as usize, released);
}

#[test]
fn a_grow_is_a_free_then_an_alloc() {
    let Some(_g) = serial() else { return };
    let pool = Pool::new(Src::<4>);
    let traced = Traced::named(System, "trace_record::grow");
    trace::start(TraceConfig::default()).unwrap();
    let mut v: AVec<u8, _> = AVec::with_capacity_in(100, &pool);
    v.reserve(2 << 20); // a large block: moved
    let mut w: AVec<u8, _> = AVec::with_capacity_in(100, &traced);
    w.reserve(1000);
    let (vp, wp) = (v.as_ptr() as u64, w.as_ptr() as u64);
    drop((v, w));
    let t = trace::stop();
    for name in ["Pool<Src<4>>", "trace_record::grow"] {
        let e: Vec<&Event> = events_of(&t, name)
            .into_iter()
            .filter(|e| matches!(e.action, Action::Alloc | Action::FreeRequested))
            .collect();
        let sizes: Vec<(&str, u64)> = e.iter().map(|e| (e.action.torch_name(), e.size)).collect();
        assert_eq!(sizes.len(), 4, "{name}: {sizes:?}");
        assert_eq!(sizes[0], ("alloc", 100), "{name}");
        // Live at once: the new block before the old one's free (a move), or after it
        // (in place); either way both sizes appear and the last free is the new block's.
        assert!(sizes.contains(&("free_requested", 100)), "{name}: {sizes:?}");
        assert_eq!(sizes[3].0, "free_requested", "{name}");
        let last = if name.starts_with("Pool") { vp } else { wp };
        assert_eq!(e[3].addr, last, "{name}");
    }
}

#[test]
fn arenas_and_handles_record_under_their_names() {
    let Some(_g) = serial() else { return };
    let mut arena = Arena::new(Src::<5>);
    trace::start(TraceConfig::default()).unwrap();
    let b = Box::new_in(7u32, &arena);
    let p = Box::new_in([0u8; 48], cudalloc::PinnedAlloc);
    let pp = &*p as *const [u8; 48] as u64;
    drop((b, p));
    arena.reset();
    drop(arena);
    let t = trace::stop();
    let e = events_of(&t, "Arena<Src<5>>");
    let names = actions(&e);
    assert_eq!(names[0], "segment_alloc", "{names:?}");
    assert_eq!(&names[1..4], ["alloc", "free_requested", "free_completed"]);
    assert_eq!((e[1].size, e[1].align), (4, 4));
    assert_eq!(names.last(), Some(&"segment_free"), "{names:?}");
    let pinned = if cudalloc::cuda::driver_available() {
        "PinnedAlloc"
    } else {
        "PinnedAlloc(fallback)"
    };
    let e = events_of(&t, pinned);
    let mine: Vec<&&Event> = e.iter().filter(|e| e.addr == pp).collect();
    assert!(mine.len() >= 2, "{pinned}: {:?}", actions(&e));
    assert_eq!((mine[0].action.clone(), mine[0].size), (Action::Alloc, 48));
}

#[cfg(feature = "backtrace")]
#[test]
fn sites_name_the_allocating_function() {
    let Some(_g) = serial() else { return };
    let a = Traced::named(System, "trace_record::sites");
    trace::start(TraceConfig::default().with_sites(true)).unwrap();
    #[inline(never)]
    fn allocating_here(a: &Traced<System>) {
        drop(std::hint::black_box(Box::new_in(5u64, a)));
    }
    allocating_here(&a);
    let t = trace::stop();
    let e = events_of(&t, "trace_record::sites");
    let frames = &e[0].frames;
    assert!(
        frames.iter().any(|f| f.name.contains("allocating_here")),
        "{frames:#?}"
    );
    assert!(!frames[0].name.contains("cudalloc::trace"), "{frames:#?}");
}

#[cfg(not(feature = "backtrace"))]
#[test]
fn sites_without_the_backtrace_feature_are_refused() {
    let Some(_g) = serial() else { return };
    let err = trace::start(TraceConfig::default().with_sites(true)).unwrap_err();
    assert!(err.to_string().contains("backtrace"), "{err}");
    assert!(!trace::is_recording());
}

// ---- device pools ----------------------------------------------------------------------

use cudalloc::cuda::Stream;
use cudalloc::device::sim::{SimPool, SimStream};
use cudalloc::device::{Backing, DeviceArena, DevicePool, DevicePoolConfig};
use cudalloc::trace::replay::{self, DevicePoolTarget, Plan, ReplayOptions, SimTarget};
use cudalloc::trace::{TraceMemory, TracedAllocator};

/// The events of every allocator named `name` on the streams `streams` (the process-wide
/// device pools and other tests' pools share the name; stream ids are never reused).
fn on_streams<'t>(t: &'t Trace, name: &str, streams: &[u64]) -> Vec<&'t Event> {
    t.events
        .iter()
        .filter(|e| t.allocators[e.allocator as usize].name == name && streams.contains(&e.stream))
        .collect()
}

/// A trace of `events` alone, as one device allocator's (for a replay).
fn device_trace(events: &[&Event]) -> Trace {
    let mut t = Trace::default();
    t.allocators
        .push(TracedAllocator::new("recorded", TraceMemory::Device, 0));
    t.events = events
        .iter()
        .map(|&e| {
            let mut e = e.clone();
            e.allocator = 0;
            e
        })
        .collect();
    t
}

/// `events` without the segment events (the driver pool's growths and trims, which
/// `a_simulated_driver_pool_records_its_growth_and_trim_as_segments` tests).
fn without_segments(events: Vec<&Event>) -> Vec<&Event> {
    events
        .into_iter()
        .filter(|e| !matches!(e.action, Action::SegmentAlloc | Action::SegmentFree))
        .collect()
}

/// The segment events of `events`, as (action, address, size, stream).
fn segments(events: &[&Event]) -> Vec<(&'static str, u64, u64, u64)> {
    events
        .iter()
        .filter(|e| matches!(e.action, Action::SegmentAlloc | Action::SegmentFree))
        .map(|e| (e.action.torch_name(), e.addr, e.size, e.stream))
        .collect()
}

/// The snapshot the crate writes of `t`, read by the standard-library checker
/// (`tools/check_snapshot.py`) and, where PyTorch is installed (the GPU machine),
/// by `python3 -m torch.cuda._memory_viz stats` and `trace`: each must succeed. The
/// checker's report (`None`: no python3 or no checker here).
fn snapshot_opens(t: &Trace, what: &str) -> Option<String> {
    let python = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new("python3")
            .args(args)
            .output()
            .ok()
            .map(|o| {
                let text =
                    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
                (o.status.success(), text)
            })
    };
    python(&["--version".as_ref()])?;
    let path = std::env::temp_dir().join(format!("cudalloc-{what}-{}.pickle", std::process::id()));
    let mut bytes = Vec::new();
    cudalloc::trace::format::torch::write(t, &mut bytes).unwrap();
    std::fs::write(&path, bytes).unwrap();
    // The checker where the crate was built, or in the working directory (a binary
    // staged on the GPU machine runs at the root of a copy of the tree).
    let checker = [
        concat!(env!("CARGO_MANIFEST_DIR"), "/tools/check_snapshot.py"),
        "tools/check_snapshot.py",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).is_file());
    let report = checker.map(|checker| {
        let (ok, report) = python(&[checker.as_ref(), path.as_os_str()]).unwrap();
        assert!(ok, "check_snapshot.py on {what}:\n{report}");
        report
    });
    if report.is_none() {
        println!("check_snapshot.py not found: {what} not checked by it");
    }
    if python(&["-c".as_ref(), "import torch.cuda._memory_viz".as_ref()]).is_some_and(|r| r.0) {
        for cmd in ["stats", "trace"] {
            let args = [
                "-m".as_ref(),
                "torch.cuda._memory_viz".as_ref(),
                cmd.as_ref(),
                path.as_os_str(),
            ];
            let (ok, text) = python(&args).unwrap();
            assert!(ok, "_memory_viz {cmd} on {what}:\n{text}");
            println!("_memory_viz {cmd} on {what}:\n{text}");
        }
    }
    let _ = std::fs::remove_file(&path);
    report
}

/// Bytes of the `SegmentAlloc`s of `events`, less those of its `SegmentFree`s.
fn segment_bytes(events: &[&Event]) -> (u64, u64) {
    let sum = |a: Action| events.iter().filter(|e| e.action == a).map(|e| e.size).sum();
    (sum(Action::SegmentAlloc), sum(Action::SegmentFree))
}

/// The most bytes live at once by the allocations and frees requested of `events`.
fn peak_requested(events: &[&Event]) -> u64 {
    let (mut live, mut peak) = (0u64, 0u64);
    for e in events {
        match e.action {
            Action::Alloc => live += e.size,
            Action::FreeRequested => live -= e.size,
            _ => {}
        }
        peak = peak.max(live);
    }
    peak
}

#[test]
fn a_simulated_device_pool_records_streams_sizes_hits_and_failures() {
    let Some(_g) = serial() else { return };
    let name = "SimPool(trace_record)";
    let pool = SimPool::new(256 << 20).traced_as(name);
    let (s1, s2) = (SimStream::new(), SimStream::new());
    trace::start(TraceConfig::default()).unwrap();
    let a = pool.alloc(1000, &s1).unwrap(); // a miss
    let addr = a.device_ptr();
    drop(a);
    let hits = pool.hits();
    let b = pool.alloc(1000, &s1).unwrap(); // the hit
    assert_eq!((b.device_ptr(), pool.hits()), (addr, hits + 1));
    let c = pool.alloc(5000, &s2).unwrap();
    let failed = pool.alloc(usize::MAX - 10, &s2).err().unwrap();
    drop(b);
    drop(c);
    let t = trace::stop();
    let e = without_segments(events_of(&t, name));
    assert_eq!(
        actions(&e),
        [
            "alloc",
            "free_requested",
            "free_completed",
            "alloc",
            "alloc",
            "oom", // a failure
            "free_requested",
            "free_completed",
            "free_requested",
            "free_completed"
        ],
        "{e:#?}"
    );
    let mine = t.allocators.iter().find(|a| a.name == name).unwrap();
    assert_eq!((mine.memory, mine.device), (TraceMemory::Device, 0));
    let (one, two) = (e[0].stream, e[4].stream);
    assert!(one != 0 && two != 0 && one != two, "{one} {two}");
    for (i, (size, given, stream)) in [
        (1000, 1024, one),
        (1000, 1024, one),
        (1000, 1024, one),
        (1000, 1024, one),
        (5000, 5120, two),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!((e[i].size, e[i].stream), (size, stream), "event {i}: {:?}", e[i]);
        if e[i].action == Action::Alloc {
            assert_eq!((e[i].given, e[i].align), (given, 256), "event {i}: {:?}", e[i]);
        }
    }
    assert_eq!((e[0].addr, e[3].addr), (addr, addr), "the hit reuses the block");
    match &e[5].action {
        Action::Failure(msg) => assert!(
            !msg.is_empty() && failed.to_string().starts_with(msg.as_ref()),
            "{msg} / {failed}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!((e[5].size, e[5].stream), ((usize::MAX - 10) as u64, two));
    assert_eq!((e[6].addr, e[6].size, e[6].stream), (addr, 1000, one));
    assert_eq!((e[8].size, e[8].stream), (5000, two));
}

#[test]
fn a_simulated_driver_pool_records_its_growth_and_trim_as_segments() {
    let Some(_g) = serial() else { return };
    let name = "SimPool(trace_record segments)";
    const MIB: u64 = 1 << 20;
    let pool = SimPool::new(0).traced_as(name);
    let s = SimStream::new();
    // Reserved before the recording (a chunk of its own): its release is recorded at
    // address 0.
    let early = pool.alloc(128 << 20, &s).unwrap();
    trace::start(TraceConfig::default()).unwrap();
    let a = pool.alloc(1000, &s).unwrap(); // the model grows by a 32 MiB chunk
    let b = pool.alloc(64 << 20, &s).unwrap(); // by a chunk of its own
    let c = pool.alloc(1 << 20, &s).unwrap(); // in a's chunk: no growth
    let (pa, pb) = (a.device_ptr(), b.device_ptr());
    let peak = pool.peak_reserved();
    drop((early, a, b, c));
    pool.trim();
    let t = trace::stop();
    let e = events_of(&t, name);
    let id = e[0].stream;
    assert_eq!(
        segments(&e),
        [
            ("segment_alloc", pa, 32 * MIB, id),
            ("segment_alloc", pb, 64 * MIB, id),
            // The newest growths go back first, then what was reserved before.
            ("segment_free", pb, 64 * MIB, id),
            ("segment_free", pa, 32 * MIB, id),
            ("segment_free", 0, 128 * MIB, 0),
        ],
        "{e:#?}"
    );
    assert_eq!(peak, 224 * MIB, "the model's reservation at its peak");
    // Each growth comes before the allocation it was seen after.
    let names = actions(&e);
    assert_eq!(
        &names[..4],
        ["segment_alloc", "alloc", "segment_alloc", "alloc"],
        "{e:#?}"
    );
    assert_eq!((e[1].addr, e[3].addr), (pa, pb));
    let trim = e.iter().find(|e| e.action == Action::Trim).expect("the trim");
    assert_eq!(segment_bytes(&e), (96 * MIB, 224 * MIB));
    assert_eq!(trim.size, 224 * MIB, "the trim gave back what the segments say");
    // The snapshot holds the segments: none live at the end.
    let mut snap = Vec::new();
    cudalloc::trace::format::torch::write(&device_trace(&e), &mut snap).unwrap();
    let back = cudalloc::trace::format::torch::read(&snap[..]).unwrap();
    assert_eq!(segments(&back.events.iter().collect::<Vec<_>>()), segments(&e));
    // Before the frees: the two growths live, with blocks in them.
    let live = e.iter().position(|e| e.action == Action::FreeRequested).unwrap();
    if let Some(report) = snapshot_opens(&device_trace(&e[..live]), "sim-segments") {
        assert!(report.contains("segment_alloc: 2\n"), "{report}");
        assert!(report.contains("blocks active_allocated: 3\n"), "{report}");
    }
}

#[test]
fn a_simulated_device_trace_replays_to_the_same_peak() {
    let Some(_g) = serial() else { return };
    let name = "SimPool(trace_record replay)";
    let pool = SimPool::new(256 << 20).traced_as(name);
    let streams = [SimStream::new(), SimStream::new()];
    trace::start(TraceConfig::default()).unwrap();
    let mut live = Vec::new();
    for i in 0..200usize {
        live.push(pool.alloc(256 + (i * 7919) % (3 << 20), &streams[i % 2]).unwrap());
        if i % 3 == 2 {
            live.remove((i * 31) % live.len());
        }
    }
    drop(live);
    let t = trace::stop();
    let e: Vec<&Event> = events_of(&t, name)
        .into_iter()
        .filter(|e| {
            matches!(
                e.action,
                Action::Alloc | Action::FreeRequested | Action::FreeCompleted
            )
        })
        .collect();
    assert_eq!(e.iter().filter(|e| e.action == Action::Alloc).count(), 200);
    let recorded = device_trace(&e);
    let plan = Plan::new(&recorded, &ReplayOptions::default()).unwrap();
    assert_eq!(plan.peak_requested(), peak_requested(&e));
    let r = plan.replay(SimTarget::new(256 << 20)).unwrap();
    assert_eq!((r.allocations, r.frees, r.failures), (200, 200, 0));
    assert_eq!(r.peak_requested, peak_requested(&e));
    assert_eq!(r.streams, 2);
}

#[test]
fn a_device_pool_records_allocs_and_frees_on_two_streams() {
    gpu!();
    let Some(_g) = serial() else { return };
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let (s1, s2) = (Stream::new(0).unwrap(), Stream::new(0).unwrap());
    let ids = [s1.id().get(), s2.id().get()];
    trace::start(TraceConfig::default()).unwrap();
    let a = pool.alloc::<u8>(1000, &s1).unwrap();
    let addr = a.device_ptr();
    // 1 MiB: cached by class, so its recorded use gates it until the trim.
    let mut b = pool.alloc::<u32>(1 << 18, &s2).unwrap();
    let b_addr = b.device_ptr();
    drop(a);
    let a2 = pool.alloc::<u8>(1000, &s1).unwrap(); // a hit
    assert_eq!(a2.device_ptr(), addr);
    b.record_use(&s1);
    drop(b); // completes once s1's work has: at the trim
    drop(a2);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    pool.trim();
    let t = trace::stop();
    let e = without_segments(on_streams(&t, "DevicePool(0)", &ids));
    let brief: Vec<(&str, u64, u64, u64)> = e
        .iter()
        .map(|e| (e.action.torch_name(), e.addr, e.size, e.stream))
        .collect();
    let (one, two) = (ids[0], ids[1]);
    assert_eq!(
        brief,
        [
            ("alloc", addr, 1000, one),
            ("alloc", b_addr, 1 << 20, two),
            ("free_requested", addr, 1000, one),
            ("free_completed", addr, 1000, one),
            ("alloc", addr, 1000, one),
            ("free_requested", b_addr, 1 << 20, two),
            ("free_requested", addr, 1000, one),
            ("free_completed", addr, 1000, one),
            ("free_completed", b_addr, 1 << 20, two),
        ],
        "{e:#?}"
    );
    for e in e.iter().filter(|e| e.action == Action::Alloc) {
        assert!(e.given >= e.size && e.given % 256 == 0 && e.align == 256, "{e:?}");
    }
    assert!(
        t.allocators
            .iter()
            .any(|a| a.name == "DevicePool(0)" && a.memory == TraceMemory::Device),
        "{:?}",
        t.allocators
    );
}

#[test]
fn a_device_pool_records_an_out_of_memory_error() {
    gpu!();
    let Some(_g) = serial() else { return };
    let pool = DevicePool::new(0, DevicePoolConfig::default().with_limit(61 << 20)).unwrap();
    let s = Stream::new(0).unwrap();
    trace::start(TraceConfig::default()).unwrap();
    let err = pool.alloc::<u8>(128 << 20, &s).err().unwrap();
    let t = trace::stop();
    assert!(matches!(err, cudalloc::Error::DeviceOutOfMemory { .. }), "{err}");
    let e = on_streams(&t, "DevicePool(0)", &[s.id().get()]);
    assert_eq!(e.len(), 2, "{e:#?}");
    assert_eq!(e[1].action, Action::OutOfMemory);
    match &e[0].action {
        // The recorder keeps a message's first 200 bytes.
        Action::Failure(msg) => assert!(
            !msg.is_empty() && err.to_string().starts_with(msg.as_ref()),
            "{msg} / {err}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(e[0].size, 128 << 20);
}

#[test]
fn a_device_arena_records_its_slices_chunks_and_resets() {
    gpu!();
    let Some(_g) = serial() else { return };
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let s = Stream::new(0).unwrap();
    let id = s.id().get();
    trace::start(TraceConfig::default()).unwrap();
    let mut arena = DeviceArena::with_chunk_size(&pool, &s, 1 << 20).unwrap();
    let x = arena.alloc::<u8>(1000).unwrap().device_ptr();
    let y = arena.alloc::<u64>(100).unwrap().device_ptr();
    let mark = arena.checkpoint();
    let z = arena.alloc::<u8>(4096).unwrap().device_ptr();
    arena.rewind(mark).unwrap();
    arena.reset();
    let chunk = arena.stats().capacity_bytes as u64;
    drop(arena);
    let t = trace::stop();
    let e = on_streams(&t, "DeviceArena(0)", &[id]);
    let brief: Vec<(&str, u64, u64)> = e
        .iter()
        .map(|e| (e.action.torch_name(), e.addr, e.size))
        .collect();
    assert_eq!(
        brief,
        [
            ("segment_alloc", x, chunk),
            ("alloc", x, 1000),
            ("alloc", y, 800),
            ("alloc", z, 4096),
            ("free_requested", z, 4096),
            ("free_completed", z, 4096),
            ("free_requested", x, 1000),
            ("free_completed", x, 1000),
            ("free_requested", y, 800),
            ("free_completed", y, 800),
            ("segment_free", x, chunk),
        ],
        "{e:#?}"
    );
    assert_eq!((e[1].given, e[1].align), (1024, 256));
    // The chunk itself is a buffer of the pool.
    let p = without_segments(on_streams(&t, "DevicePool(0)", &[id]));
    assert_eq!(actions(&p)[..1], ["alloc"]);
    assert_eq!((p[0].addr, p[0].size), (x, chunk));
}

#[test]
fn a_device_pool_records_its_driver_pools_growth_and_trim_as_segments() {
    gpu!();
    backings_in_use!();
    let Some(_g) = serial() else { return };
    // With `Auto`, blocks below the page heap's threshold (the large ones map pages:
    // `SegmentMap`s, apart), so that the stats' reservation is the driver pool's.
    let small = [1000usize, 1 << 20, 5000, 300 << 10];
    let large = [1000usize, 1 << 20, 3 << 20, 64 << 20, 200 << 20, 5000];
    for (backing, sizes) in [(Backing::DriverPool, &large[..]), (Backing::Auto, &small[..])] {
        let pool = DevicePool::new(0, DevicePoolConfig::default().with_backing(backing)).unwrap();
        let s = Stream::new(0).unwrap();
        let id = s.id().get();
        trace::start(TraceConfig::default()).unwrap();
        let before = pool.stats().reserved_bytes;
        let blocks: Vec<_> = sizes.iter().map(|&n| pool.alloc::<u8>(n, &s).unwrap()).collect();
        let grown = pool.stats().reserved_bytes;
        drop(blocks);
        s.synchronize().unwrap();
        pool.trim();
        let after = pool.stats().reserved_bytes;
        let t = trace::stop();
        // Other tests' pools share the name: this stream's events alone (a release of what
        // the pool reserved before the recording would be at stream 0).
        let e = on_streams(&t, "DevicePool(0)", &[id]);
        let (alloc, free) = segment_bytes(&e);
        println!(
            "{backing:?}: reserved {before} -> {grown} -> {after}; segments {:?}",
            segments(&e)
        );
        assert!(alloc > 0, "{backing:?}: the driver pool grew: {e:#?}");
        assert_eq!(
            alloc,
            grown - before,
            "{backing:?}: the growth the pool's stats report"
        );
        // The growths go back first.
        assert_eq!(
            free,
            (grown - after).min(alloc),
            "{backing:?}: the trim gave back what the stats say"
        );
        // Each growth was seen after an allocation of this stream: at its block.
        for (i, g) in e
            .iter()
            .enumerate()
            .filter(|(_, g)| g.action == Action::SegmentAlloc)
        {
            assert_eq!(g.stream, id, "{g:?}");
            let next = e[i + 1..].iter().find(|n| n.action == Action::Alloc).unwrap();
            assert_eq!(next.addr, g.addr, "{g:?} then {next:?}");
        }
        // The snapshot before the frees (growths live, blocks in them) and after opens.
        let live = e.iter().position(|e| e.action == Action::FreeRequested).unwrap();
        let growths = e.iter().filter(|e| e.action == Action::SegmentAlloc).count();
        if let Some(report) = snapshot_opens(&device_trace(&e[..live]), "gpu-segments") {
            assert!(
                report.contains(&format!("segment_alloc: {growths}\n")),
                "{report}"
            );
        }
        snapshot_opens(&device_trace(&e), "gpu-segments-trimmed");
    }
}

#[test]
fn a_recorded_device_trace_replays_on_the_gpu_to_the_same_peak() {
    gpu!();
    let Some(_g) = serial() else { return };
    let pool = DevicePool::new(0, DevicePoolConfig::default()).unwrap();
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let ids: Vec<u64> = streams.iter().map(|s| s.id().get()).collect();
    trace::start(TraceConfig::default()).unwrap();
    let mut live = Vec::new();
    for i in 0..300usize {
        live.push(
            pool.alloc::<u8>(256 + (i * 7919) % (6 << 20), &streams[i % 2])
                .unwrap(),
        );
        if i % 3 == 2 {
            live.remove((i * 31) % live.len());
        }
    }
    drop(live);
    let t = trace::stop();
    let e: Vec<&Event> = on_streams(&t, "DevicePool(0)", &ids)
        .into_iter()
        .filter(|e| {
            matches!(
                e.action,
                Action::Alloc | Action::FreeRequested | Action::FreeCompleted
            )
        })
        .collect();
    assert_eq!(e.iter().filter(|e| e.action == Action::Alloc).count(), 300);
    let recorded = device_trace(&e);
    let plan = Plan::new(&recorded, &ReplayOptions::default()).unwrap();
    assert_eq!(plan.peak_requested(), peak_requested(&e));
    let target = DevicePoolTarget::new("replayed", 0, DevicePoolConfig::default()).unwrap();
    let r = plan.replay(target).unwrap();
    assert_eq!((r.allocations, r.frees, r.failures), (300, 300, 0), "{r:?}");
    assert_eq!(r.peak_requested, peak_requested(&e));
    assert_eq!(r.streams, 2);
    assert!(r.peak_held >= r.peak_requested, "{r:?}");
    // The same through `replay::replay`, on the trace as recorded.
    let again = replay::replay(
        &recorded,
        DevicePoolTarget::uncached("uncached", 0).unwrap(),
        &ReplayOptions::default(),
    )
    .unwrap();
    assert_eq!(again.peak_requested, r.peak_requested);
}

/// Each recorded thread's events, in the trace's order, as (step, action) where the size
/// `8 * (1 + step)` names the step: a thread's events must be whole steps, consecutive,
/// each its alloc, free requested, free completed (the last step may be cut short).
fn steps_of_each_thread(t: &Trace, name: &str) -> Vec<Vec<(u64, &'static str)>> {
    let e = events_of(t, name);
    let mut threads: Vec<u32> = e.iter().map(|e| e.thread).collect();
    threads.sort_unstable();
    threads.dedup();
    threads
        .iter()
        .map(|&th| {
            e.iter()
                .filter(|e| e.thread == th)
                .map(|e| (e.size / 8 - 1, e.action.torch_name()))
                .collect()
        })
        .collect()
}

fn assert_whole_consecutive_steps(steps: &[(u64, &'static str)], what: &str) {
    const CYCLE: [&str; 3] = ["alloc", "free_requested", "free_completed"];
    let first = steps.first().map_or(0, |s| s.0);
    for (i, &(step, action)) in steps.iter().enumerate() {
        assert_eq!(step, first + (i / 3) as u64, "{what}: event {i} of its step");
        assert_eq!(action, CYCLE[i % 3], "{what}: event {i} of the cycle");
    }
}

#[test]
fn stopping_while_threads_record_keeps_whole_events_in_each_threads_order() {
    let Some(_g) = serial() else { return };
    const THREADS: usize = 3;
    let a = Traced::named(System, "trace_record::stopping");
    let steps: Vec<std::sync::atomic::AtomicU64> = (0..THREADS)
        .map(|_| std::sync::atomic::AtomicU64::new(0))
        .collect();
    let done = AtomicBool::new(false);
    // Each thread has taken `n` more steps than it had at the call.
    let wait_steps = |n: u64| {
        let from: Vec<u64> = steps.iter().map(|s| s.load(Ordering::Acquire)).collect();
        for (s, f) in steps.iter().zip(from) {
            while s.load(Ordering::Acquire) < f + n {
                std::thread::yield_now();
            }
        }
    };
    trace::start(TraceConfig::default()).unwrap();
    let (first, second) = std::thread::scope(|s| {
        for step in &steps {
            let (a, done) = (&a, &done);
            s.spawn(move || {
                let mut i = 0;
                while !done.load(Ordering::Acquire) {
                    let l = Layout::from_size_align(8 * (1 + i), 8).unwrap();
                    let p = a.allocate(l).unwrap();
                    // SAFETY: allocated just above with `l`.
                    unsafe { a.deallocate(p.cast(), l) };
                    i += 1;
                    step.store(i as u64, Ordering::Release);
                }
            });
        }
        // Stopped while every thread records, then recorded again (the buffers reused
        // mid-run), and stopped again.
        wait_steps(200);
        let first = trace::stop();
        wait_steps(200);
        trace::start(TraceConfig::default()).unwrap();
        wait_steps(200);
        let second = trace::stop();
        done.store(true, Ordering::Release);
        (first, second)
    });
    for (t, which) in [(&first, "first"), (&second, "second")] {
        let threads = steps_of_each_thread(t, "trace_record::stopping");
        assert_eq!(threads.len(), THREADS, "{which}: every thread recorded");
        for (th, steps) in threads.iter().enumerate() {
            let w = format!("{which} recording, thread {th}");
            // The cycle from the first alloc: the second recording starts mid-step (the
            // first of its 200 steps may have allocated before `start`).
            let from = steps.iter().position(|s| s.1 == "alloc").unwrap();
            assert!(
                steps.len() - from >= 3 * 199,
                "{which}: {} events, {} of them before the first alloc",
                steps.len(),
                from
            );
            assert_whole_consecutive_steps(&steps[from..], &w);
        }
        let mut seqs: Vec<u64> = t.events.iter().map(|e| e.seq).collect();
        seqs.dedup();
        assert_eq!(seqs.len(), t.events.len(), "{which}: every seq distinct");
    }
}
