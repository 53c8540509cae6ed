//! What the device cache needs from below: stream-ordered allocation from a driver pool,
//! and stream order itself ("mark a point on stream S", "make T wait for it", "has it
//! completed?"). [`CudaBackend`] implements it with a `cuMemPool` and pooled events; the
//! fake in [`fake`] simulates streams as counters so that the cache's algorithm runs in
//! CPU tests and loom models, and checks every cross-stream hand-over it makes.

use crate::cuda::mem_pool::MemPool;
use crate::cuda::{mem_info, PooledEvent, Stream, StreamId};
use crate::error::{Error, Result};

/// Stream-ordered memory and stream order, as the cache uses them.
pub(crate) trait Backend: Send + Sync + 'static {
    /// A live handle of a stream (the cache keeps one for every stream whose blocks it
    /// holds, to record marks on it later).
    type Stream: Clone + Send + Sync + 'static;
    /// A point recorded on a stream (a CUDA event).
    type Mark: Send + 'static;

    /// The stream's process-unique id (never the raw handle, which the driver reuses).
    fn stream_id(stream: &Self::Stream) -> StreamId;
    /// Records a mark at the current end of `stream`.
    fn mark(&self, stream: &Self::Stream) -> Result<Self::Mark>;
    /// Makes work queued on `stream` from now on wait for `mark` (no host wait).
    fn wait(&self, stream: &Self::Stream, mark: &Self::Mark) -> Result<()>;
    /// Whether the work before `mark` has completed (never blocks).
    fn is_complete(&self, mark: &Self::Mark) -> Result<bool>;
    /// Blocks the host until the work before `mark` has completed.
    fn wait_host(&self, mark: &Self::Mark) -> Result<()>;
    /// Blocks the host until all work queued on `stream` has completed.
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;
    /// Allocates `bytes` (nonzero, a multiple of 256) usable by work queued on `stream`
    /// from now on.
    fn alloc(&self, bytes: usize, stream: &Self::Stream) -> Result<u64>;
    /// Frees a block in the order of `stream`.
    ///
    /// # Safety
    /// 1. `ptr` came from [`Backend::alloc`] of this backend with `bytes`, is freed once,
    ///    and every use of it is ordered before this point of `stream`.
    unsafe fn free(&self, ptr: u64, bytes: usize, stream: &Self::Stream);
    /// Returns memory the backend holds but no allocation uses (frees that have
    /// completed) to the device. Errors are counted, never raised.
    fn trim(&self);
}

/// Whether `e` says that memory ran out (rather than that something is broken).
pub(crate) fn is_out_of_memory(e: &Error) -> bool {
    match e {
        Error::OutOfMemory { .. } | Error::DeviceOutOfMemory { .. } | Error::LimitExceeded { .. } => true,
        Error::Cuda(c) => c.is_out_of_memory(),
        _ => false,
    }
}

/// The backend of a [`DevicePool`](super::DevicePool): its own `cuMemPool` and the
/// per-device pool of reusable events.
#[derive(Debug)]
pub(crate) struct CudaBackend {
    pub(crate) pool: MemPool,
    /// The device's memory, in bytes.
    pub(crate) device_bytes: usize,
}

