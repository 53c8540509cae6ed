//! Mapping the chunks of a new block, with no lock held across a driver call: under the
//! lock the heap decides where each unmapped chunk's handle comes from (a spare one, an
//! idle chunk's, a retired one, or a new one) and marks the chunk busy; without it, it
//! unmaps, creates, maps and sets access ([`Job`]s); under the lock again it publishes
//! what was done, or rolls back what failed (the handles to the spares, the chunks
//! unmapped). A block whose chunk another allocation is mapping waits for that one
//! alone; blocks that fit in mapped memory never wait.

use super::clocks::{known, merge, retag, Ask, Freed, Known, Stamps};
use super::state::{unlock, State};
use super::{timed, PageHeap, ACCESS, CREATE, MAP, RECLAIM_TRIES, UNMAP};
use crate::cuda::{record_drop_error, StreamId};
use crate::device::order::StreamOrder;
use crate::device::phys::Phys;
use crate::error::{Error, Result};
use crate::sync::{lock, wait, MutexGuard};
use crate::trace::Code;

/// Where the handle of a chunk to map comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// A spare handle (mapped nowhere).
    Spare,
    /// A new one (`cuMemCreate`; its bytes already charged to the reservations).
    Create,
    /// An idle chunk whose work completed, unmapped first (carved out and busy).
    Moved { from: usize, va: u64 },
    /// An idle chunk whose work may be pending: its old mapping retired meanwhile.
    Retired,
}

/// What became of a job.
enum Outcome {
    Pending,
    Mapped,
    /// The source could not be unmapped: the chunk needs another handle.
    Retry,
    Failed(Error),
    /// Mapped, but access failed and so did the unmap: the mapping stays, stuck.
    Stuck(Error),
}

/// One chunk to map: planned under the lock, run without it.
struct Job {
    chunk: usize,
    va: u64,
    source: Source,
    handle: Option<u64>,
    created: bool,
    /// Whether a `Moved` source was unmapped.
    unmapped: bool,
    outcome: Outcome,
}

/// A handle's source, with the frees its earlier work was for; or a free whose stream
/// must be asked about first.
enum Got {
    Handle(Source, Option<u64>, Stamps),
    Ask(Freed),
}

/// One round of planning: the jobs; whether other allocations map chunks of the block;
/// the error that stopped it; the free to ask about before going on.
#[derive(Default)]
struct Round {
    jobs: Vec<Job>,
    others: bool,
    failed: Option<Error>,
    ask: Option<Freed>,
}

impl Job {
    fn new(chunk: usize, va: u64, source: Source, handle: Option<u64>) -> Self {
        Self {
            chunk,
            va,
            source,
            handle,
            created: false,
            unmapped: false,
            outcome: Outcome::Pending,
        }
    }
}

/// Driver time and calls of one round of jobs, added to the stats under the lock.
#[derive(Default)]
struct Tally {
    ns: [u64; 5],
    accesses: u64,
}

impl<P: Phys, B: StreamOrder> PageHeap<P, B> {
    /// Maps every chunk of units `start..start + n` (taken for a block) that is not,
    /// adding to `after` the frees that the handles' earlier work was for (`asked`: the
    /// streams this allocation asked the driver about). Rounds of plan (locked), run
    /// (unlocked: the jobs and at most one question about a stream), publish (locked)
    /// until none is left; chunks that other allocations map are waited for.
    pub(super) fn map_block(
        &self,
        b: &B,
        start: usize,
        n: usize,
        after: &mut Stamps,
        asked: &mut Vec<StreamId>,
    ) -> Result<()> {
        let mut oom: Option<Error> = None;
        let mut st = lock(&self.state);
        loop {
            let mut round = self.plan_jobs(&mut st, start, n, &oom, after, asked);
            let question = round.ask.and_then(|f| {
                asked.push(f.stream);
                Ask::of(&st.clocks, &f, true)
            });
            if round.jobs.is_empty() && question.is_none() {
                if let Some(e) = round.failed {
                    return Err(e);
                }
                if !round.others {
                    return Ok(());
                }
                st = wait(&self.changed, st);
                continue;
            }
            let peers = st.peers.clone();
            drop(st);
            let answer = question.map(|q| q.settle(b));
            let tally = self.run_jobs(b, &mut round.jobs, &peers);
            st = lock(&self.state);
            self.apply(&mut st, answer.into_iter().collect());
            let err = self.publish(&mut st, round.jobs, tally);
            self.changed.notify_all();
            st = self.grant_late(st, start, n, &peers);
            match err.or(round.failed) {
                None => {}
                Some(e) if e.is_out_of_memory() && oom.is_none() => oom = Some(e),
                Some(e) => return Err(e),
            }
        }
    }

