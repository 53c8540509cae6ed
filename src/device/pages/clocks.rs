//! The page heap's stream order: what each stream that freed units here has completed,
//! the stamps a free run keeps of the frees that touched it, and the driver questions
//! (query a mark, query a stream, record a mark, wait) asked about them. No memory here:
//! the heap decides which stamps a run keeps; [`Clocks`] answers whether their work may
//! be pending and orders a taker after it. Tested on its own below, with a scripted
//! [`StreamOrder`] (no physical memory, no simulator).
//!
//! The driver is asked with the heap's lock let go, in three steps: under the lock,
//! [`Clocks::asks`] (or [`Clocks::ask`]) copies what a question needs ([`Ask`]: the
//! stream, its latest free, its marks shared by reference count); without it, [`answer`]
//! queries, records a mark and makes a taker wait; under the lock again,
//! [`Clocks::answered`] keeps what was learned ([`Answer`]). What is learned only ever
//! grows `done` (a mark recorded, or a stream found idle, after the lock was let go still
//! covers every free numbered before), so answers arriving late or in any order are safe.
//!
//! Invariant, per [`Clock`]: `done <= freed <= seq` (the heap's latest number), and the
//! marks are in strictly increasing order of number, each in `done + 1..=freed`. A
//! stream without a clock has no free that may be pending: a clock goes only once
//! `done == freed` with no mark left ([`Clocks::forget`]). A failed query or wait is
//! never taken for completion.

use std::collections::{HashMap, VecDeque};

use crate::cuda::StreamId;
use crate::device::order::StreamOrder;
use crate::error::Result;
use crate::sync::global::Arc;

/// Frees of units by one stream, as a free run remembers them: the sequence number of
/// the latest (under the heap's lock, so in the stream's order) and the hull of the units
/// the frees it stands for touched. No driver call is made at a free: a mark (an event)
/// is recorded on the stream only when another stream takes the units while the work may
/// be pending, and one mark then covers every free of the stream so far ([`Clock`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Freed {
    pub(super) stream: StreamId,
    pub(super) seq: u64,
    pub(super) lo: usize,
    pub(super) hi: usize,
}

/// The frees a free run remembers: the latest of each stream not known to have completed.
pub(super) type Stamps = Vec<Freed>;

/// The stamps of `stamps` whose frees touched units `lo..hi`.
pub(super) fn touching(stamps: &Stamps, lo: usize, hi: usize) -> Stamps {
    stamps
        .iter()
        .filter(|s| s.lo < hi && s.hi > lo)
        .copied()
        .collect()
}

/// `stamps` taken to stand for frees of units `lo..hi` (where their work may now touch).
pub(super) fn retag(mut stamps: Stamps, lo: usize, hi: usize) -> Stamps {
    for s in &mut stamps {
        (s.lo, s.hi) = (lo, hi);
    }
    stamps
}

/// What the heap knows of one stream's frees: which completed, and the marks recorded on
/// it that cover the others.
struct Clock<B: StreamOrder> {
    /// A live handle, to record marks on and to ask whether its work completed.
    stream: B::Stream,
    /// The latest free on the stream.
    freed: u64,
    /// Every free of the stream numbered up to this has completed.
    done: u64,
    /// Marks recorded on the stream, oldest first, each after every free up to its
    /// number (shared with the questions being asked about them).
    marks: VecDeque<(u64, Arc<B::Mark>)>,
}

/// The clocks of the streams that freed units here with work that may be pending, with
/// the numbering of frees and of heap operations. See the [module docs](self).
pub(super) struct Clocks<B: StreamOrder> {
    by_stream: HashMap<StreamId, Clock<B>>,
    /// The latest free's sequence number.
    seq: u64,
    /// What goes after the heap's lock ([`take_dead`](Self::take_dead)).
    dead: Dead<B>,
    /// Empty vectors kept for the next questions and answers (no allocation per taker).
    spare: (Vec<Ask<B>>, Vec<Answer<B>>),
}

