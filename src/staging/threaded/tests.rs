//! The pipelines' schedules (threaded, and the single-threaded split launch) against a
//! model of the ring (no driver): a buffer's last work completes when the host waits for
//! it, as a GPU that has not run it yet. A lease marked with `last_use_queued` gives the
//! ring a completion of its own (the upload's), which the ring's wait completes without
//! completing the rest of the batch.

use std::collections::VecDeque;

use super::*;
use crate::error::Result;
use crate::sync::global::{lock, Arc, AtomicBool, Mutex, Ordering};

/// A leased buffer of the model: dropped, it goes back to the ring (as a `Staged`).
struct FakeLease {
    index: usize,
    bytes: std::vec::Vec<u8>,
    home: Arc<Mutex<FakeState>>,
    /// `Staged::last_use_queued` was called: the ring waits for the upload only.
    early: AtomicBool,
}

impl FakeLease {
    /// As `Staged::last_use_queued`: the work queued so far (the upload) is the buffer's
    /// last use.
    fn last_use_queued(&self) {
        self.early.store(true, Ordering::SeqCst);
    }
}

/// A launched batch's completion in the model, and the ring's event for its buffer: the
/// same completion, or (after `last_use_queued`) the upload's, which stream order
/// completes with the batch.
struct FakeDone {
    done: Arc<AtomicBool>,
    upload: Arc<AtomicBool>,
}

impl core::ops::Deref for FakeLease {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl core::ops::DerefMut for FakeLease {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl Drop for FakeLease {
    fn drop(&mut self) {
        let bytes = core::mem::take(&mut self.bytes);
        lock(&self.home).free.push_back((self.index, bytes));
    }
}

/// The ring and its GPU: buffers free or leased, and the completion of each buffer's last
/// launched work (false until someone waits for it).
struct FakeRing {
    state: Arc<Mutex<FakeState>>,
}

struct FakeState {
    free: VecDeque<(usize, std::vec::Vec<u8>)>,
    /// The ring's event of each buffer.
    last_use: std::vec::Vec<Option<Arc<AtomicBool>>>,
    /// The completion of each buffer's last launched batch.
    last_batch: std::vec::Vec<Option<Arc<AtomicBool>>>,
    /// Every completion handed out, to check that none is left running.
    all: std::vec::Vec<Arc<AtomicBool>>,
}

impl FakeState {
    fn idle(&self, index: usize) -> bool {
        self.last_use[index]
            .as_ref()
            .is_none_or(|d| d.load(Ordering::SeqCst))
    }
}

impl FakeRing {
    fn new(buffers: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(FakeState {
                free: (0..buffers).map(|index| (index, vec![0; 16])).collect(),
                last_use: vec![None; buffers],
                last_batch: vec![None; buffers],
                all: std::vec::Vec::new(),
            })),
        }
    }

    /// Whether the GPU is done with buffer `index`'s last use.
    fn idle(&self, index: usize) -> bool {
        lock(&self.state).idle(index)
    }

    /// Whether buffer `index`'s last launched batch is still running.
    fn batch_running(&self, index: usize) -> bool {
        lock(&self.state).last_batch[index]
            .as_ref()
            .is_some_and(|d| !d.load(Ordering::SeqCst))
    }

    fn free(&self) -> usize {
        lock(&self.state).free.len()
    }

    fn all_complete(&self) -> bool {
        lock(&self.state).all.iter().all(|d| d.load(Ordering::SeqCst))
    }

    /// A lease of buffer `index`, its index in its first 8 bytes (read by the fills).
    fn lease_of(&self, (index, mut bytes): (usize, std::vec::Vec<u8>)) -> FakeLease {
        bytes[..8].copy_from_slice(&(index as u64).to_ne_bytes());
        FakeLease {
            index,
            bytes,
            home: self.state.clone(),
            early: AtomicBool::new(false),
        }
    }
}

impl Lanes for FakeRing {
    type Lease = FakeLease;
    type Done = FakeDone;

