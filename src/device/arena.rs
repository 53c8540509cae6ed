//! [`DeviceArena`]: bump allocation of device memory for per-batch scratch on one stream,
//! with a stream-ordered [`reset`](DeviceArena::reset) and checkpoints.
//!
//! An allocation is a pointer bump in a chunk (a block of a [`DevicePool`], on the arena's
//! stream): no lock, no CUDA call. A reset makes the whole arena reusable, and costs
//! nothing when every use of its memory was queued on the arena's stream: work queued
//! after the reset runs after those uses by stream order (llama.cpp's per-stream pools
//! rely on the same rule). Uses on other streams are declared with
//! [`DeviceArena::record_use`]; at the reset the arena's stream waits (on the GPU, no host
//! wait) for an event recorded on each. `reset(&mut self)` also proves on the host that no
//! slice of the arena is still alive. Chunks are kept across resets and reused in order,
//! so a steady batch loop makes no allocation at all after its first batch.

mod slice;

use core::cell::{Cell, RefCell};
use core::fmt;
use core::marker::PhantomData;

pub use slice::ArenaSlice;

use super::backend::CudaBackend;
use super::buffer::DeviceBuffer;
use super::order::MarkSet;
use super::pool::DevicePool;
use super::size_class::{round_to_granule, GRANULE};
use super::DeviceCopy;
use crate::cuda::{memset_d8_async, nvtx, Stream};
use crate::error::{Error, Result};
use crate::sync::global::{AtomicU64, Ordering};
use crate::trace::{Code, Note, Tag};

/// The default size of an arena's first chunk.
const DEFAULT_CHUNK: usize = 4 << 20;
/// Chunks double up to this size (larger requests get chunks of their own size).
const MAX_CHUNK: usize = 1 << 30;

/// A position in a [`DeviceArena`], from [`DeviceArena::checkpoint`];
/// [`DeviceArena::rewind`] makes everything allocated after it reusable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceCheckpoint {
    arena: u64,
    epoch: u64,
    chunk: usize,
    offset: usize,
    /// The device address of the chunk at index `chunk` then (0 with no chunk): after a
    /// rewind went behind this position, later allocations may rearrange the chunks, and
    /// the index then names another chunk.
    base: u64,
    /// How many slices the recorder had seen allocated then.
    traced: usize,
    /// How many slices were NVTX regions then.
    annotated: usize,
}

/// What a [`DeviceArena`] holds and hands out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct DeviceArenaStats {
    /// Chunks held.
    pub chunks: usize,
    /// Bytes of all chunks.
    pub capacity_bytes: usize,
    /// Bytes handed out since the last reset (alignment and skipped chunk tails included).
    pub used_bytes: usize,
    /// Other streams recorded with [`DeviceArena::record_use`] since the last reset.
    pub foreign_streams: usize,
    /// Events the arena's stream waited for at resets and rewinds, in all.
    pub foreign_waits: u64,
    /// Bytes given up on (never reused, never freed) because ordering after a recorded use
    /// failed.
    pub abandoned_bytes: usize,
}

