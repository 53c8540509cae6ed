//! The staging pipeline: batches flow host -> device -> kernel -> host, each batch on
//! one of several streams, so that copies in both directions and kernels overlap.
//! Every variant of issue 11 runs here, on the same kernel and the same data:
//!
//! | variant | host memory of a batch | written on |
//! |---|---|---|
//! | `pageable` | a pageable in/out pair (`StagingRing<Global>`, 1 buffer) | `staging::Pipeline` |
//! | `pinned-S` | a `PinnedAlloc` in/out pair per stream (`StagingRing<PinnedAlloc>`, 1 buffer per stream), S streams | `staging::Pipeline` |
//! | `double` | two `Vec<u32, PinnedAlloc>` slots, one stream per stage (H2D, kernel, D2H) | hand-written |
//! | `raw-S` | the reference: `cuMemHostAlloc` + `cuMemAlloc` buffers, raw copies, S streams | hand-written |
//! | `arena-S` | input staged in a per-stream `Arena<PinnedSource>`, reset per batch | hand-written |
//! | `fresh-S` | input in a fresh `Vec<u32, PinnedAlloc>` per batch, dropped right after its copy is queued: the pool's event-guarded reuse is the ring | hand-written |
//! | `ring-S` | input in a `StagingRing` of S+1 `PinnedAlloc` buffers, reused once its copy is done | `StagingRing` |
//! | `pipeline-S` | a `StagingRing` of 2 buffers per stream, S streams (only with `--variants pipeline`) | `staging::Pipeline` |
//! | `threaded-S` | `pipeline-S` with its fill on [`Config::fill_workers`] worker threads (`Pipeline::fill_threads`), each writing its batch with `fill_threads / fill_workers` threads: the same threads in all as the ideal's fill | `staging::ThreadedPipeline` |
//! | `hand-pageable`, `hand-pinned-S`, `hand-ring-S` | the rows above as they were written by hand before the library's types (a `Vec<u32>` / `Vec<u32, PinnedAlloc>` in/out pair per stream, an explicit ring of S+1 `Vec<u32, PinnedAlloc>`): the same-run reference for the rows on the library (only with `--variants hand`) | hand-written |
//!
//! Fixed-buffer variants (pageable, pinned, double, raw) write a batch's input at its
//! checked positions only ("stamp"): like the hand-written reference, they measure the
//! pipeline, not the host's memory bandwidth. Staging variants (arena, fresh, ring) take a
//! new buffer per batch and so write all of it, with [`Config::fill_threads`] threads:
//! their ideal includes that host fill, measured alone the same way. Every batch's output
//! is checked against the host's reference ([`hash_rounds`]): at sampled positions in the
//! benchmark, everywhere with `verify_all`.
//!
//! The rows on the library's types are a few lines each: `pageable` and `pinned-S` give
//! `ring.pipeline().run_split(..)` the stamp or fill, the two halves of the launch (H2D
//! and kernel; D2H, on the lease's stream) and the check ([`run_ring`]); `ring-S` leases
//! its inputs from a `StagingRing` inside the hand-written lane loop. A ring buffer is
//! refilled once its upload is done (the first half calls `Staged::last_use_queued` right
//! after it, as the hand-written loop's `AwaitInputRead` waits for the H2D only), and a
//! buffer's next upload and kernel are queued before its last batch is checked, its D2H
//! after: the hand-written loop's order.
//!
//! Issue order of the hand-written loops ([`plan`]): the issuing thread blocks only where
//! a buffer it is about to touch may still be in use, and only just before touching it.
//! Batch b's input waits for the H2D copy of the last batch that used the buffer (not for
//! that batch's D2H); its H2D copy and kernel are queued at once; only then does the
//! thread wait for the D2H of the batch that last used the output buffer, check that
//! output, and queue batch b's D2H.
//! So every stream has its next batch queued before its current one ends, and the host's
//! check runs while the GPU copies and computes. With `chain_copies`, each copy also
//! waits (on the GPU, through an event) for the previous batch's copy in the same
//! direction: one copy per direction at a time, at full speed, lanes staggered so that
//! H2D and D2H overlap. [`simulate`] runs an issue order against a model of the GPU; the
//! tests use it to show that the order never writes a buffer a queued copy may still use.
//!
//! Timing: six timed events per batch (H2D, kernel and D2H start and end) give the
//! intervals; the GPU busy share is the *union* of kernel intervals over the GPU's wall
//! time (a sum would pass 100% when kernels overlap); the exposed transfer share is the
//! time some copy runs and no kernel does. The same intervals, with the host's fill timed
//! on its clock, draw each run's lanes ([`Results::timelines`], `timeline.rs`).

// Shared by several examples and tests (`#[path]` includes): each uses part of it.
#![allow(dead_code)]

use std::ffi::c_void;
use std::time::Instant;

use allocator_api2::vec::Vec as PVec;
use cudalloc::arena::Arena;
use cudalloc::cuda::{Event, Kernel, Module, Stream};
use cudalloc::device::{DeviceBuffer, DevicePool};
use cudalloc::source::PinnedSource;
use cudalloc::staging::StagingRing;
use cudalloc::testing::{DeviceMemory, RawPinnedBuffer};
use cudalloc::{Error, PinnedAlloc, Result};

use crate::report::{fmt_size, Table, Unit, Value};

/// The timeline SVG of the pipeline's runs (`--timeline FILE`), next to this file.
#[path = "timeline.rs"]
pub mod timeline;

/// How long the ring rows wait at most for a staging buffer (the pipeline's default).
const RING_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The kernel, as PTX generated by `kernels/build-ptx.sh` from `kernels/pipeline.cu`.
pub const PTX: &str = include_str!("../../kernels/pipeline.ptx");
/// Its name in the PTX (`extern "C"`, so unmangled).
pub const KERNEL: &str = "pipeline_hash";

/// What the kernel computes for one element: `rounds` rounds of a multiply-add and
/// xor-shift mix. Must match `kernels/pipeline.cu` bit for bit.
pub fn hash_rounds(mut x: u32, rounds: u32) -> u32 {
    for _ in 0..rounds {
        x = x.wrapping_mul(0x9E37_79B1).wrapping_add(0x7F4A_7C15);
        x ^= x >> 15;
    }
    x
}

/// Element `i` of batch `batch`'s input: differs between batches at every position, so a
/// stale buffer (last batch's data, or a copy that has not landed) cannot pass the check.
pub fn input_value(batch: usize, i: usize) -> u32 {
    (i as u32).wrapping_mul(0x9E37_79B9)
        ^ (batch as u32).wrapping_mul(0x85EB_CA6B).rotate_left(7)
        ^ 0x2545_F491
}

/// How much work the kernel does per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    /// One round: the kernel takes a small fraction of a copy's time.
    TransferBound,
    /// As many rounds as make a kernel take as long as one batch's copy takes in a
    /// pipeline, where H2D and D2H run at once and share the link (on the H200: 1.33 ms
    /// at 101 GB/s both ways, against 1.22 ms for one direction alone). The stages are
    /// then equal where it counts, as in the C++ reference (1.3 ms).
    Balanced,
    /// Four times a copy's time (one direction alone).
    ComputeBound,
    /// A fixed number of rounds.
    Rounds(u32),
}

impl Regime {
    pub fn name(self) -> String {
        match self {
            Regime::TransferBound => "transfer-bound".into(),
            Regime::Balanced => "balanced".into(),
            Regime::ComputeBound => "compute-bound".into(),
            Regime::Rounds(r) => format!("{r} rounds"),
        }
    }

    /// `transfer`, `balanced`, `compute`, or a number of rounds.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "transfer" | "transfer-bound" => Some(Regime::TransferBound),
            "balanced" => Some(Regime::Balanced),
            "compute" | "compute-bound" => Some(Regime::ComputeBound),
            n => n.parse().ok().filter(|&r| r > 0).map(Regime::Rounds),
        }
    }
}

/// One way of staging the batches (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Pageable,
    Pinned(usize),
    DoubleBuffered,
    Raw(usize),
    Arena(usize),
    FreshVec(usize),
    Ring(usize),
    /// `cudalloc::staging::Pipeline` (the library's helper) on S streams.
    Pipeline(usize),
    /// The same with its fill on worker threads (`Pipeline::fill_threads`): the library's
    /// staging row where the host fill bounds the pipeline.
    Threaded(usize),
    /// `Pageable`, `Pinned(S)` and `Ring(S)` as written by hand, without the library's
    /// staging types: the reference they are measured against in the same run.
    HandPageable,
    HandPinned(usize),
    HandRing(usize),
}

impl Variant {
    pub fn label(self) -> String {
        let streams = |s: usize| {
            if s == 1 {
                "1 stream".to_string()
            } else {
                format!("{s} streams")
            }
        };
        match self {
            Variant::Pageable => "pageable Vec, 1 stream".into(),
            Variant::Pinned(s) => format!("PinnedAlloc, {}", streams(s)),
            Variant::DoubleBuffered => "PinnedAlloc, double buffering".into(),
            Variant::Raw(s) => format!("raw cuMemHostAlloc + cuMemAlloc, {}", streams(s)),
            Variant::Arena(s) => format!("Arena<PinnedSource> per stream, {}", streams(s)),
            Variant::FreshVec(s) => format!("fresh Vec<PinnedAlloc> per batch, {}", streams(s)),
            Variant::Ring(s) => format!("ring of {} Vec<PinnedAlloc>, {}", s + 1, streams(s)),
            Variant::Pipeline(s) => format!("staging::Pipeline, {}", streams(s)),
            Variant::Threaded(s) => format!("staging::Pipeline, fill on worker threads, {}", streams(s)),
            Variant::HandPageable => "pageable Vec, 1 stream, hand-written".into(),
            Variant::HandPinned(s) => format!("PinnedAlloc, {}, hand-written", streams(s)),
            Variant::HandRing(s) => {
                format!("ring of {} Vec<PinnedAlloc>, {}, hand-written", s + 1, streams(s))
            }
        }
    }

    /// A short name for charts and `--variants`: `pinned-4`, `raw-4`, `fresh-4`, ...
    pub fn key(self) -> String {
        match self {
            Variant::Pageable => "pageable".into(),
            Variant::Pinned(s) => format!("pinned-{s}"),
            Variant::DoubleBuffered => "double".into(),
            Variant::Raw(s) => format!("raw-{s}"),
            Variant::Arena(s) => format!("arena-{s}"),
            Variant::FreshVec(s) => format!("fresh-{s}"),
            Variant::Ring(s) => format!("ring-{s}"),
            Variant::Pipeline(s) => format!("pipeline-{s}"),
            Variant::Threaded(s) => format!("threaded-{s}"),
            Variant::HandPageable => "hand-pageable".into(),
            Variant::HandPinned(s) => format!("hand-pinned-{s}"),
            Variant::HandRing(s) => format!("hand-ring-{s}"),
        }
    }

    /// Streams the variant uses.
    pub fn streams(self) -> usize {
        match self {
            Variant::Pageable | Variant::HandPageable => 1,
            Variant::DoubleBuffered => 3,
            Variant::Pinned(s)
            | Variant::Raw(s)
            | Variant::Arena(s)
            | Variant::FreshVec(s)
            | Variant::Ring(s)
            | Variant::Pipeline(s)
            | Variant::Threaded(s)
            | Variant::HandPinned(s)
            | Variant::HandRing(s) => s,
        }
    }

    /// Whether each batch gets a new staging buffer (and so the host writes all of it).
    fn staged(self) -> bool {
        matches!(
            self,
            Variant::Arena(_)
                | Variant::FreshVec(_)
                | Variant::Ring(_)
                | Variant::Pipeline(_)
                | Variant::Threaded(_)
                | Variant::HandRing(_)
        )
    }

    /// The hand-written row a row on the library's types replaced, for the `vs hand`
    /// column.
    pub fn hand_written(self) -> Option<Variant> {
        match self {
            Variant::Pageable => Some(Variant::HandPageable),
            Variant::Pinned(s) => Some(Variant::HandPinned(s)),
            Variant::Ring(s) => Some(Variant::HandRing(s)),
            _ => None,
        }
    }

    /// The raw reference with as many streams, for the `vs raw` column.
    fn reference(self) -> Option<Variant> {
        match self {
            Variant::Pinned(s)
            | Variant::Arena(s)
            | Variant::FreshVec(s)
            | Variant::Ring(s)
            | Variant::Pipeline(s)
            | Variant::Threaded(s)
            | Variant::HandPinned(s)
            | Variant::HandRing(s) => Some(Variant::Raw(s)),
            _ => None,
        }
    }

