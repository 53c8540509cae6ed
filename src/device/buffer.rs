//! [`DeviceBuffer<T>`]: typed device memory from a [`DevicePool`], bound to its stream;
//! and the copies between host slices and device ranges that buffers and arena slices
//! share.

use core::fmt;
use core::marker::PhantomData;

use zerocopy::IntoBytes;

use super::local::{self, Owned};
use super::pool::{DevicePool, PoolRef};
use super::DeviceCopy;
use crate::cuda::{copy_async, memset_d8_async, raw, Stream};
use crate::error::{Error, Result};

/// `len` elements of `T` in device memory from a [`DevicePool`], bound to the stream it
/// was allocated on: copies run on that stream, and dropping the buffer frees it there
/// (stream-ordered: work queued before the drop still sees the memory; the block is
/// reused by later work on that stream at once, and by other streams only after an
/// event).
///
/// The host cannot dereference it; use [`copy_from_host`](Self::copy_from_host),
/// [`copy_to_host`](Self::copy_to_host), [`to_vec`](Self::to_vec), or pass
/// [`device_ptr`](Self::device_ptr) to a kernel launched on [`stream`](Self::stream).
/// Work on other streams that uses the buffer must be declared with
/// [`record_use`](Self::record_use) before the buffer is dropped.
///
/// ```
/// use cudalloc::{cuda::Stream, device::DevicePool};
/// if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
///     let mut buf = pool.alloc::<u16>(3, &stream).unwrap();
///     buf.copy_from_host(&[1, 2, 3]).unwrap();
///     let mut back = [0u16; 3];
///     buf.copy_to_host(&mut back).unwrap();
///     assert_eq!(back, [1, 2, 3]);
///     assert!(buf.copy_from_host(&[1, 2]).is_err(), "lengths must match");
///     assert_eq!(buf.device_ptr() % 256, 0);
/// }
/// ```
///
/// Device memory cannot be read on the host: there is no way to index or deref it.
///
/// ```compile_fail
/// use cudalloc::{cuda::Stream, device::DevicePool};
/// let buf = DevicePool::get(0).unwrap().alloc::<u8>(4, &Stream::new(0).unwrap()).unwrap();
/// let first: u8 = buf[0];
/// ```
pub struct DeviceBuffer<T: DeviceCopy> {
    /// The block, its stream and pool handles, and its recorded uses.
    block: Owned<PoolRef>,
    len: usize,
    _elements: PhantomData<T>,
}