    fn try_lease(&self) -> Result<Option<FakeLease>> {
        let taken = {
            let mut s = lock(&self.state);
            let at = s.free.iter().position(|&(i, _)| s.idle(i));
            at.and_then(|i| s.free.remove(i))
        };
        Ok(taken.map(|t| self.lease_of(t)))
    }

    fn lease(&self) -> Result<FakeLease> {
        let taken = {
            let mut s = lock(&self.state);
            let taken = s
                .free
                .pop_front()
                .ok_or(Error::TimedOut("every buffer is leased"))?;
            // The ring waits for the buffer's last use: it completes.
            if let Some(d) = &s.last_use[taken.0] {
                d.store(true, Ordering::SeqCst);
            }
            taken
        };
        Ok(self.lease_of(taken))
    }

    fn index(lease: &FakeLease) -> usize {
        lease.index
    }

    fn launched(&self, lease: FakeLease, spare: &mut std::vec::Vec<FakeDone>) -> Result<FakeDone> {
        drop(spare.pop()); // a model: new completions each time
        let done = Arc::new(AtomicBool::new(false));
        let upload = if lease.early.load(Ordering::SeqCst) {
            Arc::new(AtomicBool::new(false))
        } else {
            done.clone()
        };
        {
            let mut s = lock(&self.state);
            s.last_use[lease.index] = Some(upload.clone());
            s.last_batch[lease.index] = Some(done.clone());
            s.all.push(done.clone());
        }
        drop(lease);
        Ok(FakeDone { done, upload })
    }

    fn abandon(&self, lease: FakeLease) {
        drop(lease);
    }

