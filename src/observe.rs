//! The one word the allocation hot paths read for everything that may want to see a block
//! handed out or freed: the trace recorder ([`crate::trace`]) and an attached NVTX tool
//! ([`crate::cuda::nvtx`]). A hit tests it once (one Relaxed load and a branch that goes
//! the same way while nobody watches) and calls the observers from a `#[cold]` function
//! otherwise, so the NVTX annotations add no instruction of their own to a hit: they
//! share the branch the trace recorder needs anyway (issue 24: "at most 1 ns without a
//! tool").
//!
//! Each observer keeps its own exact state; its bit here is a summary the hot paths may
//! read instead. The rule that keeps the summary safe: **a bit is set whenever its
//! observer is on**, once the thread that turned it on has returned from doing so. A bit
//! set while its observer is off only sends hits to the cold path, which asks the
//! observer itself. So:
//! - an observer turned on stores its own state first, then [`raise`]s its bit;
//! - one turned off stores its own state first, then [`lower`]s its bit, which clears it
//!   and reads the state again, raising the bit again if the observer came back on in
//!   between. A raise that the clear overwrote came earlier in the word's modification
//!   order, so the clear (an acquiring read-modify-write) reads from its release
//!   sequence, and the state stored before that raise is visible to the re-read.
//!
//! A leaf: it imports nothing of the crate but the sync shim.

use crate::sync::global::{AtomicUsize, Ordering};

/// The trace recorder's bit (none under loom, where the recorder compiles to nothing).
pub(crate) const TRACE: usize = if cfg!(loom) { 0 } else { 1 };
/// The NVTX annotations' bit (none when built with `--cfg cudalloc_no_nvtx`).
pub(crate) const NVTX: usize = if cfg!(cudalloc_no_nvtx) { 0 } else { 2 };
/// Every observer.
pub(crate) const ALL: usize = TRACE | NVTX;

/// Both start set: the recorder has not read `CUDALLOC_TRACE` yet, and no annotation has
/// looked for a tool; the first hit's cold path settles both.
static WANTED: AtomicUsize = AtomicUsize::new(TRACE | NVTX);

/// Whether an observer in `mask` may want to see this block: the hot paths' one branch.
#[inline(always)]
pub(crate) fn wanted(mask: usize) -> bool {
    mask != 0 && WANTED.load(Ordering::Relaxed) & mask != 0
}

/// Sets `bit`, after its observer stored its state as on.
pub(crate) fn raise(bit: usize) {
    protocol::raise(&WANTED, bit);
}

/// Clears `bit`, after its observer stored its state as off; sets it again if `on` (the
/// observer's own state, read after the clear) says it is back on.
pub(crate) fn lower(bit: usize, on: impl Fn() -> bool) {
    protocol::lower(&WANTED, bit, on);
}

/// The two steps on any word of the kind: the process-wide `std` word above, and loom's
/// in the model below.
mod protocol {
    /// What the steps need of a word: `fetch_or` and `fetch_and`, acquiring and releasing.
    pub(super) trait Word {
        fn or(&self, bits: usize);
        fn and(&self, bits: usize);
    }

    macro_rules! word {
        ($t:ty, $o:path) => {
            impl Word for $t {
                fn or(&self, bits: usize) {
                    self.fetch_or(bits, $o);
                }
                fn and(&self, bits: usize) {
                    self.fetch_and(bits, $o);
                }
            }
        };
    }
    word!(
        crate::sync::global::AtomicUsize,
        crate::sync::global::Ordering::AcqRel
    );
    #[cfg(loom)]
    word!(crate::sync::AtomicUsize, crate::sync::Ordering::AcqRel);

    pub(super) fn raise(word: &impl Word, bit: usize) {
        word.or(bit);
    }

    pub(super) fn lower(word: &impl Word, bit: usize, on: impl Fn() -> bool) {
        word.and(!bit);
        if on() {
            word.or(bit);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    // A bit no observer owns, so that the test runs beside the crate's own.
    const TEST_BIT: usize = 1 << 20;

    #[test]
    fn a_lowered_bit_stays_raised_when_its_observer_is_back_on() {
        raise(TEST_BIT);
        assert!(wanted(TEST_BIT));
        lower(TEST_BIT, || true);
        assert!(wanted(TEST_BIT), "the observer is on again: its bit must be set");
        lower(TEST_BIT, || false);
        assert!(!wanted(TEST_BIT));
        assert!(!wanted(0), "an empty mask wants nothing");
    }
}

/// The rule under every interleaving: an observer turned on by one thread while another
/// turns it off ends with its bit set whenever it ends on (`lower`'s re-read), and the
/// re-read is what makes it so (the control without it fails).
#[cfg(all(test, loom))]
mod loom_models {
    use super::protocol;
    use crate::sync::{thread, Arc, AtomicBool, AtomicUsize, Ordering};

    fn race(recheck: bool) {
        loom::model(move || {
            let word = Arc::new(AtomicUsize::new(1));
            let on = Arc::new(AtomicBool::new(true));
            let turn_on = {
                let (word, on) = (word.clone(), on.clone());
                thread::spawn(move || {
                    on.store(true, Ordering::Release);
                    protocol::raise(&*word, 1);
                })
            };
            on.store(false, Ordering::Release);
            if recheck {
                protocol::lower(&*word, 1, || on.load(Ordering::Acquire));
            } else {
                protocol::lower(&*word, 1, || false);
            }
            turn_on.join().unwrap();
            if on.load(Ordering::Relaxed) {
                assert_eq!(word.load(Ordering::Relaxed) & 1, 1, "on, with its bit clear");
            }
        });
    }

    #[test]
    fn an_observer_on_at_the_end_has_its_bit() {
        race(true);
    }

    #[test]
    #[should_panic(expected = "on, with its bit clear")]
    fn without_the_re_read_a_bit_is_lost() {
        race(false);
    }
}
