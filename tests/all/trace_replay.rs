//! Replay: traces run again on the allocators, in their recorded order and threads, with
//! what they measured; bad traces refused with the event named.

use std::sync::Mutex;
use std::thread::ThreadId;

use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;
use cudalloc::trace::format::Location;
use cudalloc::trace::replay::{
    self, random_workload, targets, HostTarget, Plan, RandomWorkload, ReplayError, ReplayOptions,
    ReplayTarget,
};
use cudalloc::trace::{Action, Event, Trace, TraceMemory};

fn ev(action: Action, thread: u32, addr: u64, size: u64) -> Event {
    let mut e = Event::new(action, addr, size);
    e.thread = thread;
    e
}

/// Notes which OS thread ran each allocation (identified by its size) and in what order.
#[derive(Default)]
struct Witness {
    seen: Mutex<Vec<(ThreadId, u64)>>,
}

impl ReplayTarget for &Witness {
    type Block = u64;
    fn name(&self) -> String {
        "witness".into()
    }
    fn alloc(&self, size: usize, _align: usize, _stream: usize) -> Result<(u64, usize), String> {
        self.seen
            .lock()
            .unwrap()
            .push((std::thread::current().id(), size as u64));
        Ok((size as u64, size))
    }
    unsafe fn free(&self, _block: u64, _stream: usize) {}
}

#[test]
fn a_trace_with_threads_replays_each_threads_events_in_order_on_a_thread_of_its_own() {
    // 3 recorded threads, interleaved; allocation i has size i + 1, on thread i % 3 (or
    // in runs of 2 for variety); frees from other threads than the allocating one.
    let mut t = Trace::default();
    let mut expected = Vec::new();
    for i in 0..600u64 {
        let thread = ((i / 2) % 3) as u32;
        t.events.push(ev(Action::Alloc, thread, 0x1000 + i * 64, i + 1));
        expected.push((thread, i + 1));
        if i % 5 == 4 {
            t.events.push(ev(
                Action::FreeRequested,
                (thread + 1) % 3,
                0x1000 + (i - 2) * 64,
                i - 1,
            ));
        }
    }
    let w = Witness::default();
    let r = replay::replay(&t, &w, &ReplayOptions::default()).unwrap();
    assert_eq!((r.threads, r.allocations, r.frees), (3, 600, 120));
    let seen = w.seen.into_inner().unwrap();
    // The global order is the trace's.
    assert_eq!(
        seen.iter().map(|s| s.1).collect::<Vec<_>>(),
        expected.iter().map(|e| e.1).collect::<Vec<_>>()
    );
    // Each recorded thread ran on one OS thread, a different one for each.
    let mut os: Vec<Option<ThreadId>> = vec![None; 3];
    for ((id, _), (thread, _)) in seen.iter().zip(&expected) {
        let slot = os[*thread as usize].get_or_insert(*id);
        assert_eq!(slot, id, "recorded thread {thread} moved between OS threads");
    }
    let ids: Vec<ThreadId> = os.into_iter().map(Option::unwrap).collect();
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
}

#[test]
fn a_replay_gives_the_traces_peak_request_and_allocation_count_and_reports_blocks_never_freed() {
    let mut trace = random_workload(&RandomWorkload {
        allocations: 3000,
        threads: 2,
        ..RandomWorkload::small()
    });
    // Drop the final frees of the last 10 blocks: they are never freed.
    let frees_at_end = trace.events.len() - 10;
    let never: u64 = trace.events[frees_at_end..].iter().map(|e| e.size).sum();
    trace.events.truncate(frees_at_end);
    let allocs = trace.events.iter().filter(|e| e.action == Action::Alloc).count() as u64;
    let plan = Plan::new(&trace, &ReplayOptions::default()).unwrap();
    let pool = HostTarget::new("Pool", Pool::new(HostSource))
        .with_peak_reserved(|p| p.stats().peak_source_bytes as u64);
    let r = plan.replay(pool).unwrap();
    assert_eq!(r.allocations, allocs);
    assert_eq!(r.frees, allocs - 10);
    assert_eq!(r.failures, 0);
    assert_eq!(r.peak_requested, plan.peak_requested());
    assert!(r.peak_held >= r.peak_requested);
    assert!(r.peak_reserved.unwrap() >= r.peak_held);
    assert!(r.reserved_ratio().unwrap() >= 1.0);
    assert_eq!((r.never_freed_blocks, r.never_freed_bytes), (10, never));
    assert!(r.alloc_median_ns <= r.alloc_p99_ns && r.free_median_ns <= r.free_p99_ns);
    assert_eq!((r.streams, r.threads), (4, 2));
}