    fn wait(d: &FakeDone) -> Result<()> {
        // Stream order: the upload completed before the batch.
        d.upload.store(true, Ordering::SeqCst);
        d.done.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// What the closures saw.
#[derive(Default)]
struct Seen {
    fills: std::vec::Vec<usize>,
    launches: std::vec::Vec<usize>,
    drains: std::vec::Vec<usize>,
    /// The buffer of each launched batch.
    buffer_of: std::vec::Vec<usize>,
    /// Fills of a buffer whose last use (the ring's event) the GPU had not finished.
    pending_refills: usize,
    /// Fills of a buffer whose last batch was still running (allowed: its last use was
    /// the upload, `last_use_queued`).
    refills_while_running: usize,
    /// Launches in a buffer whose last batch had not been drained.
    undrained_launches: usize,
    /// Launches of a lease that held another batch's fill.
    wrong_lease: usize,
}

fn shape(threads: usize, ahead: usize, in_flight: usize) -> Shape {
    Shape {
        threads,
        ahead,
        in_flight,
        drain_before_launch: true,
    }
}

/// Runs `batches` batches over `ring`; `fail` makes a closure fail at a batch.
fn run_fake(
    ring: &FakeRing,
    shape: Shape,
    batches: usize,
    fail: Option<(&str, usize)>,
) -> (core::result::Result<ThreadedRun, Error>, Seen) {
    run_fake_with(ring, shape, batches, fail, false)
}

/// As `run_fake`; with `early`, each launch calls `last_use_queued` after its "upload".
fn run_fake_with(
    ring: &FakeRing,
    shape: Shape,
    batches: usize,
    fail: Option<(&str, usize)>,
    early: bool,
) -> (core::result::Result<ThreadedRun, Error>, Seen) {
    let seen = Mutex::new(Seen::default());
    let fails = |what: &str, b: usize| fail == Some((what, b));
    let out = run_threaded(
        ring,
        shape,
        batches,
        |b, bytes| {
            let index = u64::from_ne_bytes(bytes[..8].try_into().unwrap()) as usize;
            {
                let mut s = lock(&seen);
                s.fills.push(b);
                if !ring.idle(index) {
                    s.pending_refills += 1;
                }
                if ring.batch_running(index) {
                    s.refills_while_running += 1;
                }
            }
            // Uneven fills, so that the workers finish out of order.
            for _ in 0..(b * 7919) % 5 {
                std::thread::yield_now();
            }
            bytes[8..].copy_from_slice(&(b as u64).to_ne_bytes());
            if fails("fill", b) {
                return Err(Error::InvalidArgument("fill fails"));
            }
            Ok(())
        },
        |b, lease| {
            let mut s = lock(&seen);
            if let Some(prev) = s.buffer_of.iter().rposition(|&k| k == lease.index) {
                if !s.drains.contains(&prev) {
                    s.undrained_launches += 1;
                }
            }
            s.launches.push(b);
            s.buffer_of.push(lease.index);
            if early {
                lease.last_use_queued();
            }
            if u64::from_ne_bytes(lease[8..].try_into().unwrap()) != b as u64 {
                s.wrong_lease += 1;
            }
            if fails("launch", b) {
                return Err(Error::InvalidArgument("launch fails"));
            }
            Ok(b)
        },
        |b, v| {
            assert_eq!(b, v, "a drain got another batch's value");
            lock(&seen).drains.push(b);
            if fails("drain", b) {
                return Err(Error::InvalidArgument("drain fails"));
            }
            Ok(())
        },
    );
    (out, seen.into_inner().unwrap_or_else(|e| e.into_inner()))
}

#[test]
fn a_threaded_run_fills_launches_and_drains_every_batch_once_in_order() {
    for (threads, buffers, early) in [1, 2, 3, 8]
        .into_iter()
        .flat_map(|t| [1, 2, 5, 8].map(|b| (t, b)))
        .flat_map(|(t, b)| [(t, b, false), (t, b, true)])
    {
        {
            for (ahead, in_flight) in [(threads + 1, buffers), (1, 1), (buffers, 2 * buffers)] {
                for batches in [0, 1, 7, 40] {
                    let ring = FakeRing::new(buffers);
                    let case = format!("{threads} threads, {buffers} buffers, ahead {ahead}, in flight {in_flight}, {batches} batches, last_use_queued {early}");
                    let (out, seen) = run_fake_with(
                        &ring,
                        shape(threads, ahead.min(buffers), in_flight),
                        batches,
                        None,
                        early,
                    );
                    let run = out.unwrap_or_else(|e| panic!("{case}: {e:?}"));
                    assert_eq!(run.pipeline.batches, batches, "{case}");
                    let mut fills = seen.fills.clone();
                    fills.sort_unstable();
                    assert_eq!(
                        fills,
                        (0..batches).collect::<std::vec::Vec<_>>(),
                        "{case}: each batch filled once"
                    );
                    assert!(
                        seen.launches.iter().copied().eq(0..batches),
                        "{case}: launches {:?}",
                        seen.launches
                    );
                    assert!(
                        seen.drains.iter().copied().eq(0..batches),
                        "{case}: drains {:?}",
                        seen.drains
                    );
                    assert_eq!(
                        seen.wrong_lease, 0,
                        "{case}: a batch launched with another's fill"
                    );
                    assert_eq!(
                        seen.pending_refills, 0,
                        "{case}: a buffer filled while the GPU used it"
                    );
                    assert_eq!(
                        seen.undrained_launches, 0,
                        "{case}: a batch launched in a buffer before the buffer's last batch was drained"
                    );
                    if !early {
                        assert_eq!(
                            seen.refills_while_running, 0,
                            "{case}: a buffer refilled while its last batch ran, without last_use_queued"
                        );
                    }
                    assert_eq!(ring.free(), buffers, "{case}: a buffer not given back");
                    assert!(ring.all_complete(), "{case}: work left running");
                }
            }
        }
    }
}

#[test]
fn without_the_drain_before_launch_the_check_sees_undrained_launches() {
    // The negative control of the test above: the check can fail.
    for early in [false, true] {
        let ring = FakeRing::new(2);
        let shape = Shape {
            drain_before_launch: false,
            ..shape(2, 2, 8)
        };
        let (out, seen) = run_fake_with(&ring, shape, 16, None, early);
        out.unwrap();
        assert!(
            seen.undrained_launches > 0,
            "last_use_queued {early}: every launch found its buffer's last batch drained"
        );
    }
}

#[test]
fn with_last_use_queued_a_buffer_is_refilled_while_its_last_batch_still_runs() {
    // One buffer, one batch in flight: batch 1's fill waits for batch 0's upload only,
    // and batch 0 is drained after that fill, before batch 1's launch.
    for threads in [1, 2] {
        let ring = FakeRing::new(1);
        let (out, seen) = run_fake_with(&ring, shape(threads, 1, 1), 8, None, true);
        assert_eq!(out.unwrap().pipeline.batches, 8);
        assert_eq!(
            seen.refills_while_running, 7,
            "{threads} threads: every refill but the first overlaps the last batch"
        );
        assert_eq!(seen.pending_refills, 0, "a fill while the upload was queued");
        assert_eq!(seen.undrained_launches, 0);
        assert!(ring.all_complete());
    }
    // Its negative control: without it, the ring waits for the whole batch.
    let ring = FakeRing::new(1);
    let (out, seen) = run_fake_with(&ring, shape(1, 1, 1), 8, None, false);
    out.unwrap();
    assert_eq!(seen.refills_while_running, 0, "refilled while the batch ran");
}

#[test]
fn an_error_in_a_fill_stops_the_run_and_is_returned() {
    for threads in [1, 2, 4] {
        let ring = FakeRing::new(4);
        let (out, seen) = run_fake(&ring, shape(threads, 3, 4), 20, Some(("fill", 5)));
        let err = out.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument("fill fails")), "{err:?}");
        assert!(seen.launches.iter().copied().eq(0..seen.launches.len()));
        assert!(
            seen.launches.len() <= 5,
            "launched past the failed fill: {:?}",
            seen.launches
        );
        assert!(seen.drains.len() < 5, "{:?}", seen.drains);
        assert!(
            seen.fills.iter().all(|&b| b < 5 + 3),
            "filled far past the error: {:?}",
            seen.fills
        );
        assert_eq!(ring.free(), 4, "a buffer not given back");
        assert!(ring.all_complete(), "the run returned with work running");
    }
}

