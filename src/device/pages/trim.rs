//! Giving memory back, with no lock held across a driver call: retired mappings unmapped
//! once their work completed (`poll`), idle chunks unmapped and handles released down to
//! what a trim keeps (waiting on the host for pending work without the lock), empty
//! regions freed, a peer given access to every mapping. Each decides under the lock and
//! marks what it works on busy (or carves it out of the free runs), runs the driver calls
//! without it, and publishes under it again.

use super::clocks::{known, Answer, Ask, Freed, Known};
use super::state::{unlock, State};
use super::{timed, PageHeap, ACCESS, MAX_CLOCKS, RELEASE, UNMAP};
use crate::cuda::{record_drop_error, StreamId};
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::error::Result;
use crate::sync::{lock, MutexGuard};
use crate::trace::Code;

/// Rounds of a trim at most (each unmaps, releases or waits; more only if frees keep
/// coming meanwhile).
const TRIM_ROUNDS: usize = 64;

/// What one round of a trim does without the lock.
struct TrimPlan<B: StreamOrder> {
    /// Spare handles to release.
    release: Vec<u64>,
    /// Idle chunks (carved out, busy) to unmap: chunk, address, handle, whether to
    /// release the handle after (not while a retired chunk still maps it).
    unmap: Vec<(usize, u64, u64, bool)>,
    /// Streams to wait for on the host.
    asks: Vec<Ask<B>>,
    /// The trim ends after this round: a handle to release is still mapped at a retired
    /// chunk whose work could not be waited for.
    last: bool,
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Asks the driver about `frees` without the lock (`wait`: host waits; else
    /// queries), each stream once (`asked`), then applies the answers; the guard again,
    /// and the streams whose wait failed.
    fn ask_unlocked<'a>(
        &'a self,
        b: &B,
        st: MutexGuard<'a, State<B>>,
        frees: Vec<Freed>,
        wait: bool,
        asked: &mut Vec<StreamId>,
    ) -> (MutexGuard<'a, State<B>>, Vec<StreamId>) {
        let mut asks = Vec::new();
        for f in &frees {
            if !asked.contains(&f.stream) {
                asked.push(f.stream);
                asks.extend(Ask::of(&st.clocks, f, true));
            }
        }
        if asks.is_empty() {
            return (st, Vec::new());
        }
        drop(st);
        let answers: Vec<Answer<B>> = asks
            .iter()
            .map(|a| if wait { a.wait_host(b) } else { a.settle(b) })
            .collect();
        let failed = asks
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a.failed)
            .map(|(q, _)| q.stream_id())
            .collect();
        let mut st = lock(&self.state);
        self.apply(&mut st, answers);
        (st, failed)
    }

    /// Applies answers of the driver to the clocks and the stats.
    pub(super) fn apply(&self, st: &mut State<B>, answers: Vec<Answer<B>>) {
        let st = &mut *st;
        for a in answers {
            st.stats.marks += u64::from(a.marked());
            st.stats.waits += u64::from(a.waited);
            a.apply(&mut st.clocks, &mut st.dead_marks);
        }
    }

    /// Unmaps retired chunks whose marks completed (looking at `max` chunks at most; with
    /// `wait`, after waiting on the host), and frees their units. The walk of the first
    /// version: in list order, a chunk found done taken out by a swap with the last, a
    /// chunk's frees looked at in order; where one's stream must be asked about, the walk
    /// drops the lock, asks, and goes on where it was. Without `wait`, `asked` holds the
    /// streams asked about in the operation (once each); with it, those whose wait
    /// failed (every other is waited for until its frees completed).
    pub(super) fn poll(&self, b: &B, max: usize, wait: bool, asked: &mut Vec<StreamId>) {
        let mut st = lock(&self.state);
        let mut order: Vec<usize> = st.retired.iter().map(|r| r.0).collect();
        let (mut i, mut seen, mut done) = (0, 0, Vec::new());
        while i < order.len() && seen < max {
            let c = order[i];
            let frees = st.retired.iter().find(|r| r.0 == c).map(|r| r.1.clone());
            let known = match frees {
                Some(frees) if !st.chunks[c].busy => known(&st.clocks, &frees, asked),
                _ => Known::Pending,
            };
            match known {
                Known::Ask(f) => st = self.ask_one(b, st, f, wait, asked),
                Known::Done if st.granting == 0 => {
                    seen += 1;
                    order.swap_remove(i);
                    st.chunks[c].busy = true;
                    done.push((c, self.va_of(&st, c * self.chunk_units)));
                }
                _ => (seen, i) = (seen + 1, i + 1),
            }
        }
        self.unmap_retired(b, st, done);
    }

    /// Asks the driver about free `f` without the lock (`wait`: waits on the host), as
    /// [`poll`](Self::poll) says; the guard again.
    fn ask_one<'a>(
        &'a self,
        b: &B,
        st: MutexGuard<'a, State<B>>,
        f: Freed,
        wait: bool,
        asked: &mut Vec<StreamId>,
    ) -> MutexGuard<'a, State<B>> {
        let mut round = Vec::new();
        let (st, failed) = self.ask_unlocked(b, st, vec![f], wait, &mut round);
        if !wait || !failed.is_empty() {
            asked.push(f.stream);
        }
        st
    }

    /// Unmaps the retired chunks `done` (busy) without the lock, and publishes it (taking
    /// them out of the list in the walk's order).
    fn unmap_retired(&self, b: &B, st: MutexGuard<'_, State<B>>, done: Vec<(usize, u64)>) {
        if done.is_empty() {
            return unlock(st);
        }
        drop(st);
        let cb = self.chunk_bytes();
        let mut ns = 0;
        // SAFETY: each chunk's old mapping (a chunk's bytes); no block holds its units
        // (carved out), it is busy (no one else unmaps it), and its frees completed.
        let results: Vec<_> = done
            .iter()
            .map(|&(_, va)| timed(&mut ns, || unsafe { self.phys.unmap(va, cb) }))
            .collect();
        let mut st = lock(&self.state);
        st.stats.driver_ns[UNMAP] += ns;
        for ((c, va), r) in done.into_iter().zip(results) {
            self.publish_retired(b, &mut st, c, va, r);
        }
        unlock(st);
    }

    /// A retired chunk's unmap done: its units free (unmapped: the handle lives on in
    /// its new mapping), or on an error left mapped and out of use for good.
    fn publish_retired(&self, b: &B, st: &mut State<B>, c: usize, va: u64, r: Result<()>) {
        if let Some(at) = st.retired.iter().position(|r| r.0 == c) {
            st.retired.swap_remove(at);
        }
        st.chunks[c].busy = false;
        match r {
            Ok(()) => {
                st.stats.unmaps += 1;
                b.trace()
                    .segment(Code::SegmentUnmap, va as usize, self.chunk_bytes());
                st.chunks[c].handle = None;
                self.give_back(st, c * self.chunk_units, self.chunk_units, Vec::new());
            }
            Err(e) => {
                // The mapping stays: the units are never used again.
                record_drop_error("cuMemUnmap", e);
                st.chunks[c].stuck = true;
            }
        }
    }

    /// Releases spare handles, then idle chunks from the highest address (waiting on the
    /// host for their marks, without the lock), until the heap reserves less than `keep`
    /// bytes (0: all it can, and the regions left empty are freed).
    pub(crate) fn trim_to(&self, b: &B, keep: usize) {
        let all = keep == 0;
        let keep = keep.max(1);
        self.poll(b, usize::MAX, true, &mut Vec::new());
        let mut given_up: Vec<StreamId> = Vec::new();
        for _ in 0..TRIM_ROUNDS {
            let plan = {
                let mut st = lock(&self.state);
                self.plan_trim(&mut st, keep, &given_up)
            };
            if plan.release.is_empty() && plan.unmap.is_empty() && plan.asks.is_empty() {
                break;
            }
            let last = plan.last;
            if !self.run_trim(b, plan, &mut given_up) || last {
                break;
            }
        }
        if all {
            self.free_empty_regions();
        }
        let mut st = lock(&self.state);
        self.forget_clocks(&mut st, if all { 0 } else { MAX_CLOCKS });
        unlock(st);
    }

    /// One round of a trim, decided: spare handles to release while the heap reserves
    /// `keep` or more, then idle chunks from the highest address: carved out to unmap if
    /// their work completed, else their streams to wait for (except those `given_up`).
    fn plan_trim(&self, st: &mut State<B>, keep: usize, given_up: &[StreamId]) -> TrimPlan<B> {
        let cb = self.chunk_bytes();
        let mut plan = TrimPlan {
            release: Vec::new(),
            unmap: Vec::new(),
            asks: Vec::new(),
            last: false,
        };
        let mut left = st.stats.reserved;
        if self.plan_spares(st, keep, &mut plan, &mut left) {
            return plan;
        }
        let idle: Vec<usize> = st.idle.iter().rev().copied().collect();
        for c in idle {
            if left < keep {
                break;
            }
            let pending = self.pending_at(st, c);
            if pending.is_empty() && st.granting == 0 {
                let Some(h) = st.chunks[c].handle else { continue };
                self.carve(st, c);
                st.chunks[c].busy = true;
                let release = !st.retired_holds(h);
                plan.unmap
                    .push((c, self.va_of(st, c * self.chunk_units), h, release));
                if !release {
                    plan.last = true;
                    return plan;
                }
            } else if pending.iter().any(|f| given_up.contains(&f.stream)) {
                continue;
            } else {
                for f in &pending {
                    if !plan.asks.iter().any(|a| a.stream_id() == f.stream) {
                        plan.asks.extend(Ask::of(&st.clocks, f, true));
                    }
                }
            }
            left = left.saturating_sub(cb);
        }
        plan
    }

    /// Spare handles to release while `left` (what the heap will reserve) is `keep` or
    /// more; whether the trim stops here (a spare handle still mapped at a retired chunk
    /// whose work could not be waited for is kept, and ends it).
    fn plan_spares(&self, st: &mut State<B>, keep: usize, plan: &mut TrimPlan<B>, left: &mut usize) -> bool {
        while *left >= keep {
            match st.spare.pop() {
                Some(h) if st.retired_holds(h) => {
                    st.spare.push(h);
                    plan.last = true;
                    return true;
                }
                Some(h) => plan.release.push(h),
                None => break,
            }
            *left -= self.chunk_bytes();
        }
        false
    }

    /// Runs a round of a trim without the lock and publishes it; whether it got anywhere
    /// (released, unmapped, or waited for a stream).
    fn run_trim(&self, b: &B, plan: TrimPlan<B>, given_up: &mut Vec<StreamId>) -> bool {
        let cb = self.chunk_bytes();
        let mut ns = [0u64; 5];
        let mut unmapped = Vec::new();
        for &(c, va, h, release) in &plan.unmap {
            // SAFETY: an idle chunk's mapping (a chunk's bytes), carved out and busy; the
            // frees of its units completed.
            let r = timed(&mut ns[UNMAP], || unsafe { self.phys.unmap(va, cb) });
            unmapped.push((c, va, h, release, r));
        }
        let mut releases: Vec<Result<()>> = Vec::new();
        let handles = plan
            .release
            .iter()
            .copied()
            .chain(unmapped.iter().filter(|u| u.3 && u.4.is_ok()).map(|u| u.2));
        for h in handles {
            // SAFETY: the handle is mapped nowhere (spare, or just unmapped and mapped at
            // no retired chunk) and forgotten at publishing.
            releases.push(timed(&mut ns[RELEASE], || unsafe { self.phys.release(h) }));
        }
        let answers: Vec<Answer<B>> = plan.asks.iter().map(|a| a.wait_host(b)).collect();
        let mut st = lock(&self.state);
        for (slot, t) in st.stats.driver_ns.iter_mut().zip(ns) {
            *slot += t;
        }
        let mut progress = !releases.is_empty();
        for (c, va, h, release, r) in unmapped {
            progress |= r.is_ok();
            self.publish_trimmed(b, &mut st, c, va, (h, release), r);
        }
        for r in releases {
            self.publish_release(&mut st, r);
        }
        for (a, ask) in answers.iter().zip(&plan.asks) {
            if a.failed {
                given_up.push(ask.stream_id());
            } else {
                progress = true;
            }
        }
        self.apply(&mut st, answers);
        unlock(st);
        progress
    }

    /// An idle chunk unmapped by a trim (its handle released, or kept spare while a
    /// retired chunk maps it), or, its unmap failed, left mapped for good.
    fn publish_trimmed(
        &self,
        b: &B,
        st: &mut State<B>,
        c: usize,
        va: u64,
        handle: (u64, bool),
        r: Result<()>,
    ) {
        let cb = self.chunk_bytes();
        st.chunks[c].busy = false;
        match r {
            Ok(()) => {
                st.stats.unmaps += 1;
                b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                st.chunks[c].handle = None;
                if !handle.1 {
                    st.spare.push(handle.0);
                }
            }
            Err(e) => {
                record_drop_error("cuMemUnmap", e);
                st.chunks[c].stuck = true;
            }
        }
        self.give_back(st, c * self.chunk_units, self.chunk_units, Vec::new());
    }

    fn publish_release(&self, st: &mut State<B>, r: Result<()>) {
        match r {
            Ok(()) => {
                st.stats.reserved -= self.chunk_bytes();
                self.reservations.give(self.chunk_bytes());
                st.stats.releases += 1;
            }
            Err(e) => record_drop_error("cuMemRelease", e),
        }
    }

    /// Frees the regions with no block and no mapping.
    fn free_empty_regions(&self) {
        let cu = self.chunk_units;
        let mut st = lock(&self.state);
        let mut gone = Vec::new();
        let mut i = 0;
        while i < st.regions.len() {
            let r = &st.regions[i];
            let (first, units, va) = (r.first, r.units, r.va);
            let empty = st.free.len_at(first) == Some(units)
                && (first / cu..(first + units) / cu)
                    .all(|c| st.chunks[c].handle.is_none() && !st.chunks[c].busy);
            if !empty {
                i += 1;
                continue;
            }
            self.take_run(&mut st, first);
            st.regions.remove(i);
            gone.push((va, units * self.unit));
        }
        unlock(st);
        for (va, bytes) in gone {
            // SAFETY: the range came from reserve, nothing is mapped in it, and it was
            // forgotten above (no block can be placed there again).
            if let Err(e) = unsafe { self.phys.free_range(va, bytes) } {
                record_drop_error("cuMemAddressFree", e);
            }
        }
    }

    /// Gives everything back, at the backend's drop: trims to 0, then releases the
    /// handles of chunks still mapped (blocks still live, or stuck; the driver frees them
    /// once unmapped).
    pub(crate) fn shutdown(&self, b: &B) {
        self.trim_to(b, 0);
        let mut st = lock(&self.state);
        let s = &mut *st;
        s.dead.extend(s.clocks.drain().map(|(_, c)| c.stream));
        // A handle may be mapped at two chunks (its own and a retired one): released once.
        let mut handles: std::collections::BTreeSet<u64> = s.spare.drain(..).collect();
        handles.extend(s.chunks.iter_mut().filter_map(|c| c.handle.take()));
        unlock(st);
        for h in handles {
            // SAFETY: the pool is being dropped: nothing allocates from it again; a
            // handle released while mapped is freed by the driver at its unmap.
            if let Err(e) = unsafe { self.phys.release(h) } {
                record_drop_error("cuMemRelease", e);
            }
        }
    }

    /// Lets device `peer` access every block, present and future: every later mapping
    /// includes it at once, then access is set on every mapped chunk (span by span)
    /// without the lock, while no chunk is unmapped; allocations mapping meanwhile grant
    /// it themselves. On an error the peer is not recorded (some chunks may have access
    /// already).
    pub(crate) fn enable_peer(&self, peer: usize) -> Result<()> {
        let spans = {
            let mut st = lock(&self.state);
            if st.granted.contains(&peer) {
                return Ok(());
            }
            if !st.peers.contains(&peer) {
                st.peers.push(peer);
            }
            st.granting += 1;
            self.mapped_spans(&st)
        };
        let (mut ns, mut calls) = (0, 0);
        let mut result = Ok(());
        for (va, bytes) in spans {
            calls += 1;
            // SAFETY: a span of mapped chunks, none busy: no chunk is unmapped while
            // `granting` is set.
            result = timed(&mut ns, || unsafe { self.phys.set_access(va, bytes, &[peer]) });
            if result.is_err() {
                break;
            }
        }
        let mut st = lock(&self.state);
        st.granting -= 1;
        st.stats.accesses += calls;
        st.stats.driver_ns[ACCESS] += ns;
        match &result {
            Ok(()) => st.granted.push(peer),
            Err(_) => st.peers.retain(|&p| p != peer),
        }
        result
    }

    /// The spans of consecutive mapped chunks that no operation is unmapping (never
    /// across regions: a chunk of the index space between regions is never mapped).
    fn mapped_spans(&self, st: &State<B>) -> Vec<(u64, usize)> {
        let mapped = |c: usize| st.chunks[c].handle.is_some() && !st.chunks[c].busy;
        let mut spans = Vec::new();
        let mut c = 0;
        while c < st.chunks.len() {
            if !mapped(c) {
                c += 1;
                continue;
            }
            let from = c;
            while c < st.chunks.len() && mapped(c) {
                c += 1;
            }
            spans.push((
                self.va_of(st, from * self.chunk_units),
                (c - from) * self.chunk_bytes(),
            ));
        }
        spans
    }
}
