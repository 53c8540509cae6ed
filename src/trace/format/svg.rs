//! A self-contained SVG timeline of a trace: the bytes live (requested, of blocks not yet
//! freed) and reserved (segments taken from the driver, and chunks of physical pages
//! mapped, not given back or unmapped) over time,
//! per allocator, and for device memory per stream. One file, no script, no external
//! font or style: it opens in any browser and on GitHub.
//!
//! Each series is a step line, downsampled to at most [`MAX_POINTS`] points by keeping
//! each interval's highest value (peaks survive). Times are the events' `time_ns`, or
//! their order where the trace has no times.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::trace::{Action, Trace, TraceMemory};

/// The most points one series is drawn with.
pub const MAX_POINTS: usize = 1200;
/// At most this many streams of one allocator get a series of their own.
pub const MAX_STREAMS: usize = 8;

const WIDTH: f64 = 1100.0;
const PLOT_HEIGHT: f64 = 360.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const LEGEND_ROW: f64 = 18.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf",
];

/// A running total and its value after each change: (time, bytes).
type Running = (u64, Vec<(u64, u64)>);

/// One line of the chart.
struct Series {
    name: String,
    dashed: bool,
    /// (time, bytes) after each change.
    points: Vec<(u64, u64)>,
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn fmt_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut u) = (b, 0);
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn series_of(trace: &Trace) -> (Vec<Series>, bool) {
    let timed = trace.events.iter().any(|e| e.time_ns != 0);
    let at = |i: usize, t: u64| if timed { t } else { i as u64 };
    // One series slot per listed allocator, and one more that every event of an
    // allocator not listed shares: sized by the list, not by the indices events name
    // (an event naming allocator 4294967295 must not size a vector by it).
    let listed = trace.allocators.len();
    let n_alloc = listed + 1;
    let slot = |a: u32| (a as usize).min(listed);
    let mut unlisted: Vec<u32> = trace
        .events
        .iter()
        .map(|e| e.allocator)
        .filter(|&a| a as usize >= listed)
        .collect();
    unlisted.sort_unstable();
    unlisted.dedup();
    let name = |a: usize| match (trace.allocators.get(a), &unlisted[..]) {
        (Some(t), _) => t.name.clone(),
        (None, [one]) => format!("allocator {one}"),
        (None, _) => "unlisted allocators".to_string(),
    };
    let device = |a: usize| {
        trace
            .allocators
            .get(a)
            .is_some_and(|t| t.memory == TraceMemory::Device)
    };
    let mut live: Vec<Running> = vec![(0, Vec::new()); n_alloc];
    let mut reserved: Vec<Running> = vec![(0, Vec::new()); n_alloc];
    // (allocator, stream) -> running total and points.
    let mut per_stream: HashMap<(usize, u64), Running> = HashMap::new();
    // (allocator, addr) -> (size, stream) of the live block or segment there.
    let mut blocks: HashMap<(usize, u64), (u64, u64)> = HashMap::new();
    let mut segs: HashMap<(usize, u64), u64> = HashMap::new();
    let bump = |s: &mut Running, t: u64, add: bool, n: u64| {
        s.0 = if add {
            s.0.saturating_add(n)
        } else {
            s.0.saturating_sub(n)
        };
        s.1.push((t, s.0));
    };
    for (i, e) in trace.events.iter().enumerate() {
        let (a, t) = (slot(e.allocator), at(i, e.time_ns));
        let key = (a, e.addr);
        match e.action {
            Action::Alloc => {
                blocks.insert(key, (e.size, e.stream));
                bump(&mut live[a], t, true, e.size);
                if device(a) {
                    bump(per_stream.entry((a, e.stream)).or_default(), t, true, e.size);
                }
            }
            Action::FreeRequested => {
                if let Some((size, stream)) = blocks.remove(&key) {
                    bump(&mut live[a], t, false, size);
                    if device(a) {
                        bump(per_stream.entry((a, stream)).or_default(), t, false, size);
                    }
                }
            }
            // A page heap's chunks are its reservation (`DevicePool` on physical pages).
            Action::SegmentAlloc | Action::SegmentMap => {
                segs.insert(key, e.size);
                bump(&mut reserved[a], t, true, e.size);
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                if let Some(size) = segs.remove(&key) {
                    bump(&mut reserved[a], t, false, size);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for a in 0..n_alloc {
        if !live[a].1.is_empty() {
            out.push(Series {
                name: format!("{}: live", name(a)),
                dashed: false,
                points: std::mem::take(&mut live[a].1),
            });
        }
        if !reserved[a].1.is_empty() {
            out.push(Series {
                name: format!("{}: reserved", name(a)),
                dashed: true,
                points: std::mem::take(&mut reserved[a].1),
            });
        }
        let mut streams: Vec<u64> = per_stream.keys().filter(|k| k.0 == a).map(|k| k.1).collect();
        if streams.len() > 1 {
            streams.sort_unstable();
            for s in streams.into_iter().take(MAX_STREAMS) {
                if let Some((_, points)) = per_stream.remove(&(a, s)) {
                    out.push(Series {
                        name: format!("{}: live on stream {s:#x}", name(a)),
                        dashed: false,
                        points,
                    });
                }
            }
        }
    }
    (out, timed)
}

/// At most `MAX_POINTS` points: per interval of time, the highest value in it.
fn downsample(points: &[(u64, u64)], t0: u64, t1: u64) -> Vec<(u64, u64)> {
    if points.len() <= MAX_POINTS {
        return points.to_vec();
    }
    let span = (t1 - t0).max(1) as u128;
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(MAX_POINTS + 1);
    let mut bucket = u128::MAX;
    for &(t, v) in points {
        let b = (t - t0) as u128 * MAX_POINTS as u128 / span;
        match out.last_mut() {
            Some(last) if b == bucket => last.1 = last.1.max(v),
            _ => {
                bucket = b;
                out.push((t, v));
            }
        }
    }
    out
}

/// The timeline of `trace` as an SVG document (see the module docs).
///
/// ```
/// use cudalloc::trace::{format::svg, Action, Event, Trace, TraceMemory, TracedAllocator};
/// let mut t = Trace::default();
/// t.allocators.push(TracedAllocator::new("Pool", TraceMemory::Host, 0));
/// t.events.push(Event::new(Action::Alloc, 0x1000, 4096));
/// t.events.push(Event::new(Action::FreeRequested, 0x1000, 4096));
/// let doc = svg::timeline(&t);
/// assert!(doc.starts_with("<svg") && doc.contains("Pool: live"));
/// ```
pub fn timeline(trace: &Trace) -> String {
    let (series, timed) = series_of(trace);
    let times = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (t0, t1) = times.fold((u64::MAX, 0u64), |(lo, hi), t| (lo.min(t), hi.max(t)));
    // A span of at least 1, also when every event is at u64::MAX.
    let (t0, t1) = if t0 > t1 {
        (0, 1)
    } else {
        let t1 = t1.max(t0.saturating_add(1));
        (t0.min(t1 - 1), t1)
    };
    let ymax = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let legend_h = LEGEND_ROW * series.len().max(1) as f64 + 10.0;
    let height = TOP + PLOT_HEIGHT + 50.0 + legend_h;
    let plot_w = WIDTH - LEFT - RIGHT;
    let x = |t: u64| LEFT + (t - t0) as f64 / (t1 - t0) as f64 * plot_w;
    let y = |v: u64| TOP + PLOT_HEIGHT - v as f64 / ymax * PLOT_HEIGHT;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        o,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let events = trace.events.len();
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="24" font-size="16" font-weight="bold">Memory over time: {events} events, {} allocators</text>"#,
        trace.allocators.len()
    );
    // Axes and ticks.
    let _ = writeln!(
        o,
        r##"<g stroke="#444" fill="none"><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{b}"/><line x1="{LEFT}" y1="{b}" x2="{r}" y2="{b}"/></g>"##,
        b = TOP + PLOT_HEIGHT,
        r = WIDTH - RIGHT
    );
    for i in 0..=5 {
        let v = ymax * i as f64 / 5.0;
        let yy = TOP + PLOT_HEIGHT - PLOT_HEIGHT * i as f64 / 5.0;
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{r}" y2="{yy:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{label}</text>"##,
            r = WIDTH - RIGHT,
            tx = LEFT - 6.0,
            ty = yy + 4.0,
            label = fmt_bytes(v)
        );
        let t = t0 as f64 + (t1 - t0) as f64 * i as f64 / 5.0;
        let label = if timed {
            format!("{:.3} ms", t / 1e6)
        } else {
            format!("event {t:.0}")
        };
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{label}</text>"#,
            LEFT + plot_w * i as f64 / 5.0,
            TOP + PLOT_HEIGHT + 18.0
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        TOP + PLOT_HEIGHT + 36.0,
        if timed {
            "time since the recording started"
        } else {
            "event order (the trace has no times)"
        }
    );
    if series.is_empty() {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}">no allocations in this trace</text>"#,
            LEFT + 20.0,
            TOP + 30.0
        );
    }
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts = downsample(&s.points, t0, t1);
        let mut path = format!("{:.1},{:.1}", x(t0), y(0));
        let mut prev = 0;
        for &(t, v) in &pts {
            // A step: hold the previous value until this point's time.
            let _ = write!(path, " {:.1},{:.1} {:.1},{:.1}", x(t), y(prev), x(t), y(v));
            prev = v;
        }
        let _ = write!(path, " {:.1},{:.1}", x(t1), y(prev));
        let dash = if s.dashed {
            r#" stroke-dasharray="6 3""#
        } else {
            ""
        };
        let name = xml_escape(&s.name);
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{path}"><title>{name}</title></polyline>"#
        );
        let ly = TOP + PLOT_HEIGHT + 56.0 + LEGEND_ROW * i as f64;
        let peak = s.points.iter().map(|p| p.1).max().unwrap_or(0);
        let _ = writeln!(
            o,
            r#"<line x1="{LEFT}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"{dash}/><text x="{:.1}" y="{:.1}">{name} (peak {})</text>"#,
            LEFT + 24.0,
            LEFT + 30.0,
            ly + 4.0,
            fmt_bytes(peak as f64)
        );
    }
    o.push_str("</svg>\n");
    o
}