#[test]
fn failed_allocations_are_counted_and_the_replay_goes_on() {
    // 4 blocks of 1 MiB live at once under a pool limited to 2.5 MiB: two fail, their
    // frees are skipped, the rest replays.
    let mut t = Trace::default();
    for i in 0..4 {
        t.events.push(ev(Action::Alloc, 0, 0x10_0000 * (i + 1), 1 << 20));
    }
    for i in 0..4 {
        t.events
            .push(ev(Action::FreeRequested, 0, 0x10_0000 * (i + 1), 1 << 20));
    }
    t.events.push(ev(Action::Alloc, 0, 0x99, 1 << 20));
    t.events.push(ev(Action::FreeRequested, 0, 0x99, 1 << 20));
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default()
            .with_large_threshold(64 << 10)
            .with_limit((5 << 20) / 2),
    );
    let r = replay::replay(&t, HostTarget::new("limited", pool), &ReplayOptions::default()).unwrap();
    assert_eq!((r.allocations, r.failures, r.frees), (3, 2, 3));
    assert!(r.first_failure.unwrap().starts_with("1048576 bytes"));
    assert_eq!(r.peak_requested, 2 << 20);
}

#[test]
fn bad_events_are_errors_naming_the_event_or_skipped_and_counted_when_lenient() {
    let a = |addr, size| ev(Action::Alloc, 0, addr, size);
    let f = |addr| ev(Action::FreeRequested, 0, addr, 8);
    let mut aligned = a(0x40, 8);
    aligned.align = 3;
    let cases: Vec<(Vec<Event>, &str)> = vec![
        (
            vec![a(0x10, 8), f(0x20)],
            "free of 0x20, which the trace never allocated",
        ),
        (
            vec![a(0x10, 8), f(0x10), f(0x10)],
            "double free of 0x10 (event 1 freed it)",
        ),
        (
            vec![a(0x10, 8), a(0x10, 8)],
            "allocation at 0x10, which event 0 allocated",
        ),
        (
            vec![a(0x10, 8), a(0x20, u64::MAX)],
            "allocation of 18446744073709551615 bytes, beyond memory",
        ),
        (vec![a(0x10, 8), aligned], "alignment 3 is not a power of two"),
    ];
    for (events, what) in cases {
        let mut t = Trace::default();
        t.events = events;
        let at = t.events.len() as u64 - 1;
        let global = HostTarget::new("Global", allocator_api2::alloc::Global);
        match replay::replay(&t, global, &ReplayOptions::default()) {
            Err(ReplayError::Trace(e)) => {
                assert_eq!(e.location, Location::Event(at), "{what}");
                assert!(e.message.starts_with(what), "{e}");
            }
            other => panic!("{what}: {other:?}"),
        }
        let global = HostTarget::new("Global", allocator_api2::alloc::Global);
        let r = replay::replay(&t, global, &ReplayOptions::default().with_lenient(true)).unwrap();
        assert_eq!(r.skipped, 1, "{what}");
        assert_eq!(r.allocations, 1, "{what}");
    }
    // A size the host cannot give is a failure, not an error: the allocator says no. (All
    // of a 47-bit address space but 1 MiB: 2^46 bytes were given by an overcommitting
    // kernel on the H200 machine, and beyond 2^47 the replay refuses the event itself.)
    let mut t = Trace::default();
    t.events.push(a(0x10, (1 << 47) - (1 << 20)));
    let r = replay::replay(
        &t,
        HostTarget::new("Global", allocator_api2::alloc::Global),
        &Default::default(),
    )
    .unwrap();
    assert_eq!((r.allocations, r.failures), (0, 1));
}

#[test]
fn every_standard_target_replays_a_multi_stream_trace() {
    let trace = random_workload(&RandomWorkload {
        allocations: 500,
        ..RandomWorkload::small()
    });
    let plan = Plan::new(&trace, &ReplayOptions::default()).unwrap();
    for memory in [TraceMemory::Host, TraceMemory::Device] {
        for t in targets(memory) {
            let r = t.run(&plan).unwrap();
            assert_eq!(r.failures, 0, "{}", t.name);
            assert_eq!(r.peak_requested, plan.peak_requested(), "{}", t.name);
            assert_eq!(r.allocations as usize * 2, plan.len(), "{}", t.name);
            if !cudalloc::cuda::driver_available() && memory == TraceMemory::Device {
                assert!(r.note.unwrap().contains("simulated GPU"), "{}", t.name);
            }
        }
    }
}

