//! Trace formats: RMM's CSV log, PyTorch's snapshot pickle and the SVG timeline, each
//! written and read back, and each reader's answer to bad input.

use std::borrow::Cow;

use cudalloc::trace::format::{self, rmm, Location};
use cudalloc::trace::replay::{random_workload, RandomWorkload};
use cudalloc::trace::{Action, Event, Trace, TraceMemory, TracedAllocator};

/// A log as RMM's `logging_resource_adaptor` writes it (spdlog's `%t,%H:%M:%S.%f` then
/// `allocate,%p,%zu,<stream in hex>`): two OS threads, two streams, a failure.
const RMM_LOG: &str = "Thread,Time,Action,Pointer,Size,Stream
140202131208960,23:59:59.999000,allocate,0x7f8a3c000000,1024,0x0
140202131208960,23:59:59.999500,allocate,0x7f8a3c000400,4096,0x55d1c6f3a2b0
140202122816256,00:00:00.000250,allocate failure,(nil),1099511627776,0x55d1c6f3a2b0
140202122816256,00:00:00.001000,free,0x7f8a3c000000,1024,0x0
140202131208960,00:00:00.002000,free,0x7f8a3c000400,4096,0x55d1c6f3a2b0
";

#[test]
fn rmm_log_as_rmm_writes_it_parses() {
    let t = rmm::read(RMM_LOG).unwrap();
    assert_eq!(
        t.allocators,
        vec![TracedAllocator::new("RMM log", TraceMemory::Device, 0)]
    );
    let got: Vec<(u32, u64, Action, u64, u64, u64)> = t
        .events
        .iter()
        .map(|e| (e.thread, e.time_ns, e.action.clone(), e.addr, e.size, e.stream))
        .collect();
    let fail = Action::Failure(Cow::Borrowed("allocate failure"));
    assert_eq!(
        got,
        vec![
            (0, 0, Action::Alloc, 0x7f8a_3c00_0000, 1024, 0),
            (
                0,
                500_000,
                Action::Alloc,
                0x7f8a_3c00_0400,
                4096,
                0x55d1_c6f3_a2b0
            ),
            // Past midnight: the clock wrapped, the time goes on.
            (1, 1_250_000, fail, 0, 1 << 40, 0x55d1_c6f3_a2b0),
            (1, 2_000_000, Action::FreeRequested, 0x7f8a_3c00_0000, 1024, 0),
            (
                0,
                3_000_000,
                Action::FreeRequested,
                0x7f8a_3c00_0400,
                4096,
                0x55d1_c6f3_a2b0
            ),
        ]
    );
    assert!(t.events.iter().enumerate().all(|(i, e)| e.seq == i as u64));
}

fn written(t: &Trace) -> String {
    let mut out = Vec::new();
    rmm::write(t, &mut out).unwrap();
    String::from_utf8(out).unwrap()
}

#[test]
fn rmm_log_round_trips_rmm_rows_exactly() {
    // RMM's own log: read, written, the same text (up to the thread ids' and clock's
    // renumbering: read again, the same events).
    let t = rmm::read(RMM_LOG).unwrap();
    let text = written(&t);
    assert!(text.starts_with(
        "Thread,Time,Action,Pointer,Size,Stream\n0,00:00:00.000000,allocate,0x7f8a3c000000,1024,0x0\n"
    ));
    assert!(text.contains("\n1,00:00:00.001250,allocate failure,(nil),1099511627776,0x55d1c6f3a2b0\n"));
    assert_eq!(rmm::read(&text).unwrap(), t);
    // A generated workload with 4 streams and 3 threads: every event survives.
    let w = random_workload(&RandomWorkload {
        allocations: 2000,
        threads: 3,
        ..RandomWorkload::small()
    });
    let back = rmm::read(&written(&w)).unwrap();
    assert_eq!(back.events.len(), w.events.len());
    for (a, b) in w.events.iter().zip(&back.events) {
        assert_eq!(
            (a.seq, a.time_ns, &a.action, a.addr, a.size, a.stream),
            (b.seq, b.time_ns, &b.action, b.addr, b.size, b.stream)
        );
    }
}

#[test]
fn rmm_writer_leaves_out_what_rmm_has_no_row_for() {
    let mut t = Trace::default();
    for a in [
        Action::SegmentAlloc,
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::Trim,
        Action::OutOfMemory,
    ] {
        t.events.push(Event::new(a, 0x1000, 64));
    }
    let mut out = Vec::new();
    assert_eq!(rmm::write(&t, &mut out).unwrap(), 2);
    let lines: Vec<String> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[1].contains(",allocate,0x1000,64,0x0") && lines[2].contains(",free,0x1000,64,0x0"));
}