#[test]
fn an_error_in_a_launch_or_a_drain_stops_the_run_and_is_returned() {
    for what in ["launch", "drain"] {
        let ring = FakeRing::new(3);
        let (out, seen) = run_fake(&ring, shape(2, 3, 3), 20, Some((what, 6)));
        let err = out.unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(m) if m.starts_with(what)),
            "{err:?}"
        );
        assert!(seen.launches.iter().copied().eq(0..seen.launches.len()), "{what}");
        assert!(seen.launches.len() <= 6 + 3, "{what}: {:?}", seen.launches);
        assert_eq!(ring.free(), 3, "{what}: a buffer not given back");
        assert!(ring.all_complete(), "{what}: the run returned with work running");
    }
}

#[test]
fn a_panic_in_a_fill_reaches_the_caller_after_the_clean_up() {
    let ring = FakeRing::new(3);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_threaded(
            &ring,
            shape(2, 3, 3),
            10,
            |b, _| {
                assert!(b != 4, "fill 4 panics");
                Ok::<_, Error>(())
            },
            |b, _| Ok(b),
            |_, _| Ok(()),
        )
    }));
    let msg = caught.unwrap_err();
    assert_eq!(msg.downcast_ref::<&str>(), Some(&"fill 4 panics"));
    assert_eq!(ring.free(), 3, "a buffer not given back");
    assert!(ring.all_complete());
}

