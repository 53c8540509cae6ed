//! [`Traced<A>`]: any allocator, recorded. The adaptor that puts `System`, `Global`,
//! `bumpalo::Bump` (or any other `GlobalAlloc` or allocator-api2 `Allocator`) into a
//! trace beside the crate's own allocators.

use core::ptr::NonNull;
use std::alloc::GlobalAlloc;

use allocator_api2::alloc::{AllocError, Allocator, Layout};

use super::record::{short_type_name, Tag};

/// An allocator that records what passes through `A` while a recording runs (see
/// [`start`](super::start)): allocations, frees (requested and completed at once: a
/// host allocator has no GPU uses to wait for), failures; a grow or shrink as the free
/// of the old block and the allocation of the new one. Off, it costs one load and a
/// branch per call.
///
/// It is a `GlobalAlloc` when `A` is, and `const`-constructible, so it can record a whole
/// program; and an allocator-api2 `Allocator` when `A` is (use it by reference:
/// `Vec::new_in(&traced)`). The recorder's own memory comes from `System` and is never
/// recorded, so `Traced<System>` may be the `#[global_allocator]`:
///
/// ```
/// use std::alloc::System;
/// use cudalloc::trace::Traced;
///
/// #[global_allocator]
/// static GLOBAL: Traced<System> = Traced::new(System);
///
/// fn main() {
///     # if cudalloc::trace::is_recording() { return; }
///     cudalloc::trace::start(Default::default()).unwrap();
///     let v = vec![1u32, 2, 3];
///     drop(v);
///     let t = cudalloc::trace::stop();
///     assert!(t.allocators.iter().any(|a| a.name == "Traced<System>"));
/// }
/// ```
///
/// Zero-size blocks are passed through unrecorded.
pub struct Traced<A> {
    inner: A,
    name: Option<&'static str>,
    tag: Tag,
}

impl<A> Traced<A> {
    /// Wraps `inner`, named in traces `Traced<A>` (the type's name without its module
    /// path: `Traced<System>`, `Traced<&Bump>`).
    ///
    /// ```
    /// let t = cudalloc::trace::Traced::new(allocator_api2::alloc::Global);
    /// assert_eq!(t.name(), "Traced<Global>");
    /// ```
    pub const fn new(inner: A) -> Self {
        Self {
            inner,
            name: None,
            tag: Tag::new(short_type_name::<Self>),
        }
    }

    /// Wraps `inner`, named `name` in traces.
    ///
    /// ```
    /// let t = cudalloc::trace::Traced::named(std::alloc::System, "malloc");
    /// assert_eq!(t.name(), "malloc");
    /// ```
    pub const fn named(inner: A, name: &'static str) -> Self {
        Self {
            inner,
            name: Some(name),
            tag: Tag::named(name, short_type_name::<Self>),
        }
    }

    /// The wrapped allocator.
    ///
    /// ```
    /// use cudalloc::{trace::Traced, PinnedAlloc};
    /// assert_eq!(*Traced::new(PinnedAlloc).inner(), PinnedAlloc);
    /// ```
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The name the allocator has in traces.
    pub fn name(&self) -> String {
        match self.name {
            Some(n) => n.to_owned(),
            None => short_type_name::<Self>(),
        }
    }
}

impl<A> core::fmt::Debug for Traced<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Traced").field("name", &self.name()).finish()
    }
}

// SAFETY: every call is passed to `inner` with its arguments unchanged, and its result
// returned unchanged; recording only reads them.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Traced<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's obligations are `inner.alloc`'s.
        let p = unsafe { self.inner.alloc(layout) };
        self.record_alloc(p, layout);
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        self.record_alloc(p, layout);
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Before the free: once `inner` has the block back, another thread may be
        // handed it and record its allocation.
        self.tag.free(ptr, layout.size(), true);
        // SAFETY: the caller's obligations are `inner.dealloc`'s.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.tag.free(ptr, layout.size(), true);
        // SAFETY: the caller's obligations are `inner.realloc`'s.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        // SAFETY: the caller promises `new_size`, rounded to the alignment, fits `isize`.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if p.is_null() {
            // The old block stays the caller's: recorded again, after the failure.
            self.tag.failure(new, &AllocError);
            self.tag.alloc(ptr, layout, layout.size());
        } else {
            self.tag.alloc(p, new, new_size);
        }
        p
    }
}

impl<A> Traced<A> {
    #[inline(always)]
    fn record_alloc(&self, p: *mut u8, layout: Layout) {
        if p.is_null() {
            self.tag.failure(layout, &AllocError);
        } else {
            self.tag.alloc(p, layout, layout.size());
        }
    }

    /// A grow or shrink through `f`: the old block freed first (before `inner` may hand
    /// it to another thread), the new one allocated after, the old one again if `f`
    /// fails (the caller keeps it).
    #[inline(always)]
    fn resize(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
        f: impl FnOnce() -> Result<NonNull<[u8]>, AllocError>,
    ) -> Result<NonNull<[u8]>, AllocError> {
        self.tag.free(ptr.as_ptr(), old.size(), true);
        let r = self.tag.allocated(new, f());
        if r.is_err() {
            self.tag.alloc(ptr.as_ptr(), old, old.size());
        }
        r
    }
}

// SAFETY: every call is passed to `inner` with its arguments unchanged, and its result
// returned unchanged; recording only reads them. Blocks are `inner`'s, so they keep its
// guarantees, and any copy of a reference to this allocator frees them through `inner`.
unsafe impl<A: Allocator> Allocator for Traced<A> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.tag.allocated(layout, self.inner.allocate(layout))
    }

    #[inline]
    fn allocate_zeroed(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.tag.allocated(layout, self.inner.allocate_zeroed(layout))
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        self.tag.free(ptr.as_ptr(), layout.size(), true);
        // SAFETY: the caller's obligations are `inner.deallocate`'s.
        unsafe { self.inner.deallocate(ptr, layout) }
    }

    #[inline]
    unsafe fn grow(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the caller's obligations are `inner.grow`'s.
        self.resize(ptr, old, new, || unsafe { self.inner.grow(ptr, old, new) })
    }

    #[inline]
    unsafe fn grow_zeroed(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the caller's obligations are `inner.grow_zeroed`'s.
        self.resize(ptr, old, new, || unsafe { self.inner.grow_zeroed(ptr, old, new) })
    }

    #[inline]
    unsafe fn shrink(&self, ptr: NonNull<u8>, old: Layout, new: Layout) -> Result<NonNull<[u8]>, AllocError> {
        // SAFETY: the caller's obligations are `inner.shrink`'s.
        self.resize(ptr, old, new, || unsafe { self.inner.shrink(ptr, old, new) })
    }
}