    /// Plans a job for every chunk of the run that is unmapped and not busy, until a
    /// handle's source needs a question to the driver or fails.
    fn plan_jobs(
        &self,
        st: &mut State<B>,
        start: usize,
        n: usize,
        oom: &Option<Error>,
        after: &mut Stamps,
        asked: &[StreamId],
    ) -> Round {
        let mut round = Round::default();
        for (c, _) in self.chunks_of(start, n) {
            let ch = &st.chunks[c];
            if ch.handle.is_some() {
                continue;
            }
            if ch.busy {
                round.others = true;
                continue;
            }
            let (source, handle, pending) = match self.source(st, oom, asked) {
                Ok(Got::Handle(source, handle, pending)) => (source, handle, pending),
                Ok(Got::Ask(f)) => {
                    round.ask = Some(f);
                    return round;
                }
                Err(e) => {
                    round.failed = Some(e);
                    return round;
                }
            };
            let first = c * self.chunk_units;
            if !pending.is_empty() {
                // The handle's old work may touch any part of it: the free units of the
                // chunk pass its frees on too.
                let pending = retag(pending, first, first + self.chunk_units);
                self.stamp_free(st, first, first + self.chunk_units, &pending);
                merge(&st.clocks, after, pending);
            }
            st.chunks[c].busy = true;
            let va = self.va_of(st, first);
            round.jobs.push(Job::new(c, va, source, handle));
        }
        round
    }

    /// A handle for a chunk, with the frees its previous users' work was for: a spare
    /// one; while idle chunks exceed the allowance, an idle chunk's; a new one (charged to
    /// the reservations now, made without the lock); at the limit, or after the device
    /// ran out of memory (`oom`), any idle chunk's. Or a stream to ask about first.
    fn source(&self, st: &mut State<B>, oom: &Option<Error>, asked: &[StreamId]) -> Result<Got> {
        if let Some(h) = st.spare.pop() {
            return Ok(Got::Handle(Source::Spare, Some(h), Vec::new()));
        }
        if let Some(e) = oom {
            return self.reclaim(st, usize::MAX, asked).ok_or_else(|| e.clone());
        }
        // Idle chunks stay mapped for the blocks that fit there, up to an allowance;
        // beyond it one is moved (its work completed, else pending) before new memory is
        // made. Moving costs an unmap and a map where making costs a map: an allowance of
        // none would move chunks back and forth (on the H200, 20 s for RMM's workload).
        if self.idle_over_allowance(st) {
            if let Some(got) = self.reclaim(st, RECLAIM_TRIES, asked) {
                return Ok(got);
            }
        }
        match self.reservations.take(self.chunk_bytes()) {
            Ok(()) => Ok(Got::Handle(Source::Create, None, Vec::new())),
            // At the pool's limit: only an idle chunk can serve (the cache's recovery
            // runs next).
            Err(e) => self.reclaim(st, usize::MAX, asked).ok_or(e),
        }
    }