#[test]
fn rmm_reader_names_the_bad_line() {
    let h = "Thread,Time,Action,Pointer,Size,Stream\n";
    let good = "1,10:00:00.000001,allocate,0x1000,64,0x0\n";
    let cases = [
        ("1,10:00:00.000001,allocate,0x1000,64\n", "expected 6 fields"),
        ("x,10:00:00.000001,allocate,0x1000,64,0x0\n", "thread `x`"),
        (
            "1,10:00:61.000001,allocate,0x1000,64,0x0\n",
            "time `10:00:61.000001`",
        ),
        ("1,10:00,allocate,0x1000,64,0x0\n", "time `10:00`"),
        ("1,10:00:00.000001,alloc,0x1000,64,0x0\n", "action `alloc`"),
        ("1,10:00:00.000001,allocate,0xZZ,64,0x0\n", "pointer `0xZZ`"),
        ("1,10:00:00.000001,allocate,(nil),64,0x0\n", "null pointer"),
        ("1,10:00:00.000001,allocate,0x1000,-5,0x0\n", "size `-5`"),
        (
            "1,10:00:00.000001,allocate,0x1000,99999999999999999999,0x0\n",
            "size `9999",
        ),
        ("1,10:00:00.000001,allocate,0x1000,64,stream\n", "stream `stream`"),
    ];
    for (bad, what) in cases {
        let text = format!("{h}{good}{bad}{good}");
        let e = rmm::read(&text).unwrap_err();
        assert_eq!(e.location, Location::Line(3), "{bad}");
        assert!(e.message.contains(what), "{bad}: {e}");
        // Lenient: the bad line is skipped and named, the rest read.
        let l = rmm::read_lenient(&text).unwrap();
        assert_eq!((l.trace.events.len(), l.skipped.len()), (2, 1), "{bad}");
        assert_eq!(l.skipped[0], e);
    }
    for (text, at) in [("", Location::Input), ("\n\nfoo,bar\n", Location::Line(3))] {
        assert_eq!(rmm::read(text).unwrap_err().location, at);
        assert_eq!(rmm::read_lenient(text).unwrap_err().location, at);
    }
    // Not UTF-8-dependent, no panic on odd bytes or huge lines.
    let junk = format!("{h}{}\n", "\u{fffd},".repeat(10_000));
    assert!(rmm::read(&junk).is_err());
}

/// Found by review (2026-12-06): the day counter times 24 h overflowed u64 after 213,504
/// midnight crossings (a panic, or times wrapping round).
#[test]
fn rmm_times_past_u64_nanoseconds_saturate_in_order_instead_of_overflowing() {
    // 23:00 then 01:00: a midnight crossing every other line, 220,000 in all (the fewest
    // that pass 2^64 ns: each crossing needs a drop of more than 12 h).
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    text.push_str(
        &"1,23:00:00.000000,allocate,0x1000,8,0x0\n1,01:00:00.000000,free,0x1000,8,0x0\n".repeat(220_000),
    );
    let t = rmm::read(&text).unwrap();
    assert_eq!(t.events.len(), 440_000);
    assert!(
        t.events.windows(2).all(|w| w[0].time_ns <= w[1].time_ns),
        "times went backwards"
    );
    let first = 23 * 3600 * 1_000_000_000;
    assert_eq!(t.events.last().map(|e| e.time_ns), Some(u64::MAX - first));
}

/// Found by review (2026-12-06): a lenient read of an RMM log failed as a whole for one
/// byte that is not UTF-8, instead of skipping its line.
#[test]
fn a_lenient_read_of_an_rmm_log_skips_a_line_that_is_not_utf8() {
    let mut bytes =
        b"Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x1000,64,0x0\n".to_vec();
    bytes.extend(b"1,10:00:00.000002,allocate,0x2000,6\xff,0x0\n");
    bytes.extend(b"1,10:00:00.000003,free,0x1000,64,0x0\n");
    let l = format::read_any(&bytes, true).unwrap();
    assert_eq!((l.trace.events.len(), l.skipped.len()), (2, 1));
    assert_eq!(l.skipped[0].location, Location::Line(3), "{}", l.skipped[0]);
    // Strict reading still refuses the input, naming the byte.
    let e = format::read_any(&bytes, false).unwrap_err();
    assert_eq!(e.location, Location::Offset(115), "{e}");
}

mod torch {
    use std::borrow::Cow;

    use cudalloc::trace::format::{torch, Location};
    use cudalloc::trace::{Action, Event, Frame, Trace, TraceMemory, TracedAllocator};
    use serde_pickle::{HashableValue, SerOptions, Value};

