//! The A/B report: the same workloads on every allocator, and the raw CUDA calls they
//! replace, in one run; printed as Markdown tables with ratios, and written as JSON, CSV
//! and SVG charts to share.
//!
//!     cargo run --release --example ab
//!     cargo run --release --example ab -- --json ab.json --csv ab-csv --svg ab.svg
//!
//! Sections: `latency` (allocate + free per allocator, raw cuMemHostAlloc and
//! cuMemHostRegister rows), `growth` (Vec push), `staging` (many small objects), `device`
//! (DevicePool against raw cuMemAllocAsync and cuMemAlloc), `bandwidth` (H2D and D2H per
//! kind of host memory), `cpu_bandwidth` (CPU writes and reads over default and
//! write-combined pinned memory, one thread and several), `cold` (the first pinned
//! allocation of 64 MiB, 256 MiB and 1 GiB, each in a fresh process of `ab`, by growth
//! mode; `tools/torch_pinned_cold.py` measures PyTorch the same way), `pipeline` (the
//! staging pipeline's summary: see `examples/pipeline.rs`), `replay` (with `--trace FILE`
//! only: the trace replayed against every allocator, see `examples/replay.rs`). Rows that need a GPU run only where a CUDA driver is present;
//! elsewhere the report says why they are missing. Progress goes to stderr.
//!
//! Options:
//!   --json FILE          every row as JSON
//!   --csv DIR            one CSV file per table
//!   --svg FILE           every charted table (latency, growth, staging, device, bandwidth,
//!                        cpu_bandwidth, cold, pipeline; replay with --trace) as one SVG
//!   --only LIST          run only these sections (comma-separated)
//!   --sizes LIST         sizes for latency, device, bandwidth and cold: 256,64K,1M,16M
//!                        (cpu_bandwidth takes the largest)
//!   --trace FILE         also replay this trace (RMM's CSV or PyTorch's snapshot) against
//!                        every allocator that fits its memory: the `replay` section, with
//!                        its chart in --svg (as `examples/replay.rs` prints it)
//!   --quick              short time budgets and small workloads
//!   --pipeline-batches N batches in the pipeline summary (32)
//!   --quiet              no progress on stderr

#[path = "common/pipeline.rs"]
mod pipeline;
#[path = "common/plot.rs"]
mod plot;
#[path = "common/replay_report.rs"]
mod replay_report;
#[path = "common/report.rs"]
mod report;
#[path = "common/sections.rs"]
mod sections;

use std::path::PathBuf;
use std::process::ExitCode;

use sections::{Options, Progress};

struct Args {
    opts: Options,
    json: Option<PathBuf>,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    quiet: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        opts: Options::default(),
        json: None,
        csv: None,
        svg: None,
        quiet: false,
    };
    let known: Vec<&str> = sections::sections().iter().map(|s| s.name).collect();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--json" => a.json = Some(value()?.into()),
            "--csv" => a.csv = Some(value()?.into()),
            "--svg" => a.svg = Some(value()?.into()),
            "--only" => {
                let only: Vec<String> = value()?.split(',').map(str::to_string).collect();
                if let Some(bad) = only.iter().find(|s| !known.contains(&s.as_str())) {
                    return Err(format!("unknown section {bad:?}; sections: {}", known.join(", ")));
                }
                a.opts.only = Some(only);
            }
            "--sizes" => {
                let sizes = value()?
                    .split(',')
                    .map(|s| {
                        report::parse_size(s)
                            .filter(|&n| n > 0)
                            .ok_or(format!("--sizes: cannot read {s:?}"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                a.opts.sizes = Some(sizes);
            }
            "--trace" => a.opts.trace = Some(value()?.into()),
            "--quick" => a.opts.quick = true,
            "--pipeline-batches" => {
                a.opts.pipeline_batches = value()?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("--pipeline-batches: not a count")?
            }
            "--quiet" => a.quiet = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(sections::COLD_CHILD_FLAG) {
        // One cold allocation in this fresh process, for the `cold` section.
        let size = argv.get(3).and_then(|s| report::parse_size(s));
        let done = match (argv.get(2), size) {
            (Some(kind), Some(size)) => sections::cold_child(kind, size),
            _ => Err("usage: ab --cold-child pinned|pageable|prefault SIZE".into()),
        };
        return match done {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ab: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("ab: {e}");
            }
            eprintln!("usage: see the comment at the top of examples/ab.rs");
            return ExitCode::from(2);
        }
    };
    let report = sections::collect(&args.opts, &Progress::new(!args.quiet));
    print!("{}", report.markdown());
    let mut ok = true;
    if let Some(path) = &args.json {
        match report.write_json(path) {
            Ok(()) => eprintln!("ab: wrote {}", path.display()),
            Err(e) => {
                eprintln!("ab: writing {}: {e}", path.display());
                ok = false;
            }
        }
    }
    if let Some(dir) = &args.csv {
        match report.write_csv(dir) {
            Ok(files) => eprintln!("ab: wrote {} CSV files to {}", files.len(), dir.display()),
            Err(e) => {
                eprintln!("ab: writing CSV to {}: {e}", dir.display());
                ok = false;
            }
        }
    }
    if let Some(path) = &args.svg {
        match plot::write_svg(&report, path) {
            Ok(n) => eprintln!("ab: wrote {n} charts to {}", path.display()),
            Err(e) => {
                eprintln!("ab: writing {}: {e}", path.display());
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