    /// Every variant: `streams` for the pinned and raw rows, `staging` streams for the
    /// arena, fresh-Vec, ring and threaded rows. `names` filters by kind (`pageable`,
    /// `pinned`, `double`, `raw`, `arena`, `fresh`, `ring`, `threaded`); `pipeline` (the library's
    /// `staging::Pipeline`, `staging` streams) runs only when named, and so do `hand`'s
    /// rows (`hand-pageable`, `hand-pinned-S` for `streams`, `hand-ring-S` for `staging`).
    pub fn all(streams: &[usize], staging: usize, names: Option<&[String]>) -> Vec<Variant> {
        let wants = |k: &str| names.is_none_or(|n| n.iter().any(|x| x == k));
        let mut v = Vec::new();
        if wants("pageable") {
            v.push(Variant::Pageable);
        }
        if wants("pinned") {
            v.extend(streams.iter().map(|&s| Variant::Pinned(s)));
        }
        if wants("double") {
            v.push(Variant::DoubleBuffered);
        }
        if wants("raw") {
            v.extend(streams.iter().map(|&s| Variant::Raw(s)));
        }
        if wants("arena") {
            v.push(Variant::Arena(staging));
        }
        if wants("fresh") {
            v.push(Variant::FreshVec(staging));
        }
        if wants("ring") {
            v.push(Variant::Ring(staging));
        }
        if wants("threaded") {
            v.push(Variant::Threaded(staging));
        }
        let named = |k: &str| names.is_some_and(|n| n.iter().any(|x| x == k));
        if named("pipeline") {
            v.push(Variant::Pipeline(staging));
        }
        if named("hand") {
            v.push(Variant::HandPageable);
            v.extend(streams.iter().map(|&s| Variant::HandPinned(s)));
            v.push(Variant::HandRing(staging));
        }
        v
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    pub batches: usize,
    pub batch_bytes: usize,
    pub regimes: Vec<Regime>,
    pub variants: Vec<Variant>,
    /// Positions checked per batch (besides the first and last element).
    pub samples: usize,
    /// Write and check every element of every batch (slow; for tests).
    pub verify_all: bool,
    /// Run each variant once on a few batches before timing it (first-use costs: pinning,
    /// JIT, pool growth).
    pub warmup: bool,
    /// While the fresh-Vec rows run, cap the pinned pools at what they hold plus this
    /// many bytes (`None`: leave the cap alone): shows what a staging loop does when the
    /// pool reaches its cap while blocks wait for their copies.
    pub fresh_headroom: Option<usize>,
    /// Threads that write a whole batch on the host (the staging rows, and every row with
    /// `verify_all`): filling is part of what a staging pipeline does, and one thread
    /// writes 64 MiB several times slower than a copy moves it.
    pub fill_threads: usize,
    /// Worker threads of the `threaded-S` row's fill (`Pipeline::fill_threads`); each
    /// writes its batch with `fill_threads / fill_workers` threads (at least one), so the
    /// row fills with as many threads in all as the ideal's fill was timed with.
    pub fill_workers: usize,
    /// Make each copy wait, through an event, for the previous batch's copy in the same
    /// direction: one H2D and one D2H at a time, each at full speed, lanes staggered.
    /// Off: a lane's copies are ordered by its own stream only, as in the C++ reference.
    pub chain_copies: bool,
    /// Staging buffers per stream of the pageable and pinned rows' `StagingRing` (1: an
    /// in/out pair per stream, as the hand-written rows and the C++ reference have). The
    /// pipeline refills a buffer once its last batch is drained, so with one a stream's
    /// next H2D waits for its last D2H and check on the host; 2 keeps each stream's next
    /// batch queued.
    pub ring_buffers: usize,
    /// Times each row is run, the rows of a regime in turn (1, 2, .., 1, 2, ..), keeping
    /// the run of median wall time: rows then compare over the same stretch of time, not
    /// one after another (whole processes move by a fifth). Every run's output is checked.
    pub repeat: usize,
}

/// Fill threads by default: half the cores, at most 8. One thread took 8.7 ms to write
/// 64 MiB on the H200 machine, seven times as long as a copy of it.
pub fn default_fill_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get() / 2)
        .clamp(1, 8)
}

impl Config {
    /// The full benchmark: 64 batches of 64 MiB, every variant, three regimes.
    pub fn full() -> Self {
        Self {
            batches: 64,
            batch_bytes: 64 << 20,
            regimes: vec![Regime::TransferBound, Regime::Balanced, Regime::ComputeBound],
            variants: Variant::all(&[1, 2, 4, 8], 4, None),
            samples: 256,
            verify_all: false,
            warmup: true,
            fresh_headroom: None,
            fill_threads: default_fill_threads(),
            fill_workers: 2,
            chain_copies: true,
            ring_buffers: 1,
            repeat: 1,
        }
    }

    /// The A/B report's summary: the balanced regime, one row of each kind.
    pub fn summary(batches: usize) -> Self {
        Self {
            batches,
            regimes: vec![Regime::Balanced],
            variants: vec![
                Variant::Pageable,
                Variant::Pinned(1),
                Variant::Pinned(4),
                Variant::DoubleBuffered,
                Variant::Raw(4),
                Variant::Arena(4),
                Variant::FreshVec(4),
                Variant::Ring(4),
            ],
            ..Self::full()
        }
    }
}

/// Per-batch costs of each stage measured alone, in the same run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Baseline {
    pub h2d_ms: f64,
    pub d2h_ms: f64,
    /// GB/s moved by H2D and D2H copies running at the same time (both directions).
    pub bidir_gbps: f64,
    /// Writing one whole batch on the host, with `fill_threads` threads (the same buffer
    /// each time, after an untimed fill: the median of 5).
    pub fill_ms: f64,
    /// The same into four batch buffers in turn (two rounds, the median of 8), as a
    /// pipeline writes its ring's buffers: above `fill_ms` where a batch buffer written
    /// again at once is still partly in the CPU's cache, which a pipeline's fill is not.
    pub fill_rotating_ms: f64,
    /// The fill into four buffers in turn while copies run both ways on two others (the
    /// median of 8), as a staging pipeline's fill runs beside its copies: the copy
    /// engines read and write host memory too, so above `fill_rotating_ms` by what the
    /// memory bus gives them. `None` where the copies did not last as long as the fills.
    pub fill_under_copies_ms: Option<f64>,
    pub fill_threads: usize,
}

impl Baseline {
    /// One batch's copies both ways when both directions run at once (they share the
    /// link: 2 x batch / the concurrent rate), in ms.
    fn both_ways_ms(&self, batch_bytes: usize) -> f64 {
        if self.bidir_gbps > 0.0 {
            2.0 * batch_bytes as f64 / (self.bidir_gbps * 1e9) * 1e3
        } else {
            0.0
        }
    }

    /// A staging pipeline's fill of one batch with its copies beside it, as the fills into
    /// buffers in turn measured alone and under copies predict it: a fill-bound pipeline
    /// runs each batch's copies (both ways at once: [`Baseline::both_ways_ms`]) while the
    /// next batch is filled, so the fill runs at its loaded rate for that long and at its
    /// own rate for the rest, `copies + (1 - copies / under) * alone` (and `under` where
    /// the copies outlast the fill). `None` without the loaded measurement.
    pub fn fill_in_pipeline_ms(&self, batch_bytes: usize) -> Option<f64> {
        let under = self.fill_under_copies_ms.filter(|&f| f > 0.0)?;
        let copies = self.both_ways_ms(batch_bytes);
        Some(if copies >= under {
            under
        } else {
            copies + (1.0 - copies / under) * self.fill_rotating_ms
        })
    }
}

/// A row of the hand-written CUDA C++ pipeline that issue 11 quotes: the same H200
/// machine, 64 batches of 64 MiB, one pinned in/out buffer pair and one device pair per
/// stream. Its kernel is not ours: about 0.05, 1.3 and 5.1 ms per batch in the three
/// regimes, against ours calibrated in the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CppRow {
    pub regime: Regime,
    /// Pageable host memory (else pinned).
    pub pageable: bool,
    /// The stream counts the row stands for (`2..=usize::MAX`: "2+ streams").
    pub min_streams: usize,
    pub max_streams: usize,
    pub kernel_ms: f64,
    pub wall_ms: f64,
    /// Against the reference's own ideal (its own stages measured alone).
    pub vs_ideal: f64,
    pub gpu_busy_pct: Option<f64>,
}

const fn cpp(
    regime: Regime,
    pageable: bool,
    streams: (usize, usize),
    kernel_ms: f64,
    wall_ms: f64,
    vs_ideal: f64,
    gpu_busy_pct: Option<f64>,
) -> CppRow {
    CppRow {
        regime,
        pageable,
        min_streams: streams.0,
        max_streams: streams.1,
        kernel_ms,
        wall_ms,
        vs_ideal,
        gpu_busy_pct,
    }
}

/// The C++ reference as issue 11 quotes it.
pub const CPP_REFERENCE: [CppRow; 9] = {
    use Regime::{Balanced as B, ComputeBound as C, TransferBound as T};
    [
        cpp(T, true, (1, 1), 0.05, 1076.0, 13.6, None),
        cpp(T, false, (1, 1), 0.05, 160.0, 2.0, None),
        cpp(T, false, (2, 2), 0.05, 88.0, 1.10, None),
        cpp(T, false, (4, 4), 0.05, 87.0, 1.10, None),
        cpp(T, false, (8, 8), 0.05, 88.0, 1.10, None),
        cpp(B, false, (1, 1), 1.3, 240.0, 2.9, Some(35.0)),
        cpp(B, false, (4, 4), 1.3, 89.0, 1.06, Some(95.0)),
        cpp(C, false, (1, 1), 5.1, 485.0, 1.5, Some(68.0)),
        cpp(C, false, (2, usize::MAX), 5.1, 309.0, 0.94, None),
    ]
};

impl CppRow {
    /// `pageable, 1 stream`, `pinned, 2+ streams`, ...
    pub fn label(&self) -> String {
        let memory = if self.pageable { "pageable" } else { "pinned" };
        match (self.min_streams, self.max_streams) {
            (1, 1) => format!("{memory}, 1 stream"),
            (a, b) if a == b => format!("{memory}, {a} streams"),
            (a, _) => format!("{memory}, {a}+ streams"),
        }
    }
}

impl Variant {
    /// The C++ reference row for this variant in `regime`, where the issue quotes one:
    /// matched by memory (pageable or pinned) and stream count. Staging rows match too
    /// (they are pipelines with as many streams), though they also write every input.
    pub fn cpp_reference(self, regime: Regime) -> Option<&'static CppRow> {
        let (pageable, streams) = match self {
            Variant::Pageable | Variant::HandPageable => (true, 1),
            v => (false, v.streams()),
        };
        CPP_REFERENCE.iter().find(|r| {
            r.regime == regime && r.pageable == pageable && (r.min_streams..=r.max_streams).contains(&streams)
        })
    }
}

/// One variant's measurements in one regime.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub wall_ms: f64,
    pub ideal_ms: f64,
    /// A staging row's ideal with the fill as its copies slow it
    /// ([`Baseline::fill_in_pipeline_ms`]) in place of the fill alone: what a pipeline
    /// that overlaps its fill with its copies can reach on this machine's memory bus.
    pub contended_ideal_ms: Option<f64>,
    pub bound: &'static str,
    pub gpu_busy: f64,
    pub exposed_transfer: f64,
    pub copy_gbps: f64,
    /// Share of the wall time the issuing thread spent blocked on the GPU (event
    /// waits, an arena's reset): near 1 when the GPU is the bottleneck, near 0 when the
    /// host is.
    pub issuer_blocked: f64,
    /// Pinned allocations the process-wide pools had to take from the driver during the
    /// timed run (0: every staging buffer came from the cache).
    pub pinned_source_allocs: u64,
    pub batches_checked: usize,
    pub elements_checked: usize,
    pub mismatches: usize,
    pub first_mismatch: Option<String>,
    /// The staging rows' host fill of one batch inside the run (the mean of its fills'
    /// spans), against the fill alone ([`Baseline::fill_ms`]): above it, the fill is slowed
    /// by what runs beside it (copies, the other fills); the rest of the wall per batch is
    /// the issue's serial part.
    pub fill_in_run_ms: Option<f64>,
    /// The timed run's streams and host fill over time, from the events it recorded.
    pub timeline: timeline::Timeline,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub variant: Variant,
    pub outcome: std::result::Result<Measured, String>,
}

#[derive(Clone, Debug)]
pub struct RegimeResult {
    pub regime: Regime,
    pub rounds: u32,
    pub kernel_ms: f64,
    pub rows: Vec<Row>,
}

impl RegimeResult {
    fn measured(&self, v: Variant) -> Option<&Measured> {
        self.rows
            .iter()
            .find(|r| r.variant == v)
            .and_then(|r| r.outcome.as_ref().ok())
    }
}

#[derive(Clone, Debug)]
pub struct Results {
    pub config: Config,
    pub baseline: Baseline,
    pub regimes: Vec<RegimeResult>,
}

impl Results {
    /// Mismatched elements over all variants (must be 0).
    pub fn mismatches(&self) -> usize {
        self.rows()
            .filter_map(|(_, r)| r.outcome.as_ref().ok())
            .map(|m| m.mismatches)
            .sum()
    }

    /// Variants that could not run.
    pub fn failures(&self) -> usize {
        self.rows().filter(|(_, r)| r.outcome.is_err()).count()
    }

    /// One timeline per measured row (regime by regime, in the table's order), captioned
    /// with the row's regime, variant and wall time: `--timeline FILE` draws them.
    pub fn timelines(&self) -> Vec<timeline::Timeline> {
        self.rows()
            .filter_map(|(g, r)| {
                let m = r.outcome.as_ref().ok()?;
                Some(timeline::Timeline {
                    title: format!(
                        "{}: {} (wall {:.1} ms, ideal {:.1} ms, GPU busy {:.0}%)",
                        g.regime.name(),
                        r.variant.label(),
                        m.wall_ms,
                        m.ideal_ms,
                        100.0 * m.gpu_busy
                    ),
                    ..m.timeline.clone()
                })
            })
            .collect()
    }

    fn rows(&self) -> impl Iterator<Item = (&RegimeResult, &Row)> {
        self.regimes
            .iter()
            .flat_map(|g| g.rows.iter().map(move |r| (g, r)))
    }

