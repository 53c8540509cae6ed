//! Pinning memory the caller already has: [`HostRegistration`] page-locks an existing
//! buffer (an mmap'd file, a `Vec` from another crate) with `cuMemHostRegister` for as long
//! as the guard lives, and makes it known to the crate like its own pinned memory: the
//! copy helpers, [`record_use`](crate::record_use) and the cudarc views record their GPU
//! uses on it, and the guard unregisters the buffer only after those uses have completed.

use core::marker::PhantomData;
use core::ptr::NonNull;

use crate::cuda::raw;
use crate::error::{Error, Result};
use crate::fence::registry::{self, UseRecorder};
use crate::fence::{SharedFence, UseSet};
use crate::sync::{lock, Arc, Mutex};

/// Above this many recorded uses, recording a new one first forgets the completed ones
/// (uses without a stream, such as those of cudarc copies, are never merged).
const PRUNE_ABOVE: usize = 32;

/// The uses of a registration still open to records.
struct OpenUses {
    set: UseSet,
    /// Above this many uses a record forgets the completed ones: [`PRUNE_ABOVE`], or
    /// twice what a prune left pending, so that uses that stay pending are polled once
    /// per doubling (amortized O(1) polls per record) rather than at every record.
    prune_at: usize,
}

/// The uses recorded on a registered range, shared with its registry entry. `None` once
/// the guard has started to release the range: later records are refused with an error,
/// so that a copy helper falls back to synchronizing its stream.
struct RegistrationUses {
    set: Mutex<Option<OpenUses>>,
}

impl RegistrationUses {
    fn new() -> Self {
        Self {
            set: Mutex::new(Some(OpenUses {
                set: UseSet::default(),
                prune_at: PRUNE_ABOVE,
            })),
        }
    }

    fn record(&self, fence: SharedFence) -> Result<bool> {
        let (superseded, crowded) = {
            let mut set = lock(&self.set);
            let Some(open) = set.as_mut() else {
                return Err(Error::InvalidArgument(
                    "the host registration holding this memory is being released",
                ));
            };
            let superseded = open.set.record(fence);
            (superseded, open.set.len() > open.prune_at)
        };
        drop(superseded); // outside the lock: a pooled event goes back to its pool
        if crowded {
            self.forget_completed();
        }
        Ok(true)
    }

    /// Polls the recorded uses (no lock held: driver calls) and forgets the completed ones.
    fn forget_completed(&self) {
        let snapshot: Vec<SharedFence> = match lock(&self.set).as_ref() {
            Some(open) => open.set.fences().to_vec(),
            None => return,
        };
        let done: Vec<SharedFence> = snapshot.into_iter().filter(crate::fence::poll_one).collect();
        if let Some(open) = lock(&self.set).as_mut() {
            for f in &done {
                open.set.forget(f);
            }
            open.prune_at = (2 * open.set.len()).max(PRUNE_ABOVE);
        }
        drop(done); // outside the lock
    }

    fn len(&self) -> usize {
        lock(&self.set).as_ref().map_or(0, |open| open.set.len())
    }

    /// Closes the set and returns what it held.
    fn close(&self) -> UseSet {
        lock(&self.set).take().map(|open| open.set).unwrap_or_default()
    }
}

/// The registry's handle on a registration's uses.
struct UsesRef(Arc<RegistrationUses>);

impl UseRecorder for UsesRef {
    fn record(&self, _addr: usize, fence: SharedFence) -> Result<bool> {
        self.0.record(fence)
    }
}

/// What a non-empty registration holds: its registry id and its recorded uses.
struct Registered {
    id: u64,
    uses: Arc<RegistrationUses>,
}

