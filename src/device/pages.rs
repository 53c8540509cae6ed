//! The page heap: large blocks of a device pool backed by physical memory through the
//! CUDA virtual memory management API (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`,
//! `cuMemSetAccess`), so that memory freed from a block of one size serves a block of
//! any other size (what PyTorch's expandable segments do). Opt-in:
//! [`Backing::PhysicalPages`](super::Backing::PhysicalPages).
//!
//! # The algorithm
//!
//! - **Handles** of physical memory come in power-of-two multiples of the allocation
//!   granule (2 MiB on the H200): 1, 2, 4, ... granules. A block of n granules gets a
//!   virtual range of n granules (from a small cache of ranges by size, or
//!   `cuMemAddressReserve`), mapped from free handles, largest that fit first, then, for
//!   what is still missing, from new handles (the binary decomposition of the remainder),
//!   at consecutive offsets, and one `cuMemSetAccess` over the range. A handle is never
//!   split or partly mapped; one handle may be mapped at several ranges at once (its old
//!   block's, waiting to be unmapped, and its new one's).
//! - **Stream order**: a free records one mark (an event) on the freeing stream; the
//!   block's handles go back to the free lists at once, carrying that mark, and the block's
//!   range is *retired*. An allocation on stream T that takes a handle whose marks have not
//!   completed makes T wait for them (`cuStreamWaitEvent`, no host wait), the ordering
//!   the cache uses for its cross-stream hand-over. A handle keeps its marks until they
//!   complete, so a block that goes back without ever being ordered after the previous
//!   user still passes the older mark on. A retired range is unmapped (one `cuMemUnmap`
//!   per handle mapping) only once its mark has completed, polled on later calls; its
//!   reservation then goes to the cache of ranges (at most [`MAX_RANGES`]) or is freed.
//! - **Idle memory**: before new handles are created, free handles whose marks completed
//!   and that nothing maps any more are released (largest first) while the free bytes
//!   exceed 1/2^[`IDLE_SHIFT`] of the bytes in blocks: free handles that did not fit the
//!   request would otherwise add to the reservation. On out-of-memory every such handle is
//!   released and the creation retried once; then the error goes up to the cache, which
//!   releases its blocks, retries, and finally trims (below) after synchronizing.
//! - **Trim** (`trim_to(keep)`) waits on the host for every retired range and free
//!   handle, unmaps, and releases free handles (largest first) until the heap reserves
//!   less than `keep`; trimming to 0 also frees the cached ranges.
//! - One lock guards the heap, driver calls included: only misses of large blocks come
//!   here, and each is already a handful of driver calls.
//!
//! The algorithm is generic over [`Phys`] (the physical operations) and the cache's
//! [`Backend`] (its marks), so CPU tests drive it with `backend::fake`, whose fake
//! physical memory checks every mapping, unmapping and use against the simulated streams.

use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;

use super::backend::{is_out_of_memory, Backend};
use crate::cuda::{record_drop_error, StreamId};
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};

/// Free bytes tolerated before new handles are created: 1/2^IDLE_SHIFT of the bytes in
/// blocks.
pub(crate) const IDLE_SHIFT: u32 = 5;
/// Free bytes always tolerated, in granules.
const IDLE_FLOOR_GRANULES: usize = 8;
/// Retired ranges polled per call.
const POLL: usize = 16;
/// The most virtual ranges kept for reuse.
pub(crate) const MAX_RANGES: usize = 256;

