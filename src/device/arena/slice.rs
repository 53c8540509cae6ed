//! [`ArenaSlice`]: a typed view of memory in a [`DeviceArena`], borrowed from it, so that
//! no slice outlives a reset (the borrow checker proves it). Invariant: `ptr..ptr + len *
//! size_of::<T>()` lies in one chunk of the arena, handed out since its last reset or rewind,
//! and every copy through the slice is queued on the arena's stream.

use core::fmt;
use core::marker::PhantomData;

use super::DeviceArena;
use crate::cuda::Stream;
use crate::device::buffer::{copy_from_host_async, copy_to_host_async};
use crate::device::pool::DevicePool;
use crate::device::DeviceCopy;
use crate::error::Result;

/// `len` elements of `T` in a [`DeviceArena`], valid while the borrow of the arena lasts:
/// a kernel argument ([`device_ptr`](Self::device_ptr)) and a copy target, ordered on the
/// arena's [`stream`](Self::stream).
///
/// A slice cannot outlive a reset:
///
/// ```compile_fail
/// use cudalloc::{cuda::Stream, device::{DeviceArena, DevicePool}};
/// let pool = DevicePool::get(0).unwrap();
/// let mut arena = DeviceArena::new(&pool, &Stream::new(0).unwrap()).unwrap();
/// let slice = arena.alloc::<u8>(16).unwrap();
/// arena.reset();
/// println!("{}", slice.device_ptr());
/// ```
pub struct ArenaSlice<'a, T: DeviceCopy> {
    pub(super) ptr: u64,
    pub(super) len: usize,
    pub(super) arena: &'a DeviceArena,
    pub(super) _elements: PhantomData<T>,
}

impl<T: DeviceCopy> fmt::Debug for ArenaSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaSlice")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.arena.stream.id())
            .finish()
    }
}

impl<'a, T: DeviceCopy> ArenaSlice<'a, T> {
    crate::device::element_len!();

    /// The device address (0 for an empty slice; a multiple of 256 otherwise).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The arena's stream, on which the slice's work is ordered.
    pub fn stream(&self) -> &'a Stream {
        &self.arena.stream
    }

    /// The pool the arena's chunks come from.
    pub fn pool(&self) -> &'a DevicePool {
        &self.arena.pool
    }

    /// The arena it lives in.
    pub fn arena(&self) -> &'a DeviceArena {
        self.arena
    }

    /// Declares work queued on `stream` that uses the slice (see
    /// [`DeviceArena::record_use`]).
    pub fn record_use(&self, stream: &Stream) {
        self.arena.record_use(stream);
    }

    /// Queues a copy of `src` (as long as the slice) into the slice on the arena's stream
    /// and returns at once.
    ///
    /// # Safety
    /// 1. `src` stays valid and is not written until the copy has completed on the arena's
    ///    stream; for memory of the crate's pools, dropping it early is allowed.
    pub unsafe fn copy_from_host_async(&mut self, src: &[T]) -> Result<()> {
        // SAFETY: the range is this slice's (`&mut self`: no one else writes it through
        // the arena); obligation 1 passes to the caller.
        unsafe { copy_from_host_async(self.ptr, self.len, src, &self.arena.stream) }
    }

    /// Queues a copy of the slice into `dst` (as long as the slice) on the arena's stream
    /// and returns at once.
    ///
    /// # Safety
    /// 1. `dst` stays valid and is neither read nor written until the copy has completed
    ///    on the arena's stream; for memory of the crate's pools, dropping it early is
    ///    allowed.
    pub unsafe fn copy_to_host_async(&self, dst: &mut [T]) -> Result<()> {
        // SAFETY: the range is this slice's; obligation 1 passes to the caller.
        unsafe { copy_to_host_async(self.ptr, self.len, dst, &self.arena.stream) }
    }

    /// Copies `src` (as long as the slice) into the slice and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        // SAFETY: the stream is synchronized before `src`'s borrow ends.
        unsafe { self.copy_from_host_async(src) }?;
        self.arena.stream.synchronize()
    }

    /// Copies the slice into `dst` (as long as the slice) and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        // SAFETY: the stream is synchronized before `dst`'s borrow ends.
        unsafe { self.copy_to_host_async(dst) }?;
        self.arena.stream.synchronize()
    }

    /// The slice's elements, copied into a new `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::new_zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}
