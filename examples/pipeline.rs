//! The staging pipeline users run GPUs for: batches flow host -> device -> kernel ->
//! host, with copies in both directions and kernels overlapping on several streams.
//!
//!     cargo run --release --example pipeline
//!     cargo run --release --example pipeline -- --batches 64 --batch-size 64M \
//!         --streams 1,2,4,8 --staging-streams 4 --work transfer,balanced,compute
//!
//! Every variant runs in one process on the same kernel (`kernels/pipeline.cu`, loaded
//! from PTX with `cudalloc::cuda::Module`): pageable memory, `PinnedAlloc` with 1..8
//! streams, double buffering, per-stream arenas, a fresh pinned `Vec` per batch next to a
//! ring, and the raw reference (`cuMemHostAlloc` + `cuMemAlloc`). The pageable and pinned
//! rows run on the library's `staging::Pipeline` (`ring.pipeline().run_split(fill,
//! queue_in, queue_out, drain)`), the threaded row on it with its fill on worker threads
//! (`ring.pipeline().fill_threads(n)`), the ring row on a `StagingRing`; the raw,
//! double-buffering, arena and fresh-Vec rows are written by hand. The code is in `examples/common/pipeline.rs`.
//!
//! In the hand-written loops the issuing thread waits only for what it is about to reuse
//! (a lane's input buffer: the H2D that read it; its output buffer: the D2H that filled
//! it, then the check), so every stream has its next batch queued before the current one
//! ends; the pipeline refills a buffer once its upload is done (`Staged::last_use_queued`
//! in the launch), queues the buffer's next upload and kernel before its last batch is
//! checked and its copy back after (`Pipeline::run_split`). The report puts
//! each row next to the hand-written CUDA C++ pipeline that issue 11 quotes (table
//! `pipeline_cpp`, and the `vs C++` column).
//!
//! Every batch's output is checked against the host's reference; a wrong element, or a
//! variant that cannot run, makes the program exit with status 1. Without a GPU it says
//! why and exits 0.
//!
//! Options:
//!   --batches N            batches per run (64)
//!   --batch-size SIZE      bytes per batch: 64M, 1G, 4096 (64M)
//!   --streams LIST         stream counts of the PinnedAlloc and raw rows (1,2,4,8)
//!   --staging-streams N    streams of the arena, fresh-Vec, ring, threaded and pipeline rows (4)
//!   --work LIST            transfer, balanced, compute, or rounds per element (all three)
//!   --variants LIST        pageable,pinned,double,raw,arena,fresh,ring,threaded (all); pipeline and
//!                          hand (only when named): `hand` adds the hand-written loops the
//!                          pageable, pinned and ring rows ran on before the library's
//!                          `StagingRing` and `staging::Pipeline`, as rows `hand-*` (and
//!                          the `vs hand-written` column)
//!   --samples N            positions checked per batch besides the first and last (256)
//!   --verify-all           write and check every element (slow)
//!   --fill-threads N       threads that write a whole batch (half the cores, at most 8)
//!   --fill-workers N       worker threads of the threaded-S row's fill
//!                          (`Pipeline::fill_threads`, 2), each writing its batch with
//!                          fill-threads / N threads
//!   --unchained            order each lane's copies by its own stream only (as the C++
//!                          reference does), not also after the previous batch's copy in
//!                          the same direction
//!   --no-warmup            time first use too
//!   --ring-buffers N       staging buffers per stream of the pageable and pinned rows'
//!                          StagingRing (1: an in/out pair per stream, as the hand-written
//!                          rows and the C++ reference; 2: each stream's next batch stays
//!                          queued while its last one is checked)
//!   --repeat N             run each row N times, the rows of a regime in turn, and keep
//!                          the run of median wall time (1): rows then compare over the
//!                          same stretch of time
//!   --pinned-limit SIZE    cap the pinned pools (PinnedAlloc::set_limit) before running
//!   --fresh-headroom SIZE  while the fresh-Vec rows run, cap the pinned pools at what they
//!                          hold plus SIZE: what a staging loop meets at the pool's cap
//!   --json FILE, --csv DIR the tables as JSON / CSV
//!   --svg FILE             the variants' wall time against the ideal, as a chart
//!   --timeline FILE        each row's streams over time, as an SVG: one lane per stream
//!                          (H2D, kernel and D2H bars from the events every batch
//!                          records) and one for the host's fill; gaps are where a
//!                          stream waits

#[path = "common/pipeline.rs"]
mod pipeline;
#[path = "common/plot.rs"]
mod plot;
#[path = "common/report.rs"]
mod report;

use std::path::PathBuf;
use std::process::ExitCode;

use pipeline::{Config, Regime, Variant};
use report::{parse_size, Report};

fn list<T>(s: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|x| parse(x).ok_or_else(|| format!("cannot read {x:?}")))
        .collect()
}