/// The physical operations of the virtual memory management API, on one device.
pub(crate) trait Phys: Send + Sync + 'static {
    /// The allocation granule in bytes (a power of two).
    fn granule(&self) -> usize;
    /// Creates a handle of `bytes` (a multiple of the granule) of physical memory.
    fn create(&self, bytes: usize) -> Result<u64>;
    /// Releases a handle that no range maps.
    ///
    /// # Safety
    /// 1. `handle` came from [`Phys::create`], is released once, and is not mapped.
    unsafe fn release(&self, handle: u64) -> Result<()>;
    /// Reserves a virtual range of `bytes` (a multiple of the granule).
    fn reserve(&self, bytes: usize) -> Result<u64>;
    /// Frees a virtual range.
    ///
    /// # Safety
    /// 1. `va`, `bytes` came from [`Phys::reserve`], are freed once, and nothing in the
    ///    range is mapped.
    unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()>;
    /// Maps the whole of `handle` (of `bytes`) at `va`.
    ///
    /// # Safety
    /// 1. `[va, va + bytes)` lies in a reserved range and nothing is mapped in it; `handle`
    ///    is live and of `bytes`.
    unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()>;
    /// Unmaps the mapping at `va` of `bytes` (one handle's).
    ///
    /// # Safety
    /// 1. One [`Phys::map`] made exactly this mapping, and no work queued on the device
    ///    that has not completed uses it.
    unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()>;
    /// Lets the device read and write `[va, va + bytes)`.
    ///
    /// # Safety
    /// 1. The range is wholly mapped.
    unsafe fn set_access(&self, va: u64, bytes: usize) -> Result<()>;
}

/// A mark recorded at a free, shared by the handles of the freed block and its retired
/// range.
struct Stamp<M> {
    stream: StreamId,
    /// `None`: the stream was synchronized instead (complete).
    mark: Option<M>,
    done: AtomicBool,
}

impl<M> Stamp<M> {
    /// Whether the work before the mark has completed (queried once it has, never again).
    fn complete<B: Backend<Mark = M>>(&self, b: &B) -> bool {
        if self.done.load(Ordering::Relaxed) {
            return true;
        }
        let done = match &self.mark {
            None => true,
            Some(m) => matches!(b.is_complete(m), Ok(true)),
        };
        if done {
            self.done.store(true, Ordering::Relaxed);
        }
        done
    }

    /// Waits on the host; whether it completed.
    fn wait_host<B: Backend<Mark = M>>(&self, b: &B) -> bool {
        if self.complete(b) {
            return true;
        }
        let ok = self.mark.as_ref().is_none_or(|m| match b.wait_host(m) {
            Ok(()) => true,
            Err(e) => {
                record_drop_error("waiting for a page's mark", e);
                false
            }
        });
        if ok {
            self.done.store(true, Ordering::Relaxed);
        }
        ok
    }
}

/// A handle of physical memory.
struct Page<M> {
    bytes: usize,
    /// Marks of frees whose work may not have completed.
    marks: Vec<Arc<Stamp<M>>>,
    /// Ranges mapping it now.
    maps: u32,
}

/// One handle's mapping in a block: (handle, its bytes), at consecutive offsets.
type Pieces = Vec<(u64, usize)>;

/// A freed block's range, mapped until its mark completes.
struct Retired<M> {
    va: u64,
    pieces: Pieces,
    stamp: Arc<Stamp<M>>,
}

/// What the heap has done and holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageStats {
    /// Bytes of live handles, now and at most.
    pub(crate) reserved: usize,
    pub(crate) peak_reserved: usize,
    /// Bytes of handles in no block.
    pub(crate) free_bytes: usize,
    /// Bytes of handles in live blocks, now and at most.
    pub(crate) block_bytes: usize,
    pub(crate) peak_block_bytes: usize,
    pub(crate) handles: usize,
    pub(crate) creates: u64,
    pub(crate) releases: u64,
    pub(crate) maps: u64,
    pub(crate) unmaps: u64,
    pub(crate) range_reserves: u64,
    pub(crate) waits: u64,
}

struct State<M> {
    pages: HashMap<u64, Page<M>>,
    /// Free handles by order (2^order granules), oldest first.
    free: Vec<VecDeque<u64>>,
    /// Live blocks by address.
    live: HashMap<u64, Pieces>,
    retired: VecDeque<Retired<M>>,
    /// Unmapped virtual ranges by size.
    ranges: HashMap<usize, Vec<u64>>,
    range_count: usize,
    /// Blocks whose free could neither be marked nor synchronized: never reused.
    lost: Vec<(u64, Pieces)>,
    stats: PageStats,
}

