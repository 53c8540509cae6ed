//! Unit tests of the page heap's stream order, against a scripted [`StreamOrder`]: no
//! physical memory, no simulator. The tests that change clocks check the invariant of
//! `clocks.rs` as they go.

use super::*;
use crate::error::Error;
use crate::sync::global::{Arc, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::trace::Tag;

/// A scripted stream: work queued and completed so far, as positions.
struct Lane {
    id: StreamId,
    queued: AtomicU64,
    completed: AtomicU64,
}

#[derive(Clone)]
struct S(Arc<Lane>);

impl S {
    fn new() -> Self {
        S(Arc::new(Lane {
            id: StreamId::fresh(),
            queued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
        }))
    }
    /// Queues work that does not complete until [`S::finish`].
    fn busy(&self) -> &Self {
        self.0.queued.fetch_add(1, Ordering::Relaxed);
        self
    }
    fn finish(&self) {
        let q = self.0.queued.load(Ordering::Relaxed);
        self.0.completed.store(q, Ordering::Relaxed);
    }
}

/// A stream order answering from the lanes, counting the questions, and failing
/// every query and host wait while `failing`.
#[derive(Default)]
struct Script {
    failing: AtomicBool,
    queries: AtomicUsize,
    trace: Tag,
}

impl Script {
    fn queries(&self) -> usize {
        self.queries.load(Ordering::Relaxed)
    }
    fn answer<T>(&self, v: T) -> Result<T> {
        self.queries.fetch_add(1, Ordering::Relaxed);
        if self.failing.load(Ordering::Relaxed) {
            Err(Error::InvalidArgument("scripted driver failure"))
        } else {
            Ok(v)
        }
    }
}

impl StreamOrder for Script {
    type Stream = S;
    /// The lane and the position marked.
    type Mark = (Arc<Lane>, u64);
    fn stream_id(stream: &S) -> StreamId {
        stream.0.id
    }
    fn mark(&self, stream: &S) -> Result<Self::Mark> {
        Ok((stream.0.clone(), stream.0.queued.load(Ordering::Relaxed)))
    }
    fn wait(&self, _: &S, _: &Self::Mark) -> Result<()> {
        Ok(())
    }
    fn is_complete(&self, (lane, at): &Self::Mark) -> Result<bool> {
        self.answer(lane.completed.load(Ordering::Relaxed) >= *at)
    }
    fn wait_host(&self, (lane, at): &Self::Mark) -> Result<()> {
        self.answer(())?;
        lane.completed.fetch_max(*at, Ordering::Relaxed);
        Ok(())
    }
    fn is_idle(&self, s: &S) -> Result<bool> {
        self.answer(s.0.completed.load(Ordering::Relaxed) >= s.0.queued.load(Ordering::Relaxed))
    }
    fn synchronize(&self, s: &S) -> Result<()> {
        self.answer(())?;
        s.finish();
        Ok(())
    }
    fn trace(&self) -> &Tag {
        &self.trace
    }
}

fn freed(stream: &S, seq: u64, lo: usize, hi: usize) -> Freed {
    Freed {
        stream: stream.0.id,
        seq,
        lo,
        hi,
    }
}

#[test]
fn merge_keeps_the_latest_free_of_each_stream_with_the_hull() {
    let (a, b) = (S::new(), S::new());
    let mut clocks = Clocks::<Script>::default();
    let f1 = clocks.number_free(&a, 0, 4);
    let f2 = clocks.number_free(&b, 5, 6);
    let f3 = clocks.number_free(&a, 10, 12);
    let mut into = vec![f1];
    clocks.merge(&mut into, vec![f3, f2]);
    assert_eq!(into, vec![freed(&a, 3, 0, 12), freed(&b, 2, 5, 6)]);
    clocks.check();
}

/// Learns what completed of every stream with frees that may be pending, as an operation
/// of the heap reusing units of the latest free of each asks (without its lock).
fn refresh(clocks: &mut Clocks<Script>, order: &Script) {
    let asks: Vec<_> = (clocks.by_stream.iter())
        .filter(|(_, c)| c.done < c.freed)
        .filter_map(|(&id, c)| clocks.ask(id, c.freed))
        .collect();
    let answers: Vec<_> = asks.into_iter().map(|a| answer(order, a, None).0).collect();
    clocks.answered(answers);
}

/// Orders `taker` after `f`, as the heap's `order_taker` does: the marks recorded and the
/// waits made, and the first error.
fn ordered(clocks: &mut Clocks<Script>, order: &Script, taker: &S, f: &Freed) -> (u64, u64, Result<()>) {
    let (mut marks, mut waits, mut res) = (0, 0, Ok(()));
    let mut answers = Vec::new();
    for a in clocks.asks([f].into_iter()) {
        let (got, r) = answer(order, a, Some(taker));
        (marks, waits, res) = (marks + got.marks, waits + got.waits, res.and(r));
        answers.push(got);
    }
    clocks.answered(answers);
    (marks, waits, res)
}

#[test]
fn merge_drops_frees_known_complete() {
    let (a, b) = (S::new(), S::new());
    b.busy();
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let fa = clocks.number_free(&a, 0, 1);
    let fb = clocks.number_free(&b, 1, 2);
    refresh(&mut clocks, &order);
    assert!(clocks.completed(&fa), "a is idle");
    assert!(!clocks.completed(&fb), "b is busy");
    let mut into = vec![fa];
    clocks.merge(&mut into, vec![fa, fb]);
    assert_eq!(into, vec![fb]);
    clocks.check();
}

#[test]
fn touching_keeps_the_overlapping_and_retag_moves_them() {
    let a = S::new();
    let stamps = vec![freed(&a, 1, 0, 4), freed(&a, 2, 4, 8), freed(&a, 3, 8, 9)];
    assert_eq!(touching(&stamps, 3, 5), stamps[..2].to_vec());
    assert_eq!(touching(&stamps, 9, 12), Vec::new());
    assert_eq!(retag(touching(&stamps, 8, 9), 16, 32), vec![freed(&a, 3, 16, 32)]);
}

#[test]
fn a_refresh_asks_the_newest_mark_and_the_stream_only_without_a_pending_mark() {
    let (a, t) = (S::new(), S::new());
    a.busy();
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let f = clocks.number_free(&a, 0, 1);
    refresh(&mut clocks, &order);
    assert_eq!(order.queries(), 1, "no mark: the stream is asked");
    assert!(!clocks.completed(&f));
    assert_eq!(order_pair(ordered(&mut clocks, &order, &t, &f)), (1, 1));
    assert_eq!(order.queries(), 2);
    refresh(&mut clocks, &order);
    assert_eq!(order.queries(), 3, "the mark is asked, not the stream");
    assert!(!clocks.completed(&f));
    a.finish();
    refresh(&mut clocks, &order);
    assert_eq!(order.queries(), 4);
    assert!(clocks.completed(&f), "the mark completed");
    assert_eq!(
        clocks.take_dead().marks.len(),
        1,
        "the completed mark goes after the lock"
    );
    refresh(&mut clocks, &order);
    assert_eq!(order.queries(), 4, "nothing pending: nothing asked");
    clocks.check();
}

/// (marks, waits) of an [`ordered`] that must succeed.
fn order_pair((marks, waits, r): (u64, u64, Result<()>)) -> (u64, u64) {
    r.unwrap();
    (marks, waits)
}

#[test]
fn a_failed_query_counts_as_pending() {
    let (a, t) = (S::new(), S::new());
    let order = Script::default();
    order.failing.store(true, Ordering::Relaxed);
    let mut clocks = Clocks::<Script>::default();
    let f = clocks.number_free(&a, 0, 1);
    refresh(&mut clocks, &order);
    assert!(!clocks.completed(&f), "the stream is idle, but the query failed");
    assert_eq!(
        order_pair(ordered(&mut clocks, &order, &t, &f)),
        (1, 1),
        "ordered after the free"
    );
    refresh(&mut clocks, &order);
    assert!(!clocks.completed(&f), "the mark's query failed");
    order.failing.store(false, Ordering::Relaxed);
    refresh(&mut clocks, &order);
    assert!(clocks.completed(&f));
    clocks.check();
}

#[test]
fn one_mark_covers_every_free_of_its_stream_so_far() {
    let (a, t) = (S::new(), S::new());
    a.busy();
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let f1 = clocks.number_free(&a, 0, 1);
    let f2 = clocks.number_free(&a, 1, 2);
    assert_eq!(order_pair(ordered(&mut clocks, &order, &t, &f1)), (1, 1));
    assert_eq!(
        order_pair(ordered(&mut clocks, &order, &t, &f2)),
        (0, 1),
        "f2 waits for the mark of f1"
    );
    clocks.check();
    let f3 = clocks.number_free(&a, 2, 3);
    assert_eq!(
        order_pair(ordered(&mut clocks, &order, &t, &f3)),
        (1, 1),
        "a later free needs a new mark"
    );
    clocks.check();
}

#[test]
fn ordering_after_completed_work_records_nothing() {
    let (a, t) = (S::new(), S::new());
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let f = clocks.number_free(&a, 0, 1);
    assert_eq!(order_pair(ordered(&mut clocks, &order, &t, &f)), (0, 0));
    assert!(clocks.completed(&f), "learned on the way");
    clocks.check();
}

#[test]
fn marks_answered_late_keep_their_order_and_a_second_for_the_same_free_goes() {
    let (a, t) = (S::new(), S::new());
    a.busy();
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let f1 = clocks.number_free(&a, 0, 1);
    // Two takers asked before either answer came back: both record a mark for free 1.
    let asks1 = clocks.asks([&f1].into_iter());
    let asks2 = clocks.asks([&f1].into_iter());
    let f2 = clocks.number_free(&a, 1, 2);
    let asks3 = clocks.asks([&f2].into_iter());
    let answer_all = |asks: Vec<Ask<Script>>| -> Vec<Answer<Script>> {
        asks.into_iter().map(|q| answer(&order, q, Some(&t)).0).collect()
    };
    let (x1, x2, x3) = (answer_all(asks1), answer_all(asks2), answer_all(asks3));
    // The later free's mark is answered first.
    clocks.answered(x3);
    clocks.answered(x1);
    clocks.check();
    clocks.answered(x2);
    clocks.check();
    assert_eq!(
        clocks.take_dead().marks.len(),
        1,
        "the second mark of free 1 goes"
    );
    assert_eq!(clocks.by_stream[&a.0.id].marks.len(), 2);
}

#[test]
fn a_host_wait_completes_the_frees_numbered_before_it_and_no_later_one() {
    let (a, b, t) = (S::new(), S::new(), S::new());
    a.busy();
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let f1 = clocks.number_free(&a, 0, 1);
    let f2 = clocks.number_free(&a, 1, 2);
    let done = clocks.number_free(&b, 2, 3);
    refresh(&mut clocks, &order);
    assert!(clocks.completed(&done), "b is idle");
    order_pair(ordered(&mut clocks, &order, &t, &f1));
    let pending = clocks.pending();
    assert_eq!(pending.len(), 1, "only a has frees that may be pending");
    let (stream, seq) = &pending[0];
    assert_eq!((stream.0.id, *seq), (a.0.id, f2.seq));
    // Freed after the wait began: not covered by it.
    let f3 = clocks.number_free(&a, 3, 4);
    order.synchronize(stream).unwrap();
    clocks.completed_to(Script::stream_id(stream), *seq);
    assert!(clocks.completed(&f1) && clocks.completed(&f2));
    assert!(!clocks.completed(&f3), "f3 came after the wait");
    clocks.check();
    assert_eq!(clocks.pending().len(), 1, "f3 is still pending");
}

#[test]
fn forget_keeps_the_clocks_of_streams_with_pending_frees() {
    let (a, b, c) = (S::new(), S::new(), S::new());
    c.busy();
    let order = Script::default();
    let mut clocks = Clocks::<Script>::default();
    let fs: Vec<Freed> = [&a, &b, &c].iter().map(|s| clocks.number_free(s, 0, 1)).collect();
    refresh(&mut clocks, &order);
    clocks.forget(3);
    assert!(clocks.take_dead().streams.is_empty(), "at most 3 clocks are kept");
    clocks.forget(0);
    assert_eq!(clocks.take_dead().streams.len(), 2);
    assert!(
        fs[..2].iter().all(|f| clocks.completed(f)),
        "no clock, nothing pending"
    );
    assert!(!clocks.completed(&fs[2]), "c's clock stays");
    clocks.forget_all();
    assert_eq!(clocks.take_dead().streams.len(), 1);
    clocks.check();
}
