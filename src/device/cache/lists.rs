//! The shared lists of a device cache: per stream, its free blocks by class and its gated
//! blocks (freed with recorded uses on other streams), all behind one lock. The lock-free
//! readers (the release policy, the poll's early exit) read two mirrors of the counts,
//! which only [`SharedGuard`]'s drop stores: a change made under the lock is always
//! published before the lock is released.

use std::collections::VecDeque;

use crate::cuda::StreamId;
use crate::device::order::{MarkSet, StreamOrder};
use crate::device::size_class::class_size;
use crate::sync::{lock, AtomicUsize, Mutex, MutexGuard, Ordering};

/// A block freed while work recorded on other streams may still use it.
pub(super) struct Gated<S: StreamOrder> {
    pub(super) ptr: u64,
    pub(super) class: usize,
    /// One mark per other stream, recorded at the free.
    pub(super) marks: MarkSet<S>,
}

/// One stream's blocks waiting for their recorded uses, oldest first, and how many of
/// them are being polled outside the lock.
struct GatedList<S: StreamOrder> {
    waiting: VecDeque<Gated<S>>,
    // polling == blocks taken by `take_oldest` and not yet back through `put_back`/`done`
    polling: usize,
}

impl<S: StreamOrder> GatedList<S> {
    fn new() -> Self {
        Self {
            waiting: VecDeque::new(),
            polling: 0,
        }
    }

    /// Blocks waiting or being polled.
    fn len(&self) -> usize {
        self.waiting.len() + self.polling
    }

    /// The oldest `n` blocks, for a poll outside the lock (counted until they come back).
    fn take_oldest(&mut self, n: usize) -> impl Iterator<Item = Gated<S>> + '_ {
        let n = n.min(self.waiting.len());
        self.polling += n;
        self.waiting.drain(..n)
    }

    /// A polled block whose uses have not completed: back at the front (called newest
    /// first, the blocks keep their order).
    fn put_back(&mut self, g: Gated<S>) {
        self.polling -= 1;
        self.waiting.push_front(g);
    }

    /// A polled block whose uses have completed.
    fn done(&mut self) {
        self.polling -= 1;
    }
}

/// One stream's shared lists.
pub(super) struct StreamLists<S: StreamOrder> {
    pub(super) id: StreamId,
    /// A live handle of the stream: marks are recorded on it when another stream takes
    /// its blocks, and its blocks are freed to the backend in its order.
    pub(super) stream: S::Stream,
    /// Free blocks by class (grown on demand), most recently freed last.
    pub(super) free: Vec<Vec<u64>>,
    // bytes == sum over free of len * class size
    pub(super) bytes: usize,
    // blocks == sum over free of len
    pub(super) blocks: usize,
    gated: GatedList<S>,
}

impl<S: StreamOrder> StreamLists<S> {
    fn is_empty(&self) -> bool {
        self.blocks == 0 && self.gated.len() == 0
    }

    /// The gated blocks still waiting (none is being polled once the cache goes).
    pub(super) fn drain_gated(&mut self) -> impl Iterator<Item = Gated<S>> + '_ {
        self.gated.waiting.drain(..)
    }
}

/// The shared lists of every stream, behind the cache's lock.
pub(super) struct Shared<S: StreamOrder> {
    pub(super) streams: Vec<StreamLists<S>>,
    // bytes == sum over streams of bytes (free blocks)
    pub(super) bytes: usize,
    pub(super) blocks: usize,
    // pending_* count gated blocks, those being polled included:
    // pending_blocks == sum over streams of gated.len()
    pub(super) pending_bytes: usize,
    pub(super) pending_blocks: usize,
}

impl<S: StreamOrder> Shared<S> {
    fn new() -> Self {
        Self {
            streams: Vec::new(),
            bytes: 0,
            blocks: 0,
            pending_bytes: 0,
            pending_blocks: 0,
        }
    }

    pub(super) fn index(&self, id: StreamId) -> Option<usize> {
        self.streams.iter().position(|s| s.id == id)
    }

