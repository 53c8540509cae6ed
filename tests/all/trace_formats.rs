//! Trace formats: RMM's CSV log, PyTorch's snapshot pickle and the SVG timeline, each
//! written and read back, and each reader's answer to bad input.

use std::borrow::Cow;

use cudalloc::trace::format::{rmm, Location};
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
