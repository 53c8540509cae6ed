//! The shape that the host pool's and the device cache's size classes share: exact
//! multiples of a quantum up to `2^exact_max_log2` bytes, then `2^per_doubling_log2`
//! classes per power of two (`2^k + j * 2^(k - per_doubling_log2)`, `j = 1..`), up to
//! `2^max_log2` bytes. Each user fixes one [`Geometry`] as a constant
//! (`pool::size_class`, `device::size_class`): the calls are `#[inline(always)]` const
//! functions of that constant, so each folds to the shifts and masks of its own table.

/// One family of size classes (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// The smallest class and the step of the exact classes (a power of two).
    pub(crate) quantum: usize,
    /// `log2` of the largest exact class.
    pub(crate) exact_max_log2: u32,
    /// `log2` of the number of classes per power of two above it.
    pub(crate) per_doubling_log2: u32,
    /// `log2` of the largest class.
    pub(crate) max_log2: u32,
}

impl Geometry {
    /// Number of exact classes.
    pub(crate) const fn exact_classes(&self) -> usize {
        (1 << self.exact_max_log2) / self.quantum
    }

    /// Classes per power of two above the exact ones.
    pub(crate) const fn per_doubling(&self) -> usize {
        1 << self.per_doubling_log2
    }

    /// Number of classes.
    pub(crate) const fn num_classes(&self) -> usize {
        self.exact_classes() + self.per_doubling() * (self.max_log2 - self.exact_max_log2) as usize
    }

    /// The largest class.
    pub(crate) const fn max_class_size(&self) -> usize {
        1 << self.max_log2
    }

    /// The class of a request of `bytes` (`1..=max_class_size()`): the smallest class at
    /// least `bytes`.
    #[inline(always)]
    pub(crate) const fn class_of(&self, bytes: usize) -> usize {
        debug_assert!(bytes > 0 && bytes <= self.max_class_size());
        if bytes <= 1 << self.exact_max_log2 {
            (bytes - 1) / self.quantum
        } else {
            let s = bytes - 1;
            let k = usize::BITS - 1 - s.leading_zeros(); // s in [2^k, 2^(k+1)), k >= exact_max_log2
            let sub = (s >> (k - self.per_doubling_log2)) & (self.per_doubling() - 1);
            self.exact_classes() + (k - self.exact_max_log2) as usize * self.per_doubling() + sub
        }
    }

    /// The size of class `class` (`< num_classes()`).
    #[inline(always)]
    pub(crate) const fn class_size(&self, class: usize) -> usize {
        if class < self.exact_classes() {
            (class + 1) * self.quantum
        } else {
            let j = class - self.exact_classes();
            let k = self.exact_max_log2 as usize + j / self.per_doubling();
            (1 << k) + (j % self.per_doubling() + 1) * (1 << (k - self.per_doubling_log2 as usize))
        }
    }
}