    /// Two allocators (host on device 0, device on device 1), two threads, two streams,
    /// segments with blocks and gaps, frames, a failure, an out-of-memory and a free
    /// completed.
    fn sample() -> Trace {
        let mut t = Trace::default();
        t.allocators
            .push(TracedAllocator::new("Pool<HostSource>", TraceMemory::Host, 0));
        t.allocators
            .push(TracedAllocator::new("DevicePool(1)", TraceMemory::Device, 1));
        t.dropped = 3;
        let mut push = |action: Action, allocator: u32, addr: u64, size: u64, given: u64| {
            let mut e = Event::new(action, addr, size);
            e.seq = t.events.len() as u64;
            e.time_ns = e.seq * 7000;
            e.thread = (e.seq % 2) as u32;
            e.allocator = allocator;
            e.given = given;
            e.align = if allocator == 0 { 64 } else { 256 };
            e.stream = if allocator == 1 { 0x55d0 + e.seq % 2 } else { 0 };
            if e.seq % 3 == 0 {
                e.frames = vec![
                    Frame::new("main", "src/main.rs", 12),
                    Frame::new("run", "src/lib.rs", 40),
                ];
            }
            t.events.push(e);
        };
        push(Action::SegmentAlloc, 1, 0x7000_0000, 8 << 20, 8 << 20);
        push(Action::Alloc, 1, 0x7000_0000, 1000, 1024);
        push(Action::Alloc, 1, 0x7010_0000, 3 << 20, 3 << 20);
        push(Action::Alloc, 0, 0x5500_0000, 100, 112);
        push(Action::Alloc, 0, 0x5500_1000, 5000, 8192);
        push(Action::FreeRequested, 0, 0x5500_0000, 100, 112);
        push(
            Action::Failure(Cow::Borrowed("limit of 64 MiB reached")),
            1,
            0,
            1 << 40,
            1 << 40,
        );
        push(Action::OutOfMemory, 1, 0, 1 << 40, 1 << 40);
        push(Action::FreeRequested, 1, 0x7000_0000, 1000, 1024);
        push(Action::FreeCompleted, 1, 0x7000_0000, 1000, 1024);
        push(Action::Alloc, 1, 0x7050_0000, 512, 512);
        push(Action::SegmentMap, 1, 0x9000_0000, 2 << 20, 2 << 20);
        push(Action::SegmentUnmap, 1, 0x9000_0000, 2 << 20, 2 << 20);
        push(Action::SegmentAlloc, 1, 0x8000_0000, 2 << 20, 2 << 20);
        push(Action::SegmentFree, 1, 0x8000_0000, 2 << 20, 2 << 20);
        t
    }

    fn bytes(t: &Trace) -> Vec<u8> {
        let mut out = Vec::new();
        torch::write(t, &mut out).unwrap();
        out
    }

    #[test]
    fn snapshot_round_trips_every_event() {
        let t = sample();
        assert_eq!(torch::read(&bytes(&t)).unwrap(), t);
        // Trim has no PyTorch action: left out.
        let mut trim = t.clone();
        trim.events.push(Event::new(Action::Trim, 0, 4096));
        assert_eq!(torch::read(&bytes(&trim)).unwrap(), t);
    }

    fn d(entries: Vec<(&str, Value)>) -> Value {
        Value::Dict(
            entries
                .into_iter()
                .map(|(k, v)| (HashableValue::String(k.into()), v))
                .collect(),
        )
    }

    fn s(x: &str) -> Value {
        Value::String(x.into())
    }

    fn entry(action: &str, addr: i64, size: i64, time_us: i64) -> Value {
        d(vec![
            ("action", s(action)),
            ("addr", Value::I64(addr)),
            ("size", Value::I64(size)),
            ("stream", Value::I64(0)),
            ("time_us", Value::I64(time_us)),
            (
                "frames",
                Value::List(vec![d(vec![
                    ("filename", s("train.py")),
                    ("line", Value::I64(7)),
                    ("name", s("forward")),
                ])]),
            ),
        ])
    }

    /// A snapshot shaped as PyTorch writes it (protocol 2, tuples, `snapshot` entries, no
    /// key of ours).
    fn pytorch_like(device_traces: Value) -> Vec<u8> {
        let seg = d(vec![
            ("device", Value::I64(0)),
            ("address", Value::I64(0x7f00_0000_0000)),
            ("total_size", Value::I64(2 << 20)),
            (
                "segment_pool_id",
                Value::Tuple(vec![Value::I64(0), Value::I64(0)]),
            ),
            ("blocks", Value::List(Vec::new())),
        ]);
        let snap = d(vec![
            ("segments", Value::List(vec![seg])),
            ("device_traces", device_traces),
        ]);
        serde_pickle::value_to_vec(&snap, SerOptions::new().proto_v2()).unwrap()
    }

