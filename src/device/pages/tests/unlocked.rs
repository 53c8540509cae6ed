//! No lock across a driver call (`held.rs`): while one thread is inside a driver call of
//! the heap (held there by the simulated physical memory's hook), other threads free
//! blocks, take blocks that fit in mapped memory and read the stats; a thread whose block
//! needs a mapping waits for the turn and then places its block again. (Every test of
//! the simulated memory also fails on a driver call made under the heap's lock:
//! `FakePhys::called`.)

use std::time::Duration;

use super::{free, Heap, GRANULE, MIB, TUNING};
use crate::device::fake::{FakeBackend, FakePhys, FakeStream, PhysOp};
use crate::device::pages::PageHeap;
use crate::sync::global::{mpsc, Arc, Mutex};

/// How long a step that must not wait for the held driver call may take.
const PROMPT: Duration = Duration::from_secs(5);

/// A heap and the backend of its marks, shared by the test's threads.
struct Rig {
    h: Heap,
    b: FakeBackend,
}

impl Rig {
    fn alloc(&self, bytes: usize, s: &FakeStream) -> u64 {
        self.h.alloc(&self.b, bytes, s).unwrap()
    }

    fn free(&self, ptr: u64, s: &FakeStream) {
        free(&self.h, &self.b, ptr, s)
    }
}

/// A hook that holds the first call of the armed operation until released.
struct Pause {
    armed: Arc<Mutex<Option<PhysOp>>>,
    entered: mpsc::Receiver<()>,
    go: mpsc::Sender<()>,
}

/// A heap over simulated memory whose first call of `op` (once armed) waits for
/// [`Pause::go`] (at most 10 s, so that a heap that holds its lock fails rather than hangs).
fn paused_heap() -> (Arc<Rig>, FakePhys, Pause) {
    let armed: Arc<Mutex<Option<PhysOp>>> = Arc::default();
    let (entered_tx, entered) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let (entered_tx, go_rx) = (Mutex::new(entered_tx), Mutex::new(go_rx));
    let hook_armed = armed.clone();
    let phys = FakePhys::new(GRANULE, usize::MAX).with_hook(move |op| {
        let hit = {
            let mut a = hook_armed.lock().unwrap();
            a.take_if(|a| *a == op).is_some()
        };
        if hit {
            entered_tx.lock().unwrap().send(()).unwrap();
            let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(10));
        }
    });
    let rig = Rig {
        h: PageHeap::new(phys.clone(), TUNING),
        b: FakeBackend::new(u64::MAX),
    };
    (Arc::new(rig), phys, Pause { armed, entered, go })
}

impl Pause {
    /// Arms `op`, runs `held` on a thread until it is inside that call, runs `meanwhile`
    /// on another thread and says whether it finished while the call was held; then lets
    /// the call go and returns what `held` returned.
    fn around<T: Send + 'static>(
        &self,
        op: PhysOp,
        held: impl FnOnce() -> T + Send + 'static,
        meanwhile: impl FnOnce() + Send + 'static,
    ) -> (T, bool) {
        *self.armed.lock().unwrap() = Some(op);
        let t = std::thread::spawn(held);
        self.entered
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{op:?} was never called"));
        let (done_tx, done) = mpsc::channel();
        let m = std::thread::spawn(move || {
            meanwhile();
            done_tx.send(()).unwrap();
        });
        let prompt = done.recv_timeout(PROMPT).is_ok();
        self.go.send(()).unwrap();
        m.join().unwrap();
        (t.join().unwrap(), prompt)
    }
}

#[test]
fn frees_and_fits_go_on_while_a_block_is_created_mapped_and_granted_access() {
    for op in [PhysOp::Create, PhysOp::Map, PhysOp::SetAccess] {
        let (r, phys, pause) = paused_heap();
        let s = FakeStream::new();
        let x = r.alloc(16 * MIB, &s);
        let reserved = r.h.stats().reserved;
        // A block of new memory, held inside `op`, while another thread frees `x` and
        // takes a block that fits in its memory.
        let (rb, sb) = (r.clone(), s.clone());
        let (rm, sm) = (r.clone(), s.clone());
        let (fit_tx, fit_rx) = mpsc::channel();
        let (big, prompt) = pause.around(
            op,
            move || rb.alloc(32 * MIB, &sb),
            move || {
                rm.free(x, &sm);
                fit_tx.send(rm.alloc(16 * MIB, &sm)).unwrap();
                let _ = rm.h.stats();
            },
        );
        assert!(prompt, "{op:?}: the free and the fit waited for the driver call");
        let fit = fit_rx.recv().unwrap();
        assert_eq!(fit, x, "{op:?}: the fit took the freed memory");
        assert_eq!(r.h.stats().reserved, reserved + 32 * MIB, "{op:?}");
        assert!(phys.use_block(big, 32 * MIB, &s) && phys.use_block(fit, 16 * MIB, &s));
        r.free(big, &s);
        r.free(fit, &s);
        super::trim_clean(&r.h, &r.b, &phys);
    }
}

