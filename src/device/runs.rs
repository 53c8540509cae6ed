//! The page heap's free-run index, on its own (after RMM's `coalescing_free_list`): the
//! free runs of an index space of units, by first unit and by (length, first unit), each
//! with a payload (the heap keeps the frees that touched the run there). Pure `&mut`
//! bookkeeping, no driver and no stream: the heap decides what to put and when to
//! coalesce; the index answers where runs are. Tested on its own below, by properties
//! against a plain model.

use std::collections::{BTreeMap, BTreeSet};

/// Free runs by first unit (with their length and payload) and by (length, first unit)
/// for the best fit. Runs never overlap.
pub(crate) struct Runs<T> {
    by_start: BTreeMap<usize, (usize, T)>,
    by_len: BTreeSet<(usize, usize)>,
}

impl<T> Default for Runs<T> {
    fn default() -> Self {
        Self {
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
        }
    }
}

impl<T> Runs<T> {
    /// Adds the run `start..start + len` (nonzero; overlapping no run) as it is: the
    /// caller merges it with free neighbours first if it wants them coalesced.
    pub(crate) fn insert(&mut self, start: usize, len: usize, payload: T) {
        debug_assert!(len > 0, "an empty run");
        debug_assert!(
            self.at_or_before(start + len - 1)
                .is_none_or(|(s, l, _)| s + l <= start),
            "runs overlap"
        );
        self.by_len.insert((len, start));
        self.by_start.insert(start, (len, payload));
    }

    /// Removes the run starting at `start`: its length and payload.
    pub(crate) fn remove(&mut self, start: usize) -> Option<(usize, T)> {
        let (len, payload) = self.by_start.remove(&start)?;
        self.by_len.remove(&(len, start));
        Some((len, payload))
    }

    /// The length of the run starting at `start`.
    pub(crate) fn len_at(&self, start: usize) -> Option<usize> {
        self.by_start.get(&start).map(|&(len, _)| len)
    }

    /// The payload of the run starting at `start`.
    pub(crate) fn payload_mut(&mut self, start: usize) -> Option<&mut T> {
        self.by_start.get_mut(&start).map(|(_, p)| p)
    }

    /// The last run starting at or before `unit` (which it may or may not contain):
    /// (start, length, payload).
    pub(crate) fn at_or_before(&self, unit: usize) -> Option<(usize, usize, &T)> {
        self.by_start
            .range(..=unit)
            .next_back()
            .map(|(&s, (l, p))| (s, *l, p))
    }

    /// The run that ends exactly at `start` (a free left neighbour): (start, length).
    pub(crate) fn ending_at(&self, start: usize) -> Option<(usize, usize)> {
        let (&s, &(l, _)) = self.by_start.range(..start).next_back()?;
        (s + l == start).then_some((s, l))
    }

    /// The first units of the runs of at least `n` units, smallest first (the lowest
    /// first unit among equals): the best fits in order.
    pub(crate) fn fitting(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        self.by_len.range((n, 0)..).map(|&(_, start)| start)
    }

    /// The first units of the runs overlapping units `lo..hi`.
    pub(crate) fn overlapping(&self, lo: usize, hi: usize) -> Vec<usize> {
        self.by_start
            .range(..hi)
            .rev()
            .take_while(|(&s, (l, _))| s + l > lo)
            .map(|(&s, _)| s)
            .collect()
    }

    /// Runs in the index.
    #[cfg(test)]
    pub(crate) fn count(&self) -> usize {
        self.by_start.len()
    }

