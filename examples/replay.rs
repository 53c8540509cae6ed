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
//! and, without a GPU, on the pool's cache and the simulated page heap and driver pool over
//! the simulated GPU (with their reservations), which the report says.
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
//!   --rounds N         replay N times per allocator, in rounds that alternate them;
//!                      each row is the median round by total time (default 1)

#[path = "common/replay_report.rs"]
mod replay_report;
#[path = "common/report.rs"]
mod report;

use std::path::PathBuf;
use std::process::ExitCode;

use cudalloc::trace::format;
use cudalloc::trace::TraceMemory;
use replay_report::{replay_file, ReplayArgs};
use report::Report;

#[derive(Default)]
struct Args {
    replay: ReplayArgs,
    json: Option<PathBuf>,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args::default();
    let mut trace = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--allocators" => {
                a.replay.allocators = value("--allocators")?
                    .split(',')
                    .map(|s| s.trim().to_lowercase())
                    .filter(|s| !s.is_empty())
                    .collect()
            }
            "--memory" => {
                a.replay.memory = Some(match value("--memory")?.as_str() {
                    "host" => TraceMemory::Host,
                    "device" => TraceMemory::Device,
                    other => return Err(format!("--memory {other}: host or device")),
                })
            }
            "--json" => a.json = Some(value("--json")?.into()),
            "--csv" => a.csv = Some(value("--csv")?.into()),
            "--svg" => a.svg = Some(value("--svg")?.into()),
            "--fit" => a.replay.fit = true,
            "--lenient" => a.replay.lenient = true,
            "--rounds" => {
                let v = value("--rounds")?;
                a.replay.rounds = match v.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("--rounds {v}: a count of at least 1")),
                };
            }
            s if s.starts_with("--") => return Err(format!("unknown option {s}")),
            s if trace.is_none() => trace = Some(PathBuf::from(s)),
            s => return Err(format!("one trace at a time ({s})")),
        }
    }
    a.replay.trace = trace.ok_or("no TRACE given")?;
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("replay: {e}");
            eprintln!("usage: replay TRACE [--allocators LIST] [--memory host|device] [--json F] [--csv DIR] [--svg F] [--fit] [--lenient] [--rounds N]");
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
    let replayed = replay_file(&args.replay, &|what: &str| eprintln!("replay: {what}"))?;
    let report = Report {
        title: replayed.title,
        environment: replayed.environment,
        notes: replayed.notes,
        tables: replayed.tables,
    };
    let trace = replayed.trace;
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
