//! PyTorch's memory snapshot: the pickle `torch.cuda.memory._snapshot()` returns (and
//! `torch.cuda.memory._dump_snapshot(FILE)` writes), which pytorch.org/memory_viz and
//! `python -m torch.cuda._memory_viz stats|trace|segments|memory FILE` open.
//!
//! Written (plain dicts, lists, ints, strings, bools and `None`, pickle protocol 3):
//!
//! ```text
//! {'segments': [{'device', 'address', 'total_size', 'allocated_size', 'active_size',
//!                'requested_size', 'stream', 'segment_type': 'large'|'small',
//!                'segment_pool_id': [0, 0], 'is_expandable': False, 'frames',
//!                'blocks': [{'address', 'size', 'requested_size',
//!                            'state': 'active_allocated'|'inactive', 'frames'}]}],
//!  'device_traces': [[{'action', 'addr', 'size', 'stream', 'time_us', 'frames',
//!                      'seq', 'thread', 'allocator', 'given', 'align'}]],   # one list per device
//!  'cudalloc': {'version': 1, 'allocators': [{'name', 'memory': 'host'|'device', 'device'}]}}
//! ```
//!
//! - `segments` is the state at the end of the trace. Where the trace has segment events
//!   ([`Action::SegmentAlloc`]/[`SegmentFree`](Action::SegmentFree)), each segment live at
//!   the end is one entry, its live blocks `active_allocated` and the gaps between them
//!   `inactive` blocks (so blocks tile the segment, as `_memory_viz stats` checks); a live
//!   block in no segment, and every live block of a trace without segment events, gets a
//!   synthetic segment of its own (`total_size` = the bytes it holds).
//! - `device_traces[d]` has the events of the allocators on device `d` (host allocators'
//!   on their `device`, 0 by default), in order; devices from [`MAX_DEVICE_TRACES`] on
//!   (no CUDA ordinal is that large) share the last list, so that a trace naming device
//!   4294967295 is not written as four billion empty lists (our `allocator` key still
//!   tells them apart when read back). Action names are
//!   [`Action::torch_name`]'s; a failure is an `oom` entry with `device_free: 0` and its
//!   message in `error`; [`Action::Trim`] has no PyTorch action and is left out.
//! - `seq`, `thread`, `allocator`, `given`, `align` and the top-level `cudalloc` key are
//!   ours (PyTorch's readers ignore them) so that a trace written and read back is the
//!   same (times to the microsecond).
//!
//! Left out of PyTorch's snapshot: `allocator_settings`, blocks' `active_pending_free`
//! state, `device_free` of `oom` entries, `segment_pool_id`s other than `[0, 0]`,
//! `compile_context` and `user_metadata`, and frames beyond what the trace recorded.
//!
//! Read: PyTorch's snapshots (pickle protocols 2 to 5 and the numeric opcodes of 0 and 1,
//! with CPython's memo semantics: `format/unpickle.rs` says why not serde-pickle's reader;
//! any global such as a class or function is refused) and ours. Without our `cudalloc` key each device
//! is one allocator named `CUDACachingAllocator(d)`, every event on thread 0; the
//! `snapshot` entries PyTorch writes are skipped. A trace PyTorch's ring buffer cut
//! may free blocks it never allocated: replay such a trace with
//! [`ReplayOptions::lenient`](crate::trace::replay::ReplayOptions::lenient).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::{self, Write};

use serde_pickle::{HashableValue, SerOptions, Value};

use super::{Lenient, Location, TraceError};
use crate::trace::{Action, Event, Frame, Trace, TraceMemory, TracedAllocator};

fn int(x: u64) -> Value {
    match i64::try_from(x) {
        Ok(v) => Value::I64(v),
        Err(_) => serde_pickle::to_value(&x).unwrap_or(Value::None),
    }
}

fn s(x: &str) -> Value {
    Value::String(x.to_string())
}

fn dict(entries: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        entries
            .into_iter()
            .map(|(k, v)| (HashableValue::String(k.to_string()), v))
            .collect(),
    )
}

fn frames(f: &[Frame]) -> Value {
    Value::List(
        f.iter()
            .map(|f| {
                dict(vec![
                    ("filename", s(&f.filename)),
                    ("line", int(u64::from(f.line))),
                    ("name", s(&f.name)),
                ])
            })
            .collect(),
    )
}

