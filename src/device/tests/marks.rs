//! `MarkSet` (`order.rs`), the recorded uses of the cache's gated blocks and of
//! `DeviceArena`. Invariant: each other stream is marked once, and a set completes (or
//! orders a stream after it) only once every mark did.

use super::*;

#[test]
fn a_mark_set_marks_each_other_stream_once_and_polls_only_what_is_pending() {
    use crate::device::order::MarkSet;
    let b = FakeBackend::new(u64::MAX);
    let (home, u, v) = (FakeStream::new(), FakeStream::new(), FakeStream::new());
    u.enqueue();
    v.enqueue();
    // The home stream and a repeated stream are kept once or not at all.
    let uses = vec![u.clone(), home.clone(), v.clone(), u.clone()];
    let mut set: MarkSet<FakeBackend> = MarkSet::of_uses(home.id(), uses);
    assert_eq!(set.len(), 2);
    let mut recorded = 0;
    set.seal(&b, 1, &mut recorded).unwrap();
    assert_eq!(
        (recorded, b.marks.load(Ordering::SeqCst)),
        (2, 2),
        "one mark per other stream"
    );
    assert!(!set.poll(&b), "the uses have not completed");
    u.complete_all();
    assert!(!set.poll(&b));
    assert_eq!(set.len(), 1, "u's completed mark is dropped, v's stays");
    let before = b.marks.load(Ordering::SeqCst);
    v.complete_all();
    assert!(set.poll(&b));
    assert_eq!(b.marks.load(Ordering::SeqCst), before, "polls record nothing");
    // The latest mark of a stream by seq stays; an older one is handed back.
    let later = b.mark(&u).unwrap();
    assert!(set.insert(u.id(), 5, later).is_none());
    let older = b.mark(&u).unwrap();
    assert!(
        set.insert(u.id(), 4, older).is_some(),
        "an older mark does not replace a later one"
    );
    let newest = b.mark(&u).unwrap();
    assert!(
        set.insert(u.id(), 6, newest).is_some(),
        "the later mark replaces the earlier"
    );
    assert_eq!(set.len(), 1);
}

#[test]
fn a_mark_set_orders_a_stream_after_its_uses_on_the_gpu() {
    use crate::device::order::MarkSet;
    let b = FakeBackend::new(u64::MAX);
    let (home, u) = (FakeStream::new(), FakeStream::new());
    let used_at = u.enqueue();
    let mut set: MarkSet<FakeBackend> = MarkSet::of_uses(home.id(), vec![u.clone()]);
    set.seal(&b, 0, &mut 0).unwrap();
    assert!(!home.covers(&u, used_at), "nothing orders home after u yet");
    let mut waits = 0;
    assert!(set.order_before(&b, &home, &mut waits));
    assert_eq!(waits, 1);
    assert!(home.covers(&u, used_at), "home's next work follows u's use");
    assert!(set.wait_host(&b));
    assert!(set.is_empty());
}