    /// Checks the two indexes against each other and that no runs overlap (tests).
    #[cfg(test)]
    pub(crate) fn check(&self) {
        assert_eq!(self.by_start.len(), self.by_len.len(), "the indexes differ");
        let mut end = 0;
        for (&s, &(l, _)) in &self.by_start {
            assert!(l > 0 && s >= end, "runs overlap or are empty at {s}");
            assert!(self.by_len.contains(&(l, s)), "by_len lacks ({l}, {s})");
            end = s + l;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Runs;
    use proptest::prelude::*;

    /// Frees `start..start + len` into `runs` coalescing with free neighbours, as the
    /// page heap does (payload: the number of frees merged into the run).
    fn free(runs: &mut Runs<u32>, start: usize, len: usize) {
        let (mut start, mut len, mut frees) = (start, len, 1);
        if let Some((s, l)) = runs.ending_at(start) {
            frees += runs.remove(s).map_or(0, |(_, p)| p);
            (start, len) = (s, len + l);
        }
        if let Some((l, p)) = runs.remove(start + len) {
            len += l;
            frees += p;
        }
        runs.insert(start, len, frees);
    }

    #[test]
    fn best_fit_order_and_neighbours() {
        let mut r = Runs::default();
        r.insert(0, 8, ());
        r.insert(20, 4, ());
        r.insert(40, 4, ());
        r.insert(60, 16, ());
        assert_eq!(r.fitting(4).collect::<Vec<_>>(), [20, 40, 0, 60]);
        assert_eq!(r.fitting(9).collect::<Vec<_>>(), [60]);
        assert_eq!(r.fitting(17).count(), 0);
        assert_eq!(r.ending_at(8), Some((0, 8)));
        assert_eq!(r.ending_at(9), None);
        assert_eq!(r.at_or_before(30).map(|(s, l, _)| (s, l)), Some((20, 4)));
        assert_eq!(r.overlapping(7, 42), [40, 20, 0]);
        assert_eq!(r.remove(20), Some((4, ())));
        assert_eq!(r.remove(20), None);
        r.check();
    }

    proptest! {
        /// Allocating by best fit and freeing with coalescing, against a model of the
        /// units: the index always describes exactly the free units, as maximal runs,
        /// and the best fit is the smallest free run that fits.
        #[test]
        fn the_index_is_the_free_units_as_maximal_runs(ops in prop::collection::vec((any::<bool>(), 1usize..24), 1..200)) {
            const UNITS: usize = 512;
            let mut runs: Runs<u32> = Runs::default();
            runs.insert(0, UNITS, 0);
            let mut used = vec![false; UNITS];
            let mut live: Vec<(usize, usize)> = Vec::new();
            for (alloc, n) in ops {
                if alloc || live.is_empty() {
                    let Some(start) = runs.fitting(n).next() else { continue };
                    let (len, p) = runs.remove(start).unwrap();
                    // The smallest free run of the model that fits has this length.
                    let mut best = usize::MAX;
                    let mut i = 0;
                    while i < UNITS {
                        if used[i] { i += 1; continue; }
                        let j = (i..UNITS).find(|&j| used[j]).unwrap_or(UNITS);
                        if start != i && j - i >= n { best = best.min(j - i); }
                        i = j;
                    }
                    prop_assert!(len <= best, "best fit: took {len}, a run of {best} fits");
                    if len > n { runs.insert(start + n, len - n, p); }
                    for u in &mut used[start..start + n] { prop_assert!(!*u); *u = true; }
                    live.push((start, n));
                } else {
                    let (start, n) = live.swap_remove(n % live.len());
                    for u in &mut used[start..start + n] { *u = false; }
                    free(&mut runs, start, n);
                }
                runs.check();
                // Every free unit is in exactly one run, no used unit in any, and no two
                // runs touch (they are maximal).
                let mut covered = vec![false; UNITS];
                let mut prev_end = None;
                for (&start, &(len, _)) in &runs.by_start {
                    prop_assert!(prev_end != Some(start), "runs touch at {}", start);
                    for c in &mut covered[start..start + len] { *c = true; }
                    prev_end = Some(start + len);
                }
                for u in 0..UNITS {
                    prop_assert_eq!(covered[u], !used[u], "unit {}", u);
                }
            }
            prop_assert!(runs.count() >= 1 || live.iter().map(|l| l.1).sum::<usize>() == UNITS);
        }
    }
}