/// Handles of streams whose clocks went and marks no longer needed, dropped after the
/// heap's lock (the last handle of an owned stream destroys it, and a mark beyond the
/// event pool's idle ones is destroyed: driver calls).
pub(super) struct Dead<B: StreamOrder> {
    pub(super) streams: Vec<B::Stream>,
    marks: Vec<Arc<B::Mark>>,
}

impl<B: StreamOrder> Default for Dead<B> {
    fn default() -> Self {
        Self {
            streams: Vec::new(),
            marks: Vec::new(),
        }
    }
}

impl<B: StreamOrder> Default for Clocks<B> {
    fn default() -> Self {
        Self {
            by_stream: HashMap::new(),
            seq: 0,
            dead: Dead::default(),
            spare: (Vec::new(), Vec::new()),
        }
    }
}

/// A question for the driver about one stream's frees, asked with the heap's lock let go
/// ([`answer`]).
pub(super) struct Ask<B: StreamOrder> {
    id: StreamId,
    stream: B::Stream,
    /// The stream's latest free when asked.
    freed: u64,
    /// The free to know complete, or to order a taker after.
    need: u64,
    /// The mark to ask first: the first after `need` if there is one (to wait for),
    /// else the newest; and whether it is the newest (a stream with a mark pending is
    /// not asked whether it is idle).
    probe: Option<(u64, Arc<B::Mark>)>,
    newest: bool,
    /// The oldest mark, asked when the probe is pending (so that completed marks go).
    oldest: Option<(u64, Arc<B::Mark>)>,
}

/// What the driver answered about one stream: every free up to `done` completed (0:
/// nothing learned), and the mark recorded (with the free it covers), if one was.
pub(super) struct Answer<B: StreamOrder> {
    id: StreamId,
    done: u64,
    mark: Option<(u64, Arc<B::Mark>)>,
    /// Marks recorded and waits made.
    pub(super) marks: u64,
    pub(super) waits: u64,
}

impl<B: StreamOrder> Answer<B> {
    /// No mark recorded and no wait made: what it taught is only what completed.
    pub(super) fn plain(&self) -> bool {
        self.marks == 0 && self.waits == 0
    }
}

/// Asks the driver about `ask`'s stream (with no lock held): its probe mark (and, if that
/// is pending, its oldest mark), then, with no mark pending, whether the stream is idle.
/// With a `taker`, if the free needed may still be pending, makes it wait (no host wait)
/// for the first mark after that free, recorded now if there is none (it covers every
/// free of its stream so far). A failed query counts as pending; a failed record or wait
/// is the error.
pub(super) fn answer<B: StreamOrder>(
    b: &B,
    ask: Ask<B>,
    taker: Option<&B::Stream>,
) -> (Answer<B>, Result<()>) {
    let mut a = Answer {
        id: ask.id,
        done: learn(b, &ask),
        mark: None,
        marks: 0,
        waits: 0,
    };
    let waited = match taker.filter(|_| a.done < ask.need) {
        Some(taker) => wait_after(b, &ask, taker, &mut a),
        None => Ok(()),
    };
    (a, waited)
}

/// What the driver says completed of `ask`'s stream: every free up to the number
/// returned (0: nothing learned).
fn learn<B: StreamOrder>(b: &B, ask: &Ask<B>) -> u64 {
    let complete = |m: &Arc<B::Mark>| matches!(b.is_complete(m), Ok(true));
    let mut done = 0;
    let probe_pending = match &ask.probe {
        Some((seq, m)) if complete(m) => {
            done = *seq;
            false
        }
        Some(_) => true,
        None => false,
    };
    if probe_pending {
        // The oldest mark (if it is not the probe), so that completed marks go.
        let other = |(s, _): &&(u64, Arc<B::Mark>)| ask.probe.as_ref().is_some_and(|p| p.0 != *s);
        if let Some((seq, m)) = ask.oldest.as_ref().filter(other) {
            if complete(m) {
                done = *seq;
            }
        }
    }
    // A pending mark means pending work: only without one is the stream asked.
    let quiet = !probe_pending && (ask.newest || ask.probe.is_none());
    if quiet && done < ask.freed && matches!(b.is_idle(&ask.stream), Ok(true)) {
        done = ask.freed;
    }
    done
}