    /// The results as report tables: the stages alone, the regimes, the variants, and
    /// the variants next to the C++ reference.
    pub fn tables(&self) -> Vec<Table> {
        let c = &self.config;
        let b = &self.baseline;
        let gbps = |ms: f64| c.batch_bytes as f64 / (ms * 1e-3) / 1e9;
        let mut base = Table::new(
            "pipeline_stages",
            "pipeline",
            &format!("Pipeline stages alone, per batch of {}", fmt_size(c.batch_bytes)),
        )
        .col("batch_bytes", "batch", Unit::Bytes)
        .col("h2d_ms", "H2D", Unit::Millis)
        .col("h2d_gbps", "H2D", Unit::GBps)
        .col("d2h_ms", "D2H", Unit::Millis)
        .col("d2h_gbps", "D2H", Unit::GBps)
        .col("bidir_gbps", "H2D + D2H at once", Unit::GBps)
        .col("fill_ms", "host fill", Unit::Millis)
        .col("fill_rotating_ms", "host fill, 4 buffers in turn", Unit::Millis)
        .col(
            "fill_under_copies_ms",
            "host fill, 4 buffers in turn, under copies",
            Unit::Millis,
        )
        .col("fill_threads", "fill threads", Unit::Count);
        base.push(vec![
            c.batch_bytes.into(),
            b.h2d_ms.into(),
            gbps(b.h2d_ms).into(),
            b.d2h_ms.into(),
            gbps(b.d2h_ms).into(),
            b.bidir_gbps.into(),
            b.fill_ms.into(),
            b.fill_rotating_ms.into(),
            b.fill_under_copies_ms.into(),
            b.fill_threads.into(),
        ]);
        base.note(
            "Pinned (PinnedAlloc) buffers; each stage timed alone with events, in the same run; \
             host fill: writing a whole batch with that many threads, as the staging rows do (the \
             ideal's; the same buffer each time), into four batch buffers in turn, as a \
             pipeline writes its ring's buffers, and the same while copies run both ways on two \
             other buffers, as a staging pipeline's fill runs beside its copies (empty: the \
             copies ended first).",
        );

        let both_ways = b.both_ways_ms(c.batch_bytes);
        let mut regimes = Table::new(
            "pipeline_regimes",
            "pipeline",
            "Pipeline regimes: kernel work per batch",
        )
        .col("regime", "regime", Unit::Label)
        .col("rounds", "rounds per element", Unit::Count)
        .col("kernel_ms", "kernel per batch", Unit::Millis)
        .col("ideal_ms", "ideal (fixed buffers)", Unit::Millis)
        .col("ideal_staged_ms", "ideal (staging)", Unit::Millis)
        .col("fill_in_pipeline_ms", "fill beside its copies", Unit::Millis)
        .col("contended_ideal_ms", "contended ideal (staging)", Unit::Millis)
        .col("floor_ms", "floor (copies share the link)", Unit::Millis);
        let fill_beside = b.fill_in_pipeline_ms(c.batch_bytes);
        for g in &self.regimes {
            let n = c.batches as f64;
            let stage = b.h2d_ms.max(b.d2h_ms).max(g.kernel_ms);
            regimes.push(vec![
                g.regime.name().into(),
                (g.rounds as usize).into(),
                g.kernel_ms.into(),
                (n * stage).into(),
                (n * stage.max(b.fill_ms)).into(),
                fill_beside.into(),
                fill_beside.map(|f| n * stage.max(f)).into(),
                (n * stage.max(both_ways)).into(),
            ]);
        }
        regimes.note(
            "ideal = batches x max(H2D, D2H, kernel), each measured alone (staging variants also \
             max with the host fill, which they do per batch); fill beside its copies = both \
             copies at once + (1 - that / fill under copies) x fill into 4 buffers alone: a fill-bound pipeline \
             fills each batch while the last one's copies run, and the copy engines share the \
             host's memory with the fill; contended ideal = batches x max(H2D, D2H, kernel, that \
             fill); floor = batches x max(kernel, both copies at the rate the two directions \
             reach together), what a pipeline whose H2D and D2H overlap can reach before its \
             first and last batch.",
        );

        let mut t = Table::new(
            "pipeline",
            "pipeline",
            &format!(
                "Pipeline: {} batches of {} H2D -> kernel -> D2H",
                c.batches,
                fmt_size(c.batch_bytes)
            ),
        )
        .col("regime", "regime", Unit::Label)
        .col("variant", "variant", Unit::Label)
        .col("key", "key", Unit::Label)
        .col("streams", "streams", Unit::Count)
        .col("wall_ms", "wall", Unit::Millis)
        .col("ideal_ms", "ideal", Unit::Millis)
        .col("vs_ideal", "vs ideal", Unit::Ratio)
        .col("vs_contended_ideal", "vs contended ideal", Unit::Ratio)
        .col("bound", "ideal bound by", Unit::Label)
        .col("vs_raw", "vs raw", Unit::Ratio)
        .col("vs_hand", "vs hand-written", Unit::Ratio)
        .col("cpp_wall_ms", "C++ ref", Unit::Millis)
        .col("vs_cpp", "vs C++", Unit::Ratio)
        .col("gpu_busy_pct", "GPU busy", Unit::Percent)
        .col("exposed_transfer_pct", "transfer only", Unit::Percent)
        .col("copy_gbps", "H2D+D2H", Unit::GBps)
        .col("issuer_blocked_pct", "issuer blocked", Unit::Percent)
        .col("fill_in_run_ms", "fill in run", Unit::Millis)
        .col("pinned_source_allocs", "new pinned blocks", Unit::Count)
        .col("batches_checked", "batches checked", Unit::Count)
        .col("elements_checked", "elements checked", Unit::Count)
        .col("mismatches", "wrong", Unit::Count)
        .col("error", "error", Unit::Label)
        .chart("key", "regime", "vs_ideal", true)
        .skip_in_markdown(&["key", "streams", "batches_checked"]);
        for g in &self.regimes {
            for r in &g.rows {
                let mut row: Vec<Value> = vec![
                    g.regime.name().into(),
                    r.variant.label().into(),
                    r.variant.key().into(),
                    r.variant.streams().into(),
                ];
                match &r.outcome {
                    Ok(m) => {
                        let vs_raw = r
                            .variant
                            .reference()
                            .and_then(|v| g.measured(v))
                            .map(|raw| m.wall_ms / raw.wall_ms);
                        let vs_hand = r
                            .variant
                            .hand_written()
                            .and_then(|v| g.measured(v))
                            .map(|hand| m.wall_ms / hand.wall_ms);
                        let cpp = r.variant.cpp_reference(g.regime).map(|x| x.wall_ms);
                        row.extend([
                            m.wall_ms.into(),
                            m.ideal_ms.into(),
                            (m.wall_ms / m.ideal_ms).into(),
                            m.contended_ideal_ms.map(|i| m.wall_ms / i).into(),
                            m.bound.into(),
                            vs_raw.into(),
                            vs_hand.into(),
                            cpp.into(),
                            cpp.map(|w| m.wall_ms / w).into(),
                            (100.0 * m.gpu_busy).into(),
                            (100.0 * m.exposed_transfer).into(),
                            m.copy_gbps.into(),
                            (100.0 * m.issuer_blocked).into(),
                            m.fill_in_run_ms.into(),
                            (m.pinned_source_allocs as usize).into(),
                            m.batches_checked.into(),
                            m.elements_checked.into(),
                            m.mismatches.into(),
                            m.first_mismatch.clone().unwrap_or_default().into(),
                        ]);
                    }
                    Err(e) => {
                        row.extend(std::iter::repeat_n(Value::Missing, 18));
                        row.push(e.clone().into());
                    }
                }
                t.push(row);
            }
        }
        t.note(format!(
            "GPU busy: union of kernel intervals over the GPU's wall time; transfer only: time a copy \
             runs and no kernel does; H2D+D2H: bytes both ways over the union of copy intervals; vs \
             raw: wall time against the raw reference with as many streams; vs hand-written: against \
             the same row written by hand before the library's staging types (`--variants hand`); C++ ref: the hand-written \
             CUDA C++ pipeline with as many streams that issue 11 quotes (its own kernel; staging \
             rows also write every input); issuer blocked: share of the wall the issuing thread \
             waited for the GPU; fill in run: a staging row's fill of one batch inside the run \
             (the fill alone: the stages table); vs contended ideal: a staging row's wall \
             against its ideal with the fill slowed by its copies (the regimes table). Copies chained per direction: {}. The pageable and pinned rows: \
             staging::Pipeline over a StagingRing of {} buffer(s) per stream.",
            if c.chain_copies { "yes" } else { "no" },
            c.ring_buffers
        ));
        vec![base, regimes, t, self.cpp_table()]
    }

    /// Our PinnedAlloc, pageable and raw rows next to each row of the C++ reference.
    fn cpp_table(&self) -> Table {
        let mut t = Table::new(
            "pipeline_cpp",
            "pipeline",
            "Pipeline against the CUDA C++ reference (issue 11, same machine)",
        )
        .col("regime", "regime", Unit::Label)
        .col("variant", "variant", Unit::Label)
        .col("cpp_kernel_ms", "C++ kernel", Unit::Millis)
        .col("kernel_ms", "our kernel", Unit::Millis)
        .col("cpp_wall_ms", "C++ wall", Unit::Millis)
        .col("cpp_vs_ideal", "C++ vs ideal", Unit::Ratio)
        .col("cpp_gpu_busy_pct", "C++ GPU busy", Unit::Percent)
        .col("wall_ms", "our wall", Unit::Millis)
        .col("vs_ideal", "vs ideal", Unit::Ratio)
        .col("gpu_busy_pct", "GPU busy", Unit::Percent)
        .col("vs_cpp", "vs C++", Unit::Ratio)
        .col("raw_wall_ms", "raw wall", Unit::Millis)
        .col("raw_vs_cpp", "raw vs C++", Unit::Ratio);
        for g in &self.regimes {
            for cpp in CPP_REFERENCE.iter().filter(|r| r.regime == g.regime) {
                let ours: Vec<(Variant, Option<Variant>)> = if cpp.pageable {
                    vec![(Variant::Pageable, None)]
                } else {
                    let mut s: Vec<usize> = g
                        .rows
                        .iter()
                        .filter_map(|r| match r.variant {
                            Variant::Pinned(s) | Variant::Raw(s) => Some(s),
                            _ => None,
                        })
                        .filter(|s| (cpp.min_streams..=cpp.max_streams).contains(s))
                        .collect();
                    s.sort_unstable();
                    s.dedup();
                    s.into_iter()
                        .map(|s| (Variant::Pinned(s), Some(Variant::Raw(s))))
                        .collect()
                };
                for (v, raw) in ours {
                    let m = g.measured(v);
                    let raw = raw.and_then(|r| g.measured(r));
                    if m.is_none() && raw.is_none() {
                        continue;
                    }
                    let label = match v {
                        Variant::Pageable => cpp.label(),
                        v => format!(
                            "pinned, {} stream{}",
                            v.streams(),
                            if v.streams() == 1 { "" } else { "s" }
                        ),
                    };
                    t.push(vec![
                        g.regime.name().into(),
                        label.into(),
                        cpp.kernel_ms.into(),
                        g.kernel_ms.into(),
                        cpp.wall_ms.into(),
                        cpp.vs_ideal.into(),
                        cpp.gpu_busy_pct.into(),
                        m.map(|m| m.wall_ms).into(),
                        m.map(|m| m.wall_ms / m.ideal_ms).into(),
                        m.map(|m| 100.0 * m.gpu_busy).into(),
                        m.map(|m| m.wall_ms / cpp.wall_ms).into(),
                        raw.map(|r| r.wall_ms).into(),
                        raw.map(|r| r.wall_ms / cpp.wall_ms).into(),
                    ]);
                }
            }
        }
        t.note(
            "C++ columns as issue 11 quotes them (one pinned in/out pair and one device pair per \
             stream; its compute-bound row is for 2+ streams). The kernels differ: compare the \
             kernel columns before the walls. our wall: PinnedAlloc buffers (a pageable Vec on the \
             pageable row); raw: cuMemHostAlloc + cuMemAlloc buffers in this process, same loop and kernel.",
        );
        t
    }
}

// ----- memory ---------------------------------------------------------------------------

/// Host memory of one buffer.
enum HostBuf {
    Pageable(Vec<u32>),
    Pinned(PVec<u32, PinnedAlloc>),
    Raw(RawPinnedBuffer<u32>),
}

impl HostBuf {
    fn pinned(n: usize) -> Result<Self> {
        let mut v = PVec::new_in(PinnedAlloc);
        v.try_reserve_exact(n)
            .map_err(|_| Error::OutOfMemory { requested: n * 4 })?;
        v.resize(n, 0);
        Ok(HostBuf::Pinned(v))
    }
}

impl std::ops::Deref for HostBuf {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        match self {
            HostBuf::Pageable(v) => v,
            HostBuf::Pinned(v) => v,
            HostBuf::Raw(v) => v,
        }
    }
}

impl std::ops::DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [u32] {
        match self {
            HostBuf::Pageable(v) => v,
            HostBuf::Pinned(v) => v,
            HostBuf::Raw(v) => v,
        }
    }
}

/// Device memory of one buffer: the crate's pool, or raw `cuMemAlloc`.
enum DevBuf {
    Pool(DeviceBuffer<u32>),
    Raw(DeviceMemory),
}