#[test]
fn a_threaded_run_refuses_zero_threads_ahead_or_in_flight_before_any_call() {
    for s in [shape(0, 1, 1), shape(1, 0, 1), shape(1, 1, 0)] {
        let ring = FakeRing::new(2);
        let (out, seen) = run_fake(&ring, s, 4, None);
        assert!(matches!(out, Err(Error::InvalidArgument(_))), "{s:?}");
        assert!(seen.fills.is_empty() && seen.launches.is_empty(), "{s:?}");
    }
}

/// Found by review (2026-12-06): `in_flight(usize::MAX)` (no limit beyond the buffers)
/// panicked sizing the queue of batches in flight.
#[test]
fn a_threaded_run_takes_any_number_in_flight() {
    let ring = FakeRing::new(2);
    let (out, seen) = run_fake(&ring, shape(2, 2, usize::MAX), 7, None);
    assert_eq!(out.unwrap().pipeline.batches, 7);
    assert!(seen.drains.iter().copied().eq(0..7), "drains {:?}", seen.drains);
}

// ----- the single-threaded schedule (`Pipeline::run_split`) on the same model ----------

/// What the split schedule's closures saw, in call order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Fill(usize),
    Launch(usize),
    Finish(usize),
    Drain(usize),
}

/// Runs `batches` batches through `super::super::pipeline::run_on` over `ring` (each
/// launch calls `last_use_queued`, as after an upload): the calls in order, and how many
/// finishes found their buffer's last batch undrained or still running (the state the
/// finish writes would be overwritten under a drain). `fail` makes a closure fail.
fn run_split_fake(
    ring: &FakeRing,
    in_flight: usize,
    drain_before_launch: bool,
    batches: usize,
    fail: Option<(&str, usize)>,
) -> (
    core::result::Result<PipelineRun, Error>,
    std::vec::Vec<Call>,
    usize,
) {
    let calls = std::cell::RefCell::new(std::vec::Vec::new());
    let buffer_of = std::cell::RefCell::new(std::vec::Vec::new());
    let mut unsafe_finishes = 0;
    let fails = |what: &str, b: usize| fail == Some((what, b));
    let out = super::super::pipeline::run_on(
        ring,
        in_flight,
        drain_before_launch,
        batches,
        (
            |b: usize, _: &mut [u8]| {
                calls.borrow_mut().push(Call::Fill(b));
                if fails("fill", b) {
                    return Err(Error::InvalidArgument("fill fails"));
                }
                Ok(())
            },
            |b: usize, lease: &FakeLease| {
                calls.borrow_mut().push(Call::Launch(b));
                buffer_of.borrow_mut().push(lease.index);
                lease.last_use_queued();
                if fails("launch", b) {
                    return Err(Error::InvalidArgument("launch fails"));
                }
                Ok(b)
            },
            |b: usize, lease: &FakeLease, v: usize| {
                assert_eq!(b, v, "a finish got another batch's first half");
                let calls_now = calls.borrow();
                let last = buffer_of.borrow()[..b].iter().rposition(|&k| k == lease.index);
                if let Some(prev) = last {
                    if !calls_now.contains(&Call::Drain(prev)) || ring.batch_running(lease.index) {
                        unsafe_finishes += 1;
                    }
                }
                drop(calls_now);
                calls.borrow_mut().push(Call::Finish(b));
                if fails("finish", b) {
                    return Err(Error::InvalidArgument("finish fails"));
                }
                Ok(b)
            },
            |b: usize, v: usize| {
                assert_eq!(b, v, "a drain got another batch's value");
                calls.borrow_mut().push(Call::Drain(b));
                Ok(())
            },
        ),
    );
    (out, calls.into_inner(), unsafe_finishes)
}

