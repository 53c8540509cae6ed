//! The page heap's stream clocks: what it knows of the frees of each stream (which
//! completed, the marks recorded after them), and the questions it asks the driver about
//! them. A question is asked with the heap's lock dropped: snapshot under the lock
//! ([`Ask::of`]), the driver calls without it ([`Ask::settle`], [`Ask::order`],
//! [`Ask::wait_host`]), the answer applied under the lock again ([`Answer::apply`]).
//! An answer only ever moves a clock forward, so answers that arrive in any order, or
//! for a clock forgotten meanwhile, are sound.

use std::collections::{HashMap, VecDeque};

use crate::cuda::{record_drop_error, StreamId};
use crate::device::order::StreamOrder;
use crate::error::Result;
use crate::sync::Arc;

/// Frees of units by one stream, as a free run remembers them: the sequence number of
/// the latest (under the heap's lock, so in the stream's order) and the hull of the units
/// the frees it stands for touched. No driver call is made at a free: a mark (an event)
/// is recorded on the stream only when another stream takes the units while the work may
/// be pending, and one mark then covers every free of the stream so far ([`Clock`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Freed {
    pub(super) stream: StreamId,
    pub(super) seq: u64,
    pub(super) lo: usize,
    pub(super) hi: usize,
}

/// The frees a free run remembers: the latest of each stream not known to have completed.
pub(super) type Stamps = Vec<Freed>;

/// What the heap knows of one stream's frees: which completed, and the marks recorded on
/// it that cover the others. `done <= freed`; every free numbered up to `done` completed.
pub(super) struct Clock<B: StreamOrder> {
    /// A live handle, to record marks on and to ask whether its work completed.
    pub(super) stream: B::Stream,
    /// The latest free on the stream.
    pub(super) freed: u64,
    /// Every free of the stream numbered up to this has completed.
    pub(super) done: u64,
    /// Marks recorded on the stream, by the number of the latest free each was recorded
    /// after (ascending, all above `done`); shared with questions asked outside the lock.
    pub(super) marks: VecDeque<(u64, Arc<B::Mark>)>,
}

/// The clocks of the streams that freed here with work that may be pending.
pub(super) type Clocks<B> = HashMap<StreamId, Clock<B>>;

/// Numbers free `seq` of `stream` on its clock (made if the stream has none); its id.
pub(super) fn note_free<B: StreamOrder>(clocks: &mut Clocks<B>, stream: &B::Stream, seq: u64) -> StreamId {
    let id = B::stream_id(stream);
    clocks
        .entry(id)
        .or_insert_with(|| Clock {
            stream: stream.clone(),
            freed: seq,
            // A stream without a clock has no free pending (see `completed`).
            done: seq - 1,
            marks: VecDeque::new(),
        })
        .freed = seq;
    id
}

/// One rule for a failed query (of a mark, or of a stream's work): the work counts as
/// pending, so the memory it may touch is never handed out or unmapped on that answer.
pub(super) fn completed<B: StreamOrder>(clocks: &Clocks<B>, f: &Freed) -> bool {
    // A stream without a clock has no free pending: clocks go only once all completed.
    clocks.get(&f.stream).is_none_or(|c| f.seq <= c.done)
}

/// What is known of a set of frees, in an operation that asked the driver about the
/// streams `asked` already (at most once a stream).
pub(super) enum Known {
    /// All completed.
    Done,
    /// One may be pending, and its stream was asked about in this operation.
    Pending,
    /// The first that may be pending, its stream not asked about yet.
    Ask(Freed),
}

/// What is known of `frees` (looked at in order, as a wait for all would).
pub(super) fn known<B: StreamOrder>(clocks: &Clocks<B>, frees: &Stamps, asked: &[StreamId]) -> Known {
    match frees.iter().find(|f| !completed(clocks, f)) {
        None => Known::Done,
        Some(f) if asked.contains(&f.stream) => Known::Pending,
        Some(f) => Known::Ask(*f),
    }
}

