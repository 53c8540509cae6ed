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

    /// The checks every table passes, for a `const _` item: the first class is the
    /// quantum and the last the largest; classes increase and are multiples of the
    /// quantum; `class_of` maps each class, and the request just above the class before
    /// it, to it; a request wastes less than a quantum or at most `1 / per_doubling()` of
    /// itself. Panics (fails the build) where one does not hold.
    pub(crate) const fn check(&self) {
        let n = self.num_classes();
        assert!(self.class_size(0) == self.quantum);
        assert!(self.class_size(n - 1) == self.max_class_size());
        assert!(self.class_of(self.max_class_size()) == n - 1);
        let mut i = 0;
        while i < n {
            let c = self.class_size(i);
            assert!(c % self.quantum == 0, "classes are multiples of the quantum");
            assert!(self.class_of(c) == i, "class_of(class_size(i)) == i");
            if i > 0 {
                let prev = self.class_size(i - 1);
                assert!(prev < c, "classes increase");
                assert!(
                    self.class_of(prev + 1) == i,
                    "the request just above a class maps to the next"
                );
                // The worst request for class i is prev + 1; its waste is c - prev - 1.
                let waste = c - prev - 1;
                assert!(
                    waste < self.quantum || waste * self.per_doubling() <= prev + 1,
                    "waste under a quantum or at most 1 / per_doubling of the request"
                );
            }
            i += 1;
        }
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

/// The items a user of a [`Geometry`] defines from its constant (named `$classes`):
/// `MAX_CLASS_SIZE`, `NUM_CLASSES`, and the `#[inline(always)]` const functions
/// `class_of` and `class_size`, which fold to its own table's shifts and masks.
macro_rules! class_table {
    ($classes:ident) => {
        /// The largest class; larger requests are served outside the classes.
        pub(crate) const MAX_CLASS_SIZE: usize = $classes.max_class_size();
        /// Number of classes.
        #[allow(dead_code)] // not every user counts its classes
        pub(crate) const NUM_CLASSES: usize = $classes.num_classes();

        /// The class of a request of `bytes` (`1..=MAX_CLASS_SIZE`): the smallest class at
        /// least `bytes`.
        #[inline(always)]
        pub(crate) const fn class_of(bytes: usize) -> usize {
            $classes.class_of(bytes)
        }

        /// The block size of class `class` (`< NUM_CLASSES`).
        #[inline(always)]
        pub(crate) const fn class_size(class: usize) -> usize {
            $classes.class_size(class)
        }
    };
}
pub(crate) use class_table;