/// The most `device_traces` lists written (see the module docs).
pub const MAX_DEVICE_TRACES: u32 = 1024;

/// The snapshot of `trace` as a pickle value (see the module docs).
pub fn to_value(trace: &Trace) -> Value {
    let device_of = |a: u32| trace.allocators.get(a as usize).map_or(0, |t| t.device);
    let list_of = |a: u32| device_of(a).min(MAX_DEVICE_TRACES - 1) as usize;
    // What is live at the end: blocks and segments, per (allocator, address).
    let mut blocks: BTreeMap<(u32, u64), &Event> = BTreeMap::new();
    let mut segs: BTreeMap<(u32, u64), &Event> = BTreeMap::new();
    let ndev = trace
        .allocators
        .iter()
        .map(|a| a.device.min(MAX_DEVICE_TRACES - 1) as usize + 1)
        .chain(trace.events.iter().map(|e| list_of(e.allocator) + 1))
        .max()
        .unwrap_or(1);
    let mut traces: Vec<Vec<Value>> = vec![Vec::new(); ndev];
    for e in &trace.events {
        let key = (e.allocator, e.addr);
        match e.action {
            Action::Alloc => {
                blocks.insert(key, e);
            }
            Action::FreeRequested => {
                blocks.remove(&key);
            }
            Action::SegmentAlloc => {
                segs.insert(key, e);
            }
            Action::SegmentFree => {
                segs.remove(&key);
            }
            Action::Trim => continue,
            _ => {}
        }
        let mut entry = vec![
            ("action", s(e.action.torch_name())),
            ("addr", int(e.addr)),
            ("size", int(e.size)),
            ("stream", int(e.stream)),
            ("time_us", int(e.time_ns / 1000)),
            ("frames", frames(&e.frames)),
            ("seq", int(e.seq)),
            ("thread", int(u64::from(e.thread))),
            ("allocator", int(u64::from(e.allocator))),
            ("given", int(e.given)),
            ("align", int(e.align)),
        ];
        match &e.action {
            Action::Failure(msg) => {
                entry.push(("device_free", int(0)));
                entry.push(("error", s(msg)));
            }
            Action::OutOfMemory => entry.push(("device_free", int(0))),
            _ => {}
        }
        traces[list_of(e.allocator)].push(dict(entry));
    }
    let block = |e: &Event, state: &str, size: u64, requested: u64, addr: u64| {
        dict(vec![
            ("address", int(addr)),
            ("size", int(size)),
            ("requested_size", int(requested)),
            ("state", s(state)),
            (
                "frames",
                if state == "inactive" {
                    Value::List(Vec::new())
                } else {
                    frames(&e.frames)
                },
            ),
        ])
    };
    let segment = |alloc: u32,
                   addr: u64,
                   total: u64,
                   stream: u64,
                   frames_v: Value,
                   b: Vec<Value>,
                   active: u64,
                   requested: u64| {
        dict(vec![
            ("device", int(u64::from(device_of(alloc)))),
            ("address", int(addr)),
            ("total_size", int(total)),
            ("allocated_size", int(active)),
            ("active_size", int(active)),
            ("requested_size", int(requested)),
            ("stream", int(stream)),
            (
                "segment_type",
                s(if total >= 1 << 20 { "large" } else { "small" }),
            ),
            ("segment_pool_id", Value::List(vec![int(0), int(0)])),
            ("is_expandable", Value::Bool(false)),
            ("frames", frames_v),
            ("blocks", Value::List(b)),
        ])
    };
    let mut out_segments = Vec::new();
    // Segments live at the end, with the live blocks inside them.
    for (&(alloc, saddr), seg) in &segs {
        let end = saddr.saturating_add(seg.size);
        // Blocks in address order that fit in the segment without overlapping the one
        // before (an overlap is a bad trace: the later block gets a segment of its own).
        let mut inside: Vec<(u64, &Event)> = Vec::new();
        for (&(_, a), &b) in blocks.range((alloc, saddr)..(alloc, end)) {
            let free_from = inside
                .last()
                .map_or(saddr, |&(pa, pb)| pa.saturating_add(pb.given));
            if a >= free_from && a.saturating_add(b.given) <= end {
                inside.push((a, b));
            }
        }
        // Saturating: a read trace's `size` (requested) is not bounded by `given`, and
        // blocks at the top of the address space end at the cap.
        let (mut at, mut b, mut active, mut requested) = (saddr, Vec::new(), 0u64, 0u64);
        for &(addr, e) in &inside {
            if addr > at {
                b.push(block(seg, "inactive", addr - at, 0, at));
            }
            b.push(block(e, "active_allocated", e.given, e.size, addr));
            active = active.saturating_add(e.given);
            requested = requested.saturating_add(e.size);
            at = addr.saturating_add(e.given);
        }
        if end > at {
            b.push(block(seg, "inactive", end - at, 0, at));
        }
        out_segments.push(segment(
            alloc,
            saddr,
            seg.size,
            seg.stream,
            frames(&seg.frames),
            b,
            active,
            requested,
        ));
        for (addr, _) in inside {
            blocks.remove(&(alloc, addr));
        }
    }
    // Synthetic segments: one per block in no live segment.
    for (&(alloc, addr), &e) in &blocks {
        let b = vec![block(e, "active_allocated", e.given, e.size, addr)];
        out_segments.push(segment(
            alloc,
            addr,
            e.given,
            e.stream,
            Value::List(Vec::new()),
            b,
            e.given,
            e.size,
        ));
    }
    let allocators = trace
        .allocators
        .iter()
        .map(|a| {
            dict(vec![
                ("name", s(&a.name)),
                (
                    "memory",
                    s(match a.memory {
                        TraceMemory::Host => "host",
                        TraceMemory::Device => "device",
                    }),
                ),
                ("device", int(u64::from(a.device))),
            ])
        })
        .collect();
    dict(vec![
        ("segments", Value::List(out_segments)),
        (
            "device_traces",
            Value::List(traces.into_iter().map(Value::List).collect()),
        ),
        (
            "cudalloc",
            dict(vec![
                ("version", int(1)),
                ("allocators", Value::List(allocators)),
                ("dropped", int(trace.dropped)),
            ]),
        ),
    ])
}