/// Bump allocation of device memory on one stream, for per-batch scratch.
///
/// ```
/// use cudalloc::{cuda::Stream, device::{DeviceArena, DevicePool}};
/// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
///     let mut arena = DeviceArena::new(&pool, &stream).unwrap();
///     for batch in 0..3u32 {
///         let mut input = arena.alloc::<u32>(1024).unwrap();
///         let scratch = arena.alloc_zeroed::<f32>(4096).unwrap();
///         input.copy_from_host(&[batch; 1024]).unwrap();
///         // ... launch kernels on `stream` with input.device_ptr(), scratch.device_ptr() ...
///         assert_eq!(scratch.to_vec().unwrap()[0], 0.0);
///         arena.reset(); // no wait: every use was on the arena's stream
///     }
///     assert_eq!(arena.stats().chunks, 1);
/// }
/// ```
pub struct DeviceArena {
    pool: DevicePool,
    stream: Stream,
    /// Chunks in use order: `chunks[..=current]` have been bumped into since the last
    /// reset (or rewind), the ones after are spares.
    chunks: RefCell<Vec<DeviceBuffer<u8>>>,
    // current < chunks.len() whenever chunks is not empty
    current: Cell<usize>,
    // offset <= chunks[current].byte_len(), a multiple of GRANULE
    offset: Cell<usize>,
    /// The size of the next chunk (doubles up to MAX_CHUNK).
    next_chunk: Cell<usize>,
    /// Streams other than the arena's whose work uses its memory, since the last reset.
    foreign: RefCell<MarkSet<CudaBackend>>,
    id: u64,
    /// Moves at every reset: checkpoints from before are stale.
    epoch: Cell<u64>,
    foreign_waits: Cell<u64>,
    abandoned_bytes: Cell<usize>,
    /// Whether resets order the arena's stream after recorded uses (always, except in
    /// negative-control tests).
    guard: bool,
    /// The arena's events, named `DeviceArena(<ordinal>)`.
    trace: Tag,
    /// The slices allocated while recording and not yet made reusable (address, bytes),
    /// in allocation order: a reset or rewind records their frees. Empty while not
    /// recording.
    traced: RefCell<Vec<(u64, usize)>>,
    /// The slices registered as NVTX regions since the last reset (with a tool attached
    /// only), in allocation order: a reset or a rewind unregisters them.
    annotated: RefCell<Vec<u64>>,
}

fn device_arena_name(device: u32) -> String {
    format!("DeviceArena({device})")
}

impl fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceArena")
            .field("device", &self.pool.device())
            .field("stream", &self.stream.id())
            .field("stats", &self.stats())
            .finish()
    }
}

static NEXT_ARENA: AtomicU64 = AtomicU64::new(1);

impl DeviceArena {
    /// An arena on `stream` taking chunks (4 MiB first, doubling) from `pool`. Takes no
    /// memory until the first allocation.
    pub fn new(pool: &DevicePool, stream: &Stream) -> Result<Self> {
        Self::with_chunk_size(pool, stream, DEFAULT_CHUNK)
    }

