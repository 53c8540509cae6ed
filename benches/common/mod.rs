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

/// Two variants timed in alternating batches over the same stretch of time (the order
/// swapped every round, so that neither always runs first): what each costs per call, and
/// the median of the rounds' differences `a - b` with its interquartile range. Within one
/// process and one stretch of time the drift that moves whole processes by a third
/// cancels out of the difference.
#[allow(dead_code)] // not every bench pairs variants
#[derive(Clone, Copy, Debug)]
pub struct Paired {
    pub a: PerCall,
    pub b: PerCall,
    /// Median of the per-round differences `a - b`, per call, in nanoseconds.
    pub diff: f64,
    /// Its 25th and 75th percentiles.
    pub diff_iqr: (f64, f64),
    /// Median of the per-round ratios `a / b`: where `b` is a reference (a `malloc`), what
    /// `a` costs in its units at the same moments, whatever the machine's speed then.
    pub ratio: f64,
}

impl std::fmt::Display for Paired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} vs {}, a - b {:+.2} ns (IQR {:+.2} .. {:+.2})",
            self.a, self.b, self.diff, self.diff_iqr.0, self.diff_iqr.1
        )
    }
}

/// Times `rounds` rounds of one batch of `per_batch` calls of `a` and one of `b` (after one
/// untimed batch of each).
#[allow(dead_code)] // not every bench pairs variants
pub fn paired(rounds: usize, per_batch: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> Paired {
    fn batch(per_batch: usize, f: &mut impl FnMut()) -> f64 {
        let t0 = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e9 / per_batch as f64
    }
    batch(per_batch, &mut a);
    batch(per_batch, &mut b);
    let rounds = rounds.max(1);
    let (mut ta, mut tb, mut d, mut q) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (x, y) = if r % 2 == 0 {
            let x = batch(per_batch, &mut a);
            (x, batch(per_batch, &mut b))
        } else {
            let y = batch(per_batch, &mut b);
            (batch(per_batch, &mut a), y)
        };
        ta.push(x);
        tb.push(y);
        d.push(x - y);
        q.push(x / y);
    }
    let summary = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        PerCall {
            median: v[v.len() / 2],
            fastest: v[0],
        }
    };
    d.sort_by(f64::total_cmp);
    q.sort_by(f64::total_cmp);
    Paired {
        a: summary(ta),
        b: summary(tb),
        diff: d[d.len() / 2],
        diff_iqr: (d[d.len() / 4], d[d.len() * 3 / 4]),
        ratio: q[q.len() / 2],
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
