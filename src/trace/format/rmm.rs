//! RMM's replay log: the CSV that `rmm::mr::logging_resource_adaptor` writes and RMM's
//! `REPLAY_BENCH` reads.
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 140202131208960,14:03:21.571223,allocate,0x7f8a3c000000,1024,0x0
//! 140202131208960,14:03:21.571295,allocate failure,(nil),1099511627776,0x0
//! 140202131208960,14:03:21.571302,free,0x7f8a3c000000,1024,0x0
//! ```
//!
//! Fields, as RMM writes them: `Thread` the OS thread id (decimal; read as the number of
//! the thread in order of first appearance: 0, 1, ...), `Time` the wall-clock time of day
//! `HH:MM:SS.ffffff` (read as nanoseconds since the first row; a time earlier than the
//! previous row's by more than 12 hours is taken to have crossed midnight), `Action`
//! `allocate`, `free` or `allocate failure`, `Pointer` in hex (`0x...`, or `(nil)` for a
//! failure), `Size` in bytes (decimal), `Stream` the `cudaStream_t` in hex (`0x0`, `0` or
//! `(nil)` for the default stream).
//!
//! The format has no allocator, alignment, size-given or site column: read traces have
//! one allocator (`RMM log`, device memory), alignment 1 and `given == size`. Written
//! traces carry only allocations (`allocate`), frees requested (`free`) and failures
//! (`allocate failure`); every other action (frees completed, segments, out-of-memory
//! and trim events) has no row in RMM's format and is left out.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{self, Write};

use super::{Lenient, Location, TraceError};
use crate::trace::{Action, Event, Trace, TraceMemory, TracedAllocator};

/// The header line RMM writes first.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

const DAY_NS: u64 = 24 * 3600 * 1_000_000_000;

/// Reads an RMM log; the first malformed line is an error naming it.
///
/// ```
/// use cudalloc::trace::{format::rmm, Action};
/// let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
///            7,10:00:00.000001,allocate,0x7f0000000000,256,0x5a\n\
///            7,10:00:00.000003,free,0x7f0000000000,256,0x5a\n";
/// let t = rmm::read(csv).unwrap();
/// assert_eq!(t.events[0].action, Action::Alloc);
/// assert_eq!((t.events[1].addr, t.events[1].stream, t.events[1].time_ns), (0x7f00_0000_0000, 0x5a, 2000));
/// assert_eq!(rmm::read("Thread,Time\n").unwrap_err().to_string(),
///            format!("line 1: not an RMM log: the header is not `{}`", rmm::HEADER));
/// ```
pub fn read(text: &str) -> Result<Trace, TraceError> {
    parse(text, false).map(|l| l.trace)
}

/// Reads an RMM log, skipping malformed lines (each reported in [`Lenient::skipped`]).
/// A missing header is still an error: the input is not an RMM log.
pub fn read_lenient(text: &str) -> Result<Lenient, TraceError> {
    parse(text, true)
}

fn parse(text: &str, lenient: bool) -> Result<Lenient, TraceError> {
    let mut lines = text.lines().enumerate();
    let header = lines.by_ref().find(|(_, l)| !l.trim().is_empty());
    match header {
        Some((_, h)) if h.trim().replace(' ', "") == HEADER => {}
        Some((i, _)) => {
            return Err(TraceError::new(
                Location::Line(i as u64 + 1),
                format!("not an RMM log: the header is not `{HEADER}`"),
            ))
        }
        None => return Err(TraceError::new(Location::Input, "empty input: no RMM log header")),
    }
    let mut out = Lenient::default();
    out.trace
        .allocators
        .push(TracedAllocator::new("RMM log", TraceMemory::Device, 0));
    let mut threads: HashMap<u64, u32> = HashMap::new();
    let (mut first, mut prev, mut days) = (None::<u64>, 0u64, 0u64);
    for (i, line) in lines {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let row = match parse_row(line) {
            Ok(r) => r,
            Err(msg) => {
                let e = TraceError::new(Location::Line(i as u64 + 1), msg);
                if lenient {
                    out.skipped.push(e);
                    continue;
                }
                return Err(e);
            }
        };
        let next = threads.len() as u32;
        let thread = *threads.entry(row.thread).or_insert(next);
        if row.time_of_day + DAY_NS / 2 < prev {
            days += 1;
        }
        prev = row.time_of_day;
        // Saturating: a log crossing midnight 213,504 times passes u64 nanoseconds; its
        // times then stay at the cap (still in order) instead of wrapping round.
        let t = row.time_of_day.saturating_add(days.saturating_mul(DAY_NS));
        let t0 = *first.get_or_insert(t);
        let mut e = Event::new(row.action, row.addr, row.size);
        e.seq = out.trace.events.len() as u64;
        e.time_ns = t - t0.min(t);
        e.thread = thread;
        e.stream = row.stream;
        out.trace.events.push(e);
    }
    Ok(out)
}

struct Row {
    thread: u64,
    time_of_day: u64,
    action: Action,
    addr: u64,
    size: u64,
    stream: u64,
}