/// Makes `taker` wait (no host wait) for the first mark after the free `ask` needs,
/// recorded now if there is none (it covers every free of its stream so far, and goes to
/// `a` to be kept); counts the mark and the wait in `a`.
fn wait_after<B: StreamOrder>(b: &B, ask: &Ask<B>, taker: &B::Stream, a: &mut Answer<B>) -> Result<()> {
    let waited = match ask.probe.as_ref().filter(|(seq, _)| *seq >= ask.need) {
        Some((_, m)) => b.wait(taker, m),
        None => {
            let m = Arc::new(b.mark(&ask.stream)?);
            a.marks += 1;
            let w = b.wait(taker, &m);
            a.mark = Some((ask.freed, m));
            w
        }
    };
    a.waits += u64::from(waited.is_ok());
    waited
}

impl<B: StreamOrder> Clocks<B> {
    /// Numbers a free of units `lo..hi` on `stream` (under the heap's lock: the frees of
    /// one stream are numbered in its order). No driver call: another stream that takes
    /// these units first asks whether the work completed ([`Clocks::order_after`]).
    pub(super) fn number_free(&mut self, stream: &B::Stream, lo: usize, hi: usize) -> Freed {
        self.seq += 1;
        let seq = self.seq;
        let id = B::stream_id(stream);
        self.by_stream
            .entry(id)
            .or_insert_with(|| Clock {
                stream: stream.clone(),
                freed: seq,
                // A stream without a clock has no free pending (see `completed`).
                done: seq - 1,
                marks: VecDeque::new(),
            })
            .freed = seq;
        Freed {
            stream: id,
            seq,
            lo,
            hi,
        }
    }

    /// Whether the frees `f` stands for are known to have completed, without asking the
    /// driver. One rule for a failed query (of a mark, or of a stream's work): the work
    /// counts as pending, so the memory it may touch is never handed out or unmapped on
    /// that answer.
    pub(super) fn completed(&self, f: &Freed) -> bool {
        // A stream without a clock has no free pending: clocks go only once all completed.
        self.by_stream.get(&f.stream).is_none_or(|c| f.seq <= c.done)
    }

    /// Adds `from` to `into`, keeping the latest free of each stream (with the hull of
    /// both ranges: waiting for the later free waits for the earlier) and dropping those
    /// known complete.
    pub(super) fn merge(&self, into: &mut Stamps, from: Stamps) {
        into.retain(|s| !self.completed(s));
        for s in from {
            if self.completed(&s) {
                continue;
            }
            match into.iter_mut().find(|t| t.stream == s.stream) {
                Some(t) => {
                    let (lo, hi) = (t.lo.min(s.lo), t.hi.max(s.hi));
                    t.seq = t.seq.max(s.seq);
                    (t.lo, t.hi) = (lo, hi);
                }
                None => into.push(s),
            }
        }
    }