    /// Takes the handle of an idle chunk (trying at most `tries`, from the highest
    /// address): the first whose work completed, to unmap (not while a peer's access is
    /// being set), else the first pending one, its old mapping retired. A chunk whose
    /// frees' stream was not asked about yet stops the search: asked first.
    fn reclaim(&self, st: &mut State<B>, tries: usize, asked: &[StreamId]) -> Option<Got> {
        let mut below = usize::MAX;
        let mut pending = None;
        for _ in 0..tries {
            let Some(&c) = st.idle.range(..below).next_back() else {
                break;
            };
            below = c;
            match known(&st.clocks, &self.pending_at(st, c), asked) {
                Known::Ask(f) => return Some(Got::Ask(f)),
                Known::Pending => pending = pending.or(Some(c)),
                Known::Done if st.granting > 0 => {}
                Known::Done => {
                    let h = st.chunks[c].handle?;
                    self.carve(st, c);
                    st.chunks[c].busy = true;
                    let va = self.va_of(st, c * self.chunk_units);
                    return Some(Got::Handle(Source::Moved { from: c, va }, Some(h), Vec::new()));
                }
            }
        }
        let c = pending?;
        let h = st.chunks[c].handle?;
        // Carved out of its run: its units stay mapped, out of use, until the frees'
        // marks complete (`poll`).
        let mine = self.carve(st, c);
        st.retired.push((c, mine.clone()));
        Some(Got::Handle(Source::Retired, Some(h), mine))
    }

    /// Runs the jobs (sorted by chunk) without the lock: each chunk's source unmapped or
    /// its handle created, then mapped; one access call per span of consecutive chunks
    /// mapped (unmapped again if it fails).
    fn run_jobs(&self, b: &B, jobs: &mut [Job], peers: &[usize]) -> Tally {
        let mut tally = Tally::default();
        for job in jobs.iter_mut() {
            self.run_job(b, job, &mut tally);
        }
        let mut i = 0;
        while i < jobs.len() {
            if !matches!(jobs[i].outcome, Outcome::Mapped) {
                i += 1;
                continue;
            }
            let from = i;
            while i + 1 < jobs.len()
                && matches!(jobs[i + 1].outcome, Outcome::Mapped)
                && jobs[i + 1].chunk == jobs[i].chunk + 1
            {
                i += 1;
            }
            i += 1;
            self.set_span_access(b, &mut jobs[from..i], peers, &mut tally);
        }
        tally
    }

    /// Unmaps the job's source or creates its handle, then maps it.
    fn run_job(&self, b: &B, job: &mut Job, tally: &mut Tally) {
        let cb = self.chunk_bytes();
        if let Source::Moved { va, .. } = job.source {
            // SAFETY: the idle chunk was mapped with a chunk's bytes; it is busy (no one
            // else maps, unmaps or hands out its units), and the frees of its units
            // completed (a run keeps the latest free of each stream until it completes).
            match timed(&mut tally.ns[UNMAP], || unsafe { self.phys.unmap(va, cb) }) {
                Ok(()) => {
                    job.unmapped = true;
                    b.trace().segment(Code::SegmentUnmap, va as usize, cb);
                }
                Err(e) => {
                    record_drop_error("cuMemUnmap", e);
                    job.handle = None;
                    job.outcome = Outcome::Retry;
                    return;
                }
            }
        }
        if job.handle.is_none() {
            match timed(&mut tally.ns[CREATE], || self.phys.create(cb)) {
                Ok(h) => (job.handle, job.created) = (Some(h), true),
                Err(e) => {
                    job.outcome = Outcome::Failed(e);
                    return;
                }
            }
        }
        let Some(h) = job.handle else { return };
        // SAFETY: the chunk lies in a reserved region, nothing is mapped there (no handle
        // is recorded for it, and it is busy: this job alone maps it); h is live, of a
        // chunk's bytes, and mapped nowhere (spare, just unmapped, or new) or only at a
        // retired chunk whose work the allocation is ordered after.
        match timed(&mut tally.ns[MAP], || unsafe { self.phys.map(job.va, cb, h) }) {
            Ok(()) => {
                job.outcome = Outcome::Mapped;
                b.trace().segment(Code::SegmentMap, job.va as usize, cb);
            }
            Err(e) => job.outcome = Outcome::Failed(e),
        }
    }