/// Blocks of at least this many granules go to the page heap (when there is one): 2
/// granules (4 MiB on the H200). Rounding a block up to whole granules wastes less than a
/// granule, at most a third of a block from 2 granules up and little of the bytes of a
/// workload whose sizes spread to tens of MiB; blocks below a granule would waste most
/// of one, and the driver pool packs them into its chunks. The threshold is low because
/// the driver pool fragments under blocks of mixed sizes: on the simulated pool, RMM's
/// random workload reserves 1.108 of its peak request with pages from 2 granules up,
/// 1.112 from 4, 1.174 from 8 (the driver pool's share then reserved 2.7 GiB for about
/// 1 GiB of blocks) and 1.285 from 16.
pub(crate) const PAGE_MIN_GRANULES: usize = 2;

/// Large blocks on physical pages. See the [module docs](self).
pub(crate) struct PageHeap<P: Phys, B: Backend> {
    phys: P,
    granule: usize,
    /// The smallest block the heap serves; smaller ones stay on the driver pool.
    min_block: usize,
    state: Mutex<State<B::Mark>>,
    _backend: PhantomData<fn() -> B>,
}

impl<P: Phys, B: Backend> core::fmt::Debug for PageHeap<P, B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PageHeap")
            .field("granule", &self.granule)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<P: Phys, B: Backend> PageHeap<P, B> {
    pub(crate) fn new(phys: P) -> Self {
        let granule = phys.granule();
        debug_assert!(granule.is_power_of_two());
        Self {
            phys,
            granule,
            min_block: granule * PAGE_MIN_GRANULES,
            state: Mutex::new(State {
                pages: HashMap::new(),
                free: Vec::new(),
                live: HashMap::new(),
                retired: VecDeque::new(),
                ranges: HashMap::new(),
                range_count: 0,
                lost: Vec::new(),
                stats: PageStats::default(),
            }),
            _backend: PhantomData,
        }
    }

    /// This heap serving blocks of `bytes` and more (simulated devices test thresholds).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn with_min_block(self, bytes: usize) -> Self {
        Self {
            min_block: bytes,
            ..self
        }
    }

    /// `heap`, if there is one and it serves blocks of `bytes` (a backend's routing: the
    /// same size routes an allocation and its free).
    #[inline]
    pub(crate) fn serving(heap: &Option<Self>, bytes: usize) -> Option<&Self> {
        heap.as_ref().filter(|h| bytes >= h.min_block)
    }

    /// Trims this heap and says what the driver pool beside it (reserving `pool_reserved`
    /// bytes) may keep, so that the two together keep less than `keep`.
    pub(crate) fn trim_beside_pool(&self, b: &B, keep: usize, pool_reserved: usize) -> usize {
        self.trim_to(b, keep.saturating_sub(pool_reserved));
        keep.saturating_sub(self.reserved())
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn phys(&self) -> &P {
        &self.phys
    }

    pub(crate) fn stats(&self) -> PageStats {
        lock(&self.state).stats
    }

    pub(crate) fn reserved(&self) -> usize {
        lock(&self.state).stats.reserved
    }

    pub(crate) fn reset_peak(&self) {
        let mut st = lock(&self.state);
        st.stats.peak_reserved = st.stats.reserved;
        st.stats.peak_block_bytes = st.stats.block_bytes;
    }

    fn order(&self, bytes: usize) -> usize {
        (bytes / self.granule).trailing_zeros() as usize
    }

    /// A block of at least `bytes` (nonzero) usable by work queued on `stream` from now on.
    pub(crate) fn alloc(&self, b: &B, bytes: usize, stream: &B::Stream) -> Result<u64> {
        let g = self.granule;
        let n = bytes.div_ceil(g);
        let len = n.checked_mul(g).ok_or(Error::OutOfMemory { requested: bytes })?;
        let mut st = lock(&self.state);
        self.poll(&mut st, b, POLL);
        let va = match st.ranges.get_mut(&len).and_then(Vec::pop) {
            Some(va) => {
                st.range_count -= 1;
                va
            }
            None => {
                st.stats.range_reserves += 1;
                self.phys.reserve(len)?
            }
        };
        let mut pieces: Pieces = Vec::new();
        let mut left = n;
        // Free handles, largest that fit first.
        for order in (0..st.free.len()).rev() {
            let k = 1usize << order;
            while k <= left {
                let Some(h) = st.free[order].pop_front() else {
                    break;
                };
                st.stats.free_bytes -= k * g;
                pieces.push((h, k * g));
                left -= k;
            }
        }
        if left > 0 {
            // Bound the free handles that did not fit before adding new ones.
            let allowance = ((st.stats.block_bytes + len) >> IDLE_SHIFT).max(IDLE_FLOOR_GRANULES * g);
            if st.stats.free_bytes > allowance {
                self.release_free(&mut st, b, allowance, false);
            }
        }
        let mut retried = false;
        while left > 0 {
            let k = 1usize << (usize::BITS - 1 - left.leading_zeros());
            match self.phys.create(k * g) {
                Ok(h) => {
                    st.pages.insert(
                        h,
                        Page {
                            bytes: k * g,
                            marks: Vec::new(),
                            maps: 0,
                        },
                    );
                    st.stats.creates += 1;
                    st.stats.handles += 1;
                    st.stats.reserved += k * g;
                    st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
                    pieces.push((h, k * g));
                    left -= k;
                }
                Err(e) if is_out_of_memory(&e) && !retried && st.stats.free_bytes > 0 => {
                    retried = true;
                    self.poll(&mut st, b, usize::MAX);
                    self.release_free(&mut st, b, 0, false);
                }
                Err(e) => {
                    self.undo(&mut st, va, len, pieces, 0);
                    return Err(e);
                }
            }
        }
        // Order `stream` after the previous users of the handles it takes.
        let me = B::stream_id(stream);
        let mut waited: Vec<*const Stamp<B::Mark>> = Vec::new();
        let mut failed = None;
        'outer: for (h, _) in &pieces {
            let Some(page) = st.pages.get_mut(h) else { continue };
            page.marks.retain(|s| !s.complete(b));
            for s in &page.marks {
                let (Some(m), false) = (&s.mark, s.stream == me || waited.contains(&Arc::as_ptr(s))) else {
                    continue;
                };
                if let Err(e) = b.wait(stream, m) {
                    failed = Some(e);
                    break 'outer;
                }
                waited.push(Arc::as_ptr(s));
            }
        }
        st.stats.waits += waited.len() as u64;
        if let Some(e) = failed {
            self.undo(&mut st, va, len, pieces, 0);
            return Err(e);
        }
        let mut off = 0u64;
        for (i, &(h, sz)) in pieces.iter().enumerate() {
            // SAFETY: the range [va, va + len) is reserved and unmapped (fresh, or cached
            // after its mappings were unmapped); the pieces' sizes sum to len; h is live and
            // of sz bytes.
            if let Err(e) = unsafe { self.phys.map(va + off, sz, h) } {
                self.undo(&mut st, va, len, pieces, i);
                return Err(e);
            }
            if let Some(p) = st.pages.get_mut(&h) {
                p.maps += 1;
            }
            st.stats.maps += 1;
            off += sz as u64;
        }
        // SAFETY: every piece of the range was mapped above.
        if let Err(e) = unsafe { self.phys.set_access(va, len) } {
            let mapped = pieces.len();
            self.undo(&mut st, va, len, pieces, mapped);
            return Err(e);
        }
        st.stats.block_bytes += len;
        st.stats.peak_block_bytes = st.stats.peak_block_bytes.max(st.stats.block_bytes);
        st.live.insert(va, pieces);
        Ok(va)
    }

    /// Undoes a failed allocation: unmaps the first `mapped` pieces (nothing used them),
    /// puts the handles back in the free lists, keeps the range for reuse.
    fn undo(&self, st: &mut State<B::Mark>, va: u64, len: usize, pieces: Pieces, mapped: usize) {
        // SAFETY: the first `mapped` pieces were mapped at `va` by this allocation (at
        // consecutive offsets); no work was queued on them.
        let clean = unsafe { self.unmap_pieces(st, va, &pieces[..mapped]) };
        if !clean {
            // A mapping stays: neither the range nor its handles may be reused.
            st.lost.push((va, pieces));
            return;
        }
        for (h, sz) in pieces.into_iter().rev() {
            let order = self.order(sz);
            if st.free.len() <= order {
                st.free.resize_with(order + 1, VecDeque::new);
            }
            st.free[order].push_front(h);
            st.stats.free_bytes += sz;
        }
        self.keep_range(st, va, len);
    }

    /// Unmaps `pieces`, mapped at consecutive offsets from `va`, one call each; false if
    /// any unmap failed (counted as a drop error; that mapping stays).
    ///
    /// # Safety
    /// 1. Each piece is mapped at its offset from `va` and no work uses the range any more
    ///    (none was queued on it, or every use completed).
    unsafe fn unmap_pieces(&self, st: &mut State<B::Mark>, va: u64, pieces: &[(u64, usize)]) -> bool {
        let mut off = 0u64;
        let mut clean = true;
        for &(h, sz) in pieces {
            // SAFETY: obligation 1.
            match unsafe { self.phys.unmap(va + off, sz) } {
                Ok(()) => {
                    if let Some(p) = st.pages.get_mut(&h) {
                        p.maps -= 1;
                    }
                    st.stats.unmaps += 1;
                }
                Err(e) => {
                    clean = false;
                    record_drop_error("cuMemUnmap", e);
                }
            }
            off += sz as u64;
        }
        clean
    }

    /// Keeps an unmapped range for reuse, or frees it.
    fn keep_range(&self, st: &mut State<B::Mark>, va: u64, len: usize) {
        if st.range_count < MAX_RANGES {
            st.ranges.entry(len).or_default().push(va);
            st.range_count += 1;
        } else {
            // SAFETY: the range came from reserve, is unmapped and is forgotten here.
            if let Err(e) = unsafe { self.phys.free_range(va, len) } {
                record_drop_error("cuMemAddressFree", e);
            }
        }
    }

    /// Frees the block at `ptr` in the order of `stream`.
    ///
    /// # Safety
    /// 1. `ptr` came from [`PageHeap::alloc`] of this heap, is freed once, and every use of
    ///    it is ordered before this point of `stream`.
    pub(crate) unsafe fn free(&self, b: &B, ptr: u64, stream: &B::Stream) {
        let mark = match b.mark(stream) {
            Ok(m) => Some(m),
            Err(e) => {
                record_drop_error("recording a page block's free", e);
                if let Err(e) = b.synchronize(stream) {
                    record_drop_error("synchronizing a page block's free", e);
                    let mut st = lock(&self.state);
                    if let Some(pieces) = st.live.remove(&ptr) {
                        st.lost.push((ptr, pieces));
                    }
                    return;
                }
                None
            }
        };
        let stamp = Arc::new(Stamp {
            stream: B::stream_id(stream),
            mark,
            done: AtomicBool::new(false),
        });
        let mut st = lock(&self.state);
        let Some(pieces) = st.live.remove(&ptr) else {
            drop(st);
            return record_drop_error(
                "freeing a page block",
                Error::InvalidArgument("not a live block of the page heap"),
            );
        };
        for &(h, sz) in &pieces {
            if let Some(page) = st.pages.get_mut(&h) {
                page.marks.retain(|s| !s.complete(b));
                page.marks.push(stamp.clone());
            }
            let order = self.order(sz);
            if st.free.len() <= order {
                st.free.resize_with(order + 1, VecDeque::new);
            }
            st.free[order].push_back(h);
            st.stats.free_bytes += sz;
            st.stats.block_bytes -= sz;
        }
        st.retired.push_back(Retired {
            va: ptr,
            pieces,
            stamp,
        });
        self.poll(&mut st, b, POLL);
    }

    /// Unmaps retired ranges whose marks completed, querying at most `max` marks. Marks of
    /// one stream complete in order: after one that has not, the later ones of its stream
    /// are skipped without a query.
    fn poll(&self, st: &mut State<B::Mark>, b: &B, max: usize) {
        let mut i = 0;
        let mut seen = 0;
        let mut behind: Vec<StreamId> = Vec::new();
        while i < st.retired.len() && seen < max {
            let stamp = &st.retired[i].stamp;
            if behind.contains(&stamp.stream) {
                i += 1;
                continue;
            }
            seen += 1;
            if stamp.complete(b) {
                if let Some(r) = st.retired.remove(i) {
                    self.unmap_retired(st, r);
                }
            } else {
                behind.push(st.retired[i].stamp.stream);
                i += 1;
            }
        }
    }

    fn unmap_retired(&self, st: &mut State<B::Mark>, r: Retired<B::Mark>) {
        let len: usize = r.pieces.iter().map(|p| p.1).sum();
        // SAFETY: the pieces were mapped at `r.va` by an allocation; the free's mark
        // completed, so no work uses them (every use was ordered before the mark).
        let clean = unsafe { self.unmap_pieces(st, r.va, &r.pieces) };
        if clean {
            self.keep_range(st, r.va, len);
        }
    }

    /// Releases free handles, largest first, while the free bytes exceed `target`: those
    /// that nothing maps and whose marks completed (with `wait`, after waiting on the host
    /// for them).
    fn release_free(&self, st: &mut State<B::Mark>, b: &B, target: usize, wait: bool) {
        for order in (0..st.free.len()).rev() {
            let mut i = 0;
            while i < st.free[order].len() && st.stats.free_bytes > target {
                let h = st.free[order][i];
                let Some(page) = st.pages.get_mut(&h) else {
                    st.free[order].remove(i);
                    continue;
                };
                let ready = page.maps == 0
                    && page
                        .marks
                        .iter()
                        .all(|s| if wait { s.wait_host(b) } else { s.complete(b) });
                if !ready {
                    i += 1;
                    continue;
                }
                // SAFETY: the handle is live, in no block, and nothing maps it.
                match unsafe { self.phys.release(h) } {
                    Ok(()) => {
                        st.free[order].remove(i);
                        let bytes = st.pages.remove(&h).map_or(0, |p| p.bytes);
                        st.stats.free_bytes -= bytes;
                        st.stats.reserved -= bytes;
                        st.stats.handles -= 1;
                        st.stats.releases += 1;
                    }
                    Err(e) => {
                        record_drop_error("cuMemRelease", e);
                        i += 1;
                    }
                }
            }
        }
    }

    /// Waits on the host for every retired range and free handle, unmaps, and releases
    /// free handles until the heap reserves less than `keep` bytes (0: all of them, and the
    /// cached ranges are freed too).
    pub(crate) fn trim_to(&self, b: &B, keep: usize) {
        let mut st = lock(&self.state);
        let retired: Vec<Retired<B::Mark>> = st.retired.drain(..).collect();
        for r in retired {
            if r.stamp.wait_host(b) {
                self.unmap_retired(&mut st, r);
            } else {
                st.retired.push_back(r);
            }
        }
        if st.stats.reserved >= keep.max(1) {
            // Releasing more than reserved - keep of the free bytes brings it below keep.
            let target = st.stats.free_bytes.saturating_sub(st.stats.reserved - keep + 1);
            self.release_free(&mut st, b, target, true);
        }
        if keep == 0 {
            for (len, vas) in std::mem::take(&mut st.ranges) {
                for va in vas {
                    // SAFETY: cached ranges are unmapped and owned by the heap alone.
                    if let Err(e) = unsafe { self.phys.free_range(va, len) } {
                        record_drop_error("cuMemAddressFree", e);
                    }
                }
            }
            st.range_count = 0;
        }
    }

    /// Gives everything back, at the backend's drop: trims to 0, then releases the
    /// handles of blocks still live or lost (the driver frees them once unmapped).
    pub(crate) fn shutdown(&self, b: &B) {
        self.trim_to(b, 0);
        let mut st = lock(&self.state);
        let st = &mut *st;
        let live: Vec<(u64, Pieces)> = st.live.drain().chain(st.lost.drain(..)).collect();
        for (_, pieces) in live {
            for (h, _) in pieces {
                if st.pages.remove(&h).is_some() {
                    // SAFETY: the pool is being dropped: nothing allocates from it again; a
                    // handle released while mapped is freed by the driver at its unmap.
                    if let Err(e) = unsafe { self.phys.release(h) } {
                        record_drop_error("cuMemRelease", e);
                    }
                }
            }
        }
    }
}