impl CudaBackend {
    /// Refuses, before any driver allocation, what cannot fit: for requests of an eighth
    /// of the device and more, more than is free on it plus what this pool holds unused.
    /// A driver asked for more than is free may fill the device while it tries, failing
    /// other threads' and processes' allocations.
    fn check_fits(&self, bytes: usize) -> Result<()> {
        if bytes >= self.device_bytes / 8 {
            let (free, _) = mem_info(self.pool.device())?;
            let u = self.pool.usage()?;
            let idle = usize::try_from(u.reserved.saturating_sub(u.used)).unwrap_or(usize::MAX);
            if bytes > free.saturating_add(idle) {
                return Err(Error::OutOfMemory { requested: bytes });
            }
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Stream = Stream;
    type Mark = PooledEvent;

    #[inline(always)]
    fn stream_id(stream: &Stream) -> StreamId {
        stream.id()
    }

    fn mark(&self, stream: &Stream) -> Result<PooledEvent> {
        PooledEvent::record(stream)
    }

    fn wait(&self, stream: &Stream, mark: &PooledEvent) -> Result<()> {
        stream.wait(mark.event())
    }

    fn is_complete(&self, mark: &PooledEvent) -> Result<bool> {
        mark.is_complete()
    }

    fn wait_host(&self, mark: &PooledEvent) -> Result<()> {
        mark.synchronize()
    }

    fn synchronize(&self, stream: &Stream) -> Result<()> {
        stream.synchronize()
    }

    fn alloc(&self, bytes: usize, stream: &Stream) -> Result<u64> {
        self.check_fits(bytes)?;
        self.pool.alloc_async(bytes, stream)
    }

    unsafe fn free(&self, ptr: u64, _bytes: usize, stream: &Stream) {
        // SAFETY: obligation 1 of this function is MemPool::free_async's obligation 1.
        unsafe { self.pool.free_async(ptr, stream) }
    }

    fn trim(&self) {
        if let Err(e) = self.pool.trim_to(0) {
            crate::cuda::record_drop_error("cuMemPoolTrimTo", e);
        }
    }
}

/// A simulated GPU for CPU tests and loom models: each stream is a counter of the
/// operations queued on it and of those completed; a mark is a position; a wait is
/// remembered by the waiting stream. Tests ask [`FakeStream::covers`] whether a stream
/// that received a block is ordered after the block's last use elsewhere.
#[cfg(test)]
pub(crate) mod fake {
    use std::collections::BTreeMap;

    use super::Backend;
    use crate::cuda::StreamId;
    use crate::error::{Error, Result};
    use crate::sync::{lock, Arc, AtomicBool, AtomicU64, Mutex, Ordering};

    /// One simulated stream's queue.
    #[derive(Debug, Default)]
    pub(crate) struct Lane {
        /// Operations queued so far (positions 1..=queued).
        queued: AtomicU64,
        /// Operations completed so far.
        completed: AtomicU64,
        /// A vector clock: for each other stream, the latest position of it that work
        /// queued on this stream from now on runs after (through waits, transitively: a
        /// mark carries the clock of its stream, and a wait merges it).
        clock: Mutex<BTreeMap<StreamId, u64>>,
    }

    /// A simulated stream (clones share the queue).
    #[derive(Clone, Debug)]
    pub(crate) struct FakeStream {
        pub(crate) id: StreamId,
        pub(crate) lane: Arc<Lane>,
    }

    impl FakeStream {
        pub(crate) fn new() -> Self {
            Self {
                id: StreamId::fresh(),
                lane: Arc::new(Lane::default()),
            }
        }

        /// Queues an operation (a kernel using a block); returns its position.
        pub(crate) fn enqueue(&self) -> u64 {
            self.lane.queued.fetch_add(1, Ordering::SeqCst) + 1
        }

        /// Operations completed so far.
        pub(crate) fn completed(&self) -> u64 {
            self.lane.completed.load(Ordering::SeqCst)
        }

        /// The GPU catches up: everything queued so far completes.
        pub(crate) fn complete_all(&self) {
            let q = self.lane.queued.load(Ordering::SeqCst);
            self.lane.completed.fetch_max(q, Ordering::SeqCst);
        }

        /// Whether work queued on `self` from now on runs after position `pos` of
        /// `other`: the same stream, or `other` has completed it, or `self` waits
        /// (directly or through other streams' marks) for a mark of `other` at or after it.
        pub(crate) fn covers(&self, other: &FakeStream, pos: u64) -> bool {
            if self.id == other.id || other.completed() >= pos {
                return true;
            }
            lock(&self.lane.clock).get(&other.id).is_some_and(|&p| p >= pos)
        }
    }

    /// A position recorded on a simulated stream, with that stream's clock then.
    #[derive(Debug)]
    pub(crate) struct FakeMark {
        stream: StreamId,
        pos: u64,
        lane: Arc<Lane>,
        clock: BTreeMap<StreamId, u64>,
    }

    /// A simulated device: addresses from a counter, a byte limit, a check that every
    /// block is freed once with its size.
    #[derive(Debug)]
    pub(crate) struct FakeBackend {
        next: AtomicU64,
        held: AtomicU64,
        limit: u64,
        live: Arc<Mutex<BTreeMap<u64, usize>>>,
        /// Marks fail (a broken stream) while set.
        pub(crate) fail_marks: AtomicBool,
        pub(crate) marks: AtomicU64,
        pub(crate) allocs: AtomicU64,
        pub(crate) frees: AtomicU64,
        pub(crate) syncs: AtomicU64,
    }

    impl FakeBackend {
        pub(crate) fn new(limit: u64) -> Self {
            Self {
                next: AtomicU64::new(1 << 20),
                held: AtomicU64::new(0),
                limit,
                live: Arc::new(Mutex::new(BTreeMap::new())),
                fail_marks: AtomicBool::new(false),
                marks: AtomicU64::new(0),
                allocs: AtomicU64::new(0),
                frees: AtomicU64::new(0),
                syncs: AtomicU64::new(0),
            }
        }

        /// Bytes allocated and not freed.
        pub(crate) fn held(&self) -> u64 {
            self.held.load(Ordering::SeqCst)
        }

        /// Blocks allocated and not freed.
        pub(crate) fn live_blocks(&self) -> usize {
            lock(&self.live).len()
        }

        /// The blocks allocated and not freed, readable after the backend is gone.
        pub(crate) fn live_map(&self) -> Arc<Mutex<BTreeMap<u64, usize>>> {
            self.live.clone()
        }
    }

    impl Backend for FakeBackend {
        type Stream = FakeStream;
        type Mark = FakeMark;

        fn stream_id(stream: &FakeStream) -> StreamId {
            stream.id
        }

        fn mark(&self, stream: &FakeStream) -> Result<FakeMark> {
            if self.fail_marks.load(Ordering::SeqCst) {
                return Err(Error::InvalidArgument("fake: marks fail"));
            }
            self.marks.fetch_add(1, Ordering::SeqCst);
            // Recording is itself an operation queued on the stream, after all earlier ones
            // (the waits queued before it included: the clock is read under its lock).
            let clock = lock(&stream.lane.clock);
            let pos = stream.enqueue();
            let mut snapshot = clock.clone();
            snapshot.insert(stream.id, pos);
            Ok(FakeMark {
                stream: stream.id,
                pos,
                lane: stream.lane.clone(),
                clock: snapshot,
            })
        }

        fn wait(&self, stream: &FakeStream, mark: &FakeMark) -> Result<()> {
            debug_assert_eq!(mark.clock.get(&mark.stream), Some(&mark.pos));
            let mut clock = lock(&stream.lane.clock);
            for (&s, &p) in &mark.clock {
                if s != stream.id {
                    let e = clock.entry(s).or_insert(0);
                    *e = (*e).max(p);
                }
            }
            Ok(())
        }

        fn is_complete(&self, mark: &FakeMark) -> Result<bool> {
            Ok(mark.lane.completed.load(Ordering::SeqCst) >= mark.pos)
        }

        fn wait_host(&self, mark: &FakeMark) -> Result<()> {
            mark.lane.completed.fetch_max(mark.pos, Ordering::SeqCst);
            Ok(())
        }

        fn synchronize(&self, stream: &FakeStream) -> Result<()> {
            self.syncs.fetch_add(1, Ordering::SeqCst);
            stream.complete_all();
            Ok(())
        }

        fn alloc(&self, bytes: usize, _stream: &FakeStream) -> Result<u64> {
            assert!(bytes > 0 && bytes % 256 == 0, "fake: bad request {bytes}");
            let b = bytes as u64;
            let mut held = self.held.load(Ordering::SeqCst);
            loop {
                if held + b > self.limit {
                    return Err(Error::OutOfMemory { requested: bytes });
                }
                match self
                    .held
                    .compare_exchange(held, held + b, Ordering::SeqCst, Ordering::SeqCst)
                {
                    Ok(_) => break,
                    Err(now) => held = now,
                }
            }
            let ptr = self.next.fetch_add(b, Ordering::SeqCst);
            lock(&self.live).insert(ptr, bytes);
            self.allocs.fetch_add(1, Ordering::SeqCst);
            Ok(ptr)
        }

        unsafe fn free(&self, ptr: u64, bytes: usize, _stream: &FakeStream) {
            let size = lock(&self.live).remove(&ptr);
            assert_eq!(
                size,
                Some(bytes),
                "fake: block {ptr:#x} freed twice or with a wrong size"
            );
            self.held.fetch_sub(bytes as u64, Ordering::SeqCst);
            self.frees.fetch_add(1, Ordering::SeqCst);
        }

        fn trim(&self) {}
    }
}
