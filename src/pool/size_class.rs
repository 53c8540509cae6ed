//! Size classes: a pure function from a request to the block size that serves it, and a
//! table of the classes, checked at compile time.
//!
//! Classes are exact multiples of 16 bytes up to 256 B (16 classes), then 8 per power of
//! two (`2^k + j * 2^(k-3)`, `j = 1..=8`) up to 1 MiB: 112 classes in all. Above 128 B
//! a block wastes at most 12.5% of the request; below, at most 15 bytes.
//!
//! Why 8 per power of two and not 4: 4 classes per doubling (jemalloc's choice) waste up
//! to 25% of the request (a 129-byte request in a 160-byte block is 24%), which breaks
//! the "at most 12.5%" promise; 8 per doubling keeps it. The cost is more classes (more
//! thread-cache bins), which the bins pay for only when used.

use crate::util::PAGE_SIZE;

use crate::class_geometry::Geometry;

/// The classes: multiples of 16 up to 256 B, then 8 per power of two up to 1 MiB
/// (`MAX_CLASS_SIZE`; larger blocks are never carved from chunks). `class_of` takes
/// requests of alignment 16 or less.
const CLASSES: Geometry = Geometry {
    quantum: 16,
    exact_max_log2: 8,
    per_doubling_log2: 3,
    max_log2: 20,
};
/// Smallest block and the step of the exact classes.
pub(crate) const QUANTUM: usize = CLASSES.quantum;

crate::class_geometry::class_table!(CLASSES);

/// The class for `size` bytes aligned to `align` (a power of two up to [`PAGE_SIZE`]): the
/// smallest class that is at least `size` and a multiple of `align`. Blocks of a class
/// lie at multiples of the class size from page-aligned run starts, so a class that is a
/// multiple of `align` gives `align`-aligned blocks. `None` past [`MAX_CLASS_SIZE`].
///
/// Monotone in `size` for a fixed `align`, and `class_size` of the answer maps back to
/// the answer: a block may be freed with any size between the request and its class size.
pub(crate) const fn class_of_aligned(size: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two() && align <= PAGE_SIZE);
    let rounded = match crate::util::align_up(size, align) {
        Some(r) => r,
        None => return None,
    };
    if rounded == 0 || rounded > MAX_CLASS_SIZE {
        return None;
    }
    let mut c = class_of(rounded);
    // At most PER_DOUBLING steps: the power of two ending each group is a multiple of
    // every alignment not above it, and `rounded >= align`.
    while class_size(c) % align != 0 {
        c += 1;
        if c == NUM_CLASSES {
            return None;
        }
    }
    Some(c)
}

/// Bytes of a run (a page-aligned stretch of a chunk holding blocks of one class) for
/// class `class`: at least 64 KiB and a whole number of pages, chosen so the tail that
/// holds no whole block is at most 1/16 of the run; classes of 64 KiB and up get runs of
/// exactly one block (their sizes are page multiples).
pub(crate) const fn run_bytes(class: usize) -> usize {
    RUN_BYTES[class]
}

const MIN_RUN_PAGES: usize = 16;
const MAX_RUN_PAGES: usize = 128;

const fn compute_run_bytes(class: usize) -> usize {
    let c = class_size(class);
    if c >= MIN_RUN_PAGES * PAGE_SIZE {
        return c.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    }
    let mut pages = MIN_RUN_PAGES;
    while pages < MAX_RUN_PAGES {
        let bytes = pages * PAGE_SIZE;
        if bytes % c <= bytes / 16 {
            return bytes;
        }
        pages += 1;
    }
    MAX_RUN_PAGES * PAGE_SIZE
}

const RUN_BYTES: [usize; NUM_CLASSES] = {
    let mut t = [0; NUM_CLASSES];
    let mut i = 0;
    while i < NUM_CLASSES {
        t[i] = compute_run_bytes(i);
        i += 1;
    }
    t
};

/// The class sizes, for documentation and tests.
pub(crate) const CLASS_SIZES: [usize; NUM_CLASSES] = {
    let mut t = [0; NUM_CLASSES];
    let mut i = 0;
    while i < NUM_CLASSES {
        t[i] = class_size(i);
        i += 1;
    }
    t
};

// Compile-time checks on the table: monotone, the bounds on waste (at most 15 bytes or
// 12.5% of the request), the two functions are inverse, every class is a multiple of 16
// (`Geometry::check`); runs hold whole blocks with a small tail.
const _: () = {
    CLASSES.check();
    let mut i = 0;
    while i < NUM_CLASSES {
        let c = CLASS_SIZES[i];
        let run = RUN_BYTES[i];
        assert!(
            run % PAGE_SIZE == 0 && run >= c,
            "runs are pages holding at least one block"
        );
        assert!(
            run % c <= run / 16 || c >= MIN_RUN_PAGES * PAGE_SIZE,
            "run tails waste at most 1/16"
        );
        i += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_maps_to_the_smallest_class_that_fits() {
        let mut prev = 0;
        for size in 1..=70_000usize {
            let c = class_of(size);
            assert!(class_size(c) >= size);
            if c > 0 {
                assert!(
                    class_size(c - 1) < size,
                    "size {size}: class {c} is not the smallest"
                );
            }
            assert!(c >= prev, "monotone");
            prev = c;
        }
        for &s in &[1 << 17, (1 << 17) + 1, 999_999, MAX_CLASS_SIZE] {
            let c = class_of(s);
            assert!(class_size(c) >= s && (c == 0 || class_size(c - 1) < s));
        }
    }

    #[test]
    fn aligned_classes_are_multiples_of_the_alignment_and_round_trip() {
        let mut align = 1;
        while align <= PAGE_SIZE {
            let mut prev = 0;
            for size in (1..200_000).step_by(97).chain([align, align + 1, 3 * align]) {
                let Some(c) = class_of_aligned(size, align) else {
                    continue;
                };
                let cs = class_size(c);
                assert!(
                    cs >= size && cs % align == 0,
                    "size {size} align {align}: class {cs}"
                );
                // Freed with any size between the request and the class size: same class.
                assert_eq!(class_of_aligned(cs, align), Some(c));
                assert_eq!(class_of_aligned(size + (cs - size) / 2, align), Some(c));
                if size > prev {
                    prev = size;
                }
            }
            align *= 2;
        }
        assert_eq!(class_of_aligned(MAX_CLASS_SIZE + 1, 16), None);
        assert_eq!(class_of_aligned(usize::MAX, 4096), None);
    }
}
