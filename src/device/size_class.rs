//! Size classes of device blocks: a pure function from a request to the block size the
//! cache hands out for it, and compile-time checks on the table.
//!
//! Blocks are multiples of 256 bytes (the alignment `cudaMalloc` promises and kernels
//! rely on): exact multiples of 256 up to 4 KiB (16 classes), then 16 per power of two
//! (`2^k + j * 2^(k-4)`, `j = 1..=16`). A block wastes at most 255 bytes below 4 KiB and
//! at most 1/16 (6.25%) of the request above; on uniformly spread sizes about 3%.
//!
//! Why 16 per doubling and not the host pool's 8: device memory is the scarce resource
//! (a request of 65 MiB in a 72 MiB class wastes 7 MiB of a GPU), and the target of the
//! multi-stream benchmark is at most 15% more memory held than requested, cache
//! included. More classes cost only bins, which the per-thread caches keep lazily.

use crate::class_geometry::Geometry;

/// The classes: multiples of 256 up to 4 KiB, then 16 per power of two up to 1 TiB
/// (`MAX_CLASS_SIZE`; larger requests are never cached).
const CLASSES: Geometry = Geometry {
    quantum: 256,
    exact_max_log2: 12,
    per_doubling_log2: 4,
    max_log2: 40,
};
/// The alignment and granule of every block.
pub(crate) const GRANULE: usize = CLASSES.quantum;

crate::class_geometry::class_table!(CLASSES);

/// `bytes` rounded up to [`GRANULE`] (for blocks too large for any class); `None` on
/// overflow.
pub(crate) const fn round_to_granule(bytes: usize) -> Option<usize> {
    crate::util::align_up(bytes, GRANULE)
}

// Compile-time checks: classes increase, are multiples of the granule, map back to
// themselves, and waste at most 255 bytes or 1/16 of the request.
const _: () = CLASSES.check();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_maps_to_the_smallest_class_that_fits() {
        let mut prev = 0;
        let sizes = (1..=300_000usize).chain((20..40).flat_map(|k| {
            let p = 1usize << k;
            [p - 1, p, p + 1, p + p / 3, p + p / 16, p + p / 16 + 1]
        }));
        for size in sizes {
            let c = class_of(size);
            assert!(class_size(c) >= size, "{size}");
            assert!(
                c == 0 || class_size(c - 1) < size,
                "size {size}: class {c} is not the smallest"
            );
            if size <= 300_000 {
                assert!(c >= prev, "monotone");
                prev = c;
            }
        }
        assert_eq!(class_size(class_of(128 << 20)), 128 << 20);
        assert_eq!(class_size(class_of((64 << 20) + 1)), (64 << 20) + (4 << 20));
        assert_eq!(round_to_granule(1), Some(256));
        assert_eq!(round_to_granule(usize::MAX), None);
    }
}