fn parse_row(line: &str) -> Result<Row, String> {
    let f: Vec<&str> = line.split(',').map(str::trim).collect();
    if f.len() != 6 {
        return Err(format!(
            "expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found {}: `{line}`",
            f.len()
        ));
    }
    let thread = f[0]
        .parse::<u64>()
        .map_err(|_| format!("thread `{}` is not a decimal number", f[0]))?;
    let time_of_day = parse_time(f[1]).ok_or_else(|| format!("time `{}` is not HH:MM:SS.ffffff", f[1]))?;
    let action = match f[2] {
        "allocate" => Action::Alloc,
        "free" => Action::FreeRequested,
        "allocate failure" => Action::Failure(Cow::Borrowed("allocate failure")),
        other => {
            return Err(format!(
                "action `{other}` is not `allocate`, `free` or `allocate failure`"
            ))
        }
    };
    let addr =
        parse_hex(f[3]).ok_or_else(|| format!("pointer `{}` is not hex (`0x...`) or `(nil)`", f[3]))?;
    if addr == 0 && action != Action::Failure(Cow::Borrowed("allocate failure")) {
        return Err(format!("`{}` with a null pointer", f[2]));
    }
    let size = f[4]
        .parse::<u64>()
        .map_err(|_| format!("size `{}` is not a decimal number", f[4]))?;
    let stream =
        parse_hex(f[5]).ok_or_else(|| format!("stream `{}` is not hex (`0x...`) or `(nil)`", f[5]))?;
    Ok(Row {
        thread,
        time_of_day,
        action,
        addr,
        size,
        stream,
    })
}

/// `(nil)` (glibc's `%p` of a null pointer), `0x1f`, `1f`: the value.
fn parse_hex(s: &str) -> Option<u64> {
    if s == "(nil)" {
        return Some(0);
    }
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// `HH:MM:SS.ffffff` (fraction of 1 to 9 digits): nanoseconds since midnight.
fn parse_time(s: &str) -> Option<u64> {
    let (hms, frac) = s.split_once('.').unwrap_or((s, "0"));
    let mut parts = hms.split(':');
    let (h, m, sec) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || frac.is_empty() || frac.len() > 9 {
        return None;
    }
    let num = |x: &str, max: u64| -> Option<u64> {
        let v = x
            .parse::<u64>()
            .ok()
            .filter(|_| x.bytes().all(|b| b.is_ascii_digit()))?;
        (v < max).then_some(v)
    };
    let (h, m, sec) = (num(h, 24)?, num(m, 60)?, num(sec, 61)?);
    let frac_ns = num(frac, 1_000_000_000)? * 10u64.pow(9 - frac.len() as u32);
    Some(((h * 60 + m) * 60 + sec) * 1_000_000_000 + frac_ns)
}

/// Writes every event of `trace` RMM's way (see the module docs for what is left out);
/// returns the rows written.
///
/// ```
/// use cudalloc::trace::{format::rmm, Action, Event, Trace};
/// let mut t = Trace::default();
/// let mut e = Event::new(Action::Alloc, 0x7f00_0000_0000, 256);
/// e.time_ns = 1_500_000;
/// t.events.push(e);
/// let mut out = Vec::new();
/// assert_eq!(rmm::write(&t, &mut out).unwrap(), 1);
/// assert_eq!(String::from_utf8(out).unwrap(),
///            "Thread,Time,Action,Pointer,Size,Stream\n0,00:00:00.001500,allocate,0x7f0000000000,256,0x0\n");
/// ```
pub fn write(trace: &Trace, out: &mut impl Write) -> io::Result<usize> {
    write_events(trace.events.iter(), out)
}

/// Writes the events of one allocator of `trace` (an index into [`Trace::allocators`]).
pub fn write_allocator(trace: &Trace, allocator: u32, out: &mut impl Write) -> io::Result<usize> {
    write_events(trace.events.iter().filter(|e| e.allocator == allocator), out)
}

fn write_events<'a>(events: impl Iterator<Item = &'a Event>, out: &mut impl Write) -> io::Result<usize> {
    let mut w = io::BufWriter::new(out);
    writeln!(w, "{HEADER}")?;
    let mut rows = 0;
    for e in events {
        let action = match e.action {
            Action::Alloc => "allocate",
            Action::FreeRequested => "free",
            Action::Failure(_) => "allocate failure",
            _ => continue,
        };
        let us = e.time_ns / 1000;
        let (h, m, s, f) = (
            us / 3_600_000_000 % 24,
            us / 60_000_000 % 60,
            us / 1_000_000 % 60,
            us % 1_000_000,
        );
        write!(w, "{},{h:02}:{m:02}:{s:02}.{f:06},{action},", e.thread)?;
        if e.addr == 0 || matches!(e.action, Action::Failure(_)) {
            w.write_all(b"(nil)")?;
        } else {
            write!(w, "{:#x}", e.addr)?;
        }
        writeln!(w, ",{},{:#x}", e.size, e.stream)?;
        rows += 1;
    }
    w.flush()?;
    Ok(rows)
}
