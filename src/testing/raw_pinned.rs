//! A typed buffer of raw pinned host memory: one `cuMemHostAlloc` per buffer, freed with
//! `cuMemFreeHost`, no pool and no recorded uses. The reference that the crate's pinned
//! handles are measured against (what a hand-written CUDA program does).

use core::marker::PhantomData;
use core::ptr::NonNull;

use zerocopy::IntoBytes;

use crate::cuda::{raw, HostAllocFlags};
use crate::device::DeviceCopy;
use crate::error::{Error, Result};

/// `len` zeroed elements of `T` in pinned host memory from one `cuMemHostAlloc`.
///
/// ```
/// use cudalloc::testing::RawPinnedBuffer;
/// match RawPinnedBuffer::<u32>::zeroed(1024) {
///     Ok(mut buf) => {
///         buf[5] = 7;
///         assert_eq!(buf.iter().sum::<u32>(), 7);
///         assert_eq!(buf.as_bytes().len(), 4096);
///     }
///     Err(e) => println!("no pinned memory without a driver: {e}"),
/// }
/// ```
pub struct RawPinnedBuffer<T: DeviceCopy> {
    ptr: NonNull<T>,
    len: usize,
    _owns: PhantomData<T>,
}

// SAFETY: the buffer owns its memory exclusively, like a `Box<[T]>`; pinned memory may be
// used from any thread.
unsafe impl<T: DeviceCopy> Send for RawPinnedBuffer<T> {}
// SAFETY: shared access only reads through `&[T]`, and `T: Sync`.
unsafe impl<T: DeviceCopy> Sync for RawPinnedBuffer<T> {}

impl<T: DeviceCopy> RawPinnedBuffer<T> {
    /// Allocates `len` elements (at least one byte is taken) and zeroes them.
    pub fn zeroed(len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::InvalidArgument("buffer size overflows usize"))?;
        let p = raw::host_alloc(bytes.max(1), HostAllocFlags::DEFAULT)?;
        // SAFETY: `p` is a fresh block of at least `bytes` bytes; zero bytes are a valid
        // `T` (DeviceCopy: FromBytes).
        unsafe { p.write_bytes(0, bytes) };
        debug_assert!(p as usize % align_of::<T>() == 0, "cuMemHostAlloc aligns to 256");
        Ok(Self {
            // SAFETY: host_alloc never returns null (it reports OutOfMemory instead).
            ptr: unsafe { NonNull::new_unchecked(p.cast()) },
            len,
            _owns: PhantomData,
        })
    }

    /// The buffer's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        (**self).as_bytes()
    }

    /// The buffer's bytes, writable (every byte pattern is a valid `T`).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        (**self).as_mut_bytes()
    }
}

impl<T: DeviceCopy> core::ops::Deref for RawPinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialized elements owned by self.
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: DeviceCopy> core::ops::DerefMut for RawPinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: DeviceCopy> core::fmt::Debug for RawPinnedBuffer<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RawPinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceCopy> Drop for RawPinnedBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: the block came from `raw::host_alloc` and is freed once. The owner
        // waits for every copy of it before dropping it (raw memory has no recorded uses).
        unsafe { raw::host_free(self.ptr.as_ptr().cast()) };
    }
}