fn as_bytes(s: &[u32]) -> &[u8] {
    // SAFETY: any initialized u32 is 4 initialized bytes; the view has the same lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn as_bytes_mut(s: &mut [u32]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid u32.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

impl DevBuf {
    fn pool(n: usize, stream: &Stream) -> Result<Self> {
        Ok(DevBuf::Pool(
            DevicePool::get(stream.device())?.alloc::<u32>(n, stream)?,
        ))
    }

    fn ptr(&self) -> u64 {
        match self {
            DevBuf::Pool(b) => b.device_ptr(),
            DevBuf::Raw(m) => m.device_ptr(),
        }
    }

    /// Queues a copy of `src` into the buffer on `stream` (a pool buffer's own stream).
    ///
    /// # Safety
    /// 1. `src` is not written, and (unless it is pooled memory) stays allocated, until
    ///    the copy has completed on `stream`.
    unsafe fn upload(&mut self, src: &[u32], stream: &Stream) -> Result<()> {
        match self {
            DevBuf::Pool(b) => {
                debug_assert!(b.stream() == stream, "a pool buffer copies on its own stream");
                // SAFETY: obligation 1 of this function.
                unsafe { b.copy_from_host_async(src) }
            }
            // SAFETY: obligation 1 of this function; the range is the whole buffer.
            DevBuf::Raw(m) => unsafe { m.copy_from_host_async(0, as_bytes(src), stream) },
        }
    }

    /// Queues a copy of the buffer into `dst` on `stream` (a pool buffer's own stream).
    ///
    /// # Safety
    /// 1. `dst` is neither read nor written, and stays allocated, until the copy has
    ///    completed on `stream`.
    unsafe fn download(&self, dst: &mut [u32], stream: &Stream) -> Result<()> {
        match self {
            DevBuf::Pool(b) => {
                debug_assert!(b.stream() == stream, "a pool buffer copies on its own stream");
                // SAFETY: obligation 1 of this function.
                unsafe { b.copy_to_host_async(dst) }
            }
            // SAFETY: obligation 1 of this function; the range is the whole buffer.
            DevBuf::Raw(m) => unsafe { m.copy_to_host_async(0, as_bytes_mut(dst), stream) },
        }
    }
}

/// Queues the kernel: `output[i] = hash_rounds(input[i], rounds)` for `n` elements.
///
/// # Safety
/// 1. `input` and `output` are device buffers of at least `n` u32s, allocated until the
///    kernel completes, and no other work touches them meanwhile (ordered by `stream`
///    or by events).
unsafe fn launch_hash(
    kernel: &Kernel,
    stream: &Stream,
    input: u64,
    output: u64,
    n: usize,
    rounds: u32,
) -> Result<()> {
    let (mut input, mut output, mut n64, mut rounds) = (input, output, n as u64, rounds);
    let block = 256u32;
    // A grid-stride loop covers any n; a million blocks is plenty for any GPU.
    let grid = n.div_ceil(block as usize).clamp(1, 1 << 20) as u32;
    let mut args: [*mut c_void; 4] = [
        (&mut input as *mut u64).cast(),
        (&mut output as *mut u64).cast(),
        (&mut n64 as *mut u64).cast(),
        (&mut rounds as *mut u32).cast(),
    ];
    // SAFETY: the four arguments match `pipeline_hash(const u32*, u32*, u64, u32)` and
    // live across the call; obligation 1 of this function covers the buffers; the caller
    // keeps `kernel` (and so its module) until the stream has run it.
    unsafe { kernel.launch((grid, 1, 1), (block, 1, 1), 0, stream, &mut args) }
}

// ----- the host's side of the data ------------------------------------------------------

/// `hash_rounds` of 16 values at once: 16 independent chains the CPU (or its vector
/// unit) interleaves, several times faster than one chain after another. The check of a
/// compute-bound batch (258 positions x 2390 rounds) takes a few tens of microseconds
/// this way instead of about a millisecond.
fn hash_rounds_16(xs: &mut [u32; 16], rounds: u32) {
    for _ in 0..rounds {
        for x in xs.iter_mut() {
            *x = x.wrapping_mul(0x9E37_79B1).wrapping_add(0x7F4A_7C15);
            *x ^= *x >> 15;
        }
    }
}

/// Runs `f(offset, chunk)` over up to `threads` contiguous chunks of `data`, on scoped
/// threads (the calling thread takes the first chunk). Small data stays on one thread.
fn par_chunks<T: Send>(data: &mut [T], threads: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    // Below this many elements per thread, starting a thread costs more than it saves.
    const MIN_CHUNK: usize = 1 << 16;
    let threads = threads.clamp(1, data.len().div_ceil(MIN_CHUNK).max(1));
    if threads == 1 {
        f(0, data);
        return;
    }
    let chunk = data.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let mut parts = data.chunks_mut(chunk).enumerate();
        let first = parts.next();
        for (i, part) in parts {
            scope.spawn(move || f(i * chunk, part));
        }
        if let Some((_, part)) = first {
            f(0, part);
        }
    });
}

/// Where a batch's input is written and its output checked.
pub(crate) struct Checker {
    pub(crate) n: usize,
    pub(crate) samples: usize,
    pub(crate) all: bool,
}

impl Checker {
    /// The positions of batch `b` that are written (stamp mode) and checked: the first and
    /// last element and `samples` evenly spaced ones at an offset that moves per batch;
    /// every position when checking all (or when the batch is too small to sample).
    pub(crate) fn positions(&self, b: usize) -> Box<dyn Iterator<Item = usize>> {
        let n = self.n;
        let stride = n / self.samples.max(1);
        if self.all || stride < 3 {
            return Box::new(0..n);
        }
        // Offsets in 1..stride-1 keep the sampled positions off 0 and n-1.
        let off = 1 + (hash_rounds(b as u32, 2) as usize % (stride - 2));
        let samples = self.samples;
        Box::new(
            [0, n - 1]
                .into_iter()
                .chain((0..samples).map(move |j| j * stride + off)),
        )
    }

    /// Writes batch `b`'s input at its checked positions only.
    pub(crate) fn stamp(&self, b: usize, input: &mut [u32]) {
        for p in self.positions(b) {
            input[p] = input_value(b, p);
        }
    }

    /// Writes all of batch `b`'s input.
    pub(crate) fn fill(b: usize, input: &mut [u32]) {
        Self::fill_with(b, input, 1);
    }

    /// Writes all of batch `b`'s input with up to `threads` threads.
    pub(crate) fn fill_with(b: usize, input: &mut [u32], threads: usize) {
        par_chunks(input, threads, |offset, part| {
            for (i, x) in part.iter_mut().enumerate() {
                *x = input_value(b, offset + i);
            }
        });
    }

    /// Fills a new staging `Vec` with batch `b`'s `n` elements (one pass, no zeroing, up
    /// to `threads` threads). A failed reservation returns `Err(())`: the caller says why.
    pub(crate) fn fill_new<A: allocator_api2::alloc::Allocator>(
        b: usize,
        n: usize,
        v: &mut PVec<u32, A>,
        threads: usize,
    ) -> std::result::Result<(), ()> {
        v.clear();
        v.try_reserve_exact(n).map_err(|_| ())?;
        par_chunks(&mut v.spare_capacity_mut()[..n], threads, |offset, part| {
            for (i, slot) in part.iter_mut().enumerate() {
                slot.write(input_value(b, offset + i));
            }
        });
        // SAFETY: all `n` elements were written just above (every chunk of the first `n`
        // spare slots, each by one thread, joined before `par_chunks` returned), within
        // the capacity.
        unsafe { v.set_len(n) };
        Ok(())
    }

    /// Checks batch `b`'s output against the host's reference.
    pub(crate) fn check(&self, b: usize, rounds: u32, output: &[u32], tally: &mut Tally) {
        tally.batches_checked += 1;
        let mut positions = self.positions(b);
        loop {
            let (mut at, mut want) = ([0usize; 16], [0u32; 16]);
            let mut k = 0;
            for p in positions.by_ref().take(16) {
                at[k] = p;
                want[k] = input_value(b, p);
                k += 1;
            }
            if k == 0 {
                break;
            }
            hash_rounds_16(&mut want, rounds);
            for (&p, &want) in at[..k].iter().zip(&want[..k]) {
                tally.elements_checked += 1;
                if output[p] != want {
                    tally.mismatches += 1;
                    if tally.first_mismatch.is_none() {
                        tally.first_mismatch = Some(format!(
                            "batch {b} element {p}: got {:#010x}, want {want:#010x}",
                            output[p]
                        ));
                    }
                }
            }
        }
    }
}

#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) batches_checked: usize,
    pub(crate) elements_checked: usize,
    pub(crate) mismatches: usize,
    pub(crate) first_mismatch: Option<String>,
    /// Seconds the issuing thread spent blocked on the GPU.
    pub(crate) blocked_s: f64,
    /// The host's clock at the run's start event ([`Ctx::start`]): host spans are timed
    /// from here.
    pub(crate) origin: Option<Instant>,
    /// Each host fill of a batch's input: (batch, start, end) in ms since `origin`.
    pub(crate) fills: Vec<(usize, f64, f64)>,
    /// The stream (lane) of each batch, in batch order, where the variant does not fix it
    /// (the library's pipeline: the ring's buffer decides).
    pub(crate) stream_of: Vec<usize>,
}

impl Tally {
    /// Runs `wait` (a blocking wait for the GPU) and adds its time to `blocked_s`.
    fn blocked<T>(&mut self, wait: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = wait();
        self.blocked_s += t.elapsed().as_secs_f64();
        out
    }

    /// Runs `fill` (batch `b`'s host fill) and keeps its span for the timeline: two reads
    /// of the host's clock.
    fn filled<T>(&mut self, b: usize, fill: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = fill();
        if let Some(origin) = self.origin {
            let ms = |i: Instant| i.saturating_duration_since(origin).as_secs_f64() * 1e3;
            self.fills.push((b, ms(t), ms(Instant::now())));
        }
        out
    }
}

// ----- timing ---------------------------------------------------------------------------

/// The timed events of one batch: start and end of its H2D copy, kernel and D2H copy.
struct BatchEvents {
    h0: Event,
    h1: Event,
    k0: Event,
    k1: Event,
    d0: Event,
    d1: Event,
}

impl BatchEvents {
    fn new(device: usize) -> Result<Self> {
        Ok(Self {
            h0: Event::timed(device)?,
            h1: Event::timed(device)?,
            k0: Event::timed(device)?,
            k1: Event::timed(device)?,
            d0: Event::timed(device)?,
            d1: Event::timed(device)?,
        })
    }
}

/// Total length of the union of intervals.
pub(crate) fn union_len(mut iv: Vec<(f64, f64)>) -> f64 {
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (s, e) in iv {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    if let Some((cs, ce)) = cur {
        total += ce - cs;
    }
    total
}

/// Each batch's H2D copy, kernel and D2H copy as (start, end) in seconds after `t0`.
pub(crate) type StageIntervals = [(f64, f64); 3];

fn stage_intervals(events: &[BatchEvents], t0: &Event) -> Result<Vec<StageIntervals>> {
    let at = |e: &Event| -> Result<f64> { Ok(e.elapsed_since(t0)?.as_secs_f64()) };
    events
        .iter()
        .map(|e| {
            Ok([
                (at(&e.h0)?, at(&e.h1)?),
                (at(&e.k0)?, at(&e.k1)?),
                (at(&e.d0)?, at(&e.d1)?),
            ])
        })
        .collect()
}

/// Busy shares of a run, from its batches' intervals.
struct Busy {
    gpu_busy: f64,
    exposed_transfer: f64,
    copy_union: f64,
}

fn busy(iv: &[StageIntervals]) -> Busy {
    let (mut copies, mut kernels) = (Vec::new(), Vec::new());
    let mut wall: f64 = 0.0;
    for [h, k, d] in iv {
        copies.push(*h);
        kernels.push(*k);
        copies.push(*d);
        wall = wall.max(d.1);
    }
    let kernel_union = union_len(kernels.clone());
    let copy_union = union_len(copies.clone());
    let mut all = copies;
    all.extend(kernels);
    let all_union = union_len(all);
    Busy {
        gpu_busy: kernel_union / wall.max(f64::MIN_POSITIVE),
        exposed_transfer: (all_union - kernel_union) / wall.max(f64::MIN_POSITIVE),
        copy_union,
    }
}

impl Variant {
    /// The lanes of this variant's timeline: its streams, then the host.
    pub fn timeline_lanes(self) -> Vec<String> {
        let mut lanes: Vec<String> = match self {
            Variant::DoubleBuffered => ["H2D stream", "kernel stream", "D2H stream"]
                .map(str::to_string)
                .to_vec(),
            v => (0..v.streams()).map(|k| format!("stream {k}")).collect(),
        };
        lanes.push("host".into());
        lanes
    }

    /// The timeline's lane of batch `b`'s stage `stage` (0: H2D, 1: kernel, 2: D2H):
    /// double buffering has a stream per stage, the library's pipeline (`pinned`,
    /// `pipeline`) says where each batch went (`stream_of`), every other variant puts
    /// batch b on stream b % S.
    fn lane(self, b: usize, stage: usize, stream_of: &[usize]) -> usize {
        match self {
            Variant::DoubleBuffered => stage,
            // On the library's pipeline, the ring's free buffer decides.
            Variant::Pipeline(s) | Variant::Threaded(s) | Variant::Pinned(s) => {
                stream_of.get(b).copied().unwrap_or(b % s)
            }
            v => b % v.streams(),
        }
    }
}

/// The bars of one run: each batch's three GPU stages on its stream's lane (from the
/// timed events, seconds after the start event) and its host fill on the last lane (ms
/// on the host's clock from the same start).
pub(crate) fn spans(
    variant: Variant,
    iv: &[StageIntervals],
    stream_of: &[usize],
    fills: &[(usize, f64, f64)],
) -> Vec<timeline::Span> {
    use timeline::{Span, SpanKind};
    let kinds = [SpanKind::H2D, SpanKind::Kernel, SpanKind::D2H];
    let mut out: Vec<Span> = iv
        .iter()
        .enumerate()
        .flat_map(|(b, stages)| {
            stages
                .iter()
                .zip(kinds)
                .enumerate()
                .map(move |(k, (&(s, e), kind))| Span {
                    lane: variant.lane(b, k, stream_of),
                    kind,
                    batch: b,
                    start_ms: s * 1e3,
                    end_ms: e * 1e3,
                })
        })
        .collect();
    let host = variant.timeline_lanes().len() - 1;
    out.extend(fills.iter().map(|&(batch, start_ms, end_ms)| Span {
        lane: host,
        kind: SpanKind::Fill,
        batch,
        start_ms,
        end_ms,
    }));
    out
}

// ----- the issue order ------------------------------------------------------------------

/// One step of the thread that issues the pipeline's work, in the order [`plan`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Block until batch `p`'s H2D copy has read its input, so that its host buffer can
    /// take a later batch's input (the staging variants' own buffers have their own
    /// guards: an arena's reset, a ring slot's event, the pool).
    AwaitInputRead(usize),
    /// Write batch `b`'s input, queue its H2D copy and then its kernel.
    QueueIn(usize),
    /// Block until batch `p`'s D2H copy has landed, then check its output.
    CheckOut(usize),
    /// Queue batch `b`'s D2H copy.
    QueueOut(usize),
}