    #[test]
    fn a_pytorch_snapshot_reads_as_a_device_trace() {
        let traces = Value::List(vec![
            Value::List(vec![
                entry("segment_alloc", 0x7f00_0000_0000, 2 << 20, 10),
                entry("alloc", 0x7f00_0000_0000, 512, 11),
                entry("snapshot", 0, 0, 12),
                entry("free_requested", 0x7f00_0000_0000, 512, 13),
                entry("free_completed", 0x7f00_0000_0000, 512, 14),
            ]),
            Value::List(Vec::new()),
            Value::List(vec![entry("alloc", 0x7e00_0000_0000, 1 << 20, 12)]),
        ]);
        let t = torch::read(&pytorch_like(traces)).unwrap();
        let names: Vec<&str> = t.allocators.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["CUDACachingAllocator(0)", "CUDACachingAllocator(2)"]);
        assert!(t.allocators.iter().all(|a| a.memory == TraceMemory::Device));
        assert_eq!(t.allocators[1].device, 2);
        let got: Vec<(u64, Action, u32, u64)> = t
            .events
            .iter()
            .map(|e| (e.seq, e.action.clone(), e.allocator, e.time_ns))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, Action::SegmentAlloc, 0, 10_000),
                (1, Action::Alloc, 0, 11_000),
                (2, Action::Alloc, 1, 12_000),
                (3, Action::FreeRequested, 0, 13_000),
                (4, Action::FreeCompleted, 0, 14_000),
            ]
        );
        assert_eq!(t.events[1].frames, vec![Frame::new("forward", "train.py", 7)]);
        // It replays.
        let r = cudalloc::trace::replay::replay(
            &t,
            cudalloc::trace::replay::HostTarget::new("Global", allocator_api2::alloc::Global),
            &Default::default(),
        )
        .unwrap();
        assert_eq!((r.allocations, r.frees, r.never_freed_blocks), (2, 1, 1));
    }

    #[test]
    fn bad_snapshots_are_clear_errors_never_panics() {
        let good = bytes(&sample());
        // Every truncation of a good file.
        for cut in 0..good.len() {
            let e = torch::read(&good[..cut]).unwrap_err();
            assert!(
                matches!(e.location, Location::Offset(_) | Location::Input),
                "cut at {cut}: {e}"
            );
        }
        // A global (the classic `os.system`) is refused, not resolved.
        let e =
            torch::read(b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.").unwrap_err();
        assert!(e.to_string().contains("bad pickle"), "{e}");
        // Wrong types, each named.
        let cases: Vec<(Value, &str)> = vec![
            (Value::I64(3), "device_traces: expected a list, found int"),
            (
                Value::List(vec![Value::I64(3)]),
                "device_traces[0]: expected a list, found int",
            ),
            (
                Value::List(vec![Value::List(vec![s("alloc")])]),
                "device_traces[0][0]: expected a dict, found str",
            ),
            (
                Value::List(vec![Value::List(vec![d(vec![
                    ("action", s("alloc")),
                    ("size", s("big")),
                ])])]),
                "device_traces[0][0].size: expected an int, found str",
            ),
            (
                Value::List(vec![Value::List(vec![d(vec![
                    ("action", s("teleport")),
                    ("size", Value::I64(1)),
                ])])]),
                "device_traces[0][0].action: unknown action `teleport`",
            ),
            (
                Value::List(vec![Value::List(vec![d(vec![
                    ("action", s("alloc")),
                    ("addr", Value::I64(16)),
                ])])]),
                "device_traces[0][0]: no `size`",
            ),
            (
                Value::List(vec![Value::List(vec![d(vec![
                    ("action", s("alloc")),
                    ("size", Value::I64(-4)),
                ])])]),
                "device_traces[0][0].size: -4 is negative",
            ),
            (
                Value::List(vec![Value::List(vec![d(vec![
                    ("action", s("alloc")),
                    ("size", Value::I64(4)),
                    ("frames", Value::I64(0)),
                ])])]),
                "device_traces[0][0].frames: expected a list, found int",
            ),
        ];
        for (traces, what) in cases {
            let e = torch::read(&pytorch_like(traces.clone())).unwrap_err();
            assert_eq!(e.message, what);
            // Lenient: a bad entry is skipped; a bad container is still an error.
            if what.starts_with("device_traces[0][0]") {
                let l = torch::read_lenient(&pytorch_like(traces)).unwrap();
                assert_eq!((l.trace.events.len(), l.skipped.len()), (0, 1), "{what}");
            }
        }
        let no_traces =
            serde_pickle::value_to_vec(&d(vec![("segments", Value::List(Vec::new()))]), SerOptions::new())
                .unwrap();
        assert!(torch::read(&no_traces)
            .unwrap_err()
            .message
            .contains("_record_memory_history"));
        let not_dict = serde_pickle::value_to_vec(&Value::List(Vec::new()), SerOptions::new()).unwrap();
        assert_eq!(
            torch::read(&not_dict).unwrap_err().message,
            "snapshot: expected a dict, found list"
        );
    }

    /// PyTorch's own reader (`python3 -m torch.cuda._memory_viz stats|trace`) on a
    /// snapshot the crate wrote: its counts match the trace. Needs PyTorch (the GPU
    /// machine has it): skipped without it, unless `REQUIRE_TORCH=1`.
    #[test]
    fn pytorch_memory_viz_reads_a_snapshot_the_crate_wrote() {
        let torch_here = std::process::Command::new("python3")
            .args(["-c", "import torch.cuda._memory_viz"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !torch_here {
            assert!(
                std::env::var("REQUIRE_TORCH").map_or(true, |v| v != "1"),
                "REQUIRE_TORCH=1 but python3 cannot import torch.cuda._memory_viz"
            );
            println!("skipped: no PyTorch");
            return;
        }
        let path = std::env::temp_dir().join(format!("cudalloc-viz-{}.pickle", std::process::id()));
        std::fs::write(&path, bytes(&sample())).unwrap();
        let viz = |cmd: &str| {
            let out = std::process::Command::new("python3")
                .args(["-m", "torch.cuda._memory_viz", cmd])
                .arg(&path)
                .output()
                .unwrap();
            let text =
                String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "_memory_viz {cmd}:\n{text}");
            text
        };
        let stats = viz("stats");
        assert!(stats.contains("segments: 2\n"), "{stats}");
        assert!(stats.contains("total_reserved: 8.0MiB\n"), "{stats}");
        let trace = viz("trace");
        // Device 0 has the host allocator's 3 events, device 1 the device pool's 12.
        assert!(
            trace.contains("Device 0 ----------------\n3 entries\n"),
            "{trace}"
        );
        assert!(
            trace.contains("Device 1 ----------------\n12 entries\n"),
            "{trace}"
        );
        // memory_viz prints `raise OutOfMemoryError # 1.0TiB requested, ...` (H200 run).
        assert!(trace.contains("raise OutOfMemoryError"), "{trace}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn the_standard_library_checker_accepts_what_the_crate_writes() {
        if std::process::Command::new("python3")
            .arg("--version")
            .output()
            .is_err()
        {
            println!("skipped: no python3 on PATH");
            return;
        }
        let dir = std::env::temp_dir().join(format!("cudalloc-snapshot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let run = |name: &str, data: &[u8]| {
            let path = dir.join(name);
            std::fs::write(&path, data).unwrap();
            let out = std::process::Command::new("python3")
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tools/check_snapshot.py"))
                .arg(&path)
                .output()
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
            )
        };
        let (code, text) = run("sample.pickle", &bytes(&sample()));
        assert_eq!(code, Some(0), "{text}");
        // Live at the end: segment 0x7000_0000 (8 MiB) holding 2 blocks (3 MiB + 512 B,
        // with gaps), and the host block of 8192 bytes in a synthetic segment.
        for line in [
            "segments: 2\n",
            "total_reserved: 8396800\n",
            "total_allocated: 3154432\n",
            "blocks active_allocated: 3\n",
            "alloc: 5\n",
            "free_requested: 2\n",
            "oom: 2\n",
            "segment_alloc: 2\n",
            "entries: 15\n",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
        // Negative controls: a global is refused; a segment whose blocks do not fill it.
        let (code, text) = run(
            "global.pickle",
            b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.",
        );
        assert_eq!(code, Some(1), "{text}");
        assert!(text.contains("refused"), "{text}");
        let (code, text) = run("truncated.pickle", &bytes(&sample())[..100]);
        assert_eq!(code, Some(1), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A snapshot of ours with one allocator on `allocator_device`, and one entry naming
    /// allocator `entry_allocator`.
    fn snapshot_with(entry_allocator: i64, allocator_device: i64) -> Vec<u8> {
        let entry = d(vec![
            ("action", s("alloc")),
            ("addr", Value::I64(0x1000)),
            ("size", Value::I64(64)),
            ("allocator", Value::I64(entry_allocator)),
        ]);
        let allocator = d(vec![
            ("name", s("A")),
            ("memory", s("device")),
            ("device", Value::I64(allocator_device)),
        ]);
        let snap = d(vec![
            ("device_traces", Value::List(vec![Value::List(vec![entry])])),
            (
                "cudalloc",
                d(vec![
                    ("version", Value::I64(1)),
                    ("allocators", Value::List(vec![allocator])),
                ]),
            ),
        ]);
        serde_pickle::value_to_vec(&snap, SerOptions::new()).unwrap()
    }

    /// A snapshot whose one trace is `entries`, no key of ours.
    fn with_entries(entries: Vec<Value>) -> Vec<u8> {
        let snap = d(vec![("device_traces", Value::List(vec![Value::List(entries)]))]);
        serde_pickle::value_to_vec(&snap, SerOptions::new()).unwrap()
    }

    /// Found by review (2026-12-06): converting a pickle recursed once per level of
    /// nesting, so 40 KB of nested lists overflowed the stack (an abort).
    #[test]
    fn a_deeply_nested_pickle_is_an_error_not_a_stack_overflow() {
        let nested = |n: usize| {
            // `]` n times, then `a` to put each list into the one below it.
            let mut p = vec![0x80, 4];
            p.extend(std::iter::repeat_n(b']', n));
            p.extend(std::iter::repeat_n(b'a', n - 1));
            p.push(b'.');
            p
        };
        let p = nested(20_000);
        let e = crate::support::on_a_stack_of(2 << 20, || torch::read(&p)).unwrap_err();
        assert!(e.message.contains("nested more than"), "{e}");
        // Nesting far beyond a snapshot's (under 20) reads: refused as a snapshot only.
        let e = torch::read(&nested(100)).unwrap_err();
        assert!(e.message.contains("expected a dict"), "{e}");
    }

    /// Found by review (2026-12-06): each memo reference (`BINGET`) to a string or bytes
    /// copied it with no bound: 64 KiB referred to 65,536 times took 4 GiB.
    #[test]
    #[ignore = "run by its parent test in a capped child process"]
    fn child_a_big_string_referred_to_many_times() {
        let big = 64usize << 10;
        let mut p = vec![0x80, 4, b'(', b'B'];
        p.extend((big as u32).to_le_bytes());
        p.extend(std::iter::repeat_n(b'x', big));
        p.push(0x94); // MEMOIZE: memo 0
        for _ in 0..65_536 {
            p.extend([b'h', 0]); // BINGET 0
        }
        p.extend([b'l', b'.']); // LIST from the mark, STOP
        let e = torch::read(&p).unwrap_err();
        assert!(e.message.contains("expands to more than"), "{e}");
    }

    /// Found by review (2026-12-06): see the child; refused within 1 GiB.
    #[test]
    fn a_pickle_referring_to_a_big_string_many_times_is_an_error_in_bounded_memory() {
        crate::support::in_a_capped_child(
            "trace_formats::torch::child_a_big_string_referred_to_many_times",
            1024,
        );
    }

    /// Found by review (2026-12-06): `(x, x)` nested 40 deep through the memo (123 bytes)
    /// was refused only after 2^26 values, 4.7 GB.
    #[test]
    #[ignore = "run by its parent test in a capped child process"]
    fn child_shared_references_nested_to_expand_exponentially() {
        let mut p = vec![0x80, 4, b'N'];
        for _ in 0..40 {
            p.extend([0x94, b'2', 0x86]); // memoize top, DUP, TUPLE2: (x, x)
        }
        p.push(b'.');
        let e = torch::read(&p).unwrap_err();
        assert!(e.message.contains("expands to more than"), "{e}");
    }

    /// Found by review (2026-12-06): see the child; refused within 1 GiB.
    #[test]
    fn shared_references_nested_to_expand_exponentially_are_refused_in_bounded_memory() {
        crate::support::in_a_capped_child(
            "trace_formats::torch::child_shared_references_nested_to_expand_exponentially",
            1024,
        );
    }

    /// Found by review (2026-12-06): an entry naming an allocator not in
    /// `cudalloc.allocators` was read, and the timeline then sized vectors by its index.
    #[test]
    fn a_snapshot_entry_naming_an_allocator_not_listed_is_an_error() {
        let p = snapshot_with(i64::from(u32::MAX), 0);
        let e = torch::read(&p).unwrap_err();
        assert!(e.message.contains("device_traces[0][0].allocator"), "{e}");
        let l = torch::read_lenient(&p).unwrap();
        assert_eq!((l.trace.events.len(), l.skipped.len()), (0, 1));
        assert_eq!(torch::read(&snapshot_with(0, 0)).unwrap().events.len(), 1);
    }

    /// Found by review (2026-12-06): an allocator's `device` beyond 32 bits was silently
    /// read as device 0.
    #[test]
    fn an_allocator_device_beyond_32_bits_is_an_error_not_device_0() {
        let e = torch::read(&snapshot_with(0, 1 << 32)).unwrap_err();
        assert!(e.message.contains("cudalloc.allocators[0].device"), "{e}");
        let t = torch::read(&snapshot_with(0, i64::from(u32::MAX))).unwrap();
        assert_eq!(t.allocators[0].device, u32::MAX);
    }

    /// Found by review (2026-12-06): writing a trace with an allocator on device
    /// 4294967295 made one `device_traces` list per device up to it (137 GB).
    #[test]
    #[ignore = "run by its parent test in a capped child process"]
    fn child_write_a_trace_on_device_u32_max() {
        let mut t = Trace::default();
        t.allocators
            .push(TracedAllocator::new("A", TraceMemory::Device, u32::MAX));
        t.events.push(Event::new(Action::Alloc, 0x1000, 64));
        assert_eq!(torch::read(&bytes(&t)).unwrap(), t);
    }

    /// Found by review (2026-12-06): see the child; written within 1 GiB, read back the same.
    #[test]
    fn writing_a_trace_on_device_u32_max_is_bounded() {
        crate::support::in_a_capped_child(
            "trace_formats::torch::child_write_a_trace_on_device_u32_max",
            1024,
        );
    }

    /// Found by review (2026-12-06): the writer summed the requested sizes of a segment's
    /// blocks unchecked, and a read trace's requested size is not bounded by `given`.
    #[test]
    fn writing_blocks_whose_requested_sizes_pass_u64_does_not_overflow() {
        let entry = |action: &str, addr: i64, size: i64, given: i64| {
            d(vec![
                ("action", s(action)),
                ("addr", Value::I64(addr)),
                ("size", Value::I64(size)),
                ("given", Value::I64(given)),
            ])
        };
        let t = torch::read(&with_entries(vec![
            entry("segment_alloc", 0x1000, 4096, 4096),
            entry("alloc", 0x1000, i64::MAX, 16),
            entry("alloc", 0x1100, i64::MAX, 16),
            entry("alloc", 0x1200, i64::MAX, 16),
        ]))
        .unwrap();
        assert_eq!(torch::read(&bytes(&t)).unwrap().events, t.events);
    }
}

mod svg {
    use cudalloc::trace::format::svg;
    use cudalloc::trace::replay::{random_workload, RandomWorkload};
    use cudalloc::trace::{Action, Event, Trace, TraceMemory, TracedAllocator};

    fn polylines(doc: &str) -> Vec<(String, Vec<(f64, f64)>)> {
        let xml = roxmltree::Document::parse(doc).expect("well-formed SVG");
        let root = xml.root_element();
        assert_eq!(root.tag_name().name(), "svg");
        let (w, h): (f64, f64) = (
            root.attribute("width").unwrap().parse().unwrap(),
            root.attribute("height").unwrap().parse().unwrap(),
        );
        root.descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .map(|n| {
                let title = n
                    .children()
                    .find(|c| c.has_tag_name("title"))
                    .unwrap()
                    .text()
                    .unwrap()
                    .to_string();
                let pts: Vec<(f64, f64)> = n
                    .attribute("points")
                    .unwrap()
                    .split(' ')
                    .map(|p| {
                        let (x, y) = p.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect();
                assert!(
                    pts.iter()
                        .all(|&(x, y)| (0.0..=w).contains(&x) && (0.0..=h).contains(&y)),
                    "{title}"
                );
                (title, pts)
            })
            .collect()
    }

    #[test]
    fn the_timeline_has_live_and_reserved_per_allocator_and_live_per_stream() {
        let mut t = Trace::default();
        t.allocators
            .push(TracedAllocator::new("Pool<A&B>", TraceMemory::Host, 0));
        t.allocators
            .push(TracedAllocator::new("DevicePool(0)", TraceMemory::Device, 0));
        let mut push = |action, allocator, addr, size, stream| {
            let mut e = Event::new(action, addr, size);
            e.time_ns = t.events.len() as u64 * 1000;
            e.allocator = allocator;
            e.stream = stream;
            t.events.push(e);
        };
        push(Action::SegmentAlloc, 1, 0x9000, 1 << 20, 0);
        push(Action::Alloc, 1, 0x9000, 4096, 7);
        push(Action::Alloc, 1, 0xa000, 8192, 9);
        push(Action::Alloc, 0, 0x10, 100, 0);
        push(Action::FreeRequested, 1, 0x9000, 4096, 7);
        push(Action::FreeRequested, 0, 0x10, 100, 0);
        let doc = svg::timeline(&t);
        let lines = polylines(&doc);
        let titles: Vec<&str> = lines.iter().map(|l| l.0.as_str()).collect();
        assert_eq!(
            titles,
            [
                "Pool<A&B>: live",
                "DevicePool(0): live",
                "DevicePool(0): reserved",
                "DevicePool(0): live on stream 0x7",
                "DevicePool(0): live on stream 0x9",
            ]
        );
        // The reserved line is the highest: 1 MiB is the chart's top.
        let top = lines[2].1.iter().map(|p| p.1).fold(f64::MAX, f64::min);
        assert!(lines.iter().all(|l| l.1.iter().all(|p| p.1 >= top)));
        assert!(doc.contains("(peak 12.0 KiB)"), "{doc}");
        // A page heap's mapped chunks are reserved too.
        let mut paged = Trace::default();
        paged
            .allocators
            .push(TracedAllocator::new("DevicePool(0)", TraceMemory::Device, 0));
        for (i, (action, addr)) in [
            (Action::SegmentMap, 0x20_0000),
            (Action::Alloc, 0x20_0000),
            (Action::SegmentMap, 0x40_0000),
            (Action::SegmentUnmap, 0x20_0000),
        ]
        .into_iter()
        .enumerate()
        {
            let mut e = Event::new(action, addr, 2 << 20);
            e.time_ns = i as u64 * 1000;
            paged.events.push(e);
        }
        let lines = polylines(&svg::timeline(&paged));
        let reserved = lines
            .iter()
            .find(|l| l.0 == "DevicePool(0): reserved")
            .expect("a reserved line of the mapped chunks");
        let ys: Vec<f64> = reserved.1.iter().map(|p| p.1).collect();
        let (top, last) = (ys.iter().copied().fold(f64::MAX, f64::min), *ys.last().unwrap());
        assert!(last > top, "two chunks at the peak, one at the end: {ys:?}");
        // No allocations: still a document, saying so.
        assert!(polylines(&svg::timeline(&Trace::default())).is_empty());
        assert!(svg::timeline(&Trace::default()).contains("no allocations"));
    }

    #[test]
    fn a_long_trace_is_downsampled_keeping_its_peak() {
        let t = random_workload(&RandomWorkload {
            allocations: 20_000,
            ..RandomWorkload::small()
        });
        let doc = svg::timeline(&t);
        assert!(doc.len() < 1 << 20, "{} bytes", doc.len());
        let lines = polylines(&doc);
        assert_eq!(lines.len(), 1 + 4, "live, and live on each of 4 streams");
        for (title, pts) in &lines {
            assert!(
                pts.len() <= 2 * svg::MAX_POINTS + 4,
                "{title}: {} points",
                pts.len()
            );
        }
        // The live line reaches the chart's top (its peak is the highest value drawn).
        let top = lines[0].1.iter().map(|p| p.1).fold(f64::MAX, f64::min);
        assert!((top - 50.0).abs() < 0.11, "top at {top}");
    }

    /// Found by review (2026-12-06): the timeline sized two vectors by the largest
    /// allocator index an event names (4294967295: 137 GB), listed or not.
    #[test]
    #[ignore = "run by its parent test in a capped child process"]
    fn child_timeline_of_an_unlisted_allocator_index() {
        let mut t = Trace::default();
        t.allocators.push(TracedAllocator::new("A", TraceMemory::Host, 0));
        let mut e = Event::new(Action::Alloc, 0x1000, 64);
        e.allocator = u32::MAX;
        t.events.push(e);
        let doc = svg::timeline(&t);
        assert!(doc.contains("allocator 4294967295: live"), "{doc}");
    }

    /// Found by review (2026-12-06): see the child; drawn within 1 GiB.
    #[test]
    fn the_timeline_of_an_unlisted_huge_allocator_index_is_bounded() {
        crate::support::in_a_capped_child(
            "trace_formats::svg::child_timeline_of_an_unlisted_allocator_index",
            1024,
        );
    }

    /// Found by review (2026-12-06): an event at time u64::MAX (a snapshot's `time_us`
    /// near i64::MAX, saturated) overflowed the timeline's span.
    #[test]
    fn the_timeline_of_an_event_at_the_largest_time_has_a_span() {
        let mut t = Trace::default();
        let mut e = Event::new(Action::Alloc, 0x1000, 64);
        e.time_ns = u64::MAX;
        t.events.push(e);
        let doc = svg::timeline(&t);
        assert!(!doc.contains("NaN") && !doc.contains("inf"), "{doc}");
        assert_eq!(polylines(&doc).len(), 1);
    }
}
