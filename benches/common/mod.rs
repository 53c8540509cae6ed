//! What the benches share: size labels, and per-call times over timed batches (beside
//! criterion's estimates, which a shared machine's noise moves by a third from one
//! process to the next).

use std::time::Instant;

/// `256B`, `4KiB`, `16MiB`.
pub fn size_label(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{}MiB", s >> 20),
        s if s >= 1 << 10 => format!("{}KiB", s >> 10),
        s => format!("{s}B"),
    }
}

/// Per-call times of `batches` timed batches of `per_batch` calls each.
#[derive(Clone, Copy, Debug)]
pub struct PerCall {
    /// The median batch, per call, in nanoseconds: the typical cost.
    pub median: f64,
    /// The fastest batch, per call: what the code costs when nothing else runs.
    pub fastest: f64,
}

impl std::fmt::Display for PerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} / {:.1} ns", self.median, self.fastest)
    }
}

/// Times `batches` batches of `per_batch` calls of `f` (after one untimed batch).
pub fn per_call(batches: usize, per_batch: usize, mut f: impl FnMut()) -> PerCall {
    let mut batch = || {
        let t0 = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e9 / per_batch as f64
    };
    batch();
    let mut times: Vec<f64> = (0..batches.max(1)).map(|_| batch()).collect();
    times.sort_by(f64::total_cmp);
    PerCall {
        median: times[times.len() / 2],
        fastest: times[0],
    }
}

/// Whether the command line's filters (criterion's positional arguments) may select
/// `group`: work outside criterion's timing (the memory runs of `device_random`, the
/// summaries) is skipped for groups no filter names.
pub fn wanted(group: &str) -> bool {
    const TAKES_VALUE: [&str; 16] = [
        "--warm-up-time",
        "--measurement-time",
        "--sample-size",
        "--save-baseline",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--output-format",
        "--color",
        "--profile-time",
        "--significance-level",
        "--noise-threshold",
        "--confidence-level",
        "--nresamples",
        "--plotting-backend",
        "--format",
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filters: Vec<&String> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| !a.starts_with('-') && (*i == 0 || !TAKES_VALUE.contains(&args[i - 1].as_str())))
        .map(|(_, a)| a)
        .collect();
    filters.is_empty()
        || filters
            .iter()
            .any(|f| f.contains(group) || group.contains(f.as_str()))
}