/// The issue order for `batches` batches whose buffers are reused every `reuse` batches
/// (the lanes, or double buffering's two slots), the output side `skew` batches behind
/// the input side (`skew < reuse`, so that batch b's kernel may wait for the D2H of
/// batch b - reuse, queued before it).
///
/// Per batch b: wait until the H2D of b - reuse has read the input buffer (not for its
/// kernel or D2H); write b's input; queue b's H2D and kernel; then (for batch o = b -
/// skew) wait for the D2H of o - reuse, check that output, queue o's D2H. The GPU thus
/// always holds the next batch of every stream before the current one ends, and the host
/// checks an output while the GPU copies and computes the batches after it.
pub(crate) fn plan(batches: usize, reuse: usize, skew: usize) -> Vec<Step> {
    assert!(
        skew < reuse,
        "the output side must stay less than `reuse` batches behind"
    );
    let mut steps = Vec::with_capacity(4 * batches);
    for i in 0..batches + skew {
        if i < batches {
            if let Some(p) = i.checked_sub(reuse) {
                steps.push(Step::AwaitInputRead(p));
            }
            steps.push(Step::QueueIn(i));
        }
        if let Some(o) = i.checked_sub(skew) {
            if let Some(p) = o.checked_sub(reuse) {
                steps.push(Step::CheckOut(p));
            }
            steps.push(Step::QueueOut(o));
        }
    }
    steps.extend((batches.saturating_sub(reuse)..batches).map(Step::CheckOut));
    steps
}

/// How a pipeline lays its batches out on streams and buffers, for [`simulate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Batch b on lane b % S: one stream and one buffer set per lane.
    Lanes(usize),
    /// Two buffer slots, one stream per stage ([`run_double`]).
    Double,
}

impl Layout {
    fn reuse(self) -> usize {
        match self {
            Layout::Lanes(s) => s,
            Layout::Double => 2,
        }
    }
}

/// Per-batch costs for [`simulate`], in ms: the GPU's stages, and the issuing thread's
/// time to write an input (`write`), queue a step's work (`queue`) and check an output
/// (`check`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Costs {
    pub(crate) h2d: f64,
    pub(crate) kernel: f64,
    pub(crate) d2h: f64,
    pub(crate) write: f64,
    pub(crate) queue: f64,
    pub(crate) check: f64,
}

/// What [`simulate`] found.
#[derive(Debug)]
pub(crate) struct Simulation {
    /// When the last D2H copy ends.
    pub(crate) wall: f64,
    /// Every place where the steps would let the host or the GPU touch a buffer still in
    /// use, wait for work never queued, or skip or repeat a batch (empty: none).
    pub(crate) hazards: Vec<String>,
}

/// Runs `steps` against a model of the GPU: each stage has one engine (one H2D copy, one
/// kernel and one D2H copy at a time, each in the order queued), an operation starts when
/// it is queued, its engine is free, and what it waits for has ended (its stream's
/// previous operation, and the events the executors wait on). The issuing thread's
/// clock advances by the host costs and jumps forward to the end of what it waits for.
///
/// Besides the time, the model checks the order: the host writes an input only after
/// every H2D that read the buffer before has ended; a D2H is queued only after the output
/// it overwrites has been checked; each batch is queued and checked exactly once, and
/// nothing waits for work not yet queued.
pub(crate) fn simulate(steps: &[Step], layout: Layout, batches: usize, c: Costs) -> Simulation {
    let reuse = layout.reuse();
    let mut hazards = Vec::new();
    let (mut he, mut ke, mut de) = (vec![None; batches], vec![None; batches], vec![None; batches]);
    let mut checked: Vec<Option<f64>> = vec![None; batches];
    let mut checks = vec![0usize; batches];
    let mut host: f64 = 0.0;
    let (mut h_free, mut k_free, mut d_free) = (0.0f64, 0.0f64, 0.0f64);
    let at = |v: &[Option<f64>], b: usize, what: &str, hazards: &mut Vec<String>| -> f64 {
        v[b].unwrap_or_else(|| {
            hazards.push(format!("waits for the {what} of batch {b}, not queued yet"));
            f64::INFINITY
        })
    };
    for &step in steps {
        match step {
            Step::AwaitInputRead(p) => host = host.max(at(&he, p, "H2D", &mut hazards)),
            Step::CheckOut(p) => {
                host = host.max(at(&de, p, "D2H", &mut hazards)) + c.check;
                checked[p] = Some(host);
                checks[p] += 1;
            }
            Step::QueueIn(b) => {
                if he[b].is_some() {
                    hazards.push(format!("batch {b} queued twice"));
                }
                // The host writes the input buffer now: the last H2D that read it (and so,
                // in engine order, every earlier one) must have ended.
                if let Some(p) = b.checked_sub(reuse) {
                    if !he[p].is_some_and(|e| e <= host) {
                        hazards.push(format!(
                            "input of batch {b} written while the H2D of batch {p} may read it"
                        ));
                    }
                }
                host += c.write + c.queue;
                // H2D: after its stream's previous operation and the engine.
                let mut start = host.max(h_free);
                match layout {
                    Layout::Lanes(s) => {
                        if let Some(p) = b.checked_sub(s) {
                            start = start.max(at(&de, p, "D2H", &mut hazards));
                        }
                    }
                    // The slot's device input is free once the kernel two batches back ends.
                    Layout::Double => {
                        if let Some(p) = b.checked_sub(2) {
                            start = start.max(at(&ke, p, "kernel", &mut hazards));
                        }
                    }
                }
                let h_end = start + c.h2d;
                he[b] = Some(h_end);
                h_free = h_end;
                // Kernel: after its input landed (and for double buffering, once the
                // slot's output was copied out).
                let mut start = h_end.max(k_free);
                if layout == Layout::Double {
                    if let Some(p) = b.checked_sub(2) {
                        start = start.max(at(&de, p, "D2H", &mut hazards));
                    }
                }
                let k_end = start + c.kernel;
                ke[b] = Some(k_end);
                k_free = k_end;
            }
            Step::QueueOut(b) => {
                if de[b].is_some() {
                    hazards.push(format!("the D2H of batch {b} queued twice"));
                }
                if let Some(p) = b.checked_sub(reuse) {
                    if checked[p].is_none() {
                        hazards.push(format!(
                            "the D2H of batch {b} queued before batch {p}'s output, in the same buffer, was checked"
                        ));
                    }
                }
                host += c.queue;
                let start = host.max(d_free).max(at(&ke, b, "kernel", &mut hazards));
                let d_end = start + c.d2h;
                de[b] = Some(d_end);
                d_free = d_end;
            }
        }
    }
    for b in 0..batches {
        if he[b].is_none() || de[b].is_none() {
            hazards.push(format!("batch {b} never queued"));
        }
        if checks[b] != 1 {
            hazards.push(format!("batch {b} checked {} times", checks[b]));
        }
    }
    let wall = de.iter().flatten().fold(0.0f64, |a, &b| a.max(b));
    Simulation { wall, hazards }
}

// ----- the pipelines --------------------------------------------------------------------

/// A stream with a device input/output pair and a host input/output pair.
struct Lane {
    stream: Stream,
    dev_in: DevBuf,
    dev_out: DevBuf,
    host_in: HostBuf,
    host_out: HostBuf,
}

impl Lane {
    fn new(n: usize, raw: bool, pageable: bool) -> Result<Self> {
        let stream = Stream::new(0)?;
        let (dev_in, dev_out, host_in, host_out) = if raw {
            (
                DevBuf::Raw(DeviceMemory::new(n * 4, 0)?),
                DevBuf::Raw(DeviceMemory::new(n * 4, 0)?),
                HostBuf::Raw(RawPinnedBuffer::zeroed(n)?),
                HostBuf::Raw(RawPinnedBuffer::zeroed(n)?),
            )
        } else if pageable {
            (
                DevBuf::pool(n, &stream)?,
                DevBuf::pool(n, &stream)?,
                HostBuf::Pageable(vec![0; n]),
                HostBuf::Pageable(vec![0; n]),
            )
        } else {
            (
                DevBuf::pool(n, &stream)?,
                DevBuf::pool(n, &stream)?,
                HostBuf::pinned(n)?,
                HostBuf::pinned(n)?,
            )
        };
        Ok(Self {
            stream,
            dev_in,
            dev_out,
            host_in,
            host_out,
        })
    }
}

/// Double buffering: two slots, a stream per stage.
struct Double {
    s_in: Stream,
    s_kernel: Stream,
    s_out: Stream,
    slots: [Slot; 2],
}

struct Slot {
    dev_in: DevBuf,
    dev_out: DevBuf,
    host_in: HostBuf,
    host_out: HostBuf,
}

impl Double {
    fn new(n: usize) -> Result<Self> {
        let (s_in, s_kernel, s_out) = (Stream::new(0)?, Stream::new(0)?, Stream::new(0)?);
        let slot = || -> Result<Slot> {
            Ok(Slot {
                dev_in: DevBuf::pool(n, &s_in)?,
                dev_out: DevBuf::pool(n, &s_out)?,
                host_in: HostBuf::pinned(n)?,
                host_out: HostBuf::pinned(n)?,
            })
        };
        let slots = [slot()?, slot()?];
        Ok(Self {
            s_in,
            s_kernel,
            s_out,
            slots,
        })
    }

    fn synchronize(&self) {
        for s in [&self.s_in, &self.s_kernel, &self.s_out] {
            let _ = s.synchronize();
        }
    }
}

/// How a lane variant gets the host memory of a batch's input.
enum Staging<'a> {
    /// The lane's own input buffer.
    Lane,
    /// A per-lane arena, reset before each batch (the reset waits for the recorded copy).
    Arena(&'a mut [Arena<PinnedSource>]),
    /// A fresh pinned `Vec` per batch, dropped as soon as its copy is queued.
    Fresh,
    /// The library's ring (its buffers on a stream of their own that only waits): a
    /// buffer is handed out again once the copy that last read it is done.
    Ring(&'a StagingRing<PinnedAlloc>),
    /// The hand-written ring: slot `b % len` is reused once the copy of its last batch
    /// is done.
    HandRing {
        slots: &'a mut [PVec<u32, PinnedAlloc>],
        last: Vec<Option<usize>>,
    },
}

/// One staged input, alive until its copy is queued (and its use recorded).
enum Staged<'a> {
    Lane,
    Arena(PVec<u32, &'a Arena<PinnedSource>>, &'a Arena<PinnedSource>),
    Fresh(PVec<u32, PinnedAlloc>),
    Ring(cudalloc::staging::Staged<PinnedAlloc>),
    HandRing(&'a [u32]),
}

/// What every run shares: the kernel, the events, the checker.
struct Ctx<'a> {
    kernel: &'a Kernel,
    events: &'a [BatchEvents],
    t0: &'a Event,
    checker: &'a Checker,
    rounds: u32,
    n: usize,
    fill_threads: usize,
    fill_workers: usize,
    chain_copies: bool,
}

impl Ctx<'_> {
    /// Marks the start: `t0` on the first stream, which every other stream waits for.
    /// Returns a tally whose host clock starts there (the streams are idle: `t0` runs as
    /// soon as it is queued).
    fn start<'s>(&self, streams: impl IntoIterator<Item = &'s Stream>) -> Result<Tally> {
        let mut streams = streams.into_iter();
        let first = streams.next().ok_or(Error::InvalidArgument("no stream"))?;
        self.t0.record(first)?;
        let origin = Instant::now();
        for s in streams {
            s.wait(self.t0)?;
        }
        Ok(Tally {
            origin: Some(origin),
            ..Tally::default()
        })
    }

    /// Writes batch `b`'s input into a fixed buffer: all of it when `full`, else its
    /// checked positions.
    fn write_input(&self, b: usize, input: &mut [u32], full: bool) {
        if full {
            Checker::fill_with(b, input, self.fill_threads);
        } else {
            self.checker.stamp(b, input);
        }
    }

    /// Blocks until batch `p`'s D2H copy has landed, then checks its output.
    fn check_out(&self, p: usize, output: &[u32], tally: &mut Tally) -> Result<()> {
        tally.blocked(|| self.events[p].d1.synchronize())?;
        self.checker.check(p, self.rounds, output, tally);
        Ok(())
    }
}