#[test]
fn fit_finds_a_limit_that_replays_without_failure() {
    let trace = random_workload(&RandomWorkload {
        allocations: 400,
        max_size: 4 << 20,
        max_usage: 32 << 20,
        ..RandomWorkload::small()
    });
    let plan = Plan::new(&trace, &ReplayOptions::default()).unwrap();
    let pool = targets(TraceMemory::Host)
        .into_iter()
        .find(|t| t.name == "Pool<HostSource>")
        .unwrap();
    let fit = pool.fit(&plan).unwrap().unwrap();
    assert!(fit >= plan.peak_requested());
    // Near the fit a run may fail or not from one run to the next (a best fit among
    // blocks whose order depends on the addresses the system hands out): with a margin
    // it must pass.
    assert_eq!(pool.run_limited(&plan, fit + fit / 8).unwrap().failures, 0);
    // Well below the peak request something must fail.
    assert!(
        pool.run_limited(&plan, plan.peak_requested() / 2)
            .unwrap()
            .failures
            > 0
    );
    assert!(targets(TraceMemory::Host)
        .into_iter()
        .find(|t| t.name == "Global")
        .unwrap()
        .fit(&plan)
        .is_none());
}

#[test]
fn a_device_trace_replays_on_the_gpu_with_its_streams() {
    gpu!();
    let trace = random_workload(&RandomWorkload {
        allocations: 5000,
        max_size: 64 << 20,
        max_usage: 4000 << 20,
        ..RandomWorkload::rmm()
    });
    let plan = Plan::new(&trace, &ReplayOptions::default()).unwrap();
    let allocs = trace.events.iter().filter(|e| e.action == Action::Alloc).count() as u64;
    for t in targets(TraceMemory::Device) {
        let r = t.run(&plan).unwrap();
        println!(
            "{}: {:.1} ms, peak requested {} MiB, reserved {:?}",
            r.allocator,
            r.total_ns as f64 / 1e6,
            r.peak_requested >> 20,
            r.peak_reserved.map(|b| b >> 20)
        );
        // A real GPU: no simulator's note (a pool on pages notes its heap's counters).
        assert!(
            r.note.as_deref().is_none_or(|n| n.starts_with("page heap: ")),
            "a real GPU: {}: {:?}",
            t.name,
            r.note
        );
        assert_eq!(
            (r.allocations, r.failures, r.streams),
            (allocs, 0, 4),
            "{}",
            t.name
        );
        assert_eq!(r.peak_requested, plan.peak_requested(), "{}", t.name);
        if t.limitable {
            assert!(r.peak_reserved.unwrap() >= r.peak_requested, "{}", t.name);
        }
    }
}

#[test]
fn every_sample_trace_replays_on_the_host_allocators_and_its_own_kind() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("csv" | "pickle")))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "{files:?}");
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            bytes.len() < 1 << 20,
            "{}: a sample stays under 1 MB",
            path.display()
        );
        let trace = cudalloc::trace::format::read_any(&bytes, false).unwrap().trace;
        let plan = Plan::new(&trace, &ReplayOptions::default()).unwrap();
        let allocs = trace.events.iter().filter(|e| e.action == Action::Alloc).count() as u64;
        // The pipeline example's recording is small by nature (its rings reuse 41
        // buffers for every batch); the other samples have thousands of allocations.
        assert!(allocs >= 32, "{}: an empty or broken recording", path.display());
        let own = trace.allocators[0].memory;
        let mut kinds = vec![TraceMemory::Host];
        if own == TraceMemory::Device {
            kinds.push(own);
        }
        for memory in kinds {
            for t in targets(memory) {
                let r = t.run(&plan).unwrap();
                let what = format!("{} on {}", path.display(), t.name);
                assert_eq!((r.allocations, r.failures), (allocs, 0), "{what}");
                assert_eq!(r.peak_requested, plan.peak_requested(), "{what}");
                assert_eq!(r.never_freed_blocks, 0, "{what}");
            }
        }
    }
}