/// Writes the snapshot of `trace` as a pickle (protocol 3; see the module docs).
///
/// ```
/// use cudalloc::trace::{format::torch, Action, Event, Trace};
/// let mut t = Trace::default();
/// t.events.push(Event::new(Action::Alloc, 0x7f00_0000_0000, 512));
/// let mut bytes = Vec::new();
/// torch::write(&t, &mut bytes).unwrap();
/// assert_eq!(&bytes[..2], b"\x80\x03");
/// assert_eq!(torch::read(&bytes).unwrap().events, t.events);
/// ```
pub fn write(trace: &Trace, out: &mut impl Write) -> io::Result<()> {
    let bytes = serde_pickle::value_to_vec(&to_value(trace), SerOptions::new()).map_err(io::Error::other)?;
    out.write_all(&bytes)
}

/// Reads a snapshot; bad input is an error naming the byte offset (a malformed or
/// truncated pickle) or the entry (a wrong type).
///
/// ```
/// use cudalloc::trace::format::torch;
/// let e = torch::read(b"\x80\x03}q\x00").unwrap_err(); // cut short
/// assert!(e.to_string().contains("truncated"), "{e}");
/// ```
pub fn read(bytes: &[u8]) -> Result<Trace, TraceError> {
    parse(bytes, false).map(|l| l.trace)
}

/// Reads a snapshot, skipping bad trace entries (each listed in [`Lenient::skipped`]).
/// A malformed pickle or a snapshot without `device_traces` is still an error.
pub fn read_lenient(bytes: &[u8]) -> Result<Lenient, TraceError> {
    parse(bytes, true)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::I64(_) | Value::Int(_) => "int",
        Value::F64(_) => "float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "str",
        Value::List(_) => "list",
        Value::Tuple(_) => "tuple",
        Value::Set(_) | Value::FrozenSet(_) => "set",
        Value::Dict(_) => "dict",
    }
}

type Dict = BTreeMap<HashableValue, Value>;

fn get<'a>(d: &'a Dict, key: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(key.to_string()))
}

