//! The replay report of one trace file: the table of what each allocator took and held
//! (and, with `fit`, the smallest limit each pool replays it in), shared by
//! `examples/replay.rs` and `ab --trace FILE`.

// Shared by several examples and tests (`#[path]` includes): each uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;

use cudalloc::trace::format;
use cudalloc::trace::replay::{targets, Plan, ReplayOptions, ReplayReport, Target};
use cudalloc::trace::{Action, Trace, TraceMemory};

use crate::report::{self, Table, Unit};

/// What to replay and how.
#[derive(Clone, Debug, Default)]
pub struct ReplayArgs {
    pub trace: PathBuf,
    /// Only allocators whose name starts with one of these (lower case); empty: all.
    pub allocators: Vec<String>,
    /// The allocators to use (`None`: the trace's kind of memory).
    pub memory: Option<TraceMemory>,
    /// The smallest limit each limitable pool replays the trace in.
    pub fit: bool,
    /// Skip bad lines and events (counted) instead of stopping.
    pub lenient: bool,
    /// Replays per allocator (0 or 1: one), in rounds that run every allocator once, in
    /// an order rotated by one each round; each row is the allocator's median round by
    /// total time, with the fastest and slowest totals beside it.
    pub rounds: usize,
}

/// The replay of one trace: the lines of a report and the trace read.
pub struct Replayed {
    pub title: String,
    pub environment: Vec<(String, String)>,
    pub notes: Vec<String>,
    /// `replay` (charted: total time per allocator), and `fit` when asked for.
    pub tables: Vec<Table>,
    pub trace: Trace,
}