/// Runs `batches` batches over `lanes` (batch b on lane b % lanes) in the order of
/// [`plan`], staging inputs as `staging` says. Returns the tally of checked outputs.
///
/// Why each buffer is safe (stream order: operations on one stream run in order):
/// - the lane's host input is written for batch b only after the H2D of b - S (the last
///   copy that read it) has completed (`AwaitInputRead`); staging buffers wait on their
///   own guards (an arena's reset, a ring slot's `h1`, the pool's recorded use);
/// - the lane's device input is written by the H2D of b after the kernel of b - S has
///   read it, and its device output by the kernel of b after the D2H of b - S has read
///   it: both earlier on the lane's stream;
/// - the lane's host output is overwritten by the D2H of b, which is queued only after
///   the host has waited for the D2H of b - S and checked that output (`CheckOut`).
///
/// With `chain_copies`, each copy also waits (`cuStreamWaitEvent`) for the previous
/// batch's copy in the same direction, recorded earlier in this run: an added order,
/// never a cycle (it points to an earlier batch, which points to earlier ones).
fn run_lanes(
    ctx: &Ctx<'_>,
    lanes: &mut [Lane],
    staging: &mut Staging<'_>,
    batches: usize,
    full: bool,
) -> Result<Tally> {
    let s = lanes.len();
    let mut tally = ctx.start(lanes.iter().map(|l| &l.stream))?;
    let chain = ctx.chain_copies && s > 1;
    for step in plan(batches, s, 0) {
        match step {
            Step::AwaitInputRead(p) => {
                if matches!(staging, Staging::Lane) {
                    tally.blocked(|| ctx.events[p].h1.synchronize())?;
                }
            }
            Step::QueueIn(b) => {
                let lane = &mut lanes[b % s];
                let ev = &ctx.events[b];
                let staged = stage(ctx, staging, b, b % s, &mut tally)?;
                let Lane {
                    stream,
                    dev_in,
                    dev_out,
                    host_in,
                    ..
                } = lane;
                let input: &[u32] = match &staged {
                    Staged::Lane => {
                        tally.filled(b, || ctx.write_input(b, host_in, full));
                        host_in
                    }
                    Staged::Arena(v, _) => v,
                    Staged::Fresh(v) => v,
                    Staged::Ring(lease) => as_words(lease)?,
                    Staged::HandRing(v) => v,
                };
                if chain && b > 0 {
                    stream.wait(&ctx.events[b - 1].h1)?;
                }
                ev.h0.record(stream)?;
                // SAFETY: the input is not written until the copy is done: the lane's buffer
                // is rewritten only after this batch's `h1` (AwaitInputRead, S batches on);
                // an arena block only after its reset, which waits for the use recorded
                // below; a fresh Vec is pooled memory (the copy records its use, so dropping
                // it early is allowed); a ring slot only after `h1`.
                unsafe { dev_in.upload(input, stream) }?;
                ev.h1.record(stream)?;
                match &staged {
                    // The copy helper recorded the use already (the arena is registered);
                    // saying so explicitly costs one event record and shows the API.
                    Staged::Arena(v, arena) => {
                        arena.record_use(v.as_ptr().cast(), stream)?;
                    }
                    // The copy ran on the lane's stream, not the buffer's: say so, and the
                    // event the lease records when dropped covers it.
                    Staged::Ring(lease) => lease.record_use(stream)?,
                    _ => {}
                }
                // A fresh Vec goes back to the pool here, a ring's lease to its ring, the
                // copy still queued.
                drop(staged);
                ev.k0.record(stream)?;
                // SAFETY: both device buffers hold `n` u32s, live in `lanes` until the end of
                // the run, and are used only on this lane's stream, in its order.
                unsafe { launch_hash(ctx.kernel, stream, dev_in.ptr(), dev_out.ptr(), ctx.n, ctx.rounds) }?;
                ev.k1.record(stream)?;
            }
            Step::CheckOut(p) => ctx.check_out(p, &lanes[p % s].host_out, &mut tally)?,
            Step::QueueOut(b) => {
                let Lane {
                    stream,
                    dev_out,
                    host_out,
                    ..
                } = &mut lanes[b % s];
                let ev = &ctx.events[b];
                if chain && b > 0 {
                    stream.wait(&ctx.events[b - 1].d1)?;
                }
                ev.d0.record(stream)?;
                // SAFETY: `host_out` was last read by the check of batch b - S, done before
                // this step; it is read again only after this batch's `d1` (CheckOut).
                unsafe { dev_out.download(host_out, stream) }?;
                ev.d1.record(stream)?;
            }
        }
    }
    Ok(tally)
}

/// Gets batch `b`'s input (lane `l`) from `staging`, written whole: the staging
/// variants' part of `Step::QueueIn`.
fn stage<'s>(
    ctx: &Ctx<'_>,
    staging: &'s mut Staging<'_>,
    b: usize,
    l: usize,
    tally: &mut Tally,
) -> Result<Staged<'s>> {
    let threads = ctx.fill_threads;
    Ok(match staging {
        Staging::Lane => Staged::Lane,
        Staging::Arena(arenas) => {
            let arena = &mut arenas[l];
            // Waits for the copy recorded on this arena S batches ago.
            tally.blocked(|| {
                arena.reset();
                Ok(())
            })?;
            let arena = &*arena;
            let mut v = PVec::new_in(arena);
            tally
                .filled(b, || Checker::fill_new(b, ctx.n, &mut v, threads))
                .map_err(|()| Error::OutOfMemory { requested: ctx.n * 4 })?;
            Staged::Arena(v, arena)
        }
        Staging::Fresh => {
            // `try_reserve` rather than `with_capacity`: a pool at its byte cap waits for
            // the oldest pending copies (backpressure, up to 10 s) and then refuses; a
            // refusal must not abort the process.
            let mut v = PVec::new_in(PinnedAlloc);
            tally
                .filled(b, || Checker::fill_new(b, ctx.n, &mut v, threads))
                .map_err(|()| Error::LimitExceeded {
                    requested: ctx.n * 4,
                    held: PinnedAlloc::stats().source_bytes,
                    limit: PinnedAlloc::limit().unwrap_or(usize::MAX),
                })?;
            Staged::Fresh(v)
        }
        Staging::Ring(ring) => {
            let mut lease = tally.blocked(|| ring.next(RING_WAIT))?;
            let input = as_words_mut(&mut lease)?;
            tally.filled(b, || Checker::fill_with(b, input, threads));
            Staged::Ring(lease)
        }
        Staging::HandRing { slots, last } => {
            let k = b % slots.len();
            if let Some(prev) = last[k] {
                tally.blocked(|| ctx.events[prev].h1.synchronize())?; // its last copy has read it
            }
            tally.filled(b, || Checker::fill_with(b, &mut slots[k], threads));
            last[k] = Some(b);
            Staged::HandRing(&slots[k])
        }
    })
}

/// Double buffering: slot b % 2, H2D on one stream, the kernel on a second, D2H on a
/// third, ordered by events, in the order of [`plan`] with the output side one batch
/// behind: the H2D and kernel of b are queued before the host waits for anything the D2H
/// of b - 1 needs.
///
/// Why each buffer is safe: the slot's host input is written for b after the H2D of
/// b - 2 completed (`AwaitInputRead`); its device input is overwritten by the H2D of b,
/// which waits for the kernel of b - 2 (`k1`); its device output is overwritten by the
/// kernel of b, which waits for the D2H of b - 2 (`d1`, queued one step earlier); its host
/// output is overwritten by the D2H of b, queued only after the host checked b - 2.
fn run_double(ctx: &Ctx<'_>, db: &mut Double, batches: usize, full: bool) -> Result<Tally> {
    let Double {
        s_in,
        s_kernel,
        s_out,
        slots,
    } = db;
    let mut tally = ctx.start([&*s_in, &*s_kernel, &*s_out])?;
    for step in plan(batches, 2, 1) {
        match step {
            Step::AwaitInputRead(p) => tally.blocked(|| ctx.events[p].h1.synchronize())?,
            Step::QueueIn(b) => {
                let slot = &mut slots[b % 2];
                let ev = &ctx.events[b];
                let prev = b.checked_sub(2).map(|p| &ctx.events[p]);
                tally.filled(b, || ctx.write_input(b, &mut slot.host_in, full));
                if let Some(p) = prev {
                    s_in.wait(&p.k1)?; // the slot's device input: the kernel two batches ago is done
                }
                ev.h0.record(s_in)?;
                // SAFETY: the slot's host input is rewritten only after this batch's `h1`.
                unsafe { slot.dev_in.upload(&slot.host_in, s_in) }?;
                ev.h1.record(s_in)?;
                s_kernel.wait(&ev.h1)?;
                if let Some(p) = prev {
                    s_kernel.wait(&p.d1)?; // the slot's device output has been copied out
                }
                ev.k0.record(s_kernel)?;
                // SAFETY: the device input is written on `s_in` before `h1`, which the kernel
                // waits for; the output is free once `d1` two batches ago is done (waited
                // above; plan(.., 2, 1) queues that D2H before this step); the next writer
                // of the input waits for `k1`.
                unsafe {
                    launch_hash(
                        ctx.kernel,
                        s_kernel,
                        slot.dev_in.ptr(),
                        slot.dev_out.ptr(),
                        ctx.n,
                        ctx.rounds,
                    )
                }?;
                ev.k1.record(s_kernel)?;
            }
            Step::CheckOut(p) => ctx.check_out(p, &slots[p % 2].host_out, &mut tally)?,
            Step::QueueOut(b) => {
                let slot = &mut slots[b % 2];
                let ev = &ctx.events[b];
                s_out.wait(&ev.k1)?;
                ev.d0.record(s_out)?;
                // SAFETY: the slot's host output was last read by the check of b - 2, done
                // before this step; it is read again only after this batch's `d1`.
                unsafe { slot.dev_out.download(&mut slot.host_out, s_out) }?;
                ev.d1.record(s_out)?;
            }
        }
    }
    Ok(tally)
}

/// A row on the library's pipeline (`cudalloc::staging::Pipeline`): a `StagingRing` of
/// `per_stream` input buffers per stream from `A`, and per ring buffer a device
/// input/output pair and a host output of the same kind of memory.
struct Piped<A: allocator_api2::alloc::Allocator> {
    streams: Vec<Stream>,
    ring: StagingRing<A>,
    /// Indexed by the ring buffer (`Staged::index`); buffer k belongs to stream k % S.
    slots: Vec<Slot>,
}

