//! The threaded schedule against a model of the ring (no driver): a buffer's last work
//! completes when the host waits for it, as a GPU that has not run it yet.

use super::*;
use crate::sync::global::{lock, Arc, AtomicBool, Mutex, Ordering};

/// A leased buffer of the model: dropped, it goes back to the ring (as a `Staged`).
struct FakeLease {
    index: usize,
    bytes: std::vec::Vec<u8>,
    home: Arc<Mutex<FakeState>>,
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
    last_use: std::vec::Vec<Option<Arc<AtomicBool>>>,
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
                all: std::vec::Vec::new(),
            })),
        }
    }

    /// Whether the GPU is done with buffer `index`'s last use.
    fn idle(&self, index: usize) -> bool {
        lock(&self.state).idle(index)
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
        }
    }
}

impl Lanes for FakeRing {
    type Lease = FakeLease;
    type Done = Arc<AtomicBool>;

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

    fn launched(
        &self,
        lease: FakeLease,
        spare: &mut std::vec::Vec<Arc<AtomicBool>>,
    ) -> Result<Arc<AtomicBool>> {
        drop(spare.pop()); // a model: a new completion each time
        let done = Arc::new(AtomicBool::new(false));
        {
            let mut s = lock(&self.state);
            s.last_use[lease.index] = Some(done.clone());
            s.all.push(done.clone());
        }
        drop(lease);
        Ok(done)
    }

    fn abandon(&self, lease: FakeLease) {
        drop(lease);
    }

    fn wait(done: &Arc<AtomicBool>) -> Result<()> {
        done.store(true, Ordering::SeqCst);
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
    /// Fills of a buffer whose last use the GPU had not finished, or whose last batch had
    /// not been drained.
    pending_refills: usize,
    undrained_refills: usize,
    /// Launches of a lease that held another batch's fill.
    wrong_lease: usize,
}

fn shape(threads: usize, ahead: usize, in_flight: usize) -> Shape {
    Shape {
        threads,
        ahead,
        in_flight,
        drain_before_refill: true,
    }
}

/// Runs `batches` batches over `ring`; `fail` makes a closure fail at a batch.
fn run_fake(
    ring: &FakeRing,
    shape: Shape,
    batches: usize,
    fail: Option<(&str, usize)>,
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
                if let Some(prev) = s.buffer_of.iter().rposition(|&k| k == index) {
                    if !s.drains.contains(&prev) {
                        s.undrained_refills += 1;
                    }
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
            s.launches.push(b);
            s.buffer_of.push(lease.index);
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
    for threads in [1, 2, 3, 8] {
        for buffers in [1, 2, 5, 8] {
            for (ahead, in_flight) in [(threads + 1, buffers), (1, 1), (buffers, 2 * buffers)] {
                for batches in [0, 1, 7, 40] {
                    let ring = FakeRing::new(buffers);
                    let case = format!("{threads} threads, {buffers} buffers, ahead {ahead}, in flight {in_flight}, {batches} batches");
                    let (out, seen) = run_fake(
                        &ring,
                        shape(threads, ahead.min(buffers), in_flight),
                        batches,
                        None,
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
                        seen.undrained_refills, 0,
                        "{case}: a buffer refilled before its last batch's drain"
                    );
                    assert_eq!(ring.free(), buffers, "{case}: a buffer not given back");
                    assert!(ring.all_complete(), "{case}: work left running");
                }
            }
        }
    }
}

#[test]
fn without_the_drain_before_refill_the_check_sees_undrained_refills() {
    // The negative control of the test above: the check can fail.
    let ring = FakeRing::new(2);
    let shape = Shape {
        drain_before_refill: false,
        ..shape(2, 2, 8)
    };
    let (out, seen) = run_fake(&ring, shape, 16, None);
    out.unwrap();
    assert!(
        seen.undrained_refills > 0,
        "every refill found its last batch drained"
    );
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