    /// Sets access on a span of consecutive chunks just mapped; if that fails, unmaps
    /// them (their handles go to the spares at publishing, or the chunk stays stuck).
    fn set_span_access(&self, b: &B, span: &mut [Job], peers: &[usize], tally: &mut Tally) {
        let cb = self.chunk_bytes();
        let va = span[0].va;
        tally.accesses += 1;
        // SAFETY: the span's chunks are consecutive in one region and were all mapped
        // by these jobs.
        let access = timed(&mut tally.ns[ACCESS], || unsafe {
            self.phys.set_access(va, span.len() * cb, peers)
        });
        let Err(e) = access else { return };
        for job in span {
            // SAFETY: mapped by this job, and no work was queued on it.
            job.outcome = match unsafe { self.phys.unmap(job.va, cb) } {
                Ok(()) => {
                    b.trace().segment(Code::SegmentUnmap, job.va as usize, cb);
                    Outcome::Failed(e.clone())
                }
                Err(u) => {
                    record_drop_error("cuMemUnmap", u);
                    Outcome::Stuck(e.clone())
                }
            };
        }
    }

    /// Publishes a round of jobs: mapped chunks get their handles, failed ones give
    /// theirs to the spares, moved sources become unmapped free units; the first error.
    fn publish(&self, st: &mut State<B>, jobs: Vec<Job>, tally: Tally) -> Option<Error> {
        let cb = self.chunk_bytes();
        for (slot, ns) in st.stats.driver_ns.iter_mut().zip(tally.ns) {
            *slot += ns;
        }
        st.stats.accesses += tally.accesses;
        let mut err = None;
        for job in jobs {
            self.publish_source(st, &job);
            if job.created {
                st.stats.creates += 1;
                st.stats.reserved += cb;
                st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
            } else if job.source == Source::Create {
                self.reservations.give(cb);
            }
            let ch = &mut st.chunks[job.chunk];
            ch.busy = false;
            match job.outcome {
                Outcome::Mapped => {
                    ch.handle = job.handle;
                    st.stats.maps += 1;
                }
                Outcome::Stuck(e) => {
                    (ch.handle, ch.stuck) = (job.handle, true);
                    err = err.or(Some(e));
                }
                Outcome::Failed(e) => {
                    st.spare.extend(job.handle);
                    err = err.or(Some(e));
                }
                Outcome::Retry | Outcome::Pending => {}
            }
        }
        err
    }

    /// The source chunk of a moved handle: unmapped free units, or (its unmap failed)
    /// mapped units that are never unmapped again.
    fn publish_source(&self, st: &mut State<B>, job: &Job) {
        let Source::Moved { from, .. } = job.source else {
            return;
        };
        let ch = &mut st.chunks[from];
        ch.busy = false;
        if job.unmapped {
            ch.handle = None;
            st.stats.unmaps += 1;
        } else {
            ch.stuck = true;
        }
        self.give_back(st, from * self.chunk_units, self.chunk_units, Vec::new());
    }

    /// Gives the peers enabled while this round ran (`peers` its snapshot) access to the
    /// block's mapped chunks, with the lock dropped (no chunk of a live block is unmapped).
    fn grant_late<'a>(
        &'a self,
        st: MutexGuard<'a, State<B>>,
        start: usize,
        n: usize,
        peers: &[usize],
    ) -> MutexGuard<'a, State<B>> {
        let new: Vec<usize> = st.peers.iter().copied().filter(|p| !peers.contains(p)).collect();
        if new.is_empty() {
            return st;
        }
        let cb = self.chunk_bytes();
        let vas: Vec<u64> = self
            .chunks_of(start, n)
            .filter(|&(c, _)| st.chunks[c].handle.is_some() && !st.chunks[c].busy)
            .map(|(c, _)| self.va_of(&st, c * self.chunk_units))
            .collect();
        unlock(st);
        for va in vas {
            // SAFETY: a chunk of this (not yet returned) block, mapped.
            if let Err(e) = unsafe { self.phys.set_access(va, cb, &new) } {
                record_drop_error("cuMemSetAccess for a peer", e);
            }
        }
        lock(&self.state)
    }
}