    /// The index of `stream`'s lists, making them (with a clone of the handle: an atomic
    /// increment, no CUDA call) if needed.
    pub(super) fn entry(&mut self, stream: &S::Stream) -> usize {
        let id = S::stream_id(stream);
        match self.index(id) {
            Some(i) => i,
            None => {
                self.streams.push(StreamLists {
                    id,
                    stream: stream.clone(),
                    free: Vec::new(),
                    bytes: 0,
                    blocks: 0,
                    gated: GatedList::new(),
                });
                self.streams.len() - 1
            }
        }
    }

    /// The index of a stream other than `not` with a free block of `class`.
    pub(super) fn other_with(&self, not: StreamId, class: usize) -> Option<usize> {
        self.streams
            .iter()
            .position(|s| s.id != not && s.free.get(class).is_some_and(|l| !l.is_empty()))
    }

    pub(super) fn push_free(&mut self, i: usize, class: usize, blocks: impl IntoIterator<Item = u64>) {
        let s = &mut self.streams[i];
        if s.free.len() <= class {
            s.free.resize_with(class + 1, Vec::new);
        }
        let before = s.free[class].len();
        s.free[class].extend(blocks);
        let n = s.free[class].len() - before;
        let bytes = n * class_size(class);
        s.bytes += bytes;
        s.blocks += n;
        self.bytes += bytes;
        self.blocks += n;
    }

    /// Takes up to `n` (at least one, if any) free blocks of `class` of stream index `i`,
    /// the oldest first.
    pub(super) fn take_free(&mut self, i: usize, class: usize, n: usize) -> Vec<u64> {
        let s = &mut self.streams[i];
        let Some(list) = s.free.get_mut(class) else {
            return Vec::new();
        };
        let k = n.max(1).min(list.len());
        let taken: Vec<u64> = list.drain(..k).collect();
        let bytes = k * class_size(class);
        s.bytes -= bytes;
        s.blocks -= k;
        self.bytes -= bytes;
        self.blocks -= k;
        taken
    }

    /// Takes the largest free blocks of any stream until at least `excess` bytes.
    pub(super) fn take_largest(&mut self, mut excess: usize) -> Vec<(S::Stream, usize, u64)> {
        let mut out = Vec::new();
        let top = self.streams.iter().map(|s| s.free.len()).max().unwrap_or(0);
        for class in (0..top).rev() {
            for i in 0..self.streams.len() {
                while excess > 0 {
                    let taken = self.take_free(i, class, 1);
                    let Some(&ptr) = taken.first() else { break };
                    out.push((self.streams[i].stream.clone(), class, ptr));
                    excess = excess.saturating_sub(class_size(class));
                }
            }
            if excess == 0 {
                break;
            }
        }
        out
    }

    /// Adds a gated block to `stream`'s list.
    pub(super) fn push_gated(&mut self, stream: &S::Stream, g: Gated<S>) {
        let i = self.entry(stream);
        self.pending_bytes += class_size(g.class);
        self.pending_blocks += 1;
        self.streams[i].gated.waiting.push_back(g);
    }

    /// The oldest `per_stream` gated blocks of each stream with their stream's handle, to
    /// poll outside the lock; each comes back through [`polled`](Self::polled).
    pub(super) fn take_polls(&mut self, per_stream: usize) -> Vec<(S::Stream, Gated<S>)> {
        let mut batch = Vec::new();
        for s in &mut self.streams {
            let stream = &s.stream;
            batch.extend(s.gated.take_oldest(per_stream).map(|g| (stream.clone(), g)));
        }
        batch
    }

    /// A polled block back: to the free list of its stream when its uses `completed`
    /// (returned, for its marks to be dropped after the lock), else to the front of its
    /// gated list.
    pub(super) fn polled(&mut self, stream: &S::Stream, g: Gated<S>, completed: bool) -> Option<Gated<S>> {
        let i = self.entry(stream);
        if !completed {
            self.streams[i].gated.put_back(g);
            return None;
        }
        self.streams[i].gated.done();
        self.pending_bytes -= class_size(g.class);
        self.pending_blocks -= 1;
        self.push_free(i, g.class, [g.ptr]);
        Some(g)
    }