/// Reads `args.trace` (RMM's CSV or PyTorch's snapshot, told apart by content) and replays
/// it against every allocator that fits its memory; `progress` hears each allocator's name
/// and the skipped events.
pub fn replay_file(args: &ReplayArgs, progress: &dyn Fn(&str)) -> Result<Replayed, String> {
    let path = args.trace.display();
    let bytes = std::fs::read(&args.trace).map_err(|e| format!("reading {path}: {e}"))?;
    let read = format::read_any(&bytes, args.lenient).map_err(|e| format!("{path}: {e}"))?;
    for e in read.skipped.iter().take(5) {
        progress(&format!("{path}: skipped {e}"));
    }
    let trace = read.trace;
    let memory = args.memory.unwrap_or_else(|| {
        let device = trace.allocators.iter().any(|a| a.memory == TraceMemory::Device);
        if device {
            TraceMemory::Device
        } else {
            TraceMemory::Host
        }
    });
    let opts = ReplayOptions::default().with_lenient(args.lenient);
    let plan = Plan::new(&trace, &opts).map_err(|e| format!("{path}: {e}"))?;
    for e in plan.skipped().iter().take(5) {
        progress(&format!("{path}: skipped {e}"));
    }
    let gpu = cudalloc::cuda::driver_available();

    let mut out = Replayed {
        title: format!("Replay of {path}"),
        environment: Vec::new(),
        notes: Vec::new(),
        tables: Vec::new(),
        trace: Trace::default(),
    };
    let env = &mut out.environment;
    env.push(("cudalloc".into(), env!("CARGO_PKG_VERSION").into()));
    env.push((
        "CUDA driver".into(),
        if gpu { "present" } else { "absent" }.into(),
    ));
    let allocs = trace.events.iter().filter(|e| e.action == Action::Alloc).count();
    env.push((
        "trace".into(),
        format!(
            "{} events ({allocs} allocations), {} threads, {} streams, {} memory, peak requested {}",
            trace.events.len(),
            plan.threads(),
            plan.streams(),
            if memory == TraceMemory::Device {
                "device"
            } else {
                "host"
            },
            report::fmt_size(plan.peak_requested() as usize)
        ),
    ));
    let skipped = read.skipped.len() + plan.skipped().len();
    if skipped > 0 {
        out.notes
            .push(format!("--lenient: {skipped} bad lines or events skipped."));
    }
    if memory == TraceMemory::Device && !gpu {
        out.notes.push(
            "No CUDA driver: the device trace replays on the device pool over the simulated GPU (the \
             cache alone, and the simulated page heap and driver pool): no driver or GPU time; \
             reservation figures for the simulated page-heap and driver-pool rows only."
                .into(),
        );
    }

    let chosen: Vec<_> = targets(memory)
        .into_iter()
        .filter(|t| {
            let name = t.name.to_lowercase();
            args.allocators.is_empty() || args.allocators.iter().any(|a| name.starts_with(a.as_str()))
        })
        .collect();
    if chosen.is_empty() {
        return Err(format!(
            "no allocator matches --allocators {}",
            args.allocators.join(",")
        ));
    }

    let mut table = Table::new("replay", "replay", "Replay: time and memory per allocator")
        .col("allocator", "allocator", Unit::Label)
        .col("total_ms", "total", Unit::Millis)
        .col("alloc_median_ns", "alloc median", Unit::Nanos)
        .col("alloc_p99_ns", "alloc p99", Unit::Nanos)
        .col("free_median_ns", "free median", Unit::Nanos)
        .col("free_p99_ns", "free p99", Unit::Nanos)
        .col("peak_requested", "peak requested", Unit::Bytes)
        .col("peak_held", "peak held", Unit::Bytes)
        .col("peak_reserved", "peak reserved", Unit::Bytes)
        .col("reserved_ratio", "reserved / requested", Unit::Ratio)
        .col("failures", "failed allocs", Unit::Count)
        .col("never_freed", "never freed", Unit::Count)
        .chart("allocator", "allocator", "total_ms", false);
    let mut fit = Table::new(
        "fit",
        "replay",
        "Fit: the smallest limit that replays without a failure",
    )
    .col("allocator", "allocator", Unit::Label)
    .col("limit", "smallest limit", Unit::Bytes)
    .col("limit_ratio", "limit / peak requested", Unit::Ratio);
    let rounds = args.rounds.max(1);
    if rounds > 1 {
        let spread = [
            ("total_min_ms", "fastest total"),
            ("total_max_ms", "slowest total"),
        ];
        for (key, title) in spread {
            table = table.col(key, title, Unit::Millis);
        }
    }
    let runs = run_rounds(&chosen, &plan, rounds, progress);
    let mut notes: Vec<String> = Vec::new();
    let mut never_freed = None;
    for (t, runs) in chosen.iter().zip(runs) {
        let (r, spread) = match runs {
            Ok(runs) => median_run(runs),
            Err(e) => {
                table.note(format!("{}: did not run: {e}", t.name));
                continue;
            }
        };
        let mut row = vec![
            r.allocator.clone().into(),
            (r.total_ns as f64 / 1e6).into(),
            (r.alloc_median_ns as f64).into(),
            (r.alloc_p99_ns as f64).into(),
            (r.free_median_ns as f64).into(),
            (r.free_p99_ns as f64).into(),
            (r.peak_requested as usize).into(),
            (r.peak_held as usize).into(),
            r.peak_reserved.map(|b| b as f64).into(),
            r.reserved_ratio().into(),
            (r.failures as usize).into(),
            (r.never_freed_blocks as usize).into(),
        ];
        if rounds > 1 {
            row.push((spread.0 as f64 / 1e6).into());
            row.push((spread.1 as f64 / 1e6).into());
        }
        table.push(row);
        never_freed.get_or_insert((r.never_freed_blocks, r.never_freed_bytes));
        if let Some(f) = &r.first_failure {
            notes.push(format!(
                "{}: {} allocations failed, the first of {f}",
                r.allocator, r.failures
            ));
        }
        if let Some(n) = &r.note {
            notes.push(format!("{}: {n}", r.allocator));
        }
        if args.fit {
            match t.fit(&plan) {
                Some(Ok(limit)) => fit.push(vec![
                    t.name.clone().into(),
                    (limit as usize).into(),
                    (limit as f64 / plan.peak_requested().max(1) as f64).into(),
                ]),
                Some(Err(e)) => fit.note(format!("{}: {e}", t.name)),
                None => {}
            }
        }
    }
    if let Some((blocks, bytes)) = never_freed.filter(|n| n.0 > 0) {
        notes.push(format!(
            "The trace never frees {blocks} blocks ({}): reported, freed after the timed run, not charged.",
            report::fmt_size(bytes as usize)
        ));
    }
    for n in notes {
        table.note(n);
    }
    if rounds > 1 {
        table.note(format!(
            "Each allocator replayed the trace {rounds} times, in rounds that run every allocator once (the \
             order rotated by one each round); each row is its median round by total time."
        ));
    }
    table.note(
        "Times per operation include the clock reads around the call; total is the wall time of the whole \
         replay, with the handing of turns between replay threads. On a GPU the driver's one-time set-up of \
         stream-ordered allocation (8-11 ms on the H200, paid by a process's first such allocation) is paid \
         before any allocator is timed.",
    );
    out.tables.push(table);
    if args.fit {
        if fit.rows.is_empty() {
            fit.note("No allocator here has a limit to fit (the pools with one: Pool<HostSource> and, on a GPU, DevicePool).");
        }
        out.tables.push(fit);
    }
    out.trace = trace;
    Ok(out)
}

/// Replays `plan` on every target `rounds` times: round `k` starts at target `k` (mod
/// their number) and runs each once, so that no allocator always runs first or right
/// after the same one. Per target: its reports in round order, or its first error (a
/// target that fails once is not run again).
fn run_rounds(
    chosen: &[Target],
    plan: &Plan,
    rounds: usize,
    progress: &dyn Fn(&str),
) -> Vec<Result<Vec<ReplayReport>, String>> {
    let mut runs: Vec<Result<Vec<ReplayReport>, String>> = chosen.iter().map(|_| Ok(Vec::new())).collect();
    for round in 0..rounds {
        for i in (0..chosen.len()).map(|j| (j + round) % chosen.len()) {
            let Ok(done) = &mut runs[i] else { continue };
            let t = &chosen[i];
            progress(&if rounds > 1 {
                format!("{} (round {} of {rounds})", t.name, round + 1)
            } else {
                t.name.clone()
            });
            match t.run(plan) {
                Ok(r) => done.push(r),
                Err(e) => runs[i] = Err(e),
            }
        }
    }
    runs
}

/// The median of one target's replays by total time (the lower median of an even
/// number), with the fastest and slowest totals.
fn median_run(mut runs: Vec<ReplayReport>) -> (ReplayReport, (u64, u64)) {
    runs.sort_by_key(|r| r.total_ns);
    let spread = (runs[0].total_ns, runs[runs.len() - 1].total_ns);
    let median = runs.swap_remove((runs.len() - 1) / 2);
    (median, spread)
}
