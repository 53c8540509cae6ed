//! Replays an allocation trace against every allocator that fits its memory, and prints
//! what each took and held: the instrument to answer "which allocator for my program?".
//!
//!     cargo run --release --example replay -- traces/rmm_random.csv
//!     cargo run --release --example replay -- my_snapshot.pickle --fit --svg timeline.svg
//!
//! TRACE is RMM's CSV log (`logging_resource_adaptor`) or PyTorch's snapshot pickle
//! (`torch.cuda.memory._snapshot()`), told apart by their content. Host traces replay
//! on the host allocators; device traces on the device pools (each `Backing` and
//! `PageTuning` preset, the uncached driver pool, raw `cuMemAllocAsync` and `cuMemAlloc`)
//! and, without a GPU, on the pool's cache over the simulated GPU, which the report says.
//!
//! Options:
//!   --allocators LIST  only these (comma-separated, each matching a name's start, case
//!                      ignored: `global,pool`)
//!   --memory KIND      host or device: the allocators to use (default: the trace's kind)
//!   --json FILE        every row as JSON
//!   --csv DIR          one CSV file per table
//!   --svg FILE         the trace's timeline (bytes live and reserved over time)
//!   --fit              the smallest limit each limitable pool replays the trace in
//!   --lenient          skip bad lines and events (counted) instead of stopping

#[path = "common/report.rs"]
mod report;

use std::path::PathBuf;
use std::process::ExitCode;

use cudalloc::trace::format;
use cudalloc::trace::replay::{targets, Plan, ReplayOptions};
use cudalloc::trace::{Action, TraceMemory};
use report::{Report, Table, Unit};

#[derive(Default)]
struct Args {
    trace: PathBuf,
    allocators: Vec<String>,
    memory: Option<TraceMemory>,
    json: Option<PathBuf>,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    fit: bool,
    lenient: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args::default();
    let mut trace = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--allocators" => {
                a.allocators = value("--allocators")?
                    .split(',')
                    .map(|s| s.trim().to_lowercase())
                    .filter(|s| !s.is_empty())
                    .collect()
            }
            "--memory" => {
                a.memory = Some(match value("--memory")?.as_str() {
                    "host" => TraceMemory::Host,
                    "device" => TraceMemory::Device,
                    other => return Err(format!("--memory {other}: host or device")),
                })
            }
            "--json" => a.json = Some(value("--json")?.into()),
            "--csv" => a.csv = Some(value("--csv")?.into()),
            "--svg" => a.svg = Some(value("--svg")?.into()),
            "--fit" => a.fit = true,
            "--lenient" => a.lenient = true,
            s if s.starts_with("--") => return Err(format!("unknown option {s}")),
            s if trace.is_none() => trace = Some(PathBuf::from(s)),
            s => return Err(format!("one trace at a time ({s})")),
        }
    }
    a.trace = trace.ok_or("no TRACE given")?;
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("replay: {e}");
            eprintln!("usage: replay TRACE [--allocators LIST] [--memory host|device] [--json F] [--csv DIR] [--svg F] [--fit] [--lenient]");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replay: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let path = args.trace.display();
    let bytes = std::fs::read(&args.trace).map_err(|e| format!("reading {path}: {e}"))?;
    let read = format::read_any(&bytes, args.lenient).map_err(|e| format!("{path}: {e}"))?;
    for e in read.skipped.iter().take(5) {
        eprintln!("replay: {path}: skipped {e}");
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
        eprintln!("replay: {path}: skipped {e}");
    }
    let gpu = cudalloc::cuda::driver_available();

    let mut report = Report {
        title: format!("Replay of {path}"),
        ..Default::default()
    };
    let env = &mut report.environment;
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
        report
            .notes
            .push(format!("--lenient: {skipped} bad lines or events skipped."));
    }
    if memory == TraceMemory::Device && !gpu {
        report.notes.push(
            "No CUDA driver: the device trace replays on the device pool's cache over the simulated GPU \
             (the cache's own work; no driver or GPU time, no reservation figures)."
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
    let mut notes: Vec<String> = Vec::new();
    let mut never_freed = None;
    for t in &chosen {
        eprintln!("replay: {}", t.name);
        let r = match t.run(&plan) {
            Ok(r) => r,
            Err(e) => {
                table.note(format!("{}: did not run: {e}", t.name));
                continue;
            }
        };
        table.push(vec![
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
        ]);
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
    table.note(
        "Times per operation include the clock reads around the call; total is the wall time of the whole \
         replay, with the handing of turns between replay threads.",
    );
    report.tables.push(table);
    if args.fit {
        if fit.rows.is_empty() {
            fit.note("No allocator here has a limit to fit (the pools with one: Pool<HostSource> and, on a GPU, DevicePool).");
        }
        report.tables.push(fit);
    }
    print!("{}", report.markdown());

    if let Some(p) = &args.json {
        report
            .write_json(p)
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
        eprintln!("replay: wrote {}", p.display());
    }
    if let Some(d) = &args.csv {
        let files = report
            .write_csv(d)
            .map_err(|e| format!("writing CSV to {}: {e}", d.display()))?;
        eprintln!("replay: wrote {} CSV files to {}", files.len(), d.display());
    }
    if let Some(p) = &args.svg {
        std::fs::write(p, format::svg::timeline(&trace))
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
        eprintln!("replay: wrote {}", p.display());
    }
    Ok(())
}