impl<A: allocator_api2::alloc::Allocator + Clone> Piped<A> {
    fn new(alloc: A, n: usize, streams: usize, per_stream: usize, pinned_out: bool) -> Result<Self> {
        let streams: Vec<Stream> = (0..streams).map(|_| Stream::new(0)).collect::<Result<_>>()?;
        let ring = StagingRing::new(alloc, &streams, per_stream, n * 4)?;
        let slots = (0..ring.buffers())
            .map(|k| {
                let s = &streams[k % streams.len()];
                Ok(Slot {
                    dev_in: DevBuf::pool(n, s)?,
                    dev_out: DevBuf::pool(n, s)?,
                    host_in: HostBuf::Pageable(Vec::new()), // the ring's buffer is the input
                    host_out: if pinned_out {
                        HostBuf::pinned(n)?
                    } else {
                        HostBuf::Pageable(vec![0; n])
                    },
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { streams, ring, slots })
    }
}

/// A staging buffer's bytes as u32s (the ring's pinned buffers are page-aligned).
fn as_words(bytes: &[u8]) -> Result<&[u32]> {
    if bytes.as_ptr().align_offset(4) != 0 || bytes.len() % 4 != 0 {
        return Err(Error::InvalidArgument("a staging buffer not aligned for u32s"));
    }
    // SAFETY: aligned and a whole number of u32s (checked); any bytes are a valid u32;
    // the view borrows `bytes`.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / 4) })
}

fn as_words_mut(bytes: &mut [u8]) -> Result<&mut [u32]> {
    if bytes.as_ptr().align_offset(4) != 0 || bytes.len() % 4 != 0 {
        return Err(Error::InvalidArgument("a staging buffer not aligned for u32s"));
    }
    // SAFETY: as in `as_words`, and the view borrows `bytes` mutably.
    Ok(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len() / 4) })
}

/// A row's work on the library's `staging::Pipeline`: the helper leases the input
/// buffers (each once its last upload is done: `last_use_queued`), keeps a batch per ring
/// buffer in flight and waits for each batch before its check; with `run_split` a
/// buffer's next upload and kernel are queued before its last batch's check and its D2H
/// after it (the hand-written lanes' order). The user code is the fill (all of the input
/// when `full`, else its checked positions), the two halves of the launch and the check.
/// With `workers`, the fill runs on that many worker threads (`Pipeline::fill_threads`),
/// each writing its batch with `fill_threads / workers` threads, while this thread
/// launches (both halves at once) and checks.
fn run_ring<A: allocator_api2::alloc::Allocator + Send>(
    ctx: &Ctx<'_>,
    p: &mut Piped<A>,
    batches: usize,
    full: bool,
    workers: Option<usize>,
) -> Result<Tally> {
    let mut tally = ctx.start(&p.streams)?;
    let chain = ctx.chain_copies && p.streams.len() > 1;
    let slots = std::cell::RefCell::new(&mut p.slots);
    // The fill's spans (from any thread) and each batch's stream, for the timeline.
    let fills = std::sync::Mutex::new(Vec::new());
    let origin = tally.origin;
    let checker = ctx.checker;
    let threads = workers.map_or(ctx.fill_threads, |w| (ctx.fill_threads / w.max(1)).max(1));
    let fill = |b: usize, bytes: &mut [u8]| {
        let input = as_words_mut(bytes)?;
        let t = Instant::now();
        if full {
            Checker::fill_with(b, input, threads);
        } else {
            checker.stamp(b, input);
        }
        if let Some(origin) = origin {
            let ms = |i: Instant| i.saturating_duration_since(origin).as_secs_f64() * 1e3;
            let span = (b, ms(t), ms(Instant::now()));
            fills.lock().unwrap_or_else(|e| e.into_inner()).push(span);
        }
        Ok::<_, Error>(())
    };
    let streams = p.streams.len();
    let stream_of = std::cell::RefCell::new(Vec::with_capacity(batches));
    // The launch's first half: the upload and the kernel (what the hand-written lanes'
    // `QueueIn` queues), queued before the buffer's last batch is checked.
    let queue_in = |b: usize, buf: &cudalloc::staging::Staged<A>| {
        let (s, ev) = (buf.stream(), &ctx.events[b]);
        stream_of.borrow_mut().push(buf.index() % streams); // buffer k is stream k % S's
        let mut slots = slots.borrow_mut();
        let Slot { dev_in, dev_out, .. } = &mut slots[buf.index()];
        if chain && b > 0 {
            s.wait(&ctx.events[b - 1].h1)?;
        }
        ev.h0.record(s)?;
        // SAFETY: nothing below uses the ring's buffer (`last_use_queued` says so): the
        // ring hands it to the next fill only once the event it records after this copy
        // has completed. The ring's memory is the ring's until then. `dev_in` is this ring
        // buffer's and used on `s` only, after its last batch's kernel in `s`'s order.
        unsafe { dev_in.upload(as_words(buf)?, s) }?;
        // The hand-written lanes' `AwaitInputRead`: the next fill of this buffer waits
        // for this copy, not for the kernel and the D2H below.
        buf.last_use_queued()?;
        ev.h1.record(s)?;
        ev.k0.record(s)?;
        // SAFETY: both device buffers hold `n` u32s, are this ring buffer's and used on
        // `s` only, in its order: the last batch's kernel and D2H on this ring buffer
        // were queued on `s` before this kernel.
        unsafe { launch_hash(ctx.kernel, s, dev_in.ptr(), dev_out.ptr(), ctx.n, ctx.rounds) }?;
        ev.k1.record(s)?;
        Ok::<_, Error>(())
    };
    // Its second half: the D2H into the ring buffer's host output (the lanes' `QueueOut`),
    // queued once the buffer's last batch was checked.
    let queue_out = |b: usize, buf: &cudalloc::staging::Staged<A>| {
        let (s, ev) = (buf.stream(), &ctx.events[b]);
        let mut slots = slots.borrow_mut();
        let Slot {
            dev_out, host_out, ..
        } = &mut slots[buf.index()];
        if chain && b > 0 {
            s.wait(&ctx.events[b - 1].d1)?;
        }
        ev.d0.record(s)?;
        // SAFETY: `host_out` is read by this batch's check only, after the batch completed
        // (the drain waits for an event recorded after this copy); the last batch on this
        // ring buffer was checked before this copy was queued (the pipeline drains it
        // before the finish).
        unsafe { dev_out.download(host_out, s) }?;
        ev.d1.record(s)?;
        Ok::<_, Error>(buf.index())
    };
    let mut checks = Tally::default();
    let drain = |b: usize, k: usize| {
        ctx.checker
            .check(b, ctx.rounds, &slots.borrow()[k].host_out, &mut checks);
        Ok(())
    };
    let pipeline = p.ring.pipeline();
    let run = match workers {
        // The buffer's next batch is queued before its last one is checked.
        None => pipeline.run_split(batches, fill, queue_in, |b, buf, ()| queue_out(b, buf), drain)?,
        Some(w) => {
            let launch = |b: usize, buf: &cudalloc::staging::Staged<A>| {
                queue_in(b, buf)?;
                queue_out(b, buf)
            };
            pipeline
                .fill_threads(w)
                .run(batches, fill, launch, drain)?
                .pipeline
        }
    };
    tally.batches_checked = checks.batches_checked;
    tally.elements_checked = checks.elements_checked;
    tally.mismatches = checks.mismatches;
    tally.first_mismatch = checks.first_mismatch;
    tally.blocked_s = (run.buffer_wait + run.drain_wait).as_secs_f64();
    tally.fills = fills.into_inner().unwrap_or_else(|e| e.into_inner());
    tally.fills.sort_by_key(|&(b, ..)| b);
    tally.stream_of = stream_of.into_inner();
    Ok(tally)
}

/// Everything the variants run on, allocated once per run.
struct Resources {
    pinned: Vec<Lane>,
    raw: Vec<Lane>,
    /// `hand-pageable`'s lane.
    pageable: Option<Lane>,
    double: Option<Double>,
    arenas: Vec<Arena<PinnedSource>>,
    /// `hand-ring-S`'s slots (the longest ring's; shorter rings use the first ones).
    hand_ring: Vec<PVec<u32, PinnedAlloc>>,
    /// One per `Ring(s)` variant: (s, its ring of s + 1 buffers on `ring_stream`).
    rings: Vec<(usize, StagingRing<PinnedAlloc>)>,
    /// The rings' own stream: it only waits for the lanes' copies, so its events say
    /// when a buffer's copy is done without ordering any work.
    ring_stream: Option<Stream>,
    /// `pageable` on the pipeline.
    pageable_pipe: Option<Piped<allocator_api2::alloc::Global>>,
    /// One per `Pinned(s)` (one buffer per stream), `Pipeline(s)` and `Threaded(s)` (two)
    /// variant.
    pipes: Vec<(Variant, Piped<PinnedAlloc>)>,
}

impl Resources {
    fn new(cfg: &Config, n: usize, progress: &dyn Fn(&str)) -> Result<Self> {
        let v = &cfg.variants;
        let max = |f: fn(Variant) -> Option<usize>| v.iter().filter_map(|&x| f(x)).max().unwrap_or(0);
        let pinned_lanes = max(|x| match x {
            Variant::HandPinned(s)
            | Variant::Arena(s)
            | Variant::FreshVec(s)
            | Variant::Ring(s)
            | Variant::HandRing(s) => Some(s),
            _ => None,
        })
        .max(2); // the stages alone use two
        let raw_lanes = max(|x| if let Variant::Raw(s) = x { Some(s) } else { None });
        let ring_slots = max(|x| {
            if let Variant::HandRing(s) = x {
                Some(s + 1)
            } else {
                None
            }
        });
        let arenas = max(|x| if let Variant::Arena(s) = x { Some(s) } else { None });
        progress(&format!(
            "allocating {pinned_lanes} pinned and {raw_lanes} raw stream pairs of {}",
            fmt_size(n * 4)
        ));
        let pinned = (0..pinned_lanes)
            .map(|_| Lane::new(n, false, false))
            .collect::<Result<_>>()?;
        let raw = (0..raw_lanes)
            .map(|_| Lane::new(n, true, false))
            .collect::<Result<_>>()?;
        let pageable = if v.contains(&Variant::HandPageable) {
            Some(Lane::new(n, false, true)?)
        } else {
            None
        };
        let double = if v.contains(&Variant::DoubleBuffered) {
            Some(Double::new(n)?)
        } else {
            None
        };
        let hand_ring = (0..ring_slots)
            .map(|_| match HostBuf::pinned(n)? {
                HostBuf::Pinned(v) => Ok(v),
                _ => unreachable!("HostBuf::pinned makes pinned buffers"),
            })
            .collect::<Result<_>>()?;
        let ring_stream = if v.iter().any(|x| matches!(x, Variant::Ring(_))) {
            Some(Stream::new(0)?)
        } else {
            None
        };
        let (mut rings, mut pipes) = (Vec::new(), Vec::new());
        let pageable_pipe = if v.contains(&Variant::Pageable) {
            Some(Piped::new(
                allocator_api2::alloc::Global,
                n,
                1,
                cfg.ring_buffers,
                false,
            )?)
        } else {
            None
        };
        for &x in v {
            match (x, &ring_stream) {
                (Variant::Ring(s), Some(stream)) if !rings.iter().any(|(k, _)| *k == s) => {
                    rings.push((
                        s,
                        StagingRing::new(PinnedAlloc, std::slice::from_ref(stream), s + 1, n * 4)?,
                    ));
                }
                (Variant::Pinned(s), _) if !pipes.iter().any(|(k, _)| *k == x) => {
                    pipes.push((x, Piped::new(PinnedAlloc, n, s, cfg.ring_buffers, true)?));
                }
                (Variant::Pipeline(s) | Variant::Threaded(s), _) if !pipes.iter().any(|(k, _)| *k == x) => {
                    pipes.push((x, Piped::new(PinnedAlloc, n, s, 2, true)?));
                }
                _ => {}
            }
        }
        Ok(Self {
            pinned,
            raw,
            pageable,
            double,
            arenas: (0..arenas).map(|_| Arena::pinned()).collect(),
            hand_ring,
            rings,
            ring_stream,
            pageable_pipe,
            pipes,
        })
    }

    /// Waits for everything queued (after an error too, so no buffer is freed under a copy).
    fn synchronize(&self) {
        for lane in self.pinned.iter().chain(&self.raw).chain(&self.pageable) {
            let _ = lane.stream.synchronize();
        }
        if let Some(d) = &self.double {
            d.synchronize();
        }
        let pipe_streams = self.pipes.iter().flat_map(|(_, p)| &p.streams);
        let pageable_streams = self.pageable_pipe.iter().flat_map(|p| &p.streams);
        for s in pipe_streams.chain(pageable_streams).chain(&self.ring_stream) {
            let _ = s.synchronize();
        }
    }