impl<T: DeviceCopy> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.block.ptr()))
            .field("len", &self.len)
            .field("stream", &self.stream().id())
            .field("device", &self.pool().device())
            .field(
                "uses",
                &self.block.uses().iter().map(Stream::id).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    #[inline(always)]
    pub(crate) fn from_parts(block: Owned<PoolRef>, len: usize) -> Self {
        Self {
            block,
            len,
            _elements: PhantomData,
        }
    }

    super::element_len!();

    /// The device address (0 for an empty buffer; a multiple of 256 otherwise), for
    /// kernels queued on [`stream`](Self::stream) (or on streams ordered after it by
    /// events, declared with [`record_use`](Self::record_use)).
    pub fn device_ptr(&self) -> u64 {
        self.block.ptr()
    }

    /// The device address as a reference into the buffer (which lives as long as the
    /// borrow), for APIs that keep a pointer to a kernel argument and read it at launch:
    /// cudarc's `LaunchArgs::arg` (the `cudarc` feature's `PushKernelArg` impl).
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn device_ptr_ref(&self) -> &u64 {
        self.block.ptr_ref()
    }

    /// The stream the buffer was allocated on and is freed on.
    pub fn stream(&self) -> &Stream {
        self.block.stream()
    }

    /// The pool it came from.
    pub fn pool(&self) -> &DevicePool {
        DevicePool::from_ref(self.block.pool())
    }

    /// Declares that work queued on `stream` (another stream than the buffer's) uses the
    /// buffer, as PyTorch's `record_stream`: when the buffer is dropped, an event is
    /// recorded on `stream` (after all work queued there until then) and the block is
    /// reused only once it has completed. Nothing waits on the GPU for it, so no stream
    /// is slowed down; the memory returns a little later. Streams of other devices may be
    /// recorded too (work on a peer that reads the buffer).
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(s), Ok(t)) = (DevicePool::get(0), Stream::new(0), Stream::new(0)) {
    ///     let mut buf = pool.from_host(&[7u32; 256], &s).unwrap();
    ///     t.wait(&s.record_event().unwrap()).unwrap(); // t runs after the copy into buf
    ///     // ... launch a kernel reading buf.device_ptr() on t ...
    ///     buf.record_use(&t);
    ///     drop(buf); // reused only after t's work so far has completed
    ///     t.synchronize().unwrap();
    /// }
    /// ```
    pub fn record_use(&mut self, stream: &Stream) {
        self.block.record_use(stream);
    }

    /// Queues a copy of `src` (as long as the buffer) into the buffer on its stream and
    /// returns at once. A `src` in a block of the crate's pools is kept from reuse until
    /// the copy completes.
    ///
    /// # Safety
    /// 1. `src` stays valid and is not written until the copy has completed on the
    ///    buffer's stream (synchronize it, or wait on an event recorded after the copy);
    ///    for memory of the crate's pools, dropping it early is allowed.
    pub unsafe fn copy_from_host_async(&mut self, src: &[T]) -> Result<()> {
        // SAFETY: the range is this buffer's block, which `&mut self` lets us write;
        // obligation 1 passes to the caller.
        unsafe { copy_from_host_async(self.device_ptr(), self.len, src, self.stream()) }
    }

    /// Queues a copy of the buffer into `dst` (as long as the buffer) on its stream and
    /// returns at once. A `dst` in a block of the crate's pools is kept from reuse until
    /// the copy completes.
    ///
    /// # Safety
    /// 1. `dst` stays valid and is neither read nor written until the copy has completed
    ///    on the buffer's stream; for memory of the crate's pools, dropping it early is
    ///    allowed.
    pub unsafe fn copy_to_host_async(&self, dst: &mut [T]) -> Result<()> {
        // SAFETY: the range is this buffer's block; obligation 1 passes to the caller.
        unsafe { copy_to_host_async(self.device_ptr(), self.len, dst, self.stream()) }
    }

    /// Copies `src` (as long as the buffer) into the buffer and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        // SAFETY: the stream is synchronized before `src`'s borrow ends.
        unsafe { self.copy_from_host_async(src) }?;
        self.stream().synchronize()
    }

    /// Copies the buffer into `dst` (as long as the buffer) and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        // SAFETY: the stream is synchronized before `dst`'s borrow ends.
        unsafe { self.copy_to_host_async(dst) }?;
        self.stream().synchronize()
    }

    /// The buffer's elements, copied into a new `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::new_zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Queues a copy of `src` (as long as the buffer; on this device or another, a peer
    /// copy with `cuMemcpyPeerAsync`) into this buffer on this buffer's stream, and
    /// returns at once. Safe, because it is ordered with both buffers' streams: when the
    /// streams differ, the copy waits for the work queued on `src`'s stream, and `src`'s
    /// stream waits for the copy before its later work (so `src` may be dropped at once).
    /// Copies between devices run over NVLink or PCIe when the destination pool has
    /// [peer access](DevicePool::enable_peer_access), and are staged otherwise.
    ///
    /// ```
    /// use cudalloc::{cuda::Stream, device::DevicePool};
    /// if let (Ok(pool), Ok(s), Ok(t)) = (DevicePool::get(0), Stream::new(0), Stream::new(0)) {
    ///     let src = pool.from_host(&[1.5f32; 1000], &s).unwrap();
    ///     let mut dst = pool.alloc::<f32>(1000, &t).unwrap();
    ///     dst.copy_from_device(&src).unwrap();
    ///     drop(src); // fine: s waits for the copy before reusing it
    ///     assert_eq!(dst.to_vec().unwrap(), vec![1.5f32; 1000]);
    /// }
    /// ```
    pub fn copy_from_device(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        check_len(self.len, src.len)?;
        let bytes = self.byte_len();
        if bytes == 0 {
            return Ok(());
        }
        let (dst_stream, src_stream) = (self.stream(), src.stream());
        let crossing = dst_stream != src_stream;
        if crossing {
            dst_stream.wait_queued(src_stream)?;
        }
        // SAFETY: both ranges are whole buffers of `bytes` (lengths checked); the
        // destination is ours to write (`&mut self`); the source is alive now and its
        // stream is made to wait for the copy below before any later work (its free and
        // any reuse of its block included); the copy is ordered after the source's
        // earlier work by the wait above.
        unsafe {
            copy_async(
                self.device_ptr(),
                self.pool().device(),
                src.device_ptr(),
                src.pool().device(),
                bytes,
                dst_stream,
            )
        }?;
        if crossing {
            // The source's stream must not run ahead of the copy (if need be, the host
            // waits for the copy).
            src_stream.wait_for(dst_stream)?;
        }
        Ok(())
    }
}