    /// An arena whose first chunk has `chunk_size` bytes (rounded up to 256).
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::{DeviceArena, DevicePool}};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
    ///     let arena = DeviceArena::with_chunk_size(&pool, &stream, 64 << 20).unwrap();
    ///     let _a = arena.alloc::<u8>(1000).unwrap();
    ///     assert_eq!(arena.stats().capacity_bytes, 64 << 20);
    /// }
    /// ```
    pub fn with_chunk_size(pool: &DevicePool, stream: &Stream, chunk_size: usize) -> Result<Self> {
        if stream.device() != pool.device() {
            return Err(Error::InvalidArgument("the stream belongs to another device"));
        }
        let chunk = round_to_granule(chunk_size.clamp(GRANULE, MAX_CHUNK)).unwrap_or(MAX_CHUNK);
        Ok(Self {
            pool: pool.clone(),
            stream: stream.clone(),
            chunks: RefCell::new(Vec::new()),
            current: Cell::new(0),
            offset: Cell::new(0),
            next_chunk: Cell::new(chunk),
            foreign: RefCell::new(MarkSet::default()),
            id: NEXT_ARENA.fetch_add(1, Ordering::Relaxed),
            epoch: Cell::new(0),
            foreign_waits: Cell::new(0),
            abandoned_bytes: Cell::new(0),
            guard: true,
            trace: Tag::for_device(
                device_arena_name,
                u32::try_from(pool.device()).unwrap_or(u32::MAX),
            ),
            traced: RefCell::new(Vec::new()),
            annotated: RefCell::new(Vec::new()),
        })
    }

    /// The arena's stream: its slices are ordered on it.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The pool its chunks come from.
    pub fn pool(&self) -> &DevicePool {
        &self.pool
    }

    /// `len` elements of `T`, 256-byte aligned, valid until the next
    /// [`reset`](Self::reset) or [`rewind`](Self::rewind) (which the borrow enforces).
    /// Contents are unspecified.
    #[inline]
    pub fn alloc<T: DeviceCopy>(&self, len: usize) -> Result<ArenaSlice<'_, T>> {
        #[allow(clippy::let_unit_value)] // evaluated at compile time: the alignment check
        let () = super::Aligned::<T>::OK;
        // The limit is the device's memory, as the pool's own refusal says: a request
        // larger than a chunk gets a chunk of its own.
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| Error::TooLarge {
            requested: usize::MAX,
            limit: self.pool.device_bytes(),
        })?;
        let ptr = if bytes == 0 { 0 } else { self.bump(bytes)? };
        if crate::trace::on() && ptr != 0 {
            self.record_alloc(ptr, bytes);
        }
        if nvtx::on() && ptr != 0 {
            self.annotate(ptr, bytes);
        }
        Ok(ArenaSlice {
            ptr,
            len,
            arena: self,
            _elements: PhantomData,
        })
    }

    /// `len` zeroed elements (zeroed in the arena's stream order).
    pub fn alloc_zeroed<T: DeviceCopy>(&self, len: usize) -> Result<ArenaSlice<'_, T>> {
        let slice = self.alloc::<T>(len)?;
        if slice.ptr != 0 {
            // SAFETY: the range is the slice's own, queued on the arena's stream.
            unsafe { memset_d8_async(slice.ptr, 0, slice.byte_len(), &self.stream) }?;
        }
        Ok(slice)
    }

    #[inline(always)]
    fn bump(&self, bytes: usize) -> Result<u64> {
        let need = round_to_granule(bytes).ok_or_else(|| Error::TooLarge {
            requested: bytes,
            limit: self.pool.device_bytes(),
        })?;
        {
            let chunks = self.chunks.borrow();
            if let Some(c) = chunks.get(self.current.get()) {
                let offset = self.offset.get();
                if c.byte_len() - offset >= need {
                    self.offset.set(offset + need);
                    return Ok(c.device_ptr() + offset as u64);
                }
            }
        }
        self.bump_slow(need)
    }

    /// Records the slice at `ptr` (`bytes`), to record its free at the next reset or
    /// rewind past it.
    #[cold]
    #[inline(never)]
    fn record_alloc(&self, ptr: u64, bytes: usize) {
        self.trace.event(|| Note {
            given: round_to_granule(bytes).unwrap_or(bytes),
            align: GRANULE,
            stream: self.stream.id().get(),
            ..Note::new(Code::Alloc, ptr as usize, bytes)
        });
        if crate::trace::is_recording() {
            self.traced.borrow_mut().push((ptr, bytes));
        }
    }

    /// Records the frees of the slices recorded since the `from`th.
    /// The slice at `ptr` is a live region of its requested length.
    #[cold]
    #[inline(never)]
    fn annotate(&self, ptr: u64, bytes: usize) {
        nvtx::region_register(ptr, bytes);
        self.annotated.borrow_mut().push(ptr);
    }

    /// The slices from the `from`-th on are no longer live regions.
    fn unannotate(&self, from: usize) {
        let mut annotated = self.annotated.borrow_mut();
        let from = from.min(annotated.len());
        for ptr in annotated.drain(from..) {
            nvtx::region_unregister(ptr);
        }
    }

    fn record_frees(&self, from: usize) {
        let mut traced = self.traced.borrow_mut();
        let from = from.min(traced.len());
        let stream = self.stream.id().get();
        for (ptr, bytes) in traced.drain(from..) {
            self.trace.device_free(ptr, bytes, stream, true);
        }
    }

    /// Moves on to a spare chunk that fits, or to a new one.
    #[cold]
    #[inline(never)]
    fn bump_slow(&self, need: usize) -> Result<u64> {
        let mut chunks = self.chunks.borrow_mut();
        let next = if chunks.is_empty() {
            0
        } else {
            self.current.get() + 1
        };
        match (next..chunks.len()).find(|&j| chunks[j].byte_len() >= need) {
            Some(j) => chunks.swap(next, j),
            None => {
                let size = self.next_chunk.get().max(need);
                let chunk = self.pool.alloc::<u8>(size, &self.stream).inspect_err(|e| {
                    self.trace.event(|| Note {
                        given: 0,
                        align: GRANULE,
                        stream: self.stream.id().get(),
                        error: Some(e),
                        ..Note::new(Code::Failure, 0, need)
                    })
                })?;
                self.trace.event(|| Note {
                    stream: self.stream.id().get(),
                    ..Note::new(Code::SegmentAlloc, chunk.device_ptr() as usize, size)
                });
                self.next_chunk.set((size.saturating_mul(2)).min(MAX_CHUNK));
                // Only the slices in a chunk are live regions, not the chunk as a whole
                // (its drop's unregistration then finds no region).
                if nvtx::on() {
                    nvtx::region_unregister(chunk.device_ptr());
                }
                chunks.insert(next, chunk);
            }
        }
        self.current.set(next);
        self.offset.set(need);
        Ok(chunks[next].device_ptr())
    }

    /// Declares that work queued on `stream` (another stream than the arena's) uses the
    /// arena's memory: the next [`reset`](Self::reset), [`rewind`](Self::rewind) or drop
    /// makes the arena's stream wait (on the GPU) for an event recorded on `stream` then,
    /// after all work queued there until that moment.
    pub fn record_use(&self, stream: &Stream) {
        if stream.id() == self.stream.id() {
            return;
        }
        self.foreign.borrow_mut().add(stream.clone());
    }

    /// Orders the arena's stream after the recorded uses (an event on each of those
    /// streams, waited for by the arena's stream). False if that failed: the memory must
    /// not be reused.
    fn order_after_uses(&mut self) -> bool {
        let mut foreign = core::mem::take(self.foreign.get_mut());
        if !self.guard || foreign.is_empty() {
            return true;
        }
        let backend = &self.pool.cache().backend;
        if let Err(e) = foreign.seal(backend, 0, &mut 0) {
            crate::cuda::record_drop_error("ordering a device arena after a recorded use", e);
            return false;
        }
        let mut waits = 0;
        let ordered = foreign.order_before(backend, &self.stream, &mut waits);
        self.foreign_waits.set(self.foreign_waits.get() + waits);
        if !ordered {
            crate::cuda::record_drop_error(
                "ordering a device arena after a recorded use",
                "waiting for its event failed on the GPU and on the host",
            );
        }
        ordered
    }

    /// Gives up on every chunk after ordering failed: the GPU may still use them, so they
    /// are neither reused nor freed.
    fn abandon_all(&mut self) {
        let chunks = core::mem::take(self.chunks.get_mut());
        let bytes: usize = chunks.iter().map(DeviceBuffer::byte_len).sum();
        self.abandoned_bytes.set(self.abandoned_bytes.get() + bytes);
        for c in chunks {
            core::mem::forget(c);
        }
        log::error!("cudalloc: a device arena abandons {bytes} bytes the GPU may still use");
    }

    /// Makes all the arena's memory reusable. Stream-ordered: no wait at all when every use
    /// was on the arena's stream; for streams declared with
    /// [`record_use`](Self::record_use), the arena's stream waits for an event recorded on
    /// each (a GPU-side wait). `&mut self` proves no slice is alive. Chunks are kept.
    pub fn reset(&mut self) {
        if !self.order_after_uses() {
            self.abandon_all();
        }
        self.record_frees(0);
        self.unannotate(0);
        self.start_over();
    }

    /// Back to the first chunk, empty; checkpoints taken so far go stale.
    fn start_over(&mut self) {
        self.current.set(0);
        self.offset.set(0);
        self.epoch.set(self.epoch.get() + 1);
    }

    /// The current position: [`rewind`](Self::rewind) to it makes everything allocated
    /// after it reusable, for nested scopes of scratch.
    pub fn checkpoint(&self) -> DeviceCheckpoint {
        DeviceCheckpoint {
            arena: self.id,
            epoch: self.epoch.get(),
            chunk: self.current.get(),
            offset: self.offset.get(),
            base: self
                .chunks
                .borrow()
                .get(self.current.get())
                .map_or(0, DeviceBuffer::device_ptr),
            traced: self.traced.borrow().len(),
            annotated: self.annotated.borrow().len(),
        }
    }

    /// Makes everything allocated after `checkpoint` reusable, stream-ordered as
    /// [`reset`](Self::reset). Errors with `InvalidArgument` (changing nothing) for a
    /// checkpoint of another arena, from before a reset, after the current position, or
    /// behind which an earlier rewind went once the arena has since put another chunk at
    /// its place (as the host [`Arena`](crate::Arena) refuses a mark whose chunk went).
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::{DeviceArena, DevicePool}};
    /// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
    ///     let mut arena = DeviceArena::new(&pool, &stream).unwrap();
    ///     let _keep = arena.alloc::<u64>(16).unwrap().device_ptr();
    ///     let mark = arena.checkpoint();
    ///     let tmp = arena.alloc::<u64>(1 << 20).unwrap().device_ptr();
    ///     arena.rewind(mark).unwrap();
    ///     assert_eq!(arena.alloc::<u64>(1 << 20).unwrap().device_ptr(), tmp); // reused
    ///     arena.reset();
    ///     assert!(arena.rewind(mark).is_err(), "stale after the reset");
    /// }
    /// ```
    pub fn rewind(&mut self, checkpoint: DeviceCheckpoint) -> Result<()> {
        let DeviceCheckpoint {
            arena,
            epoch,
            chunk,
            offset,
            base,
            traced,
            annotated,
        } = checkpoint;
        let here = (self.current.get(), self.offset.get());
        // The chunk it names is still at its index (not rearranged since an earlier rewind
        // went behind it), so the position lies within that chunk; the start of a chunk
        // (the arena's start included) is a position whatever the chunk.
        let same_chunk = offset == 0
            || self
                .chunks
                .borrow()
                .get(chunk)
                .is_some_and(|c| c.device_ptr() == base && offset <= c.byte_len());
        if arena != self.id || epoch != self.epoch.get() || (chunk, offset) > here || !same_chunk {
            return Err(Error::InvalidArgument(
                "the checkpoint is of another arena, from before a reset, past the current position, \
                 or in a chunk rearranged since an earlier rewind went behind it",
            ));
        }
        if !self.order_after_uses() {
            self.abandon_all();
            self.record_frees(0);
            self.unannotate(0);
            self.start_over();
            return Ok(());
        }
        self.record_frees(traced);
        self.unannotate(annotated);
        self.current.set(chunk);
        self.offset.set(offset);
        Ok(())
    }

    /// What the arena holds and has handed out.
    pub fn stats(&self) -> DeviceArenaStats {
        let chunks = self.chunks.borrow();
        let current = self.current.get();
        let used_before: usize = chunks.iter().take(current).map(DeviceBuffer::byte_len).sum();
        DeviceArenaStats {
            chunks: chunks.len(),
            capacity_bytes: chunks.iter().map(DeviceBuffer::byte_len).sum(),
            used_bytes: if chunks.is_empty() {
                0
            } else {
                used_before + self.offset.get()
            },
            foreign_streams: self.foreign.borrow().len(),
            foreign_waits: self.foreign_waits.get(),
            abandoned_bytes: self.abandoned_bytes.get(),
        }
    }

    /// Test switch: with `false`, resets and rewinds reuse memory without ordering the
    /// arena's stream after recorded uses (the race the events prevent).
    #[cfg(feature = "test-hooks")]
    pub fn set_event_guard(&mut self, on: bool) {
        self.guard = on;
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        // The chunks are freed on the arena's stream (into the pool's cache): first order
        // that stream after the recorded uses.
        if !self.order_after_uses() {
            self.abandon_all();
        }
        self.record_frees(0);
        self.unannotate(0);
        if crate::trace::on() {
            let stream = self.stream.id().get();
            for c in self.chunks.borrow().iter() {
                self.trace.event(|| Note {
                    stream,
                    ..Note::new(Code::SegmentFree, c.device_ptr() as usize, c.byte_len())
                });
            }
        }
    }
}