struct Args {
    cfg: Config,
    pinned_limit: Option<usize>,
    json: Option<PathBuf>,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    timeline: Option<PathBuf>,
}

/// A count of at least 1, or `FLAG: not a count`.
fn count(v: &str, flag: &str) -> Result<usize, String> {
    v.parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or(format!("{flag}: not a count"))
}

fn parse_args() -> Result<Args, String> {
    let mut cfg = Config::full();
    let mut streams = vec![1, 2, 4, 8];
    let mut staging = 4;
    let mut names: Option<Vec<String>> = None;
    let (mut pinned_limit, mut json, mut csv, mut svg, mut timeline) = (None, None, None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--batches" => cfg.batches = value()?.parse().map_err(|e| format!("--batches: {e}"))?,
            "--batch-size" => cfg.batch_bytes = parse_size(&value()?).ok_or("--batch-size: not a size")?,
            "--streams" => streams = list(&value()?, |s| s.parse().ok().filter(|&n| n > 0))?,
            "--staging-streams" => staging = count(&value()?, "--staging-streams")?,
            "--work" => cfg.regimes = list(&value()?, Regime::parse)?,
            "--variants" => names = Some(value()?.split(',').map(str::to_string).collect()),
            "--samples" => cfg.samples = value()?.parse().map_err(|e| format!("--samples: {e}"))?,
            "--verify-all" => cfg.verify_all = true,
            "--fill-threads" => cfg.fill_threads = count(&value()?, "--fill-threads")?,
            "--fill-workers" => cfg.fill_workers = count(&value()?, "--fill-workers")?,
            "--unchained" => cfg.chain_copies = false,
            "--no-warmup" => cfg.warmup = false,
            "--repeat" => cfg.repeat = count(&value()?, "--repeat")?,
            "--ring-buffers" => cfg.ring_buffers = count(&value()?, "--ring-buffers")?,
            "--fresh-headroom" => {
                cfg.fresh_headroom = Some(parse_size(&value()?).ok_or("--fresh-headroom: not a size")?)
            }
            "--pinned-limit" => {
                pinned_limit = Some(parse_size(&value()?).ok_or("--pinned-limit: not a size")?)
            }
            "--json" => json = Some(PathBuf::from(value()?)),
            "--csv" => csv = Some(PathBuf::from(value()?)),
            "--svg" => svg = Some(PathBuf::from(value()?)),
            "--timeline" => timeline = Some(PathBuf::from(value()?)),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    cfg.variants = Variant::all(&streams, staging, names.as_deref());
    if cfg.variants.is_empty() {
        return Err("--variants selects nothing".into());
    }
    Ok(Args {
        cfg,
        pinned_limit,
        json,
        csv,
        svg,
        timeline,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("pipeline: {e}");
            }
            eprintln!("usage: see the comment at the top of examples/pipeline.rs");
            return ExitCode::from(2);
        }
    };
    if !cudalloc::cuda::driver_available() {
        println!(
            "pipeline: no CUDA driver on this machine (libcuda not found, cuInit failed, or no device); \
             nothing to measure. Run it on a machine with an NVIDIA GPU."
        );
        return ExitCode::SUCCESS;
    }
    if let Some(limit) = args.pinned_limit {
        cudalloc::PinnedAlloc::set_limit(Some(limit));
    }
    let results = match pipeline::run(&args.cfg, &|what: &str| eprintln!("[pipeline] {what}")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pipeline: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut rep = Report {
        title: "cudalloc staging pipeline".into(),
        ..Default::default()
    };
    rep.environment.push((
        "GPU".into(),
        cudalloc::cuda::device_name(0).unwrap_or_else(|e| format!("unknown ({e})")),
    ));
    rep.environment
        .push(("pinned pool".into(), cudalloc::PinnedAlloc::stats().to_string()));
    rep.tables = results.tables();
    print!("{}", rep.markdown());
    if let Some(path) = &args.json {
        if let Err(e) = rep.write_json(path) {
            eprintln!("pipeline: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(dir) = &args.csv {
        if let Err(e) = rep.write_csv(dir) {
            eprintln!("pipeline: writing CSV to {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(path) = &args.svg {
        if let Err(e) = plot::write_svg(&rep, path) {
            eprintln!("pipeline: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(path) = &args.timeline {
        let timelines = results.timelines();
        if let Err(e) = pipeline::timeline::write_svg(&timelines, path) {
            eprintln!("pipeline: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!(
            "Timeline of {} runs (one lane per stream, and the host's fill): {}",
            timelines.len(),
            path.display()
        );
    }
    let (wrong, failed) = (results.mismatches(), results.failures());
    if wrong > 0 || failed > 0 {
        eprintln!("pipeline: {wrong} wrong elements, {failed} variants failed");
        return ExitCode::FAILURE;
    }
    println!("All outputs checked: 0 wrong elements.");
    ExitCode::SUCCESS
}
