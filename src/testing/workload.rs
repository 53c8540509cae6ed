//! Generic workloads for A/B comparisons: each takes any allocator-api2 allocator, so
//! the same code runs on `Global`, `&bumpalo::Bump` and every allocator of this crate.
//! The criterion benches and the `ab` example both time these functions.
//!
//! ```
//! use cudalloc::testing::workload;
//! let bump = bumpalo::Bump::new();
//! assert_eq!(workload::vec_push(&bump, 1000), 999 * 1000 / 2);
//! assert_eq!(workload::vec_push(cudalloc::PinnedAlloc, 1000), 999 * 1000 / 2);
//! ```

use core::hint::black_box;

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::vec::Vec;

/// Allocates a block of `size` bytes (8-aligned), writes its first and last byte, frees
/// it. Returns whether the allocation succeeded.
///
/// ```
/// assert!(cudalloc::testing::workload::alloc_free(&allocator_api2::alloc::Global, 256));
/// ```
#[inline]
pub fn alloc_free<A: Allocator>(a: &A, size: usize) -> bool {
    let Ok(layout) = Layout::from_size_align(size.max(1), 8) else {
        return false;
    };
    match a.allocate(layout) {
        Ok(p) => {
            let p = p.cast::<u8>();
            // SAFETY: the block has `layout.size()` >= 1 writable bytes.
            unsafe {
                p.as_ptr().write_volatile(1);
                p.as_ptr().add(layout.size() - 1).write_volatile(2);
                a.deallocate(black_box(p), layout);
            }
            true
        }
        Err(_) => false,
    }
}

/// Pairs per batch of [`alloc_free_interleaved`].
pub const INTERLEAVED_BATCH: u64 = 256;

/// Times `pairs` calls of [`alloc_free`] on `timed`, in batches of
/// [`INTERLEAVED_BATCH`] alternating with as many untimed calls on `other` (same size):
/// the total time of `timed`'s batches. Two allocators compared this way, each timed
/// with the other as `other`, run under the same conditions (caches, the inner
/// allocator's state, the machine's frequency and neighbours) to within one batch,
/// so their ratio holds to a nanosecond where timing one after the other moves by more
/// on a shared machine. Returns `None` if an allocation failed.
///
/// ```
/// use allocator_api2::alloc::Global;
/// use cudalloc::count::Counting;
/// use cudalloc::testing::workload::alloc_free_interleaved;
/// let counting = Counting::new(Global);
/// let t = alloc_free_interleaved(&counting, &Global, 256, 1000).unwrap();
/// assert!(t.as_nanos() > 0);
/// assert_eq!(counting.snapshot().allocs, 1000);
/// ```
pub fn alloc_free_interleaved<A: Allocator, O: Allocator>(
    timed: &A,
    other: &O,
    size: usize,
    pairs: u64,
) -> Option<std::time::Duration> {
    let mut total = std::time::Duration::ZERO;
    let mut left = pairs;
    while left > 0 {
        let n = left.min(INTERLEAVED_BATCH);
        time_pairs(other, size, n)?;
        total += time_pairs(timed, size, n)?;
        left -= n;
    }
    Some(total)
}

/// Times `pairs` calls of [`alloc_free`] on each of `a` and `b`, in alternating batches
/// of [`INTERLEAVED_BATCH`] (`a` first in the first batch and every other one after it): the total
/// time of each, measured over the same stretch of the machine's time, so that their
/// ratio holds where two runs one after the other would drift apart. `None` if an
/// allocation failed.
///
/// ```
/// use allocator_api2::alloc::Global;
/// use cudalloc::count::Counting;
/// use cudalloc::testing::workload::alloc_free_ab;
/// let counting = Counting::new(Global);
/// let (global, counted) = alloc_free_ab(&Global, &counting, 256, 1000).unwrap();
/// assert!(global.as_nanos() > 0 && counted.as_nanos() > 0);
/// assert_eq!(counting.snapshot().allocs, 1000);
/// ```
pub fn alloc_free_ab<A: Allocator, B: Allocator>(
    a: &A,
    b: &B,
    size: usize,
    pairs: u64,
) -> Option<(std::time::Duration, std::time::Duration)> {
    let (mut ta, mut tb) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    let mut left = pairs;
    let mut round = 0u64;
    while left > 0 {
        let n = left.min(INTERLEAVED_BATCH);
        if round % 2 == 0 {
            ta += time_pairs(a, size, n)?;
            tb += time_pairs(b, size, n)?;
        } else {
            tb += time_pairs(b, size, n)?;
            ta += time_pairs(a, size, n)?;
        }
        left -= n;
        round += 1;
    }
    Some((ta, tb))
}

/// The time of `n` calls of [`alloc_free`] on `a`; `None` if one failed.
fn time_pairs<A: Allocator>(a: &A, size: usize, n: u64) -> Option<std::time::Duration> {
    let t = std::time::Instant::now();
    let mut ok = true;
    for _ in 0..n {
        ok &= alloc_free(a, black_box(size));
    }
    let elapsed = t.elapsed();
    ok.then_some(elapsed)
}

/// Pushes `0..n` as `u64` one at a time into a `Vec` in `a` (growth by doubling,
/// through `grow`), and returns their sum.
pub fn vec_push<A: Allocator>(a: A, n: usize) -> u64 {
    let mut v: Vec<u64, A> = Vec::new_in(a);
    for i in 0..n as u64 {
        v.push(black_box(i));
    }
    v.iter().sum()
}

/// The sizes [`small_objects`] allocates: a fixed pseudo-random sequence of `n` sizes in
/// 8..=256 bytes (xorshift32), the same on every run and for every allocator.
///
/// ```
/// let sizes: Vec<usize> = cudalloc::testing::workload::object_sizes(1000).collect();
/// assert!(sizes.iter().all(|s| (8..=256).contains(s)));
/// assert_eq!(sizes, cudalloc::testing::workload::object_sizes(1000).collect::<Vec<_>>());
/// ```
pub fn object_sizes(n: usize) -> impl Iterator<Item = usize> {
    let mut x: u32 = 0x9E37_79B9;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        8 + (x as usize % 249)
    })
}

/// Allocates `n` small objects of 8..=256 bytes ([`object_sizes`]), writes each, keeps
/// them all live, then frees them in allocation order. Returns the bytes allocated. This
/// is the per-batch staging pattern arenas are made for.
pub fn small_objects<A: Allocator>(a: &A, n: usize) -> usize {
    let mut live: std::vec::Vec<(core::ptr::NonNull<u8>, Layout)> = std::vec::Vec::with_capacity(n);
    let mut bytes = 0;
    for size in object_sizes(n) {
        let Ok(layout) = Layout::from_size_align(size, 8) else {
            continue;
        };
        let Ok(p) = a.allocate(layout) else { break };
        // SAFETY: the block has `size` >= 8 writable bytes.
        unsafe { p.cast::<u8>().as_ptr().write_volatile(size as u8) };
        bytes += size;
        live.push((p.cast(), layout));
    }
    for (p, layout) in live {
        // SAFETY: allocated above by `a` with `layout`, freed once.
        unsafe { a.deallocate(p, layout) };
    }
    bytes
}
