//! Device memory: typed buffers from stream-ordered pools, with a caching layer that
//! makes a reused allocation cost tens of nanoseconds, bump arenas for per-batch scratch,
//! and every GPU of the host.
//!
//! Device memory is not behind `Allocator`: a `Vec` in memory the host cannot touch would
//! fault on its first push. Instead a [`DevicePool`] (one per device, in front of a CUDA
//! memory pool of its own, `cuMemPoolCreate`) hands out [`DeviceBuffer<T>`]s: typed,
//! owning their block, and bound to the stream they were allocated on.
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
//! } // the buffer is freed on its stream when dropped, into the pool's cache
//! ```
//!
//! # How the cache works
//!
//! - **Hit**: a freed block goes into the freeing thread's bin for (its stream, its size
//!   class); an allocation on the same stream of the same class pops it. No lock, no
//!   atomic read-modify-write, no CUDA call; the buffer's stream and pool handles are
//!   recycled with the block, so not even a reference count moves. Stream order makes it
//!   safe: the block was freed on the host after its work was queued on that stream, and
//!   the new owner's work is queued later on the same stream. Classes are multiples of
//!   256 bytes up to 4 KiB, then 16 per power of two (at most 6.25% rounding).
//! - **Another stream** takes a cached block only after its previous stream's work: the
//!   blocks leave that stream's list, one event is recorded on it (per batch, never per
//!   free), the taking stream waits for it on the GPU, and only then are the blocks
//!   handed over.
//! - **Uses on other streams** are declared with [`DeviceBuffer::record_use`]: at the free
//!   an event is recorded on each, and the block is reused once they have completed.
//! - **Large blocks**: every cached block is a whole allocation of the driver pool, which
//!   splits and merges extents itself in stream order; requests above
//!   [`DevicePoolConfig::max_cached_block`] (1 GiB) bypass the cache. A miss that must
//!   allocate releases idle blocks first while they exceed 1/32 of the live bytes or a
//!   learned allowance, whichever is larger (the allowance starts at 0 and grows only
//!   when the cache misses classes it gave back, up to twice the live class bytes and at
//!   most 64 MiB), so a workload whose sizes change keeps its memory near its use.
//!   By default ([`Backing::Auto`], on a device with CUDA's virtual memory management)
//!   blocks of one allocation granule (2 MiB on the H100 and H200) and more are instead
//!   runs of one large virtual range over chunks of physical memory
//!   ([`Backing::PhysicalPages`]): freed runs coalesce, any later block that fits takes
//!   them whatever its size, and idle chunks move to where blocks need them
//!   ([`PageTuning`] sets how eagerly), so the driver pool's fragmentation goes away for
//!   them. [`Backing::DriverPool`] keeps every block on the driver pool.
//! - **Out of memory**: the pool releases every cached block (each freed in its stream's
//!   order), asks other threads for theirs, retries, then synchronizes, trims the driver
//!   pool and retries once more; then it returns [`Error::DeviceOutOfMemory`] naming the
//!   device, the size and the pool's state.
//!
//! [`DevicePool::stats`] and [`report`] say what each device holds; `Display` prints
//! them for users. [`DevicePool::uncached`] gives the plain driver pool, for comparison.
//!
//! Element types are [`DeviceCopy`]: plain data with no padding that accepts every bit
//! pattern (zerocopy's `FromBytes + IntoBytes + Immutable`: the integers, floats, arrays
//! of them, and `#[derive]`d structs), since bytes come back from the device unchecked.
//!
//! [`Error::DeviceOutOfMemory`]: crate::Error::DeviceOutOfMemory

use zerocopy::{FromBytes, Immutable, IntoBytes};

mod arena;
mod backend;
mod buffer;
mod cache;
mod close;
mod config;
#[cfg(any(test, feature = "sim"))]
#[cfg_attr(not(test), allow(dead_code))]
mod fake;
mod local;
mod order;
pub(crate) mod pages;
mod phys;
mod pool;
mod report;
mod reserve;
mod runs;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
mod size_class;
mod thread_cache;

#[cfg(test)]
mod tests;

#[cfg(all(test, loom))]
mod loom_models;

pub use arena::{ArenaSlice, DeviceArena, DeviceArenaStats, DeviceCheckpoint};
pub use buffer::DeviceBuffer;
pub(crate) use buffer::{copy_from_host_async, copy_to_host_async};
pub use config::{Backing, DevicePoolConfig, PageTuning};
pub use pool::{report, DevicePool};
pub use report::{DeviceEntry, DeviceMemorySummary, DevicePoolStats, DeviceReport, StreamCacheStats};

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
///
/// Its alignment may be at most [`MAX_ELEMENT_ALIGN`] (256 bytes, where every device
/// block starts): [`DevicePool::alloc`] and [`DeviceArena::alloc`] of a type aligned to
/// more fail to compile, instead of handing out memory its type says is misaligned.
///
/// ```
/// use cudalloc::{cuda::Stream, device::{DeviceBuffer, DevicePool}};
/// # use zerocopy::{FromBytes, Immutable, IntoBytes};
/// #[derive(Clone, Copy, FromBytes, IntoBytes, Immutable)]
/// #[repr(C, align(256))]
/// struct Tile([u8; 256]);
/// fn tiles(pool: &DevicePool, s: &Stream) -> cudalloc::Result<DeviceBuffer<Tile>> {
///     pool.alloc::<Tile>(4, s)
/// }
/// let _compiled: fn(&DevicePool, &Stream) -> _ = tiles;
/// ```
///
/// ```compile_fail,E0080
/// use cudalloc::{cuda::Stream, device::{DeviceBuffer, DevicePool}};
/// # use zerocopy::{FromBytes, Immutable, IntoBytes};
/// #[derive(Clone, Copy, FromBytes, IntoBytes, Immutable)]
/// #[repr(C, align(512))]
/// struct Tile([u8; 512]);
/// fn tiles(pool: &DevicePool, s: &Stream) -> cudalloc::Result<DeviceBuffer<Tile>> {
///     pool.alloc::<Tile>(4, s) // aligned to 512: refused
/// }
/// let _compiled: fn(&DevicePool, &Stream) -> _ = tiles;
/// ```
pub trait DeviceCopy: FromBytes + IntoBytes + Immutable + Copy + Send + Sync + 'static {}

impl<T: FromBytes + IntoBytes + Immutable + Copy + Send + Sync + 'static> DeviceCopy for T {}

/// The most a [`DeviceCopy`] element may be aligned to: every block of the device pools
/// and arenas starts at a multiple of 256 bytes, as `cuMemAlloc`'s blocks do.
///
/// ```
/// use cudalloc::device::MAX_ELEMENT_ALIGN;
/// assert!(core::mem::align_of::<[f64; 4]>() <= MAX_ELEMENT_ALIGN);
/// ```
pub const MAX_ELEMENT_ALIGN: usize = 256;

/// `Aligned::<T>::OK`, named where a typed device range is made, fails to compile for a
/// `T` aligned to more than [`MAX_ELEMENT_ALIGN`] (no cost at run time).
pub(crate) struct Aligned<T>(core::marker::PhantomData<T>);

impl<T> Aligned<T> {
    pub(crate) const OK: () = assert!(
        core::mem::align_of::<T>() <= MAX_ELEMENT_ALIGN,
        "a device element type may be aligned to at most MAX_ELEMENT_ALIGN (256) bytes"
    );
}

/// The length accessors of a typed device range (a `len` field counting elements of `T`):
/// [`DeviceBuffer`]'s and [`ArenaSlice`]'s, written once.
macro_rules! element_len {
    () => {
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
    };
}
use element_len;