    /// Takes every waiting gated block, with its stream's handle.
    pub(super) fn take_all_gated(&mut self) -> Vec<(S::Stream, Gated<S>)> {
        let mut out = Vec::new();
        for s in &mut self.streams {
            let stream = &s.stream;
            out.extend(s.gated.waiting.drain(..).map(|g| (stream.clone(), g)));
        }
        for (_, g) in &out {
            self.pending_bytes -= class_size(g.class);
            self.pending_blocks -= 1;
        }
        out
    }

    /// Takes out the lists of streams with nothing cached, to be dropped (with their
    /// stream handles, which may destroy a stream) after the lock is released: the cache
    /// keeps a handle only of streams whose blocks it holds.
    pub(super) fn prune(&mut self) -> Vec<StreamLists<S>> {
        if self.streams.iter().all(|s| !s.is_empty()) {
            return Vec::new();
        }
        let (keep, empty): (Vec<_>, Vec<_>) = core::mem::take(&mut self.streams)
            .into_iter()
            .partition(|s| !s.is_empty());
        self.streams = keep;
        empty
    }

    /// Checks the counts against the lists (debug builds).
    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let (mut bytes, mut blocks, mut pending) = (0, 0, 0);
            for s in &self.streams {
                let b: usize = s
                    .free
                    .iter()
                    .enumerate()
                    .map(|(c, l)| l.len() * class_size(c))
                    .sum();
                let n: usize = s.free.iter().map(Vec::len).sum();
                debug_assert_eq!((b, n), (s.bytes, s.blocks), "stream {} counts", s.id);
                bytes += b;
                blocks += n;
                pending += s.gated.len();
            }
            debug_assert_eq!((bytes, blocks), (self.bytes, self.blocks), "shared counts");
            debug_assert_eq!(pending, self.pending_blocks, "pending blocks");
        }
    }
}

/// The shared lists behind their lock, with the mirrors of their counts.
pub(super) struct SharedLists<S: StreamOrder> {
    lists: Mutex<Shared<S>>,
    /// Mirror of `Shared::bytes` (the free bytes), for the release policy.
    idle_bytes: AtomicUsize,
    /// Mirror of `Shared::pending_blocks`: polls are skipped without locking when it is 0.
    gated: AtomicUsize,
}

impl<S: StreamOrder> SharedLists<S> {
    pub(super) fn new() -> Self {
        Self {
            lists: Mutex::new(Shared::new()),
            idle_bytes: AtomicUsize::new(0),
            gated: AtomicUsize::new(0),
        }
    }

    /// The lists, locked; the mirrors are published when the guard drops.
    pub(super) fn lock(&self) -> SharedGuard<'_, S> {
        SharedGuard {
            lists: lock(&self.lists),
            owner: self,
        }
    }

    /// The free bytes of the shared lists, as last published.
    pub(super) fn idle_bytes(&self) -> usize {
        self.idle_bytes.load(Ordering::Relaxed)
    }

    /// The gated blocks, as last published.
    pub(super) fn gated(&self) -> usize {
        self.gated.load(Ordering::Relaxed)
    }

    /// Every stream's lists, taken out (the cache goes away).
    pub(super) fn take_all(&self) -> Vec<StreamLists<S>> {
        let mut sh = self.lock();
        let streams = core::mem::take(&mut sh.streams);
        *sh = Shared::new();
        streams
    }
}

/// The locked shared lists. Dropping it publishes the mirrors (and checks the counts in
/// debug builds) before the lock is released.
pub(super) struct SharedGuard<'a, S: StreamOrder> {
    lists: MutexGuard<'a, Shared<S>>,
    owner: &'a SharedLists<S>,
}

impl<S: StreamOrder> core::ops::Deref for SharedGuard<'_, S> {
    type Target = Shared<S>;
    fn deref(&self) -> &Shared<S> {
        &self.lists
    }
}

impl<S: StreamOrder> core::ops::DerefMut for SharedGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut Shared<S> {
        &mut self.lists
    }
}

impl<S: StreamOrder> Drop for SharedGuard<'_, S> {
    fn drop(&mut self) {
        self.owner.idle_bytes.store(self.lists.bytes, Ordering::Relaxed);
        self.owner
            .gated
            .store(self.lists.pending_blocks, Ordering::Relaxed);
        self.lists.debug_check();
    }
}