    /// Runs `batches` batches of `variant` and waits for all of it (also on an error, so
    /// no buffer is freed under a copy).
    fn run(&mut self, ctx: &Ctx<'_>, variant: Variant, batches: usize) -> Result<Tally> {
        let full = variant.staged() || ctx.checker.all;
        let out = match variant {
            Variant::Pageable => match &mut self.pageable_pipe {
                Some(p) => run_ring(ctx, p, batches, full, None),
                None => Err(Error::InvalidArgument("no pageable ring")),
            },
            Variant::Pinned(_) | Variant::Pipeline(_) | Variant::Threaded(_) => {
                let workers = matches!(variant, Variant::Threaded(_)).then_some(ctx.fill_workers);
                match self.pipes.iter_mut().find(|(k, _)| *k == variant) {
                    Some((_, p)) => run_ring(ctx, p, batches, full, workers),
                    None => Err(Error::InvalidArgument("no staging pipeline of that many streams")),
                }
            }
            Variant::HandPageable => {
                let lane = self
                    .pageable
                    .as_mut()
                    .ok_or(Error::InvalidArgument("no pageable lane"))?;
                run_lanes(ctx, std::slice::from_mut(lane), &mut Staging::Lane, batches, full)
            }
            Variant::HandPinned(s) => {
                let k = s.min(self.pinned.len());
                run_lanes(ctx, &mut self.pinned[..k], &mut Staging::Lane, batches, full)
            }
            Variant::Raw(s) => {
                let k = s.min(self.raw.len());
                run_lanes(ctx, &mut self.raw[..k], &mut Staging::Lane, batches, full)
            }
            Variant::DoubleBuffered => {
                let db = self
                    .double
                    .as_mut()
                    .ok_or(Error::InvalidArgument("no double buffers"))?;
                run_double(ctx, db, batches, full)
            }
            Variant::Arena(s) => {
                let k = s.min(self.pinned.len());
                let mut staging = Staging::Arena(&mut self.arenas[..k]);
                run_lanes(ctx, &mut self.pinned[..k], &mut staging, batches, full)
            }
            Variant::FreshVec(s) => {
                let k = s.min(self.pinned.len());
                run_lanes(ctx, &mut self.pinned[..k], &mut Staging::Fresh, batches, full)
            }
            Variant::Ring(s) => match self.rings.iter().find(|(k, _)| *k == s) {
                Some((_, ring)) => {
                    let k = s.min(self.pinned.len());
                    run_lanes(
                        ctx,
                        &mut self.pinned[..k],
                        &mut Staging::Ring(ring),
                        batches,
                        full,
                    )
                }
                None => Err(Error::InvalidArgument("no staging ring of that many streams")),
            },
            Variant::HandRing(s) => {
                let k = s.min(self.pinned.len());
                let len = (s + 1).min(self.hand_ring.len());
                let slots = &mut self.hand_ring[..len];
                let last = vec![None; slots.len()];
                run_lanes(
                    ctx,
                    &mut self.pinned[..k],
                    &mut Staging::HandRing { slots, last },
                    batches,
                    full,
                )
            }
        };
        self.synchronize();
        out
    }
}

impl Drop for Resources {
    fn drop(&mut self) {
        // Raw buffers are freed at once: nothing may still be copying them.
        self.synchronize();
    }
}

/// Average time of `reps` calls of `queue` on `stream`, timed with events, in ms.
fn time_ms(stream: &Stream, reps: usize, mut queue: impl FnMut() -> Result<()>) -> Result<f64> {
    let (a, b) = (Event::timed(stream.device())?, Event::timed(stream.device())?);
    a.record(stream)?;
    for _ in 0..reps {
        queue()?;
    }
    b.record(stream)?;
    b.synchronize()?;
    Ok(b.elapsed_since(&a)?.as_secs_f64() * 1e3 / reps as f64)
}

fn kernel_ms(kernel: &Kernel, lane: &Lane, n: usize, rounds: u32, reps: usize) -> Result<f64> {
    time_ms(&lane.stream, reps, || {
        // SAFETY: the lane's device buffers hold `n` u32s and are used only on its stream.
        unsafe {
            launch_hash(
                kernel,
                &lane.stream,
                lane.dev_in.ptr(),
                lane.dev_out.ptr(),
                n,
                rounds,
            )
        }
    })
}

/// Measures H2D, D2H, both at once, and the host fill (with `fill_threads`), each alone.
fn baseline(lanes: &mut [Lane], n: usize, reps: usize, fill_threads: usize) -> Result<Baseline> {
    let bytes = (n * 4) as f64;
    let [a, b, rest @ ..] = lanes else {
        return Err(Error::InvalidArgument("the stages alone need two streams"));
    };
    let h2d_ms = time_ms(&a.stream, reps, || {
        // SAFETY: the host input is not written until the stream is synchronized (in time_ms).
        unsafe { a.dev_in.upload(&a.host_in, &a.stream) }
    })?;
    let d2h_ms = time_ms(&a.stream, reps, || {
        // SAFETY: the host output is not touched until the stream is synchronized.
        unsafe { a.dev_out.download(&mut a.host_out, &a.stream) }
    })?;
    // Both directions at once: H2D on one stream, D2H on another, from a common start.
    // SAFETY: neither host buffer is touched until both streams are synchronized below
    // (on an error, by the caller).
    let [start, end_a, end_b] = unsafe { copies_both_ways(a, b, reps) }?;
    end_a.synchronize()?;
    end_b.synchronize()?;
    let both = end_a.elapsed_since(&start)?.max(end_b.elapsed_since(&start)?);
    let bidir_gbps = 2.0 * reps as f64 * bytes / both.as_secs_f64().max(1e-9) / 1e9;
    // Untimed first: the fill's threads and the buffer's pages are warm for the rest.
    Checker::fill_with(0, &mut a.host_in, fill_threads);
    let fill_ms = median_fill_ms(&mut [&mut a.host_in], 5, fill_threads);
    let fill_rotating_ms = median_fill_ms(
        &mut [&mut a.host_in, &mut b.host_in, &mut a.host_out, &mut b.host_out],
        8,
        fill_threads,
    );
    let copy_ms = h2d_ms.min(d2h_ms);
    let fill_under_copies_ms = fill_under_copies(a, b, rest, fill_rotating_ms, copy_ms, fill_threads)?;
    Ok(Baseline {
        h2d_ms,
        d2h_ms,
        bidir_gbps,
        fill_ms,
        fill_rotating_ms,
        fill_under_copies_ms,
        fill_threads,
    })
}

/// `count` uploads of `up`'s host input on `up`'s stream and as many downloads into
/// `down`'s host output on `down`'s stream, from a common start: the events recorded at
/// the start and at the end of each stream.
///
/// # Safety
/// `up`'s host input and `down`'s host output must not be touched until both end events
/// have completed.
unsafe fn copies_both_ways(up: &mut Lane, down: &mut Lane, count: usize) -> Result<[Event; 3]> {
    let start = Event::timed(0)?;
    start.record(&up.stream)?;
    down.stream.wait(&start)?;
    for _ in 0..count {
        // SAFETY: the caller's: neither host buffer is touched until the copies are done.
        unsafe {
            up.dev_in.upload(&up.host_in, &up.stream)?;
            down.dev_out.download(&mut down.host_out, &down.stream)?;
        }
    }
    let (end_up, end_down) = (Event::timed(0)?, Event::timed(0)?);
    end_up.record(&up.stream)?;
    end_down.record(&down.stream)?;
    Ok([start, end_up, end_down])
}

/// The host fill into four buffers in turn (`a`'s input, `b`'s output, then `rest`'s;
/// fewer where there are fewer lanes) while `b`'s input is uploaded on `b`'s stream and
/// `a`'s output downloaded on `a`'s, over and over: enough copies queued to outlast the
/// fills (about four times their expected time), and `None` if the copies' events say
/// they ended before the fills did. Each device buffer is used only on its own lane's
/// stream, and the fill writes host buffers no copy touches.
fn fill_under_copies(
    a: &mut Lane,
    b: &mut Lane,
    rest: &mut [Lane],
    fill_ms: f64,
    copy_ms: f64,
    fill_threads: usize,
) -> Result<Option<f64>> {
    const FILLS: usize = 8;
    let copies = ((4.0 * FILLS as f64 * fill_ms / copy_ms.max(1e-6)).ceil() as usize).clamp(4, 1024);
    // SAFETY: neither host buffer of a copy is touched until both streams are synchronized
    // below, or by the caller on an error (the fills write `a.host_in`, `b.host_out` and
    // other lanes' buffers, which no copy here uses).
    let [start, end_b, end_a] = unsafe { copies_both_ways(b, a, copies) }?;
    // The copies start once the GPU reaches `start`; wait for that, then fill.
    start.synchronize()?;
    let mut bufs: Vec<&mut [u32]> = vec![&mut a.host_in, &mut b.host_out];
    for lane in rest {
        bufs.extend([&mut lane.host_in[..], &mut lane.host_out[..]]);
    }
    bufs.truncate(4);
    let began = Instant::now();
    let fill = median_fill_ms(&mut bufs, FILLS, fill_threads);
    let filled = began.elapsed();
    end_a.synchronize()?;
    end_b.synchronize()?;
    let copies_lasted = end_a.elapsed_since(&start)?.min(end_b.elapsed_since(&start)?);
    Ok((copies_lasted > filled).then_some(fill))
}

/// The median of `fills` timed fills with `fill_threads` threads, into `bufs` in turn, in ms.
fn median_fill_ms(bufs: &mut [&mut [u32]], fills: usize, fill_threads: usize) -> f64 {
    let mut times: Vec<f64> = (0..fills)
        .map(|i| {
            let buf = &mut *bufs[i % bufs.len()];
            let t = Instant::now();
            Checker::fill_with(i, buf, fill_threads);
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[fills / 2]
}

/// Rounds per element that make the kernel take `target_ms` per batch, from two timings
/// (the kernel's time is linear in its rounds above the memory-bound floor).
fn calibrate(kernel: &Kernel, lane: &Lane, n: usize, target_ms: f64) -> Result<u32> {
    const PROBE: u32 = 256;
    let t1 = kernel_ms(kernel, lane, n, 1, 3)?;
    let tp = kernel_ms(kernel, lane, n, PROBE, 3)?;
    let per_round = ((tp - t1) / f64::from(PROBE - 1)).max(1e-9);
    let rounds = 1.0 + ((target_ms - t1) / per_round).max(0.0);
    Ok(rounds.round().clamp(1.0, f64::from(1u32 << 24)) as u32)
}

/// Runs every regime and variant of `cfg`. `progress` hears what is running.
pub fn run(cfg: &Config, progress: &dyn Fn(&str)) -> Result<Results> {
    if !cudalloc::cuda::driver_available() {
        return Err(Error::NoDriver);
    }
    if cfg.batch_bytes < 16 || cfg.batch_bytes % 4 != 0 || cfg.batches == 0 {
        return Err(Error::InvalidArgument(
            "batches must be at least 1 and the batch size a multiple of 4 bytes, at least 16",
        ));
    }
    let n = cfg.batch_bytes / 4;
    let module = Module::load_ptx(0, PTX)?;
    let kernel = module.function(KERNEL)?;
    let events = (0..cfg.batches)
        .map(|_| BatchEvents::new(0))
        .collect::<Result<Vec<_>>>()?;
    let t0 = Event::timed(0)?;
    let checker = Checker {
        n,
        samples: cfg.samples,
        all: cfg.verify_all,
    };
    let mut res = Resources::new(cfg, n, progress)?;
    // Stream-ordered allocations must be done before another stream uses the buffers
    // (double buffering writes a buffer of one stream on another).
    res.synchronize();
    let reps = cfg.batches.clamp(1, 8);
    progress("timing the stages alone");
    let fill_threads = cfg.fill_threads.max(1);
    let base = baseline(&mut res.pinned, n, reps, fill_threads);
    res.synchronize();
    let base = base?;
    let copy_ms = base.h2d_ms.max(base.d2h_ms);
    let pipelined_copy_ms = copy_ms.max(base.both_ways_ms(cfg.batch_bytes));
    let mut regimes = Vec::new();
    for &regime in &cfg.regimes {
        let rounds = match regime {
            Regime::TransferBound => 1,
            Regime::Rounds(r) => r,
            Regime::Balanced => calibrate(&kernel, &res.pinned[0], n, pipelined_copy_ms)?,
            Regime::ComputeBound => calibrate(&kernel, &res.pinned[0], n, 4.0 * copy_ms)?,
        };
        let kernel_ms = kernel_ms(&kernel, &res.pinned[0], n, rounds, reps)?;
        res.synchronize();
        let ctx = Ctx {
            kernel: &kernel,
            events: &events,
            t0: &t0,
            checker: &checker,
            rounds,
            n,
            fill_threads,
            fill_workers: cfg.fill_workers.max(1),
            chain_copies: cfg.chain_copies,
        };
        let mut runs: Vec<Vec<std::result::Result<Measured, String>>> = vec![Vec::new(); cfg.variants.len()];
        for round in 0..cfg.repeat.max(1) {
            for (i, &variant) in cfg.variants.iter().enumerate() {
                progress(&format!(
                    "{}: {} (run {})",
                    regime.name(),
                    variant.label(),
                    round + 1
                ));
                let capped = match (variant, cfg.fresh_headroom) {
                    (Variant::FreshVec(_), Some(headroom)) => {
                        let old = PinnedAlloc::limit();
                        PinnedAlloc::trim();
                        PinnedAlloc::set_limit(Some(
                            PinnedAlloc::stats().source_bytes.saturating_add(headroom),
                        ));
                        Some(old)
                    }
                    _ => None,
                };
                let outcome =
                    measure(&mut res, &ctx, variant, cfg, &base, kernel_ms).map_err(|e| e.to_string());
                if let Some(old) = capped {
                    PinnedAlloc::set_limit(old);
                }
                runs[i].push(outcome);
            }
        }
        let rows = cfg
            .variants
            .iter()
            .zip(runs)
            .map(|(&variant, runs)| Row {
                variant,
                outcome: median_run(runs),
            })
            .collect();
        regimes.push(RegimeResult {
            regime,
            rounds,
            kernel_ms,
            rows,
        });
    }
    drop(res);
    drop(kernel);
    drop(module);
    Ok(Results {
        config: cfg.clone(),
        baseline: base,
        regimes,
    })
}

/// The run of median wall time among a row's runs, with every run's checks added in (a
/// wrong element in any run shows); the first error if a run failed.
fn median_run(runs: Vec<std::result::Result<Measured, String>>) -> std::result::Result<Measured, String> {
    let mut ok = Vec::with_capacity(runs.len());
    for r in runs {
        ok.push(r?);
    }
    let (batches, elements, wrong) = ok.iter().fold((0, 0, 0), |(b, e, w), m| {
        (b + m.batches_checked, e + m.elements_checked, w + m.mismatches)
    });
    let first = ok.iter().find_map(|m| m.first_mismatch.clone());
    ok.sort_by(|a, b| a.wall_ms.total_cmp(&b.wall_ms));
    let mut m = ok.swap_remove(ok.len() / 2);
    m.batches_checked = batches;
    m.elements_checked = elements;
    m.mismatches = wrong;
    m.first_mismatch = first;
    Ok(m)
}

/// Warms `variant` up, then times it over all batches.
fn measure(
    res: &mut Resources,
    ctx: &Ctx<'_>,
    variant: Variant,
    cfg: &Config,
    base: &Baseline,
    kernel_ms: f64,
) -> Result<Measured> {
    if cfg.warmup {
        let warm = (2 * variant.streams() + 2).min(cfg.batches);
        res.run(ctx, variant, warm)?;
    }
    let before = PinnedAlloc::stats();
    let start = Instant::now();
    let tally = res.run(ctx, variant, cfg.batches)?;
    let wall = start.elapsed().as_secs_f64();
    let after = PinnedAlloc::stats();
    let iv = stage_intervals(&ctx.events[..cfg.batches], ctx.t0)?;
    let tl = busy(&iv);
    let mut stages = vec![("H2D", base.h2d_ms), ("D2H", base.d2h_ms), ("kernel", kernel_ms)];
    if variant.staged() {
        stages.push(("host fill", base.fill_ms));
    }
    let (bound, per_batch) = stages
        .into_iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or(("-", 0.0));
    let contended_ideal_ms = base
        .fill_in_pipeline_ms(cfg.batch_bytes)
        .filter(|_| variant.staged())
        .map(|fill| cfg.batches as f64 * fill.max(base.h2d_ms).max(base.d2h_ms).max(kernel_ms));
    let moved = 2.0 * cfg.batches as f64 * cfg.batch_bytes as f64;
    let fill_in_run_ms = (variant.staged() && !tally.fills.is_empty())
        .then(|| tally.fills.iter().map(|&(_, s, e)| e - s).sum::<f64>() / tally.fills.len() as f64);
    Ok(Measured {
        wall_ms: wall * 1e3,
        ideal_ms: cfg.batches as f64 * per_batch,
        contended_ideal_ms,
        bound,
        gpu_busy: tl.gpu_busy,
        exposed_transfer: tl.exposed_transfer,
        copy_gbps: moved / tl.copy_union.max(1e-9) / 1e9,
        issuer_blocked: (tally.blocked_s / wall.max(1e-9)).min(1.0),
        pinned_source_allocs: after.misses.saturating_sub(before.misses),
        batches_checked: tally.batches_checked,
        elements_checked: tally.elements_checked,
        mismatches: tally.mismatches,
        first_mismatch: tally.first_mismatch,
        fill_in_run_ms,
        timeline: timeline::Timeline {
            title: String::new(), // named by `Results::timelines`
            lanes: variant.timeline_lanes(),
            spans: spans(variant, &iv, &tally.stream_of, &tally.fills),
        },
    })
}