#[test]
fn a_split_run_queues_a_buffers_next_launch_before_its_last_drain_and_finishes_after() {
    for buffers in [1, 2, 4] {
        for in_flight in [buffers, 2 * buffers] {
            let ring = FakeRing::new(buffers);
            let batches = 24;
            let (out, calls, unsafe_finishes) = run_split_fake(&ring, in_flight, true, batches, None);
            let case = format!("{buffers} buffers, {in_flight} in flight");
            assert_eq!(out.unwrap().batches, batches, "{case}");
            let at = |c: Call| calls.iter().position(|&x| x == c).unwrap();
            for b in 0..batches {
                assert!(at(Call::Fill(b)) < at(Call::Launch(b)), "{case}");
                assert!(at(Call::Launch(b)) < at(Call::Finish(b)), "{case}");
                assert!(at(Call::Finish(b)) < at(Call::Drain(b)), "{case}");
                if b + buffers < batches {
                    let next = b + buffers; // the next batch in batch b's buffer
                    assert!(
                        at(Call::Launch(next)) < at(Call::Drain(b)),
                        "{case}: batch {next} was launched only after batch {b}'s drain"
                    );
                    assert!(
                        at(Call::Drain(b)) < at(Call::Finish(next)),
                        "{case}: batch {next}'s finish ran before batch {b}'s drain"
                    );
                }
            }
            let drains: std::vec::Vec<_> = calls
                .iter()
                .filter_map(|c| match c {
                    Call::Drain(b) => Some(*b),
                    _ => None,
                })
                .collect();
            assert!(drains.iter().copied().eq(0..batches), "{case}: drains {drains:?}");
            assert_eq!(unsafe_finishes, 0, "{case}");
            assert_eq!(ring.free(), buffers, "{case}: a buffer not given back");
            assert!(ring.all_complete(), "{case}: work left running");
        }
    }
}

#[test]
fn without_the_drain_before_a_finish_the_check_sees_unsafe_finishes() {
    // The negative control of the test above: its check can fail.
    let ring = FakeRing::new(2);
    let (out, _, unsafe_finishes) = run_split_fake(&ring, 8, false, 16, None);
    out.unwrap();
    assert!(
        unsafe_finishes > 0,
        "every finish found its buffer's last batch drained"
    );
}

#[test]
fn an_error_in_either_half_stops_a_split_run_with_nothing_running() {
    for what in ["fill", "launch", "finish"] {
        let ring = FakeRing::new(2);
        let (out, calls, _) = run_split_fake(&ring, 2, true, 12, Some((what, 5)));
        let err = out.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{what}: {err:?}");
        assert!(
            !calls
                .iter()
                .any(|c| matches!(c, Call::Fill(b) | Call::Launch(b) if *b > 5)),
            "{what}: the run went past the failed batch: {calls:?}"
        );
        assert!(
            !calls.contains(&Call::Drain(5)),
            "{what}: the failed batch was drained"
        );
        assert_eq!(ring.free(), 2, "{what}: a buffer not given back");
        assert!(ring.all_complete(), "{what}: the run returned with work running");
    }
}

#[test]
fn a_split_run_refuses_no_batches_in_flight() {
    let ring = FakeRing::new(1);
    let (out, calls, _) = run_split_fake(&ring, 0, true, 4, None);
    assert!(matches!(out, Err(Error::InvalidArgument(_))), "{out:?}");
    assert!(
        calls.is_empty(),
        "a closure ran before the arguments were checked"
    );
}

/// Found by the audit of 2026-12-07: `fill_threads(n)` started `n` threads whatever the
/// batches, so a huge `n` panicked when the system refused a thread. A run starts at
/// most as many as it has batches (and batches ahead), and goes on with those the
/// system gave it.
#[test]
fn a_huge_number_of_fill_threads_starts_only_as_many_as_the_batches_need() {
    let ring = FakeRing::new(4);
    // Before the fix this spawned until the system refused, then panicked.
    let (out, seen) = run_fake(&ring, shape(usize::MAX, usize::MAX, 2), 6, None);
    let run = out.expect("the run completes");
    assert_eq!(run.pipeline.batches, 6);
    assert_eq!(seen.drains, (0..6).collect::<std::vec::Vec<_>>());
    assert!(ring.all_complete() && ring.free() == 4);
}