impl<T: DeviceCopy> Drop for DeviceBuffer<T> {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: called once, here; the block is not used afterwards.
        unsafe { self.block.release(self.len * size_of::<T>()) }
    }
}

/// The typed constructors of buffers (here rather than in `pool.rs`, so that the pool
/// does not depend on its buffers).
impl DevicePool {
    /// A buffer of `len` elements on `stream` (which must belong to the pool's device),
    /// usable by work queued on `stream` from now on. Its contents are unspecified: fill
    /// it before reading (or use [`alloc_zeroed`](Self::alloc_zeroed)). A buffer of zero
    /// bytes takes no memory (its [`device_ptr`](DeviceBuffer::device_ptr) is 0).
    ///
    /// Errors: `InvalidArgument` for a stream of another device; `TooLarge` for more than
    /// the device holds; [`Error::DeviceOutOfMemory`] (naming the device, the size and the
    /// pool's state) when the memory is not there even after the cache was released.
    // Always inlined: the hit is a few dozen instructions, and a call with its register
    // saves costs a tenth of it.
    #[inline(always)]
    pub fn alloc<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        #[allow(clippy::let_unit_value)] // evaluated at compile time: the alignment check
        let () = super::Aligned::<T>::OK;
        // No device check on the hit: a bin of this pool's thread cache only holds blocks
        // freed on streams of its device (stream ids are never reused), so a stream of
        // another device misses and the slow path refuses it.
        if let Some(bytes) = len.checked_mul(size_of::<T>()).filter(|&b| b != 0) {
            if let Some(buf) = self.try_alloc_fast(len, bytes, stream) {
                return Ok(buf);
            }
        }
        // Every other case in one call: with only two ways out, the compiler knows the
        // hit's `Result` is `Ok` where the caller unwraps it, and moves the buffer field
        // by field. (With three, the `Result` was merged in memory, its tag read back, and
        // the buffer copied 16 bytes at a time from 8-byte stores: a store the CPU cannot
        // forward, about 10 ns, wherever a program moved the buffer right away.)
        self.alloc_missed(len, stream)
    }

    /// The hit: a block of the request's class freed on `stream`, from this thread's bin.
    #[inline(always)]
    fn try_alloc_fast<T: DeviceCopy>(
        &self,
        len: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Option<DeviceBuffer<T>> {
        let block = local::try_alloc_fast(self.handle(), bytes, stream)?;
        Some(DeviceBuffer::from_parts(block, len))
    }

    /// A miss of the thread cache, an empty buffer or a size that overflows.
    #[cold]
    #[inline(never)]
    fn alloc_missed<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        match len.checked_mul(size_of::<T>()) {
            Some(bytes) if bytes != 0 => self.alloc_slow(len, bytes, stream),
            bytes => self.alloc_unusual(len, bytes, stream),
        }
    }

    #[cold]
    #[inline(never)]
    fn alloc_slow<T: DeviceCopy>(
        &self,
        len: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<DeviceBuffer<T>> {
        match self.alloc_block(bytes, stream) {
            Ok(block) => Ok(DeviceBuffer::from_parts(block, len)),
            Err(e) => {
                local::record_failure(self.handle(), bytes, stream, &e);
                Err(e)
            }
        }
    }

    /// The slow path's block (its failures recorded by the caller).
    fn alloc_block(&self, bytes: usize, stream: &Stream) -> Result<Owned<PoolRef>> {
        if stream.device() != self.device() {
            return Err(Error::InvalidArgument("the stream belongs to another device"));
        }
        let device_bytes = self.device_bytes();
        if bytes > device_bytes {
            self.cache().count_failure();
            return Err(Error::TooLarge {
                requested: bytes,
                limit: device_bytes,
            });
        }
        local::alloc_slow(self.handle(), bytes, stream).map_err(|e| self.out_of_memory(e, bytes))
    }

    /// Zero bytes, a size that overflows, or a stream of another device.
    #[cold]
    #[inline(never)]
    fn alloc_unusual<T: DeviceCopy>(
        &self,
        len: usize,
        bytes: Option<usize>,
        stream: &Stream,
    ) -> Result<DeviceBuffer<T>> {
        if stream.device() != self.device() {
            return Err(Error::InvalidArgument("the stream belongs to another device"));
        }
        match bytes {
            Some(0) => Ok(DeviceBuffer::from_parts(
                Owned::empty(stream.clone(), self.handle().clone()),
                len,
            )),
            Some(bytes) => self.alloc_slow(len, bytes, stream),
            None => {
                self.cache().count_failure();
                Err(Error::TooLarge {
                    requested: usize::MAX,
                    limit: self.device_bytes(),
                })
            }
        }
    }

    /// A buffer of `len` zeroed elements on `stream` (zeroed in stream order).
    pub fn alloc_zeroed<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let buf = self.alloc::<T>(len, stream)?;
        if buf.device_ptr() != 0 {
            // SAFETY: the range is the buffer's own block, queued on its stream after the
            // allocation.
            unsafe { memset_d8_async(buf.device_ptr(), 0, buf.byte_len(), stream) }?;
        }
        Ok(buf)
    }

    /// A buffer holding a copy of `src`, on `stream`; returns when the copy is done.
    pub fn from_host<T: DeviceCopy>(&self, src: &[T], stream: &Stream) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc::<T>(src.len(), stream)?;
        buf.copy_from_host(src)?;
        Ok(buf)
    }
}

