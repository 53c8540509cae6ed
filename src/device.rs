//! Device memory from stream-ordered pools, as typed buffers.
//!
//! Device memory is not behind `Allocator`: a `Vec` in memory the host cannot touch would
//! fault on its first push. Instead a [`DevicePool`] (a CUDA memory pool of one device,
//! `cuMemPoolCreate`) hands out [`DeviceBuffer<T>`]s: typed, owning their block, and
//! bound to the stream they were allocated on. Allocation and free are stream-ordered
//! (`cuMemAllocFromPoolAsync`, `cuMemFreeAsync`): a buffer freed on its stream can be
//! reused by the next allocation on that stream at once, without a synchronization, and
//! the pool keeps freed memory (release threshold `u64::MAX` by default; the driver's
//! default of 0 returns it at every synchronization), so an allocation costs about a
//! microsecond where `cuMemAlloc` costs 2-60 us.
//!
//! ```
//! use cudalloc::cuda::Stream;
//! use cudalloc::device::DevicePool;
//!
//! if let (Ok(pool), Ok(stream)) = (DevicePool::get(0), Stream::new(0)) {
//!     let input: Vec<f32> = (0..1024).map(|i| i as f32).collect();
//!     let buf = pool.from_host(&input, &stream).unwrap(); // DeviceBuffer<f32>
//!     // ... launch kernels on `stream` with `buf.device_ptr()` ...
//!     assert_eq!(buf.to_vec().unwrap(), input);
//! } // the buffer is freed on its stream when dropped
//! ```
//!
//! Element types are [`DeviceCopy`]: plain data with no padding that accepts every bit
//! pattern (zerocopy's `FromBytes + IntoBytes + Immutable`: the integers, floats, arrays
//! of them, and `#[derive]`d structs), since bytes come back from the device unchecked.

use crate::sync::global::{Arc, OnceLock};
use core::marker::PhantomData;

use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::cuda::mem_pool::MemPool;
use crate::cuda::{device_count, mem_info, memset_d8_async, raw, Stream};
use crate::error::{Error, Result};
use crate::sync::global::{AtomicU64, Ordering};

/// Element types of a [`DeviceBuffer`]: plain data that may be copied to and from the
/// device as bytes (no padding, every bit pattern valid). Implemented for every type
/// with zerocopy's `FromBytes + IntoBytes + Immutable`.
///
/// ```
/// fn device_copy<T: cudalloc::device::DeviceCopy>() {}
/// device_copy::<f32>();
/// device_copy::<[u64; 4]>();
/// ```
///
/// `bool` is not (not every byte is a valid `bool`):
///
/// ```compile_fail
/// fn device_copy<T: cudalloc::device::DeviceCopy>() {}
/// device_copy::<bool>();
/// ```
pub trait DeviceCopy: FromBytes + IntoBytes + Immutable + Copy + Send + Sync + 'static {}

impl<T: FromBytes + IntoBytes + Immutable + Copy + Send + Sync + 'static> DeviceCopy for T {}

/// How a [`DevicePool`] behaves.
///
/// ```
/// let c = cudalloc::device::DevicePoolConfig::default();
/// assert_eq!(c.release_threshold, u64::MAX);
/// assert_eq!(c.limit, 0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePoolConfig {
    /// Freed bytes the pool keeps across synchronizations (default `u64::MAX`: all).
    pub release_threshold: u64,
    /// The most bytes the pool reserves from the device (0, the default: no limit
    /// beyond the device's memory).
    pub limit: usize,
}

impl Default for DevicePoolConfig {
    fn default() -> Self {
        Self {
            release_threshold: u64::MAX,
            limit: 0,
        }
    }
}

/// A snapshot of a [`DevicePool`]'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevicePoolStats {
    /// Bytes the pool has reserved from the device now.
    pub reserved_bytes: u64,
    /// The most bytes it has reserved.
    pub peak_reserved_bytes: u64,
    /// Bytes in allocations not yet freed (in stream order).
    pub used_bytes: u64,
    /// The most bytes in use at once.
    pub peak_used_bytes: u64,
    /// Buffers allocated (nonzero size) since the pool was created.
    pub allocations: u64,
    /// Buffers of nonzero size alive now.
    pub live_buffers: u64,
    /// Allocations that failed (refused up front or by the driver).
    pub failures: u64,
}

#[derive(Debug)]
struct Inner {
    pool: MemPool,
    /// The device's memory, in bytes.
    device_bytes: usize,
    allocations: AtomicU64,
    frees: AtomicU64,
    failures: AtomicU64,
}

/// A stream-ordered pool of device memory on one device; a cheap, cloneable handle.
///
/// ```
/// use cudalloc::{cuda::Stream, device::{DevicePool, DevicePoolConfig}};
/// if let Ok(stream) = Stream::new(0) {
///     let pool = DevicePool::new(0, DevicePoolConfig { limit: 64 << 20, ..Default::default() }).unwrap();
///     let a = pool.alloc_zeroed::<u32>(1 << 20, &stream).unwrap();
///     assert_eq!(a.len(), 1 << 20);
///     assert!(pool.alloc::<u8>(128 << 20, &stream).is_err(), "past the 64 MiB limit");
///     drop(a);
///     stream.synchronize().unwrap();
///     assert!(pool.stats().unwrap().reserved_bytes >= 4 << 20, "freed memory stays cached");
///     pool.trim().unwrap();
///     assert_eq!(pool.stats().unwrap().reserved_bytes, 0);
/// }
/// ```
#[derive(Clone, Debug)]
pub struct DevicePool {
    inner: Arc<Inner>,
}