fn as_dict<'a>(v: &'a Value, what: &str) -> Result<&'a Dict, String> {
    match v {
        Value::Dict(d) => Ok(d),
        other => Err(format!("{what}: expected a dict, found {}", type_name(other))),
    }
}

fn as_list<'a>(v: &'a Value, what: &str) -> Result<&'a [Value], String> {
    match v {
        Value::List(l) | Value::Tuple(l) => Ok(l),
        other => Err(format!("{what}: expected a list, found {}", type_name(other))),
    }
}

fn as_u64(v: &Value, what: &str) -> Result<u64, String> {
    match v {
        Value::I64(i) => u64::try_from(*i).map_err(|_| format!("{what}: {i} is negative")),
        Value::Int(b) => b
            .to_string()
            .parse::<u64>()
            .map_err(|_| format!("{what}: {b} is not a 64-bit unsigned integer")),
        Value::Bool(b) => Ok(u64::from(*b)),
        other => Err(format!("{what}: expected an int, found {}", type_name(other))),
    }
}

fn field_u64(d: &Dict, key: &str, what: &str, default: Option<u64>) -> Result<u64, String> {
    match (get(d, key), default) {
        (Some(v), _) => as_u64(v, &format!("{what}.{key}")),
        (None, Some(x)) => Ok(x),
        (None, None) => Err(format!("{what}: no `{key}`")),
    }
}

fn as_str<'a>(v: &'a Value, what: &str) -> Result<&'a str, String> {
    match v {
        Value::String(s) => Ok(s),
        other => Err(format!("{what}: expected a str, found {}", type_name(other))),
    }
}

fn read_frames(v: Option<&Value>, what: &str) -> Result<Vec<Frame>, String> {
    let Some(v) = v else { return Ok(Vec::new()) };
    as_list(v, what)?
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let w = format!("{what}[{i}]");
            let d = as_dict(f, &w)?;
            let text = |k: &str| -> Result<String, String> {
                get(d, k).map_or(Ok(String::new()), |v| {
                    as_str(v, &format!("{w}.{k}")).map(String::from)
                })
            };
            let line = field_u64(d, "line", &w, Some(0))?;
            Ok(Frame::new(
                text("name")?,
                text("filename")?,
                u32::try_from(line).unwrap_or(u32::MAX),
            ))
        })
        .collect()
}

fn parse(bytes: &[u8], lenient: bool) -> Result<Lenient, TraceError> {
    let root = super::unpickle::value_from_slice(bytes)?;
    let input = |msg: String| TraceError::new(Location::Input, msg);
    let top = as_dict(&root, "snapshot").map_err(input)?;
    let traces = get(top, "device_traces").ok_or_else(|| {
        input(
            "snapshot has no `device_traces` (record them with torch.cuda.memory._record_memory_history() before \
             taking the snapshot)"
                .into(),
        )
    })?;
    let traces = as_list(traces, "device_traces").map_err(input)?;
    let mut out = Lenient::default();
    // Our own key: the allocators as they were.
    let ours = get(top, "cudalloc");
    if let Some(c) = ours {
        let c = as_dict(c, "cudalloc").map_err(input)?;
        if let Some(list) = get(c, "allocators") {
            for (i, a) in as_list(list, "cudalloc.allocators")
                .map_err(input)?
                .iter()
                .enumerate()
            {
                let w = format!("cudalloc.allocators[{i}]");
                let d = as_dict(a, &w).map_err(input)?;
                let name = get(d, "name").map_or(Ok(""), |v| as_str(v, &w)).map_err(input)?;
                let memory = match get(d, "memory")
                    .map(|v| as_str(v, &w))
                    .transpose()
                    .map_err(input)?
                {
                    Some("host") => TraceMemory::Host,
                    _ => TraceMemory::Device,
                };
                let device = field_u64(d, "device", &w, Some(0)).map_err(input)?;
                let device = u32::try_from(device).map_err(|_| {
                    input(format!(
                        "{w}.device: {device} is not a device ordinal (beyond 32 bits)"
                    ))
                })?;
                out.trace
                    .allocators
                    .push(TracedAllocator::new(name, memory, device));
            }
        }
        out.trace.dropped = field_u64(c, "dropped", "cudalloc", Some(0)).map_err(input)?;
    }
    let mut events: Vec<(u64, Event)> = Vec::new();
    for (dev, list) in traces.iter().enumerate() {
        let list = as_list(list, &format!("device_traces[{dev}]")).map_err(input)?;
        if ours.is_none() && !list.is_empty() {
            out.trace.allocators.push(TracedAllocator::new(
                format!("CUDACachingAllocator({dev})"),
                TraceMemory::Device,
                dev as u32,
            ));
        }
        let default_alloc = out.trace.allocators.len().saturating_sub(1) as u64;
        // With none listed, the default allocator is added below.
        let n_alloc = out.trace.allocators.len().max(1) as u64;
        for (i, entry) in list.iter().enumerate() {
            let what = format!("device_traces[{dev}][{i}]");
            match read_entry(entry, &what, default_alloc, n_alloc) {
                Ok(Some(e)) => events.push((e.seq, e)),
                Ok(None) => {}
                Err(msg) => {
                    let e = TraceError::new(Location::Input, msg);
                    if lenient {
                        out.skipped.push(e);
                    } else {
                        return Err(e);
                    }
                }
            }
        }
    }
    if ours.is_some() {
        // Our `seq` is the global order; stable for equal keys.
        events.sort_by_key(|(seq, _)| *seq);
    } else {
        events.sort_by_key(|(_, e)| e.time_ns);
    }
    out.trace.events = events.into_iter().map(|(_, e)| e).collect();
    if ours.is_none() {
        for (i, e) in out.trace.events.iter_mut().enumerate() {
            e.seq = i as u64;
        }
    }
    if out.trace.allocators.is_empty() {
        out.trace.allocators.push(TracedAllocator::new(
            "CUDACachingAllocator(0)",
            TraceMemory::Device,
            0,
        ));
    }
    Ok(out)
}

