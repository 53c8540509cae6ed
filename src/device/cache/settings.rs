//! A device cache's shape, fixed at creation: which requests it caches by class, its
//! thread caches, its limit.

use crate::device::size_class::{class_of, class_size, MAX_CLASS_SIZE};

/// The cache's shape, fixed at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Requests up to this many bytes are cached by class (0: nothing is cached); larger
    /// blocks go to and from the backend directly.
    pub(crate) max_cached_bytes: usize,
    /// The largest class a thread cache keeps (`None`: no thread caches).
    pub(crate) thread_max_class: Option<usize>,
    /// The most bytes one thread's cache keeps for this pool.
    pub(crate) thread_cache_bytes: usize,
    /// The most bytes held from the backend (`usize::MAX` for no limit: the arithmetic
    /// needs no branch).
    pub(crate) limit: usize,
    /// The most idle bytes a miss learns to tolerate where 1/32 of the live bytes is less
    /// (64 MiB by default; the allowance itself is learned: `cache/idle.rs`).
    pub(crate) idle_cap: usize,
    /// The learned allowance's starting value (0 by default: nothing is kept idle until
    /// the program shows that it re-requests what was given back).
    pub(crate) idle_start: usize,
    /// Blocks not cached by class up to this many bytes are kept in the thread caches'
    /// large slots for reuse at the same size (0, the default: none; the page heap's
    /// blocks on a pool with physical pages).
    pub(crate) max_large_bytes: usize,
}

impl Settings {
    /// The settings of a cache keeping blocks up to `max_cached_bytes`, with thread caches
    /// of `thread_cache_bytes` (0: none), holding at most `limit` bytes (`None`: no
    /// limit).
    pub(crate) fn new(max_cached_bytes: usize, thread_cache_bytes: usize, limit: Option<usize>) -> Self {
        let max_cached_bytes = max_cached_bytes.min(MAX_CLASS_SIZE);
        let max_cached_bytes = match max_cached_bytes {
            0 => 0,
            // The largest class not above the setting.
            b => {
                let c = class_of(b);
                if class_size(c) > b {
                    if c == 0 {
                        0
                    } else {
                        class_size(c - 1)
                    }
                } else {
                    b
                }
            }
        };
        let thread_limit = thread_cache_bytes.min(max_cached_bytes);
        let thread_max_class = match thread_limit {
            0..=255 => None,
            b => {
                let c = class_of(b);
                Some(if class_size(c) > b { c - 1 } else { c })
            }
        };
        Self {
            max_cached_bytes,
            thread_max_class,
            thread_cache_bytes,
            limit: limit.unwrap_or(usize::MAX),
            idle_cap: 64 << 20,
            idle_start: 0,
            max_large_bytes: 0,
        }
    }
}