pub(crate) fn check_len(device: usize, host: usize) -> Result<()> {
    if host == device {
        Ok(())
    } else {
        Err(Error::InvalidArgument(
            "the source and the destination differ in length",
        ))
    }
}

/// Queues a copy of `src` into the `len` elements at `ptr`, on `stream`.
///
/// # Safety
/// 1. `src` stays valid and is not written until the copy has completed on `stream`
///    (pooled host blocks may be dropped early).
/// 2. `ptr` is device memory of at least `len` elements of `T` that the caller may write,
///    ordered on `stream`.
pub(crate) unsafe fn copy_from_host_async<T: DeviceCopy>(
    ptr: u64,
    len: usize,
    src: &[T],
    stream: &Stream,
) -> Result<()> {
    check_len(len, src.len())?;
    let host = src.as_bytes();
    if host.is_empty() {
        return Ok(());
    }
    // SAFETY: obligation 2 for the device range (lengths checked above); obligation 1
    // keeps the host bytes valid until the copy has read them; pooled host blocks are
    // protected by `protect` below.
    unsafe { raw::copy_htod_async(ptr, host.as_ptr(), host.len(), stream) }?;
    crate::copy::protect(host.as_ptr(), stream)
}

/// Queues a copy of the `len` elements at `ptr` into `dst`, on `stream`.
///
/// # Safety
/// 1. `dst` stays valid and is neither read nor written until the copy has completed on
///    `stream` (pooled host blocks may be dropped early).
/// 2. `ptr` is device memory of at least `len` elements of `T`, ordered on `stream`.
pub(crate) unsafe fn copy_to_host_async<T: DeviceCopy>(
    ptr: u64,
    len: usize,
    dst: &mut [T],
    stream: &Stream,
) -> Result<()> {
    check_len(len, dst.len())?;
    let host = dst.as_mut_bytes();
    if host.is_empty() {
        return Ok(());
    }
    // SAFETY: obligation 2 for the device range; obligation 1 keeps `dst` valid and
    // untouched until the copy has written it; any bytes are valid `T`s (T: FromBytes);
    // pooled host blocks are protected by `protect` below.
    unsafe { raw::copy_dtoh_async(host.as_mut_ptr(), ptr, host.len(), stream) }?;
    crate::copy::protect(host.as_ptr(), stream)
}
