//! How often the heap asks whether a stream's work has completed (`Backend`'s idle
//! query) when it takes or moves blocks another stream freed: only the streams that freed
//! what it takes, and an answer kept while nothing new was freed.

use super::{free, heap, CHUNK, TUNING};
use crate::device::fake::FakeStream;
use crate::sync::Ordering;

#[test]
fn moving_an_idle_chunk_asks_only_the_streams_that_freed_it() {
    let (h, b, _phys) = heap(usize::MAX, TUNING, None);
    let a = FakeStream::new();
    let others: Vec<FakeStream> = (0..6).map(|_| FakeStream::new()).collect();
    // A chunk for each of the other streams, then 8 chunks of `a`, each followed by a
    // live separator: once freed, every chunk is a free run of its own.
    let mut seps = Vec::new();
    let mut chunk_then_separator = |s: &FakeStream| {
        let p = h.alloc(&b, CHUNK, s).unwrap();
        seps.push(h.alloc(&b, CHUNK, &a).unwrap());
        p
    };
    let low: Vec<u64> = others.iter().map(&mut chunk_then_separator).collect();
    let high: Vec<u64> = (0..8).map(|_| chunk_then_separator(&a)).collect();
    for (p, s) in low.iter().zip(&others) {
        // Work queued and never run: the other streams' frees stay pending.
        s.enqueue();
        free(&h, &b, *p, s);
    }
    for p in high {
        free(&h, &b, p, &a);
    }
    assert_eq!(b.idle_queries.load(Ordering::SeqCst), 0, "a free asks nothing");
    // 14 chunks idle, over the allowance: a block that fits in no run moves idle chunks
    // from the highest address down (4 of a's, whose work completed).
    let big = h.alloc(&b, 4 * CHUNK, &a).unwrap();
    let st = h.stats();
    assert_eq!(st.unmaps, 4, "four idle chunks moved: {st:?}");
    assert_eq!(
        b.idle_queries.load(Ordering::SeqCst),
        1,
        "only a asked, once for the whole allocation (asking every stream with frees \
         pending asked 7)"
    );
    for p in seps.into_iter().chain([big]) {
        free(&h, &b, p, &a);
    }
    for s in &others {
        s.complete_all();
    }
}

#[test]
fn a_takers_answer_is_kept_when_the_lock_is_free() {
    let (h, b, _phys) = heap(usize::MAX, TUNING, None);
    let (a, t) = (FakeStream::new(), FakeStream::new());
    // Two blocks of `a`, kept apart by a live one, freed on `a` (idle: no work queued).
    let x = h.alloc(&b, CHUNK, &a).unwrap();
    let sep = h.alloc(&b, CHUNK, &a).unwrap();
    let y = h.alloc(&b, CHUNK, &a).unwrap();
    free(&h, &b, x, &a);
    free(&h, &b, y, &a);
    // `t` takes x's units: it asks whether a is idle, learns that every free of a so far
    // completed and keeps it, so taking y's units asks nothing.
    let x2 = h.alloc(&b, CHUNK, &t).unwrap();
    assert_eq!(b.idle_queries.load(Ordering::SeqCst), 1);
    let y2 = h.alloc(&b, CHUNK, &t).unwrap();
    assert_eq!((x2, y2), (x, y), "the freed blocks' units, reused");
    assert_eq!(
        b.idle_queries.load(Ordering::SeqCst),
        1,
        "the first answer was kept: nothing asked again"
    );
    for p in [x2, y2, sep] {
        free(&h, &b, p, &t);
    }
}