impl DevicePool {
    /// A new pool on device `device`.
    pub fn new(device: usize, config: DevicePoolConfig) -> Result<Self> {
        let pool = MemPool::new(device, config.limit, config.release_threshold)?;
        let (_, device_bytes) = mem_info(device)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                device_bytes,
                allocations: AtomicU64::new(0),
                frees: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            }),
        })
    }

    /// The process-wide pool of device `device` (default configuration), created on
    /// first use.
    ///
    /// ```
    /// match cudalloc::device::DevicePool::get(0) {
    ///     Ok(pool) => assert_eq!(pool.device(), 0),
    ///     Err(e) => println!("no device pool: {e}"),
    /// }
    /// ```
    pub fn get(device: usize) -> Result<Self> {
        static POOLS: OnceLock<Box<[OnceLock<DevicePool>]>> = OnceLock::new();
        let pools = POOLS.get_or_init(|| (0..device_count()).map(|_| OnceLock::new()).collect());
        if pools.is_empty() {
            return Err(Error::NoDriver);
        }
        let slot = pools
            .get(device)
            .ok_or(Error::InvalidArgument("no CUDA device with that ordinal"))?;
        if let Some(pool) = slot.get() {
            return Ok(pool.clone());
        }
        let pool = Self::new(device, DevicePoolConfig::default())?;
        // Two threads may race to create it: one wins, the other's pool is dropped.
        Ok(slot.get_or_init(|| pool).clone())
    }

    /// The device.
    pub fn device(&self) -> usize {
        self.inner.pool.device()
    }

    /// A buffer of `len` elements on `stream` (which must belong to the pool's device),
    /// usable by work queued on `stream` from now on. Its contents are unspecified: fill
    /// it before reading (or use [`alloc_zeroed`](Self::alloc_zeroed)).
    pub fn alloc<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        if stream.device() != self.device() {
            return Err(Error::InvalidArgument("the stream belongs to another device"));
        }
        let ptr = match len.checked_mul(size_of::<T>()) {
            Some(0) => 0,
            Some(bytes) => self.alloc_bytes(bytes, stream)?,
            None => {
                return Err(self.failed(Error::TooLarge {
                    requested: usize::MAX,
                    limit: self.inner.device_bytes,
                }))
            }
        };
        Ok(DeviceBuffer {
            ptr,
            len,
            pool: self.clone(),
            stream: stream.clone(),
            _elements: PhantomData,
        })
    }

    #[cold]
    fn failed(&self, e: Error) -> Error {
        self.inner.failures.fetch_add(1, Ordering::Relaxed);
        e
    }

    /// Refuses, before any driver allocation, what cannot fit: more than the device
    /// holds, or (for requests of an eighth of the device and more) more than is free on
    /// it plus what this pool holds unused. A driver asked for more than is free may fill
    /// the device while it tries, failing other threads' and processes' allocations.
    fn check_fits(&self, bytes: usize) -> Result<()> {
        let total = self.inner.device_bytes;
        if bytes > total {
            return Err(Error::TooLarge {
                requested: bytes,
                limit: total,
            });
        }
        if bytes >= total / 8 {
            let (free, _) = mem_info(self.device())?;
            let u = self.inner.pool.usage()?;
            let idle = usize::try_from(u.reserved.saturating_sub(u.used)).unwrap_or(usize::MAX);
            if bytes > free.saturating_add(idle) {
                return Err(Error::OutOfMemory { requested: bytes });
            }
        }
        Ok(())
    }

    fn alloc_bytes(&self, bytes: usize, stream: &Stream) -> Result<u64> {
        self.check_fits(bytes).map_err(|e| self.failed(e))?;
        let pool = &self.inner.pool;
        let ptr = match pool.alloc_async(bytes, stream) {
            Err(Error::Cuda(e)) if e.is_out_of_memory() => {
                // Memory whose frees have completed may sit in the pool unused by this
                // stream: release it and retry once.
                log::debug!(
                    "cudalloc: device pool out of memory for {bytes} bytes; trimming and retrying once"
                );
                pool.trim_to(0)?;
                pool.alloc_async(bytes, stream)
            }
            other => other,
        };
        match ptr {
            Ok(p) => {
                self.inner.allocations.fetch_add(1, Ordering::Relaxed);
                Ok(p)
            }
            Err(e) => Err(self.failed(e)),
        }
    }

    /// A buffer of `len` zeroed elements on `stream` (zeroed in stream order).
    pub fn alloc_zeroed<T: DeviceCopy>(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let buf = self.alloc::<T>(len, stream)?;
        if buf.ptr != 0 {
            // SAFETY: the range is the buffer's own block, queued on its stream after the
            // allocation.
            unsafe { memset_d8_async(buf.ptr, 0, buf.byte_len(), stream) }?;
        }
        Ok(buf)
    }

    /// A buffer holding a copy of `src`, on `stream`; returns when the copy is done.
    pub fn from_host<T: DeviceCopy>(&self, src: &[T], stream: &Stream) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc::<T>(src.len(), stream)?;
        buf.copy_from_host(src)?;
        Ok(buf)
    }

    /// The pool's counters (the driver's reserved and used bytes, and this handle's
    /// allocation counts).
    pub fn stats(&self) -> Result<DevicePoolStats> {
        let u = self.inner.pool.usage()?;
        let allocations = self.inner.allocations.load(Ordering::Relaxed);
        Ok(DevicePoolStats {
            reserved_bytes: u.reserved,
            peak_reserved_bytes: u.reserved_high,
            used_bytes: u.used,
            peak_used_bytes: u.used_high,
            allocations,
            live_buffers: allocations.saturating_sub(self.inner.frees.load(Ordering::Relaxed)),
            failures: self.inner.failures.load(Ordering::Relaxed),
        })
    }

    /// Returns the memory the pool holds but no buffer uses to the device. Memory freed
    /// in stream order is released once its free has completed (synchronize the stream
    /// first to release everything).
    pub fn trim(&self) -> Result<()> {
        self.inner.pool.trim_to(0)
    }

    /// Sets how many freed bytes the pool keeps across synchronizations.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.inner.pool.set_release_threshold(bytes)
    }
}