#[test]
fn frees_and_fits_go_on_while_a_trim_unmaps_and_releases() {
    for op in [PhysOp::Unmap, PhysOp::Release] {
        let (r, phys, pause) = paused_heap();
        let s = FakeStream::new();
        let x = r.alloc(16 * MIB, &s);
        let idle = r.alloc(16 * MIB, &s);
        r.free(idle, &s);
        let rt = r.clone();
        let (rm, sm) = (r.clone(), s.clone());
        let (fit_tx, fit_rx) = mpsc::channel();
        let ((), prompt) = pause.around(
            op,
            move || rt.h.trim_to(&rt.b, 0),
            move || {
                rm.free(x, &sm);
                fit_tx.send(rm.alloc(16 * MIB, &sm)).unwrap();
            },
        );
        assert!(prompt, "{op:?}: the free and the fit waited for the trim");
        let fit = fit_rx.recv().unwrap();
        assert_eq!(fit, x, "{op:?}");
        assert!(phys.use_block(fit, 16 * MIB, &s));
        assert_eq!(
            r.h.stats().reserved,
            16 * MIB,
            "{op:?}: the trim took the idle block's memory only"
        );
        r.free(fit, &s);
        super::trim_clean(&r.h, &r.b, &phys);
    }
}

#[test]
fn a_block_that_needs_a_mapping_waits_for_the_turn_and_takes_memory_freed_meanwhile() {
    let (r, phys, pause) = paused_heap();
    let s = FakeStream::new();
    let z = r.alloc(32 * MIB, &s);
    let (rb, sb) = (r.clone(), s.clone());
    let (rw, sw) = (r.clone(), s.clone());
    let (rf, sf) = (r.clone(), s.clone());
    let (got_tx, got) = mpsc::channel();
    let (big, prompt) = pause.around(
        PhysOp::Map,
        move || rb.alloc(32 * MIB, &sb),
        move || {
            // This block fits nowhere mapped: it waits for the turn...
            let waiter = std::thread::spawn(move || got_tx.send(rw.alloc(32 * MIB, &sw)));
            std::thread::sleep(Duration::from_millis(50));
            // ...while z, freed meanwhile, makes room for it.
            rf.free(z, &sf);
            drop(waiter);
        },
    );
    assert!(prompt, "the free waited for the driver call");
    let placed = got.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(placed, z, "placed again after the turn: in the freed memory");
    let st = r.h.stats();
    assert_eq!(
        st.reserved,
        64 * MIB,
        "no memory made for the waiting block: {st:?}"
    );
    assert!(st.turn_waits >= 1, "the wait for the turn is counted: {st:?}");
    assert!(phys.use_block(big, 32 * MIB, &s) && phys.use_block(placed, 32 * MIB, &s));
    r.free(big, &s);
    r.free(placed, &s);
    super::trim_clean(&r.h, &r.b, &phys);
}

#[test]
fn a_panic_in_a_driver_call_gives_the_turn_up() {
    let phys = FakePhys::new(GRANULE, usize::MAX).with_hook({
        let once = Mutex::new(true);
        move |op| {
            if op == PhysOp::Map && std::mem::take(&mut *once.lock().unwrap()) {
                panic!("a driver call panics");
            }
        }
    });
    let r = Arc::new(Rig {
        h: PageHeap::new(phys.clone(), TUNING),
        b: FakeBackend::new(u64::MAX),
    });
    let s = FakeStream::new();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.alloc(16 * MIB, &s)));
    assert!(panicked.is_err());
    // Another thread's block needs a mapping: it gets the turn, not a wait forever.
    let (done_tx, done) = mpsc::channel();
    let (rt, st) = (r.clone(), s.clone());
    std::thread::spawn(move || done_tx.send(rt.alloc(16 * MIB, &st)).unwrap());
    let p = done.recv_timeout(PROMPT).expect("the turn was left taken");
    assert!(phys.use_block(p, 16 * MIB, &s));
}