/// An existing buffer page-locked (`cuMemHostRegister`, portable: every context sees it
/// as pinned) for as long as this guard lives. The guard borrows the buffer mutably, so
/// it can be neither freed nor moved while registered; read and write it through the
/// guard (`Deref<Target = [T]>`, `DerefMut`).
///
/// The crate treats the range as its own pinned memory: the copy helpers
/// ([`crate::copy`], [`DeviceBuffer`](crate::device::DeviceBuffer)'s `_async` copies),
/// [`record_use`](crate::record_use) and, with the `cudarc` feature, the
/// [`PinnedView`](crate::PinnedView)s record their GPU uses on it; dropping the guard
/// waits for those uses to complete, then unregisters the range. Drop never panics: a
/// failed wait or unregistration is counted in [`drop_errors`](crate::cuda::drop_errors)
/// (use [`unregister`](Self::unregister) to get the error instead).
///
/// Registering costs about 0.07 ms for 256 B and 5.4 ms for 128 MiB of touched memory
/// (H200 machine): keep a registration for as long as the buffer is copied, not per copy.
///
/// ```
/// use cudalloc::{cuda::Stream, device::DevicePool, HostRegistration};
///
/// let mut frame = vec![7u8; 1 << 20]; // memory from anywhere: a Vec, an mmap'd file, ...
/// if let (Ok(mut pinned), Ok(stream)) = (HostRegistration::new(&mut frame[..]), Stream::new(0)) {
///     pinned[0] = 1; // read and write through the guard
///     let mut dev = DevicePool::get(0).unwrap().alloc::<u8>(pinned.len(), &stream).unwrap();
///     // SAFETY: `pinned` is not written until the copy has completed (the drop below
///     // waits for the use the copy recorded before it unregisters the memory).
///     unsafe { dev.copy_from_host_async(&pinned) }.unwrap();
///     drop(pinned); // waits for the copy, then unregisters
/// }
/// frame[1] = 2; // the buffer is the caller's again
/// ```
///
/// Ranges need not be page-aligned: CUDA (since 4.1) registers any start and length,
/// page-locking the pages that hold them. A range that overlaps memory already registered
/// or pinned (by the crate's pools, another registration or another library) is refused:
/// by the crate with [`Error::InvalidArgument`] when it is the crate's own memory, by the
/// driver with `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED` (712) otherwise. An empty
/// buffer registers nothing. Without a driver, [`Error::NoDriver`].
pub struct HostRegistration<'a, T> {
    ptr: NonNull<T>,
    len: usize,
    /// `None` for an empty buffer (nothing registered) and once released.
    registered: Option<Registered>,
    _buffer: PhantomData<&'a mut [T]>,
}

// SAFETY: the guard is a `&mut [T]` plus a registration that any thread may release.
unsafe impl<T: Send> Send for HostRegistration<'_, T> {}
// SAFETY: shared access only hands out `&[T]`.
unsafe impl<T: Sync> Sync for HostRegistration<'_, T> {}