/// Adds `from` to `into`, keeping the latest free of each stream (with the hull of both
/// ranges: waiting for the later free waits for the earlier) and dropping those known
/// complete.
pub(super) fn merge<B: StreamOrder>(clocks: &Clocks<B>, into: &mut Stamps, from: Stamps) {
    into.retain(|s| !completed(clocks, s));
    for s in from {
        if completed(clocks, &s) {
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

/// A question about one stream's frees, snapshot under the heap's lock and asked
/// without it.
pub(super) struct Ask<B: StreamOrder> {
    id: StreamId,
    stream: B::Stream,
    /// The free the asker needs completed.
    seq: u64,
    /// The stream's latest free at the snapshot: a mark recorded now, or an idle answer,
    /// covers every free up to it.
    freed: u64,
    /// The stream's marks at the snapshot, oldest first.
    marks: Vec<(u64, Arc<B::Mark>)>,
    /// Whether the driver may be queried (its stream not yet asked in this operation).
    query: bool,
}

/// What the driver said: frees up to `done` completed; a mark recorded (by the free it
/// covers); whether a stream was made to wait; whether a host wait failed.
pub(super) struct Answer<B: StreamOrder> {
    id: StreamId,
    done: u64,
    mark: Option<(u64, Arc<B::Mark>)>,
    pub(super) waited: bool,
    pub(super) failed: bool,
}

impl<B: StreamOrder> Ask<B> {
    /// The question whether free `f` completed (none if it is known to have); `query`:
    /// whether the driver may be asked whether it did, else only what to wait for.
    pub(super) fn of(clocks: &Clocks<B>, f: &Freed, query: bool) -> Option<Self> {
        if completed(clocks, f) {
            return None;
        }
        let c = clocks.get(&f.stream)?;
        Some(Self {
            id: f.stream,
            stream: c.stream.clone(),
            seq: f.seq,
            freed: c.freed,
            marks: c.marks.iter().map(|(s, m)| (*s, m.clone())).collect(),
            query,
        })
    }

    /// The stream this question is about.
    pub(super) fn stream_id(&self) -> StreamId {
        self.id
    }

    fn answer(&self) -> Answer<B> {
        Answer {
            id: self.id,
            done: 0,
            mark: None,
            waited: false,
            failed: false,
        }
    }

    /// Asks whether the free completed, never blocking: the stream's oldest marks, and
    /// only without a pending one, whether the stream is idle. A failed query counts as
    /// pending.
    pub(super) fn settle(&self, order: &B) -> Answer<B> {
        let mut ans = self.answer();
        self.query(order, &mut ans);
        ans
    }

    fn query(&self, order: &B, ans: &mut Answer<B>) -> bool {
        if !self.query {
            return false;
        }
        for (seq, m) in &self.marks {
            if !matches!(order.is_complete(m), Ok(true)) {
                // A pending mark means pending work: the stream is not asked.
                return self.seq <= ans.done;
            }
            ans.done = ans.done.max(*seq);
        }
        if self.seq > ans.done && matches!(order.is_idle(&self.stream), Ok(true)) {
            ans.done = self.freed;
        }
        self.seq <= ans.done
    }

    /// Makes work queued on `on` from now on run after the free: nothing if it completed,
    /// else a wait (no host wait) for the first mark recorded after it, recorded now if
    /// there is none (covering every free of the stream so far).
    pub(super) fn order(&self, order: &B, on: &B::Stream) -> Result<Answer<B>> {
        let mut ans = self.answer();
        if self.query(order, &mut ans) {
            return Ok(ans);
        }
        let mark = match self.marks.iter().find(|(s, _)| *s >= self.seq) {
            Some((_, m)) => m.clone(),
            None => {
                let m = Arc::new(order.mark(&self.stream)?);
                ans.mark = Some((self.freed, m.clone()));
                m
            }
        };
        order.wait(on, &mark)?;
        ans.waited = true;
        Ok(ans)
    }

    /// Waits on the host until the free completed (the first mark after it, else the
    /// whole stream); a failed wait is counted and leaves the work pending.
    pub(super) fn wait_host(&self, order: &B) -> Answer<B> {
        let mut ans = self.answer();
        if self.query(order, &mut ans) {
            return ans;
        }
        let waited = match self.marks.iter().find(|(s, _)| *s >= self.seq) {
            Some((s, m)) => order.wait_host(m).map(|()| *s),
            None => order.synchronize(&self.stream).map(|()| self.freed),
        };
        match waited {
            Ok(seq) => ans.done = ans.done.max(seq),
            Err(e) => {
                record_drop_error("waiting for a page block's frees", e);
                ans.failed = true;
            }
        }
        ans
    }
}

impl<B: StreamOrder> Answer<B> {
    /// Whether a mark was recorded.
    pub(super) fn marked(&self) -> bool {
        self.mark.is_some()
    }

    /// Moves the stream's clock forward by this answer; marks that go (covered, or of a
    /// clock forgotten meanwhile) are put in `dead`, to be dropped after the lock.
    pub(super) fn apply(self, clocks: &mut Clocks<B>, dead: &mut Vec<Arc<B::Mark>>) {
        let Some(c) = clocks.get_mut(&self.id) else {
            dead.extend(self.mark.map(|(_, m)| m));
            return;
        };
        c.done = c.done.max(self.done).min(c.freed);
        if let Some((seq, m)) = self.mark {
            let i = c.marks.partition_point(|(s, _)| *s <= seq);
            c.marks.insert(i, (seq, m));
        }
        while c.marks.front().is_some_and(|(s, _)| *s <= c.done) {
            dead.extend(c.marks.pop_front().map(|(_, m)| m));
        }
    }
}