/// One trace entry; its `allocator` must be one of the first `n_alloc` (those listed):
/// every user of a trace indexes `Trace::allocators` by it.
fn read_entry(entry: &Value, what: &str, default_alloc: u64, n_alloc: u64) -> Result<Option<Event>, String> {
    let d = as_dict(entry, what)?;
    let name = as_str(
        get(d, "action").ok_or(format!("{what}: no `action`"))?,
        &format!("{what}.action"),
    )?;
    let action = match name {
        "alloc" => Action::Alloc,
        "free_requested" => Action::FreeRequested,
        "free_completed" => Action::FreeCompleted,
        "segment_alloc" => Action::SegmentAlloc,
        "segment_free" => Action::SegmentFree,
        "segment_map" => Action::SegmentMap,
        "segment_unmap" => Action::SegmentUnmap,
        "oom" => match get(d, "error") {
            Some(v) => Action::Failure(Cow::Owned(as_str(v, &format!("{what}.error"))?.to_string())),
            None => Action::OutOfMemory,
        },
        "snapshot" => return Ok(None),
        other => return Err(format!("{what}.action: unknown action `{other}`")),
    };
    let addr = field_u64(d, "addr", what, Some(0))?;
    let size = field_u64(d, "size", what, None)?;
    let mut e = Event::new(action, addr, size);
    e.stream = field_u64(d, "stream", what, Some(0))?;
    e.time_ns = field_u64(d, "time_us", what, Some(0))?.saturating_mul(1000);
    e.frames = read_frames(get(d, "frames"), &format!("{what}.frames"))?;
    e.seq = field_u64(d, "seq", what, Some(0))?;
    e.thread = u32::try_from(field_u64(d, "thread", what, Some(0))?)
        .map_err(|_| format!("{what}.thread: too large"))?;
    let allocator = field_u64(d, "allocator", what, Some(default_alloc))?;
    if allocator >= n_alloc {
        return Err(format!(
            "{what}.allocator: {allocator} is not one of the {n_alloc} allocators listed"
        ));
    }
    e.allocator = u32::try_from(allocator).map_err(|_| format!("{what}.allocator: too large"))?;
    e.given = field_u64(d, "given", what, Some(size))?;
    e.align = field_u64(d, "align", what, Some(1))?;
    Ok(Some(e))
}

impl From<TraceError> for io::Error {
    fn from(e: TraceError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}