impl<'a, T> HostRegistration<'a, T> {
    /// Page-locks `buf` until the guard is dropped.
    pub fn new(buf: &'a mut [T]) -> Result<Self> {
        crate::cuda::driver_available()
            .then_some(())
            .ok_or(Error::NoDriver)?;
        let len = buf.len();
        let bytes = core::mem::size_of_val(buf);
        let ptr = NonNull::from(&mut *buf).cast::<T>();
        let mut this = Self {
            ptr,
            len,
            registered: None,
            _buffer: PhantomData,
        };
        if bytes == 0 {
            return Ok(this);
        }
        let start = ptr.as_ptr() as usize;
        if registry::overlaps(start, bytes) {
            return Err(Error::InvalidArgument(
                "the buffer is (partly) memory of the crate's allocators or of another registration, already pinned",
            ));
        }
        // SAFETY: `buf` is borrowed mutably for 'a, so the range stays allocated and in place
        // until this guard, which unregisters it, is dropped.
        unsafe { raw::host_register(ptr.as_ptr().cast(), bytes, false) }?;
        let uses = Arc::new(RegistrationUses::new());
        let id = registry::new_owner_id();
        registry::add_owner(id, UsesRef(uses.clone()));
        if !registry::insert_range(start, bytes, id) {
            drop(registry::remove_owner(id));
            // SAFETY: registered just above, and no copy has used it yet.
            unsafe { raw::host_unregister(ptr.as_ptr().cast()) };
            return Err(Error::InvalidArgument(
                "the buffer is (partly) memory of the crate's allocators or of another registration, already pinned",
            ));
        }
        this.registered = Some(Registered { id, uses });
        Ok(this)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (then nothing is registered).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// GPU uses recorded on the range (by the copy helpers, `record_use`, cudarc views)
    /// and not yet known to have completed; the drop waits for them.
    pub fn pending_uses(&self) -> usize {
        self.registered.as_ref().map_or(0, |r| r.uses.len())
    }

    /// Waits for the recorded uses, then unregisters the range, returning what went
    /// wrong (dropping the guard does the same and counts errors instead).
    pub fn unregister(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        let Some(Registered { id, uses }) = self.registered.take() else {
            return Ok(());
        };
        // No new uses: the registry forgets the range, and records that found it just
        // before are refused from here on.
        drop(registry::remove_owner(id));
        let mut set = uses.close();
        set.seal(); // the memory is being freed: every use of it was queued before
                    // The wait fails for a fence whose wait errs (counted) or panics; the
                    // range is still unregistered below (the buffer goes back to its owner
                    // either way) and the error says so.
        let waited = set.wait(None);
        // SAFETY: the range was registered by `new` and is unregistered once (`registered`
        // was taken above); its recorded uses have completed.
        let unregistered = unsafe { raw::try_host_unregister(self.ptr.as_ptr().cast()) };
        match (waited, unregistered) {
            (_, Err(e)) => Err(e),
            (false, Ok(())) => Err(Error::InvalidArgument(
                "a recorded GPU use of the registered memory could not be waited for",
            )),
            (true, Ok(())) => Ok(()),
        }
    }
}

impl<T> core::ops::Deref for HostRegistration<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr..ptr+len` is the buffer borrowed mutably for 'a, which outlives the
        // guard; shared access through `&self`.
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> core::ops::DerefMut for HostRegistration<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> core::fmt::Debug for HostRegistration<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("registered", &self.registered.is_some())
            .field("pending_uses", &self.pending_uses())
            .finish()
    }
}

impl<T> Drop for HostRegistration<'_, T> {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            crate::cuda::record_drop_error("releasing a host registration", e);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::fence::Fence;
    use crate::sync::{AtomicBool, AtomicUsize, Ordering};

    /// A use without a stream (never merged) that counts its polls.
    struct Counted {
        polls: Arc<AtomicUsize>,
        done: Arc<AtomicBool>,
    }

    // SAFETY: the test sets `done` only for uses it no longer has (no memory is behind it).
    unsafe impl Fence for Counted {
        fn is_complete(&self) -> Result<bool> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            Ok(self.done.load(Ordering::Relaxed))
        }
    }

    #[test]
    fn pending_uses_are_polled_amortized_not_at_every_record() {
        let uses = RegistrationUses::new();
        let polls = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let fence = || -> SharedFence {
            Arc::new(Box::new(Counted {
                polls: polls.clone(),
                done: done.clone(),
            }))
        };
        let n = 4096;
        for _ in 0..n {
            uses.record(fence()).unwrap();
        }
        assert_eq!(uses.len(), n, "pending uses are all kept");
        // A prune at each doubling polls fewer than 2n + 33 fences in all (polling every
        // pending use at every record past 32 would be about n^2 / 2).
        let p = polls.load(Ordering::Relaxed);
        assert!(p < 2 * n + PRUNE_ABOVE + 1, "{p} polls for {n} records");
        // Once they complete, the next prune forgets them, and the threshold comes down.
        done.store(true, Ordering::Relaxed);
        while uses.len() >= n {
            uses.record(fence()).unwrap();
        }
        assert!(uses.len() <= PRUNE_ABOVE, "{} left", uses.len());
        for _ in 0..4 * PRUNE_ABOVE {
            uses.record(fence()).unwrap();
        }
        assert!(
            uses.len() <= PRUNE_ABOVE + 1,
            "completed uses are forgotten again"
        );
        // Closed: what it held comes out once, and later records are refused.
        let held = uses.len();
        assert_eq!(uses.close().len(), held);
        assert!(matches!(uses.record(fence()), Err(Error::InvalidArgument(_))));
        assert_eq!(uses.len(), 0);
    }
}
