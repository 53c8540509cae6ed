//! The page heap's stream order: what each stream that freed units here has completed,
//! the stamps a free run keeps of the frees that touched it, and the driver questions
//! (query a mark, query a stream, record a mark, wait) asked about them. No memory here:
//! the heap decides which stamps a run keeps; [`Clocks`] answers whether their work may
//! be pending and orders a taker after it. Tested on its own below, with a scripted
//! [`StreamOrder`] (no physical memory, no simulator).
//!
//! Invariant, per [`Clock`]: `done <= freed <= seq` (the heap's latest number), and the
//! marks are in strictly increasing order of number, each in `done + 1..=freed`. A
//! stream without a clock has no free that may be pending: a clock goes only once
//! `done == freed` with no mark left ([`Clocks::forget`]). A failed query or wait is
//! never taken for completion.

use std::collections::{HashMap, VecDeque};

use super::stats::PageStats;
use crate::cuda::StreamId;
use crate::device::order::StreamOrder;
use crate::error::Result;

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
    /// number.
    marks: VecDeque<(u64, B::Mark)>,
    /// The heap operation that last asked the driver about this stream (at most once an
    /// operation).
    asked: u64,
}

/// The clocks of the streams that freed units here with work that may be pending, with
/// the numbering of frees and of heap operations. See the [module docs](self).
pub(super) struct Clocks<B: StreamOrder> {
    by_stream: HashMap<StreamId, Clock<B>>,
    /// The latest free's sequence number.
    seq: u64,
    /// Heap operations so far (a stream is asked about at most once in one).
    op: u64,
    /// Handles of streams whose clocks went, dropped after the heap's lock (the last
    /// handle of an owned stream destroys it: a driver call).
    dead: Vec<B::Stream>,
}

impl<B: StreamOrder> Default for Clocks<B> {
    fn default() -> Self {
        Self {
            by_stream: HashMap::new(),
            seq: 0,
            op: 0,
            dead: Vec::new(),
        }
    }
}

impl<B: StreamOrder> Clocks<B> {
    /// Starts a heap operation: the driver may be asked about each stream once more.
    pub(super) fn begin_op(&mut self) {
        self.op += 1;
    }

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
                asked: 0,
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

    /// Whether the frees `f` stands for are known to have completed, asking the driver
    /// (the stream's oldest marks; without a pending mark, whether the stream is idle) at
    /// most once per stream and heap operation. A failed query counts as pending.
    pub(super) fn settle(&mut self, b: &B, f: &Freed) -> bool {
        if self.completed(f) {
            return true;
        }
        let op = self.op;
        let Some(c) = self.by_stream.get_mut(&f.stream) else {
            return true;
        };
        if c.asked == op {
            return false;
        }
        c.asked = op;
        // Marks of one stream complete in order.
        while let Some((seq, m)) = c.marks.front() {
            if !matches!(b.is_complete(m), Ok(true)) {
                break;
            }
            c.done = c.done.max(*seq);
            c.marks.pop_front();
        }
        // A pending mark means pending work: only without one is the stream asked.
        if f.seq > c.done && c.marks.is_empty() && matches!(b.is_idle(&c.stream), Ok(true)) {
            c.done = c.freed;
        }
        f.seq <= c.done
    }

    /// Makes work queued on `stream` from now on run after the work of the frees `f`
    /// stands for: nothing if it completed, else a wait (no host wait) for the first mark
    /// recorded after them, recorded now if there is none (it covers every free of its
    /// stream so far). Counts marks and waits in `stats`.
    pub(super) fn order_after(
        &mut self,
        b: &B,
        stream: &B::Stream,
        f: &Freed,
        stats: &mut PageStats,
    ) -> Result<()> {
        if self.settle(b, f) {
            return Ok(());
        }
        let Some(c) = self.by_stream.get_mut(&f.stream) else {
            return Ok(());
        };
        let i = match c.marks.iter().position(|&(seq, _)| seq >= f.seq) {
            Some(i) => i,
            None => {
                c.marks.push_back((c.freed, b.mark(&c.stream)?));
                stats.marks += 1;
                c.marks.len() - 1
            }
        };
        b.wait(stream, &c.marks[i].1)?;
        stats.waits += 1;
        Ok(())
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
            c.marks.pop_front();
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
                self.dead.push(c.stream);
            }
        }
    }

    /// Forgets every clock, pending or not (the heap is shutting down).
    pub(super) fn forget_all(&mut self) {
        self.dead.extend(self.by_stream.drain().map(|(_, c)| c.stream));
    }

    /// The handles of forgotten streams, for the caller to drop after the heap's lock.
    pub(super) fn take_dead(&mut self) -> Vec<B::Stream> {
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