/// `len` elements of `T` in device memory from a [`DevicePool`], bound to the stream it
/// was allocated on: copies run on that stream, and dropping the buffer frees it there
/// (stream-ordered: work queued before the drop still sees the memory).
///
/// The host cannot dereference it; use [`copy_from_host`](Self::copy_from_host),
/// [`copy_to_host`](Self::copy_to_host), [`to_vec`](Self::to_vec), or pass
/// [`device_ptr`](Self::device_ptr) to a kernel launched on [`stream`](Self::stream).
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
/// }
/// ```
#[derive(Debug)]
pub struct DeviceBuffer<T: DeviceCopy> {
    ptr: u64,
    len: usize,
    pool: DevicePool,
    stream: Stream,
    _elements: PhantomData<T>,
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address (0 for an empty buffer), for kernels queued on
    /// [`stream`](Self::stream) (or on streams ordered after it by events).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address as a reference into the buffer (which lives as long as the
    /// borrow), for APIs that keep a pointer to a kernel argument and read it at launch:
    /// cudarc's `LaunchArgs::arg` (the `cudarc` feature's `PushKernelArg` impl).
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn device_ptr_ref(&self) -> &u64 {
        &self.ptr
    }

    /// The stream the buffer was allocated on and is freed on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> &DevicePool {
        &self.pool
    }

    fn check_len(&self, host: usize) -> Result<()> {
        if host == self.len {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "the host slice and the device buffer differ in length",
            ))
        }
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
        self.check_len(src.len())?;
        if self.byte_len() == 0 {
            return Ok(());
        }
        let host = src.as_bytes();
        // SAFETY: the device range is this buffer's block (lengths checked above), which
        // `&mut self` lets us write; obligation 1 keeps the host bytes valid until the copy
        // has read them; pooled host blocks are protected by `protect` below.
        unsafe { raw::copy_htod_async(self.ptr, host.as_ptr(), host.len(), &self.stream) }?;
        crate::copy::protect(host.as_ptr(), &self.stream)
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
        self.check_len(dst.len())?;
        if self.byte_len() == 0 {
            return Ok(());
        }
        let host = dst.as_mut_bytes();
        // SAFETY: the device range is this buffer's block; obligation 1 keeps `dst` valid
        // and untouched until the copy has written it; any bytes are valid `T`s
        // (T: FromBytes); pooled host blocks are protected by `protect` below.
        unsafe { raw::copy_dtoh_async(host.as_mut_ptr(), self.ptr, host.len(), &self.stream) }?;
        crate::copy::protect(host.as_ptr(), &self.stream)
    }

    /// Copies `src` (as long as the buffer) into the buffer and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        // SAFETY: the stream is synchronized before `src`'s borrow ends.
        unsafe { self.copy_from_host_async(src) }?;
        self.stream.synchronize()
    }

    /// Copies the buffer into `dst` (as long as the buffer) and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        // SAFETY: the stream is synchronized before `dst`'s borrow ends.
        unsafe { self.copy_to_host_async(dst) }?;
        self.stream.synchronize()
    }

    /// The buffer's elements, copied into a new `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::new_zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}

impl<T: DeviceCopy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: the block came from this pool's alloc_async and is freed once, on the
            // stream it was allocated on (kept alive by the handle): work queued on it before
            // this point still sees the memory.
            unsafe { self.pool.inner.pool.free_async(self.ptr, &self.stream) };
            self.pool.inner.frees.fetch_add(1, Ordering::Relaxed);
        }
    }
}