/// Panics on its 5th allocation.
struct Panicky(std::sync::atomic::AtomicUsize);

impl ReplayTarget for Panicky {
    type Block = ();
    fn name(&self) -> String {
        "panicky".into()
    }
    fn alloc(&self, size: usize, _align: usize, _stream: usize) -> Result<((), usize), String> {
        if self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 4 {
            panic!("a target's bug");
        }
        Ok(((), size))
    }
    unsafe fn free(&self, _block: (), _stream: usize) {}
}

#[test]
fn a_target_that_panics_ends_the_replay_with_an_error_not_a_hang() {
    let mut t = Trace::default();
    for i in 0..40u64 {
        t.events
            .push(ev(Action::Alloc, (i % 4) as u32, 0x100 * (i + 1), 8));
    }
    let mut one = t.clone();
    for e in &mut one.events {
        e.thread = 0;
    }
    // On 4 threads (the others stop waiting for their turn) and on one.
    for trace in [&t, &one] {
        let r = replay::replay(trace, Panicky(Default::default()), &ReplayOptions::default());
        match r {
            Err(ReplayError::Target(e)) => assert!(e.contains("panicked"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
}

/// `tools/peers_replay.py` (the peers, PyTorch's and CuPy's allocators, replaying a trace
/// from Python) run with these arguments: its exit status, stdout and stderr; `None`
/// without python3 (the test is then skipped).
fn peers_replay(args: &[&str]) -> Option<(Option<i32>, String, String)> {
    let out = std::process::Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tools/peers_replay.py"))
        .args(args)
        .output();
    match out {
        Ok(o) => Some((
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )),
        Err(e) => {
            println!("skipped: no python3 on PATH ({e})");
            None
        }
    }
}

#[test]
fn the_peers_replay_tool_passes_its_self_test() {
    // Its reader and plan against hand-made traces (the crate's messages), and every
    // allocator's child process (the empty loop, a fake pool, and torch and cupy through
    // the stand-ins in tools/peers_fakes) against figures computed from the rows alone.
    let Some((code, out, err)) = peers_replay(&["--self-test"]) else {
        return;
    };
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("self-test: ok"), "{out}{err}");
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn the_peers_replay_tool_reads_and_plans_a_trace_as_the_crate_does() {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/rmm_random.csv");
    let json = std::env::temp_dir().join(format!("cudalloc-peers-{}.json", std::process::id()));
    let Some((code, out, err)) =
        peers_replay(&[sample, "--allocators", "fake", "--json", json.to_str().unwrap()])
    else {
        return;
    };
    assert_eq!(code, Some(0), "{out}{err}");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let trace = cudalloc::trace::format::read_any(&std::fs::read(sample).unwrap(), false)
        .unwrap()
        .trace;
    let plan = Plan::new(&trace, &ReplayOptions::default()).unwrap();
    let allocs = trace.events.iter().filter(|e| e.action == Action::Alloc).count() as u64;
    let rows = doc["tables"][0]["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["empty", "fake"]);
    for r in rows {
        let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
        assert_eq!(n("allocations"), allocs, "{r}");
        assert_eq!(n("frees"), plan.len() as u64 - allocs, "{r}");
        assert_eq!(n("peak_requested"), plan.peak_requested(), "{r}");
        assert_eq!(n("streams"), plan.streams() as u64, "{r}");
        assert_eq!((n("failures"), n("never_freed")), (0, 0), "{r}");
    }
    // The fake pool reserves at least what is requested; the empty loop reserves nothing.
    assert!(rows[1]["peak_reserved"].as_u64().unwrap() >= plan.peak_requested());
    assert!(rows[0]["peak_reserved"].is_null());

    // A bad trace: the same error as the crate's, naming the same event.
    let bad = std::env::temp_dir().join(format!("cudalloc-peers-bad-{}.csv", std::process::id()));
    std::fs::write(
        &bad,
        "Thread,Time,Action,Pointer,Size,Stream\n\
         1,10:00:00.000001,allocate,0x10,8,0x0\n\
         1,10:00:00.000002,free,0x10,8,0x0\n\
         1,10:00:00.000003,free,0x10,8,0x0\n",
    )
    .unwrap();
    let crate_error = Plan::new(
        &cudalloc::trace::format::read_any(&std::fs::read(&bad).unwrap(), false)
            .unwrap()
            .trace,
        &ReplayOptions::default(),
    )
    .unwrap_err()
    .to_string();
    let (code, _, err) = peers_replay(&[bad.to_str().unwrap(), "--allocators", "fake"]).unwrap();
    let _ = std::fs::remove_file(&bad);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&crate_error), "{crate_error:?} not in {err}");
}

/// A target that allocates nothing and hands out any size.
struct Nothing;

impl ReplayTarget for Nothing {
    type Block = ();
    fn name(&self) -> String {
        "nothing".into()
    }
    fn alloc(&self, size: usize, _align: usize, _stream: usize) -> Result<((), usize), String> {
        Ok(((), size))
    }
    unsafe fn free(&self, _block: (), _stream: usize) {}
}

/// 2^17 blocks of 2^47 bytes (each within the default bound), never freed: 2^64 bytes.
fn live_past_u64() -> Trace {
    let mut t = Trace::default();
    for i in 0..(1u64 << 17) {
        t.events.push(Event::new(Action::Alloc, 0x1000 + i * 16, 1 << 47));
    }
    t
}

/// Found by review (2026-12-06): `Plan::peak_requested` summed live bytes unchecked and
/// panicked when they passed u64.
#[test]
fn the_plans_peak_request_saturates_instead_of_overflowing() {
    let plan = Plan::new(&live_past_u64(), &ReplayOptions::default()).unwrap();
    assert_eq!(plan.peak_requested(), u64::MAX);
}

/// Found by review (2026-12-06): the replay summed requested, held and never-freed bytes
/// unchecked; past u64 a replay thread panicked and the replay blamed the allocator.
#[test]
fn replay_statistics_saturate_instead_of_overflowing() {
    let r = replay::replay(&live_past_u64(), Nothing, &ReplayOptions::default()).unwrap();
    assert_eq!((r.never_freed_blocks, r.never_freed_bytes), (1 << 17, u64::MAX));
    assert_eq!((r.peak_requested, r.peak_held), (u64::MAX, u64::MAX));
}

/// `replay --rounds N`: every allocator replays the trace N times, and its row is the
/// median of those replays, with the fastest and slowest beside it; the trace's own
/// figures are those of a single replay.
#[test]
fn replaying_in_rounds_reports_each_allocators_median_between_its_fastest_and_slowest() {
    use crate::replay_report::{replay_file, ReplayArgs};
    use crate::report::Value;
    let args = |rounds| ReplayArgs {
        trace: concat!(env!("CARGO_MANIFEST_DIR"), "/traces/rmm_random.csv").into(),
        memory: Some(TraceMemory::Host),
        allocators: vec!["global".into(), "pool".into()],
        rounds,
        ..Default::default()
    };
    let heard = Mutex::new(Vec::new());
    let rounds = replay_file(&args(3), &|what: &str| {
        heard.lock().unwrap().push(what.to_owned())
    })
    .unwrap();
    let once = replay_file(&args(1), &|_: &str| {}).unwrap();
    let (table, single) = (&rounds.tables[0], &once.tables[0]);
    let col = |t: &crate::report::Table, key: &str| t.columns.iter().position(|c| c.key == key).unwrap();
    let num = |v: &Value| match v {
        Value::Num(n) => *n,
        other => panic!("not a number: {other:?}"),
    };
    assert!(
        single.columns.iter().all(|c| c.key != "total_min_ms"),
        "one round: no spread columns"
    );
    assert_eq!(table.rows.len(), single.rows.len());
    assert!(table.rows.len() >= 2, "the rows asked for: {:?}", table.rows);
    let heard = heard.into_inner().unwrap();
    for (row, one) in table.rows.iter().zip(&single.rows) {
        let (total, min, max) = (
            num(&row[col(table, "total_ms")]),
            num(&row[col(table, "total_min_ms")]),
            num(&row[col(table, "total_max_ms")]),
        );
        assert!(min <= total && total <= max, "{row:?}");
        let Value::Text(name) = &row[0] else {
            panic!("{row:?}")
        };
        for round in 1..=3 {
            let step = format!("{name} (round {round} of 3)");
            assert!(heard.contains(&step), "{step} not run: {heard:?}");
        }
        for key in ["peak_requested", "failures", "never_freed"] {
            assert_eq!(row[col(table, key)], one[col(single, key)], "{name}: {key}");
        }
    }
    assert!(table
        .notes
        .iter()
        .any(|n| n.contains("replayed the trace 3 times")));
}