    /// The questions to order a taker after the frees of `stamps` (those of other
    /// streams) not known complete, one per stream ([`answer`] with the taker).
    pub(super) fn asks<'s>(&mut self, stamps: impl Iterator<Item = &'s Freed>) -> Vec<Ask<B>> {
        let mut asks = core::mem::take(&mut self.spare.0);
        asks.extend(
            stamps
                .filter(|f| !self.completed(f))
                .filter_map(|f| self.ask(f.stream, f.seq)),
        );
        asks
    }

    /// An empty vector for answers (kept from earlier questions).
    pub(super) fn answers(&mut self) -> Vec<Answer<B>> {
        core::mem::take(&mut self.spare.1)
    }

    /// Keeps the vectors of questions and answers, emptied, for the next ones.
    pub(super) fn recycle(&mut self, asks: Vec<Ask<B>>, answers: Vec<Answer<B>>) {
        // Drained by the caller: nothing is dropped here (no stream handle, no mark).
        debug_assert!(asks.is_empty() && answers.is_empty());
        self.spare = (asks, answers);
    }

    /// The question that learns whether the free `need` of stream `id` completed
    /// ([`answer`] without a taker), or orders a taker after it (with one); `None` for a
    /// stream without a clock (nothing of it pending).
    pub(super) fn ask(&self, id: StreamId, need: u64) -> Option<Ask<B>> {
        let c = self.by_stream.get(&id)?;
        let share = |(seq, m): &(u64, Arc<B::Mark>)| (*seq, m.clone());
        // The first mark after the free (marks are in order of number), else the newest.
        let at = c.marks.partition_point(|&(seq, _)| seq < need);
        let (probe, newest) = match c.marks.get(at) {
            Some(m) => (Some(share(m)), at + 1 == c.marks.len()),
            None => (c.marks.back().map(share), true),
        };
        Some(Ask {
            id,
            stream: c.stream.clone(),
            freed: c.freed,
            need,
            probe,
            newest,
            oldest: c.marks.front().map(share),
        })
    }

    /// Keeps what the driver answered: frees known complete, and marks recorded (in
    /// order, unless one covering the same free is kept already, or all it covers is
    /// known complete).
    pub(super) fn answered(&mut self, answers: impl IntoIterator<Item = Answer<B>>) {
        for a in answers {
            self.completed_to(a.id, a.done);
            let Some((seq, m)) = a.mark else { continue };
            let Some(c) = self.by_stream.get_mut(&a.id) else {
                self.dead.marks.push(m);
                continue;
            };
            let at = c.marks.partition_point(|&(s, _)| s < seq);
            if seq <= c.done || c.marks.get(at).is_some_and(|&(s, _)| s == seq) {
                self.dead.marks.push(m);
            } else {
                c.marks.insert(at, (seq, m));
            }
        }
    }

    /// The streams with frees not known to have completed, each with the number of its
    /// latest free: what a host wait made without the heap's lock (a trim's) synchronizes,
    /// and then reports with [`completed_to`](Self::completed_to).
    pub(super) fn pending(&self) -> Vec<(B::Stream, u64)> {
        self.by_stream
            .values()
            .filter(|c| c.done < c.freed)
            .map(|c| (c.stream.clone(), c.freed))
            .collect()
    }

    /// Records that every free of stream `id` up to `seq` completed (its work was waited
    /// for on the host); its marks up to there go.
    pub(super) fn completed_to(&mut self, id: StreamId, seq: u64) {
        let Some(c) = self.by_stream.get_mut(&id) else {
            return;
        };
        c.done = c.done.max(seq.min(c.freed));
        while c.marks.front().is_some_and(|&(s, _)| s <= c.done) {
            self.dead.marks.extend(c.marks.pop_front().map(|(_, m)| m));
        }
    }

    /// Forgets the clocks of streams whose frees all completed while there are more than
    /// `keep` clocks (their handles wait in [`take_dead`](Self::take_dead)).
    pub(super) fn forget(&mut self, keep: usize) {
        if self.by_stream.len() <= keep {
            return;
        }
        let gone: Vec<StreamId> = self
            .by_stream
            .iter()
            .filter(|(_, c)| c.done >= c.freed && c.marks.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(c) = self.by_stream.remove(&id) {
                self.dead.streams.push(c.stream);
            }
        }
    }

    /// Forgets every clock, pending or not (the heap is shutting down).
    pub(super) fn forget_all(&mut self) {
        for (_, c) in self.by_stream.drain() {
            self.dead.streams.push(c.stream);
            self.dead.marks.extend(c.marks.into_iter().map(|(_, m)| m));
        }
    }

    /// The handles of forgotten streams and the marks no longer needed, for the caller to
    /// drop after the heap's lock.
    pub(super) fn take_dead(&mut self) -> Dead<B> {
        core::mem::take(&mut self.dead)
    }

    /// Checks the invariant of the [module docs](self).
    #[cfg(test)]
    fn check(&self) {
        for (id, c) in &self.by_stream {
            assert!(
                c.done <= c.freed && c.freed <= self.seq,
                "{id:?}: done {} freed {}",
                c.done,
                c.freed
            );
            let mut last = c.done;
            for &(seq, _) in &c.marks {
                assert!(
                    last < seq && seq <= c.freed,
                    "{id:?}: a mark at {seq} after {last}"
                );
                last = seq;
            }
        }
    }
}

#[cfg(test)]
mod tests;
